//! The GameDay controller: starts runs when the schedule or a `run` command says so, moves them
//! with the run machine ([`super`]) against the FailoverPolicy's status, gives the policy its
//! commands, and records runs, verdicts and the next run in status.
//!
//! Each reconcile: handle the GameDay's command annotation → work out the next scheduled time and
//! whether a run is due → read the policy (and whether another game day holds it) → advance the
//! run → apply the status (write-ahead: a command is recorded before it is given) → give the
//! command with a compare-and-set on the policy's resourceVersion → publish Events.
//!
//! What this controller must never do:
//! - give the policy a command while the steady state does not hold (the machine decides);
//! - run two game days on one policy at once: the command is given together with the annotation
//!   `understudy.dev/game-day` naming the game day, in one patch conditional on the
//!   resourceVersion the steady state was judged on, and a policy held by another game day with a
//!   run under way is not steady;
//! - write to the policy anything but those two annotations: the promotion, the fencing and the
//!   primary stay the policy controller's.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::tz::TimeZone;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use understudy_api::FIELD_MANAGER;
use understudy_api::fence_fault::{FAULT_PATH, FenceFault, MAX_FAULT_SECONDS};
use understudy_prober::http1;
use understudy_prober::probe::Bearer;

use super::{DRIFT_VARIABLE, PolicyCommand, PolicyView, RunConfig, RunMachine, StopLimits, instant, load};
use crate::command::COMMAND_ANNOTATION;
use crate::crd::{
    ConcurrencyPolicy, FailoverPolicy, Fault, GameDay, GameDayRun, GameDayStatus, PoolSpec, RequestCounts,
    RunPhase, RunTrigger, Verdict, WorkloadKind,
};
use crate::cron::CronSchedule;
use crate::peers::Routers;
use crate::ports::{Clock, SystemClock};
use crate::reconciler::{self, CONTROLLER_NAME, Shell, StatusWrite, object_reference, rfc3339, send, warn};
use crate::replicas::{KubeReplicas, replica_endpoint};
use crate::router_admin::RouterToken;
use crate::watchdog::{Reconciler, Watchdog};

/// The annotation on a FailoverPolicy naming the game day whose run gave it a command.
pub const GAME_DAY_ANNOTATION: &str = "understudy.dev/game-day";

/// How soon a game day with a run under way is looked at again.
pub const ACTIVE_REQUEUE: Duration = Duration::from_secs(5);

/// The longest an idle game day waits before it is looked at again.
const IDLE_REQUEUE: Duration = Duration::from_secs(3600);

/// How late a scheduled run may start, like a CronJob's `startingDeadlineSeconds`: a run missed
/// by more (the operator was down) is skipped, so that nobody's failover lands at an hour that
/// was never scheduled.
pub const STARTING_DEADLINE: Duration = Duration::from_secs(600);

/// Why a reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object lacks a namespace or name; the API server always sets them.
    #[error("the object has no {0}")]
    MissingObjectKey(&'static str),
    /// Reading the FailoverPolicy, or the game day holding it, failed.
    #[error("reading {object}: {source}")]
    Read {
        object: String,
        #[source]
        source: kube::Error,
    },
    /// The policy changed after the steady state was judged; the command was not given.
    #[error("the FailoverPolicy changed before the command could be given; judging it again")]
    PolicyChanged,
    /// Giving the policy its command failed.
    #[error("giving the FailoverPolicy its command: {0}")]
    Command(#[source] kube::Error),
    /// A fault that is not a command could not be injected; the run waits out `maxRecovery`.
    #[error("injecting the fault: {0}")]
    Inject(String),
    /// The status was written against a GameDay that has changed since it was read: the
    /// reconcile saw a stale copy and starts again from the current one.
    #[error("the GameDay changed since it was read; reading it again")]
    StatusConflict,
    /// The status could not be written.
    #[error("status patch: {0}")]
    StatusPatch(#[source] kube::Error),
    /// The status patch got no answer in time.
    #[error("status patch got no answer within {0:?}")]
    StatusTimeout(Duration),
}

impl Error {
    /// The phase that failed, from a closed list.
    #[must_use]
    pub fn category(&self) -> &'static str {
        match self {
            Error::MissingObjectKey(_) => "object",
            Error::Read { .. } => "read",
            Error::PolicyChanged => "policy_changed",
            Error::Command(_) => "command",
            Error::Inject(_) => "inject",
            Error::StatusConflict | Error::StatusPatch(_) | Error::StatusTimeout(_) => "status",
        }
    }
}

/// What every GameDay reconcile shares.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub clock: Arc<dyn Clock>,
    /// The longest a write may take.
    pub write_timeout: Duration,
    /// Where each reconcile records that it runs, so that a stuck one is noticed.
    pub watchdog: Watchdog,
    /// The routers whose counters are a run's record of loss and its stop conditions' evidence,
    /// and their admin token; without them a run records no loss and stops on nothing it sees.
    pub routers: Option<(Routers, RouterToken)>,
    /// The fences' control token, which sets and takes away the faults they play (`hang`,
    /// `halfFailed`); without it the fences refuse them.
    pub replica_token: Option<Bearer>,
    /// Each run's samples of the routers' counters within its stop conditions' window, oldest
    /// first, by `namespace/gameday/run`. Lost on a restart: the window starts again.
    samples: Mutex<HashMap<String, VecDeque<(Duration, load::Counters)>>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("clock", &self.clock)
            .field("write_timeout", &self.write_timeout)
            .field("watchdog", &self.watchdog)
            .finish_non_exhaustive()
    }
}

