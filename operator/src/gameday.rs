//! The run of a game day, as a state machine: Scheduled → CheckingSteadyState → Injected →
//! Recovered → (HoldingOnStandby → FailingBack →) Done, or Aborted / Failed with a reason.
//!
//! Pure: it reads a [`PolicyView`] (what the FailoverPolicy's status says) and the time it is
//! given, updates the run record that `GameDay.status` shows, and says which command the policy
//! should be given. The controller ([`controller`]) does the reading and writing. The record is
//! the CRD's own type, which is why this lives in the operator and not in core.
//!
//! What a run must never do: inject while the steady state does not hold, or take any action on
//! the policy other than its own `failover` and `failback` commands, which the policy carries out
//! (or refuses) behind its fencing epoch. A run that stops does not undo a promotion in progress:
//! the policy finishes it and keeps a primary throughout.

pub mod controller;
pub mod load;

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::command::{COMMAND_ANNOTATION, HandledCommand, pending_command};
use crate::reconciler::rfc3339;
use understudy_api::fence_fault::FenceFault;

use crate::crd::{
    Condition, ConditionStatus, FailoverPolicy, FailoverTimeline, Fault, GameDayFailbackMode, GameDayRun,
    GameDaySpec, LoadProofRecord, RecoveryTimeline, RunPhase, RunTransition, RunTrigger, TransitionKind,
    Verdict, condition_type,
};

/// The policy's `minDwell` is counted from a finish time recorded to the second; waiting one
/// second more makes sure the policy's own clock agrees the dwell is over.
const DWELL_MARGIN: Duration = Duration::from_secs(1);

/// What a run needs from the GameDay's spec, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// What a run injects.
    pub fault: Fault,
    pub max_recovery: Duration,
    /// `None`: failback is manual.
    pub failback_after: Option<Duration>,
    pub ready_for: Option<Duration>,
    pub stop: Option<StopLimits>,
}

/// `spec.stopConditions`, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct StopLimits {
    pub max_error_rate: Option<f64>,
    pub max_ttft_p99: Option<Duration>,
    pub window: Duration,
    pub min_requests: u64,
}

impl StopLimits {
    /// What fired over a window in which the routers counted `window`, if anything: the reason,
    /// with the numbers. Too few requests judge nothing.
    #[must_use]
    pub fn fired(&self, window: &load::Counters) -> Option<String> {
        if window.sent < self.min_requests {
            return None;
        }
        let span = understudy_core::duration::format(self.window);
        #[allow(clippy::cast_precision_loss, reason = "request counts are far below 2^52")]
        let rate = window.failed as f64 / window.sent as f64;
        if let Some(max) = self.max_error_rate
            && rate > max
        {
            return Some(format!(
                "stop condition: {:.1}% of the last {span}'s {} requests failed ({} of them), above maxErrorRate {:.1}%",
                rate * 100.0,
                window.sent,
                window.failed,
                max * 100.0
            ));
        }
        if let (Some(max), Some(p99)) = (self.max_ttft_p99, window.ttft_p99())
            && p99 > max
        {
            let p99 = if p99 == Duration::MAX {
                "beyond the routers' last bucket".to_owned()
            } else {
                understudy_core::duration::format(p99)
            };
            return Some(format!(
                "stop condition: the last {span}'s 99th percentile time to first token was {p99}, above maxTtftP99 ({})",
                understudy_core::duration::format(max)
            ));
        }
        None
    }
}

impl RunConfig {
    /// Parses the spec's durations; the schema has checked them, this reports any it did not.
    pub fn from_spec(spec: &GameDaySpec) -> Result<Self, String> {
        let max_recovery = spec
            .max_recovery
            .parse()
            .map_err(|e| format!("maxRecovery: {e}"))?;
        let failback_after = match (spec.failback.mode, &spec.failback.after) {
            (GameDayFailbackMode::Manual, _) => None,
            (GameDayFailbackMode::After, Some(after)) => {
                Some(after.parse().map_err(|e| format!("failback.after: {e}"))?)
            }
            (GameDayFailbackMode::After, None) => {
                return Err("failback.after is required when failback.mode is after".to_owned());
            }
        };
        let ready_for = spec
            .steady_state
            .ready_for
            .as_ref()
            .map(|d| d.parse().map_err(|e| format!("steadyState.readyFor: {e}")))
            .transpose()?;
        let stop = spec
            .stop_conditions
            .as_ref()
            .map(|stop| -> Result<StopLimits, String> {
                Ok(StopLimits {
                    max_error_rate: stop.max_error_rate,
                    max_ttft_p99: stop
                        .max_ttft_p99
                        .as_ref()
                        .map(|d| d.parse().map_err(|e| format!("stopConditions.maxTtftP99: {e}")))
                        .transpose()?,
                    window: stop
                        .window
                        .parse()
                        .map_err(|e| format!("stopConditions.window: {e}"))?,
                    min_requests: u64::from(stop.min_requests),
                })
            })
            .transpose()?;
        Ok(RunConfig {
            fault: spec.fault,
            max_recovery,
            failback_after,
            ready_for,
            stop,
        })
    }
}

