//! The routers' admin API as the operator calls it: where a router's admin port is
//! ([`RouterAdminUrl`]), the token it takes ([`RouterToken`]), and one call per path on a fresh
//! connection (`PUT` and `GET /route`, `GET /signals`, `GET /shapes`, `GET /metrics`), each answer classified once
//! ([`RouterAnswer`]). The Route step ([`crate::route_push`]), the probing rounds' passive signals
//! and the game days' load counters all call the routers through here.
//!
//! This module must never put a timeout of its own on a call (each caller bounds its own), or print
//! the token.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use bytes::Bytes;
use understudy_api::route::RouterHolds;
use understudy_core::failover::PassiveSignal;
use understudy_core::load_proof::ShapeSample;
use understudy_prober::http1;
use understudy_prober::probe::Bearer;

/// Why the router configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RouterConfigError {
    /// Not an `http://host[:port][/prefix]` URL.
    #[error("router admin URL {url:?}: {why}")]
    BadUrl { url: String, why: &'static str },
    /// The token file cannot be read.
    #[error("reading the router admin token from {path}")]
    TokenUnreadable {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The token file holds nothing but whitespace.
    #[error("the router admin token in {path} is empty")]
    TokenEmpty { path: String },
}

/// A router's admin API: `http://host[:port][/prefix]`; `PUT /route` goes to `<prefix>/route`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RouterAdminUrl {
    text: String,
    host: String,
    port: u16,
    prefix: String,
}

impl fmt::Display for RouterAdminUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for RouterAdminUrl {
    type Err = RouterConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = |why| RouterConfigError::BadUrl {
            url: text.to_owned(),
            why,
        };
        let text = text.trim();
        if text.starts_with("https://") {
            return Err(bad(
                "https is not supported; the admin API is plain HTTP on the cluster network",
            ));
        }
        let rest = text
            .strip_prefix("http://")
            .ok_or_else(|| bad("must start with http://"))?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.contains('@') || prefix.contains(['?', '#']) {
            return Err(bad("must not carry credentials, a query or a fragment"));
        }
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            let (host, after) = bracketed.split_once(']').ok_or_else(|| bad("unclosed '['"))?;
            (host, after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("names no host"));
        }
        let port = match port {
            Some(port) => port.parse().map_err(|_| bad("the port is not a number"))?,
            None => 80,
        };
        Ok(RouterAdminUrl {
            text: text.trim_end_matches('/').to_owned(),
            host: host.to_owned(),
            port,
            prefix: prefix.to_owned(),
        })
    }
}

/// The routers' admin bearer token. Never printed.
#[derive(Clone)]
pub struct RouterToken(Bearer);

impl fmt::Debug for RouterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RouterToken(..)")
    }
}

impl RouterToken {
    /// The token from its text; a trailing newline, as files have, is dropped.
    pub fn new(text: &str) -> Option<Self> {
        Bearer::new(text).map(RouterToken)
    }

    /// Reads the token from `path`, once, at start.
    pub fn read(path: &Path) -> Result<Self, RouterConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| RouterConfigError::TokenUnreadable {
            path: shown.clone(),
            source,
        })?;
        RouterToken::new(&text).ok_or(RouterConfigError::TokenEmpty { path: shown })
    }
}

/// How one router answered one push.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouterAnswer {
    /// 200: the router holds this route (`new_epoch` or `same_epoch`).
    Taken,
    /// 409: the router has seen a higher epoch, or another pool at this one.
    Stale {
        highest: Option<u64>,
        pool: Option<String>,
    },
    /// 401: the router does not take this token.
    Unauthorized,
    /// Another 4xx: the router will not take this route as it is.
    Rejected { status: u16, message: String },
    /// No answer, or a 5xx: worth trying again.
    Unavailable { why: String },
}

/// How routers know `policy`: `namespace/name`, the key of its route and of its epochs.
#[must_use]
pub fn policy_key(policy: &crate::crd::FailoverPolicy) -> String {
    use kube::ResourceExt;
    format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any())
}

/// One `PUT <prefix>/route` on a fresh connection; no timeout here, the caller bounds it.
pub(crate) async fn put_route(router: &RouterAdminUrl, token: &RouterToken, body: Bytes) -> RouterAnswer {
    match exchange(router, token, http::Method::PUT, Some(body)).await {
        Ok((status, body)) => classify(status, &body),
        Err(why) => RouterAnswer::Unavailable { why },
    }
}

/// One `GET <prefix>/route?policy=<policy>` on a fresh connection: what the router holds for
/// `policy`, or the answer that says why it did not tell. No timeout here, the caller bounds it.
pub(crate) async fn get_route(
    router: &RouterAdminUrl,
    token: &RouterToken,
    policy: &str,
) -> Result<RouterHolds, RouterAnswer> {
    // A policy key is a namespace and a name, DNS labels both: only the slash needs encoding.
    let path = format!("route?policy={}", policy.replace('/', "%2F"));
    let (status, body) = exchange_at(router, token, &path, http::Method::GET, None)
        .await
        .map_err(|why| RouterAnswer::Unavailable { why })?;
    if status != http::StatusCode::OK {
        return Err(match classify(status, &body) {
            // Only a 200 carries what the router holds.
            RouterAnswer::Taken | RouterAnswer::Stale { .. } => RouterAnswer::Rejected {
                status: status.as_u16(),
                message: "GET /route did not answer 200".to_owned(),
            },
            answer => answer,
        });
    }
    serde_json::from_slice(&body).map_err(|error| RouterAnswer::Unavailable {
        why: format!("GET /route answered what is not a route: {error}"),
    })
}

