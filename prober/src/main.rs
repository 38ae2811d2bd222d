//! `understudy-prober`: one round of generating probes, rounds every interval behind an admin
//! port, or a cold-start stage table, from the command line, without the operator.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use std::time::Duration;

use understudy_core::Pool;
use understudy_prober::admin::{self, Published, Watch};
use understudy_prober::agent;
use understudy_prober::coldstart::{self, source::Recorded};
use understudy_prober::model_cache::ModelCache;
use understudy_prober::outcome::pool_verdict;
use understudy_prober::parity::Fingerprint;
use understudy_prober::parity::model::{self, Depth};
use understudy_prober::parity::runtime::runtime_fingerprint;
use understudy_prober::probe::{self, Budget, Endpoint, Expectation, ProbeSpec};

#[derive(Debug, Parser)]
#[command(
    name = "understudy-prober",
    about = "Probe vLLM replicas and time their cold starts"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

fn go_duration(text: &str) -> Result<Duration, String> {
    understudy_core::duration::parse(text).map_err(|e| e.to_string())
}

/// What a probe sends and accepts, shared by `probe` and `watch`.
#[derive(Debug, Args)]
struct ProbeArgs {
    /// Replica endpoints, `http://HOST:PORT`.
    #[arg(required = true)]
    endpoints: Vec<Endpoint>,
    /// The golden answer's prefix the text must start with.
    #[arg(long, conflicts_with = "expect_regex")]
    expect_prefix: Option<String>,
    /// A regular expression the text must match.
    #[arg(long)]
    expect_regex: Option<regex::Regex>,
    /// The served model name (default: the server's only model).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value = "The capital of France is")]
    prompt: String,
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    #[arg(long, default_value = "10s", value_parser = go_duration)]
    timeout: Duration,
    #[arg(long, default_value = "2s", value_parser = go_duration)]
    first_token_budget: Duration,
    #[arg(long, default_value = "5s", value_parser = go_duration)]
    total_budget: Duration,
    #[arg(long, default_value = "3s", value_parser = go_duration)]
    stall_after: Duration,
    /// How many replicas must pass for the pool to pass.
    #[arg(long, default_value_t = 1)]
    min_serving: usize,
    /// Spread the probes over this long (seeded jitter); 0s probes all at once.
    #[arg(long, default_value = "0s", value_parser = go_duration)]
    jitter: Duration,
}

