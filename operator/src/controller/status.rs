//! What a FailoverPolicy's status says, computed from the state machine and the previous status.
//!
//! Pure: the reconciler gathers the facts, this module turns them into the status it applies.
//! It must never invent what the operator has not observed: a condition nobody measured yet is
//! `Unknown` with a reason saying so.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use understudy_core::failover::{
    ControlPlane, FailoverConfig, FailoverState, Phase, Promotion, Step, TransitionKind as MachineKind,
};
use understudy_core::recovery::{Objective, Stage, StageTimes, Standby, judge, secs};
use understudy_core::{Epoch, Pool};

use crate::coldstart;
use crate::command::HandledCommand;
use crate::crd::{
    ArtifactDigest, ColdStartBreakdown, Condition, ConditionStatus, FailoverPolicySpec, FailoverPolicyStatus,
    FailoverTimeline, GoldenAnswer, GpuReserve, LoadProofRecord, LoadProofSpec, ParityStatus, RolloutRecord,
    StandbyProofRecord, TimelineStep, TransitionKind, condition_type,
};
use crate::parity;
use crate::policy::{pool_name, validate};
use crate::reconciler::rfc3339;

/// The operator's own record, kept in `status.failover`: the state machine, the last command
/// handled, and the steps it handed off. A restarted operator resumes from it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorRecord {
    pub machine: FailoverState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handled_command: Option<HandledCommand>,
    /// The steps of the latest promotion that were left to another component, so that every later
    /// status still says which steps nobody here carried out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handed_off: Vec<HandedOffStep>,
}

/// A promotion step with a note for the timeline: one the operator made no call for, or one
/// another component confirmed with something worth showing (the routers that took a route).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HandedOffStep {
    pub epoch: Epoch,
    pub step: Step,
    /// What the timeline says about it: who carries it, and what was (not) done.
    pub note: String,
    /// False for a step that was carried out and only has a note. Records written before
    /// this field held handed-off steps only.
    #[serde(default = "handed_off_by_default", skip_serializing_if = "is_handed_off")]
    pub handed_off: bool,
}

fn handed_off_by_default() -> bool {
    true
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_handed_off(handed_off: &bool) -> bool {
    *handed_off
}

/// What a status holds of the operator's record. Each part is read on its own key, so that a
/// garbled state machine does not also lose the handled command, which would replay it.
#[derive(Debug)]
pub struct StoredRecord {
    /// `None` when nothing was recorded yet.
    pub machine: Result<Option<FailoverState>, serde_json::Error>,
    /// `None` when no command was handled yet.
    pub handled_command: Result<Option<HandledCommand>, serde_json::Error>,
    /// Display only: an unreadable list reads as empty.
    pub handed_off: Vec<HandedOffStep>,
}

/// Reads the record back from a status, part by part.
#[must_use]
pub fn load_record(status: Option<&FailoverPolicyStatus>) -> StoredRecord {
    let record = status.and_then(|s| s.failover.as_ref()).filter(|v| !v.is_null());
    let Some(record) = record else {
        return StoredRecord {
            machine: Ok(None),
            handled_command: Ok(None),
            handed_off: Vec::new(),
        };
    };
    let Some(fields) = record.as_object() else {
        let not_an_object = serde::de::Error::custom(format!("status.failover is not an object: {record}"));
        return StoredRecord {
            machine: Err(not_an_object),
            handled_command: Ok(None),
            handed_off: Vec::new(),
        };
    };
    fn field<T: serde::de::DeserializeOwned>(
        fields: &serde_json::Map<String, serde_json::Value>,
        key: &str,
    ) -> Result<Option<T>, serde_json::Error> {
        fields
            .get(key)
            .filter(|v| !v.is_null())
            .cloned()
            .map(serde_json::from_value)
            .transpose()
    }
    StoredRecord {
        machine: field(fields, "machine").and_then(|machine| {
            // A record with other keys but no machine is as unreadable as a garbled one.
            machine
                .map(Some)
                .ok_or_else(|| serde::de::Error::missing_field("machine"))
        }),
        handled_command: field(fields, "handledCommand"),
        handed_off: field(fields, "handedOff").ok().flatten().unwrap_or_default(),
    }
}

/// The name status shows for a phase.
#[must_use]
pub fn phase_name(phase: &Phase) -> &'static str {
    match phase {
        Phase::Serving => "Serving",
        Phase::Suspect => "Suspect",
        Phase::Stranded => "Stranded",
        Phase::Promoting(_) => "Promoting",
    }
}

/// How a timeline names a finished step.
#[must_use]
pub fn step_name(step: Step) -> &'static str {
    match step {
        Step::AcquireLease => "LeaseClaimed",
        Step::FenceOld => "Fenced",
        Step::Wake => "Woken",
        Step::Scale => "ScaledUp",
        Step::AwaitServing => "Serving",
        Step::Route => "Routed",
        Step::OpenAdmission => "AdmissionOpened",
    }
}

/// Everything the status is computed from.
#[derive(Debug)]
pub struct StatusFacts<'a> {
    pub spec: &'a FailoverPolicySpec,
    pub config: &'a FailoverConfig,
    pub generation: Option<i64>,
    pub previous: Option<&'a FailoverPolicyStatus>,
    pub record: &'a OperatorRecord,
    /// A promotion that finished during this reconcile, with every step recorded.
    pub finished: Option<&'a Promotion>,
    /// The epoch Lease's epoch, when it is below the record's: the Lease went back.
    pub lease_behind: Option<Epoch>,
    /// The GPU reserve held after this reconcile.
    pub gpu_reserve: Option<&'a GpuReserve>,
    /// The golden answer the probes judge by after this reconcile.
    pub golden_answer: Option<&'a GoldenAnswer>,
    /// Whether the replicas took the last round's probe, or why not; `None` before any round.
    pub probe_accepted: Option<Result<(), &'a str>>,
    /// The cold starts measured after this reconcile; `None` keeps the previous status's.
    pub cold_start: Option<&'a [ColdStartBreakdown]>,
    /// A standby proof this reconcile ran; `None` keeps the previous status's.
    pub standby_proof: Option<&'a StandbyProofRecord>,
    /// A load proof this reconcile took in; `None` keeps the previous status's.
    pub load_proof: Option<&'a LoadProofRecord>,
    /// The last comparison of the pools; `None` keeps the previous status's.
    pub parity: Option<&'a ParityStatus>,
    /// The level each of the standby's sleeping replicas sleeps at, as the probes last read it.
    pub standby_asleep_levels: &'a [Option<u8>],
    /// Where a standby-first rollout stands after this reconcile.
    pub rollout: Option<&'a RolloutRecord>,
    pub now: Duration,
}

