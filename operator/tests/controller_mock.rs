//! The FailoverPolicy controller against a scripted API server.
//!
//! Each test hands `reconcile` a client whose transport is a `tower-test` mock, and runs an
//! [`ApiServer`] that expects the requests of one scenario in order, checks their method, path
//! and the body fields that matter, and answers with realistic objects. Events (POST or PATCH to
//! `events.k8s.io`) are answered and collected on the side, so a scenario lists only the writes
//! that carry state. So is the list of the policy's GPU reserves every reconcile makes, with none
//! found, unless a scenario about reserves turns that off to script it. A scenario that ends with [`ApiServer::expect_no_more`] also proves that the
//! reconcile made no request beyond the script: the mock sees the client hang up first.
//!
//! The tests at the end marked `#[ignore]` need a real cluster:
//!
//! ```text
//! kind create cluster
//! cargo run -q -p understudy-operator --bin crdgen | kubectl apply -f -
//! cargo test -p understudy-operator --test controller_mock -- --ignored
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::Client;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Config, applier};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;
use serde_json::{Value, json};
use understudy_core::failover::{
    CheckResult, FailoverState, Phase, PoolHealth, Promotion, Step, TransitionKind,
};
use understudy_core::{Epoch, Pool};
use understudy_operator::command::HandledCommand;
use understudy_operator::controller::{Context, HandedOffStep, OperatorRecord, error_policy, reconcile};
use understudy_operator::crd::{FailoverPolicy, GoldenAnswer, ParityDrift, ParityStatus};
use understudy_operator::metrics::Metrics;
use understudy_operator::ports::{
    Clock, Observation, ObservationSource, ProbeFindings, RouteSyncReport, RouteSyncRequest, StepExecutor,
    StepReport, StepRequest,
};
use understudy_operator::watchdog::{Reconciler, Watchdog};

mod support;
use support::{ApiServer, Call, NS, Published, TIMEOUT, reasons, status};

const NAME: &str = "llama";
const UID: &str = "0d5e8c42-6a55-4c3e-9a8e-1f2b3c4d5e6f";
const POLICY_PATH: &str = "/apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies/llama";
const STATUS_PATH: &str = "/apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies/llama/status";
const LEASES_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/serving/leases";
const LEASE_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/serving/leases/llama-epoch";
const WEST_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/vllm-west";
const DEPLOYMENTS_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments";

/// 2024-06-01T12:00:00Z
const NOW: Duration = Duration::from_secs(1_717_243_200);

#[derive(Debug)]
struct FixedClock;

impl Clock for FixedClock {
    fn now(&self) -> Duration {
        NOW
    }
}

/// Hands out a fixed list of observations once, as a prober would after one round.
#[derive(Debug, Default)]
struct Scripted(Mutex<Vec<Observation>>);

impl ObservationSource for Scripted {
    fn drain(&self, _: &ObjectRef<FailoverPolicy>) -> Vec<Observation> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A policy as the API server stores it, with every default spelled out.
fn policy() -> Value {
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

fn guard(object: &Value) -> Arc<DeserializeGuard<FailoverPolicy>> {
    Arc::new(serde_json::from_value(object.clone()).unwrap())
}

fn lease(holder: &str, epoch: u64, version: &str) -> Value {
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

fn with_record(mut object: Value, record: &OperatorRecord) -> Value {
    object["status"] = json!({ "failover": serde_json::to_value(record).unwrap() });
    object
}

fn record(machine: FailoverState, handled: Option<&str>) -> OperatorRecord {
    OperatorRecord {
        machine,
        handled_command: handled.map(|value| HandledCommand { value: value.into() }),
        handed_off: Vec::new(),
    }
}

/// Two passing checks of the standby: enough to prove it under the default trigger.
fn standby_proven() -> Vec<Observation> {
    vec![
        Observation::Check {
            pool: Pool::B,
            result: CheckResult::Pass,
        };
        2
    ]
}

fn west_scale(replicas: u32) -> Value {
    json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": "vllm-west", "namespace": NS},
        "spec": {"replicas": replicas}, "status": {"replicas": replicas},
    })
}

fn west_deployment(ready: u32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "vllm-west", "namespace": NS},
        "spec": {"replicas": 4},
        "status": {"replicas": 4, "readyReplicas": ready},
    })
}

/// The names of a timeline's steps, each with whether it was handed off.
fn steps_of(timeline: &Value) -> Vec<(String, bool)> {
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

fn context(observations: Vec<Observation>) -> (Arc<Context>, ApiServer) {
    let (client, mut server) = support::client();
    let ctx = Context::new(client, Arc::new(Metrics::new()), Some("test-0".into()))
        .with_clock(Arc::new(FixedClock))
        .with_observations(Arc::new(Scripted(Mutex::new(observations))));
    // The list of the policy's GPU reserves every reconcile makes, with none found.
    server.read_on_the_side = Some((DEPLOYMENTS_PATH, deployment_list(Vec::new())));
    (Arc::new(ctx), server)
}

/// Answers a status apply with the policy carrying the applied status, as the API server does.
fn answer_status(call: Call, object: &Value) -> Value {
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
async fn run_scenario<F>(
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
    support::play(scenario(server), reconcile(guard(object), ctx)).await
}

#[tokio::test]
async fn new_policy_gets_a_finalizer_a_lease_and_a_status() {
    // First pass: no finalizer yet, so the only write is adding it.
    let mut fresh = policy();
    fresh["metadata"].as_object_mut().unwrap().remove("finalizers");
    let (ctx, server) = context(Vec::new());
    let object = fresh.clone();
    let (result, _) = run_scenario(
        &fresh,
        ctx,
        |mut server| async move {
            let call = server.expect("PATCH", POLICY_PATH).await;
            assert_eq!(call.content_type, "application/json-patch+json");
            let added = call
                .body
                .as_array()
                .unwrap()
                .iter()
                .find(|op| op["op"] == "add")
                .unwrap();
            assert_eq!(added["value"], json!(["understudy.dev/cleanup"]));
            let mut stored = object;
            stored["metadata"]["finalizers"] = json!(["understudy.dev/cleanup"]);
            call.answer(200, &stored);
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());

    // Second pass, finalizer in place: the epoch Lease is created for the home pool at epoch 0,
    // owned by nobody so that it outlives the policy, and the status says so.
    let object = policy();
    let (ctx, server) = context(Vec::new());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(404, &status(404, "NotFound", "leases \"llama-epoch\" not found"));
            let create = server.expect("POST", LEASES_PATH).await;
            assert_eq!(create.body["metadata"]["name"], "llama-epoch");
            assert_eq!(create.body["spec"]["holderIdentity"], "us-east");
            assert_eq!(
                create.body["metadata"]["annotations"]["understudy.dev/epoch"],
                "0"
            );
            assert!(
                create.body["metadata"].get("ownerReferences").is_none(),
                "a Lease owned by the policy would be deleted with it and its epoch start again at 0"
            );
            create.answer(201, &lease("us-east", 0, "41"));
            let patch = server.expect("PATCH", STATUS_PATH).await;
            assert!(patch.query.contains("force=true"), "{}", patch.query);
            assert_eq!(patch.content_type, "application/apply-patch+yaml");
            let applied = answer_status(patch, &stored);
            assert_eq!(applied["primaryPool"], "us-east");
            assert_eq!(applied["epoch"], 0);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["observedGeneration"], 1);
            assert_eq!(applied["conditions"]["Ready"]["status"], "True");
            assert_eq!(applied["conditions"]["Ready"]["reason"], "LeaseHeld");
            assert_eq!(
                applied["conditions"]["Ready"]["lastTransitionTime"],
                "2024-06-01T12:00:00Z"
            );
            assert_eq!(applied["failover"]["machine"]["epoch"], 0);
            server.expect_no_more().await
        },
        server,
    )
    .await;
    // Requeued after the probe interval (10s by default) to read the Lease again.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(reasons, ["LeaseCreated"]);
}

#[tokio::test]
async fn lost_compare_and_set_makes_no_further_writes() {
    // One round of checks: the standby passes twice, the primary refuses connections twice.
    let observations = vec![
        Observation::Check {
            pool: Pool::B,
            result: CheckResult::Pass,
        },
        Observation::Check {
            pool: Pool::B,
            result: CheckResult::Pass,
        },
        Observation::Check {
            pool: Pool::A,
            result: CheckResult::HardFail,
        },
        Observation::Check {
            pool: Pool::A,
            result: CheckResult::HardFail,
        },
    ];
    let object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    let (ctx, server) = context(observations);
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            // The promotion is recorded before the Lease is touched.
            let intent = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(intent["state"], "Promoting");
            assert_eq!(intent["failover"]["machine"]["phase"]["Promoting"]["epoch"], 1);
            let put = server.expect("PUT", LEASE_PATH).await;
            assert_eq!(put.body["metadata"]["resourceVersion"], "41");
            assert_eq!(put.body["spec"]["holderIdentity"], "us-west");
            assert_eq!(put.body["metadata"]["annotations"]["understudy.dev/epoch"], "1");
            // Another operator moved the Lease first.
            put.answer(409, &status(409, "Conflict", "the object has been modified"));
            server.expect_no_more().await
        },
        server,
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.category(), "lost_race", "{error}");
    assert!(events.is_empty(), "the loser published {events:?}");
}

