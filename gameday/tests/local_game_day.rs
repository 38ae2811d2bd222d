//! The local game day end to end: emulator replicas, fences and routers as real processes on
//! loopback, the failover logic driving promotion over a file lease, open-loop load, and real
//! signals. Asserts verdicts and counts, never times.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use understudy_gameday::local::replicas::Launcher;
use understudy_gameday::local::report::{RunReport, Verdict};
use understudy_gameday::local::scenario::Scenario;
use understudy_gameday::local::{Progress, RunOptions, run};

const SHORT_CRASH: &str = include_str!("../../examples/gamedays/local/short-crash.yaml");

fn options() -> RunOptions {
    RunOptions {
        launcher: Launcher {
            // The emulator as `understudy-gameday run` starts it: this binary's `emulator` subcommand.
            program: PathBuf::from(env!("CARGO_BIN_EXE_understudy-gameday")),
            prefix: vec!["emulator".to_owned()],
        },
        router: Launcher {
            program: PathBuf::from(env!("CARGO_BIN_EXE_understudy-gameday")),
            prefix: vec!["router".to_owned()],
        },
        seed: 7,
        progress: Progress::Quiet,
    }
}

/// How many replicas each route to `pool` held, in the order the routers were given them.
fn routed_to(report: &RunReport, pool: &str) -> Vec<usize> {
    report
        .routes
        .iter()
        .filter(|r| r.pool == pool)
        .map(|r| r.replicas)
        .collect()
}

/// Each run of a scenario with several, one after another.
async fn run_plan(text: &str) -> Vec<RunReport> {
    let mut reports = Vec::new();
    for checked in &Scenario::plan(text).unwrap().runs {
        reports.push(run(checked, &options()).await.unwrap());
    }
    reports
}

