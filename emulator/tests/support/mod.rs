//! Drives a real `vllm-emulator` process over real HTTP on 127.0.0.1, as a client would.
//!
//! A tiny blocking HTTP/1.1 client (one request per connection, chunked bodies decoded) keeps the
//! tests free of a client library. The child process is killed when the handle drops.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

pub const MODEL: &str = "Qwen/Qwen3-0.6B";

/// Asks [`Emulator::spawn`] for a control port.
pub const CONTROL_PORT: &str = "--emu-control-port=auto";

/// A running emulator.
pub struct Emulator {
    child: Child,
    lines: Receiver<String>,
    pub log: Vec<String>,
    pub port: u16,
    pub control_port: Option<u16>,
}

impl Emulator {
    /// Starts `vllm-emulator serve MODEL --host 127.0.0.1 --port 0 ARGS…` with `env` added, and
    /// reads the ports it bound from its log. [`CONTROL_PORT`] among `args` asks for a control
    /// port, also on port 0. The OS picks every port at bind time, so tests running side by side
    /// never race for one; the API port is known early, while it still refuses connections.
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let mut e = Emulator::launch(args, env);
        e.port = e.bound_port("emulator API endpoint bound");
        if args.contains(&CONTROL_PORT) {
            e.control_port = Some(e.bound_port("emulator control endpoint on"));
        }
        e
    }

    /// Starts one that must refuse to start, before it binds anything, and returns how it exited.
    pub fn refused_start(args: &[&str], env: &[(&str, &str)]) -> ExitStatus {
        let mut e = Emulator::launch(args, env);
        e.wait_exit(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("still running; log:\n{}", e.drain_log().join("\n")))
    }

    fn launch(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vllm-emulator"));
        cmd.args(["serve", MODEL, "--host", "127.0.0.1", "--port", "0"]);
        for a in args {
            cmd.arg(if *a == CONTROL_PORT {
                "--emu-control-port=0"
            } else {
                a
            });
        }
        cmd.env_remove("VLLM_SERVER_DEV_MODE")
            .env_remove("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let (tx, lines) = channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Emulator {
            child,
            lines,
            log: Vec::new(),
            port: 0,
            control_port: None,
        }
    }

    /// The port at the end of the line containing `needle` (`… on http://127.0.0.1:PORT`).
    fn bound_port(&mut self, needle: &str) -> u16 {
        let line = self.wait_for_line(needle);
        line.rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port at the end of `{line}`"))
    }

    /// Starts one with instant startup and a zero cost model, and waits until it is ready.
    pub fn ready(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let mut all = vec!["--emu-instant", "--emu-zero-cost"];
        all.extend_from_slice(args);
        let mut e = Emulator::spawn(&all, env);
        e.wait_for_line("Application startup complete.");
        e
    }

    /// Starts one with instant startup and the cost model on, and waits until it is ready.
    pub fn ready_with_costs(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let mut all = vec!["--emu-instant"];
        all.extend_from_slice(args);
        let mut e = Emulator::spawn(&all, env);
        e.wait_for_line("Application startup complete.");
        e
    }

    /// Waits (at most 20 s) for a log line containing `needle` and returns it.
    pub fn wait_for_line(&mut self, needle: &str) -> String {
        if let Some(l) = self.log.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no line with `{needle}` in 20 s; log:\n{}", self.log.join("\n"))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("emulator exited before `{needle}`; log:\n{}", self.log.join("\n"))
                }
            }
        }
    }

    /// Everything logged so far.
    pub fn drain_log(&mut self) -> Vec<String> {
        while let Ok(line) = self.lines.try_recv() {
            self.log.push(line);
        }
        self.log.clone()
    }

    /// Sends SIGTERM, as the kubelet stops a container (`unsafe` is forbidden: through kill(1)).
    pub fn terminate(&self) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits (at most `limit`) for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn get(&self, path: &str) -> Response {
        request(self.port, "GET", path, None)
    }

    pub fn post(&self, path: &str, body: &str) -> Response {
        request(self.port, "POST", path, Some(body))
    }

    /// POSTs a fault spec to the control port.
    pub fn inject(&self, spec: &str) -> Response {
        request(
            self.control_port.expect("started with CONTROL_PORT"),
            "POST",
            "/faults",
            Some(spec),
        )
    }

    /// A greedy completion's text.
    pub fn greedy_text(&self, prompt: &str, max_tokens: u32) -> String {
        let r = self.post("/v1/completions", &completion_body(prompt, max_tokens, false));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn completion_body(prompt: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": stream,
    })
    .to_string()
}