/// The record an operator leaves when it dies after claiming epoch 2 for us-west, fencing and
/// waking (both handed off), before scaling.
fn record_stopped_at_scale() -> OperatorRecord {
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

#[tokio::test]
async fn operator_restarted_mid_promotion_finishes_with_the_same_epoch() {
    let mut object = with_record(policy(), &record_stopped_at_scale());
    // The command that started it is still on the object; it must not be replayed.
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(Vec::new());
    let metrics = ctx.metrics.clone();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 2, "57"));
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(1));
            let scale = server.expect("PATCH", &format!("{WEST_PATH}/scale")).await;
            assert_eq!(scale.body["spec"]["replicas"], 4);
            scale.answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(3));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["epoch"], 2);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            // Ready claims the Lease, not a route nobody pushed.
            assert_eq!(applied["conditions"]["Ready"]["reason"], "LeaseHeld");
            let message = applied["conditions"]["Ready"]["message"].as_str().unwrap();
            assert!(message.contains("not checked here"), "{message}");
            let timeline = &applied["lastFailover"];
            assert_eq!(timeline["epoch"], 2);
            assert_eq!(timeline["kind"], "failover");
            assert_eq!(timeline["finishedAt"], "2024-06-01T12:00:00Z");
            // The steps no call was made for say so, those of the last operator included.
            let steps = steps_of(timeline);
            let expected = [
                ("LeaseClaimed", false),
                ("Fenced", true),
                ("Woken", true),
                ("ScaledUp", false),
                ("Serving", false),
                ("Routed", true),
                ("AdmissionOpened", true),
            ]
            .map(|(s, h)| (s.to_owned(), h));
            assert_eq!(steps, expected);
            let routed = timeline["steps"][5]["note"].as_str().unwrap();
            assert!(routed.contains("no route was pushed"), "{routed}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let reasons = reasons(&events);
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
    assert!(
        !reasons.contains(&"PromotionStarted"),
        "promoted twice: {reasons:?}"
    );
    // The whole timeline, step by step, in one Event.
    let told = events.iter().find(|e| e.reason == "FailoverTimeline").unwrap();
    assert!(
        told.note
            .starts_with("Failover us-east → us-west at epoch 2: decided at "),
        "{}",
        told.note
    );
    assert!(
        told.note.contains("LeaseClaimed ") && told.note.contains("AdmissionOpened "),
        "{}",
        told.note
    );
    // The steps this version hands to later components say so.
    let routed = events
        .iter()
        .find(|e| e.reason == "StepHandedOff" && e.note.starts_with("Routed"))
        .unwrap();
    assert!(routed.note.contains("no route was pushed"), "{}", routed.note);
    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"understudy_failovers_total{namespace="serving",policy="llama",kind="manual"} 1"#),
        "{text}"
    );
}

/// Routers as the route push reports them: the route step answers `route`, every other step is
/// done without a note.
#[derive(Debug)]
struct Routers {
    route: StepReport,
}

impl StepExecutor for Routers {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> futures::future::BoxFuture<'a, StepReport> {
        let report = match request.step {
            Step::Route => self.route.clone(),
            _ => StepReport::Done {
                carried_by: "router",
                note: None,
            },
        };
        Box::pin(async move { report })
    }
}

/// A reconcile of a promotion stopped at scale, with `route` for the route step: the Lease read,
/// the scale-up, the serving check, then whatever `scenario` expects next.
async fn reconcile_to_the_route<F>(
    route: StepReport,
    scenario: impl FnOnce(ApiServer, Value) -> F + Send + 'static,
) -> (
    Result<Action, understudy_operator::controller::Error>,
    Vec<Published>,
)
where
    F: Future<Output = Vec<Published>> + Send + 'static,
{
    let object = with_record(policy(), &record_stopped_at_scale());
    let (ctx, server) = context(Vec::new());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_steps(Arc::new(Routers { route })),
    );
    let stored = object.clone();
    run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 2, "57"));
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(3));
            scenario(server, stored).await
        },
        server,
    )
    .await
}

#[tokio::test]
async fn a_route_a_router_refuses_as_stale_is_told_in_a_warning_and_the_promotion_waits_at_the_route() {
    let refused = StepReport::Refused {
        carried_by: "router",
        reason: "RouteStale",
        note: "router http://r:9091 has seen epoch 3 (pool us-east); ours is 2 for us-west".into(),
    };
    let (result, events) = reconcile_to_the_route(refused, |mut server, stored| async move {
        let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
        assert_eq!(applied["state"], "Promoting");
        let steps = steps_of(&applied["lastFailover"]);
        assert!(
            !steps.iter().any(|(s, _)| s == "Routed"),
            "a refused route is in the timeline: {steps:?}"
        );
        server.expect_no_more().await
    })
    .await;
    // Looked at again soon: the next reconcile reads the Lease before it pushes again.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(2)));
    let stale = events.iter().find(|e| e.reason == "RouteStale").unwrap();
    assert_eq!(stale.type_, "Warning");
    assert!(
        stale.note.contains("epoch 3") && stale.note.contains("ours is 2"),
        "{}",
        stale.note
    );
    assert!(
        !reasons(&events).contains(&"PromotionFinished"),
        "{:?}",
        reasons(&events)
    );
}

#[tokio::test]
async fn a_route_every_router_took_is_in_the_timeline_as_done_with_the_routers_note() {
    let taken = StepReport::Done {
        carried_by: "router",
        note: Some("pushed to all 2 router(s): us-west at epoch 2, 3 endpoint(s)".into()),
    };
    let (result, events) = reconcile_to_the_route(taken, |mut server, stored| async move {
        let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
        assert_eq!(applied["state"], "Serving");
        let timeline = &applied["lastFailover"];
        let steps = steps_of(timeline);
        assert!(steps.contains(&("Routed".to_owned(), false)), "{steps:?}");
        assert!(
            steps.contains(&("AdmissionOpened".to_owned(), false)),
            "{steps:?}"
        );
        let routed = timeline["steps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["step"] == "Routed")
            .unwrap();
        assert_eq!(
            routed["note"],
            "pushed to all 2 router(s): us-west at epoch 2, 3 endpoint(s)"
        );
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    let reasons = reasons(&events);
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
    assert!(!reasons.contains(&"StepHandedOff"), "{reasons:?}");
}

#[tokio::test]
async fn operator_restarted_after_its_lease_write_resumes_without_a_second_compare_and_set() {
    // The write-ahead record says epoch 3 for us-west at the lease step; the operator died after
    // its compare-and-set landed but before it could record it.
    let machine = FailoverState {
        phase: Phase::Promoting(Promotion {
            kind: TransitionKind::Manual,
            from: Pool::A,
            to: Pool::B,
            epoch: Epoch(3),
            step: Step::AcquireLease,
            started_at: NOW - Duration::from_secs(5),
            done: Vec::new(),
            fault_seen_at: None,
        }),
        ..FailoverState::starting_at(Pool::A, Epoch(2))
    };
    let object = with_record(policy(), &record(machine, Some("failover")));
    let (ctx, server) = context(Vec::new());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 3, "58"));
            // No PUT to the Lease: the next request is the workload, not a compare-and-set.
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(4));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["epoch"], 3);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["lastFailover"]["epoch"], 3);
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let reasons = reasons(&events);
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
    assert!(!reasons.contains(&"EpochAdopted"), "{reasons:?}");
}

#[tokio::test]
async fn a_failed_final_status_write_tells_and_counts_nothing_that_will_run_again() {
    let object = with_record(policy(), &record_stopped_at_scale());
    let (ctx, server) = context(Vec::new());
    let metrics = ctx.metrics.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 2, "57"));
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(4));
            // The promotion finished, but the status that records it is refused.
            server.expect("PATCH", STATUS_PATH).await.answer(
                500,
                &status(500, "InternalError", "etcdserver: request timed out"),
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.category(), "status", "{error}");
    // The next reconcile resumes from the same record and finishes again: it tells and counts it
    // then, once.
    assert!(events.is_empty(), "{events:?}");
    let text = metrics.encode().unwrap();
    assert!(!text.contains("understudy_failovers_total{"), "{text}");
}

#[tokio::test]
async fn an_unreachable_lease_write_is_counted_as_the_control_plane_not_the_status() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(standby_proven());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            // The API server goes away between the write-ahead and the compare-and-set.
            server
                .expect("PUT", LEASE_PATH)
                .await
                .answer(503, &status(503, "ServiceUnavailable", "etcd is down"));
            server
                .expect("PATCH", STATUS_PATH)
                .await
                .answer(503, &status(503, "ServiceUnavailable", "etcd is down"));
            server.expect_no_more().await
        },
        server,
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.category(), "control_plane_unreachable", "{error}");
    // What the write-ahead recorded is told; what only the failed write held is not.
    assert_eq!(reasons(&events), ["PromotionStarted"]);
}

