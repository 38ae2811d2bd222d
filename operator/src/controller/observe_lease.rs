//! Stage 2: read (or create) the epoch Lease and feed the machine the control plane, the Lease
//! and the pools; a Lease below the recorded epoch stops the reconcile here.

use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use understudy_core::failover::{ControlPlane, Input};
use understudy_core::{Epoch, Pool};

use super::context::Context;
use super::dereference::recorded_position;
use super::error::Error;
use super::events::{Notice, publish};
use super::run::{Recorded, Run};
use super::update_status::write_status;
use crate::crd::{FailoverPolicy, FailoverPolicySpec, condition_type};
use crate::lease::{EpochLease, KubeLease, LeaseError, LeaseRecord};
use crate::policy::{pool_by_name, pool_name};
use crate::reconciler::warn;

/// The `Ready` reason for a Lease whose epoch went below the recorded one.
pub(super) const LEASE_REGRESSED: &str = "LeaseRegressed";

/// Reads the epoch Lease; creates it when it does not exist, naming `recorded`: the primary and
/// epoch the policy's status last recorded, so that no epoch is ever reused.
pub(super) async fn read_or_create_lease(
    lease: &impl EpochLease,
    spec: &FailoverPolicySpec,
    recorded: (Pool, Epoch),
) -> Result<(LeaseRecord, bool), LeaseError> {
    if let Some(record) = lease.read().await? {
        return Ok((record, false));
    }
    let (holder, epoch) = recorded;
    match lease.create(pool_name(spec, holder), epoch).await {
        Ok(record) => Ok((record, true)),
        // Created by somebody else between our read and our create: read theirs.
        Err(LeaseError::LostRace) => lease
            .read()
            .await?
            .map(|r| (r, false))
            .ok_or(LeaseError::LostRace),
        Err(error) => Err(error),
    }
}

/// Reads the epoch Lease (creating it when missing) and feeds the machine what is known of the
/// control plane, the Lease and both pools. An unreachable Lease pauses control: the paused state
/// is reported, best effort, and the reconcile ends with that error.
pub(super) async fn observe(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    lease: &KubeLease,
    run: &mut Run<'_>,
    recorded: &Recorded,
) -> Result<LeaseRecord, Error> {
    let spec = &policy.spec;
    let reference = policy.object_ref(&());
    let position = recorded_position(recorded.machine.as_ref(), policy.status.as_ref(), spec);
    let lease_now = match read_or_create_lease(lease, spec, position).await {
        Ok((record, created)) => {
            if created {
                run.notices.push(Notice::LeaseCreated {
                    holder: record.holder.clone(),
                    epoch: record.epoch,
                });
            }
            record
        }
        Err(error) if error.is_unreachable() => {
            // Without a record there is nothing true to report: the epoch is unknown.
            if recorded.machine.is_some() {
                run.feed(Input::ControlPlane(ControlPlane::Unreachable));
                run.feed(Input::Tick);
                // Best effort: the status write likely fails the same way, and the error that
                // matters to the caller is that control is paused.
                if let Err(error) = write_status(ctx, policy, namespace, run, None).await {
                    tracing::warn!(%namespace, policy = %policy.name_any(), %error, "could not report the paused control plane");
                }
                publish(ctx, &reference, spec, &run.notices).await;
            }
            return Err(Error::ControlPlaneUnreachable(error));
        }
        Err(error) => {
            if let LeaseError::Malformed(why) = &error {
                let note = format!("the epoch Lease is malformed and is left as it is: {why}");
                warn(&ctx.shell, &reference, "LeaseMalformed", note).await;
            }
            return Err(Error::Lease(error));
        }
    };
    let Some(holder) = pool_by_name(spec, &lease_now.holder) else {
        let note = format!(
            "the epoch Lease names {:?}, which is neither of this policy's pools",
            lease_now.holder
        );
        warn(&ctx.shell, &reference, "LeaseHolderUnknown", note).await;
        return Err(Error::LeaseHolderUnknown {
            holder: lease_now.holder,
        });
    };
    run.feed(Input::ControlPlane(ControlPlane::Reachable));
    run.feed(Input::LeaseObserved {
        holder,
        epoch: lease_now.epoch,
    });
    // Observations before any command: they happened before this reconcile, and a command is
    // judged on the freshest view of both pools' health.
    for observation in ctx.observations.drain(&ObjectRef::from_obj(policy)) {
        run.feed(observation.into());
    }
    Ok(lease_now)
}

/// Reports a Lease whose epoch went below the recorded one (deleted and recreated by hand,
/// restored from a backup): a Warning Event when the condition is new, and `Ready=False` with
/// reason `LeaseRegressed`. No command is taken, nothing is decided, nothing else is written.
pub(super) async fn report_lease_regressed(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    run: &Run<'_>,
    lease_epoch: Epoch,
) -> Result<(), Error> {
    let already_reported = policy
        .status
        .as_ref()
        .and_then(|s| s.conditions.get(condition_type::READY))
        .is_some_and(|ready| ready.reason == LEASE_REGRESSED);
    write_status(ctx, policy, namespace, run, Some(lease_epoch)).await?;
    let reference = policy.object_ref(&());
    if !already_reported {
        let note = format!(
            "the epoch Lease is at epoch {lease_epoch}, below the recorded epoch {}; no control action \
             is taken until the Lease is back at epoch {} or higher",
            run.machine.epoch, run.machine.epoch
        );
        warn(&ctx.shell, &reference, LEASE_REGRESSED, note).await;
    }
    publish(ctx, &reference, run.spec, &run.notices).await;
    Ok(())
}
