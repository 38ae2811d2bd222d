//! States, inputs, actions and the transition function.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::config::{FailbackPolicy, FailoverConfig};
use crate::{Epoch, Pool};

/// The result of one round of checks of one pool, aggregated over its replicas by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CheckResult {
    /// Enough replicas generated the expected answer within budget.
    Pass,
    /// Weak evidence: timeouts, answers too slow, wrong output, a stall mid-stream.
    SoftFail,
    /// Strong evidence: connection refused or reset, 5xx, engine dead.
    HardFail,
    /// The pool is asleep (vLLM sleep mode) and alive. Fine for a warm standby, a failure for a
    /// primary, which must serve.
    Asleep,
}

/// Evidence from the router's data path about one pool, beside the active checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PassiveSignal {
    /// Every endpoint of the pool refused or reset connections: counts as a hard failed check.
    AllRefused,
    /// Requests timed out or were slow: makes the pool suspect, never promotes on its own.
    Timeouts,
}

/// A deliberate instruction from a person or a game day.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Promote the standby now (a switchover when the primary is healthy).
    Failover,
    /// Give the primary role back to the home pool (pool A).
    Failback,
    /// Promote the standby now even though it has not proven itself (no passing checks, parity
    /// unknown or broken): the last resort when the primary is gone and nothing vouches for the
    /// standby. The lease, the control plane and the dwell still rule.
    ForceFailover,
}

/// Why an executor could not finish a promotion step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepFailure {
    /// The lease's compare-and-set lost: somebody else wrote first.
    LostRace,
    /// The step could not be done now (unreachable API, replicas not serving yet); it is retried.
    Retry,
}

/// What happened to the control plane's store (the Kubernetes API and the lease in it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlPlane {
    #[default]
    Reachable,
    /// Control actions pause; the data path keeps serving the current primary.
    Unreachable,
}

/// What a home observed about a policy's pools, as a probe round or the router's data path
/// reports it: the inputs that only update what the machine knows. Commands, the lease and step
/// reports reach the machine by other ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Observation {
    /// One round of active checks of one pool.
    Check { pool: Pool, result: CheckResult },
    /// A data-path signal about one pool.
    Passive { pool: Pool, signal: PassiveSignal },
    /// Whether the two pools agree on model, tokenizer, runtime and flags.
    Parity { holds: bool },
    /// Whether a pool kept the thresholds of its last load proof (the primary's recorded traffic
    /// replayed against it); `true` also where a failed proof must not block promotion.
    LoadProof { pool: Pool, proven: bool },
}

impl From<Observation> for Input {
    fn from(observation: Observation) -> Input {
        match observation {
            Observation::Check { pool, result } => Input::Check { pool, result },
            Observation::Passive { pool, signal } => Input::Passive { pool, signal },
            Observation::Parity { holds } => Input::Parity { holds },
            Observation::LoadProof { pool, proven } => Input::LoadProof { pool, proven },
        }
    }
}

/// One input to the state machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Input {
    /// One round of active checks of one pool.
    Check { pool: Pool, result: CheckResult },
    /// A data-path signal about one pool.
    Passive { pool: Pool, signal: PassiveSignal },
    /// Whether the two pools agree on model, tokenizer, runtime and flags.
    Parity { holds: bool },
    /// Whether a pool kept the thresholds of its last load proof.
    LoadProof { pool: Pool, proven: bool },
    /// The lease as just read: who holds it, at which epoch.
    LeaseObserved { holder: Pool, epoch: Epoch },
    /// Whether the lease's store can be reached at all.
    ControlPlane(ControlPlane),
    /// A deliberate command.
    Command(Command),
    /// The executor finished a promotion step for the given epoch.
    StepDone { epoch: Epoch, step: Step },
    /// The executor could not finish a promotion step.
    StepFailed {
        epoch: Epoch,
        step: Step,
        reason: StepFailure,
    },
    /// Time passed with nothing else to say.
    Tick,
}

