//! The Kubernetes home's executor: core's [`Executor`], carried out against the epoch Lease, the
//! pools' workloads, and the components behind [`StepExecutor`](super::StepExecutor) (the routers, the replicas' sleep
//! endpoints, the fence sidecars).
//!
//! The lease step compare-and-sets the Lease on its `resourceVersion`, after writing the promotion
//! to status first (the write-ahead), so that an operator restarted after the Lease moved resumes
//! the promotion instead of adopting the new epoch and skipping its remaining steps. Wake calls
//! the new primary's sleeping replicas ([`crate::wake`]) and times each one; Scale raises the new
//! primary's workload through its scale subresource; AwaitServing counts its replicas that pass
//! the generating probe, and times the first token of each replica woken before it. Where the
//! operator cannot reach the replicas, Wake is handed off and AwaitServing counts ready pods.
//! Every other step goes to [`StepExecutor`](super::StepExecutor).
//!
//! It must never write after losing the compare-and-set, and never claim a call it did not make.

use understudy_core::Pool;
use understudy_core::drive::{
    Completion, Executor, LeaseClaim, ScaleOrder, ServingOrder, StepOutcome, Target, WakeOrder,
};
use understudy_core::failover::Step;
use understudy_core::recovery::Stage;
use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::probe::{Expectation, ProbeReport};
use understudy_prober::sleep::{WakeTimeouts, wake_replica_at_its_level};

use super::context::Context;
use super::error::Error;
use crate::crd::{ColdStartBreakdown, FailoverPolicy, FailoverPolicyStatus, PoolSpec};
use crate::judge::{probe_all, probe_spec};
use crate::lease::{EpochLease, KubeLease, LeaseError, LeaseRecord};
use crate::policy::{pool_name, validate};
use crate::ports::ReplicaEndpoints;
use crate::ports::{StepReport, StepRequest};
use crate::reconciler;
use crate::wake::{self, Woken};
use crate::workload::Workload;

/// Why a step of the Kubernetes executor waits.
#[derive(Debug)]
pub(super) enum Waiting {
    /// Not done yet (replicas not ready, a replica still asleep); the reconciler comes back.
    NotYet(String),
    /// A component refused the step in a way somebody should look at: a Warning Event says why.
    Refused {
        carried_by: &'static str,
        reason: &'static str,
        note: String,
    },
    /// A call failed; the reconcile reports the error once the status is written.
    Failed(Error),
    /// The write-ahead failed: the reconcile stops and writes nothing more.
    Abort(Error),
}

/// One reconcile's executor for one policy.
pub(super) struct KubeExecutor<'a> {
    pub ctx: &'a Context,
    pub policy: &'a FailoverPolicy,
    pub namespace: &'a str,
    pub lease: &'a KubeLease,
    /// The Lease as last read or written in this reconcile.
    pub lease_now: LeaseRecord,
    /// The status to apply before the Lease is written, when status does not record the
    /// promotion yet. Taken by the first compare-and-set that needs it.
    pub write_ahead: Option<FailoverPolicyStatus>,
    /// Whether the write-ahead was applied: the notices it records are true from then on.
    pub wrote_ahead: bool,
    /// The replicas the Wake step woke in this reconcile, each with its pool and its wake timed.
    pub woken: Vec<(Pool, Woken)>,
    /// The first token of each woken replica, once a probe of it passed.
    pub first_tokens: Vec<(String, std::time::Duration)>,
}

type Outcome = StepOutcome<Waiting>;

