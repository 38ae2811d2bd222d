//! The serving-grant contract between whoever holds the epoch Lease (the operator, or the local
//! game day's runner) and the fence sidecars. A fence in grant mode reads no Lease: it serves
//! only while it holds a [`Grant`] naming its own pool that has not run out, and the grantor
//! renews every pool's grants well before they do. A fence cut off from its grantor therefore
//! stops on its own, and no fence needs credentials for the cluster that holds the Lease.
//!
//! `PUT /understudy/grant` (with the operator's token) gives a fence a grant; it answers with
//! [`GrantView`], its state after taking it, or 409 with its view when the grant is below the
//! highest epoch it has seen. `GET /understudy/grant` answers the same view to anyone: the other
//! pool's fences read it before extending their own grant without the grantor (failsafe, below).
//!
//! # The arithmetic ([`GrantTiming`])
//!
//! Write `T` for the grant's time to live, `R` for the renewal period, `P` for the longest one
//! push may take and `S` for the clock-skew margin (defaults 10 s, 2 s, 1 s, 1 s).
//!
//! - **Serving under a grant.** A fence that takes a grant at its monotonic time `r` serves until
//!   `min(r + T, expiresAt)`, `expiresAt` being the grantor's wall clock at issue plus `T`, read
//!   against the fence's own wall clock. The wall-clock bound is what stops a grant delayed in the
//!   network from serving past `issue + T + S` of true time, as long as the two wall clocks
//!   differ by at most `S`; the monotonic bound is what holds when they do not.
//! - **Renewal.** The grantor pushes every `R`; a push lands within `P`, the holder's after the
//!   other pool's. With `R + 2P < T`, a reachable fence's grant does not run out while reading the
//!   Lease and listing the fences is quick and the clocks agree (a fence whose clock runs `S`
//!   ahead sees `S` less of each grant); `T >= 3R` leaves two renewals to miss before the
//!   failsafe starts ([`GrantTiming::check`]).
//! - **Taking over.** The new holder's fences take its grant at once only when every fence of the
//!   old holder acknowledged the new epoch (`priorRevoked`). Otherwise a fence serves from
//!   `r + T + S`: every grant the old holder was given was issued before the Lease moved, so ran
//!   out by `r + T + S`, and every extension it made for itself began before the new holder's
//!   first fence knew the new epoch, so ran out by then too (failsafe, next).
//! - **Failsafe.** When the grantor is gone, a holder's fence whose grant has less than `T - 2R`
//!   left asks every fence of the other pool named in its last grant (`peers`) for its view, each
//!   within half a renewal period. Only when all of them answer, and none knows an epoch above its
//!   own (nor its own epoch for another holder), does it extend its grant to `c + T`, `c` being
//!   when it began asking. A fence that knows a newer epoch, one that cannot be
//!   reached, or one that knows no epoch at all (restarted since its last grant) refuses the
//!   extension: the grant runs out and the pool stops. So the pools keep serving through the loss
//!   of the control plane exactly while the other pool can vouch that nobody was promoted, as
//!   Patroni's failsafe mode keeps a primary that can reach every member. (A fence of the other
//!   pool created after that grant is not asked: an uneven partition that lets the old holder
//!   reach only the other pool's older fences, while the operator reaches only a newer one, is
//!   the case this does not cover.)
//! - **Self-fencing.** A holder cut off from both its grantor and its peers stops serving at most
//!   `T` after the last grant or extension it took, measured on its own clock. A new holder's
//!   fence waits the longest `T + S` it has seen, in memory: after `spec.grants.ttl` is lowered, a
//!   fence restarted since knows only the new one.
//!
//! One type for both sides of the socket, as [`crate::route`] is. This module only describes a
//! grant and checks its numbers; it must never decide whether a fence serves (the fence does, in
//! `understudy_router::grant`) or touch a socket.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use understudy_core::Epoch;

/// Where a fence takes and shows its grant.
pub const GRANT_PATH: &str = "/understudy/grant";