/// What a FailoverPolicy's status and metadata say, as a run reads them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyView {
    /// The home primary (the first pool) and the home standby (the second).
    pub home: String,
    pub home_standby: String,
    pub primary: Option<String>,
    pub epoch: Option<u64>,
    pub state: Option<String>,
    pub ready: Option<Condition>,
    pub standby_proven: Option<Condition>,
    pub parity: Option<Condition>,
    pub last_transition: Option<FailoverTimeline>,
    /// The policy's `spec.loadProof` is set, and its last load proof.
    pub sets_load_proof: bool,
    pub load_proof: Option<LoadProofRecord>,
    /// The `understudy.dev/command` annotation on the policy.
    pub command: Option<String>,
    /// The last command value the policy handled.
    pub handled_command: Option<String>,
    /// The policy's `trigger.minDwell`.
    pub min_dwell: Duration,
    /// Another game day with a run under way on this policy.
    pub claimed_by: Option<String>,
    /// The game day the policy's `understudy.dev/game-day` annotation names: whose command the
    /// policy was last given by a game day, whether or not that run is still under way.
    pub claim: Option<String>,
    /// The policy's `spec.paused`: under maintenance, no game day starts.
    pub paused: bool,
    /// The policy has a deletion timestamp: it is going away.
    pub deleting: bool,
}

impl PolicyView {
    /// Reads a policy; `claimed_by` is another game day the controller found running on it.
    #[must_use]
    pub fn of(policy: &FailoverPolicy, command: Option<&str>, claimed_by: Option<String>) -> Self {
        let pool = |i: usize| {
            policy
                .spec
                .pools
                .get(i)
                .map(|p| p.name.clone())
                .unwrap_or_default()
        };
        let status = policy.status.clone().unwrap_or_default();
        let handled_command = status
            .failover
            .as_ref()
            .and_then(|f| f.pointer("/handledCommand/value"))
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned);
        PolicyView {
            home: pool(0),
            home_standby: pool(1),
            primary: status.primary_pool,
            epoch: status.epoch,
            state: status.state,
            ready: status.conditions.get(condition_type::READY).cloned(),
            standby_proven: status.conditions.get(condition_type::STANDBY_PROVEN).cloned(),
            parity: status.conditions.get(condition_type::PARITY_HOLDS).cloned(),
            last_transition: status.last_failover,
            sets_load_proof: policy.spec.load_proof.is_some(),
            load_proof: status.load_proof,
            command: command.map(str::to_owned),
            handled_command,
            min_dwell: policy.spec.trigger.min_dwell.parse().unwrap_or_default(),
            claimed_by,
            claim: policy
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(controller::GAME_DAY_ANNOTATION))
                .cloned(),
            paused: policy.spec.paused,
            deleting: policy.metadata.deletion_timestamp.is_some(),
        }
    }

    fn standby(&self) -> &str {
        if self.primary.as_deref() == Some(self.home.as_str()) {
            &self.home_standby
        } else {
            &self.home
        }
    }

    fn promoting(&self) -> bool {
        self.state.as_deref() == Some("Promoting")
    }

    /// The policy's latest transition, when it is newer than `epoch`.
    fn transition_after(&self, epoch: u64) -> Option<&FailoverTimeline> {
        self.last_transition.as_ref().filter(|t| t.epoch > epoch)
    }

    /// Whether the policy's last transition is unfinished: a command given now would be refused.
    fn transition_unfinished(&self) -> bool {
        self.promoting()
            || self
                .last_transition
                .as_ref()
                .is_some_and(|t| t.finished_at.is_none())
    }

    /// Whether a transition the policy made after `command` was given is the one `command` asked
    /// for: the policy handled that very value, or it has forgotten every value (the annotation
    /// was removed) while the game day's claim still names `gameday`. A transition under another
    /// handled value was someone else's: another game day's, a person's, or the policy's own.
    fn moved_for(&self, gameday: &str, command: &str) -> bool {
        match self.handled_command.as_deref() {
            Some(handled) => handled == command,
            None => self.claim.as_deref() == Some(gameday),
        }
    }

    /// A command annotation the policy has not handled yet; a run must not overwrite it.
    fn pending_command(&self) -> Option<&str> {
        let handled = self
            .handled_command
            .as_ref()
            .map(|value| HandledCommand { value: value.clone() });
        pending_command(self.command.as_deref(), handled.as_ref()).and(self.command.as_deref())
    }

    fn saw(&self, command: &str) -> bool {
        self.command.as_deref() == Some(command) || self.handled_command.as_deref() == Some(command)
    }

    /// When the policy's minimum dwell after its last transition ends.
    fn dwell_until(&self) -> Option<Duration> {
        let finished = instant(self.last_transition.as_ref()?.finished_at.as_deref()?)?;
        Some(finished + self.min_dwell + DWELL_MARGIN)
    }
}

/// What a run does to the policy: a command, with the annotation value that carries it, or a
/// fault the controller injects itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyCommand {
    Failover(String),
    Failback(String),
    /// Delete the serving pods of the pool named here, the primary.
    Crash(String),
    /// Set [`DRIFT_VARIABLE`] to the run's id in the serving container of the pool named here,
    /// the standby, so that it rolls out with another configuration.
    Drift(String),
    /// Have the fences of the pool named here, the primary, play a fault for at most the
    /// duration given.
    Fence(String, FenceFault, Duration),
    /// Give the policy this `prove-load` command value.
    ProveLoad(String),
    /// Take the run's fault away from the pool named here again: the drift variable, or the
    /// fences' fault.
    Restore(String),
}

