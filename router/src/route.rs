//! A route: which pool serves user traffic, at which endpoints, under which fencing epoch, and
//! how carefully it is admitted after the switch. This is the body of the admin API's
//! `PUT /route` and nothing more.
//!
//! This module only describes and validates a route; it must never decide whether a route is
//! stale (that is [`crate::fencing`]) or touch a socket.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use understudy_core::Epoch;

/// A route update as the operator pushes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// The pool's name, as the Lease's holder names it.
    pub pool: String,
    /// The pool's serving endpoints (fence sidecars in a cluster), `ip:port`.
    pub endpoints: Vec<SocketAddr>,
    /// The fencing epoch under which this pool is primary.
    pub epoch: Epoch,
    /// How work is admitted to the pool after the switch.
    #[serde(default)]
    pub admission: AdmissionSettings,
    /// What a client sees when the replica serving its stream dies mid-stream.
    #[serde(default)]
    pub stream_contract: StreamContract,
}

/// Why a route update cannot be taken, before any question of epochs.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidRoute {
    /// A route must name its pool.
    #[error("a route must name its pool")]
    EmptyPool,
    /// A route with no endpoints would send everything to the waiting room.
    #[error("a route must list at least one endpoint")]
    NoEndpoints,
    /// The admission settings contradict each other.
    #[error("admission: {0}")]
    Admission(&'static str),
}

impl Route {
    /// Checks what can be checked without knowing the epochs seen before.
    pub fn validate(&self) -> Result<(), InvalidRoute> {
        if self.pool.trim().is_empty() {
            return Err(InvalidRoute::EmptyPool);
        }
        if self.endpoints.is_empty() {
            return Err(InvalidRoute::NoEndpoints);
        }
        self.admission.validate()
    }
}

/// Admission control after a new route: a budget that starts low and ramps up over a window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionSettings {
    /// How long after the route arrives the budget applies; 0 turns admission control off.
    pub window_s: f64,
    /// Concurrent requests admitted at the start of the window.
    pub initial_concurrency: u32,
    /// Concurrent requests admitted at the end of the window.
    pub max_concurrency: u32,
    /// Prompt tokens in prefill or decode admitted at the start of the window.
    pub initial_prefill_tokens: u64,
    /// Prompt tokens admitted at the end of the window.
    pub max_prefill_tokens: u64,
    /// Added to the lowest first-token latency seen before a slower average counts as queueing
    /// (Envoy's gradient controller's buffer).
    pub ttft_buffer: f64,
}

impl Default for AdmissionSettings {
    fn default() -> Self {
        AdmissionSettings {
            window_s: 0.0,
            initial_concurrency: 4,
            max_concurrency: 256,
            initial_prefill_tokens: 16_384,
            max_prefill_tokens: 1_048_576,
            ttft_buffer: 0.25,
        }
    }
}

impl AdmissionSettings {
    /// The window as a duration (0 when off).
    #[must_use]
    pub fn window(&self) -> Duration {
        Duration::try_from_secs_f64(self.window_s).unwrap_or(Duration::ZERO)
    }

    fn validate(&self) -> Result<(), InvalidRoute> {
        if !self.window_s.is_finite() || self.window_s < 0.0 || self.window_s > 86_400.0 {
            return Err(InvalidRoute::Admission("window_s must be between 0 and 86400"));
        }
        if self.initial_concurrency == 0 || self.initial_concurrency > self.max_concurrency {
            return Err(InvalidRoute::Admission(
                "initial_concurrency must be at least 1 and at most max_concurrency",
            ));
        }
        if self.initial_prefill_tokens == 0 || self.initial_prefill_tokens > self.max_prefill_tokens {
            return Err(InvalidRoute::Admission(
                "initial_prefill_tokens must be at least 1 and at most max_prefill_tokens",
            ));
        }
        if !self.ttft_buffer.is_finite() || self.ttft_buffer < 0.0 {
            return Err(InvalidRoute::Admission("ttft_buffer must be 0 or more"));
        }
        Ok(())
    }
}

/// What a client sees when its stream's replica dies after tokens went out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StreamContract {
    /// An SSE error event marked `"retryable": true`, and never a `[DONE]`.
    #[default]
    RetryableError,
    /// A completions stream is carried on by another endpoint of the route: the original prompt
    /// plus the text delivered, `max_tokens` less the tokens delivered, its events stamped with
    /// the first stream's id. Chat streams, and a continuation that fails too, end as under
    /// `retryable-error` (see [`crate::continuation`] for why chat is not continued).
    Continuation,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_minimal_route_reads_with_default_admission_and_the_retryable_error_contract() {
        let r: Route =
            serde_json::from_str(r#"{"pool":"b","endpoints":["127.0.0.1:8000"],"epoch":3}"#).unwrap();
        assert_eq!(r.epoch, Epoch(3));
        assert_eq!(r.stream_contract, StreamContract::RetryableError);
        assert_eq!(r.admission.window(), Duration::ZERO);
        assert_eq!(r.validate(), Ok(()));
    }

    #[test]
    fn a_route_without_endpoints_or_pool_or_with_inverted_budgets_is_invalid() {
        let mut r: Route =
            serde_json::from_str(r#"{"pool":"b","endpoints":["127.0.0.1:8000"],"epoch":3}"#).unwrap();
        r.admission.initial_concurrency = 1000;
        assert!(matches!(r.validate(), Err(InvalidRoute::Admission(_))));
        r.admission = AdmissionSettings::default();
        r.endpoints.clear();
        assert_eq!(r.validate(), Err(InvalidRoute::NoEndpoints));
        r.pool = " ".into();
        assert_eq!(r.validate(), Err(InvalidRoute::EmptyPool));
    }

    #[test]
    fn the_continuation_contract_is_taken_and_an_unknown_one_refused() {
        let r: Route = serde_json::from_str(
            r#"{"pool":"b","endpoints":["127.0.0.1:8000"],"epoch":3,"stream_contract":"continuation"}"#,
        )
        .unwrap();
        assert_eq!(r.stream_contract, StreamContract::Continuation);
        assert!(
            serde_json::from_str::<Route>(
                r#"{"pool":"b","endpoints":["127.0.0.1:8000"],"epoch":3,"stream_contract":"resume"}"#,
            )
            .is_err()
        );
    }

    #[test]
    fn unknown_fields_are_refused_rather_than_ignored() {
        let r = serde_json::from_str::<Route>(
            r#"{"pool":"b","endpoints":["127.0.0.1:8000"],"epoch":3,"epcoh":4}"#,
        );
        assert!(r.is_err());
    }
}
