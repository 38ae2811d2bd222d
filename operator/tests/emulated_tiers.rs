//! Each standby tier's path through a failover, call by call: the operator's real reconcile, in
//! a loop as its controller runs it, against a fake API server that keeps the objects it is given
//! (the epoch Lease, the workloads and their scale, the GPU reserves, the policy's status) and
//! emulated vLLM replicas on loopback, each behind a proxy that writes down every call that
//! changes or tests a replica. The routers and fences are a step executor that writes down what
//! it is asked. One journal holds all of it in the order it happened, so a test states the exact
//! calls of a path: the standby kept in its shape, the Lease moved, the old primary fenced, the
//! new one woken or grown, probed, routed, and the old primary put into its standby shape after;
//! and a standby that drifts from the primary neither put to sleep nor switched to.
//!
//! Reads (GETs of the API server, `GET /is_sleeping`) change nothing and repeat every reconcile,
//! so they are answered and not written down. A pool's replicas become ready one per reconcile
//! after a scale-up, as pods do; the ready ones are what the operator reaches.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../prober/tests/emulated/mod.rs"]
mod prober_support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::ObjectRef;
use prober_support::Emulator;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use understudy_core::Epoch;
use understudy_core::Pool;
use understudy_core::failover::{CheckResult, FailoverState};
use understudy_operator::controller::{Context, OperatorRecord, reconcile};
use understudy_operator::crd::{FailoverPolicy, GoldenAnswer, ParityDrift, ParityStatus, PoolSpec};
use understudy_operator::metrics::Metrics;
use understudy_operator::ports::{
    Clock, Observation, ObservationSource, ProbeFindings, StepExecutor, StepReport, StepRequest,
};
use understudy_operator::ports::{ReplicaEndpoints, ResolveError};
use understudy_operator::reconciler::WithShell;
use understudy_prober::probe::Endpoint;

const NS: &str = "serving";
const UID: &str = "7b0c2d1e-3f4a-4b5c-8d6e-9f0a1b2c3d4e";
const DEV_MODE: &[(&str, &str)] = &[("VLLM_SERVER_DEV_MODE", "1")];
/// 2026-01-05T09:00:00Z
const START: Duration = Duration::from_secs(1_767_603_600);

/// Everything that happened, in order.
#[derive(Clone, Debug, Default)]
struct Journal(Arc<Mutex<Vec<String>>>);

impl Journal {
    fn push(&self, entry: String) {
        self.0.lock().unwrap().push(entry);
    }

    fn entries(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// A replica's calls beside everything that is not a replica's: the exact order one replica saw
/// against the Lease, the workloads and the routers. (Replicas of a pool are called at once, so
/// their calls interleave in no fixed order among themselves.)
fn as_seen_by(journal: &[String], replica: &str) -> Vec<String> {
    journal
        .iter()
        .filter(|e| !is_replica_call(e) || e.starts_with(&format!("{replica} ")))
        .cloned()
        .collect()
}

fn is_replica_call(entry: &str) -> bool {
    entry.starts_with("east-") || entry.starts_with("west-")
}

fn without_replicas(journal: &[String]) -> Vec<String> {
    journal.iter().filter(|e| !is_replica_call(e)).cloned().collect()
}

/// Forwards every connection on `listener` to `upstream`, writing down its request line first
/// as `label`'s call. The operator opens a fresh connection per call, so the first request line
/// is the call.
fn recording_proxy(listener: TcpListener, label: String, upstream: u16, journal: Journal) {
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let (label, journal) = (label.clone(), journal.clone());
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n") && head.len() < 4096 {
                    if client.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let line = String::from_utf8_lossy(&head);
                let mut words = line.split_whitespace();
                let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
                if method != "GET" {
                    let call = match target {
                        "/v1/completions" | "/v1/chat/completions" => "probe".to_owned(),
                        other => format!("{method} {other}"),
                    };
                    journal.push(format!("{label} {call}"));
                }
                let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                if server.write_all(&head).await.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
}

/// One pool's emulated replicas, each behind its recording proxy, named `pool-0`, `pool-1`… in
/// address order, the order the operator sorts them in.
struct Replicas {
    _emulators: Vec<Emulator>,
    endpoints: Vec<Endpoint>,
}

async fn replicas(pool: &str, count: usize, journal: &Journal) -> Replicas {
    let emulators: Vec<Emulator> = (0..count)
        .map(|_| Emulator::ready(&["--enable-sleep-mode"], DEV_MODE))
        .collect();
    let mut listeners = Vec::new();
    for _ in 0..count {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listeners.push((listener.local_addr().unwrap().to_string(), listener));
    }
    listeners.sort_by(|a, b| a.0.cmp(&b.0));
    let mut endpoints = Vec::new();
    for (i, ((_, listener), emulator)) in listeners.into_iter().zip(&emulators).enumerate() {
        endpoints.push(Endpoint::new("127.0.0.1", listener.local_addr().unwrap().port()));
        recording_proxy(
            listener,
            format!("{pool}-{i}"),
            emulator.endpoint.port,
            journal.clone(),
        );
    }
    Replicas {
        _emulators: emulators,
        endpoints,
    }
}

/// What the fake API server keeps.
#[derive(Debug)]
struct Objects {
    lease_holder: String,
    lease_epoch: u64,
    lease_version: u64,
    policy: Value,
    /// Workloads and reserves by name.
    deployments: BTreeMap<String, Value>,
    /// Each workload's ready replicas.
    ready: BTreeMap<String, u32>,
    /// Requests no rule answers.
    surprises: Vec<String>,
    /// A workload whose scale may not be raised (a quota, RBAC): each try is refused with a 403.
    cannot_grow: Option<String>,
}

type Shared = Arc<Mutex<Objects>>;

fn workload(name: &str, replicas: u32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"), "resourceVersion": "1"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                    "resources": {"limits": {"nvidia.com/gpu": "2"}},
                }]},
            },
        },
    })
}

