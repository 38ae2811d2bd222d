//! A load proof's replay against emulated replicas on loopback, real sockets and the emulator's
//! cost model: the same recorded traffic that a full pool serves within its thresholds breaks
//! them on a pool with half its capacity, which answers every probe.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod emulated;

use std::time::Duration;

use emulated::Emulator;
use understudy_core::load_proof::{RequestShape, Thresholds, judge, plan};
use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::probe::{self, ProbeSpec};
use understudy_prober::replay::{ReplayLimits, replay};

/// Two decode slots a replica, 32 tokens at 8 ms each: about 7.8 requests a second a replica.
const CAPACITY: &[&str] = &["--max-num-seqs", "2"];

fn recorded() -> Vec<RequestShape> {
    // Recorded at 10 a second: 20 prompt tokens, 32 asked for, streamed.
    (0..20)
        .map(|i| RequestShape {
            prompt_tokens: 20,
            max_tokens: 32,
            stream: i % 2 == 0,
            priority: "default".to_owned(),
            gap_us: 100_000,
        })
        .collect()
}

fn limits() -> Thresholds {
    Thresholds {
        max_error_rate: 0.0,
        ttft_p99: Duration::from_millis(800),
        itl_p99: Duration::from_millis(250),
    }
}

const BOUNDS: ReplayLimits = ReplayLimits {
    timeout: Duration::from_secs(30),
    stall_after: Duration::from_secs(10),
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_half_the_capacity_passes_its_probes_and_fails_the_load_proof() {
    let replicas = [
        Emulator::ready_with_costs(CAPACITY, &[]),
        Emulator::ready_with_costs(CAPACITY, &[]),
    ];
    let endpoints: Vec<_> = replicas.iter().map(|e| e.endpoint.clone()).collect();
    // Both answer a probe: nothing but load tells the pools apart.
    for e in &endpoints {
        let spec = ProbeSpec {
            model: Some(emulated::MODEL.to_owned()),
            ..ProbeSpec::default()
        };
        let report = probe::probe(e, &spec).await;
        assert!(matches!(report.outcome, ProbeOutcome::Ok { .. }), "{report:?}");
    }
    // 12 a second for 4 s: within the two replicas' ~15.6, past one's ~7.8.
    let plan = plan(&recorded(), 10.0, 1.2, Duration::from_secs(4)).unwrap();
    assert_eq!(plan.len(), 48);

    let full = judge(
        &replay(&endpoints, &plan, Some(emulated::MODEL), BOUNDS).await,
        &limits(),
    );
    let half = judge(
        &replay(&endpoints[..1], &plan, Some(emulated::MODEL), BOUNDS).await,
        &limits(),
    );

    for (pool, v) in [("two replicas", &full), ("one replica", &half)] {
        println!(
            "{pool}: {} requests, {} failed, TTFT p99 {:?}, inter-token p99 {:?}, proven {}",
            v.requests, v.errors, v.ttft_p99, v.itl_p99, v.proven
        );
    }
    assert!(full.proven, "the full pool: {full:?}");
    assert_eq!(full.requests, 48);
    // Every request was answered whole on both; only the half pool kept its clients waiting.
    assert_eq!((full.errors, half.errors), (0, 0), "{half:?}");
    assert!(!half.proven, "the half pool: {half:?}");
    assert!(
        half.broken.iter().any(|b| b.starts_with("TTFT p99")),
        "{:?}",
        half.broken
    );
    assert!(half.ttft_p99 > full.ttft_p99, "{half:?} / {full:?}");
    // Each request streamed its 32 tokens: 31 gaps each.
    assert!(full.itl_p99.is_some());
}

#[tokio::test]
async fn a_replay_to_a_closed_port_fails_every_request_and_sends_no_more_than_planned() {
    let closed = understudy_emulator::local::ClosedPort::bind();
    let endpoint = probe::Endpoint::new("127.0.0.1", closed.port);
    let plan = plan(&recorded(), 10.0, 1.0, Duration::from_millis(500)).unwrap();
    let replayed = replay(&[endpoint], &plan, None, BOUNDS).await;
    assert_eq!(replayed.len(), plan.len());
    let verdict = judge(&replayed, &limits());
    assert_eq!(verdict.errors, plan.len());
    assert!(
        verdict.broken[0].contains(&format!("{0} of {0} requests failed", plan.len())),
        "{:?}",
        verdict.broken
    );
    assert_eq!(replay(&[], &plan, None, BOUNDS).await, vec![]);
}

#[tokio::test(start_paused = true)]
async fn in_paused_time_each_request_is_sent_at_its_planned_time_to_the_microsecond() {
    // Recorded bursty: gaps of 100 ms and 300 ms, replayed at twice the rate for a second.
    let shapes: Vec<RequestShape> = [0, 100_000, 300_000]
        .into_iter()
        .map(|gap_us| RequestShape {
            gap_us,
            ..recorded()[0].clone()
        })
        .collect();
    let plan = plan(&shapes, 5.0, 2.0, Duration::from_secs(1)).unwrap();
    let closed = understudy_emulator::local::ClosedPort::bind();
    let endpoint = probe::Endpoint::new("127.0.0.1", closed.port);
    let replayed = replay(&[endpoint], &plan, None, BOUNDS).await;
    let sent: Vec<Duration> = replayed.iter().map(|r| r.sent_at).collect();
    let planned: Vec<Duration> = plan.iter().map(|p| p.at).collect();
    assert_eq!(sent, planned);
    assert_eq!(
        planned,
        [0, 50, 200, 300, 350, 500, 600, 650, 800, 900, 950].map(Duration::from_millis)
    );
    assert!(replayed.iter().all(|r| r.sent_late.is_zero() && !r.ok));
    let verdict = judge(&replayed, &limits());
    // Ten gaps over the 950 ms from the first send to the last.
    assert_eq!(verdict.sent_rate, Some(10.0 / 0.95));
    assert!(!verdict.replayer_behind());
}
