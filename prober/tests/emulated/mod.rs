//! An in-process vLLM emulator on loopback for the prober's end-to-end tests.
//!
//! Each emulator is a [`LocalEmulator`]: its own thread and runtime, shut down when the handle
//! drops, so nothing outlives a test. Faults go to its control port.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use understudy_emulator::local::LocalEmulator;
use understudy_prober::probe::Endpoint;

pub const MODEL: &str = "Qwen/Qwen3-0.6B";

/// A running emulator with a control port.
pub struct Emulator {
    pub endpoint: Endpoint,
    pub control_port: u16,
    local: LocalEmulator,
}

impl Emulator {
    /// Starts `serve MODEL --host 127.0.0.1 --port 0 --emu-control-port 0 ARGS…` and waits only
    /// until its ports are bound (early: the API port still refuses connections). The OS picks
    /// each port when it binds it, so tests side by side never race for one.
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Emulator {
        let mut argv: Vec<String> = ["serve", MODEL, "--host", "127.0.0.1", "--port", "0"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        argv.push("--emu-control-port=0".into());
        argv.extend(args.iter().map(|s| s.to_string()));
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let local = LocalEmulator::start(&argv, env).expect("emulator arguments");
        let bound = |addr: Option<SocketAddr>, which: &str| {
            addr.unwrap_or_else(|| panic!("no {which} port bound in 20 s; log:\n{}", local.log()))
                .port()
        };
        Emulator {
            endpoint: Endpoint::new("127.0.0.1", bound(local.api_addr(Duration::from_secs(20)), "API")),
            control_port: bound(local.control_addr(Duration::from_secs(20)), "control"),
            local,
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
        self.local.log()
    }

    pub fn wait_for_line(&self, needle: &str) {
        assert!(
            self.local.wait_for_line(needle, Duration::from_secs(20)),
            "no `{needle}` in 20 s; log:\n{}",
            self.log()
        );
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
