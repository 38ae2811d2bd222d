//! The standby in its shape. Between promotions the pool that does not hold the Lease waits as
//! its tiers say: its pilot-light replicas do not run (its workload is scaled down to its hot and
//! warm replicas), and its warm replicas sleep at their level. After a failover this is what turns
//! the pool that lost into the new standby, so it stops holding every GPU it served with.
//!
//! A replica is put to sleep only after it answered a generating probe right (the policy's
//! expectation, or the golden answer recorded from the primary), and only while the standby does
//! not drift from the primary: a broken or drifted replica is never put to sleep to be woken into
//! a promotion. Nothing happens to the pool that holds the Lease, and
//! the caller runs this only between promotions, so the pool is fenced before it shrinks.
//!
//! Level 1 parks a replica's weights in its node's host memory. A replica whose node has not
//! the room for them, as the GPU agents read the nodes ([`HostRoom`]), sleeps at level 2
//! instead (its weights discarded, reloaded on waking), and the pass says so: pushing a node
//! into swapping or eviction to save seconds of a wake is no trade.

use std::collections::BTreeMap;
use std::fmt;

use futures::future::join_all;
use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::probe::{self, Endpoint, Expectation, ProbeSpec};
use understudy_prober::sleep::{
    ReplicaWake, WakeTimeouts, is_sleeping, put_to_sleep, sleep_level, wake_replica_at_its_level,
};

use crate::crd::{PoolSpec, Tier};
use crate::ports::{ReplicaEndpoints, ResolveError};
use crate::workload::Workload;

/// What one pass did to the standby.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kept {
    /// The workload's replicas changed from, to the replicas its hot and warm tiers run: lowered
    /// as a pool becomes the standby, or raised from none (an all-pilot-light pool's one kept
    /// running, found with nothing running).
    pub scaled: Option<(u32, u32)>,
    /// Replicas put to sleep, each after a passing probe.
    pub put_to_sleep: Vec<String>,
    /// Replicas left awake that should sleep, and why.
    pub left_awake: Vec<(String, String)>,
    /// Replicas put to sleep at level 2 where their group sleeps at level 1, and why.
    pub deeper: Vec<(String, String)>,
}

impl Kept {
    /// Whether anything changed.
    #[must_use]
    pub fn changed(&self) -> bool {
        self.scaled.is_some() || !self.put_to_sleep.is_empty()
    }
}

impl fmt::Display for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        match self.scaled {
            Some((from, to)) if from > to => parts.push(format!(
                "scaled from {from} to {to} replicas: its pilot light does not run"
            )),
            Some((from, to)) => parts.push(format!(
                "scaled from {from} to {to} replicas: a standby with nothing running cannot be proven"
            )),
            None => {}
        }
        if !self.put_to_sleep.is_empty() {
            parts.push(format!(
                "put {} to sleep after each answered its probe right",
                self.put_to_sleep.join(", ")
            ));
        }
        for (replica, why) in &self.deeper {
            parts.push(format!("put {replica} to sleep at level 2, not 1: {why}"));
        }
        for (replica, why) in &self.left_awake {
            parts.push(format!("left {replica} awake: {why}"));
        }
        write!(f, "{}", parts.join("; "))
    }
}

/// Why the standby could not be kept in shape this time.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("scaling {workload}: {source}")]
    Scale {
        workload: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Resolve(#[from] ResolveError),
}

/// Host memory for level-1 sleepers: where each replica runs and how large its weights are, and
/// how much memory each node has available, as the GPU agents last read them. What it does not
/// know of, it does not refuse: a replica or a node it has no figure for has room.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostRoom {
    /// By replica (`host:port`): its node, and the bytes of its weight files.
    pub replicas: BTreeMap<String, (String, u64)>,
    /// By node: the bytes of memory available.
    pub available: BTreeMap<String, u64>,
}

impl HostRoom {
    /// Takes room for the weights of the replica at `authority` (`host:port`) on its node, or
    /// says why there is none: a level-1 sleeper needs its weights and a tenth more (pinned
    /// buffers, and the page cache the node goes on needing).
    pub fn take(&mut self, authority: &str) -> Result<(), String> {
        let Some((node, weights)) = self.replicas.get(authority) else {
            return Ok(());
        };
        let Some(available) = self.available.get_mut(node) else {
            return Ok(());
        };
        let needed = weights.saturating_add(weights / 10);
        if *available < needed {
            return Err(format!(
                "node {node} has {} of host memory available and its weights need {} with a tenth to spare",
                binary_size(*available),
                binary_size(needed)
            ));
        }
        *available -= weights;
        Ok(())
    }

