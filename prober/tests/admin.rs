//! The watch loop and the admin port over real sockets: `/round` is 503 until the first round and
//! then the round's outcomes as JSON, `/metrics` is Prometheus text counting them, and rounds
//! come once per interval (paused time).

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use understudy_core::Pool;
use understudy_prober::admin::{self, Published, Watch};
use understudy_prober::probe::{Budget, Expectation, ProbeSpec};

mod support;

use support::{GarblingServer, good_answer, response};

/// Budgets far beyond anything loopback takes, so `Ok` never depends on the machine's speed.
fn spec() -> ProbeSpec {
    ProbeSpec {
        expect: Expectation::Prefix(" Paris".into()),
        budget: Budget {
            first_token: Duration::from_secs(60),
            total: Duration::from_secs(60),
        },
        timeout: Duration::from_secs(120),
        check_sleep: false,
        ..ProbeSpec::default()
    }
}

/// A healthy replica and one whose engine answers 500.
async fn replicas() -> (GarblingServer, GarblingServer) {
    let good = GarblingServer::start(Arc::new(|_: &str| good_answer())).await;
    let dead = GarblingServer::start(Arc::new(|_: &str| {
        response("HTTP/1.1 500 Internal Server Error", "{}")
    }))
    .await;
    (good, dead)
}

fn watch(endpoints: &[&GarblingServer], max_jitter: Duration) -> Watch {
    Watch {
        pool: Pool::A,
        endpoints: endpoints.iter().map(|s| s.endpoint.clone()).collect(),
        spec: spec(),
        seed: 7,
        max_jitter,
        min_serving: 1,
    }
}

async fn start_admin(published: &Published) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = admin::serve(listener, admin::Limits::default(), published.clone());
    (addr, tokio::spawn(serving))
}

/// One plain HTTP/1.1 GET; the status code and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_owned())
}

/// Parses OpenMetrics text strictly enough to fail on anything malformed: every sample line is
/// `name{labels} value` with a number for the value, and the text ends with `# EOF`.
fn parse_metrics(text: &str) -> HashMap<String, f64> {
    assert_eq!(text.lines().last(), Some("# EOF"), "{text}");
    let mut samples = HashMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line:?}"));
        let name_end = series.find('{').unwrap_or(series.len());
        assert!(
            series[..name_end]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line:?}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "{line:?}");
        }
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line:?}"));
        samples.insert(series.to_owned(), value);
    }
    samples
}

fn probes_total(samples: &HashMap<String, f64>, endpoint: &str, outcome: &str) -> f64 {
    let series =
        format!(r#"understudy_prober_probes_total{{pool="A",endpoint="{endpoint}",outcome="{outcome}"}}"#);
    samples.get(&series).copied().unwrap_or(0.0)
}

#[tokio::test]
async fn round_is_503_until_the_first_round_then_the_outcomes_and_metrics_count_them() {
    let (good, dead) = replicas().await;
    let published = Published::default();
    let (addr, server) = start_admin(&published).await;

    assert_eq!(get(addr, "/live").await.0, 200);
    assert_eq!(get(addr, "/ready").await.0, 503, "not ready before a round");
    assert_eq!(get(addr, "/round").await.0, 503, "no round to serve yet");

    let watch = watch(&[&good, &dead], Duration::ZERO);
    watch.round(0, &published).await;

    assert_eq!(get(addr, "/ready").await.0, 200);
    let (code, body) = get(addr, "/round").await;
    assert_eq!(code, 200, "{body}");
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["pools"][0]["pool"], "A");
    assert_eq!(
        doc["pools"][0]["verdict"], "Pass",
        "one of two serves, min serving 1"
    );
    let replicas = &doc["pools"][0]["replicas"];
    assert_eq!(replicas[0]["endpoint"], good.endpoint.to_string());
    assert_eq!(replicas[0]["outcome"], "ok");
    assert_eq!(replicas[0]["text"], " Paris.");
    assert_eq!(replicas[1]["endpoint"], dead.endpoint.to_string());
    assert_eq!(replicas[1]["outcome"], "http-error");
    assert_eq!(replicas[1]["http_status"], 500);

    watch.round(1, &published).await;
    let (code, text) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let samples = parse_metrics(&text);
    let (good, dead) = (good.endpoint.to_string(), dead.endpoint.to_string());
    assert_eq!(probes_total(&samples, &good, "ok"), 2.0, "{text}");
    assert_eq!(probes_total(&samples, &dead, "http-error"), 2.0, "{text}");
    assert_eq!(probes_total(&samples, &dead, "ok"), 0.0, "{text}");
    let first_token = format!(r#"understudy_prober_first_token_seconds_count{{pool="A",endpoint="{good}"}}"#);
    assert_eq!(samples.get(&first_token), Some(&2.0), "{text}");
    server.abort();
}

#[tokio::test(start_paused = true)]
async fn the_watch_loop_probes_once_per_interval_after_seeded_jitter() {
    let (good, dead) = replicas().await;
    let published = Published::default();
    let interval = Duration::from_secs(10);
    let max_jitter = Duration::from_secs(2);
    let loop_ = tokio::spawn(watch(&[&good, &dead], max_jitter).run(interval, published.clone()));

    // Rounds start at 0 s, 10 s and 20 s, each probe within 2 s of its round's start.
    tokio::time::sleep(Duration::from_secs(25)).await;
    let samples = parse_metrics(&published.metrics().encode());
    assert_eq!(probes_total(&samples, &good.endpoint.to_string(), "ok"), 3.0);
    assert_eq!(
        probes_total(&samples, &dead.endpoint.to_string(), "http-error"),
        3.0
    );

    // Before 30 s no fourth round has started.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(good.paths.lock().unwrap().len(), 3, "one probe per round");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        good.paths.lock().unwrap().len(),
        4,
        "the fourth round came at 30 s"
    );
    loop_.abort();
}
