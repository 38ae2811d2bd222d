//! The stages of one GameDay reconcile, over its working state ([`Pass`]): read the spec, handle
//! the `run` command, work out the schedule, start, advance and file runs, take faults back and
//! give the policy its commands.

use std::time::Duration;

use k8s_openapi::jiff::tz::TimeZone;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::context::{ACTIVE_REQUEUE, Context, IDLE_REQUEUE, STARTING_DEADLINE};
use super::error::Error;
use super::faults::{crash, set_drift, set_fence_fault};
use super::notices::Notice;
use super::policy::{give_command, holder, read_policy};
use super::schedule::{due_while_running, next_after};
use super::watch::watch_load;
use crate::command::COMMAND_ANNOTATION;
use crate::crd::{FailoverPolicy, Fault, GameDay, GameDayRun, GameDayStatus, RunPhase, RunTrigger, Verdict};
use crate::cron::{CronError, CronSchedule};
use crate::gameday::{PolicyCommand, PolicyView, RunConfig, RunMachine, instant};
use crate::reconciler::rfc3339;

/// The spec as one reconcile reads it.
pub(super) struct SpecRead {
    pub(super) config: Result<RunConfig, String>,
    pub(super) schedule: Result<Option<CronSchedule>, CronError>,
    pub(super) zone: TimeZone,
    /// Why the spec cannot run, when it cannot.
    pub(super) error: Option<String>,
}

impl SpecRead {
    pub(super) fn of(gameday: &GameDay) -> SpecRead {
        let config = RunConfig::from_spec(&gameday.spec);
        let schedule = gameday
            .spec
            .schedule
            .as_deref()
            .map(CronSchedule::parse)
            .transpose();
        let zone = match gameday.spec.time_zone.as_deref() {
            None => Ok(TimeZone::UTC),
            Some(name) => TimeZone::get(name)
                .map_err(|error| format!("timeZone {name:?} is not an IANA time zone: {error}")),
        };
        let error = match (&config, &schedule, &zone) {
            (Err(why), _, _) | (_, _, Err(why)) => Some(why.clone()),
            (_, Err(error), _) => Some(error.to_string()),
            _ => None,
        };
        SpecRead {
            config,
            schedule,
            zone: zone.unwrap_or(TimeZone::UTC),
            error,
        }
    }

    /// What status says of the spec: why it cannot run, or that its schedule reads but never
    /// fires (`0 0 31 2 *`; a `run` still runs).
    pub(super) fn message(&self, gameday: &GameDay, now: Duration) -> Option<String> {
        let never_fires = match &self.schedule {
            Ok(Some(cron)) if next_after(cron, &self.zone, now).is_none() => Some(format!(
                "the schedule {:?} never fires: no such date within 28 years",
                gameday.spec.schedule.as_deref().unwrap_or_default()
            )),
            _ => None,
        };
        self.error.clone().or(never_fires)
    }
}

/// The working state of one reconcile of a GameDay: what status said, what it will say, and
/// what to tell.
pub(super) struct Pass {
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) now: Duration,
    pub(super) previous: GameDayStatus,
    pub(super) status: GameDayStatus,
    pub(super) notices: Vec<Notice>,
    pub(super) same_generation: bool,
}

impl Pass {
    pub(super) fn begin(gameday: &GameDay, now: Duration) -> Result<Pass, Error> {
        let namespace = gameday.namespace().ok_or(Error::MissingObjectKey("namespace"))?;
        let name = gameday
            .metadata
            .name
            .clone()
            .ok_or(Error::MissingObjectKey("name"))?;
        let previous = gameday.status.clone().unwrap_or_default();
        let mut status = previous.clone();
        let same_generation = previous.observed_generation == gameday.metadata.generation;
        status.observed_generation = gameday.metadata.generation;
        Ok(Pass {
            namespace,
            name,
            now,
            previous,
            status,
            notices: Vec::new(),
            same_generation,
        })
    }

    /// Says in status why the spec cannot run, and tells it once.
    pub(super) fn report_spec(&mut self, spec: &SpecRead, gameday: &GameDay) {
        self.status.message = spec.message(gameday, self.now);
        if let Some(message) = &self.status.message
            && self.previous.message.as_ref() != Some(message)
        {
            self.notices.push(Notice::InvalidSpec {
                message: message.clone(),
            });
        }
    }

