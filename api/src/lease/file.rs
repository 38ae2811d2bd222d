//! The fencing Lease in one small JSON file, so that separate local processes (the game day's
//! fences, its operator) share one Lease without a cluster.
//!
//! The file holds `{"holder", "epoch", "version"}`. Every write goes to a temporary file in the
//! same directory and is renamed (or, for `create`, hard-linked) into place, so a reader sees the
//! old record or the new one, never half of one. A compare-and-set re-reads and writes under an
//! exclusive lock on the sibling `<file>.lock`, so two writers that read the same version cannot
//! both win. `version` is a decimal counter, opaque to callers like `resourceVersion`.
//!
//! What this module must never do: write over the file without the lock (only `create` does,
//! and it refuses when the file exists), or read a garbled file as a record: that is
//! [`LeaseError::Malformed`], and nothing is written over it.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};
use understudy_core::Epoch;

use super::{EpochLease, LeaseError, LeaseRecord, Unreachable, check_cas};

/// The fencing Lease stored in a file. Values on the same path, in one process or several,
/// contend for the same Lease.
#[derive(Clone, Debug)]
pub struct FileLease {
    path: PathBuf,
}

/// The file's contents.
#[derive(Serialize, Deserialize)]
struct Stored {
    holder: String,
    epoch: Epoch,
    version: String,
}

impl FileLease {
    /// The Lease kept at `path`. Nothing is touched until the first call.
    #[must_use]
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileLease { path: path.into() }
    }

    /// The lease file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs blocking file work off the runtime's workers.
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Path) -> Result<T, LeaseError> + Send + 'static,
    ) -> Result<T, LeaseError> {
        let path = self.path.clone();
        match tokio::task::spawn_blocking(move || work(&path)).await {
            Ok(answer) => answer,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Only when the runtime shuts down: whether the write happened is unknown.
            Err(_) => Err(unreachable(
                &self.path,
                std::io::Error::new(ErrorKind::Interrupted, "the runtime shut down"),
            )),
        }
    }
}

fn unreachable(path: &Path, source: std::io::Error) -> LeaseError {
    Unreachable::File {
        path: path.to_owned(),
        source,
    }
    .into()
}

/// The record in the file, `None` when there is no file.
fn read_record(path: &Path) -> Result<Option<LeaseRecord>, LeaseError> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unreachable(path, e)),
    };
    let stored: Stored = serde_json::from_slice(&text)
        .map_err(|e| LeaseError::Malformed(format!("{}: {e}", path.display())))?;
    if stored.holder.is_empty() {
        return Err(LeaseError::Malformed(format!(
            "{}: the holder is empty",
            path.display()
        )));
    }
    if stored.version.is_empty() {
        return Err(LeaseError::Malformed(format!(
            "{}: the version is empty",
            path.display()
        )));
    }
    Ok(Some(LeaseRecord {
        holder: stored.holder,
        epoch: stored.epoch,
        version: stored.version,
    }))
}

/// The directory temporary and lock files go in: the lease file's own, so a rename stays on one
/// filesystem and is atomic.
fn directory(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    directory(path).join(format!(".{name}{suffix}"))
}

/// Writes `record` to a fresh temporary file beside `path` and returns the temporary's path.
fn write_temporary(path: &Path, record: &LeaseRecord) -> Result<PathBuf, LeaseError> {
    // Unique within this process by the counter, across processes by the pid.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let temporary = sibling(
        path,
        &format!(".{}.{}.tmp", std::process::id(), NEXT.fetch_add(1, Relaxed)),
    );
    let stored = Stored {
        holder: record.holder.clone(),
        epoch: record.epoch,
        version: record.version.clone(),
    };
    let text = serde_json::to_vec(&stored)
        .map_err(|e| LeaseError::Malformed(format!("the record could not be written: {e}")))?;
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temporary)
        .and_then(|mut file| {
            file.write_all(&text)?;
            file.sync_all()
        });
    match written {
        Ok(()) => Ok(temporary),
        Err(e) => {
            let _ = std::fs::remove_file(&temporary);
            Err(unreachable(path, e))
        }
    }
}