fn spec_replicas(object: &Value) -> u32 {
    u32::try_from(object["spec"]["replicas"].as_u64().unwrap_or(0)).unwrap()
}

fn lease_object(objects: &Objects) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {
            "name": "llama-epoch", "namespace": NS,
            "resourceVersion": objects.lease_version.to_string(),
            "annotations": {"understudy.dev/epoch": objects.lease_epoch.to_string()},
        },
        "spec": {"holderIdentity": objects.lease_holder, "leaseTransitions": objects.lease_epoch},
    })
}

fn not_found(what: &str) -> (u16, Value) {
    let status = json!({
        "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 404,
        "reason": "NotFound", "message": format!("{what} not found"), "metadata": {},
    });
    (404, status)
}

fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%' && i + 2 < bytes.len())
            .then(|| u8::from_str_radix(&text[i + 1..i + 3], 16).ok())
            .flatten();
        if let Some(b) = escaped {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

/// Whether `object`'s labels hold every `key=value` of the query's label selector.
fn selected(object: &Value, query: &str) -> bool {
    let selector = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("labelSelector="))
        .map(percent_decoded)
        .unwrap_or_default();
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        let (key, value) = term.split_once('=').unwrap();
        object["metadata"]["labels"][key].as_str() == Some(value)
    })
}

/// Answers one request from `objects`, writing down in `journal` what it changed.
fn answer(
    objects: &mut Objects,
    journal: &Journal,
    method: &str,
    path: &str,
    query: &str,
    body: &Value,
) -> (u16, Value) {
    const DEPLOYMENTS: &str = "/apis/apps/v1/namespaces/serving/deployments";
    const POLICY: &str = "/apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies/llama";
    const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/serving/leases/llama-epoch";
    if path.starts_with("/apis/events.k8s.io/") {
        if body["type"] == "Warning" {
            journal.push(format!(
                "warning: {}",
                body["reason"].as_str().unwrap_or_default()
            ));
        }
        return (201, body.clone());
    }
    match (method, path) {
        ("GET", LEASE) => (200, lease_object(objects)),
        ("PUT", LEASE) => {
            let version = body["metadata"]["resourceVersion"].as_str().unwrap_or_default();
            if version != objects.lease_version.to_string() {
                let conflict = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "code": 409, "reason": "Conflict", "message": "the object has been modified", "metadata": {}});
                return (409, conflict);
            }
            objects.lease_holder = body["spec"]["holderIdentity"].as_str().unwrap().to_owned();
            objects.lease_epoch = body["metadata"]["annotations"]["understudy.dev/epoch"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap();
            objects.lease_version += 1;
            journal.push(format!(
                "lease: {} at epoch {}",
                objects.lease_holder, objects.lease_epoch
            ));
            (200, lease_object(objects))
        }
        ("PATCH", p) if p == format!("{POLICY}/status") => {
            objects.policy["status"] = body["status"].clone();
            (200, objects.policy.clone())
        }
        ("GET", "/api/v1/namespaces/serving/pods") => (
            200,
            json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []}),
        ),
        ("GET", DEPLOYMENTS) => {
            let items: Vec<Value> = objects
                .deployments
                .values()
                .filter(|d| selected(d, query))
                .cloned()
                .collect();
            (
                200,
                json!({"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {}, "items": items}),
            )
        }
        (_, p) if p.starts_with(DEPLOYMENTS) => {
            let rest = &p[DEPLOYMENTS.len() + 1..];
            let (name, scale) = match rest.strip_suffix("/scale") {
                Some(name) => (name.to_owned(), true),
                None => (rest.to_owned(), false),
            };
            deployment(objects, journal, method, &name, scale, body)
        }
        _ => {
            objects.surprises.push(format!("{method} {path}?{query}"));
            not_found(path)
        }
    }
}

