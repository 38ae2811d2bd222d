//! The fence sidecar end to end: in front of an emulated replica, watching an in-memory epoch
//! Lease, it refuses generation once its pool loses the Lease (also when the Lease moved while
//! the sidecar could not read it), and keeps answering probes and control calls; and a gateway in
//! front of fences tries another endpoint when a fence answers for a replica that never took the
//! request.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod router_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use router_support::{Emulator, FenceSidecar, Router, completion, request, route};
use understudy_api::lease::{EpochLease, LeaseError, LeaseRecord, MemoryLease, Unreachable};
use understudy_core::Epoch;
use understudy_router::fence_sidecar::LeaseSource;
use understudy_router::gateway::GatewayConfig;
use understudy_tests::ClosedPort;

const POLL: Duration = Duration::from_millis(20);

/// A view of the Lease that a network partition can cut off from this sidecar alone.
#[derive(Clone)]
struct Partitioned {
    lease: MemoryLease,
    cut: Arc<AtomicBool>,
}

impl LeaseSource for Partitioned {
    async fn read_lease(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        if self.cut.load(Ordering::Relaxed) {
            return Err(LeaseError::Unreachable(Unreachable::MemoryStoreDown));
        }
        self.lease.read().await
    }
}

fn generate(port: u16) -> router_support::Reply {
    request(port, "POST", "/v1/completions", &[], &completion(4, false))
}

