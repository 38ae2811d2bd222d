//! One pod on an emulated node, from its binding to its removal: its address, the kubelet's
//! events, a process per container, restarts, readiness probes, status, and the stop.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Container, Event, ObjectReference, Pod, Probe, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Kubelet;
use super::containers::{self, Image, Log, StartError};
use super::node::MANAGER;

/// The longest restart back-off, as the kubelet's.
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// How often due readiness probes are looked for.
const PROBE_TICK: Duration = Duration::from_millis(200);

/// A running pod's task, fed the pod's latest version by the watch.
#[derive(Debug)]
pub struct Handle {
    pod: watch::Sender<Pod>,
    task: JoinHandle<()>,
}

impl Handle {
    pub fn start(kubelet: Arc<Kubelet>, pod: Pod, node: String) -> Handle {
        let (sender, receiver) = watch::channel(pod);
        let task = tokio::spawn(async move {
            let name = receiver.borrow().name_any();
            if let Err(error) = PodRun::new(kubelet, receiver, node).await.run().await {
                tracing::warn!(pod = %name, %error, "an emulated pod stopped");
            }
        });
        Handle { pod: sender, task }
    }

    /// Hands the task the pod's latest version (a deletion starts the stop).
    pub fn update(&self, pod: &Pod) {
        self.pod.send_replace(pod.clone());
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// Deletes `pod` for good, as the kubelet does once its containers are stopped: no grace left,
/// and only this pod (its uid), never a new one of the same name.
pub async fn remove(client: Client, pod: Pod) {
    let api: Api<Pod> = Api::namespaced(client, &pod.namespace().unwrap_or_default());
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    if let Err(error) = api.delete(&pod.name_any(), &params).await {
        tracing::debug!(pod = %pod.name_any(), %error, "removing a stopped pod");
    }
}

/// A container's last run that ended.
#[derive(Debug, Clone)]
struct Terminated {
    exit_code: i32,
    reason: &'static str,
    started: Option<Timestamp>,
    finished: Timestamp,
}

/// How a container's readiness probe stands.
#[derive(Debug, Default)]
struct Readiness {
    ready: bool,
    next: Option<Instant>,
    failures: i32,
    successes: i32,
}

/// One container of the pod, across its restarts.
#[derive(Debug)]
struct ContainerRun {
    spec: Container,
    image: Image,
    log: Arc<Log>,
    /// The running process's id and the switch that kills it (dropped: killed).
    pid: Option<u32>,
    kill: Option<oneshot::Sender<()>>,
    /// Counts the container's instances, so that a late exit of an old one is ignored.
    instance: u32,
    started_at: Option<Timestamp>,
    restarts: i32,
    last: Option<Terminated>,
    waiting: Option<(&'static str, String)>,
    restart_at: Option<Instant>,
    backoff: Duration,
    readiness: Readiness,
}

impl ContainerRun {
    fn running(&self) -> bool {
        self.started_at.is_some() && self.waiting.is_none()
    }

    fn ready(&self) -> bool {
        self.running()
            && match &self.spec.readiness_probe {
                Some(_) => self.readiness.ready,
                None => true,
            }
    }

    fn status(&self) -> serde_json::Value {
        let state = match (&self.waiting, self.started_at) {
            (Some((reason, message)), _) => json!({"waiting": {"reason": reason, "message": message}}),
            (None, Some(started)) => json!({"running": {"startedAt": started}}),
            (None, None) => json!({"waiting": {"reason": "ContainerCreating"}}),
        };
        let last = self.last.as_ref().map_or(json!({}), |t| {
            json!({"terminated": {
                "exitCode": t.exit_code, "reason": t.reason,
                "startedAt": t.started, "finishedAt": t.finished,
            }})
        });
        json!({
            "name": self.spec.name,
            "image": self.spec.image.clone().unwrap_or_default(),
            "imageID": format!("emulated://{}", self.spec.image.clone().unwrap_or_default()),
            // The process id, so that a test can find the process behind a container.
            "containerID": self.pid.map(|pid| format!("emulated://{pid}")),
            "ready": self.ready(),
            "started": self.running(),
            "restartCount": self.restarts,
            "state": state,
            "lastState": last,
        })
    }
}

/// A process ended: its container's index, the container's instance, and its exit code.
type Exit = (usize, u32, i32);

/// Why a pod's run ended early.
#[derive(Debug, thiserror::Error)]
enum RunError {
    #[error("writing its status: {0}")]
    Status(kube::Error),
    #[error("its files: {0}")]
    Files(#[from] std::io::Error),
}

/// A pod as this kubelet runs it.
struct PodRun {
    kubelet: Arc<Kubelet>,
    updates: watch::Receiver<Pod>,
    pod: Pod,
    node: String,
    ip: Ipv4Addr,
    dir: PathBuf,
    containers: Vec<ContainerRun>,
    exits: (mpsc::UnboundedSender<Exit>, mpsc::UnboundedReceiver<Exit>),
    started: Timestamp,
    reported: Option<serde_json::Value>,
}

impl PodRun {
    async fn new(kubelet: Arc<Kubelet>, updates: watch::Receiver<Pod>, node: String) -> PodRun {
        let pod = updates.borrow().clone();
        let ip = kubelet.addresses.take();
        let dir = kubelet.config.work_dir.join(format!(
            "{}_{}_{}",
            pod.namespace().unwrap_or_default(),
            pod.name_any(),
            pod.uid().unwrap_or_default()
        ));
        PodRun {
            kubelet,
            updates,
            pod,
            node,
            ip,
            dir,
            containers: Vec::new(),
            exits: mpsc::unbounded_channel(),
            started: Timestamp::now(),
            reported: None,
        }
    }

    fn namespace(&self) -> String {
        self.pod.namespace().unwrap_or_default()
    }

    async fn run(mut self) -> Result<(), RunError> {
        tokio::fs::create_dir_all(&self.dir).await?;
        let specs = self
            .pod
            .spec
            .as_ref()
            .map(|s| s.containers.clone())
            .unwrap_or_default();
        for spec in specs {
            let log = Log::create(self.dir.join(format!("{}.log", spec.name))).await?;
            self.kubelet
                .logs
                .insert(&self.namespace(), &self.pod.name_any(), &spec.name, log.clone());
            self.containers.push(ContainerRun {
                image: Image::of(spec.image.as_deref().unwrap_or_default()),
                spec,
                log,
                pid: None,
                kill: None,
                instance: 0,
                started_at: None,
                restarts: 0,
                last: None,
                waiting: None,
                restart_at: None,
                backoff: self.kubelet.config.restart_backoff,
                readiness: Readiness::default(),
            });
        }
        self.report().await?;
        for index in 0..self.containers.len() {
            if self.deleting() {
                break;
            }
            self.pull(index).await;
            self.start(index).await;
            self.report().await?;
        }
        self.serve().await?;
        self.stop().await;
        Ok(())
    }

    fn deleting(&self) -> bool {
        self.updates.borrow().metadata.deletion_timestamp.is_some()
    }

    /// Runs until the pod is deleted (or the watch lets it go): restarts what dies, probes
    /// readiness, reports what changed.
    async fn serve(&mut self) -> Result<(), RunError> {
        let mut tick = tokio::time::interval(PROBE_TICK);
        loop {
            tokio::select! {
                changed = self.updates.changed() => {
                    if changed.is_err() || self.deleting() {
                        return Ok(());
                    }
                }
                Some((index, instance, code)) = self.exits.1.recv() => self.exited(index, instance, code).await,
                _ = tick.tick() => {
                    let now = Instant::now();
                    for index in 0..self.containers.len() {
                        if self.containers[index].restart_at.is_some_and(|at| at <= now) {
                            self.containers[index].restart_at = None;
                            self.start(index).await;
                        }
                        self.probe(index, now).await;
                    }
                }
            }
            self.report().await?;
        }
    }

    /// The image, pulled once per node: the kubelet's Pulling and Pulled events, with the pull's
    /// own duration in Go's notation, or "already present".
    async fn pull(&mut self, index: usize) {
        let container = &self.containers[index].spec;
        let image = container.image.clone().unwrap_or_default();
        let name = container.name.clone();
        if self.kubelet.pull(&self.node, &image) {
            let message = format!("Container image {image:?} already present on machine");
            self.event(&name, "Pulled", &message).await;
            return;
        }
        self.event(&name, "Pulling", &format!("Pulling image {image:?}"))
            .await;
        let began = Instant::now();
        tokio::time::sleep(self.kubelet.config.pull_time).await;
        let took = go_duration(began.elapsed());
        let message = format!(
            "Successfully pulled image {image:?} in {took} ({took} including waiting). Image size: {} bytes.",
            1_000_000 + image.len()
        );
        self.event(&name, "Pulled", &message).await;
    }

    /// Creates and starts container `index` as its program; a start that fails waits out the
    /// back-off and is tried again.
    async fn start(&mut self, index: usize) {
        let name = self.containers[index].spec.name.clone();
        match self.spawn(index).await {
            Ok(()) => {
                self.event(&name, "Created", &format!("Created container: {name}"))
                    .await;
                self.event(&name, "Started", &format!("Started container {name}"))
                    .await;
            }
            Err(error) => {
                let message = error.to_string();
                self.event(&name, "Failed", &format!("Error: {message}")).await;
                let container = &mut self.containers[index];
                container.waiting = Some(("CreateContainerError", message));
                container.restart_at = Some(Instant::now() + container.backoff);
                container.backoff = (container.backoff * 2).min(MAX_BACKOFF);
            }
        }
    }

    async fn spawn(&mut self, index: usize) -> Result<(), StartError> {
        let client = self.kubelet.client.clone();
        let (image, spec) = (self.containers[index].image, self.containers[index].spec.clone());
        let mut env = containers::environment(&client, &self.pod, self.ip, &spec).await?;
        let program = match image {
            Image::Inert => None,
            Image::Vllm => Some(self.kubelet.config.programs.vllm.clone()),
            Image::VllmCpu => {
                let program = self.kubelet.config.programs.vllm_cpu.clone();
                Some(program.ok_or_else(|| StartError::NoProgram(spec.image.clone().unwrap_or_default()))?)
            }
            Image::Understudy(binary) => {
                let program = self.kubelet.config.programs.understudy.get(&binary).cloned();
                let program =
                    program.ok_or_else(|| StartError::NoProgram(spec.image.clone().unwrap_or_default()))?;
                env.insert("KUBECONFIG".to_owned(), self.service_account_kubeconfig().await?);
                Some(program)
            }
        };
        let container = &mut self.containers[index];
        container.instance += 1;
        if container.restarts > 0 || container.instance > 1 {
            container
                .log
                .restart()
                .await
                .map_err(|e| StartError::Env(e.to_string()))?;
        }
        if let Some(program) = program {
            let mounts = containers::mounts(&client, &self.pod, &self.dir, &spec).await?;
            let argv: Vec<String> = containers::argv(image, &spec, self.ip)
                .iter()
                .map(|word| containers::on_mounts(word, &mounts))
                .collect();
            for value in env.values_mut() {
                *value = containers::on_mounts(value, &mounts);
            }
            let mut child = containers::spawn(&program, &argv, &env, &self.dir, &container.log)?;
            container.pid = child.id();
            let (kill, killed) = oneshot::channel::<()>();
            container.kill = Some(kill);
            let (exits, instance) = (self.exits.0.clone(), container.instance);
            let pid = child.id();
            // Dropped with the task, as when the nodes stop: the container's whole group goes
            // with its first process (a real vLLM server's engine core and worker).
            let group = pid.map(containers::GroupGuard);
            tokio::spawn(async move {
                let _group = group;
                tokio::select! {
                    status = child.wait() => {
                        // Killed by a signal: 128 + its number, as a container runtime reports.
                        let code = status.ok().map_or(-1, |s| {
                            use std::os::unix::process::ExitStatusExt;
                            s.code().or_else(|| s.signal().map(|n| 128 + n)).unwrap_or(-1)
                        });
                        let _ = exits.send((index, instance, code));
                    }
                    _ = killed => {
                        if let Some(pid) = pid {
                            containers::kill_group(pid).await;
                        }
                        let _ = child.kill().await;
                    }
                }
            });
        }
        container.started_at = Some(Timestamp::now());
        container.waiting = None;
        container.readiness = Readiness {
            next: Some(Instant::now() + initial_delay(container.spec.readiness_probe.as_ref())),
            ..Readiness::default()
        };
        Ok(())
    }

    /// A kubeconfig with a token of the pod's service account, bound to the pod, in place of the
    /// token a real kubelet mounts: the understudy container reaches the API server as the pod
    /// would, with no more rights than its service account has.
    async fn service_account_kubeconfig(&self) -> Result<String, StartError> {
        let account = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".to_owned());
        let accounts: Api<ServiceAccount> = Api::namespaced(self.kubelet.client.clone(), &self.namespace());
        let request = TokenRequest {
            metadata: ObjectMeta::default(),
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                expiration_seconds: Some(3600),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".to_owned()),
                    kind: Some("Pod".to_owned()),
                    name: Some(self.pod.name_any()),
                    uid: self.pod.uid(),
                }),
            },
            status: None,
        };
        let token: TokenRequest = accounts
            .create_subresource("token", &account, &PostParams::default(), &request)
            .await
            .map_err(|e| StartError::Env(format!("a token for service account {account}: {e}")))?;
        let token = token.status.map(|s| s.token).unwrap_or_default();
        let config = &self.kubelet.config;
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: {:?}, certificate-authority: {:?}}}}}]\n\
             users: [{{name: u, user: {{token: {token:?}}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: u, namespace: {:?}}}}}]\n\
             current-context: c\n",
            config.api_server,
            config.api_ca.display().to_string(),
            self.namespace(),
        );
        let path = self.dir.join("kubeconfig");
        tokio::fs::write(&path, kubeconfig)
            .await
            .map_err(|e| StartError::Env(e.to_string()))?;
        Ok(path.display().to_string())
    }

    /// A process ended: the container terminated, and restarts after its back-off if the pod's
    /// restart policy says so.
    async fn exited(&mut self, index: usize, instance: u32, code: i32) {
        let policy = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".to_owned());
        let container = &mut self.containers[index];
        if container.instance != instance {
            return;
        }
        container.last = Some(Terminated {
            exit_code: code,
            reason: if code == 0 { "Completed" } else { "Error" },
            started: container.started_at,
            finished: Timestamp::now(),
        });
        container.pid = None;
        container.kill = None;
        container.started_at = None;
        container.readiness = Readiness::default();
        let restart = policy == "Always" || (policy == "OnFailure" && code != 0);
        if restart {
            container.restarts += 1;
            let message = format!(
                "back-off {} restarting failed container={} pod={}",
                go_duration(container.backoff),
                container.spec.name,
                self.pod.name_any()
            );
            container.waiting = Some(("CrashLoopBackOff", message.clone()));
            container.restart_at = Some(Instant::now() + container.backoff);
            container.backoff = (container.backoff * 2).min(MAX_BACKOFF);
            let name = container.spec.name.clone();
            self.event(&name, "BackOff", &message).await;
        } else {
            container.waiting = Some(("Completed", format!("exit code {code}")));
        }
    }

    /// Runs container `index`'s readiness probe if it is due.
    async fn probe(&mut self, index: usize, now: Instant) {
        let ip = self.ip;
        let container = &mut self.containers[index];
        let Some(probe) = container.spec.readiness_probe.clone() else {
            return;
        };
        if !container.running() || container.readiness.next.is_none_or(|next| next > now) {
            return;
        }
        let period = Duration::from_secs(probe.period_seconds.unwrap_or(10).max(1).unsigned_abs().into());
        container.readiness.next = Some(now + period);
        let passed = check(&probe, &container.spec, ip).await;
        let readiness = &mut container.readiness;
        if passed {
            readiness.failures = 0;
            readiness.successes += 1;
            if readiness.successes >= probe.success_threshold.unwrap_or(1) {
                readiness.ready = true;
            }
        } else {
            readiness.successes = 0;
            readiness.failures += 1;
            if readiness.failures >= probe.failure_threshold.unwrap_or(3) {
                readiness.ready = false;
            }
        }
    }

    /// The pod's status as it stands; written when it changed.
    async fn report(&mut self) -> Result<(), RunError> {
        let ready = !self.containers.is_empty() && self.containers.iter().all(ContainerRun::ready);
        let any_running = self.containers.iter().any(ContainerRun::running);
        let since = self.started;
        let condition = |kind: &str, status: bool| json!({"type": kind, "status": if status { "True" } else { "False" }, "lastTransitionTime": since});
        let status = json!({
            "phase": if any_running || self.containers.iter().any(|c| c.restarts > 0) { "Running" } else { "Pending" },
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip.to_string(),
            "podIPs": [{"ip": self.ip.to_string()}],
            "startTime": since,
            "conditions": [
                condition("PodReadyToStartContainers", true),
                condition("Initialized", true),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ],
            "containerStatuses": self.containers.iter().map(ContainerRun::status).collect::<Vec<_>>(),
        });
        if self.reported.as_ref() == Some(&status) {
            return Ok(());
        }
        let api: Api<Pod> = Api::namespaced(self.kubelet.client.clone(), &self.namespace());
        let patch = json!({"apiVersion": "v1", "kind": "Pod", "status": status});
        match api
            .patch_status(
                &self.pod.name_any(),
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => {
                self.reported = Some(status);
                Ok(())
            }
            // Gone already: the stop follows from the watch.
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(error) => Err(RunError::Status(error)),
        }
    }

    /// Stops every container as the kubelet stops a deleted pod: a Killing event and SIGTERM,
    /// SIGKILL for what is still running after the grace period, then the pod is removed.
    async fn stop(&mut self) {
        let pod = self.updates.borrow().clone();
        let grace = pod
            .metadata
            .deletion_grace_period_seconds
            .unwrap_or(30)
            .max(0)
            .unsigned_abs();
        for index in 0..self.containers.len() {
            let (name, pid) = (
                self.containers[index].spec.name.clone(),
                self.containers[index].pid,
            );
            if let Some(pid) = pid {
                self.event(&name, "Killing", &format!("Stopping container {name}"))
                    .await;
                containers::terminate(pid).await;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(grace);
        while self.containers.iter().any(|c| c.pid.is_some()) {
            match tokio::time::timeout_at(deadline, self.exits.1.recv()).await {
                Ok(Some((index, instance, _))) if self.containers[index].instance == instance => {
                    self.containers[index].pid = None;
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        // Dropping the switches kills whatever is left.
        for container in &mut self.containers {
            container.kill = None;
        }
        self.kubelet
            .logs
            .remove_pod(&self.namespace(), &self.pod.name_any());
        remove(self.kubelet.client.clone(), pod).await;
    }

    /// Posts a kubelet event about container `container` of this pod.
    async fn event(&self, container: &str, reason: &str, message: &str) {
        let now = Time(Timestamp::now());
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", self.pod.name_any())),
                namespace: Some(self.namespace()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: Some(self.pod.name_any()),
                namespace: Some(self.namespace()),
                uid: self.pod.uid(),
                field_path: Some(format!("spec.containers{{{container}}}")),
                ..ObjectReference::default()
            },
            reason: Some(reason.to_owned()),
            message: Some(message.to_owned()),
            type_: Some(
                if matches!(reason, "BackOff" | "Failed") {
                    "Warning"
                } else {
                    "Normal"
                }
                .to_owned(),
            ),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            source: Some(k8s_openapi::api::core::v1::EventSource {
                component: Some("kubelet".to_owned()),
                host: Some(self.node.clone()),
            }),
            reporting_component: Some("kubelet".to_owned()),
            reporting_instance: Some(self.node.clone()),
            ..Event::default()
        };
        let events: Api<Event> = Api::namespaced(self.kubelet.client.clone(), &self.namespace());
        if let Err(error) = events.create(&PostParams::default(), &event).await {
            tracing::debug!(%error, reason, "posting an event");
        }
    }
}

fn initial_delay(probe: Option<&Probe>) -> Duration {
    let seconds = probe.and_then(|p| p.initial_delay_seconds).unwrap_or(0).max(0);
    Duration::from_secs(seconds.unsigned_abs().into())
}

/// The port a probe names, by number or by the container's port name.
fn probe_port(port: &IntOrString, container: &Container) -> Option<u16> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).ok(),
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| u16::try_from(p.container_port).ok()),
    }
}

