//! vLLM's log lines: `(APIServer pid=N) INFO MM-DD HH:MM:SS [file.py:line] message`.
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
}

/// A line sink shared by the whole emulator.
pub struct Log {
    pid: u32,
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
            sink: Mutex::new(sink),
        }
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
        let who = match proc {
            Proc::ApiServer => "APIServer",
            Proc::EngineCore => "EngineCore_DP0",
        };
        let stamp = vllm_timestamp(SystemTime::now());
        self.write(&format!(
            "({who} pid={}) {level} {stamp} [{source}] {message}\n",
            self.pid
        ));
    }

    /// uvicorn's own format: `INFO:     message`, still behind vLLM's process prefix.
    pub fn uvicorn(&self, message: &str) {
        self.write(&format!("(APIServer pid={}) INFO:     {message}\n", self.pid));
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
