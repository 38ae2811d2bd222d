//! Sleep against requests still waiting for a slot, KV blocks or the prefill lane, on tokio's
//! paused clock: no request produces a token while the engine is asleep.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use understudy_emulator::EmulatorConfig;
use understudy_emulator::engine::{Engine, Event, FinishReason, GenerationRequest};
use understudy_emulator::generate::{Sampling, tokenize};
use understudy_emulator::log::Log;
use understudy_emulator::sleep::{PauseMode, SleepLevel};

const COST: &str = "--emu-prefill-s-per-token=0.001 --emu-prefill-overhead-s=0 --emu-decode-s-per-token=0.01 \
                    --emu-decode-batch-slowdown=0 --emu-weights-gib=1 --emu-host-gib-per-s=1 --emu-wake-alloc-s=0.1";

fn engine(flags: &str) -> Arc<Engine> {
    let argv: Vec<String> = format!("serve m --enable-sleep-mode {COST} {flags}")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let config = EmulatorConfig::from_args(&argv, Vec::new()).unwrap();
    config.build_engine(Arc::new(Log::new(1, Box::new(std::io::sink()))))
}

/// A prompt of `n` distinct one-token words.
fn request(tag: usize, n: usize, max_tokens: u32) -> GenerationRequest {
    let prompt = (0..n)
        .map(|i| format!("{tag:x}.{i:x}"))
        .collect::<Vec<_>>()
        .join(" ");
    GenerationRequest {
        prompt: tokenize(&prompt),
        max_tokens,
        sampling: Sampling::Greedy,
        ignore_eos: true,
        stop: Vec::new(),
    }
}

type Timeline = Arc<Mutex<Vec<(Instant, Event)>>>;

/// Runs a request in the background, recording when each event came.
fn spawn(engine: &Arc<Engine>, req: GenerationRequest) -> (Timeline, JoinHandle<()>) {
    let timeline: Timeline = Arc::default();
    let mut g = engine.generate(req);
    let t = Arc::clone(&timeline);
    let h = tokio::spawn(async move {
        while let Some(ev) = g.next().await {
            t.lock().unwrap().push((Instant::now(), ev));
        }
    });
    (timeline, h)
}

fn tokens_between(t: &Timeline, from: Instant, to: Instant) -> usize {
    t.lock()
        .unwrap()
        .iter()
        .filter(|(at, ev)| matches!(ev, Event::Token(_)) && *at >= from && *at < to)
        .count()
}

fn last(t: &Timeline) -> Event {
    t.lock().unwrap().last().unwrap().1.clone()
}

#[tokio::test(start_paused = true)]
async fn a_request_queued_for_a_slot_when_sleep_aborts_ends_aborted_without_a_token() {
    let e = engine("--max-num-seqs 1");
    let (running, a) = spawn(&e, request(1, 1, 1000));
    let (queued, b) = spawn(&e, request(2, 1, 10));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(e.metrics.num_requests_waiting.get(), 1.0);
    e.sleep(SleepLevel::One, PauseMode::Abort).await.unwrap();
    a.await.unwrap();
    b.await.unwrap();
    let abort = Event::Finished {
        reason: FinishReason::Abort,
        stop_reason: None,
    };
    assert_eq!(last(&running), abort);
    assert_eq!(
        queued
            .lock()
            .unwrap()
            .iter()
            .map(|(_, ev)| ev.clone())
            .collect::<Vec<_>>(),
        vec![abort],
        "the queued request was in flight when sleep aborted"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_queued_for_a_slot_during_a_wait_drain_produces_nothing_until_wake() {
    let e = engine("--max-num-seqs 1");
    let (running, a) = spawn(&e, request(1, 1, 20));
    let (queued, b) = spawn(&e, request(2, 1, 10));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let asleep_from = Instant::now();
    // The running request has to finish for the drain to end; it used to freeze instead.
    tokio::time::timeout(Duration::from_secs(60), e.sleep(SleepLevel::One, PauseMode::Wait))
        .await
        .expect("the running request drains")
        .unwrap();
    a.await.unwrap();
    assert!(matches!(
        last(&running),
        Event::Finished {
            reason: FinishReason::Length,
            ..
        }
    ));
    tokio::time::sleep(Duration::from_secs(30)).await;
    e.wake_up(&[]).await.unwrap();
    let awake_from = Instant::now();
    b.await.unwrap();
    assert_eq!(
        tokens_between(&queued, asleep_from, awake_from),
        0,
        "{:?}",
        queued.lock().unwrap()
    );
    assert_eq!(
        tokens_between(&queued, awake_from, Instant::now() + Duration::from_secs(1)),
        10
    );
}

#[tokio::test(start_paused = true)]
async fn requests_prefilling_or_queued_for_the_prefill_lane_when_sleep_keeps_them_wait_for_wake() {
    let e = engine("--max-num-seqs 4");
    // 1000 prompt tokens: a one-second prefill each, one at a time.
    let (first, a) = spawn(&e, request(1, 1000, 3));
    let (second, b) = spawn(&e, request(2, 1000, 3));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asleep_from = Instant::now();
    e.sleep(SleepLevel::One, PauseMode::Keep).await.unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    e.wake_up(&[]).await.unwrap();
    let awake_from = Instant::now();
    a.await.unwrap();
    b.await.unwrap();
    for t in [&first, &second] {
        assert_eq!(
            tokens_between(t, asleep_from, awake_from),
            0,
            "{:?}",
            t.lock().unwrap()
        );
        assert_eq!(
            tokens_between(t, awake_from, Instant::now() + Duration::from_secs(1)),
            3
        );
    }
}
