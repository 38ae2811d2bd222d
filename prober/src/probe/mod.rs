//! Generating probes: a real, deterministic, streamed completion per replica.
//!
//! A probe first reads whether the replica sleeps (`/is_sleeping`, else the
//! `vllm:engine_sleep_state` metric) and sends a sleeping replica no generation. Otherwise it
//! streams a `/v1/completions` with `temperature: 0`, a fixed seed and a small `max_tokens`,
//! times the first token and the whole answer, and compares the text with the golden answer.
//! Each probe ends in exactly one [`ProbeOutcome`]. Probe traffic is marked ([`PROBE_HEADER`],
//! [`PROBE_USER`]) so that it can be kept out of user metrics, and a round is spread by
//! [`jitter`] so that replicas are not probed in lockstep.
//!
//! This module must never retry a probe (a retry hides the failure being measured), never send
//! generation to a sleeping replica, and never panic on anything a server sends.

pub mod classify;
pub mod http;
pub mod sse;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use http_body_util::BodyExt;
use serde::Serialize;
use tokio::time::Instant;

pub use self::classify::{Budget, Ending, Expectation, GOLDEN_PREFIX_CHARS, Transcript, classify};
use self::http::{BodyRead, Failure};
use self::sse::{SseDecoder, SseEvent};
use crate::outcome::ProbeOutcome;

/// The header a fence sidecar sets on the 503 it answers when its pool does not hold the epoch.
pub const FENCE_HEADER: &str = "x-understudy-fenced";
/// The header every probe request carries, so that probe traffic can be told from users'.
pub const PROBE_HEADER: &str = "x-understudy-probe";
/// The OpenAI `user` field every probe sends.
pub const PROBE_USER: &str = "understudy-prober";

/// Why an endpoint could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint {0:?}: expected http://HOST:PORT (TLS is not probed)")]
    Invalid(String),
}

/// A replica's OpenAI-compatible server, and the bearer token every call to it carries: the
/// fence sidecar's control token, when a fence stands in front of the replica, so that the
/// operator's probes pass a fenced standby and its control calls are let through.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub bearer: Option<Bearer>,
}

/// A bearer token, never printed.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Bearer(std::sync::Arc<str>);

impl Bearer {
    /// A token from its text (a trailing newline, as files have, is dropped); `None` when empty.
    #[must_use]
    pub fn new(text: &str) -> Option<Bearer> {
        let text = text.trim();
        (!text.is_empty()).then(|| Bearer(text.into()))
    }

    /// The token, for an `Authorization: Bearer` header.
    #[must_use]
    pub fn secret(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Bearer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Bearer(..)")
    }
}

impl Endpoint {
    pub fn new(host: impl Into<String>, port: u16) -> Endpoint {
        Endpoint {
            host: host.into(),
            port,
            bearer: None,
        }
    }

    /// The same endpoint, called with `bearer`.
    #[must_use]
    pub fn with_bearer(mut self, bearer: Option<Bearer>) -> Endpoint {
        self.bearer = bearer;
        self
    }

    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority())
    }
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    /// `http://host:port[/]`, or `host:port`.
    fn from_str(s: &str) -> Result<Endpoint, EndpointError> {
        let invalid = || EndpointError::Invalid(s.to_owned());
        let rest = match s.split_once("://") {
            Some(("http", rest)) => rest,
            Some(_) => return Err(invalid()),
            None => s,
        };
        let authority = rest.trim_end_matches('/');
        if authority.contains('/') {
            return Err(invalid());
        }
        let uri: ::http::uri::Authority = authority.parse().map_err(|_| invalid())?;
        let host = uri.host().trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(invalid());
        }
        Ok(Endpoint::new(host, uri.port_u16().unwrap_or(80)))
    }
}

/// What a probe sends and what it accepts.
#[derive(Debug, Clone)]
pub struct ProbeSpec {
    /// The served model name; omitted from the request (vLLM then uses its only model) if `None`.
    pub model: Option<String>,
    pub prompt: String,
    pub max_tokens: u32,
    pub seed: u64,
    pub expect: Expectation,
    pub budget: Budget,
    /// The whole probe, the sleep check included, ends by this.
    pub timeout: Duration,
    /// After the first token, this long without a byte is a stall.
    pub stall_after: Duration,
    /// Read the sleep state before generating (on for every replica that may sleep).
    pub check_sleep: bool,
}

impl Default for ProbeSpec {
    fn default() -> Self {
        ProbeSpec {
            model: None,
            prompt: "The capital of France is".to_owned(),
            max_tokens: 8,
            seed: 1234,
            expect: Expectation::NonEmpty,
            budget: Budget {
                first_token: Duration::from_secs(2),
                total: Duration::from_secs(5),
            },
            timeout: Duration::from_secs(10),
            stall_after: Duration::from_secs(3),
            check_sleep: true,
        }
    }
}

