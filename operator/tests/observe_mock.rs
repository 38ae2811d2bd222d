//! Finding a pool's replicas against a scripted API server.
//!
//! Each test hands [`KubeReplicas`] a client whose transport is a `tower-test` mock, and an
//! [`ApiServer`] that expects the requests of one scenario in order (method, path and the label
//! selector of a list), answers them with realistic objects, and, through
//! [`ApiServer::expect_no_more`], proves that nothing beyond the script was asked.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use understudy_operator::crd::PoolSpec;
use understudy_operator::ports::{ReplicaEndpoints, ResolveError};
use understudy_operator::replicas::KubeReplicas;
use understudy_prober::probe::Endpoint;

mod support;
use support::{ApiServer, Call, NS, TIMEOUT, status};

const DEPLOYMENT_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/vllm-east";
const STATEFULSET_PATH: &str = "/apis/apps/v1/namespaces/serving/statefulsets/vllm-east";
const PODS_PATH: &str = "/api/v1/namespaces/serving/pods";

fn pool(kind: &str) -> PoolSpec {
    serde_yaml::from_str(&format!(
        "{{name: east, workload: {{kind: {kind}, name: vllm-east}}, replicas: 4, port: 8000}}"
    ))
    .unwrap()
}

fn deployment(selector: &Value) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "vllm-east", "namespace": NS},
        "spec": {
            "replicas": 4,
            "selector": selector,
            "template": {"metadata": {"labels": {"app": "vllm", "pool": "east"}}, "spec": {"containers": []}},
        },
    })
}

fn pod(name: &str, phase: &str, ip: Option<&str>) -> Value {
    let mut status = json!({ "phase": phase });
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "vllm", "pool": "east"}},
        "spec": {"containers": []},
        "status": status,
    })
}

fn pod_list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": items})
}

fn not_found() -> Value {
    status(404, "NotFound", "deployments.apps \"vllm-east\" not found")
}

/// Reads the label selector a list asked for.
trait LabelSelector {
    /// The `labelSelector` of a list, decoded.
    fn label_selector(&self) -> String;
}

impl LabelSelector for Call {
    fn label_selector(&self) -> String {
        let raw = self
            .query
            .split('&')
            .find_map(|pair| pair.strip_prefix("labelSelector="))
            .unwrap_or_else(|| panic!("no labelSelector in {:?}", self.query));
        raw.replace("%3D", "=")
            .replace("%2C", ",")
            .replace("%2F", "/")
            .replace("%21", "!")
            .replace("%28", "(")
            .replace("%29", ")")
            .replace('+', " ")
    }
}

fn replicas() -> (KubeReplicas, ApiServer) {
    let (client, server) = support::client();
    (KubeReplicas::new(client), server)
}

/// Resolves `pool` while `scenario` plays the API server.
async fn resolve<F>(
    pool: PoolSpec,
    scenario: impl FnOnce(ApiServer) -> F,
) -> Result<Vec<Endpoint>, ResolveError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let (replicas, server) = replicas();
    let resolution = async move {
        let resolved = replicas.endpoints(NS, &pool).await;
        // Hang up, so that the scenario can tell nothing more is asked.
        drop(replicas);
        resolved
    };
    support::play(scenario(server), resolution).await.0
}

#[tokio::test]
async fn a_deployments_running_pods_with_an_ip_are_the_pools_endpoints() {
    let resolved = resolve(pool("Deployment"), |mut server| async move {
        server.expect("GET", DEPLOYMENT_PATH).await.answer(
            200,
            &deployment(&json!({"matchLabels": {"app": "vllm", "pool": "east"}})),
        );
        let list = server.expect("GET", PODS_PATH).await;
        assert_eq!(list.label_selector(), "app=vllm,pool=east");
        let mut leaving = pod("vllm-east-4", "Running", Some("10.0.0.5"));
        leaving["metadata"]["deletionTimestamp"] = json!("2024-06-01T12:00:00Z");
        list.answer(
            200,
            &pod_list(vec![
                pod("vllm-east-0", "Running", Some("10.0.0.1")),
                pod("vllm-east-1", "Pending", None),
                pod("vllm-east-2", "Running", None),
                pod("vllm-east-3", "Succeeded", Some("10.0.0.4")),
                leaving,
                pod("vllm-east-5", "Running", Some("fd00::6")),
            ]),
        );
        server.expect_no_more().await;
    })
    .await;
    assert_eq!(
        resolved.unwrap(),
        vec![Endpoint::new("10.0.0.1", 8000), Endpoint::new("fd00::6", 8000)]
    );
}

