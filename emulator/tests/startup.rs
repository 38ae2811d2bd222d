//! Starting like `vllm serve`: refused until ready, vLLM's log lines with the configured times.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::TcpStream;
use std::time::Duration;

use regex::Regex;
use support::{Emulator, OpenStream, completion_body, try_request};

fn captured(line: &str, pattern: &str) -> f64 {
    let re = Regex::new(pattern).unwrap();
    let caps = re
        .captures(line)
        .unwrap_or_else(|| panic!("`{line}` does not match {pattern}"));
    caps[1].parse().unwrap()
}

#[test]
fn the_port_refuses_connections_until_the_engine_is_ready() {
    // Weights take 30 s (30 GiB at 1 GiB/s): the knocks land while they load however slow the
    // machine, and the emulator is dropped long before it would listen. That the port answers
    // once ready, every other test shows.
    let mut e = Emulator::spawn(
        &[
            "--emu-weights-gib",
            "30",
            "--emu-load-gib-per-s",
            "1",
            "--emu-zero-cost",
        ],
        &[],
    );
    e.wait_for_line("Starting to load model");
    let refused =
        TcpStream::connect(("127.0.0.1", e.port)).expect_err("nothing may answer while weights load");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(try_request(e.port, "GET", "/health", None).is_err());
}

/// The lines each release prints where they differ, and the process names its lines carry.
struct Lines {
    flags: &'static [&'static str],
    prefix: &'static str,
    version: &'static str,
    init_unit: &'static str,
    serving: &'static str,
    uvicorn: &'static str,
}

const CURRENT: Lines = Lines {
    flags: &[],
    prefix: "(?:APIServer|EngineCore|Worker)",
    version: " ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0",
    init_unit: " s",
    serving: "Starting vLLM server on",
    uvicorn: "INFO:     ",
};

const OLDER: Lines = Lines {
    flags: &["--emu-vllm-version", "0.11.0"],
    prefix: "(?:APIServer|EngineCore_DP0)",
    version: "vLLM API server version 0.11.0",
    init_unit: " seconds",
    serving: "Starting vLLM API server 0 on",
    uvicorn: "(APIServer pid=",
};

#[test]
fn startup_log_lines_carry_the_configured_stage_durations_in_vllms_current_format() {
    startup_lines_in(&CURRENT);
}

#[test]
fn an_older_version_prints_vllm_0_11s_startup_lines() {
    startup_lines_in(&OLDER);
}

fn startup_lines_in(lines: &Lines) {
    let mut e = Emulator::spawn(
        &[
            lines.flags,
            &[
                "--emu-weights-gib=0.6",
                "--emu-load-gib-per-s=2",
                "--emu-compile-s=0.3",
                "--emu-cudagraph-s=1.1",
                "--emu-profile-s=0.1",
            ],
        ]
        .concat(),
        &[],
    );
    e.wait_for_line("Application startup complete.");
    let log = e.drain_log();
    let prefix = Regex::new(&format!(
        r"^\({} pid=\d+\) (INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+\.py:\d+\] ",
        lines.prefix
    ))
    .unwrap();
    let line = |needle: &str| -> (usize, String) {
        let i = log
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no `{needle}` in\n{}", log.join("\n")));
        (i, log[i].clone())
    };
    for l in log.iter().filter(|l| !l.contains("INFO:     ")) {
        assert!(prefix.is_match(l), "line without vLLM's prefix: {l}");
    }

    let (i_version, _) = line(lines.version);
    let (i_args, _) = line("non-default args: {'model_tag': 'Qwen/Qwen3-0.6B'");
    let (i_start, _) = line("Starting to load model Qwen/Qwen3-0.6B...");
    let (i_weights, weights) = line("Loading weights took");
    let weights = captured(&weights, r"Loading weights took ([\d.]+) seconds");
    // Durations are measured by the emulator while it really waits, so they are at least the
    // configured ones; how much longer depends on the machine's load and is not asserted.
    assert!(weights >= 0.3, "0.6 GiB at 2 GiB/s is 0.3 s, printed {weights}");
    let (_, loading) = line("Model loading took");
    let loading = captured(
        &loading,
        r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    );
    assert!(
        loading >= weights,
        "model loading ({loading}) includes the weight load ({weights})"
    );
    let (i_compile, compile) = line("torch.compile takes");
    let compile = captured(&compile, r"torch\.compile takes ([\d.]+) s in total");
    assert!(compile >= 0.3, "printed {compile}");
    let (i_graph, graph) = line("Graph capturing finished");
    let graph = captured(
        &graph,
        r"Graph capturing finished in (\d+) secs?, took [\d.]+ GiB",
    );
    assert!(graph >= 1.0, "1.1 s printed as whole seconds, got {graph}");
    let (i_init, init) = line("init engine (profile, create kv cache, warmup model)");
    let init = captured(
        &init,
        &format!(
            r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+){}$",
            lines.init_unit
        ),
    );
    assert!(
        init >= 1.5 && init >= compile,
        "compile, profile and graph capture take 1.5 s, printed {init}"
    );
    let (i_serving, serving) = line(lines.serving);
    let url = Regex::new(r"Starting vLLM (?:API )?server(?: \d+)? on (\S+)")
        .unwrap()
        .captures(&serving)
        .unwrap()[1]
        .to_string();
    assert_eq!(url, format!("http://127.0.0.1:{}", e.port));
    let (i_started, started) = line(&format!("INFO:     Started server process [{}]", e_pid(&log)));
    assert!(started.starts_with(lines.uvicorn), "{started}");
    let (i_waiting, _) = line("INFO:     Waiting for application startup.");
    let (i_ready, _) = line("INFO:     Application startup complete.");
    let order = [
        i_version, i_args, i_start, i_weights, i_compile, i_graph, i_init, i_serving, i_started, i_waiting,
        i_ready,
    ];
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "lines out of vLLM's order: {order:?}"
    );
}

