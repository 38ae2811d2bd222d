//! The promotion's Wake step against emulated vLLM replicas on loopback: sleeping replicas are
//! woken and confirmed awake through `/is_sleeping`, a level-2 sleeper generates the model's text
//! again, and a replica without dev mode counts as awake.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../prober/tests/emulated/mod.rs"]
mod prober_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use prober_support::{Emulator, MODEL};
use understudy_core::drive::WakeOrder;
use understudy_core::{Epoch, Pool};
use understudy_operator::crd::FailoverPolicy;
use understudy_operator::ports::StepReport;
use understudy_operator::replicas::FixedReplicas;
use understudy_operator::wake::{ReplicaWake, WakeTimeouts, wake_pool};
use understudy_prober::probe::Endpoint;
use understudy_prober::sleep::wake_replica_at_its_level;

const DEV_MODE: &[(&str, &str)] = &[("VLLM_SERVER_DEV_MODE", "1")];

/// A policy whose second pool, `west`, waits as `standby` says.
fn policy(standby: &str) -> FailoverPolicy {
    serde_yaml::from_str(&format!(
        r"
apiVersion: understudy.dev/v1alpha1
kind: FailoverPolicy
metadata: {{name: chat, namespace: serving}}
spec:
  pools:
    - {{name: east, workload: {{kind: Deployment, name: chat-east}}, replicas: 2}}
    - {{name: west, workload: {{kind: Deployment, name: chat-west}}, replicas: 2, standby: {standby}}}
  recoveryObjective: 1m
  admission: {{window: 90s, initialConcurrency: 3}}
"
    ))
    .unwrap()
}

fn warm(level: u8) -> String {
    format!("[{{tier: warm, replicas: 2, sleepLevel: {level}}}]")
}