impl Context {
    #[must_use]
    pub fn new(client: Client, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: CONTROLLER_NAME.to_owned(),
            instance,
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            clock: Arc::new(SystemClock::new()),
            write_timeout: Duration::from_secs(10),
            watchdog: Watchdog::default(),
            routers: None,
            replica_token: None,
            samples: Mutex::new(HashMap::new()),
        }
    }

    /// Sets and takes away the fences' faults with `token`.
    #[must_use]
    pub fn with_replica_token(mut self, token: Option<Bearer>) -> Self {
        self.replica_token = token;
        self
    }

    /// Reads `routers`' counters during a run, for its record of loss and its stop conditions.
    #[must_use]
    pub fn with_routers(mut self, routers: Routers, token: RouterToken) -> Self {
        self.routers = Some((routers, token));
        self
    }

    fn samples(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<(Duration, load::Counters)>>> {
        self.samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    #[must_use]
    pub fn with_watchdog(mut self, watchdog: Watchdog) -> Self {
        self.watchdog = watchdog;
        self
    }
}

impl Shell for Context {
    const ACTION: &'static str = "GameDay";

    fn client(&self) -> &Client {
        &self.client
    }

    fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    fn write_timeout(&self) -> Duration {
        self.write_timeout
    }
}

impl From<StatusWrite> for Error {
    fn from(failed: StatusWrite) -> Self {
        match failed {
            StatusWrite::Patch(kube::Error::Api(status)) if status.code == 409 => Error::StatusConflict,
            StatusWrite::Patch(error) => Error::StatusPatch(error),
            StatusWrite::Timeout(after) => Error::StatusTimeout(after),
        }
    }
}

/// Something the reconcile tells the user about.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Notice {
    Commanded {
        value: String,
        policy: String,
    },
    /// The primary's serving pods were deleted.
    Crashed {
        pool: String,
        pods: Vec<String>,
    },
    /// The standby was given the drift variable.
    Drifted {
        pool: String,
        run: String,
    },
    /// The drift variable was taken away again.
    DriftTakenBack {
        pool: String,
    },
    /// The primary's fences were told to play a fault.
    FencesFaulted {
        pool: String,
        fault: FenceFault,
        pods: Vec<String>,
    },
    /// The fences' fault was taken away again.
    FencesRestored {
        pool: String,
        pods: Vec<String>,
    },
    Finished {
        run: String,
        verdict: Verdict,
        reason: String,
    },
    RunRefused {
        value: String,
    },
    UnknownCommand {
        value: String,
    },
    Skipped {
        due: String,
        why: String,
    },
    Missed {
        due: String,
    },
    InvalidSpec {
        message: String,
    },
}

/// Runs the GameDay controller over one namespace or all of them until the stream ends.
pub async fn run(ctx: Arc<Context>, namespace: Option<&str>) {
    // Policies are not watched: a run under way is looked at every few seconds, and its
    // measurements come from the timestamps in the policy's status, not from when we look.
    reconciler::run(ctx, namespace, reconcile, error_policy).await;
}

