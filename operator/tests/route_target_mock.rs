//! Route targets through a scripted API server: a promotion's Route step moves an HTTPRoute's
//! backendRefs' weights to the new primary (a replace at the version read, with the epoch in its
//! annotation) and is done only once its gateways accepted the generation written; a Service's
//! selector moves to the new primary's pod labels; the admission step opens nothing; and a
//! policy without `spec.route` goes to the routers' executor as before.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;

use serde_json::{Value, json};
use support::policy::{WEST_PATH, policy};
use support::{NS, play};
use understudy_core::Epoch;
use understudy_core::failover::Step;
use understudy_operator::crd::{EPOCH_ANNOTATION, FailoverPolicy};
use understudy_operator::ports::{HandOffToComponents, StepExecutor, StepReport, StepRequest};
use understudy_operator::route_target::RouteTargets;

const ROUTE: &str = "/apis/gateway.networking.k8s.io/v1/namespaces/serving/httproutes/llama";
const SERVICE: &str = "/api/v1/namespaces/serving/services/llama";

/// The fixture's policy with `route` as its `spec.route`.
fn routed(route: Value) -> FailoverPolicy {
    let mut policy = policy();
    policy["spec"]["route"] = route;
    serde_json::from_value(policy).unwrap()
}

fn http_route_target() -> Value {
    json!({"httpRoute": {"name": "llama", "backends": [
        {"pool": "us-east", "name": "vllm-east"},
        {"pool": "us-west", "kind": "InferencePool", "name": "vllm-west"},
    ]}})
}

/// The HTTPRoute at `generation`, sending to us-east, with its gateway's acceptance of
/// `accepted`.
fn http_route(generation: i64, east: u64, west: u64, accepted: i64) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "llama", "namespace": NS, "generation": generation, "resourceVersion": "7"},
        "spec": {
            "parentRefs": [{"name": "edge"}],
            "rules": [{"backendRefs": [
                {"name": "vllm-east", "port": 8000, "weight": east},
                {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm-west", "weight": west},
            ]}],
        },
        "status": {"parents": [{
            "parentRef": {"name": "edge"}, "controllerName": "example.com/gateway",
            "conditions": [{"type": "Accepted", "status": "True", "observedGeneration": accepted, "reason": "Accepted"}],
        }]},
    })
}

/// The HTTPRoute as the operator wrote it for us-west at epoch 1, its gateway having accepted
/// generation `accepted`.
fn written_at_epoch_1(accepted: i64) -> Value {
    let mut written = http_route(4, 0, 1, accepted);
    written["metadata"]["annotations"] = json!({EPOCH_ANNOTATION: "1"});
    written
}

fn request<'a>(policy: &'a FailoverPolicy, step: Step) -> StepRequest<'a> {
    StepRequest {
        policy,
        step,
        pool: &policy.spec.pools[1],
        epoch: Epoch(1),
        serving: None,
        overdue: None,
    }
}

fn targets(client: kube::Client) -> RouteTargets {
    RouteTargets::new(Arc::new(HandOffToComponents), client)
}

#[tokio::test]
async fn a_promotion_moves_the_httproutes_weights_and_waits_until_its_gateway_accepts_them() {
    let (client, mut server) = support::client();
    let policy = routed(http_route_target());
    let scenario = async move {
        server
            .expect("GET", ROUTE)
            .await
            .answer(200, &http_route(3, 1, 0, 3));
        let put = server.expect("PUT", ROUTE).await;
        let refs = &put.body["spec"]["rules"][0]["backendRefs"];
        assert_eq!(
            (refs[0]["weight"].clone(), refs[1]["weight"].clone()),
            (json!(0), json!(1))
        );
        assert_eq!(put.body["metadata"]["annotations"][EPOCH_ANNOTATION], "1");
        assert_eq!(
            put.body["metadata"]["resourceVersion"], "7",
            "replaced at the version read"
        );
        assert_eq!(put.body["spec"]["parentRefs"], json!([{"name": "edge"}]));
        put.answer(200, &http_route(4, 0, 1, 3));
        // The gateway has not seen generation 4 yet.
        server
            .expect("GET", ROUTE)
            .await
            .answer(200, &http_route(4, 0, 1, 3));
        // Next try: written already, only its acceptance is read.
        let written = written_at_epoch_1(4);
        server.expect("GET", ROUTE).await.answer(200, &written);
        server.expect("GET", ROUTE).await.answer(200, &written);
        server.expect_no_more().await;
    };
    let (reports, _) = play(scenario, async {
        let targets = targets(client);
        let first = targets.carry_out(request(&policy, Step::Route)).await;
        let second = targets.carry_out(request(&policy, Step::Route)).await;
        (first, second)
    })
    .await;
    let StepReport::NotYet { reason } = &reports.0 else {
        panic!("{:?}", reports.0)
    };
    assert!(reason.contains("generation 3 of it, not 4"), "{reason}");
    let StepReport::Done { note: Some(note), .. } = &reports.1 else {
        panic!("{:?}", reports.1)
    };
    assert_eq!(note, "HTTPRoute llama sends to us-west at epoch 1");
}

