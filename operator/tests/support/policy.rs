//! The FailoverPolicy the controller tests start from, as the API server stores it, the records
//! and Leases they script, and one reconcile run against a scenario: the fixture every
//! `controller_*` test shares, as controller-rs's `fixtures.rs` is.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use serde_json::{Value, json};
use understudy_core::failover::{
    CheckResult, FailoverState, Phase, PoolHealth, Promotion, Step, TransitionKind,
};
use understudy_core::{Epoch, Pool};
use understudy_operator::command::HandledCommand;
use understudy_operator::controller::{Context, HandedOffStep, OperatorRecord, reconcile};
use understudy_operator::crd::{FailoverPolicy, GoldenAnswer};
use understudy_operator::metrics::Metrics;
use understudy_operator::ports::{Clock, Observation, ObservationSource};
use understudy_operator::reconciler::WithShell;

use super::{ApiServer, Call, NS, Published};

pub const NAME: &str = "llama";

pub const UID: &str = "0d5e8c42-6a55-4c3e-9a8e-1f2b3c4d5e6f";

pub const POLICY_PATH: &str = "/apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies/llama";

pub const STATUS_PATH: &str =
    "/apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies/llama/status";

pub const LEASE_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/serving/leases/llama-epoch";

pub const WEST_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/vllm-west";

pub const DEPLOYMENTS_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments";

/// 2024-06-01T12:00:00Z
pub const NOW: Duration = Duration::from_secs(1_717_243_200);

#[derive(Debug)]
pub struct FixedClock;

impl Clock for FixedClock {
    fn now(&self) -> Duration {
        NOW
    }
}

/// Hands out a fixed list of observations once, as a prober would after one round.
#[derive(Debug, Default)]
pub struct Scripted(pub Mutex<Vec<Observation>>);

impl ObservationSource for Scripted {
    fn drain(&self, _: &ObjectRef<FailoverPolicy>) -> Vec<Observation> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A policy as the API server stores it, with every default spelled out.
pub fn policy() -> Value {
    json!({
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "FailoverPolicy",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "uid": UID,
            "generation": 1,
            "resourceVersion": "100",
            "finalizers": ["understudy.dev/cleanup"],
        },
        "spec": {
            "recoveryObjective": "5m",
            "pools": [
                {"name": "us-east", "workload": {"kind": "Deployment", "name": "vllm-east"}, "replicas": 4},
                {"name": "us-west", "workload": {"kind": "Deployment", "name": "vllm-west"}, "replicas": 4},
            ],
        },
    })
}

pub fn guard(object: &Value) -> Arc<DeserializeGuard<FailoverPolicy>> {
    Arc::new(serde_json::from_value(object.clone()).unwrap())
}

pub fn lease(holder: &str, epoch: u64, version: &str) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": "llama-epoch",
            "namespace": NS,
            "resourceVersion": version,
            "annotations": {"understudy.dev/epoch": epoch.to_string()},
        },
        "spec": {"holderIdentity": holder, "leaseTransitions": epoch},
    })
}

pub fn with_record(mut object: Value, record: &OperatorRecord) -> Value {
    object["status"] = json!({ "failover": serde_json::to_value(record).unwrap() });
    object
}

pub fn record(machine: FailoverState, handled: Option<&str>) -> OperatorRecord {
    OperatorRecord {
        machine,
        handled_command: handled.map(|value| HandledCommand { value: value.into() }),
        handed_off: Vec::new(),
    }
}

/// Two passing checks of the standby: enough to prove it under the default trigger.
pub fn standby_proven() -> Vec<Observation> {
    vec![
        Observation::Check {
            pool: Pool::B,
            result: CheckResult::Pass,
        };
        2
    ]
}

pub fn west_scale(replicas: u32) -> Value {
    json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": "vllm-west", "namespace": NS},
        "spec": {"replicas": replicas}, "status": {"replicas": replicas},
    })
}

pub fn west_deployment(ready: u32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "vllm-west", "namespace": NS},
        "spec": {"replicas": 4},
        "status": {"replicas": 4, "readyReplicas": ready},
    })
}

/// Answers the two reads a promotion to us-west makes once it is scaled: the Scale step finds four
/// replicas desired already (nothing to write), and AwaitServing finds `ready` of them ready.
pub async fn answer_west_at_four(server: &mut ApiServer, ready: u32) {
    server
        .expect("GET", &format!("{WEST_PATH}/scale"))
        .await
        .answer(200, &west_scale(4));
    server
        .expect("GET", WEST_PATH)
        .await
        .answer(200, &west_deployment(ready));
}

