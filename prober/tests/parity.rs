//! Parity fingerprints of generated model directories: fake Hugging Face caches with real
//! safetensors headers, built in temporary directories.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};
use understudy_prober::parity::flags::{FlagPolicy, flags_fingerprint};
use understudy_prober::parity::model::{self, Depth, hex};

const COMMIT: &str = "8d2a6e4c1f0b9e7d3c5a1b2f4e6d8c0a9b7e5f31";

/// What a generated model holds; every field changes the files.
#[derive(Clone)]
struct Spec {
    /// Rows of the second shard's tensor (64 columns of F16): its weight size.
    rows: usize,
    /// A byte to flip in the second shard's data, if any.
    flip: Option<usize>,
    tokenizer: &'static str,
    chat_template: &'static str,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            rows: 512,
            flip: None,
            tokenizer: r#"{"version":"1.0","model":{"type":"BPE"}}"#,
            chat_template: "{{ messages }}",
        }
    }
}

/// A safetensors file: u64 LE header length, JSON header padded with spaces, then the data.
fn safetensors(tensor: &str, rows: usize, flip: Option<usize>) -> Vec<u8> {
    let len = rows * 64 * 2;
    let mut header = format!(
        r#"{{"__metadata__":{{"format":"pt"}},"{tensor}":{{"dtype":"F16","shape":[{rows},64],"data_offsets":[0,{len}]}}}}"#
    )
    .into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    let mut x: u32 = 0x1234_5678;
    out.extend((0..len).map(|_| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x as u8
    }));
    if let Some(i) = flip {
        let at = out.len() - len + i;
        out[at] ^= 0xff;
    }
    out
}

/// `models--acme--tiny-llm` with `refs/main`, blobs named by content digest, snapshot symlinks.
fn hf_cache(root: &Path, spec: &Spec) -> PathBuf {
    let repo = root.join("models--acme--tiny-llm");
    let snapshot = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    let config =
        serde_json::json!({"chat_template": spec.chat_template, "model_max_length": 8192}).to_string();
    let files: Vec<(&str, Vec<u8>, bool)> = vec![
        (
            "model-00001-of-00002.safetensors",
            safetensors("model.embed_tokens.weight", 256, None),
            true,
        ),
        (
            "model-00002-of-00002.safetensors",
            safetensors("lm_head.weight", spec.rows, spec.flip),
            true,
        ),
        (
            "config.json",
            br#"{"architectures":["Qwen3ForCausalLM"],"torch_dtype":"bfloat16"}"#.to_vec(),
            false,
        ),
        ("tokenizer.json", spec.tokenizer.as_bytes().to_vec(), false),
        ("tokenizer_config.json", config.into_bytes(), false),
    ];
    for (name, bytes, lfs) in files {
        let digest = hex(&Sha256::digest(&bytes));
        // LFS blobs are named by SHA-256; git blobs by a 40-hex SHA-1 (stood in for here).
        let blob = if lfs { digest } else { digest[..40].to_string() };
        std::fs::write(repo.join("blobs").join(&blob), &bytes).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(name)).unwrap();
    }
    repo
}

fn fingerprint(spec: &Spec, depth: Depth) -> (understudy_prober::parity::Fingerprint, u64) {
    let dir = tempfile::tempdir().unwrap();
    let repo = hf_cache(dir.path(), spec);
    let (fp, cost) = model::fingerprint(&model::locate(&repo).unwrap(), depth).unwrap();
    (fp, cost.bytes_read)
}

const FULL: Depth = Depth::Full { threads: 2 };

#[test]
fn identical_model_directories_agree_at_every_depth() {
    for depth in [Depth::Headers, FULL] {
        let (a, _) = fingerprint(&Spec::default(), depth);
        let (b, _) = fingerprint(&Spec::default(), depth);
        assert!(a.drift(&b).holds(), "{depth:?}: {}", a.drift(&b).render());
        assert_eq!(a.get("model.commit"), Some(COMMIT));
    }
}

