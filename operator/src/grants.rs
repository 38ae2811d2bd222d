//! Serving grants for the fences that run with `--grants`: every `spec.grants.renewEvery` the
//! leader reads each policy's epoch Lease and grants every fence of both pools the Lease's epoch
//! held by the Lease's holder ([`grant_round`]), with the fences' control token. The old holder's
//! fences are told first, so the new holder's learn whether they may serve at once or must wait
//! out the old holder's grants. A Lease that cannot be read renews nothing: the fences then serve
//! on under their failsafe only while the other pool vouches for them, and stop when it cannot.
//!
//! The Fence step grants the new epoch at once ([`Granting`]), and the Route step waits until the
//! new primary's fences serve: a route to fences that refuse serves nobody.
//!
//! This module must never grant an epoch or a holder the Lease does not say, count a fence that
//! did not answer as revoked, or print the token.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, ResourceExt};
use tokio::time::Instant;
use understudy_api::grant::{
    FenceAddr, GRANT_PATH, Grant, GrantAnswer, GrantRound, GrantTiming, PoolFences, grant_round,
};
use understudy_api::lease::{EpochLease, KubeLease};
use understudy_core::Epoch;
use understudy_core::failover::Step;
use understudy_prober::http1;
use understudy_prober::probe::Endpoint;

use crate::crd::{FailoverPolicy, GrantsStatus, PoolGrants, PoolSpec};
use crate::metrics::Metrics;
use crate::policy::validate;
use crate::ports::{
    ReplicaEndpoints, RouteSyncReport, RouteSyncRequest, StepExecutor, StepReport, StepRequest,
};

/// Who carries the grants.
pub const CARRIED_BY: &str = "operator";

/// How often the rounds due are looked for.
const TICK: Duration = Duration::from_millis(200);

/// A round, and when it was pushed.
#[derive(Clone, Debug)]
pub struct LastRound {
    pub at: Timestamp,
    pub round: GrantRound,
}

#[derive(Debug)]
struct Tracked {
    policy: Arc<FailoverPolicy>,
    next: Instant,
    in_flight: bool,
    last: Option<LastRound>,
    /// Held through a round, from before the Lease is read to the last push: in this process, a
    /// renewal that read the Lease before a promotion moved it finishes before the promotion's
    /// own round begins. (Across processes, and for a policy tracked anew, it is the grants'
    /// dates, taken before the Lease is read, and the fences' refusal of stale grants that hold.)
    rounds: Arc<tokio::sync::Mutex<()>>,
}

/// Grants every tracked policy's fences their right to serve.
pub struct Grantor {
    client: Client,
    replicas: Arc<dyn ReplicaEndpoints>,
    metrics: Arc<Metrics>,
    tracked: Mutex<HashMap<ObjectRef<FailoverPolicy>, Tracked>>,
}

impl fmt::Debug for Grantor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grantor").finish_non_exhaustive()
    }
}

/// The grants' timing of `policy`: its own, or the defaults for one that does not validate (which
/// is never promoted; its fences are renewed with the defaults).
fn timing(policy: &FailoverPolicy) -> GrantTiming {
    validate(&policy.spec).map_or_else(|_| GrantTiming::default(), |v| v.grants)
}

impl Grantor {
    /// Reads Leases with `client` and finds the fences through `replicas`, whose endpoints carry
    /// the fences' control token.
    #[must_use]
    pub fn new(client: Client, replicas: Arc<dyn ReplicaEndpoints>, metrics: Arc<Metrics>) -> Self {
        Grantor {
            client,
            replicas,
            metrics,
            tracked: Mutex::new(HashMap::new()),
        }
    }

