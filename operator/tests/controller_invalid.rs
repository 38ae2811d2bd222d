//! The FailoverPolicy controller against a scripted API server: policies that cannot be run are
//! reported and nothing else is touched; deleted ones are let go.
//!
//! Each test hands `reconcile` a client whose transport is a `tower-test` mock, and runs an
//! [`ApiServer`] that expects the requests of one scenario in order, checks their method, path
//! and the body fields that matter, and answers with realistic objects. Events (POST or PATCH to
//! `events.k8s.io`) are answered and collected on the side, so a scenario lists only the writes
//! that carry state. So is the list of the policy's GPU reserves every reconcile makes, with none
//! found, unless a scenario about reserves turns that off to script it. A scenario that ends with
//! [`ApiServer::expect_no_more`] also proves that the reconcile made no request beyond the
//! script: the mock sees the client hang up first. The policy, its records and the one reconcile
//! run are the shared fixture in `support/policy.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kube::runtime::controller::Action;
use serde_json::{Value, json};

mod support;
use support::NS;
use support::policy::*;

fn object_with_status(patch: &Value) -> Value {
    let mut stored = policy();
    stored["status"] = patch["status"].clone();
    stored
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