fn e_pid(log: &[String]) -> String {
    Regex::new(r"pid=(\d+)").unwrap().captures(&log[0]).unwrap()[1].to_string()
}

#[test]
fn enforce_eager_skips_torch_compile_and_graph_capture_lines() {
    let mut e = Emulator::spawn(&["--emu-instant", "--enforce-eager"], &[]);
    e.wait_for_line("Application startup complete.");
    let log = e.drain_log().join("\n");
    assert!(!log.contains("torch.compile takes"), "{log}");
    assert!(!log.contains("Graph capturing finished"), "{log}");
    assert!(log.contains("init engine (profile, create kv cache, warmup model) took"));
}

#[test]
fn unknown_flags_are_accepted_and_reported_like_vllms_non_default_args() {
    let mut e = Emulator::spawn(
        &[
            "--emu-instant",
            "--kv-cache-dtype",
            "fp8",
            "--max_num_seqs=4",
            "--served-model-name",
            "qwen",
        ],
        &[],
    );
    let line = e.wait_for_line("non-default args:");
    assert!(line.contains("'kv_cache_dtype': 'fp8'"), "{line}");
    assert!(line.contains("'max_num_seqs': 4"), "{line}");
    assert!(line.contains("'served_model_name': ['qwen']"), "{line}");
    e.wait_for_line("Application startup complete.");
    assert_eq!(e.get("/v1/models").json()["data"][0]["id"], "qwen");
}

#[test]
fn a_context_longer_than_the_kv_cache_fails_startup_like_vllm() {
    let status = Emulator::refused_start(
        &[
            "--emu-instant",
            "--max-model-len",
            "8192",
            "--emu-kv-cache-tokens",
            "4096",
        ],
        &[],
    );
    assert!(!status.success());
}

#[test]
fn sigterm_answers_the_stream_in_flight_then_exits_cleanly_as_vllm_does() {
    // 200 tokens at the default 8 ms: a stream of well over a second.
    let mut e = Emulator::ready_with_costs(&[], &[]);
    let mut stream = OpenStream::post(
        e.port,
        "/v1/completions",
        &completion_body("The capital of France is", 200, true),
    );
    assert!(stream.read_until("data: {", Duration::from_secs(20)));
    e.terminate();
    e.wait_for_line("Shutting down FastAPI HTTP server.");
    // The request in flight is answered to its end, not cut.
    let done = stream.finish();
    assert!(done.body.contains("data: [DONE]"), "{}", done.body);
    let status = e
        .wait_exit(Duration::from_secs(20))
        .expect("exits once the stream is done");
    assert!(status.success(), "{status:?}");
}
