//! When the schedule fires next, and what a run that falls due while another is under way
//! becomes (`concurrencyPolicy`).

use std::time::Duration;

use k8s_openapi::jiff::tz::TimeZone;

use super::notices::Notice;
use crate::crd::{ConcurrencyPolicy, GameDayStatus, RunPhase, Verdict};
use crate::cron::CronSchedule;
use crate::gameday::RunMachine;
use crate::reconciler::rfc3339;

pub(super) fn next_after(cron: &CronSchedule, zone: &TimeZone, now: Duration) -> Option<Duration> {
    let now = k8s_openapi::jiff::Timestamp::from_second(i64::try_from(now.as_secs()).ok()?).ok()?;
    let next = cron.next_after_in(now, zone)?;
    Some(Duration::from_secs(u64::try_from(next.as_second()).ok()?))
}

/// A scheduled run came due at `at` while another run, or a `run` command, holds the game day:
/// `policy` says whether it is skipped, waits, or replaces a run that has not injected yet.
pub(super) fn due_while_running(
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
