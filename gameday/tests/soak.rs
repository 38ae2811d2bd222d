//! The soak, short: real emulator and gateway processes on loopback, a replica killed, a replica
//! stopped and a gateway restarted by SIGTERM under load. With the gateways' drain the soak
//! passes; without it, the requests sent to a gateway that stopped listening are caught as failed
//! before any replica took them. Asserts counts, never times.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use understudy_gameday::local::replicas::Launcher;
use understudy_gameday::soak::{self, SoakConfig, SoakFault, SoakReport};

async fn soak(drain_delay: Duration) -> SoakReport {
    let emulator = Launcher {
        program: PathBuf::from(env!("CARGO_BIN_EXE_understudy-gameday")),
        prefix: vec!["emulator".to_owned()],
    };
    let router = Launcher {
        program: PathBuf::from(env!("CARGO_BIN_EXE_understudy-gameday")),
        prefix: vec!["router".to_owned()],
    };
    // Faults at 3, 6 and 9 s: one of each kind.
    let config = SoakConfig {
        duration: Duration::from_secs(12),
        fault_every: Duration::from_secs(3),
        rate: 60.0,
        drain_delay,
        ..SoakConfig::default()
    };
    soak::run(&emulator, &router, &config).await.unwrap()
}

fn kinds(report: &SoakReport) -> Vec<SoakFault> {
    report.faults.iter().map(|f| f.fault).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_drain_no_request_fails_before_a_replica_and_no_cut_looks_finished() {
    let report = soak(Duration::from_secs(1)).await;
    let every_kind = [
        SoakFault::ReplicaKilled,
        SoakFault::ReplicaStopped,
        SoakFault::GatewayRestarted,
    ];
    assert_eq!(kinds(&report), every_kind, "{report:#?}");
    assert!(report.passed(), "{}", report.summary());
    assert_eq!(report.failed_before_a_replica, 0, "{report:#?}");
    assert_eq!(report.cut_looking_finished, 0, "{report:#?}");
    assert!(report.sent > 300 && report.streams > 100, "{report:#?}");
    assert!(report.ok * 10 > report.sent * 9, "{}", report.summary());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_drain_a_restarted_gateway_refuses_requests_and_the_soak_fails() {
    let report = soak(Duration::ZERO).await;
    assert!(
        kinds(&report).contains(&SoakFault::GatewayRestarted),
        "{report:#?}"
    );
    // Between SIGTERM and the client's next /ready poll, the gateway no longer listens.
    assert!(report.failed_before_a_replica > 0, "{}", report.summary());
    assert!(!report.passed());
    assert_eq!(report.cut_looking_finished, 0, "{report:#?}");
}
