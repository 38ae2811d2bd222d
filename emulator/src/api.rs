//! The HTTP API on the serving port: vLLM's OpenAI-compatible routes, health and metrics, and the
//! dev-mode routes for sleep mode.
//!
//! Routes and status codes follow the reference: `/health` 200 (also asleep) or 503 (engine
//! dead); generation 500 with an empty body when the engine is dead; 400 and 404 errors as JSON
//! `{"error": {...}}`; the dev routes (`/sleep`, `/wake_up`, `/is_sleeping`, `/collective_rpc`,
//! `/reset_prefix_cache`, `/server_info`) exist only with `VLLM_SERVER_DEV_MODE=1`, so FastAPI's
//! 404 is what a client sees otherwise. This module must never serve the fault controls: those
//! live on their own port ([`super::control`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::FutureExt;
use serde::Deserialize;
use serde_json::{Value, json};

use understudy_listener::Peer;

use super::args::ServeArgs;
use super::engine::{Engine, Event, FinishReason, GenerationError, GenerationRequest, SleepError};
use super::generate::{Sampling, tokenize};
use super::log::Log;
use super::sleep::{PauseMode, SleepLevel};
use super::sse::{self, Api, Envelope, Usage};

/// What the API knows about the server beyond the engine.
#[derive(Debug)]
pub struct ServerInfo {
    pub serve: ServeArgs,
    pub version: String,
    /// What answers carry as `system_fingerprint` (none before 0.32).
    pub fingerprint: Option<String>,
    pub max_model_len: u32,
    pub dev_mode: bool,
    /// `VLLM_*` variables without `KEY` in the name, for `/server_info`.
    pub vllm_env: Vec<(String, String)>,
}

/// Shared by every handler.
#[derive(Debug)]
pub struct AppState {
    pub engine: Arc<Engine>,
    pub info: ServerInfo,
    request_counter: AtomicU64,
    /// Where uvicorn's access lines go; `None` with `--disable-uvicorn-access-log`.
    access_log: Option<Arc<Log>>,
}

impl AppState {
    pub fn new(engine: Arc<Engine>, info: ServerInfo, log: Arc<Log>) -> AppState {
        let access_log = (!info.serve.disable_uvicorn_access_log).then_some(log);
        AppState {
            engine,
            info,
            request_counter: AtomicU64::new(0),
            access_log,
        }
    }

    fn version(&self) -> String {
        self.engine
            .faults
            .drift()
            .version
            .unwrap_or_else(|| self.info.version.clone())
    }

    fn max_model_len(&self) -> u32 {
        self.engine
            .faults
            .drift()
            .max_model_len
            .unwrap_or(self.info.max_model_len)
    }

    fn request_id(&self, api: Api) -> String {
        let n = self.request_counter.fetch_add(1, Ordering::Relaxed);
        let mixed = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(std::process::id()).rotate_left(32);
        format!("{}{mixed:016x}{n:016x}", api.id_prefix())
    }
}

/// The router for the serving port.
pub fn router(state: Arc<AppState>) -> Router {
    let mut app = Router::new()
        .route("/health", get(health))
        .route("/ping", get(health).post(health))
        .route("/version", get(version))
        .route("/load", get(load))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize_route));
    if state.info.dev_mode {
        app = app
            .route("/sleep", post(sleep))
            .route("/wake_up", post(wake_up))
            .route("/is_sleeping", get(is_sleeping))
            .route("/collective_rpc", post(collective_rpc))
            .route("/reset_prefix_cache", post(reset_prefix_cache))
            .route("/server_info", get(server_info));
    }
    app.fallback(not_found)
        .layer(middleware::from_fn_with_state(Arc::clone(&state), gatekeeper))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), access_log))
        .with_state(state)
}

/// uvicorn's access line, as vLLM's server logs one for every request unless
/// `--disable-uvicorn-access-log`: `127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK`,
/// written when the response starts (a stream's when its head is sent; a hung request's never).
async fn access_log(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(log) = state.access_log.clone() else {
        return next.run(request).await;
    };
    let client = request
        .extensions()
        .get::<Peer>()
        .map_or_else(|| "-".to_string(), |Peer(addr)| addr.to_string());
    let target = request
        .uri()
        .path_and_query()
        .map_or_else(|| request.uri().path().to_string(), ToString::to_string);
    let line = format!(
        "{client} - \"{} {target} {:?}\"",
        request.method(),
        request.version()
    );
    let response = next.run(request).await;
    let status = response.status();
    let reason = status
        .canonical_reason()
        .map(|r| format!(" {r}"))
        .unwrap_or_default();
    log.uvicorn(&format!("{line} {}{reason}", status.as_u16()));
    response
}