#[tokio::test]
async fn malformed_policy_is_reported_as_an_event_and_a_condition() {
    let mut object = policy();
    object["spec"]["pools"] = json!("us-east,us-west");
    let guarded = guard(&object);
    assert!(guarded.0.is_err(), "the fixture must not deserialize");
    let (ctx, server) = context(Vec::new());
    let raw = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            // The stored object is read for its Ready condition; it has none yet.
            server.expect("GET", POLICY_PATH).await.answer(200, &raw);
            let patch = server.expect("PATCH", STATUS_PATH).await;
            assert_eq!(patch.content_type, "application/merge-patch+json");
            let ready = patch.body["status"]["conditions"]["Ready"].clone();
            assert_eq!(ready["status"], "False");
            assert_eq!(ready["reason"], "InvalidSpec");
            let message = ready["message"].as_str().unwrap().to_lowercase();
            assert!(message.contains("expected a sequence"), "{ready}");
            assert_eq!(ready["lastTransitionTime"], "2024-06-01T12:00:00Z");
            assert_eq!(patch.body["status"]["state"], "InvalidSpec");
            // The answer is the stored object, which still does not deserialize.
            let mut stored = object_with_status(&patch.body);
            stored["spec"]["pools"] = json!("us-east,us-west");
            patch.answer(200, &stored);
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (events[0].type_.as_str(), events[0].reason.as_str()),
        ("Warning", "InvalidSpec")
    );
}

#[tokio::test]
async fn a_malformed_policy_reported_again_keeps_the_time_it_became_invalid() {
    let mut object = policy();
    object["spec"]["pools"] = json!(7);
    object["status"] = json!({"conditions": {"Ready": {
        "status": "False", "reason": "InvalidSpec", "message": "spec.pools: invalid type",
        "lastTransitionTime": "2024-06-01T11:00:00Z",
    }}});
    let (ctx, server) = context(Vec::new());
    let raw = object.clone();
    let (result, _) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server.expect("GET", POLICY_PATH).await.answer(200, &raw);
            let patch = server.expect("PATCH", STATUS_PATH).await;
            let ready = patch.body["status"]["conditions"]["Ready"].clone();
            assert_eq!(ready["reason"], "InvalidSpec");
            // Invalid all along: the time it became so stays, and a report that repeats itself
            // does not move the object on every reconcile.
            assert_eq!(ready["lastTransitionTime"], "2024-06-01T11:00:00Z");
            patch.answer(200, &raw);
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}

fn object_with_status(patch: &Value) -> Value {
    let mut stored = policy();
    stored["status"] = patch["status"].clone();
    stored
}

#[tokio::test]
async fn policy_that_breaks_a_rule_is_reported_the_same_way_and_nothing_else_is_touched() {
    let mut object = policy();
    object["spec"]["trigger"] = json!({"suspectAfter": 5, "promoteAfter": 3});
    let (ctx, server) = context(Vec::new());
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            let patch = server.expect("PATCH", STATUS_PATH).await;
            let ready = patch.body["status"]["conditions"]["Ready"].clone();
            assert_eq!(ready["reason"], "InvalidSpec");
            assert!(
                ready["message"].as_str().unwrap().contains("promoteAfter"),
                "{ready}"
            );
            let stored = object_with_status(&patch.body);
            patch.answer(200, &stored);
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].reason, "InvalidSpec");
    assert!(events[0].note.contains("promoteAfter"), "{}", events[0].note);
}

#[tokio::test]
async fn unreachable_api_server_pauses_control_and_never_fails_over() {
    // The primary has failed its checks past the trigger (four in a row), the standby is proven,
    // and a failover command waits on the object: everything a promotion needs, except the
    // Lease, which cannot be read.
    let mut machine = FailoverState::starting_at(Pool::A, Epoch(3));
    machine.phase = Phase::Suspect;
    machine.health[Pool::A.index()] = PoolHealth {
        failures: 4,
        ..PoolHealth::default()
    };
    machine.health[Pool::B.index()].passes = 5;
    let recorded = with_record(policy(), &record(machine, None));
    let mut object = recorded.clone();
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, mut server) = context(Vec::new());
    server.event_answer = 503;
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(503, &status(503, "ServiceUnavailable", "etcd is down"));
            // A best-effort status saying control is paused; no Lease write anywhere.
            let patch = server.expect("PATCH", STATUS_PATH).await;
            let applied = patch.body["status"].clone();
            patch.answer(503, &status(503, "ServiceUnavailable", "etcd is down"));
            assert_eq!(applied["epoch"], 3);
            assert_eq!(applied["primaryPool"], "us-east");
            // Stranded, not Promoting: the failing primary keeps its role.
            assert_eq!(applied["state"], "Stranded");
            assert_eq!(
                applied["conditions"]["Ready"]["reason"],
                "ControlPlaneUnreachable"
            );
            // The command is not consumed: it waits for the control plane to come back.
            assert!(applied["failover"].get("handledCommand").is_none(), "{applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.category(), "control_plane_unreachable", "{error}");
    assert_eq!(reasons(&events), ["ControlPlaneUnreachable", "PromotionBlocked"]);
    let blocked = &events[1];
    assert!(
        blocked.note.contains("ControlPlaneUnreachable"),
        "{}",
        blocked.note
    );

    // The API server is back; the command was withdrawn meanwhile, and the prober's fresh round
    // finds the primary passing. The failure count in the record is stale: judged together with
    // the fresh check, nothing is promoted.
    let (ctx, server) = context(vec![Observation::Check {
        pool: Pool::A,
        result: CheckResult::Pass,
    }]);
    let stored = recorded.clone();
    let (result, events) = run_scenario(
        &recorded,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 3, "77"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["epoch"], 3);
            assert_eq!(applied["primaryPool"], "us-east");
            // Nothing after the status: no write-ahead, no compare-and-set.
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    assert_eq!(reasons(&events), ["PrimaryRecovered"]);
}

#[tokio::test]
async fn a_failed_reconcile_goes_through_the_error_policy_and_the_loop_carries_on() {
    tokio::time::pause();
    let object = policy();
    let (ctx, server) = context(Vec::new());
    let metrics = ctx.metrics.clone();
    let stored = object.clone();
    let verifier = tokio::spawn(async move {
        let mut server = server;
        // First attempt: the API server is overloaded.
        server.expect("GET", LEASE_PATH).await.answer(
            500,
            &status(500, "InternalError", "etcdserver: request timed out"),
        );
        // The retry, after the error policy's backoff, goes through.
        server
            .expect("GET", LEASE_PATH)
            .await
            .answer(200, &lease("us-east", 0, "41"));
        let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
        assert_eq!(applied["state"], "Serving");
        server
    });

    let (reader, mut writer) = reflector::store::<DeserializeGuard<FailoverPolicy>>();
    let policy_object: DeserializeGuard<FailoverPolicy> = serde_json::from_value(object.clone()).unwrap();
    // As a watcher's first list would: the loop waits for the store to be initialised.
    writer.apply_watcher_event(&watcher::Event::Init);
    writer.apply_watcher_event(&watcher::Event::InitApply(policy_object.clone()));
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let (queue_tx, queue_rx) = futures::channel::mpsc::unbounded();
    queue_tx
        .unbounded_send(ObjectRef::from_obj(&policy_object))
        .unwrap();
    let outcomes: Vec<_> = tokio::time::timeout(
        Duration::from_secs(60),
        applier(
            |object, ctx| Box::pin(reconcile(object, ctx)),
            error_policy,
            ctx,
            reader,
            queue_rx.map(Ok::<_, std::convert::Infallible>),
            Config::default(),
        )
        .take(2)
        .collect(),
    )
    .await
    .expect("the loop stalled");
    drop(queue_tx);

    assert!(outcomes[0].is_err(), "{:?}", outcomes[0]);
    let (reconciled, action) = outcomes[1].as_ref().unwrap();
    assert_eq!(reconciled.name, NAME);
    assert_eq!(*action, Action::requeue(Duration::from_secs(10)));
    let _server = tokio::time::timeout(TIMEOUT, verifier).await.unwrap().unwrap();

    let text = metrics.encode().unwrap();
    assert!(text.contains("understudy_reconciliations_total 2"), "{text}");
    assert!(
        text.contains(r#"understudy_reconcile_errors_total{category="control_plane_unreachable"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_command_promotes_a_proven_standby_and_waits_for_it_to_serve() {
    // The prober saw the standby pass twice, which proves it; then a person asks for a failover.
    let observations = vec![
        Observation::Check {
            pool: Pool::B,
            result: CheckResult::Pass,
        },
        Observation::Check {
            pool: Pool::B,
            result: CheckResult::Pass,
        },
    ];
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover@drill-7"});
    let (ctx, server) = context(observations);
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let intent = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(intent["failover"]["handledCommand"]["value"], "failover@drill-7");
            let put = server.expect("PUT", LEASE_PATH).await;
            assert_eq!(put.body["metadata"]["annotations"]["understudy.dev/epoch"], "1");
            put.answer(200, &lease("us-west", 1, "42"));
            // Already at its serving size: nothing is written to the workload.
            server.expect("GET", &format!("{WEST_PATH}/scale")).await.answer(
                200,
                &json!({
                    "apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {"name": "vllm-west", "namespace": NS},
                    "spec": {"replicas": 4}, "status": {"replicas": 4},
                }),
            );
            // Two of four ready is not a majority: the promotion waits here.
            server.expect("GET", WEST_PATH).await.answer(
                200,
                &json!({
                    "apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": "vllm-west", "namespace": NS},
                    "status": {"replicas": 4, "readyReplicas": 2},
                }),
            );
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Promoting");
            assert_eq!(applied["epoch"], 1);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["conditions"]["Ready"]["reason"], "Promoting");
            let steps: Vec<&str> = applied["lastFailover"]["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["step"].as_str().unwrap())
                .collect();
            assert_eq!(steps, ["LeaseClaimed", "Fenced", "Woken", "ScaledUp"]);
            assert!(applied["lastFailover"].get("finishedAt").is_none());
            server.expect_no_more().await
        },
        server,
    )
    .await;
    // Looked at again soon, not after a whole probe interval.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(2)));
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.contains(&"PromotionStarted"), "{reasons:?}");
    assert!(reasons.contains(&"StepWaiting"), "{reasons:?}");
    assert!(!reasons.contains(&"PromotionFinished"), "{reasons:?}");
}

