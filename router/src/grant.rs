//! A fence's serving grant: what it holds ([`GrantBook`], pure, driven by the instants it is
//! given), the task that keeps its verdict true as time passes and extends the grant without the
//! grantor when the other pool vouches for it ([`keep_grant`]), and the answers to
//! `GET`/`PUT /understudy/grant`. The arithmetic, and why it is safe, is in
//! [`understudy_api::grant`].
//!
//! What this module must never do: serve past a deadline, serve a new epoch before the old
//! holder's grants have run out unless the grantor says they were revoked, extend a grant that
//! any peer could not vouch for, or bring an expired grant back without the grantor.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Notify;
use tokio::time::Instant;
pub use understudy_api::grant::{GRANT_PATH, Grant, GrantStanding, GrantView};
use understudy_core::Epoch;

use crate::body::RouterBody;
use crate::fence_fault::{json_response, read_capped};
use crate::fence_sidecar::{FenceState, FenceVerdict};
use crate::refusal::error_response;

/// A grant below the highest epoch the fence has seen, or at that epoch for another holder.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the fence holds epoch {seen} for {holder}; a grant at {offered} for {offered_holder} is stale")]
pub struct Stale {
    pub seen: Epoch,
    pub holder: String,
    pub offered: Epoch,
    pub offered_holder: String,
}

/// What one fence holds: the highest epoch it was granted at, who holds it, and, when its own
/// pool does, from when and until when it serves.
#[derive(Debug, Clone)]
pub struct GrantBook {
    pool: String,
    epoch: Option<Epoch>,
    holder: String,
    serve_from: Option<Instant>,
    serve_until: Option<Instant>,
    /// The deadline came from a failsafe extension, not the grantor.
    extended: bool,
    ttl: Duration,
    renew: Duration,
    /// The longest `T + S` of any grant this fence has taken: a new holder waits at least this
    /// long, since the old holder's grants may have been given with it.
    longest_wait: Duration,
    peers: Vec<String>,
    extensions: u64,
    refusals: u64,
}

impl GrantBook {
    /// A fence of `pool` that has taken no grant: fenced.
    #[must_use]
    pub fn new(pool: impl Into<String>) -> Self {
        GrantBook {
            pool: pool.into(),
            epoch: None,
            holder: String::new(),
            serve_from: None,
            serve_until: None,
            extended: false,
            ttl: Duration::ZERO,
            renew: Duration::ZERO,
            longest_wait: Duration::ZERO,
            peers: Vec::new(),
            extensions: 0,
            refusals: 0,
        }
    }

    /// Takes `grant` at monotonic `now`, the fence's wall clock reading `wall_now` since the Unix
    /// epoch.
    pub fn take(&mut self, grant: &Grant, now: Instant, wall_now: Duration) -> Result<(), Stale> {
        // Below the highest epoch seen, or at it for another holder: the grantor is behind.
        let conflicting =
            |seen: &Epoch| grant.epoch < *seen || (grant.epoch == *seen && grant.holder != self.holder);
        if let Some(seen) = self.epoch.filter(conflicting) {
            return Err(Stale {
                seen,
                holder: self.holder.clone(),
                offered: grant.epoch,
                offered_holder: grant.holder.clone(),
            });
        }
        let ttl = Duration::from_millis(grant.ttl_ms);
        let skew = Duration::from_millis(grant.skew_ms);
        self.longest_wait = self.longest_wait.max(ttl + skew);
        let ours = grant.holder == self.pool;
        let held = self.epoch == Some(grant.epoch) && self.holder == self.pool;
        let expired = self.standing(now) == GrantStanding::Expired;
        if ours {
            // Never past the grantor's own deadline, read on our wall clock.
            let wall_left = Duration::from_millis(grant.expires_at_ms).saturating_sub(wall_now);
            let until = now + ttl.min(wall_left);
            self.serve_from = Some(match (grant.prior_revoked, held, self.serve_from) {
                (true, _, _) => now,
                (false, true, Some(from)) => from,
                // A new epoch, with the old holder's grants not known to be revoked: wait them out,
                // at the longest any grant this fence saw could have lasted.
                _ => now + self.longest_wait,
            });
            // A renewal never shortens an extension already confirmed with the peers.
            self.serve_until = Some(match (held, self.serve_until) {
                (true, Some(was)) if !expired => was.max(until),
                _ => until,
            });
            self.extended = held && self.serve_until != Some(until);
        } else {
            self.serve_from = None;
            self.serve_until = None;
            self.extended = false;
        }
        self.epoch = Some(grant.epoch);
        self.holder.clone_from(&grant.holder);
        self.ttl = ttl;
        self.renew = Duration::from_millis(grant.renew_ms);
        self.peers.clone_from(&grant.peers);
        Ok(())
    }