/// One try of a readiness probe: an HTTP GET answered 200 to 399, or a TCP connection taken,
/// within the probe's timeout. Exec and gRPC probes are not emulated and pass.
async fn check(probe: &Probe, container: &Container, ip: Ipv4Addr) -> bool {
    let timeout = Duration::from_secs(probe.timeout_seconds.unwrap_or(1).max(1).unsigned_abs().into());
    let attempt = async {
        if let Some(get) = &probe.http_get {
            let port = probe_port(&get.port, container)?;
            let path = get.path.clone().unwrap_or_else(|| "/".to_owned());
            let mut stream = tokio::net::TcpStream::connect((ip, port)).await.ok()?;
            let request = format!(
                "GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nUser-Agent: kube-probe/1.36\r\nConnection: close\r\n\r\n"
            );
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut head = [0u8; 16];
            let mut read = 0;
            while read < 12 {
                let n = stream.read(&mut head[read..]).await.ok()?;
                if n == 0 {
                    return None;
                }
                read += n;
            }
            let code: u16 = std::str::from_utf8(&head[9..12]).ok()?.parse().ok()?;
            return Some((200..400).contains(&code));
        }
        if let Some(tcp) = &probe.tcp_socket {
            let port = probe_port(&tcp.port, container)?;
            return Some(tokio::net::TcpStream::connect((ip, port)).await.is_ok());
        }
        Some(true)
    };
    matches!(tokio::time::timeout(timeout, attempt).await, Ok(Some(true)))
}

/// A duration as Go's `time.Duration.String()` writes it after `Truncate(time.Millisecond)`:
/// `850ms`, `1.5s`, `1m2.5s`.
fn go_duration(duration: Duration) -> String {
    let ms = duration.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (minutes, ms) = (ms / 60_000, ms % 60_000);
    let seconds = format!("{}.{:03}", ms / 1000, ms % 1000);
    let seconds = seconds.trim_end_matches('0').trim_end_matches('.');
    if minutes == 0 {
        format!("{seconds}s")
    } else {
        format!("{minutes}m{seconds}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_the_kubelet_writes_them() {
        assert_eq!(go_duration(Duration::from_millis(850)), "850ms");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(Duration::from_millis(2000)), "2s");
        assert_eq!(go_duration(Duration::from_millis(62_500)), "1m2.5s");
        assert_eq!(go_duration(Duration::from_micros(1_234_567)), "1.234s");
    }
}
