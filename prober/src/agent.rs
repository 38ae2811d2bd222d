//! The node agent, `understudy-prober agent`: run as a DaemonSet on GPU nodes, it reads every GPU
//! of its node once per interval ([`crate::gpu`]: NVML behind [`GpuInventory`]), judges each one
//! healthy, degraded or failed, asks the kubelet which pod holds which GPU
//! ([`crate::podresources`]), and publishes the lot:
//!
//! - `GET /gpus`: the [`NodeReport`] as JSON, which the operator reads to fail a replica whose GPU
//!   failed and to see free GPUs;
//! - `GET /metrics`: DCGM-exporter-compatible gauges (`DCGM_FI_DEV_GPU_TEMP`, `DCGM_FI_DEV_FB_USED`,
//!   `DCGM_FI_DEV_FB_FREE`, `DCGM_FI_DEV_XID_ERRORS`, `DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`, with the
//!   `gpu`, `UUID`, `Hostname` labels and the holding pod's `namespace`, `pod`, `container`), and
//!   `understudy_gpu_health` (0 healthy, 1 degraded, 2 failed) and `understudy_gpus_free`;
//! - `/live`, and `/ready` once a first reading is published;
//! - with the node's model cache mounted, `GET /models`: a model directory's fingerprint for
//!   parity ([`crate::model_cache`]).
//!
//! A node without the NVML library has no GPUs: the report says "no GPUs found" and why, and the
//! agent keeps serving. A kubelet that cannot be asked leaves the pods unknown, said the same way.
//! The agent only reads: it must never change a GPU or a pod.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use understudy_listener::{Limits, serve_service_until};

use crate::gpu::{GpuInventory, GpuState, GpuVerdict, NodeHealth, Thresholds};
use crate::latest::{self, Latest};
use crate::model_cache::{self, ModelCache};
use crate::podresources::{self, PodDevices};

/// One GPU as the agent publishes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuReport {
    pub index: u32,
    pub uuid: String,
    /// `healthy`, `degraded` or `failed`.
    pub verdict: String,
    /// Why it is not healthy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    pub temperature_c: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// The last Xid seen, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_xid: Option<u64>,
    pub ecc_uncorrectable: u64,
}

/// A pod holding GPUs of this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodGpus {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub gpus: Vec<String>,
    /// A GPU it holds has failed: the replica cannot be trusted to compute.
    pub failed: bool,
}

/// What the agent publishes about its node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    pub node: String,
    /// When the GPUs were read, RFC 3339.
    pub read_at: String,
    pub gpus: Vec<GpuReport>,
    /// Healthy GPUs no process uses: where a pilot-light replica can start without waiting for
    /// a node.
    pub free: Vec<String>,
    pub pods: Vec<PodGpus>,
    /// The node's host memory, where a level-1 sleeper parks its weights; `None` when it could
    /// not be read (a note says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<HostMemory>,
    /// What is missing from this report and why: no GPUs found, pods unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// A node's memory as the kernel counts it (`/proc/meminfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostMemory {
    pub total_bytes: u64,
    /// What can be given to a new allocation without swapping (`MemAvailable`).
    pub available_bytes: u64,
}

impl HostMemory {
    /// `MemTotal` and `MemAvailable` in `meminfo`'s text.
    pub fn parse(meminfo: &str) -> Result<Self, String> {
        let field = |name: &str| -> Result<u64, String> {
            let line = meminfo
                .lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .ok_or_else(|| format!("no {name} line"))?;
            let kib = line.trim().trim_end_matches("kB").trim();
            kib.parse::<u64>()
                .ok()
                .and_then(|kib| kib.checked_mul(1024))
                .ok_or_else(|| format!("{name} is {line:?}"))
        };
        Ok(HostMemory {
            total_bytes: field("MemTotal")?,
            available_bytes: field("MemAvailable")?,
        })
    }
}

/// Where the kernel says how much memory the node has.
pub const MEMINFO: &str = "/proc/meminfo";

impl NodeReport {
    /// The pods on a failed GPU, as `namespace/pod`.
    #[must_use]
    pub fn failed_pods(&self) -> Vec<String> {
        self.pods
            .iter()
            .filter(|p| p.failed)
            .map(|p| format!("{}/{}", p.namespace, p.pod))
            .collect()
    }
}

