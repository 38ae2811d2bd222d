//! The operator at scale, side by side in one run: the operator binary against a real control
//! plane, its FailoverPolicies' pools of `vllm-emulator` pods run by the emulated GPU nodes, and a
//! real router process. Each setup (`POLICIESxREPLICAS`: that many policies, each with two pools
//! of that many replicas) runs in a namespace of its own, one after another, and is measured the
//! same way:
//!
//! - **probes per interval and their spread**, from the replicas' side: every emulator writes
//!   uvicorn's access line for each request, which the emulated kubelet stamps as it reads it;
//!   the probes' arrival times over the sampled intervals, folded onto one interval, give the
//!   share of the interval they arrive over and the busiest 100 ms;
//! - **CPU per interval and memory**, of the operator's process (`/proc/PID/stat` and `status`);
//! - **a failover**: every policy's primary pods killed at once (one SIGKILL each, by one
//!   kill(1)), then per policy the time until the router holds its standby at epoch 1, seen from
//!   here, and the time from the decision to the route as the operator's timeline times its steps
//!   (`status.lastFailover.steps[].milliseconds` up to Routed).
//!
//! It reports; it asserts nothing. `tests/cluster/scale.sh` brings the cluster up and runs it:
//!
//!   tests/cluster/scale.sh [--intervals N] [SETUP...]     (default: 1x200 50x4)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::future::join_all;
use jiff::Timestamp;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use understudy_api::crd::{ConditionStatus, FailoverPolicy, condition_type};
use understudy_tests::process::{Process, router_gateway};

const TOKEN: &str = "scale-bench-admin-token";
/// The probe interval of every policy.
const INTERVAL: Duration = Duration::from_secs(5);
/// The width of the busiest-slice measure.
const SLICE: Duration = Duration::from_millis(100);

/// One setup: `policies` policies, each with two pools of `replicas` replicas.
#[derive(Clone, Copy, Debug)]
struct Setup {
    policies: usize,
    replicas: usize,
}

impl Setup {
    fn parse(text: &str) -> anyhow::Result<Setup> {
        let (policies, replicas) = text
            .split_once('x')
            .with_context(|| format!("`{text}`: a setup is POLICIESxREPLICAS, e.g. 50x4"))?;
        let setup = Setup {
            policies: policies.parse().with_context(|| format!("`{text}`: policies"))?,
            replicas: replicas.parse().with_context(|| format!("`{text}`: replicas"))?,
        };
        if setup.policies == 0 || setup.replicas == 0 {
            bail!("`{text}`: at least one policy of one replica");
        }
        Ok(setup)
    }

    fn total(self) -> usize {
        self.policies * self.replicas * 2
    }

    fn namespace(self) -> String {
        format!("scale-{}x{}", self.policies, self.replicas)
    }
}

/// What one setup measured.
#[derive(Debug, Default)]
struct Measured {
    intervals: u32,
    probes_per_interval: f64,
    /// The share of the interval the probes arrive over: the interval less the longest gap with
    /// no arrival, all intervals folded onto one.
    busy_share: f64,
    /// The most probes in one [`SLICE`] of the folded interval, per interval.
    busiest_slice: f64,
    cpu_per_interval: Duration,
    rss_mib: f64,
    peak_rss_mib: f64,
    /// Per policy: from the kill to the router's new route, seen from here.
    kill_to_route: Vec<Duration>,
    /// Per policy: from the decision to the route, as the operator's timeline times its steps.
    decision_to_route: Vec<Duration>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut intervals = 12u32;
    let mut setups = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--intervals" => intervals = args.next().context("--intervals N")?.parse()?,
            // What cargo bench passes to every bench.
            "--bench" => {}
            setup => setups.push(Setup::parse(setup)?),
        }
    }
    if setups.is_empty() {
        setups = vec![Setup::parse("1x200")?, Setup::parse("50x4")?];
    }
    let Ok(kubeconfig) = std::env::var("UNDERSTUDY_CLUSTER_KUBECONFIG") else {
        eprintln!("no cluster: tests/cluster/scale.sh brings one up and runs this");
        return Ok(());
    };
    let operator =
        PathBuf::from(std::env::var("UNDERSTUDY_SCALE_OPERATOR").context("UNDERSTUDY_SCALE_OPERATOR")?);
    let router = PathBuf::from(std::env::var("UNDERSTUDY_SCALE_ROUTER").context("UNDERSTUDY_SCALE_ROUTER")?);
    let client = client_from(Path::new(&kubeconfig)).await?;
    let dir = tempfile::tempdir()?;
    let token_file = dir.path().join("router-token");
    std::fs::write(&token_file, TOKEN)?;
    let bench = Bench {
        client,
        kubeconfig: PathBuf::from(kubeconfig),
        operator,
        router,
        token_file,
        intervals,
    };
    let mut results = Vec::new();
    for setup in &setups {
        eprintln!(
            "{}: {} policies, {} replicas ...",
            setup.namespace(),
            setup.policies,
            setup.total()
        );
        results.push((*setup, bench.run(*setup).await?));
    }
    report(&results);
    Ok(())
}

