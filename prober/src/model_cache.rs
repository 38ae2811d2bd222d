//! The node's model cache as the GPU agent reads it for parity: `GET /models?path=PATH&depth=D`
//! answers the fingerprint ([`crate::parity::model`]) of the model directory at `PATH` on the
//! node, as a [`ModelReading`], so that the operator compares the weights each pool really
//! loads, where they lie.
//!
//! `PATH` is the directory as the node names it (the operator finds it from a replica's
//! hostPath volume); the agent reads it through its own mount of the cache and refuses any path
//! outside it. `D` is `cache` (the names and sizes the cache already has: nothing read),
//! `headers` (safetensors headers and tokenizer files: O(files) bytes) or `full` (the SHA-256 of
//! every file). A full reading of a large model takes minutes, so it runs in the background: the
//! first request answers `202` while it runs, later ones the last reading, and one a minute old
//! or more starts the next. A file whose identity changed since the last reading (written,
//! replaced, added or removed) is answered as changed, never with its old digest, and starts the
//! next reading at once. Full digests are kept by file identity ([`KnownDigests`]), in a file that
//! outlives the agent when it is given one, so that a restart or a second reading hashes only
//! what changed.
//!
//! Only regular files inside the cache are read, each no further than its size: a path, or a
//! link in the cache, that leads out of it is refused, and a linked directory is not followed.
//! This module only reads the cache: it must never write there.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::parity::Fingerprint;
use crate::parity::model::{self, Depth, DigestCost, FileIdentity, KnownDigests, ModelFiles};

/// How a file that changed since the last full digest is answered, before the time it changed.
pub const CHANGED: &str = "changed since ";

/// How old a full reading may be before a request starts the next one.
pub const FULL_REFRESH: Duration = Duration::from_secs(60);
/// The most model directories whose full readings are kept.
const MAX_FULL_READINGS: usize = 256;

/// One reading of a model directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelReading {
    /// The directory, as the node names it.
    pub path: String,
    /// `cache`, `headers` or `full`.
    pub depth: String,
    /// When the reading finished, RFC 3339.
    pub read_at: String,
    pub fingerprint: Fingerprint,
    pub cost: DigestCost,
}

/// The query of `GET /models`.
#[derive(Debug, Deserialize)]
pub struct ModelQuery {
    pub path: String,
    pub depth: String,
}

/// A full reading under way or done, for one directory.
#[derive(Debug, Default)]
struct FullReading {
    running: bool,
    last: Option<(Instant, Result<Read, String>)>,
}

/// A reading, the snapshot it read, and each file it read by name, real path and identity then.
#[derive(Clone, Debug)]
struct Read {
    reading: ModelReading,
    commit: Option<String>,
    files: Vec<(String, PathBuf, FileIdentity)>,
}

/// The node's model cache, mounted in the agent.
#[derive(Debug)]
pub struct ModelCache {
    /// Where the cache is mounted here.
    mount: PathBuf,
    /// What the node calls the same directory.
    host: PathBuf,
    /// Where the full digests taken are kept across restarts.
    digests_file: Option<PathBuf>,
    known: Mutex<KnownDigests>,
    full: Mutex<HashMap<PathBuf, FullReading>>,
    threads: usize,
    refresh: Duration,
}

impl ModelCache {
    /// The cache the node has at `host`, mounted here at `mount`; full digests are kept in
    /// `digests_file` when given (read now, if it is there and readable).
    #[must_use]
    pub fn new(mount: PathBuf, host: PathBuf, digests_file: Option<PathBuf>) -> Self {
        let known = digests_file
            .as_deref()
            .and_then(|file| std::fs::read(file).ok())
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        let threads = std::thread::available_parallelism().map_or(1, usize::from).min(4);
        ModelCache {
            mount,
            host,
            digests_file,
            known: Mutex::new(known),
            full: Mutex::new(HashMap::new()),
            threads,
            refresh: FULL_REFRESH,
        }
    }

    /// Starts the next full reading of a directory once the last is `refresh` old, rather than
    /// [`FULL_REFRESH`].
    #[must_use]
    pub fn with_refresh(mut self, refresh: Duration) -> Self {
        self.refresh = refresh;
        self
    }

    /// How many full digests are known.
    #[must_use]
    pub fn known_digests(&self) -> usize {
        self.known.lock().unwrap_or_else(PoisonError::into_inner).0.len()
    }

