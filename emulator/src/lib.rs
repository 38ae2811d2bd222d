//! A vLLM-compatible emulator: `vllm-emulator serve MODEL [vLLM flags]`.
//!
//! Everything understudy does (probes, parity, cold-start timelines, sleep-mode standbys,
//! failover) is tested against this emulator, so it copies what a client, an operator and a log
//! parser can observe of `vllm serve`: the flags, the refused port until ready, the startup log
//! lines with real stage times, the OpenAI routes and their SSE shape, the metrics, sleep mode and
//! its dev-mode gating, deterministic output tied to the model's identity, and a cost model in
//! which prefill, decode, batching and the prefix cache take time. Faults are injected through
//! flags or a separate control port. See `docs/emulator.md`.
//!
//! The pieces: [`args`] and [`settings`] read the command line; [`startup`] runs the stages;
//! [`engine`] schedules requests under the [`cost`] model and [`sleep`] mode; [`api`] and
//! [`sse`] speak HTTP; [`metrics`] exports; [`faults`] and [`control`] break things on purpose;
//! [`generate`] makes the text; [`log`] prints vLLM's lines. This module wires them and never
//! exits the process itself: [`run`] returns an [`Exit`] and the binary exits.

pub mod api;
pub mod args;
pub mod control;
pub mod cost;
pub mod engine;
pub mod faults;
pub mod generate;
pub mod local;
pub mod log;
pub mod metrics;
pub mod settings;
pub mod sleep;
pub mod sse;
pub mod startup;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use understudy_listener::{Limits, serve_service_until};

use self::api::{AppState, ServerInfo};
use self::args::ServeArgs;
use self::cost::{CostModel, blocks_for};
use self::engine::{Engine, EngineConfig};
use self::faults::ScheduledFault;
use self::generate::ModelIdentity;
use self::log::{Dialect, Log, Proc};
use self::metrics::Metrics;
use self::settings::EmuSettings;
use self::sleep::Bandwidths;

/// Everything that can stop the emulator from starting or serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("usage: vllm-emulator serve MODEL [vLLM flags] [--emu-… settings]: {0}")]
    Usage(String),
    #[error("argument --{flag}: {reason}")]
    Flag { flag: String, reason: String },
    #[error("emulator settings: {0}")]
    Settings(String),
    #[error("reading {path}: {source}")]
    ReadConfig { path: String, source: std::io::Error },
    #[error("fault `{spec}`: {reason}")]
    Fault { spec: String, reason: String },
    #[error("binding {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error(
        "To serve at least one request with the models's max seq len ({max_model_len}), the KV cache must \
         hold {max_model_len} tokens, but it holds {kv_cache_tokens}. Try decreasing `max_model_len` when \
         initializing the engine (or raise --emu-kv-cache-tokens)."
    )]
    KvCacheTooSmall {
        max_model_len: u32,
        kv_cache_tokens: u32,
    },
    #[error("starting the runtime: {0}")]
    Runtime(std::io::Error),
}

/// A parsed, validated emulator configuration.
#[derive(Debug, Clone)]
pub struct EmulatorConfig {
    pub serve: ServeArgs,
    pub emu: EmuSettings,
    pub faults: Vec<ScheduledFault>,
    /// `VLLM_SERVER_DEV_MODE=1`: the sleep-mode routes exist.
    pub dev_mode: bool,
    /// `VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`: the process outlives its engine.
    pub keep_alive_on_engine_death: bool,
    /// The `VLLM_*` environment without secrets, for `/server_info`.
    pub vllm_env: Vec<(String, String)>,
}

impl EmulatorConfig {
    /// Reads `serve MODEL [flags]` and the process environment's `VLLM_*` variables.
    pub fn from_args(
        argv: &[String],
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, Error> {
        let cmd = args::parse(argv)?;
        let emu = EmuSettings::from_flags(&cmd.emu)?;
        let faults = emu
            .fault
            .iter()
            .map(|f| ScheduledFault::parse(f))
            .collect::<Result<Vec<_>, _>>()?;
        let vllm_env: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with("VLLM_") && !k.contains("KEY"))
            .collect();
        let flag = |name: &str| {
            vllm_env
                .iter()
                .any(|(k, v)| k == name && matches!(v.as_str(), "1" | "true" | "True"))
        };
        let config = EmulatorConfig {
            dev_mode: flag("VLLM_SERVER_DEV_MODE"),
            keep_alive_on_engine_death: flag("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"),
            serve: cmd.serve,
            emu,
            faults,
            vllm_env,
        };
        if config.max_model_len() > config.emu.kv_cache_tokens {
            return Err(Error::KvCacheTooSmall {
                max_model_len: config.max_model_len(),
                kv_cache_tokens: config.emu.kv_cache_tokens,
            });
        }
        Ok(config)
    }

    /// The effective context length.
    pub fn max_model_len(&self) -> u32 {
        self.serve.max_model_len.unwrap_or(self.emu.model_max_len)
    }

