//! The HTTP handlers: each turns a request into an [`Incoming`] (identity,
//! deadline, pin and session from the body or its headers), hands it to the
//! same [`Router::route`] the gRPC service calls, and the stream it returns
//! into an OpenAI response. Refusals become OpenAI errors here, once.
use super::auth::{authenticate, ApiKeys, ConnInfo};
use super::convert::{error_frame, Answer, Collected};
use super::errors::ApiError;
use super::request::{parse, Endpoint, Parsed};
use super::wire::{Model, ModelList};
use crate::errors::RouterError;
use crate::route::{request_trace, Api, Incoming, RequestTrace, Routed, Router};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::StreamExt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokenmesh_proto::headers;
use tokenmesh_proto::v1::{generate_response::Event, GenerateResponse};
use tokenmesh_proto::validate::{check_id, check_name, check_request};
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};
use tracing::Span;

/// Request header: the sticky-session key (beside DESIGN's `x-tokenmesh-session`).
pub const SESSION_ID: &str = "x-session-id";
/// Request header: the caller's deadline in milliseconds (HTTP has no
/// `grpc-timeout`; that header is honoured too).
pub const TIMEOUT_MS: &str = "x-tokenmesh-timeout-ms";
/// Request and response header: the request id.
pub const REQUEST_ID: &str = "x-request-id";

/// What every handler shares.
pub struct AppState {
    /// The request path the gRPC service uses too.
    pub router: Arc<Router>,
    /// `--api-keys`.
    pub keys: Option<ApiKeys>,
    /// `--http-max-body-bytes`.
    pub max_body_bytes: usize,
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(s): State<Arc<AppState>>,
    Extension(conn): Extension<ConnInfo>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    s.generate(Endpoint::Chat, conn, headers, body).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(s): State<Arc<AppState>>,
    Extension(conn): Extension<ConnInfo>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    s.generate(Endpoint::Completions, conn, headers, body).await
}

