//! An in-process vLLM emulator on loopback for the prober's end-to-end tests.
//!
//! Each emulator runs on its own thread and runtime (as the binary does) and is shut down when
//! the handle drops, so nothing outlives a test. Faults go to its control port.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use understudy_gameday::emulator::log::Log;
use understudy_gameday::emulator::{self, EmulatorConfig};
use understudy_prober::probe::Endpoint;

pub const MODEL: &str = "Qwen/Qwen3-0.6B";

/// A port nobody listens on right now.
///
/// Racy: another process may take the port between this drop and the emulator's bind. Port 0
/// would remove the race, but the emulator prints the resolved port (0), not the bound one, and
/// prints it only once ready, after the tests that knock during weight load need it; fixing that
/// means logging `local_addr()` early in the emulator. Left as is for now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The emulator's log lines, shared with the test.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A running emulator with a control port.
pub struct Emulator {
    pub endpoint: Endpoint,
    pub control_port: u16,
    lines: Lines,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Emulator {
    /// Starts `serve MODEL --host 127.0.0.1 --port P --emu-control-port C ARGS…` without waiting.
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let port = free_port();
        let control_port = free_port();
        let mut argv: Vec<String> = ["serve", MODEL, "--host", "127.0.0.1", "--port", &port.to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        argv.push(format!("--emu-control-port={control_port}"));
        argv.extend(args.iter().map(|s| s.to_string()));
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let config = EmulatorConfig::from_args(&argv, env).expect("emulator arguments");
        let lines = Lines::default();
        let log = Arc::new(Log::new(std::process::id(), Box::new(lines.clone())));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                tokio::select! {
                    _ = emulator::run(config, log) => {}
                    _ = stopped => {}
                }
            });
        });
        Emulator {
            endpoint: Endpoint::new("127.0.0.1", port),
            control_port,
            lines,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Starts one with instant startup and no generation cost, and waits until it serves.
    pub fn ready(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let mut all = vec!["--emu-instant", "--emu-zero-cost"];
        all.extend_from_slice(args);
        let e = Emulator::spawn(&all, env);
        e.wait_for_line("Application startup complete.");
        e
    }

    /// Starts one with instant startup and the cost model on, and waits until it serves.
    pub fn ready_with_costs(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let mut all = vec!["--emu-instant"];
        all.extend_from_slice(args);
        let e = Emulator::spawn(&all, env);
        e.wait_for_line("Application startup complete.");
        e
    }

    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.lines.0.lock().unwrap()).into_owned()
    }

    pub fn wait_for_line(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "no `{needle}` in 20 s; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// POSTs a fault spec to the control port; panics unless it is accepted.
    pub fn inject(&self, spec: &str) {
        assert_eq!(post(self.control_port, "/faults", spec), 200, "fault {spec}");
    }

    /// POSTs to the API port; the status.
    pub fn post(&self, path: &str, body: &str) -> u16 {
        post(self.endpoint.port, path, body)
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One blocking POST on a fresh loopback connection; the status code.
pub fn post(port: u16, path: &str, body: &str) -> u16 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    raw.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}