#[test]
fn a_changed_weight_byte_is_named_by_the_cache_for_free_and_by_the_full_digest() {
    let changed = Spec {
        flip: Some(1000),
        ..Spec::default()
    };
    let (a, _) = fingerprint(&Spec::default(), Depth::Headers);
    let (b, _) = fingerprint(&changed, Depth::Headers);
    assert_eq!(
        a.drift(&b).keys(),
        vec!["model.file.model-00002-of-00002.safetensors.lfs-sha256"],
        "the blob name is the content digest; headers and sizes are unchanged"
    );
    let (a, _) = fingerprint(&Spec::default(), FULL);
    let (b, _) = fingerprint(&changed, FULL);
    assert_eq!(
        a.drift(&b).keys(),
        vec![
            "model.file.model-00002-of-00002.safetensors.lfs-sha256",
            "model.file.model-00002-of-00002.safetensors.sha256",
        ]
    );
}

#[test]
fn a_changed_weight_byte_outside_a_cache_is_seen_only_by_the_full_digest() {
    let plain = |spec: &Spec, depth| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("model.safetensors"),
            safetensors("w", 128, spec.flip),
        )
        .unwrap();
        model::fingerprint(&model::locate(dir.path()).unwrap(), depth)
            .unwrap()
            .0
    };
    let changed = Spec {
        flip: Some(7),
        ..Spec::default()
    };
    assert!(
        plain(&Spec::default(), Depth::Headers)
            .drift(&plain(&changed, Depth::Headers))
            .holds()
    );
    assert_eq!(
        plain(&Spec::default(), FULL).drift(&plain(&changed, FULL)).keys(),
        vec!["model.file.model.safetensors.sha256"]
    );
}

#[test]
fn a_changed_shape_is_caught_by_the_cheap_header_digest() {
    let (a, _) = fingerprint(&Spec::default(), Depth::Headers);
    let (b, _) = fingerprint(
        &Spec {
            rows: 513,
            ..Spec::default()
        },
        Depth::Headers,
    );
    let report = a.drift(&b);
    let keys = report.keys();
    assert!(keys.contains(&"model.safetensors-headers"), "{keys:?}");
    assert!(
        keys.contains(&"model.file.model-00002-of-00002.safetensors.size"),
        "{keys:?}"
    );
}

#[test]
fn a_changed_tokenizer_file_and_chat_template_are_reported_by_name() {
    let (a, _) = fingerprint(&Spec::default(), Depth::Headers);
    let (b, _) = fingerprint(
        &Spec {
            tokenizer: r#"{"version":"1.0","model":{"type":"Unigram"}}"#,
            ..Spec::default()
        },
        Depth::Headers,
    );
    let report = a.drift(&b);
    let keys = report.keys();
    assert!(keys.contains(&"tokenizer.tokenizer.json.sha256"), "{keys:?}");
    assert!(!keys.iter().any(|k| k.contains("chat-template")), "{keys:?}");
    let (c, _) = fingerprint(
        &Spec {
            chat_template: "{{ bos_token }}{{ messages }}",
            ..Spec::default()
        },
        Depth::Headers,
    );
    let report = a.drift(&c);
    let keys = report.keys();
    assert!(keys.contains(&"tokenizer.chat-template.sha256"), "{keys:?}");
    assert!(
        keys.contains(&"tokenizer.tokenizer_config.json.sha256"),
        "{keys:?}"
    );
}

#[test]
fn a_changed_serving_flag_is_reported_with_both_values() {
    let argv = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let policy = FlagPolicy::default();
    let a = flags_fingerprint(
        &argv("vllm serve acme/tiny-llm --max-model-len=8192 --port 8000"),
        &policy,
    );
    let b = flags_fingerprint(
        &argv("vllm serve acme/tiny-llm --port 9000 --max-model-len 4096"),
        &policy,
    );
    let report = a.drift(&b);
    assert_eq!(report.keys(), vec!["flag.max-model-len"]);
    assert_eq!(report.render(), "flag.max-model-len: 8192 ≠ 4096\n");
}

