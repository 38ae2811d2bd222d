//! Runtime parity against the real vLLM emulator: a drifted replica's version and context
//! length are reported by key, with both values.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod emulated;

use std::time::Duration;

use emulated::Emulator;
use understudy_prober::parity::runtime::runtime_fingerprint;

const IMAGE: &str =
    "docker.io/vllm/vllm-openai@sha256:3f1c8a9d2b7e4f60a1c5d9e8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8";

#[tokio::test]
async fn twin_replicas_agree_and_a_drifted_one_is_reported_by_version_and_context_length() {
    let primary = Emulator::ready(&["--max-model-len=8192"], &[]);
    let standby = Emulator::ready(&["--max-model-len=8192"], &[]);
    let timeout = Duration::from_secs(5);
    let a = runtime_fingerprint(&primary.endpoint, Some(IMAGE), timeout)
        .await
        .unwrap();
    let b = runtime_fingerprint(&standby.endpoint, Some(IMAGE), timeout)
        .await
        .unwrap();
    assert!(a.drift(&b).holds(), "{}", a.drift(&b).render());
    assert_eq!(a.get("runtime.version"), Some("0.32.0"));
    assert_eq!(a.get("served.Qwen/Qwen3-0.6B.max-model-len"), Some("8192"));
    // How each tokenizes the fixed text and chat (`POST /tokenize`): present, and the same.
    for key in [
        "served.Qwen/Qwen3-0.6B.tokenizer",
        "served.Qwen/Qwen3-0.6B.chat-template",
    ] {
        assert_eq!(a.get(key).map(str::len), Some(16), "{key}: {a:?}");
    }
    assert_ne!(
        a.get("served.Qwen/Qwen3-0.6B.tokenizer"),
        a.get("served.Qwen/Qwen3-0.6B.chat-template")
    );
    assert_eq!(
        a.get("runtime.image"),
        Some(&IMAGE[IMAGE.find('@').unwrap() + 1..])
    );

    standby.inject("drift:version=0.10.2,max-model-len=2048");
    let b = runtime_fingerprint(&standby.endpoint, Some(IMAGE), timeout)
        .await
        .unwrap();
    let report = a.drift(&b);
    assert_eq!(
        report.keys(),
        vec!["runtime.version", "served.Qwen/Qwen3-0.6B.max-model-len"]
    );
    assert_eq!(
        report.render(),
        "runtime.version: 0.32.0 ≠ 0.10.2\nserved.Qwen/Qwen3-0.6B.max-model-len: 8192 ≠ 2048\n"
    );
}

#[tokio::test]
async fn an_unreachable_replica_is_an_error_not_an_empty_fingerprint() {
    let closed_port = understudy_emulator::local::ClosedPort::bind();
    let closed = understudy_prober::probe::Endpoint::new("127.0.0.1", closed_port.port);
    assert!(
        runtime_fingerprint(&closed, None, Duration::from_secs(2))
            .await
            .is_err()
    );
}