/// Hang faults and `--api-key`, before any route.
async fn gatekeeper(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if state.engine.faults.hang() {
        // Accepted and read, never answered: what a wedged Python event loop looks like.
        return futures::future::pending().await;
    }
    if let Some(key) = &state.info.serve.api_key
        && request.uri().path().starts_with("/v1")
    {
        let expected = format!("Bearer {key}");
        if request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            != Some(expected.as_str())
        {
            return (StatusCode::UNAUTHORIZED, Json(json!({"error": "Unauthorized"}))).into_response();
        }
    }
    if request.method() == http::Method::POST
        && takes_json(request.uri().path())
        && !is_json(request.headers())
    {
        // vLLM's `validate_json_request`, before the body is read.
        let message = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed";
        let body = json!({"error": {"message": message, "type": "Bad Request", "param": null, "code": 400}});
        return (StatusCode::BAD_REQUEST, Json(body)).into_response();
    }
    // The body is read whole, within a deadline, before any handler: a client that sends half a
    // body is answered 408 and does not hold a handler (every route takes a small JSON body).
    let (parts, body) = request.into_parts();
    match read_body(body, BODY_READ_TIMEOUT).await {
        Ok(body) => next.run(Request::from_parts(parts, Body::from(body))).await,
        Err(e) => e.into_response(),
    }
}

/// The routes whose body vLLM reads as JSON, and refuses under any other content type.
fn takes_json(path: &str) -> bool {
    matches!(path, "/v1/completions" | "/v1/chat/completions" | "/tokenize")
}

/// `Content-Type: application/json`, with or without parameters.
fn is_json(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        })
}

/// The whole body within `timeout`: 408 past it, 413 over [`MAX_BODY_BYTES`], 400 when it broke
/// off.
async fn read_body(body: Body, timeout: std::time::Duration) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => Err(body_error(&e)),
        Err(_) => {
            let message = format!("the request body did not arrive within {timeout:?}");
            Err(ApiError::new(StatusCode::REQUEST_TIMEOUT, message))
        }
    }
}

/// How long a request body may take to arrive, as the gateway allows.
const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The largest request body: axum's default limit, which the handlers' extractors keep too.
const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// 413 for a body over the limit, 400 for one that broke off.
fn body_error(e: &axum::Error) -> ApiError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = source {
        if error.is::<http_body_util::LengthLimitError>() {
            let message = format!("the request body is over {MAX_BODY_BYTES} bytes");
            return ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, message);
        }
        source = error.source();
    }
    ApiError::bad_request(format!("could not read the request body: {e}"))
}

async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
}

/// A vLLM-style error body.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            _ => "InternalServerError",
        };
        let body = json!({"error": {"message": self.message, "type": kind, "param": null, "code": self.status.as_u16()}});
        (self.status, Json(body)).into_response()
    }
}

/// vLLM's exception handler for `EngineDeadError`: a bare 500.
fn engine_dead() -> Response {
    StatusCode::INTERNAL_SERVER_ERROR.into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.engine.is_dead() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn version(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"version": state.version()}))
}

