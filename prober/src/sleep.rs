//! vLLM's sleep mode from the outside, through its dev endpoints (`GET /is_sleeping`,
//! `POST /sleep`, `POST /wake_up`, and after a level-2 sleep `POST /collective_rpc
//! {"method":"reload_weights"}` and `POST /reset_prefix_cache`): how the operator wakes a warm
//! tier on promotion, and how the local game day puts one to sleep and wakes it.
//!
//! A 200 from `/wake_up` or `/sleep` proves nothing: a replica counts as woken, or asleep, only
//! once `/is_sleeping` says so. A level-2 wake follows vLLM's documented order (weights,
//! `reload_weights`, then the KV cache), so that a replica whose reload failed still reports
//! itself asleep and is retried, rather than looking awake with garbage weights. A replica that
//! answers 404 has no dev endpoints (`VLLM_SERVER_DEV_MODE` is off), so nothing can have put it to
//! sleep through them: it counts as awake.
//!
//! This module must never report a replica woken that `/is_sleeping` did not confirm, send a
//! request without a timeout, or let one replica's failure keep the others from being woken.

use std::collections::HashSet;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use crate::probe::{Bearer, Endpoint};

/// The longest `GET /is_sleeping` may take, connection included.
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest one waking call may take. Bringing weights back from host memory, or reloading
/// them from disk after a level-2 sleep, takes seconds to minutes on a large model; a call cut
/// short is retried by the next reconcile.
pub const DEFAULT_WAKE_TIMEOUT: Duration = Duration::from_secs(120);

/// The per-call timeouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WakeTimeouts {
    /// For `GET /is_sleeping`.
    pub query: Duration,
    /// For each call that wakes, reloads or resets.
    pub wake: Duration,
}

impl Default for WakeTimeouts {
    fn default() -> Self {
        WakeTimeouts {
            query: DEFAULT_QUERY_TIMEOUT,
            wake: DEFAULT_WAKE_TIMEOUT,
        }
    }
}

/// What became of one replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaWake {
    /// It was not asleep; nothing was sent.
    Awake,
    /// `/is_sleeping` answered 404: dev mode is off, so it cannot be asleep through the API.
    NoSleepApi,
    /// It was asleep, and after the waking calls `/is_sleeping` says false.
    Woken,
    /// The waking calls were answered, but it still reports itself asleep.
    StillAsleep,
    /// A call failed: no answer, a timeout, or an answer other than 2xx.
    Failed(String),
}

impl ReplicaWake {
    /// Whether the replica is awake now, as far as its API says.
    #[must_use]
    pub fn is_awake(&self) -> bool {
        matches!(
            self,
            ReplicaWake::Awake | ReplicaWake::NoSleepApi | ReplicaWake::Woken
        )
    }
}

/// One call to one replica, under `timeout`; the status and answer, or why there is none.
async fn call(
    endpoint: &Endpoint,
    method: http::Method,
    target: &str,
    json: Option<&'static str>,
    timeout: Duration,
) -> Result<(http::StatusCode, Bytes), String> {
    let exchange = crate::http1::exchange(crate::http1::Call {
        host: &endpoint.host,
        port: endpoint.port,
        method: method.clone(),
        target,
        bearer: endpoint.bearer.as_ref().map(Bearer::secret),
        json: json.map(|text| Bytes::from_static(text.as_bytes())),
    });
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(why)) => Err(format!("{method} {target}: {why}")),
        Err(_) => Err(format!("{method} {target}: no answer within {timeout:?}")),
    }
}

/// One state-changing call that must be answered 2xx.
async fn post(
    endpoint: &Endpoint,
    target: &str,
    json: Option<&'static str>,
    timeout: Duration,
) -> Result<(), String> {
    let (status, body) = call(endpoint, http::Method::POST, target, json, timeout).await?;
    if status.is_success() {
        Ok(())
    } else {
        let shown = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        Err(format!("POST {target} answered {}: {shown}", status.as_u16()))
    }
}

/// Whether the replica is asleep: `None` when it has no sleep API (404).
pub async fn is_sleeping(endpoint: &Endpoint, timeout: Duration) -> Result<Option<bool>, String> {
    let (status, body) = call(endpoint, http::Method::GET, "/is_sleeping", None, timeout).await?;
    if status == http::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !status.is_success() {
        return Err(format!("GET /is_sleeping answered {}", status.as_u16()));
    }
    let json: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|error| format!("GET /is_sleeping answered what is not JSON: {error}"))?;
    json.get("is_sleeping")
        .and_then(serde_json::Value::as_bool)
        .map(Some)
        .ok_or_else(|| "GET /is_sleeping answered without a boolean `is_sleeping`".to_owned())
}

