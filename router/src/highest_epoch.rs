//! The highest epoch this router has taken for each policy, persisted in its state file, and the
//! judgement of a route update against its policy's: anything older is refused, and so is
//! anything far above it unless forced. The highest epochs are written to the state file (write to
//! a temporary file, fsync, rename) before a route is taken, so they survive a restart. The file
//! holds a list of records, one per policy; a file from a router that served one unnamed policy
//! (one record, not a list) reads as that policy's.
//!
//! What this module must never do: take a route whose epoch is lower than the highest seen, or
//! take a different pool at the same epoch (two primaries for one epoch); let the in-memory epoch
//! run ahead of the state file; guess an epoch from a state file it cannot read.

use std::io::Write;
use std::path::{Path, PathBuf};

use understudy_api::route::HeldEpoch;
use understudy_core::Epoch;

/// What an update is, against the highest epoch seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A higher epoch (or the first route ever): take it.
    Newer,
    /// The same epoch and pool again: answer OK and change nothing... except endpoints and
    /// settings, which the operator may refresh under the same epoch.
    SameEpoch,
    /// Older than the highest seen, or the same epoch naming another pool: refused, nothing changes.
    Stale {
        /// The highest epoch seen.
        highest: Epoch,
        /// The pool taken at it.
        pool: String,
    },
    /// Further above the highest seen than the limit allows: refused, nothing changes.
    TooFar {
        /// The highest epoch seen, if any.
        highest: Option<Epoch>,
        /// How far above it an update may go.
        limit: u64,
    },
}

/// How far above the highest epoch seen (0 before any) an update may go unless it is forced.
/// Epochs grow by one per promotion, so a router that missed a thousand of them is unlikely; an
/// epoch far above is a bug or an attack, and taking it would refuse every honest route after it.
pub const DEFAULT_MAX_EPOCH_JUMP: u64 = 1000;

/// How far above the highest seen an update may go: at most this many epochs, or any number
/// when `None` (`PUT /route?force=true`).
pub type JumpLimit = Option<u64>;

/// Decides an update against the highest seen. Pure.
#[must_use]
pub fn judge(highest: Option<&HeldEpoch>, epoch: Epoch, pool: &str, limit: JumpLimit) -> Verdict {
    let base = highest.map_or(0, |h| h.epoch.0);
    match highest {
        _ if limit.is_some_and(|jump| epoch.0 > base.saturating_add(jump)) => Verdict::TooFar {
            highest: highest.map(|h| h.epoch),
            limit: limit.unwrap_or_default(),
        },
        None => Verdict::Newer,
        Some(h) if epoch > h.epoch => Verdict::Newer,
        Some(h) if epoch == h.epoch && pool == h.pool => Verdict::SameEpoch,
        Some(h) => Verdict::Stale {
            highest: h.epoch,
            pool: h.pool.clone(),
        },
    }
}

/// Why the state file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// Reading, writing, syncing or renaming failed.
    #[error("state file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The file exists and is not a fencing record: refuse to start rather than forget an epoch.
    #[error("state file {path} is not a fencing record: {source}")]
    Garbled {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: serde_json::Error,
    },
}