/// A grant as the grantor pushes it to one fence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Grant {
    /// The policy, `namespace/name`.
    #[serde(default)]
    pub policy: String,
    /// The Lease's epoch.
    pub epoch: Epoch,
    /// The pool that holds the Lease at that epoch. A fence of any other pool is fenced by it.
    pub holder: String,
    /// How long from taking it the holder's fence may serve, in milliseconds.
    pub ttl_ms: u64,
    /// The grantor's wall clock when it issued the grant plus the time to live, in milliseconds
    /// since the Unix epoch.
    pub expires_at_ms: u64,
    /// The clock-skew margin, in milliseconds.
    pub skew_ms: u64,
    /// The renewal period, in milliseconds: when a fence starts its failsafe.
    pub renew_ms: u64,
    /// Every fence of the previous holder has acknowledged this epoch: serve at once, without
    /// waiting out the previous holder's grants.
    #[serde(default)]
    pub prior_revoked: bool,
    /// The other pool's fences, `host:port`, which a holder's fence asks before extending its
    /// own grant without the grantor.
    #[serde(default)]
    pub peers: Vec<String>,
}

/// Where a fence's grant stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum GrantStanding {
    /// No grant taken since the fence started: fenced.
    None,
    /// Another pool holds the epoch: fenced.
    Fenced,
    /// Granted, but waiting out the previous holder's grants before serving.
    Waiting,
    /// Serving under the grantor's grant.
    Serving,
    /// Serving under an extension confirmed with the other pool's fences.
    Failsafe,
    /// The grant ran out: fenced until the next one.
    Expired,
}

impl GrantStanding {
    /// Its name, as the view spells it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            GrantStanding::None => "none",
            GrantStanding::Fenced => "fenced",
            GrantStanding::Waiting => "waiting",
            GrantStanding::Serving => "serving",
            GrantStanding::Failsafe => "failsafe",
            GrantStanding::Expired => "expired",
        }
    }

    /// Whether the fence serves clients' generations.
    #[must_use]
    pub fn serves(self) -> bool {
        matches!(self, GrantStanding::Serving | GrantStanding::Failsafe)
    }
}

/// A fence's grant as it answers `GET` and `PUT /understudy/grant`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrantView {
    /// The fence's pool.
    pub pool: String,
    /// The highest epoch it has taken a grant at; `None` when it has taken none.
    pub epoch: Option<Epoch>,
    /// The pool that holds that epoch.
    #[serde(default)]
    pub holder: String,
    pub standing: GrantStanding,
    /// How long it may serve on, in milliseconds, when it serves or waits to.
    #[serde(default)]
    pub remaining_ms: Option<u64>,
    /// How many failsafe extensions it has taken, and how many it was refused, since it started.
    #[serde(default)]
    pub extended: u64,
    #[serde(default)]
    pub extension_refused: u64,
}

/// The numbers a grantor grants with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantTiming {
    /// `T`: how long a grant lets its holder serve.
    pub ttl: Duration,
    /// `R`: how often the grantor renews.
    pub renew_every: Duration,
    /// `S`: how far two clocks may disagree.
    pub skew: Duration,
    /// `P`: the longest one push (or one failsafe question) may take.
    pub push_timeout: Duration,
}

impl Default for GrantTiming {
    fn default() -> Self {
        GrantTiming {
            ttl: Duration::from_secs(10),
            renew_every: Duration::from_secs(2),
            skew: Duration::from_secs(1),
            push_timeout: Duration::from_secs(1),
        }
    }
}

/// Why a [`GrantTiming`] cannot keep its promises.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidTiming {
    #[error("the grant's time to live ({ttl:?}) must be at least three renewal periods ({renew:?} each)")]
    TooFewRenewals { ttl: Duration, renew: Duration },
    #[error("a push may take at most one renewal period ({renew:?}), not {push:?}")]
    SlowPush { push: Duration, renew: Duration },
    #[error(
        "a renewal period ({renew:?}) and two pushes ({push:?} each) must fit inside the time to live ({ttl:?}), or a reachable fence's grant can lapse"
    )]
    NoRoomToRenew {
        ttl: Duration,
        renew: Duration,
        push: Duration,
    },
    #[error("the clock-skew margin ({skew:?}) must be below half the time to live ({ttl:?})")]
    WideSkew { skew: Duration, ttl: Duration },
    #[error("the renewal period must be longer than zero")]
    NoRenewal,
}