/// How long the fences play a run's fault at most: past `maxRecovery` the run is judged and
/// takes it away, so this only ever ends a fault whose run was lost.
#[must_use]
pub fn fence_fault_lasts(config: &RunConfig) -> Duration {
    config.max_recovery + Duration::from_secs(60)
}

/// What a run's reasons call `fault` after it was injected.
fn fault_name(fault: Fault) -> &'static str {
    match fault {
        Fault::Failover => "the command",
        Fault::Crash => "the crash",
        Fault::Drift => "the drift",
        Fault::Hang => "the hang",
        Fault::HalfFailed => "the half-failure",
        Fault::LoadProof => "the load proof",
    }
}

/// The fault the fences play for `fault`, if they play it.
#[must_use]
pub fn fence_fault(fault: Fault) -> Option<FenceFault> {
    match fault {
        Fault::Hang => Some(FenceFault::Hang),
        Fault::HalfFailed => Some(FenceFault::WrongAnswers),
        Fault::Failover | Fault::Crash | Fault::Drift | Fault::LoadProof => None,
    }
}

/// The variable a drift run gives the standby's serving container. A `VLLM_` variable, so that
/// parity compares it; vLLM only warns of a name it does not know.
pub const DRIFT_VARIABLE: &str = "VLLM_UNDERSTUDY_GAMEDAY_DRIFT";

impl PolicyCommand {
    /// The `understudy.dev/command` annotation value; `None` for a fault that is not a command.
    #[must_use]
    pub fn value(&self) -> Option<&str> {
        match self {
            PolicyCommand::Failover(value)
            | PolicyCommand::Failback(value)
            | PolicyCommand::ProveLoad(value) => Some(value),
            PolicyCommand::Crash(_)
            | PolicyCommand::Drift(_)
            | PolicyCommand::Fence(..)
            | PolicyCommand::Restore(_) => None,
        }
    }
}

/// A run's id, from the time it was due: `20240604-100000`.
#[must_use]
pub fn run_id(due: Duration) -> String {
    rfc3339(due)
        .chars()
        .filter(|c| c.is_ascii_digit() || *c == 'T')
        .collect::<String>()
        .replace('T', "-")
}

/// The annotation value that gives `word` to the policy for one run; the token after `@` makes
/// every run's command new to the policy, which handles each value once.
#[must_use]
pub fn command_value(word: &str, gameday: &str, run: &str) -> String {
    format!("{word}@gameday-{gameday}-{run}")
}

/// Reads an RFC 3339 time as time since the Unix epoch.
#[must_use]
pub fn instant(text: &str) -> Option<Duration> {
    let at: Timestamp = text.parse().ok()?;
    Some(Duration::from_secs(u64::try_from(at.as_second()).ok()?))
}

fn condition_is_true(condition: Option<&Condition>) -> bool {
    condition.is_some_and(|c| c.status == ConditionStatus::True)
}

fn describe_condition(kind: &str, condition: Option<&Condition>) -> String {
    match condition {
        Some(c) => format!("{kind} is {:?} ({}): {}", c.status, c.reason, c.message),
        None => format!("the policy reports no {kind} condition yet"),
    }
}

/// Everything about the policy that forbids injecting now; empty when the steady state holds.
#[must_use]
pub fn steady_state_violations(view: &PolicyView, config: &RunConfig, now: Duration) -> Vec<String> {
    let mut violations = Vec::new();
    if let Some(other) = &view.claimed_by {
        violations.push(format!("game day {other} is running on the policy"));
    }
    if view.paused {
        violations.push("the policy is paused (spec.paused)".to_owned());
    }
    if config.fault == Fault::LoadProof && !view.sets_load_proof {
        violations.push(
            "the policy sets no spec.loadProof: nothing says how to prove its standby at load".to_owned(),
        );
    }
    if view.deleting {
        violations.push("the policy is being deleted".to_owned());
    }
    if let Some(pending) = view.pending_command() {
        violations.push(format!(
            "the policy has a command it has not handled yet ({COMMAND_ANNOTATION}={pending})"
        ));
    }
    if condition_is_true(view.ready.as_ref()) {
        let since = view
            .ready
            .as_ref()
            .and_then(|c| c.last_transition_time.as_deref())
            .and_then(instant);
        if let Some(ready_for) = config.ready_for
            && since.is_none_or(|since| now < since + ready_for)
        {
            violations.push(format!(
                "Ready has been True for less than steadyState.readyFor ({})",
                understudy_core::duration::format(ready_for)
            ));
        }
    } else {
        violations.push(describe_condition("Ready", view.ready.as_ref()));
    }
    match view.state.as_deref() {
        Some("Serving") => {}
        Some(state) => violations.push(format!("the policy is {state}, not Serving")),
        None => violations.push("the policy reports no state yet".to_owned()),
    }
    if !condition_is_true(view.standby_proven.as_ref()) {
        violations.push(describe_condition("StandbyProven", view.standby_proven.as_ref()));
    }
    if view
        .parity
        .as_ref()
        .is_some_and(|c| c.status == ConditionStatus::False)
    {
        violations.push(describe_condition("ParityHolds", view.parity.as_ref()));
    }
    if view.primary.as_deref() != Some(view.home.as_str()) {
        violations.push(format!(
            "the primary is {}, not the home pool {}: fail back first",
            view.primary.as_deref().unwrap_or("unknown"),
            view.home
        ));
    }
    if let Some(until) = view.dwell_until()
        && now < until
    {
        violations.push(format!(
            "the policy's minDwell after its last transition lasts until {}; it would refuse a failover",
            rfc3339(until)
        ));
    }
    violations
}