fn deployment(
    objects: &mut Objects,
    journal: &Journal,
    method: &str,
    name: &str,
    scale: bool,
    body: &Value,
) -> (u16, Value) {
    let ready = objects.ready.get(name).copied().unwrap_or(0);
    let cannot_grow = objects.cannot_grow.as_deref() == Some(name);
    match (method, scale, objects.deployments.get_mut(name)) {
        ("PATCH", true, Some(object))
            if cannot_grow && body["spec"]["replicas"].as_u64() > object["spec"]["replicas"].as_u64() =>
        {
            journal.push(format!("scale {name} refused"));
            let forbidden = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 403,
                "reason": "Forbidden", "message": "exceeded quota: gpus", "metadata": {}});
            (403, forbidden)
        }
        ("GET", false, Some(object)) => {
            let mut object = object.clone();
            object["status"] = json!({"replicas": spec_replicas(&object), "readyReplicas": ready});
            (200, object)
        }
        ("GET", true, Some(object)) => {
            let replicas = spec_replicas(object);
            let scale = json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": replicas}, "status": {"replicas": replicas}});
            (200, scale)
        }
        ("PATCH", true, Some(object)) => {
            let (from, to) = (
                spec_replicas(object),
                u32::try_from(body["spec"]["replicas"].as_u64().unwrap()).unwrap(),
            );
            object["spec"]["replicas"] = json!(to);
            objects.ready.insert(name.to_owned(), ready.min(to));
            journal.push(format!("scale {name}: {from} → {to}"));
            let scale = json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": NS}, "spec": {"replicas": to}});
            (200, scale)
        }
        ("PATCH", false, _) => {
            // A reserve, applied server side on every reconcile: written down when it changed.
            let mut applied = body.clone();
            applied["metadata"]["uid"] = json!(format!("uid-{name}"));
            applied["metadata"]["resourceVersion"] = json!("1");
            if objects.deployments.get(name) != Some(&applied) {
                journal.push(format!(
                    "apply {name}: {} placeholder(s)",
                    spec_replicas(&applied)
                ));
            }
            objects.deployments.insert(name.to_owned(), applied.clone());
            (200, applied)
        }
        ("DELETE", false, Some(_)) => {
            let removed = objects.deployments.remove(name).unwrap();
            journal.push(format!("delete {name}"));
            (200, removed)
        }
        ("GET", _, None) => not_found(name),
        _ => {
            objects
                .surprises
                .push(format!("{method} deployment {name} (scale: {scale})"));
            not_found(name)
        }
    }
}

/// A client whose every request the fake API server answers from `objects`.
fn fake_api(objects: Shared, journal: Journal) -> Client {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((request, reply)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.unwrap();
            let body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).unwrap()
            };
            let query = parts.uri.query().unwrap_or_default().to_owned();
            let (code, answer) = answer(
                &mut objects.lock().unwrap(),
                &journal,
                parts.method.as_str(),
                parts.uri.path(),
                &query,
                &body,
            );
            let response = Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                .unwrap();
            reply.send_response(response);
        }
    });
    Client::new(mock, NS)
}

/// A pool's replicas are its workload's ready ones, first to last.
#[derive(Debug)]
struct ReadyReplicas {
    objects: Shared,
    pools: BTreeMap<String, Vec<Endpoint>>,
}

impl ReplicaEndpoints for ReadyReplicas {
    fn resolve<'a>(
        &'a self,
        _: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<Endpoint>, ResolveError>> {
        let ready = self
            .objects
            .lock()
            .unwrap()
            .ready
            .get(&pool.workload.name)
            .copied()
            .unwrap_or(0);
        let endpoints = self.pools[&pool.name]
            .iter()
            .take(ready as usize)
            .cloned()
            .collect();
        Box::pin(async move { Ok(endpoints) })
    }
}

/// The routers and fences: each step they are given is written down and done.
#[derive(Debug)]
struct Routers(Journal);

impl StepExecutor for Routers {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> BoxFuture<'a, StepReport> {
        self.0.push(format!(
            "router: {:?} {} at epoch {}",
            request.step, request.pool.name, request.epoch.0
        ));
        Box::pin(async {
            StepReport::Done {
                carried_by: "router",
                note: None,
            }
        })
    }
}

#[derive(Debug, Default)]
struct Observed(Mutex<Vec<Observation>>);

impl ObservationSource for Observed {
    fn drain(&self, _: &ObjectRef<FailoverPolicy>) -> Vec<Observation> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// Two seconds pass between reconciles.
#[derive(Debug, Default)]
struct Ticking(AtomicU64);

impl Clock for Ticking {
    fn now(&self) -> Duration {
        START + Duration::from_secs(self.0.load(Ordering::SeqCst))
    }
}

/// One path: the two pools (east serving, west the standby) and the spec fields beside them.
struct Path {
    east: Value,
    west: Value,
    /// West's workload's replicas at the start, as the keeper left them.
    west_running: u32,
    spec: Value,
    /// What the prober's last comparison of the pools found drifting, if anything.
    drift: Option<ParityStatus>,
    /// How the new primary's replicas come up after the command.
    west_after: WestAfter,
}

/// How the standby's replicas come up once it is promoted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WestAfter {
    /// Each pod it grows turns ready one reconcile after another, and every replica serves.
    Serves,
    /// No pod it grows ever turns ready.
    GrowsNothing,
    /// No pod it grows turns ready, and the replicas it runs answer every generation with a 500.
    ServesNothing,
    /// Its workload's scale may not be raised.
    CannotGrow,
}

