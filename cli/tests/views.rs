//! The views and the changes against recorded status fixtures (`tests/fixtures/README.md`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::json;
use understudy_api::crd::{FailoverPolicy, GameDay, RolloutMode};
use understudy_cli::act::{self, Change};
use understudy_cli::view;

fn fixture<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn llama() -> FailoverPolicy {
    fixture("llama-after-failover.json")
}

#[test]
fn get_prints_a_row_per_policy_with_its_primary_epoch_state_and_conditions() {
    assert_eq!(
        view::policies(&[llama()], true),
        "NAMESPACE   NAME    PRIMARY   EPOCH   STATE     READY   STANDBY   PARITY    OBJECTIVE   GRANTS\n\
         serving     llama   us-west   1       Serving   True    Unknown   Unknown   True        -\n"
    );
    assert_eq!(view::policies(&[], false), "No FailoverPolicies found.\n");
}

#[test]
fn get_and_describe_name_the_cluster_of_a_pool_that_lives_in_another() {
    let mut policy = llama();
    policy.spec.pools[1].cluster = Some(
        serde_json::from_value(
            serde_json::json!({"name": "us-west-2", "kubeconfigSecret": {"name": "west"}}),
        )
        .unwrap(),
    );
    let row = view::policies(std::slice::from_ref(&policy), false);
    assert!(row.contains("llama   us-west@us-west-2   1 "), "{row}");
    let text = view::describe(&policy);
    for line in [
        "  us-east   (the operator's)   Deployment/vllm-east   2          1 hot, 1 warm (level 1)\n",
        "  us-west   us-west-2          Deployment/vllm-west   8          4 warm (level 1), 4 pilot light\n",
    ] {
        assert!(text.contains(line), "no {line:?} in:\n{text}");
    }
}

#[test]
fn coldstart_prints_each_replicas_stages_in_the_order_it_went_through_them_and_each_tier() {
    assert_eq!(
        view::cold_starts(&llama()),
        "\
REPLICA           POOL      TIER         NODE    IMAGEPULL   CONTAINERSTART   WEIGHTLOAD   WARMUP   APIREADY   WAKELEVEL1   FIRSTTOKEN   TOTAL
west-2            us-west   pilotLight   92.2s   86.5s       1.0s             29.5s        45.6s    1.5s       -            2.2s         259s
west-3            us-west   pilotLight   160s    1.2s        0s               12.5s        40.0s    1.1s       -            4.9s         220s
127.0.0.1:32797   us-west   warm         -       -           -                -            -        -          166ms        4ms          170ms
127.0.0.1:33891   us-west   warm         -       -           -                -            -        -          165ms        4ms          170ms
127.0.0.1:37125   us-west   warm         -       -           -                -            -        -          165ms        5ms          171ms
127.0.0.1:38329   us-west   warm         -       -           -                -            -        -          166ms        4ms          170ms

Per tier (median / worst):
TIER         REPLICAS   NODE          IMAGEPULL       CONTAINERSTART   WEIGHTLOAD      WARMUP          APIREADY      WAKELEVEL1      FIRSTTOKEN
pilotLight   2          126s / 160s   43.9s / 86.5s   500ms / 1.0s     21.0s / 29.5s   42.8s / 45.6s   1.3s / 1.5s   -               3.6s / 4.9s
warm         4          -             -               -                -               -               -             166ms / 166ms   4ms / 5ms
"
    );
    let mut fresh = llama();
    fresh.status = None;
    assert_eq!(
        view::cold_starts(&fresh),
        "No cold starts measured for llama yet: they are timed when a promotion wakes or starts replicas.\n"
    );
}

