//! The promotion's Wake step: the new primary's warm replicas are woken from vLLM sleep mode
//! through the prober's sleep-mode client ([`understudy_prober::sleep`], which the local game day
//! shares), and the step is done once as many are confirmed awake as the pool's serving quorum
//! needs ([`understudy_core::drive::WakeOrder::needed`]); the others go on waking and join the
//! route when they pass. Past the promotion's deadline it is done with the replicas that are awake.
//!
//! This module must never count a replica awake that `/is_sleeping` did not confirm.

use std::time::Duration;

use tokio::time::Instant;
use understudy_core::drive::WakeOrder;
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
    DEFAULT_QUERY_TIMEOUT, DEFAULT_WAKE_TIMEOUT, PoolWake, ReplicaWake, WakeTimeouts, wake_enough,
    wake_replica, went_on_without,
};

/// What a wake means for the Wake step of `pool`: done once no more than `tolerated` replicas
/// are not awake, or whatever is awake once the promotion is `overdue`.
#[must_use]
pub fn judge(pool: &str, wake: &PoolWake<'_>, tolerated: usize, overdue: Option<Duration>) -> StepReport {
    let behind = wake.behind();
    let replicas = wake.finished.len() + wake.still_waking.len();
    if behind.len() > tolerated && overdue.is_none() {
        return StepReport::NotYet {
            reason: format!(
                "{} of {replicas} replica(s) of {pool} are not awake yet: {}",
                behind.len(),
                behind.join("; ")
            ),
        };
    }
    let count = |wanted: &ReplicaWake| wake.finished.iter().filter(|w| w.outcome == *wanted).count();
    let woken_at = |level: u8| {
        let at = wake
            .finished
            .iter()
            .filter(|w| w.outcome == ReplicaWake::Woken && w.level == level)
            .count();
        (at > 0).then(|| format!("{at} from sleep level {level}"))
    };
    let levels: Vec<String> = [1, 2].into_iter().filter_map(woken_at).collect();
    let (woken, awake, no_api) = (
        count(&ReplicaWake::Woken),
        count(&ReplicaWake::Awake),
        count(&ReplicaWake::NoSleepApi),
    );
    let mut note = format!("woke {woken} of {replicas} replica(s) of {pool}");
    if !levels.is_empty() {
        note.push_str(&format!(" ({})", levels.join(", ")));
    }
    note.push_str(&format!(
        ", each confirmed by /is_sleeping; {awake} were awake already"
    ));
    if no_api > 0 {
        note.push_str(&format!(
            "; {no_api} have no sleep API (VLLM_SERVER_DEV_MODE is off), so they cannot have slept"
        ));
    }
    if let Some(without) = went_on_without(&behind, tolerated, overdue) {
        note.push_str(&format!("; {without}"));
    }
    StepReport::Done {
        carried_by: CARRIED_BY,
        note: Some(note),
    }
}