/// Reads the node's GPUs and who holds them.
pub struct Agent {
    pub node: String,
    pub inventory: Box<dyn GpuInventory + Send>,
    /// Why there is no NVML, said in every report: the node has no GPUs as far as the agent knows.
    pub no_nvml: Option<String>,
    /// The kubelet's pod-resources socket.
    pub socket: PathBuf,
    /// The resource the GPUs are allocated as.
    pub resource: String,
    pub limits: Thresholds,
    /// Where the node's memory is read ([`MEMINFO`]).
    pub meminfo: PathBuf,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("node", &self.node)
            .field("socket", &self.socket)
            .field("resource", &self.resource)
            .finish_non_exhaustive()
    }
}

fn verdict_parts(verdict: &GpuVerdict) -> (&'static str, Vec<String>) {
    match verdict {
        GpuVerdict::Healthy => ("healthy", Vec::new()),
        GpuVerdict::Degraded(why) => ("degraded", why.clone()),
        GpuVerdict::Failed(why) => ("failed", why.clone()),
    }
}

impl Agent {
    /// One reading of the node, stamped `read_at`.
    pub async fn read(&mut self, read_at: String) -> NodeReport {
        let mut notes = Vec::new();
        let gpus: Vec<GpuState> = match self.inventory.read() {
            Ok(gpus) => gpus,
            Err(error) => {
                notes.push(format!("the GPUs could not be read: {error}"));
                Vec::new()
            }
        };
        if gpus.is_empty() && notes.is_empty() {
            let why = self.no_nvml.as_deref().unwrap_or("NVML lists none");
            notes.push(format!("no GPUs found: {why}"));
        }
        let health = NodeHealth::judge(&gpus, &self.limits);
        let reports: Vec<GpuReport> = gpus
            .iter()
            .zip(&health.gpus)
            .map(|(gpu, (_, verdict))| {
                let (word, reasons) = verdict_parts(verdict);
                GpuReport {
                    index: gpu.index,
                    uuid: gpu.uuid.clone(),
                    verdict: word.to_owned(),
                    reasons,
                    temperature_c: gpu.temperature_c,
                    memory_used_bytes: gpu.memory_used_bytes,
                    memory_total_bytes: gpu.memory_total_bytes,
                    last_xid: gpu.xid_events.last().copied(),
                    ecc_uncorrectable: gpu.ecc_uncorrectable,
                }
            })
            .collect();
        let pods = match podresources::list(&self.socket, Duration::from_secs(5)).await {
            Ok(devices) => self.pods(&devices, &reports),
            Err(error) => {
                notes.push(format!("which pod holds which GPU is not known: {error}"));
                Vec::new()
            }
        };
        let memory = std::fs::read_to_string(&self.meminfo)
            .map_err(|e| e.to_string())
            .and_then(|text| HostMemory::parse(&text));
        let memory = match memory {
            Ok(memory) => Some(memory),
            Err(error) => {
                notes.push(format!(
                    "the host memory could not be read from {}: {error}",
                    self.meminfo.display()
                ));
                None
            }
        };
        NodeReport {
            node: self.node.clone(),
            read_at,
            gpus: reports,
            free: health.free,
            pods,
            memory,
            notes,
        }
    }

    fn pods(&self, devices: &[PodDevices], gpus: &[GpuReport]) -> Vec<PodGpus> {
        let failed = |uuid: &String| gpus.iter().any(|g| &g.uuid == uuid && g.verdict == "failed");
        devices
            .iter()
            .filter(|d| d.resource == self.resource && !d.devices.is_empty())
            .map(|d| PodGpus {
                namespace: d.namespace.clone(),
                pod: d.pod.clone(),
                container: d.container.clone(),
                gpus: d.devices.clone(),
                failed: d.devices.iter().any(failed),
            })
            .collect()
    }
}

/// A report, and its JSON serialized once.
type Serialized = (NodeReport, Arc<str>);

/// The latest report, serialized once per reading.
#[derive(Clone, Debug, Default)]
pub struct Published(Arc<RwLock<Option<Serialized>>>);

impl Published {
    /// Makes `report` the one served.
    pub fn publish(&self, report: NodeReport) {
        let json: Arc<str> = serde_json::to_string(&report).unwrap_or_default().into();
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Some((report, json));
    }

    fn latest(&self) -> Option<Serialized> {
        self.0.read().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl Latest for Published {
    const NOT_YET: &'static str = "no reading yet\n";

    fn latest_json(&self) -> Option<Arc<str>> {
        self.latest().map(|(_, json)| json)
    }
}

/// Reads the node every `interval` and publishes each reading, until dropped.
pub async fn run(mut agent: Agent, interval: Duration, published: Published) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let now = jiff::Timestamp::now();
        let read_at = jiff::Timestamp::from_second(now.as_second())
            .unwrap_or(now)
            .to_string();
        published.publish(agent.read(read_at).await);
    }
}

