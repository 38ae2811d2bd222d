//! The FailoverPolicy controller and its epoch Lease, against a scripted API server: creating it,
//! the compare-and-set, restarts mid-promotion, a Lease recreated or below the record, and an
//! API server that cannot be reached.
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

use std::time::Duration;

use kube::runtime::controller::Action;
use serde_json::json;
use understudy_core::failover::{
    CheckResult, FailoverState, Phase, PoolHealth, Promotion, Step, TransitionKind,
};
use understudy_core::{Epoch, Pool};
use understudy_operator::ports::Observation;

mod support;
use support::policy::*;
use support::{reasons, status};

const LEASES_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/serving/leases";

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
            assert!(message.contains("not recorded here"), "{message}");
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
            answer_west_at_four(&mut server, 4).await;
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
            answer_west_at_four(&mut server, 4).await;
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