/// A prober's findings: no golden answer (the policy's expectation is fixed), and the last
/// comparison of the pools it holds.
#[derive(Debug)]
struct Compared(Option<ParityStatus>);

impl ProbeFindings for Compared {
    fn golden_answer(&self, _: &ObjectRef<FailoverPolicy>) -> Option<GoldenAnswer> {
        None
    }

    fn parity(&self, _: &ObjectRef<FailoverPolicy>) -> Option<ParityStatus> {
        self.0.clone()
    }
}

/// What a run of a path left.
struct Ran {
    journal: Vec<String>,
    status: Value,
    deployments: BTreeMap<String, Value>,
    /// The journal's length after each reconcile: two seconds pass between one and the next.
    reconciled: Vec<usize>,
}

/// Runs `path` as the controller would: reconciles until nothing more happens, then a failover
/// command (with the standby seen to pass twice), then reconciles until the new primary serves and
/// nothing more happens. Every reconcile must succeed and every request must be one the fake
/// knows.
async fn run(path: Path) -> Ran {
    let journal = Journal::default();
    let count = |pool: &Value| usize::try_from(pool["replicas"].as_u64().unwrap()).unwrap();
    let east = replicas("east", count(&path.east), &journal).await;
    let west = replicas("west", count(&path.west), &journal).await;
    let west_ready_at_most = match path.west_after {
        WestAfter::Serves => u32::MAX,
        WestAfter::GrowsNothing | WestAfter::ServesNothing | WestAfter::CannotGrow => path.west_running,
    };
    // A move planned by command drains the old primary for `stream.drainFor` before it is put into
    // its standby shape; these paths cut at once unless they say otherwise.
    let mut spec = json!({"recoveryObjective": "5m", "probe": {"expect": {"mode": "nonEmpty"}},
        "stream": {"drainFor": "0s"}, "pools": [path.east, path.west]});
    let drain_s = path.spec["stream"]["drainFor"]
        .as_str()
        .map_or(0, |d| d.trim_end_matches('s').parse::<u32>().unwrap());
    let reconciled = Mutex::new(Vec::new());
    for (key, value) in path.spec.as_object().unwrap() {
        spec[key] = value.clone();
    }
    let record = OperatorRecord {
        machine: FailoverState::starting_at(Pool::A, Epoch(0)),
        handled_command: None,
        handed_off: Vec::new(),
    };
    let policy = json!({
        "apiVersion": "understudy.dev/v1alpha1", "kind": "FailoverPolicy",
        "metadata": {"name": "llama", "namespace": NS, "uid": UID, "generation": 1, "resourceVersion": "100",
            "finalizers": ["understudy.dev/cleanup"]},
        "spec": spec,
        "status": {"failover": serde_json::to_value(&record).unwrap()},
    });
    let east_running = u32::try_from(east.endpoints.len()).unwrap();
    let objects: Shared = Arc::new(Mutex::new(Objects {
        lease_holder: "us-east".into(),
        lease_epoch: 0,
        lease_version: 1,
        policy,
        deployments: BTreeMap::from([
            ("vllm-east".to_owned(), workload("vllm-east", east_running)),
            ("vllm-west".to_owned(), workload("vllm-west", path.west_running)),
        ]),
        ready: BTreeMap::from([
            ("vllm-east".to_owned(), east_running),
            ("vllm-west".to_owned(), path.west_running),
        ]),
        surprises: Vec::new(),
        cannot_grow: (path.west_after == WestAfter::CannotGrow).then(|| "vllm-west".to_owned()),
    }));
    let client = fake_api(objects.clone(), journal.clone());
    let replicas = Arc::new(ReadyReplicas {
        objects: objects.clone(),
        pools: BTreeMap::from([
            ("us-east".to_owned(), east.endpoints.clone()),
            ("us-west".to_owned(), west.endpoints.clone()),
        ]),
    });
    let observed = Arc::new(Observed::default());
    if let Some(drift) = &path.drift {
        observed.0.lock().unwrap().push(Observation::Parity {
            holds: drift.drift.is_empty(),
        });
    }
    let promoted_to = if path.drift.is_some() {
        "us-east"
    } else {
        "us-west"
    };
    let clock = Arc::new(Ticking::default());
    let ctx = Arc::new(
        Context::new(client, Arc::new(Metrics::new()), Some("test-0".into()))
            .with_clock(clock.clone())
            .with_observations(observed.clone())
            .with_findings(Arc::new(Compared(path.drift.clone())))
            .with_steps(Arc::new(Routers(journal.clone())))
            .with_replicas(replicas),
    );
    let reconcile_until_quiet = async |promoted: bool| {
        let mut quiet = 0;
        // Quiet for longer than a drain lasts, so that what comes after it is seen.
        let quiet_enough = 2 + drain_s.div_ceil(2);
        for _ in 0..24 {
            let before = journal.len();
            let object = objects.lock().unwrap().policy.clone();
            let guard: DeserializeGuard<FailoverPolicy> = serde_json::from_value(object).unwrap();
            let result = reconcile(Arc::new(guard), ctx.clone()).await;
            // A refused scale is the reconcile's error, told once its status is written.
            let refused = matches!(&result, Err(e) if e.to_string().contains("exceeded quota"));
            assert!(
                result.is_ok() || (refused && path.west_after == WestAfter::CannotGrow),
                "{result:?}\njournal: {:#?}",
                journal.entries()
            );
            clock.0.fetch_add(2, Ordering::SeqCst);
            reconciled.lock().unwrap().push(journal.len());
            // A replica of a scaled-up workload becomes ready each reconcile, as pods do.
            let mut objects = objects.lock().unwrap();
            let wanted: Vec<(String, u32)> = objects
                .deployments
                .iter()
                .map(|(name, d)| (name.clone(), spec_replicas(d)))
                .collect();
            for (name, replicas) in wanted {
                let most = if name == "vllm-west" {
                    west_ready_at_most
                } else {
                    u32::MAX
                };
                if let Some(ready) = objects.ready.get_mut(&name) {
                    *ready = (*ready + 1).min(replicas).min(most).max(*ready);
                }
            }
            let serving = objects.policy["status"]["state"] == "Serving"
                && (!promoted || objects.policy["status"]["primaryPool"] == promoted_to);
            quiet = if serving && journal.len() == before {
                quiet + 1
            } else {
                0
            };
            if quiet == quiet_enough {
                return;
            }
        }
        panic!("no quiet reconcile in 24; journal: {:#?}", journal.entries());
    };
    reconcile_until_quiet(false).await;
    if path.west_after == WestAfter::ServesNothing {
        for emulator in &west._emulators {
            emulator.inject("half-failed:error");
        }
    }
    journal.push("command: failover".into());
    objects.lock().unwrap().policy["metadata"]["annotations"] =
        json!({"understudy.dev/command": "failover@drill-1"});
    let passes = Observation::Check {
        pool: Pool::B,
        result: CheckResult::Pass,
    };
    observed.0.lock().unwrap().extend([passes, passes]);
    if path.west_after == WestAfter::ServesNothing {
        // It never serves: the promotion waits, and what it says while it does is the outcome.
        for _ in 0..12 {
            let object = objects.lock().unwrap().policy.clone();
            let guard: DeserializeGuard<FailoverPolicy> = serde_json::from_value(object).unwrap();
            let result = reconcile(Arc::new(guard), ctx.clone()).await;
            assert!(result.is_ok(), "{result:?}\njournal: {:#?}", journal.entries());
            clock.0.fetch_add(2, Ordering::SeqCst);
        }
    } else {
        reconcile_until_quiet(true).await;
    }
    let objects = objects.lock().unwrap();
    assert!(objects.surprises.is_empty(), "{:?}", objects.surprises);
    Ran {
        journal: journal.entries(),
        status: objects.policy["status"].clone(),
        deployments: objects.deployments.clone(),
        reconciled: reconciled.into_inner().unwrap(),
    }
}