    /// Where the grant stands at `now`.
    #[must_use]
    pub fn standing(&self, now: Instant) -> GrantStanding {
        match (self.epoch, self.serve_from, self.serve_until) {
            (None, _, _) => GrantStanding::None,
            _ if self.holder != self.pool => GrantStanding::Fenced,
            // Still waiting out the old holder, whether or not this grant lapsed meanwhile.
            (_, Some(from), _) if now < from => GrantStanding::Waiting,
            (_, _, Some(until)) if now >= until => GrantStanding::Expired,
            _ if self.extended => GrantStanding::Failsafe,
            _ => GrantStanding::Serving,
        }
    }

    /// The fence's verdict at `now`.
    #[must_use]
    pub fn verdict(&self, now: Instant) -> FenceVerdict {
        let epoch = self.epoch.unwrap_or(Epoch(0));
        if self.standing(now).serves() {
            FenceVerdict::Serving(epoch)
        } else {
            FenceVerdict::Fenced { epoch }
        }
    }

    /// Until when it serves, while it serves.
    #[must_use]
    pub fn serving_until(&self, now: Instant) -> Option<Instant> {
        self.standing(now).serves().then_some(self.serve_until).flatten()
    }

    /// When the failsafe starts asking the peers: once less than `T - 2R` is left, two renewals
    /// missed. `None` when there is nothing to extend.
    #[must_use]
    pub fn failsafe_from(&self, now: Instant) -> Option<Instant> {
        let until = self.serving_until(now)?;
        Some(until - self.ttl.saturating_sub(self.renew * 2).min(until - now))
    }

    /// The next instant at which the standing changes or the failsafe is due, after `now`.
    #[must_use]
    pub fn next_change(&self, now: Instant) -> Option<Instant> {
        [self.serve_from, self.serve_until, self.failsafe_from(now)]
            .into_iter()
            .flatten()
            .filter(|at| *at > now)
            .min()
    }

    /// The peers' views, asked from `began`, vouch for it: extend to `began + T`.
    pub fn extend(&mut self, began: Instant, now: Instant) {
        if self.standing(now).serves() {
            self.serve_until = self.serve_until.map(|until| until.max(began + self.ttl));
            self.extended = true;
            self.extensions += 1;
        }
    }

    /// Whether `views` (one per peer, `None` for a peer that did not answer) vouch that nobody
    /// holds an epoch above ours. Every peer must answer, with an epoch it knows: below ours, or
    /// ours held by our pool.
    #[must_use]
    pub fn vouched(&self, views: &[Option<GrantView>]) -> bool {
        let Some(ours) = self.epoch else { return false };
        let vouches = |view: &GrantView| match view.epoch {
            Some(theirs) if theirs < ours => true,
            Some(theirs) => theirs == ours && view.holder == self.holder,
            None => false,
        };
        !views.is_empty() && views.iter().all(|view| view.as_ref().is_some_and(vouches))
    }

    /// The book as `GET /understudy/grant` shows it.
    #[must_use]
    pub fn view(&self, now: Instant) -> GrantView {
        let standing = self.standing(now);
        let left = match standing {
            GrantStanding::Serving | GrantStanding::Failsafe | GrantStanding::Waiting => self.serve_until,
            _ => None,
        };
        GrantView {
            pool: self.pool.clone(),
            epoch: self.epoch,
            holder: self.holder.clone(),
            standing,
            remaining_ms: left.map(|until| {
                u64::try_from(until.saturating_duration_since(now).as_millis()).unwrap_or(u64::MAX)
            }),
            extended: self.extensions,
            extension_refused: self.refusals,
        }
    }
}

/// A fence's grant, shared by its requests and the task that keeps it.
#[derive(Debug)]
pub struct Granted {
    book: Mutex<GrantBook>,
    state: Arc<FenceState>,
    changed: Notify,
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl Granted {
    /// The grant of `state`'s pool, none taken yet.
    #[must_use]
    pub fn new(pool: &str, state: Arc<FenceState>) -> Arc<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Arc::new(Granted {
            book: Mutex::new(GrantBook::new(pool)),
            state,
            changed: Notify::new(),
            client: Client::builder(TokioExecutor::new()).build(connector),
        })
    }

