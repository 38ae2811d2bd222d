//! The operator's serving grants against real fences on loopback: the grantor pushes each round
//! to every fence of both pools with the fences' token, the old holder's first, so that a new
//! holder serves at once when every old fence took the new epoch and waits out their grants when
//! one could not be told; the Fence step grants the new epoch, the Route step waits until the new
//! primary's fences serve (and goes on past the promotion's deadline), and status shows each
//! pool's fences by standing. A recorder in place of a fence shows the grant carries the policy's
//! `spec.grants` exactly. Nothing here asserts a time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../router/tests/support/mod.rs"]
mod router_support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::Arc;

use router_support::{Emulator, FenceSidecar, completion, request};
use understudy_api::grant::{Grant, GrantStanding, GrantView};
use understudy_core::Epoch;
use understudy_core::failover::Step;
use understudy_operator::crd::FailoverPolicy;
use understudy_operator::grants::{Granting, Grantor};
use understudy_operator::metrics::Metrics;
use understudy_operator::ports::{HandOffToComponents, StepExecutor, StepReport, StepRequest};
use understudy_operator::replicas::FixedReplicas;
use understudy_prober::probe::{Bearer, Endpoint};

const TOKEN: &str = "fence-token";

fn policy(grants: &str) -> FailoverPolicy {
    let spec = serde_yaml::from_str(&format!(
        "
pools:
  - {{name: east, workload: {{kind: Deployment, name: vllm-east}}, replicas: 2, port: 8001}}
  - {{name: west, workload: {{kind: Deployment, name: vllm-west}}, replicas: 1, port: 8001}}
recoveryObjective: 5m
{grants}
"
    ))
    .unwrap();
    let mut policy = FailoverPolicy::new("chat", spec);
    policy.metadata.namespace = Some("default".into());
    policy
}

fn endpoint(port: u16) -> Endpoint {
    Endpoint::new("127.0.0.1", port).with_bearer(Bearer::new(TOKEN))
}

/// A client no test call reaches: the grantor reads the Lease only when it renews on its own.
fn idle_client() -> kube::Client {
    let (service, _handle) =
        tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
    kube::Client::new(service, "default")
}

fn grantor(replicas: FixedReplicas) -> Arc<Grantor> {
    Arc::new(Grantor::new(
        idle_client(),
        Arc::new(replicas),
        Arc::new(Metrics::new()),
    ))
}

fn view(port: u16) -> GrantView {
    serde_json::from_slice(&request(port, "GET", "/understudy/grant", &[], "").body).unwrap()
}

fn generates(port: u16) -> u16 {
    request(port, "POST", "/v1/completions", &[], &completion(4, false)).status
}