impl GrantTiming {
    /// Checks the bounds the arithmetic above rests on.
    pub fn check(&self) -> Result<(), InvalidTiming> {
        let GrantTiming {
            ttl,
            renew_every: renew,
            skew,
            push_timeout: push,
        } = *self;
        if renew.is_zero() {
            return Err(InvalidTiming::NoRenewal);
        }
        if ttl < renew * 3 {
            return Err(InvalidTiming::TooFewRenewals { ttl, renew });
        }
        if push > renew {
            return Err(InvalidTiming::SlowPush { push, renew });
        }
        // The holder's grant is pushed after the other pool's, each push within P: it lands up to
        // 2P after the round began, and the next one up to R + 2P after that.
        if renew + push * 2 >= ttl {
            return Err(InvalidTiming::NoRoomToRenew { ttl, renew, push });
        }
        if skew * 2 >= ttl {
            return Err(InvalidTiming::WideSkew { skew, ttl });
        }
        Ok(())
    }

    /// The grant to push at `epoch` to a fence, issued at `wall_now` (since the Unix epoch).
    #[must_use]
    pub fn grant(&self, policy: &str, epoch: Epoch, holder: &str, wall_now: Duration) -> Grant {
        Grant {
            policy: policy.to_owned(),
            epoch,
            holder: holder.to_owned(),
            ttl_ms: millis(self.ttl),
            expires_at_ms: millis(wall_now + self.ttl),
            skew_ms: millis(self.skew),
            renew_ms: millis(self.renew_every),
            prior_revoked: false,
            peers: Vec::new(),
        }
    }
}

/// One fence as the grantor reaches it and as the other pool's fences reach it (the same
/// `host:port` in one flat network).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceAddr {
    pub grantor: String,
    pub peer: String,
}

/// One pool's fences, for a grant round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolFences {
    /// The pool's name, as the Lease's holder names it.
    pub pool: String,
    pub fences: Vec<FenceAddr>,
    /// Whether `fences` is every fence the pool has. `false` when its cluster could not be
    /// listed: a fence nobody could name can never be counted as revoked.
    pub complete: bool,
}

/// What a fence made of a grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrantAnswer {
    /// It took it: its view after.
    Took(GrantView),
    /// It knows a higher epoch already: its view.
    Stale(GrantView),
    /// It takes no grants (404): a fence that reads the Lease itself, or vLLM with no fence in
    /// front. It holds no grant to revoke, and is fenced, or not, by other means.
    TakesNoGrants,
    /// No answer, or one that is not a fence's: why.
    Failed(String),
}

impl GrantAnswer {
    /// A fence's answer to `PUT /understudy/grant`, from its status and body.
    #[must_use]
    pub fn read(status: u16, body: &[u8]) -> GrantAnswer {
        let view = serde_json::from_slice::<GrantView>(body);
        match (status, view) {
            (200, Ok(view)) => GrantAnswer::Took(view),
            (409, Ok(view)) => GrantAnswer::Stale(view),
            (404, _) => GrantAnswer::TakesNoGrants,
            (status, _) => GrantAnswer::Failed(format!(
                "answered {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            )),
        }
    }

    /// The fence's view, when it answered with one.
    #[must_use]
    pub fn view(&self) -> Option<&GrantView> {
        match self {
            GrantAnswer::Took(view) | GrantAnswer::Stale(view) => Some(view),
            GrantAnswer::TakesNoGrants | GrantAnswer::Failed(_) => None,
        }
    }

    /// Whether the fence took `epoch`, so that it can no longer serve below it under a grant. A
    /// fence that refused it as stale did not: the grantor's read of the Lease is behind, and
    /// nothing it grants can be trusted.
    #[must_use]
    pub fn revoked_below(&self, epoch: Epoch) -> bool {
        match self {
            GrantAnswer::TakesNoGrants => true,
            GrantAnswer::Took(view) => view.epoch.is_some_and(|e| e >= epoch),
            GrantAnswer::Stale(_) | GrantAnswer::Failed(_) => false,
        }
    }
}

/// One fence's answer to a grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceAnswer {
    pub pool: String,
    pub fence: String,
    pub answer: GrantAnswer,
}

/// Every standing a fence is counted in, in the order they are shown.
pub const STANDINGS: [&str; 9] = [
    "serving",
    "failsafe",
    "waiting",
    "fenced",
    "expired",
    "none",
    "takesNoGrants",
    "refused",
    "unreachable",
];

/// What one round of grants did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantRound {
    pub epoch: Epoch,
    pub holder: String,
    /// Every fence of every other pool took the epoch, so the holder's serve at once.
    pub prior_revoked: bool,
    pub answers: Vec<FenceAnswer>,
}