/// The steps of a promotion, in order. Each is recorded when done, and each action is
/// idempotent, so an executor restarted at any step converges without promoting twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Step {
    /// Compare-and-set the lease to the new holder at the next epoch. Fences the old primary.
    AcquireLease,
    /// Tell the old primary it is fenced (its sidecars also see the lease on their own).
    FenceOld,
    /// Wake sleeping replicas of the new primary.
    Wake,
    /// Scale the new primary up to its serving size (pilot light grows here).
    Scale,
    /// Wait until enough of the new primary's replicas serve.
    AwaitServing,
    /// Push the route, with the new epoch, to the routers.
    Route,
    /// Open the admission window that shields the new primary from the prefill storm.
    OpenAdmission,
}

impl Step {
    /// All steps in execution order.
    pub const ALL: [Step; 7] = [
        Step::AcquireLease,
        Step::FenceOld,
        Step::Wake,
        Step::Scale,
        Step::AwaitServing,
        Step::Route,
        Step::OpenAdmission,
    ];

    fn next(self) -> Option<Step> {
        let position = Step::ALL.iter().position(|s| *s == self)?;
        Step::ALL.get(position + 1).copied()
    }
}

/// Why a promotion happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransitionKind {
    /// The primary failed its checks; the standby took over.
    Failover,
    /// The home pool took the primary role back after sustained health.
    Failback,
    /// A person or a game day asked for it.
    Manual,
    /// A person forced it past the standby's eligibility.
    Forced,
    /// The lease moved to a newer epoch we did not write (another operator, a person): the
    /// remaining steps are re-run, idempotently, so the pools match the lease.
    Adopted,
}

impl TransitionKind {
    /// The kind's name, as metrics labels and reports print it.
    pub fn as_str(self) -> &'static str {
        match self {
            TransitionKind::Failover => "failover",
            TransitionKind::Failback => "failback",
            TransitionKind::Manual => "manual",
            TransitionKind::Forced => "forced",
            TransitionKind::Adopted => "adopted",
        }
    }
}

/// A promotion under way: where it goes, at which epoch, and how far it got.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Promotion {
    pub kind: TransitionKind,
    pub from: Pool,
    pub to: Pool,
    /// The epoch this promotion claims: one above the epoch it started from.
    pub epoch: Epoch,
    pub step: Step,
    pub started_at: Duration,
    /// Steps finished so far, with the time each finished: the failover's timeline.
    pub done: Vec<(Step, Duration)>,
    /// When the primary's run of failed checks that led here began; `None` for a promotion no
    /// failure started (a command, an adopted epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_seen_at: Option<Duration>,
}

/// Where the policy stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// The primary serves and passes its checks.
    Serving,
    /// The primary failed some checks, not yet enough to promote.
    Suspect,
    /// The primary failed enough checks to promote, but nothing can be promoted: the standby
    /// is not eligible, the policy is paused, the dwell window is open, or the control plane
    /// cannot be reached. The primary keeps its role; no pool is switched blindly.
    Stranded,
    /// A promotion is under way.
    Promoting(Promotion),
}

/// Consecutive check results of one pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolHealth {
    pub failures: u32,
    pub hard_failures: u32,
    pub passes: u32,
    /// The data path saw timeouts since the last passing check: weak evidence that makes the
    /// primary suspect but never promotes on its own.
    #[serde(default)]
    pub suspect: bool,
    /// When the current run of failures began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failing_since: Option<Duration>,
}

