//! vLLM's startup log lines, older and newer formats, read into timed milestones.
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
    pub version: Option<String>,
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
        let last_start = lines.iter().rposition(|l| p.version.is_match(l)).unwrap_or(0);
        let mut log = StartupLog::default();
        for line in &lines[last_start..] {
            let (at, message) = split_timestamp(line);
            let mark = Mark { at };
            if let Some(c) = p.version.captures(message) {
                log.version = Some(c[1].to_string());
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

#[cfg(test)]
mod tests {
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
}
