//! Faults, from flags and from the control port, over real HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{CONTROL_PORT as CONTROL, Emulator, OpenStream, completion_body, request, try_request};

#[test]
fn the_control_endpoint_is_not_on_the_api_port() {
    let e = Emulator::ready(&[CONTROL], &[]);
    assert_eq!(e.post("/faults", "crash").status, 404);
    assert_eq!(e.get("/health").status, 200, "still alive");
    let state = request(e.control_port.unwrap(), "GET", "/state", None).json();
    assert_eq!(state["ready"], true);
    assert_eq!(e.inject("crsh").status, 400, "a misspelt fault is refused");
}

#[test]
fn a_scheduled_crash_exits_the_process_and_the_port_then_refuses() {
    let mut e = Emulator::ready(&["--emu-fault", "crash:3@300ms"], &[]);
    let status = e.wait_exit(Duration::from_secs(10)).expect("crashed");
    assert_eq!(status.code(), Some(3));
    assert!(TcpStream::connect(("127.0.0.1", e.port)).is_err());
}

#[test]
fn a_crash_scheduled_during_weight_load_stops_the_start() {
    let mut e = Emulator::spawn(
        &[
            "--emu-weights-gib=5",
            "--emu-load-gib-per-s=1",
            "--emu-fault=crash@200ms",
        ],
        &[],
    );
    e.wait_for_line("Starting to load model");
    assert_eq!(
        e.wait_exit(Duration::from_secs(10)).expect("crashed").code(),
        Some(1)
    );
    assert!(!e.drain_log().iter().any(|l| l.contains("Loading weights took")));
}

#[test]
fn a_live_crash_from_the_control_port_exits_at_once() {
    let mut e = Emulator::ready(&[CONTROL], &[]);
    assert_eq!(e.inject("crash").status, 200);
    assert!(e.wait_exit(Duration::from_secs(10)).is_some());
}

#[test]
fn a_hung_replica_accepts_connections_and_never_answers() {
    let e = Emulator::ready(&[CONTROL], &[]);
    assert_eq!(e.inject("hang").status, 200);
    let mut health = OpenStream::get(e.port, "/health");
    assert!(
        !health.read_until("HTTP/1.1", Duration::from_millis(500)),
        "a hung server answered: {}",
        health.text()
    );
    assert_eq!(e.inject("clear").status, 200);
    assert_eq!(e.get("/health").status, 200, "lifting the fault restores service");
}

#[test]
fn engine_death_gives_503_health_500_generation_then_exits_at_the_watchdog() {
    let mut e = Emulator::ready(&[CONTROL, "--emu-watchdog-s=0.5"], &[]);
    assert_eq!(e.inject("engine-dead").status, 200);
    assert_eq!(e.get("/health").status, 503);
    assert_eq!(e.get("/ping").status, 503);
    let r = e.post("/v1/completions", &completion_body("hi", 2, false));
    assert_eq!((r.status, r.body.as_str()), (500, ""));
    let status = e
        .wait_exit(Duration::from_secs(10))
        .expect("the watchdog ends the server");
    assert!(!status.success());
    e.wait_for_line("EngineDeadError");
    e.wait_for_line("INFO:     Shutting down");
}

