use proptest::prelude::*;

use super::seed_model::{self, SeedParams};
use super::*;

fn simulate(schedule: &Schedule) -> Outcome {
    match super::simulate(schedule) {
        Ok(outcome) => outcome,
        Err(error) => panic!("{error}"),
    }
}

/// Seed 002's schedule, with a policy filled in.
fn seed_schedule(promote_after: u32, failback: &str, check: &str) -> Schedule {
    let text = format!(
        "rounds: 130
replica_a:
  unresponsive: [[12,12],[20,21]]
  stopped: [[30,75],[90,96]]
  half_failed: [[100,120]]
policy:
  promote_after: {promote_after}
  promotion_rounds: 1
  failback: {failback}
  check: {check}
"
    );
    match Schedule::from_yaml(&text) {
        Ok(schedule) => schedule,
        Err(error) => panic!("seed schedule refused: {error}"),
    }
}

const AUTOMATIC: &str = "{mode: automatic, healthy_rounds: 3}";
const MANUAL: &str = "{mode: manual}";

/// (failovers, false failovers, failbacks, transition rounds, dropped, silent lost)
fn row(outcome: &Outcome) -> (u32, u32, u32, u32, u32, u32) {
    (
        outcome.failovers,
        outcome.false_failovers,
        outcome.failbacks,
        outcome.transition_rounds,
        outcome.dropped,
        outcome.silent_lost,
    )
}

#[test]
fn reproduces_seed_002_threshold_table() {
    // threshold | failovers | false failovers | failbacks | transition round | dropped | silent lost update
    let seed_table = [
        (1, (4, 2, 4, 8, 12, 20)),
        (2, (3, 1, 3, 6, 13, 20)),
        (3, (2, 0, 2, 4, 13, 20)),
        (4, (2, 0, 2, 4, 15, 20)),
    ];
    for (threshold, expected) in seed_table {
        let outcome = simulate(&seed_schedule(threshold, AUTOMATIC, "shallow"));
        assert_eq!(row(&outcome), expected, "threshold {threshold}");
    }
}

#[test]
fn reproduces_seed_002_failback_table() {
    // failback | failovers | failbacks | transition round | dropped | active replica changes
    let automatic = simulate(&seed_schedule(3, AUTOMATIC, "shallow"));
    assert_eq!(
        (
            automatic.failovers,
            automatic.failbacks,
            automatic.transition_rounds,
            automatic.dropped
        ),
        (2, 2, 4, 13)
    );
    assert_eq!(automatic.transitions.len(), 4, "active replica changes");
    let manual = simulate(&seed_schedule(3, MANUAL, "shallow"));
    assert_eq!(
        (
            manual.failovers,
            manual.failbacks,
            manual.transition_rounds,
            manual.dropped
        ),
        (1, 0, 1, 7)
    );
    assert_eq!(manual.transitions.len(), 1, "active replica changes");
}

#[test]
fn reproduces_seed_002_no_failover_baseline() {
    let baseline = without_failover(&seed_schedule(3, MANUAL, "shallow"));
    assert_eq!(
        (baseline.served, baseline.dropped, baseline.silent_lost),
        (53, 56, 21)
    );
}

#[test]
fn agrees_with_the_seed_model_for_every_threshold_and_failback_mode() {
    for threshold in 1..=4 {
        for (failback, automatic) in [(AUTOMATIC, true), (MANUAL, false)] {
            let schedule = seed_schedule(threshold, failback, "shallow");
            let params = SeedParams {
                rounds: 130,
                threshold,
                automatic_failback: automatic,
                promotion: 1,
                failback_threshold: 3,
            };
            assert_seed_agrees(&schedule, &params);
        }
    }
}

