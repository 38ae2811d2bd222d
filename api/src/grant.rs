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
//! - **Renewal.** The grantor pushes every `R`; a push lands within `P`. With `R + P < T`, a
//!   reachable fence's grant never runs out; `T >= 3R` leaves two renewals to miss before the
//!   failsafe starts ([`GrantTiming::check`]).
//! - **Taking over.** The new holder's fences take its grant at once only when every fence of the
//!   old holder acknowledged the new epoch (`priorRevoked`). Otherwise a fence serves from
//!   `r + T + S`: every grant the old holder was given was issued before the Lease moved, so ran
//!   out by `r + T + S`, and every extension it made for itself began before the new holder's
//!   first fence knew the new epoch, so ran out by then too (failsafe, next).
//! - **Failsafe.** When the grantor is gone, a holder's fence whose grant has less than `T - 2R`
//!   left asks every fence of the other pool (`peers`) for its view, each within `P`. Only when
//!   all of them answer, and none knows an epoch above its own, does it extend its grant to `c +
//!   T`, `c` being when it began asking. A fence that knows a newer epoch, one that cannot be
//!   reached, or one that knows no epoch at all (restarted since its last grant) refuses the
//!   extension: the grant runs out and the pool stops. So the pools keep serving through the loss
//!   of the control plane exactly while the other pool can vouch that nobody was promoted, as
//!   Patroni's failsafe mode keeps a primary that can reach every member.
//! - **Self-fencing.** A holder cut off from both its grantor and its peers stops serving at most
//!   `T` after the last grant or extension it took, measured on its own clock.
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
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidTiming {
    #[error("the grant's time to live ({ttl:?}) must be at least three renewal periods ({renew:?} each)")]
    TooFewRenewals { ttl: Duration, renew: Duration },
    #[error("a push may take at most one renewal period ({renew:?}), not {push:?}")]
    SlowPush { push: Duration, renew: Duration },
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
        if skew * 2 >= ttl {
            return Err(InvalidTiming::WideSkew { skew, ttl });
        }
        Ok(())
    }

    /// The longest a new holder waits before serving when the old holder's fences did not all
    /// acknowledge the new epoch: `T + S` from taking its grant.
    #[must_use]
    pub fn takeover_wait(&self) -> Duration {
        self.ttl + self.skew
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
        assert_eq!(GrantTiming::default().takeover_wait(), Duration::from_secs(11));
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