impl GrantRound {
    /// The holder's fences that answered standing as `standing`.
    #[must_use]
    pub fn holders(&self, standing: GrantStanding) -> usize {
        self.answers
            .iter()
            .filter(|a| a.pool == self.holder)
            .filter(|a| a.answer.view().is_some_and(|v| v.standing == standing))
            .count()
    }

    /// The fences, of any pool, that gave no answer a fence gives.
    #[must_use]
    pub fn unanswered(&self) -> usize {
        self.answers
            .iter()
            .filter(|a| matches!(a.answer, GrantAnswer::Failed(_)))
            .count()
    }

    /// Whether the holder's fences take grants. Only when the holder has fences and every one of
    /// them answered 404 is it fenced by other means, with nothing to wait for; a holder none of
    /// whose fences was found is not known to be.
    #[must_use]
    pub fn holder_takes_grants(&self) -> bool {
        let mut ours = self.answers.iter().filter(|a| a.pool == self.holder).peekable();
        ours.peek().is_none() || ours.any(|a| a.answer != GrantAnswer::TakesNoGrants)
    }

    /// `pool`'s fences by standing, as `(standing, count)`, in the order of [`STANDINGS`]:
    /// [`GrantStanding::name`], or `takesNoGrants`, `refused` (it knows a higher epoch than the
    /// grantor read) and `unreachable` for fences that gave no view of this grant.
    #[must_use]
    pub fn standings(&self, pool: &str) -> Vec<(&'static str, usize)> {
        let mut counts = [0usize; STANDINGS.len()];
        for answer in self.answers.iter().filter(|a| a.pool == pool) {
            let name = match &answer.answer {
                GrantAnswer::Took(view) => view.standing.name(),
                GrantAnswer::Stale(_) => "refused",
                GrantAnswer::TakesNoGrants => "takesNoGrants",
                GrantAnswer::Failed(_) => "unreachable",
            };
            if let Some(i) = STANDINGS.iter().position(|n| *n == name) {
                counts[i] += 1;
            }
        }
        STANDINGS
            .into_iter()
            .zip(counts)
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// The pools the round granted to, by name.
    #[must_use]
    pub fn pools(&self) -> Vec<&str> {
        let mut pools: Vec<&str> = self.answers.iter().map(|a| a.pool.as_str()).collect();
        pools.sort_unstable();
        pools.dedup();
        pools
    }

    /// One line: who holds the epoch, and each pool's fences by standing.
    #[must_use]
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .pools()
            .into_iter()
            .map(|pool| {
                let said: Vec<String> = self
                    .standings(pool)
                    .iter()
                    .map(|(s, n)| format!("{n} {s}"))
                    .collect();
                format!("{pool}: {}", said.join(", "))
            })
            .collect();
        format!(
            "{} holds epoch {}{}; {}",
            self.holder,
            self.epoch,
            if self.prior_revoked {
                ""
            } else {
                " (the old holder not revoked)"
            },
            parts.join("; ")
        )
    }

    /// Whether the holder's fences serve: one of them does, or none takes grants.
    #[must_use]
    pub fn holder_serves(&self) -> bool {
        !self.holder_takes_grants()
            || self.holders(GrantStanding::Serving) + self.holders(GrantStanding::Failsafe) > 0
    }
}

