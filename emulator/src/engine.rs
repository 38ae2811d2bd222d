//! The emulated engine: admission, prefill, decode, sleep and wake, with the cost model's timing.
//!
//! Each request is a [`Generation`] driven by its HTTP handler, not by a central step loop: it
//! waits for a `--max-num-seqs` slot and KV blocks, queues for the single prefill lane, then
//! sleeps one decode step per token. The engine's shared state is atomics, two semaphores, one
//! FIFO mutex for prefill, and a `watch` gate that sleep, wake and engine death flip. A dropped
//! generation (client gone) releases everything it held. Time is tokio's, so tests pause it.
//! This module must never know about HTTP, JSON or the process; it reports, the API answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex as AsyncMutex, OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;

use super::cost::{CostModel, PrefixCache, blocks_for};
use super::faults::{Fault, FaultBoard, HalfFailure};
use super::generate::{ModelIdentity, Sampling, Token, TokenSource, wrong_output_seed};
use super::log::{Log, Proc};
use super::metrics::{Metrics, SleepSeries};
use super::settings::AsleepRequests;
use super::sleep::{Bandwidths, PauseMode, SleepLevel, SleepState};

/// What the engine is built from.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub cost: CostModel,
    pub max_num_seqs: u32,
    pub block_size: u32,
    pub kv_cache_tokens: u32,
    pub enable_prefix_caching: bool,
    pub enable_sleep_mode: bool,
    pub bandwidths: Bandwidths,
    pub asleep_requests: AsleepRequests,
    pub deferred_warmup: Duration,
    pub identity: ModelIdentity,
}

/// What every waiting and running request watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Gate {
    /// Awake and not paused: requests may be scheduled.
    serving: bool,
    /// Asleep (not merely paused for a sleep in progress).
    asleep: bool,
    /// Bumped by `/sleep?mode=abort`: every request admitted before it finishes with `abort`.
    abort_epoch: u64,
    /// `/sleep?mode=wait` is letting the requests already running finish; queued ones still wait.
    draining: bool,
    /// The engine is stopped (`engine-hung`): nothing is scheduled, nothing runs on.
    hung: bool,
    dead: bool,
}

/// Where a request stands when it asks the gate whether it may go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Not yet holding a sequence slot: parks or aborts while asleep per `--asleep-requests`.
    Queued,
    /// Holding a slot: runs on through a `mode=wait` drain, freezes otherwise.
    Running,
}

impl Gate {
    /// `Ok(true)`: go on; `Ok(false)`: wait for the gate to change; `Err`: the request ends so.
    fn admits(&self, standing: Standing, epoch: u64, asleep_requests: AsleepRequests) -> Result<bool, Event> {
        if self.dead {
            return Err(Event::Failed(GenerationError::EngineDead));
        }
        if self.abort_epoch != epoch {
            return Err(aborted());
        }
        if self.hung {
            return Ok(false);
        }
        if self.serving || (standing == Standing::Running && self.draining) {
            return Ok(true);
        }
        if standing == Standing::Queued && self.asleep && asleep_requests == AsleepRequests::Abort {
            return Err(aborted());
        }
        Ok(false)
    }
}

/// Why a request ended without finishing normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GenerationError {
    #[error("EngineCore encountered an issue. See stack trace (above) for the root cause.")]
    EngineDead,
    #[error("Internal server error: the engine failed to generate.")]
    HalfFailed,
}

/// How a finished request ended (vLLM's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// One step of a generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Token(&'static str),
    /// The request finished; `stop_reason` is the stop string that ended it, if one did.
    Finished {
        reason: FinishReason,
        stop_reason: Option<String>,
    },
    Failed(GenerationError),
}

/// Why sleep or wake refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SleepError {
    #[error("Sleep mode is not enabled. Please relaunch the server with --enable-sleep-mode.")]
    NotEnabled,
    #[error("engine is dead")]
    EngineDead,
}

/// What a request asks the engine for.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
}

/// The emulated engine.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    identity_seed: AtomicU64,
    seq_slots: Arc<Semaphore>,
    kv_blocks: Arc<Semaphore>,
    total_blocks: usize,
    prefill_lane: AsyncMutex<()>,
    prefix_cache: std::sync::Mutex<PrefixCache>,
    sleep: AsyncMutex<SleepState>,
    garbage_weights: AtomicBool,
    gate: watch::Sender<Gate>,
    waiting: AtomicUsize,
    running: AtomicUsize,
    drained: tokio::sync::Notify,
    warmed: AtomicBool,
    random: AtomicU64,
    pub faults: FaultBoard,
    pub metrics: Metrics,
    log: Arc<Log>,
}