    fn tracked(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectRef<FailoverPolicy>, Tracked>> {
        self.tracked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Grants `policy`'s fences from now on, as its spec is now.
    pub fn track(&self, policy: &FailoverPolicy) {
        let key = ObjectRef::from_obj(policy);
        let policy = Arc::new(policy.clone());
        self.tracked()
            .entry(key)
            .and_modify(|t| t.policy = Arc::clone(&policy))
            .or_insert(Tracked {
                policy,
                next: Instant::now(),
                in_flight: false,
                last: None,
                rounds: Arc::default(),
            });
    }

    /// `policy` is deleted: its fences are granted nothing more.
    pub fn forget(&self, policy: &ObjectRef<FailoverPolicy>) {
        self.tracked().remove(policy);
    }

    /// The last round pushed for `policy`.
    #[must_use]
    pub fn last(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<LastRound> {
        self.tracked().get(policy).and_then(|t| t.last.clone())
    }

    /// The lock `policy`'s rounds take turns under.
    fn rounds(&self, policy: &FailoverPolicy) -> Arc<tokio::sync::Mutex<()>> {
        self.tracked()
            .get(&ObjectRef::from_obj(policy))
            .map_or_else(Arc::default, |t| Arc::clone(&t.rounds))
    }

    /// The wall clock now, as a grant's issue time.
    fn wall() -> Duration {
        Duration::from_millis(u64::try_from(Timestamp::now().as_millisecond()).unwrap_or(0))
    }

    /// Grants `epoch` held by `holder` to every fence of `policy`'s pools, and keeps the round.
    pub async fn round(&self, policy: &FailoverPolicy, epoch: Epoch, holder: &str) -> GrantRound {
        let rounds = self.rounds(policy);
        let _turn = rounds.lock().await;
        self.round_issued(policy, epoch, holder, Self::wall()).await
    }

    /// A round whose grants count as issued at `wall`, taken before anything it was decided from
    /// was read; the caller holds the policy's turn.
    async fn round_issued(
        &self,
        policy: &FailoverPolicy,
        epoch: Epoch,
        holder: &str,
        wall: Duration,
    ) -> GrantRound {
        let namespace = policy.namespace().unwrap_or_default();
        let timing = timing(policy);
        let mut pools = Vec::new();
        let mut bearer = None;
        for pool in &policy.spec.pools {
            let (fences, complete) = match self.replicas.fences(&namespace, pool).await {
                Ok(found) => found,
                Err(error) => {
                    tracing::warn!(%error, pool = %pool.name, "the pool's fences cannot be listed: none is counted as revoked");
                    (Vec::new(), false)
                }
            };
            bearer = bearer.or_else(|| fences.iter().find_map(|f| f.bearer.clone()));
            pools.push(pool_fences(pool, &fences, complete));
        }
        let within = timing.push_timeout;
        let push = |fence: String, grant: Grant| {
            let bearer = bearer.clone();
            async move {
                let Some((host, port)) = split(&fence) else {
                    return GrantAnswer::Failed(format!("{fence}: not host:port"));
                };
                let body = bytes::Bytes::from(serde_json::to_vec(&grant).unwrap_or_default());
                let call = http1::exchange(http1::Call {
                    host,
                    port,
                    method: http::Method::PUT,
                    target: GRANT_PATH,
                    bearer: bearer.as_ref().map(|b| b.secret()),
                    json: Some(body),
                });
                match tokio::time::timeout(within, call).await {
                    Ok(Ok((status, body))) => GrantAnswer::read(status.as_u16(), &body),
                    Ok(Err(why)) => GrantAnswer::Failed(format!("{fence}: {why}")),
                    Err(_) => GrantAnswer::Failed(format!("{fence}: no answer within {within:?}")),
                }
            }
        };
        let key = format!("{namespace}/{}", policy.name_any());
        let round = grant_round(&timing, &key, (epoch, holder), &pools, wall, push).await;
        self.metrics.grant_round(&namespace, &policy.name_any(), &round);
        if let Some(tracked) = self.tracked().get_mut(&ObjectRef::from_obj(policy)) {
            tracked.last = Some(LastRound {
                at: Timestamp::now(),
                round: round.clone(),
            });
        }
        round
    }

    /// One renewal for `policy`: from its Lease as read now; nothing when it cannot be read.
    async fn renew(&self, policy: &FailoverPolicy) {
        let namespace = policy.namespace().unwrap_or_default();
        let name = policy.name_any();
        let rounds = self.rounds(policy);
        let _turn = rounds.lock().await;
        // Issued before the Lease is read: a grant never outlasts the moment it was decided at.
        let wall = Self::wall();
        let lease = KubeLease::for_policy(Api::<Lease>::namespaced(self.client.clone(), &namespace), &name);
        match lease.read().await {
            Ok(Some(record)) => {
                self.round_issued(policy, record.epoch, &record.holder, wall)
                    .await;
            }
            Ok(None) => self.metrics.grant_renewal_skipped(&namespace, &name, "no_lease"),
            Err(error) => {
                tracing::warn!(%error, policy = %name, "the epoch Lease cannot be read: no grant renewed");
                self.metrics
                    .grant_renewal_skipped(&namespace, &name, "lease_unreadable");
            }
        }
    }

    /// Renews every tracked policy's grants when they are due, each round on a task of its own,
    /// forever.
    pub async fn run(self: Arc<Self>) {
        let mut ticks = tokio::time::interval(TICK);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let now = Instant::now();
            let due: Vec<(ObjectRef<FailoverPolicy>, Arc<FailoverPolicy>)> = {
                let mut tracked = self.tracked();
                tracked
                    .iter_mut()
                    .filter(|(_, t)| !t.in_flight && t.next <= now)
                    .map(|(key, t)| {
                        t.in_flight = true;
                        t.next = now + timing(&t.policy).renew_every;
                        (key.clone(), Arc::clone(&t.policy))
                    })
                    .collect()
            };
            for (key, policy) in due {
                let grantor = Arc::clone(&self);
                tokio::spawn(async move {
                    // However the renewal ends (done, out of time, panicked), the next one may run.
                    let _done = Renewing {
                        grantor: &grantor,
                        key: &key,
                    };
                    // A renewal is worth nothing once the grants it renews have run out.
                    let within = timing(&policy).ttl;
                    if tokio::time::timeout(within, grantor.renew(&policy))
                        .await
                        .is_err()
                    {
                        tracing::warn!(policy = %key, ?within, "a grant renewal did not finish in time");
                    }
                });
            }
        }
    }
}

/// Marks a policy's renewal finished when dropped.
struct Renewing<'a> {
    grantor: &'a Grantor,
    key: &'a ObjectRef<FailoverPolicy>,
}

impl Drop for Renewing<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.grantor.tracked().get_mut(self.key) {
            t.in_flight = false;
        }
    }
}