/// `GET /v1/models`: every model, and every version as `model@version`.
pub async fn models(
    State(s): State<Arc<AppState>>,
    Extension(conn): Extension<ConnInfo>,
    headers: HeaderMap,
) -> Response {
    match s.model_list(&conn, &headers) {
        Ok(data) => json(
            StatusCode::OK,
            &ModelList {
                object: "list",
                data,
            },
        ),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models/{model}`.
pub async fn model(
    State(s): State<Arc<AppState>>,
    Extension(conn): Extension<ConnInfo>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let data = match s.model_list(&conn, &headers) {
        Ok(data) => data,
        Err(e) => return e.into_response(),
    };
    match data.iter().find(|m| m.id == id) {
        Some(m) => json(StatusCode::OK, m),
        None => {
            let available = data.into_iter().map(|m| m.id).collect();
            ApiError::from(RouterError::UnknownModel {
                asked: id,
                available,
            })
            .into_response()
        }
    }
}

/// Any other path.
pub async fn no_route(method: Method, uri: Uri) -> Response {
    ApiError::new(
        Code::NotFound,
        format!(
            "no route {method} {}: the API serves POST /v1/chat/completions, \
             POST /v1/completions and GET /v1/models",
            uri.path()
        ),
    )
    .reason("unknown_url")
    .into_response()
}

/// A known path with another method.
pub async fn wrong_method(method: Method, uri: Uri) -> Response {
    ApiError::new(
        Code::InvalidArgument,
        format!("{} does not accept {method}", uri.path()),
    )
    .http(StatusCode::METHOD_NOT_ALLOWED)
    .reason("method_not_allowed")
    .into_response()
}

fn json(status: StatusCode, value: &impl serde::Serialize) -> Response {
    let body = serde_json::to_string(value).unwrap_or_default();
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A request refused before it had a stream, with the model it named.
struct Refusal {
    model: String,
    error: ApiError,
}

impl From<ApiError> for Refusal {
    fn from(error: ApiError) -> Self {
        Self {
            model: String::new(),
            error,
        }
    }
}

impl AppState {
    fn model_list(&self, conn: &ConnInfo, headers: &HeaderMap) -> Result<Vec<Model>, ApiError> {
        authenticate(self.keys.as_ref(), conn, headers)?;
        self.router.ensure_loaded()?;
        let entry = |id: String| Model {
            id,
            object: "model",
            created: 0,
            owned_by: "tokenmesh",
        };
        let mut data = Vec::new();
        for (name, m) in self.router.registry().models() {
            let versions: Vec<String> = m.versions.keys().cloned().collect();
            data.push(entry(name.clone()));
            data.extend(versions.into_iter().map(|v| entry(format!("{name}@{v}"))));
        }
        Ok(data)
    }

    async fn generate(
        &self,
        endpoint: Endpoint,
        conn: ConnInfo,
        headers: HeaderMap,
        body: Body,
    ) -> Response {
        let started = Instant::now();
        let trace = request_trace(Api::Openai, &MetadataMap::from_headers(headers.clone()));
        let span = trace.span.clone();
        // Nothing here is instrumented with the span: tracing-opentelemetry
        // ends a span at its last exit, and entering it per poll costs per
        // token; log lines name it as their parent.
        let prepared = self
            .prepare(endpoint, &conn, &headers, body, started, trace)
            .await;
        let (routed, answer, stream) = match prepared {
            Ok(p) => p,
            Err(Refusal { model, error }) => return self.refused(&span, &model, error),
        };
        let request_id = answer.id.split_once('-').map(|(_, id)| id.to_string());
        let mut response = if stream {
            streamed(routed.stream, answer).await
        } else {
            whole(routed.stream, answer).await
        };
        let h = response.headers_mut();
        for (name, value) in [
            (headers::VERSION, routed.version.as_str()),
            (headers::WORKER, routed.worker_id.as_str()),
            (REQUEST_ID, request_id.as_deref().unwrap_or("")),
        ] {
            if let Ok(v) = HeaderValue::from_str(value) {
                h.insert(name, v);
            }
        }
        response
    }

    /// Logs and counts a refusal of a request that asked for `model`, and
    /// answers it.
    fn refused(&self, span: &Span, model: &str, e: ApiError) -> Response {
        span.record("otel.status_code", "ERROR");
        span.record("error", e.message.as_str());
        tracing::info!(parent: span, status = e.status.as_u16(), error = %e.message, "refused");
        self.router.count_refusal(model, Api::Openai, e.code);
        e.into_response()
    }

    /// Everything up to the first worker stream: authentication, the body,
    /// its checks, and the routing.
    async fn prepare(
        &self,
        endpoint: Endpoint,
        conn: &ConnInfo,
        headers: &HeaderMap,
        body: Body,
        started: Instant,
        trace: RequestTrace,
    ) -> Result<(Routed, Answer, bool), Refusal> {
        let RequestTrace { span, unsampled } = trace;
        let span = &span;
        // The (bounded) body is read before any other refusal: an HTTP/2
        // response sent while the client still sends its body ends with a
        // stream reset that some clients (curl) report instead of the status.
        let bytes = read_body(body, headers, self.max_body_bytes).await?;
        let identity = authenticate(self.keys.as_ref(), conn, headers)?;
        span.record("identity", identity.as_str());
        content_type(headers)?;
        let parsed = parse(endpoint, &bytes)?;
        let model = parsed.request.model.clone();
        let with_model = |error: ApiError| Refusal {
            model: model.clone(),
            error,
        };
        let (mut incoming, answer, stream) =
            incoming(endpoint, parsed, identity, headers, started, span).map_err(with_model)?;
        incoming.unsampled = unsampled;
        let routed = self
            .router
            .route(incoming, span)
            .await
            .map_err(|e| with_model(e.into()))?;
        let answer = Answer {
            version: routed.version.clone(),
            ..answer
        };
        Ok((routed, answer, stream))
    }
}

/// Only JSON bodies (a missing Content-Type is read as JSON).
fn content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(v) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let v = v.to_str().unwrap_or("");
    let essence = v.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    Err(ApiError::invalid(
        "Content-Type",
        format!("expected application/json, got {v:?}"),
    )
    .http(StatusCode::UNSUPPORTED_MEDIA_TYPE)
    .reason("unsupported_media_type"))
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        Code::InvalidArgument,
        format!(
            "the body is larger than the router's limit of {max} bytes (--http-max-body-bytes)"
        ),
    )
    .http(StatusCode::PAYLOAD_TOO_LARGE)
    .reason("body_too_large")
}

/// The body, at most `max` bytes: a declared length beyond it is refused
/// before anything is read, and reading stops as soon as it is passed.
async fn read_body(body: Body, headers: &HeaderMap, max: usize) -> Result<Vec<u8>, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large(max));
    }
    let mut buf = Vec::with_capacity(declared.unwrap_or(0) as usize);
    let mut data = body.into_data_stream();
    while let Some(chunk) = data.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::new(Code::InvalidArgument, format!("reading the body: {e}")))?;
        if buf.len() + chunk.len() > max {
            return Err(too_large(max));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf)
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// The deadline from `x-tokenmesh-timeout-ms` or `grpc-timeout`.
fn deadline(headers: &HeaderMap) -> Result<Option<Duration>, ApiError> {
    if let Some(v) = header_str(headers, TIMEOUT_MS) {
        let ms: u64 = v.parse().map_err(|_| {
            ApiError::invalid(
                TIMEOUT_MS,
                format!("{v:?} is not a whole number of milliseconds"),
            )
        })?;
        return Ok(Some(Duration::from_millis(ms)));
    }
    Ok(tokenmesh_proto::deadline::grpc_timeout(
        &MetadataMap::from_headers(headers.clone()),
    ))
}

/// The parsed body as the request path's [`Incoming`], and how to answer.
fn incoming(
    endpoint: Endpoint,
    parsed: Parsed,
    identity: String,
    headers: &HeaderMap,
    started: Instant,
    span: &Span,
) -> Result<(Incoming, Answer, bool), ApiError> {
    let mut req = parsed.request;
    let pin = match (header_str(headers, headers::VERSION), parsed.pin) {
        (Some(h), Some(m)) if h != m => {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "pins version {m:?} but the {} header pins {h:?}",
                    headers::VERSION
                ),
            ))
        }
        (Some(h), _) => Some(h.to_string()),
        (None, m) => m,
    };
    let session = header_str(headers, SESSION_ID)
        .or_else(|| header_str(headers, headers::SESSION))
        .map(str::to_string)
        .or(parsed.user);
    check_request(&req).map_err(RouterError::from)?;
    if let Some(pin) = &pin {
        check_name(headers::VERSION, pin).map_err(RouterError::from)?;
    }
    if let Some(session) = &session {
        check_id(
            "session (x-session-id, x-tokenmesh-session or user)",
            session,
        )
        .map_err(RouterError::from)?;
    }
    // Only checked strings reach the span (and the log lines under it).
    span.record("model", req.model.as_str());
    req.request_id = header_str(headers, REQUEST_ID)
        .filter(|id| check_id("x-request-id", id).is_ok())
        .map(str::to_string)
        .unwrap_or_else(|| crate::ids::uuid_v4().to_string());
    span.record("request_id", req.request_id.as_str());
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    let answer = Answer {
        endpoint,
        id: format!("{prefix}-{}", req.request_id),
        created: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: req.model.clone(),
        version: String::new(),
        include_usage: parsed.include_usage,
        logprobs: parsed.logprobs,
    };
    let incoming = Incoming {
        request: req,
        identity,
        pin,
        session,
        deadline: deadline(headers)?.map(|t| tokio::time::Instant::now() + t),
        started,
        api: Api::Openai,
        unsampled: None,
    };
    Ok((incoming, answer, parsed.stream))
}

type Messages = crate::route::ClientMessages;

/// A non-streamed answer: the whole stream, then one JSON object (or the
/// error it ended with).
async fn whole(mut messages: Messages, answer: Answer) -> Response {
    let mut collected = Collected::default();
    while let Some(msg) = messages.next().await {
        match msg.map(|m| m.event) {
            Ok(Some(Event::Delta(d))) => collected.delta(&d),
            Ok(Some(Event::Finished(f))) => {
                let body = collected.body(&answer, &f);
                return (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "application/json")],
                    body,
                )
                    .into_response();
            }
            Ok(_) => {}
            Err(status) => return ApiError::from_status(&status).into_response(),
        }
    }
    ApiError::new(Code::Unavailable, "the stream ended without finishing").into_response()
}

/// A streamed answer. The status line waits for the first event after
/// `Accepted`, so that a failure before the first token is a plain HTTP
/// error the client's library raises; after it, events go out as SSE
/// frames, and a failure ends the stream with an error frame, never with
/// `[DONE]`.
async fn streamed(mut messages: Messages, answer: Answer) -> Response {
    let first = loop {
        match messages.next().await {
            Some(Ok(GenerateResponse {
                event: Some(Event::Accepted(_)) | None,
                ..
            })) => continue,
            Some(Ok(msg)) => break msg,
            Some(Err(status)) => return ApiError::from_status(&status).into_response(),
            None => {
                return ApiError::new(Code::Unavailable, "the stream ended without finishing")
                    .into_response()
            }
        }
    };
    let answer = Arc::new(answer);
    let opening = answer.opening();
    let head = frames(&answer, Ok(first));
    let rest = messages.map({
        let answer = answer.clone();
        move |m| frames(&answer, m)
    });
    let body = futures::stream::iter([opening, head])
        .chain(rest)
        .filter(|b| futures::future::ready(!b.is_empty()))
        .map(Ok::<_, std::convert::Infallible>);
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// The SSE bytes of one message of the stream (empty for none).
fn frames(answer: &Answer, msg: Result<GenerateResponse, Status>) -> bytes::Bytes {
    match msg.map(|m| m.event) {
        Ok(Some(Event::Delta(d))) => answer.delta(&d).unwrap_or_default(),
        Ok(Some(Event::Finished(f))) => answer.finished(&f),
        Ok(_) => bytes::Bytes::new(),
        Err(status) => error_frame(&ApiError::from_status(&status)),
    }
}
