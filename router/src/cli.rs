//! The `understudy-router` command line: the gateway (`gateway`) or the fence sidecar (`fence`),
//! each on a runtime of its own. A library module so that other binaries (the game day's, the
//! end-to-end tests') can start the router as a real process without a second copy of it.
//!
//! Once bound, each listener is announced on stdout in one line, `understudy-router <listener>
//! listening on http://<addr>`, so a parent that asked for port 0 can read the port back. Those
//! lines are a contract: what this module must never do is change their wording, or announce a
//! listener before it is bound.

use std::ffi::OsString;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::{ArgGroup, Parser, Subcommand};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use understudy_api::lease::{FileLease, KubeLease};

use crate::admin::{Admin, AdminToken};
use crate::break_glass::GrantArgs;
use crate::endpoint::EjectionPolicy;
use crate::fence_sidecar::{Fence, FenceState, watch_lease};
use crate::gateway::{Gateway, GatewayConfig, housekeeping};
use crate::grant::{Granted, keep_grant};
use crate::highest_epoch::StateFile;
use crate::metrics::Metrics;
use crate::retry::RetryLimits;
use crate::table::RouteTable;
use crate::waiting_room::WaitingRoomConfig;
use understudy_listener::{Limits, serve_until};

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
    /// Break glass: grant an epoch to the fences by hand, when the operator cannot.
    Grant(GrantArgs),
}

#[derive(clap::Args, Debug)]
struct GatewayArgs {
    /// Public address (OpenAI-compatible API). Loopback by default: in a pod, give the pod's
    /// address (or 0.0.0.0) on purpose.
    #[arg(long, env = "UNDERSTUDY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Admin address (route updates, signals, metrics). Loopback by default.
    #[arg(long, env = "UNDERSTUDY_ADMIN_LISTEN", default_value = "127.0.0.1:9090")]
    admin_listen: SocketAddr,
    /// File holding the admin bearer token. Without it, the token is read from the environment
    /// (`UNDERSTUDY_ADMIN_TOKEN`); never from the command line, which every user of the machine
    /// can read in the process list.
    #[arg(long, env = "UNDERSTUDY_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// Where the highest epoch seen is kept across restarts.
    #[arg(long, env = "UNDERSTUDY_STATE_FILE")]
    state_file: Option<PathBuf>,
    /// How far above the highest epoch seen a route may go unless forced (`PUT /route?force=true`).
    #[arg(long, env = "UNDERSTUDY_MAX_EPOCH_JUMP", default_value_t = crate::highest_epoch::DEFAULT_MAX_EPOCH_JUMP)]
    max_epoch_jump: u64,
    /// Largest request body, in bytes.
    #[arg(long, env = "UNDERSTUDY_MAX_BODY_BYTES", default_value_t = 4 * 1024 * 1024)]
    max_body_bytes: usize,
    /// How long a whole request body may take to arrive, in milliseconds (408 beyond).
    #[arg(long, env = "UNDERSTUDY_BODY_READ_TIMEOUT_MS", default_value_t = 30_000)]
    body_read_timeout_ms: u64,
    /// The header that tells tenants apart, so that admission control shares its budget fairly
    /// between them: the API key by default.
    #[arg(long, env = "UNDERSTUDY_TENANT_HEADER", default_value = "authorization")]
    tenant_header: http::HeaderName,
    /// Requests that may wait for a route at once.
    #[arg(long, env = "UNDERSTUDY_QUEUE_BOUND", default_value_t = 1024)]
    queue_bound: usize,
    /// How long a request may wait for a route, in milliseconds.
    #[arg(long, env = "UNDERSTUDY_QUEUE_DEADLINE_MS", default_value_t = 30_000)]
    queue_deadline_ms: u64,
    /// How long an upstream may take to send response headers, and a stream its first byte of
    /// body, in milliseconds.
    #[arg(long, env = "UNDERSTUDY_FIRST_BYTE_TIMEOUT_MS", default_value_t = 120_000)]
    first_byte_timeout_ms: u64,
    /// First ejection of a failing endpoint, in milliseconds (multiplied per repeat).
    #[arg(long, env = "UNDERSTUDY_EJECTION_BASE_MS", default_value_t = 1_000)]
    ejection_base_ms: u64,
    /// The longest ejection, in milliseconds.
    #[arg(long, env = "UNDERSTUDY_EJECTION_MAX_MS", default_value_t = 30_000)]
    ejection_max_ms: u64,
    /// Below this percentage of endpoints not ejected (but above none), ejections are ignored
    /// and all endpoints take requests (Envoy's panic threshold); 0 turns it off.
    #[arg(long, env = "UNDERSTUDY_PANIC_BELOW_PERCENT", default_value_t = 50,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    panic_below_percent: u32,
    /// Retries in flight allowed, as a percentage of the requests in flight (0 with a floor
    /// of 0: no retries at all).
    #[arg(long, env = "UNDERSTUDY_RETRY_BUDGET_PERCENT", default_value_t = 20)]
    retry_budget_percent: usize,
    /// Retries in flight always allowed, whatever the percentage.
    #[arg(long, env = "UNDERSTUDY_RETRY_BUDGET_FLOOR", default_value_t = 3)]
    retry_budget_floor: usize,
    /// Worker threads (0: one per core).
    #[arg(long, env = "UNDERSTUDY_WORKERS", default_value_t = 0)]
    workers: usize,
    #[command(flatten)]
    serving: ServingArgs,
}

