//! The fencing Lease and the leader Lease against a mocked API server: what is sent on the wire,
//! and how each answer the API server can give is classified.
//!
//! In the style of kube-rs's controller-rs: a `tower-test` mock service stands in for the API
//! server, and an `ApiServerVerifier` asserts each request's method, path and body before it
//! sends a scripted response.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::coordination::v1::Lease;
use kube::client::Body;
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use understudy_core::Epoch;
use understudy_operator::leader::{LeaderConfig, LeaderElector, LeaderLock, Release};
use understudy_operator::lease::{
    EPOCH_ANNOTATION, EpochLease, KubeLease, LeaseError, LeaseRecord, Unreachable, epoch_lease_name,
};
use understudy_operator::watchdog::{Reconciler, Watchdog};

mod support;
use support::{respond, status};

const NAMESPACE: &str = "serving";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/serving/leases";

type ApiServerHandle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// Plays the API server: one scripted exchange per call.
struct ApiServerVerifier(ApiServerHandle);

/// What the verifier saw: method, path, query and JSON body.
struct Seen {
    method: Method,
    path: String,
    query: String,
    body: Value,
}

impl ApiServerVerifier {
    /// Take the next request, or fail the test if the client sends none.
    async fn next(&mut self) -> (Seen, tower_test::mock::SendResponse<Response<Body>>) {
        let (request, send) = self.0.next_request().await.expect("the client sent no request");
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        let query = request.uri().query().unwrap_or_default().to_owned();
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("request body is JSON")
        };
        (
            Seen {
                method,
                path,
                query,
                body,
            },
            send,
        )
    }

    /// Assert the client sends nothing more: the mock closes once the client is dropped.
    async fn no_more_requests(mut self) {
        let next = tokio::time::timeout(Duration::from_secs(30), self.0.next_request()).await;
        assert!(
            !matches!(next, Ok(Some(_))),
            "the client sent a request it should not have"
        );
    }
}

/// What the API server hands back after a write: the object, at a new resourceVersion.
fn stored(mut written: Value, version: &str) -> Value {
    written["apiVersion"] = json!("coordination.k8s.io/v1");
    written["kind"] = json!("Lease");
    written["metadata"]["resourceVersion"] = json!(version);
    written["metadata"]["uid"] = json!("0b6d4c1e-6a1d-4c55-9d38-1f0e5f3f7a10");
    written
}

fn epoch_lease_json(holder: &str, epoch: &str, version: &str) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {
            "name": "chat-epoch", "namespace": NAMESPACE, "resourceVersion": version,
            "annotations": { EPOCH_ANNOTATION: epoch },
        },
        "spec": { "holderIdentity": holder, "leaseTransitions": 3 },
    })
}

fn api_and_verifier() -> (Api<Lease>, ApiServerVerifier) {
    let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(mock, "default");
    (Api::namespaced(client, NAMESPACE), ApiServerVerifier(handle))
}

fn fencing_lease() -> (KubeLease, ApiServerVerifier) {
    let (api, verifier) = api_and_verifier();
    (KubeLease::for_policy(api, "chat"), verifier)
}

fn record(holder: &str, epoch: u64, version: &str) -> LeaseRecord {
    LeaseRecord {
        holder: holder.into(),
        epoch: Epoch(epoch),
        version: version.into(),
    }
}

/// Script one answer to the next request, and hand the verifier back for more.
fn answer_next_with(
    mut verifier: ApiServerVerifier,
    code: StatusCode,
    body: Value,
) -> JoinHandle<ApiServerVerifier> {
    tokio::spawn(async move {
        let (_, send) = verifier.next().await;
        respond(send, code, &body);
        verifier
    })
}

#[test]
fn the_fencing_lease_is_named_after_its_policy() {
    assert_eq!(epoch_lease_name("chat"), "chat-epoch");
}

