//! The working state of one reconcile of a valid policy, which each stage reads and adds to,
//! and what status recorded as the reconcile starts from it.

use std::time::Duration;

use understudy_core::drive::{Driven, StepOutcome};
use understudy_core::failover::{
    Action as MachineAction, FailoverConfig, FailoverState, Input, Phase, Promotion, Step, TransitionKind,
};
use understudy_core::{Epoch, Pool};

use super::events::Notice;
use super::executor::Waiting;
use super::status::{HandedOffStep, OperatorRecord};
use crate::command::HandledCommand;
use crate::crd::{
    ColdStartBreakdown, FailoverPolicySpec, GpuReserve, LoadProofRecord, ParityDrift, ParityStatus,
    RolloutRecord, StandbyProofRecord,
};
use crate::parity;

/// The working state of one reconcile of a valid policy.
pub(super) struct Run<'a> {
    pub(super) spec: &'a FailoverPolicySpec,
    pub(super) config: &'a FailoverConfig,
    pub(super) now: Duration,
    pub(super) machine: FailoverState,
    pub(super) notices: Vec<Notice>,
    /// A promotion that finished during this reconcile.
    pub(super) finished: Option<Promotion>,
    /// The latest promotion's steps that were left to other components, or carried out with a
    /// note.
    pub(super) handed_off: Vec<HandedOffStep>,
    /// The GPU reserve held, as the status last recorded it and this reconcile left it.
    pub(super) gpu_reserve: Option<GpuReserve>,
    /// Where a standby-first rollout stands, as the status last recorded it and this reconcile
    /// left it.
    pub(super) rollout: Option<RolloutRecord>,
    /// A rollout waits for a load proof of the standby on its new template that has not started
    /// since the standby has run it (from then).
    pub(super) proof_wanted_since: Option<Duration>,
    /// The command annotation's value handled last, as this reconcile leaves it.
    pub(super) handled_command: Option<HandledCommand>,
    /// `status.coldStart` with this reconcile's measurements in; `None` when none were taken.
    pub(super) cold_start: Option<Vec<ColdStartBreakdown>>,
    /// The standby proof this reconcile ran.
    pub(super) standby_proof: Option<StandbyProofRecord>,
    /// The load proof this reconcile took in.
    pub(super) load_proof: Option<LoadProofRecord>,
    /// A `prove-load` command asked for a load proof now.
    pub(super) prove_load_now: bool,
    /// The last comparison of the pools, read once per reconcile so that status, the drift
    /// Events and the standby's keeper all see the same one: a promotion forced past its drift
    /// says so.
    pub(super) parity: Option<ParityStatus>,
}

impl Run<'_> {
    /// The keys the standby drifts in, as last compared.
    pub(super) fn parity_drift(&self) -> &[ParityDrift] {
        self.parity.as_ref().map_or(&[], |p| p.drift.as_slice())
    }

    pub(super) fn feed(&mut self, input: Input) {
        let (next, actions) = self.machine.step(self.config, self.now, &input);
        for action in actions {
            // The pending step's action is carried out by the driver.
            if let MachineAction::Emit(event) = action {
                self.notices.push(Notice::Machine(event));
            }
        }
        self.machine = next;
    }

    /// Takes in one step the driver carried out: the machine after it, its events, the step's
    /// note for the timeline, and the promotion it finished.
    pub(super) fn take(&mut self, driven: Driven<Waiting>) -> StepOutcome<Waiting> {
        self.machine = driven.state;
        self.notices
            .extend(driven.events.into_iter().map(Notice::Machine));
        if driven.finished.is_some() {
            self.finished = driven.finished;
        }
        if let StepOutcome::Done(done) = &driven.outcome {
            let forced =
                matches!(&self.machine.phase, Phase::Promoting(p) if p.kind == TransitionKind::Forced);
            if driven.step == Step::AcquireLease && forced && !self.parity_drift().is_empty() {
                let note = format!(
                    "promoted by force-failover past parity drift: {}",
                    parity::drift_line(self.parity_drift())
                );
                self.notices.push(Notice::ParityOverridden(note.clone()));
                self.note_step(driven.epoch, driven.step, note, false);
            }
            if let Some(note) = &done.note {
                self.note_step(driven.epoch, driven.step, note.clone(), done.handed_off);
            }
            if done.handed_off {
                self.notices.push(Notice::Handoff {
                    step: driven.step,
                    carried_by: done.carried_by,
                    note: done.note.clone().unwrap_or_default(),
                });
            }
        }
        driven.outcome
    }

    fn note_step(&mut self, epoch: Epoch, step: Step, note: String, handed_off: bool) {
        // Only the latest promotion's notes are shown; older ones are history.
        self.handed_off.retain(|h| h.epoch == epoch && h.step != step);
        self.handed_off.push(HandedOffStep {
            epoch,
            step,
            note,
            handed_off,
        });
    }

    /// `pool`'s last load proof: the one this reconcile took in, else the one status holds; a
    /// proof of the other pool (from before a promotion) is none of this one's.
    pub(super) fn last_load_proof<'p>(
        &'p self,
        policy: &'p crate::crd::FailoverPolicy,
        pool: &str,
    ) -> Option<&'p LoadProofRecord> {
        self.load_proof
            .as_ref()
            .or_else(|| policy.status.as_ref().and_then(|s| s.load_proof.as_ref()))
            .filter(|p| p.pool == pool)
    }

    pub(super) fn pool_spec(&self, pool: Pool) -> &crate::crd::PoolSpec {
        // validate() guarantees two pools.
        &self.spec.pools[pool.index()]
    }

    pub(super) fn record(&self) -> OperatorRecord {
        OperatorRecord {
            machine: self.machine.clone(),
            handled_command: self.handled_command.clone(),
            handed_off: self.handed_off.clone(),
        }
    }
}

/// What status recorded, as the reconcile starts from it.
pub(super) struct Recorded {
    /// The state machine as status last recorded it; `None` for a new policy or an unreadable
    /// record, when the Lease, fed next, is the authority.
    pub(super) machine: Option<FailoverState>,
    /// Whether the record of handled commands could be read: when it cannot, whether a command
    /// ran before is unknown and none is run.
    pub(super) command_record_readable: bool,
}
