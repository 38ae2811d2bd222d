//! The gateway end to end over real sockets with the vLLM emulator behind it: streams pass
//! through intact, refused endpoints are retried elsewhere, a mid-stream death follows the
//! stream contract, stale epochs change nothing, control endpoints are unreachable, the waiting
//! room releases requests to a new route (also those a dead pool refused with no retry budget
//! left), admission sheds batch first and then opens up, and an
//! answer that is not HTTP is a 502 that is not sent again.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use support::{
    Emulator, Router, completion, completion_of, counting_silent_endpoint, policy_route, read_head,
    read_until, request, route, send, streamed_text,
};
use understudy_emulator::local::ClosedPort;
use understudy_router::gateway::GatewayConfig;
use understudy_router::retry::RetryLimits;
use understudy_router::waiting_room::WaitingRoomConfig;

#[test]
fn a_stream_passes_through_intact_and_ends_with_done() {
    let e = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("a", 1, &[e.addr()])).status, 200);
    let direct = request(e.port, "POST", "/v1/completions", &[], &completion(24, true));
    let routed = r.complete(&completion(24, true), &[]);
    assert_eq!(routed.status, 200);
    assert_eq!(
        routed.header("content-type").as_deref(),
        Some("text/event-stream; charset=utf-8")
    );
    let (d, t) = (direct.text(), routed.text());
    assert!(!streamed_text(&d).is_empty());
    assert_eq!(streamed_text(&t), streamed_text(&d));
    assert_eq!(t.matches("data: ").count(), d.matches("data: ").count());
    assert!(t.ends_with("data: [DONE]\n\n"), "{t}");
    let plain = r.complete(&completion(8, false), &[]);
    assert_eq!(plain.status, 200);
    assert!(
        plain.json()["choices"][0]["text"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );
}

/// An endpoint that reads each request's head and answers with something that is not HTTP;
/// returns its address and the number of requests it read.
fn garbled_endpoint() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&requests);
    std::thread::spawn(move || {
        for mut s in listener.incoming().map_while(Result::ok) {
            read_head(&mut s);
            count.fetch_add(1, SeqCst);
            let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n\r\n");
        }
    });
    (addr, requests)
}

#[test]
fn an_answer_that_is_not_http_is_a_502_and_not_sent_again() {
    let (a, seen_a) = garbled_endpoint();
    let (b, seen_b) = garbled_endpoint();
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("a", 1, &[a, b])).status, 200);
    let reply = r.complete(&completion(4, false), &[]);
    assert_eq!(reply.status, 502, "{}", reply.text());
    assert!(reply.text().contains("malformed"), "{}", reply.text());
    assert_eq!(
        seen_a.load(SeqCst) + seen_b.load(SeqCst),
        1,
        "the request went to one endpoint once"
    );
}

/// An endpoint that accepts connections and reads requests but never answers; the connections
/// stay open while it lives.
fn silent_endpoint() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().map_while(Result::ok) {
            held.push(s);
        }
    });
    addr
}

#[test]
fn a_request_past_its_first_byte_timeout_is_a_504_and_never_sent_to_another_endpoint() {
    // The replica may be working on it: sending it again would generate twice.
    let (a, seen_a) = counting_silent_endpoint();
    let (b, seen_b) = counting_silent_endpoint();
    let config = GatewayConfig {
        first_byte_timeout: Duration::from_millis(300),
        ..GatewayConfig::default()
    };
    let r = Router::start(config, None);
    assert_eq!(r.put_route(&route("a", 1, &[a, b])).status, 200);
    let reply = r.complete(&completion(4, false), &[]);
    assert_eq!(reply.status, 504, "{}", reply.text());
    assert_eq!(
        seen_a.load(SeqCst) + seen_b.load(SeqCst),
        1,
        "sent once, to one endpoint"
    );
    r.wait_for_metrics("no retry", |m| m.contains("understudy_router_retries_total 0"));
}