fn seconds_between(from: &str, to: &str) -> Option<u64> {
    Some(instant(to)?.saturating_sub(instant(from)?).as_secs())
}

fn from_policy(recorded: &mut RecoveryTimeline, timeline: &FailoverTimeline) {
    recorded.epoch = Some(timeline.epoch);
    recorded.started_at = Some(timeline.started_at.clone());
    recorded.serving_at.clone_from(&timeline.finished_at);
    recorded.seconds = timeline
        .finished_at
        .as_deref()
        .and_then(|finished| seconds_between(&recorded.commanded_at, finished));
    recorded.steps.clone_from(&timeline.steps);
}

/// The run machine, on the run record that `GameDay.status` shows. A trait because the record is
/// the CRD's type, defined in `understudy_api`, and the machine is the operator's.
pub trait RunMachine: Sized {
    /// A run due at `due`, not started.
    #[must_use]
    fn due(trigger: RunTrigger, due: Duration) -> Self;

    /// Moves the run as far as `view` and `now` allow, and returns the command the policy must be
    /// given, if any. The controller records the run before it gives the command (write-ahead),
    /// and a command that did not reach the policy is asked for again on the next call.
    fn advance(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: Option<&PolicyView>,
        now: Duration,
    ) -> Option<PolicyCommand>;

    /// Stops a run that has not injected its fault, recorded Aborted with `reason`.
    fn stop(&mut self, reason: String, now: Duration);
}

impl RunMachine for GameDayRun {
    fn stop(&mut self, reason: String, now: Duration) {
        self.abort(reason, now);
    }

    fn due(trigger: RunTrigger, due: Duration) -> Self {
        GameDayRun {
            id: run_id(due),
            trigger,
            phase: RunPhase::Scheduled,
            transitions: vec![RunTransition {
                phase: RunPhase::Scheduled,
                at: rfc3339(due),
            }],
            from_pool: None,
            to_pool: None,
            baseline_epoch: None,
            command: None,
            injected: None,
            handled_before: None,
            recovery: None,
            failback: None,
            verdict: None,
            reason: None,
            stop_condition: None,
            requests: None,
            requests_before: None,
        }
    }

    fn advance(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: Option<&PolicyView>,
        now: Duration,
    ) -> Option<PolicyCommand> {
        for _ in 0..RunPhase::COUNT {
            let before = self.phase;
            if let Some(command) = self.advance_once(config, gameday, view, now) {
                return Some(command);
            }
            if self.phase == before || self.phase.is_final() {
                break;
            }
        }
        None
    }
}

/// The run machine's steps, one phase at a time; private to [`RunMachine`].
trait RunSteps {
    fn enter(&mut self, phase: RunPhase, now: Duration);
    fn finish(&mut self, phase: RunPhase, verdict: Verdict, reason: String, now: Duration);
    fn abort(&mut self, reason: String, now: Duration);
    fn fail(&mut self, reason: String, now: Duration);
    fn advance_once(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: Option<&PolicyView>,
        now: Duration,
    ) -> Option<PolicyCommand>;
    fn injected(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: &PolicyView,
        now: Duration,
        max: &str,
    ) -> Option<PolicyCommand>;
    fn awaits_its_own_promotion(&mut self, config: &RunConfig, view: &PolicyView, now: Duration, max: &str);
    fn drifted(
        &mut self,
        config: &RunConfig,
        view: &PolicyView,
        now: Duration,
        max: &str,
    ) -> Option<PolicyCommand>;
    fn proving_load(&mut self, config: &RunConfig, view: &PolicyView, now: Duration, max: &str);
    fn restoring(
        &mut self,
        config: &RunConfig,
        view: &PolicyView,
        now: Duration,
        max: &str,
    ) -> Option<PolicyCommand>;
    fn recovering(
        &mut self,
        config: &RunConfig,
        transition: &FailoverTimeline,
        after: &str,
        timed_out: bool,
        now: Duration,
        max: &str,
    );
    fn holding(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: &PolicyView,
        now: Duration,
    ) -> Option<PolicyCommand>;
    fn failing_back(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: &PolicyView,
        now: Duration,
        max: &str,
    ) -> Option<PolicyCommand>;
}

impl RunSteps for GameDayRun {
    fn enter(&mut self, phase: RunPhase, now: Duration) {
        self.phase = phase;
        self.transitions.push(RunTransition {
            phase,
            at: rfc3339(now),
        });
    }

