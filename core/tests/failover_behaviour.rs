//! The failover state machine's behaviour, one rule per test, driven the way an executor
//! drives it: inputs in, actions executed against an in-memory lease, step reports fed back.

use std::time::Duration;

use understudy_core::failover::{
    Action, Blocked, CheckResult, Command, ControlPlane, Event, FailbackPolicy, FailoverConfig,
    FailoverState, Input, PassiveSignal, Phase, Step, StepFailure, TransitionKind,
};
use understudy_core::{Epoch, Pool};

const INTERVAL: Duration = Duration::from_secs(10);

fn config() -> FailoverConfig {
    FailoverConfig {
        suspect_after: 2,
        promote_after: 4,
        hard_promote_after: 2,
        standby_ready_after: 2,
        min_dwell: Duration::from_secs(300),
        failback: FailbackPolicy::Manual,
        paused: false,
    }
}

/// An executor that completes every step at once, against a lease only it writes.
struct Harness {
    config: FailoverConfig,
    state: FailoverState,
    now: Duration,
    lease: (Pool, Epoch),
    events: Vec<Event>,
    /// Steps the executor holds back instead of completing.
    hold: Option<Step>,
    executed: Vec<Action>,
}

impl Harness {
    fn new(config: FailoverConfig) -> Harness {
        Harness {
            config,
            state: FailoverState::new(),
            now: Duration::ZERO,
            lease: (Pool::A, Epoch(0)),
            events: Vec::new(),
            hold: None,
            executed: Vec::new(),
        }
    }

    fn feed(&mut self, input: Input) {
        let mut inputs = vec![input];
        while let Some(input) = inputs.pop() {
            let (next, actions) = self.state.step(&self.config, self.now, &input);
            self.state = next;
            for action in actions {
                if let Some(report) = self.execute(action) {
                    inputs.push(report);
                }
            }
        }
    }

    fn execute(&mut self, action: Action) -> Option<Input> {
        let report = match &action {
            Action::Emit(event) => {
                self.events.push(event.clone());
                return None;
            }
            Action::CompareAndSetLease {
                expected,
                holder,
                epoch,
            } => {
                if self.lease == (*holder, *epoch) {
                    (Step::AcquireLease, *epoch, None)
                } else if self.lease.1 == *expected {
                    self.lease = (*holder, *epoch);
                    (Step::AcquireLease, *epoch, None)
                } else {
                    (Step::AcquireLease, *epoch, Some(StepFailure::LostRace))
                }
            }
            Action::Fence { epoch, .. } => (Step::FenceOld, *epoch, None),
            Action::Wake { epoch, .. } => (Step::Wake, *epoch, None),
            Action::Scale { epoch, .. } => (Step::Scale, *epoch, None),
            Action::AwaitServing { epoch, .. } => (Step::AwaitServing, *epoch, None),
            Action::Route { epoch, .. } => (Step::Route, *epoch, None),
            Action::OpenAdmission { epoch, .. } => (Step::OpenAdmission, *epoch, None),
        };
        self.executed.push(action);
        let (step, epoch, failure) = report;
        if self.hold == Some(step) {
            return None;
        }
        Some(match failure {
            None => Input::StepDone { epoch, step },
            Some(reason) => Input::StepFailed { epoch, step, reason },
        })
    }

    /// One check round of both pools, the standby's first.
    fn round(&mut self, primary: CheckResult, standby: CheckResult) {
        self.now += INTERVAL;
        let p = self.state.primary;
        self.feed(Input::Check {
            pool: p.other(),
            result: standby,
        });
        self.feed(Input::Check {
            pool: p,
            result: primary,
        });
        self.feed(Input::Tick);
    }

    fn rounds(&mut self, n: usize, primary: CheckResult, standby: CheckResult) {
        for _ in 0..n {
            self.round(primary, standby);
        }
    }

    fn started(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, Event::PromotionStarted { .. }))
            .count()
    }
}

use CheckResult::{Asleep, HardFail, Pass, SoftFail};

#[test]
fn soft_failures_make_the_primary_suspect_then_promote_after_the_threshold() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.rounds(2, SoftFail, Pass);
    assert_eq!(h.state.phase, Phase::Suspect);
    assert_eq!(h.started(), 0);
    h.round(SoftFail, Pass);
    assert_eq!(h.started(), 0, "three soft failures are below promote_after = 4");
    h.round(SoftFail, Pass);
    assert_eq!(h.started(), 1);
    assert_eq!(
        (h.state.primary, h.state.epoch, &h.state.phase),
        (Pool::B, Epoch(1), &Phase::Serving)
    );
    assert_eq!(h.lease, (Pool::B, Epoch(1)));
}

