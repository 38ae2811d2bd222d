//! Stage 1: read what status recorded (the machine, the handled command, the timeline's notes,
//! the reserve) into the reconcile's working state.

use std::time::Duration;

use kube::ResourceExt;
use understudy_core::failover::{FailoverConfig, FailoverState};
use understudy_core::{Epoch, Pool};

use super::run::{Recorded, Run};
use super::status::load_record;
use crate::crd::{FailoverPolicy, FailoverPolicySpec, FailoverPolicyStatus};
use crate::policy::pool_by_name;

/// Reads what status recorded into the reconcile's working state: the machine (or a fresh one,
/// when it is missing or unreadable), the handled command, the timeline's notes, the reserve.
pub(super) fn dereference<'a>(
    policy: &'a FailoverPolicy,
    config: &'a FailoverConfig,
    now: Duration,
    namespace: &str,
) -> (Run<'a>, Recorded) {
    let name = policy.name_any();
    let stored = load_record(policy.status.as_ref());
    let machine = stored.machine.unwrap_or_else(|error| {
        // Start afresh at the home pool and epoch 0: the Lease, fed below, is the authority, and a
        // newer epoch in it is adopted by re-running the steps after the lease write.
        tracing::warn!(%namespace, policy = %name, %error, "status.failover.machine unreadable; adopting the lease");
        None
    });
    let (handled_command, command_record_readable) = match stored.handled_command {
        Ok(handled) => (handled, true),
        Err(error) => {
            tracing::warn!(%namespace, policy = %name, %error, "status.failover.handledCommand unreadable");
            (None, false)
        }
    };
    let run = Run {
        spec: &policy.spec,
        config,
        now,
        machine: machine.clone().unwrap_or_default(),
        notices: Vec::new(),
        finished: None,
        handed_off: stored.handed_off,
        gpu_reserve: policy.status.as_ref().and_then(|s| s.gpu_reserve.clone()),
        rollout: policy.status.as_ref().and_then(|s| s.rollout.clone()),
        proof_wanted_since: None,
        handled_command,
        cold_start: None,
        standby_proof: None,
        load_proof: None,
        prove_load_now: false,
        parity: None,
    };
    let recorded = Recorded {
        machine,
        command_record_readable,
    };
    (run, recorded)
}

/// The primary and epoch the status last recorded: the machine's when it reads, else the plain
/// `primaryPool` and `epoch` fields, else the home pool at epoch 0.
pub(super) fn recorded_position(
    machine: Option<&FailoverState>,
    status: Option<&FailoverPolicyStatus>,
    spec: &FailoverPolicySpec,
) -> (Pool, Epoch) {
    if let Some(machine) = machine {
        return (machine.primary, machine.epoch);
    }
    let from_status = status.and_then(|s| {
        let pool = pool_by_name(spec, s.primary_pool.as_deref()?)?;
        Some((pool, Epoch(s.epoch?)))
    });
    from_status.unwrap_or((Pool::A, Epoch(0)))
}