#[tokio::test]
async fn a_pools_replicas_resolve_to_the_port_its_spec_names() {
    let pool: PoolSpec = serde_yaml::from_str(
        "{name: east, workload: {kind: Deployment, name: vllm-east}, replicas: 4, port: 8443}",
    )
    .unwrap();
    let resolved = resolve(pool, |mut server| async move {
        server.expect("GET", DEPLOYMENT_PATH).await.answer(
            200,
            &deployment(&json!({"matchLabels": {"app": "vllm", "pool": "east"}})),
        );
        server.expect("GET", PODS_PATH).await.answer(
            200,
            &pod_list(vec![
                pod("vllm-east-0", "Running", Some("10.0.0.1")),
                pod("vllm-east-1", "Running", Some("fd00::2")),
            ]),
        );
        server.expect_no_more().await;
    })
    .await;
    assert_eq!(
        resolved.unwrap(),
        vec![Endpoint::new("10.0.0.1", 8443), Endpoint::new("fd00::2", 8443)]
    );
}

#[tokio::test]
async fn a_statefulset_selects_its_pods_with_match_expressions_as_well() {
    let resolved = resolve(pool("StatefulSet"), |mut server| async move {
        let mut set = deployment(&json!({
            "matchLabels": {"app": "vllm"},
            "matchExpressions": [{"key": "pool", "operator": "In", "values": ["east"]}],
        }));
        set["kind"] = json!("StatefulSet");
        server.expect("GET", STATEFULSET_PATH).await.answer(200, &set);
        let list = server.expect("GET", PODS_PATH).await;
        assert_eq!(list.label_selector(), "app=vllm,pool in (east)");
        list.answer(
            200,
            &pod_list(vec![pod("vllm-east-0", "Running", Some("10.0.0.1"))]),
        );
        server.expect_no_more().await;
    })
    .await;
    assert_eq!(resolved.unwrap(), vec![Endpoint::new("10.0.0.1", 8000)]);
}

#[tokio::test]
async fn a_leaderworkerset_is_probed_at_its_group_leaders() {
    let resolved = resolve(pool("LeaderWorkerSet"), |mut server| async move {
        let list = server.expect("GET", PODS_PATH).await;
        assert_eq!(
            list.label_selector(),
            "leaderworkerset.sigs.k8s.io/name=vllm-east,leaderworkerset.sigs.k8s.io/worker-index=0"
        );
        list.answer(
            200,
            &pod_list(vec![pod("vllm-east-0", "Running", Some("10.0.0.1"))]),
        );
        server.expect_no_more().await;
    })
    .await;
    assert_eq!(resolved.unwrap(), vec![Endpoint::new("10.0.0.1", 8000)]);
}

#[tokio::test]
async fn a_missing_workload_is_a_pool_without_replicas_and_no_pods_are_listed() {
    let resolved = resolve(pool("Deployment"), |mut server| async move {
        server
            .expect("GET", DEPLOYMENT_PATH)
            .await
            .answer(404, &not_found());
        server.expect_no_more().await;
    })
    .await;
    assert_eq!(resolved.unwrap(), Vec::<Endpoint>::new());
}

#[tokio::test]
async fn an_api_server_that_fails_is_an_unknown_answer_not_an_empty_pool() {
    let resolved = resolve(pool("Deployment"), |mut server| async move {
        let mut unavailable = not_found();
        unavailable["code"] = json!(503);
        unavailable["reason"] = json!("ServiceUnavailable");
        server
            .expect("GET", DEPLOYMENT_PATH)
            .await
            .answer(503, &unavailable);
        server.expect_no_more().await;
    })
    .await;
    assert!(
        matches!(resolved, Err(ResolveError::Workload { .. })),
        "{resolved:?}"
    );
}

#[tokio::test]
async fn a_selector_that_would_select_every_pod_is_refused_before_listing() {
    let resolved = resolve(pool("Deployment"), |mut server| async move {
        server
            .expect("GET", DEPLOYMENT_PATH)
            .await
            .answer(200, &deployment(&json!({})));
        server.expect_no_more().await;
    })
    .await;
    assert!(
        matches!(resolved, Err(ResolveError::Selector { .. })),
        "{resolved:?}"
    );
}