/// The agent's routes, with `GET /models` when the node's model cache is mounted.
pub fn router(published: Published, models: Option<Arc<ModelCache>>) -> Router {
    let router = latest::routes("/gpus")
        .route("/metrics", get(metrics))
        .with_state(published);
    match models {
        Some(models) => router.merge(model_cache::routes(models)),
        None => router,
    }
}

/// Serves the agent's routes on `listener` within `limits` until the process ends.
pub async fn serve(
    listener: TcpListener,
    limits: Limits,
    published: Published,
    models: Option<Arc<ModelCache>>,
) {
    serve_service_until(
        listener,
        router(published, models),
        limits,
        CancellationToken::new(),
    )
    .await;
}

async fn metrics(State(published): State<Published>) -> Response {
    let text = published
        .latest()
        .map(|(report, _)| exposition(&report))
        .unwrap_or_default();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

/// `value` with Prometheus's escapes for a label value.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A gauge per GPU: its name, its help, and its value.
type Gauge = (&'static str, &'static str, fn(&GpuReport) -> Option<u64>);

/// The report in Prometheus's text format, as dcgm-exporter names and labels its gauges.
#[must_use]
pub fn exposition(report: &NodeReport) -> String {
    let holder: BTreeMap<&str, &PodGpus> = report
        .pods
        .iter()
        .flat_map(|pod| pod.gpus.iter().map(move |uuid| (uuid.as_str(), pod)))
        .collect();
    let labels = |gpu: &GpuReport| {
        let (namespace, pod, container) = holder.get(gpu.uuid.as_str()).map_or(("", "", ""), |p| {
            (p.namespace.as_str(), p.pod.as_str(), p.container.as_str())
        });
        format!(
            r#"gpu="{}",UUID="{}",device="nvidia{}",Hostname="{}",container="{}",namespace="{}",pod="{}""#,
            gpu.index,
            label(&gpu.uuid),
            gpu.index,
            label(&report.node),
            label(container),
            label(namespace),
            label(pod)
        )
    };
    let gauges: [Gauge; 5] = [
        ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", |g| {
            Some(u64::from(g.temperature_c))
        }),
        ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", |g| {
            Some(g.memory_used_bytes >> 20)
        }),
        ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", |g| {
            Some(g.memory_total_bytes.saturating_sub(g.memory_used_bytes) >> 20)
        }),
        (
            "DCGM_FI_DEV_XID_ERRORS",
            "Value of the last XID error encountered.",
            |g| Some(g.last_xid.unwrap_or(0)),
        ),
        (
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
            "Total number of double-bit volatile ECC errors.",
            |g| Some(g.ecc_uncorrectable),
        ),
    ];
    let mut out = String::new();
    for (name, help, value) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for gpu in &report.gpus {
            if let Some(v) = value(gpu) {
                let _ = writeln!(out, "{name}{{{}}} {v}", labels(gpu));
            }
        }
    }
    let _ = writeln!(
        out,
        "# HELP understudy_gpu_health The agent's verdict: 0 healthy, 1 degraded, 2 failed.\n\
         # TYPE understudy_gpu_health gauge"
    );
    for gpu in &report.gpus {
        let level = match gpu.verdict.as_str() {
            "healthy" => 0,
            "degraded" => 1,
            _ => 2,
        };
        let _ = writeln!(out, "understudy_gpu_health{{{}}} {level}", labels(gpu));
    }
    let _ = writeln!(
        out,
        "# HELP understudy_gpus_free Healthy GPUs no process uses.\n# TYPE understudy_gpus_free gauge\n\
         understudy_gpus_free{{Hostname=\"{}\"}} {}",
        label(&report.node),
        report.free.len()
    );
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn host_memory_is_read_from_meminfo_in_bytes() {
        let meminfo =
            "MemTotal:       2113396736 kB\nMemFree:         1048576 kB\nMemAvailable:   1610612736 kB\n";
        assert_eq!(
            HostMemory::parse(meminfo).unwrap(),
            HostMemory {
                total_bytes: 2_113_396_736 * 1024,
                available_bytes: 1_610_612_736 * 1024,
            }
        );
        assert_eq!(
            HostMemory::parse("MemTotal: 1 kB\n").unwrap_err(),
            "no MemAvailable line"
        );
    }
}
