//! What the cluster tier's suites share (`tests/tests/cluster.rs`, `tests/tests/regions.rs`): clients
//! from kubeconfigs, fresh namespaces, the vLLM Deployments the emulated nodes run (with and
//! without a fence in front), polling, signals to a pod's processes, one-shot HTTP, and clients
//! under load that count what they were answered.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::missing_panics_doc)]

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt};
use serde_json::json;
use understudy_api::crd::FailoverPolicy;

pub const MODEL: &str = "Qwen/Qwen3-0.6B";

/// The control token of the fences in [`TwoPools::start_fenced`]'s pods.
pub const FENCE_TOKEN: &str = "cluster-test-fence-token";

/// The port of the fence sidecar in front of each replica, in [`TwoPools::start_fenced`].
pub const FENCE_PORT: u16 = 8001;

pub async fn client_from(path: &std::path::Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// Deletes the namespace `name`, if there is one, and waits until it is gone: its pods deleted
/// and their processes stopped by the emulated kubelet, their GPUs free again. The policies'
/// finalizer is the operator's to take off, so one must be running.
pub async fn delete_namespace(client: &Client, name: &str) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let _ = namespaces.delete(name, &DeleteParams::default()).await;
    let until = Instant::now() + Duration::from_secs(60);
    while namespaces.get_opt(name).await.unwrap().is_some() {
        assert!(Instant::now() < until, "namespace {name} is still being deleted");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A fresh namespace named `name`. One left by an earlier run that failed is deleted first,
/// with the finalizers of its policies taken off, as no operator serves them now. (A region's
/// cluster, which has no CRDs, has no policies.)
pub async fn namespace(client: &Client, name: &str) {
    let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), name);
    let listed = match policies.list(&ListParams::default()).await {
        Ok(listed) => listed.items,
        Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
        Err(error) => panic!("listing the policies of {name}: {error}"),
    };
    for policy in listed {
        let unfinalized = json!({"metadata": {"finalizers": null}});
        policies
            .patch(
                &policy.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&unfinalized),
            )
            .await
            .unwrap();
    }
    delete_namespace(client, name).await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let until = Instant::now() + Duration::from_secs(60);
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

/// `deployment` with its vLLM container serving `model` (`--served-model-name`): a router routes
/// each model by one policy.
pub fn serving_model(deployment: Deployment, model: &str) -> Deployment {
    let mut deployment = serde_json::to_value(deployment).unwrap();
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array_mut()
        .unwrap()
        .extend([json!("--served-model-name"), json!(model)]);
    serde_json::from_value(deployment).unwrap()
}

/// A Deployment of `replicas` vLLM servers, each on one GPU, ready when `/health` answers.
pub fn vllm_deployment(name: &str, replicas: u32) -> Deployment {
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
                        "image": "vllm/vllm-openai:v0.32.0",
                        "command": ["vllm", "serve"],
                        "args": [MODEL, "--port", "8000", "--max-model-len", "4096", "--enable-sleep-mode"],
                        // Sleep mode's routes, for a warm standby's replicas.
                        "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}],
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

/// [`vllm_deployment`] with the fence sidecar in front of vLLM, as `examples/pools/chat.yaml`
/// runs a pool: vLLM listens on the pod's loopback, and the fence, the one door to it, serves on
/// [`FENCE_PORT`] as `pool` under the operator's grants, and takes grants and control calls with
/// the token in Secret `chat-fence` ([`fence_access`]). It has no Kubernetes credentials.
pub fn fenced_deployment(name: &str, replicas: u32, pool: &str) -> Deployment {
    let mut deployment = serde_json::to_value(vllm_deployment(name, replicas)).unwrap();
    let spec = &mut deployment["spec"]["template"]["spec"];
    spec["automountServiceAccountToken"] = false.into();
    let vllm = &mut spec["containers"][0];
    vllm["args"]
        .as_array_mut()
        .unwrap()
        .extend([json!("--host"), json!("127.0.0.1")]);
    vllm["readinessProbe"]["httpGet"]["port"] = FENCE_PORT.into();
    spec["containers"].as_array_mut().unwrap().push(json!({
        "name": "fence",
        "image": "ghcr.io/understudy-dev/understudy-router:test",
        "command": ["understudy-router", "fence"],
        "args": ["--listen", "0.0.0.0:8001", "--upstream", "127.0.0.1:8000", "--pool", pool, "--grants"],
        "env": [
            {"name": "UNDERSTUDY_CONTROL_TOKEN",
             "valueFrom": {"secretKeyRef": {"name": "chat-fence", "key": "token"}}},
        ],
        "ports": [{"name": "fence", "containerPort": FENCE_PORT}],
    }));
    serde_json::from_value(deployment).unwrap()
}

/// What the fences of `ns` need: the Secret holding their control token, which the operator's
/// grants and control calls carry. Nothing else: they read nothing from the API server.
pub async fn fence_access(client: &Client, ns: &str) {
    use k8s_openapi::api::core::v1::Secret;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "chat-fence"}, "stringData": {"token": FENCE_TOKEN},
    }))
    .unwrap();
    Api::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

