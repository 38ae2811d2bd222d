//! What a reconcile tells the user: its notices, published as Kubernetes Events, best effort.
//!
//! An Event that cannot be written is logged, never a reason to fail a reconcile whose state is
//! already recorded.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event as KubeEvent, EventType};
use understudy_core::failover::{Event as MachineEvent, Step};
use understudy_core::{Epoch, Pool};

use super::context::Context;
use super::status::step_name;
use crate::command::{COMMAND_ANNOTATION, COMMAND_WORDS};
use crate::crd::{FailoverPolicySpec, GpuReserve, RolloutPhase, RolloutRecord};
use crate::policy::pool_name;
use crate::reconciler::send;

/// Something the reconcile tells the user about, as an Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Notice {
    Machine(MachineEvent),
    LeaseCreated {
        holder: String,
        epoch: Epoch,
    },
    Handoff {
        step: Step,
        carried_by: &'static str,
        note: String,
    },
    UnknownCommand {
        value: String,
    },
    /// A `prove-load` command was handled and no proof started, for this reason.
    ProveLoadNotRun(String),
    /// The record of handled commands could not be read, so the annotation was not run.
    CommandNotRun {
        value: String,
    },
    /// Placeholder pods hold, or now hold a different number of, the standby's GPUs.
    ReserveHeld(GpuReserve),
    /// A reserve no longer wanted (its pool is primary and ready, or the spec stopped asking) was
    /// deleted.
    ReserveReleased(GpuReserve),
    /// A forced promotion took the Lease while the standby drifted: what it overrode.
    ParityOverridden(String),
    /// A standby-first rollout came to another phase or target.
    Rollout(RolloutRecord),
    /// `spec.rollout` no longer asks for standby-first: the pool it held rolls as deployed.
    RolloutReleased {
        pool: String,
    },
}

/// Publishes the reconcile's notices as Events, best effort: an Event that cannot be written is
/// logged, never a reason to fail a reconcile whose state is already recorded.
pub(super) async fn publish(
    ctx: &Context,
    reference: &ObjectReference,
    spec: &FailoverPolicySpec,
    notices: &[Notice],
) {
    for notice in notices {
        send(&ctx.shell, reference, &describe(notice, spec)).await;
    }
}

/// The Event a notice becomes.
pub(super) fn describe(notice: &Notice, spec: &FailoverPolicySpec) -> KubeEvent {
    let (type_, reason, note, action) = match notice {
        Notice::LeaseCreated { holder, epoch } => (
            EventType::Normal,
            "LeaseCreated",
            format!("created the epoch Lease: {holder} is primary at epoch {epoch}"),
            "Lease",
        ),
        Notice::Handoff {
            step,
            carried_by,
            note,
        } => (
            EventType::Normal,
            "StepHandedOff",
            format!("{}: handed off to {carried_by}; {note}", step_name(*step)),
            "Promote",
        ),
        Notice::ReserveHeld(reserve) => (
            EventType::Normal,
            "GpuReserveHeld",
            format!(
                "placeholder pods (Deployment {}) hold the GPUs of {} pilot-light replicas of {}",
                reserve.deployment, reserve.replicas, reserve.pool
            ),
            "Reserve",
        ),
        Notice::ReserveReleased(reserve) => (
            EventType::Normal,
            "GpuReserveReleased",
            format!(
                "deleted Deployment {}: the GPUs held for {} are released",
                reserve.deployment, reserve.pool
            ),
            "Reserve",
        ),
        Notice::ParityOverridden(note) => (EventType::Warning, "ParityOverridden", note.clone(), "Promote"),
        Notice::Rollout(record) => {
            let (type_, reason) = match record.phase {
                RolloutPhase::UpToDate => (EventType::Normal, "RolloutUpToDate"),
                RolloutPhase::Holding => (EventType::Normal, "RolloutHeld"),
                RolloutPhase::Proving => (EventType::Normal, "RolloutProving"),
                RolloutPhase::Rolling => (EventType::Normal, "RolloutStarted"),
                RolloutPhase::Stopped => (EventType::Warning, "RolloutStopped"),
            };
            let change = if record.change.is_empty() {
                String::new()
            } else {
                format!(" (primary {}: {})", record.pool, record.change)
            };
            (type_, reason, format!("{}{change}", record.message), "Rollout")
        }
        Notice::RolloutReleased { pool } => (
            EventType::Normal,
            "RolloutReleased",
            format!("spec.rollout is no longer standbyFirst: {pool}'s workload rolls as it is deployed"),
            "Rollout",
        ),
        Notice::ProveLoadNotRun(why) => (
            EventType::Warning,
            "ProveLoadNotRun",
            format!("the prove-load command started no load proof: {why}"),
            "Command",
        ),
        Notice::UnknownCommand { value } => (
            EventType::Warning,
            "UnknownCommand",
            format!("{COMMAND_ANNOTATION}={value:?} names no command; use {COMMAND_WORDS}"),
            "Command",
        ),
        Notice::CommandNotRun { value } => (
            EventType::Warning,
            "CommandNotRun",
            format!(
                "{COMMAND_ANNOTATION}={value:?} was not run: the record of handled commands was \
                 unreadable, so whether it ran before is unknown; give it again with a new @token"
            ),
            "Command",
        ),
        Notice::Machine(event) => describe_machine_event(event, spec),
    };
    KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: action.to_owned(),
        secondary: None,
    }
}