/// The sibling lock file, locked exclusively. Closing it (dropping the value) unlocks it.
fn lock(path: &Path) -> Result<File, LeaseError> {
    let lock_path = sibling(path, ".lock");
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| unreachable(&lock_path, e))?;
    file.lock().map_err(|e| unreachable(&lock_path, e))?;
    Ok(file)
}

fn create(path: &Path, holder: &str, epoch: Epoch) -> Result<LeaseRecord, LeaseError> {
    let record = LeaseRecord {
        holder: holder.to_owned(),
        epoch,
        version: "1".to_owned(),
    };
    let temporary = write_temporary(path, &record)?;
    // A hard link, unlike a rename, refuses to replace an existing file, and is just as atomic.
    let linked = std::fs::hard_link(&temporary, path);
    let _ = std::fs::remove_file(&temporary);
    match linked {
        Ok(()) => Ok(record),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Err(LeaseError::LostRace),
        Err(e) => Err(unreachable(path, e)),
    }
}

fn compare_and_set(
    path: &Path,
    expected: &LeaseRecord,
    holder: &str,
    epoch: Epoch,
) -> Result<LeaseRecord, LeaseError> {
    let _locked = lock(path)?;
    // Moved on, or deleted: either way somebody else wrote.
    let current = read_record(path)?
        .filter(|current| current.version == expected.version)
        .ok_or(LeaseError::LostRace)?;
    let version = current
        .version
        .parse::<u64>()
        .ok()
        .and_then(|v| v.checked_add(1))
        .ok_or_else(|| {
            LeaseError::Malformed(format!(
                "{}: version {:?} is not a counter that can go up",
                path.display(),
                current.version
            ))
        })?;
    let record = LeaseRecord {
        holder: holder.to_owned(),
        epoch,
        version: version.to_string(),
    };
    let temporary = write_temporary(path, &record)?;
    if let Err(e) = std::fs::rename(&temporary, path) {
        let _ = std::fs::remove_file(&temporary);
        return Err(unreachable(path, e));
    }
    Ok(record)
}