#[tokio::test]
async fn a_failover_command_is_refused_for_a_standby_never_seen_to_pass() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    // No prober: no observation ever came.
    let (ctx, server) = context(Vec::new());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["epoch"], 0);
            // Refused is handled: it is not tried again on every reconcile.
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    assert_eq!(reasons(&events), ["CommandRefused"]);
    assert_eq!(events[0].type_, "Warning");
    assert!(
        events[0].note.contains("StandbyNotEligible"),
        "{}",
        events[0].note
    );
}

#[tokio::test]
async fn force_failover_promotes_a_standby_nothing_vouches_for() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), Some("failover")),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "force-failover"});
    let (ctx, server) = context(Vec::new());
    let metrics = ctx.metrics.clone();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let intent = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(
                intent["failover"]["machine"]["phase"]["Promoting"]["kind"],
                "Forced"
            );
            let put = server.expect("PUT", LEASE_PATH).await;
            assert_eq!(put.body["metadata"]["resourceVersion"], "41");
            assert_eq!(put.body["spec"]["holderIdentity"], "us-west");
            assert_eq!(put.body["metadata"]["annotations"]["understudy.dev/epoch"], "1");
            put.answer(200, &lease("us-west", 1, "42"));
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(4));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["epoch"], 1);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "force-failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let reasons = reasons(&events);
    assert!(reasons.contains(&"PromotionStarted"), "{reasons:?}");
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"understudy_failovers_total{namespace="serving",policy="llama",kind="forced"} 1"#),
        "{text}"
    );
}

/// The default policy under maintenance: `spec.paused`.
fn paused_policy() -> Value {
    let mut object = policy();
    object["spec"]["paused"] = json!(true);
    object
}

/// The controller's clock stopped `elapsed` after [`NOW`], for a scenario of several probe rounds.
#[derive(Debug)]
struct After(Duration);

impl Clock for After {
    fn now(&self) -> Duration {
        NOW + self.0
    }
}

#[tokio::test]
async fn a_paused_policy_never_promotes_however_long_its_primary_fails_and_warns_once_why() {
    // Eight probe rounds, one reconcile each, ten seconds (the probe interval) apart: the standby
    // passes every round and is proven by the second, the primary fails every round, twice the
    // default promoteAfter (4). Unpaused, the fourth round would promote.
    let mut object = with_record(
        paused_policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(3)), None),
    );
    let mut told = Vec::new();
    for round in 1..=8_u32 {
        let (ctx, server) = context(vec![
            Observation::Check {
                pool: Pool::B,
                result: CheckResult::Pass,
            },
            Observation::Check {
                pool: Pool::A,
                result: CheckResult::SoftFail,
            },
        ]);
        let elapsed = Duration::from_secs(10 * u64::from(round));
        let ctx = Arc::new(Arc::into_inner(ctx).unwrap().with_clock(Arc::new(After(elapsed))));
        let stored = object.clone();
        let (applied, done) = tokio::sync::oneshot::channel();
        let (result, events) = run_scenario(
            &object,
            ctx,
            |mut server| async move {
                server
                    .expect("GET", LEASE_PATH)
                    .await
                    .answer(200, &lease("us-east", 3, "41"));
                // The status and nothing after it: no write-ahead of a promotion, no
                // compare-and-set on the Lease.
                let patch = server.expect("PATCH", STATUS_PATH).await;
                applied.send(answer_status(patch, &stored)).unwrap();
                server.expect_no_more().await
            },
            server,
        )
        .await;
        assert_eq!(
            result.unwrap(),
            Action::requeue(Duration::from_secs(10)),
            "round {round}"
        );
        let applied = done.await.unwrap();
        let state = match round {
            1 => "Serving",
            2 | 3 => "Suspect",
            _ => "Stranded",
        };
        assert_eq!(applied["state"], state, "round {round}");
        assert_eq!(applied["epoch"], 3, "round {round}");
        assert_eq!(applied["primaryPool"], "us-east", "round {round}");
        // Every failed check is counted: the pause, not a lost observation, holds the standby back.
        assert_eq!(
            applied["failover"]["machine"]["health"][0]["failures"], round,
            "round {round}"
        );
        told.extend(events.into_iter().map(|e| (round, e)));
        object["status"] = applied;
    }

    let status = &object["status"];
    assert_eq!(
        status["conditions"]["StandbyProven"]["status"], "True",
        "{status}"
    );
    // Status names the pause as what holds the standby back, and the way past it.
    let ready = &status["conditions"]["Ready"];
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "Paused");
    assert_eq!(
        ready["message"],
        "us-east is failing and spec.paused holds us-west back: nothing fails over on its own while \
         paused (the understudy.dev/command annotation still does)"
    );
    // Stranded since the fourth round, and not stamped again by the four after it.
    assert_eq!(ready["lastTransitionTime"], "2024-06-01T12:00:40Z");
    assert!(status.get("lastFailover").is_none(), "{status}");
    // The block is told once, when it begins, not every round.
    let reasons: Vec<(u32, &str)> = told.iter().map(|(r, e)| (*r, e.reason.as_str())).collect();
    assert_eq!(reasons, [(2, "PrimarySuspect"), (4, "PromotionBlocked")]);
    let (_, blocked) = &told[1];
    assert_eq!(blocked.type_, "Warning");
    assert_eq!(
        blocked.note,
        "the primary is failing and nothing can be promoted: Paused"
    );
}

#[tokio::test]
async fn a_failover_command_still_switches_a_paused_policy_over_to_its_proven_standby() {
    // Paused, and stranded by it: the primary failed eight checks, the standby passed eight.
    // A person decides to fail over anyway; the pause stops only automatic promotion.
    let mut machine = FailoverState::starting_at(Pool::A, Epoch(3));
    machine.phase = Phase::Stranded;
    machine.health[Pool::A.index()] = PoolHealth {
        failures: 8,
        ..PoolHealth::default()
    };
    machine.health[Pool::B.index()].passes = 8;
    let mut object = with_record(paused_policy(), &record(machine, None));
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(Vec::new());
    let metrics = ctx.metrics.clone();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 3, "41"));
            let intent = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            let promotion = &intent["failover"]["machine"]["phase"]["Promoting"];
            assert_eq!(promotion["kind"], "Manual", "{intent}");
            assert_eq!(promotion["epoch"], 4, "{intent}");
            let put = server.expect("PUT", LEASE_PATH).await;
            assert_eq!(put.body["metadata"]["resourceVersion"], "41");
            assert_eq!(put.body["spec"]["holderIdentity"], "us-west");
            assert_eq!(put.body["metadata"]["annotations"]["understudy.dev/epoch"], "4");
            put.answer(200, &lease("us-west", 4, "42"));
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(4));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["epoch"], 4);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["lastFailover"]["kind"], "failover");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let reasons = reasons(&events);
    assert!(!reasons.contains(&"CommandRefused"), "{reasons:?}");
    let started = events.iter().find(|e| e.reason == "PromotionStarted").unwrap();
    assert_eq!(started.note, "Manual: promoting us-west over us-east at epoch 4");
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"understudy_failovers_total{namespace="serving",policy="llama",kind="manual"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_spec_edit_does_not_replay_a_command_left_on_the_object() {
    // The command ran at generation 1 (recorded by an operator that still wrote the generation);
    // then someone edited the spec. The standby is proven, so a replay would promote it.
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["status"]["failover"]["handledCommand"] = json!({"value": "failover", "generation": 1});
    object["metadata"]["generation"] = json!(2);
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(standby_proven());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["observedGeneration"], 2);
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    assert!(!reasons(&events).contains(&"PromotionStarted"), "{events:?}");
}

#[tokio::test]
async fn removing_the_command_annotation_forgets_it_so_the_same_value_can_be_given_again() {
    let object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), Some("failover")),
    );
    let (ctx, server) = context(Vec::new());
    let stored = object.clone();
    let (result, _) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert!(applied["failover"].get("handledCommand").is_none(), "{applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test]
async fn a_garbled_machine_record_does_not_replay_the_handled_command() {
    let mut object = policy();
    object["status"] = json!({
        "epoch": 0,
        "primaryPool": "us-east",
        "failover": {"machine": {"primary": "nobody"}, "handledCommand": {"value": "failover"}},
    });
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(standby_proven());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            // The machine starts afresh from the Lease and the record is whole again.
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["failover"]["machine"]["epoch"], 0);
            assert_eq!(applied["failover"]["machine"]["primary"], "A");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    assert!(!reasons(&events).contains(&"PromotionStarted"), "{events:?}");
}