#[test]
fn a_body_that_stops_half_way_gets_408_once_the_body_read_timeout_passes() {
    let e = Emulator::fast();
    let config = GatewayConfig {
        body_read_timeout: Duration::from_millis(300),
        ..GatewayConfig::default()
    };
    let r = Router::start(config, None);
    assert_eq!(r.put_route(&route("a", 1, &[e.addr()])).status, 200);
    let mut s = std::net::TcpStream::connect(("127.0.0.1", r.public)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // 100 bytes promised, ten sent, then nothing.
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":")
        .unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    // A whole body is served as ever.
    assert_eq!(r.complete(&completion(4, false), &[]).status, 200);
}

#[test]
fn a_replicas_4xx_is_passed_on_and_never_counts_against_the_endpoint() {
    // A request for a model the pool does not serve is the client's mistake, not the replica's.
    let e = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("a", 1, &[e.addr()])).status, 200);
    let wrong = serde_json::json!({"model": "not/served", "prompt": "x", "max_tokens": 4}).to_string();
    for _ in 0..10 {
        let reply = r.complete(&wrong, &[]);
        assert_eq!(reply.status, 404, "{}", reply.text());
    }
    let signals = r.admin_get("/signals").json();
    let endpoint = &signals["pools"][0]["endpoints"][0];
    assert_eq!(endpoint["ejected"], false, "{signals}");
    assert_eq!(endpoint["server_errors"], 0, "{signals}");
    assert!(signals["pools"][0]["signal"].is_null(), "{signals}");
    assert_eq!(r.complete(&completion(4, false), &[]).status, 200);
}

#[test]
fn a_client_that_goes_away_before_the_answer_is_not_counted_as_outstanding() {
    let endpoint = silent_endpoint();
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("a", 1, &[endpoint])).status, 200);
    let outstanding = || r.admin_get("/signals").json()["pools"][0]["endpoints"][0]["outstanding"].clone();
    let client = send(r.public, "POST", "/v1/completions", &[], &completion(4, false));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while outstanding() != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the request never reached the endpoint"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(client);
    while outstanding() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "still outstanding after the client left: {}",
            r.admin_get("/signals").json()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn requests_refused_by_a_killed_endpoint_succeed_on_another() {
    let alive = Emulator::fast();
    let killed = Emulator::fast();
    let killed_addr = killed.addr();
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(
        r.put_route(&route("a", 1, &[alive.addr(), killed_addr])).status,
        200
    );
    drop(killed);
    for _ in 0..20 {
        let reply = r.complete(&completion(4, false), &[]);
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let signals = r.admin_get("/signals").json();
    let pool = &signals["pools"][0];
    let killed_stats = pool["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["addr"] == killed_addr.to_string());
    assert!(
        killed_stats.unwrap()["refused"].as_u64().unwrap() >= 1,
        "{signals}"
    );
    assert!(pool["signal"].is_null(), "one endpoint still answers: {signals}");
    r.wait_for_metrics("a retry", |m| {
        m.contains("understudy_router_retries_total") && !m.contains("understudy_router_retries_total 0")
    });
}

#[test]
fn a_refused_try_past_the_retry_budget_is_counted_and_waits_for_an_endpoint_instead_of_failing() {
    let alive = Emulator::fast();
    let refusing = ClosedPort::bind();
    let config = GatewayConfig {
        retries: RetryLimits::NONE,
        ..GatewayConfig::default()
    };
    let r = Router::start(config, None);
    assert_eq!(
        r.put_route(&route("a", 1, &[alive.addr(), refusing.addr()]))
            .status,
        200
    );
    // Until one request has tried the refusing endpoint first (each one does about every other
    // time): no retry may be taken, so it waits for an endpoint and is served, not failed.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let reply = r.complete(&completion(4, false), &[]);
        assert_eq!(reply.status, 200, "{}", reply.text());
        let m = r.admin_get("/metrics").text();
        let overflowed = m
            .lines()
            .find_map(|l| l.strip_prefix("understudy_router_retry_overflow_total "))
            .and_then(|n| n.parse::<u64>().ok());
        if overflowed.is_some_and(|n| n > 0) {
            assert!(m.contains("understudy_router_retries_total 0"), "{m}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never tried the refusing endpoint first: {m}"
        );
    }
}

#[test]
fn a_pool_whose_every_endpoint_refuses_is_reported_as_all_refused_and_requests_get_503_with_retry_after() {
    let config = GatewayConfig {
        waiting_room: WaitingRoomConfig {
            bound: 16,
            deadline: Duration::from_millis(300),
        },
        ..GatewayConfig::default()
    };
    let r = Router::start(config, None);
    let dead = [ClosedPort::bind(), ClosedPort::bind()];
    assert_eq!(
        r.put_route(&route("a", 1, &[dead[0].addr(), dead[1].addr()]))
            .status,
        200
    );
    let reply = r.complete(&completion(4, false), &[]);
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert!(reply.header("retry-after").is_some());
    let signals = r.admin_get("/signals").json();
    assert_eq!(signals["pools"][0]["signal"], "AllRefused", "{signals}");
}

#[test]
fn a_stream_cut_mid_way_ends_with_a_retryable_error_event_and_never_done() {
    // Costs on: 60 tokens at 8 ms each keep the stream open long enough to kill the replica.
    let e = Emulator::start(&[], &[]);
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("a", 1, &[e.addr()])).status, 200);
    let mut s = send(r.public, "POST", "/v1/completions", &[], &completion(60, true));
    let mut raw = read_until(&mut s, "\"text\"");
    e.inject("crash");
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut s, &mut rest).unwrap();
    raw.extend_from_slice(&rest);
    let reply = support::parse(&raw);
    let body = reply.text();
    assert_eq!(reply.status, 200);
    assert!(body.contains("\"retryable\": true"), "{body}");
    assert!(
        !body.contains("[DONE]"),
        "a cut stream must never look finished: {body}"
    );
    assert!(
        body.trim_end().ends_with("}}"),
        "the error event is the last thing sent: {body}"
    );
}

