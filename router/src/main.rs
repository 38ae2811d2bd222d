//! `understudy-router`: the gateway (`gateway`) or the fence sidecar (`fence`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio::net::TcpListener;
use understudy_router::admin::{Admin, AdminToken};
use understudy_router::endpoint::EjectionPolicy;
use understudy_router::fence_sidecar::{Fence, FenceState, watch_lease};
use understudy_router::gateway::{Gateway, GatewayConfig, housekeeping};
use understudy_router::highest_epoch::StateFile;
use understudy_router::metrics::Metrics;
use understudy_router::serve::serve;
use understudy_router::table::RouteTable;
use understudy_router::waiting_room::WaitingRoomConfig;

#[derive(Parser, Debug)]
#[command(name = "understudy-router", version, about = "understudy's data path")]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// The epoch-fenced gateway in front of the primary pool.
    Gateway(GatewayArgs),
    /// The fence sidecar beside one vLLM replica.
    Fence(FenceArgs),
}

#[derive(clap::Args, Debug)]
struct GatewayArgs {
    /// Public address (OpenAI-compatible API).
    #[arg(long, env = "UNDERSTUDY_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Admin address (route updates, signals, metrics).
    #[arg(long, env = "UNDERSTUDY_ADMIN_LISTEN", default_value = "0.0.0.0:9090")]
    admin_listen: SocketAddr,
    /// File holding the admin bearer token.
    #[arg(long, env = "UNDERSTUDY_ADMIN_TOKEN_FILE", conflicts_with = "admin_token")]
    admin_token_file: Option<PathBuf>,
    /// The admin bearer token itself.
    #[arg(long, env = "UNDERSTUDY_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Where the highest epoch seen is kept across restarts.
    #[arg(long, env = "UNDERSTUDY_STATE_FILE")]
    state_file: Option<PathBuf>,
    /// Largest request body, in bytes.
    #[arg(long, env = "UNDERSTUDY_MAX_BODY_BYTES", default_value_t = 4 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Requests that may wait for a route at once.
    #[arg(long, env = "UNDERSTUDY_QUEUE_BOUND", default_value_t = 1024)]
    queue_bound: usize,
    /// How long a request may wait for a route, in milliseconds.
    #[arg(long, env = "UNDERSTUDY_QUEUE_DEADLINE_MS", default_value_t = 30_000)]
    queue_deadline_ms: u64,
    /// How long an upstream may take to send response headers, in milliseconds.
    #[arg(long, env = "UNDERSTUDY_FIRST_BYTE_TIMEOUT_MS", default_value_t = 120_000)]
    first_byte_timeout_ms: u64,
    /// First ejection of a failing endpoint, in milliseconds (multiplied per repeat).
    #[arg(long, env = "UNDERSTUDY_EJECTION_BASE_MS", default_value_t = 1_000)]
    ejection_base_ms: u64,
    /// Worker threads (0: one per core).
    #[arg(long, env = "UNDERSTUDY_WORKERS", default_value_t = 0)]
    workers: usize,
}

#[derive(clap::Args, Debug)]
struct FenceArgs {
    /// Address the sidecar serves on.
    #[arg(long, env = "UNDERSTUDY_LISTEN", default_value = "0.0.0.0:8001")]
    listen: SocketAddr,
    /// The local vLLM replica.
    #[arg(long, env = "UNDERSTUDY_UPSTREAM", default_value = "127.0.0.1:8000")]
    upstream: SocketAddr,
    /// This replica's pool, as the Lease's holder names it.
    #[arg(long, env = "UNDERSTUDY_POOL")]
    pool: String,
    /// The FailoverPolicy whose Lease (`<policy>-epoch`) is watched.
    #[arg(long, env = "UNDERSTUDY_POLICY")]
    policy: String,
    /// The policy's namespace.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// How often the Lease is read, in milliseconds.
    #[arg(long, env = "UNDERSTUDY_LEASE_POLL_MS", default_value_t = 1_000)]
    lease_poll_ms: u64,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let workers = match &cli.mode {
        Mode::Gateway(a) if a.workers > 0 => a.workers,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    // One worker: a current-thread runtime, which wakes tasks without cross-thread signalling
    // (the multi-thread runtime with one worker still pays an eventfd write per spawn).
    let rt = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()?
    };
    rt.block_on(async move {
        match cli.mode {
            Mode::Gateway(args) => gateway(args).await,
            Mode::Fence(args) => fence(args).await,
        }
    })
}

async fn gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let token_text = match (&args.admin_token_file, &args.admin_token) {
        (Some(path), _) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        (None, Some(t)) => t.clone(),
        (None, None) => {
            anyhow::bail!("an admin token is required: --admin-token-file or UNDERSTUDY_ADMIN_TOKEN")
        }
    };
    let token = AdminToken::new(&token_text)?;
    let routes = Arc::new(RouteTable::new(args.state_file.map(StateFile::new))?);
    if let Some(h) = routes.highest() {
        tracing::info!(epoch = %h.epoch, pool = %h.pool, "highest epoch read back from the state file");
    }
    let metrics = Arc::new(Metrics::default());
    let config = GatewayConfig {
        max_body_bytes: args.max_body_bytes,
        waiting_room: WaitingRoomConfig {
            bound: args.queue_bound,
            deadline: Duration::from_millis(args.queue_deadline_ms),
        },
        first_byte_timeout: Duration::from_millis(args.first_byte_timeout_ms),
        ejection: EjectionPolicy {
            base: Duration::from_millis(args.ejection_base_ms),
            ..EjectionPolicy::default()
        },
        ..GatewayConfig::default()
    };
    let gw = Gateway::new(config, Arc::clone(&routes), Arc::clone(&metrics));
    let admin = Admin {
        routes,
        metrics,
        token,
    };
    let public = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let admin_listener = TcpListener::bind(args.admin_listen)
        .await
        .with_context(|| format!("binding {}", args.admin_listen))?;
    tracing::info!(public = %public.local_addr()?, admin = %admin_listener.local_addr()?, "gateway listening");
    tokio::spawn(housekeeping(Arc::clone(&gw)));
    let admin_task = tokio::spawn(serve(admin_listener, move |req| admin.clone().handle(req)));
    let public_task = tokio::spawn(serve(public, move |req| Arc::clone(&gw).handle(req)));
    tokio::select! {
        _ = admin_task => anyhow::bail!("admin server stopped"),
        _ = public_task => anyhow::bail!("public server stopped"),
        r = tokio::signal::ctrl_c() => { r?; Ok(()) }
    }
}

async fn fence(args: FenceArgs) -> anyhow::Result<()> {
    let client = kube::Client::try_default().await.context("kubernetes client")?;
    let api = kube::Api::namespaced(client, &args.namespace);
    let lease = understudy_api::lease::KubeLease::for_policy(api, &args.policy);
    let state = Arc::new(FenceState::new(args.pool.clone()));
    tokio::spawn(watch_lease(
        lease,
        Arc::clone(&state),
        Duration::from_millis(args.lease_poll_ms),
    ));
    let fence = Fence::new(state, args.upstream);
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(listen = %listener.local_addr()?, upstream = %args.upstream, pool = %args.pool, "fence listening");
    tokio::select! {
        () = serve(listener, move |req| fence.clone().handle(req)) => Ok(()),
        r = tokio::signal::ctrl_c() => { r?; Ok(()) }
    }
}