#[tokio::test]
async fn create_posts_a_lease_naming_the_holder_with_the_epoch_annotation_and_no_owner() {
    let (lease, mut verifier) = fencing_lease();
    let server = tokio::spawn(async move {
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::POST);
        assert_eq!(seen.path, LEASES);
        assert!(
            seen.query.contains("fieldManager=understudy-operator"),
            "{}",
            seen.query
        );
        let body = &seen.body;
        assert_eq!(body["metadata"]["name"], "chat-epoch");
        assert_eq!(body["metadata"]["annotations"][EPOCH_ANNOTATION], "0");
        assert!(
            body["metadata"].get("resourceVersion").is_none(),
            "a create has no precondition"
        );
        // Owned by nobody: deleting the policy must not delete the epoch with it.
        assert!(body["metadata"].get("ownerReferences").is_none(), "{body}");
        assert_eq!(body["spec"]["holderIdentity"], "pool-a");
        assert_eq!(body["spec"]["leaseTransitions"], 0);
        assert!(body["spec"]["acquireTime"].is_string() && body["spec"]["renewTime"].is_string());
        respond(send, StatusCode::CREATED, &stored(seen.body, "101"));
    });
    let created = lease.create("pool-a", Epoch(0)).await.unwrap();
    assert_eq!(created, record("pool-a", 0, "101"));
    server.await.unwrap();
}

#[tokio::test]
async fn create_when_the_lease_exists_is_a_lost_race() {
    let (lease, verifier) = fencing_lease();
    let server = answer_next_with(
        verifier,
        StatusCode::CONFLICT,
        status(
            409,
            "AlreadyExists",
            r#"leases.coordination.k8s.io "chat-epoch" already exists"#,
        ),
    );
    let err = lease.create("pool-a", Epoch(0)).await.unwrap_err();
    assert!(err.is_lost_race(), "{err:?}");
    server.await.unwrap();
}

#[tokio::test]
async fn read_gets_the_lease_by_name_and_returns_holder_epoch_and_version() {
    let (lease, mut verifier) = fencing_lease();
    let server = tokio::spawn(async move {
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::GET);
        assert_eq!(seen.path, format!("{LEASES}/chat-epoch"));
        // The mirror says 3, the annotation 7: the annotation is the truth.
        respond(send, StatusCode::OK, &epoch_lease_json("pool-b", "7", "4242"));
    });
    assert_eq!(lease.read().await.unwrap(), Some(record("pool-b", 7, "4242")));
    server.await.unwrap();
}

#[tokio::test]
async fn read_of_a_lease_that_does_not_exist_is_none() {
    let (lease, verifier) = fencing_lease();
    let server = answer_next_with(
        verifier,
        StatusCode::NOT_FOUND,
        status(
            404,
            "NotFound",
            r#"leases.coordination.k8s.io "chat-epoch" not found"#,
        ),
    );
    assert_eq!(lease.read().await.unwrap(), None);
    server.await.unwrap();
}

#[tokio::test]
async fn read_of_a_lease_with_a_garbled_epoch_annotation_is_malformed() {
    for garbled in ["seven", "", "-1", "18446744073709551616"] {
        let (lease, verifier) = fencing_lease();
        let server = answer_next_with(verifier, StatusCode::OK, epoch_lease_json("pool-a", garbled, "9"));
        let err = lease.read().await.unwrap_err();
        assert!(matches!(err, LeaseError::Malformed(_)), "{garbled:?}: {err:?}");
        server.await.unwrap();
    }
}

#[tokio::test]
async fn read_of_a_lease_without_the_epoch_annotation_is_malformed() {
    let (lease, verifier) = fencing_lease();
    let mut body = epoch_lease_json("pool-a", "1", "9");
    body["metadata"]["annotations"] = json!({});
    let server = answer_next_with(verifier, StatusCode::OK, body);
    let err = lease.read().await.unwrap_err();
    assert!(
        matches!(err, LeaseError::Malformed(ref m) if m.contains(EPOCH_ANNOTATION)),
        "{err:?}"
    );
    server.await.unwrap();
}