#[test]
fn a_stale_epoch_gets_409_and_changes_nothing() {
    let b = Emulator::fast();
    let a = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("b", 5, &[b.addr()])).status, 200);
    let stale = r.put_route(&route("a", 4, &[a.addr()]));
    assert_eq!(stale.status, 409, "{}", stale.text());
    assert_eq!(stale.json()["highest_epoch"], 5);
    assert_eq!(
        r.put_route(&route("a", 5, &[a.addr()])).status,
        409,
        "same epoch, other pool"
    );
    assert_eq!(
        r.put_route(&route("b", 5, &[b.addr()])).status,
        200,
        "same epoch and pool: idempotent"
    );
    let now = r.admin_get("/route").json();
    assert_eq!(now["route"]["pool"], "b");
    assert_eq!(now["route"]["endpoints"][0], b.addr().to_string());
    assert_eq!(r.complete(&completion(4, false), &[]).status, 200);
    r.wait_for_metrics("the stale updates", |m| {
        m.contains("understudy_router_stale_routes_total 2")
    });
}

#[test]
fn the_highest_epoch_survives_a_router_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fence.json");
    let e = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), Some(file.clone()));
    assert_eq!(r.put_route(&route("b", 9, &[e.addr()])).status, 200);
    drop(r);
    let restarted = Router::start(GatewayConfig::default(), Some(file));
    assert_eq!(restarted.put_route(&route("a", 8, &[e.addr()])).status, 409);
    assert_eq!(restarted.put_route(&route("b", 9, &[e.addr()])).status, 200);
}

#[test]
fn the_admin_api_rejects_a_missing_or_wrong_token() {
    let r = Router::start(GatewayConfig::default(), None);
    let dead = ClosedPort::bind();
    let body = route("a", 1, &[dead.addr()]).to_string();
    assert_eq!(request(r.admin, "PUT", "/route", &[], &body).status, 401);
    assert_eq!(
        request(
            r.admin,
            "PUT",
            "/route",
            &[("authorization", "Bearer nope")],
            &body
        )
        .status,
        401
    );
    assert_eq!(request(r.admin, "GET", "/signals", &[], "").status, 401);
    assert!(r.routes.routes().is_empty());
}