#[test]
fn describe_tells_the_pools_conditions_and_last_failover_step_by_step() {
    let text = view::describe(&llama());
    for line in [
        "Primary:        us-west at epoch 1\n",
        "  us-west   (the operator's)   Deployment/vllm-west   8          4 warm (level 1), 4 pilot light\n",
        "  ParityHolds     Unknown   NotChecked        no parity check has reported drift",
        "Last failover:  failover us-east → us-west at epoch 1, started 2026-01-05T09:00:06Z, finished 2026-01-05T09:00:06Z\n",
        "  Serving           2026-01-05T09:00:06Z   0s     4 of 8 replicas of us-west answered the generating probe right\n",
        "Standby proof:  never\n",
        "Cold starts:    6 measured (kubectl understudy coldstart llama)\n",
    ] {
        assert!(text.contains(line), "no {line:?} in:\n{text}");
    }
    let steps: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("  STEP"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(
        steps,
        [
            "LeaseClaimed",
            "Fenced",
            "Woken",
            "ScaledUp",
            "Serving",
            "Routed",
            "AdmissionOpened"
        ]
    );
}

#[test]
fn get_and_describe_show_each_pools_fences_by_the_standing_of_their_grants() {
    let mut policy = llama();
    let text = view::describe(&policy);
    assert!(
        text.contains("Grants:         none: the fences read the Lease themselves"),
        "{text}"
    );
    let status = policy.status.as_mut().unwrap();
    status.grants = Some(
        serde_json::from_value(serde_json::json!({
            "epoch": 1, "holder": "us-west", "grantedAt": "2026-01-05T09:00:08Z", "priorRevoked": false,
            "expiresInSeconds": 9.2,
            "pools": [
                {"pool": "us-east", "fences": {"unreachable": 8}},
                {"pool": "us-west", "fences": {"serving": 4, "waiting": 4}},
            ],
        }))
        .unwrap(),
    );
    let text = view::describe(&policy);
    for line in [
        "Grants:         epoch 1 held by us-west, granted 2026-01-05T09:00:08Z; serving 9.2s more without another; \
         the old holder's fences were not all told (the new holder waits out their grants)\n",
        "  us-east   8 unreachable\n",
        "  us-west   4 serving, 4 waiting\n",
    ] {
        assert!(text.contains(line), "no {line:?} in:\n{text}");
    }
    assert!(view::policies(&[policy], false).contains("True        4/8 serving\n"));
}

#[test]
fn gamedays_prints_each_game_day_then_its_runs_and_verdicts() {
    let gameday: GameDay = fixture("weekly-gameday.json");
    assert_eq!(
        view::gamedays(&[gameday], false),
        "\
NAME     POLICY   SCHEDULE       PHASE   LAST VERDICT   NEXT RUN
weekly   llama    0 10 * * TUE   Idle    Passed         2024-06-11T10:00:00Z

Runs:
GAMEDAY   RUN               PHASE   PROMOTED            RECOVERED IN   REQUESTS SINCE THE FAULT   VERDICT   WHY
weekly    20240604-100000   Done    us-east → us-west   90s            -                          Passed    us-west served at epoch 5 90s after the command (maxRecovery 2m0s); failback is manual: us-west stays primary until the policy is given a failback command
"
    );
}

#[test]
fn a_switchover_to_an_unproven_standby_is_refused_unless_forced() {
    let policy = llama();
    let to_east = |force| Change::Switchover {
        to: "us-east".into(),
        force,
    };
    let refused = act::plan(&policy, &to_east(false), "t1").unwrap_err();
    assert_eq!(
        refused.to_string(),
        "us-east is not proven (us-east has passed 0 of the 2 checks that prove it), so the operator \
         would refuse it; --force promotes it all the same"
    );
    let forced = act::plan(&policy, &to_east(true), "t1").unwrap();
    assert_eq!(
        forced.patch,
        json!({"metadata": {"annotations": {"understudy.dev/command": "force-failover@t1"}}})
    );
    assert!(
        forced
            .question
            .starts_with("Switch llama over from us-west to us-east? The epoch Lease moves to epoch 2")
    );
}

#[test]
fn a_switchover_to_a_proven_standby_gives_the_failover_command() {
    let mut policy = llama();
    let status = policy.status.as_mut().unwrap();
    let proven = status.conditions.get_mut("StandbyProven").unwrap();
    proven.status = understudy_api::crd::ConditionStatus::True;
    let change = Change::Switchover {
        to: "us-east".into(),
        force: false,
    };
    let planned = act::plan(&policy, &change, "cli-20261202T120000Z").unwrap();
    assert_eq!(
        planned.patch,
        json!({"metadata": {"annotations": {"understudy.dev/command": "failover@cli-20261202T120000Z"}}})
    );
}

#[test]
fn changes_that_cannot_happen_are_refused_before_anything_is_written() {
    let policy = llama();
    let refusal = |change: Change| act::plan(&policy, &change, "t").unwrap_err().to_string();
    assert_eq!(
        refusal(Change::Switchover {
            to: "us-west".into(),
            force: true
        }),
        "us-west is the primary of llama already"
    );
    assert_eq!(
        refusal(Change::Switchover {
            to: "eu-west".into(),
            force: true
        }),
        "llama has no pool eu-west; its pools are us-east and us-west"
    );
    assert_eq!(refusal(Change::Resume), "llama is not paused already");
    let mut home = llama();
    home.status.as_mut().unwrap().primary_pool = Some("us-east".into());
    assert_eq!(
        act::plan(&home, &Change::Failback, "t").unwrap_err().to_string(),
        "us-east, the home pool of llama, is the primary already: nothing to fail back"
    );
}

#[test]
fn failback_pause_and_resume_are_the_command_and_the_spec_field() {
    let policy = llama();
    let failback = act::plan(&policy, &Change::Failback, "t2").unwrap();
    assert_eq!(
        failback.patch,
        json!({"metadata": {"annotations": {"understudy.dev/command": "failback@t2"}}})
    );
    let pause = act::plan(&policy, &Change::Pause, "t").unwrap();
    assert_eq!(pause.patch, json!({"spec": {"paused": true}}));
    let mut paused = llama();
    paused.spec.paused = true;
    let resume = act::plan(&paused, &Change::Resume, "t").unwrap();
    assert_eq!(resume.patch, json!({"spec": {"paused": false}}));
}

#[test]
fn describe_shows_the_last_load_proof_and_its_condition_when_the_policy_asks_for_one() {
    let mut policy = llama();
    assert!(!view::describe(&policy).contains("Load proof:"), "not asked for");
    policy.spec.load_proof = Some(serde_json::from_value(serde_json::json!({"every": "6h"})).unwrap());
    assert!(view::describe(&policy).contains("Load proof:     not run yet (every 6h)\n"));
    let status = policy.status.as_mut().unwrap();
    status.load_proof = Some(
        serde_json::from_value(serde_json::json!({
            "at": "2026-12-04T03:00:00Z", "pool": "us-east", "result": "Failed", "replicas": 1, "woken": 1,
            "recordedRate": 10.0, "replayedRate": 10.0, "requests": 600, "errors": 0,
            "ttftP99Ms": 2952, "itlP99Ms": 10, "detail": "TTFT p99 2952 ms, over 2000 ms"
        }))
        .unwrap(),
    );
    status.conditions.insert(
        "StandbyLoadProven".to_owned(),
        serde_json::from_value(serde_json::json!({
            "status": "False", "reason": "Failed", "message": "see the load proof",
            "lastTransitionTime": "2026-12-04T03:01:00Z"
        }))
        .unwrap(),
    );
    let text = view::describe(&policy);
    for line in [
        "Load proof:     Failed at 2026-12-04T03:00:00Z against us-east: 600 requests at 10/s (the primary's 10/s \
         recorded) on 1 replica (1 woken), 0 failed, TTFT p99 2952 ms, inter-token p99 10 ms: TTFT p99 2952 ms, over 2000 ms\n",
        "  StandbyLoadProven   False",
    ] {
        assert!(text.contains(line), "no {line:?} in:\n{text}");
    }
}

#[test]
fn describe_says_where_a_standby_first_rollout_stands() {
    let mut policy = llama();
    assert!(!view::describe(&policy).contains("Rollout:"), "not asked for");
    policy.spec.rollout = RolloutMode::StandbyFirst;
    assert!(view::describe(&policy).contains("Rollout:        standby first; nothing held yet\n"));
    policy.status.as_mut().unwrap().rollout = Some(
        serde_json::from_value(serde_json::json!({
            "phase": "Stopped", "pool": "us-east", "target": "0123456789ab",
            "change": "runtime.image: v0.11.0 -> v0.12.0", "since": "2026-12-05T03:00:00Z",
            "message": "stopped: standby us-west failed 3 checks in a row on it; the primary is untouched"
        }))
        .unwrap(),
    );
    let text = view::describe(&policy);
    let line = "Rollout:        Stopped since 2026-12-05T03:00:00Z: stopped: standby us-west failed 3 checks in a \
                row on it; the primary is untouched [runtime.image: v0.11.0 -> v0.12.0]\n";
    assert!(text.contains(line), "no {line:?} in:\n{text}");
}

#[test]
fn prove_load_gives_the_command_to_a_policy_that_sets_a_load_proof_and_is_serving() {
    let mut policy = llama();
    assert_eq!(
        act::plan(&policy, &Change::ProveLoad, "t")
            .unwrap_err()
            .to_string(),
        "llama sets no spec.loadProof: nothing says how to prove its standby at load"
    );
    policy.spec.load_proof = Some(serde_json::from_value(json!({"every": "6h", "duration": "90s"})).unwrap());
    let planned = act::plan(&policy, &Change::ProveLoad, "t3").unwrap();
    assert_eq!(
        planned.patch,
        json!({"metadata": {"annotations": {"understudy.dev/command": "prove-load@t3"}}})
    );
    assert!(
        planned.question.contains("against us-east now, for 90s at 1"),
        "{}",
        planned.question
    );
    policy.status.as_mut().unwrap().state = Some("Promoting".into());
    assert!(act::plan(&policy, &Change::ProveLoad, "t").is_err());
}