    fn finish(&mut self, phase: RunPhase, verdict: Verdict, reason: String, now: Duration) {
        self.enter(phase, now);
        self.verdict = Some(verdict);
        self.reason = Some(reason);
    }

    fn abort(&mut self, reason: String, now: Duration) {
        self.finish(RunPhase::Aborted, Verdict::Aborted, reason, now);
    }

    fn fail(&mut self, reason: String, now: Duration) {
        self.finish(RunPhase::Failed, Verdict::Failed, reason, now);
    }

    fn advance_once(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: Option<&PolicyView>,
        now: Duration,
    ) -> Option<PolicyCommand> {
        let max = understudy_core::duration::format(config.max_recovery);
        if self.phase.is_final() {
            return None;
        }
        if self.phase == RunPhase::Scheduled {
            self.enter(RunPhase::CheckingSteadyState, now);
            return None;
        }
        let Some(view) = view else {
            self.abort("not steady: the FailoverPolicy does not exist".to_owned(), now);
            return None;
        };
        match self.phase {
            RunPhase::CheckingSteadyState => {
                let violations = steady_state_violations(view, config, now);
                if !violations.is_empty() {
                    self.abort(format!("not steady: {}", violations.join("; ")), now);
                    return None;
                }
                self.from_pool = view.primary.clone();
                self.to_pool = Some(view.standby().to_owned());
                self.baseline_epoch = view.epoch;
                self.recovery = Some(RecoveryTimeline {
                    commanded_at: rfc3339(now),
                    epoch: None,
                    started_at: None,
                    serving_at: None,
                    seconds: None,
                    steps: Vec::new(),
                });
                self.enter(RunPhase::Injected, now);
                match config.fault {
                    Fault::Failover => {
                        let command = command_value("failover", gameday, &self.id);
                        self.command = Some(command.clone());
                        Some(PolicyCommand::Failover(command))
                    }
                    Fault::Crash => {
                        let primary = view.primary.clone().unwrap_or_default();
                        self.handled_before.clone_from(&view.handled_command);
                        self.injected = Some(format!("deleted the serving pods of {primary}"));
                        Some(PolicyCommand::Crash(primary))
                    }
                    Fault::LoadProof => {
                        let command = command_value("prove-load", gameday, &self.id);
                        self.command = Some(command.clone());
                        self.injected = Some(format!("asked for a load proof of {}", view.standby()));
                        Some(PolicyCommand::ProveLoad(command))
                    }
                    Fault::Drift => {
                        let standby = view.standby().to_owned();
                        self.injected =
                            Some(format!("restarted {standby} with {DRIFT_VARIABLE}={}", self.id));
                        Some(PolicyCommand::Drift(standby))
                    }
                    Fault::Hang | Fault::HalfFailed => {
                        let primary = view.primary.clone().unwrap_or_default();
                        let fault = fence_fault(config.fault)?;
                        self.handled_before.clone_from(&view.handled_command);
                        self.injected = Some(match fault {
                            FenceFault::Hang => format!("hung the fences of {primary}"),
                            FenceFault::WrongAnswers => {
                                format!("had the fences of {primary} answer every completion wrongly")
                            }
                        });
                        Some(PolicyCommand::Fence(primary, fault, fence_fault_lasts(config)))
                    }
                }
            }
            RunPhase::Injected => self.injected(config, gameday, view, now, &max),
            RunPhase::Recovered => {
                match (config.failback_after, self.stop_condition.clone()) {
                    (None, stop) => {
                        let reason = format!(
                            "{}; failback is manual: {} stays primary until the policy is given a failback command",
                            self.reason.clone().unwrap_or_default(),
                            self.to_pool.as_deref().unwrap_or_default()
                        );
                        match stop {
                            Some(stop) => self.fail(format!("{stop}; {reason}"), now),
                            None => self.finish(RunPhase::Done, Verdict::Passed, reason, now),
                        }
                    }
                    // Holding fails back at once when a stop condition fired.
                    (Some(_), _) => self.enter(RunPhase::HoldingOnStandby, now),
                }
                None
            }
            RunPhase::HoldingOnStandby => self.holding(config, gameday, view, now),
            RunPhase::FailingBack => self.failing_back(config, gameday, view, now, &max),
            RunPhase::Restoring => self.restoring(config, view, now, &max),
            RunPhase::Scheduled | RunPhase::Done | RunPhase::Aborted | RunPhase::Failed => None,
        }
    }