#[test]
fn control_endpoints_are_not_reachable_through_the_public_port() {
    let e = Emulator::start(
        &["--emu-zero-cost", "--enable-sleep-mode"],
        &[("VLLM_SERVER_DEV_MODE", "1")],
    );
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("a", 1, &[e.addr()])).status, 200);
    for (method, path) in [
        ("POST", "/sleep?level=1"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/collective_rpc"),
        ("GET", "/server_info"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/v1/load_lora_adapter"),
        ("GET", "/metrics"),
    ] {
        let reply = request(r.public, method, path, &[], "{}");
        assert!(
            matches!(reply.status, 403 | 404),
            "{method} {path}: {}",
            reply.status
        );
    }
    let direct = request(e.port, "GET", "/is_sleeping", &[], "");
    assert_eq!(
        direct.json()["is_sleeping"],
        false,
        "the sleep call never reached the replica"
    );
}

#[test]
fn oversized_and_malformed_requests_get_a_clear_4xx() {
    let e = Emulator::fast();
    let config = GatewayConfig {
        max_body_bytes: 1024,
        ..GatewayConfig::default()
    };
    let r = Router::start(config, None);
    assert_eq!(r.put_route(&route("a", 1, &[e.addr()])).status, 200);
    let big = format!("{{\"prompt\": \"{}\"}}", "x".repeat(4096));
    assert_eq!(r.complete(&big, &[]).status, 413);
    let bad = r.complete("{\"prompt\": ", &[]);
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["type"], "invalid_request");
    assert_eq!(
        request(r.public, "DELETE", "/v1/completions", &[], "").status,
        405
    );
    assert_eq!(
        r.complete(&completion(4, false), &[("x-understudy-deadline-ms", "soon")])
            .status,
        400
    );
}

#[test]
fn the_waiting_room_releases_queued_requests_to_a_newly_pushed_route() {
    let e = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), None);
    let public = r.public;
    let waiting: Vec<_> = (0..5)
        .map(|_| {
            std::thread::spawn(move || {
                support::request(public, "POST", "/v1/completions", &[], &completion(4, false))
            })
        })
        .collect();
    r.wait_for_metrics("five waiting", |m| {
        m.contains("understudy_router_queue_depth 5\n")
    });
    assert_eq!(r.put_route(&route("b", 2, &[e.addr()])).status, 200);
    for w in waiting {
        let reply = w.join().unwrap();
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    r.wait_for_metrics("an empty room", |m| {
        m.contains("understudy_router_queue_depth 0\n")
    });
}

