//! Standby-first rollouts (`spec.rollout: standbyFirst`), decided: a change to the primary's
//! serving template (image, model, flags, `VLLM_*` environment) is held until the standby runs the
//! same template and has passed on it; then the primary rolls.
//!
//! [`decide`] is pure, and written once: the operator feeds it what it reads of the pools'
//! workloads in Kubernetes, and the local game day what it runs as processes. A change is pending
//! when the workload has not rolled it out, and it is a serving change when some replica runs
//! other serving keys than the template: keys, not whole templates, so that a webhook that adds a
//! sidecar changes nothing here.

use std::collections::BTreeSet;
use std::time::Duration;

use understudy_core::failover::PoolHealth;
use understudy_core::fingerprint::Fingerprint;

use crate::crd::{ParityDrift, RolloutPhase, RolloutRecord, drift_line, drift_of};
use crate::time::{rfc3339, since_epoch};

/// One pool's workload as a rollout sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolView {
    pub name: String,
    /// Its template's serving keys (`flag.*`, `env.*`, `runtime.image`); `None` when it serves
    /// no model with vLLM.
    pub template: Option<Fingerprint>,
    /// The serving keys its pods run, each set once.
    pub running: Vec<Fingerprint>,
    /// Its controller has seen its spec and every replica runs its template.
    pub rolled_out: bool,
    /// Its replicas that can be probed (`host:port`).
    pub replicas: Vec<String>,
    /// Its rollout is held now (a Deployment paused, a StatefulSet's partition above 0).
    pub held: bool,
}

impl PoolView {
    /// Some pod runs other serving keys than its template names.
    fn serving_change(&self, target: &Fingerprint) -> bool {
        self.running.iter().any(|running| running != target)
    }

    /// Every pod runs its template, and some pod runs.
    fn runs(&self, target: &Fingerprint) -> bool {
        self.rolled_out && !self.running.is_empty() && !self.serving_change(target)
    }
}

/// The standby's last load proof, as a rollout reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LastProof {
    /// When it started.
    pub at: Duration,
    pub proven: bool,
    /// It failed its thresholds (not: it did not run).
    pub failed: bool,
}

/// Everything [`decide`] reads.
#[derive(Clone, Debug)]
pub struct Standing<'a> {
    pub primary: &'a PoolView,
    pub standby: &'a PoolView,
    /// The standby's checks, as the state machine counts them.
    pub standby_health: PoolHealth,
    /// The standby's replicas that have passed a generating probe and still run.
    pub passed: &'a BTreeSet<String>,
    /// Passing checks in a row the standby needs on the new template
    /// (`spec.trigger.standbyReadyAfter`).
    pub ready_after: u32,
    /// Failed checks in a row that stop the rollout: as many as would fail the primary over
    /// (`spec.trigger.promoteAfter`).
    pub stop_after: u32,
    /// The keys the pools may differ in (`spec.parity.allowDrift`).
    pub allowed: &'a [String],
    /// `None` without `spec.loadProof`; else the standby's last proof, if any.
    pub load_proof: Option<Option<LastProof>>,
    pub now: Duration,
}

/// What [`decide`] makes of a [`Standing`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub record: RolloutRecord,
    /// Whether the primary's workload is to be held now.
    pub hold: bool,
    /// The rollout came to another phase or target: worth an Event.
    pub moved: bool,
    /// A load proof of the standby on the new template is awaited, and none has started since
    /// the standby has run it (this time).
    pub proof_wanted_since: Option<Duration>,
}

