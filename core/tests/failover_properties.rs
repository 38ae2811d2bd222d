//! Invariants of the failover state machine over random observation sequences, executed by a
//! random executor that completes, delays, fails and repeats steps, and a rival that sometimes
//! moves the lease behind our back.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;
use understudy_core::failover::{
    Action, CheckResult, Command, ControlPlane, Event, FailbackPolicy, FailoverConfig, FailoverState, Input,
    PassiveSignal, Phase, Step, StepFailure, TransitionKind,
};
use understudy_core::{Epoch, Pool};

#[derive(Clone, Debug)]
enum Op {
    Check(Pool, CheckResult),
    Passive(Pool, PassiveSignal),
    Parity(bool),
    LoadProof(Pool, bool),
    Command(Command),
    ControlPlane(ControlPlane),
    /// Time passes.
    Wait(u64),
    /// A rival writes the lease, as a second operator or a person would.
    RivalWrite(Pool),
    /// The executor re-reads the lease and reports it.
    ReadLease,
    /// A duplicate or late report about some step.
    StaleReport(Step, u64),
}

/// What the executor does with the next step action it sees.
#[derive(Clone, Copy, Debug)]
enum Executor {
    Complete,
    Hold,
    Retry,
}

fn pool() -> impl Strategy<Value = Pool> {
    prop_oneof![Just(Pool::A), Just(Pool::B)]
}

fn op() -> impl Strategy<Value = Op> {
    let result = prop_oneof![
        4 => Just(CheckResult::Pass),
        2 => Just(CheckResult::SoftFail),
        2 => Just(CheckResult::HardFail),
        1 => Just(CheckResult::Asleep),
    ];
    let step = prop::sample::select(Step::ALL.to_vec());
    prop_oneof![
        20 => (pool(), result).prop_map(|(p, r)| Op::Check(p, r)),
        2 => (pool(), prop_oneof![Just(PassiveSignal::AllRefused), Just(PassiveSignal::Timeouts)])
            .prop_map(|(p, s)| Op::Passive(p, s)),
        1 => any::<bool>().prop_map(Op::Parity),
        1 => (pool(), any::<bool>()).prop_map(|(p, proven)| Op::LoadProof(p, proven)),
        1 => prop_oneof![Just(Command::Failover), Just(Command::Failback), Just(Command::ForceFailover)]
            .prop_map(Op::Command),
        1 => prop_oneof![Just(ControlPlane::Reachable), Just(ControlPlane::Unreachable)].prop_map(Op::ControlPlane),
        6 => (0u64..120).prop_map(Op::Wait),
        1 => pool().prop_map(Op::RivalWrite),
        2 => Just(Op::ReadLease),
        1 => (step, 0u64..6).prop_map(|(s, e)| Op::StaleReport(s, e)),
    ]
}

fn executor() -> impl Strategy<Value = Executor> {
    prop_oneof![6 => Just(Executor::Complete), 2 => Just(Executor::Hold), 1 => Just(Executor::Retry)]
}

fn config() -> impl Strategy<Value = FailoverConfig> {
    (
        1u32..4,
        0u32..4,
        1u32..4,
        1u32..3,
        0u64..200,
        prop::option::of(1u32..5),
        any::<bool>(),
    )
        .prop_map(
            |(suspect, extra, hard, ready, dwell, failback, paused)| FailoverConfig {
                suspect_after: suspect,
                promote_after: suspect + extra,
                hard_promote_after: hard.min(suspect + extra),
                standby_ready_after: ready,
                min_dwell: Duration::from_secs(dwell),
                failback: failback.map_or(FailbackPolicy::Manual, |healthy_checks| {
                    FailbackPolicy::Automatic { healthy_checks }
                }),
                paused,
            },
        )
}

struct World {
    config: FailoverConfig,
    state: FailoverState,
    now: Duration,
    lease: (Pool, Epoch),
    executors: Vec<Executor>,
    next_executor: usize,
    /// Which pool was routable at each epoch, over the whole run.
    routed: BTreeMap<Epoch, Pool>,
    highest_routed: Epoch,
}

impl World {
    fn executor(&mut self) -> Executor {
        let e = self.executors[self.next_executor % self.executors.len()];
        self.next_executor += 1;
        e
    }

    fn feed(&mut self, input: Input) -> Result<(), TestCaseError> {
        let mut inputs = vec![input];
        let mut budget = 64;
        while let Some(input) = inputs.pop() {
            budget -= 1;
            prop_assert!(budget > 0, "the executor loop does not settle");
            let before = self.state.clone();
            let (next, actions) = self.state.step(&self.config, self.now, &input);
            self.check_step(&before, &next, &actions)?;
            self.state = next;
            // A step that asked to be retried is retried on the next input, as a reconcile
            // loop would after its backoff, not in a tight loop.
            let retrying = matches!(
                input,
                Input::StepFailed {
                    reason: StepFailure::Retry,
                    ..
                }
            );
            for action in actions {
                if retrying && !matches!(action, Action::Emit(_)) {
                    continue;
                }
                if let Some(report) = self.execute(&action)? {
                    inputs.push(report);
                }
            }
        }
        Ok(())
    }

