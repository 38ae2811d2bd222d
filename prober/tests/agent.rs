//! The GPU agent: a fake NVML behind the inventory trait, and a kubelet's pod-resources API faked
//! as the real thing is, gRPC over HTTP/2 on a unix socket. A failed GPU fails the pod that holds
//! it; the report and the DCGM-style metrics say which; and the binary, on a machine without NVML,
//! says there are no GPUs and keeps serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use understudy_prober::agent::{self, Agent};
use understudy_prober::gpu::{FakeGpus, GpuState, NoGpus, Thresholds};
use understudy_prober::podresources::{self, NVIDIA_GPU, PodDevices};

fn gpu(index: u32) -> GpuState {
    GpuState {
        index,
        uuid: format!("GPU-{index}aaa"),
        xid_events: Vec::new(),
        ecc_uncorrectable: 0,
        row_remap_pending: false,
        retired_pages_pending: false,
        temperature_c: 45,
        throttle_reasons: Vec::new(),
        memory_used_bytes: 0,
        memory_total_bytes: 80 << 30,
        processes: 0,
        fallen_off_bus: false,
    }
}

fn holds(pod: &str, gpus: &[&str]) -> PodDevices {
    PodDevices {
        namespace: "serving".to_owned(),
        pod: pod.to_owned(),
        container: "vllm".to_owned(),
        resource: NVIDIA_GPU.to_owned(),
        devices: gpus.iter().map(|g| (*g).to_owned()).collect(),
    }
}

/// Serves `v1.PodResourcesLister/List` on a unix socket in `dir`, answering `pods`.
fn kubelet(dir: &Path, pods: Vec<PodDevices>) -> PathBuf {
    let socket = dir.join("kubelet.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(podresources::serve(listener, Arc::new(move || pods.clone())));
    socket
}

fn agent(gpus: Vec<GpuState>, socket: PathBuf) -> Agent {
    Agent {
        node: "gpu-node-1".to_owned(),
        inventory: Box::new(FakeGpus { gpus }),
        no_nvml: None,
        socket,
        resource: NVIDIA_GPU.to_owned(),
        limits: Thresholds::default(),
        meminfo: understudy_prober::agent::MEMINFO.into(),
    }
}

#[tokio::test]
async fn a_gpu_that_fell_off_the_bus_fails_the_pod_holding_it_and_only_that_one() {
    let dir = tempfile::tempdir().unwrap();
    let socket = kubelet(
        dir.path(),
        vec![
            holds("vllm-east-0", &["GPU-0aaa"]),
            holds("vllm-east-1", &["GPU-1aaa::2"]),
        ],
    );
    let mut lost = gpu(1);
    lost.fallen_off_bus = true;
    lost.xid_events = vec![79];
    let mut busy = gpu(0);
    busy.processes = 1;
    busy.memory_used_bytes = 70 << 30;
    let mut agent = agent(vec![busy, lost, gpu(2)], socket);
    let report = agent.read("2026-12-02T12:00:00Z".to_owned()).await;
    let memory = report.memory.expect("this machine's /proc/meminfo");
    assert!(
        memory.available_bytes > 0 && memory.available_bytes <= memory.total_bytes,
        "{memory:?}"
    );
    let verdicts: Vec<(&str, &str)> = report
        .gpus
        .iter()
        .map(|g| (g.uuid.as_str(), g.verdict.as_str()))
        .collect();
    assert_eq!(
        verdicts,
        [
            ("GPU-0aaa", "healthy"),
            ("GPU-1aaa", "failed"),
            ("GPU-2aaa", "healthy")
        ]
    );
    assert_eq!(report.gpus[1].reasons, ["fallen off the bus", "Xid 79"]);
    assert_eq!(report.failed_pods(), ["serving/vllm-east-1"]);
    assert_eq!(report.free, ["GPU-2aaa"], "only the idle healthy GPU is free");
    assert!(report.notes.is_empty(), "{:?}", report.notes);

    let metrics = agent::exposition(&report);
    assert!(
        metrics.contains(
            "DCGM_FI_DEV_XID_ERRORS{gpu=\"1\",UUID=\"GPU-1aaa\",device=\"nvidia1\",Hostname=\"gpu-node-1\",\
             container=\"vllm\",namespace=\"serving\",pod=\"vllm-east-1\"} 79"
        ),
        "{metrics}"
    );
    assert!(metrics.contains("DCGM_FI_DEV_FB_USED{gpu=\"0\""), "{metrics}");
    assert!(
        metrics.contains("} 71680\n"),
        "70 GiB used is 71680 MiB: {metrics}"
    );
    assert!(metrics.contains("understudy_gpu_health{gpu=\"1\""), "{metrics}");
    assert!(
        metrics.contains("understudy_gpus_free{Hostname=\"gpu-node-1\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn without_nvml_or_a_kubelet_the_report_says_what_it_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent {
        inventory: Box::new(NoGpus),
        no_nvml: Some("libnvidia-ml.so.1 cannot be loaded".to_owned()),
        meminfo: dir.path().join("no-meminfo"),
        ..agent(Vec::new(), dir.path().join("nothing.sock"))
    };
    let report = agent.read("t".to_owned()).await;
    assert!(report.gpus.is_empty() && report.pods.is_empty());
    assert_eq!(
        report.notes[0],
        "no GPUs found: libnvidia-ml.so.1 cannot be loaded"
    );
    assert!(
        report.notes[1].starts_with("which pod holds which GPU is not known: connecting to "),
        "{:?}",
        report.notes
    );
    assert!(report.memory.is_none());
    assert!(
        report.notes[2].starts_with("the host memory could not be read from "),
        "{:?}",
        report.notes
    );
}

/// One blocking GET on loopback: the status and the body.
fn get(port: u16, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (
        status,
        raw.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    )
}

#[test]
fn the_agent_binary_without_nvml_serves_a_report_with_no_gpus() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_understudy-prober"))
        .args([
            "agent",
            "--node",
            "cpu-node",
            "--admin-addr",
            "127.0.0.1:0",
            "--interval",
            "1s",
        ])
        .args(["--pod-resources-socket", "/nonexistent/kubelet.sock"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    let port = loop {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "the agent exited: {said}"
        );
        said.push_str(&line);
        if let Some(addr) = line.trim().rsplit_once("http://").map(|(_, a)| a.to_owned()) {
            break addr.rsplit_once(':').unwrap().1.parse::<u16>().unwrap();
        }
    };
    let report = loop {
        let (status, body) = get(port, "/gpus");
        if status == 200 {
            break body;
        }
        assert_eq!(status, 503, "{body}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let report: agent::NodeReport = serde_json::from_str(&report).unwrap();
    assert_eq!(report.node, "cpu-node");
    // On a machine with NVML and GPUs they are listed; without, the report says so.
    if report.gpus.is_empty() {
        assert!(report.notes[0].starts_with("no GPUs found"), "{report:?}");
    }
    assert_eq!(get(port, "/live").0, 200);
    assert_eq!(get(port, "/ready").0, 200);
    child.kill().unwrap();
    child.wait().unwrap();
}