/// The status to apply.
pub fn desired_status(facts: &StatusFacts<'_>) -> Result<FailoverPolicyStatus, serde_json::Error> {
    let machine = &facts.record.machine;
    let previous = facts.previous.cloned().unwrap_or_default();
    let handed_off = &facts.record.handed_off;
    let last_failover = match (&machine.phase, facts.finished) {
        (Phase::Promoting(p), _) => Some(timeline(facts.spec, p, None, handed_off)),
        (_, Some(done)) => Some(timeline(
            facts.spec,
            done,
            machine.last_transition_end,
            handed_off,
        )),
        _ => previous.last_failover.clone(),
    };
    let cold_start = facts
        .cold_start
        .map_or_else(|| previous.cold_start.clone(), <[_]>::to_vec);
    let standby_proof = facts.standby_proof.cloned().or(previous.standby_proof);
    let load_proof = facts.load_proof.cloned().or(previous.load_proof);
    let parity = if facts.spec.parity.enabled {
        facts.parity.cloned().or(previous.parity)
    } else {
        None
    };
    let mut conditions = conditions(
        facts.spec,
        facts.config,
        machine,
        facts.lease_behind,
        facts.probe_accepted,
        standby_proof.as_ref(),
    );
    conditions.insert(
        condition_type::OBJECTIVE_MET.to_owned(),
        objective_met(
            facts.spec,
            machine.standby(),
            &cold_start,
            facts.standby_asleep_levels,
        ),
    );
    if let Some(ready) = conditions.get_mut(condition_type::READY)
        && ready.reason == "Promoting"
        && let Some(overdue) = overdue(facts.spec, machine, facts.now)
    {
        *ready = overdue;
    }
    conditions.insert(
        condition_type::PARITY_HOLDS.to_owned(),
        parity_holds(facts.spec, machine, parity.as_ref()),
    );
    if let Some(proof) = &facts.spec.load_proof {
        conditions.insert(
            condition_type::STANDBY_LOAD_PROVEN.to_owned(),
            standby_load_proven(
                proof,
                pool_name(facts.spec, machine.standby()),
                machine,
                load_proof.as_ref(),
            ),
        );
    }
    if let Some(digest) = facts.spec.parity.artifact_digest {
        conditions.insert(
            condition_type::ARTIFACT_DIGEST_COMPARED.to_owned(),
            artifact_digest_compared(digest, facts.spec.parity.enabled, parity.as_ref()),
        );
    }
    Ok(FailoverPolicyStatus {
        primary_pool: Some(pool_name(facts.spec, machine.primary).to_owned()),
        epoch: Some(machine.epoch.0),
        state: Some(phase_name(&machine.phase).to_owned()),
        observed_generation: facts.generation,
        conditions: merge_conditions(&previous.conditions, conditions, facts.now),
        last_failover,
        cold_start_summary: coldstart::summarize(&cold_start),
        cold_start,
        standby_proof,
        load_proof,
        parity,
        gpu_reserve: facts.gpu_reserve.cloned(),
        rollout: facts.rollout.cloned(),
        golden_answer: facts
            .golden_answer
            .map(|golden| recorded(golden, previous.golden_answer.as_ref(), facts.now)),
        failover: Some(serde_json::to_value(facts.record)?),
        // The grants are the grantor's to say: `status_of` adds its last round.
        grants: None,
    })
}

/// `golden` with the time it was recorded: its own, else the previous status's when that held the
/// same answer, else `now`.
fn recorded(golden: &GoldenAnswer, previous: Option<&GoldenAnswer>, now: Duration) -> GoldenAnswer {
    let unstamped = |g: &GoldenAnswer| GoldenAnswer {
        recorded_at: None,
        ..g.clone()
    };
    let recorded_at = golden
        .recorded_at
        .clone()
        .or_else(|| {
            previous
                .filter(|previous| unstamped(previous) == unstamped(golden))
                .and_then(|previous| previous.recorded_at.clone())
        })
        .unwrap_or_else(|| rfc3339(now));
    GoldenAnswer {
        recorded_at: Some(recorded_at),
        ..golden.clone()
    }
}

/// `StandbyLoadProven` for a policy that sets `spec.loadProof`: what the last proof of this
/// standby showed, and whether its failure blocks promotion.
fn standby_load_proven(
    spec: &LoadProofSpec,
    standby: &str,
    machine: &FailoverState,
    last: Option<&LoadProofRecord>,
) -> Condition {
    use ConditionStatus::{False, True, Unknown};
    let last = last.filter(|p| p.pool == standby);
    // What the machine holds decides: the block, whatever the last record says.
    if machine.load_proof_failed[machine.standby().index()] {
        let why = last.filter(|p| p.result == "Failed").map_or_else(
            || format!("{standby} failed its last load proof"),
            LoadProofRecord::summary,
        );
        return condition(
            False,
            "Failed",
            format!("{why}; promotion is blocked until a proof passes (force-failover still promotes)"),
        );
    }
    let Some(last) = last else {
        return condition(
            Unknown,
            "NotYetRun",
            format!(
                "{standby} has not been proven at the primary's load yet; a proof runs every {}",
                spec.every
            ),
        );
    };
    let summary = last.summary();
    match last.result.as_str() {
        "Proven" => condition(True, "Proven", summary),
        "Failed" => condition(
            False,
            "FailedNotBlocking",
            format!(
                "{summary}; it does not block promotion{}",
                if spec.blocks_promotion {
                    ""
                } else {
                    " (spec.loadProof.blocksPromotion is false)"
                }
            ),
        ),
        _ => condition(Unknown, "NotRun", summary),
    }
}

/// `ArtifactDigestCompared` for a policy that sets `spec.parity.artifactDigest`: whether the last
/// comparison of the pools read both pools' model files, and if not, why.
fn artifact_digest_compared(
    digest: ArtifactDigest,
    enabled: bool,
    parity: Option<&ParityStatus>,
) -> Condition {
    let how = digest.as_str();
    if !enabled {
        return condition(
            ConditionStatus::False,
            "ParityOff",
            format!("the pools' model files ({how}) are not compared: spec.parity.enabled is false"),
        );
    }
    let Some(parity) = parity else {
        return condition(
            ConditionStatus::False,
            "NotYetCompared",
            format!("the pools' model files ({how}) have not been compared yet"),
        );
    };
    let why_not: Vec<&str> = parity
        .not_compared
        .iter()
        .filter(|line| line.contains("'s model files"))
        .map(String::as_str)
        .collect();
    if parity.artifact_keys == 0 {
        let why = if why_not.is_empty() {
            "neither pool's were read".to_owned()
        } else {
            why_not.join("; ")
        };
        return condition(
            ConditionStatus::False,
            "NotCompared",
            format!(
                "the pools' model files ({how}) were not compared at {}: {why}",
                parity.checked_at
            ),
        );
    }
    let drifted = parity
        .drift
        .iter()
        .filter(|d| d.key.starts_with(crate::parity::ARTIFACT))
        .count();
    let mut message = format!(
        "the pools' model files ({how}) were compared at {}: {} keys, {drifted} drifted",
        parity.checked_at, parity.artifact_keys
    );
    if !why_not.is_empty() {
        message.push_str("; not read: ");
        message.push_str(&why_not.join("; "));
    }
    condition(ConditionStatus::True, "Compared", message)
}

fn condition(status: ConditionStatus, reason: &str, message: String) -> Condition {
    Condition {
        status,
        reason: reason.to_owned(),
        message,
        last_transition_time: None,
    }
}

/// The conditions the machine's state implies, without transition times.
fn conditions(
    spec: &FailoverPolicySpec,
    config: &FailoverConfig,
    machine: &FailoverState,
    lease_behind: Option<Epoch>,
    probe_accepted: Option<Result<(), &str>>,
    proof: Option<&StandbyProofRecord>,
) -> BTreeMap<String, Condition> {
    let ready = ready(spec, config, machine, lease_behind);
    let standby_proven = standby_proven(spec, config, machine, proof);
    let probe = probe(probe_accepted);
    BTreeMap::from([
        (condition_type::READY.to_owned(), ready),
        (condition_type::STANDBY_PROVEN.to_owned(), standby_proven),
        (condition_type::PROBE_ACCEPTED.to_owned(), probe),
    ])
}

/// `Ready`: whether control actions can be taken on a sound Lease, and then what the phase says.
fn ready(
    spec: &FailoverPolicySpec,
    config: &FailoverConfig,
    machine: &FailoverState,
    lease_behind: Option<Epoch>,
) -> Condition {
    use ConditionStatus::False;
    let primary = pool_name(spec, machine.primary);
    if let Some(lease_epoch) = lease_behind {
        condition(
            False,
            "LeaseRegressed",
            format!(
                "the epoch Lease is at epoch {lease_epoch}, below the recorded epoch {}; epochs never go \
                 back, so no control action is taken until the Lease is restored to epoch {} or higher",
                machine.epoch, machine.epoch
            ),
        )
    } else if machine.control_plane == ControlPlane::Unreachable {
        condition(
            False,
            "ControlPlaneUnreachable",
            format!(
                "the epoch Lease cannot be read; control actions are paused and {primary} keeps its role"
            ),
        )
    } else if !machine.lease_known {
        condition(
            False,
            "LeaseUnknown",
            "a compare-and-set on the epoch Lease was lost; waiting to read it again".to_owned(),
        )
    } else {
        phase_ready(spec, config, machine)
    }
}

