//! The FailoverPolicy controller against a scripted API server: commands (`failover`,
//! `force-failover`), a paused policy, commands never replayed, and a drifted standby.
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
use kube::runtime::reflector::ObjectRef;
use serde_json::{Value, json};
use understudy_core::failover::{CheckResult, FailoverState, Phase, PoolHealth};
use understudy_core::{Epoch, Pool};
use understudy_operator::controller::Context;
use understudy_operator::crd::{FailoverPolicy, GoldenAnswer, ParityDrift, ParityStatus};
use understudy_operator::ports::{Clock, Observation, ProbeFindings};
use understudy_operator::reconciler::WithShell;

mod support;
use support::policy::*;
use support::{ApiServer, NS, reasons};

/// The default policy under maintenance: `spec.paused`.
fn paused_policy() -> Value {
    let mut object = policy();
    object["spec"]["paused"] = json!(true);
    object
}

/// The controller's clock stopped `elapsed` after [`NOW`], for a scenario of several probe rounds.
#[derive(Debug)]
struct After(Duration);

impl Clock for After {
    fn now(&self) -> Duration {
        NOW + self.0
    }
}

/// A prober whose last comparison found the standby serving a shorter context.
#[derive(Debug)]
struct Drifted;

fn drifted() -> ParityStatus {
    ParityStatus {
        checked_at: "2024-06-01T11:59:55Z".to_owned(),
        artifact_keys: 0,
        compared: 9,
        drift: vec![ParityDrift {
            key: "flag.max-model-len".to_owned(),
            primary: Some("8192".to_owned()),
            standby: Some("4096".to_owned()),
        }],
        allowed: Vec::new(),
        not_compared: Vec::new(),
        model_files: Vec::new(),
    }
}

impl ProbeFindings for Drifted {
    fn golden_answer(&self, _: &ObjectRef<FailoverPolicy>) -> Option<GoldenAnswer> {
        None
    }

    fn parity(&self, _: &ObjectRef<FailoverPolicy>) -> Option<ParityStatus> {
        Some(drifted())
    }
}

/// A proven standby that drifted, as a round reports it, and `command` on the policy.
fn drifted_standby(command: &str) -> (Value, Arc<Context>, ApiServer) {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": command});
    let mut observations = standby_proven();
    observations.push(Observation::Parity { holds: false });
    let (ctx, server) = context(observations);
    let ctx = Arc::new(Arc::into_inner(ctx).unwrap().with_findings(Arc::new(Drifted)));
    (object, ctx, server)
}

#[tokio::test]
async fn a_command_promotes_a_proven_standby_and_waits_for_it_to_serve() {
    // The prober saw the standby pass twice, which proves it; then a person asks for a failover.
    let observations = vec![
        Observation::Check {
            pool: Pool::B,
            result: CheckResult::Pass,
        },
        Observation::Check {
            pool: Pool::B,
            result: CheckResult::Pass,
        },
    ];
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover@drill-7"});
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
            let intent = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(intent["failover"]["handledCommand"]["value"], "failover@drill-7");
            let put = server.expect("PUT", LEASE_PATH).await;
            assert_eq!(put.body["metadata"]["annotations"]["understudy.dev/epoch"], "1");
            put.answer(200, &lease("us-west", 1, "42"));
            // Already at its serving size: nothing is written to the workload.
            server.expect("GET", &format!("{WEST_PATH}/scale")).await.answer(
                200,
                &json!({
                    "apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {"name": "vllm-west", "namespace": NS},
                    "spec": {"replicas": 4}, "status": {"replicas": 4},
                }),
            );
            // Two of four ready is not a majority: the promotion waits here.
            server.expect("GET", WEST_PATH).await.answer(
                200,
                &json!({
                    "apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": "vllm-west", "namespace": NS},
                    "status": {"replicas": 4, "readyReplicas": 2},
                }),
            );
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Promoting");
            assert_eq!(applied["epoch"], 1);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["conditions"]["Ready"]["reason"], "Promoting");
            let steps: Vec<&str> = applied["lastFailover"]["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["step"].as_str().unwrap())
                .collect();
            assert_eq!(steps, ["LeaseClaimed", "Fenced", "Woken", "ScaledUp"]);
            assert!(applied["lastFailover"].get("finishedAt").is_none());
            server.expect_no_more().await
        },
        server,
    )
    .await;
    // Looked at again soon, not after a whole probe interval.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(2)));
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.contains(&"PromotionStarted"), "{reasons:?}");
    assert!(reasons.contains(&"StepWaiting"), "{reasons:?}");
    assert!(!reasons.contains(&"PromotionFinished"), "{reasons:?}");
}

