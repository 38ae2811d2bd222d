//! A child process for the tests and benchmarks that run understudy's binaries: killed when
//! dropped, its output kept line by line.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A child process, killed when dropped, its output kept.
#[derive(Debug)]
pub struct Process {
    child: Child,
    output: Arc<Mutex<Vec<String>>>,
}

impl Process {
    /// Starts `command` with its output piped and kept.
    ///
    /// # Panics
    /// When the program cannot be started.
    #[must_use]
    pub fn start(command: &mut Command) -> Process {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
        let output = Arc::new(Mutex::new(Vec::new()));
        for pipe in [
            child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
            child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    output.lock().unwrap_or_else(PoisonError::into_inner).push(line);
                }
            });
        }
        Process { child, output }
    }

    /// Its process id.
    #[must_use]
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// How it ended, once it has.
    ///
    /// # Errors
    /// When its status cannot be read.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// Every line it has written so far, standard output and error interleaved as read.
    #[must_use]
    pub fn lines(&self) -> Vec<String> {
        self.output.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The address announced in a `<prefix>ADDR` line.
    ///
    /// # Panics
    /// When no such line comes within 20 s.
    #[must_use]
    pub fn announced(&self, prefix: &str) -> SocketAddr {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(addr) = self
                .lines()
                .iter()
                .find_map(|l| l.strip_prefix(prefix)?.parse().ok())
            {
                return addr;
            }
            assert!(Instant::now() < until, "no `{prefix}` line: {:?}", self.lines());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A router gateway started by `program` (`understudy-router` or the tests' build of it) on
/// loopback ports it picks, its admin port guarded by the token in `token_file`; the process,
/// its admin address and its gateway address.
#[must_use]
pub fn router_gateway(program: &Path, token_file: &Path) -> (Process, SocketAddr, SocketAddr) {
    let router = Process::start(
        Command::new(program)
            .args([
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--admin-token-file")
            .arg(token_file),
    );
    let admin = router.announced("understudy-router admin listening on http://");
    let gateway = router.announced("understudy-router gateway listening on http://");
    (router, admin, gateway)
}