/// Retries a failed reconcile soon: a run under way is timed by the policy's clock, not ours.
pub fn error_policy(object: Arc<DeserializeGuard<GameDay>>, error: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(gameday = %object.name_any(), category = error.category(), %error, "game day reconcile failed");
    Action::requeue(ACTIVE_REQUEUE)
}

/// Reconciles one GameDay, including one that does not deserialize.
pub async fn reconcile(object: Arc<DeserializeGuard<GameDay>>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _reconciling = ctx.watchdog.reconciling(Reconciler::GameDay, object.meta());
    match &object.0 {
        Ok(gameday) => reconcile_game_day(gameday, &ctx).await,
        Err(invalid) => {
            let reference = object_reference::<GameDay>(&invalid.metadata);
            warn(ctx.as_ref(), &reference, "InvalidSpec", invalid.error.clone()).await;
            Ok(Action::await_change())
        }
    }
}

async fn reconcile_game_day(gameday: &GameDay, ctx: &Context) -> Result<Action, Error> {
    let namespace = gameday.namespace().ok_or(Error::MissingObjectKey("namespace"))?;
    let name = gameday
        .metadata
        .name
        .clone()
        .ok_or(Error::MissingObjectKey("name"))?;
    let now = ctx.clock.now();
    let previous = gameday.status.clone().unwrap_or_default();
    let mut status = previous.clone();
    let mut notices = Vec::new();
    let same_generation = previous.observed_generation == gameday.metadata.generation;
    status.observed_generation = gameday.metadata.generation;

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
    let spec_error = match (&config, &schedule, &zone) {
        (Err(why), _, _) | (_, _, Err(why)) => Some(why.clone()),
        (_, Err(error), _) => Some(error.to_string()),
        _ => None,
    };
    let zone = zone.unwrap_or(TimeZone::UTC);
    // A schedule that reads but never fires (`0 0 31 2 *`) is said so; a `run` still runs.
    let never_fires = match &schedule {
        Ok(Some(cron)) if next_after(cron, &zone, now).is_none() => Some(format!(
            "the schedule {:?} never fires: no such date within 28 years",
            gameday.spec.schedule.as_deref().unwrap_or_default()
        )),
        _ => None,
    };
    status.message = spec_error.clone().or(never_fires);
    if let Some(message) = &status.message
        && previous.message.as_ref() != Some(message)
    {
        notices.push(Notice::InvalidSpec {
            message: message.clone(),
        });
    }

    // A `run` command, handled once.
    let mut run_now = false;
    let annotation = gameday
        .annotations()
        .get(COMMAND_ANNOTATION)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty());
    match annotation {
        None => status.handled_command = None,
        Some(value) if status.handled_command.as_deref() != Some(value) => {
            let word = value.split_once('@').map_or(value, |(word, _)| word);
            if !word.trim().eq_ignore_ascii_case("run") {
                notices.push(Notice::UnknownCommand {
                    value: value.to_owned(),
                });
            } else if status.current_run.is_some() || spec_error.is_some() {
                notices.push(Notice::RunRefused {
                    value: value.to_owned(),
                });
            } else {
                run_now = true;
            }
            status.handled_command = Some(value.to_owned());
        }
        Some(_) => {}
    }

    // The schedule: a stored next time is kept while the spec is unchanged; one that has passed
    // starts a run, or is skipped while another run is under way or when it is more than the
    // starting deadline late.
    let mut due = None;
    if status.current_run.is_none() && !run_now {
        // A run that waited for the one before it (`concurrencyPolicy: Allow`).
        due = status.queued_run_at.take().as_deref().and_then(instant);
    }
    status.next_run_at = match (&config, &schedule, spec_error.is_none()) {
        (Ok(_), Ok(Some(cron)), true) => {
            let stored = previous
                .next_run_at
                .as_deref()
                .and_then(instant)
                .filter(|_| same_generation);
            let next = match stored {
                Some(at) if at > now => Some(at),
                Some(at) => {
                    if now.saturating_sub(at) > STARTING_DEADLINE {
                        notices.push(Notice::Missed { due: rfc3339(at) });
                    } else if status.current_run.is_none() && !run_now && due.is_none() {
                        due = Some(at);
                    } else {
                        let policy = gameday.spec.concurrency_policy;
                        due_while_running(&mut status, policy, at, now, &mut due, &mut notices);
                    }
                    next_after(cron, &zone, now)
                }
                None => next_after(cron, &zone, now),
            };
            next.map(rfc3339)
        }
        _ => None,
    };

    if status.current_run.is_none() {
        status.current_run = match (run_now, due) {
            (true, _) => Some(GameDayRun::due(RunTrigger::Command, now)),
            (false, Some(at)) => Some(GameDayRun::due(RunTrigger::Schedule, at)),
            (false, None) => None,
        };
    }

    let mut command = None;
    let mut policy = None;
    if let (Some(run), Ok(config)) = (status.current_run.as_mut(), &config) {
        let policy_name = &gameday.spec.policy_ref.name;
        policy = read_policy(ctx, &namespace, policy_name).await?;
        let view = match &policy {
            Some(policy) => {
                let claimed_by = holder(ctx, &namespace, policy, &name).await?;
                let annotation = policy.annotations().get(COMMAND_ANNOTATION).map(String::as_str);
                Some(PolicyView::of(policy, annotation, claimed_by))
            }
            None => None,
        };
        command = run.advance(config, &name, view.as_ref(), now);
        if run.recovery.is_some() {
            let key = format!("{namespace}/{name}/{}", run.id);
            watch_load(ctx, &key, run, config.stop.as_ref(), now).await;
        }
    }
    let mut released = None;
    if let Some(run) = status.current_run.take_if(|run| run.phase.is_final()) {
        notices.push(Notice::Finished {
            run: run.id.clone(),
            verdict: run.verdict.unwrap_or(Verdict::Aborted),
            reason: run.reason.clone().unwrap_or_default(),
        });
        status.last_verdict = run.verdict;
        if run.command.is_some() || run.injected.is_some() {
            released = policy.clone();
        }
        status.last_runs.insert(0, run);
    }
    let limit = usize::try_from(gameday.spec.history_limit).unwrap_or(usize::MAX);
    status.last_runs.truncate(limit);
    status.phase = Some(
        status
            .current_run
            .as_ref()
            .map_or_else(|| "Idle".to_owned(), |run| phase_name(run.phase).to_owned()),
    );

    // A fault is taken back before anything is recorded: a restore that fails leaves the run
    // where it was, to try again.
    if let (Some(PolicyCommand::Restore(pool)), Some(policy)) = (&command, &policy) {
        if gameday.spec.fault == Fault::Drift {
            set_drift(ctx, &namespace, policy, pool, None).await?;
            notices.push(Notice::DriftTakenBack { pool: pool.clone() });
        } else {
            let pods = set_fence_fault(ctx, &namespace, policy, pool, None).await?;
            notices.push(Notice::FencesRestored {
                pool: pool.clone(),
                pods,
            });
        }
    }
    // Write-ahead: the run records the command before the policy is given it, so that a command
    // given is never one the game day forgot.
    if status != previous {
        let read_at = gameday.metadata.resource_version.as_deref();
        // Conditional on the resourceVersion the reconcile read: a reconcile that ran on a stale
        // cached copy (one that had not yet seen a run start) gets a 409 and is retried, instead
        // of starting the same run again over the live one.
        reconciler::apply_status::<GameDay, _>(ctx, &namespace, &name, read_at, &status).await?;
    }
    let reference = gameday.object_ref(&());
    if let (Some(command), Some(policy)) = (&command, &policy) {
        let notice = match command {
            // Carried out before the status write, above.
            PolicyCommand::Restore(_) => None,
            PolicyCommand::Crash(pool) => {
                give_command(ctx, &namespace, policy, &name, command).await?;
                Some(Notice::Crashed {
                    pods: crash(ctx, &namespace, policy, pool).await?,
                    pool: pool.clone(),
                })
            }
            PolicyCommand::Fence(pool, fault, lasting) => {
                give_command(ctx, &namespace, policy, &name, command).await?;
                let pods = set_fence_fault(ctx, &namespace, policy, pool, Some((*fault, *lasting))).await?;
                Some(Notice::FencesFaulted {
                    pool: pool.clone(),
                    fault: *fault,
                    pods,
                })
            }
            PolicyCommand::Drift(pool) => {
                give_command(ctx, &namespace, policy, &name, command).await?;
                let run = status
                    .current_run
                    .as_ref()
                    .map(|r| r.id.clone())
                    .unwrap_or_default();
                set_drift(ctx, &namespace, policy, pool, Some(&run)).await?;
                Some(Notice::Drifted {
                    pool: pool.clone(),
                    run,
                })
            }
            PolicyCommand::Failover(value) | PolicyCommand::Failback(value) => {
                give_command(ctx, &namespace, policy, &name, command).await?;
                Some(Notice::Commanded {
                    value: value.clone(),
                    policy: policy.name_any(),
                })
            }
        };
        if let Some(notice) = notice {
            notices.insert(0, notice);
        }
    }
    if let Some(policy) = released {
        release(ctx, &namespace, &policy, &name).await;
    }
    for notice in &notices {
        send(ctx, &reference, &describe(notice)).await;
    }
    Ok(
        match (
            &status.current_run,
            status.next_run_at.as_deref().and_then(instant),
        ) {
            (Some(_), _) => Action::requeue(ACTIVE_REQUEUE),
            (None, Some(next)) => Action::requeue(
                next.saturating_sub(now)
                    .clamp(Duration::from_secs(1), IDLE_REQUEUE),
            ),
            (None, None) => Action::await_change(),
        },
    )
}