async fn client_from(path: &Path) -> anyhow::Result<Client> {
    let kubeconfig = Kubeconfig::read_from(path)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

struct Bench {
    client: Client,
    kubeconfig: PathBuf,
    operator: PathBuf,
    router: PathBuf,
    token_file: PathBuf,
    intervals: u32,
}

impl Bench {
    async fn run(&self, setup: Setup) -> anyhow::Result<Measured> {
        let ns = setup.namespace();
        self.fresh_namespace(&ns).await?;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &ns);
        for policy in 0..setup.policies {
            for pool in ["east", "west"] {
                let deployment = deployment(
                    &format!("p{policy}-{pool}"),
                    &format!("model-{policy}"),
                    setup.replicas,
                );
                deployments.create(&PostParams::default(), &deployment).await?;
            }
        }
        let started = Instant::now();
        let limit = Duration::from_secs(120 + setup.total() as u64 / 2);
        loop {
            let ready = pods
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .filter(|p| is_ready(p))
                .count();
            if ready == setup.total() {
                break;
            }
            if started.elapsed() > limit {
                bail!("{ns}: {ready} of {} pods ready after {limit:?}", setup.total());
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        eprintln!("  {} pods ready in {:.0?}", setup.total(), started.elapsed());

        let (router, admin, _) = router_gateway(&self.router, &self.token_file);
        let operator = Process::start(
            Command::new(&self.operator)
                .env("KUBECONFIG", &self.kubeconfig)
                .env("RUST_LOG", "warn")
                .env("NO_COLOR", "1")
                .args([
                    "--identity",
                    "scale-bench",
                    "--namespace",
                    &ns,
                    "--admin-addr",
                    "127.0.0.1:0",
                ])
                .args(["--router-admin", &format!("http://{admin}")])
                .args(["--router-token-file", self.token_file.to_str().unwrap()]),
        );
        let policies: Api<FailoverPolicy> = Api::namespaced(self.client.clone(), &ns);
        for policy in 0..setup.policies {
            policies
                .create(&PostParams::default(), &failover_policy(policy, setup.replicas))
                .await?;
        }
        // Every policy serving from its home pool with a proven standby, and routed.
        let started = Instant::now();
        loop {
            let list = policies.list(&ListParams::default()).await?.items;
            let settled = list.iter().filter(|p| settled(p)).count();
            if settled == setup.policies {
                break;
            }
            if started.elapsed() > Duration::from_secs(300) {
                bail!(
                    "{ns}: {settled} of {} policies settled; operator: {:?}",
                    setup.policies,
                    tail(&operator)
                );
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        for policy in 0..setup.policies {
            let holds = route_held(admin, &ns, policy)?;
            if holds["route"]["pool"] != "east" || holds["route"]["epoch"] != 0 {
                bail!("p{policy} is settled but the router holds {holds}");
            }
        }
        eprintln!(
            "  {} policies settled and routed in {:.0?}",
            setup.policies,
            started.elapsed()
        );
        tokio::time::sleep(INTERVAL).await;

        // The sampled intervals.
        let pid = operator.id();
        let from = Timestamp::now();
        let cpu_from = cpu_time(pid)?;
        tokio::time::sleep(INTERVAL * self.intervals).await;
        let cpu = cpu_time(pid)?.saturating_sub(cpu_from);
        let to = Timestamp::now();
        let (rss_mib, peak_rss_mib) = memory(pid)?;
        let arrivals = probe_arrivals(&pods, from, to).await?;
        let mut measured = spread(&arrivals, self.intervals);
        measured.intervals = self.intervals;
        measured.cpu_per_interval = cpu / self.intervals;
        measured.rss_mib = rss_mib;
        measured.peak_rss_mib = peak_rss_mib;

        // Every primary at once: their processes listed first, then killed by one kill(1), with
        // the routes already being watched.
        let primaries = pods
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|p| p.name_any().contains("-east-"))
            .map(|p| container_pid(&p).map(|pid| pid.to_string()))
            .collect::<anyhow::Result<Vec<String>>>()?;
        let watching = tokio::task::spawn_blocking({
            let ns = ns.clone();
            move || first_routed(admin, &ns, setup.policies, Duration::from_secs(120))
        });
        let killed_at = Instant::now();
        let killed = Command::new("kill").arg("-KILL").args(&primaries).status()?;
        if !killed.success() {
            bail!("kill -KILL of {} primary replicas: {killed}", primaries.len());
        }
        let routed = watching
            .await?
            .with_context(|| format!("operator: {:?}", tail(&operator)))?;
        measured.kill_to_route = routed.iter().map(|at| at.duration_since(killed_at)).collect();
        for policy in 0..setup.policies {
            measured
                .decision_to_route
                .push(decision_to_route(&policies, policy).await?);
        }
        drop(operator);
        drop(router);
        self.fresh_namespace_gone(&ns).await?;
        Ok(measured)
    }

    /// An empty namespace `ns`, one left by an earlier run deleted first.
    async fn fresh_namespace(&self, ns: &str) -> anyhow::Result<()> {
        self.fresh_namespace_gone(ns).await?;
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
        namespaces.create(&PostParams::default(), &namespace).await?;
        Ok(())
    }

    /// Deletes `ns` with its policies' finalizers taken off (no operator runs them now), and
    /// waits until its pods' processes are stopped.
    async fn fresh_namespace_gone(&self, ns: &str) -> anyhow::Result<()> {
        let policies: Api<FailoverPolicy> = Api::namespaced(self.client.clone(), ns);
        if let Ok(list) = policies.list(&ListParams::default()).await {
            for policy in list.items {
                let unfinalized = json!({"metadata": {"finalizers": null}});
                let patch = kube::api::Patch::Merge(&unfinalized);
                policies
                    .patch(&policy.name_any(), &kube::api::PatchParams::default(), &patch)
                    .await?;
            }
        }
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let _ = namespaces.delete(ns, &DeleteParams::default()).await;
        let until = Instant::now() + Duration::from_secs(300);
        while namespaces.get_opt(ns).await?.is_some() {
            if Instant::now() > until {
                bail!("namespace {ns} is still being deleted");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Ok(())
    }
}

/// A pool of `replicas` vLLM servers serving `model`, ready when `/health` answers. No GPU: the
/// nodes' pod slots, not their GPUs, bound how many fit.
fn deployment(name: &str, model: &str, replicas: usize) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "vllm",
                        "image": "vllm/vllm-openai:v0.11.0",
                        "command": ["vllm", "serve"],
                        "args": ["Qwen/Qwen3-0.6B", "--port", "8000", "--served-model-name", model],
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
                    }],
                },
            },
        },
    }))
    .expect("a Deployment")
}