#[tokio::test]
async fn a_failover_command_is_refused_for_a_standby_never_seen_to_pass() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    // No prober: no observation ever came.
    let (ctx, server) = context(Vec::new());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["epoch"], 0);
            // Refused is handled: it is not tried again on every reconcile.
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    assert_eq!(reasons(&events), ["CommandRefused"]);
    assert_eq!(events[0].type_, "Warning");
    assert!(
        events[0].note.contains("StandbyNotEligible"),
        "{}",
        events[0].note
    );
}

#[tokio::test]
async fn force_failover_promotes_a_standby_nothing_vouches_for() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), Some("failover")),
    );
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "force-failover"});
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
                .answer(200, &lease("us-east", 0, "41"));
            let intent = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(
                intent["failover"]["machine"]["phase"]["Promoting"]["kind"],
                "Forced"
            );
            let put = server.expect("PUT", LEASE_PATH).await;
            assert_eq!(put.body["metadata"]["resourceVersion"], "41");
            assert_eq!(put.body["spec"]["holderIdentity"], "us-west");
            assert_eq!(put.body["metadata"]["annotations"]["understudy.dev/epoch"], "1");
            put.answer(200, &lease("us-west", 1, "42"));
            answer_west_at_four(&mut server, 4).await;
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["epoch"], 1);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "force-failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let reasons = reasons(&events);
    assert!(reasons.contains(&"PromotionStarted"), "{reasons:?}");
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"understudy_failovers_total{namespace="serving",policy="llama",kind="forced"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_paused_policy_never_promotes_however_long_its_primary_fails_and_warns_once_why() {
    // Eight probe rounds, one reconcile each, ten seconds (the probe interval) apart: the standby
    // passes every round and is proven by the second, the primary fails every round, twice the
    // default promoteAfter (4). Unpaused, the fourth round would promote.
    let mut object = with_record(
        paused_policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(3)), None),
    );
    let mut told = Vec::new();
    for round in 1..=8_u32 {
        let (ctx, server) = context(vec![
            Observation::Check {
                pool: Pool::B,
                result: CheckResult::Pass,
            },
            Observation::Check {
                pool: Pool::A,
                result: CheckResult::SoftFail,
            },
        ]);
        let elapsed = Duration::from_secs(10 * u64::from(round));
        let ctx = Arc::new(Arc::into_inner(ctx).unwrap().with_clock(Arc::new(After(elapsed))));
        let stored = object.clone();
        let (applied, done) = tokio::sync::oneshot::channel();
        let (result, events) = run_scenario(
            &object,
            ctx,
            |mut server| async move {
                server
                    .expect("GET", LEASE_PATH)
                    .await
                    .answer(200, &lease("us-east", 3, "41"));
                // The status and nothing after it: no write-ahead of a promotion, no
                // compare-and-set on the Lease.
                let patch = server.expect("PATCH", STATUS_PATH).await;
                applied.send(answer_status(patch, &stored)).unwrap();
                server.expect_no_more().await
            },
            server,
        )
        .await;
        assert_eq!(
            result.unwrap(),
            Action::requeue(Duration::from_secs(10)),
            "round {round}"
        );
        let applied = done.await.unwrap();
        let state = match round {
            1 => "Serving",
            2 | 3 => "Suspect",
            _ => "Stranded",
        };
        assert_eq!(applied["state"], state, "round {round}");
        assert_eq!(applied["epoch"], 3, "round {round}");
        assert_eq!(applied["primaryPool"], "us-east", "round {round}");
        // Every failed check is counted: the pause, not a lost observation, holds the standby back.
        assert_eq!(
            applied["failover"]["machine"]["health"][0]["failures"], round,
            "round {round}"
        );
        told.extend(events.into_iter().map(|e| (round, e)));
        object["status"] = applied;
    }

    let status = &object["status"];
    assert_eq!(
        status["conditions"]["StandbyProven"]["status"], "True",
        "{status}"
    );
    // Status names the pause as what holds the standby back, and the way past it.
    let ready = &status["conditions"]["Ready"];
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "Paused");
    assert_eq!(
        ready["message"],
        "us-east is failing and spec.paused holds us-west back: nothing fails over on its own while \
         paused (the understudy.dev/command annotation still does)"
    );
    // Stranded since the fourth round, and not stamped again by the four after it.
    assert_eq!(ready["lastTransitionTime"], "2024-06-01T12:00:40Z");
    assert!(status.get("lastFailover").is_none(), "{status}");
    // The block is told once, when it begins, not every round.
    let reasons: Vec<(u32, &str)> = told.iter().map(|(r, e)| (*r, e.reason.as_str())).collect();
    assert_eq!(reasons, [(2, "PrimarySuspect"), (4, "PromotionBlocked")]);
    let (_, blocked) = &told[1];
    assert_eq!(blocked.type_, "Warning");
    assert_eq!(
        blocked.note,
        "the primary is failing and nothing can be promoted: Paused"
    );
}

