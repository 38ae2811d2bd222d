//! The GameDay controller against a scripted API server, in the style of the `controller_*.rs` tests:
//! each scenario lists the requests one reconcile makes, in order, and answers them; Events are
//! collected on the side; [`ApiServer::expect_no_more`] proves nothing else was asked.
//!
//! The test at the end marked `#[ignore]` needs a real cluster:
//!
//! ```text
//! kind create cluster
//! kubectl apply -f crds/
//! cargo test -p understudy-operator --test gameday_mock -- --ignored
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use serde_json::{Value, json};
use understudy_operator::crd::GameDay;
use understudy_operator::gameday::controller::{ACTIVE_REQUEUE, Context, Error, reconcile};
use understudy_operator::peers::Routers;
use understudy_operator::ports::Clock;
use understudy_operator::reconciler::WithShell;
use understudy_operator::router_admin::RouterToken;
use understudy_operator::watchdog::{Reconciler, Watchdog};

mod support;
use support::{ApiServer, Call, NS, Published, reasons, status};

const POLICY_PATH: &str = "/apis/understudy.dev/v1alpha1/namespaces/serving/failoverpolicies/llama";
const GAMEDAY_STATUS_PATH: &str = "/apis/understudy.dev/v1alpha1/namespaces/serving/gamedays/weekly/status";
const OTHER_GAMEDAY_PATH: &str = "/apis/understudy.dev/v1alpha1/namespaces/serving/gamedays/other";

/// 2024-06-04T10:00:00Z, a Tuesday.
const NOW: Duration = Duration::from_secs(1_717_495_200);
const COMMAND: &str = "failover@gameday-weekly-20240604-100000";

#[derive(Debug)]
struct FixedClock;

impl Clock for FixedClock {
    fn now(&self) -> Duration {
        NOW
    }
}

fn time(offset_seconds: i64) -> String {
    let at = i64::try_from(NOW.as_secs()).unwrap() + offset_seconds;
    k8s_openapi::jiff::Timestamp::from_second(at).unwrap().to_string()
}

/// The weekly game day as stored, its scheduled run due now.
fn gameday() -> Value {
    json!({
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "GameDay",
        "metadata": {"name": "weekly", "namespace": NS, "uid": "6f1c", "generation": 1, "resourceVersion": "7"},
        "spec": {
            "policyRef": {"name": "llama"},
            "schedule": "0 10 * * TUE",
            "fault": "failover",
            "steadyState": {},
            "maxRecovery": "2m",
            "failback": {"mode": "manual"},
            "historyLimit": 10,
        },
        "status": {"phase": "Idle", "nextRunAt": time(0), "observedGeneration": 1},
    })
}

fn condition(status: &str, reason: &str) -> Value {
    json!({"status": status, "reason": reason, "message": "", "lastTransitionTime": time(-86_400)})
}

/// The policy serving from its home pool at epoch 4, its standby proven.
fn steady_policy() -> Value {
    json!({
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "FailoverPolicy",
        "metadata": {"name": "llama", "namespace": NS, "uid": "0d5e", "generation": 1, "resourceVersion": "100"},
        "spec": {
            "recoveryObjective": "5m",
            "pools": [
                {"name": "us-east", "workload": {"kind": "Deployment", "name": "vllm-east"}, "replicas": 4},
                {"name": "us-west", "workload": {"kind": "Deployment", "name": "vllm-west"}, "replicas": 4},
            ],
        },
        "status": {
            "primaryPool": "us-east",
            "epoch": 4,
            "state": "Serving",
            "conditions": {
                "Ready": condition("True", "LeaseHeld"),
                "StandbyProven": condition("True", "ChecksPass"),
                "ParityHolds": condition("Unknown", "NotChecked"),
            },
        },
    })
}

/// The run as the controller recorded it when it gave the command `seconds_ago`.
fn injected_run(seconds_ago: i64) -> Value {
    let at = time(-seconds_ago);
    json!({
        "id": "20240604-100000",
        "trigger": "schedule",
        "phase": "Injected",
        "transitions": [
            {"phase": "Scheduled", "at": at},
            {"phase": "CheckingSteadyState", "at": at},
            {"phase": "Injected", "at": at},
        ],
        "fromPool": "us-east",
        "toPool": "us-west",
        "baselineEpoch": 4,
        "command": COMMAND,
        "recovery": {"commandedAt": at},
    })
}