#[test]
fn a_passing_check_resets_suspicion() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.rounds(3, SoftFail, Pass);
    h.round(Pass, Pass);
    assert_eq!(h.state.phase, Phase::Serving);
    assert!(h.events.contains(&Event::PrimaryRecovered { pool: Pool::A }));
    h.rounds(3, SoftFail, Pass);
    assert_eq!(h.started(), 0, "the count starts again after a pass");
}

#[test]
fn hard_failures_promote_sooner_than_soft_ones() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.rounds(2, HardFail, Pass);
    assert_eq!(h.started(), 1, "two refused connections are enough");
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.rounds(1, HardFail, Pass);
    h.rounds(1, SoftFail, Pass);
    h.rounds(1, HardFail, Pass);
    assert_eq!(
        h.started(),
        0,
        "hard failures must be consecutive to count as hard"
    );
}

#[test]
fn a_standby_failing_its_own_checks_is_never_promoted() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.rounds(6, HardFail, SoftFail);
    assert_eq!(h.started(), 0);
    assert_eq!(h.state.phase, Phase::Stranded);
    assert!(h.events.contains(&Event::PromotionBlocked {
        reason: Blocked::StandbyNotEligible
    }));
    // The standby recovers: it must pass standby_ready_after checks before it is promoted.
    h.round(HardFail, Pass);
    assert_eq!(h.started(), 0);
    h.round(HardFail, Pass);
    assert_eq!(h.started(), 1);
}

#[test]
fn both_pools_unhealthy_never_ping_pong() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.rounds(2, HardFail, Pass);
    assert_eq!(h.state.primary, Pool::B);
    // Now both fail, for a long time, past any dwell.
    h.rounds(100, HardFail, HardFail);
    assert_eq!(h.started(), 1, "no promotion back to a failing pool");
    assert_eq!(h.state.primary, Pool::B);
}

#[test]
fn no_promotion_inside_the_dwell_window() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.rounds(2, HardFail, Pass);
    let finished = h.now;
    h.rounds(2, Pass, Pass); // A recovers as the standby
    h.rounds(2, HardFail, Pass); // B fails hard; A is eligible but the dwell is open
    assert_eq!(h.started(), 1);
    assert!(h.events.contains(&Event::PromotionBlocked {
        reason: Blocked::Dwell
    }));
    while h.now < finished + config().min_dwell - INTERVAL {
        h.round(HardFail, Pass);
        assert_eq!(h.started(), 1, "at {:?}", h.now - finished);
    }
    h.round(HardFail, Pass);
    assert_eq!(h.started(), 2, "promoted as soon as the dwell closed");
}

#[test]
fn broken_parity_blocks_promotion_and_its_repair_releases_it() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.feed(Input::Parity { holds: false });
    h.rounds(3, HardFail, Pass);
    assert_eq!(h.started(), 0);
    assert!(h.events.contains(&Event::PromotionBlocked {
        reason: Blocked::ParityBroken
    }));
    h.feed(Input::Parity { holds: true });
    assert_eq!(h.started(), 0, "only a tick decides");
    h.feed(Input::Tick);
    assert_eq!(h.started(), 1);
}

#[test]
fn a_standby_that_failed_its_load_proof_is_not_promoted_until_a_proof_passes() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    // The primary's failed proof is its own: it says nothing of the standby.
    h.feed(Input::LoadProof {
        pool: Pool::A,
        proven: false,
    });
    h.feed(Input::LoadProof {
        pool: Pool::B,
        proven: false,
    });
    h.rounds(3, HardFail, Pass);
    assert_eq!(h.started(), 0);
    assert!(h.events.contains(&Event::PromotionBlocked {
        reason: Blocked::LoadProofFailed
    }));
    h.feed(Input::Command(Command::Failover));
    assert_eq!(h.started(), 0, "a failover command is refused as well");
    h.feed(Input::LoadProof {
        pool: Pool::B,
        proven: true,
    });
    h.feed(Input::Tick);
    assert_eq!(h.started(), 1);
}

