//! The promotion's Wake step: the new primary's warm replicas are woken from vLLM sleep mode
//! through the prober's sleep-mode client ([`understudy_prober::sleep`], which the local game day
//! shares), and the step is done only when every one of them is confirmed awake.
//!
//! This module must never report the step done while a replica is not confirmed awake.

use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use kube::ResourceExt;
use understudy_core::failover::Step;
use understudy_prober::probe::Endpoint;

use crate::controller::{RouteSyncReport, RouteSyncRequest, StepExecutor, StepReport, StepRequest};
use crate::crd::PoolSpec;
use crate::observe::ReplicaEndpoints;

/// Who carries the Wake step: this operator, calling the replicas.
pub const CARRIED_BY: &str = "operator";

/// How a pool's warm replicas sleep, from its standby tiers: `None` when it has no warm tier,
/// and level 2 when any warm group sleeps at level 2, since that wake also serves level 1.
#[must_use]
pub fn warm_sleep_level(pool: &PoolSpec) -> Option<u8> {
    let shape = pool.standby_shape();
    (shape.warm > 0).then_some(shape.sleep_level)
}

pub use understudy_prober::sleep::{
    DEFAULT_QUERY_TIMEOUT, DEFAULT_WAKE_TIMEOUT, ReplicaWake, WakeTimeouts, wake_replica, wake_replicas,
};

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