/// Samples the routers' counters for an injected run: the first sample is what the run counts
/// from, each one updates its record of loss, and the samples of the last window are judged
/// against its stop conditions (the first that fires is kept).
async fn watch_load(
    ctx: &Context,
    key: &str,
    run: &mut GameDayRun,
    stop: Option<&StopLimits>,
    now: Duration,
) {
    let Some((routers, token)) = &ctx.routers else {
        return;
    };
    let routers = match routers.resolve().await {
        Ok(routers) => routers,
        Err(why) => {
            tracing::warn!(run = %key, %why, "no router's counters to read");
            return;
        }
    };
    let (counters, unread) = load::sample(&routers, token).await;
    for why in &unread {
        tracing::warn!(run = %key, %why, "a router's counters could not be read");
    }
    if unread.len() == routers.len() {
        return;
    }
    let counts = |c: &load::Counters| RequestCounts {
        sent: c.sent,
        failed: c.failed,
        shed: c.shed,
    };
    let before = *run.requests_before.get_or_insert_with(|| counts(&counters));
    let since = counters.since(&load::Counters {
        sent: before.sent,
        failed: before.failed,
        shed: before.shed,
        ttft: std::collections::BTreeMap::new(),
    });
    run.requests = Some(counts(&since));
    let mut samples = ctx.samples();
    if run.phase.is_final() {
        samples.remove(key);
        return;
    }
    let window = samples.entry(key.to_owned()).or_default();
    window.push_back((now, counters.clone()));
    let Some(stop) = stop else {
        return;
    };
    // Keep the newest sample at or before the window's start, as its beginning.
    while window.len() > 1
        && window
            .get(1)
            .is_some_and(|(at, _)| now.saturating_sub(*at) >= stop.window)
    {
        window.pop_front();
    }
    let Some((_, first)) = window.front() else {
        return;
    };
    if run.stop_condition.is_none()
        && let Some(fired) = stop.fired(&counters.since(first))
    {
        tracing::warn!(run = %key, %fired, "stop condition");
        run.stop_condition = Some(fired);
    }
}

