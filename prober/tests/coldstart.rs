//! Cold-start timelines from recorded pod, events and `kubectl logs --timestamps` fixtures, in
//! vLLM 0.10's, 0.11's and 0.32's log formats.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use jiff::SignedDuration;
use understudy_prober::coldstart::vllm_log::StartupLog;
use understudy_prober::coldstart::{self, ColdStartInputs, ColdStartStage as S, StageDuration, Timeline};

fn fixture(dir: &str, file: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/coldstart/{dir}/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn timeline(
    dir: &str,
    container: Option<&str>,
    first_token: Option<&str>,
    edit: impl Fn(&mut String),
) -> Timeline {
    let pod = coldstart::parse_pod(&fixture(dir, "pod.json")).unwrap();
    let events = coldstart::parse_events(&fixture(dir, "events.json")).unwrap();
    let mut log = fixture(dir, "logs.txt");
    edit(&mut log);
    coldstart::build(&ColdStartInputs {
        pod: &pod,
        events: &events,
        log: &log,
        container,
        first_token: first_token.map(|t| t.parse().unwrap()),
    })
}

/// The timeline of fixture `dir` with `pod` for its pod JSON and its events of `reason` left out.
fn timeline_without_event(dir: &str, pod: &str, reason: &str) -> Timeline {
    let pod = coldstart::parse_pod(pod).unwrap();
    let events: Vec<_> = coldstart::parse_events(&fixture(dir, "events.json"))
        .unwrap()
        .into_iter()
        .filter(|e| e.reason != reason)
        .collect();
    coldstart::build(&ColdStartInputs {
        pod: &pod,
        events: &events,
        log: &fixture(dir, "logs.txt"),
        container: None,
        first_token: None,
    })
}

fn ms(millis: u64) -> Option<Duration> {
    Some(Duration::from_millis(millis))
}

#[test]
fn a_newer_vllm_start_behind_karpenter_and_a_fresh_pull_has_every_stage_timed() {
    let t = timeline("newer", None, Some("2025-10-06T12:04:39.880437801Z"), |_| {});
    assert_eq!(t.container.as_deref(), Some("vllm"));
    assert_eq!(
        t.duration(S::Node),
        ms(92_250),
        "created 12:00:00 → Scheduled event 12:01:32.25"
    );
    assert_eq!(
        t.duration(S::Image),
        ms(86_512),
        "the kubelet's in-message 1m26.512s, not the event gap"
    );
    assert_eq!(
        t.duration(S::ContainerStart),
        ms(1_000),
        "Pulled 12:03:02 → startedAt 12:03:03"
    );
    assert_eq!(
        t.duration(S::EngineStart),
        Some(Duration::from_nanos(18_020_437_801)),
        "startedAt 12:03:03 → Starting to load model 12:03:21.020437801"
    );
    assert_eq!(
        t.stage(S::EngineStart).detail,
        [
            "API server at +7.2 s",
            "config resolved at +13.9 s",
            "engine core at +15.6 s"
        ],
        "0.11 on one GPU: the engine core loads the model, no worker process"
    );
    assert_eq!(
        t.duration(S::WeightLoad),
        ms(29_500),
        "log prefixes 12:03:21.02 → 12:03:50.52"
    );
    assert_eq!(t.duration(S::Warmup), ms(45_610), "→ init engine at 12:04:36.13");
    assert_eq!(
        t.duration(S::Ready),
        ms(1_500),
        "→ Application startup complete at 12:04:37.63"
    );
    assert_eq!(t.duration(S::FirstToken), ms(2_250));
    assert_eq!(
        t.to_first_token.known(),
        Some(Duration::from_nanos(279_880_437_801))
    );
    let node = &t.stage(S::Node).detail;
    assert!(
        node.iter()
            .any(|d| d == "karpenter: Pod should schedule on: nodeclaim/gpu-pool-x7k2p"),
        "{node:?}"
    );
    assert!(
        node.iter().any(|d| d == "assigned to ip-10-0-12-34.ec2.internal"),
        "{node:?}"
    );
    assert!(
        node.iter().any(|d| d == "1 FailedScheduling event(s)"),
        "{node:?}"
    );
    let warmup = &t.stage(S::Warmup).detail;
    assert!(
        warmup.iter().any(|d| d == "torch.compile 27.87 s (cold compile)"),
        "{warmup:?}"
    );
    assert!(warmup.iter().any(|d| d == "CUDA graphs 9 s"), "{warmup:?}");
    assert!(warmup.iter().any(|d| d == "engine init 45.61 s"), "{warmup:?}");
}

#[test]
fn an_older_vllm_start_behind_cluster_autoscaler_with_a_cached_image_and_no_probe_yet() {
    let t = timeline("older", Some("vllm"), None, |_| {});
    assert_eq!(
        t.duration(S::Node),
        ms(160_000),
        "created 09:05:00 → Scheduled 09:07:40"
    );
    assert_eq!(
        t.duration(S::Image),
        Some(Duration::ZERO),
        "already present on machine"
    );
    assert_eq!(
        t.stage(S::Image).detail,
        vec!["already present on machine".to_string()]
    );
    assert_eq!(
        t.duration(S::ContainerStart),
        ms(1_000),
        "Pulled 09:07:43 → startedAt 09:07:44"
    );
    assert_eq!(
        t.duration(S::EngineStart),
        ms(17_500),
        "startedAt 09:07:44 → Starting to load model 09:08:01.5"
    );
    assert_eq!(
        t.duration(S::WeightLoad),
        Some(Duration::from_nanos(12_503_120_000))
    );
    assert_eq!(t.duration(S::Warmup), ms(40_020));
    assert_eq!(t.duration(S::Ready), Some(Duration::from_nanos(1_076_880_000)));
    assert_eq!(
        t.stage(S::FirstToken).duration,
        StageDuration::Unknown {
            missing: "a successful generating probe"
        }
    );
    assert!(matches!(t.to_first_token, StageDuration::Unknown { .. }));
    let node = &t.stage(S::Node).detail;
    assert!(
        node.iter()
            .any(|d| d == "cluster-autoscaler: pod triggered scale-up: [{eks-gpu-ng-a100 1->2 (max: 4)}]"),
        "{node:?}"
    );
    let warmup = &t.stage(S::Warmup).detail;
    assert!(
        warmup
            .iter()
            .any(|d| d == "torch.compile 9.22 s (compile cache hit)"),
        "{warmup:?}"
    );
}

#[test]
fn the_sidecars_pull_does_not_time_the_serving_container() {
    // The fence sidecar's image was pulled fresh; the vLLM image was cached.
    let t = timeline("older", Some("vllm"), None, |_| {});
    assert_eq!(t.duration(S::Image), Some(Duration::ZERO));
    let fence = timeline("older", Some("fence"), None, |_| {});
    assert_eq!(fence.duration(S::Image), ms(1_204));
}

#[test]
fn a_missing_pulled_event_leaves_image_and_container_start_unknown_not_guessed() {
    let pod = fixture("newer", "pod.json");
    let t = timeline_without_event("newer", &pod, "Pulled");
    assert_eq!(
        t.stage(S::Image).duration,
        StageDuration::Unknown {
            missing: "a Pulled event"
        }
    );
    assert_eq!(
        t.stage(S::ContainerStart).duration,
        StageDuration::Unknown {
            missing: "a Pulled event"
        }
    );
    assert_eq!(
        t.duration(S::WeightLoad),
        ms(29_500),
        "the other stages are unaffected"
    );
}

#[test]
fn after_restarts_the_container_start_runs_from_the_current_runs_pull() {
    // Fresh pull 12:03:02 for the first run; the two restarts found the image present, one folded
    // event last seen 12:09:38; the current run started 12:09:40.
    let t = timeline("restarted", None, None, |_| {});
    assert_eq!(
        t.duration(S::ContainerStart),
        ms(2_000),
        "the latest pull before startedAt, not the first run's"
    );
    assert!(
        t.stage(S::ContainerStart)
            .detail
            .iter()
            .any(|d| d.contains("2 restart(s)"))
    );
}

#[test]
fn after_restarts_without_the_current_runs_pull_the_container_start_is_unknown() {
    let pod = coldstart::parse_pod(&fixture("restarted", "pod.json")).unwrap();
    let events: Vec<_> = coldstart::parse_events(&fixture("restarted", "events.json"))
        .unwrap()
        .into_iter()
        .filter(|e| !e.message.contains("already present"))
        .collect();
    let log = fixture("restarted", "logs.txt");
    let t = coldstart::build(&ColdStartInputs {
        pod: &pod,
        events: &events,
        log: &log,
        container: None,
        first_token: None,
    });
    assert!(
        matches!(
            t.stage(S::ContainerStart).duration,
            StageDuration::Unknown { missing } if missing.contains("current run")
        ),
        "{:?}",
        t.stage(S::ContainerStart)
    );
}

#[test]
fn without_kubectl_timestamps_vllms_own_seconds_are_used_and_ready_is_unknown() {
    let t = timeline("older", Some("vllm"), None, |log| {
        *log = log
            .lines()
            .map(|l| l.split_once(' ').unwrap().1)
            .collect::<Vec<_>>()
            .join("\n");
    });
    assert_eq!(
        t.duration(S::WeightLoad),
        Some(Duration::from_nanos(12_503_120_000)),
        "Model loading took … 12.503120 s"
    );
    assert_eq!(
        t.duration(S::Warmup),
        ms(40_020),
        "init engine … took 40.02 seconds"
    );
    assert!(
        matches!(t.stage(S::Ready).duration, StageDuration::Unknown { .. }),
        "no timestamp to start ready from: {:?}",
        t.stage(S::Ready).duration
    );
}

#[test]
fn with_no_log_the_vllm_stages_are_unknown_and_the_pod_stages_still_timed() {
    let t = timeline("newer", None, None, |log| log.clear());
    for stage in [S::EngineStart, S::WeightLoad, S::Warmup, S::Ready, S::FirstToken] {
        assert!(
            matches!(t.stage(stage).duration, StageDuration::Unknown { .. }),
            "{stage}"
        );
    }
    assert_eq!(t.duration(S::Node), ms(92_250));
}

#[test]
fn the_table_prints_every_stage_with_unknown_named() {
    let table = coldstart::render_table(&timeline("older", Some("vllm"), None, |_| {}));
    for stage in S::ALL {
        assert!(table.contains(stage.as_str()), "{stage} missing from\n{table}");
    }
    assert!(table.contains("missing a successful generating probe"), "{table}");
    assert!(table.contains("2m40s"), "node took 2m40s:\n{table}");
}

#[test]
fn the_json_document_names_unknown_stages_and_gives_seconds_for_known_ones() {
    let t = timeline("older", Some("vllm"), None, |_| {});
    let json = serde_json::to_value(&t).unwrap();
    assert_eq!(json["stages"][0]["stage"], "node");
    assert_eq!(json["stages"][0]["duration"]["seconds"], 160.0);
    assert_eq!(json["stages"][3]["stage"], "engine-start");
    assert_eq!(
        json["stages"][7]["duration"]["unknown"],
        "a successful generating probe"
    );
}

/// vLLM 0.32.0 on CPU, a real log; the pod and events are written for the process's start (the
/// fixture's README).
const V0_32: &str = "vllm-0.32-cpu";

#[test]
fn a_vllm_0_32_start_on_cpu_has_every_stage_to_ready_timed_and_they_leave_no_time_out() {
    let t = timeline(V0_32, None, None, |_| {});
    let to_ready: Vec<_> = t.stages.iter().take_while(|s| s.stage != S::FirstToken).collect();
    assert_eq!(to_ready.len(), 7, "node to ready");
    for s in &to_ready {
        assert!(
            s.duration.known().is_some() && s.started.is_some() && s.finished.is_some(),
            "{} not timed:\n{}",
            s.stage,
            coldstart::render_table(&t)
        );
    }
    // From the pod's creation to its readiness, each stage starts where the one before ended.
    let pod = coldstart::parse_pod(&fixture(V0_32, "pod.json")).unwrap();
    let near = |a: Option<jiff::Timestamp>, b: Option<jiff::Timestamp>| {
        b.unwrap().duration_since(a.unwrap()).abs() <= SignedDuration::from_secs(2)
    };
    assert!(near(t.created, to_ready[0].started), "node starts at creation");
    for pair in to_ready.windows(2) {
        assert!(
            near(pair[0].finished, pair[1].started),
            "a gap between {} (ends {:?}) and {} (starts {:?})",
            pair[0].stage,
            pair[0].finished,
            pair[1].stage,
            pair[1].started
        );
    }
    assert!(
        near(to_ready[6].finished, pod.condition_true_at("Ready")),
        "ready ends at the pod's Ready"
    );
    let summed: Duration = to_ready.iter().filter_map(|s| s.duration.known()).sum();
    let created_to_ready = pod
        .condition_true_at("Ready")
        .unwrap()
        .duration_since(t.created.unwrap());
    assert!(
        (SignedDuration::try_from(summed).unwrap() - created_to_ready).abs() <= SignedDuration::from_secs(2),
        "the stages add up to creation → Ready: {summed:?} against {created_to_ready:?}"
    );
}

#[test]
fn a_vllm_0_32_start_on_cpu_spends_most_of_its_time_starting_the_engine() {
    let t = timeline(V0_32, None, None, |_| {});
    let biggest = S::ALL
        .into_iter()
        .max_by_key(|&stage| t.duration(stage).unwrap_or_default())
        .unwrap();
    assert_eq!(biggest, S::EngineStart, "{}", coldstart::render_table(&t));
    assert_eq!(
        t.stage(S::EngineStart).detail,
        [
            "API server at +6.3 s",
            "config resolved at +6.3 s",
            "engine core at +12.3 s",
            "worker at +19.1 s"
        ],
        "the banner, `Resolved architecture`, `Initializing a V1 LLM engine`, the `VllmWorker-0` line"
    );
    // On CPU no `Model loading took` is printed: `Loading weights took 0.00 seconds` ends the load.
    assert!(
        t.duration(S::WeightLoad)
            .is_some_and(|d| d < Duration::from_secs(1)),
        "{:?}",
        t.stage(S::WeightLoad)
    );
    let warmup = &t.stage(S::Warmup).detail;
    assert!(warmup.iter().any(|d| d == "engine init 0.75 s"), "{warmup:?}");
    let log = StartupLog::parse(&fixture(V0_32, "logs.txt"));
    assert_eq!(log.version.as_deref(), Some("0.32.0"), "from the banner");
}

#[test]
fn engine_start_is_unknown_naming_its_missing_end() {
    let no_log = timeline(V0_32, None, None, |log| log.clear());
    assert_eq!(
        no_log.stage(S::EngineStart).duration,
        StageDuration::Unknown {
            missing: "a timestamped `Starting to load model` line"
        }
    );
    let pod = fixture(V0_32, "pod.json").replace(
        r#""state": { "running": { "startedAt": "2026-12-03T13:05:56.296288273Z" } },"#,
        r#""state": {},"#,
    );
    let t = timeline_without_event(V0_32, &pod, "Started");
    assert_eq!(
        t.stage(S::EngineStart).duration,
        StageDuration::Unknown {
            missing: "the container's running.startedAt or a Started event"
        }
    );
    assert!(
        t.duration(S::WeightLoad).is_some(),
        "the log's own stages are unaffected"
    );
}
