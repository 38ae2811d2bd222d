//! Fences under serving grants, on real sockets: a holder serves while its grant lasts, goes on
//! through the grantor's silence only while the other pool's fences vouch for it, stops once a
//! peer knows a newer epoch or cannot be reached, and a new holder waits out the old one's grant
//! unless the grantor says it was revoked. Grants are pushed as the operator pushes them, with its
//! token. The times are short and every wait polls for what the fence shows, bounded by a
//! generous limit: nothing asserts how long anything took.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::{Emulator, FenceSidecar, completion, request};
use understudy_api::grant::{GRANT_PATH, Grant, GrantStanding, GrantTiming, GrantView};
use understudy_core::Epoch;

const TOKEN: &str = "operator-token";

/// Short enough for a test, with the ratios of the defaults.
fn timing() -> GrantTiming {
    GrantTiming {
        ttl: Duration::from_millis(1_500),
        renew_every: Duration::from_millis(300),
        skew: Duration::from_millis(100),
        push_timeout: Duration::from_millis(300),
    }
}

fn grant(epoch: u64, holder: &str, peers: &[u16], prior_revoked: bool) -> Grant {
    let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    Grant {
        prior_revoked,
        peers: peers.iter().map(|p| format!("127.0.0.1:{p}")).collect(),
        ..timing().grant("default/chat", Epoch(epoch), holder, wall)
    }
}

fn push(port: u16, grant: &Grant, token: Option<&str>) -> support::Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    request(
        port,
        "PUT",
        GRANT_PATH,
        &headers,
        &serde_json::to_string(grant).unwrap(),
    )
}

fn view(port: u16) -> GrantView {
    let reply = request(port, "GET", GRANT_PATH, &[], "");
    assert_eq!(reply.status, 200, "{}", reply.text());
    serde_json::from_slice(&reply.body).unwrap()
}

fn generates(port: u16) -> u16 {
    request(port, "POST", "/v1/completions", &[], &completion(4, false)).status
}

/// Polls the fence until `wanted` holds of its view (30 s at most).
fn until(port: u16, what: &str, wanted: impl Fn(&GrantView) -> bool) -> GrantView {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = view(port);
        if wanted(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "never {what}; last: {v:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_serves_through_the_grantors_silence_only_while_the_other_pool_vouches_for_it() {
    let e = Emulator::start(&["--emu-zero-cost"], &[]);
    let (a, b) = (
        FenceSidecar::granted("a", e.addr(), TOKEN),
        FenceSidecar::granted("b", e.addr(), TOKEN),
    );
    let (a, b) = (a.port, b.port);
    let (_keep_a, _keep_b) = (a, b);
    blocking(move || {
        // Before any grant both are fenced, and the grant takes only the operator's token.
        assert_eq!(view(a).standing, GrantStanding::None);
        assert_eq!(generates(a), 503);
        assert_eq!(push(a, &grant(1, "a", &[b], true), None).status, 401);
        assert_eq!(push(a, &grant(1, "a", &[b], true), Some("wrong")).status, 401);
        let bad = request(
            a,
            "PUT",
            GRANT_PATH,
            &[("authorization", &format!("Bearer {TOKEN}"))],
            "{\"epoch\":",
        );
        assert_eq!(bad.status, 400, "{}", bad.text());

        assert_eq!(push(a, &grant(1, "a", &[b], true), Some(TOKEN)).status, 200);
        assert_eq!(push(b, &grant(1, "a", &[a], true), Some(TOKEN)).status, 200);
        assert_eq!(generates(a), 200);
        assert_eq!(generates(b), 503, "another pool's grant fences at once");
        let stale = push(a, &grant(0, "a", &[b], true), Some(TOKEN));
        assert_eq!(stale.status, 409, "{}", stale.text());

        // The grantor goes silent: a's grant would run out in 1.5 s, but b vouches for it.
        let extended = until(a, "extended by the failsafe", |v| v.extended >= 3);
        assert_eq!(extended.standing, GrantStanding::Failsafe);
        assert_eq!(generates(a), 200, "still serving, three extensions on");

        // b is promoted at epoch 2, its old holder's grant not known to be revoked: b waits it
        // out, and a, asking b, learns of the newer epoch and lets its own grant run out.
        let waiting = push(b, &grant(2, "b", &[a], false), Some(TOKEN));
        assert_eq!(waiting.status, 200);
        let waiting: GrantView = serde_json::from_slice(&waiting.body).unwrap();
        assert_eq!(waiting.standing, GrantStanding::Waiting);
        assert_eq!(generates(b), 503, "waiting out a's grant");
        let expired = until(a, "expired", |v| v.standing == GrantStanding::Expired);
        assert!(expired.extension_refused >= 1, "{expired:?}");
        assert_eq!(generates(a), 503);
        // b then serves, renewed by the grantor as it waits; a's grant ran out before.
        let deadline = Instant::now() + Duration::from_secs(30);
        while view(b).standing != GrantStanding::Serving {
            assert!(Instant::now() < deadline, "b never served: {:?}", view(b));
            assert_eq!(push(b, &grant(2, "b", &[a], false), Some(TOKEN)).status, 200);
            std::thread::sleep(timing().renew_every);
        }
        assert_eq!(generates(b), 200);
        // a never comes back at the old epoch on its own; once told the new one, an old grant
        // delayed in the network is refused.
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(view(a).standing, GrantStanding::Expired);
        assert_eq!(push(a, &grant(2, "b", &[b], true), Some(TOKEN)).status, 200);
        assert_eq!(view(a).standing, GrantStanding::Fenced);
        assert_eq!(push(a, &grant(1, "a", &[b], true), Some(TOKEN)).status, 409);
        assert_eq!(generates(a), 503);
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_its_grantor_and_its_peers_stops_serving_when_its_grant_runs_out() {
    let e = Emulator::start(&["--emu-zero-cost"], &[]);
    let a = FenceSidecar::granted("a", e.addr(), TOKEN);
    // The other pool's fence is unreachable: a port nothing listens on.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let port = a.port;
    blocking(move || {
        assert_eq!(push(port, &grant(1, "a", &[gone], true), Some(TOKEN)).status, 200);
        assert_eq!(generates(port), 200);
        let expired = until(port, "expired", |v| v.standing == GrantStanding::Expired);
        assert_eq!((expired.extended, expired.epoch), (0, Some(Epoch(1))));
        assert!(expired.extension_refused >= 1, "{expired:?}");
        let refused = request(port, "POST", "/v1/completions", &[], &completion(4, false));
        assert_eq!(refused.status, 503);
        assert_eq!(
            refused.header("x-understudy-not-served").as_deref(),
            Some("fenced")
        );
        // Probes still pass: the operator can see the replica it can no longer grant.
        assert_eq!(request(port, "GET", "/health", &[], "").status, 200);
    });
    drop(a);
}