/// Where a rollout goes from `previous` (the record status holds) given `now`.
#[must_use]
pub fn decide(now: &Standing<'_>, previous: Option<&RolloutRecord>) -> Decision {
    let primary = now.primary;
    // A record of the other pool (from before a promotion) says nothing of this one.
    let previous = previous.filter(|r| r.pool == primary.name);
    let Some(target) = &primary.template else {
        return settle(
            now,
            previous,
            Step::hold(RolloutPhase::UpToDate, String::new(), String::new())
                .saying("the primary's template runs no vLLM that names a model: nothing to hold it for"),
        );
    };
    let digest = short(target);
    let change = primary
        .running
        .iter()
        .find(|running| *running != target)
        .map(|running| change_line(running, target))
        .unwrap_or_default();
    let same_target = previous.filter(|r| r.target == digest);
    // A roll under way goes on until the workload's controller says it is done: its last pods may
    // all run the target while it still counts old ones.
    let rolling = same_target.is_some_and(|r| r.phase == RolloutPhase::Rolling)
        && (!primary.rolled_out || primary.serving_change(target));
    let step = if rolling {
        let on_it = primary.running.iter().filter(|r| *r == target).count();
        let waiting = if on_it == primary.running.len() {
            "; its controller has not yet said it rolled out"
        } else {
            ""
        };
        // The change it rolls, as the record said it while pods still ran the old template.
        let change = match (change.is_empty(), same_target) {
            (true, Some(record)) => record.change.clone(),
            _ => change,
        };
        let mut step = Step::hold(RolloutPhase::Rolling, digest, change).saying(&format!(
            "the primary rolls to it ({on_it} of {} serving templates its pods run are it){waiting}",
            primary.running.len()
        ));
        step.hold = false;
        step
    } else if !primary.serving_change(target) {
        if primary.rolled_out || primary.running.is_empty() {
            Step::hold(RolloutPhase::UpToDate, digest, String::new()).saying(&format!(
                "the primary runs its serving template {}",
                short(target)
            ))
        } else {
            // Labels, resources, a sidecar: nothing the standby could be proven on.
            let mut step = Step::hold(RolloutPhase::UpToDate, digest, String::new())
                .saying("the primary rolls a change that leaves its serving template as it is");
            step.hold = false;
            step
        }
    } else if same_target.is_some_and(|r| r.phase == RolloutPhase::Stopped) {
        let stopped = same_target.map(|r| r.message.clone()).unwrap_or_default();
        Step::hold(RolloutPhase::Stopped, digest, change).saying(&stopped)
    } else {
        standby_first(now, same_target, target, digest, change)
    };
    settle(now, previous, step)
}

