//! The step driver: carries a promotion out, one recorded step at a time, through whatever
//! [`Executor`] a home provides.
//!
//! The state machine says which step a promotion is at ([`FailoverState::pending_action`]);
//! [`drive`] turns that step into one call on the executor, with what the pools' standby tiers
//! ask of it (how many replicas sleep and how deeply, how many pilot-light replicas grow, how
//! many must serve), and feeds the call's outcome back to the machine as its own input. The
//! operator runs it against Kubernetes and the routers, the simulator against a schedule, the
//! local game day against processes on this machine: the order of the steps, what each is asked
//! and what each outcome means are decided here once.
//!
//! Resumable by construction: the driver keeps nothing between calls. Everything it knows is in
//! the [`FailoverState`] it is given, which the home records after every step, and every executor
//! call must be idempotent, so a driver restarted from any recorded state, even one recorded
//! before its last call took effect, converges on the same end without a second epoch: the
//! machine asks to compare-and-set the lease from the epoch it started from, and an executor finds
//! that write already made.
//!
//! No step waits without a deadline. Past the promotion's deadline ([`promotion_deadline`],
//! counted from its start) every order says so (`overdue`), and each step resolves to its
//! documented outcome instead of waiting on:
//!
//! - Wake is done with the replicas that are awake; the rest join the route when they pass.
//! - Scale is done with the replicas that run, when the pool cannot be grown.
//! - AwaitServing is done with whatever replicas serve, below the quorum, so the route moves to
//!   them; with none serving it waits on, and the home says so (the routers keep the waiting room
//!   closed, answering with Retry-After, and a Warning tells why).
//! - Route and OpenAdmission are done once one router holds the route; the rest are brought in
//!   line between promotions.
//! - AcquireLease has no such outcome: without the lease nothing is promoted, and a lease that
//!   cannot be written waits for the control plane. FenceOld never waits: the fences follow the
//!   lease on their own.
//!
//! What the driver must never do: call the executor while the machine may not act (the lease is
//! unknown after a lost race, or the control plane is unreachable), or call any step other than
//! the one pending.

use std::future::Future;
use std::time::Duration;

use crate::failover::{
    Action, ControlPlane, Event, FailoverConfig, FailoverState, Input, Phase, Promotion, Step, StepFailure,
};
use crate::quorum::{SleepLevel, StandbyShape};
use crate::{Epoch, Pool};

/// The compare-and-set that makes a promotion: the lease from `expected` to `holder` at `epoch`.
/// Done already when the lease shows `holder` at `epoch`; lost when it shows anything else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseClaim {
    pub expected: Epoch,
    pub holder: Pool,
    pub epoch: Epoch,
}

/// A step that acts on one pool at the promotion's epoch: the old primary for fencing, the new
/// one for routing and admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub pool: Pool,
    pub epoch: Epoch,
    /// The promotion's deadline, once it has passed: done once one router holds the route.
    pub overdue: Option<Duration>,
}

/// How long a promotion may take from its start before its steps stop waiting for everything they
/// want: what is left of the recovery objective once the failure was detected, and never less than
/// one probe interval, so that a policy whose detection alone spends its objective still gives a
/// promotion a round to finish in.
#[must_use]
pub fn promotion_deadline(objective: Duration, detection: Duration, interval: Duration) -> Duration {
    objective.saturating_sub(detection).max(interval)
}

/// Wake the new primary's sleeping replicas. Asked of every promotion: a pool with no warm tier
/// has nothing asleep (`replicas` is 0), and its executor says so on the timeline without a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WakeOrder {
    pub pool: Pool,
    pub epoch: Epoch,
    /// How many of its replicas sleep; 0 for a pool with no warm tier.
    pub replicas: u32,
    /// How many of them must be awake for the step to be done: as many as the pool's serving
    /// quorum needs beyond its hot replicas. The rest go on waking and join the route when they
    /// pass.
    pub needed: u32,
    /// The deepest level they sleep at (after level 2 the weights are reloaded too): each is woken
    /// at the level its own metrics say, and at this one when they do not.
    pub level: SleepLevel,
    /// The promotion's deadline, once it has passed: done with the replicas that are awake.
    pub overdue: Option<Duration>,
    /// How long is left before the deadline (zero once it has passed): waiting for wakes no
    /// longer than this.
    pub left: Duration,
}

/// Make the new primary run its serving size; the pilot light grows here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleOrder {
    pub pool: Pool,
    pub epoch: Epoch,
    /// The serving size. Never lowers what runs.
    pub replicas: u32,
    /// How many of those were not running as the standby and start cold now.
    pub pilot_light: u32,
    /// The promotion's deadline, once it has passed: done with the replicas that run.
    pub overdue: Option<Duration>,
}

