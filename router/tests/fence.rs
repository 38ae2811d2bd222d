//! The fence sidecar end to end: in front of an emulated replica, watching an in-memory epoch
//! Lease, it refuses generation once its pool loses the Lease (also when the Lease moved while
//! the sidecar could not read it), keeps answering probes, and passes control calls only with the
//! operator's token; and a gateway in
//! front of fences tries another endpoint when a fence answers for a replica that never took the
//! request.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use support::{Emulator, FenceSidecar, MODEL, Router, completion, request, route, streamed_text};
use understudy_api::fence_fault::{FAULT_PATH, WRONG_ANSWER};
use understudy_api::lease::{EpochLease, LeaseError, LeaseRecord, MemoryLease, Unreachable};
use understudy_core::Epoch;
use understudy_emulator::local::ClosedPort;
use understudy_router::fence_sidecar::LeaseSource;
use understudy_router::gateway::GatewayConfig;

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

fn generate(port: u16) -> support::Reply {
    request(port, "POST", "/v1/completions", &[], &completion(4, false))
}

/// Polls until a completion through the sidecar answers `status` (20 s at most).
fn wait_for_status(port: u16, status: u16) -> support::Reply {
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
async fn a_pool_that_loses_the_lease_refuses_generation_but_answers_probes() {
    let e = Emulator::start(
        &["--emu-zero-cost", "--enable-sleep-mode"],
        &[("VLLM_SERVER_DEV_MODE", "1")],
    );
    let lease = MemoryLease::new();
    let first = lease.create("pool-a", Epoch(1)).await.unwrap();
    let fence = FenceSidecar::start(lease.clone(), "pool-a", e.addr(), POLL);
    let port = fence.port;
    let served = tokio::task::spawn_blocking(move || wait_for_status(port, 200))
        .await
        .unwrap();
    assert_eq!(served.header("x-understudy-served-by").as_deref(), Some("pool-a"));
    lease.compare_and_set(&first, "pool-b", Epoch(2)).await.unwrap();
    let refused = tokio::task::spawn_blocking(move || wait_for_status(port, 503))
        .await
        .unwrap();
    assert_eq!(refused.header("x-understudy-fenced").as_deref(), Some("2"));
    assert_eq!(refused.header("x-understudy-served-by"), None);
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

/// The head of the one request a raw upstream on a free loopback port gets (answered 200).
fn one_request_upstream() -> (std::net::SocketAddr, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (heads, head) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut text = String::new();
        while reader.read_line(&mut text).unwrap() > 2 && !text.ends_with("\r\n\r\n") {}
        (&stream)
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .unwrap();
        let _ = heads.send(text);
    });
    (addr, head)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_calls_pass_only_with_the_operators_token_and_every_serving_path_is_fenced() {
    let e = Emulator::start(
        &["--emu-zero-cost", "--enable-sleep-mode"],
        &[("VLLM_SERVER_DEV_MODE", "1")],
    );
    // Nobody holds the Lease: fenced from the start.
    let fence =
        FenceSidecar::with_control_token(MemoryLease::new(), "pool-a", e.addr(), POLL, Some("op-token"));
    let closed = FenceSidecar::start(MemoryLease::new(), "pool-a", e.addr(), POLL);
    let (port, closed_port) = (fence.port, closed.port);
    let statuses = tokio::task::spawn_blocking(move || {
        let with = |token: &str| [("authorization", format!("Bearer {token}"))];
        let post = |port, path: &str, auth: &[(&str, String)]| {
            let headers: Vec<(&str, &str)> = auth.iter().map(|(k, v)| (*k, v.as_str())).collect();
            request(port, "POST", path, &headers, "{}").status
        };
        [
            // Generation outside /v1/ is fenced like /v1/.
            post(port, "/invocations", &[]),
            post(port, "/inference/v1/generate", &[]),
            post(port, "/v1/completions", &with("op-tok")),
            // The operator's probe passes: it proves the standby through the door clients use.
            request(
                port,
                "POST",
                "/v1/completions",
                &[("authorization", "Bearer op-token")],
                &completion(4, false),
            )
            .status,
            // Control: no token, a wrong one, a longer one, then the operator's.
            post(port, "/sleep?level=1", &[]),
            post(port, "/sleep?level=1", &with("op-tok")),
            post(port, "/sleep?level=1", &with("op-token2")),
            post(port, "/sleep?level=1", &with("op-token")),
            request(port, "GET", "/is_sleeping", &[], "").status,
            // Spelled to slip past: refused before anything else.
            post(port, "/%73leep", &with("op-token")),
            // A fence with no control token opens control to nobody.
            post(closed_port, "/wake_up", &with("op-token")),
        ]
    })
    .await
    .unwrap();
    assert_eq!(statuses, [503, 503, 503, 200, 401, 401, 401, 200, 200, 400, 403]);
    let asleep = tokio::task::spawn_blocking(move || request(port, "GET", "/is_sleeping", &[], ""))
        .await
        .unwrap();
    assert!(asleep.text().contains("true"), "{}", asleep.text());

    // The token stops at the fence: the replica never sees it.
    let (upstream, head) = one_request_upstream();
    let fence =
        FenceSidecar::with_control_token(MemoryLease::new(), "pool-a", upstream, POLL, Some("op-token"));
    let port = fence.port;
    let status = tokio::task::spawn_blocking(move || {
        request(
            port,
            "POST",
            "/wake_up",
            &[("authorization", "Bearer op-token")],
            "",
        )
        .status
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    let head = head.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(head.starts_with("POST /wake_up"), "{head}");
    assert!(!head.to_ascii_lowercase().contains("authorization"), "{head}");
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

/// Sends a streamed completion of `tokens` to `port` and returns once its first bytes came: the
/// stream is running. The rest of the answer comes from the task handed back.
async fn streaming(port: u16, tokens: u32) -> tokio::task::JoinHandle<support::Reply> {
    let (started, running) = tokio::sync::oneshot::channel();
    let reader = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut s = support::send(port, "POST", "/v1/completions", &[], &completion(tokens, true));
        let mut raw = vec![0u8; 512];
        let n = s.read(&mut raw).unwrap();
        raw.truncate(n);
        let _ = started.send(());
        let _ = s.read_to_end(&mut raw);
        support::parse(&raw)
    });
    running.await.unwrap();
    reader
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_running_when_its_pool_loses_the_lease_finishes_within_the_drain_and_is_cut_after_it() {
    // 200 tokens at 20 ms: a four-second stream.
    let e = Emulator::start(&["--emu-decode-s-per-token=0.02"], &[]);
    let lease = MemoryLease::new();
    let first = lease.create("pool-a", Epoch(1)).await.unwrap();
    let drains = FenceSidecar::draining(lease.clone(), "pool-a", e.addr(), POLL, Duration::from_secs(60));
    let cuts = FenceSidecar::draining(
        lease.clone(),
        "pool-a",
        e.addr(),
        POLL,
        Duration::from_millis(200),
    );
    for port in [drains.port, cuts.port] {
        tokio::task::spawn_blocking(move || wait_for_status(port, 200))
            .await
            .unwrap();
    }
    // The one that cuts is behind a gateway, which ends a cut stream for its client.
    let router = Router::start(GatewayConfig::default(), None);
    let behind = std::net::SocketAddr::from(([127, 0, 0, 1], cuts.port));
    assert_eq!(router.put_route(&route("pool-a", 1, &[behind])).status, 200);
    let drained = streaming(drains.port, 200).await;
    let cut = streaming(router.public, 200).await;

    lease.compare_and_set(&first, "pool-b", Epoch(2)).await.unwrap();
    let port = drains.port;
    let refused = tokio::task::spawn_blocking(move || wait_for_status(port, 503))
        .await
        .unwrap();
    assert!(refused.text().contains("fenced"), "new work is refused at once");

    let drained = drained.await.unwrap();
    let text = drained.text();
    assert_eq!(drained.status, 200);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    let cut = cut.await.unwrap();
    let text = cut.text();
    assert!(
        text.contains("upstream_stream_cut") && text.contains("\"retryable\": true"),
        "{text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");
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

/// A fence in front of an emulated replica, holding the Lease, that takes faults with `op-token`.
async fn serving_fence() -> (Emulator, FenceSidecar) {
    let e = Emulator::start(&["--emu-zero-cost"], &[]);
    let lease = MemoryLease::new();
    lease.create("pool-a", Epoch(1)).await.unwrap();
    let fence = FenceSidecar::with_control_token(lease, "pool-a", e.addr(), POLL, Some("op-token"));
    let port = fence.port;
    tokio::task::spawn_blocking(move || wait_for_status(port, 200))
        .await
        .unwrap();
    (e, fence)
}

const OPERATOR: [(&str, &str); 1] = [("authorization", "Bearer op-token")];

fn set_fault(port: u16, headers: &[(&str, &str)], body: &str) -> support::Reply {
    request(port, "PUT", FAULT_PATH, headers, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_failed_fence_answers_every_completion_wrongly_while_health_stays_green() {
    let (_e, fence) = serving_fence().await;
    let port = fence.port;
    tokio::task::spawn_blocking(move || {
        // Only the operator sets a fault, and only one the fence knows, for a bounded time.
        let wrong = r#"{"fault": "wrong-answers", "seconds": 60}"#;
        assert_eq!(set_fault(port, &[], wrong).status, 401);
        assert_eq!(
            set_fault(port, &[("authorization", "Bearer op-tok")], wrong).status,
            401
        );
        let unknown = set_fault(port, &OPERATOR, r#"{"fault": "melt"}"#);
        assert_eq!(unknown.status, 400, "{}", unknown.text());
        assert_eq!(
            set_fault(port, &OPERATOR, r#"{"fault": "hang", "seconds": 0}"#).status,
            400
        );
        assert_eq!(
            set_fault(port, &OPERATOR, r#"{"fault": "hang", "seconds": 3601}"#).status,
            400
        );
        assert_eq!(set_fault(port, &OPERATOR, "{\"fault\": \"ha").status, 400);
        let none = request(port, "GET", FAULT_PATH, &OPERATOR, "");
        assert_eq!(none.json()["fault"], serde_json::Value::Null);
        assert_eq!(generate(port).status, 200);

        let set = set_fault(port, &OPERATOR, wrong);
        assert_eq!(set.status, 200, "{}", set.text());
        assert_eq!(set.json()["fault"], "wrong-answers");
        let left = set.json()["secondsLeft"].as_u64().unwrap();
        assert!((59..=60).contains(&left), "{left}");
        let answer = generate(port);
        assert_eq!(answer.status, 200);
        assert_eq!(answer.json()["choices"][0]["text"], WRONG_ANSWER);
        assert_eq!(answer.json()["model"], MODEL);
        let streamed = request(port, "POST", "/v1/completions", &[], &completion(4, true));
        assert_eq!(
            streamed.header("content-type").as_deref(),
            Some("text/event-stream")
        );
        assert_eq!(streamed_text(&streamed.text()), WRONG_ANSWER);
        let chat = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
        let chat = request(port, "POST", "/v1/chat/completions", &[], &chat.to_string());
        assert_eq!(chat.json()["choices"][0]["message"]["content"], WRONG_ANSWER);
        // The probes a health check reads do not see it.
        assert_eq!(request(port, "GET", "/health", &[], "").status, 200);
        assert_eq!(request(port, "GET", "/v1/models", &[], "").status, 200);

        // Taken away: the replica answers again.
        assert_eq!(set_fault(port, &OPERATOR, r#"{"fault": null}"#).status, 200);
        let answer = generate(port);
        assert_eq!(answer.status, 200);
        let text = answer.json()["choices"][0]["text"].as_str().unwrap().to_owned();
        assert!(!text.is_empty() && text != WRONG_ANSWER, "{text}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_fence_holds_requests_and_probes_unanswered_until_the_hang_is_taken_away() {
    let (_e, fence) = serving_fence().await;
    let port = fence.port;
    tokio::task::spawn_blocking(move || {
        let set = set_fault(port, &OPERATOR, r#"{"fault": "hang", "seconds": 600}"#);
        assert_eq!(set.status, 200, "{}", set.text());
        let held = std::thread::spawn(move || generate(port));
        let health = std::thread::spawn(move || request(port, "GET", "/health", &[], ""));
        std::thread::sleep(Duration::from_millis(300));
        assert!(!held.is_finished() && !health.is_finished());
        // The operator's control calls still pass: it can read and take the fault away.
        assert_eq!(
            request(port, "GET", FAULT_PATH, &OPERATOR, "").json()["fault"],
            "hang"
        );
        assert_eq!(set_fault(port, &OPERATOR, r#"{"fault": null}"#).status, 200);
        // What was held is then served, not dropped.
        let answer = held.join().unwrap();
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_ne!(answer.json()["choices"][0]["text"], WRONG_ANSWER);
        assert_eq!(health.join().unwrap().status, 200);
    })
    .await
    .unwrap();
}
