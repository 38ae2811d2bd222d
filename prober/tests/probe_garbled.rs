//! Probes against a hand-rolled raw-TCP server that answers whatever a test scripts: statuses
//! out of range, empty bodies, connections cut mid-response, invalid SSE, answers that come
//! after the timeout. Each case must come to the same outcome every time, and nothing panics.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::probe::{self, Budget, Endpoint, Expectation, ProbeSpec};

mod support;

use support::{GarblingServer, SSE_HEAD, Step, USAGE_AND_DONE, good_answer, response, send, token};

/// Budgets and the timeout are far beyond anything loopback takes, so `Ok` never depends on the
/// machine's speed; tests that want a timeout or a slow answer tighten them and make the server
/// wait longer than that.
fn spec() -> ProbeSpec {
    ProbeSpec {
        expect: Expectation::Prefix(" Paris".into()),
        budget: Budget {
            first_token: Duration::from_secs(60),
            total: Duration::from_secs(60),
        },
        timeout: Duration::from_secs(120),
        stall_after: Duration::from_millis(300),
        check_sleep: false,
        ..ProbeSpec::default()
    }
}

/// Probes three times against a fresh server playing `script`; asserts the outcome never varies.
async fn outcome_of(
    script: impl Fn(&str) -> Vec<Step> + Send + Sync + 'static,
    spec: &ProbeSpec,
) -> ProbeOutcome {
    let server = GarblingServer::start(Arc::new(script)).await;
    let first = probe::probe(&server.endpoint, spec).await.outcome;
    for _ in 0..2 {
        assert_eq!(
            probe::probe(&server.endpoint, spec).await.outcome,
            first,
            "the same input, another outcome"
        );
    }
    first
}

fn strip_timing(o: ProbeOutcome) -> ProbeOutcome {
    match o {
        ProbeOutcome::Ok { .. } => ProbeOutcome::Ok {
            first_token: Duration::ZERO,
            total: Duration::ZERO,
        },
        other => other,
    }
}

#[tokio::test]
async fn a_well_formed_right_answer_is_ok_and_carries_probe_markers() {
    let server = GarblingServer::start(Arc::new(|_: &str| good_answer())).await;
    let report = probe::probe(&server.endpoint, &spec()).await;
    assert_eq!(report.text, " Paris.");
    assert!(matches!(report.outcome, ProbeOutcome::Ok { .. }), "{report:?}");
    assert!(report.first_token.unwrap() <= report.total.unwrap());
    assert_eq!(*server.paths.lock().unwrap(), vec!["/v1/completions".to_string()]);
}

#[tokio::test]
async fn a_connection_reset_before_or_during_the_answer_is_a_reset_and_a_hard_failure() {
    let before = outcome_of(|_: &str| vec![Step::Reset], &spec()).await;
    let during = outcome_of(
        |_: &str| vec![send(SSE_HEAD), send(&token(" Paris")), Step::Reset],
        &spec(),
    )
    .await;
    for outcome in [before, during] {
        assert_eq!(outcome, ProbeOutcome::Reset);
        assert!(outcome.is_hard_failure());
    }
}

#[tokio::test]
async fn statuses_out_of_range_are_http_errors_with_the_code_as_sent() {
    for (line, code) in [
        ("HTTP/1.1 99 Odd", 99),
        ("HTTP/1.1 600 Odd", 600),
        ("HTTP/1.1 1000 Odd", 1000),
    ] {
        let outcome = outcome_of(move |_: &str| response(line, "{}"), &spec()).await;
        assert_eq!(outcome, ProbeOutcome::HttpError(code), "{line}");
    }
}

#[tokio::test]
async fn an_engine_500_is_an_http_error_and_a_fences_503_is_fenced() {
    let dead = outcome_of(
        |_: &str| response("HTTP/1.1 500 Internal Server Error", "{}"),
        &spec(),
    )
    .await;
    assert_eq!(dead, ProbeOutcome::HttpError(500));
    let fenced = outcome_of(
        |_: &str| {
            vec![send(
                "HTTP/1.1 503 Service Unavailable\r\nx-understudy-fenced: 7\r\ncontent-length: 0\r\n\r\n",
            )]
        },
        &spec(),
    )
    .await;
    assert_eq!(fenced, ProbeOutcome::Fenced);
    let unfenced = outcome_of(
        |_: &str| response("HTTP/1.1 503 Service Unavailable", ""),
        &spec(),
    )
    .await;
    assert_eq!(
        unfenced,
        ProbeOutcome::HttpError(503),
        "a 503 without the fence header is the engine's"
    );
}

