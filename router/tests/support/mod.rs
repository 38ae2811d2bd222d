//! The router end to end on loopback: in-process vLLM emulators, the gateway or the fence on its
//! own runtime and thread, and a tiny blocking HTTP/1.1 client that can read a stream bit by bit.
//! Everything stops when its handle drops.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use understudy_emulator::local::LocalEmulator;
use understudy_listener::serve;
use understudy_router::admin::{Admin, AdminToken};
use understudy_router::fence_sidecar::{Fence, FenceState, LeaseSource, watch_lease};
use understudy_router::gateway::{Gateway, GatewayConfig};
use understudy_router::highest_epoch::StateFile;
use understudy_router::metrics::Metrics;
use understudy_router::table::RouteTable;

pub const MODEL: &str = "Qwen/Qwen3-0.6B";
pub const TOKEN: &str = "test-admin-token";

/// Something running on its own thread and runtime until dropped.
struct Background {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Background {
    fn run<F>(workers: usize, make: impl FnOnce() -> F + Send + 'static) -> Background
    where
        F: std::future::Future<Output = ()> + 'static,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let local = tokio::task::LocalSet::new();
                local
                    .run_until(async move {
                        tokio::select! {
                            () = make() => {}
                            _ = stopped => {}
                        }
                    })
                    .await;
            });
            rt.shutdown_background();
        });
        Background {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An in-process emulator with a control port.
pub struct Emulator {
    pub port: u16,
    pub control_port: u16,
    local: LocalEmulator,
}

impl Emulator {
    /// Starts one on ports the OS picks when it binds them (port 0), so tests side by side never
    /// race for a port, and waits until it serves.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let mut argv: Vec<String> = ["serve", MODEL, "--host", "127.0.0.1", "--port", "0"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        argv.push("--emu-control-port=0".into());
        argv.push("--emu-instant".into());
        argv.extend(args.iter().map(|s| s.to_string()));
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let local = LocalEmulator::start(&argv, env).expect("emulator arguments");
        let bound = |addr: Option<SocketAddr>, which: &str| {
            addr.unwrap_or_else(|| panic!("no {which} port bound in 20 s; log:\n{}", local.log()))
                .port()
        };
        let e = Emulator {
            port: bound(local.api_addr(Duration::from_secs(20)), "API"),
            control_port: bound(local.control_addr(Duration::from_secs(20)), "control"),
            local,
        };
        e.wait_for_line("Application startup complete.");
        e
    }

    /// Instant startup and no generation cost.
    pub fn fast() -> Emulator {
        Emulator::start(&["--emu-zero-cost"], &[])
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn log(&self) -> String {
        self.local.log()
    }

    pub fn wait_for_line(&self, needle: &str) {
        assert!(
            self.local.wait_for_line(needle, Duration::from_secs(20)),
            "no `{needle}` in 20 s; log:\n{}",
            self.log()
        );
    }

    /// Injects a fault through the control port.
    pub fn inject(&self, spec: &str) {
        assert_eq!(
            request(self.control_port, "POST", "/faults", &[], spec).status,
            200,
            "fault {spec}"
        );
    }
}

/// A gateway with its public and admin ports.
pub struct Router {
    pub public: u16,
    pub admin: u16,
    pub routes: Arc<RouteTable>,
    _bg: Background,
}

impl Router {
    pub fn start(config: GatewayConfig, state_file: Option<std::path::PathBuf>) -> Router {
        let routes = Arc::new(RouteTable::new(state_file.map(StateFile::new)).unwrap());
        let metrics = Arc::new(Metrics::default());
        let public = TcpListener::bind("127.0.0.1:0").unwrap();
        let admin = TcpListener::bind("127.0.0.1:0").unwrap();
        let (pp, ap) = (
            public.local_addr().unwrap().port(),
            admin.local_addr().unwrap().port(),
        );
        public.set_nonblocking(true).unwrap();
        admin.set_nonblocking(true).unwrap();
        let gw = Gateway::new(config, Arc::clone(&routes), Arc::clone(&metrics));
        let admin_api = Admin {
            routes: Arc::clone(&routes),
            metrics,
            token: AdminToken::new(TOKEN).unwrap(),
            draining: Default::default(),
            shapes: Arc::clone(gw.shapes()),
        };
        let bg = Background::run(2, move || async move {
            let public = tokio::net::TcpListener::from_std(public).unwrap();
            let admin = tokio::net::TcpListener::from_std(admin).unwrap();
            tokio::join!(
                serve(admin, move |req| admin_api.clone().handle(req)),
                serve(public, move |req| Arc::clone(&gw).handle(req)),
            );
        });
        Router {
            public: pp,
            admin: ap,
            routes,
            _bg: bg,
        }
    }

    /// PUTs a route on the admin port with the right token.
    pub fn put_route(&self, route: &serde_json::Value) -> Reply {
        request(
            self.admin,
            "PUT",
            "/route",
            &[("authorization", &format!("Bearer {TOKEN}"))],
            &route.to_string(),
        )
    }

    /// GETs an admin path with the right token.
    pub fn admin_get(&self, path: &str) -> Reply {
        request(
            self.admin,
            "GET",
            path,
            &[("authorization", &format!("Bearer {TOKEN}"))],
            "",
        )
    }

    /// A completion through the public port.
    pub fn complete(&self, body: &str, headers: &[(&str, &str)]) -> Reply {
        request(self.public, "POST", "/v1/completions", headers, body)
    }

    /// Polls `/metrics` until `pred` holds (20 s at most).
    pub fn wait_for_metrics(&self, what: &str, pred: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let m = request(self.admin, "GET", "/metrics", &[], "").text();
            if pred(&m) {
                return;
            }
            assert!(Instant::now() < deadline, "metrics never showed {what}:\n{m}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A fence sidecar in front of one replica.
pub struct FenceSidecar {
    pub port: u16,
    _bg: Background,
}

impl FenceSidecar {
    pub fn start<L: LeaseSource>(lease: L, pool: &str, upstream: SocketAddr, poll: Duration) -> FenceSidecar {
        Self::with_control_token(lease, pool, upstream, poll, None)
    }

    /// A sidecar that lets control calls through with `token`.
    pub fn with_control_token<L: LeaseSource>(
        lease: L,
        pool: &str,
        upstream: SocketAddr,
        poll: Duration,
        token: Option<&str>,
    ) -> FenceSidecar {
        Self::started(
            lease,
            pool,
            upstream,
            poll,
            token,
            understudy_router::fence_sidecar::DEFAULT_DRAIN,
        )
    }

    /// A sidecar that lets a generation running when its pool loses the Lease go on for `drain`.
    pub fn draining<L: LeaseSource>(
        lease: L,
        pool: &str,
        upstream: SocketAddr,
        poll: Duration,
        drain: Duration,
    ) -> FenceSidecar {
        Self::started(lease, pool, upstream, poll, None, drain)
    }

    /// A sidecar that serves under grants pushed with `token`, reading no Lease.
    pub fn granted(pool: &str, upstream: SocketAddr, token: &str) -> FenceSidecar {
        let token = understudy_router::admin::AdminToken::new(token).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let pool = pool.to_owned();
        let bg = Background::run(1, move || async move {
            let state = Arc::new(FenceState::new(pool.clone()));
            let granted = understudy_router::grant::Granted::new(&pool, Arc::clone(&state));
            tokio::spawn(understudy_router::grant::keep_grant(Arc::clone(&granted)));
            let fence = Fence::new(state, upstream)
                .with_control_token(Some(token))
                .with_grants(granted);
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            serve(listener, move |req| fence.clone().handle(req)).await;
        });
        FenceSidecar { port, _bg: bg }
    }

    fn started<L: LeaseSource>(
        lease: L,
        pool: &str,
        upstream: SocketAddr,
        poll: Duration,
        token: Option<&str>,
        drain: Duration,
    ) -> FenceSidecar {
        let token = token.map(|t| understudy_router::admin::AdminToken::new(t).unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let state = Arc::new(FenceState::new(pool));
        let bg = Background::run(1, move || async move {
            tokio::spawn(watch_lease(lease, Arc::clone(&state), poll));
            let fence = Fence::new(state, upstream)
                .with_control_token(token)
                .with_drain(drain);
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            serve(listener, move |req| fence.clone().handle(req)).await;
        });
        FenceSidecar { port, _bg: bg }
    }
}

/// A response as read off the wire.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
}

/// Sends a request on a fresh connection (no keep-alive) and starts reading the answer.
pub fn send(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    s
}

/// Reads from `s` until `needle` has been seen in what was read; returns what was read.
pub fn read_until(s: &mut TcpStream, needle: &str) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(needle) {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "closed before `{needle}`: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// Parses a whole HTTP/1.1 response (chunked or not) from raw bytes.
pub fn parse(raw: &[u8]) -> Reply {
    let text = raw;
    let split = text
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&text[..split]).into_owned();
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let rest = &text[split + 4..];
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(rest) } else { rest.to_vec() };
    Reply { status, head, body }
}

fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16).unwrap_or(0);
        rest = &rest[eol + 2..];
        if size == 0 || rest.len() < size {
            body.extend_from_slice(&rest[..size.min(rest.len())]);
            break;
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[(size + 2).min(rest.len())..];
    }
    body
}

/// One whole request and response.
pub fn request(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut s = send(port, method, path, headers, body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse(&raw)
}

/// The text of every SSE `data:` chunk's first choice, concatenated.
pub fn streamed_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| d.starts_with('{'))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

pub fn route(pool: &str, epoch: u64, endpoints: &[SocketAddr]) -> serde_json::Value {
    serde_json::json!({ "pool": pool, "epoch": epoch, "endpoints": endpoints })
}

/// [`route`] for `policy`, taking the requests that ask for `model`.
pub fn policy_route(
    policy: &str,
    model: &str,
    pool: &str,
    epoch: u64,
    endpoints: &[SocketAddr],
) -> serde_json::Value {
    let mut route = route(pool, epoch, endpoints);
    route["policy"] = policy.into();
    route["models"] = serde_json::json!([model]);
    route
}

/// A short plain completion asking for `model` by name.
pub fn completion_of(model: &str) -> String {
    serde_json::json!({"model": model, "prompt": "hi", "max_tokens": 2}).to_string()
}

pub fn completion(max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens,
        "temperature": 0, "stream": stream, "ignore_eos": true
    })
    .to_string()
}

/// Reads a request's head off `s`, a byte at a time, up to its blank line (or the end).
pub fn read_head(s: &mut std::net::TcpStream) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).is_ok_and(|n| n == 1) {
        head.push(byte[0]);
    }
}

/// An endpoint that reads each request's head, counts it, and never answers.
pub fn counting_silent_endpoint() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&requests);
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut s in listener.incoming().map_while(Result::ok) {
            read_head(&mut s);
            count.fetch_add(1, SeqCst);
            held.push(s);
        }
    });
    (addr, requests)
}
