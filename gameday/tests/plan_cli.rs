//! `understudy-gameday plan` as a user runs it: a real process on seed 004's policy and stage file,
//! its output, and its refusals.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const POLICY: &str = "examples/failoverpolicy-seed-004.yaml";
const STAGES: &str = "examples/stages/seed-004.json";

fn plan(args: &[&str]) -> Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    Command::new(env!("CARGO_BIN_EXE_understudy-gameday"))
        .current_dir(root)
        .arg("plan")
        .args(args)
        .output()
        .expect("run understudy-gameday")
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn json(args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    serde_json::from_str(&stdout(&plan(&args))).expect("JSON on stdout")
}

fn seed_004() -> Value {
    json(&["--policy", POLICY, "--stages", STAGES, "--gpus-per-replica", "2"])
}

fn mix<'a>(plan: &'a Value, label: &str) -> &'a Value {
    let mixes = plan["mixes"].as_array().expect("mixes");
    mixes
        .iter()
        .find(|mix| mix["mix"] == label)
        .unwrap_or_else(|| panic!("no mix {label:?} in {plan:#}"))
}

fn after_fault(mix: &Value, fraction: f64) -> f64 {
    let reached = mix["reached"].as_array().expect("reached");
    let share = reached
        .iter()
        .find(|share| share["fraction"].as_f64() == Some(fraction))
        .unwrap_or_else(|| panic!("no {fraction} share in {mix}"));
    share["after_fault_secs"].as_f64().expect("seconds")
}

/// An error run: a failing status, nothing on stdout, and one line on stderr.
fn refusal(args: &[&str]) -> String {
    let output = plan(args);
    assert!(!output.status.success(), "accepted {args:?}");
    assert!(
        output.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
    let stderr = String::from_utf8_lossy(&output.stderr).trim_end().to_owned();
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn stage_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write the stage file");
    path
}

#[test]
fn pilot_light_alone_misses_five_minutes_because_of_the_node() {
    let plan = seed_004();
    let pilot = mix(&plan, "8 × pilot light");
    assert_eq!(pilot["meets"], false);
    assert_eq!(pilot["policy"], false);
    assert_eq!(pilot["gpus_held"], 0);
    // 45 s detection (a hang), then 7 min for a node and the whole cold start.
    assert_eq!(after_fault(pilot, 0.5), 727.0);
}

#[test]
fn four_warm_and_four_pilot_light_reach_half_capacity_in_about_a_minute() {
    let plan = seed_004();
    assert_eq!(plan["detection_secs"], 45.0);
    assert_eq!(plan["fraction"], 0.5);
    assert_eq!(plan["fraction_from"], "policy");
    let own = &plan["mixes"][0];
    assert_eq!(own["policy"], true);
    assert_eq!(own["mix"], "4 × warm (level 1) + 4 × pilot light");
    assert_eq!(own["meets"], true);
    assert_eq!(own["gpus_held"], 8);
    // 45 s detection (a hang) + a 25 s wake + a 2 s first token.
    assert_eq!(after_fault(own, 0.5), 72.0);
    assert_eq!(own["recovery_secs"], 72.0);
    // The other half arrives with the pilot light, past the objective.
    assert_eq!(after_fault(own, 1.0), 727.0);
    assert!(
        plan["verdict"]
            .as_str()
            .is_some_and(|verdict| verdict.contains("1m12s after a fault") && verdict.contains("within")),
        "{}",
        plan["verdict"]
    );
}

#[test]
fn the_70b_example_meets_five_minutes_at_half_capacity_with_its_warm_half_and_misses_it_whole() {
    // What its comments say: half the capacity 1m12s after a hang, full capacity (the reserved
    // pilot light's image pull, weight load and warmup) about 5m12s after, just past the objective.
    let plan = json(&[
        "--policy",
        "examples/failoverpolicy-70b-five-minutes.yaml",
        "--gpus-per-replica",
        "2",
    ]);
    assert_eq!(plan["fraction"], 0.5);
    assert_eq!(plan["fraction_from"], "policy");
    let own = &plan["mixes"][0];
    assert_eq!(own["mix"], "4 × warm (level 1) + 4 × pilot light (GPUs reserved)");
    assert_eq!(own["meets"], true);
    assert_eq!(after_fault(own, 0.5), 72.0);
    // 45 s detection + 2m image pull + 10 s start + 70 s weights + 60 s warmup + 5 s + 2 s.
    assert_eq!(after_fault(own, 1.0), 312.0);
    assert_eq!(mix(&plan, "8 × pilot light (GPUs reserved)")["meets"], false);
}

#[test]
fn the_cheapest_mix_that_meets_it_is_four_warm_and_four_pilot_light_on_eight_gpus() {
    let plan = seed_004();
    let cheapest = &plan["cheapest"];
    assert_eq!(cheapest["mix"], "4 × warm (level 1) + 4 × pilot light");
    assert_eq!(cheapest["gpus_held"], 8);
    assert_eq!(cheapest["recovery_secs"], 72.0);
}

#[test]
fn the_text_lists_every_single_tier_mix_and_names_the_cheapest() {
    let output = plan(&["--policy", POLICY, "--stages", STAGES, "--gpus-per-replica", "2"]);
    let text = stdout(&output);
    assert!(text.contains("detection: 45s"), "{text}");
    // A row is its label between column gaps: `8 × pilot light` is not `8 × pilot light (GPUs …`.
    let row = |label: &str| {
        text.lines()
            .find(|line| line.contains(&format!("  {label}  ")))
            .unwrap_or_else(|| panic!("no row for {label:?} in:\n{text}"))
            .split_whitespace()
            .rev()
            .take(5)
            .collect::<Vec<_>>()
    };
    // The last five cells, right to left: verdict, 100%, 75%, 50%, 25%.
    assert_eq!(
        row("4 × warm (level 1) + 4 × pilot light"),
        ["meets", "12m7s", "12m7s", "1m12s", "1m12s"]
    );
    assert_eq!(row("8 × hot"), ["meets", "45s", "45s", "45s", "45s"]);
    assert_eq!(
        row("8 × warm (level 2)"),
        ["meets", "2m2s", "2m2s", "2m2s", "2m2s"]
    );
    assert_eq!(
        row("8 × pilot light (GPUs reserved)"),
        ["misses", "5m7s", "5m7s", "5m7s", "5m7s"]
    );
    assert_eq!(
        row("8 × pilot light"),
        ["misses", "12m7s", "12m7s", "12m7s", "12m7s"]
    );
    assert!(
        text.contains(
            "cheapest mix that meets the objective: 4 × warm (level 1) + 4 × pilot light, 8 GPUs held"
        ),
        "{text}"
    );
}

#[test]
fn the_stage_file_wins_over_the_estimates_stage_by_stage() {
    let stage = |plan: &Value, name: &str| {
        let stages = plan["stages"].as_array().expect("stages");
        let row = stages.iter().find(|row| row["stage"] == name).expect("stage row");
        (row["secs"].as_f64().expect("seconds"), row["from"].clone())
    };
    let measured = seed_004();
    assert_eq!(stage(&measured, "node"), (420.0, Value::from("stage_file")));
    assert_eq!(stage(&measured, "weightLoad"), (65.0, Value::from("stage_file")));
    assert_eq!(stage(&measured, "imagePull"), (120.0, Value::from("policy")));

    let estimated = json(&["--policy", POLICY]);
    assert_eq!(stage(&estimated, "node"), (360.0, Value::from("policy")));
    assert_eq!(after_fault(mix(&estimated, "8 × pilot light"), 0.5), 45.0 + 627.0);
    assert_eq!(estimated["gpus_per_replica"], 1);
    assert_eq!(estimated["cheapest"]["gpus_held"], 4);
}

#[test]
fn a_mix_that_needs_an_unknown_stage_is_shown_as_unknown_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(POLICY))
        .unwrap()
        .replace("    node: 6m\n", "");
    let policy = stage_file(dir.path(), "policy.yaml", &text);
    let plan = json(&["--policy", policy.to_str().unwrap()]);
    let pilot = mix(&plan, "8 × pilot light");
    assert_eq!(pilot["missing_stage"], "node");
    assert_eq!(pilot["meets"], Value::Null);
    // The policy's own mix needs the node too; the warm tier alone does not.
    assert_eq!(plan["mixes"][0]["missing_stage"], "node");
    assert_eq!(mix(&plan, "8 × warm (level 1)")["meets"], true);
}