#[tokio::test]
async fn compare_and_set_puts_the_expected_version_the_new_holder_and_the_raised_epoch() {
    let (lease, mut verifier) = fencing_lease();
    let server = tokio::spawn(async move {
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::PUT);
        assert_eq!(seen.path, format!("{LEASES}/chat-epoch"));
        assert!(
            seen.query.contains("fieldManager=understudy-operator"),
            "{}",
            seen.query
        );
        let body = &seen.body;
        assert_eq!(body["metadata"]["name"], "chat-epoch");
        assert_eq!(body["metadata"]["resourceVersion"], "101", "the precondition");
        assert_eq!(body["metadata"]["annotations"][EPOCH_ANNOTATION], "8");
        // A replace carries the whole object: an owner reference an older operator set is dropped.
        assert!(body["metadata"].get("ownerReferences").is_none(), "{body}");
        assert_eq!(body["spec"]["holderIdentity"], "pool-b");
        assert_eq!(body["spec"]["leaseTransitions"], 8);
        assert!(body["spec"]["acquireTime"].is_string() && body["spec"]["renewTime"].is_string());
        respond(send, StatusCode::OK, &stored(seen.body, "102"));
    });
    let written = lease
        .compare_and_set(&record("pool-a", 7, "101"), "pool-b", Epoch(8))
        .await
        .unwrap();
    assert_eq!(written, record("pool-b", 8, "102"));
    server.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn compare_and_set_that_meets_a_conflict_is_a_lost_race_and_sends_nothing_more() {
    let (lease, verifier) = fencing_lease();
    let server = answer_next_with(
        verifier,
        StatusCode::CONFLICT,
        status(
            409,
            "Conflict",
            r#"Operation cannot be fulfilled on leases.coordination.k8s.io "chat-epoch": the object has been modified; please apply your changes to the latest version and try again"#,
        ),
    );
    let err = lease
        .compare_and_set(&record("pool-a", 7, "101"), "pool-b", Epoch(8))
        .await
        .unwrap_err();
    assert!(err.is_lost_race(), "{err:?}");
    drop(lease);
    server.await.unwrap().no_more_requests().await;
}

#[tokio::test(start_paused = true)]
async fn compare_and_set_of_a_deleted_lease_is_a_lost_race() {
    let (lease, verifier) = fencing_lease();
    let server = answer_next_with(
        verifier,
        StatusCode::NOT_FOUND,
        status(404, "NotFound", "not found"),
    );
    let err = lease
        .compare_and_set(&record("pool-a", 7, "101"), "pool-b", Epoch(8))
        .await
        .unwrap_err();
    assert!(err.is_lost_race(), "{err:?}");
    server.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn compare_and_set_refuses_an_epoch_that_does_not_rise_without_calling_the_api() {
    let (lease, verifier) = fencing_lease();
    let err = lease
        .compare_and_set(&record("pool-a", 7, "101"), "pool-b", Epoch(7))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            LeaseError::EpochNotRaised {
                current: Epoch(7),
                proposed: Epoch(7)
            }
        ),
        "{err:?}"
    );
    drop(lease);
    verifier.no_more_requests().await;
}

#[tokio::test]
async fn a_server_that_is_not_serving_is_unreachable_not_a_lost_race() {
    for (code, reason) in [
        (503, "ServiceUnavailable"),
        (500, "InternalError"),
        (429, "TooManyRequests"),
    ] {
        let (lease, verifier) = fencing_lease();
        let server = answer_next_with(
            verifier,
            StatusCode::from_u16(code).unwrap(),
            status(
                code,
                reason,
                "the server is currently unable to handle the request",
            ),
        );
        let err = lease
            .compare_and_set(&record("pool-a", 7, "101"), "pool-b", Epoch(8))
            .await
            .unwrap_err();
        assert!(
            matches!(err, LeaseError::Unreachable(Unreachable::Status { code: c, .. }) if c == code),
            "{code}: {err:?}"
        );
        server.await.unwrap();
    }
}

#[tokio::test]
async fn a_proxy_error_page_that_is_not_a_status_is_still_unreachable() {
    let (lease, mut verifier) = fencing_lease();
    let server = tokio::spawn(async move {
        let (_, send) = verifier.next().await;
        send.send_response(
            Response::builder()
                .status(StatusCode::BAD_GATEWAY)
                .body(Body::from(b"<html>502 Bad Gateway</html>".to_vec()))
                .unwrap(),
        );
    });
    let err = lease.read().await.unwrap_err();
    assert!(
        matches!(
            err,
            LeaseError::Unreachable(Unreachable::Status { code: 502, .. })
        ),
        "{err:?}"
    );
    server.await.unwrap();
}

#[tokio::test]
async fn a_dropped_connection_is_unreachable() {
    let (lease, mut verifier) = fencing_lease();
    let server = tokio::spawn(async move {
        let (_, send) = verifier.next().await;
        send.send_error(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        ));
    });
    let err = lease
        .compare_and_set(&record("pool-a", 7, "101"), "pool-b", Epoch(8))
        .await
        .unwrap_err();
    assert!(
        matches!(err, LeaseError::Unreachable(Unreachable::Transport(_))),
        "{err:?}"
    );
    server.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn no_answer_within_the_request_timeout_is_unreachable() {
    let (api, mut verifier) = api_and_verifier();
    let lease = KubeLease::new(api, "chat-epoch").with_request_timeout(Duration::from_secs(3));
    let server = tokio::spawn(async move {
        let (seen, send) = verifier.next().await;
        // Hold the answer past the client's timeout.
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(send);
        seen.method
    });
    let err = lease.create("pool-a", Epoch(0)).await.unwrap_err();
    assert!(
        matches!(err, LeaseError::Unreachable(Unreachable::Timeout(t)) if t == Duration::from_secs(3)),
        "{err:?}"
    );
    assert_eq!(server.await.unwrap(), Method::POST);
}