fn strings(lines: &[&str]) -> Vec<String> {
    lines.iter().map(|s| (*s).to_owned()).collect()
}

fn pool(name: &str, replicas: u32, standby: Value) -> Value {
    let workload = format!("vllm-{}", name.trim_start_matches("us-"));
    json!({"name": name, "workload": {"kind": "Deployment", "name": workload}, "replicas": replicas, "standby": standby})
}

/// The old primary waits with one replica hot and one warm at `level`.
fn east_hot_and_warm(level: u8) -> Value {
    pool(
        "us-east",
        2,
        json!([{"tier": "hot", "replicas": 1}, {"tier": "warm", "replicas": 1, "sleepLevel": level}]),
    )
}

/// What the routers and fences are asked for a promotion to us-west at epoch 1.
const FENCE: &str = "router: FenceOld us-east at epoch 1";
const ROUTE: &str = "router: Route us-west at epoch 1";
const ADMISSION: &str = "router: OpenAdmission us-west at epoch 1";
const LEASE: &str = "lease: us-west at epoch 1";
const COMMAND: &str = "command: failover";

/// The old primary's second replica, probed right and put to sleep at `level` once the
/// promotion is done, after the Lease moved and the fences were told.
fn old_primary_sleeps(ran: &Ran, before: &[&str], level: u8) {
    let sleep = format!("east-1 POST /sleep?level={level}");
    let mut expected = strings(before);
    expected.extend(strings(&["east-1 probe", &sleep]));
    assert_eq!(as_seen_by(&ran.journal, "east-1"), expected);
    // The hot one is left serving as it was.
    assert_eq!(as_seen_by(&ran.journal, "east-0"), strings(before));
}