    fn injected(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: &PolicyView,
        now: Duration,
        max: &str,
    ) -> Option<PolicyCommand> {
        if config.fault == Fault::Drift {
            return self.drifted(config, view, now, max);
        }
        if config.fault == Fault::LoadProof {
            self.proving_load(config, view, now, max);
            return None;
        }
        let Some(command) = self.command.clone() else {
            self.awaits_its_own_promotion(config, view, now, max);
            // A fault the fences play is taken away as soon as the run is judged, whatever the
            // verdict: before a failback, and before the old primary is proven again.
            if fence_fault(config.fault).is_some() && self.phase != RunPhase::Injected {
                return self.from_pool.clone().map(PolicyCommand::Restore);
            }
            return None;
        };
        let recovery = self.recovery.clone()?;
        let commanded = instant(&recovery.commanded_at).unwrap_or(now);
        let baseline = self.baseline_epoch.unwrap_or(0);
        let timed_out = now >= commanded + config.max_recovery;
        if let Some(transition) = view.transition_after(baseline) {
            if !view.moved_for(gameday, &command) {
                self.abort(
                    format!(
                        "another game day or someone else moved the policy: a {:?} to {} at epoch {} \
                         under command {}, claimed by {}",
                        transition.kind,
                        transition.to_pool,
                        transition.epoch,
                        view.handled_command.as_deref().unwrap_or("none"),
                        view.claim.as_deref().unwrap_or("no game day")
                    ),
                    now,
                );
                return None;
            }
            self.recovering(config, transition, "the command", timed_out, now, max);
            return None;
        }
        if !view.saw(&command) {
            if timed_out {
                self.fail(
                    format!("the failover command did not reach the policy within maxRecovery ({max})"),
                    now,
                );
                return None;
            }
            // The command was recorded but not given, or was overwritten before the policy read
            // it: give it again, but only while the steady state still holds.
            let violations = steady_state_violations(view, config, now);
            if !violations.is_empty() {
                self.abort(
                    format!(
                        "not steady before the command reached the policy: {}",
                        violations.join("; ")
                    ),
                    now,
                );
                return None;
            }
            return Some(PolicyCommand::Failover(command));
        }
        if view.handled_command.as_deref() == Some(command.as_str()) && !view.promoting() {
            self.abort(
                "the policy refused the failover command; its CommandRefused Event says why".to_owned(),
                now,
            );
        } else if timed_out {
            self.fail(
                format!("the promotion had not started within maxRecovery ({max})"),
                now,
            );
        }
        None
    }

    /// After the primary was crashed, hung or half-failed: waits for the policy to promote the
    /// standby on its own, under the command it had handled before (a promotion under another was
    /// somebody's command, not the policy's answer to the fault).
    fn awaits_its_own_promotion(&mut self, config: &RunConfig, view: &PolicyView, now: Duration, max: &str) {
        let Some(recovery) = &self.recovery else {
            return;
        };
        let injected = instant(&recovery.commanded_at).unwrap_or(now);
        let timed_out = now >= injected + config.max_recovery;
        let baseline = self.baseline_epoch.unwrap_or(0);
        if let Some(transition) = view.transition_after(baseline) {
            if view.handled_command != self.handled_before {
                self.abort(
                    format!(
                        "someone commanded the policy after {} ({}): its move to {} at epoch {} \
                         was not its own answer to the fault",
                        fault_name(config.fault),
                        view.handled_command.as_deref().unwrap_or("none"),
                        transition.to_pool,
                        transition.epoch
                    ),
                    now,
                );
                return;
            }
            self.recovering(config, transition, fault_name(config.fault), timed_out, now, max);
        } else if timed_out {
            self.fail(
                format!(
                    "the policy did not promote {} within maxRecovery ({max}) after {}",
                    self.to_pool.as_deref().unwrap_or_default(),
                    match config.fault {
                        Fault::Hang => "its primary hung",
                        Fault::HalfFailed => "its primary began to answer wrongly",
                        _ => "its primary's pods were deleted",
                    }
                ),
                now,
            );
        }
    }

    /// After the `prove-load` command: the first load proof of the standby that started since
    /// decides the run. The policy must move nowhere meanwhile.
    fn proving_load(&mut self, config: &RunConfig, view: &PolicyView, now: Duration, max: &str) {
        let Some(commanded) = self.recovery.as_ref().and_then(|r| instant(&r.commanded_at)) else {
            return;
        };
        let standby = self.to_pool.clone().unwrap_or_default();
        let proof = view
            .load_proof
            .as_ref()
            .filter(|p| p.pool == standby && instant(&p.at).is_some_and(|at| at >= commanded));
        if view.epoch != self.baseline_epoch {
            self.fail(
                format!(
                    "the policy moved to epoch {} while {standby} was being proven at load",
                    view.epoch.unwrap_or_default()
                ),
                now,
            );
        } else if let Some(proof) = proof {
            let summary = proof.summary();
            if proof.result == "Proven" {
                self.finish(
                    RunPhase::Done,
                    Verdict::Passed,
                    format!("{standby} proven at load: {summary}"),
                    now,
                );
            } else {
                self.fail(format!("{standby}'s load proof: {summary}"), now);
            }
        } else if now >= commanded + config.max_recovery {
            self.fail(
                format!(
                    "no load proof of {standby} ended within maxRecovery ({max}) after the prove-load command"
                ),
                now,
            );
        }
    }

