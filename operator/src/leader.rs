//! Leader election for the operator itself: of several replicas, one acts, through a Lease of its
//! own (e.g. `understudy-operator`), with client-go's semantics.
//!
//! A candidate takes the Lease over only when the record it last observed has not changed for
//! `lease_duration` on its own monotonic clock ([`tokio::time::Instant`]); the timestamps written
//! in the record are for `kubectl` readers and are never read back. Taking and renewing are
//! compare-and-set on `resourceVersion`, through the same plumbing as the fencing lease in
//! [`crate::lease`]. A leader that cannot renew within `renew_deadline` stops acting, and because
//! `renew_deadline < lease_duration` it stops before anybody else may start.
//!
//! Stopping ([`LeaderElector::run_until`]) gives the Lease up as client-go's `ReleaseOnCancel`
//! does: the leader stops reporting leadership, then writes the Lease with no holder, conditioned
//! on the `resourceVersion` it read, so that the next candidate takes over at its next retry
//! instead of after `lease_duration`. A Lease somebody else holds is left alone.
//!
//! Given the controllers' [`Watchdog`] ([`LeaderElector::with_watchdog`]), a candidate claims the
//! Lease only while no controller is stalled: a leader whose controllers are stuck stops renewing,
//! stops leading at the renew deadline, and another replica takes over after the lease duration.
//! It contends again once they progress.
//!
//! What this module must never do: report leadership it did not just confirm with a successful
//! write, keep reporting it past the renew deadline (or after its task is dropped), or trust a
//! clock other than the local monotonic one. Leader election alone is not fencing: two replicas
//! may briefly both believe they lead if a clock runs fast, which is why every failover write also
//! goes through the epoch Lease and the router refuses stale epochs.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::lease::{KubeLease, LeaseError, MemoryLease, resource_version};
use crate::watchdog::{Stall, Watchdog};

/// Timing of leader election. The defaults are those of the Kubernetes core components.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaderConfig {
    /// How long a candidate waits, after the record last changed, before it takes over.
    pub lease_duration: Duration,
    /// How long a leader keeps acting without a successful renewal.
    pub renew_deadline: Duration,
    /// How often candidates try to acquire and leaders renew.
    pub retry_period: Duration,
}

impl Default for LeaderConfig {
    fn default() -> Self {
        LeaderConfig {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Why a leader-election setup was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaderConfigError {
    /// A duration was zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The field that was zero.
        field: &'static str,
    },
    /// The leader could still be acting when a candidate takes over.
    #[error(
        "lease_duration ({lease_duration:?}) must be greater than renew_deadline ({renew_deadline:?}), \
         or a candidate could take over while the old leader still acts"
    )]
    LeaseNotLongerThanRenewDeadline {
        /// The configured lease duration.
        lease_duration: Duration,
        /// The configured renew deadline.
        renew_deadline: Duration,
    },
    /// The leader would not get a second try at renewing before its deadline.
    #[error(
        "renew_deadline ({renew_deadline:?}) must be greater than 1.2 × retry_period ({retry_period:?}), \
         or one slow renewal would cost the lease"
    )]
    RenewDeadlineTooShort {
        /// The configured renew deadline.
        renew_deadline: Duration,
        /// The configured retry period.
        retry_period: Duration,
    },
    /// The candidate's identity was empty; an empty holder means "released".
    #[error("the candidate identity must not be empty")]
    EmptyIdentity,
}

impl LeaderConfig {
    /// Check client-go's rule: `lease_duration > renew_deadline > 1.2 × retry_period > 0`.
    pub fn validate(&self) -> Result<(), LeaderConfigError> {
        for (field, value) in [
            ("lease_duration", self.lease_duration),
            ("renew_deadline", self.renew_deadline),
            ("retry_period", self.retry_period),
        ] {
            if value.is_zero() {
                return Err(LeaderConfigError::Zero { field });
            }
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(LeaderConfigError::LeaseNotLongerThanRenewDeadline {
                lease_duration: self.lease_duration,
                renew_deadline: self.renew_deadline,
            });
        }
        // 5 × renew > 6 × retry is renew > 1.2 × retry without floating point.
        if self.renew_deadline.as_nanos() * 5 <= self.retry_period.as_nanos() * 6 {
            return Err(LeaderConfigError::RenewDeadlineTooShort {
                renew_deadline: self.renew_deadline,
                retry_period: self.retry_period,
            });
        }
        Ok(())
    }
}

/// What a leader Lease says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderRecord {
    /// The identity of the holder; empty when the Lease was released.
    pub holder: String,
    /// How many times the holder has changed.
    pub transitions: i32,
    /// The `resourceVersion` this record was read at. Opaque.
    pub version: String,
    /// When the current holder acquired it, kept across renewals for `kubectl` readers only.
    acquire_time: Option<MicroTime>,
}

