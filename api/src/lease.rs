//! The fencing lease: one `coordination.k8s.io/v1` Lease per FailoverPolicy that names the primary
//! pool and carries the fencing epoch, changed only by compare-and-set on `resourceVersion`.
//!
//! The Lease is named `<policy>-epoch` ([`epoch_lease_name`]). `spec.holderIdentity` is the
//! primary pool's name. The epoch lives in the annotation [`EPOCH_ANNOTATION`], which is
//! authoritative; `spec.leaseTransitions` mirrors it (saturating at `i32::MAX`) only so that
//! `kubectl get lease` shows something sensible. A promotion is a single write that names the new
//! holder and raises the epoch, so no reader can ever see a new primary under an old epoch.
//!
//! The Lease has no owner reference: epochs must never go back, so it outlives its policy, and a
//! policy deleted and created again carries on from the epoch its Lease holds.
//!
//! Writes are PUTs carrying `metadata.resourceVersion`, not server-side apply: apply merges, and
//! fencing needs the write to fail when anyone wrote in between. The same plumbing (holder plus
//! `resourceVersion` compare-and-set) carries the operator's own leader election
//! (`understudy_operator::leader`), which is why the raw reads and writes below are public.
//!
//! Beside [`KubeLease`], two stand-ins with the same semantics: [`MemoryLease`] for tests and
//! in-process runs, and [`FileLease`] for local runs where separate processes share one Lease.
//!
//! What this module must never do:
//! - write without the `resourceVersion` precondition (only `create` has none, and the API server
//!   refuses it when the Lease exists);
//! - lower or reuse an epoch, or guess one when the annotation is missing: that is
//!   [`LeaseError::Malformed`] and the caller stops;
//! - confuse the two failures that matter: [`LeaseError::LostRace`] means somebody else wrote first
//!   and the loser acts on nothing; [`LeaseError::Unreachable`] means nobody knows, control
//!   actions pause, and the data path is never failed over because of it. Errors are told apart by
//!   type and status code, never by message text.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use understudy_core::Epoch;

use crate::FIELD_MANAGER;

mod file;

pub use file::FileLease;

/// The annotation that holds the fencing epoch, as a decimal `u64`.
pub const EPOCH_ANNOTATION: &str = "understudy.dev/epoch";

/// How long one Lease request may take before it counts as [`Unreachable::Timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The name of the fencing Lease of the FailoverPolicy `policy_name`.
#[must_use]
pub fn epoch_lease_name(policy_name: &str) -> String {
    format!("{policy_name}-epoch")
}

/// What the fencing Lease says: who is primary, under which epoch, at which version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The primary pool's name.
    pub holder: String,
    /// The fencing epoch of that primary.
    pub epoch: Epoch,
    /// The `resourceVersion` this record was read at. Opaque: compare for equality, never order.
    pub version: String,
}

