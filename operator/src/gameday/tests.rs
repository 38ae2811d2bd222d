//! The run machine, with time given explicitly: each call says what instant it is.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::crd::TimelineStep;

/// 2024-06-04T10:00:00Z
const T0: Duration = Duration::from_secs(1_717_495_200);

fn at(seconds: u64) -> Duration {
    T0 + Duration::from_secs(seconds)
}

fn condition(status: ConditionStatus, reason: &str, since: Duration) -> Condition {
    Condition {
        status,
        reason: reason.to_owned(),
        message: String::new(),
        last_transition_time: Some(rfc3339(since)),
    }
}

/// A policy serving from its home pool at epoch 4 for a day, standby proven.
fn steady() -> PolicyView {
    let day_before = T0 - Duration::from_secs(86_400);
    PolicyView {
        home: "us-east".to_owned(),
        home_standby: "us-west".to_owned(),
        primary: Some("us-east".to_owned()),
        epoch: Some(4),
        state: Some("Serving".to_owned()),
        ready: Some(condition(ConditionStatus::True, "LeaseHeld", day_before)),
        standby_proven: Some(condition(ConditionStatus::True, "ChecksPass", day_before)),
        parity: Some(condition(ConditionStatus::Unknown, "NotChecked", day_before)),
        last_transition: None,
        sets_load_proof: false,
        load_proof: None,
        command: None,
        handled_command: None,
        min_dwell: Duration::from_secs(300),
        claimed_by: None,
        claim: None,
        paused: false,
        deleting: false,
    }
}

fn config(failback_after: Option<u64>) -> RunConfig {
    RunConfig {
        fault: Fault::Failover,
        stop: None,
        max_recovery: Duration::from_secs(120),
        failback_after: failback_after.map(Duration::from_secs),
        ready_for: None,
    }
}

const COMMAND: &str = "failover@gameday-weekly-20240604-100000";
const FAILBACK: &str = "failback@gameday-weekly-20240604-100000";

fn transition(
    kind: TransitionKind,
    to: &str,
    epoch: u64,
    started: u64,
    finished: Option<u64>,
) -> FailoverTimeline {
    FailoverTimeline {
        kind,
        from_pool: if to == "us-west" { "us-east" } else { "us-west" }.to_owned(),
        to_pool: to.to_owned(),
        epoch,
        fault_seen_at: None,
        started_at: rfc3339(at(started)),
        steps: vec![TimelineStep {
            step: "LeaseClaimed".to_owned(),
            started_at: Some(rfc3339(at(started))),
            at: rfc3339(at(started)),
            milliseconds: Some(0),
            handed_off: false,
            note: None,
        }],
        finished_at: finished.map(|f| rfc3339(at(f))),
    }
}

/// The policy a few seconds after it took the command: promoting us-west at epoch 5.
fn promoting(started: u64) -> PolicyView {
    PolicyView {
        state: Some("Promoting".to_owned()),
        primary: Some("us-west".to_owned()),
        epoch: Some(5),
        ready: Some(condition(ConditionStatus::False, "Promoting", at(started))),
        command: Some(COMMAND.to_owned()),
        handled_command: Some(COMMAND.to_owned()),
        last_transition: Some(transition(TransitionKind::Failover, "us-west", 5, started, None)),
        claim: Some("weekly".to_owned()),
        ..steady()
    }
}

/// The policy once us-west serves at epoch 5.
fn on_standby(finished: u64) -> PolicyView {
    PolicyView {
        state: Some("Serving".to_owned()),
        ready: Some(condition(ConditionStatus::True, "LeaseHeld", at(finished))),
        last_transition: Some(transition(
            TransitionKind::Failover,
            "us-west",
            5,
            2,
            Some(finished),
        )),
        ..promoting(2)
    }
}

fn phases(run: &GameDayRun) -> Vec<(RunPhase, String)> {
    run.transitions.iter().map(|t| (t.phase, t.at.clone())).collect()
}

/// A run that injected at T0 against a steady policy.
fn injected(config: &RunConfig) -> GameDayRun {
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    let command = run.advance(config, "weekly", Some(&steady()), T0);
    assert_eq!(command, Some(PolicyCommand::Failover(COMMAND.to_owned())));
    run
}

#[test]
fn a_steady_policy_is_given_the_failover_command_with_every_step_timestamped() {
    let run = injected(&config(None));
    assert_eq!(run.id, "20240604-100000");
    assert_eq!(run.phase, RunPhase::Injected);
    let t0 = rfc3339(T0);
    assert_eq!(
        phases(&run),
        [
            (RunPhase::Scheduled, t0.clone()),
            (RunPhase::CheckingSteadyState, t0.clone()),
            (RunPhase::Injected, t0.clone()),
        ]
    );
    assert_eq!(run.from_pool.as_deref(), Some("us-east"));
    assert_eq!(run.to_pool.as_deref(), Some("us-west"));
    assert_eq!(run.baseline_epoch, Some(4));
    assert_eq!(run.command.as_deref(), Some(COMMAND));
    assert_eq!(run.recovery.as_ref().unwrap().commanded_at, t0);
}

