//! Probing on a schedule, and the admin port that serves what the rounds found.
//!
//! - [`Watch`] probes a pool's replicas once per interval, each after its seeded
//!   [`jitter`](crate::probe::jitter), and publishes every round to [`Published`].
//! - [`router`] serves `/live` (200 while the process serves HTTP), `/ready` (200 once the first
//!   round is published), `/metrics` ([`ProberMetrics`] as OpenMetrics text) and `/round` (the
//!   latest [`RoundDocument`] as JSON; 503 before the first round).
//!
//! The admin server only reads what the rounds published: it must never probe, and a request to
//! it must never wait for a round.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use understudy_core::Pool;
pub use understudy_listener::Limits;
use understudy_listener::serve_service_until;

use crate::latest::{self, Latest};
use crate::probe::{self, Endpoint, ProbeSpec};
use crate::report::{PoolRound, ProberMetrics, RoundDocument};

/// What the rounds so far have published: the metrics, and the latest round as JSON.
#[derive(Clone, Debug, Default)]
pub struct Published {
    metrics: Arc<ProberMetrics>,
    /// Serialized once per round, so that a request only clones a pointer.
    latest: Arc<RwLock<Option<Arc<str>>>>,
}

impl Published {
    /// Counts the round in the metrics and makes it the one `/round` serves.
    pub fn publish(&self, round: &PoolRound) {
        self.metrics.record_round(round);
        let document = RoundDocument::new(std::slice::from_ref(round), None);
        // A document of plain strings and numbers always serializes.
        let json = serde_json::to_string_pretty(&document).unwrap_or_default();
        *self.latest.write().unwrap_or_else(PoisonError::into_inner) = Some(json.into());
    }

    /// The latest round's JSON; `None` before the first round.
    pub fn latest(&self) -> Option<Arc<str>> {
        self.latest.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub fn metrics(&self) -> &ProberMetrics {
        &self.metrics
    }
}

impl Latest for Published {
    const NOT_YET: &'static str = "no round yet\n";

    fn latest_json(&self) -> Option<Arc<str>> {
        self.latest()
    }
}

/// One pool's replicas, probed every interval.
#[derive(Debug, Clone)]
pub struct Watch {
    pub pool: Pool,
    pub endpoints: Vec<Endpoint>,
    pub spec: ProbeSpec,
    /// Seeds the jitter; the same seed gives the same schedule.
    pub seed: u64,
    /// Each replica's probe starts somewhere in `[0, max_jitter)` after the round does.
    pub max_jitter: Duration,
    pub min_serving: usize,
}

impl Watch {
    /// Probes every replica once (round number `round` picks the jitter's phase) and publishes.
    pub async fn round(&self, round: u64, published: &Published) -> PoolRound {
        let reports =
            probe::probe_round(&self.endpoints, &self.spec, self.seed, round, self.max_jitter).await;
        let round = PoolRound {
            pool: self.pool,
            min_serving: self.min_serving,
            reports,
        };
        published.publish(&round);
        round
    }

    /// A round now, then one every `interval` from the start of the last; a round that runs
    /// over pushes the next one back instead of bunching rounds up.
    pub async fn run(self, interval: Duration, published: Published) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        for round in 0.. {
            ticker.tick().await;
            self.round(round, &published).await;
        }
    }
}

/// The admin routes.
pub fn router(published: Published) -> Router {
    latest::routes("/round")
        .route("/metrics", get(metrics_text))
        .with_state(published)
}

/// Serves the admin routes on `listener` within `limits` until the process ends.
pub async fn serve(listener: TcpListener, limits: Limits, published: Published) {
    serve_service_until(listener, router(published), limits, CancellationToken::new()).await;
}

async fn metrics_text(State(published): State<Published>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        published.metrics.encode(),
    )
        .into_response()
}