impl PoolHealth {
    fn record(&mut self, result: CheckResult, role: Role, now: Duration) {
        let failed = match (result, role) {
            (CheckResult::Pass, _) | (CheckResult::Asleep, Role::Standby) => None,
            (CheckResult::SoftFail, _) => Some(false),
            (CheckResult::HardFail, _) | (CheckResult::Asleep, Role::Primary) => Some(true),
        };
        match failed {
            None => {
                *self = PoolHealth {
                    failures: 0,
                    hard_failures: 0,
                    passes: self.passes.saturating_add(1),
                    suspect: false,
                    failing_since: None,
                }
            }
            Some(hard) => {
                if self.failures == 0 {
                    self.failing_since = Some(now);
                }
                self.passes = 0;
                self.failures = self.failures.saturating_add(1);
                self.hard_failures = if hard {
                    self.hard_failures.saturating_add(1)
                } else {
                    0
                };
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Primary,
    Standby,
}

/// Something the executor must do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// Compare-and-set the lease from `expected` to `holder` at `epoch`. Done already when the
    /// lease shows `holder` at `epoch`; lost when it shows anything else.
    CompareAndSetLease {
        expected: Epoch,
        holder: Pool,
        epoch: Epoch,
    },
    /// Fence the old primary at the new epoch.
    Fence { pool: Pool, epoch: Epoch },
    /// Wake the pool's sleeping replicas.
    Wake { pool: Pool, epoch: Epoch },
    /// Scale the pool to its serving size.
    Scale { pool: Pool, epoch: Epoch },
    /// Report done once enough of the pool's replicas serve.
    AwaitServing { pool: Pool, epoch: Epoch },
    /// Route user traffic to the pool at the epoch.
    Route { pool: Pool, epoch: Epoch },
    /// Open the admission window on the pool.
    OpenAdmission { pool: Pool, epoch: Epoch },
    /// Tell the user.
    Emit(Event),
}

impl Action {
    fn for_step(step: Step, promotion: &Promotion) -> Action {
        let (pool, epoch) = (promotion.to, promotion.epoch);
        match step {
            Step::AcquireLease => Action::CompareAndSetLease {
                expected: Epoch(epoch.0 - 1),
                holder: pool,
                epoch,
            },
            Step::FenceOld => Action::Fence {
                pool: promotion.from,
                epoch,
            },
            Step::Wake => Action::Wake { pool, epoch },
            Step::Scale => Action::Scale { pool, epoch },
            Step::AwaitServing => Action::AwaitServing { pool, epoch },
            Step::Route => Action::Route { pool, epoch },
            Step::OpenAdmission => Action::OpenAdmission { pool, epoch },
        }
    }
}

/// Something worth telling a user, as a Kubernetes event or a line of simulator output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    PrimarySuspect {
        pool: Pool,
        failures: u32,
    },
    PrimaryRecovered {
        pool: Pool,
    },
    PromotionStarted {
        kind: TransitionKind,
        from: Pool,
        to: Pool,
        epoch: Epoch,
    },
    PromotionFinished {
        kind: TransitionKind,
        to: Pool,
        epoch: Epoch,
    },
    /// The primary is failing and nothing can be promoted; says why.
    PromotionBlocked {
        reason: Blocked,
    },
    CommandRefused {
        command: Command,
        reason: Blocked,
    },
    /// The lease moved under us: we act on nothing until we have read it again.
    LostRace {
        epoch: Epoch,
    },
    /// Someone else's newer epoch was adopted.
    EpochAdopted {
        holder: Pool,
        epoch: Epoch,
    },
    ControlPlaneUnreachable,
    ControlPlaneRestored,
    StepRetried {
        step: Step,
        epoch: Epoch,
    },
}

/// Why a promotion cannot start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Blocked {
    StandbyNotEligible,
    ParityBroken,
    /// The standby failed its last load proof.
    LoadProofFailed,
    Paused,
    Dwell,
    ControlPlaneUnreachable,
    LeaseUnknown,
    AlreadyPromoting,
    AlreadyHome,
    /// The epoch has reached its largest value (a hand-edited lease): no promotion can raise it.
    EpochExhausted,
}

/// Everything the state machine remembers. Serializable, so the operator keeps it in the
/// policy's status and a restarted operator carries on where the last one stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailoverState {
    /// The pool holding the lease.
    pub primary: Pool,
    /// The lease's epoch.
    pub epoch: Epoch,
    pub phase: Phase,
    /// Health of pool A and pool B, by [`Pool::index`].
    pub health: [PoolHealth; 2],
    pub parity_holds: bool,
    /// Pools whose last load proof failed, by [`Pool::index`]; absent from records written before
    /// load proofs.
    #[serde(default)]
    pub load_proof_failed: [bool; 2],
    pub control_plane: ControlPlane,
    /// False after a lost compare-and-set, until the lease has been read again.
    pub lease_known: bool,
    /// When the last promotion finished, for the dwell window.
    pub last_transition_end: Option<Duration>,
}