    /// Where the node's `path` would lie here, by its text alone: `Err` for a path that is not a
    /// plain absolute path (no `.`, `..` or empty parts) inside the cache.
    pub fn lexical(&self, path: &str) -> Result<PathBuf, String> {
        let plain = path.starts_with('/')
            && path
                .split('/')
                .skip(1)
                .all(|part| !part.is_empty() && part != "." && part != "..");
        if !plain {
            return Err(format!("{path} is not a plain absolute path"));
        }
        let inside = Path::new(path).strip_prefix(&self.host).map_err(|_| {
            format!(
                "{path} is not in this node's model cache, {}",
                self.host.display()
            )
        })?;
        Ok(self.mount.join(inside))
    }

    /// Where the node's `path` lies here, links followed: `Err` for one that is not
    /// [`Self::lexical`]ly in the cache or leads out of it.
    pub fn local(&self, path: &str) -> Result<PathBuf, String> {
        let local = self.lexical(path)?;
        let real = std::fs::canonicalize(&local).map_err(|e| format!("{path}: {e}"))?;
        self.confined(path, &real)?;
        Ok(real)
    }

    /// `Err` unless `real` (a path with its links followed) lies in the cache.
    fn confined(&self, what: &str, real: &Path) -> Result<(), String> {
        let root = std::fs::canonicalize(&self.mount)
            .map_err(|e| format!("the model cache {}: {e}", self.mount.display()))?;
        if real.starts_with(&root) {
            Ok(())
        } else {
            Err(format!(
                "{what} leads out of the model cache, to {}",
                real.display()
            ))
        }
    }

    /// The model at `local`, each of its files confined to the cache.
    fn locate(&self, path: &str, local: &Path) -> Result<ModelFiles, String> {
        let files = model::locate(local).map_err(|e| e.to_string())?;
        for (real, _) in model::identities(&files).map_err(|e| e.to_string())? {
            self.confined(path, &real)?;
        }
        Ok(files)
    }

    /// Reads `path` (here at `local`) at `depth` now.
    fn read_now(&self, path: &str, local: &Path, depth: &str) -> Result<Read, String> {
        let files = self.locate(path, local)?;
        let (depth_of, mut known) = match depth {
            "cache" => (Depth::Cache, None),
            "headers" => (Depth::Headers, None),
            _ => (
                Depth::Full {
                    threads: self.threads,
                },
                Some(self.known.lock().unwrap_or_else(PoisonError::into_inner)),
            ),
        };
        let identities = model::identities(&files).map_err(|e| e.to_string())?;
        let (fingerprint, cost) = match known.as_deref_mut() {
            Some(known) => model::fingerprint_known(&files, depth_of, known),
            None => model::fingerprint(&files, depth_of),
        }
        .map_err(|e| e.to_string())?;
        if let Some(known) = known.as_deref_mut() {
            known.prune();
            self.keep(known);
        }
        let now = jiff::Timestamp::now();
        let reading = ModelReading {
            path: path.to_owned(),
            depth: depth.to_owned(),
            read_at: jiff::Timestamp::from_second(now.as_second())
                .unwrap_or(now)
                .to_string(),
            fingerprint,
            cost,
        };
        let commit = files.commit.clone();
        let files = files
            .files
            .into_iter()
            .zip(identities)
            .map(|(file, (real, identity))| (file.name, real, identity))
            .collect();
        Ok(Read {
            reading,
            commit,
            files,
        })
    }

    /// The files of `path` that are not what `read` read: another snapshot, a name that leads to
    /// another file or to the same one changed, a file that came or went. Answered as changed,
    /// not by their old digests.
    fn changed_since(&self, path: &str, local: &Path, read: &Read) -> BTreeSet<String> {
        let all = || read.files.iter().map(|(name, _, _)| name.clone()).collect();
        let Ok(now) = self.locate(path, local) else {
            return all();
        };
        if now.commit != read.commit {
            let mut changed: BTreeSet<String> = all();
            changed.extend(now.files.iter().map(|file| file.name.clone()));
            return changed;
        }
        let then: BTreeMap<&String, (&PathBuf, &FileIdentity)> = read
            .files
            .iter()
            .map(|(name, real, identity)| (name, (real, identity)))
            .collect();
        let mut changed: BTreeSet<String> = then
            .keys()
            .filter(|name| !now.files.iter().any(|file| file.name == ***name))
            .map(|name| (*name).clone())
            .collect();
        for file in &now.files {
            let same = then.get(&file.name).is_some_and(|(real, identity)| {
                std::fs::canonicalize(&file.path).is_ok_and(|now| now == **real)
                    && FileIdentity::of(real).is_ok_and(|now| now == **identity)
            });
            if !same {
                changed.insert(file.name.clone());
            }
        }
        changed
    }

