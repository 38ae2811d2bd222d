//! Faults a game day injects into a serving pod through its fence sidecar, the one door to the
//! replica: `hang` (every request but a control call is held, unanswered, until the fault ends)
//! and `wrong-answers` (every completion is answered at once, well formed, with text the model
//! never wrote: a replica that is up, healthy to `/health`, and wrong, which only a probe that
//! checks a real generation sees).
//!
//! `PUT /understudy/fault` with the operator's token sets one: `{"fault": "hang", "seconds": 300}`,
//! and `{"fault": null}` takes it away; `GET` reads it back. A fault always ends by itself after its
//! `seconds` (600 unless given, at most an hour), so an operator lost in the middle of a game day
//! never leaves a pool hung for good.
//!
//! What this module must never do: inject a fault without the token, or keep a fault past its end.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;
pub use understudy_api::fence_fault::{
    DEFAULT_FAULT_SECONDS, FAULT_PATH, FaultCall, FaultState, FenceFault, MAX_FAULT_SECONDS, WRONG_ANSWER,
};

use crate::body::RouterBody;
use crate::refusal::error_response;

/// The fault a fence plays, shared by its requests.
#[derive(Debug)]
pub struct Faults {
    playing: watch::Sender<Option<(FenceFault, Instant)>>,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            playing: watch::Sender::new(None),
        }
    }
}

impl Faults {
    /// The fault in play now, if it has not ended.
    #[must_use]
    pub fn current(&self) -> Option<FenceFault> {
        self.playing
            .borrow()
            .filter(|(_, until)| Instant::now() < *until)
            .map(|(fault, _)| fault)
    }

    /// Plays `fault` for `lasting`, or takes the fault away (`None`).
    pub fn set(&self, fault: Option<FenceFault>, lasting: Duration) {
        self.playing
            .send_replace(fault.map(|fault| (fault, Instant::now() + lasting)));
    }

    /// The fault in play, as [`FAULT_PATH`] answers it.
    #[must_use]
    pub fn state(&self) -> FaultState {
        let playing = *self.playing.borrow();
        match playing {
            Some((fault, until)) if Instant::now() < until => FaultState {
                fault: Some(fault),
                seconds_left: Some(until.saturating_duration_since(Instant::now()).as_secs()),
            },
            _ => FaultState {
                fault: None,
                seconds_left: None,
            },
        }
    }