#[test]
fn paused_policy_does_not_fail_over_automatically_but_obeys_a_command() {
    let mut h = Harness::new(FailoverConfig {
        paused: true,
        ..config()
    });
    h.rounds(2, Pass, Pass);
    h.rounds(5, HardFail, Pass);
    assert_eq!(h.started(), 0);
    assert!(h.events.contains(&Event::PromotionBlocked {
        reason: Blocked::Paused
    }));
    h.feed(Input::Command(Command::Failover));
    assert_eq!(h.started(), 1);
    assert_eq!(h.state.primary, Pool::B);
}

#[test]
fn manual_failback_happens_only_on_command() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.rounds(2, HardFail, Pass);
    h.rounds(200, Pass, Pass);
    assert_eq!(
        h.state.primary,
        Pool::B,
        "manual failback never returns on its own"
    );
    h.feed(Input::Command(Command::Failback));
    assert_eq!(h.state.primary, Pool::A);
    assert_eq!(h.state.epoch, Epoch(2));
    assert!(h.events.iter().any(|e| matches!(
        e,
        Event::PromotionFinished {
            kind: TransitionKind::Failback,
            to: Pool::A,
            epoch: Epoch(2)
        }
    )));
    h.feed(Input::Command(Command::Failback));
    assert!(h.events.contains(&Event::CommandRefused {
        command: Command::Failback,
        reason: Blocked::AlreadyHome
    }));
}

#[test]
fn automatic_failback_waits_for_sustained_health_and_the_dwell() {
    let mut h = Harness::new(FailoverConfig {
        failback: FailbackPolicy::Automatic { healthy_checks: 3 },
        min_dwell: Duration::ZERO,
        ..config()
    });
    h.rounds(2, Pass, Pass);
    h.rounds(2, HardFail, Pass);
    assert_eq!(h.state.primary, Pool::B);
    h.rounds(2, Pass, Pass);
    h.round(Pass, SoftFail); // A stumbles: the count starts again
    h.rounds(2, Pass, Pass);
    assert_eq!(h.state.primary, Pool::B);
    h.round(Pass, Pass);
    assert_eq!(h.state.primary, Pool::A, "three consecutive healthy checks");
}

#[test]
fn an_asleep_standby_is_eligible_but_an_asleep_primary_is_failing() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Asleep);
    h.rounds(2, Asleep, Asleep);
    assert_eq!(h.started(), 1);
    let wake = h.executed.iter().any(|a| {
        matches!(
            a,
            Action::Wake {
                pool: Pool::B,
                epoch: Epoch(1)
            }
        )
    });
    assert!(wake, "the promotion wakes the new primary");
}

#[test]
fn passive_refusals_count_as_hard_failures_and_timeouts_only_raise_suspicion() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    for _ in 0..10 {
        h.feed(Input::Passive {
            pool: Pool::A,
            signal: PassiveSignal::Timeouts,
        });
        h.feed(Input::Tick);
    }
    assert_eq!(h.state.phase, Phase::Suspect);
    assert_eq!(h.started(), 0, "timeouts alone never promote");
    h.round(Pass, Pass);
    assert_eq!(
        h.state.phase,
        Phase::Serving,
        "a passing check clears the suspicion"
    );
    h.feed(Input::Passive {
        pool: Pool::A,
        signal: PassiveSignal::AllRefused,
    });
    h.feed(Input::Tick);
    assert_eq!(
        h.started(),
        0,
        "one signal short of hardFailure.promoteAfter leaves the primary in place"
    );
    h.feed(Input::Passive {
        pool: Pool::A,
        signal: PassiveSignal::AllRefused,
    });
    assert_eq!(h.started(), 0, "only a tick decides");
    h.feed(Input::Tick);
    assert_eq!(h.started(), 1);
}

#[test]
fn steps_run_in_order_and_the_timeline_is_recorded() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.hold = Some(Step::AwaitServing);
    h.rounds(2, HardFail, Pass);
    let Phase::Promoting(p) = &h.state.phase else {
        panic!("expected a promotion, got {:?}", h.state.phase)
    };
    let done: Vec<Step> = p.done.iter().map(|(s, _)| *s).collect();
    assert_eq!(
        done,
        [Step::AcquireLease, Step::FenceOld, Step::Wake, Step::Scale]
    );
    assert_eq!(p.step, Step::AwaitServing);
    assert_eq!(
        h.state.routable(),
        None,
        "old primary fenced, new one not yet serving"
    );
    h.hold = None;
    h.feed(Input::Tick);
    assert_eq!(h.state.routable(), Some((Pool::B, Epoch(1))));
}