    fn check_step(
        &mut self,
        before: &FailoverState,
        next: &FailoverState,
        actions: &[Action],
    ) -> Result<(), TestCaseError> {
        prop_assert!(
            next.epoch >= before.epoch,
            "epoch went down: {:?} -> {:?}",
            before.epoch,
            next.epoch
        );
        if let Some((pool, epoch)) = next.routable() {
            let owner = *self.routed.entry(epoch).or_insert(pool);
            prop_assert_eq!(owner, pool, "two pools routable at epoch {}", epoch);
            prop_assert!(epoch >= self.highest_routed, "routable epoch went down");
            self.highest_routed = epoch;
        }
        for action in actions {
            let Action::Emit(Event::PromotionStarted { kind, to, .. }) = action else {
                continue;
            };
            if let Some(end) = before.last_transition_end {
                prop_assert!(
                    self.now >= end + self.config.min_dwell,
                    "promotion inside the dwell window"
                );
            }
            prop_assert!(before.lease_known, "promoted without knowing the lease");
            prop_assert_eq!(
                before.control_plane,
                ControlPlane::Reachable,
                "promoted with the control plane down"
            );
            // Only a person's explicit force skips the standby's own proof.
            if *kind != TransitionKind::Forced {
                let standby = next.health[to.index()];
                prop_assert!(
                    standby.failures == 0 && standby.passes >= self.config.standby_ready_after,
                    "promoted a standby that is not eligible: {standby:?}"
                );
                prop_assert!(next.parity_holds, "promoted with parity broken");
                prop_assert!(
                    !next.load_proof_failed[to.index()],
                    "promoted a standby that failed its load proof"
                );
            }
            if *kind == TransitionKind::Failover {
                prop_assert!(!self.config.paused, "automatic failover while paused");
            }
        }
        Ok(())
    }

    fn execute(&mut self, action: &Action) -> Result<Option<Input>, TestCaseError> {
        let (step, epoch) = match *action {
            Action::Emit(_) => return Ok(None),
            Action::CompareAndSetLease {
                expected,
                holder,
                epoch,
            } => {
                prop_assert_eq!(
                    epoch,
                    expected.next(),
                    "a compare-and-set raises the epoch by exactly one"
                );
                if self.lease == (holder, epoch) {
                    return Ok(Some(Input::StepDone {
                        epoch,
                        step: Step::AcquireLease,
                    }));
                }
                if self.lease.1 != expected {
                    let reason = StepFailure::LostRace;
                    return Ok(Some(Input::StepFailed {
                        epoch,
                        step: Step::AcquireLease,
                        reason,
                    }));
                }
                match self.executor() {
                    Executor::Hold => return Ok(None),
                    Executor::Retry => {
                        return Ok(Some(Input::StepFailed {
                            epoch,
                            step: Step::AcquireLease,
                            reason: StepFailure::Retry,
                        }));
                    }
                    Executor::Complete => {
                        self.lease = (holder, epoch);
                        return Ok(Some(Input::StepDone {
                            epoch,
                            step: Step::AcquireLease,
                        }));
                    }
                }
            }
            Action::Fence { epoch, .. } => (Step::FenceOld, epoch),
            Action::Wake { epoch, .. } => (Step::Wake, epoch),
            Action::Scale { epoch, .. } => (Step::Scale, epoch),
            Action::AwaitServing { epoch, .. } => (Step::AwaitServing, epoch),
            Action::Route { epoch, .. } => (Step::Route, epoch),
            Action::OpenAdmission { epoch, .. } => (Step::OpenAdmission, epoch),
        };
        Ok(match self.executor() {
            Executor::Complete => Some(Input::StepDone { epoch, step }),
            Executor::Hold => None,
            Executor::Retry => Some(Input::StepFailed {
                epoch,
                step,
                reason: StepFailure::Retry,
            }),
        })
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn invariants_hold_over_random_observation_sequences(
        config in config(),
        ops in prop::collection::vec(op(), 1..250),
        executors in prop::collection::vec(executor(), 1..8),
    ) {
        let mut world = World {
            config,
            state: FailoverState::new(),
            now: Duration::ZERO,
            lease: (Pool::A, Epoch(0)),
            executors,
            next_executor: 0,
            routed: BTreeMap::new(),
            highest_routed: Epoch(0),
        };
        let mut lease_epochs = vec![world.lease.1];
        for op in ops {
            let input = match op {
                Op::Check(pool, result) => Input::Check { pool, result },
                Op::Passive(pool, signal) => Input::Passive { pool, signal },
                Op::Parity(holds) => Input::Parity { holds },
                Op::LoadProof(pool, proven) => Input::LoadProof { pool, proven },
                Op::Command(command) => Input::Command(command),
                Op::ControlPlane(reach) => Input::ControlPlane(reach),
                Op::Wait(secs) => {
                    world.now += Duration::from_secs(secs);
                    Input::Tick
                }
                Op::RivalWrite(pool) => {
                    world.lease = (pool, world.lease.1.next());
                    continue;
                }
                Op::ReadLease => Input::LeaseObserved { holder: world.lease.0, epoch: world.lease.1 },
                Op::StaleReport(step, epoch) => {
                    // A report for the step under way at its own epoch is not stale: only the
                    // executor that did the step may send it.
                    let current = matches!(&world.state.phase, Phase::Promoting(p) if p.step == step && p.epoch == Epoch(epoch));
                    if current {
                        continue;
                    }
                    Input::StepDone { epoch: Epoch(epoch), step }
                }
            };
            world.feed(input)?;
            prop_assert!(world.lease.1 >= *lease_epochs.last().unwrap_or(&Epoch(0)), "lease epoch went down");
            lease_epochs.push(world.lease.1);
            prop_assert!(world.state.epoch <= world.lease.1, "the machine claims an epoch the lease never had");
        }
    }
}