/// The replicas this process is waking now, by address: a wake still under way (one a promotion
/// went on without) is not started twice, which after a level-2 sleep would reload the weights
/// again.
static WAKING: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Mutex::default);

/// Holds one replica in [`WAKING`] while it is woken.
struct Waking(String);

impl Waking {
    fn start(endpoint: &Endpoint) -> Option<Waking> {
        let key = endpoint.authority();
        let mut waking = WAKING.lock().unwrap_or_else(PoisonError::into_inner);
        waking.insert(key.clone()).then_some(Waking(key))
    }
}

impl Drop for Waking {
    fn drop(&mut self) {
        WAKING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.0);
    }
}

/// Wakes one replica that sleeps at up to `level`, and says what became of it. One this process
/// is waking already is not called again: it has `Failed`, with why, until that wake ends.
pub async fn wake_replica(endpoint: &Endpoint, level: u8, timeouts: WakeTimeouts) -> ReplicaWake {
    let Some(_waking) = Waking::start(endpoint) else {
        return ReplicaWake::Failed("a wake of it is already under way".to_owned());
    };
    match wake_replica_calls(endpoint, level, timeouts).await {
        Ok(outcome) => outcome,
        Err(why) => ReplicaWake::Failed(why),
    }
}

async fn wake_replica_calls(
    endpoint: &Endpoint,
    level: u8,
    timeouts: WakeTimeouts,
) -> Result<ReplicaWake, String> {
    match is_sleeping(endpoint, timeouts.query).await? {
        None => return Ok(ReplicaWake::NoSleepApi),
        Some(false) => return Ok(ReplicaWake::Awake),
        Some(true) => {}
    }
    if level >= 2 {
        // The KV cache comes back last, so `/is_sleeping` stays true until the weights are the
        // model's again: a failed reload is retried instead of serving garbage.
        post(endpoint, "/wake_up?tags=weights", None, timeouts.wake).await?;
        let reload = Some(r#"{"method":"reload_weights"}"#);
        post(endpoint, "/collective_rpc", reload, timeouts.wake).await?;
        post(endpoint, "/wake_up?tags=kv_cache", None, timeouts.wake).await?;
        post(endpoint, "/reset_prefix_cache", None, timeouts.wake).await?;
    } else {
        post(endpoint, "/wake_up", None, timeouts.wake).await?;
    }
    Ok(match is_sleeping(endpoint, timeouts.query).await? {
        Some(true) => ReplicaWake::StillAsleep,
        Some(false) => ReplicaWake::Woken,
        // It answered before; a 404 now is a replaced pod, which was never put to sleep.
        None => ReplicaWake::NoSleepApi,
    })
}

/// The level a replica sleeps at, as its `vllm:engine_sleep_state` gauge says: `discard_all` is
/// level 2, `weights_offloaded` level 1 (the deeper when engines differ); `None` when it says
/// neither (awake, or metrics without the gauge: an older vLLM).
#[must_use]
pub fn level_in_metrics(metrics: &str) -> Option<u8> {
    let mut level = None;
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("vllm:engine_sleep_state{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        if value.trim().parse::<f64>().is_ok_and(|v| v >= 1.0) {
            let this = if labels.contains("sleep_state=\"discard_all\"") {
                2
            } else if labels.contains("sleep_state=\"weights_offloaded\"") {
                1
            } else {
                continue;
            };
            level = level.max(Some(this));
        }
    }
    level
}

/// The level a sleeping replica sleeps at, read from its `/metrics` ([`level_in_metrics`]);
/// `None` when they do not say or cannot be read.
pub async fn sleep_level(endpoint: &Endpoint, timeout: Duration) -> Option<u8> {
    let (status, body) = call(endpoint, http::Method::GET, "/metrics", None, timeout)
        .await
        .ok()?;
    if !status.is_success() {
        return None;
    }
    level_in_metrics(&String::from_utf8_lossy(&body))
}

/// Wakes one replica at the level it sleeps at by its own metrics, else at `level`; what became of
/// it, and the level it was woken at.
pub async fn wake_replica_at_its_level(
    endpoint: &Endpoint,
    level: u8,
    timeouts: WakeTimeouts,
) -> (ReplicaWake, u8) {
    let level = sleep_level(endpoint, timeouts.query).await.unwrap_or(level);
    (wake_replica(endpoint, level, timeouts).await, level)
}

/// One replica's wake: what became of it, how long it took from the first call to the last
/// answer, and the sleep level it was woken from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaWoke<'a> {
    pub endpoint: &'a Endpoint,
    pub outcome: ReplicaWake,
    pub took: Duration,
    pub level: u8,
}

