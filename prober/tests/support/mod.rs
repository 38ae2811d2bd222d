//! A hand-rolled raw-TCP server that answers whatever a test scripts, shared by the probe and
//! admin tests.

#![allow(dead_code, clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use understudy_prober::probe::Endpoint;

/// One thing the server does, in order.
#[derive(Clone, Debug)]
pub enum Step {
    Send(Vec<u8>),
    Wait(Duration),
    /// Keep the connection open and say nothing more.
    Hang,
    /// Abort the connection: a TCP RST instead of a FIN (`SO_LINGER` of zero, then close).
    Reset,
}

pub fn send(s: &str) -> Step {
    Step::Send(s.as_bytes().to_vec())
}

pub type Script = Arc<dyn Fn(&str) -> Vec<Step> + Send + Sync>;

/// A loopback server playing a script per request path; it stops when dropped.
pub struct GarblingServer {
    pub endpoint: Endpoint,
    pub paths: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for GarblingServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl GarblingServer {
    pub async fn start(script: Script) -> GarblingServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let paths = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&paths);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((mut socket, _)) = listener.accept().await {
                let script = Arc::clone(&script);
                let seen = Arc::clone(&seen);
                connections.spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&buf).to_string();
                    let path = head.split(' ').nth(1).unwrap_or("").to_string();
                    seen.lock().unwrap().push(path.clone());
                    for step in script(&path) {
                        match step {
                            Step::Send(bytes) => {
                                if socket.write_all(&bytes).await.is_err() {
                                    return;
                                }
                            }
                            Step::Wait(d) => tokio::time::sleep(d).await,
                            Step::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
                            Step::Reset => {
                                let _ = socket.set_zero_linger();
                                return;
                            }
                        }
                    }
                });
            }
        });
        GarblingServer {
            endpoint: Endpoint::new("127.0.0.1", port),
            paths,
            task,
        }
    }
}

pub const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";

pub fn token(text: &str) -> String {
    format!(
        "data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"{text}\",\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
    )
}

pub const USAGE_AND_DONE: &str = "data: {\"id\":\"cmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\ndata: [DONE]\n\n";

pub fn good_answer() -> Vec<Step> {
    vec![
        send(SSE_HEAD),
        send(&token(" Paris")),
        send(&token(".")),
        send(USAGE_AND_DONE),
    ]
}

pub fn response(status_line: &str, body: &str) -> Vec<Step> {
    vec![send(&format!(
        "{status_line}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    ))]
}