#[tokio::test]
async fn forbidden_is_a_rejection_not_unreachable_and_not_a_lost_race() {
    let (lease, verifier) = fencing_lease();
    let server = answer_next_with(
        verifier,
        StatusCode::FORBIDDEN,
        status(
            403,
            "Forbidden",
            r#"leases.coordination.k8s.io "chat-epoch" is forbidden: User "system:serviceaccount:serving:understudy" cannot update resource "leases""#,
        ),
    );
    let err = lease
        .compare_and_set(&record("pool-a", 7, "101"), "pool-b", Epoch(8))
        .await
        .unwrap_err();
    assert!(matches!(err, LeaseError::Rejected { code: 403, .. }), "{err:?}");
    server.await.unwrap();
}

#[tokio::test]
async fn the_leader_lease_is_taken_over_with_a_put_that_counts_the_transition() {
    let (api, mut verifier) = api_and_verifier();
    let lock = KubeLease::new(api, "understudy-operator");
    let server = tokio::spawn(async move {
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::GET);
        assert_eq!(seen.path, format!("{LEASES}/understudy-operator"));
        respond(
            send,
            StatusCode::OK,
            &json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": { "name": "understudy-operator", "namespace": NAMESPACE, "resourceVersion": "55" },
                "spec": {
                    "holderIdentity": "pod-0", "leaseDurationSeconds": 15, "leaseTransitions": 4,
                    "acquireTime": "2020-01-01T00:00:00.000000Z", "renewTime": "2020-01-01T00:00:10.000000Z",
                },
            }),
        );

        // Renewal by the same holder keeps acquireTime and the transition count.
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::PUT);
        let body = &seen.body;
        assert_eq!(body["metadata"]["resourceVersion"], "55");
        assert!(
            body["metadata"].get("annotations").is_none(),
            "no epoch on the leader lease"
        );
        assert_eq!(body["spec"]["holderIdentity"], "pod-0");
        assert_eq!(body["spec"]["leaseTransitions"], 4);
        assert_eq!(body["spec"]["leaseDurationSeconds"], 15);
        assert_eq!(body["spec"]["acquireTime"], "2020-01-01T00:00:00.000000Z");
        assert_ne!(body["spec"]["renewTime"], "2020-01-01T00:00:10.000000Z");
        respond(send, StatusCode::OK, &stored(seen.body, "56"));

        // A different holder takes it over: a new acquireTime and one more transition.
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::PUT);
        let body = &seen.body;
        assert_eq!(body["metadata"]["resourceVersion"], "56");
        assert_eq!(body["spec"]["holderIdentity"], "pod-1");
        assert_eq!(body["spec"]["leaseTransitions"], 5);
        assert_ne!(body["spec"]["acquireTime"], "2020-01-01T00:00:00.000000Z");
        respond(send, StatusCode::OK, &stored(seen.body, "57"));
    });
    let seen = lock.observe().await.unwrap().unwrap();
    assert_eq!(
        (seen.holder.as_str(), seen.transitions, seen.version.as_str()),
        ("pod-0", 4, "55")
    );
    let renewed = lock
        .claim(Some(&seen), "pod-0", Duration::from_secs(15))
        .await
        .unwrap();
    assert_eq!(renewed.version, "56");
    let taken = lock
        .claim(Some(&renewed), "pod-1", Duration::from_secs(15))
        .await
        .unwrap();
    assert_eq!(
        (taken.holder.as_str(), taken.transitions, taken.version.as_str()),
        ("pod-1", 5, "57")
    );
    server.await.unwrap();
}

fn leader_lease_json(holder: &str, version: &str, transitions: i32) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": { "name": "understudy-operator", "namespace": NAMESPACE, "resourceVersion": version },
        "spec": {
            "holderIdentity": holder, "leaseDurationSeconds": 15, "leaseTransitions": transitions,
            "acquireTime": "2020-01-01T00:00:00.000000Z", "renewTime": "2020-01-01T00:00:10.000000Z",
        },
    })
}

