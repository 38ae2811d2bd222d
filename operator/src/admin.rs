//! The admin server: `/live`, `/ready` and `/metrics` on the admin port.
//!
//! - `/live` answers 200 for as long as the process serves HTTP at all.
//! - `/ready` answers 200 when this replica does its job in the election: it leads and its
//!   controller runs, or it stands by as a candidate whose elector is running. It answers 503
//!   while starting, while a new leader's controller has not started yet, and while stopping.
//!   A standby is ready on purpose: the operator serves no traffic, and a rollout must be able to
//!   replace replicas that correctly wait their turn.
//! - `/metrics` serves [`crate::metrics::Metrics`] as OpenMetrics text.
//!
//! It must never take part in decisions: it reads shared state and writes nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Where this replica stands in the election.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Not contending yet.
    Starting = 0,
    /// Contending, somebody else leads.
    StandingBy = 1,
    /// Won the election; the controller is not running yet.
    Elected = 2,
    /// Leading, and the controller runs.
    Leading = 3,
    /// Shutting down or lost the lease.
    Stopping = 4,
}

/// Shared, lock-free record of this replica's [`Role`].
#[derive(Clone, Debug)]
pub struct Readiness(Arc<AtomicU8>);

impl Default for Readiness {
    fn default() -> Self {
        Readiness(Arc::new(AtomicU8::new(Role::Starting as u8)))
    }
}

impl Readiness {
    pub fn set(&self, role: Role) {
        self.0.store(role as u8, Ordering::Release);
    }

    #[must_use]
    pub fn role(&self) -> Role {
        match self.0.load(Ordering::Acquire) {
            1 => Role::StandingBy,
            2 => Role::Elected,
            3 => Role::Leading,
            4 => Role::Stopping,
            _ => Role::Starting,
        }
    }

    #[must_use]
    pub fn is_ready(&self) -> bool {
        matches!(self.role(), Role::StandingBy | Role::Leading)
    }
}

#[derive(Clone, Debug)]
struct AdminState {
    metrics: Arc<Metrics>,
    readiness: Readiness,
}

/// The admin routes.
pub fn router(metrics: Arc<Metrics>, readiness: Readiness) -> Router {
    Router::new()
        .route("/live", get(|| async { "live\n" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .with_state(AdminState { metrics, readiness })
}

/// Serves the admin routes on `listener` until the process ends.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    readiness: Readiness,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, readiness)).await
}

async fn ready(State(state): State<AdminState>) -> Response {
    let role = state.readiness.role();
    let status = if state.readiness.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, format!("{role:?}\n")).into_response()
}

async fn metrics_text(State(state): State<AdminState>) -> Response {
    match state.metrics.encode() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// One plain HTTP/1.1 request over a real socket, as a kubelet probe sends it.
    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    }

    #[tokio::test]
    async fn live_always_ready_only_when_leading_or_standing_by_and_metrics_as_text() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        let readiness = Readiness::default();
        let server = tokio::spawn(serve(listener, metrics.clone(), readiness.clone()));

        assert!(get(addr, "/live").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/ready").await.starts_with("HTTP/1.1 503"));
        for (role, code) in [
            (Role::StandingBy, "200"),
            (Role::Elected, "503"),
            (Role::Leading, "200"),
            (Role::Stopping, "503"),
        ] {
            readiness.set(role);
            let answer = get(addr, "/ready").await;
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {code}")),
                "{role:?}: {answer}"
            );
        }
        assert!(get(addr, "/live").await.starts_with("HTTP/1.1 200"));

        metrics.reconcile_failed("status");
        let answer = get(addr, "/metrics").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("application/openmetrics-text"), "{answer}");
        assert!(
            answer.contains(r#"understudy_reconcile_errors_total{category="status"} 1"#),
            "{answer}"
        );
        server.abort();
    }
}