/// `Ready` on a Lease the operator knows: what the machine's phase says of the primary.
fn phase_ready(spec: &FailoverPolicySpec, config: &FailoverConfig, machine: &FailoverState) -> Condition {
    use ConditionStatus::{False, True};
    let primary = pool_name(spec, machine.primary);
    let standby = pool_name(spec, machine.standby());
    match &machine.phase {
        // Holding the Lease is all that is known here: the routers are kept on the route between
        // promotions, but what they answered is not recorded in status (a router ahead or
        // refusing is a Warning Event), so saying the pool serves would claim more than is known.
        Phase::Serving => condition(
            True,
            "LeaseHeld",
            format!(
                "{primary} holds the epoch Lease at epoch {}; whether the routers route to it is not recorded \
                 here (a router that refuses its route raises a Warning Event){}",
                machine.epoch,
                if config.paused {
                    "; spec.paused: nothing fails over on its own"
                } else {
                    ""
                }
            ),
        ),
        Phase::Suspect => condition(
            True,
            "PrimarySuspect",
            format!(
                "{primary} holds the epoch Lease at epoch {} but failed recent checks",
                machine.epoch
            ),
        ),
        Phase::Stranded if config.paused => condition(
            False,
            "Paused",
            format!(
                "{primary} is failing and spec.paused holds {standby} back: nothing fails over \
                 on its own while paused (the understudy.dev/command annotation still does)"
            ),
        ),
        Phase::Stranded => condition(
            False,
            "Stranded",
            format!("{primary} is failing and {standby} cannot be promoted now"),
        ),
        Phase::Promoting(p) => condition(
            False,
            "Promoting",
            format!(
                "promoting {} at epoch {}, at step {:?}",
                pool_name(spec, p.to),
                p.epoch,
                p.step
            ),
        ),
    }
}

/// `Ready` for a promotion past its deadline ([`understudy_core::drive`]): which step holds it,
/// and what that means for traffic. `None` while it is not past it.
fn overdue(spec: &FailoverPolicySpec, machine: &FailoverState, now: Duration) -> Option<Condition> {
    let Phase::Promoting(p) = &machine.phase else {
        return None;
    };
    let deadline = validate(spec).ok()?.promotion_deadline();
    if now.saturating_sub(p.started_at) < deadline {
        return None;
    }
    let to = pool_name(spec, p.to);
    let held = match p.step {
        Step::AcquireLease => {
            "the epoch Lease is not written yet, and nothing is promoted without it".to_owned()
        }
        Step::AwaitServing => format!(
            "none of {to}'s replicas answers the generating probe yet: the routers keep the waiting room \
             closed, answering with Retry-After, and the promotion keeps trying"
        ),
        Step::Route | Step::OpenAdmission => format!(
            "no router holds the route to {to} yet: requests wait in the routers' waiting room, then \
             are answered with Retry-After"
        ),
        // Past the deadline these are done with what they have at their next try.
        Step::FenceOld | Step::Wake | Step::Scale => "it goes on with what it has".to_owned(),
    };
    Some(condition(
        ConditionStatus::False,
        "PromotionOverdue",
        format!(
            "promoting {to} at epoch {}, at step {:?}, past the promotion's deadline of {deadline:?} (the \
             recovery objective less a hang's detection): {held}",
            p.epoch, p.step
        ),
    ))
}

/// `StandbyProven`: the standby's recent checks, and its last proof while asleep.
fn standby_proven(
    spec: &FailoverPolicySpec,
    config: &FailoverConfig,
    machine: &FailoverState,
    proof: Option<&StandbyProofRecord>,
) -> Condition {
    use ConditionStatus::{False, True, Unknown};
    let standby = pool_name(spec, machine.standby());
    let health = machine.health[machine.standby().index()];
    let standby_proven = if health.failures > 0 {
        condition(
            False,
            "StandbyFailing",
            format!("{standby} failed its last {} checks", health.failures),
        )
    } else if health.passes >= config.standby_ready_after {
        condition(
            True,
            "ChecksPass",
            format!("{standby} passed its last {} checks", health.passes),
        )
    } else {
        condition(
            Unknown,
            "NotProven",
            format!(
                "{standby} has passed {} of the {} checks that prove it",
                health.passes, config.standby_ready_after
            ),
        )
    };
    // The last proof of a sleeping standby, when it was of this standby.
    match proof.filter(|p| p.pool == standby) {
        Some(p) => Condition {
            message: format!(
                "{}; last proof {}{}: {} {}",
                standby_proven.message,
                p.at,
                if p.passed { "" } else { " failed" },
                p.replica,
                p.detail
            ),
            ..standby_proven
        },
        None => standby_proven,
    }
}

/// `ProbeAccepted`: whether the replicas took the last round's probe.
fn probe(probe_accepted: Option<Result<(), &str>>) -> Condition {
    use ConditionStatus::{False, True, Unknown};
    match probe_accepted {
        Some(Ok(())) => condition(True, "Answered", "the replicas answer the probe".to_owned()),
        Some(Err(why)) => condition(
            False,
            "ProbeRejected",
            format!(
                "{why}: the probe itself is wrong (spec.probe, or the model the pools serve), so no \
                 check judges either pool and nothing fails over on probes until it is fixed"
            ),
        ),
        None => condition(Unknown, "NotProbed", "no probe round has finished yet".to_owned()),
    }
}

/// A finished transition's timeline in one line, for its Event: when the fault was first seen,
/// how long detection took, each step's time, and the total from the decision and the fault.
#[must_use]
pub fn timeline_note(timeline: &FailoverTimeline) -> String {
    let instant = |text: &str| text.parse::<Timestamp>().ok();
    let span = |from: Option<Timestamp>, to: Option<Timestamp>| {
        let (from, to) = (from?, to?);
        let span = Duration::try_from(to.duration_since(from)).ok()?;
        Some(secs(span))
    };
    let decided = instant(&timeline.started_at);
    let mut note = format!(
        "{:?} {} → {} at epoch {}: ",
        timeline.kind, timeline.from_pool, timeline.to_pool, timeline.epoch
    );
    let fault = timeline.fault_seen_at.as_deref().and_then(instant);
    match (&timeline.fault_seen_at, span(fault, decided)) {
        (Some(seen), Some(detection)) => {
            note.push_str(&format!("fault first seen {seen}, decided {detection} later; "));
        }
        _ => note.push_str(&format!(
            "decided at {} (no failure started it); ",
            timeline.started_at
        )),
    }
    let steps: Vec<String> = timeline
        .steps
        .iter()
        .map(|step| {
            let took = step
                .milliseconds
                .map_or_else(|| "?".to_owned(), |ms| secs(Duration::from_millis(ms)));
            format!("{} {took}", step.step)
        })
        .collect();
    note.push_str(&steps.join(", "));
    let finished = timeline.finished_at.as_deref().and_then(instant);
    if let Some(total) = span(decided, finished) {
        note.push_str(&format!("; done {total} after the decision"));
        if let Some(from_fault) = span(fault, finished) {
            note.push_str(&format!(", {from_fault} after the fault"));
        }
    }
    note
}

