//! GPU health as the node agents see it (`understudy-prober agent`, a DaemonSet on GPU nodes):
//! which pods hold a GPU that failed. Each probing round asks every agent `GET /gpus`; a pool
//! whose replicas on healthy GPUs are fewer than it needs gets a hard failed check, whatever its
//! probes said, since a replica on a GPU that fell off the bus or reported a fatal Xid cannot be
//! trusted to compute.
//!
//! An agent that cannot be read says nothing about its node: its pods count as healthy, and the
//! reason is logged. The agents also read their node's model cache for parity
//! ([`read_model`]). This module reads; the state machine decides.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use futures::future::join_all;
use understudy_prober::agent::NodeReport;
use understudy_prober::http1;
use understudy_prober::model_cache::ModelReading;

use crate::peers::{LabelledPods, PolicyClusters};

/// How long one agent has to answer.
const READ_TIMEOUT: Duration = Duration::from_secs(3);

/// Where the node agents are.
#[derive(Clone, Debug)]
pub enum GpuAgents {
    /// At these `host:port`s.
    At(Vec<(String, u16)>),
    /// The agent pods a label selects, at their port.
    Labelled(LabelledPods),
}

impl GpuAgents {
    /// Each agent's address, with the cluster it runs in (`None`: the operator's own).
    async fn addresses(
        &self,
        policy: Option<PolicyClusters<'_>>,
    ) -> Result<Vec<(Option<String>, String, u16)>, String> {
        match self {
            GpuAgents::At(at) => Ok(at
                .iter()
                .map(|(host, port)| (None, host.clone(), *port))
                .collect()),
            GpuAgents::Labelled(pods) => pods.addresses_by_cluster("GPU agents", policy).await,
        }
    }

    /// Every agent's report that could be read (with the agents of every cluster `policy`'s
    /// pools live in), each with its cluster, and why the others could not.
    pub async fn reports(
        &self,
        policy: Option<PolicyClusters<'_>>,
    ) -> (Vec<(Option<String>, NodeReport)>, Vec<String>) {
        let (read, unread) = self.read_all(policy).await;
        let reports = read
            .into_iter()
            .map(|(cluster, _, report)| (cluster, report))
            .collect();
        (reports, unread)
    }

    /// Each agent that answered, at the cluster and node its report names, and why the others
    /// did not answer.
    pub async fn by_node(&self, policy: Option<PolicyClusters<'_>>) -> (AgentsByNode, Vec<String>) {
        let (read, unread) = self.read_all(policy).await;
        let by_node = read
            .into_iter()
            .map(|(cluster, (host, port), report)| {
                let node = report.node.clone();
                ((cluster, node), NodeAgent { host, port, report })
            })
            .collect();
        (by_node, unread)
    }

    async fn read_all(
        &self,
        policy: Option<PolicyClusters<'_>>,
    ) -> (Vec<(Option<String>, (String, u16), NodeReport)>, Vec<String>) {
        let addresses = match self.addresses(policy).await {
            Ok(addresses) => addresses,
            Err(why) => return (Vec::new(), vec![why]),
        };
        let reads = join_all(addresses.iter().map(|(_, host, port)| read(host, *port))).await;
        let mut reports = Vec::new();
        let mut unread = Vec::new();
        for ((cluster, host, port), read) in addresses.into_iter().zip(reads) {
            match read {
                Ok(report) => reports.push((cluster, (host, port), report)),
                Err(why) => unread.push(format!("the GPU agent at {host}:{port}: {why}")),
            }
        }
        (reports, unread)
    }
}

/// A node's agent: where it answers, and its last report of the node.
#[derive(Clone, Debug)]
pub struct NodeAgent {
    pub host: String,
    pub port: u16,
    pub report: NodeReport,
}

/// The pods that hold a GPU that failed, as `agents` report them, each as its cluster (`None`:
/// the operator's own) and `namespace/name`: two clusters may each run a pod of the same name.
#[must_use]
pub fn failed_pods(agents: &AgentsByNode) -> BTreeSet<(Option<String>, String)> {
    agents
        .iter()
        .flat_map(|((cluster, _), agent)| {
            agent
                .report
                .failed_pods()
                .into_iter()
                .map(move |pod| (cluster.clone(), pod))
        })
        .collect()
}