impl FailoverState {
    /// The state of a new policy: the home pool (A) is primary at epoch 0.
    pub fn new() -> FailoverState {
        FailoverState::starting_at(Pool::A, Epoch(0))
    }

    /// The state when the lease already names `primary` at `epoch`.
    pub fn starting_at(primary: Pool, epoch: Epoch) -> FailoverState {
        FailoverState {
            primary,
            epoch,
            phase: Phase::Serving,
            health: [PoolHealth::default(); 2],
            parity_holds: true,
            load_proof_failed: [false; 2],
            control_plane: ControlPlane::Reachable,
            lease_known: true,
            last_transition_end: None,
        }
    }

    /// The standby pool: the one not holding the lease.
    pub fn standby(&self) -> Pool {
        self.primary.other()
    }

    /// The pool that may serve user traffic now, and the epoch it serves at. `None` between the
    /// lease moving and the new primary's route being pushed: the old primary is fenced and the
    /// new one not yet serving, so the router's waiting room holds requests.
    pub fn routable(&self) -> Option<(Pool, Epoch)> {
        match &self.phase {
            Phase::Promoting(p) if p.step == Step::AcquireLease => Some((p.from, Epoch(p.epoch.0 - 1))),
            Phase::Promoting(p) if p.step <= Step::Route => None,
            _ => Some((self.primary, self.epoch)),
        }
    }

    /// The action of the step a promotion is at, if one is under way and may act now. Each is
    /// idempotent: executors may repeat it after a restart.
    pub fn pending_action(&self) -> Option<Action> {
        match &self.phase {
            Phase::Promoting(p) if self.may_act() => Some(Action::for_step(p.step, p)),
            _ => None,
        }
    }

    fn may_act(&self) -> bool {
        self.lease_known && self.control_plane == ControlPlane::Reachable
    }

    fn health(&self, pool: Pool) -> &PoolHealth {
        &self.health[pool.index()]
    }

    /// Applies one input at time `now` and returns the next state and what to do.
    ///
    /// While a promotion is under way, the output always ends with its pending step's action
    /// (when it may act), so a caller that simply executes what it gets back makes progress.
    #[must_use]
    pub fn step(
        &self,
        config: &FailoverConfig,
        now: Duration,
        input: &Input,
    ) -> (FailoverState, Vec<Action>) {
        let mut next = self.clone();
        let mut actions = Vec::new();
        next.apply(config, now, input, &mut actions);
        if let Some(action) = next.pending_action() {
            actions.push(action);
        }
        (next, actions)
    }

    fn apply(&mut self, config: &FailoverConfig, now: Duration, input: &Input, out: &mut Vec<Action>) {
        match *input {
            Input::Check { pool, result } => {
                let role = if pool == self.primary {
                    Role::Primary
                } else {
                    Role::Standby
                };
                self.health[pool.index()].record(result, role, now);
            }
            Input::Passive { pool, signal } => {
                if pool != self.primary || matches!(self.phase, Phase::Promoting(_)) {
                    return;
                }
                let health = &mut self.health[pool.index()];
                match signal {
                    PassiveSignal::AllRefused => health.record(CheckResult::HardFail, Role::Primary, now),
                    PassiveSignal::Timeouts => health.suspect = true,
                }
            }
            Input::Parity { holds } => self.parity_holds = holds,
            Input::LoadProof { pool, proven } => self.load_proof_failed[pool.index()] = !proven,
            Input::LeaseObserved { holder, epoch } => self.observe_lease(holder, epoch, now, out),
            Input::ControlPlane(reach) => {
                if reach != self.control_plane {
                    self.control_plane = reach;
                    out.push(Action::Emit(match reach {
                        ControlPlane::Reachable => Event::ControlPlaneRestored,
                        ControlPlane::Unreachable => Event::ControlPlaneUnreachable,
                    }));
                }
            }
            Input::Command(command) => self.command(config, now, command, out),
            Input::StepDone { epoch, step } => self.step_done(epoch, step, now, out),
            Input::StepFailed { epoch, step, reason } => {
                let Phase::Promoting(p) = &self.phase else { return };
                if p.epoch != epoch || p.step != step {
                    return; // a stale report about a step already behind us
                }
                match reason {
                    StepFailure::LostRace => {
                        // Somebody else moved the lease. Act on nothing until it is read again.
                        out.push(Action::Emit(Event::LostRace { epoch }));
                        self.phase = Phase::Stranded;
                        self.lease_known = false;
                    }
                    StepFailure::Retry => out.push(Action::Emit(Event::StepRetried { step, epoch })),
                }
            }
            Input::Tick => self.evaluate(config, now, out),
        }
    }