fn next_after(cron: &CronSchedule, zone: &TimeZone, now: Duration) -> Option<Duration> {
    let now = k8s_openapi::jiff::Timestamp::from_second(i64::try_from(now.as_secs()).ok()?).ok()?;
    let next = cron.next_after_in(now, zone)?;
    Some(Duration::from_secs(u64::try_from(next.as_second()).ok()?))
}

/// A scheduled run came due at `at` while another run, or a `run` command, holds the game day:
/// `policy` says whether it is skipped, waits, or replaces a run that has not injected yet.
fn due_while_running(
    status: &mut GameDayStatus,
    policy: ConcurrencyPolicy,
    at: Duration,
    now: Duration,
    due: &mut Option<Duration>,
    notices: &mut Vec<Notice>,
) {
    let skipped = |why: &str| Notice::Skipped {
        due: rfc3339(at),
        why: why.to_owned(),
    };
    match policy {
        ConcurrencyPolicy::Forbid => {
            notices.push(skipped("another run was under way (concurrencyPolicy: Forbid)"))
        }
        ConcurrencyPolicy::Allow if status.queued_run_at.is_none() && due.is_none() => {
            status.queued_run_at = Some(rfc3339(at));
        }
        ConcurrencyPolicy::Allow => notices.push(skipped("a run already waits for the one under way")),
        ConcurrencyPolicy::Replace => {
            let replaceable = status
                .current_run
                .as_ref()
                .is_some_and(|run| matches!(run.phase, RunPhase::Scheduled | RunPhase::CheckingSteadyState));
            if replaceable && let Some(mut run) = status.current_run.take() {
                let reason = format!("replaced by the run due at {}", rfc3339(at));
                run.stop(reason.clone(), now);
                notices.push(Notice::Finished {
                    run: run.id.clone(),
                    verdict: Verdict::Aborted,
                    reason,
                });
                status.last_runs.insert(0, run);
                *due = Some(at);
            } else {
                notices.push(skipped(
                    "the run under way has injected its fault, which is never cut short (concurrencyPolicy: Replace)",
                ));
            }
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

async fn read_policy(ctx: &Context, namespace: &str, name: &str) -> Result<Option<FailoverPolicy>, Error> {
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.client.clone(), namespace);
    api.get_opt(name).await.map_err(|source| Error::Read {
        object: format!("FailoverPolicy {name}"),
        source,
    })
}

/// The other game day holding `policy` with a run under way, if any. A hold left by a game day
/// that was deleted, or whose run is over, is stale and holds nothing.
async fn holder(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    me: &str,
) -> Result<Option<String>, Error> {
    let Some(other) = policy.annotations().get(GAME_DAY_ANNOTATION) else {
        return Ok(None);
    };
    if other == me {
        return Ok(None);
    }
    let api: Api<GameDay> = Api::namespaced(ctx.client.clone(), namespace);
    let found = api.get_opt(other).await.map_err(|source| Error::Read {
        object: format!("GameDay {other}"),
        source,
    })?;
    let running = found
        .and_then(|g| g.status)
        .and_then(|s| s.current_run)
        .is_some_and(|run| (run.command.is_some() || run.injected.is_some()) && !run.phase.is_final());
    Ok(running.then(|| other.clone()))
}

/// Crashes the pool named `pool` of `policy`: deletes its serving pods with no grace period, as
/// a node or a process dying would. Their names.
async fn crash(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    pool: &str,
) -> Result<Vec<String>, Error> {
    let Some((_, pods)) = pool_pods(ctx, namespace, policy, pool).await? else {
        return Ok(Vec::new());
    };
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    let mut deleted = Vec::new();
    for pod in pods.iter().filter(|p| p.metadata.deletion_timestamp.is_none()) {
        let name = pod.name_any();
        match api.delete(&name, &now).await {
            Ok(_) => deleted.push(name),
            Err(kube::Error::Api(status)) if status.is_not_found() => {}
            Err(error) => return Err(Error::Inject(format!("deleting pod {name}: {error}"))),
        }
    }
    Ok(deleted)
}

/// Sets [`DRIFT_VARIABLE`] to `run` in the serving container of the pool named `pool` (a
/// Deployment), or takes it away with `None`; the workload rolls out either way.
async fn set_drift(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    pool: &str,
    run: Option<&str>,
) -> Result<(), Error> {
    let Some(spec) = policy.spec.pools.iter().find(|p| p.name == pool) else {
        return Ok(());
    };
    if spec.workload.kind != WorkloadKind::Deployment {
        // Nothing was injected, so there is nothing to take back.
        return match run {
            Some(_) => Err(Error::Inject(format!(
                "a drift is injected into a Deployment, and {pool} runs a {:?}",
                spec.workload.kind
            ))),
            None => Ok(()),
        };
    }
    let api: Api<Deployment> = Api::namespaced(ctx.client.clone(), namespace);
    let name = &spec.workload.name;
    let deployment = api
        .get(name)
        .await
        .map_err(|error| Error::Inject(format!("reading Deployment {name}: {error}")))?;
    let container = deployment
        .spec
        .as_ref()
        .and_then(|s| crate::parity::serving_container(&s.template))
        .map(|c| c.name.clone())
        .ok_or_else(|| {
            Error::Inject(format!(
                "Deployment {name} runs no vLLM container that names a model"
            ))
        })?;
    let variable = match run {
        Some(run) => serde_json::json!({"name": DRIFT_VARIABLE, "value": run}),
        None => serde_json::json!({"name": DRIFT_VARIABLE, "$patch": "delete"}),
    };
    let patch = serde_json::json!({
        "spec": {"template": {"spec": {"containers": [{"name": container, "env": [variable]}]}}}
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    api.patch(name, &params, &Patch::Strategic(&patch))
        .await
        .map(|_| ())
        .map_err(|error| Error::Inject(format!("patching Deployment {name}: {error}")))
}

/// Gives the policy its command and names this game day as its holder, in one merge patch
/// conditional on the resourceVersion the run judged: a policy changed since is judged again.
async fn give_command(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    gameday: &str,
    command: &PolicyCommand,
) -> Result<(), Error> {
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.client.clone(), namespace);
    // A fault that is not a command only claims the policy.
    let mut annotations = serde_json::json!({ GAME_DAY_ANNOTATION: gameday });
    if let Some(value) = command.value() {
        annotations[COMMAND_ANNOTATION] = value.into();
    }
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": policy.metadata.resource_version,
            "annotations": annotations,
        }
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    match tokio::time::timeout(
        ctx.write_timeout,
        api.patch_metadata(&policy.name_any(), &params, &Patch::Merge(&patch)),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(kube::Error::Api(status))) if status.code == 409 => Err(Error::PolicyChanged),
        Ok(Err(error)) => Err(Error::Command(error)),
        Err(_) => Err(Error::StatusTimeout(ctx.write_timeout)),
    }
}

/// The pool named `pool` and its serving pods, whatever their phase; `None` for a pool the
/// policy does not name.
async fn pool_pods<'a>(
    ctx: &Context,
    namespace: &str,
    policy: &'a FailoverPolicy,
    pool: &str,
) -> Result<Option<(&'a PoolSpec, Vec<Pod>)>, Error> {
    let Some(spec) = policy.spec.pools.iter().find(|p| p.name == pool) else {
        return Ok(None);
    };
    let pods = KubeReplicas::new(ctx.client.clone())
        .pods(namespace, spec)
        .await
        .map_err(|error| Error::Inject(error.to_string()))?;
    Ok(Some((spec, pods)))
}

