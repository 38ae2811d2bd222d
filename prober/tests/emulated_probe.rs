//! The prober against the real vLLM emulator on loopback: every probe outcome a replica can
//! cause, from a healthy answer to a stall mid-stream and wrong output after drift.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod emulated;

use std::time::Duration;

use emulated::Emulator;
use understudy_core::failover::CheckResult;
use understudy_emulator::local::ClosedPort;
use understudy_prober::outcome::{ProbeOutcome, pool_verdict};
use understudy_prober::probe::{self, Budget, Endpoint, Expectation, ProbeSpec};

const DEV: &[(&str, &str)] = &[("VLLM_SERVER_DEV_MODE", "1")];

/// Budgets, timeout and stall window far beyond anything loopback takes, so `Ok` never depends
/// on the machine's speed; a test that wants an outcome caused by time tightens one of them and
/// makes the emulator take longer than that.
fn spec() -> ProbeSpec {
    ProbeSpec {
        model: Some(emulated::MODEL.to_string()),
        budget: Budget {
            first_token: Duration::from_secs(60),
            total: Duration::from_secs(60),
        },
        timeout: Duration::from_secs(120),
        stall_after: Duration::from_secs(30),
        ..ProbeSpec::default()
    }
}

/// The golden answer: what a healthy replica of this model says, as a prefix.
async fn golden(e: &Emulator) -> Expectation {
    let report = probe::probe(&e.endpoint, &spec()).await;
    assert!(matches!(report.outcome, ProbeOutcome::Ok { .. }), "{report:?}");
    Expectation::golden_prefix(&report.text, 24)
}

fn with(expect: Expectation) -> ProbeSpec {
    ProbeSpec { expect, ..spec() }
}

#[tokio::test]
async fn a_healthy_replica_answers_the_golden_answer_again_within_budget() {
    let e = Emulator::ready(&[], &[]);
    let expect = golden(&e).await;
    let report = probe::probe(&e.endpoint, &with(expect)).await;
    let ProbeOutcome::Ok { first_token, total } = report.outcome else {
        panic!("{report:?}")
    };
    assert!(first_token <= total);
    assert_eq!(report.first_token, Some(first_token));
}

#[tokio::test]
async fn a_closed_port_and_a_replica_still_loading_weights_are_refused() {
    let closed_port = ClosedPort::bind();
    let closed = probe::probe(&Endpoint::new("127.0.0.1", closed_port.port), &spec()).await;
    assert_eq!(closed.outcome, ProbeOutcome::Refused);
    // 30 GiB at 1 GiB/s: the port refuses for half a minute; the emulator is dropped long before.
    let starting = Emulator::spawn(&["--emu-weights-gib=30", "--emu-load-gib-per-s=1"], &[]);
    starting.wait_for_line("Starting to load model");
    assert_eq!(
        probe::probe(&starting.endpoint, &spec()).await.outcome,
        ProbeOutcome::Refused
    );
}

#[tokio::test]
async fn a_hung_replica_times_out() {
    let e = Emulator::ready(&[], &[]);
    e.inject("hang");
    let quick = ProbeSpec {
        timeout: Duration::from_millis(500),
        ..spec()
    };
    assert_eq!(
        probe::probe(&e.endpoint, &quick).await.outcome,
        ProbeOutcome::Timeout
    );
}

