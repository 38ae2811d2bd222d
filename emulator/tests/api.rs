//! The OpenAI-compatible API over real HTTP: shapes, streaming, determinism, errors, metrics.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{Value, json};
use support::{Emulator, MODEL, completion_body, metrics, parse_prometheus, sample};

#[test]
fn a_completion_stream_ends_with_the_usage_chunk_then_done() {
    let e = Emulator::ready(&[], &[]);
    let body = json!({
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
    });
    let r = e.post("/v1/completions", &body.to_string());
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = r.sse_events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert_eq!(
        usage["usage"]["prompt_tokens"], 6,
        "The| capita|l| of| France| is"
    );
    assert_eq!(usage["usage"]["total_tokens"], 10);
    let tokens = &chunks[..chunks.len() - 1];
    assert_eq!(tokens.len(), 4, "one chunk per token");
    assert!(
        tokens
            .iter()
            .all(|c| c["object"] == "text_completion" && c["choices"][0]["text"] != "")
    );
    assert!(
        tokens[..3]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null())
    );
    assert_eq!(tokens[3]["choices"][0]["finish_reason"], "length");
    let streamed: String = tokens
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(
        streamed,
        e.greedy_text("The capital of France is", 4),
        "streaming and not give the same text"
    );
}

#[test]
fn a_chat_stream_opens_with_the_role_and_omits_usage_unless_asked() {
    let e = Emulator::ready(&[], &[]);
    let body = json!({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0, "ignore_eos": true, "stream": true,
    });
    let events = e.post("/v1/chat/completions", &body.to_string()).sse_events();
    assert_eq!(
        events.len(),
        1 + 3 + 1,
        "role chunk, three tokens, [DONE]: {events:?}"
    );
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert!(events.iter().all(|e| !e.contains("\"usage\"")));
    assert_eq!(events.last().unwrap(), "[DONE]");
}

#[test]
fn a_non_streaming_chat_answer_has_vllms_shape() {
    let e = Emulator::ready(&[], &[]);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0});
    let v = e.post("/v1/chat/completions", &body.to_string()).json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(["stop", "length"].contains(&v["choices"][0]["finish_reason"].as_str().unwrap()));
    assert_eq!(
        v["usage"]["total_tokens"].as_u64().unwrap(),
        v["usage"]["prompt_tokens"].as_u64().unwrap() + v["usage"]["completion_tokens"].as_u64().unwrap()
    );
}

#[test]
fn temperature_zero_gives_the_same_text_and_a_new_identity_changes_it() {
    let base = Emulator::ready(&[], &[]);
    let again = Emulator::ready(&[], &[]);
    let renamed = Emulator::ready(&["--served-model-name", MODEL, "--revision", "v2"], &[]);
    let digest = Emulator::ready(&["--emu-weights-digest", "sha256:0123"], &[]);
    let prompt = "Say something about failover";
    let text = base.greedy_text(prompt, 12);
    assert_eq!(text, base.greedy_text(prompt, 12), "same replica, same text");
    assert_eq!(
        text,
        again.greedy_text(prompt, 12),
        "same identity on another replica, same text"
    );
    assert_ne!(
        text,
        renamed.greedy_text(prompt, 12),
        "a different revision is a different model"
    );
    assert_ne!(
        text,
        digest.greedy_text(prompt, 12),
        "different weights, different text"
    );
    assert_ne!(text, base.greedy_text("Say something else", 12));
}

#[test]
fn bad_requests_get_vllm_style_errors() {
    let e = Emulator::ready(&["--max-model-len", "64"], &[]);
    let missing = e.post(
        "/v1/completions",
        &json!({"model": MODEL, "max_tokens": 4}).to_string(),
    );
    assert_eq!(missing.status, 400);
    assert_eq!(missing.json()["error"]["type"], "BadRequestError");
    assert_eq!(missing.json()["error"]["code"], 400);
    let too_long = e.post("/v1/completions", &completion_body("hello", 100, false));
    assert_eq!(too_long.status, 400);
    assert!(
        too_long.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 64 tokens")
    );
    let unknown = e.post(
        "/v1/completions",
        &json!({"model": "gpt-4", "prompt": "x"}).to_string(),
    );
    assert_eq!(unknown.status, 404);
    assert_eq!(
        unknown.json()["error"]["message"],
        "The model `gpt-4` does not exist."
    );
    let garbled = e.post("/v1/chat/completions", "{not json");
    assert_eq!(garbled.status, 400);
    assert!(
        !e.greedy_text("still fine", 2).is_empty(),
        "bad requests change nothing"
    );
}

