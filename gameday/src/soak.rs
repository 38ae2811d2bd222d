//! The soak: mixed streaming and non-streaming load through two gateway processes in front of
//! emulated replicas, with a fault every so often, taken in turn: a replica killed (SIGKILL, and
//! started again), a replica stopped (SIGSTOP, then SIGCONT), a gateway restarted (SIGTERM, its
//! drain, and a new process on the same ports). The client does what a load balancer in front of
//! the gateways does: it polls each gateway's `/ready` and sends only to those that answer 200.
//!
//! It counts what a client saw, and holds the data path to two promises: no request fails
//! without a replica having taken it (the drain and the retries before the first byte cover every
//! such fault), and no answer that was cut ends looking finished (a cut stream ends with the
//! retryable error event, never a clean end without `[DONE]`). Requests a replica held when it
//! was killed or stopped may fail; they are counted by reason, not hidden.
//!
//! Every process is on loopback and stopped when the soak ends; the load is bounded in time.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinSet;
use tokio::time::Instant;
use understudy_core::Pool;

use crate::local::http::{Answer, ExchangeError, exchange};
use crate::local::load::{self, RequestOutcome};
use crate::local::process::{Process, ProcessError};
use crate::local::replicas::{Launcher, Replica, ReplicaError, Startup};
use crate::local::scenario::Load;
use crate::local::system::RunDir;

/// How a soak runs.
#[derive(Clone, Debug, PartialEq)]
pub struct SoakConfig {
    /// How long load runs.
    pub duration: Duration,
    /// A fault starts this often, the first one this long after load starts.
    pub fault_every: Duration,
    /// Requests a second, as a Poisson process; half of them stream.
    pub rate: f64,
    /// Emulated replicas behind the gateways.
    pub replicas: usize,
    /// The gateways' `--drain-delay-ms`: how long a stopping gateway fails `/ready` and serves on.
    pub drain_delay: Duration,
    /// How often the client reads each gateway's `/ready`.
    pub ready_poll: Duration,
    pub seed: u64,
}

impl Default for SoakConfig {
    fn default() -> Self {
        SoakConfig {
            duration: Duration::from_secs(600),
            fault_every: Duration::from_secs(30),
            rate: 20.0,
            replicas: 3,
            drain_delay: Duration::from_secs(5),
            ready_poll: Duration::from_millis(250),
            seed: 1,
        }
    }
}

/// The faults the soak takes in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SoakFault {
    ReplicaKilled,
    ReplicaStopped,
    GatewayRestarted,
}

/// One fault: when it struck, what, and when its target was back.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct FaultRecord {
    pub at_s: f64,
    pub fault: SoakFault,
    pub target: String,
    pub back_s: f64,
}

/// What the clients saw.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct SoakReport {
    pub duration_s: f64,
    pub sent: u64,
    pub streams: u64,
    pub ok: u64,
    pub shed: u64,
    pub failed: u64,
    /// Failed with no replica having taken the request: must be zero.
    pub failed_before_a_replica: u64,
    /// Answers that ended cleanly, by their framing, yet were cut (no `[DONE]` and no error
    /// event, or a body that is not an answer): must be zero.
    pub cut_looking_finished: u64,
    /// Failures by what the client saw.
    pub failures: BTreeMap<String, u64>,
    pub faults: Vec<FaultRecord>,
}

impl SoakReport {
    /// Both promises held, and the soak did something.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.failed_before_a_replica == 0
            && self.cut_looking_finished == 0
            && self.ok > 0
            && !self.faults.is_empty()
    }

    /// The report as a person reads it.
    #[must_use]
    pub fn summary(&self) -> String {
        use std::fmt::Write;

        let mut text = String::new();
        let _ = writeln!(
            text,
            "soak: {:.0} s, {} requests ({} streaming): {} ok, {} shed, {} failed",
            self.duration_s, self.sent, self.streams, self.ok, self.shed, self.failed
        );
        let _ = writeln!(
            text,
            "  failed before any replica took them: {}",
            self.failed_before_a_replica
        );
        let _ = writeln!(
            text,
            "  cut answers that looked finished:    {}",
            self.cut_looking_finished
        );
        for (reason, count) in &self.failures {
            let _ = writeln!(text, "  failed, {reason}: {count}");
        }
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for fault in &self.faults {
            *kinds.entry(fault_name(fault.fault)).or_default() += 1;
        }
        let faults: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
        let _ = writeln!(text, "  faults: {}", faults.join(", "));
        let verdict = if self.passed() { "PASSED" } else { "FAILED" };
        let _ = writeln!(text, "verdict: {verdict}");
        text
    }
}

