//! The scripted API server the operator's mock tests share.
//!
//! A `tower-test` mock stands in for the API server's transport. A scenario takes the requests
//! one at a time through [`ApiServer::expect`], checks them and answers each; Events are answered
//! and collected on the side, and so, where a test file asks for it, is one read every reconcile
//! makes. It must never answer anything else on its own: a request a scenario did not script
//! fails the test.

// Each test file uses only part of this module.
#![allow(dead_code)]

pub mod policy;

use std::time::Duration;

use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock::{Handle, SendResponse};

pub const NS: &str = "serving";
pub const EVENTS_PATH: &str = "/apis/events.k8s.io/v1/namespaces/serving/events";
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// A client in [`NS`] whose every request goes to the returned [`ApiServer`].
pub fn client() -> (Client, ApiServer) {
    let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let server = ApiServer {
        handle,
        events: Vec::new(),
        event_answer: 201,
        read_on_the_side: None,
    };
    (Client::new(mock, NS), server)
}

/// Sends `body` as JSON with the status `code`.
pub fn respond(reply: SendResponse<Response<Body>>, code: impl Into<u16>, body: &Value) {
    let response = Response::builder()
        .status(code.into())
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    reply.send_response(response);
}

/// Sends `text` as plain text, as the API server sends a pod's log.
pub fn respond_text(reply: SendResponse<Response<Body>>, text: &str) {
    let response = Response::builder()
        .status(200)
        .header("content-type", "text/plain")
        .body(Body::from(text.as_bytes().to_vec()))
        .unwrap();
    reply.send_response(response);
}

/// A `metav1.Status` failure, as the API server writes it.
pub fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Status", "status": "Failure",
        "code": code, "reason": reason, "message": message, "metadata": {},
    })
}

/// One request as the API server received it.
pub struct Call {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: String,
    pub body: Value,
    pub reply: SendResponse<Response<Body>>,
}

impl Call {
    async fn read(request: Request<Body>, reply: SendResponse<Response<Body>>) -> Self {
        let (parts, body) = request.into_parts();
        let bytes = body.collect_bytes().await.unwrap();
        Self {
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            query: parts.uri.query().unwrap_or_default().to_owned(),
            content_type: parts
                .headers
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default(),
            body: if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).unwrap()
            },
            reply,
        }
    }

    pub fn answer(self, code: u16, body: &Value) {
        respond(self.reply, code, body);
    }
}

/// An Event as the operator published it.
#[derive(Debug, Clone)]
pub struct Published {
    pub type_: String,
    pub reason: String,
    pub note: String,
}

pub fn reasons(events: &[Published]) -> Vec<&str> {
    events.iter().map(|e| e.reason.as_str()).collect()
}

pub struct ApiServer {
    handle: Handle<Request<Body>, Response<Body>>,
    pub events: Vec<Published>,
    /// The code Events are answered with: below 300 with the Event, else with a Status.
    pub event_answer: u16,
    /// A GET of this path answered with this body on the side, so that scenarios need not script
    /// a read every reconcile makes.
    pub read_on_the_side: Option<(&'static str, Value)>,
}

impl ApiServer {
    /// The next request a scenario scripts; `None` once the client hung up.
    pub async fn next(&mut self) -> Option<Call> {
        loop {
            let (request, reply) = self.handle.next_request().await?;
            let call = Call::read(request, reply).await;
            if call.path.starts_with(EVENTS_PATH) {
                self.events.push(Published {
                    type_: call.body["type"].as_str().unwrap_or_default().to_owned(),
                    reason: call.body["reason"].as_str().unwrap_or_default().to_owned(),
                    note: call.body["note"].as_str().unwrap_or_default().to_owned(),
                });
                let answer = if self.event_answer < 300 {
                    call.body.clone()
                } else {
                    status(self.event_answer, "ServiceUnavailable", "etcd is down")
                };
                let code = self.event_answer;
                call.answer(code, &answer);
                continue;
            }
            if let Some((path, body)) = &self.read_on_the_side
                && call.method == "GET"
                && call.path == *path
            {
                let body = body.clone();
                call.answer(200, &body);
                continue;
            }
            return Some(call);
        }
    }

    pub async fn expect(&mut self, method: &str, path: &str) -> Call {
        let call = self
            .next()
            .await
            .unwrap_or_else(|| panic!("expected {method} {path}, but the client hung up"));
        assert_eq!(
            (call.method.as_str(), call.path.as_str()),
            (method, path),
            "unexpected request; body: {}",
            call.body
        );
        call
    }

    /// Asserts the client makes no further request before it hangs up, and returns the Events.
    pub async fn expect_no_more(mut self) -> Vec<Published> {
        if let Some(call) = self.next().await {
            panic!(
                "unexpected {} {}?{} with body {}",
                call.method, call.path, call.query, call.body
            );
        }
        self.events
    }
}

/// Runs `work` while `scenario` plays the API server, each under [`TIMEOUT`]. `work` must own
/// the client, so that the scenario sees it hang up once `work` is done.
pub async fn play<T, S>(scenario: S, work: impl Future<Output = T>) -> (T, S::Output)
where
    S: Future + Send + 'static,
    S::Output: Send + 'static,
{
    let verifier = tokio::spawn(scenario);
    let result = tokio::time::timeout(TIMEOUT, work)
        .await
        .expect("the call under test timed out");
    let played = tokio::time::timeout(TIMEOUT, verifier)
        .await
        .expect("the scenario timed out")
        .expect("the scenario failed");
    (result, played)
}