/// Why a Lease operation did not happen.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Somebody else wrote first (409 Conflict or AlreadyExists, or the Lease was deleted under a
    /// compare-and-set). The loser acts on nothing and re-reads.
    #[error("lost the race: the lease changed since it was read")]
    LostRace,
    /// The API server could not be asked, or did not answer. A write may or may not have been
    /// applied: re-read before acting on it. Control actions pause; the data path stays put.
    #[error("lease store unreachable: {0}")]
    Unreachable(#[from] Unreachable),
    /// The Lease exists but does not say what understudy needs (epoch annotation missing or
    /// garbled, no holder, no resourceVersion). Nothing is written over it.
    #[error("lease is malformed: {0}")]
    Malformed(String),
    /// A compare-and-set must raise the epoch; this one would not. Refused before any request.
    #[error("epoch {proposed} does not raise the lease's epoch {current}")]
    EpochNotRaised {
        /// The epoch the expected record carries.
        current: Epoch,
        /// The epoch that was asked for.
        proposed: Epoch,
    },
    /// A Lease must name its holder. Refused before any request.
    #[error("a lease holder must be named")]
    EmptyHolder,
    /// The API server answered and said no for a reason that retrying will not fix
    /// (401, 403, 404 on create, 422, ...): a deployment or RBAC problem.
    #[error("the API server refused the request ({code} {reason}): {message}")]
    Rejected {
        /// HTTP status code.
        code: u16,
        /// The machine-readable `reason` of the Status.
        reason: String,
        /// The human-readable message of the Status.
        message: String,
    },
    /// The client failed before a request was made (configuration, authentication plugin).
    #[error("kube client: {0}")]
    Client(#[source] kube::Error),
}

impl LeaseError {
    /// True when somebody else wrote first.
    #[must_use]
    pub fn is_lost_race(&self) -> bool {
        matches!(self, LeaseError::LostRace)
    }

    /// True when the store could not be asked: pause, do not fail over.
    #[must_use]
    pub fn is_unreachable(&self) -> bool {
        matches!(self, LeaseError::Unreachable(_))
    }
}

/// Why the lease store counts as unreachable.
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    /// No answer within the request timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The API server answered 5xx or 429: it is there but not serving.
    #[error("the API server answered {code} {reason}: {message}")]
    Status {
        /// HTTP status code.
        code: u16,
        /// The machine-readable `reason` of the Status.
        reason: String,
        /// The human-readable message.
        message: String,
    },
    /// The connection failed or the answer could not be read.
    #[error("transport: {0}")]
    Transport(#[source] kube::Error),
    /// The in-memory store was switched off with [`MemoryLease::set_reachable`].
    #[error("the in-memory lease store is switched off")]
    MemoryStoreDown,
    /// A [`FileLease`]'s file (or its lock) could not be read or written, other than by not
    /// existing.
    #[error("lease file {}: {source}", path.display())]
    File {
        /// The file that failed.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The fencing Lease of one policy: read it, create it, and move it by compare-and-set.
///
/// Three implementations: [`KubeLease`] against the API server, [`MemoryLease`] for tests and
/// in-process runs, and [`FileLease`] for processes on one machine. All have the same semantics,
/// down to which error each failure is.
pub trait EpochLease: Send + Sync {
    /// The Lease as it is now, or `None` when it does not exist.
    fn read(&self) -> impl Future<Output = Result<Option<LeaseRecord>, LeaseError>> + Send;

    /// Create the Lease naming `holder` at `epoch`. [`LeaseError::LostRace`] when it exists.
    fn create(
        &self,
        holder: &str,
        epoch: Epoch,
    ) -> impl Future<Output = Result<LeaseRecord, LeaseError>> + Send;

    /// Name `holder` at `epoch` if and only if the Lease is still at `expected.version`.
    ///
    /// `epoch` must be greater than `expected.epoch`; otherwise [`LeaseError::EpochNotRaised`]
    /// comes back and nothing is sent.
    fn compare_and_set(
        &self,
        expected: &LeaseRecord,
        holder: &str,
        epoch: Epoch,
    ) -> impl Future<Output = Result<LeaseRecord, LeaseError>> + Send;
}

/// Checks that apply to every compare-and-set, before any request.
fn check_cas(expected: &LeaseRecord, holder: &str, epoch: Epoch) -> Result<(), LeaseError> {
    if holder.is_empty() {
        return Err(LeaseError::EmptyHolder);
    }
    if epoch <= expected.epoch {
        return Err(LeaseError::EpochNotRaised {
            current: expected.epoch,
            proposed: epoch,
        });
    }
    Ok(())
}

/// `leaseTransitions` is an `int32`; the annotation is the truth, the mirror saturates.
fn transitions_mirror(epoch: Epoch) -> i32 {
    i32::try_from(epoch.0).unwrap_or(i32::MAX)
}

/// The fencing Lease in Kubernetes.
#[derive(Clone)]
pub struct KubeLease {
    api: Api<Lease>,
    name: String,
    request_timeout: Duration,
}

impl std::fmt::Debug for KubeLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeLease")
            .field("namespace", &self.api.namespace())
            .field("name", &self.name)
            .field("request_timeout", &self.request_timeout)
            .finish()
    }
}

/// Which call failed, because the same status code means different things on each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Get,
    Create,
    Replace,
}