fn running(seconds_ago: i64) -> Value {
    let mut object = gameday();
    object["status"] = json!({
        "phase": "Injected",
        "currentRun": injected_run(seconds_ago),
        "nextRunAt": time(7 * 86_400),
        "observedGeneration": 1,
    });
    object
}

/// The policy after it took the command: `finished` seconds ago us-west served at epoch 5, or it
/// is still promoting.
fn policy_after_command(started_ago: i64, finished_ago: Option<i64>) -> Value {
    let mut policy = steady_policy();
    policy["metadata"]["annotations"] = json!({
        "understudy.dev/command": COMMAND,
        "understudy.dev/game-day": "weekly",
    });
    policy["status"]["primaryPool"] = json!("us-west");
    policy["status"]["epoch"] = json!(5);
    policy["status"]["state"] = json!(if finished_ago.is_some() {
        "Serving"
    } else {
        "Promoting"
    });
    let mut timeline = json!({
        "kind": "failover", "fromPool": "us-east", "toPool": "us-west", "epoch": 5,
        "startedAt": time(-started_ago),
        "steps": [{"step": "LeaseClaimed", "at": time(-started_ago)}],
    });
    if let Some(finished) = finished_ago {
        timeline["finishedAt"] = json!(time(-finished));
        timeline["steps"]
            .as_array_mut()
            .unwrap()
            .push(json!({"step": "Routed", "at": time(-finished)}));
    }
    policy["status"]["lastFailover"] = timeline;
    policy["status"]["failover"] = json!({"handledCommand": {"value": COMMAND}});
    policy
}

fn guard(object: &Value) -> Arc<DeserializeGuard<GameDay>> {
    Arc::new(serde_json::from_value(object.clone()).unwrap())
}

/// How a status apply of the GameDay is answered in these scenarios.
trait AnswerStatus {
    /// Answers a status apply with the object carrying the applied status; returns that status.
    fn answer_status(self, object: &Value) -> Value;
}

impl AnswerStatus for Call {
    fn answer_status(self, object: &Value) -> Value {
        assert!(
            self.query.contains("fieldManager=understudy-operator"),
            "{}",
            self.query
        );
        assert!(self.query.contains("force=true"), "{}", self.query);
        assert_eq!(self.content_type, "application/apply-patch+yaml");
        assert_eq!(
            self.body["metadata"]["resourceVersion"], object["metadata"]["resourceVersion"],
            "conditional on the GameDay the reconcile read"
        );
        let applied = self.body["status"].clone();
        let mut stored = object.clone();
        stored["status"] = applied.clone();
        self.answer(200, &stored);
        applied
    }
}

async fn run_scenario<F>(
    object: &Value,
    scenario: impl FnOnce(ApiServer) -> F,
) -> (Result<Action, Error>, Vec<Published>)
where
    F: Future<Output = Vec<Published>> + Send + 'static,
{
    let (client, server) = support::client();
    let ctx = Context::new(client, Some("test-0".into())).with_clock(Arc::new(FixedClock));
    support::play(scenario(server), reconcile(guard(object), Arc::new(ctx))).await
}

#[tokio::test(start_paused = true)]
async fn a_reconcile_whose_policy_read_goes_unanswered_stalls_the_watchdog_until_it_ends() {
    let watchdog = Watchdog::new(Duration::from_secs(60));
    let (client, mut server) = support::client();
    let ctx = Context::new(client, None)
        .with_clock(Arc::new(FixedClock))
        .with_watchdog(watchdog.clone());
    let reconciling = tokio::spawn(reconcile(guard(&gameday()), Arc::new(ctx)));
    // The run is due: the policy is read, and the API server does not answer for a minute.
    let call = server.expect("GET", POLICY_PATH).await;
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(watchdog.stall(), None);
    tokio::time::advance(Duration::from_secs(1)).await;
    let stall = watchdog
        .stall()
        .expect("a reconcile stuck for stall_after is a stall");
    assert_eq!(
        (stall.reconciler, stall.object.as_str()),
        (Reconciler::GameDay, "serving/weekly")
    );
    // A failed reconcile has finished too: its controller moves on.
    call.answer(500, &status(500, "InternalError", "etcd is down"));
    let result = reconciling.await.unwrap();
    assert!(matches!(result, Err(Error::Read { .. })), "{result:?}");
    assert_eq!(watchdog.stall(), None);
    server.expect_no_more().await;
}

