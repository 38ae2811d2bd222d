//! Facts about `vllm serve`'s command line that more than one part of understudy needs: the
//! emulator parses it as vLLM does, and the prober canonicalises it to compare two pools' flags.

/// vLLM's switches (argparse `store_true` / `BooleanOptionalAction`): they take no value, so the
/// word after one is the next argument (`vllm serve --enforce-eager M` serves `M`).
pub const SWITCHES: &[&str] = &[
    "enable-sleep-mode",
    "enforce-eager",
    "trust-remote-code",
    "enable-prefix-caching",
    "enable-chunked-prefill",
    "disable-log-stats",
    "disable-log-requests",
    "enable-log-requests",
    "enable-force-include-usage",
    "enable-server-load-tracking",
    "disable-custom-all-reduce",
    "enable-auto-tool-choice",
    "enable-lora",
    "disable-frontend-multiprocessing",
    "disable-uvicorn-access-log",
    "enable-prompt-tokens-details",
    "enable-request-id-headers",
    "enable-expert-parallel",
    "enable-eplb",
    "disable-sliding-window",
    "disable-cascade-attn",
    "headless",
    "async-scheduling",
    "skip-tokenizer-init",
];

/// Whether `name` (a flag without its dashes, `-` between words) is a switch. Every `no-x` is:
/// `BooleanOptionalAction` makes the negative form of each boolean flag.
pub fn is_switch(name: &str) -> bool {
    name.starts_with("no-") || SWITCHES.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_and_their_negations_take_no_value_and_options_do() {
        assert!(is_switch("enforce-eager"));
        assert!(is_switch("no-enable-prefix-caching"));
        assert!(!is_switch("max-model-len"));
        assert!(!is_switch("served-model-name"));
    }
}