#[test]
fn a_promotion_remembers_when_the_run_of_failures_behind_it_began() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    // A failure at 30 s that a pass at 40 s forgives does not start the run; the one at 50 s does.
    h.round(SoftFail, Pass);
    h.round(Pass, Pass);
    h.hold = Some(Step::AcquireLease);
    h.rounds(4, SoftFail, Pass);
    let Phase::Promoting(p) = &h.state.phase else {
        panic!("expected a promotion, got {:?}", h.state.phase)
    };
    assert_eq!(p.fault_seen_at, Some(Duration::from_secs(50)));
    assert_eq!(p.started_at, Duration::from_secs(80));
}

#[test]
fn a_lost_compare_and_set_acts_on_nothing_until_the_lease_is_read_again() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.lease = (Pool::B, Epoch(5)); // another operator got there first
    h.rounds(2, HardFail, Pass);
    assert!(h.events.contains(&Event::LostRace { epoch: Epoch(1) }));
    assert!(!h.state.lease_known);
    let executed = h.executed.len();
    h.rounds(5, HardFail, Pass);
    h.feed(Input::Command(Command::Failover));
    assert_eq!(
        h.executed.len(),
        executed,
        "no action at all while the lease is unknown"
    );
    h.feed(Input::LeaseObserved {
        holder: Pool::B,
        epoch: Epoch(5),
    });
    assert_eq!(
        (h.state.primary, h.state.epoch, &h.state.phase),
        (Pool::B, Epoch(5), &Phase::Serving)
    );
    let routed = Action::Route {
        pool: Pool::B,
        epoch: Epoch(5),
    };
    assert!(
        h.executed.contains(&routed),
        "the lease's holder is routed at its epoch"
    );
}

#[test]
fn an_unreachable_control_plane_pauses_promotion_and_keeps_the_route() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.feed(Input::ControlPlane(ControlPlane::Unreachable));
    h.rounds(6, HardFail, Pass);
    assert_eq!(h.started(), 0);
    assert_eq!(
        h.state.routable(),
        Some((Pool::A, Epoch(0))),
        "the data path is not failed over"
    );
    // Mid-promotion: the pending step waits for the control plane, then resumes.
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.hold = Some(Step::Wake);
    h.rounds(2, HardFail, Pass);
    h.feed(Input::ControlPlane(ControlPlane::Unreachable));
    assert_eq!(h.state.pending_action(), None);
    h.hold = None;
    h.feed(Input::ControlPlane(ControlPlane::Reachable));
    assert_eq!((h.state.primary, &h.state.phase), (Pool::B, &Phase::Serving));
}

#[test]
fn a_restarted_executor_resumes_at_the_recorded_step_without_promoting_twice() {
    for crash_at in Step::ALL {
        let mut h = Harness::new(config());
        h.rounds(2, Pass, Pass);
        h.hold = Some(crash_at);
        h.rounds(2, HardFail, Pass);
        // The executor dies; its successor reads the state back from status.
        let saved = serde_json::to_string(&h.state).unwrap_or_default();
        let restored: FailoverState = match serde_json::from_str(&saved) {
            Ok(state) => state,
            Err(error) => panic!("state does not round-trip: {error}"),
        };
        let mut successor = Harness {
            state: restored,
            hold: None,
            events: Vec::new(),
            ..h
        };
        // For a crash after the lease write but before recording it, the lease already moved.
        successor.feed(Input::LeaseObserved {
            holder: successor.lease.0,
            epoch: successor.lease.1,
        });
        successor.feed(Input::Tick);
        assert_eq!(
            (
                successor.state.primary,
                successor.state.epoch,
                &successor.state.phase
            ),
            (Pool::B, Epoch(1), &Phase::Serving),
            "crash at {crash_at:?}"
        );
        assert_eq!(
            successor.lease,
            (Pool::B, Epoch(1)),
            "crash at {crash_at:?}: the epoch moved once"
        );
        assert_eq!(
            successor.started(),
            0,
            "crash at {crash_at:?}: no second promotion"
        );
    }
}

