//! A model directory's fingerprint: what the Hugging Face cache already proves, a cheap digest
//! over safetensors headers and sizes, and (when asked) a full streamed SHA-256 of every file,
//! remembered by file identity ([`KnownDigests`]) so that a file is hashed again only once it
//! changed.
//!
//! The cache proves a lot for free: `refs/main` names the snapshot commit, and a snapshot's
//! symlinks point at `blobs/<sha256>` for LFS files (the weights), so their content digests are
//! file names. The cheap digest reads only the 8-byte length and JSON header of each safetensors
//! file: O(files), never the weights. The full digest reads everything, files in parallel, with
//! one large buffer per thread. This module reads files and nothing else; it must never write,
//! and the cheap path must never read weight bytes.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::Fingerprint;

/// The largest safetensors header accepted (the format's own limit is 100 MB).
pub const MAX_SAFETENSORS_HEADER: u64 = 100 * 1024 * 1024;
/// Read size of the full digest: large enough that syscalls do not show.
const FULL_DIGEST_BUFFER: usize = 1 << 20;

/// Files whose every byte always counts toward parity: small, and they change answers.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
];

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: not a safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Layout { path: PathBuf, reason: String },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// What a cache's blob name says about a file's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlobName {
    /// A Git LFS file: the blob is named by the SHA-256 of its content.
    LfsSha256(String),
    /// A Git-tracked file: the blob is named by its git SHA-1.
    GitSha1(String),
}

/// One file of a model snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFile {
    /// The path inside the snapshot, with `/` separators.
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    pub blob: Option<BlobName>,
}

/// A located model: a Hugging Face cache snapshot or a plain directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFiles {
    pub snapshot: PathBuf,
    /// The snapshot commit, when the directory is in a Hugging Face cache.
    pub commit: Option<String>,
    /// Sorted by name.
    pub files: Vec<ModelFile>,
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Finds the snapshot of `path`: a `models--org--repo` cache folder (resolved through
/// `refs/main`), one of its `snapshots/<commit>` folders, or any plain model directory.
pub fn locate(path: &Path) -> Result<ModelFiles, Error> {
    let refs_main = path.join("refs").join("main");
    let (snapshot, commit) = if refs_main.is_file() {
        let mut commit = String::new();
        File::open(&refs_main)
            .and_then(|file| file.take(256).read_to_string(&mut commit))
            .map_err(io_error(&refs_main))?;
        let commit = commit.trim().to_owned();
        if !is_hex(&commit, 40) {
            return Err(Error::Layout {
                path: refs_main,
                reason: format!("refs/main holds {commit:?}, not a 40-hex commit"),
            });
        }
        (path.join("snapshots").join(&commit), Some(commit))
    } else {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let in_snapshots = path
            .parent()
            .and_then(|p| p.file_name())
            .is_some_and(|n| n == "snapshots");
        let commit = (in_snapshots && is_hex(name, 40)).then(|| name.to_owned());
        (path.to_owned(), commit)
    };
    let mut files = Vec::new();
    walk(&snapshot, &snapshot, &mut files)?;
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(ModelFiles {
        snapshot,
        commit,
        files,
    })
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<ModelFile>) -> Result<(), Error> {
    for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let path = entry.path();
        let link = std::fs::symlink_metadata(&path).map_err(io_error(&path))?;
        let meta = std::fs::metadata(&path).map_err(io_error(&path))?;
        let layout = |reason: &str| Error::Layout {
            path: path.clone(),
            reason: reason.to_owned(),
        };
        if meta.is_dir() {
            // A linked directory may lead anywhere, back up the tree too: not followed.
            if link.file_type().is_symlink() {
                return Err(layout("a link to a directory, which is not followed"));
            }
            walk(root, &path, out)?;
            continue;
        }
        if !meta.is_file() {
            return Err(layout("neither a file nor a directory"));
        }
        let blob = if link.file_type().is_symlink() {
            let target = std::fs::read_link(&path).map_err(io_error(&path))?;
            let name = target
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("")
                .to_owned();
            if is_hex(&name, 64) {
                Some(BlobName::LfsSha256(name.to_ascii_lowercase()))
            } else if is_hex(&name, 40) {
                Some(BlobName::GitSha1(name.to_ascii_lowercase()))
            } else {
                None
            }
        } else {
            None
        };
        let name = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .components()
            .map(|c| c.as_os_str().to_string_lossy())
            .collect::<Vec<_>>()
            .join("/");
        out.push(ModelFile {
            name,
            path,
            size: meta.len(),
            blob,
        });
    }
    Ok(())
}

