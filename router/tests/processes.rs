//! The router as real processes, as a local game day starts them: each asked to listen on port 0
//! and read back from the line it prints once bound; a fence watching a Lease kept in a file,
//! which another process (here, the test) moves with compare-and-set; a gateway taking a route on
//! its admin port. Every child is killed when its guard drops.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::{Emulator, TOKEN, completion, read_until, request, route, send};
use understudy_api::lease::{EpochLease, FileLease};
use understudy_core::Epoch;

const ROUTER: &str = env!("CARGO_BIN_EXE_understudy-router");
const STARTUP: Duration = Duration::from_secs(20);

/// A router process, killed when dropped.
struct RouterProcess {
    child: Child,
    /// Each listener's address, by name, as announced.
    listening: Vec<(String, SocketAddr)>,
}

impl RouterProcess {
    /// Starts the router with `args` and waits until it has announced `listeners`, in order.
    fn start(args: &[&str], listeners: &[&str]) -> RouterProcess {
        let mut child = Command::new(ROUTER)
            .args(args)
            .env("RUST_LOG", "warn")
            .env("UNDERSTUDY_ADMIN_TOKEN", TOKEN)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the router");
        let stdout = child.stdout.take().expect("a piped stdout");
        let (lines, seen) = mpsc::channel();
        // Read stdout to the end, so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let mut process = RouterProcess {
            child,
            listening: Vec::new(),
        };
        let deadline = Instant::now() + STARTUP;
        for name in listeners {
            let prefix = format!("understudy-router {name} listening on http://");
            let addr = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let line = seen
                    .recv_timeout(left)
                    .unwrap_or_else(|_| panic!("no `{prefix}` line within {STARTUP:?}"));
                if let Some(addr) = line.strip_prefix(&prefix) {
                    break addr.parse().unwrap_or_else(|e| panic!("{line:?}: {e}"));
                }
            };
            process.listening.push(((*name).to_owned(), addr));
        }
        process
    }

    fn port(&self, name: &str) -> u16 {
        let (_, addr) = self.listening.iter().find(|(n, _)| n == name).unwrap();
        assert!(addr.ip().is_loopback(), "{addr}");
        addr.port()
    }
}