/// The agents by the cluster (`None`: the operator's own) and node they report.
pub type AgentsByNode = BTreeMap<(Option<String>, String), NodeAgent>;

/// The most of a model reading kept: one key per file and digest, for models of hundreds of
/// shards.
const MAX_MODEL_READING: usize = 4 << 20;

/// `path` with every byte outside the unreserved set and `/` percent-encoded, for a query.
fn query_value(path: &str) -> String {
    let mut encoded = String::with_capacity(path.len());
    for byte in path.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~/".contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            let _ = write!(encoded, "%{byte:02X}");
        }
    }
    encoded
}

/// The model directory at `path` on the node of the agent at `host:port`, read at `depth`
/// (`cache`, `headers` or `full`); `None` while the agent takes its first full digest of it.
pub async fn read_model(
    host: &str,
    port: u16,
    path: &str,
    depth: &str,
) -> Result<Option<ModelReading>, String> {
    let target = format!("/models?path={}&depth={depth}", query_value(path));
    let call = http1::exchange_up_to(
        http1::Call {
            host,
            port,
            method: http::Method::GET,
            target: &target,
            bearer: None,
            json: None,
        },
        MAX_MODEL_READING,
    );
    let (status, body) = tokio::time::timeout(READ_TIMEOUT, call)
        .await
        .map_err(|_| format!("the agent gave no answer within {READ_TIMEOUT:?}"))??;
    match status {
        http::StatusCode::OK => serde_json::from_slice(&body)
            .map(Some)
            .map_err(|error| format!("the agent answered what is not a reading: {error}")),
        http::StatusCode::ACCEPTED => Ok(None),
        http::StatusCode::NOT_FOUND if body.is_empty() => {
            Err("the agent does not read a model cache (the chart's agent.modelCacheHostPath)".to_owned())
        }
        status => Err(format!(
            "the agent answered {}: {}",
            status.as_u16(),
            String::from_utf8_lossy(&body).trim()
        )),
    }
}

async fn read(host: &str, port: u16) -> Result<NodeReport, String> {
    let call = http1::exchange(http1::Call {
        host,
        port,
        method: http::Method::GET,
        target: "/gpus",
        bearer: None,
        json: None,
    });
    let (status, body) = tokio::time::timeout(READ_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {READ_TIMEOUT:?}"))??;
    if status != http::StatusCode::OK {
        return Err(format!("GET /gpus answered {}", status.as_u16()));
    }
    serde_json::from_slice(&body).map_err(|error| format!("GET /gpus answered what is not a report: {error}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn report(failed_pod: &str) -> NodeReport {
        serde_json::from_value(serde_json::json!({
            "node": "gpu-node-0", "readAt": "2026-12-03T00:00:00Z", "gpus": [], "free": [],
            "pods": [
                {"namespace": "serving", "pod": failed_pod, "container": "vllm", "gpus": ["GPU-0"], "failed": true},
                {"namespace": "serving", "pod": "chat-1", "container": "vllm", "gpus": ["GPU-1"], "failed": false},
            ],
        }))
        .unwrap()
    }

    #[test]
    fn a_failed_gpu_is_the_pods_in_the_cluster_whose_agent_reported_it() {
        let agent = |node: &str, pod: &str| {
            let mut report = report(pod);
            report.node = node.to_owned();
            let agent = NodeAgent {
                host: "127.0.0.1".to_owned(),
                port: 9400,
                report,
            };
            (node.to_owned(), agent)
        };
        let (east, home) = (agent("gpu-node-0", "chat-0"), agent("gpu-node-0", "chat-2"));
        let failed = failed_pods(&AgentsByNode::from([
            ((Some("us-east".to_owned()), east.0), east.1),
            ((None, home.0), home.1),
        ]));
        let east = (Some("us-east".to_owned()), "serving/chat-0".to_owned());
        assert!(failed.contains(&east));
        // The same pod name in another cluster is another pod.
        assert!(!failed.contains(&(Some("us-west".to_owned()), "serving/chat-0".to_owned())));
        assert!(!failed.contains(&(None, "serving/chat-0".to_owned())));
        assert!(failed.contains(&(None, "serving/chat-2".to_owned())));
        assert_eq!(failed.len(), 2);
    }
}