/// One blocking request on a fresh loopback connection: the status and the body.
fn request(endpoint: &Endpoint, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", endpoint.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

fn is_sleeping(e: &Emulator) -> bool {
    let (status, body) = request(&e.endpoint, "GET", "/is_sleeping", "");
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    json["is_sleeping"].as_bool().unwrap()
}

fn put_to_sleep(e: &Emulator, level: u8) {
    assert_eq!(e.post(&format!("/sleep?level={level}"), ""), 200);
    assert!(is_sleeping(e));
}

/// The temperature-0 text of a short completion.
fn complete(endpoint: &Endpoint) -> String {
    let body = serde_json::json!({
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0
    })
    .to_string();
    let (status, answer) = request(endpoint, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{answer}");
    let json: serde_json::Value = serde_json::from_str(&answer).unwrap();
    json["choices"][0]["text"].as_str().unwrap().to_owned()
}

/// Runs the Wake step of promoting `west`, served at `endpoints`, needing all its warm replicas.
async fn wake(policy: &FailoverPolicy, endpoints: Vec<Endpoint>) -> StepReport {
    let warm = policy.spec.pools[1].standby_shape().warm;
    wake_needing(policy, endpoints, warm, None).await
}

/// Runs the Wake step of promoting `west`, needing `needed` of its warm replicas awake.
async fn wake_needing(
    policy: &FailoverPolicy,
    endpoints: Vec<Endpoint>,
    needed: u32,
    overdue: Option<Duration>,
) -> StepReport {
    let replicas = FixedReplicas::default().with_pool("west", endpoints);
    let pool = &policy.spec.pools[1];
    let order = wake_order(policy, needed, overdue);
    wake_pool(&replicas, "serving", pool, WakeTimeouts::default(), &order)
        .await
        .report
}

/// The Wake step's order for promoting `west`: a minute before the deadline, or `overdue`.
fn wake_order(policy: &FailoverPolicy, needed: u32, overdue: Option<Duration>) -> WakeOrder {
    let shape = policy.spec.pools[1].standby_shape();
    WakeOrder {
        pool: Pool::B,
        epoch: Epoch(1),
        replicas: shape.warm,
        needed,
        level: shape.sleep_level,
        overdue,
        left: if overdue.is_some() {
            Duration::ZERO
        } else {
            Duration::from_secs(60)
        },
    }
}

#[tokio::test]
async fn a_replica_left_asleep_is_woken_from_the_level_its_metrics_say() {
    let left = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    put_to_sleep(&left, 2);
    // Its pool's warm tier names level 1; its own metrics say it sleeps at level 2.
    let woken = wake_replica_at_its_level(&left.endpoint, 1, WakeTimeouts::default()).await;
    assert_eq!(woken, (ReplicaWake::Woken, 2));
    assert!(!is_sleeping(&left));
    // Awake, it is left as it is.
    let again = wake_replica_at_its_level(&left.endpoint, 1, WakeTimeouts::default()).await;
    assert_eq!(again.0, ReplicaWake::Awake);
}

#[tokio::test]
async fn the_step_goes_on_once_the_quorum_is_awake_and_a_hung_replica_is_left_waking() {
    let healthy = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    let hung = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    put_to_sleep(&healthy, 1);
    put_to_sleep(&hung, 1);
    // Takes connections and never answers: its wake waits out the call's timeout.
    hung.inject("hang");
    let endpoints = vec![healthy.endpoint.clone(), hung.endpoint.clone()];

    let note = done_note(wake_needing(&policy(&warm(1)), endpoints.clone(), 1, None).await);

    assert!(note.starts_with("woke 1 of 2 replica(s) of west"), "{note}");
    assert!(
        note.contains(&format!(
            "enough are awake for the serving quorum; it goes on without 1 ({} is still waking)",
            hung.endpoint
        )),
        "{note}"
    );
    assert!(!is_sleeping(&healthy));
    // Needing both, the hung one holds the step until its call times out; past the promotion's
    // deadline, the step waits only to hear who is awake, and is done with them.
    let note = done_note(wake_needing(&policy(&warm(1)), endpoints, 2, Some(Duration::from_secs(30))).await);
    assert!(note.contains("1 were awake already"), "{note}");
    assert!(
        note.contains(&format!(
            "past the promotion's deadline of 30s, it goes on without 1 ({} ",
            hung.endpoint
        )),
        "{note}"
    );
}

fn done_note(report: StepReport) -> String {
    match report {
        StepReport::Done { carried_by, note } => {
            assert_eq!(carried_by, "operator");
            note.unwrap()
        }
        other => panic!("the Wake step is not done: {other:?}"),
    }
}

#[tokio::test]
async fn two_warm_replicas_asleep_at_level_1_are_woken_and_serve() {
    let a = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    let b = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    put_to_sleep(&a, 1);
    put_to_sleep(&b, 1);

    let note = done_note(wake(&policy(&warm(1)), vec![a.endpoint.clone(), b.endpoint.clone()]).await);

    assert!(
        note.starts_with("woke 2 of 2 replica(s) of west (2 from sleep level 1)"),
        "{note}"
    );
    assert!(!is_sleeping(&a) && !is_sleeping(&b));
    assert!(!complete(&a.endpoint).is_empty());
    assert!(!complete(&b.endpoint).is_empty());
}

#[tokio::test]
async fn a_level_2_sleeper_generates_the_models_text_again_after_the_wake_step() {
    let never_slept = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    let sleeper = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    let expected = complete(&never_slept.endpoint);
    put_to_sleep(&sleeper, 2);

    let note = done_note(wake(&policy(&warm(2)), vec![sleeper.endpoint.clone()]).await);

    assert!(
        note.starts_with("woke 1 of 1 replica(s) of west (1 from sleep level 2)"),
        "{note}"
    );
    assert!(!is_sleeping(&sleeper));
    assert_eq!(complete(&sleeper.endpoint), expected);
}

#[tokio::test]
async fn a_plain_wake_up_after_level_2_serves_garbage_which_is_why_the_step_reloads() {
    // The control for the test above: without reload_weights the emulator's text differs.
    let never_slept = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    let sleeper = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    put_to_sleep(&sleeper, 2);
    assert_eq!(sleeper.post("/wake_up", ""), 200);
    assert!(!is_sleeping(&sleeper));
    assert_ne!(complete(&sleeper.endpoint), complete(&never_slept.endpoint));
}

#[tokio::test]
async fn a_replica_without_dev_mode_counts_as_awake() {
    let plain = Emulator::ready(&[], &[]);
    assert_eq!(request(&plain.endpoint, "GET", "/is_sleeping", "").0, 404);
    let asleep = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    put_to_sleep(&asleep, 1);

    let note = done_note(
        wake(
            &policy(&warm(1)),
            vec![plain.endpoint.clone(), asleep.endpoint.clone()],
        )
        .await,
    );

    assert!(note.starts_with("woke 1 of 2 replica(s) of west"), "{note}");
    assert!(note.contains("1 have no sleep API"), "{note}");
    assert!(!is_sleeping(&asleep));
}

#[tokio::test]
async fn an_unreachable_replica_holds_the_step_but_not_the_others() {
    let asleep = Emulator::ready(&["--enable-sleep-mode"], DEV_MODE);
    put_to_sleep(&asleep, 1);
    let gone_port = understudy_emulator::local::ClosedPort::bind();
    let gone = Endpoint::new("127.0.0.1", gone_port.port);

    let report = wake(&policy(&warm(1)), vec![gone, asleep.endpoint.clone()]).await;

    let StepReport::NotYet { reason } = report else {
        panic!("{report:?}")
    };
    assert!(
        reason.starts_with("1 of 2 replica(s) of west are not awake yet"),
        "{reason}"
    );
    assert!(!is_sleeping(&asleep), "the reachable replica was woken anyway");
}

#[tokio::test]
async fn a_pool_without_a_warm_tier_is_done_without_a_call() {
    // Nothing listens there: a call would fail the step.
    let nobody_port = understudy_emulator::local::ClosedPort::bind();
    let nobody = Endpoint::new("127.0.0.1", nobody_port.port);
    let note = done_note(wake(&policy("[{tier: hot, replicas: 2}]"), vec![nobody]).await);
    assert!(note.contains("no warm tier"), "{note}");
}
