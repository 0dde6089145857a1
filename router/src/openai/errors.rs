//! OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`,
//! and the one mapping from the router's errors and gRPC statuses to it: the
//! HTTP status follows the gRPC code the same failure gets on the gRPC API
//! (INVALID_ARGUMENT 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403,
//! NOT_FOUND 404, RESOURCE_EXHAUSTED 429 with `Retry-After`, UNAVAILABLE 503,
//! DEADLINE_EXCEEDED 504, …).
use crate::errors::RouterError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tonic::{Code, Status};

/// One refusal of the HTTP API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The gRPC code the same failure has, for the metrics.
    pub code: Code,
    /// What is wrong and what to do, for a person.
    pub message: String,
    /// The request field (or header) at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable reason (`model_not_found`, `unsupported_parameter`, …).
    pub reason: Option<&'static str>,
    /// Seconds to wait before retrying (429).
    pub retry_after_s: Option<u64>,
}

/// The JSON body, as OpenAI's clients parse it.
#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

/// The HTTP status a gRPC code maps to.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            StatusCode::BAD_REQUEST
        }
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Internal | Code::Unknown | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// OpenAI's `type` for an HTTP status.
fn kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

impl ApiError {
    /// A refusal with `code`'s HTTP status.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            status: http_status(code),
            code,
            message: message.into(),
            param: None,
            reason: None,
            retry_after_s: None,
        }
    }

    /// 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        let message = format!("{param}: {}", message.into());
        Self::new(Code::InvalidArgument, message).param(param)
    }

    /// 400 for a field tokenmesh has no counterpart for.
    pub fn unsupported(param: &str, why: &str) -> Self {
        Self::invalid(param, why).reason("unsupported_parameter")
    }

    /// With the field at fault.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// With a machine-readable reason.
    pub fn reason(mut self, reason: &'static str) -> Self {
        self.reason = Some(reason);
        self
    }

    /// With another HTTP status than the code's (413, 415, 405).
    pub fn http(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// A status from a worker or the request path, as it reached the edge.
    pub fn from_status(status: &Status) -> Self {
        let mut e = Self::new(status.code(), status.message());
        // Validation messages read "field: reason" (proto/src/validate.rs).
        if status.code() == Code::InvalidArgument {
            e.param = field_of(status.message());
        }
        e.retry_after_s = status
            .metadata()
            .get("retry-after-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(|ms| ms.div_ceil(1000).max(1));
        if e.code == Code::ResourceExhausted && e.retry_after_s.is_none() {
            e.retry_after_s = Some(1);
        }
        e
    }

    /// The body of an SSE error event: a stream that fails after it started
    /// ends with it instead of `[DONE]`.
    pub fn json(&self) -> String {
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: kind(self.status),
                param: self.param.as_deref(),
                code: self.reason.or(match self.code {
                    Code::ResourceExhausted => Some("rate_limit_exceeded"),
                    Code::DeadlineExceeded => Some("timeout"),
                    _ => None,
                }),
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| "{}".into())
    }
}

/// The field a "field: reason" message names, if it starts with one.
fn field_of(message: &str) -> Option<String> {
    let (field, _) = message.split_once(':')?;
    let ok = !field.is_empty()
        && field
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '[' | ']'));
    ok.then(|| field.to_string())
}

impl From<RouterError> for ApiError {
    fn from(e: RouterError) -> Self {
        let (param, reason) = match &e {
            RouterError::Invalid(f) => (Some(f.field.to_string()), None),
            RouterError::UnknownModel { .. } => (Some("model".into()), Some("model_not_found")),
            RouterError::UnknownVersion { .. } | RouterError::PinNotAllowed(_) => {
                (Some("x-tokenmesh-version".into()), None)
            }
            _ => (None, None),
        };
        let mut api = Self::from_status(&e.into_status());
        if param.is_some() {
            api.param = param;
        }
        api.reason = reason;
        api
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.json(),
        )
            .into_response();
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_map_to_the_issue_s_http_statuses() {
        for (code, http) in [
            (Code::InvalidArgument, 400),
            (Code::Unauthenticated, 401),
            (Code::PermissionDenied, 403),
            (Code::NotFound, 404),
            (Code::ResourceExhausted, 429),
            (Code::Unavailable, 503),
            (Code::DeadlineExceeded, 504),
            (Code::Internal, 500),
        ] {
            assert_eq!(http_status(code).as_u16(), http, "{code:?}");
        }
    }

    #[test]
    fn unknown_model_names_the_field_and_lists_the_models() {
        let e: ApiError = RouterError::UnknownModel {
            asked: "gpt-4".into(),
            available: vec!["a".into(), "b".into()],
        }
        .into();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        let v: serde_json::Value = serde_json::from_str(&e.json()).unwrap();
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["type"], "not_found_error");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("available: a, b"), "{message}");
    }

    #[test]
    fn overload_carries_retry_after_in_seconds() {
        let mut s = Status::resource_exhausted("router overloaded");
        s.metadata_mut()
            .insert("retry-after-ms", "1500".parse().unwrap());
        let e = ApiError::from_status(&s);
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after_s, Some(2));
        let r = e.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn a_validation_message_names_its_field() {
        let e = ApiError::from_status(&Status::invalid_argument("top_p: 2 is outside (0, 1]"));
        assert_eq!(e.param.as_deref(), Some("top_p"));
        let e = ApiError::from_status(&Status::invalid_argument("the prompt is too long: 9 > 8"));
        assert_eq!(e.param, None);
    }
}
