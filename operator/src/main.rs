//! The understudy operator: parses its configuration, serves the admin port, contends for
//! leadership, and while it leads runs the FailoverPolicy controller, the generating probes that
//! feed it, and the GameDay controller.
//!
//! Losing leadership ends the process with an error, as client-go controllers do: Kubernetes
//! restarts it, and the fresh process contends again with nothing left over from its time as
//! leader. On SIGTERM or ctrl-c the controllers stop first, then the leader Lease is released,
//! so that in a rolling update the next replica leads at its next try rather than after the
//! lease duration.
//!
//! The controllers' watchdog guards against a leader that is stuck rather than gone: once a
//! reconcile has run for `--stall-after`, `/live` answers 503 and the elector stops renewing, so
//! the leadership and then the process end, and another replica leads.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use tracing_subscriber::EnvFilter;
use understudy_operator::admin::{self, Readiness, Role};
use understudy_operator::clusters::Clusters;
use understudy_operator::controller::{self, Context};
use understudy_operator::gameday;
use understudy_operator::gpu_health::GpuAgents;
use understudy_operator::grants::{Granting, Grantor};
use understudy_operator::leader::{LeaderConfig, LeaderElector, Release};
use understudy_operator::lease::KubeLease;
use understudy_operator::load_proof::LoadProofs;
use understudy_operator::metrics::Metrics;
use understudy_operator::observe::ProbingObservations;
use understudy_operator::peers::{LabelledPods, Routers};
use understudy_operator::ports::{HandOffToComponents, StepExecutor};
use understudy_operator::reconciler::WithShell;
use understudy_operator::replicas::KubeReplicas;
use understudy_operator::reserve::{self, ReserveConfig};
use understudy_operator::route_push::RouterPush;
use understudy_operator::route_target::RouteTargets;
use understudy_operator::router_admin::{RouterAdminUrl, RouterToken};
use understudy_operator::watchdog::Watchdog;
use understudy_prober::probe::Bearer;