    /// Decides, from everything observed so far, whether the phase changes. Only a tick
    /// decides: observations fed together are judged together, so a stale failure count is
    /// never acted on before the fresh checks that arrived with it have been counted.
    fn evaluate(&mut self, config: &FailoverConfig, now: Duration, out: &mut Vec<Action>) {
        if matches!(self.phase, Phase::Promoting(_)) {
            return;
        }
        let primary = *self.health(self.primary);
        if primary.failures == 0 {
            let next = if primary.suspect {
                Phase::Suspect
            } else {
                Phase::Serving
            };
            if self.phase != next {
                out.push(Action::Emit(match next {
                    Phase::Suspect => Event::PrimarySuspect {
                        pool: self.primary,
                        failures: 0,
                    },
                    _ => Event::PrimaryRecovered { pool: self.primary },
                }));
                self.phase = next;
            }
            self.consider_failback(config, now, out);
            return;
        }
        let promote =
            primary.failures >= config.promote_after || primary.hard_failures >= config.hard_promote_after;
        if !promote {
            let suspect = primary.failures >= config.suspect_after || primary.suspect;
            if suspect && self.phase == Phase::Serving {
                self.phase = Phase::Suspect;
                out.push(Action::Emit(Event::PrimarySuspect {
                    pool: self.primary,
                    failures: primary.failures,
                }));
            }
            return;
        }
        match self.blocked(config, now, true) {
            None => self.start(TransitionKind::Failover, now, out),
            Some(reason) => {
                if self.phase != Phase::Stranded {
                    self.phase = Phase::Stranded;
                    out.push(Action::Emit(Event::PromotionBlocked { reason }));
                }
            }
        }
    }

    fn consider_failback(&mut self, config: &FailoverConfig, now: Duration, out: &mut Vec<Action>) {
        let FailbackPolicy::Automatic { healthy_checks } = config.failback else {
            return;
        };
        if self.primary == Pool::A || self.health(Pool::A).passes < healthy_checks {
            return;
        }
        if self.blocked(config, now, true).is_none() {
            self.start(TransitionKind::Failback, now, out);
        }
    }

    /// Why promoting the standby now is not allowed, if it is not.
    fn blocked(&self, config: &FailoverConfig, now: Duration, automatic: bool) -> Option<Blocked> {
        self.blocked_by_control(config, now, automatic)
            .or_else(|| self.blocked_by_standby(config))
    }

    /// What forbids any promotion, forced or not: the lease, the control plane, pause, dwell.
    fn blocked_by_control(&self, config: &FailoverConfig, now: Duration, automatic: bool) -> Option<Blocked> {
        // A dwell so long that it overflows the clock never closes.
        let dwell_open = self
            .last_transition_end
            .is_some_and(|end| end.checked_add(config.min_dwell).is_none_or(|until| now < until));
        if matches!(self.phase, Phase::Promoting(_)) {
            Some(Blocked::AlreadyPromoting)
        } else if !self.lease_known {
            Some(Blocked::LeaseUnknown)
        } else if self.control_plane == ControlPlane::Unreachable {
            Some(Blocked::ControlPlaneUnreachable)
        } else if automatic && config.paused {
            Some(Blocked::Paused)
        } else if dwell_open {
            Some(Blocked::Dwell)
        } else if self.epoch == Epoch(u64::MAX) {
            Some(Blocked::EpochExhausted)
        } else {
            None
        }
    }

