//! What a local game day measured: counts and times from the requests' records and the failover
//! logic's timeline, as `report.json`, `report.md` and a terminal summary.
//!
//! Everything here is computed from what was recorded during the run; nothing is assumed. A
//! figure that could not be measured (no failure, so no gap) is `null`, never a made-up zero.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use understudy_router::admission::Priority;

use super::lag::SchedulingLag;
use super::load::{RequestOutcome, RequestRecord};
use super::pilot::ColdStart;
use super::rollout::RolloutRun;

/// Requests by how they ended.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Requests {
    pub sent: u64,
    pub ok: u64,
    pub failed: u64,
    pub shed: u64,
    /// Tries the routers made again on another endpoint before the first byte.
    pub retried: u64,
    /// Requests the routers had sent to a pool that then lost the route, with no first byte
    /// yet, and sent to the new primary.
    pub moved: u64,
}

/// What the routers' own counters say they did for the requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouterCounts {
    /// Tries made again on another endpoint.
    pub retried: u64,
    /// Requests moved to a new route.
    pub moved: u64,
}

impl RouterCounts {
    /// Adds another router's counts.
    pub fn add(&mut self, other: RouterCounts) {
        self.retried += other.retried;
        self.moved += other.moved;
    }
}

/// Percentiles of time to first token, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Ttft {
    /// Before the first fault.
    pub steady_p99: Option<f64>,
    /// In the storm window after the promotion's route.
    pub storm_p99: Option<f64>,
    /// After the storm window.
    pub after_p99: Option<f64>,
}

/// The 95th percentile of successful requests' end-to-end latency around the first fault, in
/// milliseconds, by when they were sent: the measures seed 000 compares.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    /// Before the first fault.
    pub p95_before: Option<f64>,
    /// Between the fault and recovery (the first success of a request sent after the fault):
    /// what the requests a router held, or retried, paid.
    pub p95_during: Option<f64>,
    /// In the first second after recovery: a cold standby shows here.
    pub p95_first_second_after: Option<f64>,
    /// From the end of the storm window after recovery to the end.
    pub p95_steady_after: Option<f64>,
}

/// One step of a promotion, in milliseconds from the start of load.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepSpan {
    pub step: String,
    pub started_ms: f64,
    pub ended_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// One promotion as it ran.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Transition {
    pub kind: String,
    pub from: String,
    pub to: String,
    pub epoch: u64,
    pub started_ms: f64,
    pub steps: Vec<StepSpan>,
    /// What the replicas' own work took (waking a warm tier, starting a pilot light), when there was any.
    pub stage_ms: Option<f64>,
    /// From the promotion's start to its route, less the stage time: what the failover logic
    /// itself added.
    pub orchestration_ms: Option<f64>,
}

/// A route the routers were given: the first one, each promotion's, and each time the primary's
/// route grew with replicas that passed after it moved.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouteChange {
    pub at_ms: f64,
    pub pool: String,
    pub epoch: u64,
    /// How many replicas it routes to, each through its fence.
    pub replicas: usize,
}

/// A fault as applied.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AppliedFault {
    /// When it began to be applied: the first replica went down here.
    pub started_ms: f64,
    /// When every replica of the pool had it.
    pub at_ms: f64,
    /// When it ended, for a fault that lasts a while.
    pub ended_ms: Option<f64>,
    pub fault: String,
    pub pool: String,
    pub replicas: usize,
}

/// The standby's load proof during a run, as its replay's client saw it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoadProofRun {
    pub at_ms: f64,
    /// The pool proven, and how many of its replicas answered the generating probe just before.
    pub pool: String,
    pub replicas: usize,
    pub answered_probe: usize,
    /// The rate the routers recorded the run's load at, and the rate replayed, a second.
    pub recorded_rate: Option<f64>,
    pub replayed_rate: Option<f64>,
    pub requests: usize,
    pub errors: usize,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    /// Whether it kept every threshold; `None` when nothing was replayed.
    pub proven: Option<bool>,
    /// Each threshold broken.
    pub broken: Vec<String>,
    /// Why nothing was replayed.
    pub not_run: Option<String>,
}