/// Fails LLM serving over from an active GPU pool to a standby pool, with a fencing epoch.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address of the admin server (/live, /ready, /metrics).
    #[arg(long, env = "UNDERSTUDY_ADMIN_ADDR", default_value = "0.0.0.0:9090")]
    admin_addr: SocketAddr,

    /// Watch FailoverPolicies and GameDays in this namespace only; all namespaces when unset.
    #[arg(long, env = "UNDERSTUDY_NAMESPACE")]
    namespace: Option<String>,

    /// The Lease replicas of the operator elect their leader through.
    #[arg(
        long,
        env = "UNDERSTUDY_LEADER_LEASE_NAME",
        default_value = "understudy-operator"
    )]
    leader_lease_name: String,

    /// Namespace of the leader Lease; the watched namespace, else the client's default.
    #[arg(long, env = "UNDERSTUDY_LEADER_LEASE_NAMESPACE")]
    leader_lease_namespace: Option<String>,

    /// This replica's name in the election, normally the pod name.
    #[arg(long, env = "POD_NAME")]
    identity: String,

    /// A router's admin API (`http://host:port`), pushed the route and admission settings on
    /// each promotion and kept on the current route between them. Repeat for every router;
    /// without any, those steps are handed off and no router is called.
    #[arg(long = "router-admin", env = "UNDERSTUDY_ROUTER_ADMIN", value_delimiter = ',')]
    router_admin: Vec<RouterAdminUrl>,

    /// Instead of --router-admin: the label selector of the router pods (the chart's router
    /// Deployment), listed again at each use and called at their IP and --router-admin-port.
    #[arg(long, env = "UNDERSTUDY_ROUTER_SELECTOR", conflicts_with = "router_admin")]
    router_selector: Option<String>,

    /// The namespace the router pods run in; the operator's own namespace by default
    /// (`POD_NAMESPACE`).
    #[arg(long, env = "UNDERSTUDY_ROUTER_NAMESPACE")]
    router_namespace: Option<String>,

    /// The router pods' admin port.
    #[arg(long, env = "UNDERSTUDY_ROUTER_ADMIN_PORT", default_value_t = 9091)]
    router_admin_port: u16,

    /// The label selector of the GPU agents (`understudy-prober agent`, a DaemonSet on the GPU
    /// nodes), whose verdicts are read every probing round: a replica on a failed GPU fails its
    /// pool. Unset: GPU health is not read.
    #[arg(long, env = "UNDERSTUDY_GPU_AGENT_SELECTOR")]
    gpu_agent_selector: Option<String>,

    /// The namespace the GPU agents run in.
    #[arg(
        long,
        env = "UNDERSTUDY_GPU_AGENT_NAMESPACE",
        default_value = "understudy-system"
    )]
    gpu_agent_namespace: String,

    /// The port the GPU agents serve `/gpus` on.
    #[arg(long, env = "UNDERSTUDY_GPU_AGENT_PORT", default_value_t = 9400)]
    gpu_agent_port: u16,

    /// File holding the routers' admin bearer token; read once at start. Required with
    /// --router-admin.
    #[arg(long, env = "UNDERSTUDY_ROUTER_TOKEN_FILE")]
    router_token_file: Option<PathBuf>,

    /// File holding the control token of the fence sidecars in front of the replicas (their
    /// `--control-token-file`); read once at start. Every call the operator makes to a replica
    /// carries it: its probes pass a fenced standby's fence, its sleep and wake calls are let
    /// through, and game days set and take away the fences' faults with it. Without it, calls
    /// carry no token, as they must when a pool's `port` is vLLM's own.
    #[arg(long, env = "UNDERSTUDY_REPLICA_TOKEN_FILE")]
    replica_token_file: Option<PathBuf>,

    /// The image of the placeholder pods that hold GPUs for pilot-light replicas
    /// (`standby[].reserveGpus`): a pause container, mirrored where the registry is unreachable.
    #[arg(long, env = "UNDERSTUDY_RESERVE_IMAGE", default_value = reserve::DEFAULT_PAUSE_IMAGE)]
    reserve_image: String,

    /// The PriorityClass of the placeholder pods: negative, with `preemptionPolicy: Never`, so
    /// that they give way to any workload and never push one out. The chart installs it.
    #[arg(
        long,
        env = "UNDERSTUDY_RESERVE_PRIORITY_CLASS",
        default_value = reserve::DEFAULT_PRIORITY_CLASS
    )]
    reserve_priority_class: String,

    /// How long one reconcile may run before its controller counts as stalled: then `/live`
    /// answers 503 while this replica leads, and it stops renewing the leader Lease so that
    /// another replica takes over. A Go-style duration, more than zero. The default, 10m,
    /// outlasts the longest healthy reconcile, a promotion that wakes replicas from sleep level 2
    /// (four calls in a row of up to 2m each); a reconcile's Lease requests, status writes and
    /// router pushes time out within 10s, and a policy requeues every 2s while it promotes and
    /// every probe interval (10s by default) otherwise.
    #[arg(
        long,
        env = "UNDERSTUDY_STALL_AFTER",
        default_value = "10m",
        value_parser = stall_after
    )]
    stall_after: Duration,

    /// Log filter, in `tracing_subscriber::EnvFilter` syntax.
    #[arg(long, env = "RUST_LOG", default_value = "info")]
    log_filter: String,
}

/// `--stall-after`: a Go-style duration; zero would count every reconcile as a stall.
fn stall_after(text: &str) -> Result<Duration, String> {
    match understudy_core::duration::parse(text) {
        Ok(duration) if duration.is_zero() => Err("must be more than zero".to_owned()),
        Ok(duration) => Ok(duration),
        Err(error) => Err(error.to_string()),
    }
}