#[test]
fn a_policy_that_is_not_steady_is_never_given_a_command() {
    let cases: [(&str, PolicyView); 10] = [
        (
            "Ready is False (Stranded)",
            PolicyView {
                ready: Some(condition(ConditionStatus::False, "Stranded", T0)),
                ..steady()
            },
        ),
        (
            "the policy is Promoting, not Serving",
            PolicyView {
                state: Some("Promoting".to_owned()),
                ..steady()
            },
        ),
        (
            "the policy is Suspect, not Serving",
            PolicyView {
                state: Some("Suspect".to_owned()),
                ..steady()
            },
        ),
        (
            "StandbyProven is Unknown (NotProven)",
            PolicyView {
                standby_proven: Some(condition(ConditionStatus::Unknown, "NotProven", T0)),
                ..steady()
            },
        ),
        (
            "the primary is us-west, not the home pool us-east",
            PolicyView {
                primary: Some("us-west".to_owned()),
                ..steady()
            },
        ),
        (
            "the policy is paused",
            PolicyView {
                paused: true,
                ..steady()
            },
        ),
        (
            "the policy is being deleted",
            PolicyView {
                deleting: true,
                ..steady()
            },
        ),
        (
            "the policy has a command it has not handled yet (understudy.dev/command=failback@x)",
            PolicyView {
                command: Some("failback@x".to_owned()),
                handled_command: Some("failover@earlier".to_owned()),
                ..steady()
            },
        ),
        (
            "game day other is running on the policy",
            PolicyView {
                claimed_by: Some("other".to_owned()),
                ..steady()
            },
        ),
        (
            "minDwell after its last transition lasts until 2024-06-04T10:05:01Z",
            PolicyView {
                last_transition: Some(transition(TransitionKind::Failback, "us-east", 4, 0, Some(0))),
                ..steady()
            },
        ),
    ];
    for (expected, view) in cases {
        // Three minutes after the last transition of the dwell case, inside its five-minute dwell.
        let now = at(180);
        let mut run = GameDayRun::due(RunTrigger::Command, now);
        let command = run.advance(&config(None), "weekly", Some(&view), now);
        assert_eq!(command, None, "{expected}");
        assert_eq!(run.phase, RunPhase::Aborted, "{expected}");
        assert_eq!(run.verdict, Some(Verdict::Aborted), "{expected}");
        let reason = run.reason.unwrap();
        assert!(reason.starts_with("not steady: "), "{reason}");
        assert!(reason.contains(expected), "expected {expected:?} in {reason:?}");
    }
}

#[test]
fn ready_for_asks_for_a_ready_condition_that_old() {
    let config = RunConfig {
        ready_for: Some(Duration::from_secs(3600)),
        ..config(None)
    };
    let recently = PolicyView {
        ready: Some(condition(
            ConditionStatus::True,
            "LeaseHeld",
            T0 - Duration::from_secs(600),
        )),
        ..steady()
    };
    let violations = steady_state_violations(&recently, &config, T0);
    assert_eq!(
        violations,
        ["Ready has been True for less than steadyState.readyFor (1h0m0s)"]
    );
    assert!(steady_state_violations(&steady(), &config, T0).is_empty());
}

#[test]
fn a_missing_policy_aborts_the_run() {
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    assert_eq!(run.advance(&config(None), "weekly", None, T0), None);
    assert_eq!(run.phase, RunPhase::Aborted);
    assert!(run.reason.unwrap().contains("does not exist"));
}

#[test]
fn recovery_within_max_recovery_passes_with_the_policys_own_timeline() {
    let config = config(None);
    let mut run = injected(&config);
    // Promoting: nothing to judge yet.
    assert_eq!(run.advance(&config, "weekly", Some(&promoting(2)), at(5)), None);
    assert_eq!(run.phase, RunPhase::Injected);
    // Serving 95 s after the command (maxRecovery 2m), seen at 100 s.
    assert_eq!(
        run.advance(&config, "weekly", Some(&on_standby(95)), at(100)),
        None
    );
    assert_eq!(run.phase, RunPhase::Done);
    assert_eq!(run.verdict, Some(Verdict::Passed));
    let recovery = run.recovery.as_ref().unwrap();
    assert_eq!(recovery.epoch, Some(5));
    assert_eq!(recovery.started_at, Some(rfc3339(at(2))));
    assert_eq!(recovery.serving_at, Some(rfc3339(at(95))));
    assert_eq!(
        recovery.seconds,
        Some(95),
        "from the policy's finishedAt, not from when we looked"
    );
    assert_eq!(recovery.steps.len(), 1);
    let reason = run.reason.clone().unwrap();
    assert!(
        reason.contains("us-west served at epoch 5 95s after the command"),
        "{reason}"
    );
    assert!(reason.contains("failback is manual"), "{reason}");
    let names: Vec<RunPhase> = run.transitions.iter().map(|t| t.phase).collect();
    assert_eq!(
        names,
        [
            RunPhase::Scheduled,
            RunPhase::CheckingSteadyState,
            RunPhase::Injected,
            RunPhase::Recovered,
            RunPhase::Done
        ]
    );
}

#[test]
fn no_serving_primary_by_max_recovery_fails_the_run() {
    let config = config(None);
    let mut run = injected(&config);
    assert_eq!(run.advance(&config, "weekly", Some(&promoting(2)), at(119)), None);
    assert_eq!(run.phase, RunPhase::Injected);
    assert_eq!(run.advance(&config, "weekly", Some(&promoting(2)), at(120)), None);
    assert_eq!(run.phase, RunPhase::Failed);
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert!(
        run.reason
            .unwrap()
            .contains("not serving within maxRecovery (2m0s)")
    );
}

