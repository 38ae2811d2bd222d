//! The policy simulator: a failure schedule run through the real failover state machine.
//!
//! Time moves in rounds, a round being one check interval. Each round the simulator first
//! counts what happened to that round's user traffic (served, dropped, or accepted and silently
//! lost), then feeds the round's checks of both pools to the state machine and drives the
//! promotion steps it asks for through core's step driver, with an executor of its own: an
//! in-memory lease and instant pools that finish serving at the end of a round once a promotion
//! has waited `promotion_rounds`. The operator drives the same steps through the same driver.
//!
//! The accounting follows seed 002's model exactly, so with a shallow check and its policy the
//! simulator reproduces that seed's tables; tests compare against a transliteration of the
//! seed's code over random schedules. Nothing here is a second state machine: every decision
//! comes from [`understudy_core::failover`].

pub mod report;
mod schedule;

use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use serde::Serialize;
use understudy_api::crd::FailoverPolicySpec;
use understudy_core::drive::{
    self, Completion, Executor, LeaseClaim, ScaleOrder, ServingOrder, StepOutcome, Target, WakeOrder,
};
use understudy_core::failover::{
    Action, CheckResult, Event, FailbackPolicy, FailoverConfig, FailoverState, Input, Phase, TransitionKind,
};
use understudy_core::quorum::StandbyShape;
use understudy_core::{Epoch, Pool};

pub use schedule::{CheckKind, Condition, Faults, Schedule, ScheduleError, SimFailback, SimPolicy};

/// A schedule's own policy counts in rounds; a round then lasts a second on the machine's clock.
const ROUND: Duration = Duration::from_secs(1);

/// The policy a schedule runs under, as the simulator needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rules {
    /// What the state machine runs on.
    pub config: FailoverConfig,
    /// How long a round (one check interval) lasts on the state machine's clock.
    pub round: Duration,
    /// What the check asks replica A.
    pub check: CheckKind,
    /// Rounds a promotion takes from decision to serving.
    pub promotion_rounds: u32,
}

impl Rules {
    /// The rules of a FailoverPolicy a user would apply: its trigger, dwell and failback, a
    /// round lasting its probe interval, and its generating probes as the check.
    pub fn from_failover_policy(
        spec: &FailoverPolicySpec,
        promotion_rounds: u32,
    ) -> Result<Rules, understudy_api::policy::PolicyError> {
        let policy = understudy_api::policy::validate(spec)?;
        Ok(Rules {
            config: policy.failover,
            round: policy.probe.interval,
            check: CheckKind::Generating,
            promotion_rounds,
        })
    }

    /// The rules of a schedule's own `policy:` section.
    pub fn from_schedule(policy: &SimPolicy) -> Rules {
        Rules {
            config: failover_config(policy),
            round: ROUND,
            check: policy.check,
            promotion_rounds: policy.promotion_rounds,
        }
    }
}

/// What a schedule cost under its policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Outcome {
    /// Promotions of the standby because the primary failed its checks.
    pub failovers: u32,
    /// Failovers whose old primary would have passed the policy's check in the next round.
    pub false_failovers: u32,
    /// Returns of the primary role to replica A.
    pub failbacks: u32,
    /// Rounds spent mid-promotion, with no pool serving.
    pub transition_rounds: u32,
    /// Rounds whose traffic got an error.
    pub dropped: u32,
    /// Rounds whose traffic was accepted by a replica that could not do its work.
    pub silent_lost: u32,
    /// Rounds served correctly.
    pub served: u32,
    /// Every promotion, in order.
    pub transitions: Vec<Transition>,
}

/// One promotion as the simulator saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Transition {
    pub kind: &'static str,
    pub from: Pool,
    pub to: Pool,
    pub epoch: Epoch,
    /// The round whose check decided it.
    pub decided: u32,
    /// The round at whose end the new primary served.
    pub finished: Option<u32>,
}

/// Runs a checked schedule through the failover state machine under its own policy.
pub fn simulate(schedule: &Schedule) -> Result<Outcome, ScheduleError> {
    let policy = schedule.policy.as_ref().ok_or(ScheduleError::NoPolicy)?;
    Ok(simulate_with(schedule, &Rules::from_schedule(policy)))
}

