//! The `continuation` stream contract end to end: a completions stream whose replica dies mid-way
//! is carried on by another endpoint of the route, so the client reads one stream, under one id,
//! whose text is the delivered text followed by what the model generates for the prompt plus
//! that text, ending in `[DONE]`; and when nothing can carry it on, it ends retryable, never
//! `[DONE]`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeSet;

use support::{Emulator, MODEL, Router, completion, read_until, request, send, streamed_text};
use understudy_router::gateway::GatewayConfig;

const TOKENS: u32 = 60;

fn continuation_route(epoch: u64, endpoints: &[std::net::SocketAddr]) -> serde_json::Value {
    serde_json::json!({
        "pool": "a", "epoch": epoch, "endpoints": endpoints, "stream_contract": "continuation"
    })
}

/// Starts a stream through `r`, reads until its first text, runs `then`, reads the rest.
fn cut_stream(r: &Router, then: impl FnOnce()) -> String {
    let mut s = send(
        r.public,
        "POST",
        "/v1/completions",
        &[],
        &completion(TOKENS, true),
    );
    let mut raw = read_until(&mut s, "\"text\"");
    then();
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut s, &mut rest).unwrap();
    raw.extend_from_slice(&rest);
    let reply = support::parse(&raw);
    assert_eq!(reply.status, 200);
    reply.text()
}

fn chunk_texts(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn a_completions_stream_cut_mid_way_is_carried_on_by_another_endpoint_as_one_stream() {
    // Costs on (8 ms a token) keep the first stream open long enough to kill its replica.
    let first = Emulator::start(&[], &[]);
    let second = Emulator::start(&[], &[]);
    let oracle = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&continuation_route(1, &[first.addr()])).status, 200);
    let body = cut_stream(&r, || {
        // The same epoch with a second endpoint: the stream in flight stays on the first.
        assert_eq!(
            r.put_route(&continuation_route(1, &[first.addr(), second.addr()]))
                .status,
            200
        );
        first.inject("crash");
    });
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(!body.contains("retryable"), "{body}");
    let ids: BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .map(|v| v["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 1, "one response id across the cut: {ids:?}");

    // The delivered part is a prefix of the uncut answer, token for token; the rest is what the
    // model generates for the prompt plus that prefix, in the tokens left.
    let got = streamed_text(&body);
    let uncut = chunk_texts(
        &request(
            oracle.port,
            "POST",
            "/v1/completions",
            &[],
            &completion(TOKENS, true),
        )
        .text(),
    );
    let candidates: Vec<usize> = (1..uncut.len())
        .rev()
        .filter(|&k| got.starts_with(&uncut[..k].concat()))
        .take(3)
        .collect();
    assert!(!candidates.is_empty(), "no prefix of the uncut answer in {got:?}");
    let matched = candidates.iter().any(|&k| {
        let delivered = uncut[..k].concat();
        let follow_up = serde_json::json!({
            "model": MODEL, "prompt": format!("The capital of France is{delivered}"),
            "max_tokens": TOKENS as usize - k, "temperature": 0, "stream": false, "ignore_eos": true
        });
        let rest = request(
            oracle.port,
            "POST",
            "/v1/completions",
            &[],
            &follow_up.to_string(),
        )
        .json();
        got == format!("{delivered}{}", rest["choices"][0]["text"].as_str().unwrap())
    });
    assert!(matched, "{got:?} is not a delivered prefix plus its continuation");
    r.wait_for_metrics("one continuation", |m| {
        m.contains("understudy_router_continuations_total 1\n")
            && m.contains("understudy_router_streams_cut_total 1\n")
    });
}

#[test]
fn a_cut_stream_that_nothing_can_carry_on_ends_retryable_and_never_done() {
    let only = Emulator::start(&[], &[]);
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&continuation_route(1, &[only.addr()])).status, 200);
    let body = cut_stream(&r, || only.inject("crash"));
    assert!(body.contains("\"retryable\": true"), "{body}");
    assert!(
        !body.contains("[DONE]"),
        "a cut stream must never look finished: {body}"
    );
    r.wait_for_metrics("no continuation", |m| {
        m.contains("understudy_router_continuations_total 0\n")
    });
}