#[test]
fn the_cheap_digest_reads_only_headers_and_small_files_however_large_the_weights() {
    let (small_fp, small) = fingerprint(
        &Spec {
            rows: 64,
            ..Spec::default()
        },
        Depth::Headers,
    );
    let (_, large) = fingerprint(
        &Spec {
            rows: 262_144,
            ..Spec::default()
        },
        Depth::Headers,
    );
    // 262144 rows × 64 × 2 bytes = 32 MiB of weights, against 8 KiB.
    assert!(large < 4096, "the cheap digest read {large} bytes");
    assert!(
        large.abs_diff(small) < 16,
        "cost grew with the weights: {small} → {large}"
    );
    let (_, full) = fingerprint(
        &Spec {
            rows: 262_144,
            ..Spec::default()
        },
        FULL,
    );
    assert!(full > 32 << 20, "the full digest reads every byte: {full}");
    assert!(small_fp.get("model.safetensors-headers").is_some());
}

#[test]
fn the_cache_depth_reads_no_file_and_still_names_a_changed_weight_in_a_cache() {
    let changed = Spec {
        flip: Some(1000),
        ..Spec::default()
    };
    let (a, read) = fingerprint(&Spec::default(), Depth::Cache);
    let (b, _) = fingerprint(&changed, Depth::Cache);
    assert_eq!(read, 0, "only names and sizes");
    assert_eq!(a.get("model.commit"), Some(COMMIT));
    assert!(a.get("model.safetensors-headers").is_none(), "{a:?}");
    assert_eq!(
        a.drift(&b).keys(),
        vec!["model.file.model-00002-of-00002.safetensors.lfs-sha256"]
    );
}

#[test]
fn the_weights_a_sleep_parks_are_the_files_vllm_loads_counted_once() {
    let sizes = |files: &[(&str, u64)]| {
        let mut fp = understudy_prober::parity::Fingerprint::default();
        for (name, size) in files {
            fp.insert(format!("model.file.{name}.size"), size.to_string());
        }
        model::weight_bytes(&fp)
    };
    let sharded = [
        ("model-00001-of-00002.safetensors", 5),
        ("model-00002-of-00002.safetensors", 4),
    ];
    assert_eq!(sizes(&sharded), 9);
    let mut with_copies = sharded.to_vec();
    with_copies.extend([
        ("consolidated.safetensors", 9),
        ("original/consolidated.00.pth", 9),
        ("pytorch_model.bin", 9),
        ("tokenizer.json", 1),
    ]);
    assert_eq!(
        sizes(&with_copies),
        9,
        "copies in other formats are not loaded too"
    );
    assert_eq!(sizes(&[("consolidated.safetensors", 7), ("config.json", 1)]), 7);
    assert_eq!(sizes(&[("pytorch_model.bin", 3), ("config.json", 1)]), 3);
}

/// A cache in `root` whose second shard holds 40,000 rows (about 5 MB), located.
fn larger_cache(root: &Path) -> model::ModelFiles {
    let spec = Spec {
        rows: 40_000,
        ..Spec::default()
    };
    model::locate(&hf_cache(root, &spec)).unwrap()
}

#[test]
fn a_full_digest_already_taken_of_an_unchanged_file_is_not_taken_again() {
    let dir = tempfile::tempdir().unwrap();
    let located = larger_cache(dir.path());
    let mut known = model::KnownDigests::default();
    let (first, cost) = model::fingerprint_known(&located, FULL, &mut known).unwrap();
    assert_eq!((cost.files_hashed, cost.files_known), (5, 0));
    // Kept as a file and read back, as the node agent does across a restart.
    let mut known: model::KnownDigests =
        serde_json::from_str(&serde_json::to_string(&known).unwrap()).unwrap();
    let (second, cost) = model::fingerprint_known(&located, FULL, &mut known).unwrap();
    assert_eq!((cost.files_hashed, cost.files_known), (0, 5));
    assert!(cost.bytes_read < 4096, "headers and small files only: {cost:?}");
    assert_eq!(first, second);

    // A shard rewritten in place, same size, other bytes: hashed again, and only it.
    let shard = located
        .files
        .iter()
        .find(|f| f.name == "model-00002-of-00002.safetensors")
        .unwrap();
    let mut bytes = std::fs::read(&shard.path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&shard.path, &bytes).unwrap();
    let (third, cost) = model::fingerprint_known(&located, FULL, &mut known).unwrap();
    assert_eq!((cost.files_hashed, cost.files_known), (1, 4));
    assert_eq!(
        first.drift(&third).keys(),
        vec!["model.file.model-00002-of-00002.safetensors.sha256"],
        "the blob keeps its name: only the full digest sees the change"
    );
    std::fs::remove_file(std::fs::canonicalize(&shard.path).unwrap()).unwrap();
    known.prune();
    assert_eq!(
        known.0.len(),
        4,
        "what is known of a file that is gone is dropped"
    );
}