/// Runs a checked schedule through the failover state machine under the given rules.
pub fn simulate_with(schedule: &Schedule, rules: &Rules) -> Outcome {
    Simulation::new(schedule, rules).run()
}

/// What replica A would do with no failover at all: the baseline a policy improves on.
pub fn without_failover(schedule: &Schedule) -> Outcome {
    let mut outcome = Outcome::default();
    for t in 1..=schedule.rounds {
        match schedule.replica_a.condition(t) {
            Condition::Up => outcome.served += 1,
            Condition::HalfFailed => outcome.silent_lost += 1,
            Condition::Unresponsive | Condition::Stopped => outcome.dropped += 1,
        }
    }
    outcome
}

/// The state machine's configuration for a simulated policy.
pub fn failover_config(policy: &SimPolicy) -> FailoverConfig {
    FailoverConfig {
        suspect_after: policy.suspect_after,
        promote_after: policy.promote_after,
        hard_promote_after: policy.hard_promote_after.unwrap_or(policy.promote_after),
        standby_ready_after: policy.standby_ready_after,
        min_dwell: ROUND * policy.min_dwell_rounds,
        failback: match policy.failback {
            SimFailback::Manual => FailbackPolicy::Manual,
            SimFailback::Automatic { healthy_rounds } => FailbackPolicy::Automatic {
                healthy_checks: healthy_rounds,
            },
        },
        paused: false,
    }
}

struct Simulation<'a> {
    schedule: &'a Schedule,
    rules: &'a Rules,
    state: FailoverState,
    /// The lease: holder and epoch. The simulator is its only writer.
    lease: (Pool, Epoch),
    /// The round at whose end the pending "await serving" step is done.
    serving_due: Option<u32>,
    outcome: Outcome,
}

impl<'a> Simulation<'a> {
    fn new(schedule: &'a Schedule, rules: &'a Rules) -> Self {
        Simulation {
            schedule,
            rules,
            state: FailoverState::new(),
            lease: (Pool::A, Epoch(0)),
            serving_due: None,
            outcome: Outcome::default(),
        }
    }

    fn run(mut self) -> Outcome {
        for t in 1..=self.schedule.rounds {
            self.account_traffic(t);
            // The standby's check first: a standby that just became ready is promotable in the
            // same round the primary crosses its threshold.
            let standby = self.state.standby();
            for pool in [standby, standby.other()] {
                let result = self.check(pool, t);
                self.feed(t, Input::Check { pool, result });
            }
            self.feed(t, Input::Tick);
        }
        self.outcome
    }

    /// Counts round `t`'s user traffic against the pool routed at the start of the round.
    fn account_traffic(&mut self, t: u32) {
        let outcome = &mut self.outcome;
        match self.state.routable() {
            _ if matches!(self.state.phase, Phase::Promoting(_)) => {
                outcome.transition_rounds += 1;
                outcome.dropped += 1;
            }
            Some((Pool::A, _)) => match self.schedule.replica_a.condition(t) {
                Condition::Up => outcome.served += 1,
                Condition::HalfFailed => outcome.silent_lost += 1,
                Condition::Unresponsive | Condition::Stopped => outcome.dropped += 1,
            },
            Some((Pool::B, _)) => outcome.served += 1,
            None => outcome.dropped += 1,
        }
    }

    /// What the policy's check sees of `pool` in round `t`. Replica B is always up.
    fn check(&self, pool: Pool, t: u32) -> CheckResult {
        if pool == Pool::B {
            return CheckResult::Pass;
        }
        match (self.schedule.replica_a.condition(t), self.rules.check) {
            (Condition::Up, _) | (Condition::HalfFailed, CheckKind::Shallow) => CheckResult::Pass,
            (Condition::HalfFailed, CheckKind::Generating) | (Condition::Unresponsive, _) => {
                CheckResult::SoftFail
            }
            (Condition::Stopped, _) => CheckResult::HardFail,
        }
    }