fn fault_name(fault: SoakFault) -> &'static str {
    match fault {
        SoakFault::ReplicaKilled => "replica killed",
        SoakFault::ReplicaStopped => "replica stopped",
        SoakFault::GatewayRestarted => "gateway restarted",
    }
}

/// Why a soak could not run.
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error("the soak's files: {0}")]
    Files(#[from] std::io::Error),
    #[error("gateway {gateway} refused the route: {answer}")]
    Route { gateway: usize, answer: String },
    #[error("gateway {gateway} did not exit within {limit:?} of SIGTERM")]
    NoExit { gateway: usize, limit: Duration },
    #[error("{0} replicas: at least two are needed, so that one can fail")]
    TooFewReplicas(usize),
}

/// How long a process may take to report its ports.
const START_LIMIT: Duration = Duration::from_secs(30);
/// How long a stopping gateway may take to exit, past its drain delay: its drain timeout and a
/// margin.
const EXIT_LIMIT: Duration = Duration::from_secs(30);
/// The longest a request may take before its client gives up.
const REQUEST_LIMIT: Duration = Duration::from_secs(30);
/// A replica hangs on a gateway's first byte this long before it is a 504 (and ejected).
const FIRST_BYTE_TIMEOUT_MS: &str = "5000";
const MODEL: &str = "Qwen/Qwen3-0.6B";

/// One gateway, as the client sees it: where to send, and whether it last said it was ready.
#[derive(Debug)]
struct GatewaySlot {
    public: SocketAddr,
    admin: SocketAddr,
    ready: AtomicBool,
}

/// Runs the soak: `emulator` starts replicas, `router` gateways.
pub async fn run(
    emulator: &Launcher,
    router: &Launcher,
    config: &SoakConfig,
) -> Result<SoakReport, SoakError> {
    if config.replicas < 2 {
        return Err(SoakError::TooFewReplicas(config.replicas));
    }
    let dir = RunDir::create(config.seed)?;
    let mut replicas = Vec::new();
    for i in 0..config.replicas {
        replicas.push(start_replica(emulator, i).await?);
    }
    let mut gateways = Gateways::start(router, &dir, config).await?;
    let endpoints: Vec<SocketAddr> = replicas.iter().map(|r| r.api).collect();
    for i in 0..gateways.processes.len() {
        gateways.route(i, &endpoints).await?;
    }

    let slots = Arc::clone(&gateways.slots);
    let polling = tokio::spawn(poll_ready(Arc::clone(&slots), config.ready_poll));
    for slot in slots.iter() {
        slot.ready.store(is_ready(slot.admin).await, Ordering::Relaxed);
    }
    let start = Instant::now();
    let tally = Arc::new(Mutex::new(SoakReport::default()));
    let loading = tokio::spawn(send_load(
        Arc::clone(&slots),
        config.clone(),
        start,
        Arc::clone(&tally),
    ));

    let mut faults = Vec::new();
    let mut next = config.fault_every;
    let mut turn = 0_usize;
    // A fault starts only while load runs, and only once the last one's target is back.
    while next + config.fault_every / 2 < config.duration {
        tokio::time::sleep_until(start + next).await;
        let at_s = start.elapsed().as_secs_f64();
        let kind = [
            SoakFault::ReplicaKilled,
            SoakFault::ReplicaStopped,
            SoakFault::GatewayRestarted,
        ][turn % 3];
        let target = match kind {
            SoakFault::ReplicaKilled => {
                let i = (turn / 3) % replicas.len();
                replicas[i].crash()?;
                tokio::time::sleep(config.fault_every / 2).await;
                replicas[i] = start_replica(emulator, i).await?;
                let endpoints: Vec<SocketAddr> = replicas.iter().map(|r| r.api).collect();
                for g in 0..gateways.processes.len() {
                    gateways.route(g, &endpoints).await?;
                }
                format!("replica {i}")
            }
            SoakFault::ReplicaStopped => {
                let i = (turn / 3) % replicas.len();
                replicas[i].hang()?;
                tokio::time::sleep(config.fault_every / 2).await;
                replicas[i].resume()?;
                format!("replica {i}")
            }
            SoakFault::GatewayRestarted => {
                let g = (turn / 3) % gateways.processes.len();
                let endpoints: Vec<SocketAddr> = replicas.iter().map(|r| r.api).collect();
                gateways.restart(g, &endpoints).await?;
                format!("gateway {g}")
            }
        };
        faults.push(FaultRecord {
            at_s,
            fault: kind,
            target,
            back_s: start.elapsed().as_secs_f64(),
        });
        turn += 1;
        next = (next + config.fault_every).max(start.elapsed());
    }
    let _ = loading.await;
    polling.abort();
    drop(gateways);
    drop(replicas);
    let mut report = tally.lock().unwrap_or_else(PoisonError::into_inner).clone();
    report.duration_s = config.duration.as_secs_f64();
    report.faults = faults;
    Ok(report)
}