    /// After the standby was restarted with another configuration: the policy must say so
    /// (`ParityHolds` False naming the variable) within `maxRecovery` and promote nothing.
    /// Whatever happens the run goes on to take the variable away ([`RunPhase::Restoring`]); a
    /// drift not reported in time, or a promotion, is kept as the stop condition that fails it.
    fn drifted(
        &mut self,
        config: &RunConfig,
        view: &PolicyView,
        now: Duration,
        max: &str,
    ) -> Option<PolicyCommand> {
        let recovery = self.recovery.as_ref()?;
        let injected = instant(&recovery.commanded_at).unwrap_or(now);
        let standby = self.to_pool.clone().unwrap_or_default();
        let seen = view.parity.as_ref().is_some_and(|c| {
            c.status == ConditionStatus::False && c.message.contains(&format!("env.{DRIFT_VARIABLE}"))
        });
        if view.epoch != self.baseline_epoch {
            self.stop_condition = Some(format!(
                "the policy moved to epoch {} while {standby} drifted",
                view.epoch.unwrap_or_default()
            ));
        } else if seen {
            let seconds = now.saturating_sub(injected).as_secs();
            self.reason = Some(format!(
                "the policy reported {standby}'s drift (ParityHolds False naming env.{DRIFT_VARIABLE}) \
                 {seconds}s after it was injected, and promoted nothing"
            ));
        } else if now >= injected + config.max_recovery {
            self.stop_condition = Some(format!(
                "the policy did not report {standby}'s drift within maxRecovery ({max})"
            ));
        } else {
            return None;
        }
        self.enter(RunPhase::Restoring, now);
        if let Some(recovery) = self.recovery.as_mut() {
            // The restore is timed from here.
            recovery.serving_at = Some(rfc3339(now));
        }
        Some(PolicyCommand::Restore(standby))
    }

    /// Takes the drift back, again on every call (it is idempotent, and the controller carries
    /// it out before it records anything), until parity holds again: then the run passes,
    /// unless a stop condition fired.
    fn restoring(
        &mut self,
        config: &RunConfig,
        view: &PolicyView,
        now: Duration,
        max: &str,
    ) -> Option<PolicyCommand> {
        let since = self
            .recovery
            .as_ref()
            .and_then(|r| r.serving_at.as_deref())
            .and_then(instant)
            .unwrap_or(now);
        let standby = self.to_pool.clone().unwrap_or_default();
        let parity = view.parity.as_ref().map(|c| &c.status);
        let held = parity == Some(&ConditionStatus::True);
        // A run that is passing waits until the policy compared the pools and found them alike:
        // while the standby rolls back nothing may be comparable (Unknown), which is not yet a
        // recovery. One that already failed only waits for the drift to be gone.
        let settled = held || (self.stop_condition.is_some() && parity != Some(&ConditionStatus::False));
        let seconds = now.saturating_sub(since).as_secs();
        if !settled && now < since + config.max_recovery {
            return Some(PolicyCommand::Restore(standby));
        }
        let restored = if held {
            format!("parity held again {seconds}s after the drift was taken back")
        } else if settled {
            format!("the drift was taken back {seconds}s ago; parity has not been compared since")
        } else {
            format!("parity did not hold again within maxRecovery ({max}) after the drift was taken back")
        };
        match (self.stop_condition.clone(), held) {
            (Some(stop), _) => self.fail(format!("{stop}; {restored}"), now),
            (None, false) => {
                let detected = self.reason.clone().unwrap_or_default();
                self.fail(format!("{detected}; {restored}"), now);
            }
            (None, true) => {
                let detected = self.reason.clone().unwrap_or_default();
                self.finish(
                    RunPhase::Done,
                    Verdict::Passed,
                    format!("{detected}; {restored}"),
                    now,
                );
            }
        }
        None
    }

    /// The policy moved after the fault: judges its promotion against `maxRecovery`, counted from
    /// the injection (`after` names it).
    fn recovering(
        &mut self,
        config: &RunConfig,
        transition: &FailoverTimeline,
        after: &str,
        timed_out: bool,
        now: Duration,
        max: &str,
    ) {
        if transition.kind != TransitionKind::Failover || Some(&transition.to_pool) != self.to_pool.as_ref() {
            self.abort(moved_by_itself(transition), now);
            return;
        }
        let Some(mut recovery) = self.recovery.clone() else {
            return;
        };
        from_policy(&mut recovery, transition);
        let seconds = recovery.seconds;
        self.recovery = Some(recovery);
        match seconds {
            Some(seconds) if Duration::from_secs(seconds) <= config.max_recovery => {
                self.reason = Some(format!(
                    "{} served at epoch {} {seconds}s after {after} (maxRecovery {max})",
                    transition.to_pool, transition.epoch
                ));
                self.enter(RunPhase::Recovered, now);
            }
            Some(seconds) => self.fail(
                format!(
                    "{} served only {seconds}s after {after}, beyond maxRecovery ({max})",
                    transition.to_pool
                ),
                now,
            ),
            None if timed_out => self.fail(
                format!(
                    "{} was not serving within maxRecovery ({max}); the policy carries on with its \
                     promotion at epoch {}",
                    transition.to_pool, transition.epoch
                ),
                now,
            ),
            None => {}
        }
    }

