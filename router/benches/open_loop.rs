//! An open-loop load generator for `vs-nginx.sh`: requests arriving at a fixed mean rate (a
//! Poisson process) over keep-alive connections, latency measured from the moment each request
//! arrives (a slow answer does not slow the schedule), loopback only. Arrivals wait in a queue as
//! long as there are connections; one that finds the queue full counts as late and waits for room.
//!
//!   open_loop ADDR PATH RATE SECONDS [CONNECTIONS] [BODY]
//!
//! Prints `answered p50_us p99_us late`: the requests answered with a 2xx (latencies are theirs)
//! and the late arrivals. It does not reconnect: a target that closes connections loses them.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        args.len() >= 5,
        "open_loop ADDR PATH RATE SECONDS [CONNECTIONS] [BODY]"
    );
    let addr: std::net::SocketAddr = args[1].parse()?;
    anyhow::ensure!(addr.ip().is_loopback(), "loopback only");
    let path = args[2].clone();
    let rate: f64 = args[3].parse()?;
    let secs: f64 = args[4].parse()?;
    let conns: usize = args.get(5).map_or(Ok(64), |s| s.parse())?;
    let body: Option<Bytes> = args.get(6).map(|b| Bytes::from(b.clone()));
    let total = (rate * secs) as usize;
    let start = Instant::now() + Duration::from_millis(100);
    let (tx, rx) = async_channel(conns);
    let mut workers = Vec::new();
    for _ in 0..conns {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let rx = rx.clone();
        let (path, body) = (path.clone(), body.clone());
        workers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while let Ok(due) = rx.recv().await {
                let req = Request::builder()
                    .method(if body.is_some() { "POST" } else { "GET" })
                    .uri(&path)
                    .header("host", "127.0.0.1")
                    .header("content-type", "application/json")
                    .body(Full::new(body.clone().unwrap_or_default()));
                let Ok(req) = req else { break };
                if sender.ready().await.is_err() {
                    break;
                }
                let Ok(resp) = sender.send_request(req).await else {
                    break;
                };
                let ok = resp.status().is_success();
                if resp.into_body().collect().await.is_err() || !ok {
                    continue;
                }
                lat.push(due.elapsed());
            }
            lat
        }));
    }
    // Arrivals are a Poisson process (exponential gaps, mean 1/rate, fixed seed), timed by a
    // thread of their own that sleeps until each one is due: tokio's timer ticks in milliseconds
    // and would hand requests out in bursts (5 at once every millisecond at 5,000 req/s), which a
    // one-worker proxy must then serve one after the other.
    let pacer = std::thread::spawn(move || {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut due = start.into_std();
        let mut late = 0usize;
        for _ in 0..total {
            let now = std::time::Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let handed = Instant::now();
            match tx.try_send(handed) {
                Ok(()) => {}
                Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                    late += 1;
                    if tx.blocking_send(handed).is_err() {
                        break;
                    }
                }
                Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => break,
            }
            due += Duration::from_secs_f64(-(1.0 - rng.f64()).ln() / rate);
        }
        late
    });
    let late = tokio::task::spawn_blocking(move || pacer.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the pacer panicked"))?;
    let mut all = Vec::with_capacity(total);
    for w in workers {
        all.extend(w.await?);
    }
    all.sort();
    let q = |p: f64| all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)));
    let us = |d: Option<&Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e6);
    println!("{} {:.1} {:.1} {late}", all.len(), us(q(0.5)), us(q(0.99)));
    Ok(())
}

/// A multi-consumer queue of scheduled start times (tokio has none built in): a bounded mpsc
/// behind a mutex that only the idle connections contend for.
fn async_channel(bound: usize) -> (tokio::sync::mpsc::Sender<Instant>, Shared) {
    let (tx, rx) = tokio::sync::mpsc::channel(bound);
    (tx, Shared(std::sync::Arc::new(tokio::sync::Mutex::new(rx))))
}

#[derive(Clone)]
struct Shared(std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Instant>>>);

impl Shared {
    async fn recv(&self) -> Result<Instant, ()> {
        self.0.lock().await.recv().await.ok_or(())
    }
}
