//! The operator's route push against a real gateway on loopback, with vLLM emulators behind it:
//! a route pushed at a new epoch moves the gateway's traffic to the new primary, and a stale
//! operator's push at a lower epoch is refused and changes nothing; between promotions, a gateway
//! that has no route is given the Lease's route by the operator's route sync.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../router/tests/support/mod.rs"]
mod router_support;

use std::net::SocketAddr;
use std::sync::Arc;

use router_support::{Emulator, Router, TOKEN, completion, completion_of, route};
use understudy_api::route::{Route, RouterHolds};
use understudy_core::Epoch;
use understudy_core::failover::Step;
use understudy_operator::crd::FailoverPolicy;
use understudy_operator::peers::Routers;
use understudy_operator::ports::{RouteSyncReport, RouteSyncRequest, StepExecutor, StepReport, StepRequest};
use understudy_operator::replicas::FixedReplicas;
use understudy_operator::route_push::{Plan, RouterPush, plan};
use understudy_operator::router_admin::{RouterAdminUrl, RouterToken};
use understudy_prober::probe::Endpoint;
use understudy_router::gateway::GatewayConfig;

fn policy() -> FailoverPolicy {
    serde_yaml::from_str(
        r"
apiVersion: understudy.dev/v1alpha1
kind: FailoverPolicy
metadata: {name: chat, namespace: serving}
spec:
  pools:
    - {name: east, workload: {kind: Deployment, name: chat-east}, replicas: 1}
    - {name: west, workload: {kind: Deployment, name: chat-west}, replicas: 1}
  recoveryObjective: 1m
  admission: {window: 90s, initialConcurrency: 8, maxConcurrency: 64}
",
    )
    .unwrap()
}

/// An operator that resolves `pool` to `addr` and pushes to `router`.
fn operator(router: &Router, pool: &str, addr: SocketAddr) -> RouterPush {
    let admin: RouterAdminUrl = format!("http://127.0.0.1:{}", router.admin).parse().unwrap();
    let replicas =
        FixedReplicas::default().with_pool(pool, vec![Endpoint::new(addr.ip().to_string(), addr.port())]);
    RouterPush::new(
        Routers::At(vec![admin]),
        RouterToken::new(TOKEN).unwrap(),
        Arc::new(replicas),
    )
}

/// Carries out the route step for the pool at `pool_index` at `epoch`, as a reconcile would.
fn push_route(push: &RouterPush, pool_index: usize, epoch: u64) -> StepReport {
    push_route_of(&policy(), push, pool_index, epoch)
}

