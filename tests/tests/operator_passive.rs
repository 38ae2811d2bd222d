//! Passive signals reach the decision: the operator's probing rounds read a real gateway's
//! `/signals`, and when every endpoint of the primary refuses the gateway's traffic, that is a
//! hard failed check of the primary even while its active probes give no evidence (here they are
//! rejected: the replica wants an API key the probe does not send), so the standby is promoted
//! after `hardFailure.promoteAfter` rounds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod prober_support;
mod router_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use understudy_core::Pool;
use understudy_core::failover::{FailoverState, Input, PassiveSignal, Phase};
use understudy_operator::controller::{Observation, ObservationSource};
use understudy_operator::crd::FailoverPolicy;
use understudy_operator::observe::{FixedReplicas, ProbingObservations};
use understudy_operator::policy;
use understudy_operator::route_push::{RouterAdminUrl, RouterToken};
use understudy_router::gateway::GatewayConfig;
use understudy_router::waiting_room::WaitingRoomConfig;

fn failover_policy() -> FailoverPolicy {
    let spec = serde_yaml::from_str(
        "
pools:
  - {name: east, workload: {kind: Deployment, name: vllm-east}, replicas: 1}
  - {name: west, workload: {kind: Deployment, name: vllm-west}, replicas: 1}
recoveryObjective: 5m
probe: {interval: 10s, timeout: 5s, budgets: {firstToken: 2s, total: 4s}}
trigger: {suspectAfter: 2, promoteAfter: 4, hardFailure: {promoteAfter: 2}, standbyReadyAfter: 2}
",
    )
    .unwrap();
    let mut policy = FailoverPolicy::new("llama", spec);
    policy.metadata.namespace = Some("serving".to_owned());
    policy
}

/// A gateway routing east at epoch 0 to an address where nothing listens, with one request sent
/// through it so that its data path has seen the refusals.
fn gateway_that_sees_east_refuse() -> (router_support::Router, understudy_tests::ClosedPort) {
    let gone = understudy_tests::ClosedPort::bind();
    let addr: SocketAddr = format!("127.0.0.1:{}", gone.port).parse().unwrap();
    // Refused, then held in the waiting room no longer than a moment.
    let config = GatewayConfig {
        waiting_room: WaitingRoomConfig {
            deadline: Duration::from_millis(300),
            ..WaitingRoomConfig::default()
        },
        ..GatewayConfig::default()
    };
    let router = router_support::Router::start(config, None);
    assert_eq!(
        router
            .put_route(&router_support::route("east", 0, &[addr]))
            .status,
        200
    );
    let answer = router.complete(&router_support::completion(4, false), &[]);
    assert_ne!(answer.status, 200, "{}", answer.text());
    (router, gone)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_whose_traffic_is_refused_everywhere_is_replaced_when_its_probes_say_nothing() {
    let (router, _gone) = gateway_that_sees_east_refuse();
    let signals = router.admin_get("/signals").json();
    assert_eq!(signals["pools"][0]["signal"], "AllRefused", "{signals}");

    // East's replica answers, but only with a key: the probe is rejected, no evidence either way.
    let east = prober_support::Emulator::ready(&["--api-key", "k3y"], &[]);
    let west = prober_support::Emulator::ready(&[], &[]);
    let replicas = FixedReplicas::default()
        .with_pool("east", vec![east.endpoint.clone()])
        .with_pool("west", vec![west.endpoint.clone()]);
    let admin: RouterAdminUrl = format!("http://127.0.0.1:{}", router.admin).parse().unwrap();
    let observations = ProbingObservations::new(Arc::new(replicas))
        .with_max_jitter(Duration::ZERO)
        .with_router_signals(vec![admin], RouterToken::new(router_support::TOKEN).unwrap());
    let policy = failover_policy();
    let validated = policy::validate(&policy.spec).unwrap();
    observations.track(&policy);
    let key = observations.tracked().pop().unwrap();

    let mut machine = FailoverState::new();
    let mut now = Duration::from_secs(1_000);
    let mut seen = Vec::new();
    for _ in 0..3 {
        assert!(observations.probe_now(&key).await);
        for observation in observations.drain(&key) {
            seen.push(observation);
            machine = machine
                .step(&validated.failover, now, &Input::from(observation))
                .0;
        }
        machine = machine.step(&validated.failover, now, &Input::Tick).0;
        now += validated.probe.interval;
    }
    // No active check of east at all, a passing one of west, and the data path's refusals.
    assert!(
        !seen
            .iter()
            .any(|o| matches!(o, Observation::Check { pool: Pool::A, .. })),
        "{seen:?}"
    );
    let refused = Observation::Passive {
        pool: Pool::A,
        signal: PassiveSignal::AllRefused,
    };
    assert_eq!(seen.iter().filter(|o| **o == refused).count(), 3, "{seen:?}");
    let Phase::Promoting(promotion) = &machine.phase else {
        panic!("no promotion: {:?}", machine.phase)
    };
    assert_eq!(promotion.to, Pool::B);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_routers_the_same_primary_is_never_replaced() {
    // The control: the same rounds with no router to read give no evidence about east.
    let east = prober_support::Emulator::ready(&["--api-key", "k3y"], &[]);
    let west = prober_support::Emulator::ready(&[], &[]);
    let replicas = FixedReplicas::default()
        .with_pool("east", vec![east.endpoint.clone()])
        .with_pool("west", vec![west.endpoint.clone()]);
    let observations = ProbingObservations::new(Arc::new(replicas)).with_max_jitter(Duration::ZERO);
    let policy = failover_policy();
    let validated = policy::validate(&policy.spec).unwrap();
    observations.track(&policy);
    let key = observations.tracked().pop().unwrap();
    let mut machine = FailoverState::new();
    for round in 0..3u64 {
        assert!(observations.probe_now(&key).await);
        let now = Duration::from_secs(1_000 + 10 * round);
        for observation in observations.drain(&key) {
            machine = machine
                .step(&validated.failover, now, &Input::from(observation))
                .0;
        }
        machine = machine.step(&validated.failover, now, &Input::Tick).0;
    }
    assert_eq!(machine.phase, Phase::Serving);
}
