//! Sends a load proof's planned replay ([`understudy_core::load_proof::plan`]) to a pool's
//! replicas and records what its client saw of each request: whether it was answered in full,
//! its time to first token, the gaps between its tokens, and how late it was sent.
//!
//! Each request is a streamed `/v1/completions` with a synthetic prompt of the recorded length
//! and `ignore_eos`, so that it asks for exactly the recorded output tokens; replicas take turns.
//! Requests are sent at their planned times whether or not earlier ones were answered (an open
//! loop, as traffic arrives), and are marked as probe traffic so that routers and metrics keep
//! them apart from users'. The endpoints carry the bearer that passes a fenced standby.
//!
//! This module must never retry a request (a retry hides the failure being measured), or send
//! past its plan.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use understudy_core::load_proof::{Planned, Replayed, synthetic_prompt};

use crate::probe::{Ending, Endpoint, stream_completion};

/// The most replayed requests in flight at once: the replayer runs inside the operator, and must
/// not take its connections and memory. A standby that holds this many unanswered is failing its
/// proof already: the requests that wait for a place are sent late, and their time to first token
/// counts from their planned time, so the wait shows as the standby's.
pub const MAX_IN_FLIGHT: usize = 2048;

/// The OpenAI `user` field every replayed request sends.
pub const LOAD_PROOF_USER: &str = "understudy-load-proof";

/// How each replayed request is bounded.
#[derive(Clone, Copy, Debug)]
pub struct ReplayLimits {
    /// The whole request, first byte to last.
    pub timeout: Duration,
    /// After the first token, this long without a byte is a stall.
    pub stall_after: Duration,
}

/// The request body of one replayed request.
#[must_use]
pub fn request_body(planned: &Planned, seed: u64, model: Option<&str>) -> serde_json::Value {
    let mut body = serde_json::json!({
        "prompt": synthetic_prompt(planned.prompt_tokens, seed),
        "max_tokens": planned.max_tokens.max(1),
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
        "user": LOAD_PROOF_USER,
    });
    if let Some(model) = model {
        body["model"] = serde_json::Value::String(model.to_owned());
    }
    body
}

/// Replays `plan` against `endpoints` from now, one request after another at its planned time,
/// and returns what each request's client saw, in plan order. Nothing is sent with no endpoints.
pub async fn replay(
    endpoints: &[Endpoint],
    plan: &[Planned],
    model: Option<&str>,
    limits: ReplayLimits,
) -> Vec<Replayed> {
    if endpoints.is_empty() {
        return Vec::new();
    }
    let start = Instant::now();
    let open = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut sent = JoinSet::new();
    for (i, planned) in plan.iter().enumerate() {
        let due = start + planned.at;
        tokio::time::sleep_until(due).await;
        let endpoint = endpoints[i % endpoints.len()].clone();
        // The client's own lateness, before any wait for a place in flight: a standby that holds
        // the cap's worth unanswered delays what follows, and that is the standby's doing.
        let late = Instant::now().saturating_duration_since(due);
        let (planned, model, open) = (planned.clone(), model.map(str::to_owned), Arc::clone(&open));
        sent.spawn(async move {
            let Ok(permit) = open.acquire_owned().await else {
                return (i, Replayed::default());
            };
            // Built once it may be sent: the requests that wait hold no prompt.
            let body = request_body(&planned, i as u64, model.as_deref())
                .to_string()
                .into_bytes();
            let sent_at = Instant::now();
            let mut texts: Vec<Instant> = Vec::new();
            let transcript = stream_completion(
                &endpoint,
                body,
                limits.stall_after,
                // Timed from its planned time, not its send: a wait for a place in flight is
                // the standby's delay (no coordinated omission).
                (due, sent_at + limits.timeout),
                &mut |at| texts.push(at),
            )
            .await;
            drop(permit);
            let replayed = Replayed {
                ok: transcript.ending == Ending::Done,
                first_token: transcript.first_token,
                token_gaps: texts.windows(2).map(|w| w[1] - w[0]).collect(),
                sent_at: sent_at - start,
                sent_late: late,
            };
            (i, replayed)
        });
    }
    let mut replayed = vec![Replayed::default(); plan.len()];
    while let Some(done) = sent.join_next().await {
        // A request task cannot panic on what a server sends; one that did is a failed request.
        if let Ok((i, r)) = done {
            replayed[i] = r;
        }
    }
    replayed
}