#[test]
fn a_promotion_finished_later_than_max_recovery_fails_even_when_first_seen_done() {
    let config = config(None);
    let mut run = injected(&config);
    assert_eq!(
        run.advance(&config, "weekly", Some(&on_standby(150)), at(151)),
        None
    );
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert!(run.reason.unwrap().contains("only 150s after the command"));
    assert_eq!(run.recovery.unwrap().seconds, Some(150));
}

#[test]
fn a_refused_command_aborts_the_run() {
    let config = config(None);
    let mut run = injected(&config);
    let refused = PolicyView {
        command: Some(COMMAND.to_owned()),
        handled_command: Some(COMMAND.to_owned()),
        ..steady()
    };
    assert_eq!(run.advance(&config, "weekly", Some(&refused), at(3)), None);
    assert_eq!(run.verdict, Some(Verdict::Aborted));
    assert!(run.reason.unwrap().contains("refused the failover command"));
}

#[test]
fn a_command_that_did_not_reach_the_policy_is_given_again_only_while_steady() {
    let config = config(None);
    let mut run = injected(&config);
    assert_eq!(
        run.advance(&config, "weekly", Some(&steady()), at(5)),
        Some(PolicyCommand::Failover(COMMAND.to_owned()))
    );
    let claimed = PolicyView {
        claimed_by: Some("other".to_owned()),
        ..steady()
    };
    assert_eq!(run.advance(&config, "weekly", Some(&claimed), at(6)), None);
    assert_eq!(run.verdict, Some(Verdict::Aborted));
    assert!(run.reason.unwrap().contains("game day other is running"));
}

#[test]
fn failback_after_holds_then_fails_back_and_passes() {
    let config = config(Some(600));
    let mut run = injected(&config);
    assert_eq!(
        run.advance(&config, "weekly", Some(&on_standby(60)), at(61)),
        None
    );
    assert_eq!(run.phase, RunPhase::HoldingOnStandby);
    // Served at 60 s; hold 600 s: the failback is due at 660 s.
    assert_eq!(
        run.advance(&config, "weekly", Some(&on_standby(60)), at(659)),
        None
    );
    assert_eq!(run.phase, RunPhase::HoldingOnStandby);
    assert_eq!(
        run.advance(&config, "weekly", Some(&on_standby(60)), at(660)),
        Some(PolicyCommand::Failback(FAILBACK.to_owned()))
    );
    assert_eq!(run.phase, RunPhase::FailingBack);
    let home = PolicyView {
        primary: Some("us-east".to_owned()),
        epoch: Some(6),
        command: Some(FAILBACK.to_owned()),
        handled_command: Some(FAILBACK.to_owned()),
        last_transition: Some(transition(TransitionKind::Failback, "us-east", 6, 661, Some(700))),
        ..on_standby(60)
    };
    assert_eq!(run.advance(&config, "weekly", Some(&home), at(705)), None);
    assert_eq!(run.phase, RunPhase::Done);
    assert_eq!(run.verdict, Some(Verdict::Passed));
    let failback = run.failback.as_ref().unwrap();
    assert_eq!(failback.seconds, Some(40));
    assert_eq!(failback.epoch, Some(6));
    let names: Vec<RunPhase> = run.transitions.iter().map(|t| t.phase).collect();
    assert_eq!(
        names,
        [
            RunPhase::Scheduled,
            RunPhase::CheckingSteadyState,
            RunPhase::Injected,
            RunPhase::Recovered,
            RunPhase::HoldingOnStandby,
            RunPhase::FailingBack,
            RunPhase::Done
        ]
    );
    assert_eq!(run.transitions[5].at, rfc3339(at(660)));
}

#[test]
fn the_hold_lasts_at_least_the_policys_min_dwell() {
    // after: 60 s, minDwell: 300 s: the policy would refuse a failback before 300 s (+1 s).
    let config = config(Some(60));
    let mut run = injected(&config);
    run.advance(&config, "weekly", Some(&on_standby(30)), at(31));
    assert_eq!(
        run.advance(&config, "weekly", Some(&on_standby(30)), at(100)),
        None
    );
    assert_eq!(
        run.advance(&config, "weekly", Some(&on_standby(30)), at(330)),
        None
    );
    assert!(matches!(
        run.advance(&config, "weekly", Some(&on_standby(30)), at(331)),
        Some(PolicyCommand::Failback(_))
    ));
}

#[test]
fn a_standby_that_stops_being_ready_while_holding_fails_back_early_and_fails() {
    let config = config(Some(3600));
    let mut run = injected(&config);
    run.advance(&config, "weekly", Some(&on_standby(30)), at(31));
    let suspect = PolicyView {
        state: Some("Suspect".to_owned()),
        ready: Some(condition(ConditionStatus::True, "PrimarySuspect", at(30))),
        ..on_standby(30)
    };
    // The dwell (until 331 s) still holds it back.
    assert_eq!(run.advance(&config, "weekly", Some(&suspect), at(200)), None);
    assert!(run.stop_condition.is_some());
    assert!(matches!(
        run.advance(&config, "weekly", Some(&suspect), at(331)),
        Some(PolicyCommand::Failback(_))
    ));
    let home = PolicyView {
        primary: Some("us-east".to_owned()),
        epoch: Some(6),
        handled_command: Some(FAILBACK.to_owned()),
        last_transition: Some(transition(TransitionKind::Failback, "us-east", 6, 332, Some(360))),
        ..on_standby(30)
    };
    run.advance(&config, "weekly", Some(&home), at(361));
    assert_eq!(run.phase, RunPhase::Failed);
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert!(
        run.reason
            .unwrap()
            .contains("lost its steady state while holding")
    );
}

