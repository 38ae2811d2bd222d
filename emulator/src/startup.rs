//! Starting up like `vllm serve`: the port is bound but refuses connections until the engine is
//! ready, and each stage prints vLLM's own log line with the time it really took.
//!
//! vLLM binds its socket before building the engine and listens only once the app is built, so
//! a connect gets *connection refused* until `Application startup complete.`; this module does
//! the same with a bound, unlistened socket, and logs the port it bound as soon as it has, so
//! `--port 0` can be used while the port still refuses. Stage times come from the settings
//! (weight size over load bandwidth, compile, CUDA graph capture, profiling) and the printed
//! numbers are measured, not copied from the settings. This module must never answer HTTP.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};
use tokio::time::Instant;

use super::Error;
use super::args::ServeArgs;
use super::cost::transfer;
use super::log::{Dialect, Log, Proc};
use super::settings::EmuSettings;

/// How long each stage takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StagePlan {
    pub weights: Duration,
    pub compile: Option<Duration>,
    pub cudagraph: Option<Duration>,
    pub profile: Duration,
    pub api_startup: Duration,
}

impl StagePlan {
    pub fn new(serve: &ServeArgs, emu: &EmuSettings) -> StagePlan {
        let d = |s: f64| {
            if emu.instant {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(s)
            }
        };
        let eager = serve.enforce_eager;
        StagePlan {
            weights: if emu.instant {
                Duration::ZERO
            } else {
                transfer(emu.weights_gib, emu.load_gib_per_s)
            },
            compile: (!eager).then(|| d(emu.compile_s)),
            cudagraph: (!eager).then(|| d(emu.cudagraph_s)),
            profile: d(emu.profile_s),
            api_startup: d(emu.api_startup_s),
        }
    }
}

/// Resolves `--host`/`--port` (no host: every IPv4 address, as vLLM's `""`).
pub async fn resolve(host: Option<&str>, port: u16) -> Result<SocketAddr, Error> {
    let host = host.filter(|h| !h.is_empty()).unwrap_or("0.0.0.0");
    let target = format!("{host}:{port}");
    let looked_up = tokio::net::lookup_host(target.clone()).await;
    let first = match looked_up {
        Ok(mut found) => found.next(),
        Err(source) => return Err(Error::Bind { addr: target, source }),
    };
    first.ok_or_else(|| Error::Bind {
        addr: target,
        source: std::io::Error::other("no address for host"),
    })
}

/// Binds without listening: the port is taken, and connections to it are refused.
pub fn reserve(addr: SocketAddr) -> Result<TcpSocket, Error> {
    let bind_err = |source| Error::Bind {
        addr: addr.to_string(),
        source,
    };
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .map_err(bind_err)?;
    socket.set_reuseaddr(true).map_err(bind_err)?;
    socket.bind(addr).map_err(bind_err)?;
    Ok(socket)
}

/// What the stages need to print.
#[derive(Debug, Clone)]
pub struct StartupFacts {
    pub version: String,
    pub config_line: String,
    pub kv_cache_tokens: u32,
    pub num_gpu_blocks: usize,
    pub max_model_len: u32,
    pub dev_mode: bool,
}

async fn stage(d: Duration) -> f64 {
    let t0 = Instant::now();
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
    t0.elapsed().as_secs_f64()
}

/// Runs the stages, printing vLLM's lines, and returns the listening socket once ready. The
/// address it binds (the OS's pick under `--port 0`) goes into `bound` as soon as it is bound.
pub async fn run(
    serve: &ServeArgs,
    emu: &EmuSettings,
    facts: &StartupFacts,
    log: &Arc<Log>,
    bound: &OnceLock<SocketAddr>,
) -> Result<TcpListener, Error> {
    announce(serve, facts, log);
    let (socket, addr) = bind_refusing(serve, log, bound).await?;
    let plan = StagePlan::new(serve, emu);
    load_weights(serve, emu, facts, plan, log).await;
    init_engine(emu, facts, plan, log).await;
    start_api(serve, facts, plan, log, socket, addr).await
}