/// Policy `p{index}`: its `east` pool is the home primary, `west` a hot standby. One failed round
/// decides a hard failure, so that a failover's time from its failed round is the operator's.
fn failover_policy(index: usize, replicas: usize) -> FailoverPolicy {
    let pool = |pool: &str| json!({"name": pool, "workload": {"kind": "Deployment", "name": format!("p{index}-{pool}")}, "replicas": replicas});
    serde_json::from_value(json!({
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "FailoverPolicy",
        "metadata": {"name": format!("p{index}")},
        "spec": {
            "pools": [pool("east"), pool("west")],
            "recoveryObjective": "5m",
            "probe": {"interval": "5s", "timeout": "2s", "budgets": {"firstToken": "1s", "total": "2s"}},
            "trigger": {"suspectAfter": 1, "promoteAfter": 3, "hardFailure": {"promoteAfter": 1}, "standbyReadyAfter": 2},
        },
    }))
    .expect("a FailoverPolicy")
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Serving from its home pool, with its standby proven.
fn settled(policy: &FailoverPolicy) -> bool {
    let Some(status) = policy.status.as_ref() else {
        return false;
    };
    let holds = |kind: &str| {
        status
            .conditions
            .get(kind)
            .is_some_and(|c| c.status == ConditionStatus::True)
    };
    status.state.as_deref() == Some("Serving")
        && holds(condition_type::READY)
        && holds(condition_type::STANDBY_PROVEN)
}

/// When the router at `admin` first held each policy's standby (`west`) at epoch 1, in policy
/// order; one loop asks for every policy not yet moved, then sleeps 20 ms.
fn first_routed(
    admin: SocketAddr,
    ns: &str,
    policies: usize,
    limit: Duration,
) -> anyhow::Result<Vec<Instant>> {
    let mut routed: Vec<Option<Instant>> = vec![None; policies];
    let until = Instant::now() + limit;
    while routed.iter().any(Option::is_none) {
        for (index, at) in routed.iter_mut().enumerate().filter(|(_, at)| at.is_none()) {
            let holds = route_held(admin, ns, index)?;
            if holds["route"]["pool"] == "west" && holds["route"]["epoch"] == 1 {
                *at = Some(Instant::now());
            }
        }
        if Instant::now() > until {
            let left: Vec<usize> = (0..policies).filter(|i| routed[*i].is_none()).collect();
            bail!("the router did not move policies {left:?} to west at epoch 1 within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(routed.into_iter().flatten().collect())
}

/// From the decision to the route, as policy `p{index}`'s timeline times its steps (steps run one
/// after another; each step's milliseconds come from the operator's clock, not from the
/// timeline's whole-second timestamps), once its status records the finished promotion.
async fn decision_to_route(policies: &Api<FailoverPolicy>, index: usize) -> anyhow::Result<Duration> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let timeline = policies
            .get_status(&format!("p{index}"))
            .await?
            .status
            .and_then(|s| s.last_failover)
            .filter(|timeline| timeline.finished_at.is_some());
        if let Some(timeline) = timeline {
            let routed = timeline
                .steps
                .iter()
                .position(|step| step.step == "Routed")
                .with_context(|| format!("p{index}'s finished timeline has no Routed step"))?;
            let ms: u64 = timeline.steps[..=routed]
                .iter()
                .filter_map(|step| step.milliseconds)
                .sum();
            return Ok(Duration::from_millis(ms));
        }
        if Instant::now() > until {
            bail!("p{index}'s status records no finished promotion within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What the router at `admin` holds for policy `p{index}`.
fn route_held(admin: SocketAddr, ns: &str, index: usize) -> anyhow::Result<Value> {
    let body = get(admin, &format!("/route?policy={ns}/p{index}"))?;
    Ok(serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// `GET path` on the router's admin port; the body.
fn get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    Ok(raw.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned())
}

/// The process behind a pod's container: the emulated kubelet writes its id as the container id.
fn container_pid(pod: &Pod) -> anyhow::Result<u32> {
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|s| s.first())
        .and_then(|s| s.container_id.as_deref())
        .with_context(|| format!("{} has no container id", pod.name_any()))?;
    Ok(id.trim_start_matches("emulated://").parse()?)
}

/// The process's user and system CPU time so far.
fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("/proc/PID/stat")?
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    let per_second: u64 = String::from_utf8(Command::new("getconf").arg("CLK_TCK").output()?.stdout)?
        .trim()
        .parse()?;
    Ok(Duration::from_secs_f64(ticks as f64 / per_second as f64))
}

/// The process's resident memory now and at its peak, MiB.
fn memory(pid: u32) -> anyhow::Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| -> anyhow::Result<f64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(key))
            .with_context(|| key.to_owned())?;
        Ok(line.split_whitespace().nth(1).context("a size")?.parse::<f64>()?)
    };
    Ok((kib("VmRSS:")? / 1024.0, kib("VmHWM:")? / 1024.0))
}

/// When each probe reached a replica between `from` and `to`: the access lines of generation
/// requests in every pod's log, stamped by the kubelet as it read them.
async fn probe_arrivals(pods: &Api<Pod>, from: Timestamp, to: Timestamp) -> anyhow::Result<Vec<Timestamp>> {
    let list = pods.list(&ListParams::default()).await?.items;
    let params = LogParams {
        timestamps: true,
        ..LogParams::default()
    };
    let mut arrivals = Vec::new();
    for chunk in list.chunks(16) {
        let names: Vec<String> = chunk.iter().map(ResourceExt::name_any).collect();
        let logs = join_all(names.iter().map(|name| pods.logs(name, &params))).await;
        for log in logs {
            for line in log?.lines() {
                let Some((stamp, text)) = line.split_once(' ') else {
                    continue;
                };
                if !text.contains("\"POST /v1/") {
                    continue;
                }
                if let Ok(at) = stamp.parse::<Timestamp>()
                    && at >= from
                    && at < to
                {
                    arrivals.push(at);
                }
            }
        }
    }
    Ok(arrivals)
}

/// The probes' count per interval and their spread, all intervals folded onto one.
fn spread(arrivals: &[Timestamp], intervals: u32) -> Measured {
    let interval = INTERVAL.as_nanos() as i128;
    let mut phases: Vec<i128> = arrivals
        .iter()
        .map(|at| at.as_nanosecond().rem_euclid(interval))
        .collect();
    phases.sort_unstable();
    let largest_gap = phases
        .windows(2)
        .map(|w| w[1] - w[0])
        .chain(
            phases
                .first()
                .zip(phases.last())
                .map(|(first, last)| first + interval - last),
        )
        .max()
        .unwrap_or(interval);
    let slices = (INTERVAL.as_nanos() / SLICE.as_nanos()) as usize;
    let mut per_slice: BTreeMap<usize, usize> = BTreeMap::new();
    for phase in &phases {
        *per_slice
            .entry((phase / SLICE.as_nanos() as i128) as usize % slices)
            .or_default() += 1;
    }
    Measured {
        probes_per_interval: arrivals.len() as f64 / f64::from(intervals),
        busy_share: 1.0 - largest_gap as f64 / interval as f64,
        busiest_slice: per_slice.values().max().copied().unwrap_or(0) as f64 / f64::from(intervals),
        ..Measured::default()
    }
}

fn tail(process: &Process) -> Vec<String> {
    let lines = process.lines();
    lines[lines.len().saturating_sub(10)..].to_vec()
}

fn report(results: &[(Setup, Measured)]) {
    let Some((_, first)) = results.first() else { return };
    println!(
        "operator at scale: probe interval {:?}, {} intervals sampled per setup, on {} cores",
        INTERVAL,
        first.intervals,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let row = |name: &str, cell: &dyn Fn(&Setup, &Measured) -> String| {
        let cells: Vec<String> = results
            .iter()
            .map(|(s, m)| format!("{:>16}", cell(s, m)))
            .collect();
        println!("{name:<40}{}", cells.join(""));
    };
    row("setup (policies x replicas per pool)", &|s, _| {
        format!("{}x{}", s.policies, s.replicas)
    });
    row("replicas", &|s, _| s.total().to_string());
    row("probes reaching replicas per interval", &|_, m| {
        format!("{:.1}", m.probes_per_interval)
    });
    row("share of the interval they arrive over", &|_, m| {
        format!("{:.0}%", m.busy_share * 100.0)
    });
    row("busiest 100 ms, probes", &|_, m| {
        format!("{:.1}", m.busiest_slice)
    });
    row("operator CPU per interval", &|_, m| {
        format!("{:.0} ms", m.cpu_per_interval.as_secs_f64() * 1e3)
    });
    row("  per replica", &|s, m| {
        format!(
            "{:.2} ms",
            m.cpu_per_interval.as_secs_f64() * 1e3 / s.total() as f64
        )
    });
    row("  replicas one core takes, same mix", &|s, m| {
        let per_replica = m.cpu_per_interval.as_secs_f64() / s.total() as f64;
        format!("{:.0}", INTERVAL.as_secs_f64() / per_replica.max(f64::EPSILON))
    });
    row("operator memory (RSS / peak)", &|_, m| {
        format!("{:.0} / {:.0} MiB", m.rss_mib, m.peak_rss_mib)
    });
    row("failovers timed (every policy at once)", &|_, m| {
        m.kill_to_route.len().to_string()
    });
    row("  kill -> router holds the new route", &|_, m| {
        spread_of(&m.kill_to_route)
    });
    row("  decision -> routed (operator's steps)", &|_, m| {
        spread_of(&m.decision_to_route)
    });
    // Side by side: each setup against the one before it over as many replicas.
    for pair in results.windows(2) {
        let [(a, first), (b, second)] = pair else { continue };
        if a.total() != b.total() {
            continue;
        }
        println!(
            "{}x{} over {}x{} ({} replicas): CPU per interval {:.2}x, peak memory {:.2}x",
            b.policies,
            b.replicas,
            a.policies,
            a.replicas,
            a.total(),
            second.cpu_per_interval.as_secs_f64() / first.cpu_per_interval.as_secs_f64().max(f64::EPSILON),
            second.peak_rss_mib / first.peak_rss_mib.max(f64::EPSILON),
        );
    }
}

/// The fastest, median and slowest of `values` (one value alone when there is one), in seconds,
/// or in milliseconds when the slowest is under a second.
fn spread_of(values: &[Duration]) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let middle = match sorted.len() {
        0 => return "-".to_owned(),
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2,
    };
    let (first, last) = (sorted[0], sorted[sorted.len() - 1]);
    let (unit, scale, digits) = if last < Duration::from_secs(1) {
        ("ms", 1e3, 0)
    } else {
        ("s", 1.0, 1)
    };
    let show = |d: Duration| format!("{:.*}", digits, d.as_secs_f64() * scale);
    if sorted.len() > 1 {
        format!("{}/{}/{} {unit}", show(first), show(middle), show(last))
    } else {
        format!("{} {unit}", show(middle))
    }
}