#[tokio::test]
async fn a_command_whose_record_is_unreadable_is_not_run_and_says_so() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["status"]["failover"]["handledCommand"] = json!(["fail", "over"]);
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(standby_proven());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(reasons(&events), ["CommandNotRun"]);
    assert!(events[0].note.contains("@token"), "{}", events[0].note);
}

#[tokio::test]
async fn a_recreated_policy_adopts_its_surviving_lease_and_reruns_the_steps_after_it() {
    // The policy was deleted and created again: no status at all, but its epoch Lease outlived it
    // and names us-west at epoch 4.
    let object = policy();
    let (ctx, server) = context(Vec::new());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 4, "90"));
            // No new Lease and no compare-and-set: the steps after the lease write, for its holder.
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(4));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["epoch"], 4);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["state"], "Serving");
            let timeline = &applied["lastFailover"];
            assert_eq!(timeline["epoch"], 4);
            let steps: Vec<String> = steps_of(timeline).into_iter().map(|(s, _)| s).collect();
            assert_eq!(
                steps,
                [
                    "LeaseClaimed",
                    "Fenced",
                    "Woken",
                    "ScaledUp",
                    "Serving",
                    "Routed",
                    "AdmissionOpened"
                ]
            );
            let claimed = timeline["steps"][0]["note"].as_str().unwrap();
            assert!(claimed.contains("another writer"), "{claimed}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let reasons = reasons(&events);
    assert!(reasons.contains(&"EpochAdopted"), "{reasons:?}");
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
}

#[tokio::test]
async fn a_lease_below_the_recorded_epoch_is_reported_and_nothing_is_acted_on() {
    // Status says us-west at epoch 5; somebody recreated the Lease by hand at epoch 2. A proven
    // standby and a command are there too: neither may act on the lower epoch.
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::B, Epoch(5)), None),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failback"});
    let (ctx, server) = context(vec![
        Observation::Check {
            pool: Pool::A,
            result: CheckResult::Pass,
        };
        2
    ]);
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 2, "12"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            let ready = &applied["conditions"]["Ready"];
            assert_eq!(ready["status"], "False");
            assert_eq!(ready["reason"], "LeaseRegressed");
            let message = ready["message"].as_str().unwrap();
            assert!(
                message.contains("epoch 2") && message.contains("epoch 5"),
                "{message}"
            );
            assert_eq!(applied["epoch"], 5);
            assert_eq!(applied["primaryPool"], "us-west");
            // The command waits for a Lease that can be trusted.
            assert!(applied["failover"].get("handledCommand").is_none(), "{applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    assert_eq!(reasons(&events), ["LeaseRegressed"]);
    assert_eq!(events[0].type_, "Warning");
    assert!(
        events[0].note.contains("epoch 2") && events[0].note.contains("epoch 5"),
        "{}",
        events[0].note
    );

    // Reported once: the next reconcile keeps the condition without another Event.
    let mut reported = object.clone();
    reported["status"]["conditions"] = json!({"Ready": {
        "status": "False", "reason": "LeaseRegressed", "message": "",
        "lastTransitionTime": "2024-06-01T11:00:00Z",
    }});
    let (ctx, server) = context(Vec::new());
    let stored = reported.clone();
    let (result, events) = run_scenario(
        &reported,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 2, "12"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(
                applied["conditions"]["Ready"]["lastTransitionTime"],
                "2024-06-01T11:00:00Z"
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert!(events.is_empty(), "{events:?}");
}

#[tokio::test]
async fn a_deleted_policy_only_releases_its_finalizer() {
    let mut object = policy();
    object["metadata"]["deletionTimestamp"] = json!("2024-06-01T11:59:00Z");
    let (ctx, server) = context(Vec::new());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            // No Lease write and no scaling: the pools keep serving, and the Lease stays for a
            // policy created again under the same name.
            let call = server.expect("PATCH", POLICY_PATH).await;
            assert_eq!(call.content_type, "application/json-patch+json");
            assert!(
                call.body
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|op| op["op"] == "remove"),
                "{}",
                call.body
            );
            let mut released = stored;
            released["metadata"]["finalizers"] = json!([]);
            call.answer(200, &released);
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert!(events.is_empty(), "{events:?}");
}

#[tokio::test]
async fn a_deleted_policy_that_no_longer_deserializes_can_still_go_away() {
    let mut object = policy();
    object["metadata"]["deletionTimestamp"] = json!("2024-06-01T11:59:00Z");
    object["metadata"]["finalizers"] = json!(["example.com/other", "understudy.dev/cleanup"]);
    object["spec"]["pools"] = json!(7);
    let (ctx, server) = context(Vec::new());
    let (result, _) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            let call = server.expect("PATCH", POLICY_PATH).await;
            assert_eq!(call.content_type, "application/merge-patch+json");
            // Compare-and-set on the version, keeping everybody else's finalizers.
            assert_eq!(call.body["metadata"]["resourceVersion"], "100");
            assert_eq!(call.body["metadata"]["finalizers"], json!(["example.com/other"]));
            call.answer(
                200,
                &json!({
                    "apiVersion": "understudy.dev/v1alpha1", "kind": "FailoverPolicy",
                    "metadata": {"name": NAME, "namespace": NS, "finalizers": ["example.com/other"]},
                }),
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}

const EAST_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/vllm-east";
const WEST_RESERVE_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/llama-us-west-reserve";
const EAST_RESERVE_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/llama-us-east-reserve";

/// Both pools keep two of their four replicas as a pilot light with the GPUs reserved.
fn reserving_policy() -> Value {
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
fn vllm(name: &str, zone: &str) -> Value {
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
fn deployment_list(items: Vec<Value>) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "DeploymentList",
        "metadata": {"resourceVersion": "500"},
        "items": items,
    })
}

/// The reserve of `pool` as the API server stores it, owned by the policy whose uid is `owner`.
fn stored_reserve(pool: &str, owner: &str) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {
            "name": format!("llama-{pool}-reserve"), "namespace": NS,
            "uid": format!("uid-of-{pool}-reserve"),
            "labels": {
                "app.kubernetes.io/name": "understudy",
                "app.kubernetes.io/component": "gpu-reserve",
                "understudy.dev/policy": NAME,
                "understudy.dev/pool": pool,
            },
            "ownerReferences": [{
                "apiVersion": "understudy.dev/v1alpha1", "kind": "FailoverPolicy",
                "name": NAME, "uid": owner, "controller": true,
            }],
        },
        "spec": {"replicas": 2},
    })
}

/// Expects the list of the policy's reserves, by their labels, and answers it with `items`.
async fn expect_reserve_list(server: &mut ApiServer, items: Vec<Value>) {
    let list = server.expect("GET", DEPLOYMENTS_PATH).await;
    let query = list
        .query
        .replace("%3D", "=")
        .replace("%2C", ",")
        .replace("%2F", "/");
    assert!(
        query.contains("labelSelector=app.kubernetes.io/component=gpu-reserve,understudy.dev/policy=llama"),
        "{query}"
    );
    list.answer(200, &deployment_list(items));
}

/// Answers a reserve apply with what was applied, and returns it.
fn answer_reserve(call: Call) -> Value {
    assert_eq!(call.content_type, "application/apply-patch+yaml");
    assert!(
        call.query.contains("fieldManager=understudy-operator"),
        "{}",
        call.query
    );
    assert!(call.query.contains("force=true"), "{}", call.query);
    let applied = call.body.clone();
    call.answer(200, &applied);
    applied
}

/// Answers the delete of a reserve, having checked it names the listed object by its uid.
fn answer_reserve_delete(call: Call, pool: &str) {
    assert_eq!(call.body["propagationPolicy"], "Background");
    assert_eq!(
        call.body["preconditions"]["uid"],
        format!("uid-of-{pool}-reserve"),
        "a reserve is deleted only as the object that was listed"
    );
    call.answer(200, &deleted(&format!("llama-{pool}-reserve")));
}

fn not_found(name: &str) -> Value {
    status(404, "NotFound", &format!("deployments.apps \"{name}\" not found"))
}

fn deleted(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Status", "status": "Success", "metadata": {},
        "details": {"name": name, "group": "apps", "kind": "deployments"},
    })
}

/// A scripted API server that lists the policy's reserves only where the scenario says so.
fn reserve_context() -> (Arc<Context>, ApiServer) {
    let (ctx, mut server) = context(Vec::new());
    server.read_on_the_side = None;
    (ctx, server)
}