#[test]
fn the_full_digest_equals_sha256sum() {
    let dir = tempfile::tempdir().unwrap();
    let located = larger_cache(dir.path());
    let (fp, _) = model::fingerprint(&located, Depth::Full { threads: 3 }).unwrap();
    let output = Command::new("sha256sum")
        .args(located.files.iter().map(|f| &f.path))
        .output()
        .expect("sha256sum");
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    assert_eq!(text.lines().count(), located.files.len());
    for (line, file) in text.lines().zip(&located.files) {
        let theirs = line.split_whitespace().next().unwrap();
        assert_eq!(
            fp.get(&format!("model.file.{}.sha256", file.name)),
            Some(theirs),
            "{}",
            file.name
        );
    }
}

#[test]
fn a_truncated_safetensors_file_is_an_error_naming_it_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = safetensors("w", 16, None);
    bytes[0..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(dir.path().join("broken.safetensors"), &bytes).unwrap();
    let err = model::fingerprint(&model::locate(dir.path()).unwrap(), Depth::Headers).unwrap_err();
    assert!(err.to_string().contains("broken.safetensors"), "{err}");
    std::fs::write(dir.path().join("broken.safetensors"), b"abc").unwrap();
    assert!(model::fingerprint(&model::locate(dir.path()).unwrap(), Depth::Headers).is_err());
}

/// `understudy-prober parity --model-dir A --model-dir B`, the binary: its exit status and what
/// it printed.
fn parity_cli(a: &Path, b: &Path, extra: &[&str]) -> (i32, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_understudy-prober"))
        .arg("parity")
        .arg("--model-dir")
        .arg(a)
        .arg("--model-dir")
        .arg(b)
        .args(extra)
        .output()
        .unwrap();
    let printed =
        String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output.status.code().unwrap(), printed)
}

#[test]
fn the_parity_command_names_each_differing_key_and_exits_1_only_when_something_differs() {
    let dir = tempfile::tempdir().unwrap();
    let (same_a, same_b, other) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("c"));
    let a = hf_cache(&same_a, &Spec::default());
    let b = hf_cache(&same_b, &Spec::default());
    let c = hf_cache(
        &other,
        &Spec {
            chat_template: "{{ bos_token }}{{ messages }}",
            ..Spec::default()
        },
    );
    let (code, printed) = parity_cli(&a, &b, &[]);
    assert_eq!(code, 0, "{printed}");
    assert!(
        printed.starts_with("parity holds: ") && printed.ends_with(" keys compared, none differs\n"),
        "{printed}"
    );
    let (code, printed) = parity_cli(&a, &c, &["--full"]);
    assert_eq!(code, 1, "{printed}");
    assert!(
        printed
            .lines()
            .any(|l| l.starts_with("tokenizer.chat-template.sha256: ")),
        "{printed}"
    );
    assert!(
        printed.lines().last().unwrap().contains(" keys differ"),
        "{printed}"
    );
    let (code, printed) = parity_cli(&a, &c, &["--json"]);
    assert_eq!(code, 1);
    let json: serde_json::Value = serde_json::from_str(&printed).unwrap();
    assert!(
        json["differences"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["key"] == "tokenizer.chat-template.sha256")
    );
    let (code, printed) = parity_cli(&a, &dir.path().join("missing"), &[]);
    assert_eq!(code, 1);
    assert!(printed.contains("reading "), "{printed}");
}