/// How a process's ports bound their clients, and how it stops. Kubernetes waits
/// `terminationGracePeriodSeconds` (30 s by default) after SIGTERM: the drain delay and timeout
/// together must fit in it.
#[derive(clap::Args, Debug, Clone, Copy)]
struct ServingArgs {
    /// How long a request's head (and the wait for the next one on a kept-alive connection) may
    /// take, in milliseconds; the connection is closed beyond. 0 turns it off.
    #[arg(long, env = "UNDERSTUDY_HEADER_READ_TIMEOUT_MS", default_value_t = 10_000)]
    header_read_timeout_ms: u64,
    /// The largest request head, in bytes (431 beyond).
    #[arg(long, env = "UNDERSTUDY_MAX_HEADER_BYTES", default_value_t = 64 * 1024)]
    max_header_bytes: usize,
    /// Connections served at once on each port; one more gets 503 with Retry-After.
    #[arg(long, env = "UNDERSTUDY_MAX_CONNECTIONS", default_value_t = 4096)]
    max_connections: usize,
    /// After SIGTERM, how long readiness fails while everything is still served, so that callers
    /// notice before connections are refused, in milliseconds.
    #[arg(long, env = "UNDERSTUDY_DRAIN_DELAY_MS", default_value_t = 5_000)]
    drain_delay_ms: u64,
    /// Then, how long the requests in flight may take to finish, in milliseconds; streams still
    /// open after it end with the retryable error event.
    #[arg(long, env = "UNDERSTUDY_DRAIN_TIMEOUT_MS", default_value_t = 20_000)]
    drain_timeout_ms: u64,
}

impl ServingArgs {
    fn limits(self) -> Limits {
        Limits {
            header_read_timeout: Duration::from_millis(self.header_read_timeout_ms),
            max_header_bytes: self.max_header_bytes,
            max_connections: self.max_connections.max(1),
            peer_in_extensions: false,
        }
    }
}

#[derive(clap::Args, Debug)]
#[command(group(ArgGroup::new("lease").required(true).args(["policy", "lease_file", "grants"])))]
struct FenceArgs {
    /// Address the sidecar serves on. Loopback by default: in a pod, give the pod's address so
    /// that the gateway can reach it.
    #[arg(long, env = "UNDERSTUDY_LISTEN", default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// The local vLLM replica.
    #[arg(long, env = "UNDERSTUDY_UPSTREAM", default_value = "127.0.0.1:8000")]
    upstream: SocketAddr,
    /// This replica's pool, as the Lease's holder names it.
    #[arg(long, env = "UNDERSTUDY_POOL")]
    pool: String,
    /// The FailoverPolicy whose Lease (`<policy>-epoch`) is watched in Kubernetes.
    #[arg(long, env = "UNDERSTUDY_POLICY")]
    policy: Option<String>,
    /// The policy's namespace.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// A Lease kept in this file instead of Kubernetes, for processes on one machine.
    #[arg(long, env = "UNDERSTUDY_LEASE_FILE", conflicts_with = "policy")]
    lease_file: Option<PathBuf>,
    /// Serve under grants pushed by the operator (`PUT /understudy/grant` with its token) instead
    /// of reading a Lease: the fence needs no credentials for the cluster that holds the Lease, and
    /// stops on its own when its grant runs out.
    #[arg(long, env = "UNDERSTUDY_GRANTS", conflicts_with_all = ["policy", "lease_file"])]
    grants: bool,
    /// How often the Lease is read, in milliseconds.
    #[arg(long, env = "UNDERSTUDY_LEASE_POLL_MS", default_value_t = 1_000)]
    lease_poll_ms: u64,
    /// File holding the operator's token, which control calls (`/sleep`, `/wake_up`, ...) must
    /// carry. Without it, the token is read from `UNDERSTUDY_CONTROL_TOKEN`; without either,
    /// every control call is refused.
    #[arg(long, env = "UNDERSTUDY_CONTROL_TOKEN_FILE")]
    control_token_file: Option<PathBuf>,
    /// How long a generation that was running when the pool lost the Lease may go on, in
    /// milliseconds, before it is cut (the gateway then ends it as its stream contract says): the
    /// policy's `stream.drainFor`.
    #[arg(long, env = "UNDERSTUDY_DRAIN_MS", default_value_t = 60_000)]
    drain_ms: u64,
    #[command(flatten)]
    serving: ServingArgs,
}