fn pool_fences(pool: &PoolSpec, fences: &[Endpoint], complete: bool) -> PoolFences {
    PoolFences {
        pool: pool.name.clone(),
        fences: fences
            .iter()
            .map(|f| {
                let at = format!("{}:{}", f.host, f.port);
                FenceAddr {
                    grantor: at.clone(),
                    peer: at,
                }
            })
            .collect(),
        complete,
    }
}

impl LastRound {
    /// The round as status shows it.
    #[must_use]
    pub fn status(&self) -> GrantsStatus {
        let round = &self.round;
        let expires_in_seconds = round
            .answers
            .iter()
            .filter(|a| a.pool == round.holder)
            .filter_map(|a| a.answer.view())
            .filter(|v| v.standing.serves())
            .filter_map(|v| v.remaining_ms)
            .min()
            .map(|ms| ms as f64 / 1e3);
        GrantsStatus {
            epoch: round.epoch.0,
            holder: round.holder.clone(),
            granted_at: self.at.to_string(),
            prior_revoked: round.prior_revoked,
            expires_in_seconds,
            pools: round
                .pools()
                .into_iter()
                .map(|pool| PoolGrants {
                    pool: pool.to_owned(),
                    fences: round
                        .standings(pool)
                        .into_iter()
                        .map(|(s, n)| (s.to_owned(), u32::try_from(n).unwrap_or(u32::MAX)))
                        .collect(),
                })
                .collect(),
        }
    }
}