/// The names of a timeline's steps, each with whether it was handed off.
pub fn steps_of(timeline: &Value) -> Vec<(String, bool)> {
    timeline["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["step"].as_str().unwrap().to_owned(),
                s["handedOff"].as_bool().unwrap_or(false),
            )
        })
        .collect()
}

pub fn context(observations: Vec<Observation>) -> (Arc<Context>, ApiServer) {
    let (client, mut server) = super::client();
    let ctx = Context::new(client, Arc::new(Metrics::new()), Some("test-0".into()))
        .with_clock(Arc::new(FixedClock))
        .with_observations(Arc::new(Scripted(Mutex::new(observations))));
    // The list of the policy's GPU reserves every reconcile makes, with none found.
    server.read_on_the_side = Some((DEPLOYMENTS_PATH, deployment_list(Vec::new())));
    (Arc::new(ctx), server)
}

/// Answers a status apply with the policy carrying the applied status, as the API server does.
pub fn answer_status(call: Call, object: &Value) -> Value {
    assert!(
        call.query.contains("fieldManager=understudy-operator"),
        "{}",
        call.query
    );
    let applied = call.body["status"].clone();
    let mut stored = object.clone();
    stored["status"] = applied.clone();
    call.answer(200, &stored);
    applied
}

/// Runs one reconcile against a scenario, each under a timeout.
pub async fn run_scenario<F>(
    object: &Value,
    ctx: Arc<Context>,
    scenario: impl FnOnce(ApiServer) -> F,
    server: ApiServer,
) -> (
    Result<Action, understudy_operator::controller::Error>,
    Vec<Published>,
)
where
    F: Future<Output = Vec<Published>> + Send + 'static,
{
    super::play(scenario(server), reconcile(guard(object), ctx)).await
}

/// The record an operator leaves when it dies after claiming epoch 2 for us-west, fencing and
/// waking (both handed off), before scaling.
pub fn record_stopped_at_scale() -> OperatorRecord {
    let at = |s: u64| NOW - Duration::from_secs(60) + Duration::from_secs(s);
    let machine = FailoverState {
        primary: Pool::B,
        epoch: Epoch(2),
        phase: Phase::Promoting(Promotion {
            kind: TransitionKind::Manual,
            from: Pool::A,
            to: Pool::B,
            epoch: Epoch(2),
            step: Step::Scale,
            started_at: at(0),
            done: vec![
                (Step::AcquireLease, at(1)),
                (Step::FenceOld, at(1)),
                (Step::Wake, at(2)),
            ],
            fault_seen_at: None,
        }),
        health: [PoolHealth::default(); 2],
        ..FailoverState::starting_at(Pool::A, Epoch(1))
    };
    let mut record = record(machine, Some("failover"));
    record.handed_off = [Step::FenceOld, Step::Wake]
        .into_iter()
        .map(|step| HandedOffStep {
            epoch: Epoch(2),
            step,
            note: "no call was made".into(),
            handed_off: true,
        })
        .collect();
    record
}

/// Both pools keep two of their four replicas as a pilot light with the GPUs reserved.
pub fn reserving_policy() -> Value {
    let mut object = policy();
    for pool in object["spec"]["pools"].as_array_mut().unwrap() {
        pool["standby"] = json!([
            {"tier": "hot", "replicas": 2},
            {"tier": "pilotLight", "replicas": 2, "reserveGpus": true},
        ]);
    }
    object
}

/// A vLLM Deployment as its owner wrote it: two GPUs a replica, on H100 nodes, tolerating the
/// GPU taint.
pub fn vllm(name: &str, zone: &str) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": {"topology.kubernetes.io/zone": zone},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{
                        "name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                        "resources": {
                            "requests": {"cpu": "8", "memory": "64Gi"},
                            "limits": {"nvidia.com/gpu": "2", "memory": "64Gi"},
                        },
                    }],
                },
            },
        },
        "status": {"replicas": 2, "readyReplicas": 2},
    })
}

/// A DeploymentList as the API server answers a list.
pub fn deployment_list(items: Vec<Value>) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "DeploymentList",
        "metadata": {"resourceVersion": "500"},
        "items": items,
    })
}

pub fn golden_answer(prompt: &str, recorded_at: Option<&str>) -> GoldenAnswer {
    GoldenAnswer {
        prefix: " Paris. It is also the l".to_owned(),
        prompt: prompt.to_owned(),
        max_tokens: 8,
        pool: "us-east".to_owned(),
        model: Some("meta-llama/Llama-3.1-8B".to_owned()),
        recorded_at: recorded_at.map(str::to_owned),
    }
}