impl LoadProofRun {
    /// One line of the text report.
    #[must_use]
    pub fn line(&self) -> String {
        let probed = format!(
            "{} of {}'s {} replica(s) answered the probe",
            self.answered_probe, self.pool, self.replicas
        );
        if let Some(why) = &self.not_run {
            return format!("load proof at {:.0} ms: not run ({why}); {probed}", self.at_ms);
        }
        // Whole milliseconds as the thresholds' words count them (truncated).
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{} ms", v.floor()));
        let rate = |v: Option<f64>| v.map_or_else(|| "?".to_owned(), |v| format!("{v:.1}/s"));
        let verdict = match self.proven {
            Some(true) => "PROVEN".to_owned(),
            _ => format!("FAILED: {}", self.broken.join("; ")),
        };
        format!(
            "load proof at {:.0} ms: {probed}; {} requests replayed at {} (recorded {}): {} failed, \
             TTFT p99 {}, inter-token p99 {}: {verdict}",
            self.at_ms,
            self.requests,
            rate(self.replayed_rate),
            rate(self.recorded_rate),
            self.errors,
            ms(self.ttft_p99_ms),
            ms(self.itl_p99_ms),
        )
    }
}

/// One run's report, under the names `report.json` keeps.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunReport {
    pub name: String,
    /// The seed of the load's arrivals, prompts and lengths.
    pub seed: u64,
    /// `active-passive` or `active-active`.
    pub topology: String,
    pub duration_ms: f64,
    pub requests: Requests,
    pub failed_before_reaching_a_replica: u64,
    /// Failed requests by what their clients saw.
    pub failures: BTreeMap<String, u64>,
    /// Shed requests by the class they declared: admission control sheds batch work first.
    pub shed_by_priority: BTreeMap<String, u64>,
    /// Failed requests sent before the first fault: in flight, most of them held by a replica
    /// that died with them.
    pub failed_in_flight_at_fault: u64,
    /// From the first failure after the first fault to the first success after it, as clients
    /// saw it; `null` when no request failed.
    pub gap_ms: Option<f64>,
    /// From the first fault to the promotion's start.
    pub detection_ms: Option<f64>,
    /// What the probe interval, thresholds and timeout predict for that fault, `[low, high]`.
    pub predicted_detection_ms: Option<[f64; 2]>,
    /// The longest time after the first fault in which no request ended in success: what a
    /// client saw as the outage, failures or not.
    pub stall_ms: Option<f64>,
    pub latency_ms: Latency,
    pub ttft_ms: Ttft,
    /// The same, for the requests that declared themselves interactive.
    pub ttft_interactive_ms: Ttft,
    pub faults: Vec<AppliedFault>,
    /// What held the failover logic back, when it changed (a promotion blocked and why, a
    /// command refused, the lease's store lost and back), timed from the start of load.
    pub held_back: Vec<String>,
    /// The last parity report between the pools: the keys that drift, with both sides' values.
    pub parity: Option<understudy_prober::parity::DriftReport>,
    /// The standby's load proof, when the scenario ran one.
    pub load_proof: Option<LoadProofRun>,
    /// The standby-first rollout, when the scenario set a new version.
    pub rollout: Option<RolloutRun>,
    pub transitions: Vec<Transition>,
    /// Every route the routers were given, in order.
    pub routes: Vec<RouteChange>,
    /// What was done to pool b when it became the standby again after a failback, timed.
    pub standby_shaped: Vec<String>,
    /// Each grant round that changed what the fences hold, timed.
    pub grants: Vec<String>,
    /// For each partition: when the cut-off pool's fences stopped serving, as they answered.
    pub self_fence: Vec<SelfFence>,
    /// Each fence's grant each time it changed, as the fence answered a watch that asked it
    /// every 50 ms.
    pub fence_standings: Vec<FenceStanding>,
    /// Every replica started during the run (a pilot light), stage by stage.
    pub cold_starts: Vec<ColdStart>,
    pub verdict: Verdict,
    /// Why the verdict is what it is, one line each.
    pub verdict_reasons: Vec<String>,
    /// What this run leaves out, so nobody reads a missing part as measured.
    pub not_measured: Vec<String>,
    /// The peak memory of the run's own process, its replicas, routers and fences together, sampled every half
    /// second, in MiB.
    pub memory_peak_mib: Option<f64>,
    /// How late this process's timers fired during the run: how loaded the machine was.
    pub scheduling_lag: SchedulingLag,
    /// Every request's record, for the timeline; not in `report.json`.
    #[serde(skip)]
    pub records: Vec<RequestRecord>,
}

