//! Open-loop load: requests arrive as a Poisson process at the scenario's rate, whatever the
//! answers, and each one is sent as any OpenAI client sends it, to the routers in turn.
//!
//! Every request is recorded with when it was sent, when its first byte came, when it ended and
//! how, so the report can count and time what clients saw. The load is bounded in count and time
//! and sends only to the loopback addresses it is given.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinSet;
use tokio::time::Instant;
use understudy_router::admission::{PRIORITY_HEADER, Priority};

use super::http::{ExchangeError, exchange};
use super::scenario::Load;

/// How a request ended, as its client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestOutcome {
    /// A complete answer: every stream ended with `[DONE]`.
    Ok,
    /// Refused by admission control (429), to be retried later.
    Shed,
    /// An error, a cut stream, or no answer.
    Failed,
}

/// One request's record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    /// When it was sent, from the start of load.
    pub sent: Duration,
    pub ended: Duration,
    pub first_byte: Option<Duration>,
    pub outcome: RequestOutcome,
    /// It failed without any replica having taken it: the router could not be reached, or had
    /// nowhere to send it.
    pub never_reached_a_replica: bool,
    pub stream: bool,
    /// The class it declared (`Default` when it declared none).
    pub priority: Priority,
    /// What a failure was, as its client saw it: `http 502`, `cut stream`, `no answer`, …
    pub failure: Option<String>,
}

/// The longest a request may take before it counts as failed.
const REQUEST_LIMIT: Duration = Duration::from_secs(30);

/// Words prompts are made of, so prompts differ in length and content but never in kind.
const WORDS: [&str; 16] = [
    "the", "standby", "pool", "takes", "over", "when", "primary", "fails", "and", "serves", "every",
    "request", "with", "its", "own", "tokens",
];

/// Sends load until `until` from `start`, then waits for what is in flight.
pub async fn run(
    load: &Load,
    model: &str,
    routers: &[SocketAddr],
    seed: u64,
    start: Instant,
    until: Duration,
    records: Arc<Mutex<Vec<RequestRecord>>>,
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut in_flight = JoinSet::new();
    let mut next = Duration::ZERO;
    let mut sent: u64 = 0;
    while next < until {
        tokio::time::sleep_until(start + next).await;
        let router = routers[usize::try_from(sent).unwrap_or(0) % routers.len()];
        let request = Request::draw(load, model, &mut rng);
        let records = Arc::clone(&records);
        in_flight.spawn(async move {
            let record = request.send(router, start).await;
            records
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(record);
        });
        sent += 1;
        // Exponential gaps: a Poisson process at `rate`.
        let gap = -(1.0 - rng.f64()).ln() / load.rate;
        next += Duration::from_secs_f64(gap.min(60.0));
        while in_flight.try_join_next().is_some() {}
    }
    while in_flight.join_next().await.is_some() {}
}

/// One request, drawn from the scenario's distributions.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Request {
    pub(crate) body: Bytes,
    pub(crate) stream: bool,
    pub(crate) priority: Priority,
}

impl Request {
    pub(crate) fn draw(load: &Load, model: &str, rng: &mut fastrand::Rng) -> Request {
        let stream = rng.f64() < load.stream_share;
        let class = rng.f64();
        let priority = if class < load.priorities.interactive {
            Priority::Interactive
        } else if class < load.priorities.interactive + load.priorities.batch {
            Priority::Batch
        } else {
            Priority::Default
        };
        let words = rng.u32(load.prompt_words[0]..=load.prompt_words[1]);
        let max_tokens = rng.u32(load.max_tokens[0]..=load.max_tokens[1]);
        let mut prompt = String::new();
        if rng.f64() < load.shared_prefix_share {
            prompt.push_str("You are the standby pool's assistant; answer briefly. ");
        }
        for i in 0..words {
            if i > 0 {
                prompt.push(' ');
            }
            prompt.push_str(WORDS[rng.usize(..WORDS.len())]);
        }
        let body = serde_json::json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        });
        Request {
            body: Bytes::from(body.to_string()),
            stream,
            priority,
        }
    }

    /// The headers it is sent with: its priority class, when it declares one.
    pub(crate) fn headers(&self) -> Vec<(&'static str, &'static str)> {
        let class = match self.priority {
            Priority::Interactive => Some("interactive"),
            Priority::Batch => Some("batch"),
            Priority::Default => None,
        };
        class.map(|c| (PRIORITY_HEADER, c)).into_iter().collect()
    }

    async fn send(self, router: SocketAddr, start: Instant) -> RequestRecord {
        let sent = start.elapsed();
        let headers = self.headers();
        let answer = exchange(
            router,
            "POST",
            "/v1/completions",
            &headers,
            self.body,
            REQUEST_LIMIT,
        )
        .await;
        let ended = start.elapsed();
        let (outcome, never_reached_a_replica, first_byte) = match &answer {
            Ok(answer) => {
                let (outcome, before) = judge(answer.status, &answer.body, answer.complete, self.stream);
                (outcome, before, answer.first_byte)
            }
            Err(ExchangeError::Connect(_)) => (RequestOutcome::Failed, true, None),
            Err(_) => (RequestOutcome::Failed, false, None),
        };
        let failure = (outcome == RequestOutcome::Failed).then(|| match &answer {
            Ok(answer) if answer.status == 200 && aborted(&answer.body) => "aborted".to_owned(),
            Ok(answer) if answer.status == 200 => "cut stream".to_owned(),
            Ok(answer) => match error_type(&answer.body) {
                Some(kind) => format!("http {} {kind}", answer.status),
                None => format!("http {}", answer.status),
            },
            Err(ExchangeError::Connect(_)) => "router refused".to_owned(),
            Err(ExchangeError::Timeout(_)) => "no answer in time".to_owned(),
            Err(ExchangeError::NoAnswer(_)) => "connection closed".to_owned(),
        });
        RequestRecord {
            sent,
            ended,
            first_byte: first_byte.map(|d| sent + d),
            outcome,
            never_reached_a_replica,
            stream: self.stream,
            priority: self.priority,
            failure,
        }
    }
}

