//! The cold starts a promotion caused, read through a scripted API server from pod, event and log
//! fixtures in both of vLLM's log formats: only pods created since the promotion started, and
//! only those whose start is not recorded complete yet (through its first token, from the
//! operator's first passing probe of it), each asked for its pod, its events and its timestamped
//! log.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use support::{ApiServer, NS, play};
use understudy_operator::coldstart::{self, PILOT_LIGHT};
use understudy_operator::crd::{ColdStartBreakdown, PoolSpec};

const DEPLOYMENT_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/vllm-west";
const PODS_PATH: &str = "/api/v1/namespaces/serving/pods";

fn fixture(format: &str, file: &str) -> String {
    let path = format!(
        "{}/../prober/tests/fixtures/coldstart/{format}/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The fixture's pod, renamed into this namespace, at the address its name ends in.
fn pod(format: &str, name: &str) -> Value {
    let mut pod: Value = serde_json::from_str(&fixture(format, "pod.json")).unwrap();
    pod["metadata"]["name"] = json!(name);
    pod["metadata"]["namespace"] = json!(NS);
    pod["status"]["podIP"] = json!(address(name));
    pod
}

fn address(name: &str) -> String {
    format!("10.0.0.{}", name.trim_start_matches("west-"))
}

/// When the operator's probes first saw each replica answer, by `host:port`.
fn first_answers(answers: &[(&str, &str)]) -> impl Fn(&str) -> Option<Timestamp> {
    let answers: Vec<(String, Timestamp)> = answers
        .iter()
        .map(|(name, at)| (format!("{}:8000", address(name)), at.parse().unwrap()))
        .collect();
    move |endpoint| answers.iter().find(|(e, _)| e == endpoint).map(|(_, at)| *at)
}

fn pool() -> PoolSpec {
    serde_json::from_value(json!({
        "name": "west", "workload": {"kind": "Deployment", "name": "vllm-west"}, "replicas": 4,
        "standby": [{"tier": "hot", "replicas": 2}, {"tier": "pilotLight", "replicas": 2}],
    }))
    .unwrap()
}

/// The workload's selector, then the list of its pods.
async fn expect_pods(server: &mut ApiServer, pods: Vec<Value>) {
    server.expect("GET", DEPLOYMENT_PATH).await.answer(
        200,
        &json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "vllm-west", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "vllm-west"}}, "template": {}},
        }),
    );
    let list = server.expect("GET", PODS_PATH).await;
    assert!(
        list.query.contains("labelSelector=app%3Dvllm-west"),
        "{}",
        list.query
    );
    list.answer(
        200,
        &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods}),
    );
}

/// One pod's record: the pod, its events by field selector, its log with timestamps.
async fn expect_record(server: &mut ApiServer, format: &str, name: &str) {
    let path = format!("{PODS_PATH}/{name}");
    server.expect("GET", &path).await.answer(200, &pod(format, name));
    let events = server.expect("GET", "/api/v1/namespaces/serving/events").await;
    assert!(
        events
            .query
            .contains(&format!("fieldSelector=involvedObject.name%3D{name}")),
        "{}",
        events.query
    );
    let events_json: Value = serde_json::from_str(&fixture(format, "events.json")).unwrap();
    events.answer(200, &events_json);
    let log = server.expect("GET", &format!("{path}/log")).await;
    assert!(log.query.contains("timestamps=true"), "{}", log.query);
    support::respond_text(log.reply, &fixture(format, "logs.txt"));
}

fn seconds(breakdown: &ColdStartBreakdown, stage: &str) -> Option<f64> {
    breakdown.stages.get(stage).copied().flatten()
}

#[tokio::test]
async fn the_pods_a_promotion_created_are_read_in_both_log_formats_until_each_served_a_first_token() {
    let since: Timestamp = "2025-01-01T00:00:00Z".parse().unwrap();
    let mut before = pod("newer", "west-0");
    before["metadata"]["creationTimestamp"] = json!("2024-12-31T23:00:00Z");
    let listed = vec![before, pod("newer", "west-2"), pod("older", "west-3")];

    // west-2's first answer came after its API was up; the one seen at west-3's address is from
    // before west-3 existed (another pod's), so it is not west-3's first token.
    let answered = first_answers(&[
        ("west-2", "2025-10-06T12:04:39.880437801Z"),
        ("west-3", "2025-08-01T00:00:00Z"),
    ]);
    let (client, mut server) = support::client();
    let scenario = {
        let listed = listed.clone();
        async move {
            expect_pods(&mut server, listed).await;
            expect_record(&mut server, "newer", "west-2").await;
            expect_record(&mut server, "older", "west-3").await;
            server.expect_no_more().await
        }
    };
    let (measured, _) = play(scenario, async move {
        coldstart::measure(
            &std::sync::Arc::new(understudy_operator::clusters::Clusters::new(client.clone())),
            NS,
            &pool(),
            since,
            &[],
            answered,
        )
        .await
    })
    .await;
    let measured = measured.unwrap();
    let replicas: Vec<&str> = measured.iter().map(|b| b.replica.as_str()).collect();
    assert_eq!(
        replicas,
        ["west-2", "west-3"],
        "west-0 started before the promotion"
    );
    for b in &measured {
        assert_eq!((b.pool.as_str(), b.tier.as_deref()), ("west", Some(PILOT_LIGHT)));
        assert!(seconds(b, "engineStart").is_some_and(|s| s > 0.0), "{b:?}");
        assert!(seconds(b, "weightLoad").is_some_and(|s| s > 0.0), "{b:?}");
        assert!(seconds(b, "imagePull").is_some(), "{b:?}");
        assert!(
            seconds(b, "apiReady").is_some(),
            "the fixtures' APIs answered: {b:?}"
        );
    }
    assert!(
        seconds(&measured[0], "firstToken").is_some_and(|s| s > 2.0),
        "{:?}",
        measured[0]
    );
    assert!(coldstart::complete(&measured[0]));
    assert_eq!(seconds(&measured[1], "firstToken"), None);
    assert!(!coldstart::complete(&measured[1]), "no first token yet");

    // The next reconcile: west-2 is complete and not read again; west-3 has answered since.
    let known = measured.clone();
    let answered = first_answers(&[("west-3", "2025-08-05T09:09:00Z")]);
    let (client, mut server) = support::client();
    let scenario = async move {
        expect_pods(&mut server, listed).await;
        expect_record(&mut server, "older", "west-3").await;
        server.expect_no_more().await
    };
    let (again, _) = play(scenario, async move {
        coldstart::measure(
            &std::sync::Arc::new(understudy_operator::clusters::Clusters::new(client.clone())),
            NS,
            &pool(),
            since,
            &known,
            answered,
        )
        .await
    })
    .await;
    let again = again.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].replica, "west-3");
    assert_eq!(
        seconds(&again[0], "firstToken").map(f64::round),
        Some(5.0),
        "{:?}",
        again[0]
    );
    assert!(coldstart::complete(&again[0]));
}