async fn start_replica(launcher: &Launcher, i: usize) -> Result<Replica, SoakError> {
    let launcher = launcher.clone();
    let started = tokio::task::spawn_blocking(move || {
        let name = format!("replica-{i}");
        Replica::start(
            &launcher,
            &name,
            Pool::A,
            MODEL,
            &[],
            Startup::Instant,
            START_LIMIT,
        )
    })
    .await;
    match started {
        Ok(result) => Ok(result?),
        Err(join) => Err(SoakError::Files(std::io::Error::other(join.to_string()))),
    }
}

/// The two gateway processes, their ports kept across restarts, and their admin token.
#[derive(Debug)]
struct Gateways {
    launcher: Launcher,
    processes: Vec<Option<Process>>,
    slots: Arc<[GatewaySlot]>,
    token: String,
    token_file: PathBuf,
    dir: PathBuf,
    drain_delay: Duration,
}

impl Gateways {
    async fn start(launcher: &Launcher, dir: &RunDir, config: &SoakConfig) -> Result<Gateways, SoakError> {
        let token = format!("soak-{}", std::process::id());
        let token_file = dir.path().join("admin.token");
        std::fs::write(&token_file, &token)?;
        let mut gateways = Gateways {
            launcher: launcher.clone(),
            processes: Vec::new(),
            slots: Arc::from(Vec::new()),
            token,
            token_file,
            dir: dir.path().to_owned(),
            drain_delay: config.drain_delay,
        };
        let mut slots = Vec::new();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        for i in 0..2 {
            let process = gateways.spawn(i, any, any).await?;
            let (Some(public), Some(admin)) = (process.addr("gateway"), process.addr("admin")) else {
                return Err(SoakError::Process(ProcessError::NotListening {
                    name: format!("gateway {i}"),
                    wanted: 2,
                    limit: START_LIMIT,
                    tail: format!("{:?}", process.listening),
                }));
            };
            slots.push(GatewaySlot {
                public,
                admin,
                ready: AtomicBool::new(false),
            });
            gateways.processes.push(Some(process));
        }
        gateways.slots = Arc::from(slots);
        Ok(gateways)
    }

    async fn spawn(&self, i: usize, public: SocketAddr, admin: SocketAddr) -> Result<Process, SoakError> {
        let state = self.dir.join(format!("gateway-{i}.state.json"));
        let args: Vec<String> = [
            "gateway",
            "--listen",
            &public.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--admin-token-file",
            &self.token_file.display().to_string(),
            "--state-file",
            &state.display().to_string(),
            "--drain-delay-ms",
            &self.drain_delay.as_millis().to_string(),
            "--first-byte-timeout-ms",
            FIRST_BYTE_TIMEOUT_MS,
        ]
        .map(str::to_owned)
        .to_vec();
        let launcher = self.launcher.clone();
        let name = format!("gateway {i}");
        let started =
            tokio::task::spawn_blocking(move || Process::start(&launcher, &name, &args, 2, START_LIMIT))
                .await;
        match started {
            Ok(result) => Ok(result?),
            Err(join) => Err(SoakError::Files(std::io::Error::other(join.to_string()))),
        }
    }

    /// Gives gateway `i` the route to `endpoints`, at epoch 1.
    async fn route(&self, i: usize, endpoints: &[SocketAddr]) -> Result<(), SoakError> {
        let route = serde_json::json!({"pool": "a", "epoch": 1, "endpoints": endpoints});
        let bearer = format!("Bearer {}", self.token);
        let answer = exchange(
            self.slots[i].admin,
            "PUT",
            "/route",
            &[("authorization", &bearer)],
            Bytes::from(route.to_string()),
            Duration::from_secs(5),
        )
        .await;
        match answer {
            Ok(Answer { status: 200, .. }) => Ok(()),
            other => Err(SoakError::Route {
                gateway: i,
                answer: format!("{other:?}"),
            }),
        }
    }