    /// What makes the standby unfit to serve: broken parity, failing checks, too few passes.
    fn blocked_by_standby(&self, config: &FailoverConfig) -> Option<Blocked> {
        let standby = self.health(self.standby());
        if !self.parity_holds {
            Some(Blocked::ParityBroken)
        } else if self.load_proof_failed[self.standby().index()] {
            Some(Blocked::LoadProofFailed)
        } else if standby.failures > 0 || standby.passes < config.standby_ready_after {
            Some(Blocked::StandbyNotEligible)
        } else {
            None
        }
    }

    fn command(&mut self, config: &FailoverConfig, now: Duration, command: Command, out: &mut Vec<Action>) {
        let refusal = match command {
            Command::Failback if self.primary == Pool::A => Some(Blocked::AlreadyHome),
            Command::ForceFailover => self.blocked_by_control(config, now, false),
            Command::Failover | Command::Failback => self.blocked(config, now, false),
        };
        match refusal {
            Some(reason) => out.push(Action::Emit(Event::CommandRefused { command, reason })),
            None => {
                let kind = match command {
                    Command::Failover => TransitionKind::Manual,
                    Command::ForceFailover => TransitionKind::Forced,
                    Command::Failback => TransitionKind::Failback,
                };
                self.start(kind, now, out);
            }
        }
    }

    fn start(&mut self, kind: TransitionKind, now: Duration, out: &mut Vec<Action>) {
        let promotion = Promotion {
            kind,
            from: self.primary,
            to: self.standby(),
            epoch: self.epoch.next(),
            step: Step::AcquireLease,
            started_at: now,
            done: Vec::new(),
            fault_seen_at: self.health[self.primary.index()].failing_since,
        };
        out.push(Action::Emit(Event::PromotionStarted {
            kind,
            from: promotion.from,
            to: promotion.to,
            epoch: promotion.epoch,
        }));
        self.phase = Phase::Promoting(promotion);
    }

    fn step_done(&mut self, epoch: Epoch, step: Step, now: Duration, out: &mut Vec<Action>) {
        let Phase::Promoting(p) = &mut self.phase else {
            return;
        };
        if p.epoch != epoch || p.step != step {
            return; // stale or repeated report: steps are recorded once
        }
        p.done.push((step, now));
        if step == Step::AcquireLease {
            self.primary = p.to;
            self.epoch = p.epoch;
        }
        match step.next() {
            Some(next) => p.step = next,
            None => {
                out.push(Action::Emit(Event::PromotionFinished {
                    kind: p.kind,
                    to: p.to,
                    epoch: p.epoch,
                }));
                self.finish(now);
            }
        }
    }

    fn finish(&mut self, now: Duration) {
        self.phase = Phase::Serving;
        self.last_transition_end = Some(now);
        // Both pools start counting afresh in their new roles.
        self.health = [PoolHealth::default(); 2];
    }

    fn observe_lease(&mut self, holder: Pool, epoch: Epoch, now: Duration, out: &mut Vec<Action>) {
        self.lease_known = true;
        if let Phase::Promoting(p) = &self.phase {
            if p.step == Step::AcquireLease && epoch == p.epoch && holder == p.to {
                // Our compare-and-set went through before we could record it (a restart).
                self.step_done(epoch, Step::AcquireLease, now, out);
                return;
            }
            if epoch < p.epoch || (epoch == p.epoch && holder == p.to) {
                return; // the lease is where this promotion expects it to be
            }
        }
        if epoch > self.epoch || (epoch == self.epoch && holder != self.primary) {
            // Someone else moved the lease. Stop whatever we did, take the lease as the truth,
            // and re-run the steps after the lease write for its holder: each is idempotent, so
            // pools the other writer already woke, scaled and routed are left as they are, and
            // steps it never finished get done.
            out.push(Action::Emit(Event::EpochAdopted { holder, epoch }));
            self.primary = holder;
            self.epoch = epoch;
            self.health = [PoolHealth::default(); 2];
            self.phase = Phase::Promoting(Promotion {
                kind: TransitionKind::Adopted,
                from: holder.other(),
                to: holder,
                epoch,
                step: Step::FenceOld,
                started_at: now,
                done: vec![(Step::AcquireLease, now)],
                fault_seen_at: None,
            });
        }
    }
}

impl Default for FailoverState {
    fn default() -> Self {
        FailoverState::new()
    }
}