#[test]
fn a_failback_not_done_within_max_recovery_fails_and_leaves_the_standby_primary() {
    let config = config(Some(600));
    let mut run = injected(&config);
    run.advance(&config, "weekly", Some(&on_standby(60)), at(61));
    run.advance(&config, "weekly", Some(&on_standby(60)), at(660));
    let waiting = PolicyView {
        command: Some(FAILBACK.to_owned()),
        ..on_standby(60)
    };
    assert_eq!(run.advance(&config, "weekly", Some(&waiting), at(779)), None);
    assert_eq!(run.phase, RunPhase::FailingBack);
    assert_eq!(run.advance(&config, "weekly", Some(&waiting), at(780)), None);
    assert_eq!(run.phase, RunPhase::Failed);
    assert!(run.reason.unwrap().contains("us-west stays primary"));
}

#[test]
fn run_ids_and_commands_are_new_for_every_run() {
    assert_eq!(run_id(T0), "20240604-100000");
    assert_eq!(run_id(at(61)), "20240604-100101");
    assert_eq!(command_value("failover", "weekly", "20240604-100000"), COMMAND);
}

#[test]
fn a_promotion_seen_after_the_command_annotation_was_removed_still_counts() {
    // Someone removed the annotation once the policy had taken it: the policy forgets the handled
    // value, but its lastFailover shows the promotion, and nothing is given again.
    let config = config(None);
    let mut run = injected(&config);
    let forgotten = PolicyView {
        command: None,
        handled_command: None,
        ..on_standby(40)
    };
    assert_eq!(run.advance(&config, "weekly", Some(&forgotten), at(45)), None);
    assert_eq!(run.verdict, Some(Verdict::Passed));
}

#[test]
fn a_command_already_handled_by_the_policy_is_not_pending() {
    let handled = PolicyView {
        command: Some("failback@x".to_owned()),
        handled_command: Some("failback@x".to_owned()),
        ..steady()
    };
    assert!(steady_state_violations(&handled, &config(None), T0).is_empty());
}

#[test]
fn a_promotion_another_game_day_commanded_is_not_credited_to_this_run() {
    // Two game days fired together; both recorded Injected, and the other one's patch won.
    let config = config(Some(600));
    let mut run = injected(&config);
    let other = "failover@gameday-other-20240604-100000";
    let winner = PolicyView {
        command: Some(other.to_owned()),
        handled_command: Some(other.to_owned()),
        claim: Some("other".to_owned()),
        claimed_by: Some("other".to_owned()),
        ..on_standby(60)
    };
    assert_eq!(run.advance(&config, "weekly", Some(&winner), at(61)), None);
    assert_eq!(run.phase, RunPhase::Aborted);
    assert_eq!(run.verdict, Some(Verdict::Aborted));
    let reason = run.reason.unwrap();
    assert!(
        reason.contains("another game day or someone else moved the policy"),
        "{reason}"
    );
    assert!(reason.contains(other), "{reason}");
    assert_eq!(
        run.recovery.unwrap().epoch,
        None,
        "nothing of the other run is recorded"
    );
}

#[test]
fn a_promotion_under_someone_elses_command_is_not_credited_even_under_this_claim() {
    let config = config(None);
    let mut run = injected(&config);
    let human = PolicyView {
        command: Some("force-failover@oncall".to_owned()),
        handled_command: Some("force-failover@oncall".to_owned()),
        ..on_standby(60)
    };
    run.advance(&config, "weekly", Some(&human), at(61));
    assert_eq!(run.verdict, Some(Verdict::Aborted));
}

/// The policy back home at epoch 6, serving since `finished`, by a move the run did not command.
fn home_on_its_own(finished: u64) -> PolicyView {
    PolicyView {
        primary: Some("us-east".to_owned()),
        epoch: Some(6),
        last_transition: Some(transition(
            TransitionKind::Failback,
            "us-east",
            6,
            finished - 20,
            Some(finished),
        )),
        ..on_standby(30)
    }
}

#[test]
fn a_move_home_the_run_did_not_command_while_holding_fails_the_run() {
    // The status calls every move home a failback; this one came while the game day held.
    let config = config(Some(3600));
    let mut run = injected(&config);
    run.advance(&config, "weekly", Some(&on_standby(30)), at(31));
    assert_eq!(run.phase, RunPhase::HoldingOnStandby);
    assert_eq!(
        run.advance(&config, "weekly", Some(&home_on_its_own(200)), at(205)),
        None
    );
    assert_eq!(run.phase, RunPhase::Failed);
    assert_eq!(run.verdict, Some(Verdict::Failed));
    let reason = run.reason.unwrap();
    assert!(reason.contains("the policy moved on its own"), "{reason}");
    assert!(reason.contains("that the run did not command"), "{reason}");
}