/// The API server's first lines: its version, its arguments, and what it warns about.
fn announce(serve: &ServeArgs, facts: &StartupFacts, log: &Log) {
    let api = Proc::ApiServer;
    match log.dialect() {
        Dialect::V0_11 => log.info(
            api,
            "api_server.py:1839",
            &format!("vLLM API server version {}", facts.version),
        ),
        Dialect::V0_32 => {
            for line in banner(&facts.version, &serve.model) {
                log.info(api, "api_utils.py:347", &line);
            }
        }
    }
    log.info(
        api,
        "utils.py:233",
        &format!("non-default args: {}", serve.non_default_repr()),
    );
    if !serve.unmodelled.is_empty() {
        log.warning(
            api,
            "vllm_emulator.py:1",
            &format!(
                "the emulator accepts but does not model: {}",
                serve.unmodelled.join(", ")
            ),
        );
    }
    if facts.dev_mode {
        log.warning(
            api,
            "__init__.py:36",
            "SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!",
        );
    }
}

/// vLLM 0.32's banner: the logo, with the version and the model beside it.
fn banner(version: &str, model: &str) -> [String; 6] {
    [
        String::new(),
        "       █     █     █▄   ▄█".to_owned(),
        format!(" ▄▄ ▄█ █     █     █ ▀▄▀ █  version {version}"),
        format!("  █▄█▀ █     █     █     █  model   {model}"),
        "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀".to_owned(),
        String::new(),
    ]
}

/// Binds the serving port without listening, and says at once which port it is.
async fn bind_refusing(
    serve: &ServeArgs,
    log: &Log,
    bound: &OnceLock<SocketAddr>,
) -> Result<(TcpSocket, SocketAddr), Error> {
    let addr = resolve(serve.host.as_deref(), serve.port).await?;
    let socket = reserve(addr)?;
    let addr = socket.local_addr().map_err(|source| Error::Bind {
        addr: addr.to_string(),
        source,
    })?;
    let _ = bound.set(addr);
    // vLLM says where it serves only once ready; whoever started us with `--port 0` needs the
    // port while we still refuse (to see the refusal), so this line of our own says it now.
    log.info(
        Proc::ApiServer,
        "vllm_emulator.py:1",
        &format!("emulator API endpoint bound, refusing connections until ready, on http://{addr}"),
    );
    Ok((socket, addr))
}

/// The engine starts and loads the weights.
async fn load_weights(
    serve: &ServeArgs,
    emu: &EmuSettings,
    facts: &StartupFacts,
    plan: StagePlan,
    log: &Log,
) {
    let core = Proc::EngineCore;
    let worker = Proc::Worker;
    log.info(
        core,
        "core.py:77",
        &format!(
            "Initializing a V1 LLM engine (v{}) with config: {}",
            facts.version, facts.config_line
        ),
    );
    log.info(
        worker,
        "gpu_model_runner.py:2338",
        &format!("Starting to load model {}...", serve.model),
    );
    let weights = stage(plan.weights).await;
    log.info(
        worker,
        "default_loader.py:267",
        &format!("Loading weights took {weights:.2} seconds"),
    );
    log.info(
        worker,
        "gpu_model_runner.py:2370",
        &format!(
            "Model loading took {:.4} GiB memory and {weights:.6} seconds",
            emu.weights_gib
        ),
    );
}

/// The engine compiles, profiles memory, sizes the KV cache and captures CUDA graphs.
async fn init_engine(emu: &EmuSettings, facts: &StartupFacts, plan: StagePlan, log: &Log) {
    let core = Proc::EngineCore;
    let init_started = Instant::now();
    if let Some(compile) = plan.compile {
        compile_graphs(compile, log).await;
    }
    let profile = stage(plan.profile).await;
    log.info(
        core,
        "gpu_worker.py:276",
        &format!("Memory profiling takes {profile:.2} seconds"),
    );
    let kv_gib = facts.kv_cache_tokens as f64 * 1.0e-4;
    log.info(
        core,
        "gpu_worker.py:298",
        &format!("Available KV cache memory: {kv_gib:.2} GiB"),
    );
    log.info(
        core,
        "kv_cache_utils.py:1087",
        &format!("GPU KV cache size: {} tokens", thousands(facts.kv_cache_tokens)),
    );
    log.info(
        core,
        "kv_cache_utils.py:1091",
        &format!(
            "Maximum concurrency for {} tokens per request: {:.2}x",
            thousands(facts.max_model_len),
            facts.kv_cache_tokens as f64 / facts.max_model_len as f64
        ),
    );
    if let Some(cudagraph) = plan.cudagraph {
        let took = stage(cudagraph).await;
        log.info(
            core,
            "gpu_model_runner.py:3480",
            &format!(
                "Graph capturing finished in {took:.0} secs, took {:.2} GiB",
                emu.cudagraph_gib
            ),
        );
    }
    log.info(
        core,
        "core.py:210",
        &format!(
            "init engine (profile, create kv cache, warmup model) took {:.2} {}",
            init_started.elapsed().as_secs_f64(),
            match log.dialect() {
                Dialect::V0_11 => "seconds",
                Dialect::V0_32 => "s",
            }
        ),
    );
}

