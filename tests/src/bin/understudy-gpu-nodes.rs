//! `understudy-gpu-nodes`: emulated GPU nodes for the cluster tier (`understudy_tests::nodes`).
//! Registers the nodes with the API server the kubeconfig names and runs the pods bound to them
//! as local processes until it is stopped (SIGTERM or ctrl-c), which stops those processes too.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use kube::config::{KubeConfigOptions, Kubeconfig};
use understudy_tests::nodes::{self, Binary, Programs, TlsFiles};

/// Emulated GPU nodes: a kubelet whose containers are local processes on loopback.
#[derive(Debug, Parser)]
#[command(about)]
struct Args {
    /// The kubeconfig of the cluster to join (its current context); the identity needs to
    /// write nodes, leases, pods' status, events and service-account tokens.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: PathBuf,
    /// How many nodes.
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// `nvidia.com/gpu` on each.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    #[arg(long, default_value = "gpu-node")]
    node_prefix: String,
    #[arg(long, default_value = "NVIDIA-H100-80GB-HBM3")]
    gpu_product: String,
    /// The program that runs vLLM images: `vllm-emulator`.
    #[arg(long)]
    vllm: PathBuf,
    /// The program that runs vLLM's CPU images (`vllm-cpu` in the name) as real vLLM:
    /// `tests/vllm/serve.sh`. Without it, such images fail to start.
    #[arg(long)]
    vllm_cpu: Option<PathBuf>,
    /// The program that runs the router's image (`understudy-router`: the gateway and the fence).
    #[arg(long)]
    router: Option<PathBuf>,
    /// The program that runs the operator's image (`understudy-operator`).
    #[arg(long)]
    operator: Option<PathBuf>,
    /// The program that runs the prober's image (`understudy-prober`: the GPU agent).
    #[arg(long)]
    prober: Option<PathBuf>,
    /// How long the first pull of an image takes on a node, in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    pull_ms: u64,
    /// The first restart's back-off, in milliseconds (the kubelet's is 10 s).
    #[arg(long, default_value_t = 10_000)]
    restart_backoff_ms: u64,
    /// The first pod address; pods get the ones after it in turn.
    #[arg(long, default_value = "127.0.0.10")]
    first_pod_ip: Ipv4Addr,
    /// Where pods' logs and files go.
    #[arg(long)]
    work_dir: PathBuf,
    /// The log endpoint's certificate and key (PEM).
    #[arg(long)]
    tls_cert: PathBuf,
    #[arg(long)]
    tls_key: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let kubeconfig = Kubeconfig::read_from(&args.kubeconfig).context("reading the kubeconfig")?;
    let cluster = kubeconfig
        .clusters
        .first()
        .and_then(|c| c.cluster.clone())
        .context("the kubeconfig names no cluster")?;
    let api_server = cluster.server.context("the kubeconfig's cluster has no server")?;
    let api_ca = PathBuf::from(
        cluster
            .certificate_authority
            .context("the kubeconfig's cluster has no certificate-authority file")?,
    );
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    let client = kube::Client::try_from(config)?;
    std::fs::create_dir_all(&args.work_dir).context("creating --work-dir")?;
    let config = nodes::Config {
        node_prefix: args.node_prefix,
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        gpu_product: args.gpu_product,
        // Absolute, since each container runs in its pod's own directory.
        programs: Programs {
            vllm: std::fs::canonicalize(&args.vllm).context("--vllm")?,
            vllm_cpu: args
                .vllm_cpu
                .map(|path| std::fs::canonicalize(path).context("--vllm-cpu"))
                .transpose()?,
            understudy: [
                (Binary::Router, args.router, "--router"),
                (Binary::Operator, args.operator, "--operator"),
                (Binary::Prober, args.prober, "--prober"),
            ]
            .into_iter()
            .filter_map(|(binary, path, flag)| {
                Some(
                    std::fs::canonicalize(path?)
                        .context(flag)
                        .map(|path| (binary, path)),
                )
            })
            .collect::<anyhow::Result<_>>()?,
        },
        pull_time: Duration::from_millis(args.pull_ms),
        restart_backoff: Duration::from_millis(args.restart_backoff_ms),
        first_pod_ip: args.first_pod_ip,
        work_dir: args.work_dir,
        tls: TlsFiles {
            cert: args.tls_cert,
            key: args.tls_key,
        },
        api_server,
        api_ca,
    };
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        result = nodes::run(client, config) => result?,
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    // Returning drops the runtime and with it every pod's task: each container's process is
    // killed with it, so that nothing outlives the nodes.
    Ok(())
}
