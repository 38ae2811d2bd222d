//! The runner's other processes, the routers and the fences: each started from this binary
//! (`understudy-gameday router …`, the router's own command line), on loopback ports it picks
//! and reports on stdout, and killed when its handle is dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::replicas::Launcher;

/// A process of the system, with the addresses it reported.
#[derive(Debug)]
pub struct Process {
    pub name: String,
    /// Each `… LABEL listening on http://ADDR` line, in the order they came.
    pub listening: Vec<(String, SocketAddr)>,
    child: Child,
}

/// Why a process could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("starting {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} did not report {wanted} listening address(es) within {limit:?}; its last lines: {tail}")]
    NotListening {
        name: String,
        wanted: usize,
        limit: Duration,
        tail: String,
    },
}

/// The label and address of a `… LABEL listening on http://ADDR` line.
fn listening_in(line: &str) -> Option<(String, SocketAddr)> {
    let (head, rest) = line.split_once(" listening on http://")?;
    let label = head.rsplit(' ').next()?.to_owned();
    Some((label, rest.split_whitespace().next()?.parse().ok()?))
}

impl Process {
    /// Starts `launcher` with `args` and waits until it has reported `wanted` listening
    /// addresses. Its stderr is dropped, its stdout read to the end so that it never blocks.
    pub fn start(
        launcher: &Launcher,
        name: &str,
        args: &[String],
        wanted: usize,
        limit: Duration,
    ) -> Result<Process, ProcessError> {
        let mut child = Command::new(&launcher.program)
            .args(&launcher.prefix)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| ProcessError::Spawn {
                name: name.to_owned(),
                source,
            })?;
        let (lines, seen) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    // Once the reader below has what it waited for, the rest is read and dropped.
                    let _ = lines.send(line);
                }
            });
        }
        let deadline = std::time::Instant::now() + limit;
        let mut listening = Vec::new();
        let mut tail = Vec::new();
        while listening.len() < wanted {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Ok(line) = seen.recv_timeout(left) else {
                let _ = child.kill();
                let _ = child.wait();
                return Err(ProcessError::NotListening {
                    name: name.to_owned(),
                    wanted,
                    limit,
                    tail: tail.join(" | "),
                });
            };
            if let Some(found) = listening_in(&line) {
                listening.push(found);
            }
            tail.push(line);
            if tail.len() > 5 {
                tail.remove(0);
            }
        }
        Ok(Process {
            name: name.to_owned(),
            listening,
            child,
        })
    }

    /// The address reported under `label`.
    #[must_use]
    pub fn addr(&self, label: &str) -> Option<SocketAddr> {
        self.listening
            .iter()
            .find(|(l, _)| l == label)
            .map(|(_, addr)| *addr)
    }

    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then waits up to `limit` for the process to exit; whether it did.
    pub fn terminate(&mut self, limit: Duration) -> bool {
        if super::replicas::signal(self.child.id(), "-TERM").is_err() {
            return false;
        }
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_line_gives_its_label_and_address() {
        assert_eq!(
            listening_in("understudy-router admin listening on http://127.0.0.1:40123"),
            Some(("admin".to_owned(), SocketAddr::from(([127, 0, 0, 1], 40123))))
        );
        assert_eq!(listening_in("INFO something else"), None);
    }
}
