//! The FailoverPolicy controller against a scripted API server: what a status write records and
//! tells, the error policy, the golden answer in status, and the watchdog.
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

use futures::StreamExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Config, applier};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;
use serde_json::{Value, json};
use understudy_core::failover::FailoverState;
use understudy_core::{Epoch, Pool};
use understudy_operator::controller::{Context, error_policy, reconcile};
use understudy_operator::crd::{FailoverPolicy, GoldenAnswer};
use understudy_operator::metrics::Metrics;
use understudy_operator::ports::ProbeFindings;
use understudy_operator::reconciler::WithShell;
use understudy_operator::watchdog::{Reconciler, Watchdog};

mod support;
use support::policy::*;
use support::{ApiServer, TIMEOUT, reasons, status};

/// The golden answer a prober holds for every policy.
#[derive(Debug)]
struct HeldGolden(Option<GoldenAnswer>);

impl ProbeFindings for HeldGolden {
    fn golden_answer(&self, _: &ObjectRef<FailoverPolicy>) -> Option<GoldenAnswer> {
        self.0.clone()
    }
}

/// The status one reconcile of `object` applies, between promotions with the Lease as recorded.
async fn applied_status(object: Value, ctx: Arc<Context>, server: ApiServer) -> Value {
    let stored = object.clone();
    let (applied, done) = tokio::sync::oneshot::channel();
    let (result, _) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-east", 0, "41"));
            let patch = server.expect("PATCH", STATUS_PATH).await;
            applied.send(answer_status(patch, &stored)).unwrap();
            server.expect_no_more().await
        },
        server,
    )
    .await;
    result.unwrap();
    done.await.unwrap()
}

#[tokio::test]
async fn a_failed_final_status_write_tells_and_counts_nothing_that_will_run_again() {
    let object = with_record(policy(), &record_stopped_at_scale());
    let (ctx, server) = context(Vec::new());
    let metrics = ctx.metrics.clone();
    let (result, events) = run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 2, "57"));
            answer_west_at_four(&mut server, 4).await;
            // The promotion finished, but the status that records it is refused.
            server.expect("PATCH", STATUS_PATH).await.answer(
                500,
                &status(500, "InternalError", "etcdserver: request timed out"),
            );
            server.expect_no_more().await
        },
        server,
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.category(), "status", "{error}");
    // The next reconcile resumes from the same record and finishes again: it tells and counts it
    // then, once.
    assert!(events.is_empty(), "{events:?}");
    let text = metrics.encode().unwrap();
    assert!(!text.contains("understudy_failovers_total{"), "{text}");
}

#[tokio::test]
async fn an_unreachable_lease_write_is_counted_as_the_control_plane_not_the_status() {
    let mut object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
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
            answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
            // The API server goes away between the write-ahead and the compare-and-set.
            server
                .expect("PUT", LEASE_PATH)
                .await
                .answer(503, &status(503, "ServiceUnavailable", "etcd is down"));
            server
                .expect("PATCH", STATUS_PATH)
                .await
                .answer(503, &status(503, "ServiceUnavailable", "etcd is down"));
            server.expect_no_more().await
        },
        server,
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.category(), "control_plane_unreachable", "{error}");
    // What the write-ahead recorded is told; what only the failed write held is not.
    assert_eq!(reasons(&events), ["PromotionStarted"]);
}

