//! What a GameDay reconcile tells people, as Events.

use kube::runtime::events::{Event as KubeEvent, EventType};
use understudy_api::fence_fault::FenceFault;

use super::context::STARTING_DEADLINE;
use crate::command::COMMAND_ANNOTATION;
use crate::crd::Verdict;
use crate::gameday::DRIFT_VARIABLE;

/// Something the reconcile tells the user about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Notice {
    Commanded {
        value: String,
        policy: String,
    },
    /// The primary's serving pods were deleted.
    Crashed {
        pool: String,
        pods: Vec<String>,
    },
    /// The standby was given the drift variable.
    Drifted {
        pool: String,
        run: String,
    },
    /// The drift variable was taken away again.
    DriftTakenBack {
        pool: String,
    },
    /// The primary's fences were told to play a fault.
    FencesFaulted {
        pool: String,
        fault: FenceFault,
        pods: Vec<String>,
    },
    /// The fences' fault was taken away again.
    FencesRestored {
        pool: String,
        pods: Vec<String>,
    },
    Finished {
        run: String,
        verdict: Verdict,
        reason: String,
    },
    RunRefused {
        value: String,
    },
    UnknownCommand {
        value: String,
    },
    Skipped {
        due: String,
        why: String,
    },
    Missed {
        due: String,
    },
    InvalidSpec {
        message: String,
    },
}

pub(super) fn describe(notice: &Notice) -> KubeEvent {
    let (type_, reason, note) = match notice {
        Notice::Commanded { value, policy } => (
            EventType::Normal,
            "CommandGiven",
            format!("gave FailoverPolicy {policy} {COMMAND_ANNOTATION}={value}"),
        ),
        Notice::Drifted { pool, run } => (
            EventType::Warning,
            "FaultInjected",
            format!("drifted {pool}: its serving container rolls out with {DRIFT_VARIABLE}={run}"),
        ),
        Notice::DriftTakenBack { pool } => (
            EventType::Normal,
            "FaultTakenBack",
            format!("took {DRIFT_VARIABLE} away from {pool}'s serving container: it rolls out as before"),
        ),
        Notice::FencesFaulted { pool, fault, pods } => (
            EventType::Warning,
            "FaultInjected",
            format!(
                "{} {pool}: the fences of its {} serving pod(s) ({}) {}",
                match fault {
                    FenceFault::Hang => "hung",
                    FenceFault::WrongAnswers => "half-failed",
                },
                pods.len(),
                pods.join(", "),
                match fault {
                    FenceFault::Hang => "hold every request but the operator's control calls, unanswered",
                    FenceFault::WrongAnswers => "answer every completion at once, and wrongly",
                }
            ),
        ),
        Notice::FencesRestored { pool, pods } => (
            EventType::Normal,
            "FaultTakenBack",
            format!(
                "took the fault away from the fences of {pool}'s {} serving pod(s) ({})",
                pods.len(),
                pods.join(", ")
            ),
        ),
        Notice::Crashed { pool, pods } => (
            EventType::Warning,
            "FaultInjected",
            format!(
                "crashed {pool}: deleted its {} serving pod(s) with no grace period ({})",
                pods.len(),
                pods.join(", ")
            ),
        ),
        Notice::Finished { run, verdict, reason } => (
            if *verdict == Verdict::Passed {
                EventType::Normal
            } else {
                EventType::Warning
            },
            match verdict {
                Verdict::Passed => "RunPassed",
                Verdict::Failed => "RunFailed",
                Verdict::Aborted => "RunAborted",
            },
            format!("run {run}: {reason}"),
        ),
        Notice::RunRefused { value } => (
            EventType::Warning,
            "RunRefused",
            format!("{COMMAND_ANNOTATION}={value:?} not run: a run is under way or the spec cannot run"),
        ),
        Notice::UnknownCommand { value } => (
            EventType::Warning,
            "UnknownCommand",
            format!("{COMMAND_ANNOTATION}={value:?} names no command; use run"),
        ),
        Notice::Skipped { due, why } => (
            EventType::Warning,
            "RunSkipped",
            format!("the run due at {due} was skipped: {why}"),
        ),
        Notice::Missed { due } => (
            EventType::Warning,
            "RunMissed",
            format!(
                "the run due at {due} was skipped: it was more than {} late (the operator was not running)",
                understudy_core::duration::format(STARTING_DEADLINE)
            ),
        ),
        Notice::InvalidSpec { message } => (EventType::Warning, "InvalidSpec", message.clone()),
    };
    KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "GameDay".to_owned(),
        secondary: None,
    }
}