/// The Events a round's status calls for against the last one status recorded: the holder's
/// fences no longer all confirmed (a Warning `GrantsUnconfirmed`), all confirmed again at the same
/// epoch (`GrantsRenewed`), more fences refusing a grant because they know a higher epoch (a
/// Warning `GrantRefused`). As `(type, reason, note)`.
#[must_use]
pub fn events(before: Option<&GrantsStatus>, now: &GrantsStatus) -> Vec<(EventType, &'static str, String)> {
    let count = |grants: Option<&GrantsStatus>, pool: &str, standings: &[&str]| -> u32 {
        grants
            .and_then(|g| g.pools.iter().find(|p| p.pool == pool))
            .map_or(0, |p| standings.iter().filter_map(|s| p.fences.get(*s)).sum())
    };
    let holder = now.holder.as_str();
    let lost = ["expired", "unreachable"];
    let (lost_now, lost_before) = (count(Some(now), holder, &lost), count(before, holder, &lost));
    let refused = |g: Option<&GrantsStatus>| {
        g.map_or(0, |g| {
            g.pools
                .iter()
                .filter_map(|p| p.fences.get("refused"))
                .sum::<u32>()
        })
    };
    let mut events = Vec::new();
    if lost_now > 0 && lost_before == 0 {
        events.push((
            EventType::Warning,
            "GrantsUnconfirmed",
            format!(
                "{lost_now} of {holder}'s fences ran out of their grant or cannot be reached: each stops \
                 serving when its grant runs out (spec.grants.ttl), unless the other pool's fences vouch for it"
            ),
        ));
    } else if lost_now == 0 && lost_before > 0 && before.is_some_and(|b| b.epoch == now.epoch) {
        events.push((
            EventType::Normal,
            "GrantsRenewed",
            format!(
                "every fence of {holder} holds a grant at epoch {} again",
                now.epoch
            ),
        ));
    }
    if refused(Some(now)) > refused(before) {
        events.push((
            EventType::Warning,
            "GrantRefused",
            format!(
                "{} fence(s) refused epoch {}: they know a higher one, so this operator's read of the Lease is behind",
                refused(Some(now)),
                now.epoch
            ),
        ));
    }
    events
}

/// `host:port`, or `[v6]:port`.
fn split(at: &str) -> Option<(&str, u16)> {
    let (host, port) = at.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host, port.parse().ok()?))
}

/// The steps executor with grants: the Fence step grants the new epoch to every fence at once,
/// and the Route step waits until the new primary's fences serve; everything else goes to the
/// executor it wraps.
#[derive(Debug)]
pub struct Granting {
    pub grantor: Arc<Grantor>,
    pub inner: Arc<dyn StepExecutor>,
}

impl Granting {
    /// The new epoch granted: its holder is the other pool of the policy.
    async fn fence(&self, request: StepRequest<'_>) -> StepReport {
        let Some(holder) = request
            .policy
            .spec
            .pools
            .iter()
            .find(|p| p.name != request.pool.name)
        else {
            return StepReport::NotYet {
                reason: "the policy has no other pool to hold the epoch".to_owned(),
            };
        };
        let round = self
            .grantor
            .round(request.policy, request.epoch, &holder.name)
            .await;
        let takes_none = !round.answers.is_empty()
            && round
                .answers
                .iter()
                .all(|a| a.answer == GrantAnswer::TakesNoGrants);
        if takes_none {
            // Fences that read the Lease themselves, or vLLM with no fence: fenced by other means.
            return self.inner.carry_out(request).await;
        }
        StepReport::Done {
            carried_by: CARRIED_BY,
            note: Some(format!("granted epoch {}: {}", request.epoch, round.summary())),
        }
    }