async fn run_scenario(text: &str) -> RunReport {
    let checked = Scenario::parse(text).unwrap();
    run(&checked, &options()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_primary_is_replaced_by_its_hot_standby_and_no_request_sent_after_the_crash_fails() {
    let report = run_scenario(SHORT_CRASH).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    assert!(report.requests.sent > 60, "{:?}", report.requests);
    assert_eq!(
        report.requests.failed, report.failed_in_flight_at_fault,
        "only requests the dying replicas held may fail: {:?}",
        report.failures
    );
    assert_eq!(report.transitions.len(), 1);
    let promotion = &report.transitions[0];
    assert_eq!(
        (promotion.from.as_str(), promotion.to.as_str(), promotion.epoch),
        ("a", "b", 1)
    );
    let steps: Vec<&str> = promotion.steps.iter().map(|s| s.step.as_str()).collect();
    assert_eq!(
        steps,
        [
            "AcquireLease",
            "FenceOld",
            "Wake",
            "Scale",
            "AwaitServing",
            "Route",
            "OpenAdmission"
        ]
    );
    assert!(report.detection_ms.is_some());
    assert_eq!(report.faults[0].replicas, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_fault_nothing_fails_over_and_every_request_is_served() {
    let calm = SHORT_CRASH
        .replace("  - {at: 3s, fault: crash, pool: a}\n", "")
        .replace("faults:\n", "faults: []\n")
        .replace("failovers: 1", "failovers: 0")
        .replace("duration: 8s", "duration: 4s");
    let report = run_scenario(&calm).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    assert!(report.transitions.is_empty());
    assert_eq!(report.requests.failed, 0, "{:?}", report.failures);
    assert_eq!(report.requests.ok, report.requests.sent);
    assert_eq!(report.gap_ms, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scenario_that_expects_no_failover_fails_when_one_happens() {
    let wrong = SHORT_CRASH.replace("failovers: 1", "failovers: 0");
    let report = run_scenario(&wrong).await;
    assert_eq!(report.verdict, Verdict::Failed);
    assert!(
        report.verdict_reasons.iter().any(|r| r.contains("FAILED")),
        "{:?}",
        report.verdict_reasons
    );
}

/// The short scenario with `fault` instead of the crash.
fn short_with(fault: &str) -> String {
    SHORT_CRASH.replace("fault: crash", &format!("fault: {fault}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_failed_primary_that_answers_health_but_not_generation_is_replaced() {
    let report = run_scenario(&short_with("half-failed").replace("maxFailedSentAfterFault: 0", "")).await;
    assert_eq!(report.transitions.len(), 1, "{report:#?}");
    assert_eq!(report.faults[0].fault, "half-failed");
    // The primary's 500s reach clients until the route moves; none are refusals.
    assert_eq!(report.failed_before_reaching_a_replica, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_answering_fluently_but_wrongly_is_caught_by_the_golden_answer() {
    let report = run_scenario(&short_with("wrong-output").replace("maxFailedSentAfterFault: 0", "")).await;
    assert_eq!(report.transitions.len(), 1, "{report:#?}");
    // Its answers look fine to a client: nothing fails, and only the probe saw the fault.
    assert_eq!(report.requests.failed, 0, "{:?}", report.failures);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_primary_whose_probes_time_out_is_replaced_and_the_requests_it_held_move_to_the_new_primary() {
    // SIGSTOP for six seconds, past the end of the load: connections stay open and nothing
    // answers, so the probes time out (weak evidence) rather than being refused, and the requests
    // the routers handed the hung replicas wait for the route to move. SIGCONT then lets the
    // streams they had begun finish.
    let hang = SHORT_CRASH.replace("fault: crash, pool: a}", "fault: hang, pool: a, for: 6s}");
    let report = run_scenario(&hang).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    assert_eq!(report.faults[0].fault, "hang");
    assert_eq!(report.transitions.len(), 1, "{report:#?}");
    assert_eq!(report.transitions[0].to, "b");
    // Nothing was refused: a hung replica takes connections. What it took with no first byte
    // went to b when the route moved, and nothing failed.
    assert_eq!(report.failed_before_reaching_a_replica, 0);
    assert!(report.requests.moved > 0, "{:?}", report.requests);
    assert_eq!(report.requests.failed, 0, "{:?}", report.failures);
    assert!(report.detection_ms.is_some());
}

const SEED_000: &str = include_str!("../../examples/gamedays/local/seed-000.yaml");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_000_loses_requests_active_passive_about_one_active_active_and_none_under_understudy() {
    let short = SEED_000
        .replace("duration: 30s", "duration: 7s")
        .replace("{at: 10s, fault: crash", "{at: 3s, fault: crash");
    let reports = run_plan(&short).await;
    let names: Vec<&str> = reports.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["active-passive", "active-active", "understudy"]);
    let [passive, active, understudy] = &reports[..] else {
        unreachable!()
    };
    for report in &reports {
        assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    }
    // Every request sent before the switch goes to the dead primary and fails at once: two to
    // three probe intervals at 50 a second.
    assert!(passive.requests.failed >= 50, "{:?}", passive.requests);
    assert_eq!(passive.requests.retried, 0);
    assert_eq!(passive.transitions.len(), 1);
    // Dropped on its first failure: what it held, and the one request that found it dead.
    assert!(active.requests.failed <= 5, "{:?}", active.failures);
    assert!(active.transitions.is_empty());
    assert!(active.detection_ms.is_none() && active.predicted_detection_ms.is_none());
    // Held by the routers until the standby's route, retried past the replica that died
    // holding them: nothing fails.
    assert_eq!(understudy.requests.failed, 0, "{:?}", understudy.failures);
    assert_eq!(understudy.requests.ok, understudy.requests.sent);
    assert!(understudy.stall_ms.is_some() && understudy.gap_ms.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_and_a_failback_under_streaming_load_cut_no_stream_when_the_old_primary_drains() {
    // Streams of two to four seconds, the moves at 2 s and 6 s, and an 8 s drain: every stream b
    // took has ended before its warm replicas go back to sleep.
    let short = include_str!("../../examples/gamedays/local/planned-moves.yaml")
        .replace("duration: 24s", "duration: 16s")
        .replace("{at: 4s, command: failover}", "{at: 2s, command: failover}")
        .replace("{at: 12s, command: failback}", "{at: 6s, command: failback}")
        .replace("maxTokens: [200, 400]", "maxTokens: [100, 200]")
        .replace("drainFor: 10s", "drainFor: 8s");
    let reports = run_plan(&short).await;
    let [drained, cut] = &reports[..] else {
        panic!("two runs: {reports:#?}")
    };
    for report in &reports {
        assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
        let kinds: Vec<&str> = report.transitions.iter().map(|t| t.kind.as_str()).collect();
        assert_eq!(kinds, ["manual", "failback"], "{report:#?}");
        assert_eq!(
            report.standby_shaped.len(),
            1,
            "b went back to sleep: {report:#?}"
        );
    }
    assert_eq!(drained.requests.failed, 0, "{:?}", drained.failures);
    // Without the drain the streams b still held were cut: by its fences (the routers end them
    // with the retryable error) or by its sleep (aborted), whichever came first.
    assert!(cut.requests.failed > 0, "{:?}", cut.failures);
    assert!(
        cut.failures
            .keys()
            .all(|kind| kind == "cut stream" || kind == "aborted"),
        "{:?}",
        cut.failures
    );
}

const STORM: &str = include_str!("../../examples/gamedays/local/storm.yaml");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_promotion_admission_control_sheds_batch_work_first_and_without_it_nothing_is_shed() {
    // The times the full scenario judges are left to it: here only counts.
    let short = STORM
        .replace("duration: 30s", "duration: 8s")
        .replace("{at: 10s, fault: crash", "{at: 3s, fault: crash")
        .replace(", interactiveStormTtftWithin: 2.0", "");
    let reports = run_plan(&short).await;
    let [without, with] = &reports[..] else {
        unreachable!()
    };
    for report in &reports {
        assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
        assert_eq!(report.transitions.len(), 1);
    }
    assert_eq!(without.requests.shed, 0, "{:?}", without.shed_by_priority);
    assert!(with.requests.shed > 0, "{:?}", with.requests);
    let shed = |class: &str| with.shed_by_priority.get(class).copied().unwrap_or(0);
    assert!(
        shed("batch") >= shed("interactive"),
        "{:?}",
        with.shed_by_priority
    );
    let notes: Vec<&str> = with.transitions[0]
        .steps
        .iter()
        .filter_map(|s| s.note.as_deref())
        .collect();
    assert!(
        notes.iter().any(|n| n.contains("opened a 10s admission window")),
        "{notes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_standby_asleep_at_level_two_is_woken_on_promotion_and_the_wake_is_timed_apart() {
    let short = include_str!("../../examples/gamedays/local/warm-level-2.yaml")
        .replace("duration: 20s", "duration: 6s")
        .replace("{at: 8s, fault: crash", "{at: 2s, fault: crash");
    let report = run_scenario(&short).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    let promotion = &report.transitions[0];
    let wake = promotion.steps.iter().find(|s| s.step == "Wake").unwrap();
    assert_eq!(
        wake.note
            .as_deref()
            .map(|n| n.starts_with("woke 2 replica(s) of b from level-2 sleep")),
        Some(true),
        "{wake:?}"
    );
    assert!(promotion.stage_ms.is_some() && promotion.orchestration_ms.is_some());
    assert_eq!(report.requests.failed, report.failed_in_flight_at_fault);
    // Each woken replica has its own row: its wake, then its first token.
    assert_eq!(report.cold_starts.len(), 2);
    for cold in &report.cold_starts {
        let stages: Vec<&str> = cold.stages.iter().map(|s| s.stage).collect();
        assert_eq!(
            (cold.tier, stages),
            ("warm", vec!["wake", "first-token"]),
            "{cold:?}"
        );
        assert!(cold.stages.iter().all(|s| s.ms.is_some()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pilot_light_is_started_on_promotion_and_each_replica_is_timed_stage_by_stage() {
    let short = include_str!("../../examples/gamedays/local/pilot-light.yaml")
        .replace("duration: 20s", "duration: 6s")
        .replace("{at: 8s, fault: crash", "{at: 2s, fault: crash");
    let report = run_scenario(&short).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    let promotion = &report.transitions[0];
    let scale = promotion.steps.iter().find(|s| s.step == "Scale").unwrap();
    assert!(
        scale
            .note
            .as_deref()
            .is_some_and(|n| n.starts_with("started 3 pilot-light replica(s) of b")),
        "{scale:?}"
    );
    // The route moved with the three of four (a majority) that answered, and took the fourth
    // once it did.
    let to_b = routed_to(&report, "b");
    assert!(to_b.first().is_some_and(|&n| n >= 3), "{:?}", report.routes);
    assert_eq!(to_b.last(), Some(&4), "{:?}", report.routes);
    let mut names: Vec<&str> = report.cold_starts.iter().map(|c| c.replica.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["b-1", "b-2", "b-3"]);
    for cold in &report.cold_starts {
        // Every stage the emulator's log shows is timed, and the first token after them.
        assert!(cold.stages.iter().all(|s| s.ms.is_some()), "{cold:?}");
        assert_eq!(cold.stages.len(), 5);
        assert!(cold.to_first_token_ms.is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_004_routes_at_half_capacity_grows_the_route_with_its_pilot_light_and_never_fails_back() {
    let report = run_scenario(include_str!("../../examples/gamedays/local/seed-004.yaml")).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    assert_eq!(
        report.transitions.len(),
        1,
        "one failover and no failback: {report:#?}"
    );
    assert_eq!(report.transitions[0].to, "b");
    let to_b = routed_to(&report, "b");
    // Routed at the four warm replicas (a pilot-light one cannot be ready by then: its modelled
    // compile alone takes eight seconds), then grown to all eight as the pilot light passed.
    assert_eq!(to_b.first(), Some(&4), "{:?}", report.routes);
    assert_eq!(to_b.last(), Some(&8), "{:?}", report.routes);
    assert!(to_b.windows(2).all(|w| w[0] < w[1]), "{:?}", report.routes);
    assert_eq!(
        report
            .cold_starts
            .iter()
            .filter(|c| c.tier == "pilot-light")
            .count(),
        4
    );
    assert!(
        report.cold_starts.iter().all(|c| c.to_first_token_ms.is_some()),
        "every started or woken replica answered: {:?}",
        report.cold_starts
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_deadline_a_promotion_routes_the_one_replica_that_serves_and_the_pilot_light_joins_later() {
    let report = run_scenario(include_str!("../../examples/gamedays/local/deadline.yaml")).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    let promotion = &report.transitions[0];
    let serving = promotion.steps.iter().find(|s| s.step == "AwaitServing").unwrap();
    assert!(
        serving.note.as_deref().is_some_and(|n| n.starts_with(
            "past the promotion's deadline of 2.2s, the route moves to what serves: 1 of 4 replica(s) of b"
        )),
        "{serving:?}"
    );
    let to_b = routed_to(&report, "b");
    assert_eq!(to_b.first(), Some(&1), "{:?}", report.routes);
    assert_eq!(to_b.last(), Some(&4), "{:?}", report.routes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drifted_standby_is_not_promoted_until_an_operator_forces_it() {
    let short = include_str!("../../examples/gamedays/local/drifted-standby.yaml")
        .replace("duration: 20s", "duration: 9s")
        .replace("{at: 8s, fault: crash", "{at: 2s, fault: crash")
        .replace(
            "{at: 12s, command: force-failover}",
            "{at: 6s, command: force-failover}",
        );
    let report = run_scenario(&short).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    let parity = report.parity.as_ref().unwrap();
    assert!(parity.keys().contains(&"flag.max-model-len"), "{parity:?}");
    assert!(
        report
            .held_back
            .iter()
            .any(|l| l.ends_with("promotion blocked: ParityBroken")),
        "{:?}",
        report.held_back
    );
    let promotion = &report.transitions[0];
    assert_eq!((promotion.kind.as_str(), promotion.to.as_str()), ("forced", "b"));
    // Nothing was promoted before the command: the promotion starts after it.
    assert!(promotion.started_ms >= 6_000.0, "{promotion:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_lease_store_lost_control_pauses_and_the_promotion_waits_for_it() {
    let short = include_str!("../../examples/gamedays/local/lost-lease.yaml")
        .replace("duration: 20s", "duration: 10s")
        .replace(
            "{at: 5s, fault: lost-lease, for: 6s}",
            "{at: 1s, fault: lost-lease, for: 5s}",
        )
        .replace("{at: 7s, fault: crash", "{at: 2s, fault: crash");
    let report = run_scenario(&short).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    assert!(
        report.held_back[0].ends_with("control paused"),
        "{:?}",
        report.held_back
    );
    let lease_back = report.faults[0].ended_ms.unwrap();
    assert!(report.transitions[0].started_ms >= lease_back, "{report:#?}");
    assert_eq!(report.requests.failed, report.failed_in_flight_at_fault);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_primary_keeps_its_standby_under_manual_failback_and_gets_the_role_back_under_automatic() {
    let short = include_str!("../../examples/gamedays/local/flapping.yaml")
        .replace("duration: 28s", "duration: 12s")
        .replace(
            "{at: 5s, fault: hang, pool: a, for: 4s}",
            "{at: 1s, fault: hang, pool: a, for: 3s}",
        )
        .replace(
            "{at: 17s, fault: hang, pool: a, for: 4s}",
            "{at: 11s, fault: hang, pool: a, for: 1s}",
        )
        .replace("minDwell: 5s", "minDwell: 2s")
        .replace("expect: {failovers: 1}", "expect: {}")
        .replace("expect: {failovers: 4}", "expect: {}");
    let mut kinds = Vec::new();
    for report in run_plan(&short).await {
        assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
        kinds.push(
            report
                .transitions
                .iter()
                .map(|t| t.kind.clone())
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(kinds[0], ["failover"]);
    assert_eq!(kinds[1][..2], ["failover", "failback"], "{kinds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_both_pools_down_nothing_fails_over_and_clients_are_told_to_come_back_later() {
    // Both pools crash together; without a waiting room the routers answer at once.
    let both = SHORT_CRASH
        .replace(
            "  - {at: 3s, fault: crash, pool: a}\n",
            "  - {at: 3s, fault: crash, pool: a}\n  - {at: 3s, fault: crash, pool: b}\n",
        )
        .replace("failovers: 1", "failovers: 0")
        .replace("  maxFailedSentAfterFault: 0\n", "")
        .replace("duration: 8s", "duration: 6s")
        + "router: {waitingRoom: false}\n";
    let report = run_scenario(&both).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    // No promotion to a pool that is down too, and no ping-pong: the epoch never moved.
    assert!(report.transitions.is_empty(), "{:?}", report.transitions);
    assert_eq!(report.faults.len(), 2);
    // What clients saw once both were down: the router's own 503 `unavailable` at once (it
    // carries Retry-After: router/tests/gateway.rs), not a hang.
    assert!(
        report.failures.get("http 503 unavailable").copied().unwrap_or(0) > 0,
        "{:?}",
        report.failures
    );
    assert!(report.failed_before_reaching_a_replica > 0, "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_behind_a_green_health_blinds_the_health_checked_baseline_and_not_the_generating_probes()
 {
    let [baseline, ours] =
        &run_plan(include_str!("../../examples/gamedays/local/hung-engine.yaml")).await[..]
    else {
        panic!("two runs");
    };
    // The baseline never noticed: nothing failed over, and every request sent after the hang
    // failed, as its client saw it.
    assert_eq!(baseline.verdict, Verdict::Passed, "{baseline:#?}");
    assert!(baseline.transitions.is_empty(), "{:?}", baseline.transitions);
    let after = baseline.requests.failed - baseline.failed_in_flight_at_fault;
    assert!(after > 20, "{:?}", baseline.requests);
    // Generating probes saw it: b took over, and nothing sent after the hang was lost, streams
    // whose 200 head had come from the hung engine included.
    assert_eq!(ours.verdict, Verdict::Passed, "{ours:#?}");
    assert_eq!(
        ours.requests.failed, ours.failed_in_flight_at_fault,
        "{:?}",
        ours.requests
    );
    assert!(ours.requests.moved > 0, "{:?}", ours.requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_cut_off_from_the_grantor_and_its_peers_stops_serving_and_the_standby_waits_out_its_grants()
{
    let report = run_scenario(include_str!("../../examples/gamedays/local/partition.yaml")).await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    let [cut] = report.self_fence.as_slice() else {
        panic!("one partition: {:?}", report.self_fence)
    };
    assert_eq!(
        (cut.pool.as_str(), cut.fences, cut.served_again),
        ("a", 2, 0),
        "{cut:?}"
    );
    assert!(cut.stopped_after_ms.is_some(), "{cut:?}");
    // The standby's fences could not be told a's were revoked: each waited, then served, and
    // the first of them seen serving was seen after every one of a's was seen stopped.
    let fences = |pool: &str, standing: &str, epoch: u64| -> std::collections::BTreeMap<String, u64> {
        let mut first = std::collections::BTreeMap::new();
        for s in report.fence_standings.iter() {
            if s.pool == pool && s.standing == standing && s.epoch == Some(epoch) {
                first.entry(s.fence.clone()).or_insert(s.at_ms);
            }
        }
        first
    };
    let (waiting, serving, stopped) = (
        fences("b", "waiting", 1),
        fences("b", "serving", 1),
        fences("a", "expired", 0),
    );
    assert_eq!(
        (waiting.len(), serving.len(), stopped.len()),
        (2, 2, 2),
        "{:?}",
        report.fence_standings
    );
    let last_stop = stopped.values().max().unwrap();
    assert!(
        serving.values().all(|at| at > last_stop),
        "{:?}",
        report.fence_standings
    );
    // And a's fences, once they stopped, never served at epoch 0 again.
    let a_served_after = report.fence_standings.iter().any(|s| {
        s.pool == "a"
            && s.at_ms > *last_stop
            && s.epoch == Some(0)
            && (s.standing == "serving" || s.standing == "failsafe")
    });
    assert!(!a_served_after, "{:?}", report.fence_standings);
    assert_eq!(report.transitions.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_control_plane_lost_the_primary_serves_on_under_grants_its_peers_vouch_for() {
    let report = run_scenario(include_str!(
        "../../examples/gamedays/local/lost-control-plane.yaml"
    ))
    .await;
    assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    assert_eq!((report.requests.failed, report.transitions.len()), (0, 0));
    let on_failsafe: std::collections::BTreeSet<&str> = report
        .fence_standings
        .iter()
        .filter(|s| s.pool == "a" && s.standing == "failsafe")
        .map(|s| s.fence.as_str())
        .collect();
    let on_failsafe = on_failsafe.len();
    assert_eq!(
        on_failsafe, 2,
        "both of a's fences extended: {:?}",
        report.fence_standings
    );
    assert!(
        report.grants.iter().any(|g| g.contains("no grants renewed")),
        "{:?}",
        report.grants
    );
    assert!(report.fence_standings.iter().all(|s| s.standing != "expired"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_with_half_the_capacity_answers_its_probes_and_fails_its_load_proof() {
    let reports = run_plan(include_str!("../../examples/gamedays/local/load-proof.yaml")).await;
    let [half, full] = &reports[..] else {
        panic!("two runs")
    };
    for report in &reports {
        println!("{}: {}", report.name, report.load_proof.as_ref().unwrap().line());
        assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
    }
    let (half, full) = (
        half.load_proof.as_ref().unwrap(),
        full.load_proof.as_ref().unwrap(),
    );
    // Every replica of both standbys answered its probe: only the replay told them apart.
    assert_eq!((half.answered_probe, half.replicas), (1, 1));
    assert_eq!((full.answered_probe, full.replicas), (2, 2));
    assert_eq!(half.proven, Some(false));
    assert!(half.broken.iter().any(|b| b.starts_with("TTFT p99")), "{half:?}");
    assert_eq!(full.proven, Some(true));
    assert!(half.ttft_p99_ms > full.ttft_p99_ms, "{half:?} / {full:?}");
    assert!(half.requests > 20 && full.requests > 20, "{half:?} / {full:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_version_rolls_to_the_primary_only_after_the_standby_passed_on_it_and_never_when_it_failed_there()
 {
    use understudy_api::crd::RolloutPhase;

    let reports = run_plan(include_str!("../../examples/gamedays/local/rollout.yaml")).await;
    let [sound, broken] = &reports[..] else {
        panic!("two runs")
    };
    for report in &reports {
        println!(
            "{}:\n{}",
            report.name,
            report.rollout.as_ref().unwrap().lines().join("\n")
        );
        assert_eq!(report.verdict, Verdict::Passed, "{report:#?}");
        assert!(report.transitions.is_empty(), "nothing fails over");
    }

    // Sound: the standby's two replicas first, then, once the decision let it go, the primary's.
    let rollout = sound.rollout.as_ref().unwrap();
    let phases: Vec<RolloutPhase> = rollout.phases.iter().map(|p| p.phase).collect();
    assert_eq!(
        phases,
        [
            RolloutPhase::UpToDate,
            RolloutPhase::Holding,
            RolloutPhase::Proving,
            RolloutPhase::Rolling,
            RolloutPhase::UpToDate
        ]
    );
    let let_go = rollout.phases[3].at_ms;
    let (standby, primary) = (rollout.replaced_in("b"), rollout.replaced_in("a"));
    assert_eq!((standby.len(), primary.len()), (2, 2), "{rollout:?}");
    let standby_ready = standby.iter().map(|r| r.at_ms + r.took_ms).fold(0.0, f64::max);
    for replaced in &primary {
        assert!(
            replaced.at_ms >= let_go && replaced.at_ms >= standby_ready,
            "{rollout:?}"
        );
    }
    assert!(
        sound.parity.as_ref().unwrap().holds(),
        "both pools run the new version"
    );

    // Broken: the standby fails on it, the rollout stops, and the primary runs what it ran.
    let rollout = broken.rollout.as_ref().unwrap();
    let stopped = rollout.last_phase().unwrap();
    assert_eq!(stopped.phase, RolloutPhase::Stopped);
    assert!(
        stopped.message.contains("failed 3 checks in a row"),
        "{stopped:?}"
    );
    assert_eq!(rollout.replaced_in("b").len(), 2);
    assert!(rollout.replaced_in("a").is_empty(), "the primary is untouched");
    assert!(rollout.replaced.iter().all(|r| r.pool == "b"));
    assert_eq!(broken.requests.failed, 0);
    let drift = broken.parity.as_ref().unwrap().keys();
    assert!(drift.contains(&"flag.emu-fault"), "{drift:?}");
}
