//! The operator's load proof end to end on loopback: users' requests go through a real gateway,
//! which records their shapes; the operator reads them from its admin API and replays them
//! against a standby of emulated replicas with the cost model on. A standby with the primary's
//! capacity is proven; one replica with a fraction of it answers every probe and fails the proof;
//! a sleeping standby is woken for the replay and put back to sleep after; with no traffic
//! recorded nothing is replayed and the proof says why.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../router/tests/support/mod.rs"]
mod router_support;

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use router_support::{Emulator, MODEL, Router, TOKEN, policy_route, request};
use understudy_core::Pool;
use understudy_operator::crd::FailoverPolicy;
use understudy_operator::load_proof::{Finished, Job, LoadProofs, Outcome};
use understudy_operator::peers::Routers;
use understudy_operator::policy::validate;
use understudy_operator::replicas::FixedReplicas;
use understudy_operator::router_admin::{RouterAdminUrl, RouterToken};
use understudy_prober::probe::Endpoint;
use understudy_prober::sleep::{WakeTimeouts, is_sleeping, put_to_sleep};
use understudy_router::gateway::GatewayConfig;

const DEV_MODE: &[(&str, &str)] = &[("VLLM_SERVER_DEV_MODE", "1")];

fn policy() -> FailoverPolicy {
    serde_yaml::from_str(
        r"
apiVersion: understudy.dev/v1alpha1
kind: FailoverPolicy
metadata: {name: chat, namespace: serving}
spec:
  pools:
    - {name: east, workload: {kind: Deployment, name: chat-east}, replicas: 1}
    - {name: west, workload: {kind: Deployment, name: chat-west}, replicas: 2}
  recoveryObjective: 1m
  loadProof: {every: 1h, duration: 4s, rateShare: 0.5, ttftP99: 1s, itlP99: 250ms, maxErrorRate: 0}
",
    )
    .unwrap()
}

fn endpoint(e: &Emulator) -> Endpoint {
    Endpoint::new("127.0.0.1", e.port)
}

/// A gateway routing `serving/chat` to `primary`, with 20 users' requests sent through it 50 ms
/// apart (20 a second): 24 prompt tokens, 32 tokens asked for.
fn gateway_with_traffic(primary: &Emulator) -> Router {
    let router = Router::start(GatewayConfig::default(), None);
    let route = policy_route("serving/chat", MODEL, "east", 1, &[primary.addr()]);
    assert_eq!(router.put_route(&route).status, 200);
    let body = serde_json::json!({
        "model": MODEL, "prompt": "a user's words ".repeat(6), "max_tokens": 32, "stream": true
    })
    .to_string();
    for _ in 0..20 {
        assert_eq!(router.complete(&body, &[]).status, 200);
        std::thread::sleep(Duration::from_millis(50));
    }
    router
}