/// Grants every fence of `pools` the Lease's `epoch` held by `holder`: first the other pools'
/// fences (which fences them at once), then the holder's, told whether all of the others took the
/// epoch and given the others' fences as their peers. `push` sends one grant to one fence's
/// grantor address and reads its view; it bounds its own time.
pub async fn grant_round<F, Fut>(
    timing: &GrantTiming,
    policy: &str,
    (epoch, holder): (Epoch, &str),
    pools: &[PoolFences],
    wall_now: Duration,
    push: F,
) -> GrantRound
where
    F: Fn(String, Grant) -> Fut,
    Fut: std::future::Future<Output = GrantAnswer>,
{
    let grant = timing.grant(policy, epoch, holder, wall_now);
    let (others, ours): (Vec<&PoolFences>, Vec<&PoolFences>) = pools.iter().partition(|p| p.pool != holder);
    let mut answers = ask_all(&push, &others, &grant).await;
    let complete = others.iter().all(|pool| pool.complete);
    let prior_revoked = complete && answers.iter().all(|a| a.answer.revoked_below(epoch));
    // A fence that knows a higher epoch says this grantor is behind: the holder is granted
    // nothing, and its fences run out.
    let behind = answers.iter().any(|a| matches!(a.answer, GrantAnswer::Stale(_)));
    let held = Grant {
        prior_revoked,
        // Only a whole list can vouch that nobody holds a newer epoch.
        peers: if complete {
            others
                .iter()
                .flat_map(|pool| pool.fences.iter().map(|f| f.peer.clone()))
                .collect()
        } else {
            Vec::new()
        },
        ..grant
    };
    if !behind {
        answers.extend(ask_all(&push, &ours, &held).await);
    }
    GrantRound {
        epoch,
        holder: holder.to_owned(),
        prior_revoked,
        answers,
    }
}