impl<'a> KubeExecutor<'a> {
    fn pool(&self, pool: Pool) -> &'a PoolSpec {
        // validate() guarantees two pools.
        &self.policy.spec.pools[pool.index()]
    }

    /// `pool`'s workload, in its cluster.
    async fn workload(&self, pool: Pool) -> Result<Workload, Error> {
        let spec = self.pool(pool);
        let client = self.ctx.clusters.client(self.namespace, spec).await?;
        Ok(Workload::new(client, self.namespace, &spec.workload))
    }

    fn workload_error(&self, step: Step, pool: Pool, source: kube::Error) -> Error {
        Error::Workload {
            step,
            workload: self.pool(pool).workload.name.clone(),
            source,
        }
    }

    /// AwaitServing by the generating probe: done when the quorum of the pool's running replicas
    /// answer it right (the golden answer, or any text before one is recorded), not when that
    /// many pods are Ready, since vLLM reports healthy before it can generate.
    async fn await_passing(&mut self, replicas: &dyn ReplicaEndpoints, order: ServingOrder) -> Outcome {
        let pool = self.pool(order.pool);
        let timing = match validate(&self.policy.spec) {
            Ok(validated) => validated.probe,
            Err(error) => return StepOutcome::NotYet(Waiting::NotYet(error.to_string())),
        };
        let expect = self.ctx.expectation(self.policy).unwrap_or(Expectation::NonEmpty);
        let spec = probe_spec(&self.policy.spec.probe, &timing, expect);
        let endpoints = match replicas.resolve(self.namespace, pool).await {
            Ok(endpoints) => endpoints,
            Err(error) => {
                let reason = format!("the replicas of {} cannot be found: {error}", pool.name);
                return StepOutcome::NotYet(Waiting::NotYet(reason));
            }
        };
        let sent = tokio::time::Instant::now();
        let reports = probe_all(&endpoints, &spec).await;
        // What they found is what the route holds, this reconcile and the ones after.
        self.ctx.note_probed(self.policy, order.pool, &reports);
        // A replica still asleep (its wake went on without it, or failed) is woken again; one
        // whose wake is still under way is not called twice.
        let level = pool.standby_shape().sleep_level;
        for report in reports.iter().filter(|r| r.outcome == ProbeOutcome::Asleep) {
            let endpoint = report.endpoint.clone();
            tokio::spawn(async move {
                wake_replica_at_its_level(&endpoint, level, WakeTimeouts::default()).await;
            });
        }
        let passed: Vec<&ProbeReport> = reports
            .iter()
            .filter(|r| matches!(r.outcome, ProbeOutcome::Ok { .. }))
            .collect();
        for report in &passed {
            let (Some(woken), Some(first_token)) = (
                self.woken.iter().find(|(_, w)| w.endpoint == report.endpoint),
                report.first_token,
            ) else {
                continue;
            };
            let replica = report.endpoint.authority();
            if !self.first_tokens.iter().any(|(r, _)| *r == replica) {
                let since_wake = sent.saturating_duration_since(woken.1.at) + first_token;
                self.first_tokens.push((replica, since_wake));
            }
        }
        let passing = passed.len();
        let enough = passing >= order.quorum as usize;
        if enough || (passing > 0 && order.overdue.is_some()) {
            let mut note = format!(
                "{passing} of {} replicas of {} answered the generating probe right",
                order.replicas, pool.name
            );
            if let (false, Some(deadline)) = (enough, order.overdue) {
                note = format!(
                    "past the promotion's deadline of {deadline:?}, the route moves to what serves: \
                     {note}, below the {} needed; the rest join the route as they pass",
                    order.quorum
                );
            }
            return StepOutcome::Done(Completion::noted(OPERATOR, note));
        }
        if let Some(deadline) = order.overdue {
            // Nothing serves: routing nothing is no better than the waiting room, which answers
            // with Retry-After meanwhile.
            return StepOutcome::NotYet(Waiting::Refused {
                carried_by: OPERATOR,
                reason: OVERDUE,
                note: format!(
                    "past the promotion's deadline of {deadline:?}, none of the {} running replicas \
                     of {} answers the generating probe right: the routers keep the waiting room \
                     closed, answering with Retry-After, and the promotion keeps trying",
                    endpoints.len(),
                    pool.name
                ),
            });
        }
        StepOutcome::NotYet(Waiting::NotYet(format!(
            "{passing} of {} replicas of {} answer the generating probe right ({} running), {} needed",
            order.replicas,
            pool.name,
            endpoints.len(),
            order.quorum
        )))
    }

    /// Hands a step to the components behind [`StepExecutor`](super::StepExecutor).
    async fn carry(&self, step: Step, target: Target) -> Outcome {
        let serving = self.ctx.passed(self.policy, target.pool);
        let request = StepRequest {
            policy: self.policy,
            step,
            pool: self.pool(target.pool),
            epoch: target.epoch,
            serving: serving.as_ref(),
            overdue: target.overdue,
        };
        outcome_of(self.ctx.steps.carry_out(request).await)
    }

    /// The breakdowns of the replicas this reconcile woke: each one's wake at its level, and its
    /// first token when a probe of it passed in this reconcile too.
    pub fn woken_breakdowns(&self) -> Vec<ColdStartBreakdown> {
        self.woken
            .iter()
            .map(|(pool, woken)| {
                let spec = self.pool(*pool);
                // Timed at the level the replica itself slept at.
                let stage = match woken.level {
                    1 => Stage::WakeLevel1,
                    _ => Stage::WakeLevel2,
                };
                let replica = woken.endpoint.authority();
                let first_token = self
                    .first_tokens
                    .iter()
                    .find(|(r, _)| *r == replica)
                    .map(|(_, took)| took.as_secs_f64());
                ColdStartBreakdown {
                    pool: spec.name.clone(),
                    replica,
                    tier: Some(WARM.to_owned()),
                    stages: [
                        (stage.as_str().to_owned(), Some(woken.took.as_secs_f64())),
                        (Stage::FirstToken.as_str().to_owned(), first_token),
                    ]
                    .into(),
                }
            })
            .collect()
    }
}