/// A fence's grant from a moment on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FenceStanding {
    pub at_ms: u64,
    pub pool: String,
    pub fence: String,
    /// `none`, `fenced`, `waiting`, `serving`, `failsafe` or `expired`.
    pub standing: String,
    pub epoch: Option<u64>,
}

/// How a pool cut off by a partition fenced itself, as its fences answered a watch that asked
/// them every 50 ms from outside the partition.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SelfFence {
    pub pool: String,
    /// When the partition began, and how long it lasted (to the end of the run when it did not
    /// end).
    pub fault_at_ms: f64,
    pub lasted_ms: f64,
    /// The fences serving when it began.
    pub fences: usize,
    /// From the partition to the last of those fences no longer serving; `None` when one served
    /// on to the partition's end.
    pub stopped_after_ms: Option<f64>,
    /// The bound: no fence serves past its grant's time to live from the last grant it took,
    /// which was before the partition.
    pub bound_ms: f64,
    /// A fence that stopped and then served again at the epoch it stopped at, before the
    /// partition ended: what must never happen.
    pub served_again: usize,
}

/// Whether the run showed what its scenario expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Verdict {
    Passed,
    Failed,
    /// Stopped before its end (Ctrl-C): what it had is reported, and nothing is judged.
    Interrupted,
    /// Its expectations did not hold while the machine was too loaded for its figures to be
    /// trusted ([`SchedulingLag::too_loaded`]): reported, not judged. A run that held its
    /// expectations under load passed.
    Inconclusive,
}

impl RunReport {
    /// Weighs the verdict against how loaded the machine was: a failure under too much lag is
    /// inconclusive, with the reason first among the verdict's reasons.
    pub fn judge_with(&mut self, lag: SchedulingLag) {
        if self.verdict == Verdict::Failed
            && let Some(why) = lag.too_loaded()
        {
            self.verdict = Verdict::Inconclusive;
            self.verdict_reasons.insert(0, why);
        }
        self.scheduling_lag = lag;
    }
}

/// The whole document.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub scenario: String,
    pub runs: Vec<RunReport>,
}

/// How long after a promotion's route the prefill storm is counted.
pub const STORM_WINDOW: Duration = Duration::from_secs(5);

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Counts the requests by outcome.
#[must_use]
pub fn count(records: &[RequestRecord], routed_by: RouterCounts) -> Requests {
    let of = |o: RequestOutcome| records.iter().filter(|r| r.outcome == o).count() as u64;
    Requests {
        sent: records.len() as u64,
        ok: of(RequestOutcome::Ok),
        failed: of(RequestOutcome::Failed),
        shed: of(RequestOutcome::Shed),
        retried: routed_by.retried,
        moved: routed_by.moved,
    }
}

/// Failed requests by what their clients saw.
#[must_use]
pub fn failures(records: &[RequestRecord]) -> BTreeMap<String, u64> {
    let mut by_kind = BTreeMap::new();
    for failure in records.iter().filter_map(|r| r.failure.as_ref()) {
        *by_kind.entry(failure.clone()).or_insert(0) += 1;
    }
    by_kind
}

/// Shed requests by their declared class.
#[must_use]
pub fn shed_by_priority(records: &[RequestRecord]) -> BTreeMap<String, u64> {
    let mut by_class = BTreeMap::new();
    for r in records.iter().filter(|r| r.outcome == RequestOutcome::Shed) {
        let class = match r.priority {
            Priority::Interactive => "interactive",
            Priority::Default => "default",
            Priority::Batch => "batch",
        };
        *by_class.entry(class.to_owned()).or_insert(0) += 1;
    }
    by_class
}