#[tokio::test]
async fn a_failover_command_still_switches_a_paused_policy_over_to_its_proven_standby() {
    // Paused, and stranded by it: the primary failed eight checks, the standby passed eight.
    // A person decides to fail over anyway; the pause stops only automatic promotion.
    let mut machine = FailoverState::starting_at(Pool::A, Epoch(3));
    machine.phase = Phase::Stranded;
    machine.health[Pool::A.index()] = PoolHealth {
        failures: 8,
        ..PoolHealth::default()
    };
    machine.health[Pool::B.index()].passes = 8;
    let mut object = with_record(paused_policy(), &record(machine, None));
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
                .answer(200, &lease("us-east", 3, "41"));
            let intent = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            let promotion = &intent["failover"]["machine"]["phase"]["Promoting"];
            assert_eq!(promotion["kind"], "Manual", "{intent}");
            assert_eq!(promotion["epoch"], 4, "{intent}");
            let put = server.expect("PUT", LEASE_PATH).await;
            assert_eq!(put.body["metadata"]["resourceVersion"], "41");
            assert_eq!(put.body["spec"]["holderIdentity"], "us-west");
            assert_eq!(put.body["metadata"]["annotations"]["understudy.dev/epoch"], "4");
            put.answer(200, &lease("us-west", 4, "42"));
            answer_west_at_four(&mut server, 4).await;
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["epoch"], 4);
            assert_eq!(applied["primaryPool"], "us-west");
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["lastFailover"]["kind"], "failover");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    let reasons = reasons(&events);
    assert!(!reasons.contains(&"CommandRefused"), "{reasons:?}");
    let started = events.iter().find(|e| e.reason == "PromotionStarted").unwrap();
    assert_eq!(started.note, "Manual: promoting us-west over us-east at epoch 4");
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"understudy_failovers_total{namespace="serving",policy="llama",kind="manual"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_spec_edit_does_not_replay_a_command_left_on_the_object() {
    // The command ran at generation 1 (recorded by an operator that still wrote the generation);
    // then someone edited the spec. The standby is proven, so a replay would promote it.
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["status"]["failover"]["handledCommand"] = json!({"value": "failover", "generation": 1});
    object["metadata"]["generation"] = json!(2);
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(standby_proven());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["observedGeneration"], 2);
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    assert!(!reasons(&events).contains(&"PromotionStarted"), "{events:?}");
}

