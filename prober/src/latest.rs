//! The admin routes of a port that serves what a loop published last (the prober's latest round,
//! the GPU agent's latest reading): `/live` (200 while the process serves HTTP), `/ready` (200
//! once the first document is published, 503 before), and the document itself as JSON (503
//! before the first). Each port adds its own `/metrics`.
//!
//! A request must never wait for the loop: it reads what was published, nothing else.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// What a loop published last, as its admin port serves it.
pub trait Latest: Clone + Send + Sync + 'static {
    /// What `/ready` and the document's path answer before the first document.
    const NOT_YET: &'static str;

    /// The latest document as JSON; `None` before the first.
    fn latest_json(&self) -> Option<Arc<str>>;
}

/// `/live`, `/ready`, and the latest document at `document_path`.
pub fn routes<S: Latest>(document_path: &str) -> Router<S> {
    Router::new()
        .route("/live", get(|| async { "live\n" }))
        .route("/ready", get(ready::<S>))
        .route(document_path, get(document::<S>))
}

async fn ready<S: Latest>(State(published): State<S>) -> Response {
    if published.latest_json().is_some() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, S::NOT_YET).into_response()
    }
}

async fn document<S: Latest>(State(published): State<S>) -> Response {
    match published.latest_json() {
        Some(json) => ([(header::CONTENT_TYPE, "application/json")], json.to_string()).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, S::NOT_YET).into_response(),
    }
}