impl Engine {
    pub fn new(cfg: EngineConfig, metrics: Metrics, log: Arc<Log>) -> Engine {
        let total_blocks = blocks_for(cfg.kv_cache_tokens as usize, cfg.block_size).max(1);
        let seed = cfg.identity.seed();
        Engine {
            identity_seed: AtomicU64::new(seed),
            seq_slots: Arc::new(Semaphore::new(cfg.max_num_seqs as usize)),
            kv_blocks: Arc::new(Semaphore::new(total_blocks)),
            total_blocks,
            prefill_lane: AsyncMutex::new(()),
            prefix_cache: std::sync::Mutex::new(PrefixCache::new(
                cfg.block_size,
                cfg.kv_cache_tokens,
                cfg.enable_prefix_caching,
            )),
            sleep: AsyncMutex::new(SleepState::default()),
            garbage_weights: AtomicBool::new(false),
            gate: watch::channel(Gate {
                serving: true,
                asleep: false,
                abort_epoch: 0,
                draining: false,
                hung: false,
                dead: false,
            })
            .0,
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            drained: tokio::sync::Notify::new(),
            warmed: AtomicBool::new(cfg.deferred_warmup.is_zero()),
            random: AtomicU64::new(0x5eed_0000 ^ u64::from(std::process::id())),
            faults: FaultBoard::default(),
            metrics,
            log,
            cfg,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// KV-cache blocks in the whole cache.
    pub fn total_blocks(&self) -> usize {
        self.total_blocks
    }

    /// Puts a fault in force, with what it does to the engine beyond the switchboard.
    pub fn apply_fault(&self, fault: &Fault) {
        self.faults.apply(fault);
        match fault {
            Fault::EngineDead => self.gate.send_modify(|g| g.dead = true),
            Fault::EngineHung => self.gate.send_modify(|g| g.hung = true),
            Fault::Drift(_) | Fault::Clear => {
                if matches!(fault, Fault::Clear) {
                    self.gate.send_modify(|g| g.hung = false);
                }
                let mut identity = self.cfg.identity.clone();
                if let Some(d) = self.faults.drift().weights_digest {
                    identity.weights_digest = Some(d);
                }
                self.identity_seed.store(identity.seed(), Ordering::SeqCst);
            }
            _ => {}
        }
    }

    /// Requests queued or running (what `/load` reports).
    pub fn load(&self) -> usize {
        self.waiting.load(Ordering::Relaxed) + self.running.load(Ordering::Relaxed)
    }

    pub fn is_dead(&self) -> bool {
        self.faults.engine_dead()
    }

    pub async fn is_sleeping(&self) -> bool {
        self.sleep.lock().await.is_sleeping()
    }

    /// Whether the next generation would produce the model's text.
    pub fn weights_valid(&self) -> bool {
        !self.garbage_weights.load(Ordering::Relaxed)
    }

    /// Whether the prefix cache holds nothing.
    pub fn prefix_cache_is_empty(&self) -> bool {
        self.prefix_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// `/reset_prefix_cache`.
    pub fn reset_prefix_cache(&self) {
        self.prefix_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// `/sleep?level=&mode=`: pauses scheduling, handles running requests per `mode`, frees memory.
    pub async fn sleep(&self, level: SleepLevel, mode: PauseMode) -> Result<(), SleepError> {
        if !self.cfg.enable_sleep_mode {
            return Err(SleepError::NotEnabled);
        }
        if self.is_dead() {
            return Err(SleepError::EngineDead);
        }
        let mut state = self.sleep.lock().await;
        if state.is_sleeping() {
            return Ok(());
        }
        self.gate.send_modify(|g| {
            g.serving = false;
            g.draining = mode == PauseMode::Wait;
            if mode == PauseMode::Abort {
                g.abort_epoch += 1;
            }
        });
        if mode == PauseMode::Wait {
            loop {
                let drained = self.drained.notified();
                if self.running.load(Ordering::SeqCst) == 0 {
                    break;
                }
                drained.await;
            }
            self.gate.send_modify(|g| g.draining = false);
        }
        let took = state.sleep(level, &self.cfg.bandwidths);
        wait(took).await;
        self.reset_prefix_cache();
        self.gate.send_modify(|g| g.asleep = true);
        self.metrics.set_sleep_state(match level {
            SleepLevel::One => SleepSeries::WeightsOffloaded,
            SleepLevel::Two => SleepSeries::DiscardAll,
        });
        let freed = self.cfg.bandwidths.weights_gib + self.cfg.kv_cache_tokens as f64 * 1.0e-4;
        self.log.info(
            Proc::EngineCore,
            "gpu_worker.py:122",
            &format!("Sleep mode freed {freed:.2} GiB memory, 0.45 GiB memory is still in use."),
        );
        Ok(())
    }

    /// `/wake_up?tags=`: brings tags back (all when `tags` is empty); the prefix cache stays empty.
    pub async fn wake_up(&self, tags: &[String]) -> Result<(), SleepError> {
        if self.is_dead() {
            return Err(SleepError::EngineDead);
        }
        let shown = if tags.is_empty() {
            "None".to_string()
        } else {
            format!(
                "[{}]",
                tags.iter()
                    .map(|t| format!("'{t}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        self.log.info(
            Proc::ApiServer,
            "api_router.py:57",
            &format!("wake up the engine with tags: {shown}"),
        );
        let mut state = self.sleep.lock().await;
        let took = state.wake(tags, &self.cfg.bandwidths);
        wait(took).await;
        self.garbage_weights
            .store(!state.weights_valid(), Ordering::SeqCst);
        if !state.is_sleeping() {
            self.reset_prefix_cache();
            self.metrics.set_sleep_state(SleepSeries::Awake);
            self.gate.send_modify(|g| {
                g.serving = true;
                g.asleep = false;
            });
        }
        Ok(())
    }

    /// `collective_rpc reload_weights`: the weights are the model's again after this.
    pub async fn reload_weights(&self) -> Result<(), SleepError> {
        if self.is_dead() {
            return Err(SleepError::EngineDead);
        }
        let mut state = self.sleep.lock().await;
        let took = state.reload_weights(&self.cfg.bandwidths);
        wait(took).await;
        self.garbage_weights
            .store(!state.weights_valid(), Ordering::SeqCst);
        Ok(())
    }

    /// Starts a generation; nothing happens until it is polled.
    pub fn generate(self: &Arc<Self>, request: GenerationRequest) -> Generation {
        let sampling = match request.sampling {
            Sampling::Random(_) => Sampling::Random(self.random.fetch_add(0x9e37_79b9, Ordering::Relaxed)),
            other => other,
        };
        self.waiting.fetch_add(1, Ordering::Relaxed);
        self.refresh_queue_gauges();
        Generation {
            engine: Arc::clone(self),
            request: GenerationRequest { sampling, ..request },
            phase: Phase::Queued,
            held: None,
            source: None,
            abort_epoch: self.gate.borrow().abort_epoch,
            arrived: Instant::now(),
            admitted: None,
            first_token: None,
            last_token: None,
            emitted: 0,
            text: String::new(),
            recorded: false,
        }
    }

    fn refresh_queue_gauges(&self) {
        self.metrics
            .num_requests_waiting
            .set(self.waiting.load(Ordering::Relaxed) as f64);
        self.metrics
            .num_requests_running
            .set(self.running.load(Ordering::Relaxed) as f64);
    }

    fn refresh_kv_gauge(&self) {
        let used = self
            .total_blocks
            .saturating_sub(self.kv_blocks.available_permits());
        self.metrics
            .kv_cache_usage_perc
            .set(used as f64 / self.total_blocks as f64);
    }
}

async fn wait(d: Duration) {
    // Zero-cost paths skip the timer entirely: the benchmark measures the emulator, not tokio.
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queued,
    Decoding,
    Done,
}

/// One request's progress through the engine. Dropping it aborts the request.
#[derive(Debug)]
pub struct Generation {
    engine: Arc<Engine>,
    request: GenerationRequest,
    phase: Phase,
    held: Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)>,
    source: Option<TokenSource>,
    abort_epoch: u64,
    arrived: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    emitted: u32,
    text: String,
    recorded: bool,
}

impl Generation {
    pub fn prompt_tokens(&self) -> usize {
        self.request.prompt.len()
    }

    pub fn max_tokens(&self) -> u32 {
        self.request.max_tokens
    }

    pub fn completion_tokens(&self) -> u32 {
        self.emitted
    }

    /// The next event; `None` after the request has finished or failed.
    pub async fn next(&mut self) -> Option<Event> {
        let event = match self.phase {
            Phase::Done => return None,
            Phase::Queued => self.admit_and_prefill().await,
            Phase::Decoding => self.decode().await,
        };
        match &event {
            Event::Token(_) => self.phase = Phase::Decoding,
            Event::Finished { reason, .. } => self.finish(reason.as_str()),
            Event::Failed(_) => self.finish("error"),
        }
        Some(event)
    }

    /// Waits until the gate lets this request go on; `Err` is how the request ends instead.
    async fn pass_gate(&self, gate: &mut watch::Receiver<Gate>, standing: Standing) -> Result<(), Event> {
        loop {
            let g = *gate.borrow_and_update();
            if g.admits(standing, self.abort_epoch, self.engine.cfg.asleep_requests)? {
                return Ok(());
            }
            if gate.changed().await.is_err() {
                return Err(Event::Failed(GenerationError::EngineDead));
            }
        }
    }

    /// Whether the gate lets this request go on right now, without waiting.
    fn gate_open(&self, gate: &mut watch::Receiver<Gate>, standing: Standing) -> Result<bool, Event> {
        let g = *gate.borrow_and_update();
        g.admits(standing, self.abort_epoch, self.engine.cfg.asleep_requests)
    }

    async fn admit_and_prefill(&mut self) -> Event {
        match self.try_admit_and_prefill().await {
            Ok(event) | Err(event) => event,
        }
    }

    async fn try_admit_and_prefill(&mut self) -> Result<Event, Event> {
        let engine = Arc::clone(&self.engine);
        let mut gate = engine.gate.subscribe();
        let blocks = blocks_for(
            self.request.prompt.len() + self.request.max_tokens as usize,
            engine.cfg.block_size,
        )
        .clamp(1, engine.total_blocks) as u32;
        // A sleep can land while the request waits for its slot and blocks: look again once it
        // holds them, and give them back while it parks so a `mode=wait` drain is not held up.
        let held = loop {
            self.pass_gate(&mut gate, Standing::Queued).await?;
            let (Ok(slot), Ok(kv)) = (
                Arc::clone(&engine.seq_slots).acquire_owned().await,
                Arc::clone(&engine.kv_blocks).acquire_many_owned(blocks).await,
            ) else {
                return Err(Event::Failed(GenerationError::EngineDead));
            };
            if self.gate_open(&mut gate, Standing::Queued)? {
                break (slot, kv);
            }
        };
        self.held = Some(held);
        self.admitted = Some(Instant::now());
        engine.waiting.fetch_sub(1, Ordering::Relaxed);
        engine.running.fetch_add(1, Ordering::Relaxed);
        engine.refresh_queue_gauges();
        engine.refresh_kv_gauge();

        let prompt = &self.request.prompt;
        loop {
            let lane = engine.prefill_lane.lock().await;
            // The lane is FIFO; a sleep may have landed while this request queued for it.
            if !self.gate_open(&mut gate, Standing::Running)? {
                drop(lane);
                self.pass_gate(&mut gate, Standing::Running).await?;
                continue;
            }
            let (hashes, cached) = {
                let cache = engine.prefix_cache.lock().unwrap_or_else(|e| e.into_inner());
                let hashes = cache.block_hashes(prompt);
                let cached = cache.cached_tokens(&hashes, prompt.len());
                (hashes, cached)
            };
            let m = &engine.metrics;
            m.prefix_cache_queries
                .fetch_add(prompt.len() as u64, Ordering::Relaxed);
            m.prefix_cache_hits.fetch_add(cached as u64, Ordering::Relaxed);
            m.prompt_tokens.fetch_add(prompt.len() as u64, Ordering::Relaxed);
            m.iteration_tokens.observe((prompt.len() - cached).max(1) as f64);
            let mut took = engine
                .cfg
                .cost
                .prefill(prompt.len() - cached, engine.faults.slow());
            if !engine.warmed.swap(true, Ordering::SeqCst) {
                took += engine.cfg.deferred_warmup;
            }
            wait(took).await;
            engine
                .prefix_cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(&hashes);
            break;
        }
        // A sleep that landed during the prefill holds the first token back until wake.
        self.pass_gate(&mut gate, Standing::Running).await?;
        let mut seed = engine.identity_seed.load(Ordering::Relaxed);
        if engine.faults.wrong_output() {
            seed = wrong_output_seed(seed);
        }
        self.source = Some(TokenSource::new(
            seed,
            prompt,
            self.request.sampling,
            !engine.weights_valid(),
            self.request.ignore_eos,
        ));
        if self.request.max_tokens == 0 {
            return Ok(Event::Finished {
                reason: FinishReason::Length,
                stop_reason: None,
            });
        }
        Ok(self.produce())
    }

    async fn decode(&mut self) -> Event {
        let engine = Arc::clone(&self.engine);
        let mut gate = engine.gate.subscribe();
        // `mode=keep`: frozen until wake.
        if let Err(event) = self.pass_gate(&mut gate, Standing::Running).await {
            return event;
        }
        match engine.faults.half_failed() {
            Some(HalfFailure::Error) => return Event::Failed(GenerationError::HalfFailed),
            Some(HalfFailure::Stall) => futures::future::pending::<()>().await,
            None => {}
        }
        if self.emitted >= self.request.max_tokens {
            return Event::Finished {
                reason: FinishReason::Length,
                stop_reason: None,
            };
        }
        let running = engine.running.load(Ordering::Relaxed);
        wait(engine.cfg.cost.decode_step(running, engine.faults.slow())).await;
        // A sleep that landed during the step holds its token back until wake.
        if let Err(event) = self.pass_gate(&mut gate, Standing::Running).await {
            return event;
        }
        self.produce()
    }

    fn produce(&mut self) -> Event {
        let Some(source) = self.source.as_mut() else {
            return Event::Failed(GenerationError::EngineDead);
        };
        let text = match source.next_token() {
            Token::Eos => {
                return Event::Finished {
                    reason: FinishReason::Stop,
                    stop_reason: None,
                };
            }
            Token::Text(t) => t,
        };
        if !self.request.stop.is_empty() {
            self.text.push_str(text);
            if let Some(hit) = self
                .request
                .stop
                .iter()
                .find(|s| !s.is_empty() && self.text.contains(s.as_str()))
            {
                return Event::Finished {
                    reason: FinishReason::Stop,
                    stop_reason: Some(hit.clone()),
                };
            }
        }
        let now = Instant::now();
        let m = &self.engine.metrics;
        match self.last_token {
            None => {
                self.first_token = Some(now);
                m.time_to_first_token.observe((now - self.arrived).as_secs_f64());
            }
            Some(last) => m.inter_token_latency.observe((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.emitted += 1;
        m.generation_tokens.fetch_add(1, Ordering::Relaxed);
        Event::Token(text)
    }

    fn finish(&mut self, reason: &str) {
        self.phase = Phase::Done;
        if self.recorded {
            return;
        }
        self.recorded = true;
        let engine = &self.engine;
        let m = &engine.metrics;
        let now = Instant::now();
        m.request_finished(reason);
        m.e2e_request_latency.observe((now - self.arrived).as_secs_f64());
        m.request_params_max_tokens
            .observe(f64::from(self.request.max_tokens));
        m.request_max_num_generation_tokens
            .observe(f64::from(self.request.max_tokens));
        m.request_params_n.observe(1.0);
        m.request_prompt_tokens.observe(self.request.prompt.len() as f64);
        m.request_generation_tokens.observe(f64::from(self.emitted));
        if let Some(admitted) = self.admitted {
            m.request_queue_time
                .observe((admitted - self.arrived).as_secs_f64());
            m.request_inference_time.observe((now - admitted).as_secs_f64());
            if let Some(first) = self.first_token {
                m.request_prefill_time.observe((first - admitted).as_secs_f64());
                m.request_decode_time.observe((now - first).as_secs_f64());
                if self.emitted > 1 {
                    m.request_time_per_output_token
                        .observe((now - first).as_secs_f64() / f64::from(self.emitted - 1));
                }
            }
        }
        self.release();
    }

    fn release(&mut self) {
        let engine = &self.engine;
        if self.held.take().is_some() {
            engine.running.fetch_sub(1, Ordering::SeqCst);
            engine.drained.notify_waiters();
            engine.refresh_kv_gauge();
        } else if self.admitted.is_none() {
            engine.waiting.fetch_sub(1, Ordering::Relaxed);
            // Counted as admitted now so a second release does not count it again.
            self.admitted = Some(Instant::now());
        }
        engine.refresh_queue_gauges();
    }
}

fn aborted() -> Event {
    Event::Finished {
        reason: FinishReason::Abort,
        stop_reason: None,
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.recorded {
            self.finish("abort");
        }
    }
}