/// The fencing record on disk.
#[derive(Clone, Debug)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    /// The record at `path` (which may not exist yet).
    #[must_use]
    pub fn new(path: impl Into<PathBuf>) -> Self {
        StateFile { path: path.into() }
    }

    /// The records, one per policy; none when the file does not exist.
    pub fn load(&self) -> Result<Vec<HeldEpoch>, StateFileError> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum OnDisk {
            Policies(Vec<HeldEpoch>),
            One(HeldEpoch),
        }
        match std::fs::read(&self.path) {
            Ok(bytes) => match serde_json::from_slice::<OnDisk>(&bytes) {
                Ok(OnDisk::Policies(records)) => Ok(records),
                Ok(OnDisk::One(record)) => Ok(vec![record]),
                // Parsed again as a list, for the parser's own words on what is wrong.
                Err(_) => match serde_json::from_slice::<Vec<HeldEpoch>>(&bytes) {
                    Ok(records) => Ok(records),
                    Err(source) => Err(StateFileError::Garbled {
                        path: self.path.clone(),
                        source,
                    }),
                },
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(source) => Err(self.io(source)),
        }
    }

    /// Writes the records atomically: a reader sees the old ones or the new ones, never half.
    pub fn store<'a>(&self, records: impl IntoIterator<Item = &'a HeldEpoch>) -> Result<(), StateFileError> {
        let tmp = tmp_path(&self.path);
        let records: Vec<&HeldEpoch> = records.into_iter().collect();
        let bytes = serde_json::to_vec(&records).unwrap_or_default();
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)?;
            // The rename is durable once the directory that records it is.
            match self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
                Some(dir) => std::fs::File::open(dir)?.sync_all(),
                None => std::fs::File::open(".")?.sync_all(),
            }
        };
        write().map_err(|source| self.io(source))
    }

    fn io(&self, source: std::io::Error) -> StateFileError {
        StateFileError::Io {
            path: self.path.clone(),
            source,
        }
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".tmp");
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const LIMIT: JumpLimit = Some(DEFAULT_MAX_EPOCH_JUMP);

    fn seen(epoch: u64, pool: &str) -> HeldEpoch {
        HeldEpoch {
            policy: String::new(),
            epoch: Epoch(epoch),
            pool: pool.into(),
        }
    }

    #[test]
    fn the_first_route_and_any_higher_epoch_are_newer() {
        assert_eq!(judge(None, Epoch(0), "a", LIMIT), Verdict::Newer);
        assert_eq!(judge(Some(&seen(3, "a")), Epoch(4), "b", LIMIT), Verdict::Newer);
    }

    #[test]
    fn a_lower_epoch_is_stale_whatever_pool_it_names() {
        for pool in ["a", "b"] {
            assert!(matches!(
                judge(Some(&seen(3, "a")), Epoch(2), pool, LIMIT),
                Verdict::Stale { .. }
            ));
        }
    }

    #[test]
    fn the_same_epoch_is_idempotent_for_its_pool_and_stale_for_another() {
        assert_eq!(
            judge(Some(&seen(3, "a")), Epoch(3), "a", LIMIT),
            Verdict::SameEpoch
        );
        assert_eq!(
            judge(Some(&seen(3, "a")), Epoch(3), "b", LIMIT),
            Verdict::Stale {
                highest: Epoch(3),
                pool: "a".into()
            }
        );
    }

    #[test]
    fn an_epoch_far_above_the_highest_is_refused_unless_forced() {
        let at = |epoch| judge(Some(&seen(3, "a")), Epoch(epoch), "b", Some(10));
        assert_eq!(at(13), Verdict::Newer);
        assert_eq!(
            at(14),
            Verdict::TooFar {
                highest: Some(Epoch(3)),
                limit: 10
            }
        );
        // Before any route, the jump is counted from 0.
        assert!(matches!(
            judge(None, Epoch(11), "a", Some(10)),
            Verdict::TooFar { highest: None, .. }
        ));
        assert_eq!(judge(Some(&seen(3, "a")), Epoch(5000), "b", None), Verdict::Newer);
    }

    #[test]
    fn the_state_file_round_trips_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = StateFile::new(dir.path().join("fence.json"));
        assert_eq!(file.load().unwrap(), Vec::new());
        file.store([&seen(7, "b")]).unwrap();
        let other = HeldEpoch {
            policy: "ns/other".to_owned(),
            ..seen(2, "x")
        };
        file.store([&seen(8, "a"), &other]).unwrap();
        assert_eq!(file.load().unwrap(), vec![seen(8, "a"), other]);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("fence.json")]);
    }

    #[test]
    fn a_state_file_from_a_router_of_one_policy_reads_as_the_unnamed_policys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fence.json");
        std::fs::write(&path, br#"{"epoch":7,"pool":"b"}"#).unwrap();
        assert_eq!(StateFile::new(path).load().unwrap(), vec![seen(7, "b")]);
    }

    #[test]
    fn a_garbled_state_file_is_an_error_not_epoch_zero() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fence.json");
        std::fs::write(&path, b"{\"epoch\": ").unwrap();
        assert!(matches!(
            StateFile::new(path).load(),
            Err(StateFileError::Garbled { .. })
        ));
    }
}