/// A listener announced on stdout once it is bound.
#[derive(Clone, Copy, Debug)]
enum Listener {
    Gateway,
    Admin,
    Fence,
}

impl Listener {
    fn announcement(self, addr: SocketAddr) -> String {
        let name = match self {
            Listener::Gateway => "gateway",
            Listener::Admin => "admin",
            Listener::Fence => "fence",
        };
        format!("understudy-router {name} listening on http://{addr}")
    }
}

/// Announces the bound `listener` on stdout, flushed, so a parent reading it never waits.
fn announce(kind: Listener, listener: &TcpListener) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", kind.announcement(listener.local_addr()?))?;
    out.flush().context("announcing a listener on stdout")
}

/// Parses `args` (the program name first, as `std::env::args_os` gives them) and runs the chosen
/// mode until it stops or the process is interrupted.
///
/// Bad arguments, `--help` and `--version` print what clap prints and exit the process, as any
/// command line does.
pub fn run(args: impl IntoIterator<Item = OsString>) -> anyhow::Result<()> {
    // `try_init`: a binary that embeds the router may have set up logging already.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init();
    let cli = Cli::parse_from(args);
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
            Mode::Grant(args) => {
                let token = token_text(args.token_file.as_deref(), "UNDERSTUDY_CONTROL_TOKEN")?
                    .map(|t| t.trim().to_owned())
                    .filter(|t| !t.is_empty());
                let Some(token) = token else {
                    anyhow::bail!(
                        "the fences' control token is required: --token-file or UNDERSTUDY_CONTROL_TOKEN"
                    );
                };
                crate::break_glass::grant(args, &token).await
            }
        }
    })
}