impl KubeLease {
    /// The Lease `name` in the namespace of `api`.
    #[must_use]
    pub fn new(api: Api<Lease>, name: impl Into<String>) -> Self {
        KubeLease {
            api,
            name: name.into(),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// The fencing Lease of the FailoverPolicy `policy_name`.
    ///
    /// It carries no owner reference, so deleting the policy leaves it: routers and fence sidecars
    /// refuse anything below the highest epoch they have seen, and a policy created again under
    /// the same name must carry on from this epoch rather than start again at 0. A Lease written
    /// by an older operator with an owner reference loses it on its next compare-and-set, which
    /// replaces the whole object.
    #[must_use]
    pub fn for_policy(api: Api<Lease>, policy_name: &str) -> Self {
        KubeLease::new(api, epoch_lease_name(policy_name))
    }

    /// How long one request may take before it counts as unreachable.
    #[must_use]
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The Lease's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Metadata for a write: ours, built afresh, with the precondition when there is one.
    ///
    /// A replace carries the whole object, so anything not set here is dropped; the Lease is
    /// understudy's own and nothing else is expected to annotate it. Public for the operator's
    /// leader lock, which writes its own Lease through the same plumbing.
    pub fn metadata(&self, version: Option<&str>, annotations: BTreeMap<String, String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(self.name.clone()),
            namespace: self.api.namespace().map(str::to_owned),
            resource_version: version.map(str::to_owned),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..ObjectMeta::default()
        }
    }

    fn post_params() -> PostParams {
        PostParams {
            dry_run: false,
            field_manager: Some(FIELD_MANAGER.to_owned()),
        }
    }

    async fn bounded<T>(
        &self,
        call: Call,
        request: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, LeaseError> {
        match tokio::time::timeout(self.request_timeout, request).await {
            Ok(answer) => answer.map_err(|e| classify(e, call)),
            Err(_) => Err(Unreachable::Timeout(self.request_timeout).into()),
        }
    }

    /// GET the Lease; `None` when it does not exist. Under the request timeout, errors sorted as
    /// for the fencing record.
    pub async fn fetch(&self) -> Result<Option<Lease>, LeaseError> {
        self.bounded(Call::Get, self.api.get_opt(&self.name)).await
    }

    /// POST a new Lease, under the request timeout.
    pub async fn post(&self, lease: &Lease) -> Result<Lease, LeaseError> {
        self.bounded(Call::Create, self.api.create(&Self::post_params(), lease))
            .await
    }

    /// PUT the Lease, under the request timeout; the API server checks `metadata.resourceVersion`
    /// and answers 409 when it moved. `lease` must carry the version it was read at.
    pub async fn put(&self, lease: &Lease) -> Result<Lease, LeaseError> {
        debug_assert!(
            lease.metadata.resource_version.is_some(),
            "a replace without a precondition"
        );
        self.bounded(
            Call::Replace,
            self.api.replace(&self.name, &Self::post_params(), lease),
        )
        .await
    }

    fn epoch_lease(&self, version: Option<&str>, holder: &str, epoch: Epoch) -> Lease {
        let now = MicroTime(Timestamp::now());
        Lease {
            metadata: self.metadata(
                version,
                BTreeMap::from([(EPOCH_ANNOTATION.to_owned(), epoch.to_string())]),
            ),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.to_owned()),
                lease_transitions: Some(transitions_mirror(epoch)),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                ..LeaseSpec::default()
            }),
        }
    }
}