fn step<'a>(
    policy: &'a FailoverPolicy,
    step: Step,
    pool: usize,
    epoch: u64,
    overdue: bool,
) -> StepRequest<'a> {
    StepRequest {
        policy,
        step,
        pool: &policy.spec.pools[pool],
        epoch: Epoch(epoch),
        serving: None,
        overdue: overdue.then(|| std::time::Duration::from_secs(1)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_primary_serves_at_once_when_every_old_fence_took_the_epoch_and_waits_when_one_could_not_be_told()
 {
    let e = Emulator::start(&["--emu-zero-cost"], &[]);
    let upstream = format!("127.0.0.1:{}", e.port).parse().unwrap();
    let east = [
        FenceSidecar::granted("east", upstream, TOKEN),
        FenceSidecar::granted("east", upstream, TOKEN),
    ];
    let west = FenceSidecar::granted("west", upstream, TOKEN);
    let (e0, e1, w0) = (east[0].port, east[1].port, west.port);
    let policy = policy("grants: {ttl: 30s, renewEvery: 5s, clockSkew: 1s}");
    let replicas = FixedReplicas::default()
        .with_pool("east", vec![endpoint(e0), endpoint(e1)])
        .with_pool("west", vec![endpoint(w0)]);
    let grantor = grantor(replicas);
    grantor.track(&policy);
    let steps = Granting {
        grantor: Arc::clone(&grantor),
        inner: Arc::new(HandOffToComponents),
    };

    // Epoch 0, held by east: east serves, west is fenced, and status counts them so.
    let round = grantor.round(&policy, Epoch(0), "east").await;
    assert!(round.prior_revoked, "{round:?}");
    let ports = [e0, e1, w0];
    let (codes, views) = tokio::task::spawn_blocking(move || (ports.map(generates), ports.map(view)))
        .await
        .unwrap();
    assert_eq!(codes, [200, 200, 503]);
    assert_eq!(
        views.map(|v| v.standing),
        [
            GrantStanding::Serving,
            GrantStanding::Serving,
            GrantStanding::Fenced
        ]
    );
    let status = grantor
        .last(&kube::runtime::reflector::ObjectRef::from_obj(&policy))
        .unwrap()
        .status();
    assert_eq!(
        (status.epoch, status.holder.as_str(), status.prior_revoked),
        (0, "east", true)
    );
    let counts: BTreeMap<String, BTreeMap<String, u32>> = status
        .pools
        .iter()
        .map(|p| (p.pool.clone(), p.fences.clone()))
        .collect();
    assert_eq!(counts["east"], BTreeMap::from([("serving".to_owned(), 2)]));
    assert_eq!(counts["west"], BTreeMap::from([("fenced".to_owned(), 1)]));
    assert!(status.expires_in_seconds.is_some_and(|s| s <= 30.0), "{status:?}");

    // Epoch 1 to west, every east fence told: west serves at once, the route goes on.
    let fenced = steps.carry_out(step(&policy, Step::FenceOld, 0, 1, false)).await;
    assert!(
        matches!(&fenced, StepReport::Done { note: Some(n), .. } if n.contains("west holds epoch 1")),
        "{fenced:?}"
    );
    let routed = steps.carry_out(step(&policy, Step::Route, 1, 1, false)).await;
    assert!(matches!(routed, StepReport::HandedOff { .. }), "{routed:?}");
    let codes = tokio::task::spawn_blocking(move || ports.map(generates))
        .await
        .unwrap();
    assert_eq!(codes, [503, 503, 200]);

    // Epoch 2 back to east with one of west's fences gone: nobody can say it took the epoch,
    // so east's fences wait out west's grant, and the route waits for them until the deadline.
    drop(west);
    let fenced = steps.carry_out(step(&policy, Step::FenceOld, 1, 2, false)).await;
    assert!(
        matches!(&fenced, StepReport::Done { note: Some(n), .. } if n.contains("not revoked")),
        "{fenced:?}"
    );
    let waiting = steps.carry_out(step(&policy, Step::Route, 0, 2, false)).await;
    assert!(
        matches!(&waiting, StepReport::NotYet { reason } if reason.contains("east's fences do not serve yet")),
        "{waiting:?}"
    );
    let views = tokio::task::spawn_blocking(move || [e0, e1].map(view))
        .await
        .unwrap();
    assert_eq!(
        views.map(|v| v.standing),
        [GrantStanding::Waiting, GrantStanding::Waiting]
    );
    let overdue = steps.carry_out(step(&policy, Step::Route, 0, 2, true)).await;
    assert!(
        matches!(overdue, StepReport::HandedOff { .. }),
        "past the deadline the route goes on: {overdue:?}"
    );
}

/// Answers every request with `answer`, and sends each body it got.
fn recorder(answer: &'static str) -> (u16, std::sync::mpsc::Receiver<String>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (bodies, got) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut length = 0;
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if let Some(n) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = n.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            let _ = bodies.send(String::from_utf8_lossy(&body).into_owned());
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                answer.len()
            );
            let _ = (&stream).write_all(reply.as_bytes());
        }
    });
    (port, got)
}

#[tokio::test]
async fn a_grant_carries_the_policys_time_to_live_renewal_period_and_clock_skew_and_names_the_other_pools_fences()
 {
    let answer = r#"{"pool":"east","epoch":4,"holder":"east","standing":"serving"}"#;
    let (east, east_got) = recorder(answer);
    let (west, west_got) = recorder(r#"{"pool":"west","epoch":4,"holder":"east","standing":"fenced"}"#);
    let replicas = FixedReplicas::default()
        .with_pool("east", vec![endpoint(east)])
        .with_pool("west", vec![endpoint(west)]);
    let grantor = grantor(replicas);
    let policy = policy("grants: {ttl: 3s, renewEvery: 500ms, clockSkew: 250ms}");
    let round = grantor.round(&policy, Epoch(4), "east").await;
    assert!(round.prior_revoked);
    let to_east: Grant = serde_json::from_str(&east_got.recv().unwrap()).unwrap();
    let to_west: Grant = serde_json::from_str(&west_got.recv().unwrap()).unwrap();
    assert_eq!(
        (
            to_east.ttl_ms,
            to_east.renew_ms,
            to_east.skew_ms,
            to_east.epoch,
            to_east.holder.as_str()
        ),
        (3_000, 500, 250, Epoch(4), "east")
    );
    assert_eq!(to_east.policy, "default/chat");
    assert_eq!(to_east.peers, [format!("127.0.0.1:{west}")]);
    assert!(to_east.prior_revoked && !to_west.prior_revoked && to_west.peers.is_empty());
    assert_eq!(to_west.holder, "east");
}
