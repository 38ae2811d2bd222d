//! The route contract between the operator and the routers. A [`Route`] says, for one policy,
//! which pool serves user traffic, at which endpoints, under which fencing epoch, and how
//! carefully it is admitted after the switch: it is the body of the router admin API's
//! `PUT /route`, which the operator builds from a policy ([`Route::for_pool`]) and the router
//! reads. [`RouterHolds`] is the answer to `GET /route?policy=...`: the route a router serves for
//! that policy and the highest epoch it has taken for it.
//!
//! One router set may serve several policies: each policy's route has its own epoch, and a
//! request takes the route whose `models` name the model it asks for.
//!
//! One type for both sides of the socket, so that what the operator sends is by construction what
//! the router takes. This module only describes and validates a route; it must never decide
//! whether a route is stale (the router judges that against the highest epoch it has seen) or
//! touch a socket.

use std::net::SocketAddr;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use understudy_core::Epoch;

use crate::crd::{AdmissionSpec, FailoverPolicySpec};

/// A route update as the operator pushes it and the router takes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// The policy the route is for, `namespace/name`; routes of different policies never touch
    /// each other. Empty for a route a person writes for a router that serves one policy.
    #[serde(default)]
    pub policy: String,
    /// The model names requests ask for (the `model` field) that this route takes; empty takes
    /// any model. With several routes, a request goes to the route that names its model, or else
    /// to the one that names none.
    #[serde(default)]
    pub models: Vec<String>,
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
    /// A model name must name a model.
    #[error("a route's models must not be empty names")]
    EmptyModel,
    /// A route with no endpoints would send everything to the waiting room.
    #[error("a route must list at least one endpoint")]
    NoEndpoints,
    /// The admission settings contradict each other.
    #[error("admission: {0}")]
    Admission(&'static str),
    /// The last epoch there is: no route could ever follow it.
    #[error("epoch {0} is the last there is, and no later route could be newer")]
    LastEpoch(Epoch),
}

impl Route {
    /// The route that makes `pool` primary at `epoch` for `policy`, served at `endpoints`, taking
    /// requests for `models`, with the policy's admission settings scaled to those endpoints and
    /// its stream contract.
    #[must_use]
    pub fn for_pool(
        policy: &str,
        spec: &FailoverPolicySpec,
        pool: &str,
        models: Vec<String>,
        endpoints: Vec<SocketAddr>,
        epoch: Epoch,
    ) -> Self {
        Route {
            policy: policy.to_owned(),
            models,
            pool: pool.to_owned(),
            admission: AdmissionSettings::for_replicas(&spec.admission, endpoints.len()),
            endpoints,
            epoch,
            stream_contract: spec.stream.contract,
        }
    }

    /// Checks what can be checked without knowing the epochs seen before.
    pub fn validate(&self) -> Result<(), InvalidRoute> {
        if self.pool.trim().is_empty() {
            return Err(InvalidRoute::EmptyPool);
        }
        if self.models.iter().any(|m| m.is_empty()) {
            return Err(InvalidRoute::EmptyModel);
        }
        if self.endpoints.is_empty() {
            return Err(InvalidRoute::NoEndpoints);
        }
        if self.epoch.0 == u64::MAX {
            return Err(InvalidRoute::LastEpoch(self.epoch));
        }
        self.admission.validate()
    }
}

/// Admission control after a new route: a budget that starts low and ramps up over a window.
///
/// The [`Default`] is what a router runs a route with that says nothing of admission, and its
/// numbers are also the per-replica defaults a policy's route is scaled by
/// ([`AdmissionSettings::for_replicas`]): they are written once, here.
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
    /// The request header that carries a request's priority: `interactive` and `batch` name
    /// their classes, any other value is the default class.
    pub priority_header: String,
    /// Priority values (as the header carries them) refused outright while the window is open.
    pub shed_priorities: Vec<String>,
}

/// The header a request's priority is read from when a policy names none.
pub const DEFAULT_PRIORITY_HEADER: &str = "x-understudy-priority";

impl Default for AdmissionSettings {
    fn default() -> Self {
        AdmissionSettings {
            window_s: 0.0,
            initial_concurrency: 4,
            max_concurrency: 256,
            initial_prefill_tokens: 16_384,
            max_prefill_tokens: 1_048_576,
            ttft_buffer: 0.25,
            priority_header: DEFAULT_PRIORITY_HEADER.to_owned(),
            shed_priorities: Vec::new(),
        }
    }
}

