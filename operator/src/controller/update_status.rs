//! Stage 7: the status the reconcile's working state makes, applied by server-side apply.

use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use understudy_core::Epoch;

use super::context::Context;
use super::error::Error;
use super::run::Run;
use super::status::{StatusFacts, desired_status};
use crate::crd::{FailoverPolicy, FailoverPolicyStatus};
use crate::reconciler::{self};

/// Applies the status the reconcile's working state makes, with server-side apply, under the
/// write timeout.
pub(super) async fn write_status(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    run: &Run<'_>,
    lease_behind: Option<Epoch>,
) -> Result<(), Error> {
    let status = status_of(ctx, policy, run, lease_behind)?;
    reconciler::apply_status::<FailoverPolicy, _>(&ctx.shell, namespace, &policy.name_any(), None, &status)
        .await?;
    ctx.metrics
        .set_conditions(namespace, &policy.name_any(), &status.conditions);
    Ok(())
}

/// The status the reconcile's working state makes: pure, but for asking the golden answers'
/// source what it keeps.
pub(super) fn status_of(
    ctx: &Context,
    policy: &FailoverPolicy,
    run: &Run<'_>,
    lease_behind: Option<Epoch>,
) -> Result<FailoverPolicyStatus, Error> {
    let probe_accepted = ctx
        .findings
        .as_ref()
        .and_then(|source| source.probe_accepted(&ObjectRef::from_obj(policy)));
    let golden_answer = match &ctx.findings {
        Some(source) => source.golden_answer(&ObjectRef::from_obj(policy)),
        None => policy
            .status
            .as_ref()
            .and_then(|status| status.golden_answer.clone())
            .filter(|golden| golden.fits(&run.spec.probe)),
    };
    let standby_asleep_levels = ctx.asleep_levels(policy, run.machine.standby());
    desired_status(&StatusFacts {
        spec: run.spec,
        config: run.config,
        generation: policy.metadata.generation,
        previous: policy.status.as_ref(),
        record: &run.record(),
        finished: run.finished.as_ref(),
        lease_behind,
        gpu_reserve: run.gpu_reserve.as_ref(),
        golden_answer: golden_answer.as_ref(),
        probe_accepted: probe_accepted
            .as_ref()
            .map(|r| r.as_ref().map_err(String::as_str).copied()),
        cold_start: run.cold_start.as_deref(),
        standby_proof: run.standby_proof.as_ref(),
        load_proof: run.load_proof.as_ref(),
        parity: run.parity.as_ref(),
        standby_asleep_levels: &standby_asleep_levels,
        rollout: run.rollout.as_ref(),
        now: run.now,
    })
    .map(|mut status| {
        status.grants = ctx
            .grants
            .as_ref()
            .and_then(|grants| grants.last(&ObjectRef::from_obj(policy)))
            .map(|granted| granted.status());
        status
    })
    .map_err(Error::Record)
}