#[tokio::test]
async fn a_promotion_moves_the_services_selector_to_the_new_primarys_pods() {
    let (client, mut server) = support::client();
    let policy = routed(json!({"service": {"name": "llama"}}));
    let scenario = async move {
        server.expect("GET", WEST_PATH).await.answer(
            200,
            &json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "vllm-west", "namespace": NS},
                "spec": {"selector": {"matchLabels": {"app": "vllm-west"}}, "template": {}},
            }),
        );
        server.expect("GET", SERVICE).await.answer(
            200,
            &json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "llama", "namespace": NS, "resourceVersion": "9"},
                "spec": {"selector": {"app": "vllm-east", "tier": "gpu"}, "ports": [{"port": 80, "targetPort": 8000}]},
            }),
        );
        let patch = server.expect("PATCH", SERVICE).await;
        // A merge patch at the version read: the old pool's label goes, the rest is untouched.
        assert_eq!(
            patch.body,
            json!({
                "metadata": {"resourceVersion": "9", "annotations": {EPOCH_ANNOTATION: "1"}},
                "spec": {"selector": {"app": "vllm-west", "tier": null}},
            })
        );
        patch.answer(
            200,
            &json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llama"}}),
        );
        server.expect_no_more().await;
    };
    let (report, _) = play(scenario, async {
        targets(client).carry_out(request(&policy, Step::Route)).await
    })
    .await;
    assert!(
        matches!(&report, StepReport::Done { note: Some(note), .. } if note == "Service llama sends to us-west at epoch 1"),
        "{report:?}"
    );
}

#[tokio::test]
async fn without_a_router_no_admission_window_opens_and_a_policy_without_a_target_goes_to_the_routers() {
    let (client, server) = support::client();
    let routed = routed(http_route_target());
    let plain: FailoverPolicy = serde_json::from_value(policy()).unwrap();
    let (reports, _) = play(server.expect_no_more(), async {
        let targets = targets(client);
        let admission = targets.carry_out(request(&routed, Step::OpenAdmission)).await;
        let route = targets.carry_out(request(&plain, Step::Route)).await;
        (admission, route)
    })
    .await;
    assert!(
        matches!(&reports.0, StepReport::HandedOff { note, .. } if note.contains("no admission window")),
        "{:?}",
        reports.0
    );
    assert!(
        matches!(
            &reports.1,
            StepReport::HandedOff {
                carried_by: "router",
                ..
            }
        ),
        "{:?}",
        reports.1
    );
}

/// Past the deadline a route written is enough, whether its gateway has not seen it yet or
/// accepted it without resolving its backends; the note says which.
#[tokio::test]
async fn a_missing_route_refuses_the_step_and_past_the_deadline_a_route_written_is_enough() {
    let (client, mut server) = support::client();
    let policy = routed(http_route_target());
    let scenario = async move {
        server.expect("GET", ROUTE).await.answer(
            404,
            &support::status(404, "NotFound", "httproutes \"llama\" not found"),
        );
        let written = written_at_epoch_1(3);
        server.expect("GET", ROUTE).await.answer(200, &written);
        server.expect("GET", ROUTE).await.answer(200, &written);
        let mut unresolved = written_at_epoch_1(4);
        unresolved["status"]["parents"][0]["conditions"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "ResolvedRefs", "status": "False", "reason": "BackendNotFound"}));
        server.expect("GET", ROUTE).await.answer(200, &unresolved);
        server.expect("GET", ROUTE).await.answer(200, &unresolved);
        server.expect_no_more().await;
    };
    let (reports, _) = play(scenario, async {
        let targets = targets(client);
        let missing = targets.carry_out(request(&policy, Step::Route)).await;
        let overdue = || {
            let mut overdue = request(&policy, Step::Route);
            overdue.overdue = Some(std::time::Duration::from_secs(30));
            overdue
        };
        let late = targets.carry_out(overdue()).await;
        let unresolved = targets.carry_out(overdue()).await;
        (missing, late, unresolved)
    })
    .await;
    assert!(
        matches!(&reports.0, StepReport::Refused { reason: "RouteTargetRefused", note, .. } if note.contains("does not exist")),
        "{:?}",
        reports.0
    );
    let StepReport::Done { note: Some(note), .. } = &reports.1 else {
        panic!("{:?}", reports.1)
    };
    assert!(
        note.contains("past the promotion's deadline, not taken yet"),
        "{note}"
    );
    let StepReport::Done { note: Some(note), .. } = &reports.2 else {
        panic!("{:?}", reports.2)
    };
    assert!(
        note.contains("not taken yet")
            && note.contains("gateway edge cannot resolve its backends: BackendNotFound"),
        "{note}"
    );
}
