//! The standby kept in its shape, against emulated vLLM replicas on loopback: its warm replicas
//! are put to sleep at their level, each only after it answered the probe with the golden answer;
//! a replica that answers wrong is left awake; nothing sleeps before a golden answer exists; and
//! a standby already in shape is left alone. A sleeping standby is proven a replica at a time
//! (woken, probed, asleep again). And a promoted pool is counted serving by the replicas that
//! answer the probe right, not by the ones that are up.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../prober/tests/emulated/mod.rs"]
mod prober_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use prober_support::{Emulator, MODEL};
use understudy_core::drive::WakeOrder;
use understudy_core::{Epoch, Pool};
use understudy_operator::crd::{FailoverPolicy, GoldenAnswer};
use understudy_operator::judge::{fixed_expectation, probe_all, probe_spec};
use understudy_operator::policy::validate;
use understudy_operator::replicas::FixedReplicas;
use understudy_operator::standby::{self, HostRoom, Kept, Sleep};
use understudy_operator::workload::Workload;
use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::probe::{Endpoint, Expectation, ProbeSpec};
use understudy_prober::sleep::WakeTimeouts;

const DEV_MODE: &[(&str, &str)] = &[("VLLM_SERVER_DEV_MODE", "1")];

/// `west` waits with one hot replica and two warm ones at `level`; no pilot light, so keeping it
/// in shape never calls the API server.
fn policy(level: u8) -> FailoverPolicy {
    policy_with(&format!(
        "[{{tier: hot, replicas: 1}}, {{tier: warm, replicas: 2, sleepLevel: {level}}}]"
    ))
}

/// `west` waits as `standby` says, three replicas in all.
fn policy_with(standby: &str) -> FailoverPolicy {
    serde_yaml::from_str(&format!(
        r"
apiVersion: understudy.dev/v1alpha1
kind: FailoverPolicy
metadata: {{name: chat, namespace: serving}}
spec:
  pools:
    - {{name: east, workload: {{kind: Deployment, name: chat-east}}, replicas: 3}}
    - name: west
      workload: {{kind: Deployment, name: chat-west}}
      replicas: 3
      standby: {standby}
  recoveryObjective: 1m
"
    ))
    .unwrap()
}

