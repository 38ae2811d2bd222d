//! Which request paths the public port forwards. Only the OpenAI-compatible API under `/v1/` is
//! forwarded; vLLM's development and control endpoints are never reachable through it, even when
//! a replica runs with `VLLM_SERVER_DEV_MODE=1` (which sleep mode needs).
//!
//! This module must never allow a path by default: anything not known to be user API is refused.

/// What the public port does with a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublicPath {
    /// User API: forward.
    Api,
    /// A control or development endpoint of vLLM: 403, never forwarded.
    Control,
    /// Anything else: 404.
    Unknown,
}

/// vLLM's control and development endpoints (sleep mode, RPC, cache, profiling, LoRA loading,
/// server info, scaling), plus the probes and metrics that belong to the operator, not clients.
const CONTROL: &[&str] = &[
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/server_info",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/start_profile",
    "/stop_profile",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/pause",
    "/resume",
    "/update_weights",
    "/metrics",
    "/health",
    "/ping",
    "/load",
    "/version",
    // The `/v1/` entries last, `V1_CONTROL` of them.
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
];
const V1_CONTROL: usize = 2;

/// What the fence sidecar does with a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FencePath {
    /// Health, load, version, metrics and the sleep state: anyone may read them, fenced or not,
    /// so a fenced replica can still be watched.
    Probe,
    /// A control or development endpoint of vLLM: only with the operator's token, fenced or not.
    Control,
    /// Anything else, generation or not: refused while the pool does not hold the Lease.
    Serving,
    /// A path a server further in might read as another (`//`, `..`, percent-encoding): 400.
    Garbled,
}

/// The probes among [`CONTROL`]: read-only, answered to anyone by the fence.
const PROBES: &[&str] = &[
    "/health",
    "/ping",
    "/load",
    "/version",
    "/metrics",
    "/is_sleeping",
];

/// Classifies a request path (without query) for the fence sidecar. Nothing is a probe or
/// passes without the token unless it is named here.
#[must_use]
pub fn classify_for_fence(path: &str) -> FencePath {
    if !is_plain(path) {
        return FencePath::Garbled;
    }
    let trimmed = path.trim_end_matches('/');
    if PROBES.iter().any(|p| trimmed.eq_ignore_ascii_case(p)) {
        FencePath::Probe
    } else if classify(path) == PublicPath::Control {
        FencePath::Control
    } else {
        FencePath::Serving
    }
}

/// Classifies a request path (without query).
#[must_use]
pub fn classify(path: &str) -> PublicPath {
    // Normalise what a proxy further out might not: repeated or trailing slashes.
    let trimmed = path.trim_end_matches('/');
    // Under `/v1/` (the common case) only the `/v1/` entries can match, case aside.
    let candidates = if trimmed.starts_with("/v1/") {
        &CONTROL[CONTROL.len() - V1_CONTROL..]
    } else {
        CONTROL
    };
    if candidates
        .iter()
        .any(|c| trimmed.eq_ignore_ascii_case(c) || has_prefix_segment(trimmed, c))
    {
        return PublicPath::Control;
    }
    if !is_plain(path) {
        return PublicPath::Unknown;
    }
    if path.starts_with("/v1/") && path.len() > 4 {
        PublicPath::Api
    } else {
        PublicPath::Unknown
    }
}

/// True for a path with no empty segment inside (`//`), no `..` segment and no percent-encoding:
/// nothing a server further in might read as another path. One pass over the bytes.
fn is_plain(path: &str) -> bool {
    let bytes = path.as_bytes();
    let mut segment = 0;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'%' => return false,
            b'/' if i > 0 && (segment == i || &bytes[segment..i] == b"..") => return false,
            b'/' => segment = i + 1,
            _ => {}
        }
    }
    &bytes[segment..] != b".."
}

fn has_prefix_segment(path: &str, control: &str) -> bool {
    path.len() > control.len()
        && path.as_bytes()[control.len()] == b'/'
        && path[..control.len()].eq_ignore_ascii_case(control)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_v1_control_entries_are_the_last_ones() {
        let v1 = CONTROL.iter().filter(|c| c.starts_with("/v1/")).count();
        assert_eq!(v1, V1_CONTROL);
        assert!(
            CONTROL[CONTROL.len() - V1_CONTROL..]
                .iter()
                .all(|c| c.starts_with("/v1/"))
        );
    }

    #[test]
    fn the_openai_api_is_forwarded() {
        for p in [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/v1/models/",
            "/v1/models/a..b",
            "/v1/embeddings",
        ] {
            assert_eq!(classify(p), PublicPath::Api, "{p}");
        }
    }

    #[test]
    fn every_control_endpoint_in_every_spelling_is_refused() {
        for p in [
            "/sleep",
            "/wake_up",
            "/WAKE_UP",
            "/is_sleeping/",
            "/collective_rpc",
            "/server_info",
            "/reset_prefix_cache",
            "/v1/load_lora_adapter",
            "/metrics",
        ] {
            assert_eq!(classify(p), PublicPath::Control, "{p}");
        }
    }

    #[test]
    fn the_fence_lets_probes_through_asks_a_token_for_control_and_fences_the_rest() {
        for p in [
            "/health",
            "/ping",
            "/metrics",
            "/version",
            "/load",
            "/is_sleeping",
            "/health/",
        ] {
            assert_eq!(classify_for_fence(p), FencePath::Probe, "{p}");
        }
        for p in [
            "/sleep",
            "/wake_up",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/server_info",
            "/v1/load_lora_adapter",
            "/SLEEP",
            "/sleep/now",
            "/health/anything",
        ] {
            assert_eq!(classify_for_fence(p), FencePath::Control, "{p}");
        }
        // Generation outside /v1/ is fenced too.
        for p in [
            "/v1/completions",
            "/invocations",
            "/inference/v1/generate",
            "/pooling",
            "/tokenize",
            "/",
        ] {
            assert_eq!(classify_for_fence(p), FencePath::Serving, "{p}");
        }
        for p in ["/%73leep", "//sleep", "/v1/../sleep", "/v1/%2e%2e/wake_up"] {
            assert_eq!(classify_for_fence(p), FencePath::Garbled, "{p}");
        }
    }

    #[test]
    fn paths_outside_v1_and_tricky_spellings_are_not_forwarded() {
        for p in [
            "/",
            "/v1",
            "/v1/",
            "/tokenize",
            "//v1/completions",
            "/v1/../sleep",
            "/v1/models/..",
            "/v1//models",
            "/v1/%2e%2e/sleep",
        ] {
            assert_ne!(classify(p), PublicPath::Api, "{p}");
        }
    }
}
