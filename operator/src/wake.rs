//! The promotion's Wake step: the new primary's warm replicas are woken from vLLM sleep mode
//! through the prober's sleep-mode client ([`understudy_prober::sleep`], which the local game day
//! shares), and the step is done only when every one of them is confirmed awake.
//!
//! This module must never report the step done while a replica is not confirmed awake.

use std::time::Duration;

use tokio::time::Instant;
use understudy_prober::probe::Endpoint;

use crate::crd::PoolSpec;
use crate::ports::ReplicaEndpoints;
use crate::ports::StepReport;

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

/// One replica woken by the step, and how long its wake took: from the first call to its
/// confirmation by `/is_sleeping`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Woken {
    pub endpoint: Endpoint,
    pub took: Duration,
    /// When the wake was confirmed, so that the replica's first token can be timed from it.
    pub at: Instant,
}

/// What the Wake step did to a pool: the step's report, and each replica it woke.
#[derive(Clone, Debug)]
pub struct Waking {
    pub report: StepReport,
    pub woken: Vec<Woken>,
}

/// Carries out the Wake step of `pool` by calling its replicas: each one asleep is woken at the
/// pool's warm level (all at once) and timed, and the step is done only when every one is
/// confirmed awake.
pub async fn wake_pool(
    replicas: &dyn ReplicaEndpoints,
    namespace: &str,
    pool: &PoolSpec,
    timeouts: WakeTimeouts,
) -> Waking {
    let name = &pool.name;
    let waiting = |reason: String| Waking {
        report: StepReport::NotYet { reason },
        woken: Vec::new(),
    };
    let Some(level) = warm_sleep_level(pool) else {
        return Waking {
            report: StepReport::Done {
                carried_by: CARRIED_BY,
                note: Some(format!(
                    "{name} has no warm tier: nothing sleeps, no replica was called"
                )),
            },
            woken: Vec::new(),
        };
    };
    let endpoints = match replicas.resolve(namespace, pool).await {
        Ok(endpoints) => endpoints,
        Err(error) => return waiting(format!("the replicas of {name} cannot be read: {error}")),
    };
    if endpoints.is_empty() {
        return waiting(format!("{name} has no running replica to wake yet"));
    }
    let timed = wake_replicas(&endpoints, level, timeouts).await;
    for (endpoint, outcome, took) in &timed {
        tracing::debug!(pool = %name, %endpoint, ?outcome, ?took, "wake");
    }
    let outcomes: Vec<(&Endpoint, ReplicaWake)> = timed.iter().map(|(e, o, _)| (*e, o.clone())).collect();
    let now = Instant::now();
    let woken = timed
        .iter()
        .filter(|(_, outcome, _)| *outcome == ReplicaWake::Woken)
        .map(|(endpoint, _, took)| Woken {
            endpoint: (*endpoint).clone(),
            took: *took,
            at: now,
        })
        .collect();
    Waking {
        report: judge(name, level, &outcomes),
        woken,
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