impl ProbeArgs {
    fn spec(&self) -> ProbeSpec {
        let expect = match (&self.expect_prefix, &self.expect_regex) {
            (Some(prefix), _) => Expectation::Prefix(prefix.clone()),
            (None, Some(regex)) => Expectation::Regex(regex.clone()),
            (None, None) => Expectation::NonEmpty,
        };
        ProbeSpec {
            model: self.model.clone(),
            prompt: self.prompt.clone(),
            max_tokens: self.max_tokens,
            seed: self.seed,
            expect,
            budget: Budget {
                first_token: self.first_token_budget,
                total: self.total_budget,
            },
            timeout: self.timeout,
            stall_after: self.stall_after,
            check_sleep: true,
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Probe each endpoint once with a deterministic streamed completion and print the outcomes.
    Probe {
        #[command(flatten)]
        probe: ProbeArgs,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Probe the endpoints every interval and serve /metrics, /round, /live and /ready.
    Watch {
        #[command(flatten)]
        probe: ProbeArgs,
        /// Time between the starts of two rounds.
        #[arg(long, default_value = "10s", value_parser = go_duration)]
        interval: Duration,
        /// Where the admin server listens.
        #[arg(long, default_value = "127.0.0.1:9091")]
        admin_addr: SocketAddr,
    },
    /// Print a replica's cold-start stage table from its pod, events and container log, read
    /// from the Kubernetes API (`--pod NAME`) or from files kubectl wrote (`--pod-file`).
    Coldstart {
        /// The pod's name, read from the API with the current kubeconfig or in-cluster config.
        #[arg(long, required_unless_present = "pod_file", conflicts_with = "pod_file")]
        pod: Option<String>,
        /// The pod's namespace (default: the kubeconfig context's).
        #[arg(long, requires = "pod", conflicts_with = "pod_file")]
        namespace: Option<String>,
        /// `kubectl get pod NAME -o json`
        #[arg(long)]
        pod_file: Option<PathBuf>,
        /// `kubectl get events --field-selector involvedObject.name=NAME -o json`
        #[arg(long, requires = "pod_file", conflicts_with = "pod")]
        events: Option<PathBuf>,
        /// `kubectl logs NAME -c vllm --timestamps`
        #[arg(long, requires = "pod_file", conflicts_with = "pod")]
        logs: Option<PathBuf>,
        /// The serving container (default: the pod's first).
        #[arg(long)]
        container: Option<String>,
        /// When the first successful generating probe got its first token (RFC 3339).
        #[arg(long)]
        first_token: Option<jiff::Timestamp>,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Run as the node's GPU agent: read every GPU through NVML once per interval, judge it,
    /// find which pod holds it through the kubelet's pod-resources socket, and serve `/gpus`
    /// (JSON), `/metrics` (DCGM-exporter-compatible), `/live` and `/ready`.
    Agent {
        /// This node's name (the DaemonSet passes `spec.nodeName`).
        #[arg(long, env = "NODE_NAME")]
        node: String,
        #[arg(long, default_value = "0.0.0.0:9400")]
        admin_addr: SocketAddr,
        #[arg(long, default_value = "10s", value_parser = go_duration)]
        interval: Duration,
        /// The kubelet's pod-resources socket.
        #[arg(long, default_value = understudy_prober::podresources::KUBELET_SOCKET)]
        pod_resources_socket: PathBuf,
        /// The resource GPUs are allocated as.
        #[arg(long, default_value = understudy_prober::podresources::NVIDIA_GPU)]
        resource: String,
        /// Where the node's model cache is mounted here, for parity's `GET /models`.
        #[arg(long, requires = "model_cache_host_path")]
        model_cache: Option<PathBuf>,
        /// What the node calls its model cache: the hostPath `--model-cache` mounts.
        #[arg(long, requires = "model_cache")]
        model_cache_host_path: Option<PathBuf>,
        /// A file to keep the full digests taken in, so that a restart hashes only what changed.
        #[arg(long, requires = "model_cache")]
        digests_file: Option<PathBuf>,
        /// How old a full reading of a model directory may be before a request starts the next.
        #[arg(long, default_value = "60s", value_parser = go_duration)]
        full_digest_every: Duration,
    },
    /// Compare two replicas (`--endpoint` twice: vLLM's version, each served model's root and
    /// context, how each tokenizes a fixed text and chat) or two model directories
    /// (`--model-dir` twice: the Hugging Face cache's commit and blob digests, file sizes,
    /// safetensors headers, tokenizer files and chat template; `--full` hashes every file too),
    /// and print every key that differs. Exits 1 when anything differs.
    Parity {
        /// A replica, `http://HOST:PORT`; give two.
        #[arg(long, conflicts_with = "model_dir")]
        endpoint: Vec<Endpoint>,
        /// A model directory (a Hugging Face cache's `models--ORG--NAME`, or a plain one); give two.
        #[arg(long)]
        model_dir: Vec<PathBuf>,
        /// Hash every file of the model directories (slow: reads all the weights).
        #[arg(long, requires = "model_dir")]
        full: bool,
        /// How long each replica has to answer.
        #[arg(long, default_value = "5s", value_parser = go_duration)]
        timeout: Duration,
        /// Print JSON instead of the lines.
        #[arg(long)]
        json: bool,
    },
}

/// Both sides' fingerprints, from two endpoints or two model directories.
async fn fingerprints(
    endpoints: &[Endpoint],
    model_dirs: &[PathBuf],
    full: bool,
    timeout: Duration,
) -> anyhow::Result<[Fingerprint; 2]> {
    if let [a, b] = endpoints {
        let (a, b) = tokio::join!(
            runtime_fingerprint(a, None, timeout),
            runtime_fingerprint(b, None, timeout)
        );
        return Ok([a?, b?]);
    }
    if let [a, b] = model_dirs {
        let threads = std::thread::available_parallelism().map_or(1, usize::from);
        let depth = if full {
            Depth::Full { threads }
        } else {
            Depth::Headers
        };
        let read = |dir: &PathBuf| -> anyhow::Result<Fingerprint> {
            let files = model::locate(dir).with_context(|| format!("reading {}", dir.display()))?;
            let (fingerprint, _) = model::fingerprint(&files, depth)
                .with_context(|| format!("fingerprinting {}", dir.display()))?;
            Ok(fingerprint)
        };
        return Ok([read(a)?, read(b)?]);
    }
    anyhow::bail!("give two --endpoint or two --model-dir")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Probe { probe: args, json } => probe_once(&args, json).await?,
        Command::Watch {
            probe: args,
            interval,
            admin_addr,
        } => watch_pool(args, interval, admin_addr).await?,
        Command::Coldstart {
            pod,
            namespace,
            pod_file,
            events,
            logs,
            container,
            first_token,
            json,
        } => {
            let recorded = recorded_cold_start(pod, namespace, pod_file, events, logs, container).await?;
            let timeline = recorded.timeline(first_token)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&timeline)?);
            } else {
                print!("{}", coldstart::render_table(&timeline));
            }
        }
        Command::Agent {
            node,
            admin_addr,
            interval,
            pod_resources_socket,
            resource,
            model_cache,
            model_cache_host_path,
            digests_file,
            full_digest_every,
        } => {
            let models = model_cache.zip(model_cache_host_path).map(|(mount, host)| {
                Arc::new(ModelCache::new(mount, host, digests_file).with_refresh(full_digest_every))
            });
            serve_gpu_agent(node, admin_addr, interval, pod_resources_socket, resource, models).await?;
        }
        Command::Parity {
            endpoint,
            model_dir,
            full,
            timeout,
            json,
        } => compare_parity(&endpoint, &model_dir, full, timeout, json).await?,
    }
    Ok(())
}