/// The tier a woken replica waited in, as `status.coldStart` names it.
const WARM: &str = "warm";

/// A component's report as the driver takes it.
fn outcome_of(report: StepReport) -> Outcome {
    match report {
        StepReport::Done { carried_by, note } => StepOutcome::Done(Completion {
            carried_by,
            note,
            handed_off: false,
        }),
        StepReport::HandedOff { carried_by, note } => {
            StepOutcome::Done(Completion::handed_off(carried_by, note))
        }
        StepReport::NotYet { reason } => StepOutcome::NotYet(Waiting::NotYet(reason)),
        StepReport::Refused {
            carried_by,
            reason,
            note,
        } => StepOutcome::NotYet(Waiting::Refused {
            carried_by,
            reason,
            note,
        }),
    }
}

const OPERATOR: &str = "operator";

/// The Warning Event's reason while a promotion past its deadline has nothing to route to.
pub(super) const OVERDUE: &str = "PromotionOverdue";

impl Executor for KubeExecutor<'_> {
    type Wait = Waiting;

    async fn acquire_lease(&mut self, claim: LeaseClaim) -> Outcome {
        let holder = pool_name(&self.policy.spec, claim.holder).to_owned();
        if self.lease_now.epoch == claim.epoch && self.lease_now.holder == holder {
            return StepOutcome::Done(Completion::by(OPERATOR));
        }
        if self.lease_now.epoch != claim.expected {
            // The Lease is not where this promotion started from: somebody else moved it.
            return StepOutcome::LostRace;
        }
        if let Some(status) = self.write_ahead.take() {
            let name = self.policy.metadata.name.as_deref().unwrap_or_default();
            if let Err(error) = reconciler::apply_status::<FailoverPolicy, _>(
                &self.ctx.shell,
                self.namespace,
                name,
                None,
                &status,
            )
            .await
            {
                return StepOutcome::NotYet(Waiting::Abort(error.into()));
            }
            self.wrote_ahead = true;
        }
        match self
            .lease
            .compare_and_set(&self.lease_now, &holder, claim.epoch)
            .await
        {
            Ok(record) => {
                self.lease_now = record;
                StepOutcome::Done(Completion::by(OPERATOR))
            }
            Err(LeaseError::LostRace) => StepOutcome::LostRace,
            // The write may or may not have landed; the next read of the Lease tells.
            Err(error) if error.is_unreachable() => {
                StepOutcome::Unreachable(Waiting::Failed(Error::ControlPlaneUnreachable(error)))
            }
            Err(error) => StepOutcome::NotYet(Waiting::Failed(Error::Lease(error))),
        }
    }

    async fn fence_old(&mut self, old: Target) -> Outcome {
        self.carry(Step::FenceOld, old).await
    }

    async fn wake(&mut self, order: WakeOrder) -> Outcome {
        let Some(replicas) = self.ctx.replicas.clone() else {
            let target = Target {
                pool: order.pool,
                epoch: order.epoch,
                overdue: order.overdue,
            };
            return self.carry(Step::Wake, target).await;
        };
        let pool = self.pool(order.pool);
        let waking = wake::wake_pool(
            replicas.as_ref(),
            self.namespace,
            pool,
            WakeTimeouts::default(),
            &order,
        )
        .await;
        self.woken
            .extend(waking.woken.into_iter().map(|w| (order.pool, w)));
        outcome_of(waking.report)
    }

    async fn scale(&mut self, order: ScaleOrder) -> Outcome {
        let scaled = match self.workload(order.pool).await {
            Ok(workload) => workload
                .scale_up_to(order.replicas)
                .await
                .map_err(|source| self.workload_error(Step::Scale, order.pool, source)),
            Err(error) => Err(error),
        };
        match scaled {
            Ok(_) => StepOutcome::Done(Completion::by(OPERATOR)),
            // Past the deadline a pool that cannot be grown serves with what runs.
            Err(error) if let Some(deadline) = order.overdue => {
                let note = format!(
                    "past the promotion's deadline of {deadline:?}, it goes on with the replicas that \
                     run: {} could not be scaled to {}: {error}",
                    self.pool(order.pool).workload.name,
                    order.replicas
                );
                StepOutcome::Done(Completion::noted(OPERATOR, note))
            }
            Err(error) => StepOutcome::NotYet(Waiting::Failed(error)),
        }
    }

    async fn await_serving(&mut self, order: ServingOrder) -> Outcome {
        if let Some(replicas) = self.ctx.replicas.clone() {
            return self.await_passing(replicas.as_ref(), order).await;
        }
        let ready = match self.workload(order.pool).await {
            Ok(workload) => workload
                .ready_replicas()
                .await
                .map_err(|source| self.workload_error(Step::AwaitServing, order.pool, source)),
            Err(error) => Err(error),
        };
        match ready {
            Ok(ready) if ready >= order.quorum => StepOutcome::Done(Completion::by(OPERATOR)),
            Ok(ready) if let (true, Some(deadline)) = (ready > 0, order.overdue) => {
                let note = format!(
                    "past the promotion's deadline of {deadline:?}, the route moves to what is ready: \
                     {ready} of {} replicas of {}, below the {} needed",
                    order.replicas,
                    self.pool(order.pool).name,
                    order.quorum
                );
                StepOutcome::Done(Completion::noted(OPERATOR, note))
            }
            Ok(ready) => StepOutcome::NotYet(Waiting::NotYet(format!(
                "{ready} of {} replicas of {} ready, {} needed",
                order.replicas,
                self.pool(order.pool).name,
                order.quorum
            ))),
            Err(error) => StepOutcome::NotYet(Waiting::Failed(error)),
        }
    }

    async fn route(&mut self, new: Target) -> Outcome {
        self.carry(Step::Route, new).await
    }

    async fn open_admission(&mut self, new: Target) -> Outcome {
        self.carry(Step::OpenAdmission, new).await
    }
}