/// A Lease that candidates contend for: read it, and claim it by compare-and-set.
///
/// Two implementations: [`KubeLease`] and [`MemoryLease`].
pub trait LeaderLock: Send + Sync {
    /// The Lease as it is now, or `None` when nobody ever took it.
    fn observe(&self) -> impl Future<Output = Result<Option<LeaderRecord>, LeaseError>> + Send;

    /// Take or renew the Lease for `holder`: create it when `expected` is `None`, otherwise write
    /// it if and only if it is still at `expected.version`. A change of holder counts a transition.
    fn claim(
        &self,
        expected: Option<&LeaderRecord>,
        holder: &str,
        lease_duration: Duration,
    ) -> impl Future<Output = Result<LeaderRecord, LeaseError>> + Send;

    /// Give the Lease up: write it with no holder if and only if it is still at
    /// `expected.version`, keeping the transition count.
    fn release(
        &self,
        expected: &LeaderRecord,
    ) -> impl Future<Output = Result<LeaderRecord, LeaseError>> + Send;
}

fn leader_record(lease: &Lease) -> Result<LeaderRecord, LeaseError> {
    let spec = lease.spec.clone().unwrap_or_default();
    Ok(LeaderRecord {
        holder: spec.holder_identity.unwrap_or_default(),
        transitions: spec.lease_transitions.unwrap_or(0),
        version: resource_version(lease)?,
        acquire_time: spec.acquire_time,
    })
}

/// Whether `holder` claiming what `expected` shows changes the holder, and the transition count
/// after the claim.
fn succession(expected: Option<&LeaderRecord>, holder: &str) -> (bool, i32) {
    match expected {
        None => (true, 0),
        Some(e) if e.holder == holder => (false, e.transitions),
        Some(e) => (true, e.transitions.saturating_add(1)),
    }
}

impl LeaderLock for KubeLease {
    async fn observe(&self) -> Result<Option<LeaderRecord>, LeaseError> {
        self.fetch().await?.as_ref().map(leader_record).transpose()
    }

    async fn claim(
        &self,
        expected: Option<&LeaderRecord>,
        holder: &str,
        lease_duration: Duration,
    ) -> Result<LeaderRecord, LeaseError> {
        if holder.is_empty() {
            return Err(LeaseError::EmptyHolder);
        }
        let now = MicroTime(Timestamp::now());
        let (new_holder, transitions) = succession(expected, holder);
        let acquire_time = match expected {
            Some(e) if !new_holder => e.acquire_time.clone().or_else(|| Some(now.clone())),
            _ => Some(now.clone()),
        };
        let lease = Lease {
            metadata: self.metadata(expected.map(|e| e.version.as_str()), BTreeMap::new()),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.to_owned()),
                // Rounded up, so a reader never believes the lease shorter than it is.
                lease_duration_seconds: Some(
                    i32::try_from(lease_duration.as_secs() + u64::from(lease_duration.subsec_nanos() > 0))
                        .unwrap_or(i32::MAX),
                ),
                acquire_time,
                renew_time: Some(now),
                lease_transitions: Some(transitions),
                ..LeaseSpec::default()
            }),
        };
        let written = match expected {
            None => self.post(&lease).await?,
            Some(_) => self.put(&lease).await?,
        };
        leader_record(&written)
    }

    async fn release(&self, expected: &LeaderRecord) -> Result<LeaderRecord, LeaseError> {
        let now = MicroTime(Timestamp::now());
        // client-go's released record: no holder, a one-second duration, the times of the release.
        let lease = Lease {
            metadata: self.metadata(Some(&expected.version), BTreeMap::new()),
            spec: Some(LeaseSpec {
                holder_identity: Some(String::new()),
                lease_duration_seconds: Some(1),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(expected.transitions),
                ..LeaseSpec::default()
            }),
        };
        leader_record(&self.put(&lease).await?)
    }
}

impl LeaderLock for MemoryLease {
    async fn observe(&self) -> Result<Option<LeaderRecord>, LeaseError> {
        let state = self.lock();
        state.reachable()?;
        Ok(state.current.as_ref().map(|r| LeaderRecord {
            holder: r.holder.clone(),
            transitions: i32::try_from(r.counter).unwrap_or(i32::MAX),
            version: r.version.to_string(),
            acquire_time: None,
        }))
    }

    async fn claim(
        &self,
        expected: Option<&LeaderRecord>,
        holder: &str,
        _lease_duration: Duration,
    ) -> Result<LeaderRecord, LeaseError> {
        if holder.is_empty() {
            return Err(LeaseError::EmptyHolder);
        }
        let mut state = self.lock();
        state.reachable()?;
        match expected {
            None if state.current.is_some() => return Err(LeaseError::LostRace),
            None => {}
            Some(e) => state.check_version(&e.version)?,
        }
        let (_, transitions) = succession(expected, holder);
        let written = state.write(holder, u64::try_from(transitions).unwrap_or(0));
        Ok(LeaderRecord {
            holder: written.holder,
            transitions,
            version: written.version.to_string(),
            acquire_time: None,
        })
    }