/// `status.coldStart` holds each woken replica's wake at its level and its first token after,
/// measured, and the warm tier's summary counts them.
fn woken_replicas_are_timed(ran: &Ran, wake: &str) {
    let breakdowns: Vec<&Value> = ran.status["coldStart"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["tier"] == "warm")
        .collect();
    assert_eq!(breakdowns.len(), 2, "{:#}", ran.status["coldStart"]);
    for breakdown in breakdowns {
        assert_eq!(breakdown["pool"], "us-west");
        for stage in [wake, "firstToken"] {
            let seconds = breakdown["stages"][stage].as_f64();
            assert!(seconds.is_some_and(|s| s > 0.0), "{stage}: {breakdown}");
        }
    }
    let summary = ran.status["coldStartSummary"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["tier"] == "warm")
        .unwrap();
    assert_eq!(summary["replicas"], 2, "{summary}");
}

#[tokio::test]
async fn a_hot_standby_is_probed_and_routed_without_a_call_that_wakes_or_grows_it() {
    let ran = run(Path {
        east: east_hot_and_warm(1),
        west: pool("us-west", 2, json!([{"tier": "hot", "replicas": 2}])),
        west_running: 2,
        spec: json!({}),
        drift: None,
        west_after: WestAfter::Serves,
    })
    .await;
    let api = [COMMAND, LEASE, FENCE, ROUTE, ADMISSION];
    assert_eq!(without_replicas(&ran.journal), strings(&api));
    for replica in ["west-0", "west-1"] {
        let probe = format!("{replica} probe");
        assert_eq!(
            as_seen_by(&ran.journal, replica),
            strings(&[COMMAND, LEASE, FENCE, &probe, ROUTE, ADMISSION])
        );
    }
    old_primary_sleeps(&ran, &api, 1);
    let woken = &ran.status["lastFailover"]["steps"][2];
    assert_eq!(woken["step"], "Woken");
    assert_eq!(
        woken["note"],
        "us-west has no warm tier: nothing sleeps, no replica was called"
    );
}

/// A standby of two warm replicas at `level`, and an old primary with one hot and one warm: the
/// warm ones sleep after their probe, and each is woken by `wake`'s calls after the fence and
/// probed before the route; the old primary sleeps at the same level after.
async fn warm_path(level: u8, wake: &[&str]) -> Ran {
    let ran = run(Path {
        east: east_hot_and_warm(level),
        west: pool(
            "us-west",
            2,
            json!([{"tier": "warm", "replicas": 2, "sleepLevel": level}]),
        ),
        west_running: 2,
        spec: json!({}),
        drift: None,
        west_after: WestAfter::Serves,
    })
    .await;
    let api = [COMMAND, LEASE, FENCE, ROUTE, ADMISSION];
    assert_eq!(without_replicas(&ran.journal), strings(&api));
    for replica in ["west-0", "west-1"] {
        let call = |what: &str| format!("{replica} {what}");
        let mut expected = vec![call("probe"), call(&format!("POST /sleep?level={level}"))];
        expected.extend(strings(&[COMMAND, LEASE, FENCE]));
        expected.extend(wake.iter().map(|what| call(what)));
        expected.push(call("probe"));
        expected.extend(strings(&[ROUTE, ADMISSION]));
        assert_eq!(as_seen_by(&ran.journal, replica), expected);
    }
    old_primary_sleeps(&ran, &api, level);
    woken_replicas_are_timed(&ran, &format!("wakeLevel{level}"));
    ran
}

#[tokio::test]
async fn a_warm_level_1_standby_sleeps_after_its_probe_and_is_woken_after_the_fence() {
    let ran = warm_path(1, &["POST /wake_up"]).await;
    // What the wake took now says whether the new standby, the old primary, meets the objective.
    let objective = &ran.status["conditions"]["ObjectiveMet"];
    assert_eq!(objective["status"], "True", "{objective}");
    assert!(
        objective["message"]
            .as_str()
            .unwrap()
            .contains("from measured cold starts"),
        "{objective}"
    );
    // The last in address order is put to sleep first.
    let first_sleep = ran
        .journal
        .iter()
        .position(|e| e.ends_with("/sleep?level=1"))
        .unwrap();
    assert!(
        ran.journal[first_sleep].starts_with("west-1"),
        "{:#?}",
        ran.journal
    );
}

#[tokio::test]
async fn a_warm_level_2_standby_is_woken_weights_first_reloaded_then_its_cache() {
    warm_path(
        2,
        &[
            "POST /wake_up?tags=weights",
            "POST /collective_rpc",
            "POST /wake_up?tags=kv_cache",
            "POST /reset_prefix_cache",
        ],
    )
    .await;
}

