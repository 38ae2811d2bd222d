//! The control endpoint: faults on demand, on its own port.
//!
//! `POST /faults` with a fault spec as the body (`crash`, `hang`, `slow:4@2s`, …, or JSON
//! `{"fault": "…"}`) puts it in force, after its offset counted from now. `GET /state` reports
//! what the emulator is doing. It listens only where `--emu-control-port` says, from process
//! start (a crash can be injected during weight load). This module must never be mounted on the
//! API port: a client of the model must not be able to break the replica.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::engine::Engine;
use super::faults::ScheduledFault;

/// What the control endpoint reaches.
#[derive(Debug)]
pub struct Control {
    pub engine: Arc<Engine>,
    /// Set once the API port listens.
    pub ready: Arc<AtomicBool>,
}

pub fn router(control: Arc<Control>) -> Router {
    Router::new()
        .route("/state", get(state))
        .route("/faults", post(inject))
        .with_state(control)
}

/// Puts `fault` in force at `start + fault.at`.
pub fn schedule(engine: &Arc<Engine>, fault: ScheduledFault, start: Instant) {
    if fault.at.is_zero() {
        engine.apply_fault(&fault.fault);
        return;
    }
    let engine = Arc::clone(engine);
    tokio::spawn(async move {
        tokio::time::sleep_until(start + fault.at).await;
        engine.apply_fault(&fault.fault);
    });
}

async fn inject(State(control): State<Arc<Control>>, body: Bytes) -> Response {
    let text = String::from_utf8_lossy(&body);
    let spec = match serde_json::from_str::<Value>(&text) {
        Ok(v) => v
            .get("fault")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_default(),
        Err(_) => text.trim().to_string(),
    };
    match ScheduledFault::parse(&spec) {
        Ok(fault) => {
            let at = fault.at.as_secs_f64();
            schedule(&control.engine, fault, Instant::now());
            Json(json!({"accepted": spec, "in_seconds": at})).into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, Json(json!({"error": e.to_string()}))).into_response(),
    }
}

async fn state(State(control): State<Arc<Control>>) -> Json<Value> {
    let e = &control.engine;
    let drift = e.faults.drift();
    Json(json!({
        "ready": control.ready.load(Ordering::SeqCst),
        "sleeping": e.is_sleeping().await,
        "weights_valid": e.weights_valid(),
        "prefix_cache_empty": e.prefix_cache_is_empty(),
        "load": e.load(),
        "faults": {
            "hang": e.faults.hang(),
            "engine_dead": e.faults.engine_dead(),
            "half_failed": e.faults.half_failed().map(|h| format!("{h:?}").to_lowercase()),
            "slow": e.faults.slow(),
            "wrong_output": e.faults.wrong_output(),
            "drift": {
                "version": drift.version,
                "weights_digest": drift.weights_digest,
                "max_model_len": drift.max_model_len,
            },
        },
    }))
}