    /// Applies one input, then drives the promotion's steps until one has to wait.
    fn feed(&mut self, t: u32, input: Input) {
        let now = self.rules.round * t;
        let (next, actions) = self.state.step(&self.rules.config, now, &input);
        self.state = next;
        let mut events: Vec<Event> = actions
            .into_iter()
            .filter_map(|action| match action {
                Action::Emit(event) => Some(event),
                _ => None, // the pending step's: driven below
            })
            .collect();
        let mut pools = InstantPools {
            lease: &mut self.lease,
            serving_due: &mut self.serving_due,
            round: t,
            promotion_rounds: self.rules.promotion_rounds,
            // Pools become ready only at the end of a round, after its checks: the step the
            // round's tick itself asks for may finish serving, not one reached on the way.
            on_tick: input == Input::Tick,
        };
        let shapes = [StandbyShape::hot(1); 2];
        while let Some(driven) = at_once(drive::drive(
            &self.state,
            &self.rules.config,
            || now,
            &shapes,
            // Its pools serve within the promotion's rounds: no step waits on past a deadline.
            Duration::MAX,
            &mut pools,
        )) {
            pools.on_tick = false;
            self.state = driven.state.clone();
            events.extend(driven.events.iter().cloned());
            if !driven.carries_on() {
                break;
            }
        }
        for event in events {
            self.record(t, event);
        }
    }

    fn record(&mut self, t: u32, event: Event) {
        match event {
            Event::PromotionStarted {
                kind,
                from,
                to,
                epoch,
            } => {
                let outcome = &mut self.outcome;
                match kind {
                    TransitionKind::Failover | TransitionKind::Manual | TransitionKind::Forced => {
                        outcome.failovers += 1;
                    }
                    TransitionKind::Failback => outcome.failbacks += 1,
                    TransitionKind::Adopted => {}
                }
                outcome.transitions.push(Transition {
                    kind: kind.as_str(),
                    from,
                    to,
                    epoch,
                    decided: t,
                    finished: None,
                });
            }
            Event::PromotionFinished { kind, epoch, .. } => {
                let Some(transition) = self
                    .outcome
                    .transitions
                    .iter_mut()
                    .rev()
                    .find(|tr| tr.epoch == epoch)
                else {
                    return;
                };
                transition.finished = Some(t);
                // Retroactively: had the old primary been left alone, would it have passed?
                let old = transition.from;
                if kind == TransitionKind::Failover && self.check(old, t + 1) == CheckResult::Pass {
                    self.outcome.false_failovers += 1;
                }
            }
            _ => {}
        }
    }
}

/// The simulator's pools: one replica each, instant at every step but serving, against a lease
/// the simulator alone writes.
struct InstantPools<'a> {
    lease: &'a mut (Pool, Epoch),
    /// The round at whose end the pending "await serving" step is done.
    serving_due: &'a mut Option<u32>,
    round: u32,
    promotion_rounds: u32,
    /// Whether the step being driven is the one the round's tick asked for.
    on_tick: bool,
}

const SIMULATOR: &str = "simulator";

fn done() -> StepOutcome<()> {
    StepOutcome::Done(Completion::by(SIMULATOR))
}

impl Executor for InstantPools<'_> {
    type Wait = ();

    async fn acquire_lease(&mut self, claim: LeaseClaim) -> StepOutcome<()> {
        if *self.lease == (claim.holder, claim.epoch) {
            done()
        } else if self.lease.1 == claim.expected {
            *self.lease = (claim.holder, claim.epoch);
            done()
        } else {
            StepOutcome::LostRace
        }
    }

    async fn fence_old(&mut self, _: Target) -> StepOutcome<()> {
        done()
    }

    async fn wake(&mut self, _: WakeOrder) -> StepOutcome<()> {
        done()
    }

    async fn scale(&mut self, _: ScaleOrder) -> StepOutcome<()> {
        done()
    }

    async fn await_serving(&mut self, _: ServingOrder) -> StepOutcome<()> {
        let due = *self.serving_due.get_or_insert(self.round + self.promotion_rounds);
        if self.on_tick && self.round >= due {
            *self.serving_due = None;
            done()
        } else {
            StepOutcome::NotYet(())
        }
    }

    async fn route(&mut self, _: Target) -> StepOutcome<()> {
        done()
    }

    async fn open_admission(&mut self, _: Target) -> StepOutcome<()> {
        done()
    }
}

/// The output of a future that is ready when first polled, as every step of [`InstantPools`] is.
fn at_once<F: Future>(future: F) -> F::Output {
    match pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(output) => output,
        Poll::Pending => unreachable!("the simulator's pools never wait"),
    }
}

#[cfg(test)]
mod seed_model;

#[cfg(test)]
mod tests;