/// One replica woken by the step, the level it slept at, and how long its wake took: from the
/// first call to its confirmation by `/is_sleeping`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Woken {
    pub endpoint: Endpoint,
    pub level: u8,
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
/// level its metrics say it sleeps at (else the deepest its warm groups name), all at once, and
/// timed, and the step is done once `needed` of its warm replicas are confirmed awake
/// ([`judge`]), or with those awake once the promotion is overdue: it waits for the wakes no
/// longer than the deadline.
pub async fn wake_pool(
    replicas: &dyn ReplicaEndpoints,
    namespace: &str,
    pool: &PoolSpec,
    timeouts: WakeTimeouts,
    order: &WakeOrder,
) -> Waking {
    let (needed, overdue) = (order.needed, order.overdue);
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
    let tolerated = usize::try_from(pool.standby_shape().warm.saturating_sub(needed)).unwrap_or(usize::MAX);
    // Not past the deadline, however long the wakes take; once past it, only as long as it takes
    // to hear which replicas are awake already.
    let patience = order.left.max(timeouts.query);
    let wake = wake_enough(&endpoints, level, timeouts, tolerated, patience).await;
    for w in &wake.finished {
        tracing::debug!(pool = %name, endpoint = %w.endpoint, outcome = ?w.outcome, took = ?w.took, level = w.level, "wake");
    }
    let now = Instant::now();
    let woken = wake
        .finished
        .iter()
        .filter(|w| w.outcome == ReplicaWake::Woken)
        .map(|w| Woken {
            endpoint: w.endpoint.clone(),
            level: w.level,
            took: w.took,
            at: now,
        })
        .collect();
    Waking {
        report: judge(name, &wake, tolerated, overdue),
        woken,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use understudy_prober::sleep::ReplicaWoke;

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

    fn finished<'a>(outcomes: &[(&'a Endpoint, ReplicaWake)], level: u8) -> PoolWake<'a> {
        PoolWake {
            finished: outcomes
                .iter()
                .map(|(endpoint, outcome)| ReplicaWoke {
                    endpoint,
                    outcome: outcome.clone(),
                    took: Duration::from_millis(5),
                    level,
                })
                .collect(),
            still_waking: Vec::new(),
        }
    }

    #[test]
    fn the_step_waits_while_more_replicas_are_not_awake_than_the_quorum_spares() {
        let (a, b) = (Endpoint::new("10.0.0.1", 8000), Endpoint::new("10.0.0.2", 8000));
        let wake = finished(&[(&a, ReplicaWake::Woken), (&b, ReplicaWake::StillAsleep)], 1);
        let report = judge("west", &wake, 0, None);
        let StepReport::NotYet { reason } = report else {
            panic!("{report:?}")
        };
        assert!(
            reason.contains("10.0.0.2:8000 still reports itself asleep"),
            "{reason}"
        );
        let wake = finished(
            &[
                (&a, ReplicaWake::Woken),
                (&b, ReplicaWake::Failed("no answer".into())),
            ],
            1,
        );
        let report = judge("west", &wake, 0, None);
        assert!(matches!(report, StepReport::NotYet { .. }), "{report:?}");
        // One spare: the quorum needs only one of the two.
        let report = judge("west", &wake, 1, None);
        let StepReport::Done { note: Some(note), .. } = report else {
            panic!("{report:?}")
        };
        assert!(
            note.ends_with(
                "enough are awake for the serving quorum; it goes on without 1 (http://10.0.0.2:8000: no \
                 answer), which join the route when they pass"
            ),
            "{note}"
        );
    }

    #[test]
    fn past_the_deadline_the_step_is_done_with_the_replicas_that_are_awake() {
        let (a, b, c) = (
            Endpoint::new("10.0.0.1", 8000),
            Endpoint::new("10.0.0.2", 8000),
            Endpoint::new("10.0.0.3", 8000),
        );
        let mut wake = finished(&[(&a, ReplicaWake::Woken), (&b, ReplicaWake::StillAsleep)], 2);
        wake.still_waking.push(&c);
        let report = judge("west", &wake, 0, Some(Duration::from_secs(255)));
        let StepReport::Done { note: Some(note), .. } = report else {
            panic!("{report:?}")
        };
        assert!(
            note.starts_with("woke 1 of 3 replica(s) of west (1 from sleep level 2)"),
            "{note}"
        );
        assert!(
            note.contains(
                "past the promotion's deadline of 255s, it goes on without 2 (http://10.0.0.2:8000 \
                 still reports itself asleep; http://10.0.0.3:8000 is still waking)"
            ),
            "{note}"
        );
    }

    #[test]
    fn the_done_note_counts_the_replicas_woken() {
        let (a, b, c) = (
            Endpoint::new("10.0.0.1", 8000),
            Endpoint::new("10.0.0.2", 8000),
            Endpoint::new("10.0.0.3", 8000),
        );
        let wake = finished(
            &[
                (&a, ReplicaWake::Woken),
                (&b, ReplicaWake::Awake),
                (&c, ReplicaWake::NoSleepApi),
            ],
            2,
        );
        let report = judge("west", &wake, 0, None);
        let StepReport::Done { carried_by, note } = report else {
            panic!("{report:?}")
        };
        assert_eq!(carried_by, CARRIED_BY);
        let note = note.unwrap();
        assert!(
            note.starts_with("woke 1 of 3 replica(s) of west (1 from sleep level 2)"),
            "{note}"
        );
        assert!(note.contains("1 were awake already"), "{note}");
        assert!(note.contains("1 have no sleep API"), "{note}");
        assert!(!note.contains("goes on without"), "{note}");
    }
}
