//! The cluster tier: a real kube-apiserver, controller manager and scheduler, emulated GPU nodes
//! whose pods are `vllm-emulator` processes on their own loopback addresses, and the operator
//! binary running as the chart's ServiceAccount. `tests/cluster/e2e.sh` brings all of it up and
//! runs these; without it (no `UNDERSTUDY_CLUSTER_KUBECONFIG`) each test says so and passes
//! without checking anything, as the mock API server's tests cover the calls.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt};
use serde_json::json;
use understudy_api::crd::FailoverPolicy;
use understudy_api::lease::EPOCH_ANNOTATION;
use understudy_prober::coldstart::{self, ColdStartInputs, ColdStartStage};

const MODEL: &str = "Qwen/Qwen3-0.6B";
const ROUTER: &str = env!("CARGO_BIN_EXE_understudy-router-e2e");
const ADMIN_TOKEN: &str = "cluster-test-admin-token";

/// The cluster's admin client, or `None` (with a note) when no cluster is up.
async fn cluster() -> Option<Client> {
    let Ok(path) = std::env::var("UNDERSTUDY_CLUSTER_KUBECONFIG") else {
        eprintln!("skipped: no cluster is up (tests/cluster/e2e.sh runs this suite against one)");
        return None;
    };
    Some(client_from(&PathBuf::from(path)).await)
}

async fn client_from(path: &std::path::Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// A fresh namespace named `name` (any left by an earlier run is deleted first).
async fn namespace(client: &Client, name: &str) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let _ = namespaces.delete(name, &DeleteParams::default()).await;
    let until = Instant::now() + Duration::from_secs(60);
    while namespaces.get_opt(name).await.unwrap().is_some() {
        assert!(Instant::now() < until, "namespace {name} is still being deleted");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let object = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    namespaces.create(&PostParams::default(), &object).await.unwrap();
    // The controller manager gives every namespace its default ServiceAccount.
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), name);
    while accounts.get_opt("default").await.unwrap().is_none() {
        assert!(
            Instant::now() < until,
            "namespace {name} got no default ServiceAccount"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A Deployment of `replicas` vLLM servers, each on one GPU, ready when `/health` answers.
fn vllm_deployment(name: &str, replicas: u32) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "vllm",
                        "image": "vllm/vllm-openai:v0.11.0",
                        "command": ["vllm", "serve"],
                        "args": [MODEL, "--port", "8000", "--max-model-len", "4096"],
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
                    }],
                },
            },
        },
    }))
    .unwrap()
}

/// Polls `check` every quarter second until it gives a value, for at most `limit`.
async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < until, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pods of `app`, once `count` of them are Ready.
async fn ready_pods(pods: &Api<Pod>, app: &str, count: usize) -> Vec<Pod> {
    let params = ListParams::default().labels(&format!("app={app}"));
    eventually(
        Duration::from_secs(90),
        &format!("{count} ready pod(s) of {app}"),
        || async {
            let list = pods.list(&params).await.unwrap().items;
            let ready: Vec<Pod> = list.into_iter().filter(is_ready).collect();
            (ready.len() == count).then_some(ready)
        },
    )
    .await
}

fn pod_ip(pod: &Pod) -> IpAddr {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .unwrap()
        .parse()
        .unwrap()
}

/// The process behind a pod's first container: the emulated kubelet writes its id as the
/// container id.
fn container_pid(pod: &Pod) -> u32 {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .unwrap();
    let id = statuses[0].container_id.as_deref().unwrap();
    id.strip_prefix("emulated://").unwrap().parse().unwrap()
}

fn restart_count(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, |s| s[0].restart_count)
}

fn sigkill(pid: u32) {
    let status = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -KILL {pid}");
}

/// One HTTP/1.1 request on a fresh connection; the status and the body.
fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(request.as_bytes()).unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).unwrap();
    let status = raw.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

/// A child process, killed when dropped, its output kept.
struct Process {
    child: Child,
    output: Arc<Mutex<Vec<String>>>,
}