    fn with_book<T>(&self, f: impl FnOnce(&mut GrantBook) -> T) -> T {
        let mut book = self.book.lock().unwrap_or_else(PoisonError::into_inner);
        let out = f(&mut book);
        let now = Instant::now();
        self.state.set_until(&book.verdict(now), book.serving_until(now));
        out
    }

    /// Takes a grant pushed by the grantor: the view after it, or, for a stale one, the view it
    /// was refused with.
    pub fn take(&self, grant: &Grant) -> Result<GrantView, Box<(Stale, GrantView)>> {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let now = Instant::now();
        let taken = self.with_book(|book| {
            let before = book.standing(now);
            let taken = book.take(grant, now, wall);
            let after = book.standing(now);
            if before != after {
                tracing::info!(epoch = %grant.epoch, holder = %grant.holder, ?before, ?after, "grant changed");
            }
            taken
                .map(|()| book.view(now))
                .map_err(|stale| Box::new((stale, book.view(now))))
        });
        self.changed.notify_one();
        taken
    }

    /// The grant as it stands.
    #[must_use]
    pub fn view(&self) -> GrantView {
        self.with_book(|book| book.view(Instant::now()))
    }

    /// Answers `GET` (anyone) and `PUT` (the caller passed the token check) on [`GRANT_PATH`].
    pub async fn call(&self, req: Request<Incoming>) -> Response<RouterBody> {
        match *req.method() {
            Method::GET => json_response(&self.view()),
            Method::PUT => {
                let body = match read_capped(req, 64 << 10).await {
                    Ok(body) => body,
                    Err(refusal) => return refusal,
                };
                let grant: Grant = match serde_json::from_slice(&body) {
                    Ok(grant) => grant,
                    Err(e) => {
                        let message = format!("not a grant: {e}");
                        return error_response(StatusCode::BAD_REQUEST, "invalid_grant", &message);
                    }
                };
                match self.take(&grant) {
                    Ok(view) => json_response(&view),
                    Err(refused) => {
                        let (stale, view) = *refused;
                        tracing::warn!(%stale, "stale grant refused");
                        let mut resp = json_response(&view);
                        *resp.status_mut() = StatusCode::CONFLICT;
                        resp
                    }
                }
            }
            _ => error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "GET reads the grant, PUT gives one",
            ),
        }
    }

    /// Every peer's view, each asked within `within`; `None` for one that did not answer.
    async fn ask_peers(&self, peers: &[String], within: Duration) -> Vec<Option<GrantView>> {
        let asks = peers.iter().map(|peer| async move {
            let uri = format!("http://{peer}{GRANT_PATH}");
            let req = Request::get(uri).body(Empty::new()).ok()?;
            let answer = tokio::time::timeout(within, async {
                let resp = self.client.request(req).await.ok()?;
                if resp.status() != StatusCode::OK {
                    return None;
                }
                let body = resp.into_body().collect().await.ok()?.to_bytes();
                serde_json::from_slice::<GrantView>(&body).ok()
            });
            answer.await.ok().flatten()
        });
        join_all(asks).await
    }
}

