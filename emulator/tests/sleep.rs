//! Sleep mode over real HTTP: dev-mode gating, level 1 and level 2, requests while asleep.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::{Emulator, OpenStream, completion_body, metrics, sample};

const DEV: &[(&str, &str)] = &[("VLLM_SERVER_DEV_MODE", "1")];

#[test]
fn sleep_endpoints_do_not_exist_without_dev_mode() {
    let e = Emulator::ready(&["--enable-sleep-mode"], &[]);
    assert_eq!(e.post("/sleep?level=1", "").status, 404);
    assert_eq!(e.post("/wake_up", "").status, 404);
    assert_eq!(e.get("/is_sleeping").status, 404);
    assert_eq!(
        e.post("/collective_rpc", r#"{"method":"reload_weights"}"#).status,
        404
    );
    assert_eq!(e.post("/reset_prefix_cache", "").status, 404);
    assert_eq!(e.get("/server_info").status, 404);
}

#[test]
fn sleep_needs_enable_sleep_mode_even_in_dev_mode() {
    let e = Emulator::ready(&[], DEV);
    assert_eq!(e.post("/sleep?level=1", "").status, 500);
    assert_eq!(e.get("/is_sleeping").json(), json!({"is_sleeping": false}));
}

#[test]
fn level_zero_is_refused_and_every_level_above_one_discards_the_weights() {
    let e = Emulator::ready(&["--enable-sleep-mode", "--emu-wake-alloc-s=0"], DEV);
    let refused = e.post("/sleep?level=0", "");
    assert_eq!(refused.status, 400);
    assert!(refused.body.contains("level 0"), "{}", refused.body);
    assert_eq!(e.get("/is_sleeping").json(), json!({"is_sleeping": false}));
    assert_eq!(e.post("/sleep?level=3", "").status, 200);
    assert_eq!(
        sample(
            &metrics(&e),
            "vllm:engine_sleep_state",
            &[("sleep_state", "discard_all")]
        ),
        1.0
    );
}

#[test]
fn level_one_sleep_keeps_weights_and_wakes_at_host_bandwidth_with_an_empty_prefix_cache() {
    // 2 GiB at 4 GiB/s: offload and wake each take 0.5 s.
    let args = [
        "--enable-sleep-mode",
        "--emu-weights-gib=2",
        "--emu-host-gib-per-s=4",
        "--emu-wake-alloc-s=0",
    ];
    let mut e = Emulator::ready(&args, DEV);
    let prompt = "A long shared system prompt for the prefix cache to keep. ".repeat(4);
    let before = e.greedy_text(&prompt, 8);
    assert_eq!(e.post("/sleep?level=1", "").status, 200);
    assert_eq!(e.get("/is_sleeping").json(), json!({"is_sleeping": true}));
    assert_eq!(e.get("/health").status, 200, "a sleeping engine is alive");
    let m = metrics(&e);
    assert_eq!(
        sample(&m, "vllm:engine_sleep_state", &[("sleep_state", "awake")]),
        0.0
    );
    assert_eq!(
        sample(
            &m,
            "vllm:engine_sleep_state",
            &[("sleep_state", "weights_offloaded")]
        ),
        1.0
    );
    assert_eq!(
        sample(&m, "vllm:engine_sleep_state", &[("sleep_state", "discard_all")]),
        0.0
    );

    let t0 = Instant::now();
    assert_eq!(e.post("/wake_up", "").status, 200);
    assert!(
        t0.elapsed() >= Duration::from_millis(500),
        "wake copies 2 GiB at 4 GiB/s"
    );
    assert_eq!(e.get("/is_sleeping").json(), json!({"is_sleeping": false}));
    let hits_before = sample(&metrics(&e), "vllm:prefix_cache_hits_total", &[]);
    assert_eq!(e.greedy_text(&prompt, 8), before, "level 1 keeps the weights");
    let hits_after = sample(&metrics(&e), "vllm:prefix_cache_hits_total", &[]);
    assert_eq!(hits_after, hits_before, "the prefix cache was emptied by sleep");
    assert_eq!(
        sample(
            &metrics(&e),
            "vllm:engine_sleep_state",
            &[("sleep_state", "awake")]
        ),
        1.0
    );
    e.wait_for_line("wake up the engine with tags: None");
}

#[test]
fn level_two_wakes_to_garbage_until_reload_weights_reads_them_from_storage() {
    // reload_weights reads 1 GiB at 2 GiB/s: 0.5 s.
    let args = [
        "--enable-sleep-mode",
        "--emu-weights-gib=1",
        "--emu-load-gib-per-s=2",
        "--emu-wake-alloc-s=0.1",
    ];
    let mut e = Emulator::ready(&args, DEV);
    let before = e.greedy_text("What is sleep mode?", 8);
    assert_eq!(e.post("/sleep?level=2", "").status, 200);
    assert_eq!(
        sample(
            &metrics(&e),
            "vllm:engine_sleep_state",
            &[("sleep_state", "discard_all")]
        ),
        1.0
    );

    assert_eq!(e.post("/wake_up?tags=weights", "").status, 200);
    assert_eq!(
        e.get("/is_sleeping").json(),
        json!({"is_sleeping": true}),
        "the KV cache still sleeps"
    );
    let t0 = Instant::now();
    let rpc = e.post("/collective_rpc", r#"{"method":"reload_weights"}"#);
    assert_eq!(rpc.status, 200);
    assert!(
        t0.elapsed() >= Duration::from_millis(500),
        "reload reads 1 GiB at 2 GiB/s"
    );
    assert_eq!(e.post("/wake_up?tags=kv_cache", "").status, 200);
    assert_eq!(e.get("/is_sleeping").json(), json!({"is_sleeping": false}));
    assert_eq!(
        e.greedy_text("What is sleep mode?", 8),
        before,
        "reloaded weights are the model's"
    );
    e.wait_for_line("wake up the engine with tags: ['kv_cache']");

    // Without reload_weights, the woken engine generates garbage.
    assert_eq!(e.post("/sleep?level=2", "").status, 200);
    assert_eq!(e.post("/wake_up?tags=weights&tags=kv_cache", "").status, 200);
    assert_eq!(e.get("/is_sleeping").json(), json!({"is_sleeping": false}));
    let garbage = e.greedy_text("What is sleep mode?", 8);
    assert_ne!(garbage, before);
    assert!(
        !before
            .split_whitespace()
            .any(|w| garbage.contains(w) && w.len() > 3),
        "{garbage:?} vs {before:?}"
    );
}

#[test]
fn a_request_sent_while_asleep_waits_until_wake_up() {
    let e = Emulator::ready(&["--enable-sleep-mode", "--emu-wake-alloc-s=0"], DEV);
    assert_eq!(e.post("/sleep?level=1", "").status, 200);
    let mut parked = OpenStream::post(
        e.port,
        "/v1/completions",
        &completion_body("anyone there?", 3, false),
    );
    assert!(
        !parked.read_until("HTTP/1.1", Duration::from_millis(400)),
        "no answer while asleep: {}",
        parked.text()
    );
    assert_eq!(sample(&metrics(&e), "vllm:num_requests_waiting", &[]), 1.0);
    assert_eq!(e.post("/wake_up", "").status, 200);
    let r = parked.finish();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["choices"][0]["finish_reason"], "length");
}

#[test]
fn with_asleep_requests_abort_a_request_sent_while_asleep_finishes_with_abort() {
    let e = Emulator::ready(&["--enable-sleep-mode", "--emu-asleep-requests=abort"], DEV);
    assert_eq!(e.post("/sleep?level=1", "").status, 200);
    let r = e.post("/v1/completions", &completion_body("anyone there?", 3, false));
    assert_eq!(r.json()["choices"][0]["finish_reason"], "abort");
    assert_eq!(
        sample(
            &metrics(&e),
            "vllm:request_success_total",
            &[("finished_reason", "abort")]
        ),
        1.0
    );
}

#[test]
fn sleep_in_abort_mode_ends_running_streams_with_abort_and_done() {
    let e = Emulator::ready_with_costs(&["--enable-sleep-mode", "--emu-decode-s-per-token=0.05"], DEV);
    let mut stream = OpenStream::post(
        e.port,
        "/v1/completions",
        &completion_body("a long answer", 500, true),
    );
    assert!(stream.read_until("\"text\"", Duration::from_secs(10)));
    assert_eq!(e.post("/sleep?level=1&mode=abort", "").status, 200);
    let events = stream.finish().sse_events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert!(
        events[events.len() - 2].contains("\"finish_reason\":\"abort\""),
        "{}",
        events[events.len() - 2]
    );
    assert!(events.len() < 100, "aborted long before 500 tokens");
}

#[test]
fn sleep_in_keep_mode_freezes_running_streams_until_wake() {
    let e = Emulator::ready_with_costs(
        &[
            "--enable-sleep-mode",
            "--emu-decode-s-per-token=0.02",
            "--emu-wake-alloc-s=0",
        ],
        DEV,
    );
    let mut stream = OpenStream::post(
        e.port,
        "/v1/completions",
        &completion_body("keep going", 500, true),
    );
    // 500 tokens at 20 ms: the stream runs for ten seconds at least, so the sleep lands in it.
    assert!(stream.read_until("\"text\"", Duration::from_secs(10)));
    assert_eq!(e.post("/sleep?level=1&mode=keep", "").status, 200);
    assert!(!stream.read_until("[DONE]", Duration::from_millis(500)));
    let frozen = stream.text().matches("\"text\"").count();
    assert!(!stream.read_until("[DONE]", Duration::from_millis(500)));
    assert_eq!(
        stream.text().matches("\"text\"").count(),
        frozen,
        "no token while asleep"
    );
    assert_eq!(e.post("/wake_up", "").status, 200);
    let events = stream.finish().sse_events();
    assert!(
        events[events.len() - 2].contains("\"finish_reason\":\"length\""),
        "{}",
        events[events.len() - 2]
    );
}

#[test]
fn server_info_and_reset_prefix_cache_exist_in_dev_mode() {
    let e = Emulator::ready(&["--enable-sleep-mode", "--revision", "abc123"], DEV);
    let text = e.get("/server_info").json();
    assert!(text["vllm_config"].as_str().unwrap().contains("revision=abc123"));
    let json_info = e.get("/server_info?config_format=json").json();
    assert_eq!(json_info["vllm_config"]["revision"], "abc123");
    assert_eq!(json_info["vllm_env"]["VLLM_SERVER_DEV_MODE"], "1");
    let prompt = "Shared prefix for the cache test, long enough for blocks. ".repeat(4);
    e.greedy_text(&prompt, 1);
    assert_eq!(e.post("/reset_prefix_cache", "").status, 200);
    e.greedy_text(&prompt, 1);
    assert_eq!(sample(&metrics(&e), "vllm:prefix_cache_hits_total", &[]), 0.0);
}