async fn gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let Some(token) = read_token(args.admin_token_file.as_deref(), "UNDERSTUDY_ADMIN_TOKEN")? else {
        anyhow::bail!("an admin token is required: --admin-token-file or UNDERSTUDY_ADMIN_TOKEN")
    };
    let routes = Arc::new(
        RouteTable::new(args.state_file.map(StateFile::new))?.with_max_epoch_jump(args.max_epoch_jump),
    );
    for h in routes.highest_of_all() {
        tracing::info!(policy = %h.policy, epoch = %h.epoch, pool = %h.pool, "highest epoch read back from the state file");
    }
    let metrics = Arc::new(Metrics::default());
    let config = GatewayConfig {
        max_body_bytes: args.max_body_bytes,
        body_read_timeout: Duration::from_millis(args.body_read_timeout_ms),
        tenant_header: args.tenant_header.clone(),
        waiting_room: WaitingRoomConfig {
            bound: args.queue_bound,
            deadline: Duration::from_millis(args.queue_deadline_ms),
        },
        first_byte_timeout: Duration::from_millis(args.first_byte_timeout_ms),
        ejection: EjectionPolicy {
            base: Duration::from_millis(args.ejection_base_ms),
            max: Duration::from_millis(args.ejection_max_ms.max(args.ejection_base_ms)),
            panic_below_percent: args.panic_below_percent,
            ..EjectionPolicy::default()
        },
        retries: RetryLimits {
            percent: args.retry_budget_percent,
            floor: args.retry_budget_floor,
        },
        ..GatewayConfig::default()
    };
    let gw = Gateway::new(config, Arc::clone(&routes), Arc::clone(&metrics));
    let draining = Arc::new(AtomicBool::new(false));
    let admin = Admin {
        routes,
        metrics,
        token,
        draining: Arc::clone(&draining),
        shapes: Arc::clone(gw.shapes()),
    };
    let public = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let admin_listener = TcpListener::bind(args.admin_listen)
        .await
        .with_context(|| format!("binding {}", args.admin_listen))?;
    tracing::info!(public = %public.local_addr()?, admin = %admin_listener.local_addr()?, "gateway listening");
    announce(Listener::Gateway, &public)?;
    announce(Listener::Admin, &admin_listener)?;
    tokio::spawn(housekeeping(Arc::clone(&gw)));
    let serving = args.serving;
    let (stop_public, stop_admin) = (CancellationToken::new(), CancellationToken::new());
    let mut admin_task = tokio::spawn(serve_until(
        admin_listener,
        move |req| admin.clone().handle(req),
        serving.limits(),
        stop_admin.clone(),
    ));
    let handler = Arc::clone(&gw);
    let mut public_task = tokio::spawn(serve_until(
        public,
        move |req| Arc::clone(&handler).handle(req),
        serving.limits(),
        stop_public.clone(),
    ));
    tokio::select! {
        _ = &mut admin_task => anyhow::bail!("admin server stopped"),
        _ = &mut public_task => anyhow::bail!("public server stopped"),
        asked = stop_asked() => asked?,
    }
    // Readiness fails first; the public port serves on while callers notice.
    draining.store(true, Ordering::Relaxed);
    let (delay, timeout) = (
        Duration::from_millis(serving.drain_delay_ms),
        Duration::from_millis(serving.drain_timeout_ms),
    );
    tracing::info!(?delay, "stopping: /ready fails, serving on while callers notice");
    tokio::time::sleep(delay).await;
    stop_public.cancel();
    tracing::info!(?timeout, "no new connections; waiting for the requests in flight");
    if tokio::time::timeout(timeout, &mut public_task).await.is_err() {
        tracing::warn!("streams still open are ended with the retryable error event");
        gw.stop_streams();
        let _ = tokio::time::timeout(Duration::from_secs(2), public_task).await;
    }
    stop_admin.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(1), admin_task).await;
    tracing::info!("stopped");
    Ok(())
}

/// SIGTERM, as Kubernetes stops a container, or Ctrl-C.
async fn stop_asked() -> std::io::Result<()> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = terminate.recv() => Ok(()),
        asked = tokio::signal::ctrl_c() => asked,
    }
}

/// A token from `file`, or else from the environment variable `var`; `None` when neither is
/// given. Never from the command line, which anyone on the machine can read.
fn read_token(file: Option<&std::path::Path>, var: &str) -> anyhow::Result<Option<AdminToken>> {
    match token_text(file, var)? {
        Some(text) => Ok(Some(AdminToken::new(&text)?)),
        None => Ok(None),
    }
}

/// A token's text from `file`, or else from the environment variable `var`.
fn token_text(file: Option<&std::path::Path>, var: &str) -> anyhow::Result<Option<String>> {
    Ok(match (file, std::env::var(var)) {
        (Some(path), _) => {
            Some(std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?)
        }
        (None, Ok(token)) => Some(token),
        (None, Err(_)) => None,
    })
}