/// Completes on SIGTERM, what the kubelet sends a pod it stops, or on ctrl-c.
async fn shutdown_signal() {
    #[cfg(unix)]
    if let Ok(mut terminate) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        return;
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// Stops the elector and waits for it to release the Lease if it holds it. The elector gives
/// the release its renew deadline; this waits a little longer and no more.
async fn step_down(
    stop: tokio::sync::oneshot::Sender<()>,
    election: tokio::task::JoinHandle<Release>,
    config: LeaderConfig,
) {
    let _ = stop.send(());
    match tokio::time::timeout(config.renew_deadline + Duration::from_secs(1), election).await {
        Ok(Ok(release)) => tracing::debug!(?release, "the leader elector stopped"),
        Ok(Err(error)) => tracing::warn!(%error, "the leader elector failed"),
        Err(_) => tracing::warn!("the leader elector did not stop in time; the lease expires on its own"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_new(&args.log_filter).context("--log-filter")?)
        .init();

    // Before anything else, so that a router configuration that cannot work stops the start.
    let router_token = router_token(&args)?;
    let replica_token = replica_token(&args)?;

    let client = Client::try_default()
        .await
        .context("building the Kubernetes client")?;
    // The operator's own cluster, and the ones its policies' pools name.
    let clusters = Arc::new(Clusters::new(client.clone()));
    let routers = routers(&args, &clusters);
    let metrics = Arc::new(Metrics::new());
    let readiness = Readiness::default();
    let watchdog = Watchdog::new(args.stall_after);

    let admin = serve_admin(args.admin_addr, &metrics, &readiness, &watchdog).await?;

    let Election {
        mut leading,
        stop: stop_election,
        task: election,
        config: leader_config,
    } = contend(&args, &client, &watchdog, &readiness)?;

    tokio::select! {
        elected = leading.wait_for(|leads| *leads) => { elected.context("the leader elector stopped")?; }
        () = shutdown_signal() => {
            readiness.set(Role::Stopping);
            // It may have won the Lease just now.
            step_down(stop_election, election, leader_config).await;
            return Ok(());
        }
    }
    readiness.set(Role::Elected);
    tracing::info!(identity = %args.identity, namespace = ?args.namespace, "leading: starting the controller");

    // Only the leader probes: its reconciles are the only ones that drain what the probes saw.
    let replicas = Arc::new(KubeReplicas::in_clusters(clusters.clone()).with_bearer(replica_token.clone()));
    let observations = Arc::new(observations(
        &args,
        &clusters,
        &replicas,
        &routers,
        router_token.as_ref(),
    ));
    let urgent_rounds = observations.urgent_rounds();
    let probing = tokio::spawn(observations.clone().run());
    let mut steps = steps(
        &routers,
        router_token.as_ref(),
        &replicas,
        replica_token.is_some(),
        &client,
    );
    // With the fences' token, the leader grants them their right to serve.
    let grantor = replica_token.is_some().then(|| {
        let grantor = Arc::new(Grantor::new(client.clone(), replicas.clone(), metrics.clone()));
        steps = Arc::new(Granting {
            grantor: Arc::clone(&grantor),
            inner: Arc::clone(&steps),
        });
        grantor
    });
    let granting = grantor.clone().map(|g| tokio::spawn(g.run()));
    let gamedays = gamedays(
        &args,
        &clusters,
        &watchdog,
        replica_token,
        &routers,
        router_token.as_ref(),
    );
    let mut ctx = policies(&args, &clusters, metrics, observations, steps, replicas, watchdog);
    if let Some(grantor) = grantor {
        ctx = ctx.with_grants(grantor);
    }
    if let Some(token) = &router_token {
        // The primary's traffic is read from the routers that carry it.
        ctx = ctx.with_load_proofs(LoadProofs::new(routers.clone(), token.clone()));
    }
    let ctx = Arc::new(ctx);
    readiness.set(Role::Leading);
    // The controllers stop on SIGTERM or ctrl-c themselves (`shutdown_on_signal`), which ends
    // the first branch; whichever branch ends, they are stopped before the Lease is released.
    let outcome = tokio::select! {
        ((), ()) = async {
            tokio::join!(
                controller::run(ctx, args.namespace.as_deref(), urgent_rounds),
                gameday::controller::run(gamedays, args.namespace.as_deref()),
            )
        } => Ok(()),
        lost = leading.wait_for(|leads| !*leads) => {
            lost.context("the leader elector stopped")?;
            Err(anyhow::anyhow!("lost leadership; exiting so that a fresh process contends again"))
        }
        served = admin => match served {
            Ok(()) => Err(anyhow::anyhow!("the admin server stopped")),
            Err(error) => Err(anyhow::Error::new(error).context("the admin server panicked")),
        },
    };
    readiness.set(Role::Stopping);
    probing.abort();
    if let Some(granting) = granting {
        granting.abort();
    }
    step_down(stop_election, election, leader_config).await;
    if let Err(error) = outcome {
        bail!(error);
    }
    tracing::info!("controller stopped");
    Ok(())
}

/// The routers' admin token, read when routers are given: without it they cannot be called.
fn router_token(args: &Args) -> anyhow::Result<Option<RouterToken>> {
    let routers_given = !args.router_admin.is_empty() || args.router_selector.is_some();
    let router_token = match (routers_given, &args.router_token_file) {
        (false, _) => None,
        (true, None) => bail!(
            "--router-admin or --router-selector needs --router-token-file (UNDERSTUDY_ROUTER_TOKEN_FILE)"
        ),
        (true, Some(path)) => Some(RouterToken::read(path)?),
    };
    Ok(router_token)
}

/// The fence sidecars' control token, which every call to a replica carries, when one is given.
fn replica_token(args: &Args) -> anyhow::Result<Option<Bearer>> {
    let replica_token = match &args.replica_token_file {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--replica-token-file {}", path.display()))?;
            let token = Bearer::new(&text);
            Some(token.with_context(|| format!("--replica-token-file {}: empty", path.display()))?)
        }
    };
    Ok(replica_token)
}

/// The routers: at the given admin URLs, or the pods that match the selector at each use.
fn routers(args: &Args, clusters: &Arc<Clusters>) -> Routers {
    match &args.router_selector {
        None => Routers::At(args.router_admin.clone()),
        Some(selector) => Routers::Labelled(LabelledPods {
            clusters: clusters.clone(),
            namespace: args
                .router_namespace
                .clone()
                .or_else(|| std::env::var("POD_NAMESPACE").ok())
                .unwrap_or_else(|| clusters.home().default_namespace().to_owned()),
            selector: selector.clone(),
            port: args.router_admin_port,
        }),
    }
}

/// Serves `/live`, `/ready` and `/metrics` on the admin port, in a task of its own.
async fn serve_admin(
    addr: SocketAddr,
    metrics: &Arc<Metrics>,
    readiness: &Readiness,
    watchdog: &Watchdog,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the admin server to {addr}"))?;
    Ok(tokio::spawn(admin::serve(
        listener,
        admin::Limits::default(),
        metrics.clone(),
        readiness.clone(),
        watchdog.clone(),
    )))
}

/// This replica's part in the leader election, run in a task of its own.
struct Election {
    /// Whether this replica leads now.
    leading: tokio::sync::watch::Receiver<bool>,
    /// Stops the elector, which then releases the Lease if it holds it.
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Release>,
    config: LeaderConfig,
}

/// Starts contending for the leader Lease; this replica stands by until it wins.
fn contend(
    args: &Args,
    client: &Client,
    watchdog: &Watchdog,
    readiness: &Readiness,
) -> anyhow::Result<Election> {
    let lease_namespace = args
        .leader_lease_namespace
        .clone()
        .or_else(|| args.namespace.clone())
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let lock = KubeLease::new(
        Api::<Lease>::namespaced(client.clone(), &lease_namespace),
        &args.leader_lease_name,
    );
    let leader_config = LeaderConfig::default();
    let elector = LeaderElector::new(lock, &args.identity, leader_config)
        .context("configuring leader election")?
        .with_watchdog(watchdog.clone());
    let leading = elector.is_leader();
    let (stop_election, election_stopped) = tokio::sync::oneshot::channel::<()>();
    let election = tokio::spawn(elector.run_until(async {
        let _ = election_stopped.await;
    }));
    readiness.set(Role::StandingBy);
    tracing::info!(identity = %args.identity, lease = %args.leader_lease_name, %lease_namespace, "contending for leadership");
    Ok(Election {
        leading,
        stop: stop_election,
        task: election,
        config: leader_config,
    })
}

/// What the leader observes the pools through: its probes, and where configured the routers'
/// data path and the GPU agents' verdicts.
fn observations(
    args: &Args,
    clusters: &Arc<Clusters>,
    replicas: &Arc<KubeReplicas>,
    routers: &Routers,
    router_token: Option<&RouterToken>,
) -> ProbingObservations {
    let mut observations = ProbingObservations::new(replicas.clone());
    if let Some(token) = router_token {
        // What the routers' data path sees of the primary counts beside the probes.
        observations = observations.with_router_signals(routers.clone(), token.clone());
    }
    if let Some(selector) = &args.gpu_agent_selector {
        tracing::info!(%selector, namespace = %args.gpu_agent_namespace, "reading the GPU agents' verdicts");
        observations = observations.with_gpu_agents(GpuAgents::Labelled(LabelledPods {
            clusters: clusters.clone(),
            namespace: args.gpu_agent_namespace.clone(),
            selector: selector.clone(),
            port: args.gpu_agent_port,
        }));
    }
    observations
}

/// How a promotion's routing steps are taken: written to the route target of a policy that
/// names one (an HTTPRoute or a Service, with `client`), else pushed to the routers when there
/// are any, else handed off to the components.
fn steps(
    routers: &Routers,
    router_token: Option<&RouterToken>,
    replicas: &Arc<KubeReplicas>,
    granted: bool,
    client: &kube::Client,
) -> Arc<dyn StepExecutor> {
    let mut steps: Arc<dyn StepExecutor> = Arc::new(HandOffToComponents);
    if let Some(token) = router_token {
        tracing::info!(?routers, "pushing routes to the routers");
        steps =
            Arc::new(RouterPush::new(routers.clone(), token.clone(), replicas.clone()).with_grants(granted));
    }
    Arc::new(RouteTargets::new(steps, client.clone()))
}

/// The GameDay controller's context.
fn gamedays(
    args: &Args,
    clusters: &Arc<Clusters>,
    watchdog: &Watchdog,
    replica_token: Option<Bearer>,
    routers: &Routers,
    router_token: Option<&RouterToken>,
) -> Arc<gameday::controller::Context> {
    // Same leader, same client: a game day only ever asks the policy controller to act.
    let mut gamedays =
        gameday::controller::Context::new(clusters.home().clone(), Some(args.identity.clone()))
            .with_clusters(clusters.clone())
            .with_watchdog(watchdog.clone())
            .with_replica_token(replica_token);
    if let Some(token) = router_token {
        // A run's record of loss and its stop conditions come from the routers' counters.
        gamedays = gamedays.with_routers(routers.clone(), token.clone());
    }
    Arc::new(gamedays)
}

/// The FailoverPolicy controller's context.
fn policies(
    args: &Args,
    clusters: &Arc<Clusters>,
    metrics: Arc<Metrics>,
    observations: Arc<ProbingObservations>,
    steps: Arc<dyn StepExecutor>,
    replicas: Arc<KubeReplicas>,
    watchdog: Watchdog,
) -> Context {
    Context::new(clusters.home().clone(), metrics, Some(args.identity.clone()))
        .with_clusters(clusters.clone())
        .with_observations(observations.clone())
        .with_findings(observations)
        .with_steps(steps)
        // It reaches the replicas itself: it keeps the standby in its shape, wakes the new
        // primary's warm replicas, and counts a promoted pool's replicas that pass the probe.
        .with_replicas(replicas)
        .with_reserve(ReserveConfig {
            image: args.reserve_image.clone(),
            priority_class: args.reserve_priority_class.clone(),
        })
        .with_watchdog(watchdog)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use understudy_operator::watchdog::DEFAULT_STALL_AFTER;

    use super::*;

    fn stall_after_of(extra: &[&str]) -> Result<Duration, clap::Error> {
        let args = ["understudy-operator", "--identity", "pod-0"].iter().chain(extra);
        Args::try_parse_from(args).map(|args| args.stall_after)
    }

    #[test]
    fn stall_after_defaults_to_the_watchdogs_default_and_takes_a_go_duration_above_zero() {
        assert_eq!(stall_after_of(&[]).unwrap(), DEFAULT_STALL_AFTER);
        assert_eq!(
            stall_after_of(&["--stall-after", "1m30s"]).unwrap(),
            Duration::from_secs(90)
        );
        for refused in ["0s", "-1m", "ten minutes"] {
            let flag = format!("--stall-after={refused}");
            assert!(stall_after_of(&[&flag]).is_err(), "{refused}");
        }
    }
}