/// What waking a pool's replicas came to: each replica whose wake finished, and the replicas
/// still being woken when enough were awake.
#[derive(Debug)]
pub struct PoolWake<'a> {
    pub finished: Vec<ReplicaWoke<'a>>,
    /// Their calls go on in tasks of their own, each bounded by its timeout, so that a replica on
    /// its way up still comes up.
    pub still_waking: Vec<&'a Endpoint>,
}

impl PoolWake<'_> {
    /// How many replicas are not known to be awake: still waking, or failed to wake.
    #[must_use]
    pub fn not_awake(&self) -> usize {
        self.still_waking.len() + self.finished.iter().filter(|w| !w.outcome.is_awake()).count()
    }

    /// Each replica not known to be awake, and why, as a step's note names it.
    #[must_use]
    pub fn behind(&self) -> Vec<String> {
        let mut behind: Vec<String> = self
            .finished
            .iter()
            .filter_map(|w| match &w.outcome {
                ReplicaWake::StillAsleep => Some(format!("{} still reports itself asleep", w.endpoint)),
                ReplicaWake::Failed(why) => Some(format!("{}: {why}", w.endpoint)),
                _ => None,
            })
            .collect();
        behind.extend(
            self.still_waking
                .iter()
                .map(|endpoint| format!("{endpoint} is still waking")),
        );
        behind
    }
}

/// What a Wake step's note says of the replicas it went on without (`behind`, [`PoolWake::behind`]):
/// enough were awake for the quorum, which spares `tolerated`, or the promotion was `overdue`.
/// `None` when it went on without none.
#[must_use]
pub fn went_on_without(behind: &[String], tolerated: usize, overdue: Option<Duration>) -> Option<String> {
    if behind.is_empty() {
        return None;
    }
    let why = match overdue {
        Some(deadline) if behind.len() > tolerated => {
            format!("past the promotion's deadline of {deadline:?},")
        }
        _ => "enough are awake for the serving quorum;".to_owned(),
    };
    Some(format!(
        "{why} it goes on without {} ({}), which join the route when they pass",
        behind.len(),
        behind.join("; ")
    ))
}

/// Wakes every replica at once, each at the level its metrics say it sleeps at (else `level`,
/// the deepest the pool's tiers name), and returns once every wake has finished, as soon as no
/// more than `tolerated` replicas are not awake (a promotion goes on once enough of its pool is
/// awake, and the rest join its route when they pass), or once `patience` has run out.
pub async fn wake_enough(
    endpoints: &[Endpoint],
    level: u8,
    timeouts: WakeTimeouts,
    tolerated: usize,
    patience: Duration,
) -> PoolWake<'_> {
    let give_up = tokio::time::Instant::now() + patience;
    let mut waking: FuturesUnordered<_> = endpoints
        .iter()
        .enumerate()
        .map(|(i, endpoint)| {
            let endpoint = endpoint.clone();
            let task = tokio::spawn(async move {
                let started = tokio::time::Instant::now();
                let (outcome, level) = wake_replica_at_its_level(&endpoint, level, timeouts).await;
                (outcome, started.elapsed(), level)
            });
            async move { (i, task.await) }
        })
        .collect();
    let mut wake = PoolWake {
        finished: Vec::new(),
        still_waking: endpoints.iter().collect(),
    };
    // Dropping a task's handle leaves it running.
    while wake.not_awake() > tolerated
        && let Ok(Some((i, joined))) = tokio::time::timeout_at(give_up, waking.next()).await
    {
        let (outcome, took, level) = joined.unwrap_or_else(|error| {
            let failed = ReplicaWake::Failed(format!("its wake ended early: {error}"));
            (failed, Duration::ZERO, level)
        });
        wake.still_waking.retain(|e| !std::ptr::eq(*e, &endpoints[i]));
        wake.finished.push(ReplicaWoke {
            endpoint: &endpoints[i],
            outcome,
            took,
            level,
        });
    }
    wake
}

/// Puts one replica to sleep at `level` (1: weights offloaded to host memory; 2: discarded),
/// confirmed by `/is_sleeping`.
pub async fn put_to_sleep(endpoint: &Endpoint, level: u8, timeouts: WakeTimeouts) -> Result<(), String> {
    let target = format!("/sleep?level={level}");
    post(endpoint, &target, None, timeouts.wake).await?;
    match is_sleeping(endpoint, timeouts.query).await? {
        Some(true) => Ok(()),
        Some(false) => Err(format!(
            "POST {target} was answered, and it still reports itself awake"
        )),
        None => Err("it has no sleep API: VLLM_SERVER_DEV_MODE is off".to_owned()),
    }
}
