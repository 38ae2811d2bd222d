//! `coldstart --pod NAME`: the record read from a scripted API server gives the same timeline as
//! the same record read from files, and the API is asked for exactly the pod, its events by field
//! selector, and the serving container's log with timestamps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use tower_test::mock::{Handle, SendResponse};
use understudy_prober::coldstart::{self, source::Recorded};

const NS: &str = "llm";
const POD: &str = "qwen-a-0";

fn fixture(dir: &str, file: &str) -> PathBuf {
    PathBuf::from(format!(
        "{}/tests/fixtures/coldstart/{dir}/{file}",
        env!("CARGO_MANIFEST_DIR")
    ))
}

/// One request as the API server received it.
struct Call {
    method: String,
    path: String,
    query: Vec<(String, String)>,
    reply: SendResponse<Response<Body>>,
}

impl Call {
    fn answer(self, content_type: &str, body: String) {
        let response = Response::builder()
            .status(200)
            .header("content-type", content_type)
            .body(Body::from(body.into_bytes()))
            .unwrap();
        self.reply.send_response(response);
    }

    fn query(&self, key: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// Percent-decodes a query string into pairs (only what these requests contain).
fn decode_query(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = v.replace("%3D", "=").replace("%2C", ",").replace('+', " ");
            (k.to_owned(), v)
        })
        .collect()
}

struct ApiServer {
    handle: Handle<Request<Body>, Response<Body>>,
}

impl ApiServer {
    async fn next(&mut self) -> Call {
        let (request, reply) = self.handle.next_request().await.expect("another request");
        let (parts, _) = request.into_parts();
        Call {
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            query: decode_query(parts.uri.query().unwrap_or_default()),
            reply,
        }
    }

    /// Answers the three requests of one cold-start read from the fixture `dir`, checking each;
    /// returns the container the log was asked for.
    async fn serve_fixture(mut self, dir: &str) -> Option<String> {
        let read = |file| std::fs::read_to_string(fixture(dir, file)).unwrap();

        let pod = self.next().await;
        assert_eq!(
            (pod.method.as_str(), pod.path.as_str()),
            ("GET", "/api/v1/namespaces/llm/pods/qwen-a-0")
        );
        pod.answer("application/json", read("pod.json"));

        let events = self.next().await;
        assert_eq!(
            (events.method.as_str(), events.path.as_str()),
            ("GET", "/api/v1/namespaces/llm/events")
        );
        assert_eq!(
            events.query("fieldSelector"),
            Some("involvedObject.name=qwen-a-0")
        );
        events.answer("application/json", read("events.json"));

        let log = self.next().await;
        assert_eq!(
            (log.method.as_str(), log.path.as_str()),
            ("GET", "/api/v1/namespaces/llm/pods/qwen-a-0/log")
        );
        assert_eq!(log.query("timestamps"), Some("true"), "{:?}", log.query);
        let container = log.query("container").map(str::to_owned);
        log.answer("text/plain", read("logs.txt"));

        // Nothing beyond the script: the handle's channel closes when the client is dropped.
        assert!(
            self.handle.next_request().await.is_none(),
            "an unexpected request"
        );
        container
    }
}

fn mock() -> (Client, ApiServer) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, NS), ApiServer { handle })
}

#[tokio::test]
async fn the_api_path_asks_for_pod_events_and_timestamped_log_and_agrees_with_the_files() {
    let first_token = Some("2025-10-06T12:04:39.880437801Z".parse().unwrap());
    for dir in ["newer", "older", "restarted"] {
        let from_files = Recorded::from_files(
            &fixture(dir, "pod.json"),
            Some(&fixture(dir, "events.json")),
            Some(&fixture(dir, "logs.txt")),
            None,
        )
        .unwrap()
        .timeline(first_token)
        .unwrap();

        let (client, server) = mock();
        let api = tokio::spawn(server.serve_fixture(dir));
        let recorded = Recorded::from_api(client, NS, POD, None).await.unwrap();
        let from_api = recorded.timeline(first_token).unwrap();
        let log_container = api.await.unwrap();

        assert_eq!(
            log_container, from_files.container,
            "{dir}: the log of the container the timeline is about"
        );
        assert_eq!(
            coldstart::render_table(&from_api),
            coldstart::render_table(&from_files),
            "{dir}"
        );
        assert_eq!(
            serde_json::to_value(&from_api).unwrap(),
            serde_json::to_value(&from_files).unwrap(),
            "{dir}"
        );
        assert!(
            from_api.stages.iter().any(|s| s.duration.known().is_some()),
            "{dir}: a fixture with known stages, so that agreement means something"
        );
    }
}

#[tokio::test]
async fn a_named_container_is_the_one_whose_log_is_asked_for() {
    let (client, mut server) = mock();
    let api = tokio::spawn(async move {
        let pod = server.next().await;
        pod.answer(
            "application/json",
            std::fs::read_to_string(fixture("newer", "pod.json")).unwrap(),
        );
        let events = server.next().await;
        events.answer(
            "application/json",
            r#"{"apiVersion":"v1","kind":"EventList","items":[]}"#.into(),
        );
        let log = server.next().await;
        let asked = log.query("container").map(str::to_owned);
        log.answer("text/plain", String::new());
        asked
    });
    let recorded = Recorded::from_api(client, NS, POD, Some("sidecar".into()))
        .await
        .unwrap();
    assert_eq!(api.await.unwrap().as_deref(), Some("sidecar"));
    assert_eq!(recorded.container.as_deref(), Some("sidecar"));
}

#[tokio::test]
#[ignore = "needs a cluster: a kubeconfig and a running pod named by UNDERSTUDY_COLDSTART_POD (namespace UNDERSTUDY_COLDSTART_NAMESPACE, default: the context's)"]
async fn a_real_pods_cold_start_reads_from_the_cluster() {
    let name = std::env::var("UNDERSTUDY_COLDSTART_POD").expect("UNDERSTUDY_COLDSTART_POD");
    let client = Client::try_default().await.unwrap();
    let namespace = std::env::var("UNDERSTUDY_COLDSTART_NAMESPACE")
        .unwrap_or_else(|_| client.default_namespace().to_owned());
    let recorded = Recorded::from_api(client, &namespace, &name, None).await.unwrap();
    let timeline = recorded.timeline(None).unwrap();
    print!("{}", coldstart::render_table(&timeline));
    assert_eq!(timeline.pod, name);
    assert!(
        timeline.stages.iter().any(|s| s.duration.known().is_some()),
        "a running pod has at least its node and container start timed"
    );
}