    /// Writes `known` to the digests file, whole or not at all.
    fn keep(&self, known: &KnownDigests) {
        let Some(file) = &self.digests_file else { return };
        let partial = file.with_extension("partial");
        let written = serde_json::to_vec(known)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&partial, bytes))
            .and_then(|()| std::fs::rename(&partial, file));
        if let Err(error) = written {
            eprintln!(
                "the full digests could not be kept in {}: {error}",
                file.display()
            );
        }
    }
}

/// `GET /models` on `cache`.
pub fn routes(cache: Arc<ModelCache>) -> Router {
    Router::new().route("/models", get(models)).with_state(cache)
}

fn answer(reading: Result<ModelReading, String>) -> Response {
    match reading {
        Ok(reading) => axum::Json(reading).into_response(),
        Err(why) => (StatusCode::UNPROCESSABLE_ENTITY, format!("{why}\n")).into_response(),
    }
}

/// Runs `read` and gives its answer, or says it panicked.
fn unpanicked<T>(read: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(AssertUnwindSafe(read)).unwrap_or_else(|_| Err("the reading failed".to_owned()))
}

async fn models(State(cache): State<Arc<ModelCache>>, Query(query): Query<ModelQuery>) -> Response {
    // Every reading touches the file system, which may be slow: never on the agent's one thread,
    // which also publishes the GPUs' health.
    tokio::task::spawn_blocking(move || model_answer(&cache, query))
        .await
        .unwrap_or_else(|e| answer(Err(format!("the reading failed: {e}"))))
}

fn model_answer(cache: &Arc<ModelCache>, query: ModelQuery) -> Response {
    let local = match cache.local(&query.path) {
        Ok(local) => local,
        Err(why) => return (StatusCode::NOT_FOUND, format!("{why}\n")).into_response(),
    };
    match query.depth.as_str() {
        "cache" | "headers" => {
            answer(unpanicked(|| cache.read_now(&query.path, &local, &query.depth)).map(|read| read.reading))
        }
        "full" => full(cache, query.path, local),
        other => (
            StatusCode::BAD_REQUEST,
            format!("depth {other:?} is none of cache, headers, full\n"),
        )
            .into_response(),
    }
}