#[test]
fn requests_every_endpoint_refused_wait_for_the_next_route_even_with_no_retry_budget_left() {
    // No retries at all: every request's second try, on the other dead endpoint, finds the
    // budget empty. Nothing reached a replica, so it waits for the next route rather than fail.
    let config = GatewayConfig {
        retries: RetryLimits::NONE,
        ..GatewayConfig::default()
    };
    let r = Router::start(config, None);
    let dead = [ClosedPort::bind(), ClosedPort::bind()];
    assert_eq!(
        r.put_route(&route("a", 1, &[dead[0].addr(), dead[1].addr()]))
            .status,
        200
    );
    let public = r.public;
    let waiting: Vec<_> = (0..6)
        .map(|_| {
            std::thread::spawn(move || {
                support::request(public, "POST", "/v1/completions", &[], &completion(4, false))
            })
        })
        .collect();
    r.wait_for_metrics("six waiting", |m| m.contains("understudy_router_queue_depth 6\n"));
    let e = Emulator::fast();
    assert_eq!(r.put_route(&route("b", 2, &[e.addr()])).status, 200);
    for w in waiting {
        let reply = w.join().unwrap();
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
}

#[test]
fn admission_sheds_batch_first_and_returns_to_full_admission_after_the_window() {
    // Costs on, long streams: the held requests stay in flight while the others are judged.
    let e = Emulator::start(&[], &[]);
    let r = Router::start(GatewayConfig::default(), None);
    let mut with_admission = route("b", 3, &[e.addr()]);
    with_admission["admission"] = serde_json::json!({
        "window_s": 3.0, "initial_concurrency": 4, "max_concurrency": 4,
        "initial_prefill_tokens": 100000, "max_prefill_tokens": 100000
    });
    assert_eq!(r.put_route(&with_admission).status, 200);
    // Budget 4: batch may fill 1.6 (one request), default 3, interactive 4.
    let interactive = [("x-understudy-priority", "interactive")];
    let batch = [("x-understudy-priority", "batch")];
    let mut held: Vec<_> = (0..2)
        .map(|_| {
            let mut s = send(
                r.public,
                "POST",
                "/v1/completions",
                &interactive,
                &completion(2000, true),
            );
            read_until(&mut s, "\"text\"");
            s
        })
        .collect();
    let shed = r.complete(&completion(4, false), &batch);
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert!(shed.header("retry-after").is_some());
    let mut third = send(
        r.public,
        "POST",
        "/v1/completions",
        &interactive,
        &completion(2000, true),
    );
    read_until(&mut third, "\"text\"");
    held.push(third);
    // 3 in flight: default (share 3) is shed now too, interactive still has room.
    assert_eq!(r.complete(&completion(4, false), &[]).status, 429);
    assert_eq!(r.complete(&completion(4, false), &interactive).status, 200);
    r.wait_for_metrics("batch shed", |m| {
        m.contains("understudy_router_shed_total{reason=\"concurrency\",priority=\"batch\"} 1")
    });
    // After the window, batch goes through even with the same load still in flight.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let reply = r.complete(&completion(4, false), &batch);
        if reply.status == 200 {
            break;
        }
        assert_eq!(reply.status, 429);
        assert!(std::time::Instant::now() < deadline, "admission never opened up");
        std::thread::sleep(Duration::from_millis(100));
    }
    let burst: Vec<_> = (0..8)
        .map(|_| {
            let p = r.public;
            std::thread::spawn(move || {
                request(
                    p,
                    "POST",
                    "/v1/completions",
                    &[("x-understudy-priority", "batch")],
                    &completion(4, false),
                )
            })
        })
        .collect();
    for b in burst {
        let reply = b.join().unwrap();
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    for mut s in held {
        // Still streaming: the load was in flight the whole time.
        read_until(&mut s, "\"text\"");
    }
}

#[test]
fn after_a_promotion_one_tenants_burst_cannot_keep_another_tenant_out() {
    let e = Emulator::start(&[], &[]);
    let r = Router::start(GatewayConfig::default(), None);
    let mut with_admission = route("b", 3, &[e.addr()]);
    with_admission["admission"] = serde_json::json!({
        "window_s": 60.0, "initial_concurrency": 4, "max_concurrency": 4,
        "initial_prefill_tokens": 100000, "max_prefill_tokens": 100000
    });
    assert_eq!(r.put_route(&with_admission).status, 200);
    // Tenants are told apart by their API key; interactive, so the whole budget of 4 is theirs.
    let tenant = |key: &'static str| [("authorization", key), ("x-understudy-priority", "interactive")];
    let (noisy, quiet) = (tenant("Bearer key-noisy"), tenant("Bearer key-quiet"));
    let stream = |headers: &[(&str, &str)]| {
        let mut s = send(
            r.public,
            "POST",
            "/v1/completions",
            headers,
            &completion(2000, true),
        );
        read_until(&mut s, "\"text\"");
        s
    };
    // The noisy tenant takes all four places before the quiet one asks.
    let mut held: Vec<_> = (0..4).map(|_| stream(&noisy)).collect();
    let shut_out = r.complete(&completion(4, false), &quiet);
    assert_eq!(shut_out.status, 429, "{}", shut_out.text());
    // Two of its streams end: the places go to the quiet tenant, not back to the noisy one.
    held.truncate(2);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while r.complete(&completion(4, false), &quiet).status != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the quiet tenant never got in"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    held.extend((0..2).map(|_| stream(&quiet)));
    let again = r.complete(&completion(4, false), &noisy);
    assert_eq!(again.status, 429, "{}", again.text());
    assert!(again.text().contains("tenant_share"), "{}", again.text());
    r.wait_for_metrics("a tenant share shed", |m| {
        m.contains("understudy_router_shed_total{reason=\"tenant_share\",priority=\"interactive\"} 1")
    });
}

#[test]
fn the_policys_priority_header_and_shed_priorities_decide_who_is_refused_in_the_window() {
    let e = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), None);
    let mut with_admission = route("b", 3, &[e.addr()]);
    with_admission["admission"] = serde_json::json!({
        "window_s": 600.0, "priority_header": "x-tier", "shed_priorities": ["low"]
    });
    assert_eq!(r.put_route(&with_admission).status, 200);
    let shed = r.complete(&completion(4, false), &[("x-tier", "low")]);
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert!(shed.header("retry-after").is_some());
    // Another value, or the value under the default header, is admitted.
    assert_eq!(
        r.complete(&completion(4, false), &[("x-tier", "interactive")])
            .status,
        200
    );
    assert_eq!(
        r.complete(&completion(4, false), &[("x-understudy-priority", "low")])
            .status,
        200
    );
    r.wait_for_metrics("shed for its priority", |m| {
        m.contains("understudy_router_shed_total{reason=\"priority\",priority=\"default\"} 1")
            && m.contains(
                "understudy_router_requests_total{outcome=\"forwarded\",priority=\"interactive\"} 1",
            )
    });
    // Without a window nothing is shed for its priority.
    with_admission["epoch"] = serde_json::json!(4);
    with_admission["admission"]["window_s"] = serde_json::json!(0.0);
    assert_eq!(r.put_route(&with_admission).status, 200);
    assert_eq!(
        r.complete(&completion(4, false), &[("x-tier", "low")]).status,
        200
    );
}

