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
        ttl: Duration::from_millis(3_000),
        renew_every: Duration::from_millis(600),
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
    let (a_fence, b_fence) = (a, b);
    let (a, b) = (a_fence.port, b_fence.port);
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

        // The grantor goes silent: a's grant would run out in 3 s, but b vouches for it.
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
        assert_eq!(
            view(a).standing,
            GrantStanding::Expired,
            "a stopped before b served"
        );
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

/// `understudy-router grant` with the fences' token in the environment: its exit and its output.
fn break_glass(args: &[String]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_understudy-router"))
        .arg("grant")
        .args(args)
        .env("UNDERSTUDY_CONTROL_TOKEN", TOKEN)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn break_glass_grants_the_standby_an_epoch_by_hand_and_refuses_a_stale_one() {
    let e = Emulator::start(&["--emu-zero-cost"], &[]);
    let west = FenceSidecar::granted("west", e.addr(), TOKEN);
    let w = west.port;
    // East, the old primary, is gone: nothing listens where its fence was.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    blocking(move || {
        assert_eq!(push(w, &grant(4, "east", &[gone], true), Some(TOKEN)).status, 200);
        let pools = |epoch: u64, extra: &[&str]| -> Vec<String> {
            let mut args = vec![
                "--epoch".to_owned(),
                epoch.to_string(),
                "--holder".to_owned(),
                "west".to_owned(),
                "--pool".to_owned(),
                format!("east=127.0.0.1:{gone}"),
                "--pool".to_owned(),
                format!("west=127.0.0.1:{w}"),
            ];
            args.extend(extra.iter().map(|s| (*s).to_owned()));
            args
        };
        // Without saying east is gone, west takes the epoch and waits out east's grants.
        let (ok, text) = break_glass(&pools(5, &[]));
        assert!(ok, "{text}");
        assert!(text.contains("took it: Waiting"), "{text}");
        assert_eq!(generates(w), 503);
        // Said: west serves at once.
        let (ok, text) = break_glass(&pools(6, &["--old-holder-gone", "--ttl", "10m"]));
        assert!(ok, "{text}");
        assert!(
            text.contains(&format!("west 127.0.0.1:{w}: took it: Serving")),
            "{text}"
        );
        assert_eq!(generates(w), 200);
        assert!(
            view(w).remaining_ms.is_some_and(|ms| ms > 60_000),
            "{:?}",
            view(w)
        );
        // An epoch below what the fence holds is refused, and the command says so.
        let (ok, text) = break_glass(&pools(5, &["--old-holder-gone"]));
        assert!(!ok, "{text}");
        assert!(text.contains("refused it: it holds epoch Some(6)"), "{text}");
        let (ok, text) = break_glass(&[
            "--epoch".into(),
            "7".into(),
            "--holder".into(),
            "north".into(),
            "--pool".into(),
            format!("west=127.0.0.1:{w}"),
        ]);
        assert!(
            !ok && text.contains("--holder north names none of the --pool given"),
            "{text}"
        );
    });
    drop(west);
}