#[test]
fn a_standby_that_fails_while_holding_is_never_given_a_failback_while_the_policy_promotes() {
    // The standby fails hard after the dwell; the policy promotes home by itself.
    let config = config(Some(60));
    let mut run = injected(&config);
    run.advance(&config, "weekly", Some(&on_standby(30)), at(31));
    let promoting_home = PolicyView {
        state: Some("Promoting".to_owned()),
        ready: Some(condition(ConditionStatus::False, "Promoting", at(400))),
        ..on_standby(30)
    };
    assert_eq!(
        run.advance(&config, "weekly", Some(&promoting_home), at(401)),
        None
    );
    assert_eq!(run.phase, RunPhase::HoldingOnStandby);
    assert!(run.stop_condition.is_some());
    let unfinished = PolicyView {
        state: Some("Serving".to_owned()),
        last_transition: Some(transition(TransitionKind::Failover, "us-west", 5, 2, None)),
        ..on_standby(30)
    };
    assert_eq!(run.advance(&config, "weekly", Some(&unfinished), at(402)), None);
    run.advance(&config, "weekly", Some(&home_on_its_own(420)), at(421));
    assert_eq!(run.verdict, Some(Verdict::Failed));
    let reason = run.reason.unwrap();
    assert!(reason.contains("lost its steady state while holding"), "{reason}");
    assert!(reason.contains("the policy moved on its own"), "{reason}");
}

#[test]
fn a_move_home_someone_else_commanded_during_the_failback_is_not_credited() {
    let config = config(Some(600));
    let mut run = injected(&config);
    run.advance(&config, "weekly", Some(&on_standby(60)), at(61));
    run.advance(&config, "weekly", Some(&on_standby(60)), at(660));
    assert_eq!(run.phase, RunPhase::FailingBack);
    let human = PolicyView {
        command: Some("failback@oncall".to_owned()),
        handled_command: Some("failback@oncall".to_owned()),
        ..home_on_its_own(700)
    };
    run.advance(&config, "weekly", Some(&human), at(701));
    assert_eq!(run.verdict, Some(Verdict::Aborted));
}

fn crash_config() -> RunConfig {
    RunConfig {
        fault: Fault::Crash,
        ..config(None)
    }
}

/// The policy after it promoted us-west at epoch 5 on its own: no new command handled.
fn promoted_by_itself(finished: u64) -> PolicyView {
    PolicyView {
        command: None,
        handled_command: None,
        claim: Some("weekly".to_owned()),
        ..on_standby(finished)
    }
}

#[test]
fn a_crash_deletes_the_primarys_pods_and_passes_when_the_policy_promotes_on_its_own_in_time() {
    let config = crash_config();
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    let action = run.advance(&config, "weekly", Some(&steady()), T0);
    assert_eq!(action, Some(PolicyCommand::Crash("us-east".to_owned())));
    assert_eq!(action.unwrap().value(), None, "a crash is not a command");
    assert_eq!(run.phase, RunPhase::Injected);
    assert_eq!(run.command, None);
    assert_eq!(
        run.injected.as_deref(),
        Some("deleted the serving pods of us-east")
    );
    // Nothing is given again while the policy has not moved.
    assert_eq!(run.advance(&config, "weekly", Some(&steady()), at(10)), None);
    assert_eq!(run.phase, RunPhase::Injected);
    assert_eq!(
        run.advance(&config, "weekly", Some(&promoted_by_itself(40)), at(41)),
        None
    );
    assert_eq!(run.phase, RunPhase::Done);
    assert_eq!(run.verdict, Some(Verdict::Passed));
    let reason = run.reason.unwrap();
    assert!(
        reason.starts_with("us-west served at epoch 5 40s after the crash (maxRecovery 2m0s)"),
        "{reason}"
    );
}

#[test]
fn a_crash_the_policy_does_not_answer_within_max_recovery_fails() {
    let config = crash_config();
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    run.advance(&config, "weekly", Some(&steady()), T0);
    assert_eq!(run.advance(&config, "weekly", Some(&steady()), at(119)), None);
    assert_eq!(run.phase, RunPhase::Injected);
    run.advance(&config, "weekly", Some(&steady()), at(120));
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert_eq!(
        run.reason.as_deref(),
        Some(
            "the policy did not promote us-west within maxRecovery (2m0s) after its primary's pods were deleted"
        )
    );
}

#[test]
fn a_promotion_under_a_command_given_after_the_crash_is_not_the_policys_answer_to_it() {
    let config = crash_config();
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    run.advance(&config, "weekly", Some(&steady()), T0);
    let commanded = PolicyView {
        handled_command: Some("force-failover@someone".to_owned()),
        ..promoted_by_itself(30)
    };
    run.advance(&config, "weekly", Some(&commanded), at(31));
    assert_eq!(run.verdict, Some(Verdict::Aborted));
    assert!(
        run.reason
            .unwrap()
            .starts_with("someone commanded the policy after the crash (force-failover@someone)")
    );
}