/// [`push_route`] for `policy`.
fn push_route_of(policy: &FailoverPolicy, push: &RouterPush, pool_index: usize, epoch: u64) -> StepReport {
    let request = StepRequest {
        policy,
        step: Step::Route,
        pool: &policy.spec.pools[pool_index],
        epoch: Epoch(epoch),
        serving: None,
        overdue: None,
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(push.carry_out(request))
}

#[test]
fn a_route_pushed_at_epoch_1_moves_the_gateway_and_a_stale_push_at_epoch_0_changes_nothing() {
    let east = Emulator::fast();
    let west = Emulator::fast();
    let (east_addr, west_addr) = (east.addr(), west.addr());
    let r = Router::start(GatewayConfig::default(), None);
    // Before the failover: the home pool serves at epoch 0.
    let mut home = route("east", 0, &[east_addr]);
    home["policy"] = "serving/chat".into();
    assert_eq!(r.put_route(&home).status, 200);
    assert_eq!(r.complete(&completion(4, false), &[]).status, 200);

    let report = push_route(&operator(&r, "west", west_addr), 1, 1);
    assert!(
        matches!(
            report,
            StepReport::Done {
                carried_by: "router",
                ..
            }
        ),
        "{report:?}"
    );
    let held = r.admin_get("/route?policy=serving/chat").json();
    assert_eq!(held["route"]["pool"], "west");
    assert_eq!(held["route"]["epoch"], 1);
    assert_eq!(held["route"]["endpoints"], serde_json::json!([west_addr]));
    assert_eq!(held["route"]["admission"]["window_s"], 90.0);
    assert_eq!(held["route"]["admission"]["initial_concurrency"], 8);
    // With the old primary gone, every request is served by the new one.
    drop(east);
    for _ in 0..5 {
        assert_eq!(r.complete(&completion(4, false), &[]).status, 200);
    }

    // An operator that missed the failover pushes its old view.
    let stale = push_route(&operator(&r, "east", east_addr), 0, 0);
    let StepReport::Refused { reason, note, .. } = stale else {
        panic!("the stale push was not refused: {stale:?}");
    };
    assert_eq!(reason, "RouteStale");
    assert!(note.contains("epoch 1 (pool west); ours is 0 for east"), "{note}");
    let held = r.admin_get("/route?policy=serving/chat").json();
    assert_eq!(
        (&held["route"]["pool"], &held["route"]["epoch"]),
        (&"west".into(), &1.into())
    );
    assert_eq!(r.complete(&completion(4, false), &[]).status, 200);
}

/// Keeps the pool at `pool_index` at `epoch` on the routers, as a reconcile between promotions
/// would.
fn keep_route(push: &RouterPush, pool_index: usize, epoch: u64) -> RouteSyncReport {
    keep_route_of(&policy(), push, pool_index, epoch)
}

/// [`keep_route`] for `policy`.
fn keep_route_of(
    policy: &FailoverPolicy,
    push: &RouterPush,
    pool_index: usize,
    epoch: u64,
) -> RouteSyncReport {
    let request = RouteSyncRequest {
        policy,
        pool: &policy.spec.pools[pool_index],
        epoch: Epoch(epoch),
        serving: None,
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(push.keep_route(request))
}

#[test]
fn a_fresh_gateway_is_given_the_home_pool_at_epoch_0_by_the_route_sync_and_serves_through_it() {
    let east = Emulator::fast();
    let east_addr = east.addr();
    let r = Router::start(GatewayConfig::default(), None);
    // No promotion ever pushed a route to it.
    assert_eq!(r.admin_get("/ready").status, 503);
    let operator = operator(&r, "east", east_addr);

    assert_eq!(keep_route(&operator, 0, 0), RouteSyncReport::default());
    let held = r.admin_get("/route?policy=serving/chat").json();
    assert_eq!(
        (&held["route"]["pool"], &held["route"]["epoch"]),
        (&"east".into(), &0.into())
    );
    assert_eq!(held["route"]["endpoints"], serde_json::json!([east_addr]));
    assert_eq!(r.admin_get("/ready").status, 200);
    assert_eq!(r.complete(&completion(4, false), &[]).status, 200);

    // Kept again, it is left as it is: the router's own answer reads as the route it holds, so
    // nothing is pushed and its admission window runs on.
    let holds: RouterHolds = serde_json::from_value(held.clone()).unwrap();
    let ours = Route::for_pool(
        "serving/chat",
        &policy().spec,
        "east",
        Vec::new(),
        vec![east_addr],
        Epoch(0),
    );
    assert_eq!(plan(&holds, &ours), Plan::InPlace);
    assert_eq!(keep_route(&operator, 0, 0), RouteSyncReport::default());
    assert_eq!(r.admin_get("/route?policy=serving/chat").json(), held);
    assert_eq!(r.complete(&completion(4, false), &[]).status, 200);
}

#[test]
fn the_route_sync_pushes_nothing_to_a_gateway_ahead_of_it_and_says_so() {
    let west = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), None);
    let mut theirs = route("west", 2, &[west.addr()]);
    theirs["policy"] = "serving/chat".into();
    assert_eq!(r.put_route(&theirs).status, 200);

    let report = keep_route(&operator(&r, "east", west.addr()), 0, 1);
    assert!(report.view_stale, "{report:?}");
    assert_eq!(report.warnings.len(), 1, "{report:?}");
    assert_eq!(report.warnings[0].0, "RouterAhead");
    let held = r.admin_get("/route?policy=serving/chat").json();
    assert_eq!(
        (&held["route"]["pool"], &held["route"]["epoch"]),
        (&"west".into(), &2.into())
    );
}

