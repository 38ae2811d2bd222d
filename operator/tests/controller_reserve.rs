//! The FailoverPolicy controller against a scripted API server: the standby's GPU reserve.
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

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::Action;
use serde_json::{Value, json};
use understudy_core::failover::FailoverState;
use understudy_core::{Epoch, Pool};
use understudy_operator::controller::Context;

mod support;
use support::policy::*;
use support::{ApiServer, Call, NS, reasons, status};

const EAST_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/vllm-east";

const WEST_RESERVE_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/llama-us-west-reserve";

const EAST_RESERVE_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/llama-us-east-reserve";

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

/// The chart's ClusterRole with its template expressions blanked out, as YAML.
fn chart_cluster_role() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/understudy/templates/rbac.yaml"
    );
    // A line that is only a template directive (`{{- if … }}`, `{{- end }}`) goes; any other
    // template expression stands in as a plain value.
    let mut text: String = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|line| {
            let line = line.trim();
            !(line.starts_with("{{") && line.ends_with("}}") && line.matches("{{").count() == 1)
        })
        .map(|line| format!("{line}\n"))
        .collect();
    while let Some(start) = text.find("{{") {
        let end = start + text[start..].find("}}").unwrap() + 2;
        text.replace_range(start..end, "x");
    }
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| <Value as serde::Deserialize>::deserialize(document).unwrap())
        .find(|document| document["kind"] == "ClusterRole")
        .unwrap()
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
            answer_west_at_four(&mut server, 2).await;
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