/// What the state machine's event says, in the policy's own pool names.
fn describe_machine_event(
    event: &MachineEvent,
    spec: &FailoverPolicySpec,
) -> (EventType, &'static str, String, &'static str) {
    let name = |pool: Pool| pool_name(spec, pool).to_owned();
    match event {
        MachineEvent::PrimarySuspect { pool, failures } => (
            EventType::Warning,
            "PrimarySuspect",
            format!("{} failed {failures} checks in a row", name(*pool)),
            "Check",
        ),
        MachineEvent::PrimaryRecovered { pool } => (
            EventType::Normal,
            "PrimaryRecovered",
            format!("{} passes its checks again", name(*pool)),
            "Check",
        ),
        MachineEvent::PromotionStarted {
            kind,
            from,
            to,
            epoch,
        } => (
            EventType::Normal,
            "PromotionStarted",
            format!(
                "{kind:?}: promoting {} over {} at epoch {epoch}",
                name(*to),
                name(*from)
            ),
            "Promote",
        ),
        MachineEvent::PromotionFinished { kind, to, epoch } => (
            EventType::Normal,
            "PromotionFinished",
            format!("{kind:?}: {} is primary at epoch {epoch}", name(*to)),
            "Promote",
        ),
        MachineEvent::PromotionBlocked { reason } => (
            EventType::Warning,
            "PromotionBlocked",
            format!("the primary is failing and nothing can be promoted: {reason:?}"),
            "Promote",
        ),
        MachineEvent::CommandRefused { command, reason } => (
            EventType::Warning,
            "CommandRefused",
            format!("{command:?} refused: {reason:?}"),
            "Command",
        ),
        MachineEvent::LostRace { epoch } => (
            EventType::Warning,
            "LostRace",
            format!("another writer moved the epoch Lease before epoch {epoch} could be claimed"),
            "Promote",
        ),
        MachineEvent::EpochAdopted { holder, epoch } => (
            EventType::Normal,
            "EpochAdopted",
            format!(
                "the epoch Lease names {} at epoch {epoch}; adopted",
                name(*holder)
            ),
            "Lease",
        ),
        MachineEvent::ControlPlaneUnreachable => (
            EventType::Warning,
            "ControlPlaneUnreachable",
            "the epoch Lease cannot be read; control actions are paused, the primary keeps serving"
                .to_owned(),
            "Lease",
        ),
        MachineEvent::ControlPlaneRestored => (
            EventType::Normal,
            "ControlPlaneRestored",
            "the epoch Lease can be read again".to_owned(),
            "Lease",
        ),
        MachineEvent::StepRetried { step, epoch } => (
            EventType::Normal,
            "StepWaiting",
            format!("{} at epoch {epoch} is not done yet; retrying", step_name(*step)),
            "Promote",
        ),
    }
}