    /// SIGTERM to gateway `i`, waits for it to drain and exit, and starts a new one on the same
    /// ports with the same state file.
    async fn restart(&mut self, i: usize, endpoints: &[SocketAddr]) -> Result<(), SoakError> {
        if let Some(mut process) = self.processes[i].take() {
            let limit = self.drain_delay + EXIT_LIMIT;
            let exited = tokio::task::spawn_blocking(move || process.terminate(limit)).await;
            if !matches!(exited, Ok(true)) {
                return Err(SoakError::NoExit { gateway: i, limit });
            }
        }
        let (public, admin) = (self.slots[i].public, self.slots[i].admin);
        self.processes[i] = Some(self.spawn(i, public, admin).await?);
        self.route(i, endpoints).await
    }
}

/// Reads every gateway's `/ready` each `every`, as a load balancer's health check does.
async fn poll_ready(slots: Arc<[GatewaySlot]>, every: Duration) {
    loop {
        for slot in slots.iter() {
            slot.ready.store(is_ready(slot.admin).await, Ordering::Relaxed);
        }
        tokio::time::sleep(every).await;
    }
}

async fn is_ready(admin: SocketAddr) -> bool {
    let answer = exchange(admin, "GET", "/ready", &[], Bytes::new(), Duration::from_secs(1)).await;
    matches!(answer, Ok(Answer { status: 200, .. }))
}

/// Open-loop load until the soak's end, each request to the next ready gateway; then waits for
/// the requests in flight.
async fn send_load(
    slots: Arc<[GatewaySlot]>,
    config: SoakConfig,
    start: Instant,
    tally: Arc<Mutex<SoakReport>>,
) {
    let shape = Load {
        rate: config.rate,
        stream_share: 0.5,
        max_tokens: [8, 48],
        prompt_words: [4, 48],
        shared_prefix_share: 0.0,
        priorities: Default::default(),
    };
    let mut rng = fastrand::Rng::with_seed(config.seed);
    let turn = Arc::new(AtomicUsize::new(0));
    let mut in_flight = JoinSet::new();
    let mut next = Duration::ZERO;
    while next < config.duration {
        tokio::time::sleep_until(start + next).await;
        let request = load::Request::draw(&shape, MODEL, &mut rng);
        let (slots, turn, tally) = (Arc::clone(&slots), Arc::clone(&turn), Arc::clone(&tally));
        in_flight.spawn(async move {
            let gateway = pick(&slots, &turn);
            let seen = match gateway {
                Some(addr) => Some(send(addr, &request).await),
                None => None,
            };
            tally
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .count(request.stream, seen.as_ref());
        });
        let gap = -(1.0 - rng.f64()).ln() / config.rate;
        next += Duration::from_secs_f64(gap.min(60.0));
        while in_flight.try_join_next().is_some() {}
    }
    while in_flight.join_next().await.is_some() {}
}

/// The next gateway in turn that said it was ready.
fn pick(slots: &[GatewaySlot], turn: &AtomicUsize) -> Option<SocketAddr> {
    let first = turn.fetch_add(1, Ordering::Relaxed);
    (0..slots.len())
        .map(|k| &slots[(first + k) % slots.len()])
        .find(|slot| slot.ready.load(Ordering::Relaxed))
        .map(|slot| slot.public)
}

async fn send(gateway: SocketAddr, request: &load::Request) -> Result<Answer, ExchangeError> {
    let body = request.body.clone();
    exchange(
        gateway,
        "POST",
        "/v1/completions",
        &request.headers(),
        body,
        REQUEST_LIMIT,
    )
    .await
}

/// What one request's answer means to the soak.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    outcome: RequestOutcome,
    before_a_replica: bool,
    cut_looking_finished: bool,
    reason: Option<String>,
}