/// Report done once enough of the new primary's replicas serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServingOrder {
    pub pool: Pool,
    pub epoch: Epoch,
    /// Replicas that must serve.
    pub quorum: u32,
    /// Of this many.
    pub replicas: u32,
    /// The promotion's deadline, once it has passed: done with whatever serves, at least one.
    pub overdue: Option<Duration>,
}

/// A step that is finished, and what the home says about it for the failover's timeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// Who made the call: `operator`, `router`, `fence-sidecar`, `simulator`.
    pub carried_by: &'static str,
    /// What the timeline shows beside the step, when anything.
    pub note: Option<String>,
    /// Nobody was called: the step is left to `carried_by`, which acts on its own (the fence
    /// sidecars follow the lease). The promotion moves on, and the note must say so.
    pub handed_off: bool,
}

impl Completion {
    /// Done by `carried_by`, with nothing to add.
    #[must_use]
    pub fn by(carried_by: &'static str) -> Completion {
        Completion {
            carried_by,
            note: None,
            handed_off: false,
        }
    }

    /// Done by `carried_by`, with a note for the timeline.
    #[must_use]
    pub fn noted(carried_by: &'static str, note: String) -> Completion {
        Completion {
            carried_by,
            note: Some(note),
            handed_off: false,
        }
    }

    /// Left to `carried_by`; `note` says what that means.
    #[must_use]
    pub fn handed_off(carried_by: &'static str, note: String) -> Completion {
        Completion {
            carried_by,
            note: Some(note),
            handed_off: true,
        }
    }
}

/// What became of one executor call. `W` is the home's own account of why a step waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepOutcome<W> {
    /// The step is finished; the machine records it and moves to the next.
    Done(Completion),
    /// Not done now (replicas not serving yet, a router refused, an API call failed): the
    /// promotion waits at this step and the home calls again later.
    NotYet(W),
    /// The lease's compare-and-set lost: somebody else wrote first. The machine acts on nothing
    /// until the lease has been read again.
    LostRace,
    /// The control plane could not be reached; the write may or may not have landed. Control
    /// actions pause until it is reachable again, and the next read of the lease tells.
    Unreachable(W),
}

/// What carries a promotion's steps out in one home. One method per step, each idempotent: it
/// may be called again for a step already done (after a restart that lost the record) and must
/// then report it done without doing it twice.
pub trait Executor {
    /// Why a step waits, in the home's own terms.
    type Wait;

    /// Compare-and-set the lease. Fences the old primary: everything that reads the lease stops
    /// taking work from it.
    fn acquire_lease(&mut self, claim: LeaseClaim) -> impl Future<Output = StepOutcome<Self::Wait>> + Send;

    /// Tell the old primary it is fenced at the new epoch.
    fn fence_old(&mut self, old: Target) -> impl Future<Output = StepOutcome<Self::Wait>> + Send;

    /// Wake the new primary's sleeping replicas; done once `needed` of them are awake.
    fn wake(&mut self, order: WakeOrder) -> impl Future<Output = StepOutcome<Self::Wait>> + Send;

    /// Scale the new primary to its serving size.
    fn scale(&mut self, order: ScaleOrder) -> impl Future<Output = StepOutcome<Self::Wait>> + Send;

    /// Done once enough of the new primary's replicas serve.
    fn await_serving(&mut self, order: ServingOrder) -> impl Future<Output = StepOutcome<Self::Wait>> + Send;

    /// Route user traffic to the new primary at the new epoch.
    fn route(&mut self, new: Target) -> impl Future<Output = StepOutcome<Self::Wait>> + Send;

    /// Open the admission window that shields the new primary from the prefill storm.
    fn open_admission(&mut self, new: Target) -> impl Future<Output = StepOutcome<Self::Wait>> + Send;
}

/// One step driven: the machine after its outcome was fed back, and what happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Driven<W> {
    /// The machine after the outcome: record it before driving the next step.
    pub state: FailoverState,
    /// The step that was called, and the epoch of its promotion.
    pub step: Step,
    pub epoch: Epoch,
    pub outcome: StepOutcome<W>,
    /// What the machine had to say about the outcome, in order.
    pub events: Vec<Event>,
    /// The promotion this step finished, with its whole timeline.
    pub finished: Option<Promotion>,
}

impl<W> Driven<W> {
    /// Whether the home may drive the next step now: this one is done and another is pending.
    #[must_use]
    pub fn carries_on(&self) -> bool {
        matches!(self.outcome, StepOutcome::Done(_)) && self.state.pending_action().is_some()
    }
}