/// Sort a kube error into the few outcomes a caller acts on differently.
fn classify(error: kube::Error, call: Call) -> LeaseError {
    match error {
        kube::Error::Api(status) => {
            let (code, reason, message) = (status.code, status.reason, status.message);
            match code {
                // Conflict on replace, AlreadyExists on create: both mean another writer won.
                409 => LeaseError::LostRace,
                // The Lease we meant to compare against is gone: that is a write we lost too.
                404 if call == Call::Replace => LeaseError::LostRace,
                429 | 500..=599 => Unreachable::Status {
                    code,
                    reason,
                    message,
                }
                .into(),
                _ => LeaseError::Rejected {
                    code,
                    reason,
                    message,
                },
            }
        }
        // Connection failures, resets, and answers that could not be read: the outcome is unknown.
        e @ (kube::Error::HyperError(_)
        | kube::Error::Service(_)
        | kube::Error::SerdeError(_)
        | kube::Error::FromUtf8(_)
        | kube::Error::ReadEvents(_)) => Unreachable::Transport(e).into(),
        other => LeaseError::Client(other),
    }
}

/// Read understudy's fencing record out of a Lease.
pub fn epoch_record(lease: &Lease) -> Result<LeaseRecord, LeaseError> {
    let version = resource_version(lease)?;
    let raw = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(EPOCH_ANNOTATION))
        .ok_or_else(|| LeaseError::Malformed(format!("annotation {EPOCH_ANNOTATION} is missing")))?;
    let epoch: Epoch = raw.parse().map_err(|e| {
        LeaseError::Malformed(format!(
            "annotation {EPOCH_ANNOTATION}={raw:?} is not an epoch: {e}"
        ))
    })?;
    let holder = lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .filter(|h| !h.is_empty())
        .ok_or_else(|| LeaseError::Malformed("spec.holderIdentity is empty".to_owned()))?;
    Ok(LeaseRecord {
        holder,
        epoch,
        version,
    })
}

/// The `resourceVersion` of a Lease the API server handed back; without it no CAS is possible.
pub fn resource_version(lease: &Lease) -> Result<String, LeaseError> {
    lease
        .metadata
        .resource_version
        .clone()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| LeaseError::Malformed("metadata.resourceVersion is missing".to_owned()))
}

impl EpochLease for KubeLease {
    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        self.fetch().await?.as_ref().map(epoch_record).transpose()
    }

    async fn create(&self, holder: &str, epoch: Epoch) -> Result<LeaseRecord, LeaseError> {
        if holder.is_empty() {
            return Err(LeaseError::EmptyHolder);
        }
        let created = self.post(&self.epoch_lease(None, holder, epoch)).await?;
        epoch_record(&created)
    }

    async fn compare_and_set(
        &self,
        expected: &LeaseRecord,
        holder: &str,
        epoch: Epoch,
    ) -> Result<LeaseRecord, LeaseError> {
        check_cas(expected, holder, epoch)?;
        let written = self
            .put(&self.epoch_lease(Some(&expected.version), holder, epoch))
            .await?;
        epoch_record(&written)
    }
}

/// One stored record of a [`MemoryLease`].
#[derive(Clone, Debug)]
pub struct MemoryRecord {
    /// The holder's name: a pool for the fencing Lease, a candidate for a leader lock.
    pub holder: String,
    /// The fencing epoch; a leader lock keeps its transition count here.
    pub counter: u64,
    /// The version the write was stored under; shown as a string in records.
    pub version: u64,
}

/// What a [`MemoryLease`] holds, behind its lock ([`MemoryLease::lock`]).
#[derive(Debug)]
pub struct MemoryState {
    /// The stored record, or `None` when nothing was ever written.
    pub current: Option<MemoryRecord>,
    last_version: u64,
    reachable: bool,
}

impl MemoryState {
    /// Fail as the API server would when it cannot be reached.
    pub fn reachable(&self) -> Result<(), LeaseError> {
        if self.reachable {
            Ok(())
        } else {
            Err(Unreachable::MemoryStoreDown.into())
        }
    }

    /// Store `holder` and `counter` under a fresh version, as the API server does on any write.
    pub fn write(&mut self, holder: &str, counter: u64) -> MemoryRecord {
        self.last_version += 1;
        let record = MemoryRecord {
            holder: holder.to_owned(),
            counter,
            version: self.last_version,
        };
        self.current = Some(record.clone());
        record
    }