    /// Holds on the standby until `failback.after` and the policy's dwell are over, then gives the
    /// failback command. The stop condition is judged first, and a move the run did not command
    /// fails the run: while holding, the standby is what is under test, and a policy that left it
    /// (promoting home after the standby failed hard, or a person failing back) did not hold.
    fn holding(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: &PolicyView,
        now: Duration,
    ) -> Option<PolicyCommand> {
        if self.stop_condition.is_none()
            && (!condition_is_true(view.ready.as_ref()) || view.state.as_deref() != Some("Serving"))
        {
            self.stop_condition = Some(format!(
                "{} lost its steady state while holding: {}",
                self.to_pool.as_deref().unwrap_or_default(),
                describe_condition("Ready", view.ready.as_ref())
            ));
        }
        let recovered_epoch = self.recovery.as_ref().and_then(|r| r.epoch);
        if let Some(transition) = recovered_epoch.and_then(|epoch| view.transition_after(epoch)) {
            let stop = self
                .stop_condition
                .as_ref()
                .map(|stop| format!("{stop}; "))
                .unwrap_or_default();
            let reason = format!(
                "{stop}the policy moved on its own while the game day held on the standby: a {:?} to {} \
                 at epoch {} that the run did not command",
                transition.kind, transition.to_pool, transition.epoch
            );
            self.fail(reason, now);
            return None;
        }
        if view.transition_unfinished() {
            return None;
        }
        let serving = self
            .recovery
            .as_ref()
            .and_then(|r| r.serving_at.as_deref())
            .and_then(instant)
            .unwrap_or(now);
        let dwell_over = view.dwell_until().unwrap_or(serving);
        let mut until = dwell_over.max(serving + config.failback_after.unwrap_or_default());
        if self.stop_condition.is_some() {
            // Stop holding: fail back as soon as the policy accepts it.
            until = dwell_over;
        }
        if now < until {
            return None;
        }
        let command = failback_command(self, gameday);
        self.failback = Some(RecoveryTimeline {
            commanded_at: rfc3339(now),
            epoch: None,
            started_at: None,
            serving_at: None,
            seconds: None,
            steps: Vec::new(),
        });
        self.enter(RunPhase::FailingBack, now);
        Some(PolicyCommand::Failback(command))
    }

    fn failing_back(
        &mut self,
        config: &RunConfig,
        gameday: &str,
        view: &PolicyView,
        now: Duration,
        max: &str,
    ) -> Option<PolicyCommand> {
        let failback = self.failback.clone()?;
        let command = failback_command(self, gameday);
        let commanded = instant(&failback.commanded_at).unwrap_or(now);
        let timed_out = now >= commanded + config.max_recovery;
        let recovered_epoch = self.recovery.as_ref().and_then(|r| r.epoch).unwrap_or_default();
        let stays = self.to_pool.clone().unwrap_or_default();
        if !view.saw(&command) && view.transition_after(recovered_epoch).is_none() {
            if timed_out {
                self.fail(
                    format!(
                        "the failback command did not reach the policy within maxRecovery ({max}): \
                         {stays} stays primary; fail back by hand"
                    ),
                    now,
                );
                return None;
            }
            return Some(PolicyCommand::Failback(command));
        }
        if let Some(transition) = view.transition_after(recovered_epoch) {
            if !view.moved_for(gameday, &command) || Some(&transition.to_pool) != self.from_pool.as_ref() {
                self.abort(moved_by_itself(transition), now);
                return None;
            }
            let mut failback = failback;
            from_policy(&mut failback, transition);
            let seconds = failback.seconds;
            self.failback = Some(failback);
            let home = transition.to_pool.clone();
            match seconds {
                Some(seconds) if Duration::from_secs(seconds) <= config.max_recovery => {
                    let failed_back = format!("{home} served again {seconds}s after the failback command");
                    let recovered = self.reason.clone().unwrap_or_default();
                    match self.stop_condition.clone() {
                        Some(stop) => self.finish(
                            RunPhase::Failed,
                            Verdict::Failed,
                            format!("{stop}; {failed_back}"),
                            now,
                        ),
                        None => self.finish(
                            RunPhase::Done,
                            Verdict::Passed,
                            format!("{recovered}; {failed_back}"),
                            now,
                        ),
                    }
                }
                Some(seconds) => self.fail(
                    format!("{home} served again only {seconds}s after the failback command, beyond maxRecovery ({max})"),
                    now,
                ),
                None if timed_out => self.fail(
                    format!(
                        "the failback was not done within maxRecovery ({max}); the policy carries on \
                         with it at epoch {}",
                        transition.epoch
                    ),
                    now,
                ),
                None => {}
            }
            return None;
        }
        if view.handled_command.as_deref() == Some(command.as_str()) && !view.promoting() {
            self.fail(
                format!(
                    "the policy refused the failback command (its CommandRefused Event says why): \
                     {stays} stays primary; fail back by hand"
                ),
                now,
            );
        } else if timed_out {
            self.fail(
                format!("the failback had not started within maxRecovery ({max}): {stays} stays primary"),
                now,
            );
        }
        None
    }
}

/// The failback command of a run: the run's token under the word `failback`, so that the
/// record needs no second field.
fn failback_command(run: &GameDayRun, gameday: &str) -> String {
    command_value("failback", gameday, &run.id)
}

/// Why a run stops when the policy moved in a way the run did not command.
fn moved_by_itself(transition: &FailoverTimeline) -> String {
    format!(
        "the policy moved by itself: a {:?} to {} at epoch {}",
        transition.kind, transition.to_pool, transition.epoch
    )
}

#[cfg(test)]
mod tests;