/// Whether promoting `standby` reaches the policy's serving share within `recoveryObjective`:
/// detection plus the time its tier mix takes, from the slowest measured time of each stage in
/// `cold_start`, else the policy's estimate. `Unknown`, naming the stage, while a stage the mix
/// goes through has neither.
///
/// A warm replica asleep at level 2 where its group asks for level 1 (a node short of host
/// memory for its weights puts it there, [`crate::standby::HostRoom`]) is counted at level 2, as
/// it would wake, and the message says so.
fn objective_met(
    spec: &FailoverPolicySpec,
    standby: Pool,
    cold_start: &[ColdStartBreakdown],
    asleep_levels: &[Option<u8>],
) -> Condition {
    use ConditionStatus::{False, True, Unknown};
    let Ok(policy) = validate(spec) else {
        return condition(Unknown, "InvalidSpec", "the spec does not validate".to_owned());
    };
    let Some(pool) = spec.pools.get(standby.index()) else {
        return condition(Unknown, "InvalidSpec", "the spec has no standby pool".to_owned());
    };
    let asked = pool.standby_mix();
    let asked_at = |standby: Standby| -> u32 {
        asked
            .0
            .iter()
            .filter(|(s, _)| *s == standby)
            .map(|(_, n)| n)
            .sum()
    };
    let at_level_two =
        u32::try_from(asleep_levels.iter().filter(|level| **level == Some(2)).count()).unwrap_or(u32::MAX);
    let deeper = at_level_two
        .saturating_sub(asked_at(Standby::Warm(2)))
        .min(asked_at(Standby::Warm(1)));
    let mix = asked.deeper(deeper);
    let quorum = spec.standby_shapes()[standby.index()].serving_quorum();
    let objective = Objective {
        objective: policy.recovery_objective,
        detection: policy.detection(),
        fraction: f64::from(quorum) / f64::from(pool.replicas.max(1)),
    };
    let measured = slowest_measured(cold_start);
    let times = measured.or(&policy.estimates);
    let source = match (
        measured == StageTimes::new(),
        policy.estimates == StageTimes::new(),
    ) {
        (true, _) => "from spec.coldStartEstimates",
        (false, true) => "from measured cold starts",
        (false, false) => "from measured cold starts, and spec.coldStartEstimates where none was measured",
    };
    let source = if deeper == 0 {
        source.to_owned()
    } else {
        format!(
            "{source}; {deeper} of its level-1 warm replicas sleep at level 2, where a node short of \
             host memory for their weights put them, and are counted so"
        )
    };
    match judge(&mix, &times, &objective) {
        Ok(judged) if judged.met => condition(
            True,
            "WithinObjective",
            format!("{} ({source})", judged.message(&objective)),
        ),
        Ok(judged) => condition(
            False,
            "ObjectiveMissed",
            format!("{} ({source})", judged.message(&objective)),
        ),
        Err(missing) => condition(
            Unknown,
            "ColdStartNotMeasured",
            format!(
                "{missing}, so {}'s recovery time is unknown: none measured yet, and no \
                 spec.coldStartEstimates.{}",
                pool.name,
                missing.stage.as_str()
            ),
        ),
    }
}

/// The slowest time of each stage over every breakdown: what a promotion can count on.
fn slowest_measured(cold_start: &[ColdStartBreakdown]) -> StageTimes {
    let mut slowest = StageTimes::new();
    for (name, seconds) in cold_start.iter().flat_map(|b| &b.stages) {
        let (Some(stage), Some(seconds)) = (Stage::from_name(name), seconds) else {
            continue;
        };
        let Ok(time) = Duration::try_from_secs_f64(*seconds) else {
            continue;
        };
        if slowest.get(stage).is_none_or(|t| time > t) {
            slowest.set(stage, time);
        }
    }
    slowest
}

/// `ParityHolds`, from the last comparison of the pools: False naming every key that differs,
/// True only when keys were compared and none differs, Unknown otherwise (parity off, nothing
/// compared yet, nothing that could be compared).
fn parity_holds(
    spec: &FailoverPolicySpec,
    machine: &FailoverState,
    parity: Option<&ParityStatus>,
) -> Condition {
    use ConditionStatus::{False, True, Unknown};
    let (primary, standby) = (
        pool_name(spec, machine.primary),
        pool_name(spec, machine.standby()),
    );
    if !spec.parity.enabled {
        let message = "spec.parity.enabled is false: the pools are not compared, and drift blocks nothing";
        return condition(Unknown, "Disabled", message.to_owned());
    }
    let Some(parity) = parity else {
        return if machine.parity_holds {
            condition(
                Unknown,
                "NotChecked",
                "no comparison of the pools has finished yet".to_owned(),
            )
        } else {
            condition(False, "Drift", format!("{standby} drifted from {primary}"))
        };
    };
    let mut notes = String::new();
    if !parity.allowed.is_empty() {
        notes.push_str(&format!(
            "; allowed to differ: {}",
            parity::drift_line(&parity.allowed)
        ));
    }
    if !parity.not_compared.is_empty() {
        notes.push_str(&format!("; not compared: {}", parity.not_compared.join("; ")));
    }
    match parity::holds(parity) {
        Some(false) => condition(
            False,
            "Drift",
            format!(
                "{standby} differs from {primary} in {} key(s): {}; it is not promoted automatically \
                 (force-failover still promotes it){notes}",
                parity.drift.len(),
                parity::drift_line(&parity.drift)
            ),
        ),
        Some(true) => condition(
            True,
            "Holds",
            format!(
                "{} key(s) agree between {primary} and {standby}, checked {}{notes}",
                parity.compared, parity.checked_at
            ),
        ),
        None => condition(
            Unknown,
            "NotCompared",
            format!("nothing could be compared{notes}"),
        ),
    }
}

/// Stamps each condition with when its status last changed: kept from `previous` when the status
/// is the same, `now` otherwise.
#[must_use]
pub fn merge_conditions(
    previous: &BTreeMap<String, Condition>,
    next: BTreeMap<String, Condition>,
    now: Duration,
) -> BTreeMap<String, Condition> {
    next.into_iter()
        .map(|(kind, mut condition)| {
            let kept = previous
                .get(&kind)
                .filter(|old| old.status == condition.status)
                .and_then(|old| old.last_transition_time.clone());
            condition.last_transition_time = Some(kept.unwrap_or_else(|| rfc3339(now)));
            (kind, condition)
        })
        .collect()
}

/// The timeline of a promotion, finished at `finished_at` when it is over. Steps in `handed_off`
/// are marked as such, and the lease step of an adopted promotion says nobody here wrote it.
#[must_use]
pub fn timeline(
    spec: &FailoverPolicySpec,
    promotion: &Promotion,
    finished_at: Option<Duration>,
    handed_off: &[HandedOffStep],
) -> FailoverTimeline {
    // Status knows two directions: away from home, and home again.
    let kind = if promotion.to == Pool::A {
        TransitionKind::Failback
    } else {
        TransitionKind::Failover
    };
    let step = |(i, (step, at)): (usize, &(Step, Duration))| {
        let handoff = handed_off
            .iter()
            .find(|h| h.epoch == promotion.epoch && h.step == *step);
        let adopted = promotion.kind == MachineKind::Adopted && *step == Step::AcquireLease;
        let began = i
            .checked_sub(1)
            .map_or(promotion.started_at, |before| promotion.done[before].1);
        TimelineStep {
            step: step_name(*step).to_owned(),
            started_at: Some(rfc3339(began)),
            at: rfc3339(*at),
            milliseconds: u64::try_from(at.saturating_sub(began).as_millis()).ok(),
            handed_off: handoff.is_some_and(|h| h.handed_off),
            note: match handoff {
                Some(h) => Some(h.note.clone()),
                None if adopted => {
                    Some("the Lease was found at this epoch; another writer claimed it".to_owned())
                }
                None => None,
            },
        }
    };
    FailoverTimeline {
        kind,
        from_pool: pool_name(spec, promotion.from).to_owned(),
        to_pool: pool_name(spec, promotion.to).to_owned(),
        epoch: promotion.epoch.0,
        fault_seen_at: promotion.fault_seen_at.map(rfc3339),
        started_at: rfc3339(promotion.started_at),
        steps: promotion.done.iter().enumerate().map(step).collect(),
        finished_at: finished_at.map(rfc3339),
    }
}

