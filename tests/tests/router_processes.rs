//! The router as real processes, as a local game day starts them: each asked to listen on port 0
//! and read back from the line it prints once bound; a fence watching a Lease kept in a file,
//! which another process (here, the test) moves with compare-and-set; a gateway taking a route on
//! its admin port. Every child is killed when its guard drops.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod router_support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use router_support::{Emulator, TOKEN, completion, request, route};
use understudy_api::lease::{EpochLease, FileLease};
use understudy_core::Epoch;

const ROUTER: &str = env!("CARGO_BIN_EXE_understudy-router-e2e");
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

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls until a completion on `port` answers `status` (20 s at most).
fn wait_for_status(port: u16, status: u16) -> router_support::Reply {
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
    let fence = RouterProcess::start(
        &[
            "fence",
            "--lease-file",
            path.to_str().unwrap(),
            "--upstream",
            &upstream,
            "--pool",
            "a",
            "--listen",
            "127.0.0.1:0",
            "--lease-poll-ms",
            "50",
        ],
        &["fence"],
    );
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