#[tokio::test]
async fn a_scheduled_run_on_a_steady_policy_records_then_gives_the_failover_command() {
    let object = gameday();
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        // Write-ahead: the run and its command are recorded before the policy is given it.
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["phase"], "Injected");
        let run = &applied["currentRun"];
        assert_eq!(run["trigger"], "schedule");
        assert_eq!(run["command"], COMMAND);
        assert_eq!(run["baselineEpoch"], 4);
        assert_eq!(run["toPool"], "us-west");
        assert_eq!(run["recovery"]["commandedAt"], time(0));
        let phases: Vec<&str> = run["transitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["phase"].as_str().unwrap())
            .collect();
        assert_eq!(phases, ["Scheduled", "CheckingSteadyState", "Injected"]);
        // The next Tuesday.
        assert_eq!(applied["nextRunAt"], "2024-06-11T10:00:00Z");

        let command = server.expect("PATCH", POLICY_PATH).await;
        assert_eq!(command.content_type, "application/merge-patch+json");
        assert_eq!(
            command.body["metadata"]["resourceVersion"], "100",
            "conditional on the policy the steady state was judged on"
        );
        assert_eq!(
            command.body["metadata"]["annotations"]["understudy.dev/command"],
            COMMAND
        );
        assert_eq!(
            command.body["metadata"]["annotations"]["understudy.dev/game-day"],
            "weekly"
        );
        command.answer(200, &policy_after_command(0, None));
        server.expect_no_more().await
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(ACTIVE_REQUEUE));
    assert_eq!(reasons(&events), ["CommandGiven"]);
}

#[tokio::test]
async fn a_run_on_a_policy_that_is_not_ready_is_recorded_aborted_and_injects_nothing() {
    let object = gameday();
    let stored = object.clone();
    let mut stranded = steady_policy();
    stranded["status"]["state"] = json!("Stranded");
    stranded["status"]["conditions"]["Ready"] = condition("False", "Stranded");
    let (result, events) = run_scenario(&object, |mut server| async move {
        server.expect("GET", POLICY_PATH).await.answer(200, &stranded);
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["phase"], "Idle");
        assert!(applied.get("currentRun").is_none());
        assert_eq!(applied["lastVerdict"], "Aborted");
        let run = &applied["lastRuns"][0];
        assert_eq!(run["verdict"], "Aborted");
        assert_eq!(run["phase"], "Aborted");
        let reason = run["reason"].as_str().unwrap();
        assert!(
            reason.starts_with("not steady: Ready is False (Stranded)"),
            "{reason}"
        );
        assert!(run.get("command").is_none(), "nothing was injected");
        // No write to the policy follows.
        server.expect_no_more().await
    })
    .await;
    // The next run is a week away; an idle game day is looked at again within the hour.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(3600)));
    assert_eq!(reasons(&events), ["RunAborted"]);
}