#[test]
fn generating_check_catches_the_half_failed_replica() {
    for threshold in 1..=4 {
        for failback in [AUTOMATIC, MANUAL] {
            let shallow = simulate(&seed_schedule(threshold, failback, "shallow"));
            let generating = simulate(&seed_schedule(threshold, failback, "generating"));
            // Under automatic failback A is primary when it goes half-failed; one episode.
            if failback == AUTOMATIC {
                assert_eq!(
                    shallow.silent_lost, 20,
                    "threshold {threshold}: the shallow check never notices"
                );
                assert_eq!(
                    generating.silent_lost, threshold,
                    "threshold {threshold}: caught after {threshold} checks"
                );
                assert!(
                    generating.failovers > shallow.failovers,
                    "the half-failed replica is failed over"
                );
            } else {
                // Under manual failback B stays primary after the first stop, A's half-failure is moot.
                assert_eq!(generating.silent_lost, 0);
            }
        }
    }
}

fn assert_seed_agrees(schedule: &Schedule, params: &SeedParams) {
    let ours = simulate(schedule);
    let seed = seed_model::run(&schedule.replica_a, params);
    assert_eq!(
        (
            ours.failovers,
            ours.false_failovers,
            ours.failbacks,
            ours.transition_rounds,
            ours.dropped,
            ours.silent_lost
        ),
        (
            seed.failovers,
            seed.false_failovers,
            seed.failbacks,
            seed.window,
            seed.dropped,
            seed.silent
        ),
        "schedule {schedule:?}"
    );
}

/// Disjoint fault intervals within `rounds`, each tagged with its kind.
fn faults(rounds: u32) -> impl Strategy<Value = Faults> {
    prop::collection::vec((0u8..3, 1u32..=rounds, 0u32..12), 0..8).prop_map(move |raw| {
        let mut faults = Faults::default();
        let mut taken: Vec<[u32; 2]> = Vec::new();
        for (kind, first, length) in raw {
            let last = (first + length).min(rounds);
            if taken.iter().any(|&[a, b]| first <= b && a <= last) {
                continue;
            }
            taken.push([first, last]);
            match kind {
                0 => faults.unresponsive.push([first, last]),
                1 => faults.stopped.push([first, last]),
                _ => faults.half_failed.push([first, last]),
            }
        }
        faults
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Over random schedules and policies, the real state machine and the seed's model agree
    /// on every count, so the seed's code and ours define the same thing.
    #[test]
    fn agrees_with_the_seed_model_on_random_schedules(
        (rounds, replica_a) in (1u32..120).prop_flat_map(|rounds| (Just(rounds), faults(rounds))),
        threshold in 1u32..6,
        automatic in any::<bool>(),
        promotion in 1u32..4,
        failback_threshold in 1u32..5,
    ) {
        let schedule = Schedule {
            rounds,
            replica_a,
            policy: Some(SimPolicy {
                promote_after: threshold,
                suspect_after: 1,
                hard_promote_after: None,
                standby_ready_after: 1,
                promotion_rounds: promotion,
                min_dwell_rounds: 0,
                failback: if automatic {
                    SimFailback::Automatic { healthy_rounds: failback_threshold }
                } else {
                    SimFailback::Manual
                },
                check: CheckKind::Shallow,
            }),
        };
        prop_assert!(schedule.check().is_ok());
        let params = SeedParams { rounds, threshold, automatic_failback: automatic, promotion, failback_threshold };
        assert_seed_agrees(&schedule, &params);
    }

    /// With a generating check, no half-failed episode loses more than `promote_after` rounds.
    #[test]
    fn generating_check_bounds_silent_loss_per_episode(
        threshold in 1u32..6,
        first in 1u32..60,
        length in 0u32..40,
    ) {
        let last = first + length;
        let schedule = Schedule {
            rounds: 120,
            replica_a: Faults { half_failed: vec![[first, last]], ..Faults::default() },
            policy: Some(SimPolicy {
                promote_after: threshold,
                suspect_after: 1,
                hard_promote_after: None,
                standby_ready_after: 1,
                promotion_rounds: 1,
                min_dwell_rounds: 0,
                failback: SimFailback::Automatic { healthy_rounds: 3 },
                check: CheckKind::Generating,
            }),
        };
        let outcome = simulate(&schedule);
        prop_assert!(outcome.silent_lost <= threshold, "{outcome:?}");
    }
}