#[tokio::test]
async fn the_standby_gets_a_gpu_reserve_shaped_like_its_workload_and_the_primary_gets_none() {
    let object = with_record(
        reserving_policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            expect_reserve_list(&mut server, Vec::new()).await;
            // The standby's template is read; us-east holds the Lease, so nothing of its own.
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &vllm("vllm-west", "us-west-2a"));
            // Not among the policy's reserves: the name is checked to be free first.
            server
                .expect("GET", WEST_RESERVE_PATH)
                .await
                .answer(404, &not_found("llama-us-west-reserve"));
            let reserve = answer_reserve(server.expect("PATCH", WEST_RESERVE_PATH).await);
            assert_eq!(reserve["kind"], "Deployment");
            assert_eq!(reserve["spec"]["replicas"], 2);
            assert_eq!(reserve["metadata"]["labels"]["understudy.dev/pool"], "us-west");
            assert_eq!(
                reserve["metadata"]["labels"]["app.kubernetes.io/component"],
                "gpu-reserve"
            );
            let owner = &reserve["metadata"]["ownerReferences"][0];
            assert_eq!(
                (&owner["kind"], &owner["uid"]),
                (&json!("FailoverPolicy"), &json!(UID))
            );
            let pod = &reserve["spec"]["template"]["spec"];
            assert_eq!(pod["priorityClassName"], "understudy-gpu-reserve");
            assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
            assert_eq!(
                pod["nodeSelector"],
                json!({"topology.kubernetes.io/zone": "us-west-2a"})
            );
            assert_eq!(pod["tolerations"][0]["key"], "nvidia.com/gpu");
            let container = &pod["containers"][0];
            assert_eq!(container["image"], "registry.k8s.io/pause:3.10");
            assert_eq!(
                container["resources"],
                json!({
                    "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
                    "limits": {"nvidia.com/gpu": "2"},
                })
            );
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(
                applied["gpuReserve"],
                json!({"pool": "us-west", "deployment": "llama-us-west-reserve", "replicas": 2})
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let held = events.iter().find(|e| e.reason == "GpuReserveHeld").unwrap();
    assert!(
        held.note.contains("2 pilot-light replicas of us-west"),
        "{}",
        held.note
    );

    // The next reconcile finds it among the policy's reserves and applies it again, telling
    // nobody: nothing changed.
    let mut object = object;
    object["status"]["gpuReserve"] =
        json!({"pool": "us-west", "deployment": "llama-us-west-reserve", "replicas": 2});
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            expect_reserve_list(&mut server, vec![stored_reserve("us-west", UID)]).await;
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &vllm("vllm-west", "us-west-2a"));
            answer_reserve(server.expect("PATCH", WEST_RESERVE_PATH).await);
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["gpuReserve"]["deployment"], "llama-us-west-reserve");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert!(events.is_empty(), "{events:?}");
}

#[tokio::test]
async fn after_a_failover_the_new_primarys_reserve_stays_until_its_replicas_are_ready() {
    let mut object = with_record(
        reserving_policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["status"]["gpuReserve"] =
        json!({"pool": "us-west", "deployment": "llama-us-west-reserve", "replicas": 2});
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "force-failover"});
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let intent = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            // Written ahead of the Lease: the reserve is not touched before the Lease moves.
            assert_eq!(intent["gpuReserve"]["pool"], "us-west");
            server
                .expect("PUT", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 1, "42"));
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(2));
            expect_reserve_list(&mut server, vec![stored_reserve("us-west", UID)]).await;
            // us-east, the new standby, gets a reserve for the pilot-light replicas it does not
            // run.
            server
                .expect("GET", EAST_PATH)
                .await
                .answer(200, &vllm("vllm-east", "us-east-1a"));
            // us-west holds the Lease now, but two of its four replicas are ready: its
            // placeholders stay, for its scaled-up pods to preempt, and are not deleted.
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(2));
            server
                .expect("GET", EAST_RESERVE_PATH)
                .await
                .answer(404, &not_found("llama-us-east-reserve"));
            let reserve = answer_reserve(server.expect("PATCH", EAST_RESERVE_PATH).await);
            assert_eq!(reserve["metadata"]["labels"]["understudy.dev/pool"], "us-east");
            assert_eq!(
                reserve["spec"]["template"]["spec"]["nodeSelector"]["topology.kubernetes.io/zone"],
                "us-east-1a"
            );
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(
                applied["gpuReserve"],
                json!({"pool": "us-east", "deployment": "llama-us-east-reserve", "replicas": 2})
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    let told = reasons(&events);
    assert!(!told.contains(&"GpuReserveReleased"), "{told:?}");
    assert!(told.contains(&"GpuReserveHeld"), "{told:?}");

    // Once all four of us-west's replicas are ready, its reserve goes, found by its labels: the
    // status records only us-east's.
    let mut object = with_record(
        reserving_policy(),
        &record(FailoverState::starting_at(Pool::B, Epoch(1)), None),
    );
    object["status"]["gpuReserve"] =
        json!({"pool": "us-east", "deployment": "llama-us-east-reserve", "replicas": 2});
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 1, "42"));
            expect_reserve_list(
                &mut server,
                vec![stored_reserve("us-east", UID), stored_reserve("us-west", UID)],
            )
            .await;
            server
                .expect("GET", EAST_PATH)
                .await
                .answer(200, &vllm("vllm-east", "us-east-1a"));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(4));
            answer_reserve_delete(server.expect("DELETE", WEST_RESERVE_PATH).await, "us-west");
            answer_reserve(server.expect("PATCH", EAST_RESERVE_PATH).await);
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["gpuReserve"]["pool"], "us-east");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(reasons(&events), ["GpuReserveReleased"]);
    assert!(
        events[0].note.contains("llama-us-west-reserve"),
        "{}",
        events[0].note
    );
}

#[tokio::test]
async fn an_old_primary_still_running_its_pilot_light_holds_no_reserve() {
    // us-west is primary after a failover; us-east, the standby now, still runs all four of its
    // replicas, so its pilot light holds its GPUs itself.
    let mut object = with_record(
        reserving_policy(),
        &record(FailoverState::starting_at(Pool::B, Epoch(1)), None),
    );
    object["status"]["gpuReserve"] =
        json!({"pool": "us-east", "deployment": "llama-us-east-reserve", "replicas": 2});
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 1, "42"));
            expect_reserve_list(&mut server, vec![stored_reserve("us-east", UID)]).await;
            let mut east = vllm("vllm-east", "us-east-1a");
            east["spec"]["replicas"] = json!(4);
            server.expect("GET", EAST_PATH).await.answer(200, &east);
            answer_reserve_delete(server.expect("DELETE", EAST_RESERVE_PATH).await, "us-east");
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert!(applied["gpuReserve"].is_null(), "{applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(reasons(&events), ["GpuReserveReleased"]);
}