/// Has the fences of `pool`'s running replicas play `fault` (for at most the duration given), or
/// take their fault away (`None`); the pods whose fences did. Every fence must take a fault; a
/// fence that has no fault endpoint (404: the pool's port is vLLM's own, with no fence in front)
/// has no fault to take away.
async fn set_fence_fault(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    pool: &str,
    fault: Option<(FenceFault, Duration)>,
) -> Result<Vec<String>, Error> {
    let Some((spec, pods)) = pool_pods(ctx, namespace, policy, pool).await? else {
        return Ok(Vec::new());
    };
    let body = serde_json::json!({
        "fault": fault.map(|(fault, _)| fault),
        "seconds": fault.map_or(1, |(_, lasting)| lasting.as_secs().clamp(1, MAX_FAULT_SECONDS)),
    });
    let body = bytes::Bytes::from(body.to_string());
    let mut told = Vec::new();
    for pod in &pods {
        let Some(endpoint) = replica_endpoint(pod, spec.port) else {
            continue;
        };
        let name = pod.name_any();
        let call = http1::exchange(http1::Call {
            host: &endpoint.host,
            port: endpoint.port,
            method: http::Method::PUT,
            target: FAULT_PATH,
            bearer: ctx.replica_token.as_ref().map(Bearer::secret),
            json: Some(body.clone()),
        });
        let answer = tokio::time::timeout(ctx.write_timeout, call).await;
        let why = match answer {
            Ok(Ok((status, _))) if status.is_success() => {
                told.push(name);
                continue;
            }
            Ok(Ok((status, _))) if status == http::StatusCode::NOT_FOUND && fault.is_none() => continue,
            Ok(Ok((status, answer))) => {
                let hint = match status.as_u16() {
                    404 => "; a hang or half-failed game day needs a fence sidecar on the pool's port",
                    401 | 403 => "; the operator's --replica-token-file must hold the fences' control token",
                    _ => "",
                };
                format!(
                    "answered {status}: {}{hint}",
                    String::from_utf8_lossy(&answer).trim()
                )
            }
            Ok(Err(why)) => why,
            Err(_) => format!("no answer within {:?}", ctx.write_timeout),
        };
        return Err(Error::Inject(format!(
            "the fence of pod {name} at {endpoint}: {why}"
        )));
    }
    Ok(told)
}

