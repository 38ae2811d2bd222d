//! The admin server: `/live`, `/ready` and `/metrics` on the admin port.
//!
//! - `/live` answers 200 for as long as the process serves HTTP, unless this replica leads and
//!   the [`Watchdog`] finds a controller stalled: then 503, with the [`Stall`] as the body, so
//!   that the kubelet restarts a leader whose controllers are stuck. A replica that does not lead
//!   has nothing to reconcile and stays live.
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
use tokio_util::sync::CancellationToken;
pub use understudy_listener::Limits;
use understudy_listener::serve_service_until;

use crate::metrics::Metrics;
use crate::watchdog::{Stall, Watchdog};

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
    watchdog: Watchdog,
}

/// The admin routes.
pub fn router(metrics: Arc<Metrics>, readiness: Readiness, watchdog: Watchdog) -> Router {
    Router::new()
        .route("/live", get(live))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .with_state(AdminState {
            metrics,
            readiness,
            watchdog,
        })
}

/// Serves the admin routes on `listener` within `limits` until the process ends.
pub async fn serve(
    listener: TcpListener,
    limits: Limits,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    watchdog: Watchdog,
) {
    let app = router(metrics, readiness, watchdog);
    serve_service_until(listener, app, limits, CancellationToken::new()).await;
}

/// `/live`'s answer for this replica's role and the watchdog's finding.
fn liveness(role: Role, stall: Option<Stall>) -> (StatusCode, String) {
    match (role, stall) {
        (Role::Leading, Some(stall)) => (StatusCode::SERVICE_UNAVAILABLE, format!("{stall}\n")),
        _ => (StatusCode::OK, "live\n".to_owned()),
    }
}

async fn live(State(state): State<AdminState>) -> (StatusCode, String) {
    liveness(state.readiness.role(), state.watchdog.stall())
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

    use std::time::Duration;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::advance;

    use super::*;
    use crate::watchdog::Reconciler;

    fn policy() -> ObjectMeta {
        ObjectMeta {
            namespace: Some("serving".into()),
            name: Some("llama".into()),
            ..ObjectMeta::default()
        }
    }

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
    async fn live_unless_a_leader_stalls_ready_only_when_leading_or_standing_by_and_metrics_as_text() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        let readiness = Readiness::default();
        // Real time here: with no threshold, a reconcile in flight is a stall at once.
        let watchdog = Watchdog::new(Duration::ZERO);
        let server = tokio::spawn(serve(
            listener,
            Limits::default(),
            metrics.clone(),
            readiness.clone(),
            watchdog.clone(),
        ));

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

        let stuck = watchdog.reconciling(Reconciler::FailoverPolicy, &policy());
        readiness.set(Role::Leading);
        let answer = get(addr, "/live").await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(
            answer.contains("the FailoverPolicy controller is stalled: its reconcile of serving/llama"),
            "{answer}"
        );
        drop(stuck);
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

    #[tokio::test(start_paused = true)]
    async fn a_leader_is_not_live_once_a_reconcile_has_run_for_stall_after_and_live_again_when_it_ends() {
        let watchdog = Watchdog::new(Duration::from_secs(600));
        let live = |role| liveness(role, watchdog.stall());

        // Leading and idle for hours: nothing to reconcile is not a stall.
        advance(Duration::from_secs(3 * 3600)).await;
        assert_eq!(live(Role::Leading), (StatusCode::OK, "live\n".to_owned()));

        let stuck = watchdog.reconciling(Reconciler::FailoverPolicy, &policy());
        advance(Duration::from_secs(599)).await;
        assert_eq!(live(Role::Leading).0, StatusCode::OK);
        advance(Duration::from_secs(1)).await;
        let (code, reason) = live(Role::Leading);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            reason,
            "the FailoverPolicy controller is stalled: its reconcile of serving/llama has run for \
             10m0s without finishing\n"
        );
        // A replica that does not lead has nothing to reconcile: it stays live whatever it holds.
        for role in [Role::Starting, Role::StandingBy, Role::Elected, Role::Stopping] {
            assert_eq!(live(role).0, StatusCode::OK, "{role:?}");
        }

        // The reconcile finishes: progress, and the leader is live again.
        drop(stuck);
        assert_eq!(live(Role::Leading).0, StatusCode::OK);
        let next = watchdog.reconciling(Reconciler::FailoverPolicy, &policy());
        advance(Duration::from_secs(599)).await;
        assert_eq!(
            live(Role::Leading).0,
            StatusCode::OK,
            "a fresh reconcile starts a fresh count"
        );
        drop(next);
    }
}