    fn identity(&self) -> ModelIdentity {
        ModelIdentity {
            model: self.serve.model.clone(),
            served_name: self.serve.served_names()[0].clone(),
            revision: self.serve.revision.clone(),
            tokenizer: self.serve.tokenizer.clone(),
            weights_digest: self.emu.weights_digest.clone(),
        }
    }

    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            cost: CostModel::from_settings(&self.emu),
            max_num_seqs: self.serve.max_num_seqs,
            block_size: self.serve.block_size,
            kv_cache_tokens: self.emu.kv_cache_tokens,
            enable_prefix_caching: self.serve.enable_prefix_caching,
            enable_sleep_mode: self.serve.enable_sleep_mode,
            bandwidths: Bandwidths {
                weights_gib: self.emu.weights_gib,
                load_gib_per_s: self.emu.load_gib_per_s,
                host_gib_per_s: self.emu.host_gib_per_s,
                wake_alloc_s: self.emu.wake_alloc_s,
            },
            asleep_requests: self.emu.asleep_requests,
            deferred_warmup: Duration::from_secs_f64(self.emu.deferred_warmup_s),
            identity: self.identity(),
        }
    }

    /// Builds the engine (and its metrics) this configuration describes.
    pub fn build_engine(&self, log: Arc<Log>) -> Arc<Engine> {
        let cfg = self.engine_config();
        let blocks = blocks_for(cfg.kv_cache_tokens as usize, cfg.block_size);
        let metrics = Metrics::new(
            &self.serve.served_names()[0],
            self.max_model_len(),
            cfg.block_size,
            blocks,
            cfg.enable_prefix_caching,
        );
        Arc::new(Engine::new(cfg, metrics, log))
    }
}

/// Why the emulator stopped; the binary turns it into an exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// A `crash` fault.
    Crashed { code: i32 },
    /// The engine died and the watchdog shut the server down.
    EngineDied,
    /// SIGTERM or SIGINT: the requests in flight were answered, then the server stopped.
    Stopped,
}

impl Exit {
    pub fn code(self) -> i32 {
        match self {
            Exit::Crashed { code } => code,
            Exit::EngineDied => 1,
            Exit::Stopped => 0,
        }
    }
}

/// SIGTERM, as the kubelet stops a container, or SIGINT, as vLLM's launcher wires them both to
/// uvicorn's shutdown; logged as vLLM logs it.
/// The API port's limits: uvicorn's keep-alive timeout under vLLM (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`,
/// 5 s) bounds an idle connection and the wait for a head; the rest are the router's defaults.
/// Each request carries its client's address, for uvicorn's access line.
const API_LIMITS: Limits = Limits {
    header_read_timeout: Duration::from_secs(5),
    max_header_bytes: 64 * 1024,
    max_connections: 4096,
    peer_in_extensions: true,
};

async fn stop_asked(log: &Log) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => futures::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = terminate => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    log.info(
        Proc::ApiServer,
        "launcher.py:60",
        "Shutting down FastAPI HTTP server.",
    );
    log.uvicorn("Shutting down");
}

/// `system_fingerprint` as vLLM 0.32 sends it, `vllm-VERSION-HASH`, the hash here of the engine's
/// configuration line; `None` for the versions before 0.32, which sent `null`.
fn fingerprint(version: &str, config_line: &str) -> Option<String> {
    use sha2::Digest;
    (Dialect::of(version) == Dialect::V0_32).then(|| {
        let digest = sha2::Sha256::digest(config_line.as_bytes());
        let hash: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
        format!("vllm-{version}-{hash}")
    })
}

/// The addresses the emulator has bound, each set once bound. With `--port 0` or
/// `--emu-control-port 0` the OS picks the port; this is how an in-process owner learns it (a
/// process reads the log lines that carry it).
#[derive(Debug, Default)]
pub struct BoundAddrs {
    pub api: OnceLock<SocketAddr>,
    pub control: OnceLock<SocketAddr>,
}

/// Runs the emulator until a fault ends it (or forever).
pub async fn run(config: EmulatorConfig, log: Arc<Log>) -> Result<Exit, Error> {
    run_reporting(config, log, Arc::default()).await
}

/// Runs the emulator as the `vllm-emulator` binary does, from its arguments (`serve MODEL …`) and
/// this process's environment, logging to stdout, until it exits; returns its exit code.
pub fn run_to_exit(argv: &[String]) -> Result<i32, Error> {
    let config = EmulatorConfig::from_args(argv, std::env::vars())?;
    // One thread per replica: many replicas share a small machine, and a replica is mostly asleep.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::Runtime)?;
    let log = Log::stdout().in_dialect(Dialect::of(&config.emu.vllm_version));
    let exit = runtime.block_on(run(config, Arc::new(log)))?;
    Ok(exit.code())
}

