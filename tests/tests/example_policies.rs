//! Every FailoverPolicy shipped in `examples/` run through the real state machine on seed 002's
//! failure schedule: what a user gets from applying one of them, before they apply it.

use std::path::{Path, PathBuf};

use understudy_gameday::simulate::{Rules, Schedule, simulate_with};
use understudy_operator::crd::FailoverPolicy;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn example_policies() -> Vec<(PathBuf, FailoverPolicy)> {
    let dir = root().join("examples");
    let mut policies: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .map(|path| {
            let policy: FailoverPolicy =
                serde_yaml::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, policy)
        })
        .collect();
    policies.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        policies.len() >= 2,
        "expected the example policies in {}",
        dir.display()
    );
    policies
}

#[test]
fn example_policies_ride_out_seed_002_without_false_failovers_or_silent_loss() {
    let schedule = Schedule::from_yaml(&read(&root().join("examples/schedules/seed-002.yaml")))
        .unwrap_or_else(|e| panic!("{e}"));
    for (path, policy) in example_policies() {
        let rules = Rules::from_failover_policy(&policy.spec, 1)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let outcome = simulate_with(&schedule, &rules);
        let name = path.display();
        assert_eq!(outcome.false_failovers, 0, "{name}: failed over on a brief pause");
        assert!(
            outcome.failovers >= 1,
            "{name}: never failed over a 46-round stop"
        );
        // Generating probes see the half-failed replica whenever it is primary, so at most one
        // promote_after's worth of rounds is silently lost.
        assert!(
            outcome.silent_lost <= rules.config.promote_after,
            "{name}: {outcome:?}"
        );
        // Without failover A drops 56 rounds; any example policy must do far better.
        assert!(outcome.dropped <= 20, "{name}: dropped {}", outcome.dropped);
    }
}