/// Whether an answer says its engine aborted it (`finish_reason: "abort"`).
fn aborted(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(body);
    text.contains("\"finish_reason\":\"abort\"") || text.contains("\"finish_reason\": \"abort\"")
}

/// The `error.type` of an OpenAI-style error body.
pub(crate) fn error_type(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(value.get("error")?.get("type")?.as_str()?.to_owned())
}

/// What an answer means to its client, and whether it failed before any replica took it (the
/// router had no endpoint in time, or every try was refused before a byte).
pub(crate) fn judge(status: u16, body: &[u8], complete: bool, stream: bool) -> (RequestOutcome, bool) {
    let text = String::from_utf8_lossy(body);
    match status {
        200 if !complete => (RequestOutcome::Failed, false),
        // The engine ended it early (a replica put to sleep, or shut down, while it ran): the
        // answer is cut short however cleanly it ends.
        200 if aborted(body) => (RequestOutcome::Failed, false),
        200 if stream => {
            // A cut stream ends with a retryable error event and never with `[DONE]`.
            let clean = text.trim_end().ends_with("data: [DONE]") && !text.contains("\"error\"");
            let outcome = if clean {
                RequestOutcome::Ok
            } else {
                RequestOutcome::Failed
            };
            (outcome, false)
        }
        200 if text.contains("\"choices\"") => (RequestOutcome::Ok, false),
        200 => (RequestOutcome::Failed, false),
        429 => (RequestOutcome::Shed, false),
        _ => {
            let never_reached =
                text.contains("\"type\":\"unavailable\"") || text.contains("before answering");
            (RequestOutcome::Failed, never_reached)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::scenario::{PriorityMix, Scenario};

    #[test]
    fn requests_declare_their_class_in_the_shares_the_scenario_gives() {
        let mut load = Scenario::parse(crate::local::scenario::DEFAULT)
            .unwrap_or_else(|e| panic!("{e}"))
            .scenario
            .load;
        load.priorities = PriorityMix {
            interactive: 0.3,
            batch: 0.4,
        };
        let mut rng = fastrand::Rng::with_seed(3);
        let drawn: Vec<Priority> = (0..2_000)
            .map(|_| Request::draw(&load, "m", &mut rng).priority)
            .collect();
        let share = |p: Priority| drawn.iter().filter(|d| **d == p).count() as f64 / 2_000.0;
        assert!((share(Priority::Interactive) - 0.3).abs() < 0.05);
        assert!((share(Priority::Batch) - 0.4).abs() < 0.05);
        assert!((share(Priority::Default) - 0.3).abs() < 0.05);
    }

    #[test]
    fn a_stream_is_ok_only_when_it_ends_with_done_and_carries_no_error() {
        let ok = b"data: {\"choices\":[{\"text\":\" a\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(judge(200, ok, true, true), (RequestOutcome::Ok, false));
        let cut = b"data: {\"choices\":[{\"text\":\" a\"}]}\n\ndata: {\"error\":{\"retryable\":true}}\n\n";
        assert_eq!(judge(200, cut, true, true), (RequestOutcome::Failed, false));
        let aborted =
            b"data: {\"choices\":[{\"text\":\" a\",\"finish_reason\":\"abort\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(judge(200, aborted, true, true), (RequestOutcome::Failed, false));
        let whole = br#"{"choices":[{"text":" a","finish_reason": "abort"}]}"#;
        assert_eq!(judge(200, whole, true, false), (RequestOutcome::Failed, false));
        assert_eq!(judge(200, ok, false, true), (RequestOutcome::Failed, false));
    }

    #[test]
    fn shed_and_router_refusals_are_told_apart_from_upstream_failures() {
        assert_eq!(judge(429, b"{}", true, false), (RequestOutcome::Shed, false));
        let unavailable = br#"{"error":{"message":"no serving endpoint","type":"unavailable","code":503}}"#;
        assert_eq!(
            judge(503, unavailable, true, false),
            (RequestOutcome::Failed, true)
        );
        let timeout = br#"{"error":{"message":"upstream did not answer in time","type":"upstream_timeout"}}"#;
        assert_eq!(judge(504, timeout, true, false), (RequestOutcome::Failed, false));
    }
}