#[tokio::test]
async fn turning_reserve_gpus_off_deletes_the_reserve() {
    let mut object = with_record(
        reserving_policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["spec"]["pools"][1]["standby"][1]["reserveGpus"] = json!(false);
    object["status"]["gpuReserve"] =
        json!({"pool": "us-west", "deployment": "llama-us-west-reserve", "replicas": 2});
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            expect_reserve_list(&mut server, vec![stored_reserve("us-west", UID)]).await;
            answer_reserve_delete(server.expect("DELETE", WEST_RESERVE_PATH).await, "us-west");
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert!(applied.get("gpuReserve").is_none(), "{applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(reasons(&events), ["GpuReserveReleased"]);
}

#[tokio::test]
async fn a_reserve_no_status_recorded_is_found_by_its_labels_and_deleted_but_never_anothers() {
    // A reserve was applied and the status write after it failed; then the spec stopped asking.
    // Beside it, a Deployment with the same labels that a policy of the same name, deleted and
    // created again, owned: not this policy's, so it is left to its own owner.
    let mut object = with_record(
        reserving_policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["spec"]["pools"][1]["standby"][1]["reserveGpus"] = json!(false);
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let mut anothers = stored_reserve("us-central", "uid-of-an-earlier-llama");
            anothers["metadata"]["name"] = json!("llama-us-central-reserve");
            expect_reserve_list(&mut server, vec![anothers, stored_reserve("us-west", UID)]).await;
            answer_reserve_delete(server.expect("DELETE", WEST_RESERVE_PATH).await, "us-west");
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert!(applied.get("gpuReserve").is_none(), "{applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(reasons(&events), ["GpuReserveReleased"]);
}

#[tokio::test]
async fn a_reserve_already_deleted_by_hand_is_dropped_from_the_status_and_nothing_is_deleted() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["status"]["gpuReserve"] =
        json!({"pool": "us-west", "deployment": "llama-us-west-reserve", "replicas": 2});
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            expect_reserve_list(&mut server, Vec::new()).await;
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert!(applied.get("gpuReserve").is_none(), "{applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert!(events.is_empty(), "nothing was deleted: {events:?}");
}

#[tokio::test]
async fn a_deployment_that_has_the_reserves_name_but_is_not_a_reserve_is_left_alone_and_reported() {
    let object = with_record(
        reserving_policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            expect_reserve_list(&mut server, Vec::new()).await;
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &vllm("vllm-west", "us-west-2a"));
            // Somebody's own Deployment, which happens to have the reserve's name.
            let mut theirs = vllm("llama-us-west-reserve", "us-west-2a");
            theirs["metadata"]["uid"] = json!("uid-of-theirs");
            server.expect("GET", WEST_RESERVE_PATH).await.answer(200, &theirs);
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert!(applied.get("gpuReserve").is_none(), "nothing is held: {applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.category(), "reserve");
    let failed = events.iter().find(|e| e.reason == "GpuReserveFailed").unwrap();
    assert_eq!(failed.type_, "Warning");
    assert!(
        failed
            .note
            .contains("llama-us-west-reserve exists and is not this policy's reserve"),
        "{}",
        failed.note
    );
}

#[tokio::test]
async fn a_reserve_the_operator_may_not_write_is_a_warning_and_the_status_is_still_written() {
    let object = with_record(
        reserving_policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    let (ctx, server) = reserve_context();
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            expect_reserve_list(&mut server, vec![stored_reserve("us-west", UID)]).await;
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &vllm("vllm-west", "us-west-2a"));
            server.expect("PATCH", WEST_RESERVE_PATH).await.answer(
                403,
                &status(403, "Forbidden", "deployments.apps is forbidden: cannot patch"),
            );
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert!(applied.get("gpuReserve").is_none(), "nothing is held: {applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.category(), "reserve");
    let failed = events.iter().find(|e| e.reason == "GpuReserveFailed").unwrap();
    assert_eq!(failed.type_, "Warning");
    assert!(failed.note.contains("llama-us-west-reserve"), "{}", failed.note);
}

/// The chart's ClusterRole with its template expressions blanked out, as YAML.
fn chart_cluster_role() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/understudy/templates/rbac.yaml"
    );
    let mut text = std::fs::read_to_string(path).unwrap();
    while let Some(start) = text.find("{{") {
        let end = start + text[start..].find("}}").unwrap() + 2;
        text.replace_range(start..end, "x");
    }
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| <Value as serde::Deserialize>::deserialize(document).unwrap())
        .find(|document| document["kind"] == "ClusterRole")
        .unwrap()
}

#[test]
fn the_chart_lets_the_operator_read_and_scale_every_kind_of_workload() {
    let role = chart_cluster_role();
    let granted = |group: &str, resource: &str, verb: &str| {
        role["rules"].as_array().unwrap().iter().any(|rule| {
            let has = |key: &str, want: &str| {
                rule[key]
                    .as_array()
                    .is_some_and(|values| values.iter().any(|v| v == want))
            };
            has("apiGroups", group) && has("resources", resource) && has("verbs", verb)
        })
    };
    // What a promotion does to a pool's workload: read it (its template, its ready replicas) and
    // grow it through its scale subresource.
    for (group, plural) in [
        ("apps", "deployments"),
        ("apps", "statefulsets"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets"),
    ] {
        assert!(granted(group, plural, "get"), "get {plural}");
        for verb in ["get", "patch", "update"] {
            assert!(
                granted(group, &format!("{plural}/scale"), verb),
                "{verb} {plural}/scale"
            );
        }
    }
    // GPU reserves: found by their labels, applied and deleted.
    for verb in ["list", "get", "create", "patch", "delete"] {
        assert!(granted("apps", "deployments", verb), "{verb} deployments");
    }
    // The probes list a pool's pods; a GameDay's crash deletes the primary's.
    for verb in ["list", "delete"] {
        assert!(granted("", "pods", verb), "{verb} pods");
    }
}

/// The golden answer a prober holds for every policy.
#[derive(Debug)]
struct HeldGolden(Option<GoldenAnswer>);

impl ProbeFindings for HeldGolden {
    fn golden_answer(&self, _: &ObjectRef<FailoverPolicy>) -> Option<GoldenAnswer> {
        self.0.clone()
    }
}

fn golden_answer(prompt: &str, recorded_at: Option<&str>) -> GoldenAnswer {
    GoldenAnswer {
        prefix: " Paris. It is also the l".to_owned(),
        prompt: prompt.to_owned(),
        max_tokens: 8,
        pool: "us-east".to_owned(),
        model: Some("meta-llama/Llama-3.1-8B".to_owned()),
        recorded_at: recorded_at.map(str::to_owned),
    }
}

/// The status one reconcile of `object` applies, between promotions with the Lease as recorded.
async fn applied_status(object: Value, ctx: Arc<Context>, server: ApiServer) -> Value {
    let stored = object.clone();
    let (applied, done) = tokio::sync::oneshot::channel();
    let (result, _) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let patch = server.expect("PATCH", STATUS_PATH).await;
            applied.send(answer_status(patch, &stored)).unwrap();
            server.expect_no_more().await
        },
        server,
    )
    .await;
    result.unwrap();
    done.await.unwrap()
}

#[tokio::test]
async fn the_golden_answer_the_probes_judge_by_is_applied_to_status_with_the_time_it_was_recorded() {
    const PROMPT: &str = "The capital of France is";
    // Just recorded by the prober: stamped with the reconcile's time.
    let (ctx, server) = context(Vec::new());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_findings(Arc::new(HeldGolden(Some(golden_answer(PROMPT, None))))),
    );
    let applied = applied_status(policy(), ctx, server).await;
    assert_eq!(
        applied["goldenAnswer"],
        json!({
            "prefix": " Paris. It is also the l", "prompt": PROMPT, "maxTokens": 8, "pool": "us-east",
            "model": "meta-llama/Llama-3.1-8B", "recordedAt": "2024-06-01T12:00:00Z",
        })
    );

    // The same answer already in status keeps the time it was first recorded.
    let mut object = policy();
    object["status"]["goldenAnswer"] = json!(golden_answer(PROMPT, Some("2024-05-01T08:00:00Z")));
    let (ctx, server) = context(Vec::new());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_findings(Arc::new(HeldGolden(Some(golden_answer(PROMPT, None))))),
    );
    let applied = applied_status(object.clone(), ctx, server).await;
    assert_eq!(applied["goldenAnswer"]["recordedAt"], "2024-05-01T08:00:00Z");

    // The prober dropped it (another prompt, another model): the apply leaves it out, so
    // server-side apply removes the field this manager owned.
    let (ctx, server) = context(Vec::new());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_findings(Arc::new(HeldGolden(None))),
    );
    let applied = applied_status(object.clone(), ctx, server).await;
    assert!(applied.get("goldenAnswer").is_none(), "{applied}");

    // A controller that does not probe keeps the one in status while it fits the probe.
    let (ctx, server) = context(Vec::new());
    let applied = applied_status(object, ctx, server).await;
    assert_eq!(applied["goldenAnswer"]["recordedAt"], "2024-05-01T08:00:00Z");
    let mut object = policy();
    object["status"]["goldenAnswer"] = json!(golden_answer("Another prompt", Some("2024-05-01T08:00:00Z")));
    let (ctx, server) = context(Vec::new());
    let applied = applied_status(object, ctx, server).await;
    assert!(applied.get("goldenAnswer").is_none(), "{applied}");
}

#[tokio::test(start_paused = true)]
async fn a_reconcile_the_api_server_leaves_unanswered_stalls_the_watchdog_until_it_finishes() {
    let mut fresh = policy();
    fresh["metadata"].as_object_mut().unwrap().remove("finalizers");
    let watchdog = Watchdog::new(Duration::from_secs(60));
    let (client, mut server) = support::client();
    let ctx = Context::new(client, Arc::new(Metrics::new()), None)
        .with_clock(Arc::new(FixedClock))
        .with_watchdog(watchdog.clone());
    let reconciling = tokio::spawn(reconcile(guard(&fresh), Arc::new(ctx)));
    // The finalizer patch goes unanswered for a minute.
    let call = server.expect("PATCH", POLICY_PATH).await;
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(watchdog.stall(), None);
    tokio::time::advance(Duration::from_secs(1)).await;
    let stall = watchdog
        .stall()
        .expect("a reconcile stuck for stall_after is a stall");
    assert_eq!(
        (stall.reconciler, stall.object.as_str()),
        (Reconciler::FailoverPolicy, "serving/llama")
    );
    let mut stored = fresh.clone();
    stored["metadata"]["finalizers"] = json!(["understudy.dev/cleanup"]);
    call.answer(200, &stored);
    assert_eq!(reconciling.await.unwrap().unwrap(), Action::await_change());
    assert_eq!(watchdog.stall(), None, "a finished reconcile is progress");
    server.expect_no_more().await;
}

/// Cluster tests: a real API server, the CRD installed, nothing else.
mod cluster {
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::api::{Api, DeleteParams, PostParams};

    use super::*;