#[test]
fn with_keep_alive_on_engine_death_the_dead_server_stays_up_answering_503() {
    let mut e = Emulator::ready(
        &[CONTROL, "--emu-watchdog-s=0.2"],
        &[("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "1")],
    );
    assert_eq!(e.inject("engine-dead").status, 200);
    assert!(
        e.wait_exit(Duration::from_millis(800)).is_none(),
        "four watchdog periods later, still up"
    );
    assert_eq!(e.get("/health").status, 503);
}

#[test]
fn a_half_failed_replica_is_healthy_but_fails_generation_mid_stream() {
    let e = Emulator::ready(&["--emu-fault=half-failed:error"], &[]);
    assert_eq!(e.get("/health").status, 200);
    let r = e.post("/v1/completions", &completion_body("hi", 5, false));
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["code"], 500);
    let events = e
        .post("/v1/completions", &completion_body("hi", 5, true))
        .sse_events();
    assert_eq!(events.len(), 3, "one token, an error event, [DONE]: {events:?}");
    assert!(events[0].contains("\"text\""));
    assert!(events[1].starts_with("{\"error\""));
    assert_eq!(events[2], "[DONE]");
}

#[test]
fn a_stalling_replica_sends_one_token_and_then_nothing() {
    let e = Emulator::ready(&["--emu-fault=half-failed:stall"], &[]);
    let mut stream = OpenStream::post(e.port, "/v1/completions", &completion_body("hi", 5, true));
    assert!(stream.read_until("\"text\"", Duration::from_secs(10)));
    assert!(!stream.read_until("[DONE]", Duration::from_millis(500)));
    assert_eq!(e.get("/health").status, 200);
}

#[test]
fn a_half_failed_replica_fails_a_one_token_stream_after_its_token() {
    let e = Emulator::ready(&["--emu-fault=half-failed:error"], &[]);
    let events = e
        .post("/v1/completions", &completion_body("hi", 1, true))
        .sse_events();
    assert_eq!(events.len(), 3, "one token, an error event, [DONE]: {events:?}");
    assert!(events[0].contains("\"text\""));
    assert!(!events[0].contains("\"length\""), "{events:?}");
    assert!(events[1].starts_with("{\"error\""));
    assert_eq!(events[2], "[DONE]");
}

#[test]
fn a_stalling_replica_sends_the_only_token_of_a_one_token_stream() {
    let e = Emulator::ready(&["--emu-fault=half-failed:stall"], &[]);
    let mut stream = OpenStream::post(e.port, "/v1/completions", &completion_body("hi", 1, true));
    assert!(stream.read_until("\"text\"", Duration::from_secs(10)));
    assert!(!stream.text().contains("[DONE]"));
}

#[test]
fn a_slow_fault_multiplies_generation_time() {
    // 10 tokens at 10 ms is 0.1 s; slow:10 makes it at least 1 s.
    let e = Emulator::ready_with_costs(
        &[
            CONTROL,
            "--emu-decode-s-per-token=0.01",
            "--emu-prefill-overhead-s=0",
        ],
        &[],
    );
    assert_eq!(e.inject("slow:10").status, 200);
    let t0 = Instant::now();
    e.greedy_text("pace", 11);
    let slow = t0.elapsed();
    // Only the lower bound: waiting guarantees it, a comparison with the normal run would not.
    assert!(slow >= Duration::from_secs(1), "slow took {slow:?}");
}

#[test]
fn wrong_output_changes_the_text_while_everything_looks_healthy() {
    let e = Emulator::ready(&[CONTROL], &[]);
    let good = e.greedy_text("the golden prompt", 10);
    assert_eq!(e.inject("wrong-output").status, 200);
    assert_ne!(e.greedy_text("the golden prompt", 10), good);
    assert_eq!(e.get("/health").status, 200);
    assert_eq!(e.inject("clear").status, 200);
    assert_eq!(e.greedy_text("the golden prompt", 10), good);
}

#[test]
fn drift_reports_another_version_context_length_and_weights() {
    let e = Emulator::ready(&[CONTROL], &[]);
    let good = e.greedy_text("parity", 10);
    let r = e.inject(
        &json!({"fault": "drift:version=0.10.2,max-model-len=2048,weights-digest=sha256:old"}).to_string(),
    );
    assert_eq!(r.status, 200);
    assert_eq!(e.get("/version").json()["version"], "0.10.2");
    assert_eq!(e.get("/v1/models").json()["data"][0]["max_model_len"], 2048);
    assert_ne!(e.greedy_text("parity", 10), good);
}

#[test]
fn a_fault_injected_with_an_offset_waits_for_it() {
    let later = Emulator::ready(&[CONTROL], &[]);
    assert_eq!(later.inject("engine-dead@30s").status, 200);
    assert_eq!(later.get("/health").status, 200, "not yet");
    drop(later);
    let e = Emulator::ready(&[CONTROL], &[]);
    assert_eq!(e.inject("engine-dead@400ms").status, 200);
    // A guard against hanging forever, not a timing assertion.
    let deadline = Instant::now() + Duration::from_secs(120);
    while try_request(e.port, "GET", "/health", None)
        .map(|r| r.status)
        .unwrap_or(0)
        == 200
    {
        assert!(Instant::now() < deadline, "the fault never landed");
        std::thread::sleep(Duration::from_millis(50));
    }
}