#[test]
fn a_crash_run_fails_back_under_its_own_token() {
    let config = RunConfig {
        failback_after: Some(Duration::from_secs(60)),
        ..crash_config()
    };
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    run.advance(&config, "weekly", Some(&steady()), T0);
    run.advance(&config, "weekly", Some(&promoted_by_itself(40)), at(41));
    assert_eq!(run.phase, RunPhase::HoldingOnStandby);
    let action = run.advance(&config, "weekly", Some(&promoted_by_itself(40)), at(400));
    assert_eq!(action, Some(PolicyCommand::Failback(FAILBACK.to_owned())));
}

fn limits() -> StopLimits {
    StopLimits {
        max_error_rate: Some(0.05),
        max_ttft_p99: Some(Duration::from_secs(2)),
        window: Duration::from_secs(60),
        min_requests: 20,
    }
}

fn counted(sent: u64, failed: u64, ttft: &[(u64, u64)]) -> load::Counters {
    load::Counters {
        sent,
        failed,
        shed: 0,
        ttft: ttft.iter().copied().collect(),
    }
}

#[test]
fn a_stop_condition_fires_on_the_windows_error_rate_or_first_token_time_and_not_on_a_handful() {
    let fast = [(500_000, 99), (u64::MAX, 100)];
    assert_eq!(
        limits().fired(&counted(100, 5, &fast)),
        None,
        "5% is not above 5%"
    );
    assert_eq!(
        limits().fired(&counted(100, 12, &fast)).as_deref(),
        Some(
            "stop condition: 12.0% of the last 1m0s's 100 requests failed (12 of them), above maxErrorRate 5.0%"
        )
    );
    assert_eq!(
        limits().fired(&counted(10, 10, &fast)),
        None,
        "ten requests are no rate"
    );
    let slow = [(500_000, 50), (5_000_000, 100), (u64::MAX, 100)];
    assert_eq!(
        limits().fired(&counted(100, 0, &slow)).as_deref(),
        Some(
            "stop condition: the last 1m0s's 99th percentile time to first token was 5s, above maxTtftP99 (2s)"
        )
    );
}

#[test]
fn the_run_config_takes_the_fault_failback_ready_for_and_stop_conditions_from_the_spec() {
    let spec: GameDaySpec = serde_yaml::from_str(
        "
policyRef: {name: llama}
fault: crash
steadyState: {readyFor: 30m}
maxRecovery: 3m
failback: {mode: after, after: 10m}
stopConditions: {maxTtftP99: 3s, window: 30s, minRequests: 50}
",
    )
    .unwrap();
    let config = RunConfig::from_spec(&spec).unwrap();
    assert_eq!(
        config,
        RunConfig {
            fault: Fault::Crash,
            max_recovery: Duration::from_secs(180),
            failback_after: Some(Duration::from_secs(600)),
            ready_for: Some(Duration::from_secs(1800)),
            stop: Some(StopLimits {
                max_error_rate: None,
                max_ttft_p99: Some(Duration::from_secs(3)),
                window: Duration::from_secs(30),
                min_requests: 50,
            }),
        }
    );
    // The limits as read: forty slow requests are below minRequests, a hundred fire over the
    // spec's window and limit.
    let stop = config.stop.unwrap();
    let slow = [(500_000, 50), (5_000_000, 100), (u64::MAX, 100)];
    assert_eq!(stop.fired(&counted(40, 0, &slow)), None);
    assert_eq!(
        stop.fired(&counted(100, 0, &slow)).as_deref(),
        Some(
            "stop condition: the last 30s's 99th percentile time to first token was 5s, above maxTtftP99 (3s)"
        )
    );

    let defaults: GameDaySpec = serde_yaml::from_str("{policyRef: {name: llama}, maxRecovery: 3m}").unwrap();
    assert_eq!(
        RunConfig::from_spec(&defaults),
        Ok(RunConfig {
            fault: Fault::Failover,
            max_recovery: Duration::from_secs(180),
            failback_after: None,
            ready_for: None,
            stop: None,
        })
    );
    let manual: GameDaySpec = serde_yaml::from_str(
        "{policyRef: {name: llama}, maxRecovery: 3m, failback: {mode: manual, after: 10m}}",
    )
    .unwrap();
    assert_eq!(
        RunConfig::from_spec(&manual).map(|c| c.failback_after),
        Ok(None),
        "a manual failback is never given by the run"
    );
}

#[test]
fn a_stop_condition_during_the_failover_fails_the_run_and_with_failback_after_fails_back_at_once() {
    let mut run = injected(&config(None));
    run.stop_condition = Some("stop condition: 40.0% failed".to_owned());
    run.advance(&config(None), "weekly", Some(&on_standby(90)), at(95));
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert!(
        run.reason
            .unwrap()
            .starts_with("stop condition: 40.0% failed; us-west served at epoch 5")
    );

    let holding = config(Some(3600));
    let mut run = injected(&holding);
    run.stop_condition = Some("stop condition: 40.0% failed".to_owned());
    run.advance(&holding, "weekly", Some(&on_standby(90)), at(95));
    assert_eq!(run.phase, RunPhase::HoldingOnStandby);
    // Not an hour later: as soon as the policy's dwell (5 minutes after it served) allows.
    let back = run.advance(&holding, "weekly", Some(&on_standby(90)), at(90 + 301));
    assert_eq!(back, Some(PolicyCommand::Failback(FAILBACK.to_owned())));
}

fn fence_config(fault: Fault) -> RunConfig {
    RunConfig {
        fault,
        ..config(None)
    }
}