/// An HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_events(&self) -> Vec<String> {
        assert!(
            self.body.ends_with("\n\n"),
            "an SSE body ends with a blank line: {:?}",
            self.body
        );
        self.body
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                e.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not a data line: {e:?}"))
                    .to_string()
            })
            .collect()
    }
}

fn connect(port: u16) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    Ok(s)
}

fn write_request(s: &mut TcpStream, method: &str, path: &str, body: Option<&str>) {
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
}

/// One request on a fresh connection; panics if the server cannot be reached.
pub fn request(port: u16, method: &str, path: &str, body: Option<&str>) -> Response {
    try_request(port, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

pub fn try_request(port: u16, method: &str, path: &str, body: Option<&str>) -> std::io::Result<Response> {
    let mut s = connect(port)?;
    write_request(&mut s, method, path, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    Ok(parse_response(&raw))
}

fn parse_response(raw: &[u8]) -> Response {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete HTTP head");
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked { dechunk(rest) } else { rest.to_vec() };
    Response {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
    }
}

fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
        rest = &rest[eol + 2 + size + 2..];
    }
}

/// A request whose response is read as it arrives.
pub struct OpenStream {
    stream: TcpStream,
    pub received: Vec<u8>,
}

impl OpenStream {
    pub fn post(port: u16, path: &str, body: &str) -> OpenStream {
        let mut stream = connect(port).unwrap();
        write_request(&mut stream, "POST", path, Some(body));
        OpenStream {
            stream,
            received: Vec::new(),
        }
    }

    pub fn get(port: u16, path: &str) -> OpenStream {
        let mut stream = connect(port).unwrap();
        write_request(&mut stream, "GET", path, None);
        OpenStream {
            stream,
            received: Vec::new(),
        }
    }

    /// Reads until `needle` has arrived (true) or `limit` passes with it absent (false).
    pub fn read_until(&mut self, needle: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut buf = [0u8; 4096];
        loop {
            if String::from_utf8_lossy(&self.received).contains(needle) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.stream.set_read_timeout(Some(left)).unwrap();
            match self.stream.read(&mut buf) {
                Ok(0) => return String::from_utf8_lossy(&self.received).contains(needle),
                Ok(n) => self.received.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return false;
                }
                Err(e) => panic!("reading the stream: {e}"),
            }
        }
    }

    /// Reads to the end of the response.
    pub fn finish(mut self) -> Response {
        self.stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        self.stream.read_to_end(&mut self.received).unwrap();
        let _ = self.stream.shutdown(Shutdown::Both);
        parse_response(&self.received)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.received).into_owned()
    }
}

/// One Prometheus sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// A strict parser for the Prometheus text format (0.0.4): every line is a `# HELP`, a `# TYPE`
/// or a sample; names and label names are valid; every sample belongs to a declared family.
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars().enumerate().all(|(i, c)| {
                c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
            })
    };
    let mut declared: Vec<(String, String)> = Vec::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            assert!(name_ok(rest.split(' ').next().unwrap()), "bad HELP line {line:?}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest
                .split_once(' ')
                .unwrap_or_else(|| panic!("bad TYPE line {line:?}"));
            assert!(name_ok(name), "bad metric name in {line:?}");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "bad type in {line:?}"
            );
            declared.push((name.to_string(), kind.to_string()));
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.is_empty(),
            "unexpected line {line:?}"
        );
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value in {line:?}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels in {line:?}"));
                let labels = body
                    .split("\",")
                    .map(|pair| {
                        let (k, v) = pair
                            .split_once("=\"")
                            .unwrap_or_else(|| panic!("bad label in {line:?}"));
                        assert!(name_ok(k) && !k.contains(':'), "bad label name in {line:?}");
                        (k.to_string(), v.trim_end_matches('"').to_string())
                    })
                    .collect();
                (name, labels)
            }
            None => (series, Vec::new()),
        };
        assert!(name_ok(name), "bad sample name in {line:?}");
        let family_ok = declared.iter().any(|(family, kind)| match kind.as_str() {
            "histogram" => [
                format!("{family}_bucket"),
                format!("{family}_sum"),
                format!("{family}_count"),
            ]
            .contains(&name.to_string()),
            _ => family == name,
        });
        assert!(family_ok, "sample {name} has no # TYPE before it");
        samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    samples
}

/// The value of the sample named `name` whose labels include all of `labels`.
pub fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
        })
        .unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
        .value
}

/// Reads the metrics page and parses it.
pub fn metrics(e: &Emulator) -> Vec<Sample> {
    let r = e.get("/metrics");
    assert_eq!(r.status, 200);
    parse_prometheus(&r.body)
}