    /// Why the route must wait for the new primary's fences, if it must.
    async fn unserved(&self, request: &StepRequest<'_>) -> Option<String> {
        let key = ObjectRef::from_obj(request.policy);
        let serves = |round: &GrantRound| {
            round.epoch == request.epoch && round.holder == request.pool.name && round.holder_serves()
        };
        if self.grantor.last(&key).is_some_and(|g| serves(&g.round)) {
            return None;
        }
        let round = self
            .grantor
            .round(request.policy, request.epoch, &request.pool.name)
            .await;
        // Past the deadline the route goes where it can, as every step does then.
        (!serves(&round) && request.overdue.is_none()).then(|| {
            format!(
                "{}'s fences do not serve yet: {}",
                request.pool.name,
                round.summary()
            )
        })
    }
}

impl StepExecutor for Granting {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> BoxFuture<'a, StepReport> {
        Box::pin(async move {
            match request.step {
                Step::FenceOld => self.fence(request).await,
                Step::Route => match self.unserved(&request).await {
                    Some(reason) => StepReport::NotYet { reason },
                    None => self.inner.carry_out(request).await,
                },
                _ => self.inner.carry_out(request).await,
            }
        })
    }

    fn keep_route<'a>(&'a self, request: RouteSyncRequest<'a>) -> BoxFuture<'a, RouteSyncReport> {
        self.inner.keep_route(request)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn status(epoch: u64, holder: &[(&str, u32)], refused: u32) -> GrantsStatus {
        let mut fences: std::collections::BTreeMap<String, u32> =
            holder.iter().map(|(s, n)| ((*s).to_owned(), *n)).collect();
        fences.retain(|_, n| *n > 0);
        let mut other = std::collections::BTreeMap::from([("fenced".to_owned(), 2)]);
        if refused > 0 {
            other.insert("refused".to_owned(), refused);
        }
        GrantsStatus {
            epoch,
            holder: "west".to_owned(),
            granted_at: "2026-12-03T00:00:00Z".to_owned(),
            prior_revoked: true,
            expires_in_seconds: None,
            pools: vec![
                PoolGrants {
                    pool: "east".to_owned(),
                    fences: other,
                },
                PoolGrants {
                    pool: "west".to_owned(),
                    fences,
                },
            ],
        }
    }

    fn reasons(before: Option<&GrantsStatus>, now: &GrantsStatus) -> Vec<&'static str> {
        events(before, now)
            .into_iter()
            .map(|(_, reason, _)| reason)
            .collect()
    }

    #[test]
    fn grants_unconfirmed_renewed_and_refused_are_each_told_once_when_they_change() {
        let serving = status(1, &[("serving", 2)], 0);
        let one_gone = status(1, &[("serving", 1), ("unreachable", 1)], 0);
        let one_expired = status(1, &[("serving", 1), ("expired", 1)], 0);
        assert!(reasons(None, &serving).is_empty());
        assert!(reasons(Some(&serving), &serving).is_empty());
        assert_eq!(reasons(Some(&serving), &one_gone), ["GrantsUnconfirmed"]);
        let (type_, _, note) = &events(Some(&serving), &one_gone)[0];
        assert_eq!(*type_, EventType::Warning);
        assert!(note.starts_with("1 of west's fences"), "{note}");
        assert!(
            reasons(Some(&one_gone), &one_expired).is_empty(),
            "told once while it lasts"
        );
        assert_eq!(reasons(Some(&one_expired), &serving), ["GrantsRenewed"]);
        assert!(
            reasons(Some(&one_expired), &status(2, &[("serving", 2)], 0)).is_empty(),
            "a new epoch is a promotion, told by its own Events"
        );
        assert_eq!(
            reasons(Some(&serving), &status(1, &[("serving", 2)], 1)),
            ["GrantRefused"]
        );
    }
}