#[test]
fn a_hang_is_played_by_the_primarys_fences_and_taken_away_once_the_policy_promoted_on_its_own() {
    let config = fence_config(Fault::Hang);
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    let action = run.advance(&config, "weekly", Some(&steady()), T0);
    // Played for maxRecovery and a minute at most, in case the run is lost.
    assert_eq!(
        action,
        Some(PolicyCommand::Fence(
            "us-east".to_owned(),
            FenceFault::Hang,
            Duration::from_secs(180)
        ))
    );
    assert_eq!(action.unwrap().value(), None, "a hang is not a command");
    assert_eq!(run.injected.as_deref(), Some("hung the fences of us-east"));
    assert_eq!(run.advance(&config, "weekly", Some(&steady()), at(10)), None);
    let action = run.advance(&config, "weekly", Some(&promoted_by_itself(40)), at(41));
    assert_eq!(action, Some(PolicyCommand::Restore("us-east".to_owned())));
    // Taken away first; then the run goes on.
    assert_eq!(run.phase, RunPhase::Recovered);
    assert_eq!(
        run.advance(&config, "weekly", Some(&promoted_by_itself(40)), at(42)),
        None
    );
    assert_eq!(run.verdict, Some(Verdict::Passed));
    let reason = run.reason.unwrap();
    assert!(
        reason.starts_with("us-west served at epoch 5 40s after the hang (maxRecovery 2m0s)"),
        "{reason}"
    );
}

#[test]
fn a_half_failure_the_policy_does_not_answer_fails_the_run_and_is_still_taken_away() {
    let config = fence_config(Fault::HalfFailed);
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    let action = run.advance(&config, "weekly", Some(&steady()), T0);
    assert!(
        matches!(&action, Some(PolicyCommand::Fence(pool, FenceFault::WrongAnswers, _)) if pool == "us-east"),
        "{action:?}"
    );
    assert_eq!(run.advance(&config, "weekly", Some(&steady()), at(119)), None);
    let action = run.advance(&config, "weekly", Some(&steady()), at(120));
    assert_eq!(action, Some(PolicyCommand::Restore("us-east".to_owned())));
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert_eq!(
        run.reason.as_deref(),
        Some(
            "the policy did not promote us-west within maxRecovery (2m0s) after its primary began to answer wrongly"
        )
    );
    // Once judged, nothing more is asked.
    assert_eq!(run.advance(&config, "weekly", Some(&steady()), at(121)), None);
}

#[test]
fn a_half_failed_primary_is_healed_before_the_run_fails_back_to_it() {
    let config = RunConfig {
        failback_after: Some(Duration::from_secs(60)),
        ..fence_config(Fault::HalfFailed)
    };
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    run.advance(&config, "weekly", Some(&steady()), T0);
    let action = run.advance(&config, "weekly", Some(&promoted_by_itself(40)), at(41));
    assert_eq!(action, Some(PolicyCommand::Restore("us-east".to_owned())));
    assert_eq!(run.phase, RunPhase::Recovered);
    assert_eq!(
        run.advance(&config, "weekly", Some(&promoted_by_itself(40)), at(60)),
        None
    );
    assert_eq!(run.phase, RunPhase::HoldingOnStandby);
    let action = run.advance(&config, "weekly", Some(&promoted_by_itself(40)), at(400));
    assert_eq!(action, Some(PolicyCommand::Failback(FAILBACK.to_owned())));
}

/// The steady policy with `spec.loadProof`, its last proof of `pool` started at `started` (in
/// seconds from [`T0`]) and come to `result`.
fn load_proven(proof: Option<(&str, u64, &str)>) -> PolicyView {
    let mut view = steady();
    view.sets_load_proof = true;
    view.load_proof = proof.map(|(pool, started, result)| {
        serde_json::from_value(serde_json::json!({
            "at": rfc3339(at(started)), "pool": pool, "result": result, "replicas": 2,
            "requests": 600, "errors": 0, "detail": "within every threshold",
        }))
        .unwrap()
    });
    view
}

#[test]
fn a_load_proof_run_gives_the_command_and_is_judged_by_the_first_proof_of_the_standby_after_it() {
    let config = RunConfig {
        fault: Fault::LoadProof,
        ..config(None)
    };
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    // A proof from before the run, and one of the primary, decide nothing.
    let before = load_proven(Some(("us-west", 0, "Failed")));
    let action = run.advance(&config, "weekly", Some(&before), at(10));
    assert_eq!(
        action,
        Some(PolicyCommand::ProveLoad(
            "prove-load@gameday-weekly-20240604-100000".to_owned()
        ))
    );
    assert_eq!(run.injected.as_deref(), Some("asked for a load proof of us-west"));
    assert_eq!(run.advance(&config, "weekly", Some(&before), at(40)), None);
    let primary = load_proven(Some(("us-east", 20, "Proven")));
    assert_eq!(run.advance(&config, "weekly", Some(&primary), at(50)), None);
    assert_eq!(run.verdict, None);

    let mut proven = run.clone();
    proven.advance(
        &config,
        "weekly",
        Some(&load_proven(Some(("us-west", 20, "Proven")))),
        at(90),
    );
    assert_eq!(
        (proven.phase, proven.verdict),
        (RunPhase::Done, Some(Verdict::Passed))
    );
    assert!(
        proven
            .reason
            .as_deref()
            .unwrap()
            .starts_with("us-west proven at load: Proven at")
    );

    let mut failed = run.clone();
    failed.advance(
        &config,
        "weekly",
        Some(&load_proven(Some(("us-west", 20, "NotRun")))),
        at(90),
    );
    assert_eq!(failed.verdict, Some(Verdict::Failed));

    run.advance(&config, "weekly", Some(&before), at(10 + 120));
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert!(
        run.reason.as_deref().unwrap().contains("within maxRecovery"),
        "{:?}",
        run.reason
    );
}