    /// The compare half of compare-and-set.
    pub fn check_version(&self, expected: &str) -> Result<(), LeaseError> {
        match &self.current {
            Some(current) if current.version.to_string() == expected => Ok(()),
            // Moved on, or deleted: either way somebody else wrote.
            _ => Err(LeaseError::LostRace),
        }
    }
}

/// An in-memory fencing Lease with the same semantics as [`KubeLease`].
///
/// Clones share one store, so two "operators" in a test contend for the same Lease. Versions
/// are a counter, shown as a string to keep them as opaque as `resourceVersion`.
#[derive(Clone, Debug)]
pub struct MemoryLease {
    state: Arc<Mutex<MemoryState>>,
}

impl Default for MemoryLease {
    fn default() -> Self {
        MemoryLease::new()
    }
}

impl MemoryLease {
    /// An empty, reachable store.
    #[must_use]
    pub fn new() -> Self {
        MemoryLease {
            state: Arc::new(Mutex::new(MemoryState {
                current: None,
                last_version: 0,
                reachable: true,
            })),
        }
    }

    /// Cut the store off (every call answers [`Unreachable::MemoryStoreDown`]) or bring it back.
    /// What it held is kept.
    pub fn set_reachable(&self, reachable: bool) {
        self.lock().reachable = reachable;
    }

    /// The store, locked. No lock is ever held across an await, so poisoning can only come from
    /// a panicking test; the state is still consistent then because every change is one assignment.
    /// Public for the operator's leader lock, which keeps its record in the same kind of store.
    pub fn lock(&self) -> MutexGuard<'_, MemoryState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn to_record(stored: &MemoryRecord) -> LeaseRecord {
        LeaseRecord {
            holder: stored.holder.clone(),
            epoch: Epoch(stored.counter),
            version: stored.version.to_string(),
        }
    }
}