#[tokio::test]
async fn a_promotion_done_within_max_recovery_is_recorded_passed_with_its_timeline() {
    // Commanded 95 s ago; the policy started 93 s ago and served 5 s ago: 90 s, within 2m.
    let object = running(95);
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        let policy = policy_after_command(93, Some(5));
        server.expect("GET", POLICY_PATH).await.answer(200, &policy);
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["phase"], "Idle");
        assert_eq!(applied["lastVerdict"], "Passed");
        let run = &applied["lastRuns"][0];
        assert_eq!(run["verdict"], "Passed");
        let recovery = &run["recovery"];
        assert_eq!(recovery["epoch"], 5);
        assert_eq!(recovery["startedAt"], time(-93));
        assert_eq!(recovery["servingAt"], time(-5));
        assert_eq!(recovery["seconds"], 90);
        assert_eq!(recovery["steps"][1]["step"], "Routed");
        let phases: Vec<&str> = run["transitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["phase"].as_str().unwrap())
            .collect();
        assert_eq!(
            phases,
            [
                "Scheduled",
                "CheckingSteadyState",
                "Injected",
                "Recovered",
                "Done"
            ]
        );
        // The run is over: the game day lets go of the policy.
        let release = server.expect("PATCH", POLICY_PATH).await;
        assert_eq!(
            release.body,
            json!({"metadata": {"resourceVersion": "100", "annotations": {"understudy.dev/game-day": null}}})
        );
        release.answer(200, &policy);
        server.expect_no_more().await
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(3600)));
    assert_eq!(reasons(&events), ["RunPassed"]);
    assert!(
        events[0].note.contains("failback is manual"),
        "{}",
        events[0].note
    );
}

#[tokio::test]
async fn a_finished_run_is_filed_newest_first_and_runs_beyond_the_history_limit_are_dropped() {
    let mut object = running(95);
    object["spec"]["historyLimit"] = json!(2);
    let earlier = |id: &str| json!({"id": id, "trigger": "schedule", "phase": "Done", "verdict": "Passed"});
    object["status"]["lastRuns"] = json!([earlier("20240528-100000"), earlier("20240521-100000")]);
    let stored = object.clone();
    let (result, _) = run_scenario(&object, |mut server| async move {
        let policy = policy_after_command(93, Some(5));
        server.expect("GET", POLICY_PATH).await.answer(200, &policy);
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        let kept: Vec<&str> = applied["lastRuns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|run| run["id"].as_str().unwrap())
            .collect();
        assert_eq!(kept, ["20240604-100000", "20240528-100000"]);
        server.expect("PATCH", POLICY_PATH).await.answer(200, &policy);
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn a_promotion_not_done_by_max_recovery_is_recorded_failed() {
    // Commanded 130 s ago (maxRecovery 2m); the policy is still promoting.
    let object = running(130);
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        let policy = policy_after_command(128, None);
        server.expect("GET", POLICY_PATH).await.answer(200, &policy);
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["lastVerdict"], "Failed");
        let run = &applied["lastRuns"][0];
        assert_eq!(run["phase"], "Failed");
        let reason = run["reason"].as_str().unwrap();
        assert!(
            reason.contains("not serving within maxRecovery (2m0s)"),
            "{reason}"
        );
        assert_eq!(run["recovery"]["startedAt"], time(-128));
        assert!(run["recovery"].get("servingAt").is_none());
        server.expect("PATCH", POLICY_PATH).await.answer(200, &policy);
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    assert_eq!(reasons(&events), ["RunFailed"]);
}

#[tokio::test]
async fn a_policy_held_by_another_running_game_day_is_not_steady() {
    let object = gameday();
    let stored = object.clone();
    let mut held = steady_policy();
    held["metadata"]["annotations"] = json!({"understudy.dev/game-day": "other"});
    let (result, _) = run_scenario(&object, |mut server| async move {
        server.expect("GET", POLICY_PATH).await.answer(200, &held);
        let mut other = gameday();
        other["metadata"]["name"] = json!("other");
        other["status"] = json!({"phase": "Injected", "currentRun": injected_run(10)});
        server.expect("GET", OTHER_GAMEDAY_PATH).await.answer(200, &other);
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        let reason = applied["lastRuns"][0]["reason"].as_str().unwrap();
        assert!(
            reason.contains("game day other is running on the policy"),
            "{reason}"
        );
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn a_policy_changed_after_it_was_judged_is_not_given_the_command() {
    let object = gameday();
    let stored = object.clone();
    let (result, _) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        server
            .expect("PATCH", POLICY_PATH)
            .await
            .answer(409, &status(409, "Conflict", "Conflict"));
        server.expect_no_more().await
    })
    .await;
    // The recorded run asks again on the next reconcile, after judging the policy afresh.
    assert!(matches!(result, Err(Error::PolicyChanged)), "{result:?}");
}

#[tokio::test]
async fn a_run_command_starts_a_run_once() {
    let mut object = gameday();
    object["spec"].as_object_mut().unwrap().remove("schedule");
    object["status"] = json!({"phase": "Idle", "observedGeneration": 1});
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "run@1"});
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["handledCommand"], "run@1");
        assert_eq!(applied["currentRun"]["trigger"], "command");
        assert!(applied.get("nextRunAt").is_none());
        server
            .expect("PATCH", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    assert_eq!(reasons(&events), ["CommandGiven"]);

    // The same value again, recorded as handled, starts nothing and writes nothing.
    object["status"]["handledCommand"] = json!("run@1");
    let (result, events) = run_scenario(&object, |server| async move { server.expect_no_more().await }).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert!(events.is_empty());
}

#[tokio::test]
async fn a_scheduled_time_that_passes_during_a_run_is_skipped_not_queued() {
    let mut object = running(10);
    object["status"]["nextRunAt"] = json!(time(0));
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &policy_after_command(8, None));
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["nextRunAt"], "2024-06-11T10:00:00Z");
        assert_eq!(applied["currentRun"]["id"], "20240604-100000");
        assert_eq!(applied["currentRun"]["phase"], "Injected");
        server.expect_no_more().await
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(ACTIVE_REQUEUE));
    assert_eq!(reasons(&events), ["RunSkipped"]);
}