/// A reader that counts what it reads, so the cost of a digest is measured, not assumed.
#[derive(Debug)]
pub struct CountingReader<'a, R> {
    inner: R,
    count: &'a AtomicU64,
}

impl<'a, R: Read> CountingReader<'a, R> {
    pub fn new(inner: R, count: &'a AtomicU64) -> Self {
        CountingReader { inner, count }
    }
}

impl<R: Read> Read for CountingReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Reads a safetensors file's `u64` little-endian header length and JSON header, nothing more.
pub fn read_safetensors_header(file: &ModelFile, count: &AtomicU64) -> Result<Vec<u8>, Error> {
    let bad = |reason: String| Error::Safetensors {
        path: file.path.clone(),
        reason,
    };
    let mut reader = CountingReader::new(File::open(&file.path).map_err(io_error(&file.path))?, count);
    let mut len = [0u8; 8];
    reader
        .read_exact(&mut len)
        .map_err(|_| bad("shorter than the 8-byte header length".into()))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_SAFETENSORS_HEADER || n > file.size.saturating_sub(8) {
        return Err(bad(format!(
            "header length {n} does not fit a {} byte file",
            file.size
        )));
    }
    let mut header = vec![0u8; n as usize];
    reader.read_exact(&mut header).map_err(io_error(&file.path))?;
    if header.first() != Some(&b'{') {
        return Err(bad("the header does not start with `{`".into()));
    }
    let mut framed = len.to_vec();
    framed.extend_from_slice(&header);
    Ok(framed)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 over every safetensors header and every file's name and size, in name order.
/// Catches architecture, dtype, quantization and shard-layout changes; not changed weight values.
pub fn cheap_digest(model: &ModelFiles, count: &AtomicU64) -> Result<String, Error> {
    let mut hasher = Sha256::new();
    for file in &model.files {
        hasher.update(file.name.as_bytes());
        hasher.update([0]);
        hasher.update(file.size.to_le_bytes());
        if file.name.ends_with(".safetensors") {
            hasher.update(read_safetensors_header(file, count)?);
        }
    }
    Ok(hex(&hasher.finalize()))
}

/// Streams one file of `size` bytes (no more is read) through SHA-256 with the caller's buffer.
pub fn sha256_file(path: &Path, size: u64, buf: &mut [u8], count: &AtomicU64) -> Result<String, Error> {
    let file = File::open(path).map_err(io_error(path))?.take(size);
    let mut reader = CountingReader::new(file, count);
    let mut hasher = Sha256::new();
    loop {
        let n = reader.read(buf).map_err(io_error(path))?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

/// The full SHA-256 of each path (in input order), files spread over `threads` threads,
/// largest first so one big shard does not finish last alone.
pub fn full_digests(
    paths: &[(PathBuf, u64)],
    threads: usize,
    count: &AtomicU64,
) -> Result<Vec<String>, Error> {
    let mut order: Vec<usize> = (0..paths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(paths[i].1));
    let next = AtomicUsize::new(0);
    let threads = threads.clamp(1, paths.len().max(1));
    let results: Vec<Result<Vec<(usize, String)>, Error>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut buf = vec![0u8; FULL_DIGEST_BUFFER];
                    let mut done = Vec::new();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = order.get(k) else { return Ok(done) };
                        done.push((i, sha256_file(&paths[i].0, paths[i].1, &mut buf, count)?));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|_| Ok(Vec::new())))
            .collect()
    });
    let mut digests = vec![String::new(); paths.len()];
    for result in results {
        for (i, digest) in result? {
            digests[i] = digest;
        }
    }
    if let Some(i) = digests.iter().position(String::is_empty) {
        return Err(Error::Layout {
            path: paths[i].0.clone(),
            reason: "a digest worker panicked".into(),
        });
    }
    Ok(digests)
}