/// `probe`: one round over the endpoints, and the pool's verdict.
async fn probe_once(args: &ProbeArgs, json: bool) -> anyhow::Result<()> {
    let reports = probe::probe_round(&args.endpoints, &args.spec(), args.seed, 0, args.jitter).await;
    let outcomes: Vec<_> = reports.iter().map(|r| r.outcome.clone()).collect();
    let verdict = understudy_prober::report::describe(pool_verdict(&outcomes, args.min_serving));
    if json {
        let doc = serde_json::json!({"reports": reports, "pool": verdict});
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", probe::render_table(&reports));
        println!("pool (min serving {}): {verdict}", args.min_serving);
    }
    Ok(())
}

/// `watch`: rounds every interval, published on the admin port, until stopped.
async fn watch_pool(args: ProbeArgs, interval: Duration, admin_addr: SocketAddr) -> anyhow::Result<()> {
    anyhow::ensure!(!interval.is_zero(), "--interval must be more than 0s");
    let listener = tokio::net::TcpListener::bind(admin_addr)
        .await
        .with_context(|| format!("binding the admin server to {admin_addr}"))?;
    eprintln!("admin server on http://{}", listener.local_addr()?);
    let published = Published::default();
    let watch = Watch {
        // One list of endpoints is one pool; it is labelled A.
        pool: Pool::A,
        spec: args.spec(),
        endpoints: args.endpoints,
        seed: args.seed,
        max_jitter: args.jitter,
        min_serving: args.min_serving,
    };
    // SIGTERM (a pod stopped) or Ctrl-C ends the watch cleanly: the prober serves no
    // traffic, so there is nothing to drain.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        () = admin::serve(listener, admin::Limits::default(), published.clone()) => anyhow::bail!("the admin server stopped"),
        () = watch.run(interval, published) => {}
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    Ok(())
}

/// `coldstart`'s inputs: from the API when a pod is named, else from the files kubectl wrote.
async fn recorded_cold_start(
    pod: Option<String>,
    namespace: Option<String>,
    pod_file: Option<PathBuf>,
    events: Option<PathBuf>,
    logs: Option<PathBuf>,
    container: Option<String>,
) -> anyhow::Result<Recorded> {
    let recorded = match (pod, pod_file) {
        (Some(name), _) => {
            let client = kube::Client::try_default()
                .await
                .context("connecting to Kubernetes")?;
            let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_owned());
            Recorded::from_api(client, &namespace, &name, container).await?
        }
        (None, Some(path)) => Recorded::from_files(&path, events.as_deref(), logs.as_deref(), container)?,
        (None, None) => anyhow::bail!("--pod or --pod-file is required"),
    };
    Ok(recorded)
}

/// `agent`: judges this node's GPUs every interval and serves the verdicts, until stopped.
async fn serve_gpu_agent(
    node: String,
    admin_addr: SocketAddr,
    interval: Duration,
    pod_resources_socket: PathBuf,
    resource: String,
    models: Option<Arc<ModelCache>>,
) -> anyhow::Result<()> {
    anyhow::ensure!(!interval.is_zero(), "--interval must be more than 0s");
    let listener = tokio::net::TcpListener::bind(admin_addr)
        .await
        .with_context(|| format!("binding the agent's port to {admin_addr}"))?;
    let (inventory, no_nvml) = understudy_prober::gpu::open();
    if let Some(why) = &no_nvml {
        eprintln!("no GPUs found: {why}; serving all the same");
    }
    eprintln!("GPU agent for node {node} on http://{}", listener.local_addr()?);
    if let Some(models) = &models {
        eprintln!(
            "reading the model cache for parity ({} full digests known)",
            models.known_digests()
        );
    }
    let agent = agent::Agent {
        node,
        inventory,
        no_nvml,
        socket: pod_resources_socket,
        resource,
        limits: understudy_prober::gpu::Thresholds::default(),
        meminfo: agent::MEMINFO.into(),
    };
    let published = agent::Published::default();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        () = agent::serve(listener, admin::Limits::default(), published.clone(), models) => anyhow::bail!("the agent's server stopped"),
        () = agent::run(agent, interval, published) => {}
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    Ok(())
}

/// `parity`: prints what differs between the two sides, and exits 1 when anything does.
async fn compare_parity(
    endpoints: &[Endpoint],
    model_dirs: &[PathBuf],
    full: bool,
    timeout: Duration,
    json: bool,
) -> anyhow::Result<()> {
    let [a, b] = fingerprints(endpoints, model_dirs, full, timeout).await?;
    let compared =
        a.0.keys()
            .chain(b.0.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .len();
    let report = a.drift(&b);
    if json {
        let doc = serde_json::json!({"compared": compared, "differences": report.differences});
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else if report.holds() {
        println!("parity holds: {compared} keys compared, none differs");
    } else {
        print!("{}", report.render());
        println!("{} of {compared} keys differ", report.differences.len());
    }
    if !report.holds() {
        std::process::exit(1);
    }
    Ok(())
}