#[test]
fn a_newer_epoch_in_the_lease_is_adopted_and_stops_our_promotion() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.hold = Some(Step::Scale);
    h.rounds(2, HardFail, Pass);
    h.feed(Input::LeaseObserved {
        holder: Pool::A,
        epoch: Epoch(7),
    });
    assert!(h.events.contains(&Event::EpochAdopted {
        holder: Pool::A,
        epoch: Epoch(7)
    }));
    assert_eq!((h.state.primary, h.state.epoch), (Pool::A, Epoch(7)));
    // The steps after the lease write are re-run for the lease's holder, so the pools match it.
    let Phase::Promoting(p) = &h.state.phase else {
        panic!("expected the adopted steps, got {:?}", h.state.phase)
    };
    assert_eq!(
        (p.kind, p.to, p.epoch, p.step),
        (TransitionKind::Adopted, Pool::A, Epoch(7), Step::Scale)
    );
    assert!(h.executed.contains(&Action::Fence {
        pool: Pool::B,
        epoch: Epoch(7)
    }));
    h.hold = None;
    h.feed(Input::Tick);
    assert_eq!(h.state.phase, Phase::Serving);
    assert_eq!(h.state.routable(), Some((Pool::A, Epoch(7))));
    assert_eq!(h.started(), 1, "adopting is not a promotion of ours");
}

#[test]
fn stale_step_reports_change_nothing() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.hold = Some(Step::Route);
    h.rounds(2, HardFail, Pass);
    let before = h.state.clone();
    h.feed(Input::StepDone {
        epoch: Epoch(0),
        step: Step::Route,
    });
    h.feed(Input::StepDone {
        epoch: Epoch(1),
        step: Step::OpenAdmission,
    });
    h.feed(Input::StepFailed {
        epoch: Epoch(1),
        step: Step::AcquireLease,
        reason: StepFailure::LostRace,
    });
    assert_eq!(h.state, before);
}

#[test]
fn fresh_checks_fed_with_a_reconnect_are_judged_before_deciding() {
    let mut h = Harness::new(config());
    h.rounds(2, Pass, Pass);
    h.feed(Input::ControlPlane(ControlPlane::Unreachable));
    h.rounds(5, HardFail, Pass);
    assert_eq!(h.state.phase, Phase::Stranded);
    // The control plane comes back in the same batch as a check showing the primary recovered:
    // the stale failures must not start a promotion.
    h.now += INTERVAL;
    h.feed(Input::ControlPlane(ControlPlane::Reachable));
    h.feed(Input::Check {
        pool: Pool::B,
        result: Pass,
    });
    h.feed(Input::Check {
        pool: Pool::A,
        result: Pass,
    });
    h.feed(Input::Tick);
    assert_eq!(h.started(), 0);
    assert_eq!(h.state.phase, Phase::Serving);
}

#[test]
fn a_forced_failover_skips_the_standby_proof_but_not_the_lease_or_dwell() {
    let mut h = Harness::new(config());
    h.feed(Input::Command(Command::Failover));
    assert!(h.events.contains(&Event::CommandRefused {
        command: Command::Failover,
        reason: Blocked::StandbyNotEligible
    }));
    h.feed(Input::ControlPlane(ControlPlane::Unreachable));
    h.feed(Input::Command(Command::ForceFailover));
    assert!(h.events.contains(&Event::CommandRefused {
        command: Command::ForceFailover,
        reason: Blocked::ControlPlaneUnreachable
    }));
    h.feed(Input::ControlPlane(ControlPlane::Reachable));
    h.feed(Input::Command(Command::ForceFailover));
    assert_eq!((h.state.primary, h.state.epoch), (Pool::B, Epoch(1)));
    h.feed(Input::Command(Command::ForceFailover));
    assert!(h.events.contains(&Event::CommandRefused {
        command: Command::ForceFailover,
        reason: Blocked::Dwell
    }));
}

#[test]
fn a_dwell_too_long_for_the_clock_never_closes_and_never_panics() {
    let mut h = Harness::new(FailoverConfig {
        min_dwell: Duration::MAX,
        ..config()
    });
    h.rounds(2, Pass, Pass);
    h.rounds(2, HardFail, Pass);
    assert_eq!(h.started(), 1);
    h.rounds(3, Pass, Pass);
    h.rounds(3, HardFail, Pass);
    assert_eq!(h.started(), 1);
    assert!(h.events.contains(&Event::PromotionBlocked {
        reason: Blocked::Dwell
    }));
}

#[test]
fn an_exhausted_epoch_blocks_promotion_instead_of_wrapping() {
    let mut h = Harness::new(config());
    h.state = FailoverState::starting_at(Pool::A, Epoch(u64::MAX));
    h.lease = (Pool::A, Epoch(u64::MAX));
    h.rounds(2, Pass, Pass);
    h.rounds(3, HardFail, Pass);
    assert_eq!(h.started(), 0);
    assert!(h.events.contains(&Event::PromotionBlocked {
        reason: Blocked::EpochExhausted
    }));
}