/// Sends `grant` to every fence of `pools` at once.
async fn ask_all<F, Fut>(push: &F, pools: &[&PoolFences], grant: &Grant) -> Vec<FenceAnswer>
where
    F: Fn(String, Grant) -> Fut,
    Fut: std::future::Future<Output = GrantAnswer>,
{
    let asks = pools.iter().flat_map(|pool| {
        pool.fences.iter().map(|fence| async {
            FenceAnswer {
                pool: pool.pool.clone(),
                fence: fence.grantor.clone(),
                answer: push(fence.grantor.clone(), grant.clone()).await,
            }
        })
    });
    futures::future::join_all(asks).await
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_timing_keeps_its_promises_and_bad_ones_say_which() {
        assert_eq!(GrantTiming::default().check(), Ok(()));
        let few = GrantTiming {
            ttl: Duration::from_secs(5),
            ..GrantTiming::default()
        };
        assert!(matches!(few.check(), Err(InvalidTiming::TooFewRenewals { .. })));
        let slow = GrantTiming {
            push_timeout: Duration::from_secs(3),
            ..GrantTiming::default()
        };
        assert!(matches!(slow.check(), Err(InvalidTiming::SlowPush { .. })));
        let skewed = GrantTiming {
            skew: Duration::from_secs(5),
            ..GrantTiming::default()
        };
        assert!(matches!(skewed.check(), Err(InvalidTiming::WideSkew { .. })));
        let tight = GrantTiming {
            ttl: Duration::from_secs(3),
            renew_every: Duration::from_secs(1),
            skew: Duration::from_millis(500),
            push_timeout: Duration::from_secs(1),
        };
        assert!(matches!(tight.check(), Err(InvalidTiming::NoRoomToRenew { .. })));
    }

    fn pool(name: &str, fences: &[&str], complete: bool) -> PoolFences {
        PoolFences {
            pool: name.to_owned(),
            fences: fences
                .iter()
                .map(|f| FenceAddr {
                    grantor: (*f).to_owned(),
                    peer: format!("peer-{f}"),
                })
                .collect(),
            complete,
        }
    }

    /// Answers as a fence would, except the ones named in `down`; records what each was sent.
    async fn round(pools: &[PoolFences], down: &[&str]) -> (GrantRound, Vec<(String, Grant)>) {
        let sent = std::sync::Mutex::new(Vec::new());
        let round = grant_round(
            &GrantTiming::default(),
            "ns/p",
            (Epoch(2), "b"),
            pools,
            Duration::from_secs(100),
            |fence, grant: Grant| {
                sent.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((fence.clone(), grant.clone()));
                let down = down.contains(&fence.as_str());
                async move {
                    if down {
                        return GrantAnswer::Failed("unreachable".to_owned());
                    }
                    if fence.ends_with("-ahead") {
                        let view = GrantView {
                            pool: "a".to_owned(),
                            epoch: Some(Epoch(grant.epoch.0 + 1)),
                            holder: "a".to_owned(),
                            standing: GrantStanding::Serving,
                            remaining_ms: None,
                            extended: 0,
                            extension_refused: 0,
                        };
                        return GrantAnswer::Stale(view);
                    }
                    let pool = if fence.starts_with('a') { "a" } else { "b" };
                    let standing = match (pool == grant.holder, grant.prior_revoked) {
                        (false, _) => GrantStanding::Fenced,
                        (true, true) => GrantStanding::Serving,
                        (true, false) => GrantStanding::Waiting,
                    };
                    GrantAnswer::Took(GrantView {
                        pool: pool.to_owned(),
                        epoch: Some(grant.epoch),
                        holder: grant.holder,
                        standing,
                        remaining_ms: None,
                        extended: 0,
                        extension_refused: 0,
                    })
                }
            },
        )
        .await;
        (round, sent.into_inner().unwrap_or_default())
    }

    #[tokio::test]
    async fn a_round_revokes_the_old_holder_first_and_tells_the_new_one_whether_it_may_serve_at_once() {
        let pools = [pool("a", &["a1", "a2"], true), pool("b", &["b1"], true)];
        let (all, sent) = round(&pools, &[]).await;
        assert!(all.prior_revoked);
        assert_eq!((all.holders(GrantStanding::Serving), all.unanswered()), (1, 0));
        let order: Vec<&str> = sent.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(order, ["a1", "a2", "b1"], "the old holder's fences first");
        let to_b = &sent[2].1;
        assert_eq!(to_b.peers, ["peer-a1", "peer-a2"]);
        assert!(sent[0].1.peers.is_empty() && !sent[0].1.prior_revoked);

        let (one_down, _) = round(&pools, &["a2"]).await;
        assert!(
            !one_down.prior_revoked,
            "a2 may still serve until its grant runs out"
        );
        assert_eq!(
            (one_down.holders(GrantStanding::Waiting), one_down.unanswered()),
            (1, 1)
        );

        let unlisted = [pool("a", &["a1"], false), pool("b", &["b1"], true)];
        let (partial, sent) = round(&unlisted, &[]).await;
        assert!(sent[1].1.peers.is_empty(), "a part of a pool cannot vouch for it");
        assert!(
            !partial.prior_revoked,
            "a fence nobody could list is never revoked"
        );
        assert!(partial.holder_takes_grants() && !partial.holder_serves());

        // A fence of a that knows epoch 3 says the grantor is behind: b is granted nothing.
        let ahead = [pool("a", &["a1", "a2-ahead"], true), pool("b", &["b1"], true)];
        let (behind, sent) = round(&ahead, &[]).await;
        assert!(!behind.prior_revoked);
        assert_eq!(sent.len(), 2, "nothing pushed to b: {sent:?}");
        assert!(!behind.holder_serves(), "b has no fence that answered");
    }

    #[test]
    fn a_fence_that_takes_no_grants_holds_none_to_revoke_and_a_holder_without_any_is_not_waited_for() {
        let answer = |pool: &str, answer| FenceAnswer {
            pool: pool.to_owned(),
            fence: format!("{pool}1"),
            answer,
        };
        let round = GrantRound {
            epoch: Epoch(2),
            holder: "b".to_owned(),
            prior_revoked: true,
            answers: vec![
                answer("a", GrantAnswer::TakesNoGrants),
                answer("b", GrantAnswer::TakesNoGrants),
            ],
        };
        assert!(GrantAnswer::TakesNoGrants.revoked_below(Epoch(2)));
        assert!(!GrantAnswer::Failed("down".to_owned()).revoked_below(Epoch(2)));
        assert!(!round.holder_takes_grants() && round.holder_serves());
    }

    #[test]
    fn a_grant_reads_back_as_it_was_written_and_unknown_fields_are_refused() {
        let grant = GrantTiming::default().grant("ns/chat", Epoch(3), "b", Duration::from_secs(100));
        assert_eq!(grant.expires_at_ms, 110_000);
        let json = serde_json::to_string(&grant).unwrap_or_default();
        assert!(json.contains("\"expiresAtMs\":110000"), "{json}");
        let back: Grant = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, grant);
        let unknown = json.replace("\"holder\"", "\"holdr\"");
        assert!(serde_json::from_str::<Grant>(&unknown).is_err());
    }
}