fn is_sleeping(endpoint: &Endpoint) -> bool {
    let mut s = TcpStream::connect(("127.0.0.1", endpoint.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET /is_sleeping HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    raw.contains("\"is_sleeping\":true") || raw.contains("\"is_sleeping\": true")
}

/// The golden answer, as the operator records it from a healthy primary.
fn golden(policy: &FailoverPolicy, text: &str) -> GoldenAnswer {
    GoldenAnswer {
        prefix: text.to_owned(),
        prompt: policy.spec.probe.prompt.clone(),
        max_tokens: policy.spec.probe.max_tokens,
        pool: "east".to_owned(),
        model: Some(MODEL.to_owned()),
        recorded_at: None,
    }
}

/// What the probe's prompt makes the model say, from a replica that is not part of the pool.
fn answer_of(policy: &FailoverPolicy) -> String {
    let reference = Emulator::ready(&[], &[]);
    let body = serde_json::json!({
        "model": MODEL, "prompt": policy.spec.probe.prompt, "max_tokens": policy.spec.probe.max_tokens,
        "temperature": 0,
    })
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", reference.endpoint.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let json: serde_json::Value = serde_json::from_str(raw.split_once("\r\n\r\n").unwrap().1).unwrap();
    json["choices"][0]["text"]
        .as_str()
        .unwrap()
        .chars()
        .take(16)
        .collect()
}

/// The policy's probe, judged by `expect`.
fn probe_of(policy: &FailoverPolicy, expect: Expectation) -> ProbeSpec {
    let validated = validate(&policy.spec).unwrap();
    probe_spec(&policy.spec.probe, &validated.probe, expect)
}

/// The golden answer's expectation, as the operator judges by it.
fn judged_by_golden(policy: &FailoverPolicy) -> Expectation {
    fixed_expectation(
        &policy.spec.probe.expect,
        Some(&golden(policy, &answer_of(policy))),
    )
    .unwrap()
}

/// Keeps `west` in shape once, its replicas at `endpoints`, judged by `expect`.
async fn keep(policy: &FailoverPolicy, endpoints: &[Endpoint], expect: Option<Expectation>) -> Kept {
    let sleep = expect.map_or_else(
        || Sleep::Not("no golden answer is recorded yet to probe it against".to_owned()),
        |expect| Sleep::AfterProbe(expect, HostRoom::default()),
    );
    let probe = probe_of(policy, Expectation::NonEmpty);
    let replicas = FixedReplicas::default().with_pool("west", endpoints.to_vec());
    // Nothing listens here: with no pilot light the workload is never asked.
    let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let pool = &policy.spec.pools[1];
    let workload = Workload::new(client, "serving", &pool.workload);
    standby::keep(
        &workload,
        pool,
        &replicas,
        "serving",
        &probe,
        sleep,
        WakeTimeouts::default(),
    )
    .await
    .unwrap()
}

fn three_replicas() -> (Vec<Emulator>, Vec<Endpoint>) {
    let replicas: Vec<Emulator> = (0..3)
        .map(|_| Emulator::ready(&["--enable-sleep-mode"], DEV_MODE))
        .collect();
    let mut endpoints: Vec<Endpoint> = replicas.iter().map(|e| e.endpoint.clone()).collect();
    endpoints.sort_by_key(ToString::to_string);
    (replicas, endpoints)
}

/// The level `endpoint` sleeps at, as its `vllm:engine_sleep_state` gauge says.
async fn level_of(endpoint: &Endpoint) -> Option<u8> {
    understudy_prober::sleep::sleep_level(endpoint, Duration::from_secs(5)).await
}

#[tokio::test]
async fn each_warm_group_sleeps_at_its_own_level_and_is_woken_from_it() {
    let policy = policy_with(
        "[{tier: hot, replicas: 1}, {tier: warm, replicas: 1, sleepLevel: 1}, \
         {tier: warm, replicas: 1, sleepLevel: 2}]",
    );
    let expect = Some(judged_by_golden(&policy));
    let (_replicas, endpoints) = three_replicas();
    let kept = keep(&policy, &endpoints, expect.clone()).await;
    // The last by address fills the shallowest level first, the next the deeper one.
    assert_eq!(
        kept.put_to_sleep,
        [
            format!("{} (level 1)", endpoints[2]),
            format!("{} (level 2)", endpoints[1])
        ]
    );
    assert_eq!(level_of(&endpoints[2]).await, Some(1));
    assert_eq!(level_of(&endpoints[1]).await, Some(2));
    assert_eq!(level_of(&endpoints[0]).await, None, "the hot one is awake");
    // Kept again, each one asleep counts at its own level: nothing more sleeps.
    let again = keep(&policy, &endpoints, expect).await;
    assert!(!again.changed(), "{again}");

    // The promotion's Wake step reads each one's level and wakes it from that level.
    let replicas = FixedReplicas::default().with_pool("west", endpoints.clone());
    let pool = &policy.spec.pools[1];
    let shape = pool.standby_shape();
    let order = WakeOrder {
        pool: Pool::B,
        epoch: Epoch(1),
        replicas: shape.warm,
        needed: 2,
        level: shape.sleep_level,
        overdue: None,
        left: Duration::from_secs(60),
    };
    let waking =
        understudy_operator::wake::wake_pool(&replicas, "serving", pool, WakeTimeouts::default(), &order)
            .await;
    let woken: Vec<(String, u8)> = waking
        .woken
        .iter()
        .map(|w| (w.endpoint.to_string(), w.level))
        .collect();
    assert_eq!(woken.len(), 2, "{woken:?}");
    assert!(woken.contains(&(endpoints[2].to_string(), 1)), "{woken:?}");
    assert!(woken.contains(&(endpoints[1].to_string(), 2)), "{woken:?}");
    let understudy_operator::ports::StepReport::Done { note: Some(note), .. } = waking.report else {
        panic!("{:?}", waking.report)
    };
    assert!(
        note.starts_with("woke 2 of 3 replica(s) of west (1 from sleep level 1, 1 from sleep level 2)"),
        "{note}"
    );
}

#[tokio::test]
async fn the_warm_replicas_sleep_after_a_passing_probe_and_a_standby_in_shape_is_left_alone() {
    let policy = policy(1);
    let expect = Some(judged_by_golden(&policy));
    let (_replicas, endpoints) = three_replicas();

    let kept = keep(&policy, &endpoints, expect.clone()).await;
    assert_eq!(kept.scaled, None);
    assert!(kept.left_awake.is_empty(), "{kept}");
    // The last two by address sleep; the first stays awake as the hot replica.
    let slept: Vec<String> = endpoints[1..]
        .iter()
        .rev()
        .map(|e| format!("{e} (level 1)"))
        .collect();
    assert_eq!(kept.put_to_sleep, slept);
    let asleep: Vec<bool> = endpoints.iter().map(is_sleeping).collect();
    assert_eq!(asleep, [false, true, true]);
    assert!(
        kept.to_string().contains("after each answered its probe right"),
        "{kept}"
    );

    let again = keep(&policy, &endpoints, expect).await;
    assert_eq!(again, Kept::default(), "already in shape");
}

#[tokio::test]
async fn a_replica_that_answers_wrong_is_left_awake_and_another_sleeps_in_its_place() {
    let policy = policy(2);
    let expect = Some(judged_by_golden(&policy));
    let (replicas, endpoints) = three_replicas();
    let broken = replicas.iter().find(|e| e.endpoint == endpoints[2]).unwrap();
    broken.inject("wrong-output");

    let kept = keep(&policy, &endpoints, expect).await;
    assert_eq!(kept.left_awake.len(), 1, "{kept}");
    assert_eq!(kept.left_awake[0].0, endpoints[2].to_string());
    assert_eq!(kept.left_awake[0].1, "its probe was wrong-output");
    let asleep: Vec<bool> = endpoints.iter().map(is_sleeping).collect();
    assert_eq!(asleep, [true, true, false]);
}

#[tokio::test]
async fn nothing_sleeps_before_a_golden_answer_exists() {
    let policy = policy(1);
    assert!(fixed_expectation(&policy.spec.probe.expect, None).is_none());
    let (_replicas, endpoints) = three_replicas();

    let kept = keep(&policy, &endpoints, None).await;
    assert!(kept.put_to_sleep.is_empty());
    assert_eq!(kept.left_awake.len(), 2, "{kept}");
    assert!(
        kept.left_awake
            .iter()
            .all(|(_, why)| why.contains("no golden answer")),
        "{kept}"
    );
    assert!(endpoints.iter().all(|e| !is_sleeping(e)));
}

#[tokio::test]
async fn a_promoted_pool_serves_with_the_replicas_that_answer_right_not_the_ones_that_are_up() {
    let policy = policy(1);
    let judged = probe_of(&policy, judged_by_golden(&policy));
    let (replicas, endpoints) = three_replicas();
    replicas[0].inject("wrong-output");
    assert_eq!(replicas[1].post("/sleep?level=1", ""), 200);

    let passing = async |spec: &ProbeSpec| {
        let reports = probe_all(&endpoints, spec).await;
        reports
            .iter()
            .filter(|r| matches!(r.outcome, ProbeOutcome::Ok { .. }))
            .count()
    };
    // All three are up and answer /health; one answers wrong and one sleeps.
    assert_eq!(passing(&judged).await, 1);
    // Before a golden answer exists any text counts, but a sleeping replica never does.
    let any_text = probe_of(&policy, Expectation::NonEmpty);
    assert_eq!(passing(&any_text).await, 2);
}

/// Proves `west` once, after `after`.
async fn prove(policy: &FailoverPolicy, endpoints: &[Endpoint], after: Option<&str>) -> standby::Proof {
    let probe = probe_of(policy, Expectation::NonEmpty);
    let replicas = FixedReplicas::default().with_pool("west", endpoints.to_vec());
    let pool = &policy.spec.pools[1];
    standby::prove(
        pool,
        &replicas,
        "serving",
        &probe,
        judged_by_golden(policy),
        WakeTimeouts::default(),
        after,
    )
    .await
    .unwrap()
    .expect("a sleeping replica to prove")
}

#[tokio::test]
async fn a_sleeping_standby_is_proven_a_replica_at_a_time_and_left_asleep() {
    let policy = policy(1);
    let (replicas, endpoints) = three_replicas();
    for asleep in &endpoints[1..] {
        let e = replicas.iter().find(|e| e.endpoint == *asleep).unwrap();
        assert_eq!(e.post("/sleep?level=1", ""), 200);
    }

    let first = prove(&policy, &endpoints, None).await;
    assert_eq!(first.replica, endpoints[1].to_string());
    assert!(first.passed, "{first:?}");
    assert!(
        first
            .detail
            .starts_with("woken from sleep level 1, answered right"),
        "{first:?}"
    );
    assert!(first.detail.ends_with("asleep again"), "{first:?}");
    let second = prove(&policy, &endpoints, Some(&first.replica)).await;
    assert_eq!(second.replica, endpoints[2].to_string());
    let third = prove(&policy, &endpoints, Some(&second.replica)).await;
    assert_eq!(third.replica, endpoints[1].to_string(), "the turn wraps around");
    let asleep: Vec<bool> = endpoints.iter().map(is_sleeping).collect();
    assert_eq!(asleep, [false, true, true]);

    // A sleeper that would answer wrong fails its proof, and still goes back to sleep.
    let broken = replicas.iter().find(|e| e.endpoint == endpoints[1]).unwrap();
    broken.inject("wrong-output");
    let failed = prove(&policy, &endpoints, None).await;
    assert!(!failed.passed, "{failed:?}");
    assert_eq!(
        failed.detail,
        "woken from sleep level 1, its probe was wrong-output"
    );
    assert!(is_sleeping(&endpoints[1]));
}
