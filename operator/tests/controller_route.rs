//! The FailoverPolicy controller against a scripted API server: the Route step's answers from the
//! routers, and the route kept in place between promotions.
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

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::runtime::controller::Action;
use serde_json::Value;
use understudy_core::failover::{FailoverState, Step};
use understudy_core::{Epoch, Pool};
use understudy_operator::ports::{RouteSyncReport, RouteSyncRequest, StepExecutor, StepReport, StepRequest};

mod support;
use support::policy::*;
use support::{ApiServer, Published, reasons};

/// Routers as the route push reports them: the route step answers `route`, every other step is
/// done without a note.
#[derive(Debug)]
struct Routers {
    route: StepReport,
}

impl StepExecutor for Routers {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> futures::future::BoxFuture<'a, StepReport> {
        let report = match request.step {
            Step::Route => self.route.clone(),
            _ => StepReport::Done {
                carried_by: "router",
                note: None,
            },
        };
        Box::pin(async move { report })
    }
}

/// A reconcile of a promotion stopped at scale, with `route` for the route step: the Lease read,
/// the scale-up, the serving check, then whatever `scenario` expects next.
async fn reconcile_to_the_route<F>(
    route: StepReport,
    scenario: impl FnOnce(ApiServer, Value) -> F + Send + 'static,
) -> (
    Result<Action, understudy_operator::controller::Error>,
    Vec<Published>,
)
where
    F: Future<Output = Vec<Published>> + Send + 'static,
{
    let object = with_record(policy(), &record_stopped_at_scale());
    let (ctx, server) = context(Vec::new());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_steps(Arc::new(Routers { route })),
    );
    let stored = object.clone();
    run_scenario(
        &object,
        ctx,
        |mut server| async move {
            server
                .expect("GET", LEASE_PATH)
                .await
                .answer(200, &lease("us-west", 2, "57"));
            answer_west_at_four(&mut server, 3).await;
            scenario(server, stored).await
        },
        server,
    )
    .await
}

/// Routers as the route sync reports them between promotions: one has seen a higher epoch.
#[derive(Debug)]
struct RouterAheadOfUs {
    asked: Mutex<Vec<(String, u64)>>,
}

impl StepExecutor for RouterAheadOfUs {
    fn carry_out<'a>(&'a self, _: StepRequest<'a>) -> futures::future::BoxFuture<'a, StepReport> {
        panic!("no step is carried out between promotions")
    }

    fn keep_route<'a>(
        &'a self,
        request: RouteSyncRequest<'a>,
    ) -> futures::future::BoxFuture<'a, RouteSyncReport> {
        self.asked
            .lock()
            .unwrap()
            .push((request.pool.name.clone(), request.epoch.0));
        Box::pin(async {
            RouteSyncReport {
                warnings: vec![(
                    "RouterAhead",
                    "router http://r:9091 has seen epoch 4 (pool us-west); ours is 0 for us-east".into(),
                )],
                view_stale: true,
            }
        })
    }
}

#[tokio::test]
async fn a_route_a_router_refuses_as_stale_is_told_in_a_warning_and_the_promotion_waits_at_the_route() {
    let refused = StepReport::Refused {
        carried_by: "router",
        reason: "RouteStale",
        note: "router http://r:9091 has seen epoch 3 (pool us-east); ours is 2 for us-west".into(),
    };
    let (result, events) = reconcile_to_the_route(refused, |mut server, stored| async move {
        let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
        assert_eq!(applied["state"], "Promoting");
        let steps = steps_of(&applied["lastFailover"]);
        assert!(
            !steps.iter().any(|(s, _)| s == "Routed"),
            "a refused route is in the timeline: {steps:?}"
        );
        server.expect_no_more().await
    })
    .await;
    // Looked at again soon: the next reconcile reads the Lease before it pushes again.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(2)));
    let stale = events.iter().find(|e| e.reason == "RouteStale").unwrap();
    assert_eq!(stale.type_, "Warning");
    assert!(
        stale.note.contains("epoch 3") && stale.note.contains("ours is 2"),
        "{}",
        stale.note
    );
    assert!(
        !reasons(&events).contains(&"PromotionFinished"),
        "{:?}",
        reasons(&events)
    );
}

#[tokio::test]
async fn a_route_every_router_took_is_in_the_timeline_as_done_with_the_routers_note() {
    let taken = StepReport::Done {
        carried_by: "router",
        note: Some("pushed to all 2 router(s): us-west at epoch 2, 3 endpoint(s)".into()),
    };
    let (result, events) = reconcile_to_the_route(taken, |mut server, stored| async move {
        let applied = answer_status(server.expect("PATCH", STATUS_PATH).await, &stored);
        assert_eq!(applied["state"], "Serving");
        let timeline = &applied["lastFailover"];
        let steps = steps_of(timeline);
        assert!(steps.contains(&("Routed".to_owned(), false)), "{steps:?}");
        assert!(
            steps.contains(&("AdmissionOpened".to_owned(), false)),
            "{steps:?}"
        );
        let routed = timeline["steps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["step"] == "Routed")
            .unwrap();
        assert_eq!(
            routed["note"],
            "pushed to all 2 router(s): us-west at epoch 2, 3 endpoint(s)"
        );
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    let reasons = reasons(&events);
    assert!(reasons.contains(&"PromotionFinished"), "{reasons:?}");
    assert!(!reasons.contains(&"StepHandedOff"), "{reasons:?}");
}

#[tokio::test]
async fn between_promotions_the_leases_route_is_kept_and_a_router_ahead_is_a_warning_and_a_soon_requeue() {
    let object = with_record(
        policy(),
        &record(FailoverState::starting_at(Pool::A, Epoch(0)), None),
    );
    let (ctx, server) = context(Vec::new());
    let routers = Arc::new(RouterAheadOfUs {
        asked: Mutex::new(Vec::new()),
    });
    let ctx = Arc::new(Arc::into_inner(ctx).unwrap().with_steps(routers.clone()));
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
            server.expect_no_more().await
        },
        server,
    )
    .await;
    assert_eq!(*routers.asked.lock().unwrap(), [("us-east".to_owned(), 0)]);
    // Looked at again soon, so that the Lease is read again.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(2)));
    let ahead = events.iter().find(|e| e.reason == "RouterAhead").unwrap();
    assert_eq!(ahead.type_, "Warning");
    assert!(ahead.note.contains("epoch 4"), "{}", ahead.note);
}
