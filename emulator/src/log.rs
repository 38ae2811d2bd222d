//! vLLM's log lines: `(APIServer pid=N) INFO MM-DD HH:MM:SS [file.py:line] message`.
//!
//! Two releases' lines, chosen by the version the emulator reports ([`Dialect`]): 0.32's by
//! default, 0.11's for an older `--emu-vllm-version`. They differ in the process names, in
//! whether uvicorn's lines carry the process prefix, and in the messages [`startup`] prints.
//!
//! [`startup`]: super::startup
//!
//! The prober's cold-start parser reads these lines, so the prefix, the message texts and the
//! number formats are vLLM's own (see the reference, section 3). The timestamp has no year and no
//! sub-second part, in UTC. This module formats and writes lines; it must never decide what to log.

use std::io::Write;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Which vLLM process a line claims to come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proc {
    ApiServer,
    EngineCore,
    /// The worker that holds the model (0.32 runs it as a process of its own; 0.11's lines came
    /// from the engine core).
    Worker,
}

/// Which release's log lines to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    /// vLLM 0.11: `vLLM API server version X`, `(EngineCore_DP0 pid=N)`, `took X seconds`,
    /// `Starting vLLM API server 0 on`, uvicorn behind the API server's prefix.
    V0_11,
    /// vLLM 0.32 (the current line): a banner ending `version X`, `(EngineCore pid=N)` and
    /// `(Worker pid=N)`, `took X s`, `Starting vLLM server on`, uvicorn's lines bare.
    #[default]
    V0_32,
}

impl Dialect {
    /// 0.11's lines for a version before 0.32; 0.32's for 0.32 and later, and for a version
    /// that does not read as `MAJOR.MINOR…`.
    pub fn of(version: &str) -> Dialect {
        let mut parts = version.trim_start_matches('v').split('.');
        let number = |p: Option<&str>| p.and_then(|p| p.parse::<u32>().ok());
        match (number(parts.next()), number(parts.next())) {
            (Some(0), Some(minor)) if minor < 32 => Dialect::V0_11,
            _ => Dialect::V0_32,
        }
    }
}

/// A line sink shared by the whole emulator.
pub struct Log {
    pid: u32,
    dialect: Dialect,
    sink: Mutex<Box<dyn Write + Send>>,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl Log {
    pub fn new(pid: u32, sink: Box<dyn Write + Send>) -> Log {
        Log {
            pid,
            dialect: Dialect::default(),
            sink: Mutex::new(sink),
        }
    }

    /// The same sink, printing `dialect`'s lines.
    #[must_use]
    pub fn in_dialect(mut self, dialect: Dialect) -> Log {
        self.dialect = dialect;
        self
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Logs to standard output, as vLLM does.
    pub fn stdout() -> Log {
        Log::new(std::process::id(), Box::new(std::io::stdout()))
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn info(&self, proc: Proc, source: &str, message: &str) {
        self.line(proc, "INFO", source, message);
    }

    pub fn warning(&self, proc: Proc, source: &str, message: &str) {
        self.line(proc, "WARNING", source, message);
    }

    pub fn error(&self, proc: Proc, source: &str, message: &str) {
        self.line(proc, "ERROR", source, message);
    }

    fn line(&self, proc: Proc, level: &str, source: &str, message: &str) {
        let who = match (proc, self.dialect) {
            (Proc::ApiServer, _) => "APIServer",
            (Proc::EngineCore | Proc::Worker, Dialect::V0_11) => "EngineCore_DP0",
            (Proc::EngineCore, Dialect::V0_32) => "EngineCore",
            (Proc::Worker, Dialect::V0_32) => "Worker",
        };
        let stamp = vllm_timestamp(SystemTime::now());
        self.write(&format!(
            "({who} pid={}) {level} {stamp} [{source}] {message}\n",
            self.pid
        ));
    }

    /// uvicorn's own format, `INFO:     message`: behind vLLM's process prefix in 0.11, bare in 0.32.
    pub fn uvicorn(&self, message: &str) {
        match self.dialect {
            Dialect::V0_11 => self.write(&format!("(APIServer pid={}) INFO:     {message}\n", self.pid)),
            Dialect::V0_32 => self.write(&format!("INFO:     {message}\n")),
        }
    }

    fn write(&self, line: &str) {
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        // A closed stdout must not take the server down; vLLM would keep serving too.
        let _ = sink.write_all(line.as_bytes());
        let _ = sink.flush();
    }
}

/// `MM-DD HH:MM:SS` in UTC.
pub fn vllm_timestamp(now: SystemTime) -> String {
    let secs = now.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (_, month, day) = civil_from_days(days as i64);
    format!(
        "{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Howard Hinnant's days-to-civil algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::time::Duration;

    #[test]
    fn versions_before_0_32_print_0_11s_lines_and_the_rest_the_current_ones() {
        assert_eq!(Dialect::of("0.11.0"), Dialect::V0_11);
        assert_eq!(Dialect::of("0.31.2"), Dialect::V0_11);
        assert_eq!(Dialect::of("0.32.0"), Dialect::V0_32);
        assert_eq!(Dialect::of("v0.33.1"), Dialect::V0_32);
        assert_eq!(Dialect::of("1.0.0"), Dialect::V0_32);
        assert_eq!(Dialect::of("nightly"), Dialect::V0_32);
    }

    #[test]
    fn timestamps_have_no_year_and_no_fraction() {
        // 2025-10-06 12:00:40 UTC
        let t = UNIX_EPOCH + Duration::from_secs(1_759_752_040);
        assert_eq!(vllm_timestamp(t), "10-06 12:00:40");
        assert_eq!(
            vllm_timestamp(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "02-29 00:00:00"
        );
    }
}