#[tokio::test]
async fn a_status_written_from_a_stale_copy_is_refused_and_nothing_is_given() {
    // The cached copy has not yet seen the run another reconcile started: its write is
    // conditional on what it read, gets a 409, and the policy is given nothing.
    let object = gameday();
    let (result, events) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        let apply = server.expect("PATCH", GAMEDAY_STATUS_PATH).await;
        assert_eq!(apply.body["metadata"]["resourceVersion"], "7");
        apply.answer(409, &status(409, "Conflict", "Conflict"));
        server.expect_no_more().await
    })
    .await;
    assert!(matches!(result, Err(Error::StatusConflict)), "{result:?}");
    assert!(events.is_empty(), "{events:?}");
}

#[tokio::test]
async fn a_scheduled_run_missed_by_more_than_the_starting_deadline_is_skipped() {
    // The operator was down: the run due an hour ago does not start now.
    let mut object = gameday();
    object["status"]["nextRunAt"] = json!(time(-3600));
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert!(applied.get("currentRun").is_none());
        assert_eq!(applied["phase"], "Idle");
        assert_eq!(applied["nextRunAt"], "2024-06-11T10:00:00Z");
        server.expect_no_more().await
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(3600)));
    assert_eq!(reasons(&events), ["RunMissed"]);
    assert!(events[0].note.contains(&time(-3600)), "{}", events[0].note);
}

#[tokio::test]
async fn a_scheduled_run_a_few_minutes_late_still_starts() {
    let mut object = gameday();
    object["status"]["nextRunAt"] = json!(time(-300));
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["currentRun"]["id"], "20240604-095500");
        server
            .expect("PATCH", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    assert_eq!(reasons(&events), ["CommandGiven"]);
}