    /// Gives back what [`Self::take`] took for the replica at `authority`: it did not sleep.
    pub fn give_back(&mut self, authority: &str) {
        if let Some((node, weights)) = self.replicas.get(authority)
            && let Some(available) = self.available.get_mut(node)
        {
            *available = available.saturating_add(*weights);
        }
    }
}

/// `bytes` in GiB, or in MiB below one GiB, to a tenth.
#[allow(clippy::cast_precision_loss)] // a tenth is all a message needs
fn binary_size(bytes: u64) -> String {
    let (unit, name) = if bytes >= 1 << 30 {
        (1u64 << 30, "GiB")
    } else {
        (1 << 20, "MiB")
    };
    format!("{:.1} {name}", bytes as f64 / unit as f64)
}

/// Whether the standby's warm replicas may be put to sleep now.
#[derive(Clone, Debug)]
pub enum Sleep {
    /// Each one that answers the probe as this expects, at level 1 only where its node has the
    /// host memory for its weights.
    AfterProbe(Expectation, HostRoom),
    /// None, for this reason (no golden answer recorded yet; the standby drifts from the
    /// primary): a replica is put to sleep only to be woken into a promotion it is fit for.
    Not(String),
}

/// Scales `pool`'s workload to its hot and warm replicas, then puts its warm replicas to
/// sleep, as `sleep` allows, until as many sleep as its warm tier says.
pub async fn keep(
    workload: &Workload,
    pool: &PoolSpec,
    replicas: &dyn ReplicaEndpoints,
    namespace: &str,
    probe_spec: &ProbeSpec,
    sleep: Sleep,
    timeouts: WakeTimeouts,
) -> Result<Kept, Error> {
    let shape = pool.standby_shape();
    let mut kept = Kept::default();
    let running = shape.replicas.saturating_sub(shape.pilot_light);
    if shape.pilot_light > 0 {
        let changed = workload
            .scale_standby_to(running)
            .await
            .map_err(|source| Error::Scale {
                workload: pool.workload.name.clone(),
                source,
            })?;
        kept.scaled = changed.map(|from| (from, running));
    }
    if shape.warm == 0 {
        return Ok(kept);
    }
    let mut awake = Vec::new();
    let mut asleep = Vec::new();
    for (endpoint, state) in sleep_states(replicas, namespace, pool, timeouts).await? {
        match state {
            Ok(Some(true)) => asleep.push(endpoint),
            Ok(Some(false)) => awake.push(endpoint),
            Ok(None) => kept.left_awake.push((
                endpoint.to_string(),
                "it has no sleep API (VLLM_SERVER_DEV_MODE is off)".to_owned(),
            )),
            Err(why) => kept.left_awake.push((endpoint.to_string(), why)),
        }
    }
    let wanted = usize::try_from(shape.warm).unwrap_or(usize::MAX);
    if asleep.len() >= wanted {
        return Ok(kept);
    }
    let (expect, mut room) = match sleep {
        Sleep::AfterProbe(expect, room) => (expect, room),
        Sleep::Not(why) => {
            for endpoint in awake.iter().rev().take(wanted - asleep.len()) {
                kept.left_awake.push((endpoint.to_string(), why.clone()));
            }
            return Ok(kept);
        }
    };
    let spec = ProbeSpec {
        expect,
        ..probe_spec.clone()
    };
    // Each warm group sleeps at its own level: what sleeps already counts at the level its
    // metrics say (the deepest when they do not), and each replica put to sleep fills the
    // shallowest level still short.
    let mut short = warm_levels(pool);
    let levels = join_all(asleep.iter().map(|e| sleep_level(e, timeouts.query))).await;
    for level in levels {
        let level = level.unwrap_or(shape.sleep_level);
        if let Some(slot) = short.iter_mut().find(|(l, n)| *l == level && *n > 0) {
            slot.1 -= 1;
        }
    }
    // The last replicas in address order sleep; the first stay awake as the hot tier. Never more
    // than the warm tier, whatever the levels say.
    for endpoint in awake.iter().rev() {
        let Some(slot) = short.iter_mut().find(|(_, n)| *n > 0) else {
            break;
        };
        if asleep.len() + kept.put_to_sleep.len() >= wanted {
            break;
        }
        let report = probe::probe(endpoint, &spec).await;
        if !matches!(report.outcome, ProbeOutcome::Ok { .. }) {
            let why = format!("its probe was {}", report.outcome.as_str());
            kept.left_awake.push((endpoint.to_string(), why));
            continue;
        }
        let mut level = slot.0;
        let mut deeper = None;
        if level == 1
            && let Err(why) = room.take(&endpoint.authority())
        {
            level = 2;
            deeper = Some(why);
        }
        match put_to_sleep(endpoint, level, timeouts).await {
            Ok(()) => {
                kept.put_to_sleep.push(format!("{endpoint} (level {level})"));
                kept.deeper.extend(deeper.map(|why| (endpoint.to_string(), why)));
                slot.1 -= 1;
            }
            Err(why) => {
                if level == 1 {
                    room.give_back(&endpoint.authority());
                }
                kept.left_awake.push((endpoint.to_string(), why));
            }
        }
    }
    Ok(kept)
}