#[tokio::test]
async fn an_empty_200_body_and_a_connection_cut_mid_stream_are_resets() {
    let empty = outcome_of(|_: &str| response("HTTP/1.1 200 OK", ""), &spec()).await;
    assert_eq!(empty, ProbeOutcome::Reset);
    let cut = outcome_of(|_: &str| vec![send(SSE_HEAD), send(&token(" Paris"))], &spec()).await;
    assert_eq!(
        cut,
        ProbeOutcome::Reset,
        "a cut stream never looks like a clean finish"
    );
    let cut_chunked = outcome_of(
        |_: &str| {
            vec![
                send("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"),
                send("40\r\ndata: {\"choices\":[{\"text\":\" Par"),
            ]
        },
        &spec(),
    )
    .await;
    assert_eq!(cut_chunked, ProbeOutcome::Reset);
    let not_http = outcome_of(|_: &str| vec![send("hello there\r\n\r\n")], &spec()).await;
    assert_eq!(not_http, ProbeOutcome::Reset);
}

#[tokio::test]
async fn a_stream_closed_before_done_is_a_reset_wherever_the_cut_falls() {
    let body = format!("{}{}{USAGE_AND_DONE}", token(" Paris"), token("."));
    let done_at = body.find("data: [DONE]").unwrap() + "data: [DONE]\n\n".len();
    // Event boundaries, inside events, and every seventh byte besides, short of the whole [DONE].
    let mut cuts: Vec<usize> = (0..done_at).step_by(7).collect();
    cuts.extend(
        body.match_indices("\n\n")
            .map(|(i, _)| i + 2)
            .filter(|&i| i < done_at),
    );
    cuts.extend([1, token(" Paris").len() - 1, done_at - 1, done_at - 2]);
    cuts.sort_unstable();
    cuts.dedup();
    for cut in cuts {
        let sent = format!("{SSE_HEAD}{}", &body[..cut]);
        let outcome = outcome_of(move |_: &str| vec![send(&sent)], &spec()).await;
        assert_eq!(
            outcome,
            ProbeOutcome::Reset,
            "cut at byte {cut}: {:?}",
            &body[..cut]
        );
    }
}

#[tokio::test]
async fn invalid_sse_and_a_json_body_instead_of_a_stream_are_wrong_output() {
    let garbage = outcome_of(|_: &str| vec![send(SSE_HEAD), send("hello world\n\n")], &spec()).await;
    assert_eq!(garbage, ProbeOutcome::WrongOutput);
    let bad_json = outcome_of(
        |_: &str| vec![send(SSE_HEAD), send("data: {\"choices\":[{\"te\n\n")],
        &spec(),
    )
    .await;
    assert_eq!(bad_json, ProbeOutcome::WrongOutput);
    let not_streamed = outcome_of(
        |_: &str| response("HTTP/1.1 200 OK", "{\"choices\":[{\"text\":\" Paris\"}]}"),
        &spec(),
    )
    .await;
    assert_eq!(not_streamed, ProbeOutcome::WrongOutput);
}

#[tokio::test]
async fn an_error_event_after_a_token_is_the_engines_http_error() {
    let outcome = outcome_of(
        |_: &str| {
            vec![
                send(SSE_HEAD),
                send(&token(" Paris")),
                send("data: {\"error\":{\"message\":\"EngineCore died\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\n"),
                send("data: [DONE]\n\n"),
            ]
        },
        &spec(),
    )
    .await;
    assert_eq!(outcome, ProbeOutcome::HttpError(500));
}

#[tokio::test]
async fn a_timeout_then_a_late_answer_is_a_timeout_every_time() {
    let late = |_: &str| {
        let mut steps = vec![Step::Wait(Duration::from_secs(60))];
        steps.extend(good_answer());
        steps
    };
    let mut quick = spec();
    quick.timeout = Duration::from_millis(300);
    assert_eq!(outcome_of(late, &quick).await, ProbeOutcome::Timeout);
    let head_then_nothing = |_: &str| vec![send(SSE_HEAD), Step::Hang];
    assert_eq!(outcome_of(head_then_nothing, &quick).await, ProbeOutcome::Timeout);
}

#[tokio::test]
async fn a_token_then_silence_is_a_stall() {
    let stall = |_: &str| vec![send(SSE_HEAD), send(&token(" Paris")), Step::Hang];
    assert_eq!(outcome_of(stall, &spec()).await, ProbeOutcome::Stalled);
}