/// Takes this game day's name off the policy once its run is over, conditional on the policy as
/// read (another game day may claim it as soon as this run's end is recorded); best effort, since
/// a hold whose run is over is stale to every other game day anyway.
async fn release(ctx: &Context, namespace: &str, policy: &FailoverPolicy, gameday: &str) {
    if policy.annotations().get(GAME_DAY_ANNOTATION).map(String::as_str) != Some(gameday) {
        return;
    }
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.client.clone(), namespace);
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": policy.metadata.resource_version,
            "annotations": { GAME_DAY_ANNOTATION: null },
        }
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let released = tokio::time::timeout(
        ctx.write_timeout,
        api.patch_metadata(&policy.name_any(), &params, &Patch::Merge(&patch)),
    )
    .await;
    if !matches!(released, Ok(Ok(_))) {
        tracing::warn!(%namespace, policy = %policy.name_any(), %gameday, "could not release the game-day hold");
    }
}

fn describe(notice: &Notice) -> KubeEvent {
    let (type_, reason, note) = match notice {
        Notice::Commanded { value, policy } => (
            EventType::Normal,
            "CommandGiven",
            format!("gave FailoverPolicy {policy} {COMMAND_ANNOTATION}={value}"),
        ),
        Notice::Drifted { pool, run } => (
            EventType::Warning,
            "FaultInjected",
            format!("drifted {pool}: its serving container rolls out with {DRIFT_VARIABLE}={run}"),
        ),
        Notice::DriftTakenBack { pool } => (
            EventType::Normal,
            "FaultTakenBack",
            format!("took {DRIFT_VARIABLE} away from {pool}'s serving container: it rolls out as before"),
        ),
        Notice::FencesFaulted { pool, fault, pods } => (
            EventType::Warning,
            "FaultInjected",
            format!(
                "{} {pool}: the fences of its {} serving pod(s) ({}) {}",
                match fault {
                    FenceFault::Hang => "hung",
                    FenceFault::WrongAnswers => "half-failed",
                },
                pods.len(),
                pods.join(", "),
                match fault {
                    FenceFault::Hang => "hold every request but the operator's control calls, unanswered",
                    FenceFault::WrongAnswers => "answer every completion at once, and wrongly",
                }
            ),
        ),
        Notice::FencesRestored { pool, pods } => (
            EventType::Normal,
            "FaultTakenBack",
            format!(
                "took the fault away from the fences of {pool}'s {} serving pod(s) ({})",
                pods.len(),
                pods.join(", ")
            ),
        ),
        Notice::Crashed { pool, pods } => (
            EventType::Warning,
            "FaultInjected",
            format!(
                "crashed {pool}: deleted its {} serving pod(s) with no grace period ({})",
                pods.len(),
                pods.join(", ")
            ),
        ),
        Notice::Finished { run, verdict, reason } => (
            if *verdict == Verdict::Passed {
                EventType::Normal
            } else {
                EventType::Warning
            },
            match verdict {
                Verdict::Passed => "RunPassed",
                Verdict::Failed => "RunFailed",
                Verdict::Aborted => "RunAborted",
            },
            format!("run {run}: {reason}"),
        ),
        Notice::RunRefused { value } => (
            EventType::Warning,
            "RunRefused",
            format!("{COMMAND_ANNOTATION}={value:?} not run: a run is under way or the spec cannot run"),
        ),
        Notice::UnknownCommand { value } => (
            EventType::Warning,
            "UnknownCommand",
            format!("{COMMAND_ANNOTATION}={value:?} names no command; use run"),
        ),
        Notice::Skipped { due, why } => (
            EventType::Warning,
            "RunSkipped",
            format!("the run due at {due} was skipped: {why}"),
        ),
        Notice::Missed { due } => (
            EventType::Warning,
            "RunMissed",
            format!(
                "the run due at {due} was skipped: it was more than {} late (the operator was not running)",
                understudy_core::duration::format(STARTING_DEADLINE)
            ),
        ),
        Notice::InvalidSpec { message } => (EventType::Warning, "InvalidSpec", message.clone()),
    };
    KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "GameDay".to_owned(),
        secondary: None,
    }
}