/// Judges an answer as the game day's load does, and also asks whether a failed answer ended
/// cleanly by its framing: a cut that a client could take for a whole answer.
fn judge(stream: bool, answer: Option<&Result<Answer, ExchangeError>>) -> Seen {
    let Some(answer) = answer else {
        return Seen {
            outcome: RequestOutcome::Failed,
            before_a_replica: true,
            cut_looking_finished: false,
            reason: Some("no gateway ready".to_owned()),
        };
    };
    match answer {
        Ok(answer) => {
            let (outcome, before_a_replica) =
                load::judge(answer.status, &answer.body, answer.complete, stream);
            let failed = outcome == RequestOutcome::Failed;
            let text = String::from_utf8_lossy(&answer.body);
            let cut_looking_finished =
                failed && answer.status == 200 && answer.complete && !text.contains("\"error\"");
            let reason = failed.then(|| match (answer.status, answer.complete) {
                (200, false) => "body cut without an end".to_owned(),
                (200, true) if stream => "stream ended with the retryable error event".to_owned(),
                (200, true) => "answer without choices".to_owned(),
                (status, _) => match load::error_type(&answer.body) {
                    Some(kind) => format!("http {status} {kind}"),
                    None => format!("http {status}"),
                },
            });
            Seen {
                outcome,
                before_a_replica,
                cut_looking_finished,
                reason,
            }
        }
        Err(e) => Seen {
            outcome: RequestOutcome::Failed,
            before_a_replica: matches!(e, ExchangeError::Connect(_)),
            cut_looking_finished: false,
            reason: Some(match e {
                ExchangeError::Connect(_) => "gateway refused the connection".to_owned(),
                ExchangeError::NoAnswer(_) => "connection closed without an answer".to_owned(),
                ExchangeError::Timeout(_) => "no answer in time".to_owned(),
            }),
        },
    }
}

impl SoakReport {
    fn count(&mut self, stream: bool, answer: Option<&Result<Answer, ExchangeError>>) {
        let seen = judge(stream, answer);
        self.sent += 1;
        self.streams += u64::from(stream);
        match seen.outcome {
            RequestOutcome::Ok => self.ok += 1,
            RequestOutcome::Shed => self.shed += 1,
            RequestOutcome::Failed => self.failed += 1,
        }
        self.failed_before_a_replica += u64::from(seen.before_a_replica);
        self.cut_looking_finished += u64::from(seen.cut_looking_finished);
        if let Some(reason) = seen.reason {
            *self.failures.entry(reason).or_default() += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, body: &str, complete: bool) -> Result<Answer, ExchangeError> {
        Ok(Answer {
            status,
            body: Bytes::from(body.to_owned()),
            first_byte: None,
            complete,
        })
    }

    #[test]
    fn a_clean_end_without_done_or_error_is_a_cut_that_looked_finished() {
        let whole = answer(200, "data: {\"choices\":[]}\n\ndata: [DONE]\n\n", true);
        assert_eq!(judge(true, Some(&whole)).outcome, RequestOutcome::Ok);

        let looked_finished = answer(200, "data: {\"choices\":[]}\n\n", true);
        let seen = judge(true, Some(&looked_finished));
        assert_eq!(
            (seen.outcome, seen.cut_looking_finished),
            (RequestOutcome::Failed, true)
        );

        let told = answer(
            200,
            "data: {\"choices\":[]}\n\ndata: {\"error\":{\"retryable\":true}}\n\n",
            true,
        );
        let seen = judge(true, Some(&told));
        assert_eq!(
            (seen.outcome, seen.cut_looking_finished),
            (RequestOutcome::Failed, false)
        );

        let truncated_json = answer(200, "{\"id\":\"cmpl-1\"", true);
        assert!(judge(false, Some(&truncated_json)).cut_looking_finished);

        let broken_framing = answer(200, "data: {\"choices\":[]}\n\n", false);
        assert!(!judge(true, Some(&broken_framing)).cut_looking_finished);
    }

    #[test]
    fn a_refused_connection_or_no_ready_gateway_never_reached_a_replica() {
        let refused: Result<Answer, ExchangeError> = Err(ExchangeError::Connect("refused".into()));
        assert!(judge(false, Some(&refused)).before_a_replica);
        assert!(judge(false, None).before_a_replica);
        let timed_out: Result<Answer, ExchangeError> = Err(ExchangeError::Timeout(REQUEST_LIMIT));
        assert!(!judge(false, Some(&timed_out)).before_a_replica);
        let unavailable = answer(503, "{\"error\":{\"type\":\"unavailable\"}}", true);
        assert!(judge(false, Some(&unavailable)).before_a_replica);
    }

    #[test]
    fn the_report_passes_only_when_both_promises_held() {
        let mut report = SoakReport::default();
        report.count(false, Some(&answer(200, "{\"choices\":[]}", true)));
        report.faults.push(FaultRecord {
            at_s: 1.0,
            fault: SoakFault::ReplicaKilled,
            target: "replica 0".into(),
            back_s: 2.0,
        });
        assert!(report.passed());
        report.count(true, Some(&answer(200, "data: {\"choices\":[]}\n\n", true)));
        assert!(!report.passed());
        assert!(
            report.summary().contains("verdict: FAILED"),
            "{}",
            report.summary()
        );
    }
}