    async fn release(&self, expected: &LeaderRecord) -> Result<LeaderRecord, LeaseError> {
        let mut state = self.lock();
        state.reachable()?;
        state.check_version(&expected.version)?;
        let written = state.write("", u64::try_from(expected.transitions).unwrap_or(0));
        Ok(LeaderRecord {
            holder: written.holder,
            transitions: expected.transitions,
            version: written.version.to_string(),
            acquire_time: None,
        })
    }
}

/// Reports "not leader" when dropped, so an aborted election never leaves a stale `true` behind.
#[derive(Debug)]
struct Leadership(watch::Sender<bool>);

impl Leadership {
    fn set(&self, leading: bool) {
        self.0
            .send_if_modified(|current| std::mem::replace(current, leading) != leading);
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// What stopping did with the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Release {
    /// It was ours and now has no holder: the next candidate takes it at its next try.
    Released,
    /// Somebody else held it, or nobody did, so it was left as it was.
    NotHeld,
    /// It could not be released in time; it expires after `lease_duration`.
    Failed(String),
}

/// What one attempt to acquire or renew found.
#[derive(Debug)]
enum Attempt {
    /// We hold the Lease, confirmed by the write that just succeeded.
    Leading,
    /// Somebody else holds it and it has not expired on our clock.
    HeldBy(String),
}

/// One candidate in the election.
///
/// ```no_run
/// # async fn doc(api: kube::Api<k8s_openapi::api::coordination::v1::Lease>) {
/// use understudy_operator::{lease::KubeLease, leader::{LeaderConfig, LeaderElector}};
/// let elector =
///     LeaderElector::new(KubeLease::new(api, "understudy-operator"), "pod-0", LeaderConfig::default())
///         .expect("valid timing");
/// let leading = elector.is_leader(); // hand to the controller loop and to /ready
/// tokio::spawn(elector.run());
/// # }
/// ```
#[derive(Debug)]
pub struct LeaderElector<L> {
    lock: L,
    identity: String,
    config: LeaderConfig,
    leadership: Leadership,
    /// The record last seen and the local instant it was first seen at that version.
    observed: Option<(LeaderRecord, Instant)>,
    /// While it finds a controller stalled, the Lease is neither renewed nor taken.
    watchdog: Option<Watchdog>,
}

impl<L: LeaderLock> LeaderElector<L> {
    /// A candidate named `identity` (e.g. the pod name) contending for `lock`.
    pub fn new(
        lock: L,
        identity: impl Into<String>,
        config: LeaderConfig,
    ) -> Result<Self, LeaderConfigError> {
        config.validate()?;
        let identity = identity.into();
        if identity.is_empty() {
            return Err(LeaderConfigError::EmptyIdentity);
        }
        Ok(LeaderElector {
            lock,
            identity,
            config,
            leadership: Leadership(watch::channel(false).0),
            observed: None,
            watchdog: None,
        })
    }

    /// Claim the Lease only while `watchdog` finds no controller stalled.
    #[must_use]
    pub fn with_watchdog(mut self, watchdog: Watchdog) -> Self {
        self.watchdog = Some(watchdog);
        self
    }

    /// Whether this candidate leads now. `true` only between a successful acquire or renewal and
    /// the renew deadline; `false` again once the elector stops or is dropped.
    #[must_use]
    pub fn is_leader(&self) -> watch::Receiver<bool> {
        self.leadership.0.subscribe()
    }

    /// This candidate's identity.
    #[must_use]
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Contend for the Lease for as long as the returned future is polled: acquire, renew, step
    /// down when renewal fails, and contend again. Drop or abort it to stop without releasing
    /// the Lease; [`Self::run_until`] releases it.
    pub async fn run(self) {
        self.run_until(std::future::pending()).await;
    }

    /// [`Self::run`] until `stop` completes; then stop reporting leadership and, if this
    /// candidate holds the Lease, release it. The release takes at most `renew_deadline`, as
    /// client-go's does; whether it happened is returned.
    pub async fn run_until(mut self, stop: impl Future<Output = ()>) -> Release {
        tokio::select! {
            biased;
            () = stop => {}
            () = self.contend() => {}
        }
        self.leadership.set(false);
        let release = match tokio::time::timeout(self.config.renew_deadline, self.release()).await {
            Ok(release) => release,
            Err(_) => Release::Failed("still pending at the renew deadline".to_owned()),
        };
        match &release {
            Release::Released => tracing::info!(identity = %self.identity, "released the lease"),
            Release::NotHeld => tracing::info!(identity = %self.identity, "stopped; the lease was not ours"),
            Release::Failed(error) => {
                tracing::warn!(identity = %self.identity, %error, "could not release the lease; it expires on its own");
            }
        }
        release
    }