#[test]
fn the_operators_route_body_is_a_route_the_router_reads() {
    let policy = policy();
    let body = Route::for_pool(
        "serving/chat",
        &policy.spec,
        "west",
        vec!["llama".to_owned()],
        vec![SocketAddr::from(([10, 0, 0, 1], 8000))],
        Epoch(4),
    );
    let read: Route = serde_json::from_value(serde_json::to_value(&body).unwrap()).unwrap();
    read.validate().unwrap();
    assert_eq!((read.pool.as_str(), read.epoch), ("west", Epoch(4)));
    assert_eq!(
        (read.policy.as_str(), read.models.as_slice()),
        ("serving/chat", ["llama".to_owned()].as_slice())
    );
    assert_eq!(read.admission.window_s, 90.0);
    assert_eq!(read.admission.max_concurrency, 64);
}

#[test]
fn two_policies_behind_one_router_fail_over_apart() {
    let serving = |name: &str| Emulator::start(&["--emu-zero-cost", "--served-model-name", name], &[]);
    let (chat_east, chat_west) = (serving("chat"), serving("chat"));
    let (code_east, code_west) = (serving("code"), serving("code"));
    let policy_of = |name: &str| -> FailoverPolicy {
        serde_yaml::from_str(&format!(
            r"
apiVersion: understudy.dev/v1alpha1
kind: FailoverPolicy
metadata: {{name: {name}, namespace: serving}}
spec:
  pools:
    - {{name: {name}-east, workload: {{kind: Deployment, name: {name}-east}}, replicas: 1}}
    - {{name: {name}-west, workload: {{kind: Deployment, name: {name}-west}}, replicas: 1}}
  recoveryObjective: 1m
"
        ))
        .unwrap()
    };
    let (chat, code) = (policy_of("chat"), policy_of("code"));
    let r = Router::start(GatewayConfig::default(), None);
    let at = |e: &Emulator| vec![Endpoint::new(e.addr().ip().to_string(), e.addr().port())];
    let replicas = FixedReplicas::default()
        .with_pool("chat-east", at(&chat_east))
        .with_pool("chat-west", at(&chat_west))
        .with_pool("code-east", at(&code_east))
        .with_pool("code-west", at(&code_west));
    for (pool, model) in [
        ("chat-east", "chat"),
        ("chat-west", "chat"),
        ("code-east", "code"),
        ("code-west", "code"),
    ] {
        replicas.set_model(pool, model);
    }
    let admin: RouterAdminUrl = format!("http://127.0.0.1:{}", r.admin).parse().unwrap();
    // One operator, as in a cluster: one executor for every policy.
    let push = RouterPush::new(
        Routers::At(vec![admin]),
        RouterToken::new(TOKEN).unwrap(),
        Arc::new(replicas),
    );
    assert_eq!(keep_route_of(&chat, &push, 0, 0), RouteSyncReport::default());
    assert_eq!(keep_route_of(&code, &push, 0, 0), RouteSyncReport::default());
    let ask = |model: &str| r.complete(&completion_of(model), &[]).status;
    assert_eq!((ask("chat"), ask("code")), (200, 200));
    let held = |policy: &str| r.admin_get(&format!("/route?policy=serving/{policy}")).json();
    assert_eq!(held("chat")["route"]["models"], serde_json::json!(["chat"]));

    // Chat's primary dies and chat fails over; code is not touched.
    drop(chat_east);
    assert!(matches!(
        push_route_of(&chat, &push, 1, 1),
        StepReport::Done { .. }
    ));
    for _ in 0..5 {
        assert_eq!((ask("chat"), ask("code")), (200, 200));
    }
    assert_eq!(held("chat")["route"]["pool"], "chat-west");
    assert_eq!(
        (
            held("code")["route"]["pool"].clone(),
            held("code")["route"]["epoch"].clone()
        ),
        ("code-east".into(), 0.into())
    );
    // Code, still at epoch 0, is kept as it is: chat's epoch 1 is not ahead of it.
    assert_eq!(keep_route_of(&code, &push, 0, 0), RouteSyncReport::default());
    // And code fails over on its own, to its own epoch 1.
    drop(code_east);
    assert!(matches!(
        push_route_of(&code, &push, 1, 1),
        StepReport::Done { .. }
    ));
    assert_eq!((ask("chat"), ask("code")), (200, 200));
    assert_eq!(held("code")["route"]["pool"], "code-west");
}