#[test]
fn a_load_proof_run_on_a_policy_without_one_is_aborted_and_asks_nothing() {
    let config = RunConfig {
        fault: Fault::LoadProof,
        ..config(None)
    };
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    assert_eq!(run.advance(&config, "weekly", Some(&steady()), T0), None);
    assert_eq!(run.verdict, Some(Verdict::Aborted));
    assert!(
        run.reason.as_deref().unwrap().contains("no spec.loadProof"),
        "{:?}",
        run.reason
    );
}

fn drift_config() -> RunConfig {
    RunConfig {
        fault: Fault::Drift,
        ..config(None)
    }
}

/// The steady policy, its parity as `status` with `message`.
fn parity(status: ConditionStatus, message: &str) -> PolicyView {
    let mut view = steady();
    view.parity = Some(Condition {
        message: message.to_owned(),
        ..condition(status, "Drift", T0)
    });
    view
}

const DRIFT: &str =
    "us-west differs from us-east in 1 key(s): env.VLLM_UNDERSTUDY_GAMEDAY_DRIFT (absent ≠ 20240604-100000)";

#[test]
fn a_drift_the_policy_reports_and_does_not_promote_passes_once_it_is_taken_back() {
    let config = drift_config();
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    let action = run.advance(&config, "weekly", Some(&steady()), T0);
    assert_eq!(action, Some(PolicyCommand::Drift("us-west".to_owned())));
    assert_eq!(
        run.injected.as_deref(),
        Some("restarted us-west with VLLM_UNDERSTUDY_GAMEDAY_DRIFT=20240604-100000")
    );
    // Rolling out: nothing to report yet.
    assert_eq!(run.advance(&config, "weekly", Some(&steady()), at(20)), None);
    let reported = parity(ConditionStatus::False, DRIFT);
    let action = run.advance(&config, "weekly", Some(&reported), at(30));
    assert_eq!(action, Some(PolicyCommand::Restore("us-west".to_owned())));
    assert_eq!(run.phase, RunPhase::Restoring);
    // Still rolling back: taken back again, idempotently.
    let action = run.advance(&config, "weekly", Some(&reported), at(40));
    assert_eq!(action, Some(PolicyCommand::Restore("us-west".to_owned())));
    // The new pods are not comparable yet: no drift, but parity does not hold either.
    let unknown = parity(ConditionStatus::Unknown, "nothing could be compared");
    let action = run.advance(&config, "weekly", Some(&unknown), at(45));
    assert_eq!(action, Some(PolicyCommand::Restore("us-west".to_owned())));
    assert_eq!(run.verdict, None);
    let holds = parity(ConditionStatus::True, "9 key(s) agree");
    assert_eq!(run.advance(&config, "weekly", Some(&holds), at(55)), None);
    assert_eq!(run.verdict, Some(Verdict::Passed));
    assert_eq!(
        run.reason.as_deref(),
        Some(
            "the policy reported us-west's drift (ParityHolds False naming env.VLLM_UNDERSTUDY_GAMEDAY_DRIFT) \
             30s after it was injected, and promoted nothing; parity held again 25s after the drift was taken back"
        )
    );
}

#[test]
fn a_drift_never_reported_is_taken_back_and_fails_the_run() {
    let config = drift_config();
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    run.advance(&config, "weekly", Some(&steady()), T0);
    let action = run.advance(&config, "weekly", Some(&steady()), at(120));
    assert_eq!(action, Some(PolicyCommand::Restore("us-west".to_owned())));
    run.advance(&config, "weekly", Some(&steady()), at(125));
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert!(
        run.reason
            .as_deref()
            .unwrap()
            .starts_with("the policy did not report us-west's drift within maxRecovery (2m0s)"),
        "{:?}",
        run.reason
    );
}

#[test]
fn a_policy_that_promotes_a_drifted_standby_fails_the_run() {
    let config = drift_config();
    let mut run = GameDayRun::due(RunTrigger::Schedule, T0);
    run.advance(&config, "weekly", Some(&steady()), T0);
    let moved = PolicyView {
        epoch: Some(5),
        ..parity(ConditionStatus::False, DRIFT)
    };
    let action = run.advance(&config, "weekly", Some(&moved), at(30));
    assert_eq!(action, Some(PolicyCommand::Restore("us-west".to_owned())));
    let holds = PolicyView {
        epoch: Some(5),
        ..parity(ConditionStatus::True, "agree")
    };
    run.advance(&config, "weekly", Some(&holds), at(40));
    assert_eq!(run.verdict, Some(Verdict::Failed));
    assert!(
        run.reason
            .unwrap()
            .starts_with("the policy moved to epoch 5 while us-west drifted")
    );
}
