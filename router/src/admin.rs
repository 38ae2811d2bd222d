//! The gateway's admin API, on its own port: `PUT /route` (epoch-fenced per policy; `?force=true`
//! lets a person take an epoch far above the highest seen), `GET /route?policy=<ns/name>` (what the
//! router holds for one policy; no `policy` asks for the unnamed one), `GET /signals` (passive
//! signals for the operator, one entry per policy's route), `GET /shapes?policy=<ns/name>` (the
//! shapes of the requests routed for a policy, which load proofs replay), `GET /metrics`, and `/live`,
//! `/ready`. Everything except the probes and metrics needs `Authorization: Bearer <token>`.
//!
//! This module must never take a route without the token, answer a stale route with anything
//! but 409, or be served on the public port.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue, WWW_AUTHENTICATE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::time::Instant;
use understudy_api::route::{Route, RouterHolds};

use crate::body::RouterBody;
use crate::metrics::{Metrics, Routing};
use crate::shapes::Shapes;
use crate::signals::{PoolSignals, pool_signal};
use crate::table::{Applied, RouteError, RouteTable};

/// How long a route's body may take to arrive.
const ROUTE_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The admin bearer token. Compared in constant time; never printed.
#[derive(Clone)]
pub struct AdminToken(Arc<[u8]>);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

/// Why a token cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    /// Empty (after trimming a trailing newline from a file).
    #[error("the admin token is empty")]
    Empty,
}

impl AdminToken {
    /// A token from its text (a trailing newline, as files have, is dropped).
    pub fn new(text: &str) -> Result<Self, TokenError> {
        let t = text.trim();
        if t.is_empty() {
            return Err(TokenError::Empty);
        }
        Ok(AdminToken(t.as_bytes().into()))
    }

    /// True when the `Authorization` header carries this token.
    #[must_use]
    pub fn admits(&self, header: Option<&HeaderValue>) -> bool {
        let Some(given) = header.and_then(|h| h.as_bytes().strip_prefix(b"Bearer ")) else {
            return false;
        };
        // The same work whatever the guess, its length included: every byte of the token is
        // compared with the guess's byte at that place (zero past its end), and a difference in
        // length counts as a difference. The time depends on the token's length only.
        let mut difference = given.len() ^ self.0.len();
        for (at, byte) in self.0.iter().enumerate() {
            difference |= usize::from(given.get(at).copied().unwrap_or(0) ^ byte);
        }
        std::hint::black_box(difference) == 0
    }
}