/// Runs one proof of pool west at `standby` through `router`'s recorded traffic and waits for it.
async fn prove(router: &Router, standby: &[&Emulator]) -> Finished {
    let policy = Arc::new(policy());
    let admin: RouterAdminUrl = format!("http://127.0.0.1:{}", router.admin).parse().unwrap();
    let proofs = LoadProofs::new(Routers::At(vec![admin]), RouterToken::new(TOKEN).unwrap());
    let replicas = FixedReplicas::default().with_pool("west", standby.iter().map(|e| endpoint(e)).collect());
    let job = Job {
        policy: Arc::clone(&policy),
        namespace: "serving".to_owned(),
        pool: Pool::B,
        pool_spec: policy.spec.pools[1].clone(),
        proof: validate(&policy.spec).unwrap().load_proof.unwrap(),
        replicas: Arc::new(replicas),
        started_at: Duration::from_secs(1_800_000_000),
    };
    assert!(proofs.start(job.clone()));
    assert!(!proofs.start(job), "one proof at a time per policy");
    let key = ObjectRef::from_obj(policy.as_ref());
    assert_eq!(proofs.running(&key), Some(Pool::B));
    for _ in 0..600 {
        if let Some((id, finished)) = proofs.finished(&key) {
            assert_eq!(proofs.running(&key), None);
            proofs.settle(&key, id);
            assert!(proofs.finished(&key).is_none(), "settled once");
            return finished;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the proof did not finish in 60 s");
}

#[test]
fn a_standby_with_the_primarys_capacity_is_proven_and_one_with_a_fraction_fails_at_the_same_load() {
    let primary = Emulator::fast();
    let router = gateway_with_traffic(&primary);
    // What the operator reads: shapes and gaps, never the words.
    let sample = request(
        router.admin,
        "GET",
        "/shapes?policy=serving/chat",
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "",
    )
    .json();
    assert_eq!(sample["shapes"].as_array().unwrap().len(), 20, "{sample}");
    assert!(!sample.to_string().contains("user"), "{sample}");

    // Eight decode slots a replica, 32 tokens at 8 ms: some 30 requests a second each.
    let full = [
        Emulator::start(&["--max-num-seqs", "8"], &[]),
        Emulator::start(&["--max-num-seqs", "8"], &[]),
    ];
    // One slot: some 4 a second, under half the recorded rate.
    let small = Emulator::start(&["--max-num-seqs", "1"], &[]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let proven = runtime.block_on(prove(&router, &[&full[0], &full[1]]));
    let failed = runtime.block_on(prove(&router, &[&small]));
    for finished in [&proven, &failed] {
        println!("{}", finished.record.summary());
    }

    assert_eq!(proven.outcome, Outcome::Proven, "{:?}", proven.record);
    assert_eq!(proven.pool, Pool::B);
    let record = &proven.record;
    assert_eq!((record.pool.as_str(), record.result.as_str()), ("west", "Proven"));
    assert_eq!((record.replicas, record.woken, record.errors), (2, 0, 0));
    // Recorded at 20 a second (19 gaps of some 50 ms and the request's own time), replayed at
    // half that rate (`rateShare: 0.5`) for 4 s (`duration`).
    let recorded = record.recorded_rate.unwrap();
    assert!(recorded > 5.0 && recorded <= 20.0, "{record:?}");
    // The rate the requests were sent at, from the replay's own sends.
    let share = record.replayed_rate.unwrap() / recorded;
    assert!(
        (0.4..=0.6).contains(&share),
        "replayed at {share} of the recorded rate: {record:?}"
    );
    // Every request streamed its tokens within `itlP99`, and none failed (`maxErrorRate: 0`).
    assert!(record.itl_p99_ms.unwrap() <= 250, "{record:?}");

    assert_eq!(failed.outcome, Outcome::Failed, "{:?}", failed.record);
    assert_eq!(failed.record.requests, record.requests, "the same plan");
    // `ttftP99: 1s` is what it broke.
    assert!(
        failed.record.detail.contains("over 1000 ms"),
        "{:?}",
        failed.record
    );
    assert!(
        failed.record.ttft_p99_ms > record.ttft_p99_ms,
        "{:?}",
        failed.record
    );
}

#[test]
fn a_sleeping_standby_is_woken_for_the_replay_and_put_back_to_sleep_after() {
    let primary = Emulator::fast();
    let router = gateway_with_traffic(&primary);
    let warm = Emulator::start(&["--max-num-seqs", "16", "--enable-sleep-mode"], DEV_MODE);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let finished = runtime.block_on(async {
        put_to_sleep(&endpoint(&warm), 1, WakeTimeouts::default())
            .await
            .unwrap();
        prove(&router, &[&warm]).await
    });
    assert_eq!(finished.outcome, Outcome::Proven, "{:?}", finished.record);
    assert_eq!((finished.record.replicas, finished.record.woken), (1, 1));
    let asleep = runtime.block_on(is_sleeping(&endpoint(&warm), Duration::from_secs(5)));
    assert_eq!(asleep, Ok(Some(true)), "asleep again after the replay");
}

#[test]
fn with_no_traffic_recorded_nothing_is_replayed_and_the_proof_says_why() {
    let primary = Emulator::fast();
    let router = Router::start(GatewayConfig::default(), None);
    let route = policy_route("serving/chat", MODEL, "east", 1, &[primary.addr()]);
    assert_eq!(router.put_route(&route).status, 200);
    let standby = Emulator::fast();
    let finished = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(prove(&router, &[&standby]));
    assert_eq!(finished.outcome, Outcome::NotRun);
    assert_eq!(finished.record.requests, 0);
    assert!(
        finished.record.detail.contains("no traffic was recorded"),
        "{:?}",
        finished.record
    );
}

#[test]
fn a_stopped_proof_sends_no_more_and_leaves_what_it_woke_awake() {
    let primary = Emulator::fast();
    let router = gateway_with_traffic(&primary);
    let admin: RouterAdminUrl = format!("http://127.0.0.1:{}", router.admin).parse().unwrap();
    let warm = Emulator::start(&["--enable-sleep-mode"], DEV_MODE);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        put_to_sleep(&endpoint(&warm), 1, WakeTimeouts::default())
            .await
            .unwrap();
        let policy = Arc::new(policy());
        let proofs = LoadProofs::new(Routers::At(vec![admin]), RouterToken::new(TOKEN).unwrap());
        let mut proof = validate(&policy.spec).unwrap().load_proof.unwrap();
        // Short: a stop that did nothing would let it end, put the replica back and finish.
        proof.duration = Duration::from_secs(3);
        let key = ObjectRef::from_obj(policy.as_ref());
        assert!(proofs.start(Job {
            policy: Arc::clone(&policy),
            namespace: "serving".to_owned(),
            pool: Pool::B,
            pool_spec: policy.spec.pools[1].clone(),
            proof,
            replicas: Arc::new(FixedReplicas::default().with_pool("west", vec![endpoint(&warm)])),
            started_at: Duration::from_secs(1_800_000_000),
        }));
        let mut woken = false;
        for _ in 0..100 {
            if is_sleeping(&endpoint(&warm), Duration::from_secs(5)).await == Ok(Some(false)) {
                woken = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(woken, "the proof woke the standby");
        assert_eq!(proofs.cancel(&key), Some(Pool::B));
        assert_eq!(proofs.running(&key), None);
        let served = warm_requests(&warm);
        // Past the whole replay's end: a proof that went on would have put it back and finished.
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(
            is_sleeping(&endpoint(&warm), Duration::from_secs(5)).await,
            Ok(Some(false)),
            "what a stopped proof woke stays awake (a promotion may be waking it)"
        );
        assert!(
            proofs.finished(&key).is_none(),
            "a stopped proof finishes nothing"
        );
        assert!(warm_requests(&warm) <= served + 2, "no replay after the stop");
    });
}

/// The completions `e` has taken, from its metrics.
fn warm_requests(e: &Emulator) -> u64 {
    let metrics = request(e.port, "GET", "/metrics", &[], "").text();
    metrics
        .lines()
        .filter(|l| l.starts_with("vllm:request_success_total") || l.starts_with("vllm:num_requests_running"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