/// The last full reading of `local`, with each file changed since answered as changed; starts the
/// next one when there is none under way and the last is old enough ([`FULL_REFRESH`]) or a file
/// changed; `202` while the first runs.
fn full(cache: &Arc<ModelCache>, path: String, local: PathBuf) -> Response {
    // What changed is found with no lock held: it reads the file system.
    let last = {
        let readings = cache.full.lock().unwrap_or_else(PoisonError::into_inner);
        readings.get(&local).and_then(|reading| match &reading.last {
            Some((_, Ok(read))) => Some(read.clone()),
            _ => None,
        })
    };
    let changed = last.map_or_else(BTreeSet::new, |read| cache.changed_since(&path, &local, &read));
    let mut readings = cache.full.lock().unwrap_or_else(PoisonError::into_inner);
    if !readings.contains_key(&local) && readings.len() >= MAX_FULL_READINGS {
        // The directory read longest ago, and not being read, makes room.
        let oldest = readings
            .iter()
            .filter(|(_, reading)| !reading.running)
            .min_by_key(|(_, reading)| reading.last.as_ref().map(|(at, _)| *at))
            .map(|(dir, _)| dir.clone());
        match oldest {
            Some(dir) => {
                readings.remove(&dir);
            }
            None => {
                let why = format!("{MAX_FULL_READINGS} model directories are being read in full\n");
                return (StatusCode::SERVICE_UNAVAILABLE, why).into_response();
            }
        }
    }
    let reading = readings.entry(local.clone()).or_default();
    let stale = !changed.is_empty()
        || reading
            .last
            .as_ref()
            .is_none_or(|(at, _)| at.elapsed() >= cache.refresh);
    if stale && !reading.running {
        reading.running = true;
        let cache = Arc::clone(cache);
        let (path, local) = (path.clone(), local.clone());
        tokio::task::spawn_blocking(move || {
            let result = unpanicked(|| cache.read_now(&path, &local, "full"));
            let mut readings = cache.full.lock().unwrap_or_else(PoisonError::into_inner);
            let reading = readings.entry(local).or_default();
            reading.running = false;
            reading.last = Some((Instant::now(), result));
        });
    }
    match &reading.last {
        Some((_, Ok(read))) => {
            let mut reading = read.reading.clone();
            for name in changed {
                let key = format!("model.file.{name}.sha256");
                let since = format!("{CHANGED}{}: being digested again", reading.read_at);
                reading.fingerprint.insert(key, since);
            }
            answer(Ok(reading))
        }
        Some((_, Err(why))) => answer(Err(why.clone())),
        None => (
            StatusCode::ACCEPTED,
            format!("{path}: the first full digest is being taken\n"),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn only_plain_paths_inside_the_cache_are_read() {
        let cache = ModelCache::new("/models".into(), "/var/lib/models".into(), None);
        assert_eq!(
            cache.lexical("/var/lib/models/hub/models--org--m").unwrap(),
            Path::new("/models/hub/models--org--m")
        );
        for refused in [
            "/var/lib/models/../../etc",
            "/var/lib/modelsX/m",
            "/etc/passwd",
            "var/lib/models/m",
            "/var/lib/models/./m",
            "/var/lib/models//m",
        ] {
            assert!(cache.lexical(refused).is_err(), "{refused}");
        }
    }

    #[test]
    fn a_new_snapshot_or_a_rewritten_file_is_changed_since_the_last_reading() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("models--org--m");
        let snapshot = |commit: &str, blob: &str, bytes: &[u8]| {
            let at = repo.join("snapshots").join(commit);
            std::fs::create_dir_all(&at).unwrap();
            std::fs::create_dir_all(repo.join("blobs")).unwrap();
            std::fs::write(repo.join("blobs").join(blob), bytes).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{blob}"), at.join("w.bin")).unwrap();
            std::fs::create_dir_all(repo.join("refs")).unwrap();
            std::fs::write(repo.join("refs/main"), commit).unwrap();
        };
        let (a, b) = ("a".repeat(40), "b".repeat(40));
        snapshot(&a, &"1".repeat(64), b"one");
        let cache = ModelCache::new(dir.path().into(), "/host".into(), None);
        let local = cache.local("/host/models--org--m").unwrap();
        let read = cache.read_now("/host/models--org--m", &local, "full").unwrap();
        assert!(
            cache
                .changed_since("/host/models--org--m", &local, &read)
                .is_empty()
        );
        // The same names in another snapshot: every one is changed.
        snapshot(&b, &"2".repeat(64), b"two");
        let changed = cache.changed_since("/host/models--org--m", &local, &read);
        assert_eq!(changed, BTreeSet::from(["w.bin".to_owned()]));
        // Back on the first snapshot, its blob rewritten in place: changed too.
        std::fs::write(repo.join("refs/main"), &a).unwrap();
        assert!(
            cache
                .changed_since("/host/models--org--m", &local, &read)
                .is_empty()
        );
        std::fs::write(repo.join("blobs").join("1".repeat(64)), b"ONE").unwrap();
        let changed = cache.changed_since("/host/models--org--m", &local, &read);
        assert_eq!(changed, BTreeSet::from(["w.bin".to_owned()]));
    }

    #[test]
    fn a_link_that_leads_out_of_the_cache_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (cache_dir, outside) = (dir.path().join("cache"), dir.path().join("secret"));
        std::fs::create_dir_all(cache_dir.join("m")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("key"), "not a model").unwrap();
        std::os::unix::fs::symlink(outside.join("key"), cache_dir.join("m/model.safetensors")).unwrap();
        std::os::unix::fs::symlink(&outside, cache_dir.join("away")).unwrap();
        let cache = ModelCache::new(cache_dir.clone(), "/host/models".into(), None);
        let local = cache.local("/host/models/m").unwrap();
        let why = cache.read_now("/host/models/m", &local, "headers").unwrap_err();
        assert!(why.contains("leads out of the model cache"), "{why}");
        let why = cache.local("/host/models/away").unwrap_err();
        assert!(why.contains("leads out of the model cache"), "{why}");
    }
}