/// Keeps `granted`'s verdict true as time passes, forever: flips it when a grant starts or runs
/// out, and, when the grantor has missed two renewals, asks the peers each half renewal period
/// whether it may extend its grant.
pub async fn keep_grant(granted: Arc<Granted>) {
    loop {
        let now = Instant::now();
        let (next, failsafe) = granted.with_book(|book| {
            let due = book.failsafe_from(now).filter(|from| *from <= now);
            (
                book.next_change(now),
                due.map(|_| (book.peers.clone(), book.renew)),
            )
        });
        if let Some((peers, renew)) = failsafe {
            let began = Instant::now();
            let within = (renew / 2).max(Duration::from_millis(100));
            let views = granted.ask_peers(&peers, within).await;
            granted.with_book(|book| {
                if book.vouched(&views) {
                    book.extend(began, Instant::now());
                    tracing::info!(peers = peers.len(), "grantor silent; peers vouch: grant extended");
                } else {
                    book.refusals += 1;
                    tracing::warn!(
                        answered = views.iter().flatten().count(),
                        peers = peers.len(),
                        "grantor silent; peers do not vouch: the grant runs out"
                    );
                }
            });
            // Asked again after half a renewal period, or sooner when the grant runs out.
            let again = granted.with_book(|book| book.next_change(Instant::now()));
            let wake = again.map_or(Instant::now() + within, |at| at.min(Instant::now() + within));
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = granted.changed.notified() => {}
            }
            continue;
        }
        match next {
            Some(at) => tokio::select! {
                () = tokio::time::sleep_until(at) => {}
                () = granted.changed.notified() => {}
            },
            None => granted.changed.notified().await,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use understudy_api::grant::GrantTiming;

    const WALL: Duration = Duration::from_secs(1_000_000);

    fn grant(epoch: u64, holder: &str) -> Grant {
        GrantTiming::default().grant("ns/p", Epoch(epoch), holder, WALL)
    }

    fn revoked(epoch: u64, holder: &str) -> Grant {
        Grant {
            prior_revoked: true,
            ..grant(epoch, holder)
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[tokio::test(start_paused = true)]
    async fn a_holder_serves_until_its_grant_runs_out_and_a_renewal_moves_the_deadline() {
        let t0 = Instant::now();
        let mut book = GrantBook::new("a");
        assert_eq!(book.standing(t0), GrantStanding::None);
        book.take(&revoked(1, "a"), t0, WALL).unwrap();
        assert_eq!(book.verdict(t0), FenceVerdict::Serving(Epoch(1)));
        assert_eq!(book.standing(t0 + secs(9)), GrantStanding::Serving);
        assert_eq!(book.standing(t0 + secs(10)), GrantStanding::Expired);
        // Renewed at 2 s on the same wall clock reading plus 2 s: ten seconds from then.
        book.take(
            &GrantTiming::default().grant("ns/p", Epoch(1), "a", WALL + secs(2)),
            t0 + secs(2),
            WALL + secs(2),
        )
        .unwrap();
        assert_eq!(book.standing(t0 + secs(11)), GrantStanding::Serving);
        assert_eq!(book.standing(t0 + secs(12)), GrantStanding::Expired);
        assert_eq!(
            book.verdict(t0 + secs(12)),
            FenceVerdict::Fenced { epoch: Epoch(1) }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_delayed_in_the_network_ends_at_the_grantors_deadline() {
        let t0 = Instant::now();
        let mut book = GrantBook::new("a");
        // Issued at WALL, taken 6 s later: what is left of its 10 s on our wall clock.
        book.take(&revoked(1, "a"), t0, WALL + secs(6)).unwrap();
        assert_eq!(
            book.standing(t0 + Duration::from_millis(3_999)),
            GrantStanding::Serving
        );
        assert_eq!(book.standing(t0 + secs(4)), GrantStanding::Expired);
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_holder_waits_out_the_old_holders_grants_unless_they_were_revoked() {
        let t0 = Instant::now();
        let mut waits = GrantBook::new("b");
        waits.take(&grant(2, "b"), t0, WALL).unwrap();
        assert_eq!(waits.standing(t0), GrantStanding::Waiting);
        assert_eq!(
            waits.verdict(t0 + secs(10)),
            FenceVerdict::Fenced { epoch: Epoch(2) }
        );
        // Renewals while it waits change nothing about when it starts: T + S from the first.
        waits
            .take(
                &GrantTiming::default().grant("ns/p", Epoch(2), "b", WALL + secs(5)),
                t0 + secs(5),
                WALL + secs(5),
            )
            .unwrap();
        assert_eq!(
            waits.standing(t0 + Duration::from_millis(10_999)),
            GrantStanding::Waiting
        );
        assert_eq!(waits.standing(t0 + secs(11)), GrantStanding::Serving);
        // The grantor then learns the old holder's fences took the epoch: at once from then on.
        let mut told = GrantBook::new("b");
        told.take(&grant(2, "b"), t0, WALL).unwrap();
        told.take(&revoked(2, "b"), t0 + secs(1), WALL + secs(1)).unwrap();
        assert_eq!(told.standing(t0 + secs(1)), GrantStanding::Serving);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stale_grant_is_refused_and_another_pools_grant_fences_at_once() {
        let t0 = Instant::now();
        let mut book = GrantBook::new("a");
        book.take(&revoked(3, "a"), t0, WALL).unwrap();
        assert_eq!(
            book.take(&revoked(2, "a"), t0, WALL),
            Err(Stale {
                seen: Epoch(3),
                holder: "a".into(),
                offered: Epoch(2),
                offered_holder: "a".into(),
            })
        );
        assert!(book.take(&revoked(3, "b"), t0, WALL).is_err(), "epoch 3 is a's");
        assert_eq!(book.standing(t0), GrantStanding::Serving);
        book.take(&grant(4, "b"), t0, WALL).unwrap();
        assert_eq!(book.verdict(t0), FenceVerdict::Fenced { epoch: Epoch(4) });
        assert_eq!(book.failsafe_from(t0), None, "nothing to extend");
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_holder_waits_as_long_as_the_longest_grant_it_ever_saw() {
        let t0 = Instant::now();
        let mut book = GrantBook::new("b");
        // While a held epoch 1 its grants lasted a minute; epoch 2 comes with ten seconds.
        let long = GrantTiming {
            ttl: secs(60),
            renew_every: secs(10),
            ..GrantTiming::default()
        };
        book.take(&long.grant("ns/p", Epoch(1), "a", WALL), t0, WALL)
            .unwrap();
        book.take(&grant(2, "b"), t0, WALL).unwrap();
        assert_eq!(book.standing(t0 + secs(5)), GrantStanding::Waiting);
        assert_eq!(
            book.standing(t0 + secs(30)),
            GrantStanding::Waiting,
            "its own grant lapsed meanwhile: still waiting, not serving"
        );
        assert_eq!(
            book.verdict(t0 + secs(30)),
            FenceVerdict::Fenced { epoch: Epoch(2) }
        );
        // Renewed as it waits, as the grantor does.
        let renewed = GrantTiming::default().grant("ns/p", Epoch(2), "b", WALL + secs(55));
        book.take(&renewed, t0 + secs(55), WALL + secs(55)).unwrap();
        assert_eq!(book.standing(t0 + secs(60)), GrantStanding::Waiting);
        assert_eq!(book.failsafe_from(t0 + secs(60)), None);
        assert_eq!(
            book.standing(t0 + secs(61)),
            GrantStanding::Serving,
            "61 s: a minute plus the skew"
        );
    }

    fn view(epoch: Option<u64>) -> Option<GrantView> {
        Some(GrantView {
            pool: "b".into(),
            epoch: epoch.map(Epoch),
            holder: "a".into(),
            standing: GrantStanding::Fenced,
            remaining_ms: None,
            extended: 0,
            extension_refused: 0,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn the_failsafe_extends_only_when_every_peer_vouches_and_never_revives_an_expired_grant() {
        let t0 = Instant::now();
        let mut book = GrantBook::new("a");
        book.take(
            &Grant {
                peers: vec!["b1".into(), "b2".into()],
                ..revoked(5, "a")
            },
            t0,
            WALL,
        )
        .unwrap();
        // T - 2R = 6 s before the deadline: due at 4 s.
        assert_eq!(book.failsafe_from(t0), Some(t0 + secs(4)));
        assert_eq!(book.next_change(t0), Some(t0 + secs(4)));
        assert!(book.vouched(&[view(Some(5)), view(Some(4))]));
        assert!(
            !book.vouched(&[view(Some(5)), view(Some(6))]),
            "a peer knows a newer epoch"
        );
        assert!(!book.vouched(&[view(Some(5)), None]), "a peer did not answer");
        assert!(
            !book.vouched(&[view(Some(5)), view(None)]),
            "a peer restarted and knows no epoch"
        );
        assert!(!book.vouched(&[]), "nobody to vouch");
        let other_holder = view(Some(5)).map(|v| GrantView {
            holder: "b".into(),
            ..v
        });
        assert!(!book.vouched(&[other_holder]), "our epoch, held by another pool");
        book.extend(t0 + secs(4), t0 + secs(4));
        assert_eq!(book.standing(t0 + secs(13)), GrantStanding::Failsafe);
        assert_eq!(book.standing(t0 + secs(14)), GrantStanding::Expired);
        book.extend(t0 + secs(14), t0 + secs(14));
        assert_eq!(
            book.standing(t0 + secs(14)),
            GrantStanding::Expired,
            "never revived by the peers"
        );
        assert_eq!(book.view(t0 + secs(14)).extended, 1);
        // The grantor comes back: its grant alone decides again.
        let back = GrantTiming::default().grant("ns/p", Epoch(5), "a", WALL + secs(15));
        book.take(
            &Grant {
                prior_revoked: true,
                ..back
            },
            t0 + secs(15),
            WALL + secs(15),
        )
        .unwrap();
        assert_eq!(book.standing(t0 + secs(15)), GrantStanding::Serving);
    }
}