impl AdmissionSettings {
    /// A policy's per-replica admission settings as budgets for a route of `replicas` endpoints;
    /// what the policy does not set comes from [`AdmissionSettings::default`], per replica. An
    /// unparseable window (validation rejects one) turns admission off rather than guessing.
    #[must_use]
    pub fn for_replicas(spec: &AdmissionSpec, replicas: usize) -> Self {
        let per_replica = AdmissionSettings::default();
        let n = u32::try_from(replicas.max(1)).unwrap_or(u32::MAX);
        let initial_concurrency = spec.initial_concurrency.max(1).saturating_mul(n);
        let max_concurrency = spec
            .max_concurrency
            .unwrap_or(per_replica.max_concurrency)
            .saturating_mul(n)
            .max(initial_concurrency);
        let initial_prefill_tokens = spec
            .initial_prefill_tokens
            .map_or(per_replica.initial_prefill_tokens, u64::from)
            .max(1)
            .saturating_mul(u64::from(n));
        let max_prefill_tokens = per_replica
            .max_prefill_tokens
            .saturating_mul(u64::from(n))
            .max(initial_prefill_tokens);
        AdmissionSettings {
            window_s: spec.window.parse().map_or(0.0, |w| w.as_secs_f64()),
            initial_concurrency,
            max_concurrency,
            initial_prefill_tokens,
            max_prefill_tokens,
            ttft_buffer: per_replica.ttft_buffer,
            priority_header: spec.priority_header.clone(),
            shed_priorities: spec.shed_priorities.clone().unwrap_or_default(),
        }
    }

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
        if http::HeaderName::from_bytes(self.priority_header.as_bytes()).is_err() {
            return Err(InvalidRoute::Admission(
                "priority_header must be an HTTP header name",
            ));
        }
        if self.shed_priorities.len() > 16
            || self.shed_priorities.iter().any(|p| p.is_empty() || p.len() > 63)
        {
            return Err(InvalidRoute::Admission(
                "shed_priorities must list at most 16 values of 1 to 63 bytes",
            ));
        }
        Ok(())
    }
}

/// What a client sees when its stream's replica dies after tokens went out. A policy's
/// `spec.stream.contract` is this type too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum StreamContract {
    /// An SSE error event marked `"retryable": true`, and never a `[DONE]`.
    #[default]
    RetryableError,
    /// A completions stream is carried on by another endpoint of the route: the original prompt
    /// plus the text delivered, `max_tokens` less the tokens delivered, its events stamped with
    /// the first stream's id. Chat streams, and a continuation that fails too, end as under
    /// `retryable-error` (the router's `continuation` module says why chat is not continued).
    Continuation,
}

/// The highest epoch a router has taken for a policy, and the pool it took at that epoch. The
/// router keeps one per policy in its state file, so that they survive a restart, and shows the
/// asked policy's in [`RouterHolds`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldEpoch {
    /// The policy (empty for the unnamed one).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub policy: String,
    /// The highest epoch taken.
    pub epoch: Epoch,
    /// The pool taken at that epoch.
    pub pool: String,
}

/// What a router says it holds for one policy (`GET /route?policy=...`): the route it serves, and
/// the highest epoch it has taken, which a router restarted with its state file knows before it
/// has a route again.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouterHolds {
    /// The route served now; `None` before the first route since the router started.
    pub route: Option<Route>,
    /// The highest epoch taken; `None` when the router has never taken a route.
    pub highest: Option<HeldEpoch>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Found by `fuzz/fuzz_targets/route_json.rs`: without exact float parsing, a long
    /// `window_s` read back from its own JSON was another number.
    #[test]
    fn a_route_read_back_from_its_own_json_is_the_same_route() {
        let text = r#"{"pool":"@b","epoch":5,"endpoints":["127.0.0.1:80"],"admission":{"window_s":3.77777777755555555555555554}}"#;
        let route: Route = serde_json::from_str(text).unwrap();
        let again: Route = serde_json::from_str(&serde_json::to_string(&route).unwrap()).unwrap();
        assert_eq!(again, route);
    }

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

    #[test]
    fn the_policys_priority_header_and_shed_priorities_travel_in_the_route() {
        let spec = AdmissionSpec {
            priority_header: "x-tier".to_owned(),
            shed_priorities: Some(vec!["low".to_owned(), "batch".to_owned()]),
            ..AdmissionSpec::default()
        };
        let admission = AdmissionSettings::for_replicas(&spec, 2);
        assert_eq!(admission.priority_header, "x-tier");
        assert_eq!(admission.shed_priorities, ["low", "batch"]);
        let defaults = AdmissionSettings::for_replicas(&AdmissionSpec::default(), 2);
        assert_eq!(defaults.priority_header, DEFAULT_PRIORITY_HEADER);
        assert!(defaults.shed_priorities.is_empty());
        let mut r: Route =
            serde_json::from_str(r#"{"pool":"b","endpoints":["127.0.0.1:8000"],"epoch":3}"#).unwrap();
        r.admission.priority_header = "not a header".to_owned();
        assert!(matches!(r.validate(), Err(InvalidRoute::Admission(_))));
        r.admission.priority_header = DEFAULT_PRIORITY_HEADER.to_owned();
        r.admission.shed_priorities = vec![String::new()];
        assert!(matches!(r.validate(), Err(InvalidRoute::Admission(_))));
    }

    #[test]
    fn admission_without_a_maximum_ramps_to_the_routers_default_per_replica() {
        let spec = AdmissionSpec::default();
        let admission = AdmissionSettings::for_replicas(&spec, 3);
        assert_eq!(admission.window_s, 300.0);
        assert_eq!(admission.initial_concurrency, 12);
        assert_eq!(admission.max_concurrency, 3 * 256);
        assert!(admission.initial_prefill_tokens <= admission.max_prefill_tokens);
    }

    #[test]
    fn the_policys_initial_prefill_tokens_are_per_replica_and_start_the_routes_prefill_budget() {
        let spec = AdmissionSpec {
            initial_prefill_tokens: Some(100),
            ..AdmissionSpec::default()
        };
        let admission = AdmissionSettings::for_replicas(&spec, 3);
        assert_eq!(admission.initial_prefill_tokens, 300);
        let defaults = AdmissionSettings::for_replicas(&AdmissionSpec::default(), 3);
        assert_eq!(defaults.initial_prefill_tokens, 3 * 16_384);
    }
}
