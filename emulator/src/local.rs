//! An emulator running inside this process, on its own thread and runtime, as one replica of a
//! local game day or an end-to-end test needs it.
//!
//! It behaves as the binary does (the same [`run`](super::run) on a current-thread runtime), keeps
//! its log lines in memory for the caller to read, tells the caller the ports it bound (start it
//! on port 0 and ask, rather than pick a free port and race others for it), and stops when the
//! handle drops: nothing outlives its owner. A `crash` fault ends its thread instead of the
//! process.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::log::{Dialect, Log};
use super::{BoundAddrs, EmulatorConfig, Error, run_reporting};

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
    bound: Arc<BoundAddrs>,
    has_control_port: bool,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl LocalEmulator {
    /// Starts `vllm-emulator ARGS` (`args` as the binary gets them, `serve MODEL …` included) with
    /// the given environment, without waiting for it to be ready.
    pub fn start(args: &[String], env: Vec<(String, String)>) -> Result<LocalEmulator, Error> {
        let config = EmulatorConfig::from_args(args, env)?;
        let lines = Lines::default();
        let bound = Arc::new(BoundAddrs::default());
        let has_control_port = config.emu.control_port.is_some();
        let log = Log::new(std::process::id(), Box::new(lines.clone()))
            .in_dialect(Dialect::of(&config.emu.vllm_version));
        let log = Arc::new(log);
        let (stop, stopped) = oneshot::channel::<()>();
        let reporting = Arc::clone(&bound);
        let thread = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            runtime.block_on(async move {
                tokio::select! {
                    _ = run_reporting(config, log, reporting) => {}
                    _ = stopped => {}
                }
            });
        });
        Ok(LocalEmulator {
            lines,
            bound,
            has_control_port,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Everything it has logged so far.
    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.lines.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }

    /// Waits until the API port is bound (early in startup, long before it accepts connections)
    /// and returns its address; `None` if `limit` passed or the emulator stopped first.
    pub fn api_addr(&self, limit: Duration) -> Option<SocketAddr> {
        self.wait_for_addr(&self.bound.api, limit)
    }

    /// Waits until the control port (`--emu-control-port`) is bound and returns its address; `None`
    /// at once without a control port, and if `limit` passed or the emulator stopped first.
    pub fn control_addr(&self, limit: Duration) -> Option<SocketAddr> {
        if !self.has_control_port {
            return None;
        }
        self.wait_for_addr(&self.bound.control, limit)
    }

    fn wait_for_addr(&self, addr: &OnceLock<SocketAddr>, limit: Duration) -> Option<SocketAddr> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(a) = addr.get() {
                return Some(*a);
            }
            if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
                // It may have bound just before it stopped.
                return addr.get().copied();
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
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

/// A loopback port that refuses every connection, as a dead replica's does, for tests that need one: bound, so the OS
/// gives it to nobody else while this lives, and never listened on, so a connect gets a reset.
#[derive(Debug)]
pub struct ClosedPort {
    _socket: tokio::net::TcpSocket,
    /// The port.
    pub port: u16,
}

impl ClosedPort {
    /// Binds a port the OS picks on 127.0.0.1, without listening.
    ///
    /// # Panics
    /// When no socket can be bound (a test cannot go on without one).
    #[must_use]
    #[allow(clippy::unwrap_used)]
    pub fn bind() -> ClosedPort {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let port = socket.local_addr().unwrap().port();
        ClosedPort {
            _socket: socket,
            port,
        }
    }

    /// Its address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}