#[tokio::test]
async fn an_all_pilot_light_standby_runs_one_replica_grows_the_other_into_its_reserve_and_the_old_primary_shrinks()
 {
    let ran = run(Path {
        east: pool(
            "us-east",
            2,
            json!([{"tier": "hot", "replicas": 1}, {"tier": "pilotLight", "replicas": 1, "reserveGpus": true}]),
        ),
        west: pool("us-west", 2, json!([{"tier": "pilotLight", "replicas": 2, "reserveGpus": true}])),
        west_running: 0,
        spec: json!({}),
        drift: None,
        west_after: WestAfter::Serves,
    })
    .await;
    // West is all pilot light: one replica runs (hot, holding its own GPU) so that it can be
    // proven, and a placeholder holds the other's GPU until its pod is ready on it; then the old
    // primary shrinks to its hot replica, and a placeholder holds the GPU its pilot light let go.
    let api = [
        "apply llama-us-west-reserve: 1 placeholder(s)",
        "scale vllm-west: 0 → 1",
        COMMAND,
        LEASE,
        FENCE,
        "scale vllm-west: 1 → 2",
        ROUTE,
        ADMISSION,
        "delete llama-us-west-reserve",
        "scale vllm-east: 2 → 1",
        "apply llama-us-east-reserve: 1 placeholder(s)",
    ];
    assert_eq!(without_replicas(&ran.journal), strings(&api));
    // The first pod ready is probed alone, and one of two is not enough; both answer next time.
    let (before_route, after_route) = (&api[..6], &api[6..]);
    let mut first = strings(before_route);
    first.extend(strings(&["west-0 probe", "west-0 probe"]));
    first.extend(strings(after_route));
    assert_eq!(as_seen_by(&ran.journal, "west-0"), first);
    let mut second = strings(before_route);
    second.push("west-1 probe".into());
    second.extend(strings(after_route));
    assert_eq!(as_seen_by(&ran.journal, "west-1"), second);
    let reserve = &ran.deployments["llama-us-east-reserve"];
    assert_eq!(reserve["metadata"]["labels"]["understudy.dev/pool"], "us-east");
    assert_eq!(
        reserve["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "2"
    );
    assert!(!ran.deployments.contains_key("llama-us-west-reserve"));
    assert_eq!(spec_replicas(&ran.deployments["vllm-east"]), 1);
}

#[tokio::test]
async fn four_warm_and_four_pilot_light_route_at_half_capacity_when_the_warm_four_answer() {
    let ran = run(Path {
        east: east_hot_and_warm(1),
        west: pool(
            "us-west",
            8,
            json!([{"tier": "warm", "replicas": 4}, {"tier": "pilotLight", "replicas": 4}]),
        ),
        west_running: 8,
        spec: json!({"minServingFraction": 0.5}),
        drift: None,
        west_after: WestAfter::Serves,
    })
    .await;
    let api = [
        "scale vllm-west: 8 → 4",
        COMMAND,
        LEASE,
        FENCE,
        "scale vllm-west: 4 → 8",
        ROUTE,
        ADMISSION,
    ];
    assert_eq!(without_replicas(&ran.journal), strings(&api));
    // The keeper runs four and puts all four to sleep; the promotion wakes them before it grows
    // the pilot light, and routes on their answers alone, before a pilot-light pod is ready.
    for replica in ["west-0", "west-1", "west-2", "west-3"] {
        let call = |what: &str| format!("{replica} {what}");
        assert_eq!(
            as_seen_by(&ran.journal, replica),
            strings(&[
                api[0],
                &call("probe"),
                &call("POST /sleep?level=1"),
                COMMAND,
                LEASE,
                FENCE,
                &call("POST /wake_up"),
                api[4],
                &call("probe"),
                ROUTE,
                ADMISSION,
            ])
        );
    }
    for replica in ["west-4", "west-5", "west-6", "west-7"] {
        assert_eq!(as_seen_by(&ran.journal, replica), strings(&api));
    }
    old_primary_sleeps(&ran, &api, 1);
    let serving = &ran.status["lastFailover"]["steps"][4];
    assert_eq!(serving["step"], "Serving");
    assert_eq!(
        serving["note"],
        "4 of 8 replicas of us-west answered the generating probe right"
    );
}

#[tokio::test]
async fn a_drifted_warm_standby_is_neither_put_to_sleep_nor_switched_to() {
    let drift = ParityStatus {
        checked_at: "2026-01-05T08:59:50Z".to_owned(),
        artifact_keys: 0,
        compared: 9,
        drift: vec![ParityDrift {
            key: "flag.max-model-len".to_owned(),
            primary: Some("8192".to_owned()),
            standby: Some("4096".to_owned()),
        }],
        ..ParityStatus::default()
    };
    let ran = run(Path {
        east: east_hot_and_warm(1),
        west: pool(
            "us-west",
            2,
            json!([{"tier": "warm", "replicas": 2, "sleepLevel": 1}]),
        ),
        west_running: 2,
        spec: json!({}),
        drift: Some(drift),
        west_after: WestAfter::Serves,
    })
    .await;
    // No replica was called, and the Lease never moved: the drift and the refused command were
    // told in Warnings.
    assert_eq!(
        ran.journal,
        ["warning: ParityDrift", COMMAND, "warning: CommandRefused"]
    );
    assert_eq!(ran.status["primaryPool"], "us-east");
    assert_eq!(ran.status["conditions"]["ParityHolds"]["status"], "False");
}

/// A standby of one hot replica and three pilot light, under an objective of 20 s that a 35 s
/// detection leaves nothing of: the promotion's deadline is one probe interval, 10 s.
fn one_hot_three_pilot_light(west_after: WestAfter) -> Path {
    Path {
        east: east_hot_and_warm(1),
        west: pool(
            "us-west",
            4,
            json!([{"tier": "hot", "replicas": 1}, {"tier": "pilotLight", "replicas": 3}]),
        ),
        west_running: 1,
        spec: json!({"recoveryObjective": "20s"}),
        drift: None,
        west_after,
    }
}

#[tokio::test]
async fn past_its_deadline_a_promotion_routes_the_replicas_that_serve_below_the_quorum() {
    let ran = run(one_hot_three_pilot_light(WestAfter::GrowsNothing)).await;
    // The pilot light never turns ready: the one hot replica is all that serves, three are
    // needed, and after the deadline the route moves to it.
    assert_eq!(
        without_replicas(&ran.journal),
        strings(&[COMMAND, LEASE, FENCE, "scale vllm-west: 1 → 4", ROUTE, ADMISSION])
    );
    assert_eq!(ran.status["primaryPool"], "us-west");
    let serving = &ran.status["lastFailover"]["steps"][4];
    assert_eq!(serving["step"], "Serving");
    assert_eq!(
        serving["note"],
        "past the promotion's deadline of 10s, the route moves to what serves: 1 of 4 replicas of \
         us-west answered the generating probe right, below the 3 needed; the rest join the route as \
         they pass"
    );
}

#[tokio::test]
async fn past_its_deadline_a_promotion_with_nothing_serving_keeps_the_waiting_room_closed_and_warns() {
    let ran = run(one_hot_three_pilot_light(WestAfter::ServesNothing)).await;
    let api = without_replicas(&ran.journal);
    // The Lease moved and the old primary is fenced; nothing is routed, and once past the
    // deadline each try says so in a Warning.
    assert_eq!(
        api[..4],
        strings(&[COMMAND, LEASE, FENCE, "scale vllm-west: 1 → 4"])
    );
    assert!(!api.iter().any(|e| e.starts_with("router: Route")), "{api:#?}");
    assert!(
        api[4..].iter().all(|e| e == "warning: PromotionOverdue"),
        "{api:#?}"
    );
    assert!(api.len() > 4, "{api:#?}");
    assert_eq!(ran.status["state"], "Promoting");
    let ready = &ran.status["conditions"]["Ready"];
    assert_eq!(ready["reason"], "PromotionOverdue", "{ready}");
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .ends_with("the routers keep the waiting room closed, answering with Retry-After, and the promotion keeps trying"),
        "{ready}"
    );
}