/// Drives the promotion's pending step, if one is pending and the machine may act: one call on
/// `executor`, its outcome fed back as the machine's input at the time `now` tells once the call
/// has returned, so the timeline records when each step really finished. `shapes` are the two
/// pools' standby tiers, by [`Pool::index`]; `deadline` is how long the promotion may take from
/// its start before its steps are told they are overdue ([`promotion_deadline`]). `None` when
/// nothing is pending.
pub async fn drive<E: Executor>(
    state: &FailoverState,
    config: &FailoverConfig,
    now: impl Fn() -> Duration,
    shapes: &[StandbyShape; 2],
    deadline: Duration,
    executor: &mut E,
) -> Option<Driven<E::Wait>> {
    let action = state.pending_action()?;
    let left = match &state.phase {
        Phase::Promoting(p) => deadline.saturating_sub(now().saturating_sub(p.started_at)),
        _ => deadline,
    };
    let overdue = left.is_zero().then_some(deadline);
    let (step, epoch, outcome) = match action {
        Action::CompareAndSetLease {
            expected,
            holder,
            epoch,
        } => {
            let claim = LeaseClaim {
                expected,
                holder,
                epoch,
            };
            (Step::AcquireLease, epoch, executor.acquire_lease(claim).await)
        }
        Action::Fence { pool, epoch } => (
            Step::FenceOld,
            epoch,
            executor.fence_old(Target { pool, epoch, overdue }).await,
        ),
        Action::Wake { pool, epoch } => {
            let shape = shapes[pool.index()];
            let order = WakeOrder {
                pool,
                epoch,
                replicas: shape.warm,
                needed: shape.warm_needed(),
                level: shape.sleep_level,
                overdue,
                left,
            };
            (Step::Wake, epoch, executor.wake(order).await)
        }
        Action::Scale { pool, epoch } => {
            let shape = shapes[pool.index()];
            let order = ScaleOrder {
                pool,
                epoch,
                replicas: shape.replicas,
                pilot_light: shape.pilot_light,
                overdue,
            };
            (Step::Scale, epoch, executor.scale(order).await)
        }
        Action::AwaitServing { pool, epoch } => {
            let shape = shapes[pool.index()];
            let order = ServingOrder {
                pool,
                epoch,
                quorum: shape.serving_quorum(),
                replicas: shape.replicas,
                overdue,
            };
            (Step::AwaitServing, epoch, executor.await_serving(order).await)
        }
        Action::Route { pool, epoch } => (
            Step::Route,
            epoch,
            executor.route(Target { pool, epoch, overdue }).await,
        ),
        Action::OpenAdmission { pool, epoch } => (
            Step::OpenAdmission,
            epoch,
            executor.open_admission(Target { pool, epoch, overdue }).await,
        ),
        // Never pending: events come out of `step`, not `pending_action`.
        Action::Emit(_) => return None,
    };
    Some(record(state, config, now(), step, epoch, outcome))
}

/// Feeds one step's outcome back to the machine as its own inputs.
fn record<W>(
    state: &FailoverState,
    config: &FailoverConfig,
    now: Duration,
    step: Step,
    epoch: Epoch,
    outcome: StepOutcome<W>,
) -> Driven<W> {
    let inputs: &[Input] = match &outcome {
        StepOutcome::Done(_) => &[Input::StepDone { epoch, step }],
        StepOutcome::NotYet(_) => &[Input::StepFailed {
            epoch,
            step,
            reason: StepFailure::Retry,
        }],
        StepOutcome::LostRace => &[Input::StepFailed {
            epoch,
            step,
            reason: StepFailure::LostRace,
        }],
        StepOutcome::Unreachable(_) => &[
            Input::StepFailed {
                epoch,
                step,
                reason: StepFailure::Retry,
            },
            Input::ControlPlane(ControlPlane::Unreachable),
        ],
    };
    let before = match &state.phase {
        Phase::Promoting(p) => Some(p),
        _ => None,
    };
    let mut next = state.clone();
    let mut events = Vec::new();
    let mut finished = None;
    for input in inputs {
        let (after, actions) = next.step(config, now, input);
        next = after;
        for action in actions {
            // The trailing action is the next pending step's: the home drives it next.
            let Action::Emit(event) = action else { continue };
            if let (Event::PromotionFinished { .. }, Some(promotion)) = (&event, before) {
                let mut promotion = promotion.clone();
                promotion.done.push((step, now));
                finished = Some(promotion);
            }
            events.push(event);
        }
    }
    Driven {
        state: next,
        step,
        epoch,
        outcome,
        events,
        finished,
    }
}