impl EpochLease for MemoryLease {
    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        let state = self.lock();
        state.reachable()?;
        Ok(state.current.as_ref().map(Self::to_record))
    }

    async fn create(&self, holder: &str, epoch: Epoch) -> Result<LeaseRecord, LeaseError> {
        if holder.is_empty() {
            return Err(LeaseError::EmptyHolder);
        }
        let mut state = self.lock();
        state.reachable()?;
        if state.current.is_some() {
            return Err(LeaseError::LostRace);
        }
        Ok(Self::to_record(&state.write(holder, epoch.0)))
    }

    async fn compare_and_set(
        &self,
        expected: &LeaseRecord,
        holder: &str,
        epoch: Epoch,
    ) -> Result<LeaseRecord, LeaseError> {
        check_cas(expected, holder, epoch)?;
        let mut state = self.lock();
        state.reachable()?;
        state.check_version(&expected.version)?;
        Ok(Self::to_record(&state.write(holder, epoch.0)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    async fn lease_at(holder: &str, epoch: u64) -> (MemoryLease, LeaseRecord) {
        let lease = MemoryLease::new();
        let record = lease.create(holder, Epoch(epoch)).await.unwrap();
        (lease, record)
    }

    #[tokio::test]
    async fn reading_a_lease_that_was_never_created_gives_none() {
        assert_eq!(MemoryLease::new().read().await.unwrap(), None);
    }

    #[tokio::test]
    async fn create_on_an_existing_lease_is_a_lost_race_and_changes_nothing() {
        let (lease, first) = lease_at("pool-a", 3).await;
        let err = lease.create("pool-b", Epoch(9)).await.unwrap_err();
        assert!(err.is_lost_race(), "{err:?}");
        assert_eq!(lease.read().await.unwrap(), Some(first));
    }

    #[tokio::test]
    async fn two_contenders_from_the_same_record_exactly_one_wins_and_the_epoch_rises_once() {
        let (lease, seen) = lease_at("pool-a", 7).await;
        // Two operators sharing one store, both acting on what they read.
        let (one, two) = (lease.clone(), lease.clone());
        let (r1, r2) = tokio::join!(
            one.compare_and_set(&seen, "pool-b", seen.epoch.next()),
            two.compare_and_set(&seen, "pool-a", seen.epoch.next()),
        );
        let (won, lost) = match (r1, r2) {
            (Ok(w), Err(l)) | (Err(l), Ok(w)) => (w, l),
            other => panic!("exactly one contender must win: {other:?}"),
        };
        assert!(lost.is_lost_race(), "{lost:?}");
        assert_eq!(won.epoch, Epoch(8));
        assert_eq!(lease.read().await.unwrap(), Some(won));
    }

    #[tokio::test]
    async fn a_stale_record_loses_even_when_it_asks_for_a_higher_epoch() {
        let (lease, stale) = lease_at("pool-a", 1).await;
        let fresh = lease.compare_and_set(&stale, "pool-b", Epoch(2)).await.unwrap();
        let err = lease
            .compare_and_set(&stale, "pool-a", Epoch(5))
            .await
            .unwrap_err();
        assert!(err.is_lost_race(), "{err:?}");
        assert_eq!(lease.read().await.unwrap(), Some(fresh));
    }

    #[tokio::test]
    async fn compare_and_set_refuses_an_epoch_that_does_not_rise() {
        let (lease, seen) = lease_at("pool-a", 4).await;
        for proposed in [Epoch(4), Epoch(3), Epoch(0)] {
            let err = lease
                .compare_and_set(&seen, "pool-b", proposed)
                .await
                .unwrap_err();
            assert!(
                matches!(err, LeaseError::EpochNotRaised { current: Epoch(4), proposed: p } if p == proposed),
                "{err:?}"
            );
        }
        // Nothing was written: the version is the one we read.
        assert_eq!(lease.read().await.unwrap(), Some(seen));
    }

    #[tokio::test]
    async fn a_lease_must_name_a_holder() {
        let lease = MemoryLease::new();
        assert!(matches!(
            lease.create("", Epoch(0)).await,
            Err(LeaseError::EmptyHolder)
        ));
        let seen = lease.create("pool-a", Epoch(0)).await.unwrap();
        assert!(matches!(
            lease.compare_and_set(&seen, "", Epoch(1)).await,
            Err(LeaseError::EmptyHolder)
        ));
    }

    #[tokio::test]
    async fn an_unreachable_store_is_reported_as_unreachable_not_as_a_lost_race() {
        let (lease, seen) = lease_at("pool-a", 2).await;
        lease.set_reachable(false);
        let errors = [
            lease.read().await.unwrap_err(),
            lease.create("pool-b", Epoch(0)).await.unwrap_err(),
            lease
                .compare_and_set(&seen, "pool-b", Epoch(3))
                .await
                .unwrap_err(),
        ];
        for err in errors {
            assert!(
                matches!(err, LeaseError::Unreachable(Unreachable::MemoryStoreDown)),
                "{err:?}"
            );
        }
        lease.set_reachable(true);
        assert_eq!(
            lease.read().await.unwrap(),
            Some(seen),
            "nothing changed while unreachable"
        );
    }

    #[test]
    fn the_epoch_mirror_saturates_instead_of_wrapping() {
        assert_eq!(transitions_mirror(Epoch(12)), 12);
        assert_eq!(transitions_mirror(Epoch(u64::from(u32::MAX))), i32::MAX);
    }

    #[test]
    fn a_lease_with_a_garbled_or_missing_epoch_is_malformed() {
        let mut lease = Lease {
            metadata: ObjectMeta {
                resource_version: Some("5".into()),
                annotations: Some(BTreeMap::from([(EPOCH_ANNOTATION.into(), "-1".into())])),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some("pool-a".into()),
                ..LeaseSpec::default()
            }),
        };
        assert!(matches!(epoch_record(&lease), Err(LeaseError::Malformed(_))));
        lease.metadata.annotations = None;
        assert!(matches!(epoch_record(&lease), Err(LeaseError::Malformed(_))));
        lease.metadata.annotations = Some(BTreeMap::from([(EPOCH_ANNOTATION.into(), "6".into())]));
        assert_eq!(
            epoch_record(&lease).unwrap(),
            LeaseRecord {
                holder: "pool-a".into(),
                epoch: Epoch(6),
                version: "5".into()
            }
        );
    }
}