async fn fence(args: FenceArgs) -> anyhow::Result<()> {
    let control_token = read_token(args.control_token_file.as_deref(), "UNDERSTUDY_CONTROL_TOKEN")?;
    if control_token.is_none() {
        tracing::info!("no control token: control calls through this fence are refused");
    }
    let state = Arc::new(FenceState::new(args.pool.clone()));
    let poll = Duration::from_millis(args.lease_poll_ms);
    let mut grants = None;
    match (&args.lease_file, &args.policy) {
        _ if args.grants => {
            if control_token.is_none() {
                anyhow::bail!("--grants needs the operator's token, which every grant must carry");
            }
            tracing::info!("serving under the operator's grants");
            let granted = Granted::new(&args.pool, Arc::clone(&state));
            tokio::spawn(keep_grant(Arc::clone(&granted)));
            grants = Some(granted);
        }
        (Some(path), _) => {
            tracing::info!(lease_file = %path.display(), "watching a lease file");
            tokio::spawn(watch_lease(FileLease::new(path), Arc::clone(&state), poll));
        }
        (None, Some(policy)) => {
            let client = kube::Client::try_default().await.context("kubernetes client")?;
            let api = kube::Api::namespaced(client, &args.namespace);
            tokio::spawn(watch_lease(
                KubeLease::for_policy(api, policy),
                Arc::clone(&state),
                poll,
            ));
        }
        (None, None) => anyhow::bail!("a lease to watch is required: --policy, --lease-file or --grants"),
    }
    let draining = Arc::new(AtomicBool::new(false));
    let mut fence = Fence::new(state, args.upstream);
    if let Some(granted) = grants {
        fence = fence.with_grants(granted);
    }
    let fence = fence
        .with_drain(Duration::from_millis(args.drain_ms))
        .with_control_token(control_token)
        .with_draining(Arc::clone(&draining));
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(listen = %listener.local_addr()?, upstream = %args.upstream, pool = %args.pool, "fence listening");
    announce(Listener::Fence, &listener)?;
    let serving = args.serving;
    let stop = CancellationToken::new();
    let mut task = tokio::spawn(serve_until(
        listener,
        move |req| fence.clone().handle(req),
        serving.limits(),
        stop.clone(),
    ));
    tokio::select! {
        _ = &mut task => anyhow::bail!("the fence stopped serving"),
        asked = stop_asked() => asked?,
    }
    // `/health` fails first; everything else is served on while callers notice.
    draining.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(serving.drain_delay_ms)).await;
    stop.cancel();
    // A stream still open after the timeout is cut here; the gateway in front of the fence
    // ends it for its client with the retryable error event.
    let _ = tokio::time::timeout(Duration::from_millis(serving.drain_timeout_ms), task).await;
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::error::ErrorKind;

    use super::*;

    fn fence_args(extra: &[&str]) -> Result<Cli, clap::Error> {
        let base = ["understudy-router", "fence", "--pool", "a"];
        Cli::try_parse_from(base.iter().chain(extra))
    }

    #[test]
    fn the_announcements_read_as_parents_parse_them() {
        let addr: SocketAddr = "127.0.0.1:40123".parse().unwrap();
        assert_eq!(
            Listener::Gateway.announcement(addr),
            "understudy-router gateway listening on http://127.0.0.1:40123"
        );
        assert_eq!(
            Listener::Admin.announcement(addr),
            "understudy-router admin listening on http://127.0.0.1:40123"
        );
        assert_eq!(
            Listener::Fence.announcement(addr),
            "understudy-router fence listening on http://127.0.0.1:40123"
        );
    }

    #[test]
    fn a_fence_watches_a_policy_or_a_lease_file_or_takes_grants_and_exactly_one() {
        let Mode::Fence(by_file) = fence_args(&["--lease-file", "/tmp/lease.json"]).unwrap().mode else {
            panic!("not the fence")
        };
        assert_eq!(by_file.lease_file, Some(PathBuf::from("/tmp/lease.json")));
        assert_eq!(by_file.policy, None);
        let Mode::Fence(by_policy) = fence_args(&["--policy", "chat"]).unwrap().mode else {
            panic!("not the fence")
        };
        assert_eq!(by_policy.policy.as_deref(), Some("chat"));
        let both = fence_args(&["--policy", "chat", "--lease-file", "/tmp/lease.json"]);
        assert_eq!(both.unwrap_err().kind(), ErrorKind::ArgumentConflict);
        let Mode::Fence(granted) = fence_args(&["--grants"]).unwrap().mode else {
            panic!("not the fence")
        };
        assert!(granted.grants && granted.policy.is_none() && granted.lease_file.is_none());
        let granted_and_read = fence_args(&["--grants", "--policy", "chat"]);
        assert_eq!(granted_and_read.unwrap_err().kind(), ErrorKind::ArgumentConflict);
        let neither = fence_args(&[]).unwrap_err();
        assert_eq!(neither.kind(), ErrorKind::MissingRequiredArgument);
        let message = neither.to_string();
        assert!(
            message.contains("--policy") && message.contains("--lease-file") && message.contains("--grants"),
            "{message}"
        );
    }
}