impl ProbeSpec {
    /// The request body: deterministic sampling, streamed, with usage, marked as a probe.
    pub fn request_body(&self) -> serde_json::Value {
        let mut body = serde_json::json!({
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "seed": self.seed,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
            "user": PROBE_USER,
        });
        if let Some(model) = &self.model {
            body["model"] = serde_json::Value::String(model.clone());
        }
        body
    }
}

/// One probe of one replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    pub endpoint: Endpoint,
    pub outcome: ProbeOutcome,
    /// The generated text (empty when nothing was generated).
    pub text: String,
    pub first_token: Option<Duration>,
    pub total: Option<Duration>,
}

impl Serialize for ProbeReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("ProbeReport", 6)?;
        st.serialize_field("endpoint", &self.endpoint.to_string())?;
        st.serialize_field("outcome", self.outcome.as_str())?;
        st.serialize_field(
            "http_status",
            &match self.outcome {
                ProbeOutcome::HttpError(code) => Some(code),
                _ => None,
            },
        )?;
        st.serialize_field("text", &self.text)?;
        st.serialize_field("first_token_seconds", &self.first_token.map(|d| d.as_secs_f64()))?;
        st.serialize_field("total_seconds", &self.total.map(|d| d.as_secs_f64()))?;
        st.end()
    }
}

const PROBE_HEADERS: &[(&str, &str)] = &[(PROBE_HEADER, "1"), ("accept", "text/event-stream")];

fn failure_outcome(f: Failure) -> ProbeOutcome {
    match f {
        Failure::Refused => ProbeOutcome::Refused,
        Failure::Reset => ProbeOutcome::Reset,
        Failure::Timeout => ProbeOutcome::Timeout,
        Failure::BadStatus(code) => ProbeOutcome::HttpError(code),
    }
}

/// What the sleep check found.
enum SleepState {
    Awake,
    Asleep,
    /// The check itself failed in a way that already decides the probe.
    Decided(ProbeOutcome),
}

/// `vllm:engine_sleep_state{…,sleep_state="awake"} 0` means asleep.
fn metrics_say_asleep(text: &str) -> bool {
    text.lines().any(|line| {
        line.starts_with("vllm:engine_sleep_state{")
            && line.contains("sleep_state=\"awake\"")
            && line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) == Some(0.0)
    })
}

async fn sleep_state(endpoint: &Endpoint, deadline: Instant) -> SleepState {
    let get =
        |path: &'static str| http::send(endpoint, ::http::Method::GET, path, None, PROBE_HEADERS, deadline);
    let mut exchange = match get("/is_sleeping").await {
        Ok(e) => e,
        Err(f) => return SleepState::Decided(failure_outcome(f)),
    };
    match exchange.status {
        200 => match http::read_body(&mut exchange, 64 * 1024, deadline).await {
            BodyRead::Complete(body) => {
                let asleep = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("is_sleeping").and_then(serde_json::Value::as_bool));
                if asleep == Some(true) {
                    SleepState::Asleep
                } else {
                    SleepState::Awake
                }
            }
            BodyRead::Timeout => SleepState::Decided(ProbeOutcome::Timeout),
            BodyRead::Broken => SleepState::Decided(ProbeOutcome::Reset),
        },
        503 if exchange.fenced => SleepState::Decided(ProbeOutcome::Fenced),
        // Without dev mode the route does not exist: the sleep-state metric is the other witness.
        404 => {
            drop(exchange);
            let Ok(mut metrics) = get("/metrics").await else {
                return SleepState::Awake;
            };
            match http::read_body(&mut metrics, 8 * 1024 * 1024, deadline).await {
                BodyRead::Complete(body) if metrics.status == 200 => {
                    if metrics_say_asleep(&String::from_utf8_lossy(&body)) {
                        SleepState::Asleep
                    } else {
                        SleepState::Awake
                    }
                }
                _ => SleepState::Awake,
            }
        }
        // Anything else says nothing about sleep; the generation will say what is wrong.
        _ => SleepState::Awake,
    }
}