async fn load(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"server_load": state.engine.load()}))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut response = state.engine.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let created = now_secs();
    let data: Vec<Value> = state
        .info
        .serve
        .served_names()
        .iter()
        .enumerate()
        .map(|(i, name)| {
            json!({
                "id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": state.info.serve.model, "parent": null, "max_model_len": state.max_model_len(),
                "permission": [{
                    "id": format!("modelperm-{:032x}", (created as u128) << 32 | i as u128),
                    "object": "model_permission", "created": created, "allow_create_engine": false,
                    "allow_sampling": true, "allow_logprobs": true, "allow_search_indices": false,
                    "allow_view": true, "allow_fine_tuning": false, "organization": "*", "group": null,
                    "is_blocking": false,
                }],
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

#[derive(Debug, Deserialize, Default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The fields of a completion or chat request the emulator reads; the rest are accepted.
#[derive(Debug, Deserialize, Default)]
struct GenerationBody {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Vec<Value>>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    n: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    temperature: Option<f64>,
    seed: Option<i64>,
    stop: Option<Value>,
    ignore_eos: Option<bool>,
}

fn parse_body(bytes: &Bytes) -> Result<GenerationBody, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

fn check_model(state: &AppState, requested: Option<&str>) -> Result<String, ApiError> {
    let names = state.info.serve.served_names();
    match requested {
        None => Ok(names[0].clone()),
        Some(m) if names.iter().any(|n| n == m) => Ok(m.to_string()),
        Some(m) => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{m}` does not exist."),
        }),
    }
}

/// The chat template: Qwen's, which is what the default model uses.
fn chat_prompt(messages: &[Value]) -> Result<String, ApiError> {
    let mut out = String::new();
    for m in messages {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad_request("Each message needs a 'role'."))?;
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect(),
            Some(Value::Null) | None => String::new(),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "Message content must be a string or a list of parts.",
                ));
            }
        };
        out.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
    }
    out.push_str("<|im_start|>assistant\n");
    Ok(out)
}

fn prompt_tokens(prompt: &Value) -> Result<Vec<u32>, ApiError> {
    let one = match prompt {
        Value::Array(items) if items.len() == 1 && !items[0].is_number() => &items[0],
        other => other,
    };
    match one {
        Value::String(s) if !s.is_empty() => Ok(tokenize(s)),
        Value::Array(ids) if !ids.is_empty() && ids.iter().all(Value::is_u64) => {
            Ok(ids.iter().filter_map(Value::as_u64).map(|t| t as u32).collect())
        }
        Value::Array(items) if items.len() > 1 => Err(ApiError::bad_request(
            "The emulator serves one prompt per request; send a batch as separate requests.",
        )),
        _ => Err(ApiError::bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty.",
        )),
    }
}

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(state, Api::Completions, body).await
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(state, Api::Chat, body).await
}

async fn generate(state: Arc<AppState>, api: Api, bytes: Bytes) -> Response {
    if state.engine.is_dead() {
        return engine_dead();
    }
    match prepare(&state, api, &bytes) {
        Ok((request, stream, include_usage, model)) => {
            if stream {
                stream_response(state, api, request, include_usage, model)
            } else {
                full_response(state, api, request, model).await
            }
        }
        Err(e) => e.into_response(),
    }
}

fn prepare(
    state: &AppState,
    api: Api,
    bytes: &Bytes,
) -> Result<(GenerationRequest, bool, bool, String), ApiError> {
    let body = parse_body(bytes)?;
    let model = check_model(state, body.model.as_deref())?;
    let prompt = match api {
        Api::Completions => prompt_tokens(body.prompt.as_ref().unwrap_or(&Value::Null))?,
        Api::Chat => match &body.messages {
            Some(messages) if !messages.is_empty() => tokenize(&chat_prompt(messages)?),
            _ => {
                return Err(ApiError::bad_request(
                    "Field required: 'messages' must be a non-empty list.",
                ));
            }
        },
    };
    if body.n.unwrap_or(1) != 1 {
        return Err(ApiError::bad_request("The emulator serves n=1 only."));
    }
    let max_len = state.max_model_len() as usize;
    if prompt.len() >= max_len {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {max_len} tokens. However, your request has {} input \
             tokens. Please reduce the length of the input messages.",
            prompt.len()
        )));
    }
    let requested = body.max_completion_tokens.or(body.max_tokens);
    let max_tokens = match (api, requested) {
        (_, Some(n)) if n < 1 => {
            return Err(ApiError::bad_request(format!(
                "max_tokens must be at least 1, got {n}."
            )));
        }
        (_, Some(n)) => n as usize,
        (Api::Completions, None) => 16,
        (Api::Chat, None) => max_len - prompt.len(),
    };
    if prompt.len() + max_tokens > max_len {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({} in \
             the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
            prompt.len() + max_tokens,
            prompt.len()
        )));
    }
    let sampling = match (body.temperature, body.seed) {
        (Some(0.0), _) => Sampling::Greedy,
        (Some(t), _) if t < 0.0 => {
            return Err(ApiError::bad_request(format!(
                "temperature must be non-negative, got {t}."
            )));
        }
        (_, Some(seed)) => Sampling::Seeded(seed),
        _ => Sampling::Random(0),
    };
    let stop = match body.stop {
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    };
    if body.stream_options.is_some() && body.stream != Some(true) {
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)".to_owned(),
        ));
    }
    let include_usage = state.info.serve.enable_force_include_usage
        || body
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage.unwrap_or(true));
    let request = GenerationRequest {
        prompt,
        max_tokens: max_tokens as u32,
        sampling,
        ignore_eos: body.ignore_eos.unwrap_or(false),
        stop,
    };
    Ok((request, body.stream.unwrap_or(false), include_usage, model))
}

async fn full_response(
    state: Arc<AppState>,
    api: Api,
    request: GenerationRequest,
    model: String,
) -> Response {
    let id = state.request_id(api);
    let mut generation = state.engine.generate(request);
    let mut text = String::new();
    let (finish, stop_reason) = loop {
        match generation.next().await {
            Some(Event::Token(t)) => text.push_str(t),
            Some(Event::Finished { reason, stop_reason }) => break (reason.as_str(), stop_reason),
            Some(Event::Failed(GenerationError::EngineDead)) | None => return engine_dead(),
            Some(Event::Failed(e @ GenerationError::HalfFailed)) => {
                return ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: e.to_string(),
                }
                .into_response();
            }
        }
    };
    let usage = usage_of(&generation);
    let env = Envelope {
        id: &id,
        created: now_secs(),
        model: &model,
        fingerprint: state.info.fingerprint.as_deref(),
    };
    Json(sse::full_response(
        api,
        env,
        &text,
        finish,
        stop_reason.as_deref(),
        usage,
    ))
    .into_response()
}

fn usage_of(generation: &super::engine::Generation) -> Usage {
    let prompt = generation.prompt_tokens();
    let completion = generation.completion_tokens() as usize;
    Usage {
        prompt_tokens: prompt,
        total_tokens: prompt + completion,
        completion_tokens: completion,
    }
}

/// Where a stream is.
enum StreamStep {
    Role,
    Tokens,
    /// An event already taken from the engine, to send after the token that came before it.
    Then(Event),
    Usage(Usage),
    Done,
    Closed,
}

fn stream_response(
    state: Arc<AppState>,
    api: Api,
    request: GenerationRequest,
    include_usage: bool,
    model: String,
) -> Response {
    let id = state.request_id(api);
    let created = now_secs();
    let fingerprint = state.info.fingerprint.clone();
    let generation = state.engine.generate(request);
    let first = if api == Api::Chat {
        StreamStep::Role
    } else {
        StreamStep::Tokens
    };
    let stream = futures::stream::unfold((generation, first), move |(mut generation, step)| {
        let id = id.clone();
        let model = model.clone();
        let fingerprint = fingerprint.clone();
        async move {
            let env = Envelope {
                id: &id,
                created,
                model: &model,
                fingerprint: fingerprint.as_deref(),
            };
            let (bytes, next) = match step {
                StreamStep::Closed => return None,
                StreamStep::Done => (sse::done(), StreamStep::Closed),
                StreamStep::Usage(u) => (sse::usage_chunk(api, env, u), StreamStep::Done),
                // vLLM sends the role with the engine's first output, not before it: a stopped
                // engine's stream has its head and no byte of body.
                StreamStep::Role => match generation.next().await {
                    Some(Event::Failed(e)) => (
                        sse::error_chunk(&e.to_string(), "InternalServerError", 500),
                        StreamStep::Done,
                    ),
                    Some(event) => (sse::chat_role_chunk(env), StreamStep::Then(event)),
                    None => (sse::done(), StreamStep::Closed),
                },
                StreamStep::Tokens | StreamStep::Then(_) => {
                    let after_finish = |g: &super::engine::Generation| {
                        if include_usage {
                            StreamStep::Usage(usage_of(g))
                        } else {
                            StreamStep::Done
                        }
                    };
                    let event = match step {
                        StreamStep::Then(event) => Some(event),
                        _ => generation.next().await,
                    };
                    match event {
                        Some(Event::Token(t))
                            if generation.completion_tokens() >= generation.max_tokens() =>
                        {
                            // vLLM sends the length limit with the last token, in one chunk. Look
                            // without waiting: a sleep or a stall must not hold the token back, and
                            // a failure goes out after it.
                            match generation.next().now_or_never() {
                                Some(Some(Event::Finished {
                                    reason: FinishReason::Length,
                                    ..
                                })) => {
                                    let next = after_finish(&generation);
                                    (sse::token_chunk(api, env, t, Some("length"), None), next)
                                }
                                Some(Some(event)) => {
                                    (sse::token_chunk(api, env, t, None, None), StreamStep::Then(event))
                                }
                                Some(None) | None => {
                                    (sse::token_chunk(api, env, t, None, None), StreamStep::Tokens)
                                }
                            }
                        }
                        Some(Event::Token(t)) => {
                            (sse::token_chunk(api, env, t, None, None), StreamStep::Tokens)
                        }
                        Some(Event::Finished { reason, stop_reason }) => {
                            let next = after_finish(&generation);
                            (
                                sse::token_chunk(api, env, "", Some(reason.as_str()), stop_reason.as_deref()),
                                next,
                            )
                        }
                        Some(Event::Failed(e)) => (
                            sse::error_chunk(&e.to_string(), "InternalServerError", 500),
                            StreamStep::Done,
                        ),
                        None => (sse::done(), StreamStep::Closed),
                    }
                }
            };
            Some((Ok::<Bytes, Infallible>(bytes), (generation, next)))
        }
    });
    let mut response = Body::from_stream(stream).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
}

#[derive(Debug, Deserialize)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Value>>,
}

async fn tokenize_route(State(state): State<Arc<AppState>>, bytes: Bytes) -> Response {
    let body: TokenizeBody = match serde_json::from_slice(&bytes) {
        Ok(b) => b,
        Err(e) => return ApiError::bad_request(format!("Invalid request body: {e}")).into_response(),
    };
    if let Err(e) = check_model(&state, body.model.as_deref()) {
        return e.into_response();
    }
    let tokens = match (body.prompt, body.messages) {
        (Some(p), _) => tokenize(&p),
        (None, Some(m)) => match chat_prompt(&m) {
            Ok(p) => tokenize(&p),
            Err(e) => return e.into_response(),
        },
        (None, None) => {
            return ApiError::bad_request("Either 'prompt' or 'messages' is required.").into_response();
        }
    };
    Json(json!({"count": tokens.len(), "max_model_len": state.max_model_len(), "tokens": tokens, "token_strs": null}))
        .into_response()
}

fn query_pairs(raw: Option<&str>) -> Vec<(String, String)> {
    raw.unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (p.to_string(), String::new()),
        })
        .collect()
}

fn sleep_error(e: SleepError) -> Response {
    match e {
        SleepError::EngineDead => engine_dead(),
        SleepError::NotEnabled => ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e.to_string(),
        }
        .into_response(),
    }
}

async fn sleep(State(state): State<Arc<AppState>>, RawQuery(query): RawQuery) -> Response {
    let pairs = query_pairs(query.as_deref());
    let get = |key: &str, default: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| default.to_string())
    };
    let Some(level) = SleepLevel::parse(&get("level", "1")) else {
        return ApiError::bad_request(format!(
            "invalid sleep level `{}`; the emulator takes 1 (offload) or 2 and up (discard); \
             level 0 (pause scheduling only) is not emulated",
            get("level", "1")
        ))
        .into_response();
    };
    let Some(mode) = PauseMode::parse(&get("mode", "abort")) else {
        return ApiError::bad_request(format!(
            "invalid mode `{}`; one of abort, wait, keep",
            get("mode", "")
        ))
        .into_response();
    };
    match state.engine.sleep(level, mode).await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => sleep_error(e),
    }
}

async fn wake_up(State(state): State<Arc<AppState>>, RawQuery(query): RawQuery) -> Response {
    let tags: Vec<String> = query_pairs(query.as_deref())
        .into_iter()
        .filter(|(k, _)| k == "tags")
        .map(|(_, v)| v)
        .collect();
    match state.engine.wake_up(&tags).await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => sleep_error(e),
    }
}

async fn is_sleeping(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"is_sleeping": state.engine.is_sleeping().await}))
}

async fn collective_rpc(State(state): State<Arc<AppState>>, bytes: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    match body.get("method").and_then(Value::as_str) {
        None => ApiError::bad_request("Missing 'method' in request body").into_response(),
        Some("reload_weights") => match state.engine.reload_weights().await {
            Ok(()) => Json(json!({"results": [null]})).into_response(),
            Err(e) => sleep_error(e),
        },
        Some(other) => ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("The emulator's workers have no method `{other}`; only reload_weights."),
        }
        .into_response(),
    }
}

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> StatusCode {
    state.engine.reset_prefix_cache();
    StatusCode::OK
}

async fn server_info(State(state): State<Arc<AppState>>, RawQuery(query): RawQuery) -> Json<Value> {
    let json_format = query_pairs(query.as_deref())
        .iter()
        .any(|(k, v)| k == "config_format" && v == "json");
    let config = vllm_config(&state);
    let vllm_config = if json_format {
        Value::Object(config.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
    } else {
        Value::String(
            config
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) if matches!(*k, "model" | "tokenizer" | "download_dir") => {
                        format!("{k}='{s}'")
                    }
                    Value::String(s) => format!("{k}={s}"),
                    Value::Null => format!("{k}=None"),
                    Value::Bool(true) => format!("{k}=True"),
                    Value::Bool(false) => format!("{k}=False"),
                    other => format!("{k}={other}"),
                })
                .collect::<Vec<_>>()
                .join(", "),
        )
    };
    let env: serde_json::Map<String, Value> = state
        .info
        .vllm_env
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    Json(json!({
        "vllm_config": vllm_config,
        "vllm_env": env,
        "system_env": format!("vLLM Version: {} (emulated; no GPU)", state.version()),
    }))
}

/// The fields of `VllmConfig.__str__`, in its order, as this server runs.
pub fn vllm_config(state: &AppState) -> Vec<(&'static str, Value)> {
    let s = &state.info.serve;
    let tokenizer = s.tokenizer.clone().unwrap_or_else(|| s.model.clone());
    vec![
        ("model", json!(s.model)),
        ("speculative_config", Value::Null),
        ("tokenizer", json!(tokenizer)),
        ("skip_tokenizer_init", json!(false)),
        ("tokenizer_mode", json!("auto")),
        ("revision", json!(s.revision)),
        ("tokenizer_revision", Value::Null),
        ("trust_remote_code", json!(false)),
        (
            "dtype",
            json!(if s.dtype == "auto" {
                "torch.bfloat16".to_string()
            } else {
                s.dtype.clone()
            }),
        ),
        ("max_seq_len", json!(state.max_model_len())),
        ("download_dir", Value::Null),
        ("load_format", json!("auto")),
        ("tensor_parallel_size", json!(s.tensor_parallel_size)),
        ("pipeline_parallel_size", json!(1)),
        ("data_parallel_size", json!(1)),
        ("disable_custom_all_reduce", json!(false)),
        ("quantization", Value::Null),
        ("enforce_eager", json!(s.enforce_eager)),
        ("kv_cache_dtype", json!("auto")),
        ("seed", json!(s.seed)),
        ("served_model_name", json!(s.served_names().join(","))),
        ("enable_prefix_caching", json!(s.enable_prefix_caching)),
        ("enable_sleep_mode", json!(s.enable_sleep_mode)),
        ("max_num_seqs", json!(s.max_num_seqs)),
        ("block_size", json!(s.block_size)),
        ("gpu_memory_utilization", json!(s.gpu_memory_utilization)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_arriving_is_408_and_one_over_the_limit_413() {
        let never = Body::from_stream(futures::stream::pending::<Result<Bytes, Infallible>>());
        let stalled = read_body(never, BODY_READ_TIMEOUT).await.err().map(|e| e.status);
        assert_eq!(stalled, Some(StatusCode::REQUEST_TIMEOUT));

        let huge = Body::from(vec![b'x'; MAX_BODY_BYTES + 1]);
        let over = read_body(huge, BODY_READ_TIMEOUT).await.err().map(|e| e.status);
        assert_eq!(over, Some(StatusCode::PAYLOAD_TOO_LARGE));

        let chunks = [
            Ok(Bytes::from_static(b"{\"prompt\": ")),
            Err(std::io::Error::other("reset")),
        ];
        let broken = Body::from_stream(futures::stream::iter(chunks));
        let broke_off = read_body(broken, BODY_READ_TIMEOUT).await.err().map(|e| e.status);
        assert_eq!(broke_off, Some(StatusCode::BAD_REQUEST));

        let whole = Body::from(&b"{}"[..]);
        assert_eq!(
            read_body(whole, BODY_READ_TIMEOUT).await.ok(),
            Some(Bytes::from_static(b"{}"))
        );
    }
}