/// A serving change held on the primary: where the standby stands on it.
fn standby_first(
    now: &Standing<'_>,
    same_target: Option<&RolloutRecord>,
    target: &Fingerprint,
    digest: String,
    change: String,
) -> Step {
    let standby = now.standby;
    let holding =
        |why: String| Step::hold(RolloutPhase::Holding, digest.clone(), change.clone()).saying(&why);
    let Some(standby_template) = &standby.template else {
        return holding(format!(
            "held until the standby runs it: the template of standby {} runs no vLLM that names a model",
            standby.name
        ));
    };
    let differs = differences(target, standby_template, now.allowed);
    if !differs.is_empty() {
        return holding(format!(
            "held until standby {} is set to the same serving template; it differs in {}",
            standby.name,
            drift_line(&differs)
        ));
    }
    if !standby.runs(standby_template) {
        return holding(format!("held while standby {} rolls to it", standby.name));
    }
    if standby.replicas.is_empty() {
        return holding(format!(
            "held: standby {} runs no replica it could be proven on",
            standby.name
        ));
    }
    let on_it_since = same_target
        .and_then(|r| r.standby_on_it_since.as_deref())
        .and_then(since_epoch)
        .unwrap_or(now.now);
    let health = now.standby_health;
    // Passes in a row start again from nothing after a failure.
    let passes_before = same_target
        .filter(|r| r.standby_on_it_since.is_some() && health.passes >= r.standby_passes_before)
        .map_or(health.passes, |r| r.standby_passes_before);
    // Failures in a row likewise, after a pass: only those since it has run the target count.
    let failures_before = same_target
        .filter(|r| r.standby_on_it_since.is_some() && health.failures >= r.standby_failures_before)
        .map_or(health.failures, |r| r.standby_failures_before);
    let failed_on_it = health.failures.saturating_sub(failures_before);
    let proving = |why: String| {
        let mut step = Step::hold(RolloutPhase::Proving, digest.clone(), change.clone()).saying(&why);
        step.on_it_since = Some(on_it_since);
        step.passes_before = passes_before;
        step.failures_before = failures_before;
        step
    };
    let proof_since = now
        .load_proof
        .map(|last| last.filter(|proof| proof.at >= on_it_since));
    if failed_on_it >= now.stop_after {
        let mut step = proving(format!(
            "stopped: standby {} failed {failed_on_it} checks in a row on it; the primary is untouched",
            standby.name
        ));
        step.phase = RolloutPhase::Stopped;
        return step;
    }
    if let Some(Some(proof)) = proof_since
        && proof.failed
    {
        let mut step = proving(format!(
            "stopped: standby {} failed its load proof on it; the primary is untouched",
            standby.name
        ));
        step.phase = RolloutPhase::Stopped;
        return step;
    }
    let unproven: Vec<&str> = standby
        .replicas
        .iter()
        .filter(|replica| !now.passed.contains(*replica))
        .map(String::as_str)
        .collect();
    if !unproven.is_empty() {
        return proving(format!(
            "standby {} runs it; waiting for {} to pass a generating probe",
            standby.name,
            unproven.join(", ")
        ));
    }
    let passed_on_it = health.passes.saturating_sub(passes_before);
    if health.failures > 0 || passed_on_it < now.ready_after {
        return proving(format!(
            "standby {} runs it; {passed_on_it} of {} checks in a row passed on it",
            standby.name, now.ready_after
        ));
    }
    if let Some(proof) = proof_since
        && !proof.is_some_and(|p| p.proven)
    {
        let mut step = proving(format!(
            "standby {} passed its checks on it; waiting for a load proof on it",
            standby.name
        ));
        step.proof_wanted = proof.is_none();
        return step;
    }
    let mut step = Step::hold(RolloutPhase::Rolling, digest, change).saying(&format!(
        "standby {} passed on it: the primary rolls",
        standby.name
    ));
    step.hold = false;
    step
}

/// One decision before it is dated against the previous record.
struct Step {
    phase: RolloutPhase,
    target: String,
    change: String,
    message: String,
    hold: bool,
    on_it_since: Option<Duration>,
    passes_before: u32,
    failures_before: u32,
    proof_wanted: bool,
}

impl Step {
    fn hold(phase: RolloutPhase, target: String, change: String) -> Step {
        Step {
            phase,
            target,
            change,
            message: String::new(),
            hold: true,
            on_it_since: None,
            passes_before: 0,
            failures_before: 0,
            proof_wanted: false,
        }
    }

    fn saying(mut self, message: &str) -> Step {
        message.clone_into(&mut self.message);
        self
    }
}

/// The step as a record: its phase dated from when it began.
fn settle(now: &Standing<'_>, previous: Option<&RolloutRecord>, step: Step) -> Decision {
    let moved = previous.is_none_or(|r| r.phase != step.phase || r.target != step.target);
    let since = match previous {
        Some(r) if !moved => r.since.clone(),
        _ => rfc3339(now.now),
    };
    Decision {
        record: RolloutRecord {
            phase: step.phase,
            pool: now.primary.name.clone(),
            target: step.target,
            change: step.change,
            since,
            standby_on_it_since: step.on_it_since.map(rfc3339),
            standby_passes_before: step.passes_before,
            standby_failures_before: step.failures_before,
            message: step.message,
        },
        hold: step.hold,
        moved,
        proof_wanted_since: step.on_it_since.filter(|_| step.proof_wanted),
    }
}

