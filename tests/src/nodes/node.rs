//! The nodes themselves: registered with GPU capacity, kept Ready by a heartbeat.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::Config;

/// The field manager of everything the emulated kubelet writes.
pub const MANAGER: &str = "understudy-emulated-kubelet";

/// How often a node's Lease is renewed and its Ready condition refreshed; the kubelet renews
/// every 10 s and the node controller waits 40 s or more before it calls a node NotReady.
const HEARTBEAT: Duration = Duration::from_secs(10);
const LEASE_SECONDS: i32 = 40;

/// The Kubernetes version the nodes report: the control plane's own.
const KUBELET_VERSION: &str = "v1.36.3";

/// A healthy node's conditions, beating at `now`, unchanged `since`.
fn ready_conditions(now: Timestamp, since: Timestamp) -> serde_json::Value {
    let condition = |kind: &str, status: &str, reason: &str, message: &str| {
        json!({
            "type": kind, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": now, "lastTransitionTime": since,
        })
    };
    json!([
        condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        condition(
            "MemoryPressure",
            "False",
            "KubeletHasSufficientMemory",
            "kubelet has sufficient memory available"
        ),
        condition(
            "DiskPressure",
            "False",
            "KubeletHasNoDiskPressure",
            "kubelet has no disk pressure"
        ),
        condition(
            "PIDPressure",
            "False",
            "KubeletHasSufficientPID",
            "kubelet has sufficient PID available"
        ),
    ])
}

/// Creates or updates the node `name` and its status: GPU capacity, Ready since `since`, its one
/// address (127.0.0.1, where the API server finds the log endpoint on `log_port`).
pub async fn register(
    client: &Client,
    name: &str,
    config: &Config,
    log_port: u16,
    since: Timestamp,
) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let gpus = config.gpus_per_node.to_string();
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "emulated-gpu",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": config.gpu_product,
                "nvidia.com/gpu.count": gpus,
            },
        },
    });
    let params = PatchParams::apply(MANAGER).force();
    nodes.patch(name, &params, &Patch::Apply(&node)).await?;
    let capacity = json!({
        "cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti", "nvidia.com/gpu": gpus,
    });
    let status = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": ready_conditions(since, since),
            // Only an address the API server can reach: a Hostname entry would be tried first
            // and not resolve.
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": log_port}},
            "nodeInfo": {
                "machineID": name, "systemUUID": name, "bootID": name,
                "kernelVersion": "emulated", "osImage": "understudy emulated GPU node",
                "containerRuntimeVersion": "emulated://1", "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            },
        },
    });
    nodes.patch_status(name, &params, &Patch::Apply(&status)).await?;
    Ok(())
}

/// Renews each node's Lease and refreshes its conditions (Ready since `since`) every
/// [`HEARTBEAT`], until aborted. A failed beat is logged and tried again at the next.
pub async fn heartbeat(client: Client, names: Vec<String>, since: Timestamp) {
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let nodes: Api<Node> = Api::all(client);
    let params = PatchParams::apply(MANAGER).force();
    let mut tick = tokio::time::interval(HEARTBEAT);
    loop {
        tick.tick().await;
        let now = Timestamp::now();
        for name in &names {
            let lease = json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name},
                "spec": {
                    "holderIdentity": name,
                    "leaseDurationSeconds": LEASE_SECONDS,
                    "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
                },
            });
            if let Err(error) = leases.patch(name, &params, &Patch::Apply(&lease)).await {
                tracing::warn!(node = %name, %error, "renewing the node lease");
            }
            // A strategic merge, which merges the conditions by type: an apply of the
            // conditions alone, by the manager that registered the node, would drop the rest
            // of the status it applied then (capacity, addresses, the log endpoint).
            let status = json!({"status": {"conditions": ready_conditions(now, since)}});
            let merge = PatchParams::default();
            if let Err(error) = nodes.patch_status(name, &merge, &Patch::Strategic(&status)).await {
                tracing::warn!(node = %name, %error, "refreshing the node's conditions");
            }
        }
    }
}