    /// Handles a `run` command once; whether a run starts now.
    pub(super) fn handle_command(&mut self, gameday: &GameDay, spec_invalid: bool) -> bool {
        let annotation = gameday
            .annotations()
            .get(COMMAND_ANNOTATION)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty());
        let mut run_now = false;
        match annotation {
            None => self.status.handled_command = None,
            Some(value) if self.status.handled_command.as_deref() != Some(value) => {
                let word = value.split_once('@').map_or(value, |(word, _)| word);
                if !word.trim().eq_ignore_ascii_case("run") {
                    self.notices.push(Notice::UnknownCommand {
                        value: value.to_owned(),
                    });
                } else if self.status.current_run.is_some() || spec_invalid {
                    self.notices.push(Notice::RunRefused {
                        value: value.to_owned(),
                    });
                } else {
                    run_now = true;
                }
                self.status.handled_command = Some(value.to_owned());
            }
            Some(_) => {}
        }
        run_now
    }

    /// The schedule: a stored next time is kept while the spec is unchanged; one that has passed
    /// starts a run, or is skipped while another run is under way or when it is more than the
    /// starting deadline late. Sets the next time in status, and returns when a run is due.
    pub(super) fn schedule(&mut self, gameday: &GameDay, spec: &SpecRead, run_now: bool) -> Option<Duration> {
        let now = self.now;
        let mut due = None;
        if self.status.current_run.is_none() && !run_now {
            // A run that waited for the one before it (`concurrencyPolicy: Allow`).
            due = self.status.queued_run_at.take().as_deref().and_then(instant);
        }
        self.status.next_run_at = match (&spec.config, &spec.schedule, spec.error.is_none()) {
            (Ok(_), Ok(Some(cron)), true) => {
                let stored = self
                    .previous
                    .next_run_at
                    .as_deref()
                    .and_then(instant)
                    .filter(|_| self.same_generation);
                let next = match stored {
                    Some(at) if at > now => Some(at),
                    Some(at) => {
                        if now.saturating_sub(at) > STARTING_DEADLINE {
                            self.notices.push(Notice::Missed { due: rfc3339(at) });
                        } else if self.status.current_run.is_none() && !run_now && due.is_none() {
                            due = Some(at);
                        } else {
                            let policy = gameday.spec.concurrency_policy;
                            due_while_running(&mut self.status, policy, at, now, &mut due, &mut self.notices);
                        }
                        next_after(cron, &spec.zone, now)
                    }
                    None => next_after(cron, &spec.zone, now),
                };
                next.map(rfc3339)
            }
            _ => None,
        };
        due
    }

    /// Starts a run when a command asked for one or one is due, unless one is under way.
    pub(super) fn start_run(&mut self, run_now: bool, due: Option<Duration>) {
        if self.status.current_run.is_none() {
            self.status.current_run = match (run_now, due) {
                (true, _) => Some(GameDayRun::due(RunTrigger::Command, self.now)),
                (false, Some(at)) => Some(GameDayRun::due(RunTrigger::Schedule, at)),
                (false, None) => None,
            };
        }
    }

    /// Moves the run under way with the run machine against the policy as read now (and whether
    /// another game day holds it); the command to give the policy, and the policy read.
    pub(super) async fn advance_run(
        &mut self,
        ctx: &Context,
        gameday: &GameDay,
        config: &RunConfig,
    ) -> Result<(Option<PolicyCommand>, Option<FailoverPolicy>), Error> {
        let Some(run) = self.status.current_run.as_mut() else {
            return Ok((None, None));
        };
        let (namespace, name) = (&self.namespace, &self.name);
        let policy = read_policy(ctx, namespace, &gameday.spec.policy_ref.name).await?;
        let view = match &policy {
            Some(policy) => {
                let claimed_by = holder(ctx, namespace, policy, name).await?;
                let annotation = policy.annotations().get(COMMAND_ANNOTATION).map(String::as_str);
                Some(PolicyView::of(policy, annotation, claimed_by))
            }
            None => None,
        };
        let command = run.advance(config, name, view.as_ref(), self.now);
        if run.recovery.is_some() {
            let key = format!("{namespace}/{name}/{}", run.id);
            watch_load(ctx, &key, run, config.stop.as_ref(), self.now, policy.as_ref()).await;
        }
        Ok((command, policy))
    }

    /// Files a run that finished into the history, within its limit, and says the phase; the
    /// policy to release when the run gave it a command or a fault.
    pub(super) fn file_finished_run(
        &mut self,
        gameday: &GameDay,
        policy: Option<&FailoverPolicy>,
    ) -> Option<FailoverPolicy> {
        let mut released = None;
        if let Some(run) = self.status.current_run.take_if(|run| run.phase.is_final()) {
            self.notices.push(Notice::Finished {
                run: run.id.clone(),
                verdict: run.verdict.unwrap_or(Verdict::Aborted),
                reason: run.reason.clone().unwrap_or_default(),
            });
            self.status.last_verdict = run.verdict;
            if run.command.is_some() || run.injected.is_some() {
                released = policy.cloned();
            }
            self.status.last_runs.insert(0, run);
        }
        let limit = usize::try_from(gameday.spec.history_limit).unwrap_or(usize::MAX);
        self.status.last_runs.truncate(limit);
        self.status.phase = Some(
            self.status
                .current_run
                .as_ref()
                .map_or_else(|| "Idle".to_owned(), |run| phase_name(run.phase).to_owned()),
        );
        released
    }

    /// Takes the fault back from `pool`, before anything is recorded: a restore that fails leaves
    /// the run where it was, to try again.
    pub(super) async fn take_fault_back(
        &mut self,
        ctx: &Context,
        gameday: &GameDay,
        policy: &FailoverPolicy,
        pool: &str,
    ) -> Result<(), Error> {
        if gameday.spec.fault == Fault::Drift {
            set_drift(ctx, &self.namespace, policy, pool, None).await?;
            self.notices.push(Notice::DriftTakenBack {
                pool: pool.to_owned(),
            });
        } else {
            let pods = set_fence_fault(ctx, &self.namespace, policy, pool, None).await?;
            self.notices.push(Notice::FencesRestored {
                pool: pool.to_owned(),
                pods,
            });
        }
        Ok(())
    }

    /// Gives the policy the run's command, and plays the fault it stands for; told first.
    pub(super) async fn give(
        &mut self,
        ctx: &Context,
        policy: &FailoverPolicy,
        command: &PolicyCommand,
    ) -> Result<(), Error> {
        let (namespace, name) = (&self.namespace, &self.name);
        let notice = match command {
            // Carried out before the status write.
            PolicyCommand::Restore(_) => return Ok(()),
            PolicyCommand::Crash(pool) => {
                give_command(ctx, namespace, policy, name, command).await?;
                Notice::Crashed {
                    pods: crash(ctx, namespace, policy, pool).await?,
                    pool: pool.clone(),
                }
            }
            PolicyCommand::Fence(pool, fault, lasting) => {
                give_command(ctx, namespace, policy, name, command).await?;
                let pods = set_fence_fault(ctx, namespace, policy, pool, Some((*fault, *lasting))).await?;
                Notice::FencesFaulted {
                    pool: pool.clone(),
                    fault: *fault,
                    pods,
                }
            }
            PolicyCommand::Drift(pool) => {
                give_command(ctx, namespace, policy, name, command).await?;
                let run = self
                    .status
                    .current_run
                    .as_ref()
                    .map(|r| r.id.clone())
                    .unwrap_or_default();
                set_drift(ctx, namespace, policy, pool, Some(&run)).await?;
                Notice::Drifted {
                    pool: pool.clone(),
                    run,
                }
            }
            PolicyCommand::Failover(value)
            | PolicyCommand::Failback(value)
            | PolicyCommand::ProveLoad(value) => {
                give_command(ctx, namespace, policy, name, command).await?;
                Notice::Commanded {
                    value: value.clone(),
                    policy: policy.name_any(),
                }
            }
        };
        self.notices.insert(0, notice);
        Ok(())
    }

    /// When to look again: soon while a run is under way, at the next scheduled time otherwise.
    pub(super) fn requeue(&self) -> Action {
        match (
            &self.status.current_run,
            self.status.next_run_at.as_deref().and_then(instant),
        ) {
            (Some(_), _) => Action::requeue(ACTIVE_REQUEUE),
            (None, Some(next)) => Action::requeue(
                next.saturating_sub(self.now)
                    .clamp(Duration::from_secs(1), IDLE_REQUEUE),
            ),
            (None, None) => Action::await_change(),
        }
    }
}

/// The name status shows for a run phase.
#[must_use]
pub fn phase_name(phase: RunPhase) -> &'static str {
    match phase {
        RunPhase::Scheduled => "Scheduled",
        RunPhase::CheckingSteadyState => "CheckingSteadyState",
        RunPhase::Injected => "Injected",
        RunPhase::Recovered => "Recovered",
        RunPhase::HoldingOnStandby => "HoldingOnStandby",
        RunPhase::FailingBack => "FailingBack",
        RunPhase::Restoring => "Restoring",
        RunPhase::Done => "Done",
        RunPhase::Aborted => "Aborted",
        RunPhase::Failed => "Failed",
    }
}