    #[tokio::test]
    #[ignore = "needs a cluster: tests/cluster/e2e.sh runs it; elsewhere kubectl apply -f crds/ and cargo test -- --ignored"]
    async fn applied_policy_gets_a_status_and_an_epoch_lease() {
        let client = Client::try_default().await.unwrap();
        let namespace = client.default_namespace().to_owned();
        let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), &namespace);
        let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
        let mut object = policy();
        object["metadata"] = json!({"name": "understudy-cluster-test"});
        let _ = policies
            .delete("understudy-cluster-test", &DeleteParams::default())
            .await;
        policies
            .create(&PostParams::default(), &serde_json::from_value(object).unwrap())
            .await
            .unwrap();

        let ctx = Arc::new(Context::new(client, Arc::new(Metrics::new()), None));
        let controller = tokio::spawn(async move {
            understudy_operator::controller::run(ctx, Some(&namespace)).await;
        });
        let mut seen = None;
        for _ in 0..60 {
            let current = policies.get("understudy-cluster-test").await.unwrap();
            if current.status.as_ref().and_then(|s| s.epoch).is_some() {
                seen = Some(current);
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        controller.abort();
        let current = seen.expect("no status within a minute");
        let status = current.status.unwrap();
        assert_eq!(status.primary_pool.as_deref(), Some("us-east"));
        assert_eq!(status.epoch, Some(0));
        let lease = leases.get("understudy-cluster-test-epoch").await.unwrap();
        assert_eq!(
            lease.spec.and_then(|s| s.holder_identity).as_deref(),
            Some("us-east")
        );
        policies
            .delete("understudy-cluster-test", &DeleteParams::default())
            .await
            .unwrap();
    }

    #[tokio::test]
    #[ignore = "needs a cluster: tests/cluster/e2e.sh runs it; elsewhere kubectl apply -f crds/ and cargo test -- --ignored"]
    async fn a_policy_the_schema_refuses_never_reaches_the_controller() {
        let client = Client::try_default().await.unwrap();
        let policies: Api<FailoverPolicy> = Api::default_namespaced(client);
        let mut object = policy();
        object["metadata"] = json!({"name": "understudy-cluster-refused"});
        object["spec"]["trigger"] = json!({"suspectAfter": 5, "promoteAfter": 3});
        let refused = policies
            .create(&PostParams::default(), &serde_json::from_value(object).unwrap())
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("promoteAfter"), "{refused}");
    }

    #[tokio::test]
    #[ignore = "needs a cluster: tests/cluster/e2e.sh runs it; elsewhere kubectl apply -f crds/ and cargo test -- --ignored"]
    async fn a_standby_with_reserved_gpus_gets_placeholders_that_go_with_the_policy() {
        use k8s_openapi::api::apps::v1::Deployment;

        const POLICY: &str = "understudy-cluster-reserve";
        const RESERVE: &str = "understudy-cluster-reserve-us-west-reserve";
        let client = Client::try_default().await.unwrap();
        let namespace = client.default_namespace().to_owned();
        let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), &namespace);
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &namespace);
        // The standby's workload, at zero replicas: only its template matters here.
        let mut workload = vllm("vllm-west", "us-west-2a");
        workload["metadata"] = json!({"name": "vllm-west"});
        workload["spec"]["replicas"] = json!(0);
        workload.as_object_mut().unwrap().remove("status");
        let _ = deployments.delete("vllm-west", &DeleteParams::default()).await;
        deployments
            .create(&PostParams::default(), &serde_json::from_value(workload).unwrap())
            .await
            .unwrap();
        let mut object = reserving_policy();
        object["metadata"] = json!({"name": POLICY});
        let _ = policies.delete(POLICY, &DeleteParams::default()).await;
        policies
            .create(&PostParams::default(), &serde_json::from_value(object).unwrap())
            .await
            .unwrap();

        let ctx = Arc::new(Context::new(client, Arc::new(Metrics::new()), None));
        let run_namespace = namespace.clone();
        let controller = tokio::spawn(async move {
            understudy_operator::controller::run(ctx, Some(&run_namespace)).await;
        });
        let mut reserve = None;
        for _ in 0..60 {
            if let Some(found) = deployments.get_opt(RESERVE).await.unwrap() {
                reserve = Some(found);
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let reserve = reserve.expect("no reserve within a minute");
        assert_eq!(reserve.spec.as_ref().and_then(|s| s.replicas), Some(2));
        let owner = &reserve.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("FailoverPolicy", POLICY)
        );
        let status = policies.get(POLICY).await.unwrap().status.unwrap();
        assert_eq!(status.gpu_reserve.map(|r| r.deployment).as_deref(), Some(RESERVE));

        // Deleting the policy (the controller still running, to release its finalizer) takes
        // the placeholders with it, through the owner reference.
        policies.delete(POLICY, &DeleteParams::default()).await.unwrap();
        let mut gone = false;
        for _ in 0..60 {
            if deployments.get_opt(RESERVE).await.unwrap().is_none() {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        controller.abort();
        let _ = deployments.delete("vllm-west", &DeleteParams::default()).await;
        assert!(gone, "the reserve outlived its policy");
    }
}

/// Routers as the route sync reports them between promotions: one has seen a higher epoch.
#[derive(Debug)]
struct RouterAheadOfUs {
    asked: Mutex<Vec<(String, u64)>>,
}

impl StepExecutor for RouterAheadOfUs {
    fn carry_out<'a>(&'a self, _: StepRequest<'a>) -> futures::future::BoxFuture<'a, StepReport> {
        panic!("no step is carried out between promotions")
    }

    fn keep_route<'a>(
        &'a self,
        request: RouteSyncRequest<'a>,
    ) -> futures::future::BoxFuture<'a, RouteSyncReport> {
        self.asked
            .lock()
            .unwrap()
            .push((request.pool.name.clone(), request.epoch.0));
        Box::pin(async {
            RouteSyncReport {
                warnings: vec![(
                    "RouterAhead",
                    "router http://r:9091 has seen epoch 4 (pool us-west); ours is 0 for us-east".into(),
                )],
                view_stale: true,
            }
        })
    }
}

#[tokio::test]
async fn between_promotions_the_leases_route_is_kept_and_a_router_ahead_is_a_warning_and_a_soon_requeue() {
    let object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    let (ctx, server) = context(Vec::new());
    let routers = Arc::new(RouterAheadOfUs {
        asked: Mutex::new(Vec::new()),
    });
    let ctx = Arc::new(Arc::into_inner(ctx).unwrap().with_steps(routers.clone()));
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(*routers.asked.lock().unwrap(), [("us-east".to_owned(), 0)]);
    // Looked at again soon, so that the Lease is read again.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(2)));
    let ahead = events.iter().find(|e| e.reason == "RouterAhead").unwrap();
    assert_eq!(ahead.type_, "Warning");
    assert!(ahead.note.contains("epoch 4"), "{}", ahead.note);
}

/// A prober whose last comparison found the standby serving a shorter context.
#[derive(Debug)]
struct Drifted;

fn drifted() -> ParityStatus {
    ParityStatus {
        checked_at: "2024-06-01T11:59:55Z".to_owned(),
        compared: 9,
        drift: vec![ParityDrift {
            key: "flag.max-model-len".to_owned(),
            primary: Some("8192".to_owned()),
            standby: Some("4096".to_owned()),
        }],
        allowed: Vec::new(),
        not_compared: Vec::new(),
    }
}

impl ProbeFindings for Drifted {
    fn golden_answer(&self, _: &ObjectRef<FailoverPolicy>) -> Option<GoldenAnswer> {
        None
    }

    fn parity(&self, _: &ObjectRef<FailoverPolicy>) -> Option<ParityStatus> {
        Some(drifted())
    }
}

/// A proven standby that drifted, as a round reports it, and `command` on the policy.
fn drifted_standby(command: &str) -> (Value, Arc<Context>, ApiServer) {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": command});
    let mut observations = standby_proven();
    observations.push(Observation::Parity { holds: false });
    let (ctx, server) = context(observations);
    let ctx = Arc::new(Arc::into_inner(ctx).unwrap().with_findings(Arc::new(Drifted)));
    (object, ctx, server)
}

#[tokio::test]
async fn a_drifted_standby_is_not_switched_to_and_the_drift_is_told_key_by_key() {
    let (object, ctx, server) = drifted_standby("failover@drill-9");
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            // No Lease write: the one status write records the drift and the refusal.
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["epoch"], 0);
            assert_eq!(applied["parity"]["drift"][0]["key"], "flag.max-model-len");
            let condition = &applied["conditions"]["ParityHolds"];
            assert_eq!(condition["status"], "False");
            assert_eq!(condition["reason"], "Drift");
            assert_eq!(
                condition["message"],
                "us-west differs from us-east in 1 key(s): flag.max-model-len (8192 ≠ 4096); it is not \
                 promoted automatically (force-failover still promotes it)"
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    result.unwrap();
    let refused = events.iter().find(|e| e.reason == "CommandRefused").unwrap();
    assert!(refused.note.contains("ParityBroken"), "{}", refused.note);
    let drift = events.iter().find(|e| e.reason == "ParityDrift").unwrap();
    assert_eq!(drift.type_, "Warning");
    assert_eq!(
        drift.note,
        "us-west differs from us-east: flag.max-model-len (8192 ≠ 4096); it is not promoted \
         automatically until they agree (force-failover still promotes it)"
    );
}

#[tokio::test]
async fn force_failover_promotes_a_drifted_standby_and_records_what_it_overrode() {
    let (object, ctx, server) = drifted_standby("force-failover@drill-10");
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            server
                .expect("PUT", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 1, "42"));
            server
                .expect("GET", &format!("{WEST_PATH}/scale"))
                .await
                .answer(200, &west_scale(4));
            server
                .expect("GET", WEST_PATH)
                .await
                .answer(200, &west_deployment(4));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["primaryPool"], "us-west");
            let claimed = &applied["lastFailover"]["steps"][0];
            assert_eq!(claimed["step"], "LeaseClaimed");
            assert_eq!(
                claimed["note"],
                "promoted by force-failover past parity drift: flag.max-model-len (8192 ≠ 4096)"
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    result.unwrap();
    let overridden = events.iter().find(|e| e.reason == "ParityOverridden").unwrap();
    assert_eq!(overridden.type_, "Warning");
}
