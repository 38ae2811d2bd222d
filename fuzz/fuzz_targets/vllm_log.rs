//! What the cold-start reader takes from a cluster: a vLLM container's log (with or without
//! `--timestamps` prefixes), a pod and its events as JSON. Garbage gives unknown stages, never a
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use understudy_prober::coldstart::{self, vllm_log::StartupLog};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = StartupLog::parse(&text);
    for line in text.lines() {
        let _ = coldstart::vllm_log::split_timestamp(line);
    }
    let _ = coldstart::parse_pod(&text);
    let _ = coldstart::parse_events(&text);
});