/// Polls `check` every quarter second until it gives a value, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
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

pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pods of `app`, once `count` of them are Ready, waiting up to `limit`.
pub async fn ready_pods_within(pods: &Api<Pod>, app: &str, count: usize, limit: Duration) -> Vec<Pod> {
    let params = ListParams::default().labels(&format!("app={app}"));
    eventually(limit, &format!("{count} ready pod(s) of {app}"), || async {
        let list = pods.list(&params).await.unwrap().items;
        let ready: Vec<Pod> = list.into_iter().filter(is_ready).collect();
        (ready.len() == count).then_some(ready)
    })
    .await
}

pub fn pod_ip(pod: &Pod) -> IpAddr {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .unwrap()
        .parse()
        .unwrap()
}

/// The process behind a pod's first container: the emulated kubelet writes its id as the
/// container id.
pub fn container_pid(pod: &Pod) -> u32 {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .unwrap();
    let id = statuses[0].container_id.as_deref().unwrap();
    id.strip_prefix("emulated://").unwrap().parse().unwrap()
}

/// The process behind each of a pod's containers that has one now, as [`container_pid`] reads
/// the first.
pub fn container_pids(pod: &Pod) -> Vec<u32> {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    statuses
        .into_iter()
        .flatten()
        .filter_map(|status| {
            status
                .container_id
                .as_deref()?
                .strip_prefix("emulated://")?
                .parse()
                .ok()
        })
        .collect()
}

pub fn sigkill(pid: u32) {
    let status = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -KILL {pid}");
}

/// SIGKILL to the process group `pid` leads: each emulated container is one.
pub fn sigkill_group(pid: u32) {
    let status = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .status()
        .unwrap();
    assert!(status.success(), "kill -KILL -- -{pid}");
}

/// One HTTP/1.1 request on a fresh connection; the status and the body.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let raw = exchange(addr, method, path, headers, body).unwrap();
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status_of(&raw), body)
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`), connecting within 5 s and
/// answered within 10; the answer as read, head and body.
pub fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(request.as_bytes())?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    Ok(raw)
}

/// The status of an answer [`exchange`] read; 0 when it has none.
pub fn status_of(raw: &str) -> u16 {
    raw.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Clients of the router's gateway: one completion every 100 ms (at most 1200) until stopped,
/// each given up after 10 s; how many were answered 200.
#[derive(Debug)]
pub struct Clients {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(usize, usize)>,
}

impl Clients {
    pub fn start(gateway: SocketAddr) -> Clients {
        Self::start_for(gateway, MODEL)
    }

    /// Clients asking for `model`.
    pub fn start_for(gateway: SocketAddr, model: &'static str) -> Clients {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let body =
                json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4}).to_string();
            let (mut sent, mut answered) = (0, 0);
            for _ in 0..1200 {
                if stopping.load(Ordering::Relaxed) {
                    break;
                }
                sent += 1;
                let request = format!(
                    "POST /v1/completions HTTP/1.1\r\nHost: {gateway}\r\nConnection: close\r\n\
                     Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                let answer =
                    TcpStream::connect_timeout(&gateway, Duration::from_secs(2)).and_then(|mut stream| {
                        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
                        stream.write_all(request.as_bytes())?;
                        let mut raw = String::new();
                        stream.read_to_string(&mut raw)?;
                        Ok(raw)
                    });
                if answer.is_ok_and(|raw| raw.starts_with("HTTP/1.1 200")) {
                    answered += 1;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            (sent, answered)
        });
        Clients { stop, thread }
    }

    /// How many requests were answered 200.
    pub fn stop(self) -> usize {
        self.stop_counting().1
    }

    /// How many requests were sent, and how many of them were answered 200.
    pub fn stop_counting(self) -> (usize, usize) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// The grants of `pods`' fences once each is on its failsafe and has extended its own grant at
/// least `times` times, within a minute.
pub async fn extended_on_failsafe(pods: &[Pod], times: u64) -> Vec<serde_json::Value> {
    eventually(
        Duration::from_secs(60),
        "the fences extending their own grants",
        || async {
            let views = fence_grants(pods);
            views
                .iter()
                .all(|v| v["standing"] == "failsafe" && v["extended"].as_u64() >= Some(times))
                .then_some(views)
        },
    )
    .await
}

/// The grant each of `pods`' fences holds, as it answers anyone.
pub fn fence_grants(pods: &[Pod]) -> Vec<serde_json::Value> {
    pods.iter()
        .map(|pod| {
            let fence = SocketAddr::new(pod_ip(pod), FENCE_PORT);
            let (status, body) = http(fence, "GET", "/understudy/grant", &[], "");
            assert_eq!(status, 200, "{body}");
            serde_json::from_str(&body).unwrap()
        })
        .collect()
}