    /// Read the Lease and, if it names this candidate, write it released at the version read.
    async fn release(&self) -> Release {
        let current = match self.lock.observe().await {
            Ok(Some(current)) if current.holder == self.identity => current,
            Ok(_) => return Release::NotHeld,
            Err(error) => return Release::Failed(error.to_string()),
        };
        match self.lock.release(&current).await {
            Ok(_) => Release::Released,
            // Somebody wrote since the read: whoever it was, the Lease is not ours to clear.
            Err(LeaseError::LostRace) => Release::NotHeld,
            Err(error) => Release::Failed(error.to_string()),
        }
    }

    async fn contend(&mut self) {
        loop {
            let mut renewed_at = self.acquire().await;
            tracing::info!(identity = %self.identity, "became leader");
            self.leadership.set(true);
            loop {
                // The deadline counts from when the last successful renewal was *sent*: the
                // server wrote it later, so every candidate's expiry clock started later still.
                let deadline = renewed_at + self.config.renew_deadline;
                tokio::time::sleep_until((Instant::now() + self.config.retry_period).min(deadline)).await;
                if Instant::now() >= deadline {
                    tracing::warn!(identity = %self.identity, "could not renew within the renew deadline");
                    break;
                }
                if let Some(stall) = self.stall() {
                    // Not renewing lets the deadline pass: this leader stops, another takes over.
                    tracing::warn!(identity = %self.identity, %stall, "not renewing the lease");
                    continue;
                }
                let sent = Instant::now();
                match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
                    Ok(Ok(Attempt::Leading)) => renewed_at = sent,
                    Ok(Ok(Attempt::HeldBy(holder))) => {
                        tracing::warn!(identity = %self.identity, %holder, "the lease has another holder");
                        break;
                    }
                    // Somebody wrote between our read and our write: step down rather than
                    // assume it was harmless; if the Lease is still ours we take it back.
                    Ok(Err(LeaseError::LostRace)) => {
                        tracing::warn!(identity = %self.identity, "lost a race renewing the lease");
                        break;
                    }
                    Ok(Err(error)) => tracing::warn!(identity = %self.identity, %error, "renewal failed"),
                    Err(_) => {
                        tracing::warn!(identity = %self.identity, "renewal still pending at the renew deadline");
                        break;
                    }
                }
            }
            self.leadership.set(false);
            tracing::info!(identity = %self.identity, "stopped leading");
        }
    }

    /// Try every retry period until this candidate holds the Lease; returns when the winning
    /// write was sent.
    async fn acquire(&mut self) -> Instant {
        loop {
            if let Some(stall) = self.stall() {
                // Nor take it: a leader that stepped down for a stall must not take it straight back.
                tracing::debug!(identity = %self.identity, %stall, "not contending for the lease");
                tokio::time::sleep(self.config.retry_period).await;
                continue;
            }
            let sent = Instant::now();
            // Bounded so that one hung request cannot stall the candidate indefinitely.
            match tokio::time::timeout(self.config.renew_deadline, self.try_acquire_or_renew()).await {
                Ok(Ok(Attempt::Leading)) => return sent,
                Ok(Ok(Attempt::HeldBy(holder))) => {
                    tracing::debug!(identity = %self.identity, %holder, "lease held");
                }
                Ok(Err(error)) => tracing::debug!(identity = %self.identity, %error, "could not acquire"),
                Err(_) => tracing::debug!(identity = %self.identity, "acquire attempt timed out"),
            }
            tokio::time::sleep(self.config.retry_period).await;
        }
    }

    /// What the watchdog finds stalled, if it is given one.
    fn stall(&self) -> Option<Stall> {
        self.watchdog.as_ref().and_then(Watchdog::stall)
    }