/// The admin API's state.
#[derive(Debug, Clone)]
pub struct Admin {
    /// The routes it updates.
    pub routes: Arc<RouteTable>,
    /// The metrics it renders (and counts stale updates in).
    pub metrics: Arc<Metrics>,
    /// The token it requires.
    pub token: AdminToken,
    /// Set when the router is stopping: `/ready` fails first, so callers stop sending.
    pub draining: Arc<AtomicBool>,
    /// The request shapes the gateway recorded, for `GET /shapes`.
    pub shapes: Arc<Shapes>,
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<RouterBody> {
    let mut resp = Response::new(RouterBody::from(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn error(status: StatusCode, message: &str) -> Response<RouterBody> {
    json(status, &serde_json::json!({ "error": message }))
}

impl Admin {
    /// Handles one admin request.
    pub async fn handle(self, req: Request<Incoming>) -> Response<RouterBody> {
        let path = req.uri().path().to_owned();
        match (req.method(), path.as_str()) {
            (&Method::GET, "/live") => return Response::new(RouterBody::from(Bytes::from_static(b"ok\n"))),
            (&Method::GET, "/ready") => {
                if self.draining.load(Ordering::Relaxed) {
                    return error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "draining: the router is stopping",
                    );
                }
                return if self.routes.routes().is_empty() {
                    error(StatusCode::SERVICE_UNAVAILABLE, "no route yet")
                } else {
                    Response::new(RouterBody::from(Bytes::from_static(b"ok\n")))
                };
            }
            (&Method::GET, "/metrics") => {
                let set = self.routes.routes();
                let routed: Vec<Routing<'_>> = set
                    .routes()
                    .iter()
                    .map(|r| Routing {
                        policy: &r.route.policy,
                        pool: &r.route.pool,
                        epoch: r.route.epoch.0,
                    })
                    .collect();
                let text = self.metrics.render(&routed);
                let mut resp = Response::new(RouterBody::from(text));
                resp.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                return resp;
            }
            _ => {}
        }
        if !self.token.admits(req.headers().get(AUTHORIZATION)) {
            let mut resp = error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
            resp.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return resp;
        }
        match (req.method(), path.as_str()) {
            (&Method::PUT, "/route") => self.put_route(req).await,
            (&Method::GET, "/route") => self.get_route(req.uri().query()),
            (&Method::GET, "/signals") => self.signals(),
            (&Method::GET, "/shapes") => match policy_of(req.uri().query()) {
                Ok(policy) => json(
                    StatusCode::OK,
                    &serde_json::json!(self.shapes.sample(&policy, Instant::now())),
                ),
                Err(why) => error(StatusCode::BAD_REQUEST, why),
            },
            (_, "/route" | "/signals" | "/shapes") => {
                error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
            }
            _ => error(StatusCode::NOT_FOUND, "no such admin route"),
        }
    }

    async fn put_route(&self, req: Request<Incoming>) -> Response<RouterBody> {
        let force = req
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|pair| pair == "force=true"));
        let read = tokio::time::timeout(
            ROUTE_READ_TIMEOUT,
            Limited::new(req.into_body(), 1 << 20).collect(),
        );
        let body = match read.await {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(_)) => return error(StatusCode::PAYLOAD_TOO_LARGE, "a route is at most 1 MiB"),
            Err(_) => return error(StatusCode::REQUEST_TIMEOUT, "the route did not arrive in time"),
        };
        let route: Route = match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => return error(StatusCode::BAD_REQUEST, &format!("not a route: {e}")),
        };
        let (epoch, pool) = (route.epoch, route.pool.clone());
        let taken = if force {
            tracing::warn!(%epoch, %pool, "route forced: the epoch may jump");
            self.routes.force_update(route)
        } else {
            self.routes.update(route)
        };
        match taken {
            Ok(applied) => {
                tracing::info!(%epoch, %pool, ?applied, "route taken");
                let applied = match applied {
                    Applied::NewEpoch => "new_epoch",
                    Applied::SameEpoch => "same_epoch",
                };
                json(
                    StatusCode::OK,
                    &serde_json::json!({"applied": applied, "epoch": epoch, "pool": pool}),
                )
            }
            Err(RouteError::Stale { highest, pool: held }) => {
                self.metrics.stale_route();
                tracing::warn!(%epoch, %pool, %highest, "stale route refused");
                json(
                    StatusCode::CONFLICT,
                    &serde_json::json!({
                        "error": "stale epoch", "epoch": epoch, "highest_epoch": highest, "pool": held
                    }),
                )
            }
            Err(e @ RouteError::Invalid(_)) => error(StatusCode::BAD_REQUEST, &e.to_string()),
            Err(e @ RouteError::Overlap { .. }) => {
                tracing::warn!(error = %e, "route refused");
                error(StatusCode::UNPROCESSABLE_ENTITY, &e.to_string())
            }
            Err(e @ RouteError::TooFar { .. }) => {
                tracing::warn!(error = %e, "route refused");
                error(StatusCode::UNPROCESSABLE_ENTITY, &e.to_string())
            }
            Err(e @ RouteError::Persist(_)) => {
                tracing::error!(error = %e, "could not persist the epoch");
                error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
            }
        }
    }

    fn get_route(&self, query: Option<&str>) -> Response<RouterBody> {
        let policy = match policy_of(query) {
            Ok(policy) => policy,
            Err(why) => return error(StatusCode::BAD_REQUEST, why),
        };
        let holds = RouterHolds {
            route: self.routes.routes().of_policy(&policy).map(|r| r.route.clone()),
            highest: self.routes.highest(&policy),
        };
        json(StatusCode::OK, &serde_json::json!(holds))
    }

    fn signals(&self) -> Response<RouterBody> {
        let now = Instant::now();
        let pools: Vec<PoolSignals> = self
            .routes
            .routes()
            .routes()
            .iter()
            .map(|routed| {
                let endpoints: Vec<_> = routed.endpoints.iter().map(|e| e.snapshot(now)).collect();
                PoolSignals {
                    policy: routed.route.policy.clone(),
                    pool: routed.route.pool.clone(),
                    epoch: routed.route.epoch,
                    signal: pool_signal(&endpoints),
                    endpoints,
                }
            })
            .collect();
        json(StatusCode::OK, &serde_json::json!({ "pools": pools }))
    }
}

/// The `policy` a `GET /route` asks about: `policy=<namespace>/<name>`, percent-encoded or not;
/// none is the unnamed policy (`""`).
fn policy_of(query: Option<&str>) -> Result<String, &'static str> {
    let Some(value) = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| pair.strip_prefix("policy="))
    else {
        return Ok(String::new());
    };
    let decoded = value.replace("%2F", "/").replace("%2f", "/");
    if decoded.contains('%') || decoded.contains('+') {
        return Err("policy must be namespace/name, with the slash as '/' or %2F");
    }
    Ok(decoded)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_policy_asked_about_is_read_from_the_query() {
        assert_eq!(policy_of(None), Ok(String::new()));
        assert_eq!(policy_of(Some("force=true")), Ok(String::new()));
        assert_eq!(policy_of(Some("policy=ns/chat")), Ok("ns/chat".to_owned()));
        assert_eq!(policy_of(Some("a=1&policy=ns%2Fchat")), Ok("ns/chat".to_owned()));
        assert!(policy_of(Some("policy=ns%20chat")).is_err());
    }

    #[test]
    fn the_token_admits_only_its_exact_bearer_header() {
        let t = AdminToken::new("s3cret\n").unwrap();
        assert!(t.admits(Some(&HeaderValue::from_static("Bearer s3cret"))));
        assert!(!t.admits(Some(&HeaderValue::from_static("Bearer s3cre"))));
        assert!(!t.admits(Some(&HeaderValue::from_static("Bearer s3cret2"))));
        assert!(!t.admits(Some(&HeaderValue::from_static("s3cret"))));
        assert!(!t.admits(None));
        assert_eq!(AdminToken::new(" \n").unwrap_err(), TokenError::Empty);
    }
}