/// How deep a model fingerprint reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// What the cache's names and the files' sizes say: the snapshot commit, each LFS file's
    /// SHA-256 and each Git file's SHA-1 as its blob is named. No file is read.
    Cache,
    /// All of that, plus the safetensors headers and the tokenizer files: O(files) bytes.
    Headers,
    /// All of that plus the SHA-256 of every file, on this many threads.
    Full { threads: usize },
}

/// What a fingerprint cost to take.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DigestCost {
    pub bytes_read: u64,
    /// Files whose full digest was taken this time.
    pub files_hashed: u64,
    /// Files whose full digest was known from an earlier reading of the same file.
    pub files_known: u64,
}

/// What makes a file the one whose digest was taken: its device, inode, size and modification
/// and change times. Writing to it, or renaming another file over it, changes one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileIdentity {
    /// The identity of the file at `path`, following symbolic links.
    pub fn of(path: &Path) -> Result<Self, Error> {
        let meta = std::fs::metadata(path).map_err(io_error(path))?;
        let ns = |secs: i64, nanos: i64| i128::from(secs) * 1_000_000_000 + i128::from(nanos);
        Ok(FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// One full digest taken, and of which file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Known {
    pub identity: FileIdentity,
    pub sha256: String,
}

/// Full digests already taken, by the file's real path (a cache's blob, which snapshots share):
/// a file whose identity is unchanged is not read again. Kept by whoever takes digests over time
/// (the node agent, across restarts in a file of its own).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KnownDigests(pub BTreeMap<PathBuf, Known>);

impl KnownDigests {
    /// Drops what is known of files that are gone or changed.
    pub fn prune(&mut self) {
        self.0
            .retain(|path, known| FileIdentity::of(path).is_ok_and(|now| now == known.identity));
    }
}

/// The chat template's digest: `chat_template` in `tokenizer_config.json`, else the
/// `chat_template.jinja` file.
fn chat_template(model: &ModelFiles, count: &AtomicU64) -> Result<Option<String>, Error> {
    if let Some(cfg) = model.files.iter().find(|f| f.name == "tokenizer_config.json") {
        let mut text = String::new();
        CountingReader::new(File::open(&cfg.path).map_err(io_error(&cfg.path))?, count)
            .read_to_string(&mut text)
            .map_err(io_error(&cfg.path))?;
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(&text)
            && let Some(template) = value.get("chat_template").filter(|t| !t.is_null())
        {
            return Ok(Some(hex(&Sha256::digest(template.to_string().as_bytes()))));
        }
    }
    match model.files.iter().find(|f| f.name == "chat_template.jinja") {
        Some(f) => {
            let mut buf = vec![0u8; 64 * 1024];
            Ok(Some(sha256_file(&f.path, f.size, &mut buf, count)?))
        }
        None => Ok(None),
    }
}

/// Each of `model`'s files by its real path (links followed, as to a cache's blob) and its
/// identity now, in the model's order.
pub fn identities(model: &ModelFiles) -> Result<Vec<(PathBuf, FileIdentity)>, Error> {
    model
        .files
        .iter()
        .map(|file| {
            let path = std::fs::canonicalize(&file.path).map_err(io_error(&file.path))?;
            let identity = FileIdentity::of(&path)?;
            Ok((path, identity))
        })
        .collect()
}

/// The bytes of a model's weight files, from the sizes its fingerprint records: what a level-1
/// sleep parks in host memory. Its `.safetensors` files when it has any (vLLM loads those, and a
/// repository that also ships `.bin` or `original/*.pth` copies would count twice; Mistral's
/// `consolidated.safetensors` beside sharded ones is such a copy), else its `.bin`, `.pt`, `.pth`
/// and `.gguf` files.
#[must_use]
pub fn weight_bytes(fingerprint: &Fingerprint) -> u64 {
    let files: Vec<(&str, u64)> = fingerprint
        .0
        .iter()
        .filter_map(|(key, value)| {
            let name = key.strip_prefix("model.file.")?.strip_suffix(".size")?;
            Some((name, value.parse::<u64>().ok()?))
        })
        .collect();
    let sizes = |weights: &dyn Fn(&str) -> bool| -> u64 {
        files
            .iter()
            .filter(|(name, _)| weights(name))
            .map(|(_, size)| size)
            .sum()
    };
    let sharded = |name: &str| name.ends_with(".safetensors") && !name.ends_with("consolidated.safetensors");
    match (sizes(&sharded), sizes(&|name| name.ends_with(".safetensors"))) {
        (0, 0) => sizes(&|name| {
            [".bin", ".pt", ".pth", ".gguf"]
                .iter()
                .any(|ext| name.ends_with(ext))
        }),
        (0, consolidated) => consolidated,
        (sharded, _) => sharded,
    }
}

/// The model's fingerprint at `depth`, and what it cost.
pub fn fingerprint(model: &ModelFiles, depth: Depth) -> Result<(Fingerprint, DigestCost), Error> {
    fingerprint_known(model, depth, &mut KnownDigests::default())
}

/// [`fingerprint`], hashing in full only the files `known` has no digest of for their identity
/// now, and adding the digests it takes to `known`.
pub fn fingerprint_known(
    model: &ModelFiles,
    depth: Depth,
    known: &mut KnownDigests,
) -> Result<(Fingerprint, DigestCost), Error> {
    let count = AtomicU64::new(0);
    let mut cost = DigestCost::default();
    let mut fp = Fingerprint::default();
    if let Some(commit) = &model.commit {
        fp.insert("model.commit", commit.clone());
    }
    for file in &model.files {
        fp.insert(format!("model.file.{}.size", file.name), file.size.to_string());
        match &file.blob {
            Some(BlobName::LfsSha256(d)) => {
                fp.insert(format!("model.file.{}.lfs-sha256", file.name), d.clone())
            }
            Some(BlobName::GitSha1(d)) => fp.insert(format!("model.file.{}.git-sha1", file.name), d.clone()),
            None => {}
        }
    }
    if depth == Depth::Cache {
        return Ok((fp, cost));
    }
    fp.insert("model.safetensors-headers", cheap_digest(model, &count)?);
    let mut buf = vec![0u8; 64 * 1024];
    for file in model.files.iter().filter(|f| {
        let base = f.name.rsplit('/').next().unwrap_or(&f.name);
        TOKENIZER_FILES.contains(&base)
    }) {
        fp.insert(
            format!("tokenizer.{}.sha256", file.name),
            sha256_file(&file.path, file.size, &mut buf, &count)?,
        );
    }
    if let Some(template) = chat_template(model, &count)? {
        fp.insert("tokenizer.chat-template.sha256", template);
    }
    if let Depth::Full { threads } = depth {
        // Each file by its real path and identity, read before hashing and again after: a
        // file written while it was hashed is not kept as known.
        let real = identities(model)?;
        let unknown: Vec<&(PathBuf, FileIdentity)> = real
            .iter()
            .filter(|(path, identity)| known.0.get(path).is_none_or(|k| k.identity != *identity))
            .collect();
        cost.files_hashed = unknown.len() as u64;
        cost.files_known = (real.len() - unknown.len()) as u64;
        let sizes: Vec<(PathBuf, u64)> = unknown.iter().map(|(path, id)| (path.clone(), id.size)).collect();
        for ((path, identity), sha256) in unknown.into_iter().zip(full_digests(&sizes, threads, &count)?) {
            if FileIdentity::of(path)? != *identity {
                return Err(Error::Layout {
                    path: path.clone(),
                    reason: "it changed while it was hashed".into(),
                });
            }
            known.0.insert(
                path.clone(),
                Known {
                    identity: *identity,
                    sha256,
                },
            );
        }
        for (file, (path, _)) in model.files.iter().zip(&real) {
            let sha256 = known
                .0
                .get(path)
                .map(|k| k.sha256.clone())
                .ok_or_else(|| Error::Layout {
                    path: path.clone(),
                    reason: "its digest was not taken".into(),
                })?;
            fp.insert(format!("model.file.{}.sha256", file.name), sha256);
        }
    }
    cost.bytes_read = count.load(Ordering::Relaxed);
    Ok((fp, cost))
}
