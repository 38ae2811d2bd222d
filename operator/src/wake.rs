//! The promotion's Wake step: the new primary's warm replicas are woken from vLLM sleep mode
//! through its dev endpoints (`GET /is_sleeping`, `POST /wake_up`, and after a level-2 sleep
//! `POST /collective_rpc {"method":"reload_weights"}` and `POST /reset_prefix_cache`).
//!
//! A 200 from `/wake_up` proves nothing: a replica counts as woken only once `/is_sleeping` says
//! false. A level-2 wake follows vLLM's documented order (weights, `reload_weights`, then the KV
//! cache), so that a replica whose reload failed still reports itself asleep and is retried,
//! rather than looking awake with garbage weights. A replica that answers 404 has no dev
//! endpoints (`VLLM_SERVER_DEV_MODE` is off), so nothing can have put it to sleep through them:
//! it counts as awake.
//!
//! This module must never report a replica woken that `/is_sleeping` did not confirm, send a
//! request without a timeout, or let one replica's failure keep the others from being woken.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::{BoxFuture, join_all};
use kube::ResourceExt;
use understudy_core::failover::Step;
use understudy_prober::probe::Endpoint;

use crate::controller::{RouteSyncReport, RouteSyncRequest, StepExecutor, StepReport, StepRequest};
use crate::crd::PoolSpec;
use crate::http1;
use crate::observe::ReplicaEndpoints;

/// Who carries the Wake step: this operator, calling the replicas.
pub const CARRIED_BY: &str = "operator";

/// The longest `GET /is_sleeping` may take, connection included.
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest one waking call may take. Bringing weights back from host memory, or reloading
/// them from disk after a level-2 sleep, takes seconds to minutes on a large model; a call cut
/// short is retried by the next reconcile.
pub const DEFAULT_WAKE_TIMEOUT: Duration = Duration::from_secs(120);

/// How a pool's warm replicas sleep, from its standby tiers: `None` when it has no warm tier,
/// and level 2 when any warm group sleeps at level 2, since that wake also serves level 1.
#[must_use]
pub fn warm_sleep_level(pool: &PoolSpec) -> Option<u8> {
    let shape = pool.standby_shape();
    (shape.warm > 0).then_some(shape.sleep_level)
}

/// The per-call timeouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WakeTimeouts {
    /// For `GET /is_sleeping`.
    pub query: Duration,
    /// For each call that wakes, reloads or resets.
    pub wake: Duration,
}

impl Default for WakeTimeouts {
    fn default() -> Self {
        WakeTimeouts {
            query: DEFAULT_QUERY_TIMEOUT,
            wake: DEFAULT_WAKE_TIMEOUT,
        }
    }
}

/// What became of one replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaWake {
    /// It was not asleep; nothing was sent.
    Awake,
    /// `/is_sleeping` answered 404: dev mode is off, so it cannot be asleep through the API.
    NoSleepApi,
    /// It was asleep, and after the waking calls `/is_sleeping` says false.
    Woken,
    /// The waking calls were answered, but it still reports itself asleep.
    StillAsleep,
    /// A call failed: no answer, a timeout, or an answer other than 2xx.
    Failed(String),
}

impl ReplicaWake {
    /// Whether the replica is awake now, as far as its API says.
    #[must_use]
    pub fn is_awake(&self) -> bool {
        matches!(
            self,
            ReplicaWake::Awake | ReplicaWake::NoSleepApi | ReplicaWake::Woken
        )
    }
}

/// One call to one replica, under `timeout`; the status and answer, or why there is none.
async fn call(
    endpoint: &Endpoint,
    method: http::Method,
    target: &str,
    json: Option<&'static str>,
    timeout: Duration,
) -> Result<(http::StatusCode, Bytes), String> {
    let exchange = http1::exchange(http1::Call {
        host: &endpoint.host,
        port: endpoint.port,
        method: method.clone(),
        target,
        bearer: None,
        json: json.map(|text| Bytes::from_static(text.as_bytes())),
    });
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(why)) => Err(format!("{method} {target}: {why}")),
        Err(_) => Err(format!("{method} {target}: no answer within {timeout:?}")),
    }
}

/// One state-changing call that must be answered 2xx.
async fn post(
    endpoint: &Endpoint,
    target: &str,
    json: Option<&'static str>,
    timeout: Duration,
) -> Result<(), String> {
    let (status, body) = call(endpoint, http::Method::POST, target, json, timeout).await?;
    if status.is_success() {
        Ok(())
    } else {
        let shown = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        Err(format!("POST {target} answered {}: {shown}", status.as_u16()))
    }
}

