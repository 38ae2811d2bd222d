//! What a route move does to the requests the routers hold, over real sockets: a request a hung
//! replica took, with no first byte yet, is sent to the new primary when the route moves, a stream
//! whose engine hung after its head as vLLM's does too (and not
//! when the same endpoints take the route again at a new epoch); a fence that has not read the new
//! epoch yet holds its endpoint back for a moment and never ejects it, so requests waiting through
//! a promotion are served as soon as the fence serves.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use support::{Emulator, FenceSidecar, Router, completion, counting_silent_endpoint, read_head, route};
use understudy_api::lease::{EpochLease, LeaseError, LeaseRecord, MemoryLease};
use understudy_core::Epoch;
use understudy_emulator::local::ClosedPort;
use understudy_router::fence_sidecar::LeaseSource;
use understudy_router::gateway::GatewayConfig;

/// Sends `n` completions through `router` at once, each on its own thread; their statuses come
/// back on the handles.
fn send_at_once(router: &Arc<Router>, n: usize) -> Vec<std::thread::JoinHandle<(u16, Instant)>> {
    (0..n)
        .map(|_| {
            let router = Arc::clone(router);
            std::thread::spawn(move || {
                let reply = router.complete(&completion(4, false), &[]);
                (reply.status, Instant::now())
            })
        })
        .collect()
}

