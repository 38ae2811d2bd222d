//! The cost model through the engine, on tokio's paused clock: exact times, no waiting.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use understudy_emulator::EmulatorConfig;
use understudy_emulator::engine::{Engine, Event, GenerationRequest};
use understudy_emulator::generate::{Sampling, tokenize};
use understudy_emulator::log::Log;
use understudy_emulator::sleep::{PauseMode, SleepLevel};

fn engine(flags: &str) -> Arc<Engine> {
    let argv: Vec<String> = format!("serve m --enable-sleep-mode {flags}")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let config = EmulatorConfig::from_args(&argv, Vec::new()).unwrap();
    config.build_engine(Arc::new(Log::new(1, Box::new(std::io::sink()))))
}

fn request(prompt: &str, max_tokens: u32) -> GenerationRequest {
    GenerationRequest {
        prompt: tokenize(prompt),
        max_tokens,
        sampling: Sampling::Greedy,
        ignore_eos: true,
        stop: Vec::new(),
    }
}

/// Runs one request to the end; returns (time to first token, time to finish) from `t0`.
async fn run(engine: Arc<Engine>, req: GenerationRequest, t0: Instant) -> (Duration, Duration) {
    let mut g = engine.generate(req);
    let mut first = None;
    while let Some(ev) = g.next().await {
        if matches!(ev, Event::Token(_)) && first.is_none() {
            first = Some(t0.elapsed());
        }
    }
    (first.unwrap(), t0.elapsed())
}