#[tokio::test]
async fn removing_the_command_annotation_forgets_it_so_the_same_value_can_be_given_again() {
    let object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), Some("failover")),
    );
    let (ctx, server) = context(Vec::new());
    let stored = object.clone();
    let (result, _) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert!(applied["failover"].get("handledCommand").is_none(), "{applied}");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test]
async fn a_garbled_machine_record_does_not_replay_the_handled_command() {
    let mut object = policy();
    object["status"] = json!({
        "epoch": 0,
        "primaryPool": "us-east",
        "failover": {"machine": {"primary": "nobody"}, "handledCommand": {"value": "failover"}},
    });
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(standby_proven());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            // The machine starts afresh from the Lease and the record is whole again.
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["failover"]["machine"]["epoch"], 0);
            assert_eq!(applied["failover"]["machine"]["primary"], "A");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(10)));
    assert!(!reasons(&events).contains(&"PromotionStarted"), "{events:?}");
}

#[tokio::test]
async fn a_command_whose_record_is_unreadable_is_not_run_and_says_so() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    object["status"]["failover"]["handledCommand"] = json!(["fail", "over"]);
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "failover"});
    let (ctx, server) = context(standby_proven());
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["failover"]["handledCommand"]["value"], "failover");
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(reasons(&events), ["CommandNotRun"]);
    assert!(events[0].note.contains("@token"), "{}", events[0].note);
}

#[tokio::test]
async fn a_drifted_standby_is_not_switched_to_and_the_drift_is_told_key_by_key() {
    let (object, ctx, server) = drifted_standby("failover@drill-9");
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            // No Lease write: the one status write records the drift and the refusal.
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["state"], "Serving");
            assert_eq!(applied["epoch"], 0);
            assert_eq!(applied["parity"]["drift"][0]["key"], "flag.max-model-len");
            let condition = &applied["conditions"]["ParityHolds"];
            assert_eq!(condition["status"], "False");
            assert_eq!(condition["reason"], "Drift");
            assert_eq!(
                condition["message"],
                "us-west differs from us-east in 1 key(s): flag.max-model-len (8192 ≠ 4096); it is not \
                 promoted automatically (force-failover still promotes it)"
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    result.unwrap();
    let refused = events.iter().find(|e| e.reason == "CommandRefused").unwrap();
    assert!(refused.note.contains("ParityBroken"), "{}", refused.note);
    let drift = events.iter().find(|e| e.reason == "ParityDrift").unwrap();
    assert_eq!(drift.type_, "Warning");
    assert_eq!(
        drift.note,
        "us-west differs from us-east: flag.max-model-len (8192 ≠ 4096); it is not promoted \
         automatically until they agree (force-failover still promotes it)"
    );
}

#[tokio::test]
async fn force_failover_promotes_a_drifted_standby_and_records_what_it_overrode() {
    let (object, ctx, server) = drifted_standby("force-failover@drill-10");
    let stored = object.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            server
                .expect("PUT", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 1, "42"));
            answer_west_at_four(&mut server, 4).await;
            let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            assert_eq!(applied["primaryPool"], "us-west");
            let claimed = &applied["lastFailover"]["steps"][0];
            assert_eq!(claimed["step"], "LeaseClaimed");
            assert_eq!(
                claimed["note"],
                "promoted by force-failover past parity drift: flag.max-model-len (8192 ≠ 4096)"
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    result.unwrap();
    let overridden = events.iter().find(|e| e.reason == "ParityOverridden").unwrap();
    assert_eq!(overridden.type_, "Warning");
}