impl Process {
    fn start(command: &mut Command) -> Process {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = Arc::new(Mutex::new(Vec::new()));
        for pipe in [
            child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
            child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    output.lock().unwrap().push(line);
                }
            });
        }
        Process { child, output }
    }

    fn lines(&self) -> Vec<String> {
        self.output.lock().unwrap().clone()
    }

    /// The address announced in a `<prefix>ADDR` line.
    fn announced(&self, prefix: &str) -> SocketAddr {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(addr) = self
                .lines()
                .iter()
                .find_map(|l| l.strip_prefix(prefix)?.parse().ok())
            {
                return addr;
            }
            assert!(Instant::now() < until, "no `{prefix}` line: {:?}", self.lines());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn emulated_gpu_nodes_run_a_vllm_deployment_as_a_kubelet_would() {
    let Some(client) = cluster().await else { return };
    const NS: &str = "e2e-nodes";
    namespace(&client, NS).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    deployments
        .create(&PostParams::default(), &vllm_deployment("llm", 2))
        .await
        .unwrap();

    // The scheduler placed them on GPU nodes; each has an address of its own that serves.
    let ready = ready_pods(&pods, "llm", 2).await;
    let ips: BTreeSet<IpAddr> = ready.iter().map(pod_ip).collect();
    assert_eq!(ips.len(), 2, "every pod has its own address: {ips:?}");
    for pod in &ready {
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap();
        assert!(node.starts_with("gpu-node-"), "{node}");
        let (status, body) = http(SocketAddr::new(pod_ip(pod), 8000), "GET", "/v1/models", &[], "");
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(MODEL), "{body}");
    }

    // What a cold start is read from: the kubelet's events, and vLLM's log through pods/log.
    let pod = &ready[0];
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let params = ListParams::default().fields(&format!("involvedObject.uid={}", pod.uid().unwrap()));
    let reasons: Vec<String> = events
        .list(&params)
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(|e| e.reason.clone())
        .collect();
    for reason in ["Scheduled", "Pulled", "Created", "Started"] {
        assert!(
            reasons.iter().any(|r| r == reason),
            "no {reason} event: {reasons:?}"
        );
    }
    let log = pods
        .logs(
            &pod.name_any(),
            &LogParams {
                timestamps: true,
                ..LogParams::default()
            },
        )
        .await
        .unwrap();
    assert!(log.contains("Starting vLLM API server"), "{log}");
    let pod_json = coldstart::parse_pod(&serde_json::to_string(pod).unwrap()).unwrap();
    let events_json = json!({"items": events.list(&params).await.unwrap().items});
    let events = coldstart::parse_events(&events_json.to_string()).unwrap();
    let timeline = coldstart::build(&ColdStartInputs {
        pod: &pod_json,
        events: &events,
        log: &log,
        container: Some("vllm"),
        first_token: None,
    });
    for stage in [
        ColdStartStage::Node,
        ColdStartStage::ContainerStart,
        ColdStartStage::WeightLoad,
        ColdStartStage::Ready,
    ] {
        assert!(
            timeline.duration(stage).is_some(),
            "{stage} not timed:\n{}",
            coldstart::render_table(&timeline)
        );
    }

    // A process that dies is restarted as the pod's policy says, and serves again.
    let name = pod.name_any();
    sigkill(container_pid(pod));
    let restarted = eventually(
        Duration::from_secs(60),
        "the killed container restarted",
        || async {
            let pod = pods.get(&name).await.unwrap();
            (restart_count(&pod) == 1 && is_ready(&pod)).then_some(pod)
        },
    )
    .await;
    assert_eq!(
        pod_ip(&restarted),
        pod_ip(pod),
        "a restarted container keeps its pod's address"
    );

    // Deleting the workload stops its processes: their ports refuse.
    deployments.delete("llm", &DeleteParams::default()).await.unwrap();
    eventually(Duration::from_secs(60), "the pods gone", || async {
        pods.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    for ip in ips {
        assert!(TcpStream::connect_timeout(&SocketAddr::new(ip, 8000), Duration::from_secs(1)).is_err());
    }
}

#[tokio::test]
async fn the_operator_as_the_charts_service_account_fails_a_crashed_primary_over_to_its_hot_standby() {
    let Some(client) = cluster().await else { return };
    const NS: &str = "e2e-failover";
    namespace(&client, NS).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for name in ["chat-east", "chat-west"] {
        deployments
            .create(&PostParams::default(), &vllm_deployment(name, 2))
            .await
            .unwrap();
    }
    let east = ready_pods(&pods, "chat-east", 2).await;
    let west = ready_pods(&pods, "chat-west", 2).await;

    // A real router, whose admin API the operator pushes routes to.
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("router-token");
    std::fs::write(&token_file, ADMIN_TOKEN).unwrap();
    let router = Process::start(Command::new(ROUTER).args([
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--admin-token-file",
        token_file.to_str().unwrap(),
    ]));
    let admin = router.announced("understudy-router admin listening on http://");

    let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), NS);
    let policy = serde_json::from_value(json!({
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "FailoverPolicy",
        "metadata": {"name": "chat"},
        "spec": {
            "pools": [
                {"name": "east", "workload": {"kind": "Deployment", "name": "chat-east"}, "replicas": 2},
                {"name": "west", "workload": {"kind": "Deployment", "name": "chat-west"}, "replicas": 2},
            ],
            "recoveryObjective": "1m",
            "probe": {"interval": "1s", "timeout": "800ms", "budgets": {"firstToken": "500ms", "total": "800ms"}},
            "trigger": {"suspectAfter": 1, "promoteAfter": 3, "hardFailure": {"promoteAfter": 2}, "standbyReadyAfter": 2},
        },
    }))
    .unwrap();
    policies.create(&PostParams::default(), &policy).await.unwrap();

    let operator_bin = std::env::var("UNDERSTUDY_CLUSTER_OPERATOR").expect("the operator binary");
    let operator_kubeconfig =
        std::env::var("UNDERSTUDY_CLUSTER_OPERATOR_KUBECONFIG").expect("its kubeconfig");
    let operator = Process::start(
        Command::new(operator_bin)
            .env("KUBECONFIG", &operator_kubeconfig)
            .env("RUST_LOG", "info")
            .args([
                "--identity",
                "e2e-operator-1",
                "--namespace",
                NS,
                "--admin-addr",
                "127.0.0.1:0",
            ])
            .args(["--router-admin", &format!("http://{admin}")])
            .arg("--router-token-file")
            .arg(&token_file),
    );

    // It leads, takes east as the primary at epoch 0, and tells the router.
    let held = |pool: &'static str, epoch: u64| {
        move || async move {
            let (status, body) = http(
                admin,
                "GET",
                "/route",
                &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
                "",
            );
            let holds: serde_json::Value = serde_json::from_str(&body).ok()?;
            (status == 200 && holds["route"]["pool"] == pool && holds["route"]["epoch"] == epoch)
                .then_some(holds)
        }
    };
    let home = eventually(
        Duration::from_secs(60),
        "the router holding east at epoch 0",
        held("east", 0),
    )
    .await;
    let endpoints: BTreeSet<String> = serde_json::from_value(home["route"]["endpoints"].clone()).unwrap();
    let east_endpoints: BTreeSet<String> = east.iter().map(|p| format!("{}:8000", pod_ip(p))).collect();
    assert_eq!(endpoints, east_endpoints);

    // The primary's every process dies; the kubelet's back-off keeps them down for 10 s.
    for pod in &east {
        sigkill(container_pid(pod));
    }
    let routed = eventually(
        Duration::from_secs(60),
        "the router holding west at epoch 1",
        held("west", 1),
    )
    .await;
    let endpoints: BTreeSet<String> = serde_json::from_value(routed["route"]["endpoints"].clone()).unwrap();
    let west_endpoints: BTreeSet<String> = west.iter().map(|p| format!("{}:8000", pod_ip(p))).collect();
    assert_eq!(endpoints, west_endpoints);

    // The epoch Lease moved once, by compare-and-set, and status tells the story.
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let lease = leases.get("chat-epoch").await.unwrap();
    assert_eq!(
        lease.annotations().get(EPOCH_ANNOTATION).map(String::as_str),
        Some("1")
    );
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("west")
    );
    let status = eventually(
        Duration::from_secs(30),
        "status naming west at epoch 1",
        || async {
            let status = policies.get("chat").await.unwrap().status?;
            (status.primary_pool.as_deref() == Some("west") && status.epoch == Some(1)).then_some(status)
        },
    )
    .await;
    let failover = status.last_failover.expect("the last failover's timeline");
    assert_eq!(
        (
            failover.from_pool.as_str(),
            failover.to_pool.as_str(),
            failover.epoch
        ),
        ("east", "west", 1)
    );
    assert!(failover.finished_at.is_some(), "{failover:?}");

    // The chart's ClusterRole was enough: nothing the operator asked for was refused.
    let refused: Vec<String> = operator
        .lines()
        .into_iter()
        .filter(|l| l.contains("forbidden") || l.contains("Forbidden"))
        .collect();
    assert!(refused.is_empty(), "the operator was refused: {refused:#?}");
    drop(operator);
    drop(router);
    policies.delete("chat", &DeleteParams::default()).await.unwrap();
}
