//! `emulator-load`: a small closed-loop HTTP load generator for the emulator benchmark
//! (`emulator/benches/emulator.sh`). Each worker keeps one connection open and sends completions
//! back to back; the result is one JSON line with requests/s and latency percentiles.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, Parser)]
struct Args {
    /// Emulator ports on 127.0.0.1, comma-separated; workers are spread over them.
    #[arg(long, value_delimiter = ',')]
    ports: Vec<u16>,
    /// Concurrent connections per port.
    #[arg(long, default_value_t = 1)]
    per_port: usize,
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    #[arg(long)]
    stream: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.ports.is_empty() {
        bail!("--ports is required");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let body = serde_json::json!({
        "prompt": "Benchmark the emulator's own overhead", "max_tokens": args.max_tokens,
        "temperature": 0, "ignore_eos": true, "stream": args.stream,
    })
    .to_string();
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let mut workers = Vec::new();
    for &port in &args.ports {
        for _ in 0..args.per_port {
            workers.push(tokio::spawn(worker(port, body.clone(), deadline)));
        }
    }
    let mut latencies = Vec::new();
    for w in workers {
        latencies.extend(w.await.context("worker")??);
    }
    latencies.sort();
    let n = latencies.len().max(1);
    let pct = |p: f64| {
        latencies
            .get(((n as f64 * p) as usize).min(n - 1))
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    let mean = latencies.iter().map(Duration::as_secs_f64).sum::<f64>() / n as f64 * 1e3;
    println!(
        "{}",
        serde_json::json!({
            "requests": latencies.len(), "rps": latencies.len() as f64 / args.seconds,
            "mean_ms": mean, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
        })
    );
    Ok(())
}

async fn worker(port: u16, body: String, deadline: Instant) -> anyhow::Result<Vec<Duration>> {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).await?;
    conn.set_nodelay(true)?;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut out = Vec::new();
    while Instant::now() < deadline {
        let t0 = Instant::now();
        conn.write_all(request.as_bytes()).await?;
        buf.clear();
        read_response(&mut conn, &mut buf).await?;
        out.push(t0.elapsed());
    }
    Ok(out)
}

/// Reads one response: by Content-Length, or chunked to its last chunk.
async fn read_response(conn: &mut TcpStream, buf: &mut Vec<u8>) -> anyhow::Result<()> {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed mid-response");
        }
        buf.extend_from_slice(&chunk[..n]);
        let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        if !head.starts_with("http/1.1 200") {
            bail!("unexpected response: {}", head.lines().next().unwrap_or_default());
        }
        if let Some(len) = head.lines().find_map(|l| l.strip_prefix("content-length:")) {
            if buf.len() >= head_end + 4 + len.trim().parse::<usize>()? {
                return Ok(());
            }
        } else if buf.ends_with(b"0\r\n\r\n") {
            return Ok(());
        }
    }
}