/// [`run`], recording in `bound` each address as soon as it is bound.
pub async fn run_reporting(
    config: EmulatorConfig,
    log: Arc<Log>,
    bound: Arc<BoundAddrs>,
) -> Result<Exit, Error> {
    let started = Instant::now();
    let engine = config.build_engine(Arc::clone(&log));
    for fault in &config.faults {
        control::schedule(&engine, fault.clone(), started);
    }
    let ready = Arc::new(AtomicBool::new(false));
    if let Some(port) = config.emu.control_port {
        let addr = startup::resolve(Some(&config.emu.control_host), port).await?;
        let bind_err = |source| Error::Bind {
            addr: addr.to_string(),
            source,
        };
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        let _ = bound.control.set(addr);
        let control = Arc::new(control::Control {
            engine: Arc::clone(&engine),
            ready: Arc::clone(&ready),
        });
        let app = control::router(control);
        log.info(
            Proc::ApiServer,
            "vllm_emulator.py:1",
            &format!("emulator control endpoint on http://{addr}"),
        );
        tokio::spawn(serve_service_until(
            listener,
            app,
            Limits::default(),
            CancellationToken::new(),
        ));
    }

    let serving = {
        let engine = Arc::clone(&engine);
        let log = Arc::clone(&log);
        let config = config.clone();
        async move {
            let facts = startup::StartupFacts {
                version: engine
                    .faults
                    .drift()
                    .version
                    .unwrap_or_else(|| config.emu.vllm_version.clone()),
                config_line: config_line(&config),
                kv_cache_tokens: config.emu.kv_cache_tokens,
                num_gpu_blocks: engine.total_blocks(),
                max_model_len: config.max_model_len(),
                dev_mode: config.dev_mode,
            };
            let listener = startup::run(&config.serve, &config.emu, &facts, &log, &bound.api).await?;
            ready.store(true, Ordering::SeqCst);
            let info = ServerInfo {
                fingerprint: fingerprint(&config.emu.vllm_version, &facts.config_line),
                version: config.emu.vllm_version.clone(),
                max_model_len: config.max_model_len(),
                dev_mode: config.dev_mode,
                vllm_env: config.vllm_env.clone(),
                serve: config.serve.clone(),
            };
            let app = api::router(Arc::new(AppState::new(engine, info, Arc::clone(&log))));
            // Like uvicorn under vLLM's launcher: on SIGTERM no new connection is taken and the
            // requests in flight (streams included) are answered before the process exits. The
            // listener sets TCP_NODELAY (streamed tokens are small writes), and closes a
            // connection idle for uvicorn's keep-alive timeout.
            let stop = CancellationToken::new();
            let stopping = stop.clone();
            tokio::spawn(async move {
                stop_asked(&log).await;
                stopping.cancel();
            });
            serve_service_until(listener, app, API_LIMITS, stop).await;
            Ok(Exit::Stopped)
        }
    };
    tokio::select! {
        result = serving => result,
        code = engine.faults.crashed() => Ok(Exit::Crashed { code }),
        exit = watchdog(&engine, &log, config.emu.watchdog_s, config.keep_alive_on_engine_death) => Ok(exit),
    }
}

/// vLLM's `terminate_if_errored`, every `period_s`: a dead engine ends the server.
async fn watchdog(engine: &Engine, log: &Log, period_s: f64, keep_alive: bool) -> Exit {
    let mut changes = engine.faults.watch_changes();
    while !engine.is_dead() {
        if changes.changed().await.is_err() {
            futures::future::pending::<()>().await;
        }
    }
    log.error(
        Proc::ApiServer,
        "async_llm.py:480",
        "AsyncLLM output_handler failed.",
    );
    log.error(
        Proc::ApiServer,
        "async_llm.py:480",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for \
         the root cause.",
    );
    if keep_alive {
        return futures::future::pending().await;
    }
    let period = Duration::from_secs_f64(period_s.max(0.001));
    tokio::time::sleep(period).await;
    log.uvicorn("Shutting down");
    log.uvicorn("Waiting for application shutdown.");
    log.uvicorn("Application shutdown complete.");
    log.uvicorn(&format!("Finished server process [{}]", log.pid()));
    Exit::EngineDied
}

fn config_line(config: &EmulatorConfig) -> String {
    let s = &config.serve;
    format!(
        "model='{}', speculative_config=None, tokenizer='{}', skip_tokenizer_init=False, tokenizer_mode=auto, \
         revision={}, tokenizer_revision=None, trust_remote_code=False, dtype={}, max_seq_len={}, \
         download_dir=None, load_format=auto, tensor_parallel_size={}, pipeline_parallel_size=1, \
         data_parallel_size=1, disable_custom_all_reduce=False, quantization=None, enforce_eager={}, \
         kv_cache_dtype=auto, device_config=cuda, seed={}, served_model_name={}, enable_prefix_caching={}",
        s.model,
        s.tokenizer.as_deref().unwrap_or(&s.model),
        s.revision.as_deref().unwrap_or("None"),
        if s.dtype == "auto" {
            "torch.bfloat16"
        } else {
            &s.dtype
        },
        config.max_model_len(),
        s.tensor_parallel_size,
        if s.enforce_eager { "True" } else { "False" },
        s.seed,
        s.served_names().join(","),
        if s.enable_prefix_caching { "True" } else { "False" },
    )
}