#[tokio::test]
async fn the_model_a_pool_serves_is_read_from_its_workloads_pod_template_once_it_is_rolled_out() {
    let (replicas, mut server) = replicas();
    let verifier = tokio::spawn(async move {
        let mut serving = deployment(&json!({"matchLabels": {"app": "vllm", "pool": "east"}}));
        serving["spec"]["template"]["spec"]["containers"] = json!([{
            "name": "vllm", "image": "vllm/vllm-openai:v0.9.1",
            "command": ["vllm", "serve"], "args": ["meta-llama/Llama-3.1-8B-Instruct", "--port", "8000"],
        }]);
        serving["metadata"]["generation"] = json!(3);
        // Mid-rollout: one of four replicas still runs the old template.
        serving["status"] = json!({"observedGeneration": 3, "replicas": 5, "updatedReplicas": 4});
        server.expect("GET", DEPLOYMENT_PATH).await.answer(200, &serving);
        serving["status"] = json!({"observedGeneration": 3, "replicas": 4, "updatedReplicas": 4});
        server.expect("GET", DEPLOYMENT_PATH).await.answer(200, &serving);
        server
            .expect("GET", DEPLOYMENT_PATH)
            .await
            .answer(404, &not_found());
        server.expect_no_more().await;
    });
    let east = pool("Deployment");
    let rolling = tokio::time::timeout(TIMEOUT, replicas.serving_config(NS, &east))
        .await
        .expect("timed out");
    assert_eq!(
        rolling.unwrap(),
        None,
        "old and new pods both answer until the rollout is done"
    );
    let read = tokio::time::timeout(TIMEOUT, replicas.serving_config(NS, &east))
        .await
        .expect("timed out");
    assert_eq!(
        read.unwrap().and_then(|c| c.model()).as_deref(),
        Some("meta-llama/Llama-3.1-8B-Instruct")
    );
    let gone = tokio::time::timeout(TIMEOUT, replicas.serving_config(NS, &east))
        .await
        .expect("timed out");
    assert_eq!(
        gone.unwrap(),
        None,
        "a workload that is gone serves no model that can be told"
    );
    drop(replicas);
    tokio::time::timeout(TIMEOUT, verifier)
        .await
        .expect("scenario timed out")
        .expect("scenario panicked");
}

#[tokio::test]
async fn routers_found_by_label_are_their_running_pods_at_the_admin_port_and_none_is_an_error() {
    use understudy_operator::peers::{LabelledPods, Routers};
    let (client, server) = support::client();
    let routers = Routers::Labelled(LabelledPods {
        clusters: std::sync::Arc::new(understudy_operator::clusters::Clusters::new(client)),
        namespace: NS.to_owned(),
        selector: "app.kubernetes.io/component=router".to_owned(),
        port: 9091,
    });
    let scenario = |mut server: ApiServer| async move {
        let list = server.expect("GET", PODS_PATH).await;
        assert_eq!(list.label_selector(), "app.kubernetes.io/component=router");
        let mut leaving = pod("router-c", "Running", Some("10.0.0.9"));
        leaving["metadata"]["deletionTimestamp"] = json!("2024-06-01T12:00:00Z");
        list.answer(
            200,
            &pod_list(vec![
                pod("router-a", "Running", Some("10.0.0.7")),
                pod("router-b", "Pending", None),
                leaving,
            ]),
        );
        let list = server.expect("GET", PODS_PATH).await;
        list.answer(200, &pod_list(vec![pod("router-b", "Pending", None)]));
        server.expect_no_more().await
    };
    let resolution = async move {
        let found = routers.resolve(None).await;
        let none = routers.resolve(None).await;
        drop(routers);
        (found, none)
    };
    let ((found, none), published) = support::play(scenario(server), resolution).await;
    assert!(published.is_empty());
    let found: Vec<String> = found.unwrap().iter().map(ToString::to_string).collect();
    assert_eq!(found, ["http://10.0.0.7:9091"]);
    assert_eq!(
        none.unwrap_err(),
        "no running router pod matches app.kubernetes.io/component=router in serving"
    );
}
