//! The operator's observations come from real generating probes: `ProbingObservations` probes two
//! in-process vLLM emulators on loopback (found through the fixed-list resolver, where the
//! operator would list the workloads' pods), and its checks, fed to the failover state machine
//! round by round with a tick after each as the reconciler does, promote the standby once the
//! primary has failed for as many rounds as the policy's trigger says.
//!
//! Rounds are driven one at a time with `probe_now`, with no jitter; nothing here asserts a time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod prober_support;

use std::sync::Arc;
use std::time::Duration;

use prober_support::Emulator;
use understudy_core::Pool;
use understudy_core::failover::{CheckResult, FailoverConfig, FailoverState, Input, Phase};
use understudy_operator::controller::{Observation, ObservationSource};
use understudy_operator::crd::FailoverPolicy;
use understudy_operator::observe::{FixedReplicas, ProbingObservations};
use understudy_operator::policy;

/// A dead engine answers 500 instead of taking the process down, so the fault is a hard failure
/// the same way every time.
const KEEP_ALIVE: &[(&str, &str)] = &[("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "1")];

/// East is the home primary, west the hot standby, one replica each; the trigger spelled out is
/// the default one. No `expect.value`: the golden answer is recorded from the primary.
fn failover_policy() -> FailoverPolicy {
    let spec = serde_yaml::from_str(
        "
pools:
  - {name: east, workload: {kind: Deployment, name: vllm-east}, replicas: 1}
  - {name: west, workload: {kind: Deployment, name: vllm-west}, replicas: 1}
recoveryObjective: 5m
probe: {interval: 10s, timeout: 5s, budgets: {firstToken: 2s, total: 4s}}
trigger: {suspectAfter: 2, promoteAfter: 4, hardFailure: {promoteAfter: 2}, standbyReadyAfter: 2}
",
    )
    .unwrap();
    let mut policy = FailoverPolicy::new("llama", spec);
    policy.metadata.namespace = Some("serving".to_owned());
    policy
}

fn check(pool: Pool, result: CheckResult) -> Observation {
    Observation::Check { pool, result }
}

/// The operator's probing side for one policy over two emulators, and the state machine its
/// reconciler would run.
struct Operator {
    observations: ProbingObservations,
    machine: FailoverState,
    config: FailoverConfig,
    interval: Duration,
    now: Duration,
}

impl Operator {
    fn new(east: &Emulator, west: &Emulator) -> Operator {
        let replicas = FixedReplicas::default()
            .with_pool("east", vec![east.endpoint.clone()])
            .with_pool("west", vec![west.endpoint.clone()]);
        let observations = ProbingObservations::new(Arc::new(replicas)).with_max_jitter(Duration::ZERO);
        let policy = failover_policy();
        let validated = policy::validate(&policy.spec).unwrap();
        observations.track(&policy);
        Operator {
            observations,
            machine: FailoverState::new(),
            config: validated.failover,
            interval: validated.probe.interval,
            now: Duration::from_secs(1_000),
        }
    }

    /// One probe round, then what the next reconcile does with it: drain, feed, tick. Returns
    /// the round's checks.
    async fn round(&mut self) -> Vec<Observation> {
        // The policy is found by tracking, as the reconciler's `track` leaves it.
        let key = self.observations.tracked().pop().expect("the policy is tracked");
        assert!(self.observations.probe_now(&key).await);
        let checks = self.observations.drain(&key);
        for observation in &checks {
            self.feed(&Input::from(*observation));
        }
        self.feed(&Input::Tick);
        self.now += self.interval;
        checks
    }

    fn feed(&mut self, input: &Input) {
        let (next, _) = self.machine.step(&self.config, self.now, input);
        self.machine = next;
    }

    /// The pool a promotion under way is promoting, if one is.
    fn promoting(&self) -> Option<Pool> {
        match &self.machine.phase {
            Phase::Promoting(promotion) => Some(promotion.to),
            _ => None,
        }
    }
}

#[tokio::test]
async fn both_healthy_pools_pass_their_probes_round_after_round() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    let mut operator = Operator::new(&east, &west);
    for _ in 0..3 {
        assert_eq!(
            operator.round().await,
            [
                check(Pool::A, CheckResult::Pass),
                check(Pool::B, CheckResult::Pass)
            ]
        );
    }
    assert_eq!(operator.promoting(), None);
    assert_eq!(operator.machine.health[Pool::B.index()].passes, 3);
}

#[tokio::test]
async fn a_replicas_first_answer_is_kept_from_the_first_round_it_passed() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    west.inject("wrong-output");
    let mut operator = Operator::new(&east, &west);
    let before = k8s_openapi::jiff::Timestamp::now();
    operator.round().await;
    let first = operator.observations.first_answered(&east.endpoint.authority());
    assert!(first.is_some_and(|at| at >= before), "{first:?}");
    // A replica that answered wrong has not answered yet.
    assert_eq!(
        operator.observations.first_answered(&west.endpoint.authority()),
        None
    );
    operator.round().await;
    assert_eq!(
        operator.observations.first_answered(&east.endpoint.authority()),
        first,
        "the first answer, not the latest"
    );
}

#[tokio::test]
async fn a_dead_engine_on_the_primary_fails_hard_and_promotes_the_standby_after_hard_failure_promote_after_rounds()
 {
    let east = Emulator::ready(&[], KEEP_ALIVE);
    let west = Emulator::ready(&[], &[]);
    let mut operator = Operator::new(&east, &west);
    // Two healthy rounds prove the standby (standbyReadyAfter: 2).
    for _ in 0..2 {
        operator.round().await;
    }
    east.inject("engine-dead");
    let failing = [
        check(Pool::A, CheckResult::HardFail),
        check(Pool::B, CheckResult::Pass),
    ];
    assert_eq!(operator.round().await, failing);
    assert_eq!(operator.promoting(), None, "one hard failure is not enough");
    assert_eq!(operator.round().await, failing);
    assert_eq!(
        operator.promoting(),
        Some(Pool::B),
        "hardFailure.promoteAfter is 2"
    );
}

#[tokio::test]
async fn a_primary_that_stops_giving_its_own_golden_answer_fails_softly_and_the_standby_is_promoted_after_promote_after_rounds()
 {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    let mut operator = Operator::new(&east, &west);
    // The first round records east's answer as the golden prefix.
    for _ in 0..2 {
        operator.round().await;
    }
    // Still an answer, so only the recorded golden answer can tell it is wrong.
    east.inject("wrong-output");
    let failing = [
        check(Pool::A, CheckResult::SoftFail),
        check(Pool::B, CheckResult::Pass),
    ];
    for round in 1..4 {
        assert_eq!(operator.round().await, failing, "failing round {round}");
        assert_eq!(operator.promoting(), None, "after {round} soft failures");
    }
    assert_eq!(operator.round().await, failing);
    assert_eq!(operator.promoting(), Some(Pool::B), "promoteAfter is 4");
}

#[tokio::test]
async fn a_standby_that_answers_otherwise_than_the_primary_did_first_is_never_proven() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    west.inject("wrong-output");
    let mut operator = Operator::new(&east, &west);
    // From the very first round: the standby is judged by the answer the primary just gave.
    for _ in 0..3 {
        assert_eq!(
            operator.round().await,
            [
                check(Pool::A, CheckResult::Pass),
                check(Pool::B, CheckResult::SoftFail)
            ]
        );
    }
    east.inject("engine-dead");
    for _ in 0..3 {
        operator.round().await;
    }
    assert_eq!(
        operator.promoting(),
        None,
        "an unproven standby is not promoted, however dead the primary"
    );
}
