//! A standby-first rollout's two calls through a scripted API server: a pool's workload and its
//! pods read into what the rollout decides on, and the hold set with a merge patch on
//! `spec.paused` (a Deployment) or the update partition (a StatefulSet), as `kubectl rollout
//! pause` would, never an apply that takes the field from its owner.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{Value, json};
use support::{NS, play, status};
use understudy_operator::crd::PoolSpec;
use understudy_operator::parity::{ServingConfig, template_keys};
use understudy_operator::rollout::{self, HELD_PARTITION, PoolView};
use understudy_prober::parity::flags::FlagPolicy;

const DEPLOYMENT: &str = "/apis/apps/v1/namespaces/serving/deployments/vllm-east";
const STATEFULSET: &str = "/apis/apps/v1/namespaces/serving/statefulsets/vllm-east";
const PODS: &str = "/api/v1/namespaces/serving/pods";

fn pool(kind: &str) -> PoolSpec {
    serde_json::from_value(json!({
        "name": "east", "workload": {"kind": kind, "name": "vllm-east"}, "replicas": 2,
    }))
    .unwrap()
}

fn container(image: &str) -> Value {
    json!({
        "name": "vllm", "image": image,
        "args": ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--port", "8000"],
        "env": [{"name": "VLLM_USE_V1", "value": "1"}],
    })
}

/// A paused Deployment whose template was set to `image` and not rolled out.
fn paused_deployment(image: &str) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "vllm-east", "namespace": NS, "generation": 4},
        "spec": {
            "replicas": 2, "paused": true,
            "selector": {"matchLabels": {"app": "vllm-east"}},
            "template": {"metadata": {"labels": {"app": "vllm-east"}}, "spec": {"containers": [container(image)]}},
        },
        "status": {"observedGeneration": 4, "replicas": 2, "updatedReplicas": 0, "readyReplicas": 2},
    })
}

fn pod(name: &str, image: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "vllm-east"}},
        "spec": {"containers": [container(image), {"name": "fence", "image": "understudy/fence:0.1"}]},
        "status": {"phase": "Running", "podIP": ip},
    })
}

fn keys(image: &str) -> understudy_prober::parity::Fingerprint {
    let config = ServingConfig {
        argv: [
            "vllm",
            "serve",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--port",
            "8000",
        ]
        .map(str::to_owned)
        .to_vec(),
        image: Some(image.to_owned()),
        env: [("VLLM_USE_V1".to_owned(), "1".to_owned())].into(),
    };
    template_keys(&config, &FlagPolicy::default())
}

#[tokio::test]
async fn a_held_deployment_reads_as_its_new_template_over_the_serving_keys_its_pods_still_run() {
    let (client, mut server) = support::client();
    let scenario = async move {
        server
            .expect("GET", DEPLOYMENT)
            .await
            .answer(200, &paused_deployment("vllm/vllm-openai:v0.12.0"));
        let list = server.expect("GET", PODS).await;
        assert_eq!(list.query, "&labelSelector=app%3Dvllm-east");
        list.answer(
            200,
            &json!({
                "apiVersion": "v1", "kind": "PodList", "metadata": {},
                "items": [
                    pod("vllm-east-a", "vllm/vllm-openai:v0.11.0", "10.0.0.7"),
                    pod("vllm-east-b", "vllm/vllm-openai:v0.11.0", "10.0.0.8"),
                ],
            }),
        );
        server.expect_no_more().await;
    };
    let (view, ()) = play(scenario, async move {
        rollout::read_pool(client, NS, &pool("Deployment"), &FlagPolicy::default())
            .await
            .unwrap()
    })
    .await;
    assert_eq!(
        view,
        PoolView {
            name: "east".to_owned(),
            template: Some(keys("vllm/vllm-openai:v0.12.0")),
            running: vec![keys("vllm/vllm-openai:v0.11.0")],
            rolled_out: false,
            replicas: vec!["10.0.0.7:8000".to_owned(), "10.0.0.8:8000".to_owned()],
            held: true,
        }
    );
}

#[tokio::test]
async fn a_workload_that_does_not_exist_reads_as_nothing_to_hold() {
    let (client, mut server) = support::client();
    let scenario = async move {
        server.expect("GET", DEPLOYMENT).await.answer(
            404,
            &status(404, "NotFound", "deployments.apps \"vllm-east\" not found"),
        );
        server.expect_no_more().await;
    };
    let (view, ()) = play(scenario, async move {
        rollout::read_pool(client, NS, &pool("Deployment"), &FlagPolicy::default())
            .await
            .unwrap()
    })
    .await;
    assert_eq!((view.template, view.running.len(), view.held), (None, 0, false));
}

/// The one patch `hold` sends for `kind` to `path`, answered `code`.
async fn hold_once(
    kind: &'static str,
    path: &'static str,
    held: bool,
    code: u16,
) -> (Result<(), String>, Value) {
    let (client, mut server) = support::client();
    let scenario = async move {
        let patch = server.expect("PATCH", path).await;
        assert_eq!(patch.content_type, "application/merge-patch+json");
        assert!(patch.query.contains("fieldManager=understudy"), "{}", patch.query);
        let body = patch.body.clone();
        let answer = if code == 200 {
            json!({"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": "vllm-east"}})
        } else {
            status(code, "NotFound", "gone")
        };
        patch.answer(code, &answer);
        server.expect_no_more().await;
        body
    };
    play(scenario, async move {
        rollout::hold(client, NS, &pool(kind), held)
            .await
            .map_err(|e| e.to_string())
    })
    .await
}

#[tokio::test]
async fn a_deployment_is_held_by_pausing_it_and_let_go_by_resuming_it() {
    let (held, body) = hold_once("Deployment", DEPLOYMENT, true, 200).await;
    assert_eq!(held, Ok(()));
    assert_eq!(body, json!({"spec": {"paused": true}}));
    let (released, body) = hold_once("Deployment", DEPLOYMENT, false, 200).await;
    assert_eq!(released, Ok(()));
    assert_eq!(body, json!({"spec": {"paused": false}}));
}

#[tokio::test]
async fn a_statefulset_is_held_by_a_partition_above_every_ordinal_and_let_go_at_zero() {
    let (held, body) = hold_once("StatefulSet", STATEFULSET, true, 200).await;
    assert_eq!(held, Ok(()));
    assert_eq!(
        body,
        json!({"spec": {"updateStrategy": {"rollingUpdate": {"partition": HELD_PARTITION}}}})
    );
    let (_, body) = hold_once("StatefulSet", STATEFULSET, false, 200).await;
    assert_eq!(body["spec"]["updateStrategy"]["rollingUpdate"]["partition"], 0);
}

#[tokio::test]
async fn a_deployment_deleted_meanwhile_holds_nothing_and_is_no_error() {
    let (released, _) = hold_once("Deployment", DEPLOYMENT, false, 404).await;
    assert_eq!(released, Ok(()));
}