/// From the first request to fail after `fault` (by when it ended) to the first success that
/// ended after it.
#[must_use]
pub fn gap(records: &[RequestRecord], fault: Duration) -> Option<Duration> {
    let first_failure = records
        .iter()
        .filter(|r| r.outcome == RequestOutcome::Failed && r.ended >= fault)
        .map(|r| r.ended)
        .min()?;
    let recovered = records
        .iter()
        .filter(|r| r.outcome == RequestOutcome::Ok && r.ended > first_failure)
        .map(|r| r.ended)
        .min()?;
    Some(recovered - first_failure)
}

/// The `q` quantile of `values` by rank (the smallest that covers `q` of them), in ms.
fn quantile(mut values: Vec<Duration>, q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort();
    let rank = ((values.len() as f64) * q).ceil() as usize;
    Some(ms(values[rank.clamp(1, values.len()) - 1]))
}

/// Which successful requests a percentile is taken over: sent in `[from, to)`, of one class
/// or of all.
#[derive(Clone, Copy, Debug)]
struct Window {
    from: Duration,
    to: Duration,
    class: Option<Priority>,
    /// Only requests that also ended before `to`: a steady state before a fault, which the
    /// requests the fault caught in flight are not part of.
    settled: bool,
}

impl Window {
    fn all(from: Duration, to: Duration) -> Window {
        Window {
            from,
            to,
            class: None,
            settled: false,
        }
    }

    fn before(to: Duration, class: Option<Priority>) -> Window {
        Window {
            from: Duration::ZERO,
            to,
            class,
            settled: true,
        }
    }

    fn holds(self, r: &RequestRecord) -> bool {
        r.outcome == RequestOutcome::Ok
            && r.sent >= self.from
            && r.sent < self.to
            && (!self.settled || r.ended < self.to)
            && self.class.is_none_or(|c| c == r.priority)
    }

    fn ttft_p99(self, records: &[RequestRecord]) -> Option<f64> {
        let ttfts = records.iter().filter(|r| self.holds(r));
        quantile(
            ttfts.filter_map(|r| r.first_byte.map(|f| f - r.sent)).collect(),
            0.99,
        )
    }

    fn latency_p95(self, records: &[RequestRecord]) -> Option<f64> {
        let done = records.iter().filter(|r| self.holds(r));
        quantile(done.map(|r| r.ended - r.sent).collect(), 0.95)
    }
}

/// The 99th percentile of time to first token of the successful requests sent in `[from, to)`.
#[must_use]
pub fn ttft_p99(records: &[RequestRecord], from: Duration, to: Duration) -> Option<f64> {
    Window::all(from, to).ttft_p99(records)
}

/// The time-to-first-token percentiles around the first promotion's route, of the requests of
/// `class` or of all.
#[must_use]
pub fn ttft(
    records: &[RequestRecord],
    class: Option<Priority>,
    fault: Option<Duration>,
    routed: Option<Duration>,
    end: Duration,
) -> Ttft {
    let window = |from, to| {
        Window {
            from,
            to,
            class,
            settled: false,
        }
        .ttft_p99(records)
    };
    Ttft {
        steady_p99: Window::before(fault.unwrap_or(end), class).ttft_p99(records),
        storm_p99: routed.and_then(|at| window(at, at + STORM_WINDOW)),
        after_p99: routed.and_then(|at| window(at + STORM_WINDOW, end)),
    }
}

/// When service came back after `fault`: the first success of a request sent after it.
#[must_use]
pub fn recovered(records: &[RequestRecord], fault: Duration) -> Option<Duration> {
    records
        .iter()
        .filter(|r| r.outcome == RequestOutcome::Ok && r.sent >= fault)
        .map(|r| r.ended)
        .min()
}