/// Polls until a completion through the sidecar answers `status` (20 s at most).
fn wait_for_status(port: u16, status: u16) -> router_support::Reply {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = generate(port);
        if reply.status == status {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "never {status}; last: {} {}",
            reply.status,
            reply.text()
        );
        std::thread::sleep(POLL);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_loses_the_lease_refuses_generation_but_answers_probes_and_control_calls() {
    let e = Emulator::start(
        &["--emu-zero-cost", "--enable-sleep-mode"],
        &[("VLLM_SERVER_DEV_MODE", "1")],
    );
    let lease = MemoryLease::new();
    let first = lease.create("pool-a", Epoch(1)).await.unwrap();
    let fence = FenceSidecar::start(lease.clone(), "pool-a", e.addr(), POLL);
    let port = fence.port;
    tokio::task::spawn_blocking(move || wait_for_status(port, 200))
        .await
        .unwrap();
    lease.compare_and_set(&first, "pool-b", Epoch(2)).await.unwrap();
    let refused = tokio::task::spawn_blocking(move || wait_for_status(port, 503))
        .await
        .unwrap();
    assert_eq!(refused.header("x-understudy-fenced").as_deref(), Some("2"));
    assert_eq!(refused.json()["error"]["type"], "fenced");
    let (health, sleeping, metrics) = tokio::task::spawn_blocking(move || {
        (
            request(port, "GET", "/health", &[], "").status,
            request(port, "GET", "/is_sleeping", &[], "").status,
            request(port, "GET", "/metrics", &[], "").status,
        )
    })
    .await
    .unwrap();
    assert_eq!((health, sleeping, metrics), (200, 200, 200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_old_primary_that_comes_back_fences_itself() {
    let e = Emulator::start(&["--emu-zero-cost"], &[]);
    let lease = MemoryLease::new();
    let first = lease.create("pool-a", Epoch(4)).await.unwrap();
    let cut = Arc::new(AtomicBool::new(false));
    let view = Partitioned {
        lease: lease.clone(),
        cut: Arc::clone(&cut),
    };
    let fence = FenceSidecar::start(view, "pool-a", e.addr(), POLL);
    let port = fence.port;
    tokio::task::spawn_blocking(move || wait_for_status(port, 200))
        .await
        .unwrap();
    // Away: the sidecar cannot read the Lease, and the operator promotes pool-b meanwhile.
    cut.store(true, Ordering::Relaxed);
    tokio::time::sleep(POLL * 5).await;
    // An unreadable Lease is not a failover: the sidecar keeps its last verdict and serves.
    let during = tokio::task::spawn_blocking(move || generate(port)).await.unwrap();
    assert_eq!(
        during.status, 200,
        "a store outage must not fence a pool that held the Lease"
    );
    lease.compare_and_set(&first, "pool-b", Epoch(5)).await.unwrap();
    // Back: the first read after the partition fences it.
    cut.store(false, Ordering::Relaxed);
    let refused = tokio::task::spawn_blocking(move || wait_for_status(port, 503))
        .await
        .unwrap();
    assert_eq!(refused.header("x-understudy-fenced").as_deref(), Some("5"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_lease_the_sidecar_fails_closed() {
    let e = Emulator::start(&["--emu-zero-cost"], &[]);
    let fence = FenceSidecar::start(MemoryLease::new(), "pool-a", e.addr(), POLL);
    let port = fence.port;
    let reply = tokio::task::spawn_blocking(move || generate(port)).await.unwrap();
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-understudy-fenced").as_deref(), Some("0"));
}

/// The statuses of twelve completions through a gateway whose route is the fences on `ports`.
async fn twelve_through_a_gateway(ports: &[u16]) -> Vec<u16> {
    let router = Router::start(GatewayConfig::default(), None);
    let endpoints: Vec<std::net::SocketAddr> = ports
        .iter()
        .map(|port| std::net::SocketAddr::from(([127, 0, 0, 1], *port)))
        .collect();
    assert_eq!(router.put_route(&route("pool-a", 1, &endpoints)).status, 200);
    tokio::task::spawn_blocking(move || {
        (0..12)
            .map(|_| router.complete(&completion(4, false), &[]).status)
            .collect()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_retries_past_a_fence_whose_replica_refuses_and_past_a_fenced_one() {
    let live = Emulator::start(&["--emu-zero-cost"], &[]);
    let dead = ClosedPort::bind();
    let lease = MemoryLease::new();
    lease.create("pool-a", Epoch(1)).await.unwrap();
    let in_front_of_dead = FenceSidecar::start(
        lease.clone(),
        "pool-a",
        std::net::SocketAddr::from(([127, 0, 0, 1], dead.port)),
        POLL,
    );
    let fenced = FenceSidecar::start(lease.clone(), "pool-b", live.addr(), POLL);
    let serving = FenceSidecar::start(lease.clone(), "pool-a", live.addr(), POLL);
    let port = serving.port;
    tokio::task::spawn_blocking(move || wait_for_status(port, 200))
        .await
        .unwrap();
    let answers = twelve_through_a_gateway(&[in_front_of_dead.port, fenced.port, serving.port]).await;
    // The dead replica's fence answers 502 and the fenced one 503, each marked as never served:
    // every request is retried until the serving endpoint answers it.
    assert!(answers.iter().all(|status| *status == 200), "{answers:?}");
}

/// A replica that takes every request and dies before answering: it reads the request and
/// closes the connection, at most `count` times.
fn dies_holding_requests(count: usize) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(count) {
            let Ok(mut stream) = stream else { continue };
            let mut buf = [0u8; 4096];
            let _ = std::io::Read::read(&mut stream, &mut buf);
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_dies_holding_a_request_behind_a_fence_is_retried_as_a_reset() {
    let live = Emulator::start(&["--emu-zero-cost"], &[]);
    let lease = MemoryLease::new();
    lease.create("pool-a", Epoch(1)).await.unwrap();
    let dying = FenceSidecar::start(lease.clone(), "pool-a", dies_holding_requests(64), POLL);
    let serving = FenceSidecar::start(lease.clone(), "pool-a", live.addr(), POLL);
    let port = serving.port;
    tokio::task::spawn_blocking(move || wait_for_status(port, 200))
        .await
        .unwrap();
    // The fence says why it answered for its replica.
    let dying_port = dying.port;
    let marked = tokio::task::spawn_blocking(move || generate(dying_port))
        .await
        .unwrap();
    assert_eq!(marked.status, 502);
    assert_eq!(marked.header("x-understudy-not-served").as_deref(), Some("reset"));
    let answers = twelve_through_a_gateway(&[dying.port, serving.port]).await;
    // Without the mark the fence's 502 would be the replica's own answer, and passed on.
    assert!(answers.iter().all(|status| *status == 200), "{answers:?}");
}