/// A prompt of exactly `n` tokens, unique per `tag`.
fn prompt(tag: usize, n: usize) -> String {
    // Each word is at most six bytes, so one token.
    (0..n)
        .map(|i| format!("{tag:x}.{i:x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

const PREFILL: &str = "--emu-prefill-s-per-token=0.001 --emu-prefill-overhead-s=0 --emu-decode-s-per-token=0.01 \
                       --emu-decode-batch-slowdown=0";

#[tokio::test(start_paused = true)]
async fn prefill_time_follows_uncached_prompt_tokens() {
    let e = engine(PREFILL);
    let t0 = Instant::now();
    let (ttft, done) = run(Arc::clone(&e), request(&prompt(1, 1000), 3), t0).await;
    assert_eq!(ttft, Duration::from_secs(1), "1000 tokens at 1 ms");
    assert_eq!(
        done,
        Duration::from_millis(1020),
        "then two decode steps of 10 ms"
    );
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_uncached_prompts_queues_for_prefill_and_a_warm_cache_removes_the_queue() {
    let e = engine(PREFILL);
    let system = prompt(0, 992);
    let t0 = Instant::now();
    let burst: Vec<_> = (0..4)
        .map(|i| tokio::spawn(run(Arc::clone(&e), request(&format!("{system} q{i}"), 1), t0)))
        .collect();
    let mut ttfts = Vec::new();
    for h in burst {
        ttfts.push(h.await.unwrap().0);
    }
    ttfts.sort();
    // The first prefills 993 tokens; the rest find the 992-token system prompt (62 blocks) cached.
    assert_eq!(ttfts[0], Duration::from_millis(993));
    assert!(ttfts[3] < Duration::from_millis(1000), "{ttfts:?}");

    // After a sleep and wake the cache is empty again: the storm is back.
    e.sleep(SleepLevel::One, PauseMode::Abort).await.unwrap();
    e.wake_up(&[]).await.unwrap();
    let t1 = Instant::now();
    let storm: Vec<_> = (0..4)
        .map(|i| tokio::spawn(run(Arc::clone(&e), request(&prompt(10 + i, 1000), 1), t1)))
        .collect();
    let mut ttfts = Vec::new();
    for h in storm {
        ttfts.push(h.await.unwrap().0);
    }
    ttfts.sort();
    let expected: Vec<Duration> = (1..=4).map(Duration::from_secs).collect();
    assert_eq!(
        ttfts, expected,
        "the k-th uncached prompt waits for the k-1 ahead of it"
    );
}

#[tokio::test(start_paused = true)]
async fn max_num_seqs_bounds_the_batch_and_the_rest_wait() {
    let e = engine(&format!("{PREFILL} --max-num-seqs 2"));
    let t0 = Instant::now();
    let all: Vec<_> = (0..4)
        .map(|i| tokio::spawn(run(Arc::clone(&e), request(&prompt(i, 1), 100), t0)))
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(e.metrics.num_requests_running.get(), 2.0);
    assert_eq!(e.metrics.num_requests_waiting.get(), 2.0);
    let mut done = Vec::new();
    for h in all {
        done.push(h.await.unwrap().1);
    }
    done.sort();
    assert!(
        done[2] > done[1] + Duration::from_millis(900),
        "the second pair starts after the first: {done:?}"
    );
    assert_eq!(e.metrics.num_requests_running.get(), 0.0);
}

#[tokio::test(start_paused = true)]
async fn the_kv_cache_capacity_admits_only_what_fits() {
    // 64 tokens of KV cache; each request needs 1 + 47 = 48 tokens, so only one runs at a time.
    let e = engine(&format!("{PREFILL} --max-model-len 64 --emu-kv-cache-tokens 64"));
    let t0 = Instant::now();
    let a = tokio::spawn(run(Arc::clone(&e), request(&prompt(1, 1), 47), t0));
    let b = tokio::spawn(run(Arc::clone(&e), request(&prompt(2, 1), 47), t0));
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(e.metrics.num_requests_running.get(), 1.0);
    assert_eq!(e.metrics.kv_cache_usage_perc.get(), 0.75);
    let (_, a_done) = a.await.unwrap();
    let (b_first, _) = b.await.unwrap();
    assert!(b_first >= a_done, "b waited for a's blocks");
}

#[tokio::test(start_paused = true)]
async fn a_bigger_batch_slows_each_decode_step() {
    let e = engine(
        "--emu-prefill-s-per-token=0 --emu-prefill-overhead-s=0 --emu-decode-s-per-token=0.01 --emu-decode-batch-slowdown=0.1",
    );
    let t0 = Instant::now();
    let (_, alone) = run(Arc::clone(&e), request("solo", 11), t0).await;
    assert_eq!(alone, Duration::from_millis(100));
    let t1 = Instant::now();
    let pair: Vec<_> = (0..2)
        .map(|i| tokio::spawn(run(Arc::clone(&e), request(&prompt(i, 2), 11), t1)))
        .collect();
    let mut done = Vec::new();
    for h in pair {
        done.push(h.await.unwrap().1);
    }
    done.sort();
    // Every step with both running is 10 % longer; the first may have run its first step alone.
    assert_eq!(done[1], Duration::from_millis(110), "{done:?}");
    assert!(done[0] > alone, "{done:?}");
}

#[tokio::test(start_paused = true)]
async fn level_one_wake_takes_weights_over_host_bandwidth() {
    let e = engine("--emu-weights-gib=8 --emu-host-gib-per-s=4 --emu-wake-alloc-s=0.25");
    let t0 = Instant::now();
    e.sleep(SleepLevel::One, PauseMode::Abort).await.unwrap();
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(2),
        "offloading 8 GiB at 4 GiB/s"
    );
    let t1 = Instant::now();
    e.wake_up(&[]).await.unwrap();
    assert_eq!(
        t1.elapsed(),
        Duration::from_millis(2250),
        "copy back, then re-allocate the KV cache"
    );
    assert!(e.prefix_cache_is_empty());
}

#[tokio::test(start_paused = true)]
async fn deferred_warmup_slows_only_the_first_generation() {
    let e = engine(&format!("{PREFILL} --emu-deferred-warmup-s=3"));
    let t0 = Instant::now();
    let (first, _) = run(Arc::clone(&e), request(&prompt(1, 10), 1), t0).await;
    assert_eq!(first, Duration::from_millis(3010));
    let t1 = Instant::now();
    let (second, _) = run(Arc::clone(&e), request(&prompt(2, 10), 1), t1).await;
    assert_eq!(second, Duration::from_millis(10));
}
