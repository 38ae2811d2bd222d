//! `understudy-gameday simulate` as a user runs it: a real process, a schedule file, its output.

use std::path::Path;
use std::process::{Command, Output};

fn simulate(args: &[&str]) -> Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let output = Command::new(env!("CARGO_BIN_EXE_understudy-gameday"))
        .current_dir(root)
        .arg("simulate")
        .args(args)
        .output();
    match output {
        Ok(output) => output,
        Err(error) => panic!("cannot run understudy-gameday: {error}"),
    }
}

fn json_of(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    match serde_json::from_slice(&output.stdout) {
        Ok(value) => value,
        Err(error) => panic!("not JSON ({error}): {}", String::from_utf8_lossy(&output.stdout)),
    }
}

#[test]
fn json_output_carries_the_documented_keys_at_the_top_level() {
    let report = json_of(&simulate(&["examples/schedules/seed-002.yaml", "--json"]));
    let counts: Vec<u64> = [
        "failovers",
        "false_failovers",
        "failbacks",
        "transition_rounds",
        "dropped",
        "silent_lost",
    ]
    .iter()
    .map(|key| {
        report[key]
            .as_u64()
            .unwrap_or_else(|| panic!("missing {key} in {report}"))
    })
    .collect();
    assert_eq!(counts, [2, 0, 2, 4, 13, 20]);
}

#[test]
fn generating_schedule_loses_at_most_promote_after_rounds_silently() {
    let report = json_of(&simulate(&[
        "examples/schedules/seed-002-generating.yaml",
        "--json",
    ]));
    assert_eq!(report["silent_lost"], 3);
    assert_eq!(report["without_failover"]["silent_lost"], 21);
}

#[test]
fn sweep_prints_the_seed_table() {
    let output = simulate(&["examples/schedules/seed-002.yaml", "--sweep", "1..=4"]);
    assert!(output.status.success());
    let text = String::from_utf8_lossy(&output.stdout);
    for row in [
        "            1 |         4 |               2 |         4 |                 8 |      12 |          20",
        "            4 |         2 |               0 |         2 |                 4 |      15 |          20",
    ] {
        assert!(text.contains(row), "missing row {row:?} in:\n{text}");
    }
}

#[test]
fn a_bad_schedule_is_refused_with_the_reason_and_a_failing_status() {
    let dir = std::env::temp_dir().join(format!("understudy-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let path = dir.join("overlap.yaml");
    let schedule = "rounds: 50\nreplica_a:\n  stopped: [[10, 20]]\n  half_failed: [[15, 30]]\n\
                    policy:\n  promote_after: 2\n  failback: {mode: manual}\n";
    std::fs::write(&path, schedule).unwrap_or_else(|e| panic!("{e}"));
    let output = simulate(&[path.to_str().unwrap_or_default()]);
    std::fs::remove_dir_all(&dir).ok();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("replica_a.stopped [10, 20] overlaps replica_a.half_failed [15, 30]"),
        "{stderr}"
    );
}

#[test]
fn a_failover_policy_manifest_supplies_the_rules() {
    let report = json_of(&simulate(&[
        "examples/schedules/seed-002.yaml",
        "--policy",
        "examples/failoverpolicy-70b-five-minutes.yaml",
        "--json",
    ]));
    // Its hard-failure threshold (2) catches the first stop at round 31; half an hour of health
    // before failback is longer than the whole schedule, so B keeps serving.
    assert_eq!(
        (report["failovers"].as_u64(), report["failbacks"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(report["transitions"][0]["decided"], 31);
    let description = report["schedule"].as_str().unwrap_or_default();
    assert!(description.contains("130 rounds of 10s"), "{description}");
}

#[test]
fn an_invalid_failover_policy_is_refused_with_its_field() {
    let output = simulate(&[
        "examples/schedules/seed-002.yaml",
        "--policy",
        "examples/invalid/timeout-not-shorter-than-interval.yaml",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("spec.probe.timeout"), "{stderr}");
}

/// The minimal example with `spec_tail` appended (it ends in spec's fields, so what is appended
/// is in spec), written into `dir`.
fn policy_file(dir: &tempfile::TempDir, spec_tail: &str) -> String {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/failoverpolicy-minimal.yaml");
    let minimal =
        std::fs::read_to_string(&example).unwrap_or_else(|error| panic!("{}: {error}", example.display()));
    let path = dir.path().join("policy.yaml");
    if let Err(error) = std::fs::write(&path, format!("{minimal}{spec_tail}")) {
        panic!("{}: {error}", path.display());
    }
    path.to_string_lossy().into_owned()
}

#[test]
fn an_unknown_or_misplaced_field_is_refused_as_the_api_server_refuses_it() {
    let Ok(dir) = tempfile::tempdir() else {
        panic!("no temporary directory")
    };
    for (tail, expected) in [
        (
            "  probe:\n    intervall: 3s\n",
            "unknown field \"spec.probe.intervall\"",
        ),
        ("  minDwell: 10m\n", "unknown field \"spec.minDwell\""),
    ] {
        let output = simulate(&[
            "examples/schedules/seed-002.yaml",
            "--policy",
            &policy_file(&dir, tail),
        ]);
        assert_eq!(output.status.code(), Some(1), "{tail}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{stderr}");
    }
}

#[test]
fn a_duration_too_long_for_go_is_an_error_not_a_panic() {
    let Ok(dir) = tempfile::tempdir() else {
        panic!("no temporary directory")
    };
    let output = simulate(&[
        "examples/schedules/seed-002.yaml",
        "--policy",
        &policy_file(&dir, "  probe:\n    interval: 2562047788015215h\n"),
    ]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("spec.probe.interval") && stderr.contains("too large"),
        "{stderr}"
    );
}