#[test]
fn an_unknown_stage_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let stages = stage_file(
        dir.path(),
        "stages.json",
        r#"{"node": 420, "weight_load": "65s"}"#,
    );
    let error = refusal(&["--policy", POLICY, "--stages", stages.to_str().unwrap()]);
    assert!(error.contains("unknown stage \"weight_load\""), "{error}");
}

#[test]
fn a_garbled_or_negative_duration_is_refused_naming_the_stage() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text, expected) in [
        (
            "garbled.json",
            r#"{"weightLoad": "65 seconds"}"#,
            "weightLoad: invalid duration",
        ),
        (
            "negative.json",
            r#"{"node": -420}"#,
            "node: -420 is not a number of seconds",
        ),
        (
            "negative-go.json",
            r#"{"node": "-7m"}"#,
            "node: negative duration",
        ),
        ("not-json.json", r#"{"node": 420"#, "not JSON"),
    ] {
        let stages = stage_file(dir.path(), name, text);
        let error = refusal(&["--policy", POLICY, "--stages", stages.to_str().unwrap()]);
        assert!(error.contains(expected), "{name}: {error}");
        assert!(error.contains(name), "{name}: the error names the file: {error}");
    }
}

#[test]
fn a_missing_file_is_refused_naming_it() {
    let error = refusal(&["--policy", "examples/no-such-policy.yaml"]);
    assert!(error.contains("examples/no-such-policy.yaml"), "{error}");
    let error = refusal(&["--policy", POLICY, "--stages", "examples/stages/no-such.json"]);
    assert!(error.contains("examples/stages/no-such.json"), "{error}");
}