impl EpochLease for FileLease {
    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        self.blocking(read_record).await
    }

    async fn create(&self, holder: &str, epoch: Epoch) -> Result<LeaseRecord, LeaseError> {
        if holder.is_empty() {
            return Err(LeaseError::EmptyHolder);
        }
        let holder = holder.to_owned();
        self.blocking(move |path| create(path, &holder, epoch)).await
    }

    async fn compare_and_set(
        &self,
        expected: &LeaseRecord,
        holder: &str,
        epoch: Epoch,
    ) -> Result<LeaseRecord, LeaseError> {
        check_cas(expected, holder, epoch)?;
        let (expected, holder) = (expected.clone(), holder.to_owned());
        self.blocking(move |path| compare_and_set(path, &expected, &holder, epoch))
            .await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn lease_in(dir: &tempfile::TempDir) -> FileLease {
        FileLease::new(dir.path().join("epoch.json"))
    }

    #[tokio::test]
    async fn a_missing_file_reads_as_no_lease() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(lease_in(&dir).read().await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_created_lease_reads_back_from_another_value_on_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let created = lease_in(&dir).create("pool-a", Epoch(3)).await.unwrap();
        assert_eq!((created.holder.as_str(), created.epoch), ("pool-a", Epoch(3)));
        assert_eq!(lease_in(&dir).read().await.unwrap(), Some(created));
    }

    #[tokio::test]
    async fn create_on_an_existing_file_is_a_lost_race_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let lease = lease_in(&dir);
        let first = lease.create("pool-a", Epoch(3)).await.unwrap();
        let err = lease.create("pool-b", Epoch(9)).await.unwrap_err();
        assert!(err.is_lost_race(), "{err:?}");
        assert_eq!(lease.read().await.unwrap(), Some(first));
    }

    #[tokio::test]
    async fn a_stale_record_loses_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let lease = lease_in(&dir);
        let stale = lease.create("pool-a", Epoch(1)).await.unwrap();
        let fresh = lease.compare_and_set(&stale, "pool-b", Epoch(2)).await.unwrap();
        assert_ne!(fresh.version, stale.version);
        let err = lease
            .compare_and_set(&stale, "pool-a", Epoch(5))
            .await
            .unwrap_err();
        assert!(err.is_lost_race(), "{err:?}");
        assert_eq!(lease.read().await.unwrap(), Some(fresh));
    }

    #[tokio::test]
    async fn two_writers_on_one_file_from_the_same_record_exactly_one_wins() {
        let dir = tempfile::tempdir().unwrap();
        let seen = lease_in(&dir).create("pool-a", Epoch(7)).await.unwrap();
        for round in 0..20 {
            let seen = lease_in(&dir).read().await.unwrap().unwrap();
            let (one, two) = (lease_in(&dir), lease_in(&dir));
            let (r1, r2) = tokio::join!(
                one.compare_and_set(&seen, "pool-b", seen.epoch.next()),
                two.compare_and_set(&seen, "pool-a", seen.epoch.next()),
            );
            let (won, lost) = match (r1, r2) {
                (Ok(w), Err(l)) | (Err(l), Ok(w)) => (w, l),
                other => panic!("round {round}: exactly one writer must win: {other:?}"),
            };
            assert!(lost.is_lost_race(), "{lost:?}");
            assert_eq!(won.epoch, seen.epoch.next());
            assert_eq!(lease_in(&dir).read().await.unwrap(), Some(won));
        }
        assert_eq!(
            lease_in(&dir).read().await.unwrap().unwrap().epoch,
            Epoch(seen.epoch.0 + 20)
        );
    }

    #[tokio::test]
    async fn compare_and_set_refuses_an_epoch_that_does_not_rise_and_a_missing_holder() {
        let dir = tempfile::tempdir().unwrap();
        let lease = lease_in(&dir);
        let seen = lease.create("pool-a", Epoch(4)).await.unwrap();
        let err = lease
            .compare_and_set(&seen, "pool-b", Epoch(4))
            .await
            .unwrap_err();
        assert!(matches!(err, LeaseError::EpochNotRaised { .. }), "{err:?}");
        let err = lease.compare_and_set(&seen, "", Epoch(5)).await.unwrap_err();
        assert!(matches!(err, LeaseError::EmptyHolder), "{err:?}");
        assert!(matches!(
            lease.create("", Epoch(0)).await,
            Err(LeaseError::EmptyHolder)
        ));
        assert_eq!(lease.read().await.unwrap(), Some(seen));
    }

    #[tokio::test]
    async fn a_garbled_file_is_malformed_and_is_not_written_over() {
        let dir = tempfile::tempdir().unwrap();
        let lease = lease_in(&dir);
        let seen = lease.create("pool-a", Epoch(1)).await.unwrap();
        for garbled in [
            "",
            "{\"holder\":\"pool-a\"",
            "{\"holder\":\"\",\"epoch\":1,\"version\":\"1\"}",
        ] {
            std::fs::write(lease.path(), garbled).unwrap();
            let err = lease.read().await.unwrap_err();
            assert!(matches!(err, LeaseError::Malformed(_)), "{garbled:?}: {err:?}");
            let err = lease
                .compare_and_set(&seen, "pool-b", Epoch(2))
                .await
                .unwrap_err();
            assert!(matches!(err, LeaseError::Malformed(_)), "{garbled:?}: {err:?}");
            assert_eq!(std::fs::read_to_string(lease.path()).unwrap(), garbled);
        }
    }

    #[tokio::test]
    async fn a_compare_and_set_on_a_deleted_file_is_a_lost_race() {
        let dir = tempfile::tempdir().unwrap();
        let lease = lease_in(&dir);
        let seen = lease.create("pool-a", Epoch(1)).await.unwrap();
        std::fs::remove_file(lease.path()).unwrap();
        let err = lease
            .compare_and_set(&seen, "pool-b", Epoch(2))
            .await
            .unwrap_err();
        assert!(err.is_lost_race(), "{err:?}");
        assert_eq!(lease.read().await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_file_that_cannot_be_read_is_unreachable_not_missing() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the file should be: it exists, and reading it fails.
        let lease = lease_in(&dir);
        std::fs::create_dir(lease.path()).unwrap();
        let err = lease.read().await.unwrap_err();
        assert!(
            matches!(err, LeaseError::Unreachable(Unreachable::File { .. })),
            "{err:?}"
        );
    }
}