/// torch.compile: Dynamo's bytecode transform, then the graph compile.
async fn compile_graphs(compile: Duration, log: &Log) {
    let core = Proc::EngineCore;
    let dynamo = stage(compile.mul_f64(0.4)).await;
    log.info(
        core,
        "backends.py:539",
        &format!("Dynamo bytecode transform time: {dynamo:.2} s"),
    );
    let graph = stage(compile.mul_f64(0.6)).await;
    log.info(
        core,
        "backends.py:194",
        &format!("Compiling a graph for dynamic shape takes {graph:.2} s"),
    );
    log.info(
        core,
        "monitor.py:34",
        &format!("torch.compile takes {:.2} s in total", dynamo + graph),
    );
}

/// The API server builds its app and starts listening: from here connections are accepted.
async fn start_api(
    serve: &ServeArgs,
    facts: &StartupFacts,
    plan: StagePlan,
    log: &Log,
    socket: TcpSocket,
    addr: SocketAddr,
) -> Result<TcpListener, Error> {
    let api = Proc::ApiServer;
    log.info(
        api,
        "loggers.py:147",
        &format!(
            "vllm cache_config_info with initialization after num_gpu_blocks is: {}",
            facts.num_gpu_blocks
        ),
    );
    stage(plan.api_startup).await;
    log.info(api, "api_server.py:1611", "Supported tasks: ['generate']");
    let shown_host = serve
        .host
        .as_deref()
        .filter(|h| !h.is_empty())
        .unwrap_or("0.0.0.0");
    // vLLM prints its `--port`: the bound port, except under `--port 0`, where `:0` would tell
    // nobody where to connect.
    let (source, starting) = match log.dialect() {
        Dialect::V0_11 => ("api_server.py:1912", "Starting vLLM API server 0 on"),
        Dialect::V0_32 => ("entry.py:140", "Starting vLLM server on"),
    };
    log.info(
        api,
        source,
        &format!("{starting} http://{shown_host}:{}", addr.port()),
    );
    log_routes(log);
    let listener = socket.listen(1024).map_err(|source| Error::Bind {
        addr: addr.to_string(),
        source,
    })?;
    log.uvicorn(&format!("Started server process [{}]", log.pid()));
    log.uvicorn("Waiting for application startup.");
    log.uvicorn("Application startup complete.");
    Ok(listener)
}

/// The routes the API serves, as vLLM's launcher lists them.
fn log_routes(log: &Log) {
    let api = Proc::ApiServer;
    log.info(api, "launcher.py:34", "Available routes are:");
    for (route, methods) in [
        ("/health", "GET"),
        ("/ping", "GET, POST"),
        ("/version", "GET"),
        ("/v1/models", "GET"),
        ("/v1/completions", "POST"),
        ("/v1/chat/completions", "POST"),
        ("/tokenize", "POST"),
        ("/load", "GET"),
        ("/metrics", "GET"),
    ] {
        log.info(
            api,
            "launcher.py:42",
            &format!("Route: {route}, Methods: {methods}"),
        );
    }
}

/// `131072` → `131,072`, as vLLM prints token counts.
fn thousands(n: u32) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn enforce_eager_skips_compile_and_graph_capture_and_instant_zeroes_everything() {
        let mut serve = super::super::args::parse(&["serve".into(), "m".into()])
            .unwrap()
            .serve;
        let emu = EmuSettings {
            weights_gib: 4.0,
            load_gib_per_s: 2.0,
            ..EmuSettings::default()
        };
        let plan = StagePlan::new(&serve, &emu);
        assert_eq!(plan.weights, Duration::from_secs(2));
        assert!(plan.compile.is_some());
        serve.enforce_eager = true;
        let plan = StagePlan::new(&serve, &emu);
        assert_eq!((plan.compile, plan.cudagraph), (None, None));
        let plan = StagePlan::new(&serve, &EmuSettings { instant: true, ..emu });
        assert_eq!(plan.weights + plan.profile + plan.api_startup, Duration::ZERO);
    }

    #[test]
    fn token_counts_print_with_thousands_separators() {
        assert_eq!(thousands(131_072), "131,072");
        assert_eq!(thousands(946_384), "946,384");
        assert_eq!(thousands(512), "512");
    }
}