#[test]
fn models_version_ping_tokenize_and_load_answer_like_vllm() {
    let e = Emulator::ready(&["--max-model-len", "4096", "--served-model-name", "a", "b"], &[]);
    let models = e.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a", "b"]);
    let card = &models["data"][0];
    assert_eq!(
        (card["owned_by"].as_str(), card["root"].as_str()),
        (Some("vllm"), Some(MODEL))
    );
    assert_eq!(card["max_model_len"], 4096);
    assert_eq!(card["permission"][0]["object"], "model_permission");
    assert_eq!(e.get("/version").json(), json!({"version": "0.32.0"}));
    assert_eq!(e.get("/ping").status, 200);
    assert_eq!(e.post("/ping", "").status, 200);
    let health = e.get("/health");
    assert_eq!((health.status, health.body.as_str()), (200, ""));
    let tok = e
        .post(
            "/tokenize",
            &json!({"model": "a", "prompt": "The capital of France"}).to_string(),
        )
        .json();
    assert_eq!(tok["count"], 5);
    assert_eq!(tok["max_model_len"], 4096);
    assert_eq!(tok["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(e.get("/load").json(), json!({"server_load": 0}));
    assert_eq!(e.get("/no/such/route").status, 404);
}

#[test]
fn metrics_parse_as_prometheus_text_with_vllms_names_labels_and_buckets() {
    let e = Emulator::ready(&["--served-model-name", "qwen"], &[]);
    let body = json!({"model": "qwen", "prompt": "hello world", "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    assert_eq!(e.post("/v1/completions", &body.to_string()).status, 200);
    let r = e.get("/metrics");
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let samples = parse_prometheus(&r.body);
    let l = [("model_name", "qwen"), ("engine", "0")];
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:iteration_tokens_total_count",
    ] {
        sample(&samples, name, &l);
    }
    assert_eq!(
        sample(
            &samples,
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        1.0
    );
    assert_eq!(
        sample(
            &samples,
            "vllm:request_success_total",
            &[("finished_reason", "abort")]
        ),
        0.0
    );
    assert_eq!(sample(&samples, "vllm:prompt_tokens_total", &l), 2.0);
    assert_eq!(sample(&samples, "vllm:generation_tokens_total", &l), 3.0);
    assert_eq!(
        sample(&samples, "vllm:engine_sleep_state", &[("sleep_state", "awake")]),
        1.0
    );
    assert_eq!(
        sample(&samples, "vllm:inter_token_latency_seconds_count", &l),
        2.0
    );
    let ttft_buckets: Vec<&str> = samples
        .iter()
        .filter(|s| s.name == "vllm:time_to_first_token_seconds_bucket")
        .map(|s| s.labels.iter().find(|(k, _)| k == "le").unwrap().1.as_str())
        .collect();
    assert_eq!(ttft_buckets.first(), Some(&"0.001"));
    assert_eq!(ttft_buckets[ttft_buckets.len() - 2..], ["2560.0", "+Inf"]);
    assert!(
        samples
            .iter()
            .all(|s| s.labels.iter().any(|(k, v)| k == "engine" && v == "0"))
    );
    assert!(
        samples
            .iter()
            .all(|s| !s.labels.iter().any(|(k, _)| k == "finish_reason")),
        "vLLM's label is finished_reason"
    );
}

#[test]
fn a_shared_prompt_prefix_is_served_from_the_prefix_cache() {
    let e = Emulator::ready(&[], &[]);
    let system = "You are a helpful assistant who answers briefly and politely. ".repeat(6);
    e.greedy_text(&format!("{system} First question?"), 1);
    let before = sample(&metrics(&e), "vllm:prefix_cache_hits_total", &[]);
    assert_eq!(before, 0.0, "nothing is cached on a fresh replica");
    e.greedy_text(&format!("{system} Second question?"), 1);
    let after = sample(&metrics(&e), "vllm:prefix_cache_hits_total", &[]);
    assert!(
        after >= 32.0,
        "the shared system prompt hits in whole blocks: {after}"
    );
}

#[test]
fn a_client_that_sends_half_a_head_is_disconnected_like_uvicorn_does() {
    use std::io::{Read, Write};

    let e = Emulator::ready(&[], &[]);
    let mut slow = std::net::TcpStream::connect(("127.0.0.1", e.port)).unwrap();
    slow.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: emu")
        .unwrap();
    // uvicorn's keep-alive timeout (5 s) bounds the wait for a head; then the connection closes
    // with nothing sent, instead of being held for as long as the client likes.
    let mut answer = Vec::new();
    let read = slow.read_to_end(&mut answer);
    assert!(read.is_ok(), "still open after a minute: {read:?}");
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    // The server itself is fine.
    assert_eq!(e.get("/health").status, 200);
}

#[test]
fn every_answered_request_gets_uvicorns_access_line_unless_vllms_flag_turns_it_off() {
    let mut e = Emulator::ready(&[], &[]);
    assert_eq!(e.get("/v1/models").status, 200);
    assert_eq!(e.post("/v1/completions", "{").status, 400);
    let models = e.wait_for_line("\"GET /v1/models HTTP/1.1\"");
    let bad = e.wait_for_line("\"POST /v1/completions HTTP/1.1\"");
    // `INFO:     127.0.0.1:PORT - "GET /v1/models HTTP/1.1" 200 OK`: bare in 0.32, as uvicorn prints it
    let (prefix, rest) = models.split_once("INFO:     127.0.0.1:").unwrap();
    assert!(prefix.is_empty(), "{models}");
    let (port, line) = rest.split_once(' ').unwrap();
    assert!(port.parse::<u16>().is_ok(), "{models}");
    assert_eq!(line, "- \"GET /v1/models HTTP/1.1\" 200 OK");
    assert!(
        bad.ends_with("\"POST /v1/completions HTTP/1.1\" 400 Bad Request"),
        "{bad}"
    );

    let mut quiet = Emulator::ready(&["--disable-uvicorn-access-log"], &[]);
    assert_eq!(quiet.get("/v1/models").status, 200);
    assert_eq!(quiet.get("/health").status, 200);
    // Its stop is logged after anything the two requests could have logged.
    quiet.terminate();
    quiet.wait_for_line("Shutting down");
    let log = quiet.drain_log();
    assert!(!log.iter().any(|l| l.contains("HTTP/1.1\"")), "{log:?}");
}