/// One request to `<prefix>/route` on a fresh connection, with the token; no timeout here, the
/// caller bounds it.
async fn exchange(
    router: &RouterAdminUrl,
    token: &RouterToken,
    method: http::Method,
    body: Option<Bytes>,
) -> Result<(http::StatusCode, Bytes), String> {
    exchange_at(router, token, "route", method, body).await
}

/// What a router's data path says of the pool it routes (`GET /signals`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct RoutedSignal {
    /// The policy whose route it is (`namespace/name`; empty for a route a person wrote).
    #[serde(default)]
    pub policy: String,
    /// The pool's name.
    pub pool: String,
    /// The epoch it is routed under.
    pub epoch: u64,
    /// The observation for the state machine, if any.
    pub signal: Option<PassiveSignal>,
}

#[derive(serde::Deserialize)]
struct SignalsAnswer {
    pools: Vec<RoutedSignal>,
}

/// One `GET <prefix>/signals`: the passive signals of the pool the router routes; none while it
/// routes nothing. No timeout here, the caller bounds it.
pub async fn get_signals(router: &RouterAdminUrl, token: &RouterToken) -> Result<Vec<RoutedSignal>, String> {
    let (status, body) = exchange_at(router, token, "signals", http::Method::GET, None).await?;
    if status != http::StatusCode::OK {
        return Err(format!("GET /signals answered {}", status.as_u16()));
    }
    serde_json::from_slice::<SignalsAnswer>(&body)
        .map(|answer| answer.pools)
        .map_err(|error| format!("GET /signals answered what is not signals: {error}"))
}

/// One `GET <prefix>/shapes?policy=<key>`: the shapes of the requests the router routed for the
/// policy, which a load proof replays. No timeout here, the caller bounds it.
pub async fn get_shapes(
    router: &RouterAdminUrl,
    token: &RouterToken,
    policy: &str,
) -> Result<ShapeSample, String> {
    let path = format!("shapes?policy={policy}");
    let (status, body) = exchange_at(router, token, &path, http::Method::GET, None).await?;
    if status != http::StatusCode::OK {
        return Err(format!("GET /shapes answered {}", status.as_u16()));
    }
    serde_json::from_slice(&body)
        .map_err(|error| format!("GET /shapes answered what is not a sample: {error}"))
}

/// A router's `GET /metrics`, as Prometheus text.
pub async fn get_metrics(router: &RouterAdminUrl, token: &RouterToken) -> Result<String, String> {
    let (status, body) = exchange_at(router, token, "metrics", http::Method::GET, None).await?;
    if status != http::StatusCode::OK {
        return Err(format!("GET /metrics answered {}", status.as_u16()));
    }
    String::from_utf8(body.to_vec()).map_err(|_| "GET /metrics answered what is not text".to_owned())
}

/// One request to `<prefix>/<path>` on a fresh connection, with the token.
async fn exchange_at(
    router: &RouterAdminUrl,
    token: &RouterToken,
    path: &str,
    method: http::Method,
    body: Option<Bytes>,
) -> Result<(http::StatusCode, Bytes), String> {
    let target = format!("{}/{path}", router.prefix);
    http1::exchange(http1::Call {
        host: &router.host,
        port: router.port,
        method,
        target: &target,
        bearer: Some(token.0.secret()),
        json: body,
    })
    .await
}

/// What a router's status and body say.
fn classify(status: http::StatusCode, body: &[u8]) -> RouterAnswer {
    let json: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let message = || {
        json.get("error").and_then(|e| e.as_str()).map_or_else(
            || String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
            str::to_owned,
        )
    };
    match status.as_u16() {
        200..=299 => RouterAnswer::Taken,
        409 => RouterAnswer::Stale {
            highest: json.get("highest_epoch").and_then(serde_json::Value::as_u64),
            pool: json.get("pool").and_then(|p| p.as_str()).map(str::to_owned),
        },
        401 | 403 => RouterAnswer::Unauthorized,
        code @ 400..=499 => RouterAnswer::Rejected {
            status: code,
            message: message(),
        },
        code => RouterAnswer::Unavailable {
            why: format!("answered {code}: {}", message()),
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn admin_urls_are_plain_http_with_a_host_and_an_optional_port_and_prefix() {
        let url: RouterAdminUrl = "http://router-admin.serving:9091/".parse().unwrap();
        assert_eq!(
            (url.host.as_str(), url.port, url.prefix.as_str()),
            ("router-admin.serving", 9091, "")
        );
        assert_eq!(url.to_string(), "http://router-admin.serving:9091");
        let url: RouterAdminUrl = "http://[::1]:9091/gw/a".parse().unwrap();
        assert_eq!(
            (url.host.as_str(), url.port, url.prefix.as_str()),
            ("::1", 9091, "/gw/a")
        );
        assert_eq!("http://router".parse::<RouterAdminUrl>().unwrap().port, 80);
        for bad in [
            "https://router:9091",
            "router:9091",
            "http://:9091",
            "http://router:x",
            "http://u@router",
        ] {
            assert!(bad.parse::<RouterAdminUrl>().is_err(), "{bad} was taken");
        }
    }

    #[test]
    fn a_missing_or_empty_token_file_is_an_error_that_names_the_file() {
        let missing = RouterToken::read(Path::new("/nonexistent/understudy/token")).unwrap_err();
        assert!(
            missing.to_string().contains("/nonexistent/understudy/token"),
            "{missing}"
        );
        assert!(RouterToken::new(" \n").is_none());
        assert_eq!(
            format!("{:?}", RouterToken::new("s3cret\n").unwrap()),
            "RouterToken(..)"
        );
    }
}