/// The end-to-end p95s around `fault`.
#[must_use]
pub fn latency(records: &[RequestRecord], fault: Option<Duration>, end: Duration) -> Latency {
    let Some(fault) = fault else {
        return Latency {
            p95_before: Window::all(Duration::ZERO, end).latency_p95(records),
            ..Latency::default()
        };
    };
    let back = recovered(records, fault);
    let p95 = |from, to| Window::all(from, to).latency_p95(records);
    Latency {
        p95_before: Window::before(fault, None).latency_p95(records),
        p95_during: back.and_then(|at| p95(fault, at)),
        p95_first_second_after: back.and_then(|at| p95(at, at + Duration::from_secs(1))),
        p95_steady_after: back.and_then(|at| p95(at + STORM_WINDOW, end)),
    }
}

/// The longest stretch from `fault` to `end` in which no request ended in success.
#[must_use]
pub fn stall(records: &[RequestRecord], fault: Duration, end: Duration) -> Duration {
    let mut ends: Vec<Duration> = records
        .iter()
        .filter(|r| r.outcome == RequestOutcome::Ok && r.ended >= fault)
        .map(|r| r.ended)
        .collect();
    ends.sort();
    let mut longest = Duration::ZERO;
    let mut last = fault;
    // Requests still finishing after `end` (the drain) count too; `end` only closes a stall
    // that lasted to the end of the load.
    for at in ends.into_iter().chain(std::iter::once(end)) {
        longest = longest.max(at.saturating_sub(last));
        last = last.max(at);
    }
    longest
}

/// Milliseconds, as a report prints them.
#[must_use]
pub fn to_ms(d: Duration) -> f64 {
    ms(d)
}

fn cell(value: Option<f64>) -> String {
    value.map_or("-".to_owned(), |v| format!("{v:.0}"))
}

