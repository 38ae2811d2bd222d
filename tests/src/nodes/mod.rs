//! Emulated GPU nodes for the cluster tier: a kubelet, as the API server and the operator see
//! one, for nodes that have no containers and no GPUs.
//!
//! It registers `N` nodes with `nvidia.com/gpu` capacity and keeps them Ready (a heartbeat on
//! each node's Lease, as kubelets do). For every pod the real scheduler binds to one of them it
//! plays the kubelet's part: it gives the pod its own loopback address (127.0.0.x, standing in
//! for the pod network), posts the kubelet's events (Pulling, Pulled with the pull's own time,
//! Created, Started, Killing), starts each container as a local process (a vLLM image as
//! `vllm-emulator` with the pod's own arguments, an understudy image as the router's command
//! line, anything else, a pause container say, as nothing at all), reports status as a kubelet
//! would (conditions, `podIP`, container states, restarts, readiness from the pod's own
//! readiness probe), restarts a container whose process dies as the pod's restart policy says,
//! and on deletion stops the processes (SIGTERM, then SIGKILL after the grace period) before it
//! removes the pod. It serves the kubelet's log endpoint, so `pods/log` through the API server
//! returns what the processes printed, stamped as read (`kubectl logs --timestamps`). It plays
//! kube-proxy's part too: a Service's loopback cluster IP forwards to its ready pods
//! ([`services`]).
//!
//! Not emulated: volumes, init containers, exec and liveness probes, port-forward and exec
//! through the API server, resource enforcement, and images that need a pull secret. It must
//! never touch a pod bound to a node it does not own.

mod containers;
mod logs;
mod node;
mod pod;
mod services;

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};

pub use containers::{Binary, Programs};
pub use logs::TlsFiles;

/// What the emulated nodes are and what they run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Node names, `<prefix>-1` … `<prefix>-N`.
    pub node_prefix: String,
    pub nodes: usize,
    pub gpus_per_node: u32,
    /// `nvidia.com/gpu.product` on every node.
    pub gpu_product: String,
    /// The programs that stand in for container images.
    pub programs: Programs,
    /// How long a first pull of an image takes on a node; later pulls find it present.
    pub pull_time: Duration,
    /// The first restart's back-off; it doubles up to five minutes, as the kubelet's does.
    pub restart_backoff: Duration,
    /// Pods get addresses from here upwards, one each, never reused while this runs.
    pub first_pod_ip: Ipv4Addr,
    /// Where each pod's logs and files go.
    pub work_dir: PathBuf,
    /// The kubelet's serving certificate and key, for the log endpoint.
    pub tls: TlsFiles,
    /// The API server and its CA, for the kubeconfig a pod's understudy containers get in place
    /// of a mounted service-account token.
    pub api_server: String,
    pub api_ca: PathBuf,
}

impl Config {
    fn node_names(&self) -> Vec<String> {
        (1..=self.nodes)
            .map(|i| format!("{}-{i}", self.node_prefix))
            .collect()
    }
}

/// Why the nodes stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("registering node {node}: {source}")]
    Register {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("the kubelet log endpoint: {0}")]
    Logs(#[from] logs::Error),
    #[error("watching pods: {0}")]
    Watch(#[from] watcher::Error),
}

/// Pod addresses, handed out in order.
#[derive(Debug)]
struct Addresses {
    next: Mutex<u32>,
}

impl Addresses {
    fn new(first: Ipv4Addr) -> Addresses {
        Addresses {
            next: Mutex::new(u32::from(first)),
        }
    }

    fn take(&self) -> Ipv4Addr {
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        let ip = Ipv4Addr::from(*next);
        *next += 1;
        ip
    }
}

/// What every pod task shares.
struct Kubelet {
    client: Client,
    config: Config,
    addresses: Addresses,
    logs: logs::Store,
    /// Images already pulled, per node.
    pulled: Mutex<HashMap<String, Vec<String>>>,
}

impl std::fmt::Debug for Kubelet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kubelet")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Kubelet {
    /// Whether `image` was on `node` already; either way it is from now on.
    fn pull(&self, node: &str, image: &str) -> bool {
        let mut pulled = self.pulled.lock().unwrap_or_else(PoisonError::into_inner);
        let images = pulled.entry(node.to_owned()).or_default();
        if images.iter().any(|i| i == image) {
            return true;
        }
        images.push(image.to_owned());
        false
    }
}

/// Registers the nodes, serves their log endpoint, keeps them Ready and runs their pods until
/// the pod watch ends or fails for good. Prints `kubelet listening on https://ADDR` once the
/// nodes are registered.
pub async fn run(client: Client, config: Config) -> Result<(), Error> {
    let logs = logs::Store::default();
    let (log_port, serving) = logs::serve(&config.tls, logs.clone()).await?;
    let names = config.node_names();
    let since = jiff::Timestamp::now();
    for name in &names {
        node::register(&client, name, &config, log_port, since)
            .await
            .map_err(|source| Error::Register {
                node: name.clone(),
                source,
            })?;
    }
    println!(
        "kubelet listening on https://127.0.0.1:{log_port} for {} node(s)",
        names.len()
    );
    let heartbeat = tokio::spawn(node::heartbeat(client.clone(), names.clone(), since));
    let proxy = tokio::spawn(services::serve(client.clone()));

    let kubelet = Arc::new(Kubelet {
        client: client.clone(),
        addresses: Addresses::new(config.first_pod_ip),
        config,
        logs,
        pulled: Mutex::new(HashMap::new()),
    });
    let mut running: HashMap<String, pod::Handle> = HashMap::new();
    let pods: Api<Pod> = Api::all(client);
    let mut events = watcher(pods, watcher::Config::default()).boxed();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                tracing::warn!(%error, "the pod watch failed; it resumes");
                continue;
            }
        };
        let pods = match event {
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => vec![pod],
            watcher::Event::Delete(pod) => {
                // Gone without us (a forced delete): stop what it ran.
                if let Some(uid) = pod.uid() {
                    running.remove(&uid);
                }
                continue;
            }
            watcher::Event::Init | watcher::Event::InitDone => continue,
        };
        for pod in pods {
            let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
                continue;
            };
            let Some(uid) = pod.uid() else { continue };
            if !names.contains(&node) {
                continue;
            }
            running.retain(|_, handle| !handle.is_finished());
            match running.get(&uid) {
                Some(handle) => handle.update(&pod),
                None if pod.metadata.deletion_timestamp.is_none() => {
                    running.insert(uid, pod::Handle::start(kubelet.clone(), pod, node));
                }
                // Deleted before it ran here (or before this kubelet started): nothing to stop.
                None => {
                    tokio::spawn(pod::remove(kubelet.client.clone(), pod));
                }
            }
        }
    }
    heartbeat.abort();
    proxy.abort();
    serving.abort();
    Ok(())
}