/// Waits until `count` reaches `n` (20 s at most).
fn wait_for_count(count: &AtomicUsize, n: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while count.load(SeqCst) < n {
        assert!(Instant::now() < deadline, "{what}: {} of {n}", count.load(SeqCst));
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn metric(router: &Router, name: &str) -> u64 {
    let text = router.admin_get("/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[test]
fn requests_a_hung_replica_took_are_sent_to_the_new_primary_when_the_route_moves() {
    let (hung, taken) = counting_silent_endpoint();
    let standby = Emulator::fast();
    let router = Arc::new(Router::start(GatewayConfig::default(), None));
    assert_eq!(router.put_route(&route("a", 1, &[hung])).status, 200);
    let clients = send_at_once(&router, 5);
    wait_for_count(&taken, 5, "the hung replica took");
    assert_eq!(router.put_route(&route("b", 2, &[standby.addr()])).status, 200);
    for client in clients {
        let (status, _) = client.join().unwrap();
        assert_eq!(status, 200, "served by the new primary");
    }
    assert_eq!(metric(&router, "understudy_router_requests_moved_total"), 5);
    assert_eq!(
        metric(&router, "understudy_router_retries_total"),
        0,
        "a move is not a retry"
    );
}

#[test]
fn streams_a_hung_engine_gave_only_their_head_are_sent_to_the_new_primary_when_the_route_moves() {
    // vLLM sends a stream's 200 head before the engine has produced anything: a stopped engine's
    // streams have a head and no byte of body, which the router must not take for an answer.
    let hung = Emulator::fast();
    hung.inject("engine-hung");
    let standby = Emulator::fast();
    let router = Arc::new(Router::start(GatewayConfig::default(), None));
    assert_eq!(router.put_route(&route("a", 1, &[hung.addr()])).status, 200);
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let router = Arc::clone(&router);
            std::thread::spawn(move || router.complete(&completion(4, true), &[]))
        })
        .collect();
    // Each stream's head reached the router, which holds it: the hung engine's access lines say
    // it answered them.
    let deadline = Instant::now() + Duration::from_secs(20);
    while hung.log().matches("POST /v1/completions HTTP/1.1\" 200").count() < 3 {
        assert!(
            Instant::now() < deadline,
            "the hung engine took no streams:\n{}",
            hung.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(router.put_route(&route("b", 2, &[standby.addr()])).status, 200);
    for client in clients {
        let reply = client.join().unwrap();
        assert_eq!(reply.status, 200);
        assert!(
            reply.text().ends_with("data: [DONE]\n\n"),
            "a whole stream: {}",
            reply.text()
        );
    }
    assert_eq!(metric(&router, "understudy_router_requests_moved_total"), 3);
}

/// An endpoint that answers each request 200 once `release` is set; counts what it took.
fn answers_when_released(release: Arc<AtomicBool>) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let taken = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&taken);
    std::thread::spawn(move || {
        for mut s in listener.incoming().map_while(Result::ok) {
            read_head(&mut s);
            count.fetch_add(1, SeqCst);
            let release = Arc::clone(&release);
            std::thread::spawn(move || {
                while !release.load(SeqCst) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let body = r#"{"choices":[{"text":"Paris"}]}"#;
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    (addr, taken)
}

#[test]
fn a_route_taken_again_at_a_new_epoch_by_the_same_endpoints_keeps_its_requests() {
    let release = Arc::new(AtomicBool::new(false));
    let (slow, taken) = answers_when_released(Arc::clone(&release));
    let router = Arc::new(Router::start(GatewayConfig::default(), None));
    assert_eq!(router.put_route(&route("a", 1, &[slow])).status, 200);
    let clients = send_at_once(&router, 3);
    wait_for_count(&taken, 3, "the replica took");
    assert_eq!(router.put_route(&route("a", 2, &[slow])).status, 200);
    release.store(true, SeqCst);
    for client in clients {
        assert_eq!(client.join().unwrap().0, 200);
    }
    assert_eq!(taken.load(SeqCst), 3, "each request was sent once");
    assert_eq!(metric(&router, "understudy_router_requests_moved_total"), 0);
}

/// A Lease store that answers the fence with the record it held when `stale` was set, for as
/// long as it stays set: the slow store, or the slow watch, that keeps a fence from reading a
/// new epoch.
#[derive(Clone)]
struct Lagging {
    lease: MemoryLease,
    stale: Arc<AtomicBool>,
    held: Arc<std::sync::Mutex<Option<LeaseRecord>>>,
}

impl LeaseSource for Lagging {
    async fn read_lease(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        let now = self.lease.read().await?;
        let mut held = self.held.lock().unwrap();
        if !self.stale.load(SeqCst) {
            held.clone_from(&now);
            return Ok(now);
        }
        Ok(held.clone())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_through_a_promotion_are_served_once_the_new_fences_read_the_epoch() {
    const POLL: Duration = Duration::from_millis(100);
    const WAITING: usize = 30;
    let lease = MemoryLease::new();
    let first = lease.create("pool-a", Epoch(1)).await.unwrap();
    let dead = ClosedPort::bind();
    let old = FenceSidecar::start(lease.clone(), "pool-a", dead.addr(), POLL);
    let standby = Emulator::fast();
    let stale = Arc::new(AtomicBool::new(true));
    let lagging = Lagging {
        lease: lease.clone(),
        stale: Arc::clone(&stale),
        held: Arc::default(),
    };
    let new = FenceSidecar::start(lagging, "pool-b", standby.addr(), POLL);
    let router = Arc::new(Router::start(GatewayConfig::default(), None));
    let old_fence = SocketAddr::from(([127, 0, 0, 1], old.port));
    let new_fence = SocketAddr::from(([127, 0, 0, 1], new.port));
    assert_eq!(router.put_route(&route("pool-a", 1, &[old_fence])).status, 200);
    // The primary's replica is dead: every request waits in the router.
    let clients = send_at_once(&router, WAITING);
    let r = Arc::clone(&router);
    tokio::task::spawn_blocking(move || {
        r.wait_for_metrics("every request waiting", |m| {
            m.contains(&format!("understudy_router_queue_depth {WAITING}"))
        });
    })
    .await
    .unwrap();
    // The promotion: the Lease moves and the route is pushed at once, while the new pool's fence
    // still reads the old Lease.
    lease.compare_and_set(&first, "pool-b", Epoch(2)).await.unwrap();
    let ejections_before = metric(&router, "understudy_router_ejections_total");
    assert_eq!(router.put_route(&route("pool-b", 2, &[new_fence])).status, 200);
    tokio::time::sleep(POLL * 5).await;
    let released = Instant::now();
    stale.store(false, SeqCst);
    let answers: Vec<(u16, Instant)> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    assert!(answers.iter().all(|(status, _)| *status == 200), "{answers:?}");
    let first_success = answers.iter().map(|(_, at)| *at).min().unwrap();
    // The fence's refusals held its endpoint back and never ejected it (each ejection was a
    // second or more without a success, 14 s for 30 waiting requests before).
    assert_eq!(
        metric(&router, "understudy_router_ejections_total"),
        ejections_before,
        "a fence that has not read the epoch yet is not a failed endpoint"
    );
    assert!(metric(&router, "understudy_router_fence_holds_total") > 0);
    let signals = router.admin_get("/signals").json();
    assert_eq!(signals["pools"][0]["endpoints"][0]["ejected"], false, "{signals}");
    // Timings on a shared machine are not asserted; what it was, for the reader.
    eprintln!(
        "first success {:?} after the fence could read the epoch (it reads every {POLL:?})",
        first_success.saturating_duration_since(released)
    );
}