    /// Returns once no hang is in play: at once when none is, otherwise when it is taken away,
    /// replaced, or ends.
    pub async fn hang(&self) {
        let mut changes = self.playing.subscribe();
        loop {
            let until = match *changes.borrow_and_update() {
                Some((FenceFault::Hang, until)) if Instant::now() < until => until,
                _ => return,
            };
            tokio::select! {
                () = tokio::time::sleep_until(until) => return,
                changed = changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// Answers a call to [`FAULT_PATH`], which already passed the token check.
    pub async fn call(&self, req: Request<Incoming>) -> Response<RouterBody> {
        match *req.method() {
            Method::GET => json_response(&self.state()),
            Method::PUT | Method::POST => {
                let body = match read_capped(req, 4 << 10).await {
                    Ok(body) => body,
                    Err(refusal) => return refusal,
                };
                let call: FaultCall = match serde_json::from_slice(&body) {
                    Ok(call) => call,
                    Err(e) => {
                        let message = format!(
                            "not a fault: {e}; send {{\"fault\": \"hang\" | \"wrong-answers\" | null, \"seconds\": N}}"
                        );
                        return error_response(StatusCode::BAD_REQUEST, "invalid_fault", &message);
                    }
                };
                let seconds = call.seconds.unwrap_or(DEFAULT_FAULT_SECONDS);
                if !(1..=MAX_FAULT_SECONDS).contains(&seconds) {
                    let message = format!("seconds must be from 1 to {MAX_FAULT_SECONDS}, not {seconds}");
                    return error_response(StatusCode::BAD_REQUEST, "invalid_fault", &message);
                }
                self.set(call.fault, Duration::from_secs(seconds));
                tracing::warn!(fault = ?call.fault, seconds, "game-day fault set");
                json_response(&self.state())
            }
            _ => error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "GET reads the fault, PUT sets it",
            ),
        }
    }
}

/// The answer to a completion under `wrong-answers`, made from the request: the shape its path
/// and `stream` ask for (a chat or text completion, JSON or server-sent events), its model, and
/// [`WRONG_ANSWER`] for text. A path that is not a completion is given back (`Err`), to go
/// through.
pub async fn wrong_answer(req: Request<Incoming>) -> Result<Response<RouterBody>, Request<Incoming>> {
    let chat = match req.uri().path().trim_end_matches('/') {
        "/v1/chat/completions" => true,
        "/v1/completions" => false,
        _ => return Err(req),
    };
    let body = match read_capped(req, 1 << 20).await {
        Ok(body) => body,
        Err(refusal) => return Ok(refusal),
    };
    let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let model = asked["model"].as_str().unwrap_or("unknown");
    let stream = asked["stream"].as_bool().unwrap_or(false);
    let (object, choice) = if chat {
        let delta_or_message = if stream { "delta" } else { "message" };
        (
            "chat.completion",
            serde_json::json!({
                "index": 0,
                delta_or_message: {"role": "assistant", "content": WRONG_ANSWER},
                "finish_reason": "stop",
            }),
        )
    } else {
        (
            "text_completion",
            serde_json::json!({"index": 0, "text": WRONG_ANSWER, "finish_reason": "stop"}),
        )
    };
    let mut answer = serde_json::json!({
        "id": "understudy-fault",
        "object": object,
        "created": 0,
        "model": model,
        "choices": [choice],
    });
    if !stream {
        return Ok(json_response(&answer));
    }
    if chat {
        answer["object"] = "chat.completion.chunk".into();
    }
    let events = format!("data: {answer}\n\ndata: [DONE]\n\n");
    let mut resp = Response::new(RouterBody::from(Bytes::from(events)));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    Ok(resp)
}

/// A request's body, whole, if it is at most `cap` bytes and arrives within ten seconds.
pub(crate) async fn read_capped(req: Request<Incoming>, cap: usize) -> Result<Bytes, Response<RouterBody>> {
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        Limited::new(req.into_body(), cap).collect(),
    );
    match read.await {
        Ok(Ok(body)) => Ok(body.to_bytes()),
        Ok(Err(_)) => Err(error_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            &format!("the body is over {cap} bytes"),
        )),
        Err(_) => Err(error_response(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            "the body did not arrive in time",
        )),
    }
}

pub(crate) fn json_response(value: &impl Serialize) -> Response<RouterBody> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut resp = Response::new(RouterBody::from(Bytes::from(body)));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_fault_ends_by_itself_and_a_hang_lets_go_when_it_does() {
        let faults = Faults::default();
        assert_eq!(faults.current(), None);
        faults.set(Some(FenceFault::Hang), Duration::from_secs(30));
        assert_eq!(faults.current(), Some(FenceFault::Hang));
        assert_eq!(faults.state().seconds_left, Some(30));
        let started = Instant::now();
        faults.hang().await;
        assert_eq!(started.elapsed(), Duration::from_secs(30));
        assert_eq!(faults.current(), None);
        assert_eq!(
            faults.state(),
            FaultState {
                fault: None,
                seconds_left: None
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_hang_lets_go_when_it_is_taken_away_or_replaced() {
        let faults = std::sync::Arc::new(Faults::default());
        faults.set(Some(FenceFault::Hang), Duration::from_secs(600));
        let held = tokio::spawn({
            let faults = faults.clone();
            async move { faults.hang().await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!held.is_finished());
        faults.set(Some(FenceFault::WrongAnswers), Duration::from_secs(600));
        tokio::time::timeout(Duration::from_secs(1), held)
            .await
            .expect("released by the new fault")
            .expect("the held task ends");
        // With no hang in play nothing waits.
        tokio::time::timeout(Duration::from_millis(1), faults.hang())
            .await
            .expect("nothing holds without a hang");
        faults.set(None, Duration::from_secs(1));
        assert_eq!(faults.current(), None);
    }
}