/// Streams one completion of `body` and records what happened, until `deadline`; after the first
/// token, `stall_after` without a byte is a stall. Each event that carries text is told to
/// `on_text` with when it arrived.
pub(crate) async fn stream_completion(
    endpoint: &Endpoint,
    body: Vec<u8>,
    stall_after: Duration,
    (started, deadline): (Instant, Instant),
    on_text: &mut (dyn FnMut(Instant) + Send),
) -> Transcript {
    let mut t = Transcript {
        ending: Ending::Timeout,
        text: String::new(),
        first_token: None,
        total: None,
    };
    let sent = http::send(
        endpoint,
        ::http::Method::POST,
        "/v1/completions",
        Some(body),
        PROBE_HEADERS,
        deadline,
    )
    .await;
    let mut exchange = match sent {
        Ok(e) => e,
        Err(f) => {
            t.ending = match f {
                Failure::Refused => Ending::Refused,
                Failure::Reset => Ending::Reset,
                Failure::Timeout => Ending::Timeout,
                Failure::BadStatus(code) => Ending::Status { code, fenced: false },
            };
            return t;
        }
    };
    if exchange.status != 200 {
        t.ending = Ending::Status {
            code: exchange.status,
            fenced: exchange.fenced,
        };
        return t;
    }
    let mut decoder = SseDecoder::default();
    let mut last_byte = Instant::now();
    loop {
        let wait_until = match t.first_token {
            Some(_) => deadline.min(last_byte + stall_after),
            None => deadline,
        };
        let frame = match tokio::time::timeout_at(wait_until, exchange.body.frame()).await {
            Err(_) => {
                let now = Instant::now();
                t.total = Some(now - started);
                t.ending = match t.first_token {
                    None => Ending::Timeout,
                    Some(_) if now - last_byte >= stall_after => Ending::Stalled,
                    Some(_) => Ending::DeadlineWhileStreaming,
                };
                return t;
            }
            Ok(None) => {
                t.total = Some(Instant::now() - started);
                // A stream that ends before [DONE] was closed early wherever the cut fell, mid
                // event or between events; only a whole body that is not a stream is garbled.
                let leftover = decoder.finish().is_some();
                t.ending = if leftover && !exchange.event_stream {
                    Ending::Garbled
                } else {
                    Ending::ClosedEarly
                };
                return t;
            }
            Ok(Some(Err(_))) => {
                t.total = Some(Instant::now() - started);
                t.ending = Ending::ClosedEarly;
                return t;
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Some(data) = frame.data_ref() else { continue };
        last_byte = Instant::now();
        for event in decoder.push(data) {
            match event {
                SseEvent::Text(text) => {
                    if !text.is_empty() {
                        if t.first_token.is_none() {
                            t.first_token = Some(last_byte - started);
                        }
                        on_text(last_byte);
                    }
                    t.text.push_str(&text);
                }
                SseEvent::Usage => {}
                SseEvent::Done => {
                    t.total = Some(last_byte - started);
                    t.ending = Ending::Done;
                    return t;
                }
                SseEvent::Error(code) => {
                    t.total = Some(last_byte - started);
                    t.ending = Ending::StreamError(code);
                    return t;
                }
                SseEvent::Invalid => {
                    t.total = Some(last_byte - started);
                    t.ending = Ending::Garbled;
                    return t;
                }
            }
        }
    }
}

/// Probes one replica once.
pub async fn probe(endpoint: &Endpoint, spec: &ProbeSpec) -> ProbeReport {
    let started = Instant::now();
    let deadline = started + spec.timeout;
    let report = |outcome, t: Option<Transcript>| ProbeReport {
        endpoint: endpoint.clone(),
        outcome,
        text: t.as_ref().map(|t| t.text.clone()).unwrap_or_default(),
        first_token: t.as_ref().and_then(|t| t.first_token),
        total: t.as_ref().and_then(|t| t.total),
    };
    if spec.check_sleep {
        match sleep_state(endpoint, deadline).await {
            SleepState::Asleep => return report(ProbeOutcome::Asleep, None),
            SleepState::Decided(outcome) => return report(outcome, None),
            SleepState::Awake => {}
        }
    }
    let body = spec.request_body().to_string().into_bytes();
    let transcript =
        stream_completion(endpoint, body, spec.stall_after, (started, deadline), &mut |_| {}).await;
    let outcome = classify(&transcript, &spec.expect, &spec.budget);
    report(outcome, Some(transcript))
}

/// How long to wait before probing `replica` in round `round`: a seeded, stable spread over
/// `[0, max)` in whole milliseconds, so replicas are not probed in lockstep and a test can predict the schedule.
pub fn jitter(seed: u64, replica: &str, round: u64, max: Duration) -> Duration {
    if max.is_zero() {
        return Duration::ZERO;
    }
    // FNV-1a over the name, then SplitMix64 over (seed, name, round).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in replica.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut z = seed ^ h ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    // Whole milliseconds: the timer's own resolution.
    let millis = max.as_millis().clamp(1, u128::from(u64::MAX)) as u64;
    Duration::from_millis(z % millis)
}

/// Probes every endpoint once, each after its jitter, concurrently; reports in input order.
pub async fn probe_round(
    endpoints: &[Endpoint],
    spec: &ProbeSpec,
    seed: u64,
    round: u64,
    max_jitter: Duration,
) -> Vec<ProbeReport> {
    jittered(endpoints, seed, round, max_jitter, |endpoint| {
        probe(endpoint, spec)
    })
    .await
}

/// Runs `work` for every endpoint, each started after its [`jitter`], all concurrently;
/// results in input order.
pub async fn jittered<'a, F, Fut>(
    endpoints: &'a [Endpoint],
    seed: u64,
    round: u64,
    max_jitter: Duration,
    work: F,
) -> Vec<Fut::Output>
where
    F: Fn(&'a Endpoint) -> Fut,
    Fut: std::future::Future,
{
    let work = &work;
    futures::future::join_all(endpoints.iter().map(|endpoint| async move {
        tokio::time::sleep(jitter(seed, &endpoint.authority(), round, max_jitter)).await;
        work(endpoint).await
    }))
    .await
}

/// A round as a table: endpoint, outcome, time to first token, total, text.
pub fn render_table(reports: &[ProbeReport]) -> String {
    use std::fmt::Write;
    let ms = |d: Option<Duration>| d.map_or("-".to_owned(), |d| format!("{}ms", d.as_millis()));
    let mut out = format!(
        "{:<28} {:<16} {:>8} {:>8}  text\n",
        "endpoint", "outcome", "ttft", "total"
    );
    for r in reports {
        let outcome = match r.outcome {
            ProbeOutcome::HttpError(code) => format!("http-error {code}"),
            ref other => other.as_str().to_owned(),
        };
        let _ = writeln!(
            out,
            "{:<28} {outcome:<16} {:>8} {:>8}  {:?}",
            r.endpoint.to_string(),
            ms(r.first_token),
            ms(r.total),
            r.text
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_from_urls_and_host_port_and_refuse_tls() {
        assert_eq!(
            "http://127.0.0.1:8000".parse(),
            Ok(Endpoint::new("127.0.0.1", 8000))
        );
        assert_eq!(
            "http://vllm.llm.svc:8000/".parse(),
            Ok(Endpoint::new("vllm.llm.svc", 8000))
        );
        assert_eq!("localhost:9".parse(), Ok(Endpoint::new("localhost", 9)));
        assert_eq!("http://[::1]:8000".parse(), Ok(Endpoint::new("::1", 8000)));
        assert!("https://x:1".parse::<Endpoint>().is_err());
        assert!("http://x:1/v1".parse::<Endpoint>().is_err());
        assert_eq!(Endpoint::new("::1", 8000).to_string(), "http://[::1]:8000");
    }

    #[test]
    fn the_request_is_deterministic_streamed_with_usage_and_marked_as_a_probe() {
        let body = ProbeSpec {
            model: Some("m".into()),
            ..ProbeSpec::default()
        }
        .request_body();
        assert_eq!(body["temperature"], 0);
        assert_eq!(body["seed"], 1234);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["user"], PROBE_USER);
        assert_eq!(body["model"], "m");
        assert!(ProbeSpec::default().request_body().get("model").is_none());
    }

    #[test]
    fn jitter_is_stable_per_seed_spread_across_replicas_and_within_its_bound() {
        let max = Duration::from_secs(2);
        let names: Vec<String> = (0..32).map(|i| format!("10.0.0.{i}:8000")).collect();
        let offsets: Vec<Duration> = names.iter().map(|n| jitter(7, n, 0, max)).collect();
        assert!(offsets.iter().all(|d| *d < max));
        assert_eq!(
            offsets,
            names.iter().map(|n| jitter(7, n, 0, max)).collect::<Vec<_>>()
        );
        let mut distinct = offsets.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), offsets.len(), "no two replicas share an offset");
        assert!(offsets.iter().any(|d| *d < max / 2) && offsets.iter().any(|d| *d >= max / 2));
        assert_ne!(
            jitter(8, &names[0], 0, max),
            offsets[0],
            "another seed, another schedule"
        );
        assert_ne!(
            jitter(7, &names[0], 1, max),
            offsets[0],
            "another round, another phase"
        );
        assert_eq!(jitter(7, &names[0], 0, Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn the_sleep_state_metric_says_asleep_only_when_awake_is_zero() {
        let asleep = "vllm:engine_sleep_state{engine=\"0\",model_name=\"m\",sleep_state=\"awake\"} 0.0\n\
                      vllm:engine_sleep_state{engine=\"0\",model_name=\"m\",sleep_state=\"weights_offloaded\"} 1.0\n";
        assert!(metrics_say_asleep(asleep));
        assert!(!metrics_say_asleep(&asleep.replace("} 0.0", "} 1.0")));
        assert!(!metrics_say_asleep("vllm:num_requests_running{} 0\n"));
    }
}