#[tokio::test]
async fn a_right_answer_after_the_first_token_budget_is_too_slow_and_a_wrong_one_is_wrong() {
    let slow = |_: &str| {
        let mut steps = vec![send(SSE_HEAD), Step::Wait(Duration::from_millis(400))];
        steps.extend(good_answer().into_iter().skip(1));
        steps
    };
    let mut tight = spec();
    tight.budget.first_token = Duration::from_millis(100);
    assert_eq!(outcome_of(slow, &tight).await, ProbeOutcome::TooSlow);
    let wrong = |_: &str| vec![send(SSE_HEAD), send(&token(" Lyon")), send(USAGE_AND_DONE)];
    assert_eq!(outcome_of(wrong, &spec()).await, ProbeOutcome::WrongOutput);
    let nothing = |_: &str| vec![send(SSE_HEAD), send(USAGE_AND_DONE)];
    assert_eq!(
        outcome_of(nothing, &spec()).await,
        ProbeOutcome::WrongOutput,
        "an empty answer"
    );
}

#[tokio::test]
async fn a_sleeping_replica_is_never_sent_generation() {
    let by_flag = GarblingServer::start(Arc::new(|path: &str| match path {
        "/is_sleeping" => response("HTTP/1.1 200 OK", "{\"is_sleeping\":true}"),
        _ => good_answer(),
    }))
    .await;
    let spec = ProbeSpec {
        check_sleep: true,
        ..spec()
    };
    assert_eq!(
        probe::probe(&by_flag.endpoint, &spec).await.outcome,
        ProbeOutcome::Asleep
    );
    assert_eq!(*by_flag.paths.lock().unwrap(), vec!["/is_sleeping".to_string()]);

    // Without dev mode `/is_sleeping` is a 404; the sleep-state metric tells instead.
    let by_metric = GarblingServer::start(Arc::new(|path: &str| match path {
        "/is_sleeping" => response("HTTP/1.1 404 Not Found", "{\"detail\":\"Not Found\"}"),
        "/metrics" => response(
            "HTTP/1.1 200 OK",
            "vllm:engine_sleep_state{engine=\"0\",model_name=\"m\",sleep_state=\"awake\"} 0.0\n",
        ),
        _ => good_answer(),
    }))
    .await;
    assert_eq!(
        probe::probe(&by_metric.endpoint, &spec).await.outcome,
        ProbeOutcome::Asleep
    );
    assert!(
        !by_metric
            .paths
            .lock()
            .unwrap()
            .contains(&"/v1/completions".to_string())
    );

    let awake = GarblingServer::start(Arc::new(|path: &str| match path {
        "/is_sleeping" => response("HTTP/1.1 200 OK", "{\"is_sleeping\":false}"),
        _ => good_answer(),
    }))
    .await;
    let outcome = probe::probe(&awake.endpoint, &spec).await.outcome;
    assert_eq!(
        strip_timing(outcome),
        strip_timing(ProbeOutcome::Ok {
            first_token: Duration::ZERO,
            total: Duration::ZERO
        })
    );
}

#[tokio::test]
async fn a_closed_port_is_refused() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let report = probe::probe(
        &Endpoint::new("127.0.0.1", port),
        &ProbeSpec {
            check_sleep: true,
            ..spec()
        },
    )
    .await;
    assert_eq!(report.outcome, ProbeOutcome::Refused);
}

#[tokio::test]
async fn random_bytes_never_panic_the_prober_and_always_get_one_outcome() {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut quick = spec();
    quick.timeout = Duration::from_millis(200);
    quick.stall_after = Duration::from_millis(100);
    for case in 0..40 {
        let len = (next() % 300) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if case % 2 == 0 {
            // Half the cases start like a real stream and garble after.
            let mut head = format!("{SSE_HEAD}{}", token(" Paris")).into_bytes();
            head.append(&mut bytes);
            bytes = head;
        }
        let server = GarblingServer::start(Arc::new(move |_: &str| vec![Step::Send(bytes.clone())])).await;
        let report = probe::probe(&server.endpoint, &quick).await;
        assert!(
            !matches!(report.outcome, ProbeOutcome::Ok { .. }),
            "case {case}: garbage passed: {report:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_round_starts_each_replica_at_its_own_jitter() {
    let endpoints: Vec<Endpoint> = (1..=4).map(|p| Endpoint::new("10.0.0.1", 8000 + p)).collect();
    let max = Duration::from_secs(10);
    let t0 = tokio::time::Instant::now();
    let starts = probe::jittered(&endpoints, 42, 3, max, |e| async move { (e.port, t0.elapsed()) }).await;
    let expected: Vec<(u16, Duration)> = endpoints
        .iter()
        .map(|e| (e.port, probe::jitter(42, &e.authority(), 3, max)))
        .collect();
    assert_eq!(
        starts, expected,
        "each replica starts exactly at its jitter, results in input order"
    );
    let mut offsets: Vec<Duration> = starts.iter().map(|s| s.1).collect();
    offsets.dedup();
    assert_eq!(offsets.len(), 4, "not in lockstep");
}