#[tokio::test]
async fn a_schedule_that_never_fires_says_so_and_still_takes_a_run_command() {
    let mut object = gameday();
    object["spec"]["schedule"] = json!("0 0 31 2 *");
    object["status"] = json!({"phase": "Idle", "observedGeneration": 1});
    object["metadata"]["annotations"] = json!({"understudy.dev/command": "run@1"});
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        let message = applied["message"].as_str().unwrap();
        assert!(message.contains("never fires"), "{message}");
        assert!(applied.get("nextRunAt").is_none());
        assert_eq!(applied["currentRun"]["trigger"], "command");
        server
            .expect("PATCH", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    assert_eq!(reasons(&events), ["CommandGiven", "InvalidSpec"]);
}

/// A router's admin port on loopback whose `/metrics` answers whatever `text` holds; its URL.
fn router_counting(text: Arc<std::sync::Mutex<String>>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut head = [0u8; 4096];
            let read = stream.read(&mut head).unwrap_or(0);
            let asked = String::from_utf8_lossy(&head[..read]).into_owned();
            let body = if asked.starts_with("GET /metrics ")
                && asked.contains("authorization: Bearer router-token")
            {
                text.lock().unwrap().clone()
            } else {
                String::new()
            };
            let status = if body.is_empty() {
                "401 Unauthorized"
            } else {
                "200 OK"
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    url
}

fn counters(forwarded: u64, failed: u64) -> String {
    format!(
        "understudy_router_requests_total{{outcome=\"forwarded\",priority=\"interactive\"}} {forwarded}\n\
         understudy_router_requests_total{{outcome=\"upstream_failed\",priority=\"interactive\"}} {failed}\n\
         understudy_router_requests_total{{outcome=\"shed\",priority=\"batch\"}} 7\n"
    )
}

#[tokio::test]
async fn a_run_records_what_the_routers_counted_since_the_fault_and_stops_when_the_clients_fail() {
    let text = Arc::new(std::sync::Mutex::new(counters(100, 0)));
    let url = router_counting(text.clone());
    let (client, mut server) = support::client();
    let ctx = Arc::new(
        Context::new(client, Some("test-0".into()))
            .with_clock(Arc::new(FixedClock))
            .with_routers(
                Routers::At(vec![url.parse().unwrap()]),
                RouterToken::new("router-token").unwrap(),
            ),
    );
    let mut object = running(10);
    object["spec"]["stopConditions"] = json!({"maxErrorRate": 0.05, "window": "1m", "minRequests": 20});
    object["status"]["currentRun"]["requestsBefore"] = json!({"sent": 80, "failed": 0, "shed": 5});
    let stored = object.clone();
    let scenario = tokio::spawn(async move {
        let mut applied = Vec::new();
        for _ in 0..2 {
            server
                .expect("GET", POLICY_PATH)
                .await
                .answer(200, &policy_after_command(8, None));
            applied.push(
                server
                    .expect("PATCH", GAMEDAY_STATUS_PATH)
                    .await
                    .answer_status(&stored),
            );
        }
        applied
    });
    // The first reconcile reads 107 requests since the routers started, 27 of them since the
    // fault; the second 100 more, half of them failed.
    reconcile(guard(&object), ctx.clone()).await.unwrap();
    *text.lock().unwrap() = counters(150, 50);
    reconcile(guard(&object), ctx).await.unwrap();
    let applied = scenario.await.unwrap();
    let first = &applied[0]["currentRun"];
    assert_eq!(first["requests"], json!({"sent": 27, "failed": 0, "shed": 2}));
    assert!(first.get("stopCondition").is_none(), "{first}");
    let second = &applied[1]["currentRun"];
    assert_eq!(second["requests"], json!({"sent": 127, "failed": 50, "shed": 2}));
    assert_eq!(
        second["stopCondition"],
        "stop condition: 50.0% of the last 1m0s's 100 requests failed (50 of them), above maxErrorRate 5.0%"
    );
}

#[cfg(test)]
mod cluster {
    use kube::api::{Api, DeleteParams, PostParams};

    use super::*;

    #[tokio::test]
    #[ignore = "needs a cluster: tests/cluster/e2e.sh runs it; elsewhere kubectl apply -f crds/ and cargo test -- --ignored"]
    async fn a_game_day_on_a_missing_policy_is_recorded_aborted() {
        let client = Client::try_default().await.unwrap();
        let namespace = client.default_namespace().to_owned();
        let gamedays: Api<GameDay> = Api::namespaced(client.clone(), &namespace);
        let mut object = gameday();
        object["metadata"] = json!({
            "name": "understudy-cluster-gameday",
            "annotations": {"understudy.dev/command": "run@cluster-test"},
        });
        object["spec"]["policyRef"]["name"] = json!("understudy-no-such-policy");
        object.as_object_mut().unwrap().remove("status");
        let _ = gamedays
            .delete("understudy-cluster-gameday", &DeleteParams::default())
            .await;
        gamedays
            .create(&PostParams::default(), &serde_json::from_value(object).unwrap())
            .await
            .unwrap();
        let ctx = Arc::new(Context::new(client, None));
        let controller = tokio::spawn(async move {
            understudy_operator::gameday::controller::run(ctx, Some(&namespace)).await;
        });
        let mut verdict = None;
        for _ in 0..60 {
            let current = gamedays.get("understudy-cluster-gameday").await.unwrap();
            if let Some(v) = current.status.and_then(|s| s.last_verdict) {
                verdict = Some(v);
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        controller.abort();
        assert_eq!(
            verdict,
            Some(understudy_operator::crd::Verdict::Aborted),
            "no verdict within a minute"
        );
        gamedays
            .delete("understudy-cluster-gameday", &DeleteParams::default())
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn with_concurrency_policy_allow_a_run_due_during_another_waits_and_starts_when_it_ends() {
    // Due now, while the run of 10 s ago is still promoting.
    let mut object = running(10);
    object["spec"]["concurrencyPolicy"] = json!("Allow");
    object["status"]["nextRunAt"] = json!(time(0));
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &policy_after_command(8, None));
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["queuedRunAt"], time(0));
        assert_eq!(applied["currentRun"]["phase"], "Injected");
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    assert!(reasons(&events).is_empty(), "{:?}", reasons(&events));

    // The run before it is over: the one that waited starts, as due when it was due.
    let mut object = gameday();
    object["spec"]["concurrencyPolicy"] = json!("Allow");
    object["status"] = json!({
        "phase": "Idle", "queuedRunAt": time(0), "nextRunAt": time(7 * 86_400), "observedGeneration": 1,
    });
    let stored = object.clone();
    let (result, _) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &steady_policy());
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert!(applied.get("queuedRunAt").is_none(), "{applied}");
        assert_eq!(applied["currentRun"]["id"], "20240604-100000");
        assert_eq!(applied["currentRun"]["phase"], "Injected");
        let command = server.expect("PATCH", POLICY_PATH).await;
        command.answer(200, &steady_policy());
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn with_concurrency_policy_replace_an_injected_run_is_not_cut_short() {
    let mut object = running(10);
    object["spec"]["concurrencyPolicy"] = json!("Replace");
    object["status"]["nextRunAt"] = json!(time(0));
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        server
            .expect("GET", POLICY_PATH)
            .await
            .answer(200, &policy_after_command(8, None));
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert_eq!(applied["currentRun"]["id"], "20240604-100000");
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    let skipped = events.iter().find(|e| e.reason == "RunSkipped").unwrap();
    assert!(
        skipped
            .note
            .contains("never cut short (concurrencyPolicy: Replace)"),
        "{}",
        skipped.note
    );
}

#[tokio::test]
async fn a_schedule_in_a_time_zone_is_read_there_and_an_unknown_zone_is_said() {
    let mut object = gameday();
    object["spec"]["schedule"] = json!("0 10 * * TUE");
    object["spec"]["timeZone"] = json!("America/New_York");
    object["status"] = json!({"phase": "Idle", "observedGeneration": 1});
    let stored = object.clone();
    let (result, _) = run_scenario(&object, |mut server| async move {
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        // 10:00 in New York (EDT) is 14:00 UTC; T0 is Tuesday 10:00 UTC, so today's is ahead.
        assert_eq!(applied["nextRunAt"], "2024-06-04T14:00:00Z");
        server.expect_no_more().await
    })
    .await;
    result.unwrap();

    let mut object = gameday();
    object["spec"]["timeZone"] = json!("Mars/Olympus_Mons");
    let stored = object.clone();
    let (result, events) = run_scenario(&object, |mut server| async move {
        let applied = server
            .expect("PATCH", GAMEDAY_STATUS_PATH)
            .await
            .answer_status(&stored);
        assert!(applied.get("nextRunAt").is_none(), "{applied}");
        let message = applied["message"].as_str().unwrap();
        assert!(
            message.starts_with("timeZone \"Mars/Olympus_Mons\" is not an IANA time zone"),
            "{message}"
        );
        server.expect_no_more().await
    })
    .await;
    result.unwrap();
    assert_eq!(reasons(&events), ["InvalidSpec"]);
}