/// `pool`'s replicas that say they are asleep, in address order.
async fn asleep(
    replicas: &dyn ReplicaEndpoints,
    namespace: &str,
    pool: &PoolSpec,
    timeouts: WakeTimeouts,
) -> Result<Vec<Endpoint>, Error> {
    Ok(sleep_states(replicas, namespace, pool, timeouts)
        .await?
        .into_iter()
        .filter(|(_, state)| matches!(state, Ok(Some(true))))
        .map(|(endpoint, _)| endpoint)
        .collect())
}

/// How many of `pool`'s replicas sleep at each level, shallowest first, from its warm groups.
fn warm_levels(pool: &PoolSpec) -> Vec<(u8, u32)> {
    let mut levels: Vec<(u8, u32)> = Vec::new();
    for group in pool.standby_groups().iter().filter(|g| g.tier == Tier::Warm) {
        match levels.iter_mut().find(|(level, _)| *level == group.sleep_level()) {
            Some(slot) => slot.1 += group.replicas,
            None => levels.push((group.sleep_level(), group.replicas)),
        }
    }
    levels.sort_unstable();
    levels
}

/// Each of `pool`'s replicas in address order, with what `/is_sleeping` says of it, asked of all
/// at once so that one that hangs costs one timeout, not one each.
async fn sleep_states(
    replicas: &dyn ReplicaEndpoints,
    namespace: &str,
    pool: &PoolSpec,
    timeouts: WakeTimeouts,
) -> Result<Vec<(Endpoint, Result<Option<bool>, String>)>, Error> {
    let mut endpoints = replicas.resolve(namespace, pool).await?;
    endpoints.sort_by_key(ToString::to_string);
    let states = join_all(endpoints.iter().map(|e| is_sleeping(e, timeouts.query))).await;
    Ok(endpoints.into_iter().zip(states).collect())
}

/// One proof of a sleeping standby replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proof {
    pub replica: String,
    /// Woken, answered right, and asleep again.
    pub passed: bool,
    pub detail: String,
}

/// Proves `pool`'s warm tier: wakes one sleeping replica (the first after `after` in address
/// order, so that proofs take the replicas in turn), probes it against `expect`, and puts it back
/// to sleep at its level. `None` when no replica sleeps.
pub async fn prove(
    pool: &PoolSpec,
    replicas: &dyn ReplicaEndpoints,
    namespace: &str,
    probe_spec: &ProbeSpec,
    expect: Expectation,
    timeouts: WakeTimeouts,
    after: Option<&str>,
) -> Result<Option<Proof>, Error> {
    let level = pool.standby_shape().sleep_level;
    let asleep = asleep(replicas, namespace, pool, timeouts).await?;
    let next = asleep
        .iter()
        .find(|e| after.is_some_and(|last| e.to_string().as_str() > last))
        .or_else(|| asleep.first());
    let Some(endpoint) = next else {
        return Ok(None);
    };
    let replica = endpoint.to_string();
    let failed = |detail: String| {
        Ok(Some(Proof {
            replica: replica.clone(),
            passed: false,
            detail,
        }))
    };
    // Put back at the level it slept at, which its metrics tell where vLLM exports them.
    let (woken, level) = wake_replica_at_its_level(endpoint, level, timeouts).await;
    match woken {
        ReplicaWake::Woken => {}
        other => return failed(format!("woken from sleep level {level}: {other:?}")),
    }
    let spec = ProbeSpec {
        expect,
        ..probe_spec.clone()
    };
    let report = probe::probe(endpoint, &spec).await;
    let answered = match report.outcome {
        ProbeOutcome::Ok { first_token, total } => format!(
            "answered right (first token {} ms, {} ms in all)",
            first_token.as_millis(),
            total.as_millis()
        ),
        other => {
            // Asleep again all the same: a standby replica must not stay awake unannounced.
            let slept = put_to_sleep(endpoint, level, timeouts).await;
            let again = slept.map_or_else(|why| format!("; not asleep again: {why}"), |()| String::new());
            return failed(format!(
                "woken from sleep level {level}, its probe was {}{again}",
                other.as_str()
            ));
        }
    };
    match put_to_sleep(endpoint, level, timeouts).await {
        Ok(()) => Ok(Some(Proof {
            replica,
            passed: true,
            detail: format!("woken from sleep level {level}, {answered}, asleep again"),
        })),
        Err(why) => failed(format!(
            "woken from sleep level {level}, {answered}, not asleep again: {why}"
        )),
    }
}