type Stoppable = (
    tokio::sync::watch::Receiver<bool>,
    tokio::sync::oneshot::Sender<()>,
    JoinHandle<Release>,
);

/// An elector for `pod-0` on the mocked API server, stopped when the sender is used.
fn stoppable_elector(api: Api<Lease>) -> Stoppable {
    let lock = KubeLease::new(api, "understudy-operator");
    let elector = LeaderElector::new(lock, "pod-0", LeaderConfig::default()).unwrap();
    let leading = elector.is_leader();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(elector.run_until(async {
        let _ = stopped.await;
    }));
    (leading, stop, task)
}

/// Plays the API server while `pod-0` takes over a released Lease at version 55; it then holds
/// it at version 56 with five transitions.
async fn take_over(verifier: &mut ApiServerVerifier, leading: &mut tokio::sync::watch::Receiver<bool>) {
    let (seen, send) = verifier.next().await;
    assert_eq!(
        (seen.method, seen.path),
        (Method::GET, format!("{LEASES}/understudy-operator"))
    );
    respond(send, StatusCode::OK, &leader_lease_json("", "55", 4));
    let (seen, send) = verifier.next().await;
    assert_eq!(seen.method, Method::PUT);
    assert_eq!(seen.body["spec"]["holderIdentity"], "pod-0");
    assert_eq!(seen.body["spec"]["leaseTransitions"], 5);
    respond(send, StatusCode::OK, &stored(seen.body, "56"));
    leading.wait_for(|leads| *leads).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_stopped_leader_clears_the_holder_with_a_put_at_the_version_it_read() {
    let (api, mut verifier) = api_and_verifier();
    let (mut leading, stop, elector) = stoppable_elector(api);
    take_over(&mut verifier, &mut leading).await;

    stop.send(()).unwrap();
    let (seen, send) = verifier.next().await;
    assert_eq!(seen.method, Method::GET);
    assert!(
        !*leading.borrow(),
        "leadership ends before the release is written"
    );
    respond(send, StatusCode::OK, &leader_lease_json("pod-0", "56", 5));
    let (seen, send) = verifier.next().await;
    assert_eq!(
        (seen.method, seen.path.as_str()),
        (
            Method::PUT,
            "/apis/coordination.k8s.io/v1/namespaces/serving/leases/understudy-operator"
        )
    );
    let body = &seen.body;
    assert_eq!(
        body["metadata"]["resourceVersion"], "56",
        "conditioned on the version read"
    );
    assert_eq!(body["spec"]["holderIdentity"], "");
    assert_eq!(body["spec"]["leaseDurationSeconds"], 1);
    assert_eq!(
        body["spec"]["leaseTransitions"], 5,
        "a release is not a transition"
    );
    respond(send, StatusCode::OK, &stored(seen.body, "57"));
    assert_eq!(elector.await.unwrap(), Release::Released);
    verifier.no_more_requests().await;
}

#[tokio::test(start_paused = true)]
async fn a_stopped_leader_leaves_a_lease_written_since_it_read_it_or_held_by_another() {
    // The Lease moved between the read and the release: the conflict is final.
    let (api, mut verifier) = api_and_verifier();
    let (mut leading, stop, elector) = stoppable_elector(api);
    take_over(&mut verifier, &mut leading).await;
    stop.send(()).unwrap();
    let (_, send) = verifier.next().await;
    respond(send, StatusCode::OK, &leader_lease_json("pod-0", "56", 5));
    let (seen, send) = verifier.next().await;
    assert_eq!(seen.method, Method::PUT);
    respond(
        send,
        StatusCode::CONFLICT,
        &status(
            409,
            "Conflict",
            "the object has been modified; please apply your changes to the latest version and try again",
        ),
    );
    assert_eq!(elector.await.unwrap(), Release::NotHeld);
    verifier.no_more_requests().await;

    // Another holder since: read, and nothing written.
    let (api, mut verifier) = api_and_verifier();
    let (mut leading, stop, elector) = stoppable_elector(api);
    take_over(&mut verifier, &mut leading).await;
    stop.send(()).unwrap();
    let (seen, send) = verifier.next().await;
    assert_eq!(seen.method, Method::GET);
    respond(send, StatusCode::OK, &leader_lease_json("pod-1", "60", 6));
    assert_eq!(elector.await.unwrap(), Release::NotHeld);
    verifier.no_more_requests().await;
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_controllers_stall_sends_no_renewal_until_they_progress_again() {
    let (api, mut verifier) = api_and_verifier();
    let watchdog = Watchdog::new(Duration::from_secs(5));
    let elector = LeaderElector::new(
        KubeLease::new(api, "understudy-operator"),
        "pod-0",
        LeaderConfig::default(),
    )
    .unwrap()
    .with_watchdog(watchdog.clone());
    let mut leading = elector.is_leader();
    let _elector = tokio::spawn(elector.run());
    take_over(&mut verifier, &mut leading).await;
    // A reconcile starts now and never finishes: stalled from 5 s.
    let policy = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        namespace: Some(NAMESPACE.into()),
        name: Some("chat".into()),
        ..Default::default()
    };
    let stuck = watchdog.reconciling(Reconciler::FailoverPolicy, &policy);

    // The renewals at 2 s and 4 s go out as usual.
    for (read, written) in [("56", "57"), ("57", "58")] {
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::GET);
        respond(send, StatusCode::OK, &leader_lease_json("pod-0", read, 5));
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::PUT);
        respond(send, StatusCode::OK, &stored(seen.body, written));
    }
    // From 5 s nothing is sent, not even a read; leadership ends at the renew deadline (14 s).
    let quiet = tokio::time::timeout(Duration::from_secs(30), verifier.0.next_request()).await;
    assert!(quiet.is_err(), "a stalled leader sent a request");
    assert!(!*leading.borrow());

    // The reconcile ends: the candidate contends again and takes back the Lease in its name.
    drop(stuck);
    let (seen, send) = verifier.next().await;
    assert_eq!(seen.method, Method::GET);
    respond(send, StatusCode::OK, &leader_lease_json("pod-0", "58", 5));
    let (seen, send) = verifier.next().await;
    assert_eq!(seen.method, Method::PUT);
    assert_eq!(seen.body["metadata"]["resourceVersion"], "58");
    assert_eq!(seen.body["spec"]["holderIdentity"], "pod-0");
    respond(send, StatusCode::OK, &stored(seen.body, "59"));
    leading.wait_for(|leads| *leads).await.unwrap();
}