#[tokio::test]
async fn past_its_deadline_a_promotion_whose_pool_cannot_grow_goes_on_with_what_runs() {
    let ran = run(one_hot_three_pilot_light(WestAfter::CannotGrow)).await;
    let api = without_replicas(&ran.journal);
    let refused = api.iter().filter(|e| *e == "scale vllm-west refused").count();
    assert!(refused > 1, "{api:#?}");
    assert_eq!(api[..3], strings(&[COMMAND, LEASE, FENCE]));
    assert_eq!(api[3 + refused..], strings(&[ROUTE, ADMISSION]));
    let steps = &ran.status["lastFailover"]["steps"];
    assert_eq!(steps[3]["step"], "ScaledUp");
    let note = steps[3]["note"].as_str().unwrap();
    assert!(
        note.starts_with(
            "past the promotion's deadline of 10s, it goes on with the replicas that run: vllm-west \
             could not be scaled to 4: "
        ),
        "{note}"
    );
    assert!(note.contains("exceeded quota: gpus"), "{note}");
    assert_eq!(ran.status["primaryPool"], "us-west");
}

#[tokio::test]
async fn after_a_planned_move_the_old_primary_drains_its_streams_before_it_sleeps() {
    let ran = run(Path {
        east: east_hot_and_warm(1),
        west: pool("us-west", 2, json!([{"tier": "hot", "replicas": 2}])),
        west_running: 2,
        spec: json!({"stream": {"drainFor": "8s"}}),
        drift: None,
        west_after: WestAfter::Serves,
    })
    .await;
    let api = [COMMAND, LEASE, FENCE, ROUTE, ADMISSION];
    assert_eq!(without_replicas(&ran.journal), strings(&api));
    old_primary_sleeps(&ran, &api, 1);
    // The move was a command, not a failure: east-1 is put to sleep only once 8 s, four
    // reconciles, have passed since the promotion finished.
    let at = |entry: &str| ran.journal.iter().position(|e| e == entry).unwrap();
    let (finished, slept) = (at(ADMISSION), at("east-1 POST /sleep?level=1"));
    let reconciles_between = ran
        .reconciled
        .iter()
        .filter(|&&len| len > finished && len <= slept)
        .count();
    assert!(
        reconciles_between >= 4,
        "{reconciles_between}: {:#?}",
        ran.journal
    );
}