/// A serving template's keys, shortened to name it: the first 12 hex digits of their digest.
#[must_use]
pub fn short(keys: &Fingerprint) -> String {
    keys.digest().chars().take(12).collect()
}

/// `runtime.image: v0.11.0 -> v0.12.0, flag.max-model-len: 4096 -> 8192`.
fn change_line(from: &Fingerprint, to: &Fingerprint) -> String {
    let side = |v: &Option<String>| v.clone().unwrap_or_else(|| "absent".to_owned());
    from.drift(to)
        .differences
        .iter()
        .map(|d| format!("{}: {} -> {}", d.key, side(&d.left), side(&d.right)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The keys the primary's `target` and the standby's template differ in that the policy does not
/// let differ.
fn differences(target: &Fingerprint, standby: &Fingerprint, allowed: &[String]) -> Vec<ParityDrift> {
    let (blocking, _) = target.drift(standby).split(allowed);
    drift_of(blocking.differences)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const MIN: Duration = Duration::from_secs(60);
    /// 2026-12-05T00:00:00Z.
    const T0: Duration = Duration::from_secs(1_796_428_800);

    fn keys(image: &str) -> Fingerprint {
        let mut keys = Fingerprint::default();
        keys.insert("runtime.image", image);
        keys.insert("flag.model", "meta-llama/Llama-3.1-8B-Instruct");
        keys
    }

    /// A pool whose template is `template` and whose pods run `running`.
    fn pool(name: &str, template: &str, running: &[&str]) -> PoolView {
        PoolView {
            name: name.to_owned(),
            template: Some(keys(template)),
            running: running.iter().map(|image| keys(image)).collect(),
            rolled_out: running == [template],
            replicas: vec![format!("{name}-0:8000"), format!("{name}-1:8000")],
            held: false,
        }
    }

    struct World {
        primary: PoolView,
        standby: PoolView,
        health: PoolHealth,
        passed: BTreeSet<String>,
        allowed: Vec<String>,
        load_proof: Option<Option<LastProof>>,
        now: Duration,
    }

    impl World {
        /// East is primary and runs v1, west runs v1: nothing pending.
        fn new() -> World {
            World {
                primary: pool("east", "v1", &["v1"]),
                standby: pool("west", "v1", &["v1"]),
                health: PoolHealth {
                    passes: 5,
                    ..PoolHealth::default()
                },
                passed: ["west-0:8000", "west-1:8000"].map(str::to_owned).into(),
                allowed: Vec::new(),
                load_proof: None,
                now: T0,
            }
        }

        fn decide(&self, previous: Option<&RolloutRecord>) -> Decision {
            decide(
                &Standing {
                    primary: &self.primary,
                    standby: &self.standby,
                    standby_health: self.health,
                    passed: &self.passed,
                    ready_after: 3,
                    stop_after: 3,
                    allowed: &self.allowed,
                    load_proof: self.load_proof,
                    now: self.now,
                },
                previous,
            )
        }

        /// The primary's template set to `image`, held: its pods run what they ran.
        fn primary_set_to(&mut self, image: &str) {
            self.primary.template = Some(keys(image));
            self.primary.rolled_out = false;
        }

        /// The standby rolled to `image`, its new replicas not yet probed.
        fn standby_rolled_to(&mut self, image: &str) {
            self.standby = pool("west", image, &[image]);
            self.standby.replicas = vec!["west-2:8000".to_owned(), "west-3:8000".to_owned()];
            self.passed.clear();
        }

        /// `rounds` probe rounds later, every standby replica passing.
        fn standby_passes(&mut self, rounds: u32) {
            self.passed = self.standby.replicas.iter().cloned().collect();
            self.health.passes += rounds;
            self.now += MIN * rounds;
        }
    }

    /// Decides again from each decision's record, returning the last.
    fn replay(world: &World, previous: &mut Option<RolloutRecord>) -> Decision {
        let decision = world.decide(previous.as_ref());
        *previous = Some(decision.record.clone());
        decision
    }

    #[test]
    fn a_primary_that_runs_its_template_is_held_for_the_next_change_and_its_record_keeps_its_date() {
        let mut world = World::new();
        let first = world.decide(None);
        assert_eq!(first.record.phase, RolloutPhase::UpToDate);
        assert!(first.hold && first.moved);
        assert_eq!(first.record.target, short(&keys("v1")));
        world.now += MIN;
        let again = world.decide(Some(&first.record));
        assert!(!again.moved);
        assert_eq!(again.record.since, first.record.since, "the phase began then");
    }

    #[test]
    fn a_change_to_the_primary_is_held_until_the_standby_has_run_it_and_passed_then_the_primary_rolls() {
        let mut world = World::new();
        let mut record = None;
        replay(&world, &mut record);
        world.primary_set_to("v2");
        let held = replay(&world, &mut record);
        assert_eq!(held.record.phase, RolloutPhase::Holding);
        assert!(held.hold && held.moved);
        assert_eq!(held.record.change, "runtime.image: v1 -> v2");
        assert!(
            held.record.message.contains("runtime.image (v2 ≠ v1)"),
            "{}",
            held.record.message
        );

        world.standby.template = Some(keys("v2"));
        world.standby.rolled_out = false;
        world.standby.running.push(keys("v2"));
        let rolling = replay(&world, &mut record);
        assert_eq!(rolling.record.phase, RolloutPhase::Holding);
        assert!(
            rolling.record.message.contains("rolls to it"),
            "{}",
            rolling.record.message
        );

        world.standby_rolled_to("v2");
        world.now += MIN;
        let on_it = replay(&world, &mut record);
        assert_eq!(on_it.record.phase, RolloutPhase::Proving);
        assert!(on_it.hold);
        assert_eq!(on_it.record.standby_on_it_since, Some(rfc3339(world.now)));
        assert_eq!(on_it.record.standby_passes_before, 5);
        assert!(
            on_it.record.message.contains("west-2:8000, west-3:8000"),
            "{}",
            on_it.record.message
        );

        world.standby_passes(2);
        let two = replay(&world, &mut record);
        assert_eq!(two.record.phase, RolloutPhase::Proving);
        assert!(!two.moved);
        assert!(two.record.message.contains("2 of 3"), "{}", two.record.message);

        world.standby_passes(1);
        let passed = replay(&world, &mut record);
        assert_eq!(passed.record.phase, RolloutPhase::Rolling);
        assert!(!passed.hold && passed.moved);

        // Half the primary's pods run v2: it goes on rolling.
        world.primary.running = vec![keys("v1"), keys("v2")];
        let halfway = replay(&world, &mut record);
        assert_eq!(halfway.record.phase, RolloutPhase::Rolling);
        assert!(!halfway.hold && !halfway.moved);

        // Every pod it runs is on v2, but its controller has not said it rolled out.
        world.primary.running = vec![keys("v2"), keys("v2")];
        let last = replay(&world, &mut record);
        assert_eq!(last.record.phase, RolloutPhase::Rolling);
        assert!(!last.hold && !last.moved);
        assert_eq!(last.record.change, "runtime.image: v1 -> v2");
        assert!(
            last.record.message.contains("not yet said it rolled out"),
            "{}",
            last.record.message
        );

        world.primary = pool("east", "v2", &["v2"]);
        let done = replay(&world, &mut record);
        assert_eq!(done.record.phase, RolloutPhase::UpToDate);
        assert!(done.hold && done.moved);
        assert_eq!(done.record.change, "");
    }

    #[test]
    fn a_standby_that_fails_on_the_new_template_stops_the_rollout_until_the_primary_is_set_to_another() {
        let mut world = World::new();
        let mut record = None;
        world.primary_set_to("v2");
        world.standby_rolled_to("v2");
        replay(&world, &mut record);
        world.health = PoolHealth {
            failures: 3,
            ..PoolHealth::default()
        };
        let stopped = replay(&world, &mut record);
        assert_eq!(stopped.record.phase, RolloutPhase::Stopped);
        assert!(stopped.hold && stopped.moved);
        assert!(
            stopped.record.message.contains("failed 3 checks in a row"),
            "{}",
            stopped.record.message
        );

        // It passes again: the rollout stays stopped, the primary held.
        world.health = PoolHealth::default();
        world.standby_passes(10);
        let still = replay(&world, &mut record);
        assert_eq!(still.record.phase, RolloutPhase::Stopped);
        assert!(still.hold && !still.moved);

        // A fixed v3 on both starts again; going back to v1 ends it.
        world.primary_set_to("v3");
        world.standby_rolled_to("v3");
        assert_eq!(replay(&world, &mut record).record.phase, RolloutPhase::Proving);
        world.primary = pool("east", "v1", &["v1"]);
        let back = replay(&world, &mut record);
        assert_eq!(back.record.phase, RolloutPhase::UpToDate);
        assert!(back.hold);
    }

    #[test]
    fn with_load_proofs_the_rollout_waits_for_one_started_on_the_new_template_and_stops_on_a_failed_one() {
        let mut world = World::new();
        world.load_proof = Some(Some(LastProof {
            at: T0,
            proven: true,
            failed: false,
        }));
        let mut record = None;
        world.primary_set_to("v2");
        world.now += MIN;
        world.standby_rolled_to("v2");
        let on_it = replay(&world, &mut record);
        let since = world.now;
        assert_eq!(on_it.proof_wanted_since, None, "its replicas have not passed yet");
        world.standby_passes(3);
        let waits = replay(&world, &mut record);
        assert_eq!(waits.record.phase, RolloutPhase::Proving);
        assert_eq!(
            waits.proof_wanted_since,
            Some(since),
            "the proof before it ran on v1"
        );
        assert!(
            waits.record.message.contains("load proof"),
            "{}",
            waits.record.message
        );

        let proof = |proven: bool| {
            Some(Some(LastProof {
                at: since + MIN,
                proven,
                failed: !proven,
            }))
        };
        world.load_proof = proof(true);
        let mut passed = record.clone();
        let rolls = replay(&world, &mut passed);
        assert_eq!(rolls.record.phase, RolloutPhase::Rolling);
        assert_eq!(rolls.proof_wanted_since, None);

        world.load_proof = proof(false);
        let stopped = replay(&world, &mut record);
        assert_eq!(stopped.record.phase, RolloutPhase::Stopped);
        assert!(
            stopped.record.message.contains("load proof"),
            "{}",
            stopped.record.message
        );

        // One that did not run is waited for again, not wanted anew while it is retried.
        world.load_proof = Some(Some(LastProof {
            at: since + MIN,
            proven: false,
            failed: false,
        }));
        let mut fresh = None;
        world.primary_set_to("v4");
        world.standby_rolled_to("v4");
        world.now = since;
        replay(&world, &mut fresh);
        world.standby_passes(3);
        let retried = replay(&world, &mut fresh);
        assert_eq!(retried.record.phase, RolloutPhase::Proving);
        assert_eq!(retried.proof_wanted_since, None);
    }

    #[test]
    fn failures_from_before_the_standby_ran_the_new_template_do_not_stop_the_rollout() {
        let mut world = World::new();
        let mut record = None;
        world.primary_set_to("v2");
        world.standby_rolled_to("v2");
        // Its new replicas failed while they loaded, before it was seen running v2.
        world.health = PoolHealth {
            failures: 5,
            ..PoolHealth::default()
        };
        let on_it = replay(&world, &mut record);
        assert_eq!(on_it.record.phase, RolloutPhase::Proving);
        assert_eq!(on_it.record.standby_failures_before, 5);
        world.health.failures = 7;
        assert_eq!(replay(&world, &mut record).record.phase, RolloutPhase::Proving);
        world.health.failures = 8;
        let stopped = replay(&world, &mut record);
        assert_eq!(stopped.record.phase, RolloutPhase::Stopped);
        assert!(
            stopped.record.message.contains("failed 3 checks in a row"),
            "{}",
            stopped.record.message
        );
    }

    #[test]
    fn a_failure_on_the_new_template_counts_the_passes_again_from_nothing() {
        let mut world = World::new();
        let mut record = None;
        world.primary_set_to("v2");
        world.standby_rolled_to("v2");
        replay(&world, &mut record);
        world.standby_passes(2);
        world.health = PoolHealth {
            failures: 1,
            ..PoolHealth::default()
        };
        replay(&world, &mut record);
        world.health = PoolHealth::default();
        world.standby_passes(2);
        let two = replay(&world, &mut record);
        assert_eq!(two.record.standby_passes_before, 0);
        assert!(two.record.message.contains("2 of 3"), "{}", two.record.message);
        world.standby_passes(1);
        assert_eq!(replay(&world, &mut record).record.phase, RolloutPhase::Rolling);
    }

    #[test]
    fn a_change_made_while_the_primary_rolls_is_held_again() {
        let mut world = World::new();
        let mut record = None;
        world.primary_set_to("v2");
        world.standby_rolled_to("v2");
        replay(&world, &mut record);
        world.standby_passes(3);
        assert_eq!(replay(&world, &mut record).record.phase, RolloutPhase::Rolling);
        world.primary.template = Some(keys("v3"));
        world.primary.running = vec![keys("v1"), keys("v2")];
        let held = replay(&world, &mut record);
        assert_eq!(held.record.phase, RolloutPhase::Holding);
        assert!(held.hold);
    }

    #[test]
    fn a_change_that_leaves_the_serving_template_as_it_is_rolls_at_once() {
        let mut world = World::new();
        world.primary.rolled_out = false;
        let decision = world.decide(None);
        assert_eq!(decision.record.phase, RolloutPhase::UpToDate);
        assert!(!decision.hold);
        assert!(decision.record.message.contains("leaves its serving template"));
    }

    #[test]
    fn keys_the_policy_lets_differ_do_not_hold_the_primary_and_other_keys_name_themselves() {
        let mut world = World::new();
        world.primary_set_to("v2");
        let mut standby_keys = keys("v2");
        standby_keys.insert("flag.tensor-parallel-size", "4");
        world.standby = pool("west", "v2", &["v2"]);
        world.standby.template = Some(standby_keys.clone());
        world.standby.running = vec![standby_keys];
        let held = world.decide(None);
        assert_eq!(held.record.phase, RolloutPhase::Holding);
        assert!(
            held.record.message.contains("flag.tensor-parallel-size"),
            "{}",
            held.record.message
        );
        world.allowed = vec!["flag.tensor-parallel-size".to_owned()];
        assert_eq!(world.decide(None).record.phase, RolloutPhase::Proving);
    }

    #[test]
    fn a_record_of_the_other_pool_is_not_this_ones_and_a_standby_without_replicas_holds() {
        let mut world = World::new();
        let mut record = None;
        world.primary_set_to("v2");
        world.standby_rolled_to("v2");
        world.standby_passes(3);
        replay(&world, &mut record);
        // A promotion later, west is primary: east's rollout says nothing of it.
        std::mem::swap(&mut world.primary, &mut world.standby);
        let west = world.decide(record.as_ref());
        assert_eq!(west.record.pool, "west");
        assert!(west.moved);
        world.standby = pool("east", "v2", &[]);
        world.standby.rolled_out = true;
        world.primary_set_to("v3");
        world.standby.template = Some(keys("v3"));
        let none = world.decide(None);
        assert_eq!(none.record.phase, RolloutPhase::Holding);
    }
}