#[tokio::test]
async fn a_dead_engine_is_a_hard_http_error_and_the_pool_fails_hard() {
    let healthy = Emulator::ready(&[], &[]);
    let dead = Emulator::ready(&[], &[("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "1")]);
    dead.inject("engine-dead");
    let outcome = probe::probe(&dead.endpoint, &spec()).await.outcome;
    assert_eq!(outcome, ProbeOutcome::HttpError(500));
    assert!(outcome.is_hard_failure());
    let round = probe::probe_round(
        std::slice::from_ref(&dead.endpoint),
        &spec(),
        1,
        0,
        Duration::ZERO,
    )
    .await;
    let outcomes: Vec<_> = round.into_iter().map(|r| r.outcome).collect();
    assert_eq!(pool_verdict(&outcomes, 1), Some(CheckResult::HardFail));
    let both = probe::probe_round(
        &[healthy.endpoint.clone(), dead.endpoint.clone()],
        &spec(),
        1,
        0,
        Duration::ZERO,
    )
    .await;
    let outcomes: Vec<_> = both.into_iter().map(|r| r.outcome).collect();
    assert_eq!(pool_verdict(&outcomes, 1), Some(CheckResult::Pass));
    assert_eq!(pool_verdict(&outcomes, 2), Some(CheckResult::HardFail));
}

#[tokio::test]
async fn a_probe_for_a_model_the_replicas_do_not_serve_is_rejected_and_judges_nothing() {
    let e = Emulator::ready(&[], &[]);
    let wrong = ProbeSpec {
        model: Some("not/the-served-model".into()),
        ..spec()
    };
    let round = probe::probe_round(std::slice::from_ref(&e.endpoint), &wrong, 1, 0, Duration::ZERO).await;
    let outcomes: Vec<_> = round.into_iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, [ProbeOutcome::HttpError(404)]);
    assert!(outcomes[0].is_probe_rejected());
    assert_eq!(pool_verdict(&outcomes, 1), None);
}

#[tokio::test]
async fn a_half_failed_replica_that_stalls_mid_stream_is_stalled() {
    let e = Emulator::ready(&["--emu-fault=half-failed:stall"], &[]);
    // The stall is forever, so any window shows it.
    let stall = ProbeSpec {
        stall_after: Duration::from_millis(500),
        ..spec()
    };
    let report = probe::probe(&e.endpoint, &stall).await;
    assert_eq!(report.outcome, ProbeOutcome::Stalled, "{report:?}");
    assert!(report.first_token.is_some(), "the stall came after a token");
}

#[tokio::test]
async fn a_half_failed_replica_that_errors_mid_stream_is_an_http_error() {
    let e = Emulator::ready(&["--emu-fault=half-failed:error"], &[]);
    assert_eq!(
        probe::probe(&e.endpoint, &spec()).await.outcome,
        ProbeOutcome::HttpError(500)
    );
}

#[tokio::test]
async fn wrong_output_and_drifted_weights_fail_the_golden_answer() {
    let e = Emulator::ready(&[], &[]);
    let expect = golden(&e).await;
    e.inject("wrong-output");
    assert_eq!(
        probe::probe(&e.endpoint, &with(expect.clone())).await.outcome,
        ProbeOutcome::WrongOutput
    );
    e.inject("clear");
    assert!(matches!(
        probe::probe(&e.endpoint, &with(expect.clone())).await.outcome,
        ProbeOutcome::Ok { .. }
    ));
    e.inject("drift:weights-digest=sha256:older");
    assert_eq!(
        probe::probe(&e.endpoint, &with(expect)).await.outcome,
        ProbeOutcome::WrongOutput
    );
}

#[tokio::test]
async fn a_standby_serving_other_weights_fails_the_primarys_golden_answer() {
    let primary = Emulator::ready(&["--emu-weights-digest=sha256:aaaa"], &[]);
    let standby = Emulator::ready(&["--emu-weights-digest=sha256:bbbb"], &[]);
    let expect = golden(&primary).await;
    let report = probe::probe(&standby.endpoint, &with(expect)).await;
    assert_eq!(report.outcome, ProbeOutcome::WrongOutput, "{report:?}");
}

#[tokio::test]
async fn a_slow_fault_turns_a_passing_probe_too_slow() {
    // 8 tokens at 20 ms; slow:10 makes each 200 ms, so the answer takes at least 1.6 s: over a
    // 0.8 s total budget however fast the machine is.
    let e = Emulator::ready_with_costs(&["--emu-decode-s-per-token=0.02"], &[]);
    assert!(matches!(
        probe::probe(&e.endpoint, &spec()).await.outcome,
        ProbeOutcome::Ok { .. }
    ));
    e.inject("slow:10");
    let tight = ProbeSpec {
        budget: Budget {
            first_token: Duration::from_secs(60),
            total: Duration::from_millis(800),
        },
        ..spec()
    };
    assert_eq!(
        probe::probe(&e.endpoint, &tight).await.outcome,
        ProbeOutcome::TooSlow
    );
}

#[tokio::test]
async fn a_sleeping_replica_is_asleep_and_wakes_to_pass() {
    let e = Emulator::ready(&["--enable-sleep-mode"], DEV);
    assert_eq!(e.post("/sleep?level=1", ""), 200);
    // A request sent while asleep would park until wake and time out; Asleep means none was sent.
    let quick = ProbeSpec {
        timeout: Duration::from_secs(10),
        ..spec()
    };
    assert_eq!(
        probe::probe(&e.endpoint, &quick).await.outcome,
        ProbeOutcome::Asleep
    );
    assert_eq!(
        pool_verdict(&[ProbeOutcome::Asleep], 1),
        Some(CheckResult::Asleep)
    );
    assert_eq!(e.post("/wake_up", ""), 200);
    assert!(matches!(
        probe::probe(&e.endpoint, &spec()).await.outcome,
        ProbeOutcome::Ok { .. }
    ));
}