#[test]
fn while_nothing_can_take_requests_batch_is_shed_from_the_waiting_room_first_and_a_client_deadline_is_kept() {
    let config = GatewayConfig {
        waiting_room: WaitingRoomConfig {
            bound: 5,
            // Far past the client's read timeout: only the client's own deadline can answer it.
            deadline: Duration::from_secs(600),
        },
        ..GatewayConfig::default()
    };
    let r = Arc::new(Router::start(config, None));
    let dead = ClosedPort::bind();
    assert_eq!(r.put_route(&route("a", 1, &[dead.addr()])).status, 200);
    let batch = [("x-understudy-priority", "batch")];
    // Batch may hold two of the five seats (two fifths); the third batch request is shed.
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let r = Arc::clone(&r);
            std::thread::spawn(move || r.complete(&completion(4, false), &batch).status)
        })
        .collect();
    r.wait_for_metrics("two waiting", |m| m.contains("understudy_router_queue_depth 2\n"));
    let shed = r.complete(&completion(4, false), &batch);
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert!(shed.header("retry-after").is_some());
    r.wait_for_metrics("shed from the room", |m| {
        m.contains("understudy_router_shed_total{reason=\"waiting_room\",priority=\"batch\"} 1")
    });
    // A client that said it waits 300 ms is answered then, not after the room's ten minutes.
    let impatient = r.complete(
        &completion(4, false),
        &[
            ("x-understudy-priority", "interactive"),
            ("x-understudy-deadline-ms", "300"),
        ],
    );
    assert_eq!(impatient.status, 503, "{}", impatient.text());
    // The pool comes back: the batch requests that got a seat are served.
    let alive = Emulator::fast();
    assert_eq!(r.put_route(&route("b", 2, &[alive.addr()])).status, 200);
    for w in waiting {
        assert_eq!(w.join().unwrap(), 200);
    }
}