/// The terminal summary, also the head of `report.md`.
#[must_use]
pub fn summary(run: &RunReport) -> String {
    let r = &run.requests;
    let mut out = String::new();
    let _ = writeln!(out, "{}: {:?}", run.name, run.verdict);
    for reason in &run.verdict_reasons {
        let _ = writeln!(out, "  {reason}");
    }
    let _ = writeln!(
        out,
        "requests: {} sent, {} ok, {} failed ({} before reaching a replica), {} shed, {} retried by the routers, {} moved to the new primary",
        r.sent, r.ok, r.failed, run.failed_before_reaching_a_replica, r.shed, r.retried, r.moved
    );
    if run.requests.failed > 0 {
        let _ = writeln!(
            out,
            "of the failed: {} sent before the fault (in flight when it struck), {} sent after it",
            run.failed_in_flight_at_fault,
            run.requests.failed - run.failed_in_flight_at_fault
        );
    }
    if !run.shed_by_priority.is_empty() {
        let classes: Vec<String> = run
            .shed_by_priority
            .iter()
            .map(|(class, n)| format!("{n} {class}"))
            .collect();
        let _ = writeln!(out, "shed: {}", classes.join(", "));
    }
    if !run.failures.is_empty() {
        let kinds: Vec<String> = run
            .failures
            .iter()
            .map(|(kind, n)| format!("{n} {kind}"))
            .collect();
        let _ = writeln!(out, "failures: {}", kinds.join(", "));
    }
    let _ = writeln!(
        out,
        "gap as clients saw it: {} ms; no success for {} ms at the longest; detection: {} ms (predicted {})",
        cell(run.gap_ms),
        cell(run.stall_ms),
        cell(run.detection_ms),
        run.predicted_detection_ms
            .map_or("-".to_owned(), |[low, high]| format!("{low:.0}-{high:.0} ms"))
    );
    let l = &run.latency_ms;
    let _ = writeln!(
        out,
        "latency p95: {} ms before the fault, {} ms until recovery, {} ms in the first second after, {} ms steady after",
        cell(l.p95_before),
        cell(l.p95_during),
        cell(l.p95_first_second_after),
        cell(l.p95_steady_after)
    );
    for (who, t) in [("", &run.ttft_ms), (" (interactive)", &run.ttft_interactive_ms)] {
        if who.is_empty() || t.steady_p99.is_some() {
            let _ = writeln!(
                out,
                "time to first token p99{who}: {} ms steady, {} ms in the {} s after the route, {} ms after",
                cell(t.steady_p99),
                cell(t.storm_p99),
                STORM_WINDOW.as_secs(),
                cell(t.after_p99)
            );
        }
    }
    let lag = &run.scheduling_lag;
    if lag.ticks > 0 {
        let _ = writeln!(
            out,
            "scheduling lag: {:.0} ms at the 99th percentile, {:.0} ms at the most, of this process's timers",
            lag.p99_ms, lag.max_ms
        );
    }
    if let Some(mib) = run.memory_peak_mib {
        let _ = writeln!(
            out,
            "memory: {mib} MiB at the peak, this process, its replicas, routers and fences together"
        );
    }
    for fault in &run.faults {
        let until = fault
            .ended_ms
            .map_or(String::new(), |end| format!(" until {end:.0} ms"));
        let _ = writeln!(
            out,
            "fault: {} of {} ({} replica(s)) at {:.0} ms{until}",
            fault.fault, fault.pool, fault.replicas, fault.at_ms
        );
    }
    if let Some(parity) = run.parity.as_ref().filter(|p| !p.holds()) {
        let _ = write!(out, "parity drift:\n{}", indent(&parity.render()));
    }
    if let Some(proof) = &run.load_proof {
        let _ = writeln!(out, "{}", proof.line());
    }
    for line in run.rollout.iter().flat_map(RolloutRun::lines) {
        let _ = writeln!(out, "{line}");
    }
    for line in &run.held_back {
        let _ = writeln!(out, "held back: {line}");
    }
    for transition in &run.transitions {
        let _ = writeln!(
            out,
            "{} {} -> {} at epoch {}, from {:.0} ms:",
            transition.kind, transition.from, transition.to, transition.epoch, transition.started_ms
        );
        if let (Some(stage), Some(added)) = (transition.stage_ms, transition.orchestration_ms) {
            let _ = writeln!(
                out,
                "  the replicas' own work (waking, starting) took {stage:.0} ms; the failover logic added {added:.0} ms to reach the route"
            );
        }
        for step in &transition.steps {
            let _ = writeln!(
                out,
                "  {:<14} {:>8.0} ms {:>8.1} ms  {}",
                step.step,
                step.ended_ms,
                step.ended_ms - step.started_ms,
                step.note.as_deref().unwrap_or("")
            );
        }
    }
    // The routes after the first: each promotion's, and each time one grew as replicas passed.
    if run.routes.len() > 1 {
        let routes: Vec<String> = run
            .routes
            .iter()
            .skip(1)
            .map(|r| {
                format!(
                    "{} x{} at epoch {} ({:.0} ms)",
                    r.pool, r.replicas, r.epoch, r.at_ms
                )
            })
            .collect();
        let _ = writeln!(out, "routes: {}", routes.join(", "));
    }
    for line in &run.standby_shaped {
        let _ = writeln!(out, "standby: {line}");
    }
    for line in &run.grants {
        let _ = writeln!(out, "grants: {line}");
    }
    // The fences' own account, after the first answers.
    for change in run.fence_standings.iter().skip_while(|c| c.at_ms < 500) {
        let epoch = change.epoch.map_or_else(|| "-".to_owned(), |e| e.to_string());
        let _ = writeln!(
            out,
            "fence: {:.1} s: {}'s {} {} at epoch {epoch}",
            change.at_ms as f64 / 1e3,
            change.pool,
            change.fence,
            change.standing
        );
    }
    for cut in &run.self_fence {
        let stopped = cut.stopped_after_ms.map_or_else(
            || "kept serving".to_owned(),
            |ms| format!("stopped serving {:.1} s after it", ms / 1e3),
        );
        let _ = writeln!(
            out,
            "self-fence: {}'s {} fence(s) cut off at {:.1} s for {:.1} s: {stopped} (bound: the grant's {:.1} s); served again after stopping: {}",
            cut.pool,
            cut.fences,
            cut.fault_at_ms / 1e3,
            cut.lasted_ms / 1e3,
            cut.bound_ms / 1e3,
            cut.served_again
        );
    }
    if !run.cold_starts.is_empty() {
        out.push_str(&cold_start_table(&run.cold_starts));
    }
    out
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

/// The cold starts, one row per replica, one column per stage, in milliseconds.
#[must_use]
pub fn cold_start_table(starts: &[ColdStart]) -> String {
    // Every stage any replica has, in the order they first appear.
    let mut stages: Vec<&str> = Vec::new();
    for start in starts {
        for stage in &start.stages {
            if !stages.contains(&stage.stage) {
                stages.push(stage.stage);
            }
        }
    }
    if stages.is_empty() {
        return String::new();
    }
    let mut out = String::from("cold starts (ms):\n  replica  tier         ");
    for stage in &stages {
        let _ = write!(out, "{stage:>16}");
    }
    out.push_str("   to first token\n");
    for start in starts {
        let _ = write!(out, "  {:<8} {:<12} ", start.replica, start.tier);
        for stage in &stages {
            let ms = start.stages.iter().find(|s| s.stage == *stage).and_then(|s| s.ms);
            let _ = write!(out, "{:>16}", cell(ms));
        }
        let _ = writeln!(out, "   {:>14}", cell(start.to_first_token_ms));
    }
    out
}

/// The median and range of `values`, as `median [min, max]`; `-` when there are none.
fn spread(mut values: Vec<f64>) -> String {
    if values.is_empty() {
        return "-".to_owned();
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    let median = if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    };
    format!("{median:.0} [{:.0}, {:.0}]", values[0], values[values.len() - 1])
}

/// Several runs side by side, one line each (milliseconds; p95s of successful requests'
/// latency before the fault, in the first second after recovery and steady after), then the
/// median and range of every run name that ran under more than one seed.
#[must_use]
pub fn side_by_side(runs: &[RunReport]) -> String {
    let mut out = format!(
        "{:<28} {:>5} {:<12} {:>5} {:>6} {:>6} {:>6} {:>6} {:>9} {:>6} {:>6} {:>6} {:>6}\n",
        "run",
        "seed",
        "verdict",
        "sent",
        "failed",
        "flight",
        "gap",
        "stall",
        "detection",
        "p95<",
        "p95 1s",
        "p95>",
        "lag"
    );
    for run in runs {
        let l = &run.latency_ms;
        let _ = writeln!(
            out,
            "{:<28} {:>5} {:<12} {:>5} {:>6} {:>6} {:>6} {:>6} {:>9} {:>6} {:>6} {:>6} {:>6}",
            run.name,
            run.seed,
            format!("{:?}", run.verdict),
            run.requests.sent,
            run.requests.failed,
            run.failed_in_flight_at_fault,
            cell(run.gap_ms),
            cell(run.stall_ms),
            cell(run.detection_ms),
            cell(l.p95_before),
            cell(l.p95_first_second_after),
            cell(l.p95_steady_after),
            cell((run.scheduling_lag.ticks > 0).then_some(run.scheduling_lag.max_ms))
        );
    }
    for run in runs.iter().filter(|r| r.verdict == Verdict::Inconclusive) {
        let _ = writeln!(
            out,
            "{} (seed {}) is inconclusive: {}",
            run.name,
            run.seed,
            run.verdict_reasons.first().map_or("", String::as_str)
        );
    }
    let mut names: Vec<&str> = Vec::new();
    for run in runs {
        if !names.contains(&run.name.as_str()) {
            names.push(&run.name);
        }
    }
    for name in names {
        let same: Vec<&RunReport> = runs.iter().filter(|r| r.name == name).collect();
        if same.len() < 2 {
            continue;
        }
        let of = |f: &dyn Fn(&RunReport) -> Option<f64>| spread(same.iter().copied().filter_map(f).collect());
        let _ = writeln!(
            out,
            "{name}, median [range] over {} seeds: failed {}, in flight {}, gap {} ms, stall {} ms, detection {} ms",
            same.len(),
            of(&|r| Some(r.requests.failed as f64)),
            of(&|r| Some(r.failed_in_flight_at_fault as f64)),
            of(&|r| r.gap_ms),
            of(&|r| r.stall_ms),
            of(&|r| r.detection_ms)
        );
    }
    out
}

/// `report.md`: the summary, then what was not measured.
#[must_use]
pub fn markdown(report: &Report) -> String {
    let mut out = format!("# Local game day: {}\n\n", report.scenario);
    if report.runs.len() > 1 {
        let _ = writeln!(out, "```text\n{}```\n", side_by_side(&report.runs));
    }
    for run in &report.runs {
        let _ = writeln!(out, "## {}\n\n```text\n{}```\n", run.name, summary(run));
        if !run.not_measured.is_empty() {
            out.push_str("Not measured in this run:\n\n");
            for item in &run.not_measured {
                let _ = writeln!(out, "- {item}");
            }
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(sent_ms: u64, ended_ms: u64, outcome: RequestOutcome) -> RequestRecord {
        RequestRecord {
            sent: Duration::from_millis(sent_ms),
            ended: Duration::from_millis(ended_ms),
            first_byte: Some(Duration::from_millis(sent_ms + 10)),
            outcome,
            never_reached_a_replica: false,
            stream: false,
            priority: Priority::Default,
            failure: (outcome == RequestOutcome::Failed).then(|| "http 502".to_owned()),
        }
    }

    #[test]
    fn the_gap_runs_from_the_first_failure_after_the_fault_to_the_next_success() {
        let records = [
            record(0, 900, RequestOutcome::Failed), // before the fault: not counted
            record(1_000, 1_100, RequestOutcome::Ok),
            record(1_200, 1_300, RequestOutcome::Failed),
            record(1_250, 1_400, RequestOutcome::Failed),
            record(1_300, 2_000, RequestOutcome::Ok),
        ];
        assert_eq!(
            gap(&records, Duration::from_secs(1)),
            Some(Duration::from_millis(700))
        );
        let clean = [record(1_000, 1_100, RequestOutcome::Ok)];
        assert_eq!(gap(&clean, Duration::from_secs(1)), None);
    }

    #[test]
    fn the_p99_is_the_rank_that_covers_ninety_nine_in_a_hundred() {
        let mut records: Vec<RequestRecord> =
            (0..100).map(|i| record(i, i + 50, RequestOutcome::Ok)).collect();
        records[99].first_byte = Some(Duration::from_millis(99 + 500));
        records[98].first_byte = Some(Duration::from_millis(98 + 200));
        assert_eq!(
            ttft_p99(&records, Duration::ZERO, Duration::from_secs(1)),
            Some(200.0)
        );
        assert_eq!(
            ttft_p99(&records, Duration::from_secs(5), Duration::from_secs(6)),
            None
        );
    }

    #[test]
    fn the_stall_is_the_longest_stretch_after_the_fault_without_a_success() {
        let fault = Duration::from_secs(1);
        let end = Duration::from_secs(3);
        let records = [
            record(0, 900, RequestOutcome::Ok), // before the fault: not counted
            record(900, 1_100, RequestOutcome::Ok),
            record(1_000, 1_200, RequestOutcome::Failed),
            record(1_100, 2_000, RequestOutcome::Ok), // 900 ms after the last success
            record(2_500, 3_400, RequestOutcome::Ok), // ends in the drain, after `end`
        ];
        assert_eq!(stall(&records, fault, end), Duration::from_millis(1_400));
        // Nothing succeeds after the fault: the stall lasts to the end of the load.
        assert_eq!(stall(&records[..1], fault, end), Duration::from_secs(2));
    }

    #[test]
    fn a_spread_is_the_median_and_the_range() {
        assert_eq!(spread(vec![3.0, 1.0, 2.0]), "2 [1, 3]");
        assert_eq!(spread(vec![4.0, 1.0, 2.0, 3.0]), "2 [1, 4]");
        assert_eq!(spread(Vec::new()), "-");
    }

    #[test]
    fn requests_are_counted_by_outcome() {
        let records = [
            record(0, 1, RequestOutcome::Ok),
            record(0, 1, RequestOutcome::Shed),
            record(0, 1, RequestOutcome::Failed),
            record(0, 1, RequestOutcome::Ok),
        ];
        assert_eq!(
            count(&records, RouterCounts { retried: 3, moved: 2 }),
            Requests {
                sent: 4,
                ok: 2,
                failed: 1,
                shed: 1,
                retried: 3,
                moved: 2,
            }
        );
    }
}