/// The JSON merge patch that reports a policy the operator cannot run: `Ready=False`,
/// reason `InvalidSpec`. Used when the object does not even deserialize, so it names only fields
/// that need no typed object.
#[must_use]
pub fn invalid_spec_patch(
    generation: Option<i64>,
    message: &str,
    previous_ready: Option<&Condition>,
    now: Duration,
) -> serde_json::Value {
    let mut ready = condition(ConditionStatus::False, "InvalidSpec", message.to_owned());
    let same = previous_ready.is_some_and(|old| old.status == ready.status && old.reason == ready.reason);
    ready.last_transition_time = Some(
        previous_ready
            .filter(|_| same)
            .and_then(|old| old.last_transition_time.clone())
            .unwrap_or_else(|| rfc3339(now)),
    );
    serde_json::json!({
        "status": {
            "observedGeneration": generation,
            "state": "InvalidSpec",
            "conditions": { condition_type::READY: ready },
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use understudy_core::Epoch;
    use understudy_core::failover::{Input, TransitionKind as MachineKind};

    use super::*;
    use crate::policy::failover_config;

    const NOW: Duration = Duration::from_secs(1_717_243_200); // 2024-06-01T12:00:00Z

    fn spec() -> FailoverPolicySpec {
        serde_yaml::from_str(
            r"
            recoveryObjective: 5m
            pools:
              - name: us-east
                workload: {kind: Deployment, name: vllm-east}
                replicas: 4
              - name: us-west
                workload: {kind: Deployment, name: vllm-west}
                replicas: 4
            ",
        )
        .unwrap()
    }

    fn status_of(record: &OperatorRecord, previous: Option<&FailoverPolicyStatus>) -> FailoverPolicyStatus {
        status_with(record, previous, None, None)
    }

    /// The status for `record`, with what the Lease and the probes add to it.
    fn status_with(
        record: &OperatorRecord,
        previous: Option<&FailoverPolicyStatus>,
        lease_behind: Option<Epoch>,
        probe_accepted: Option<Result<(), &str>>,
    ) -> FailoverPolicyStatus {
        let spec = spec();
        let config = failover_config(&spec).unwrap();
        desired_status(&StatusFacts {
            spec: &spec,
            config: &config,
            generation: Some(3),
            previous,
            record,
            finished: None,
            lease_behind,
            gpu_reserve: None,
            golden_answer: None,
            probe_accepted,
            cold_start: None,
            standby_proof: None,
            load_proof: None,
            parity: None,
            standby_asleep_levels: &[],
            rollout: None,
            now: NOW,
        })
        .unwrap()
    }

    /// The status for `record` under `spec`, with nothing observed but `parity`.
    fn status_under(
        spec: &FailoverPolicySpec,
        record: &OperatorRecord,
        previous: Option<&FailoverPolicyStatus>,
        parity: Option<&ParityStatus>,
    ) -> FailoverPolicyStatus {
        let config = failover_config(spec).unwrap();
        desired_status(&StatusFacts {
            spec,
            config: &config,
            generation: Some(3),
            previous,
            record,
            finished: None,
            lease_behind: None,
            gpu_reserve: None,
            golden_answer: None,
            probe_accepted: None,
            cold_start: None,
            standby_proof: None,
            load_proof: None,
            parity,
            standby_asleep_levels: &[],
            rollout: None,
            now: NOW,
        })
        .unwrap()
    }

    fn record(machine: FailoverState) -> OperatorRecord {
        OperatorRecord {
            machine,
            handled_command: None,
            handed_off: Vec::new(),
        }
    }

    #[test]
    fn a_policy_that_asks_for_load_proofs_is_told_what_the_last_one_of_its_standby_showed() {
        let fresh = record(FailoverState::new());
        assert!(
            !status_of(&fresh, None)
                .conditions
                .contains_key(condition_type::STANDBY_LOAD_PROVEN),
            "absent when the policy does not ask"
        );
        let mut spec = spec();
        spec.load_proof = Some(serde_json::from_value(serde_json::json!({"every": "6h"})).unwrap());
        let standby = spec.pools[1].name.clone();
        let load_proven = |machine: &OperatorRecord, last: Option<(&str, &str)>| {
            let previous = FailoverPolicyStatus {
                load_proof: last.map(|(pool, result)| {
                    LoadProofRecord::new(
                        "2026-12-04T03:00:00Z".to_owned(),
                        pool.to_owned(),
                        result,
                        "TTFT p99 2952 ms, over 2000 ms".to_owned(),
                    )
                }),
                ..FailoverPolicyStatus::default()
            };
            status_under(&spec, machine, Some(&previous), None).conditions
                [condition_type::STANDBY_LOAD_PROVEN]
                .clone()
        };
        let never = load_proven(&fresh, None);
        assert_eq!(
            (never.status, never.reason.as_str()),
            (ConditionStatus::Unknown, "NotYetRun")
        );
        assert!(never.message.contains("every 6h"), "{}", never.message);
        let proven = load_proven(&fresh, Some((&standby, "Proven")));
        assert_eq!(
            (proven.status, proven.reason.as_str()),
            (ConditionStatus::True, "Proven")
        );
        // The machine holds the failure: promotion is blocked, and the condition says so.
        let mut blocked = FailoverState::new();
        blocked.load_proof_failed[Pool::B.index()] = true;
        let failed = load_proven(&record(blocked), Some((&standby, "Failed")));
        assert_eq!(
            (failed.status, failed.reason.as_str()),
            (ConditionStatus::False, "Failed")
        );
        assert!(
            failed.message.contains("promotion is blocked"),
            "{}",
            failed.message
        );
        let not_blocking = load_proven(&fresh, Some((&standby, "Failed")));
        assert_eq!(not_blocking.reason, "FailedNotBlocking");
        // A proof of the pool that is primary now says nothing of the standby.
        let other = load_proven(&fresh, Some((&spec.pools[0].name, "Proven")));
        assert_eq!(other.reason, "NotYetRun");
        // Blocked with no failed record of this standby at hand (the last one did not run): the
        // block is still said.
        let mut blocked = FailoverState::new();
        blocked.load_proof_failed[Pool::B.index()] = true;
        let said = load_proven(&record(blocked), Some((&standby, "NotRun")));
        assert_eq!(
            (said.status, said.reason.as_str()),
            (ConditionStatus::False, "Failed")
        );
        assert!(said.message.contains("promotion is blocked"), "{}", said.message);
        assert_eq!(load_proven(&fresh, Some((&standby, "NotRun"))).reason, "NotRun");
    }

    #[test]
    fn a_policy_that_asks_for_artifact_digests_is_told_whether_the_model_files_were_compared() {
        let machine = record(FailoverState::new());
        let status = status_of(&machine, None);
        assert!(
            !status
                .conditions
                .contains_key(condition_type::ARTIFACT_DIGEST_COMPARED),
            "absent when the policy does not ask"
        );
        let mut spec = spec();
        spec.parity.artifact_digest = Some(ArtifactDigest::Headers);
        let status = status_under(&spec, &machine, None, None);
        let compared = &status.conditions[condition_type::ARTIFACT_DIGEST_COMPARED];
        assert_eq!(
            (compared.status, compared.reason.as_str()),
            (ConditionStatus::False, "NotYetCompared")
        );
        assert!(
            compared.message.contains("(headers) have not been compared yet"),
            "{}",
            compared.message
        );

        let mut parity = ParityStatus {
            checked_at: "2024-06-01T12:00:00Z".to_owned(),
            artifact_keys: 0,
            compared: 4,
            drift: Vec::new(),
            allowed: Vec::new(),
            not_compared: vec![
                "us-west's model files on node gpu-7: no GPU agent on it answered".to_owned(),
                "us-west's runtime: no replica of it is running".to_owned(),
            ],
            model_files: Vec::new(),
        };
        let status = status_under(&spec, &machine, None, Some(&parity));
        let compared = &status.conditions[condition_type::ARTIFACT_DIGEST_COMPARED];
        assert_eq!(
            (
                compared.status,
                compared.reason.as_str(),
                compared.message.as_str()
            ),
            (
                ConditionStatus::False,
                "NotCompared",
                "the pools' model files (headers) were not compared at 2024-06-01T12:00:00Z: \
                 us-west's model files on node gpu-7: no GPU agent on it answered"
            )
        );

        parity.artifact_keys = 3;
        parity.not_compared.clear();
        parity.drift = vec![crate::crd::ParityDrift {
            key: "artifact.model.file.model.safetensors.sha256".to_owned(),
            primary: Some("ab".to_owned()),
            standby: Some("cd".to_owned()),
        }];
        let status = status_under(&spec, &machine, None, Some(&parity));
        let compared = &status.conditions[condition_type::ARTIFACT_DIGEST_COMPARED];
        assert_eq!(
            (compared.status, compared.message.as_str()),
            (
                ConditionStatus::True,
                "the pools' model files (headers) were compared at 2024-06-01T12:00:00Z: 3 keys, 1 drifted"
            )
        );
        let holds = &status.conditions[condition_type::PARITY_HOLDS];
        assert_eq!(holds.status, ConditionStatus::False, "{holds:?}");
    }

    #[test]
    fn a_new_policy_reports_its_home_pool_holding_the_lease_at_epoch_zero() {
        let status = status_of(&record(FailoverState::new()), None);
        assert_eq!(status.primary_pool.as_deref(), Some("us-east"));
        assert_eq!(status.epoch, Some(0));
        assert_eq!(status.state.as_deref(), Some("Serving"));
        assert_eq!(status.observed_generation, Some(3));
        let ready = &status.conditions[condition_type::READY];
        // No router exists to push a route: Ready says what is known, the Lease, and no more.
        assert_eq!(
            (ready.status, ready.reason.as_str()),
            (ConditionStatus::True, "LeaseHeld")
        );
        assert_eq!(
            ready.message,
            "us-east holds the epoch Lease at epoch 0; whether the routers route to it is not recorded here \
             (a router that refuses its route raises a Warning Event)"
        );
        assert_eq!(
            ready.last_transition_time.as_deref(),
            Some("2024-06-01T12:00:00Z")
        );
        // An all-hot standby goes through no stage: detection alone decides, well inside 5m.
        let objective = &status.conditions[condition_type::OBJECTIVE_MET];
        assert_eq!(
            (objective.status, objective.reason.as_str()),
            (ConditionStatus::True, "WithinObjective"),
            "{}",
            objective.message
        );
    }

    /// Seed 004's pools: eight replicas each, the standby `tiers`, the stage `estimates`.
    fn tiered(tiers: &str, estimates: &str) -> FailoverPolicySpec {
        serde_yaml::from_str(&format!(
            "recoveryObjective: 5m\nminServingFraction: 0.5\nprobe: {{interval: 10s, timeout: 5s}}\n\
             trigger: {{hardFailure: {{promoteAfter: 2}}}}\n{estimates}pools:\n\
             - {{name: east, workload: {{kind: Deployment, name: vllm-east}}, replicas: 8}}\n\
             - {{name: west, workload: {{kind: Deployment, name: vllm-west}}, replicas: 8, standby: {tiers}}}\n"
        ))
        .unwrap()
    }

    const SEED_004: &str = "coldStartEstimates: {node: 6m, imagePull: 2m, containerStart: 1s, engineStart: 9s, \
                            weightLoad: 70s, warmup: 60s, apiReady: 5s, firstToken: 2s, wakeLevel1: 25s}\n";
    const FOUR_AND_FOUR: &str = "[{tier: warm, replicas: 4}, {tier: pilotLight, replicas: 4}]";
    const PILOT_LIGHT: &str = "[{tier: pilotLight, replicas: 8}]";

    #[test]
    fn objective_met_comes_from_the_estimates_for_the_standbys_tier_mix() {
        let met = objective_met(&tiered(FOUR_AND_FOUR, SEED_004), Pool::B, &[], &[]);
        assert_eq!(
            (met.status, met.reason.as_str()),
            (ConditionStatus::True, "WithinObjective")
        );
        assert_eq!(
            met.message,
            "4 × warm (level 1) + 4 × pilot light has 4 of 8 replicas serving 1m12s after a fault \
             (detection 45s), within the 5m objective (from spec.coldStartEstimates)"
        );
        let missed = objective_met(&tiered(PILOT_LIGHT, SEED_004), Pool::B, &[], &[]);
        assert_eq!(
            (missed.status, missed.reason.as_str()),
            (ConditionStatus::False, "ObjectiveMissed")
        );
        assert!(
            missed.message.contains("11m12s"),
            "45s + 6m + 267s: {}",
            missed.message
        );
        assert!(
            missed
                .message
                .contains("the pilot light replicas' node stage breaks it"),
            "{}",
            missed.message
        );
    }

    #[test]
    fn a_level_one_replica_put_to_level_two_for_want_of_host_memory_is_counted_at_level_two() {
        // Four warm at level 1 asked; one sleeps at level 2, and one says nothing of its level.
        let levels = [Some(1), Some(2), Some(1), None];
        let unknown = objective_met(&tiered(FOUR_AND_FOUR, SEED_004), Pool::B, &[], &levels);
        assert_eq!(unknown.status, ConditionStatus::Unknown, "{}", unknown.message);
        assert!(
            unknown.message.starts_with("no time for the wakeLevel2 stage"),
            "{}",
            unknown.message
        );
        let estimates = SEED_004.replace("wakeLevel1: 25s", "wakeLevel1: 25s, wakeLevel2: 40s");
        let met = objective_met(&tiered(FOUR_AND_FOUR, &estimates), Pool::B, &[], &levels);
        assert_eq!(
            met.message,
            "3 × warm (level 1) + 4 × pilot light + 1 × warm (level 2) has 4 of 8 replicas serving \
             1m27s after a fault (detection 45s), within the 5m objective (from spec.coldStartEstimates; \
             1 of its level-1 warm replicas sleep at level 2, where a node short of host memory for \
             their weights put them, and are counted so)"
        );
        // A pool that asks for level 2 sleeps there by its own choice.
        let asked = "[{tier: warm, replicas: 4, sleepLevel: 2}, {tier: pilotLight, replicas: 4}]";
        let chosen = objective_met(&tiered(asked, &estimates), Pool::B, &[], &[Some(2), Some(2)]);
        assert!(!chosen.message.contains("host memory"), "{}", chosen.message);
    }

    #[test]
    fn objective_met_is_unknown_naming_the_stage_nobody_measured_or_estimated() {
        let unknown = objective_met(&tiered(FOUR_AND_FOUR, ""), Pool::B, &[], &[]);
        assert_eq!(
            (unknown.status, unknown.reason.as_str()),
            (ConditionStatus::Unknown, "ColdStartNotMeasured")
        );
        assert_eq!(
            unknown.message,
            "no time for the wakeLevel1 stage, which a warm (level 1) replica goes through, so west's \
             recovery time is unknown: none measured yet, and no spec.coldStartEstimates.wakeLevel1"
        );
    }

    #[test]
    fn measured_stages_replace_estimates_and_the_slowest_measurement_counts() {
        let breakdown = |replica: &str, node: f64| ColdStartBreakdown {
            pool: "west".into(),
            replica: replica.into(),
            tier: Some("pilotLight".into()),
            stages: BTreeMap::from([("node".to_owned(), Some(node)), ("warmup".to_owned(), None)]),
        };
        // Nodes came up in 3 and 6 s, not the 6 minutes estimated: pilot light now misses the
        // objective by 18 s, not by 6 minutes (a hang is detected in 45 s).
        let measured = [breakdown("west-0", 3.0), breakdown("west-1", 6.0)];
        let met = objective_met(&tiered(PILOT_LIGHT, SEED_004), Pool::B, &measured, &[]);
        assert_eq!(met.status, ConditionStatus::False, "{}", met.message);
        assert!(
            met.message.contains("5m18s"),
            "45s + 6s node + 267s: {}",
            met.message
        );
        assert!(
            met.message.ends_with(
                "(from measured cold starts, and spec.coldStartEstimates where none was measured)"
            ),
            "{}",
            met.message
        );
    }

    #[test]
    fn the_record_round_trips_through_status() {
        let rec = OperatorRecord {
            machine: FailoverState::starting_at(Pool::B, Epoch(4)),
            handled_command: Some(HandledCommand {
                value: "failover".into(),
            }),
            handed_off: vec![HandedOffStep {
                epoch: Epoch(4),
                step: Step::Route,
                note: "no route was pushed".into(),
                handed_off: true,
            }],
        };
        let status = status_of(&rec, None);
        let loaded = load_record(Some(&status));
        assert_eq!(loaded.machine.unwrap(), Some(rec.machine));
        assert_eq!(loaded.handled_command.unwrap(), rec.handled_command);
        assert_eq!(loaded.handed_off, rec.handed_off);
        let nothing = load_record(None);
        assert_eq!(nothing.machine.unwrap(), None);
        assert_eq!(nothing.handled_command.unwrap(), None);
    }

    #[test]
    fn a_garbled_machine_record_keeps_the_handled_command_readable() {
        let status = FailoverPolicyStatus {
            failover: Some(serde_json::json!({
                "machine": {"primary": "Q"},
                "handledCommand": {"value": "failover@drill-3"},
            })),
            ..FailoverPolicyStatus::default()
        };
        let loaded = load_record(Some(&status));
        assert!(loaded.machine.is_err());
        assert_eq!(
            loaded.handled_command.unwrap(),
            Some(HandledCommand {
                value: "failover@drill-3".into()
            })
        );
        let not_an_object = FailoverPolicyStatus {
            failover: Some(serde_json::json!("garbage")),
            ..FailoverPolicyStatus::default()
        };
        assert!(load_record(Some(&not_an_object)).machine.is_err());
        let no_machine = FailoverPolicyStatus {
            failover: Some(serde_json::json!({"handledCommand": {"value": "failback"}})),
            ..FailoverPolicyStatus::default()
        };
        assert!(load_record(Some(&no_machine)).machine.is_err());
    }

    #[test]
    fn a_lease_behind_the_record_makes_ready_false_with_both_epochs() {
        let rec = record(FailoverState::starting_at(Pool::B, Epoch(7)));
        let status = status_with(&rec, None, Some(Epoch(2)), None);
        let ready = &status.conditions[condition_type::READY];
        assert_eq!(
            (ready.status, ready.reason.as_str()),
            (ConditionStatus::False, "LeaseRegressed")
        );
        assert!(
            ready.message.contains("epoch 2") && ready.message.contains("epoch 7"),
            "{}",
            ready.message
        );
        // The record's epoch stays what it was; the Lease's lower one is not taken.
        assert_eq!(status.epoch, Some(7));
    }

    #[test]
    fn a_rejected_probe_shows_as_probe_accepted_false_with_the_replicas_answer() {
        let rec = record(FailoverState::new());
        let with = |probe_accepted| {
            status_with(&rec, None, None, probe_accepted).conditions[condition_type::PROBE_ACCEPTED].clone()
        };
        let rejected = with(Some(Err("10.0.0.5:8000 answered 404 to the probe")));
        assert_eq!(
            (rejected.status, rejected.reason.as_str()),
            (ConditionStatus::False, "ProbeRejected")
        );
        assert!(
            rejected.message.starts_with("10.0.0.5:8000 answered 404"),
            "{}",
            rejected.message
        );
        let answered = with(Some(Ok(())));
        assert_eq!(
            (answered.status, answered.reason.as_str()),
            (ConditionStatus::True, "Answered")
        );
        assert_eq!(with(None).status, ConditionStatus::Unknown);
    }

    #[test]
    fn transition_time_is_kept_while_a_condition_holds_and_moves_when_it_changes() {
        let earlier = "2024-05-01T00:00:00Z".to_owned();
        let previous = BTreeMap::from([(
            "Ready".to_owned(),
            Condition {
                status: ConditionStatus::True,
                reason: "Serving".into(),
                message: String::new(),
                last_transition_time: Some(earlier.clone()),
            },
        )]);
        let same = BTreeMap::from([(
            "Ready".to_owned(),
            condition(ConditionStatus::True, "PrimarySuspect", String::new()),
        )]);
        let merged = merge_conditions(&previous, same, NOW);
        assert_eq!(merged["Ready"].last_transition_time.as_ref(), Some(&earlier));
        let changed = BTreeMap::from([(
            "Ready".to_owned(),
            condition(ConditionStatus::False, "Stranded", String::new()),
        )]);
        let merged = merge_conditions(&previous, changed, NOW);
        assert_eq!(
            merged["Ready"].last_transition_time.as_deref(),
            Some("2024-06-01T12:00:00Z")
        );
    }

    #[test]
    fn a_promotion_under_way_shows_its_timeline_and_is_not_ready() {
        let spec = spec();
        let config = failover_config(&spec).unwrap();
        // A command promotes only a standby that proved itself.
        let mut machine = FailoverState::new();
        for _ in 0..config.standby_ready_after {
            machine = machine
                .step(
                    &config,
                    NOW,
                    &Input::Check {
                        pool: Pool::B,
                        result: understudy_core::failover::CheckResult::Pass,
                    },
                )
                .0;
        }
        let (machine, _) = machine.step(
            &config,
            NOW,
            &Input::Command(understudy_core::failover::Command::Failover),
        );
        let (machine, _) = machine.step(
            &config,
            NOW + Duration::from_secs(1),
            &Input::StepDone {
                epoch: Epoch(1),
                step: Step::AcquireLease,
            },
        );
        let status = status_of(&record(machine), None);
        assert_eq!(status.state.as_deref(), Some("Promoting"));
        assert_eq!(status.epoch, Some(1));
        assert_eq!(status.primary_pool.as_deref(), Some("us-west"));
        assert_eq!(status.conditions["Ready"].status, ConditionStatus::False);
        let timeline = status.last_failover.unwrap();
        assert_eq!(timeline.kind, TransitionKind::Failover);
        assert_eq!(
            (timeline.from_pool.as_str(), timeline.to_pool.as_str()),
            ("us-east", "us-west")
        );
        assert_eq!(timeline.steps.len(), 1);
        assert_eq!(timeline.steps[0].step, "LeaseClaimed");
        assert_eq!(timeline.steps[0].at, "2024-06-01T12:00:01Z");
        assert_eq!(timeline.finished_at, None);
    }

    #[test]
    fn a_promotion_past_its_deadline_with_nothing_serving_says_the_waiting_room_stays_closed() {
        let spec = spec();
        let config = failover_config(&spec).unwrap();
        let deadline = validate(&spec).unwrap().promotion_deadline();
        let started = NOW - deadline - Duration::from_secs(1);
        let mut machine = FailoverState::new();
        for _ in 0..config.standby_ready_after {
            let pass = Input::Check {
                pool: Pool::B,
                result: understudy_core::failover::CheckResult::Pass,
            };
            machine = machine.step(&config, started, &pass).0;
        }
        let command = Input::Command(understudy_core::failover::Command::Failover);
        machine = machine.step(&config, started, &command).0;
        for step in [Step::AcquireLease, Step::FenceOld, Step::Wake, Step::Scale] {
            let done = Input::StepDone {
                epoch: Epoch(1),
                step,
            };
            machine = machine.step(&config, started, &done).0;
        }
        assert!(matches!(&machine.phase, Phase::Promoting(p) if p.step == Step::AwaitServing));
        let ready = &status_of(&record(machine.clone()), None).conditions["Ready"];
        assert_eq!(ready.status, ConditionStatus::False);
        assert_eq!(ready.reason, "PromotionOverdue");
        assert_eq!(
            ready.message,
            format!(
                "promoting us-west at epoch 1, at step AwaitServing, past the promotion's deadline of \
                 {deadline:?} (the recovery objective less a hang's detection): none of us-west's replicas \
                 answers the generating probe yet: the routers keep the waiting room closed, answering with \
                 Retry-After, and the promotion keeps trying"
            )
        );
        // Started two seconds later, it is still within its deadline.
        let mut earlier = machine;
        if let Phase::Promoting(p) = &mut earlier.phase {
            p.started_at += Duration::from_secs(2);
        }
        let ready = &status_of(&record(earlier), None).conditions["Ready"];
        assert_eq!(ready.reason, "Promoting");
    }

    #[test]
    fn each_step_begins_when_the_one_before_it_ends_and_the_event_tells_the_whole_timeline() {
        let at = |s: u64| NOW + Duration::from_millis(s);
        let promotion = Promotion {
            kind: MachineKind::Failover,
            from: Pool::A,
            to: Pool::B,
            epoch: Epoch(1),
            step: Step::OpenAdmission,
            started_at: at(20_000),
            done: vec![
                (Step::AcquireLease, at(20_100)),
                (Step::Wake, at(45_100)),
                (Step::AwaitServing, at(52_600)),
            ],
            fault_seen_at: Some(at(0)),
        };
        let timeline = timeline(&spec(), &promotion, Some(at(53_000)), &[]);
        assert_eq!(timeline.fault_seen_at.as_deref(), Some("2024-06-01T12:00:00Z"));
        let began: Vec<Option<&str>> = timeline.steps.iter().map(|s| s.started_at.as_deref()).collect();
        // Times in status are whole seconds; the steps' own milliseconds keep the detail.
        assert_eq!(
            began,
            [
                Some("2024-06-01T12:00:20Z"),
                Some("2024-06-01T12:00:20Z"),
                Some("2024-06-01T12:00:45Z")
            ]
        );
        let took: Vec<Option<u64>> = timeline.steps.iter().map(|s| s.milliseconds).collect();
        assert_eq!(took, [Some(100), Some(25_000), Some(7_500)]);
        assert_eq!(
            timeline_note(&timeline),
            "Failover us-east → us-west at epoch 1: fault first seen 2024-06-01T12:00:00Z, decided \
             20s later; LeaseClaimed 0.1s, Woken 25s, Serving 7.5s; done 33s after the decision, 53s \
             after the fault"
        );
    }

    #[test]
    fn the_standby_condition_tells_the_last_proof_of_this_standby() {
        let proof = StandbyProofRecord {
            at: "2024-06-01T11:00:00Z".into(),
            pool: "us-west".into(),
            replica: "10.0.0.7:8000".into(),
            passed: false,
            detail: "woken from sleep level 1, its probe was wrong-output, asleep again".into(),
        };
        let previous = FailoverPolicyStatus {
            standby_proof: Some(proof.clone()),
            ..FailoverPolicyStatus::default()
        };
        let status = status_of(&record(FailoverState::new()), Some(&previous));
        let proven = &status.conditions[condition_type::STANDBY_PROVEN];
        assert!(
            proven.message.ends_with(
                "; last proof 2024-06-01T11:00:00Z failed: 10.0.0.7:8000 woken from sleep level 1, its \
                 probe was wrong-output, asleep again"
            ),
            "{}",
            proven.message
        );
        assert_eq!(status.standby_proof, Some(proof.clone()));
        // A proof of the other pool (before a failover) says nothing about this standby.
        let other = FailoverPolicyStatus {
            standby_proof: Some(StandbyProofRecord {
                pool: "us-east".into(),
                ..proof
            }),
            ..FailoverPolicyStatus::default()
        };
        let status = status_of(&record(FailoverState::new()), Some(&other));
        assert!(
            !status.conditions[condition_type::STANDBY_PROVEN]
                .message
                .contains("last proof")
        );
    }

    #[test]
    fn a_finished_promotion_home_is_a_failback_with_a_finish_time() {
        let promotion = Promotion {
            kind: MachineKind::Manual,
            from: Pool::B,
            to: Pool::A,
            epoch: Epoch(2),
            step: Step::OpenAdmission,
            started_at: NOW,
            done: vec![(Step::AcquireLease, NOW)],
            fault_seen_at: None,
        };
        let timeline = timeline(&spec(), &promotion, Some(NOW + Duration::from_secs(30)), &[]);
        assert_eq!(timeline.kind, TransitionKind::Failback);
        assert_eq!(timeline.finished_at.as_deref(), Some("2024-06-01T12:00:30Z"));
    }

    #[test]
    fn a_timeline_marks_the_steps_nobody_here_carried_out() {
        let promotion = Promotion {
            kind: MachineKind::Adopted,
            from: Pool::A,
            to: Pool::B,
            epoch: Epoch(5),
            step: Step::Scale,
            started_at: NOW,
            done: vec![
                (Step::AcquireLease, NOW),
                (Step::FenceOld, NOW),
                (Step::Wake, NOW),
            ],
            fault_seen_at: None,
        };
        let handed_off = [
            HandedOffStep {
                epoch: Epoch(5),
                step: Step::FenceOld,
                note: "left to the fence sidecars".into(),
                handed_off: true,
            },
            // An older promotion's hand-off says nothing about this one.
            HandedOffStep {
                epoch: Epoch(4),
                step: Step::Wake,
                note: "old".into(),
                handed_off: true,
            },
        ];
        let steps = timeline(&spec(), &promotion, None, &handed_off).steps;
        let marks: Vec<(&str, bool, Option<&str>)> = steps
            .iter()
            .map(|s| (s.step.as_str(), s.handed_off, s.note.as_deref()))
            .collect();
        assert_eq!(
            marks,
            [
                (
                    "LeaseClaimed",
                    false,
                    Some("the Lease was found at this epoch; another writer claimed it")
                ),
                ("Fenced", true, Some("left to the fence sidecars")),
                ("Woken", false, None),
            ]
        );
    }

    #[test]
    fn the_invalid_spec_patch_keeps_the_time_of_an_earlier_identical_report() {
        let earlier = Condition {
            status: ConditionStatus::False,
            reason: "InvalidSpec".into(),
            message: "old".into(),
            last_transition_time: Some("2024-05-01T00:00:00Z".into()),
        };
        let patch = invalid_spec_patch(Some(2), "spec.pools: bad", Some(&earlier), NOW);
        let ready = &patch["status"]["conditions"]["Ready"];
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["reason"], "InvalidSpec");
        assert_eq!(ready["message"], "spec.pools: bad");
        assert_eq!(ready["lastTransitionTime"], "2024-05-01T00:00:00Z");
        assert_eq!(patch["status"]["observedGeneration"], 2);
        let fresh = invalid_spec_patch(Some(2), "spec.pools: bad", None, NOW);
        assert_eq!(
            fresh["status"]["conditions"]["Ready"]["lastTransitionTime"],
            "2024-06-01T12:00:00Z"
        );
    }

    #[test]
    fn with_parity_disabled_a_drift_found_is_neither_shown_nor_held_against_the_standby() {
        let drifted = ParityStatus {
            checked_at: "2024-06-01T11:59:00Z".to_owned(),
            artifact_keys: 0,
            compared: 12,
            drift: vec![crate::crd::ParityDrift {
                key: "flag.max-model-len".to_owned(),
                primary: Some("8192".to_owned()),
                standby: Some("4096".to_owned()),
            }],
            ..ParityStatus::default()
        };
        let machine = record(FailoverState::new());
        let status_for = |spec: &FailoverPolicySpec, previous: Option<&FailoverPolicyStatus>| {
            status_under(spec, &machine, previous, Some(&drifted))
        };
        let enabled = status_for(&spec(), None);
        let holds = &enabled.conditions[condition_type::PARITY_HOLDS];
        assert_eq!(
            (holds.status, holds.reason.as_str()),
            (ConditionStatus::False, "Drift")
        );
        assert_eq!(enabled.parity.as_ref(), Some(&drifted));

        let mut off = spec();
        off.parity.enabled = false;
        let disabled = status_for(&off, Some(&enabled));
        let holds = &disabled.conditions[condition_type::PARITY_HOLDS];
        assert_eq!(
            (holds.status, holds.reason.as_str()),
            (ConditionStatus::Unknown, "Disabled")
        );
        assert_eq!(
            disabled.parity, None,
            "neither this comparison nor the previous status's is shown"
        );
    }
}