    /// Read the Lease, then create, renew or take it over if this candidate may.
    async fn try_acquire_or_renew(&mut self) -> Result<Attempt, LeaseError> {
        let current = self.lock.observe().await?;
        let now = Instant::now();
        let Some(current) = current else {
            let created = self
                .lock
                .claim(None, &self.identity, self.config.lease_duration)
                .await?;
            self.observed = Some((created, Instant::now()));
            return Ok(Attempt::Leading);
        };
        // Expiry runs from when *we* first saw this version, never from the record's timestamps.
        let seen_at = match &self.observed {
            Some((last, at)) if last.version == current.version => *at,
            _ => now,
        };
        self.observed = Some((current.clone(), seen_at));
        let ours = current.holder == self.identity;
        let released = current.holder.is_empty();
        let expired = seen_at + self.config.lease_duration <= now;
        if !(ours || released || expired) {
            return Ok(Attempt::HeldBy(current.holder));
        }
        let written = self
            .lock
            .claim(Some(&current), &self.identity, self.config.lease_duration)
            .await?;
        self.observed = Some((written, Instant::now()));
        Ok(Attempt::Leading)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use tokio::task::JoinHandle;
    use tokio::time::sleep;

    use super::*;
    use crate::watchdog::{Reconciler, Reconciling};

    const LEASE: Duration = Duration::from_secs(15);

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn start(lock: &MemoryLease, identity: &str) -> (watch::Receiver<bool>, JoinHandle<()>) {
        let elector = LeaderElector::new(lock.clone(), identity, LeaderConfig::default()).unwrap();
        let leading = elector.is_leader();
        (leading, tokio::spawn(elector.run()))
    }

    async fn holder(lock: &MemoryLease) -> String {
        lock.observe().await.unwrap().unwrap().holder
    }

    /// Sleep until `at` after `origin`, so assertions name the instant they are about.
    async fn at(origin: Instant, offset: Duration) {
        tokio::time::sleep_until(origin + offset).await;
    }

    #[test]
    fn the_core_component_defaults_are_valid() {
        assert_eq!(LeaderConfig::default().validate(), Ok(()));
    }

    #[test]
    fn bad_timing_is_rejected_with_the_rule_it_breaks() {
        let base = LeaderConfig::default();
        let cases = [
            (
                LeaderConfig {
                    lease_duration: secs(10.0),
                    ..base
                },
                "lease_duration",
            ),
            (
                LeaderConfig {
                    renew_deadline: secs(2.4),
                    ..base
                },
                "1.2 × retry_period",
            ),
            (
                LeaderConfig {
                    retry_period: Duration::ZERO,
                    ..base
                },
                "retry_period must be greater than zero",
            ),
        ];
        for (config, says) in cases {
            let err = config.validate().unwrap_err();
            assert!(err.to_string().contains(says), "{config:?}: {err}");
        }
        // Just above the bound is fine.
        let tight = LeaderConfig {
            renew_deadline: secs(2.5),
            ..base
        };
        assert_eq!(tight.validate(), Ok(()));
        assert!(matches!(
            LeaderElector::new(
                MemoryLease::new(),
                "pod-0",
                LeaderConfig {
                    retry_period: secs(9.0),
                    ..base
                }
            ),
            Err(LeaderConfigError::RenewDeadlineTooShort { .. })
        ));
        assert!(matches!(
            LeaderElector::new(MemoryLease::new(), "", base),
            Err(LeaderConfigError::EmptyIdentity)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_candidate_does_not_take_over_while_the_leader_renews() {
        let lock = MemoryLease::new();
        let (a, _a_task) = start(&lock, "pod-a");
        sleep(secs(0.5)).await;
        assert!(*a.borrow());
        let (b, _b_task) = start(&lock, "pod-b");
        // Many lease durations, sampled often: the leader never loses the lease.
        for _ in 0..600 {
            sleep(secs(0.1)).await;
            assert!(*a.borrow() && !*b.borrow());
        }
        assert_eq!(holder(&lock).await, "pod-a");
    }

    #[tokio::test(start_paused = true)]
    async fn a_candidate_takes_over_only_after_the_record_is_unchanged_for_lease_duration() {
        let lock = MemoryLease::new();
        let origin = Instant::now();
        // A leader that wrote once and then died.
        lock.claim(None, "pod-a", LEASE).await.unwrap();
        let (b, _b_task) = start(&lock, "pod-b");
        at(origin, secs(14.9)).await;
        assert!(!*b.borrow(), "took over before the lease duration passed");
        // B tries every 2 s, so it acts at the first try at or after 15 s.
        at(origin, secs(16.1)).await;
        assert!(*b.borrow());
        let record = lock.observe().await.unwrap().unwrap();
        assert_eq!((record.holder.as_str(), record.transitions), ("pod-b", 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_seen_by_the_candidate_restarts_its_wait() {
        let lock = MemoryLease::new();
        let origin = Instant::now();
        let first = lock.claim(None, "pod-a", LEASE).await.unwrap();
        let (b, _b_task) = start(&lock, "pod-b");
        at(origin, secs(9.0)).await;
        lock.claim(Some(&first), "pod-a", LEASE).await.unwrap();
        // B sees the change at its try at 10 s, so 15 s from then, not from the start.
        at(origin, secs(24.9)).await;
        assert!(!*b.borrow(), "took over from a leader that renewed");
        at(origin, secs(26.1)).await;
        assert!(*b.borrow());
    }

    #[tokio::test(start_paused = true)]
    async fn a_candidate_takes_over_after_the_leader_stops_renewing() {
        let lock = MemoryLease::new();
        let (a, a_task) = start(&lock, "pod-a");
        sleep(secs(0.5)).await;
        let (b, _b_task) = start(&lock, "pod-b");
        sleep(secs(20.0)).await;
        assert!(*a.borrow() && !*b.borrow());
        // The leader's process stops. Its last renewal was at most one retry period ago.
        a_task.abort();
        let stopped = Instant::now();
        sleep(secs(0.01)).await;
        assert!(
            !*a.borrow(),
            "an aborted elector must not keep reporting leadership"
        );
        at(stopped, secs(12.9)).await;
        assert!(
            !*b.borrow(),
            "took over before the last renewal was lease_duration old"
        );
        at(stopped, secs(17.1)).await;
        assert!(*b.borrow());
        assert_eq!(holder(&lock).await, "pod-b");
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_cannot_renew_for_the_renew_deadline_reports_not_leader() {
        let lock = MemoryLease::new();
        let origin = Instant::now();
        let (a, _a_task) = start(&lock, "pod-a");
        // Acquired at 0, renewed at 2 and 4; the store goes away at 5.
        at(origin, secs(5.0)).await;
        lock.set_reachable(false);
        at(origin, secs(7.0)).await;
        assert!(*a.borrow(), "one failed renewal is not yet a lost lease");
        // Last renewal sent at 4 s: the deadline is 14 s, before anyone could take over at 19 s.
        at(origin, secs(13.9)).await;
        assert!(*a.borrow());
        at(origin, secs(14.001)).await;
        assert!(!*a.borrow());
        // Back in reach, the lease is still ours and is taken again.
        lock.set_reachable(true);
        at(origin, secs(16.1)).await;
        assert!(*a.borrow());
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_finds_another_holder_stops_leading_at_its_next_renewal() {
        let lock = MemoryLease::new();
        let origin = Instant::now();
        let (a, _a_task) = start(&lock, "pod-a");
        at(origin, secs(3.0)).await;
        assert!(*a.borrow());
        // Somebody takes the lease from under it (a misconfigured replica, a human).
        let seen = lock.observe().await.unwrap().unwrap();
        lock.claim(Some(&seen), "intruder", LEASE).await.unwrap();
        at(origin, secs(4.1)).await;
        assert!(!*a.borrow());
        assert_eq!(holder(&lock).await, "intruder");
    }

    /// An elector for `identity` that claims the Lease only while `watchdog` finds no stall.
    fn start_watched(
        lock: &MemoryLease,
        identity: &str,
        watchdog: &Watchdog,
    ) -> (watch::Receiver<bool>, JoinHandle<()>) {
        let elector = LeaderElector::new(lock.clone(), identity, LeaderConfig::default())
            .unwrap()
            .with_watchdog(watchdog.clone());
        let leading = elector.is_leader();
        (leading, tokio::spawn(elector.run()))
    }

    /// A reconcile that has started and, until the guard is dropped, not finished.
    fn stuck_reconcile(watchdog: &Watchdog) -> Reconciling {
        let policy = ObjectMeta {
            namespace: Some("serving".into()),
            name: Some("llama".into()),
            ..ObjectMeta::default()
        };
        watchdog.reconciling(Reconciler::FailoverPolicy, &policy)
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_controllers_stall_stops_renewing_and_a_candidate_takes_over() {
        let lock = MemoryLease::new();
        let watchdog = Watchdog::new(secs(60.0));
        let origin = Instant::now();
        let (a, _a_task) = start_watched(&lock, "pod-a", &watchdog);
        at(origin, secs(0.5)).await;
        let (b, _b_task) = start(&lock, "pod-b");
        // A's controllers get stuck at 1 s: stalled from 61 s. A renews every 2 s until then.
        at(origin, secs(1.0)).await;
        let stuck = stuck_reconcile(&watchdog);
        at(origin, secs(60.9)).await;
        assert!(*a.borrow() && !*b.borrow());
        let last_renewal = lock.observe().await.unwrap().unwrap();
        at(origin, secs(69.9)).await;
        assert_eq!(
            lock.observe().await.unwrap().unwrap(),
            last_renewal,
            "a stalled leader renewed the lease"
        );
        assert!(
            *a.borrow(),
            "it leads until the renew deadline of its last renewal"
        );
        // Renewed at 60 s: A stops at 70 s. B saw that renewal at its try at 60.5 s, so it takes
        // over at its first try after 75.5 s. A, still stalled, must not take the Lease back.
        let mut b_started = None;
        while b_started.is_none() {
            sleep(secs(0.1)).await;
            let (a_leads, b_leads) = (*a.borrow(), *b.borrow());
            let since = origin.elapsed();
            assert!(!(a_leads && since > secs(70.0)), "A leads at {since:?}");
            if b_leads {
                b_started = Some(since);
            }
        }
        let b_started = b_started.unwrap();
        assert!(
            b_started > secs(75.5) && b_started <= secs(76.6),
            "B took over at {b_started:?}"
        );
        // Once A's controllers progress it is a candidate again, and B, renewing, keeps the Lease.
        drop(stuck);
        at(origin, secs(180.0)).await;
        assert!(!*a.borrow() && *b.borrow());
        assert_eq!(holder(&lock).await, "pod-b");
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_controllers_progress_again_before_the_renew_deadline_renews_and_keeps_leading() {
        let lock = MemoryLease::new();
        let watchdog = Watchdog::new(secs(60.0));
        let origin = Instant::now();
        let (a, _a_task) = start_watched(&lock, "pod-a", &watchdog);
        at(origin, secs(0.5)).await;
        let (b, _b_task) = start(&lock, "pod-b");
        at(origin, secs(1.0)).await;
        let stuck = stuck_reconcile(&watchdog);
        // Stalled from 61 s: the renewals at 62 s and 64 s are not sent.
        at(origin, secs(61.5)).await;
        let last_renewal = lock.observe().await.unwrap().unwrap();
        at(origin, secs(64.9)).await;
        assert_eq!(lock.observe().await.unwrap().unwrap(), last_renewal);
        // The reconcile finishes at 65 s; the renewal at 66 s goes out, before the deadline at 70 s.
        drop(stuck);
        at(origin, secs(66.5)).await;
        assert_ne!(
            lock.observe().await.unwrap().unwrap(),
            last_renewal,
            "no renewal after progress"
        );
        for _ in 0..600 {
            sleep(secs(0.1)).await;
            assert!(*a.borrow() && !*b.borrow());
        }
        assert_eq!(holder(&lock).await, "pod-a");
    }

    /// An elector for `identity` that runs until the returned sender is used or dropped.
    fn start_stoppable(
        lock: &MemoryLease,
        identity: &str,
    ) -> (
        watch::Receiver<bool>,
        tokio::sync::oneshot::Sender<()>,
        JoinHandle<Release>,
    ) {
        let elector = LeaderElector::new(lock.clone(), identity, LeaderConfig::default()).unwrap();
        let leading = elector.is_leader();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(elector.run_until(async {
            let _ = stopped.await;
        }));
        (leading, stop, task)
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopped_leader_releases_the_lease_and_the_next_candidate_takes_it_at_its_next_try() {
        let lock = MemoryLease::new();
        let (a, stop_a, a_task) = start_stoppable(&lock, "pod-a");
        sleep(secs(0.5)).await;
        let (b, _b_task) = start(&lock, "pod-b");
        sleep(secs(20.0)).await;
        assert!(*a.borrow() && !*b.borrow());
        let transitions = lock.observe().await.unwrap().unwrap().transitions;
        let stopped = Instant::now();
        stop_a.send(()).unwrap();
        assert_eq!(a_task.await.unwrap(), Release::Released);
        assert!(!*a.borrow(), "a stopped elector must not report leadership");
        let released = lock.observe().await.unwrap().unwrap();
        assert_eq!(
            (released.holder.as_str(), released.transitions),
            ("", transitions)
        );
        // B tries every retry period (2 s): it need not wait out the lease duration (15 s).
        at(stopped, secs(2.1)).await;
        assert!(*b.borrow());
        assert_eq!(holder(&lock).await, "pod-b");
    }

    #[tokio::test(start_paused = true)]
    async fn stopping_leaves_a_lease_somebody_else_holds_as_it_is() {
        let lock = MemoryLease::new();
        lock.claim(None, "pod-b", LEASE).await.unwrap();
        let before = lock.observe().await.unwrap().unwrap();
        let (a, stop_a, a_task) = start_stoppable(&lock, "pod-a");
        sleep(secs(5.0)).await;
        assert!(!*a.borrow());
        drop(stop_a);
        assert_eq!(a_task.await.unwrap(), Release::NotHeld);
        assert_eq!(
            lock.observe().await.unwrap().unwrap(),
            before,
            "nothing was written"
        );
    }

    /// A lock whose API server stops answering at all once `hung` is set.
    #[derive(Clone, Debug)]
    struct Hanging {
        store: MemoryLease,
        hung: Arc<AtomicBool>,
    }

    impl Hanging {
        async fn answer(&self) {
            if self.hung.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
        }
    }

    impl LeaderLock for Hanging {
        async fn observe(&self) -> Result<Option<LeaderRecord>, LeaseError> {
            self.answer().await;
            self.store.observe().await
        }

        async fn claim(
            &self,
            expected: Option<&LeaderRecord>,
            holder: &str,
            lease_duration: Duration,
        ) -> Result<LeaderRecord, LeaseError> {
            self.answer().await;
            self.store.claim(expected, holder, lease_duration).await
        }

        async fn release(&self, expected: &LeaderRecord) -> Result<LeaderRecord, LeaseError> {
            self.answer().await;
            self.store.release(expected).await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_the_api_server_never_answers_gives_up_at_the_renew_deadline() {
        let store = MemoryLease::new();
        let hung = Arc::new(AtomicBool::new(false));
        let lock = Hanging {
            store: store.clone(),
            hung: hung.clone(),
        };
        let elector = LeaderElector::new(lock, "pod-a", LeaderConfig::default()).unwrap();
        let a = elector.is_leader();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(elector.run_until(async {
            let _ = stopped.await;
        }));
        sleep(secs(3.0)).await;
        assert!(*a.borrow());
        hung.store(true, Ordering::SeqCst);
        let asked = Instant::now();
        stop.send(()).unwrap();
        let release = task.await.unwrap();
        assert!(matches!(release, Release::Failed(_)), "{release:?}");
        assert_eq!(asked.elapsed(), LeaderConfig::default().renew_deadline);
        assert!(!*a.borrow());
        assert_eq!(holder(&store).await, "pod-a", "left to expire on its own");
    }

    /// A view of a shared store that can be cut off on its own: a network partition between one
    /// replica and the API server while the others still reach it.
    #[derive(Clone, Debug)]
    struct Partitioned {
        store: MemoryLease,
        cut: Arc<AtomicBool>,
    }

    impl Partitioned {
        fn reachable(&self) -> Result<(), LeaseError> {
            if self.cut.load(Ordering::SeqCst) {
                Err(crate::lease::Unreachable::MemoryStoreDown.into())
            } else {
                Ok(())
            }
        }
    }

    impl LeaderLock for Partitioned {
        async fn observe(&self) -> Result<Option<LeaderRecord>, LeaseError> {
            self.reachable()?;
            self.store.observe().await
        }

        async fn claim(
            &self,
            expected: Option<&LeaderRecord>,
            holder: &str,
            lease_duration: Duration,
        ) -> Result<LeaderRecord, LeaseError> {
            self.reachable()?;
            self.store.claim(expected, holder, lease_duration).await
        }

        async fn release(&self, expected: &LeaderRecord) -> Result<LeaderRecord, LeaseError> {
            self.reachable()?;
            self.store.release(expected).await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_partitioned_leader_stops_leading_before_a_connected_candidate_starts() {
        let store = MemoryLease::new();
        let cut = Arc::new(AtomicBool::new(false));
        let partitioned = Partitioned {
            store: store.clone(),
            cut: cut.clone(),
        };
        let a_elector = LeaderElector::new(partitioned, "pod-a", LeaderConfig::default()).unwrap();
        let a = a_elector.is_leader();
        let _a_task = tokio::spawn(a_elector.run());
        sleep(secs(0.3)).await;
        let (b, _b_task) = start(&store, "pod-b");
        sleep(secs(7.0)).await;
        assert!(*a.borrow() && !*b.borrow());
        cut.store(true, Ordering::SeqCst);
        let (mut a_stopped, mut b_started) = (None, None);
        for step in 0..400 {
            sleep(secs(0.05)).await;
            let (a_leads, b_leads) = (*a.borrow(), *b.borrow());
            assert!(!(a_leads && b_leads), "two leaders at once");
            if !a_leads && a_stopped.is_none() {
                a_stopped = Some(step);
            }
            if b_leads && b_started.is_none() {
                b_started = Some(step);
            }
        }
        let (a_stopped, b_started) = (a_stopped.unwrap(), b_started.unwrap());
        // Renew deadline 10 s against lease duration 15 s: at least 5 s apart, less the retry skew.
        assert!(
            b_started - a_stopped >= 60,
            "stopped at {a_stopped}, taken over at {b_started}"
        );
        assert_eq!(holder(&store).await, "pod-b");
    }

    #[tokio::test(start_paused = true)]
    async fn two_candidates_never_lead_at_once_through_store_outages() {
        let lock = MemoryLease::new();
        let (a, _a) = start(&lock, "pod-a");
        let (b, _b) = start(&lock, "pod-b");
        let mut leaders_seen = Vec::new();
        // Outages of different lengths: shorter than the renew deadline, between it and the lease
        // duration, and longer than the lease duration.
        for (up, down) in [(20.0, 5.0), (20.0, 12.0), (20.0, 40.0), (30.0, 3.0), (30.0, 0.0)] {
            for (reachable, span) in [(true, up), (false, down)] {
                lock.set_reachable(reachable);
                let steps = (span * 10.0) as u32;
                for _ in 0..steps {
                    sleep(secs(0.1)).await;
                    let (a_leads, b_leads) = (*a.borrow(), *b.borrow());
                    assert!(!(a_leads && b_leads), "two leaders at once");
                    if a_leads {
                        leaders_seen.push("pod-a");
                    }
                    if b_leads {
                        leaders_seen.push("pod-b");
                    }
                }
            }
        }
        assert!(
            !leaders_seen.is_empty(),
            "somebody must lead while the store is up"
        );
    }
}