/// Whether the replica is asleep: `None` when it has no sleep API (404).
async fn is_sleeping(endpoint: &Endpoint, timeout: Duration) -> Result<Option<bool>, String> {
    let (status, body) = call(endpoint, http::Method::GET, "/is_sleeping", None, timeout).await?;
    if status == http::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !status.is_success() {
        return Err(format!("GET /is_sleeping answered {}", status.as_u16()));
    }
    let json: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|error| format!("GET /is_sleeping answered what is not JSON: {error}"))?;
    json.get("is_sleeping")
        .and_then(serde_json::Value::as_bool)
        .map(Some)
        .ok_or_else(|| "GET /is_sleeping answered without a boolean `is_sleeping`".to_owned())
}

/// Wakes one replica that sleeps at up to `level`, and says what became of it.
pub async fn wake_replica(endpoint: &Endpoint, level: u8, timeouts: WakeTimeouts) -> ReplicaWake {
    match wake_replica_calls(endpoint, level, timeouts).await {
        Ok(outcome) => outcome,
        Err(why) => ReplicaWake::Failed(why),
    }
}

async fn wake_replica_calls(
    endpoint: &Endpoint,
    level: u8,
    timeouts: WakeTimeouts,
) -> Result<ReplicaWake, String> {
    match is_sleeping(endpoint, timeouts.query).await? {
        None => return Ok(ReplicaWake::NoSleepApi),
        Some(false) => return Ok(ReplicaWake::Awake),
        Some(true) => {}
    }
    if level >= 2 {
        // The KV cache comes back last, so `/is_sleeping` stays true until the weights are the
        // model's again: a failed reload is retried instead of serving garbage.
        post(endpoint, "/wake_up?tags=weights", None, timeouts.wake).await?;
        let reload = Some(r#"{"method":"reload_weights"}"#);
        post(endpoint, "/collective_rpc", reload, timeouts.wake).await?;
        post(endpoint, "/wake_up?tags=kv_cache", None, timeouts.wake).await?;
        post(endpoint, "/reset_prefix_cache", None, timeouts.wake).await?;
    } else {
        post(endpoint, "/wake_up", None, timeouts.wake).await?;
    }
    Ok(match is_sleeping(endpoint, timeouts.query).await? {
        Some(true) => ReplicaWake::StillAsleep,
        Some(false) => ReplicaWake::Woken,
        // It answered before; a 404 now is a replaced pod, which was never put to sleep.
        None => ReplicaWake::NoSleepApi,
    })
}

/// Wakes every replica at once; each outcome beside its endpoint.
pub async fn wake_replicas(
    endpoints: &[Endpoint],
    level: u8,
    timeouts: WakeTimeouts,
) -> Vec<(&Endpoint, ReplicaWake)> {
    join_all(
        endpoints
            .iter()
            .map(|endpoint| async move { (endpoint, wake_replica(endpoint, level, timeouts).await) }),
    )
    .await
}

/// What the outcomes mean for the Wake step of `pool`: done only when every replica is awake.
#[must_use]
pub fn judge(pool: &str, level: u8, outcomes: &[(&Endpoint, ReplicaWake)]) -> StepReport {
    let behind: Vec<String> = outcomes
        .iter()
        .filter_map(|(endpoint, outcome)| match outcome {
            ReplicaWake::StillAsleep => Some(format!("{endpoint} still reports itself asleep")),
            ReplicaWake::Failed(why) => Some(format!("{endpoint}: {why}")),
            _ => None,
        })
        .collect();
    if !behind.is_empty() {
        return StepReport::NotYet {
            reason: format!(
                "{} of {} replica(s) of {pool} are not awake yet: {}",
                behind.len(),
                outcomes.len(),
                behind.join("; ")
            ),
        };
    }
    let count = |wanted: &ReplicaWake| outcomes.iter().filter(|(_, o)| o == wanted).count();
    let (woken, awake, no_api) = (
        count(&ReplicaWake::Woken),
        count(&ReplicaWake::Awake),
        count(&ReplicaWake::NoSleepApi),
    );
    let mut note = format!(
        "woke {woken} of {} replica(s) of {pool} from sleep level {level}, each confirmed by \
         /is_sleeping; {awake} were awake already",
        outcomes.len()
    );
    if no_api > 0 {
        note.push_str(&format!(
            "; {no_api} have no sleep API (VLLM_SERVER_DEV_MODE is off), so they cannot have slept"
        ));
    }
    StepReport::Done {
        carried_by: CARRIED_BY,
        note: Some(note),
    }
}

/// Carries out the Wake step by calling the new primary's replicas; every other step, and
/// keeping the route, goes to `inner`.
pub struct WakeReplicas {
    replicas: Arc<dyn ReplicaEndpoints>,
    inner: Arc<dyn StepExecutor>,
    timeouts: WakeTimeouts,
}

impl fmt::Debug for WakeReplicas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WakeReplicas")
            .field("inner", &self.inner)
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

impl WakeReplicas {
    /// Wakes the replicas `replicas` resolves; other steps go to `inner`.
    #[must_use]
    pub fn new(replicas: Arc<dyn ReplicaEndpoints>, inner: Arc<dyn StepExecutor>) -> Self {
        WakeReplicas {
            replicas,
            inner,
            timeouts: WakeTimeouts::default(),
        }
    }

    /// The per-call timeouts.
    #[must_use]
    pub fn with_timeouts(mut self, timeouts: WakeTimeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    async fn wake(&self, request: StepRequest<'_>) -> StepReport {
        let pool = request.pool;
        let name = &pool.name;
        let Some(level) = warm_sleep_level(pool) else {
            return StepReport::Done {
                carried_by: CARRIED_BY,
                note: Some(format!(
                    "{name} has no warm tier: nothing sleeps, no replica was called"
                )),
            };
        };
        let namespace = request.policy.namespace().unwrap_or_default();
        let endpoints = match self.replicas.resolve(&namespace, pool).await {
            Ok(endpoints) => endpoints,
            Err(error) => {
                return StepReport::NotYet {
                    reason: format!("the replicas of {name} cannot be read: {error}"),
                };
            }
        };
        if endpoints.is_empty() {
            return StepReport::NotYet {
                reason: format!("{name} has no running replica to wake yet"),
            };
        }
        let outcomes = wake_replicas(&endpoints, level, self.timeouts).await;
        for (endpoint, outcome) in &outcomes {
            tracing::debug!(pool = %name, %endpoint, ?outcome, "wake");
        }
        judge(name, level, &outcomes)
    }
}

impl StepExecutor for WakeReplicas {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> BoxFuture<'a, StepReport> {
        match request.step {
            Step::Wake => Box::pin(self.wake(request)),
            _ => self.inner.carry_out(request),
        }
    }

    fn keep_route<'a>(&'a self, request: RouteSyncRequest<'a>) -> BoxFuture<'a, RouteSyncReport> {
        self.inner.keep_route(request)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn pool(standby: &str) -> PoolSpec {
        serde_yaml::from_str(&format!(
            "{{name: west, workload: {{kind: Deployment, name: chat-west}}, replicas: 3, standby: {standby}}}"
        ))
        .unwrap()
    }

    #[test]
    fn a_pool_sleeps_at_its_deepest_warm_level_and_without_a_warm_tier_not_at_all() {
        assert_eq!(warm_sleep_level(&pool("[]")), None);
        assert_eq!(
            warm_sleep_level(&pool(
                "[{tier: hot, replicas: 1}, {tier: pilotLight, replicas: 2}]"
            )),
            None
        );
        assert_eq!(
            warm_sleep_level(&pool("[{tier: hot, replicas: 1}, {tier: warm, replicas: 2}]")),
            Some(1)
        );
        assert_eq!(
            warm_sleep_level(&pool(
                "[{tier: warm, replicas: 1}, {tier: warm, replicas: 2, sleepLevel: 2}]"
            )),
            Some(2)
        );
    }

    #[test]
    fn the_step_waits_while_any_replica_is_not_confirmed_awake() {
        let (a, b) = (Endpoint::new("10.0.0.1", 8000), Endpoint::new("10.0.0.2", 8000));
        let report = judge(
            "west",
            1,
            &[(&a, ReplicaWake::Woken), (&b, ReplicaWake::StillAsleep)],
        );
        let StepReport::NotYet { reason } = report else {
            panic!("{report:?}")
        };
        assert!(
            reason.contains("10.0.0.2:8000 still reports itself asleep"),
            "{reason}"
        );
        let report = judge(
            "west",
            1,
            &[
                (&a, ReplicaWake::Woken),
                (&b, ReplicaWake::Failed("no answer".into())),
            ],
        );
        assert!(matches!(report, StepReport::NotYet { .. }), "{report:?}");
    }

    #[test]
    fn the_done_note_counts_the_replicas_woken() {
        let (a, b, c) = (
            Endpoint::new("10.0.0.1", 8000),
            Endpoint::new("10.0.0.2", 8000),
            Endpoint::new("10.0.0.3", 8000),
        );
        let report = judge(
            "west",
            2,
            &[
                (&a, ReplicaWake::Woken),
                (&b, ReplicaWake::Awake),
                (&c, ReplicaWake::NoSleepApi),
            ],
        );
        let StepReport::Done { carried_by, note } = report else {
            panic!("{report:?}")
        };
        assert_eq!(carried_by, CARRIED_BY);
        let note = note.unwrap();
        assert!(
            note.starts_with("woke 1 of 3 replica(s) of west from sleep level 2"),
            "{note}"
        );
        assert!(note.contains("1 were awake already"), "{note}");
        assert!(note.contains("1 have no sleep API"), "{note}");
    }
}