/// A leader Lease held by `holder` at `version` whose holder's clock stamped `renew_time`.
fn skewed_lease(holder: &str, version: &str, renew_time: &str) -> Value {
    let mut lease = leader_lease_json(holder, version, 3);
    lease["spec"]["renewTime"] = json!(renew_time);
    lease
}

#[tokio::test(start_paused = true)]
async fn a_holder_whose_clock_runs_ahead_is_taken_over_after_the_lease_duration_all_the_same() {
    // The holder stamped its last renewal a century ahead and stopped: the record never changes.
    let (api, mut verifier) = api_and_verifier();
    let (mut leading, _stop, _elector) = stoppable_elector(api);
    let origin = tokio::time::Instant::now();
    let frozen = skewed_lease("pod-1", "70", "2126-01-01T00:00:00.000000Z");
    let took_over_after = loop {
        let (seen, send) = verifier.next().await;
        if seen.method == Method::PUT {
            assert_eq!(seen.body["spec"]["holderIdentity"], "pod-0");
            assert_eq!(seen.body["metadata"]["resourceVersion"], "70");
            respond(send, StatusCode::OK, &stored(seen.body, "71"));
            break origin.elapsed();
        }
        respond(send, StatusCode::OK, &frozen);
    };
    // Judged by this replica's own clock from when it first saw the record: the lease duration
    // (15 s) and at most one retry period (2 s), never the holder's stamp.
    assert!(
        took_over_after >= Duration::from_secs(15) && took_over_after <= Duration::from_secs(17),
        "{took_over_after:?}"
    );
    leading.wait_for(|leads| *leads).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_holder_whose_clock_runs_behind_keeps_the_lease_while_it_renews() {
    // The holder's stamps are decades old, but every read finds a new version: it renews.
    let (api, mut verifier) = api_and_verifier();
    let (leading, _stop, _elector) = stoppable_elector(api);
    let origin = tokio::time::Instant::now();
    let mut version = 80;
    while origin.elapsed() < Duration::from_secs(120) {
        let (seen, send) = verifier.next().await;
        assert_eq!(seen.method, Method::GET, "a renewing holder was overwritten");
        version += 1;
        let renewed = skewed_lease("pod-1", &version.to_string(), "2001-01-01T00:00:00.000000Z");
        respond(send, StatusCode::OK, &renewed);
    }
    assert!(!*leading.borrow());
}
