//! An emulator running inside this process, on its own thread and runtime, as one replica of a
//! local game day or an end-to-end test needs it.
//!
//! It behaves as the binary does (the same [`run`](super::run) on a current-thread runtime), keeps
//! its log lines in memory for the caller to read, and stops when the handle drops: nothing
//! outlives its owner. A `crash` fault ends its thread instead of the process.

use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::log::Log;
use super::{EmulatorConfig, Error, run};

/// The emulator's log, shared between its thread and the handle.
#[derive(Clone, Debug, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A running in-process emulator. Dropping it stops it and joins its thread.
#[derive(Debug)]
pub struct LocalEmulator {
    lines: Lines,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl LocalEmulator {
    /// Starts `vllm-emulator ARGS` (`args` as the binary gets them, `serve MODEL …` included) with
    /// the given environment, without waiting for it to be ready.
    pub fn start(args: &[String], env: Vec<(String, String)>) -> Result<LocalEmulator, Error> {
        let config = EmulatorConfig::from_args(args, env)?;
        let lines = Lines::default();
        let log = Arc::new(Log::new(std::process::id(), Box::new(lines.clone())));
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            runtime.block_on(async move {
                tokio::select! {
                    _ = run(config, log) => {}
                    _ = stopped => {}
                }
            });
        });
        Ok(LocalEmulator {
            lines,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Everything it has logged so far.
    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.lines.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }

    /// Waits until a logged line contains `needle`; false if `limit` passed first.
    pub fn wait_for_line(&self, needle: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !self.log().contains(needle) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }
}

impl Drop for LocalEmulator {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