#[test]
fn two_policies_behind_one_router_take_their_own_models_and_fail_over_apart() {
    let serving = |name: &str| Emulator::start(&["--emu-zero-cost", "--served-model-name", name], &[]);
    let (chat_east, chat_west, code) = (serving("chat"), serving("chat"), serving("code"));
    let r = Router::start(GatewayConfig::default(), None);
    let of = |policy: &str, model: &str, pool: &str, epoch: u64, at: SocketAddr| {
        policy_route(policy, model, pool, epoch, &[at])
    };
    assert_eq!(
        r.put_route(&of("ns/chat", "chat", "east", 3, chat_east.addr()))
            .status,
        200
    );
    // Another policy's epochs are its own: 1 is not stale beside chat's 3.
    assert_eq!(
        r.put_route(&of("ns/code", "code", "x", 1, code.addr())).status,
        200
    );
    let ask = |model: &str| r.complete(&completion_of(model), &[]);
    assert_eq!(ask("chat").status, 200);
    assert_eq!(ask("code").status, 200);
    let unknown = ask("other");
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    assert_eq!(unknown.json()["error"]["type"], "model_not_found");
    // Chat fails over; code is not touched.
    drop(chat_east);
    assert_eq!(
        r.put_route(&of("ns/chat", "chat", "west", 4, chat_west.addr()))
            .status,
        200
    );
    for _ in 0..5 {
        assert_eq!(ask("chat").status, 200);
        assert_eq!(ask("code").status, 200);
    }
    let held = |policy: &str| r.admin_get(&format!("/route?policy={policy}")).json();
    assert_eq!(
        (
            held("ns/chat")["route"]["pool"].clone(),
            held("ns/chat")["route"]["epoch"].clone()
        ),
        ("west".into(), 4.into())
    );
    assert_eq!(held("ns/code")["route"]["epoch"], 1);
    assert_eq!(held("ns/code")["highest"]["epoch"], 1);
    // Each policy's own epochs decide what is stale.
    assert_eq!(
        r.put_route(&of("ns/chat", "chat", "east", 2, code.addr())).status,
        409
    );
    assert_eq!(
        r.put_route(&of("ns/code", "code", "y", 2, code.addr())).status,
        200
    );
    let m = r.admin_get("/metrics").text();
    assert!(
        m.contains("understudy_router_epoch{policy=\"ns/chat\"} 4\n"),
        "{m}"
    );
    assert!(
        m.contains("understudy_router_epoch{policy=\"ns/code\"} 2\n"),
        "{m}"
    );
    let signals = r.admin_get("/signals").json();
    assert_eq!(signals["pools"][0]["policy"], "ns/chat", "{signals}");
    assert_eq!(signals["pools"][1]["policy"], "ns/code", "{signals}");
}

#[test]
fn a_request_waiting_when_a_second_policy_arrives_takes_the_route_of_its_model() {
    let code = Emulator::start(&["--emu-zero-cost", "--served-model-name", "code"], &[]);
    let dead = ClosedPort::bind();
    let r = Arc::new(Router::start(GatewayConfig::default(), None));
    let of = |policy: &str, model: &str, epoch: u64, at: SocketAddr| {
        policy_route(policy, model, "pool", epoch, &[at])
    };
    // One policy, whose only replica is down: a request for the other model waits with it,
    // read before the router knew it would serve two.
    assert_eq!(r.put_route(&of("ns/chat", "chat", 1, dead.addr())).status, 200);
    let waiting = {
        let r = Arc::clone(&r);
        std::thread::spawn(move || r.complete(&completion_of("code"), &[]).status)
    };
    r.wait_for_metrics("the request waiting", |m| {
        m.contains("understudy_router_queue_depth 1\n")
    });
    assert_eq!(r.put_route(&of("ns/code", "code", 1, code.addr())).status, 200);
    assert_eq!(waiting.join().unwrap(), 200, "served by the route of its model");
}

#[test]
fn the_shapes_of_routed_requests_are_served_for_load_proofs_without_their_text_or_probes() {
    let e = Emulator::fast();
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("a", 1, &[e.addr()])).status, 200);
    let secret =
        serde_json::json!({"prompt": "a secret prompt of 32 characters", "max_tokens": 5}).to_string();
    assert_eq!(r.complete(&secret, &[]).status, 200);
    assert_eq!(
        r.complete(&completion(3, true), &[("x-understudy-priority", "batch")])
            .status,
        200
    );
    // A probe is no user's traffic.
    assert_eq!(
        r.complete(&completion(9, false), &[("x-understudy-probe", "1")])
            .status,
        200
    );
    let sample = r.admin_get("/shapes").json();
    let shapes = sample["shapes"].as_array().unwrap();
    assert_eq!(shapes.len(), 2, "{sample}");
    assert_eq!(shapes[0]["promptTokens"], 8, "{sample}");
    assert_eq!(shapes[0]["maxTokens"], 5, "{sample}");
    assert_eq!(shapes[0]["stream"], false, "{sample}");
    assert_eq!(shapes[1]["maxTokens"], 3, "{sample}");
    assert_eq!(shapes[1]["stream"], true, "{sample}");
    assert_eq!(shapes[1]["priority"], "batch", "{sample}");
    assert!(!sample.to_string().contains("secret"), "{sample}");
    // Another policy's sample is its own; the admin token is required.
    assert_eq!(
        r.admin_get("/shapes?policy=ns/other").json()["shapes"],
        serde_json::json!([])
    );
    assert_eq!(request(r.admin, "GET", "/shapes", &[], "").status, 401);
}