#[tokio::test]
async fn a_failed_reconcile_goes_through_the_error_policy_and_the_loop_carries_on() {
    tokio::time::pause();
    let object = policy();
    let (ctx, server) = context(Vec::new());
    let metrics = ctx.metrics.clone();
    let stored = object.clone();
    let verifier = tokio::spawn(async move {
        let mut server = server;
        // First attempt: the API server is overloaded.
        server.expect("GET", LEASE_PATH).await.answer(
            500,
            &status(500, "InternalError", "etcdserver: request timed out"),
        );
        // The retry, after the error policy's backoff, goes through.
        server
            .expect("GET", LEASE_PATH)
            .await
            .answer(200, &lease("us-east", 0, "41"));
        let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
        assert_eq!(applied["state"], "Serving");
        server
    });

    let (reader, mut writer) = reflector::store::<DeserializeGuard<FailoverPolicy>>();
    let policy_object: DeserializeGuard<FailoverPolicy> = serde_json::from_value(object.clone()).unwrap();
    // As a watcher's first list would: the loop waits for the store to be initialised.
    writer.apply_watcher_event(&watcher::Event::Init);
    writer.apply_watcher_event(&watcher::Event::InitApply(policy_object.clone()));
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let (queue_tx, queue_rx) = futures::channel::mpsc::unbounded();
    queue_tx
        .unbounded_send(ObjectRef::from_obj(&policy_object))
        .unwrap();
    let outcomes: Vec<_> = tokio::time::timeout(
        Duration::from_secs(60),
        applier(
            |object, ctx| Box::pin(reconcile(object, ctx)),
            error_policy,
            ctx,
            reader,
            queue_rx.map(Ok::<_, std::convert::Infallible>),
            Config::default(),
        )
        .take(2)
        .collect(),
    )
    .await
    .expect("the loop stalled");
    drop(queue_tx);

    assert!(outcomes[0].is_err(), "{:?}", outcomes[0]);
    let (reconciled, action) = outcomes[1].as_ref().unwrap();
    assert_eq!(reconciled.name, NAME);
    assert_eq!(*action, Action::requeue(Duration::from_secs(10)));
    let _server = tokio::time::timeout(TIMEOUT, verifier).await.unwrap().unwrap();

    let text = metrics.encode().unwrap();
    assert!(text.contains("understudy_reconciliations_total 2"), "{text}");
    assert!(
        text.contains(r#"understudy_reconcile_errors_total{category="control_plane_unreachable"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn the_golden_answer_the_probes_judge_by_is_applied_to_status_with_the_time_it_was_recorded() {
    const PROMPT: &str = "The capital of France is";
    // Just recorded by the prober: stamped with the reconcile's time.
    let (ctx, server) = context(Vec::new());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_findings(Arc::new(HeldGolden(Some(golden_answer(PROMPT, None))))),
    );
    let applied = applied_status(policy(), ctx, server).await;
    assert_eq!(
        applied["goldenAnswer"],
        json!({
            "prefix": " Paris. It is also the l", "prompt": PROMPT, "maxTokens": 8, "pool": "us-east",
            "model": "meta-llama/Llama-3.1-8B", "recordedAt": "2024-06-01T12:00:00Z",
        })
    );

    // The same answer already in status keeps the time it was first recorded.
    let mut object = policy();
    object["status"]["goldenAnswer"] = json!(golden_answer(PROMPT, Some("2024-05-01T08:00:00Z")));
    let (ctx, server) = context(Vec::new());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_findings(Arc::new(HeldGolden(Some(golden_answer(PROMPT, None))))),
    );
    let applied = applied_status(object.clone(), ctx, server).await;
    assert_eq!(applied["goldenAnswer"]["recordedAt"], "2024-05-01T08:00:00Z");

    // The prober dropped it (another prompt, another model): the apply leaves it out, so
    // server-side apply removes the field this manager owned.
    let (ctx, server) = context(Vec::new());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_findings(Arc::new(HeldGolden(None))),
    );
    let applied = applied_status(object.clone(), ctx, server).await;
    assert!(applied.get("goldenAnswer").is_none(), "{applied}");

    // A controller that does not probe keeps the one in status while it fits the probe.
    let (ctx, server) = context(Vec::new());
    let applied = applied_status(object, ctx, server).await;
    assert_eq!(applied["goldenAnswer"]["recordedAt"], "2024-05-01T08:00:00Z");
    let mut object = policy();
    object["status"]["goldenAnswer"] = json!(golden_answer("Another prompt", Some("2024-05-01T08:00:00Z")));
    let (ctx, server) = context(Vec::new());
    let applied = applied_status(object, ctx, server).await;
    assert!(applied.get("goldenAnswer").is_none(), "{applied}");
}

#[tokio::test(start_paused = true)]
async fn a_reconcile_the_api_server_leaves_unanswered_stalls_the_watchdog_until_it_finishes() {
    let mut fresh = policy();
    fresh["metadata"].as_object_mut().unwrap().remove("finalizers");
    let watchdog = Watchdog::new(Duration::from_secs(60));
    let (client, mut server) = support::client();
    let ctx = Context::new(client, Arc::new(Metrics::new()), None)
        .with_clock(Arc::new(FixedClock))
        .with_watchdog(watchdog.clone());
    let reconciling = tokio::spawn(reconcile(guard(&fresh), Arc::new(ctx)));
    // The finalizer patch goes unanswered for a minute.
    let call = server.expect("PATCH", POLICY_PATH).await;
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(watchdog.stall(), None);
    tokio::time::advance(Duration::from_secs(1)).await;
    let stall = watchdog
        .stall()
        .expect("a reconcile stuck for stall_after is a stall");
    assert_eq!(
        (stall.reconciler, stall.object.as_str()),
        (Reconciler::FailoverPolicy, "serving/llama")
    );
    let mut stored = fresh.clone();
    stored["metadata"]["finalizers"] = json!(["understudy.dev/cleanup"]);
    call.answer(200, &stored);
    assert_eq!(reconciling.await.unwrap().unwrap(), Action::await_change());
    assert_eq!(watchdog.stall(), None, "a finished reconcile is progress");
    server.expect_no_more().await;
}