impl RouterProcess {
    /// Sends SIGTERM, as the kubelet stops a container (`unsafe` is forbidden, so through kill(1)).
    fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Its exit status, once it has exited (30 s at most).
    fn exit_status(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "still running 30 s after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fence process for pool `a` in front of `upstream`, watching the lease file at `lease`, with
/// `flags` besides.
fn fence_process(lease: &std::path::Path, upstream: &str, flags: &[&str]) -> RouterProcess {
    let mut args = vec![
        "fence",
        "--lease-file",
        lease.to_str().unwrap(),
        "--upstream",
        upstream,
    ];
    args.extend_from_slice(&["--pool", "a", "--listen", "127.0.0.1:0"]);
    args.extend_from_slice(flags);
    RouterProcess::start(&args, &["fence"])
}

/// Polls until a completion on `port` answers `status` (20 s at most).
fn wait_for_status(port: u16, status: u16) -> support::Reply {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = request(port, "POST", "/v1/completions", &[], &completion(4, false));
        if reply.status == status {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "never {status}; last: {} {}",
            reply.status,
            reply.text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_process_refuses_generation_once_the_lease_file_names_another_pool() {
    let e = Emulator::fast();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("epoch.json");
    let lease = FileLease::new(&path);
    let first = lease.create("a", Epoch(1)).await.unwrap();
    let upstream = e.addr().to_string();
    let fence = fence_process(&path, &upstream, &["--lease-poll-ms", "50"]);
    let port = fence.port("fence");
    tokio::task::spawn_blocking(move || wait_for_status(port, 200))
        .await
        .unwrap();
    lease.compare_and_set(&first, "b", Epoch(2)).await.unwrap();
    let refused = tokio::task::spawn_blocking(move || wait_for_status(port, 503))
        .await
        .unwrap();
    assert_eq!(refused.header("x-understudy-fenced").as_deref(), Some("2"));
    assert_eq!(refused.json()["error"]["type"], "fenced");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_process_announces_both_ports_and_serves_the_route_it_is_given() {
    let e = Emulator::fast();
    let gateway = RouterProcess::start(
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &["gateway", "admin"],
    );
    let (public, admin) = (gateway.port("gateway"), gateway.port("admin"));
    assert_ne!(public, admin);
    let body = route("a", 1, &[e.addr()]).to_string();
    let answer = tokio::task::spawn_blocking(move || {
        let auth = format!("Bearer {TOKEN}");
        let put = request(admin, "PUT", "/route", &[("authorization", &auth)], &body);
        assert_eq!(put.status, 200, "{}", put.text());
        request(public, "POST", "/v1/completions", &[], &completion(4, false))
    })
    .await
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text());
}

/// The gateway's admin port as a person or a buggy caller uses it: epochs that would lock every
/// later route out are refused, a forced jump is taken and remembered across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_refuses_an_epoch_far_above_the_highest_unless_forced_and_remembers_it() {
    let e = Emulator::fast();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("fence.json");
    let start = || {
        RouterProcess::start(
            &[
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--state-file",
                state.to_str().unwrap(),
            ],
            &["gateway", "admin"],
        )
    };
    let upstream = e.addr();
    let put = move |admin: u16, path: &'static str, epoch: u64| {
        let body = route("a", epoch, &[upstream]).to_string();
        let auth = format!("Bearer {TOKEN}");
        let reply = request(admin, "PUT", path, &[("authorization", &auth)], &body);
        (reply.status, reply.text())
    };
    let gateway = start();
    let admin = gateway.port("admin");
    let replies = tokio::task::spawn_blocking(move || {
        [
            put(admin, "/route", 1),
            put(admin, "/route", u64::MAX),
            put(admin, "/route?force=true", u64::MAX),
            put(admin, "/route", 5000),
            put(admin, "/route?force=true", 5000),
            put(admin, "/route", 5001),
        ]
    })
    .await
    .unwrap();
    let statuses: Vec<u16> = replies.iter().map(|(status, _)| *status).collect();
    assert_eq!(statuses, [200, 400, 400, 422, 200, 200], "{replies:#?}");
    assert!(replies[1].1.contains("the last there is"), "{}", replies[1].1);
    assert!(replies[3].1.contains("more than 1000 above"), "{}", replies[3].1);
    drop(gateway);

    // Restarted on the same state file, it holds 5001 and refuses what is below.
    let gateway = start();
    let admin = gateway.port("admin");
    let (status, text) = tokio::task::spawn_blocking(move || put(admin, "/route", 4999))
        .await
        .unwrap();
    assert_eq!(status, 409, "{text}");
    assert!(text.contains("\"highest_epoch\":5001"), "{text}");
}

#[test]
fn a_gateway_with_a_garbled_state_file_refuses_to_start_and_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("fence.json");
    std::fs::write(&state, "{\"epoch\": 7, \"po").unwrap();
    let output = Command::new(ROUTER)
        .args([
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(["--state-file", state.to_str().unwrap()])
        .env("UNDERSTUDY_ADMIN_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(state.to_str().unwrap()) && stderr.contains("not a fencing record"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(&state).unwrap(),
        "{\"epoch\": 7, \"po",
        "the record is left for a person to read"
    );
}

/// A gateway process routing to `upstream`, started with `flags` besides its ports.
fn gateway_to(upstream: SocketAddr, flags: &[&str]) -> RouterProcess {
    let mut args = vec![
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(flags);
    let gateway = RouterProcess::start(&args, &["gateway", "admin"]);
    let body = route("a", 1, &[upstream]).to_string();
    let auth = format!("Bearer {TOKEN}");
    let put = request(
        gateway.port("admin"),
        "PUT",
        "/route",
        &[("authorization", &auth)],
        &body,
    );
    assert_eq!(put.status, 200, "{}", put.text());
    gateway
}

/// Starts a 100-token stream through `port` and returns it once its first token has arrived.
fn stream_started(port: u16) -> std::net::TcpStream {
    let mut stream = send(port, "POST", "/v1/completions", &[], &completion(100, true));
    read_until(&mut stream, "data: {");
    stream
}

fn rest_of(mut stream: std::net::TcpStream) -> String {
    use std::io::Read;
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    String::from_utf8_lossy(&rest).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_fails_the_gateways_readiness_first_and_lets_the_stream_in_flight_finish() {
    // 100 tokens at 20 ms: a stream of about two seconds.
    let e = Emulator::start(&["--emu-decode-s-per-token=0.02"], &[]);
    let upstream = e.addr();
    tokio::task::spawn_blocking(move || {
        let mut gateway = gateway_to(
            upstream,
            &["--drain-delay-ms", "600", "--drain-timeout-ms", "20000"],
        );
        let (public, admin) = (gateway.port("gateway"), gateway.port("admin"));
        assert_eq!(request(admin, "GET", "/ready", &[], "").status, 200);
        let stream = stream_started(public);
        gateway.terminate();
        // Readiness fails at once, while the public port still serves new requests.
        let deadline = Instant::now() + Duration::from_secs(5);
        while request(admin, "GET", "/ready", &[], "").status != 503 {
            assert!(Instant::now() < deadline, "/ready never failed");
            std::thread::sleep(Duration::from_millis(10));
        }
        let during = request(public, "POST", "/v1/completions", &[], &completion(4, false));
        assert_eq!(during.status, 200, "{}", during.text());
        // The stream that was in flight finishes as a finished stream does.
        let rest = rest_of(stream);
        assert!(rest.contains("data: [DONE]"), "{rest}");
        assert!(!rest.contains("retryable"), "{rest}");
        assert!(gateway.exit_status().success());
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_drain_timeout_ends_with_the_retryable_error_never_cut() {
    // 100 tokens at 100 ms: ten seconds, far past the drain timeout.
    let e = Emulator::start(&["--emu-decode-s-per-token=0.1"], &[]);
    let upstream = e.addr();
    tokio::task::spawn_blocking(move || {
        let mut gateway = gateway_to(upstream, &["--drain-delay-ms", "0", "--drain-timeout-ms", "300"]);
        let stream = stream_started(gateway.port("gateway"));
        gateway.terminate();
        let rest = rest_of(stream);
        assert!(rest.contains("\"retryable\": true"), "{rest}");
        assert!(!rest.contains("[DONE]"), "{rest}");
        // The chunked body is ended properly: the client sees an answer that says it is
        // incomplete, not a connection torn down mid-chunk.
        assert!(rest.ends_with("0\r\n\r\n"), "{rest:?}");
        assert!(gateway.exit_status().success());
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_half_a_head_is_closed_and_one_over_the_cap_gets_503() {
    use std::io::{Read, Write};
    let e = Emulator::fast();
    let upstream = e.addr();
    tokio::task::spawn_blocking(move || {
        let gateway = gateway_to(
            upstream,
            &["--header-read-timeout-ms", "2000", "--max-connections", "2"],
        );
        let public = gateway.port("gateway");
        let half = || {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", public)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
            s
        };
        let (mut first, second) = (half(), half());
        // A third while both are held: over the cap.
        std::thread::sleep(Duration::from_millis(50));
        let over = request(public, "GET", "/v1/models", &[], "");
        assert_eq!(over.status, 503, "{}", over.text());
        assert_eq!(over.header("retry-after").as_deref(), Some("1"));
        // The half-sent head runs out of time: the gateway closes the connection.
        let mut rest = Vec::new();
        let read = first.read_to_end(&mut rest);
        assert!(read.is_ok(), "{read:?}");
        drop(second);
        // Their slots are free again.
        let deadline = Instant::now() + Duration::from_secs(10);
        while request(public, "GET", "/v1/models", &[], "").status != 200 {
            assert!(Instant::now() < deadline, "the slots never came back");
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_fails_the_fences_health_first_then_it_exits() {
    let e = Emulator::fast();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("epoch.json");
    FileLease::new(&path).create("a", Epoch(1)).await.unwrap();
    let upstream = e.addr().to_string();
    tokio::task::spawn_blocking(move || {
        let mut fence = fence_process(&path, &upstream, &["--drain-delay-ms", "600"]);
        let port = fence.port("fence");
        assert_eq!(request(port, "GET", "/health", &[], "").status, 200);
        fence.terminate();
        let deadline = Instant::now() + Duration::from_secs(5);
        let failed = loop {
            let health = request(port, "GET", "/health", &[], "");
            if health.status == 503 {
                break health;
            }
            assert!(Instant::now() < deadline, "/health never failed");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(failed.json()["error"]["type"], "draining");
        assert!(fence.exit_status().success());
    })
    .await
    .unwrap();
}
