//! The HTTP/1.1 client towards the engine: hyper's pooled client (kept-alive
//! connections, so a request costs no handshake), JSON bodies in, bounded
//! JSON answers or a streaming body out. Plain `http://` only: engines sit
//! next to their worker (same host or pod), behind the worker's mTLS.
use super::error::UpstreamError;
use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// The largest non-streaming answer read (tokenize, metrics, errors).
pub const MAX_ANSWER_BYTES: usize = 16 << 20;

/// A client for one engine's base URL.
#[derive(Clone, Debug)]
pub struct EngineHttp {
    client: Client<HttpConnector, Full<Bytes>>,
    /// `http://host:port` plus any path prefix, without a trailing slash.
    base: String,
    /// Bounds each non-streaming call.
    timeout: Duration,
}

/// Why a base URL is unusable.
#[derive(Debug, thiserror::Error)]
#[error("--upstream-url {url:?}: {reason}")]
pub struct BadUrl {
    pub url: String,
    pub reason: String,
}

impl EngineHttp {
    /// A client for `url` (`http://host:port[/prefix]`).
    pub fn new(url: &str, timeout: Duration) -> Result<Self, BadUrl> {
        let bad = |reason: &str| BadUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(_) => {
                return Err(bad(
                    "only http:// is supported (run the engine beside the worker)",
                ))
            }
            None => return Err(bad("give the scheme, e.g. http://127.0.0.1:8080")),
        }
        if uri.authority().is_none() {
            return Err(bad("no host"));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new())
            // Under llama-server's keep-alive (cpp-httplib ends a connection
            // idle for 5 s): a connection it closed while pooled here is one
            // a request can go out on unanswered.
            .pool_idle_timeout(POOL_IDLE)
            .build(connector);
        Ok(Self {
            client,
            base: url.trim_end_matches('/').to_string(),
            timeout,
        })
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn request(
        &self,
        method: http::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Request<Full<Bytes>> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        let body = match body {
            Some(json) => {
                builder = builder.header(http::header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(json.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        builder
            .body(body)
            .expect("a request from a checked base URL")
    }

    /// Sends a request and waits for the answer's head, resent as
    /// [`send_resending`] says.
    async fn send(
        &self,
        req: Request<Full<Bytes>>,
    ) -> Result<http::Response<Incoming>, UpstreamError> {
        send_resending(&self.client, req, |e| {
            tracing::debug!(error = %error_chain(e), "engine closed the connection unanswered; sending again");
            metrics::counter!("tokenmesh_worker_upstream_resent_total").increment(1);
        })
        .await
        .map_err(|e| UpstreamError::Unreachable(error_chain(&e)))
    }

    /// `GET path`: the status and the whole (bounded) body.
    pub async fn get(&self, path: &str) -> Result<(StatusCode, Bytes), UpstreamError> {
        let req = self.request(http::Method::GET, path, None);
        self.whole(req).await
    }

    /// `POST path` with a JSON body; the answer's JSON, an HTTP error for
    /// any status but 200.
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, UpstreamError> {
        let req = self.request(http::Method::POST, path, Some(body));
        let (status, bytes) = self.whole(req).await?;
        if status != StatusCode::OK {
            return Err(http_error(status, &bytes));
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| UpstreamError::Malformed(format!("{path}: not JSON: {e}")))
    }

    /// `GET path`, parsed as JSON; an HTTP error for any status but 200.
    pub async fn get_json(&self, path: &str) -> Result<serde_json::Value, UpstreamError> {
        let (status, bytes) = self.get(path).await?;
        if status != StatusCode::OK {
            return Err(http_error(status, &bytes));
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| UpstreamError::Malformed(format!("{path}: not JSON: {e}")))
    }

    /// `POST path` for a streaming answer: its body once the engine has
    /// answered 200 (any other status is read, bounded, into an HTTP error).
    /// Dropping the body closes the connection, which stops the engine's
    /// work on it.
    pub async fn post_stream(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<Incoming, UpstreamError> {
        let req = self.request(http::Method::POST, path, Some(body));
        let resp = self.send(req).await?;
        let status = resp.status();
        if status == StatusCode::OK {
            return Ok(resp.into_body());
        }
        let bytes = tokio::time::timeout(self.timeout, read_bounded(resp.into_body()))
            .await
            .unwrap_or_else(|_| Ok(Bytes::new()))
            .unwrap_or_default();
        Err(http_error(status, &bytes))
    }

    async fn whole(&self, req: Request<Full<Bytes>>) -> Result<(StatusCode, Bytes), UpstreamError> {
        let call = async {
            let resp = self.send(req).await?;
            let status = resp.status();
            Ok((status, read_bounded(resp.into_body()).await?))
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| UpstreamError::Timeout(self.timeout))?
    }
}

/// The most of a finished stream's rest that is read to keep its
/// connection, and how long that may take: an engine sends at most a usage
/// event and `[DONE]` after the finish.
const DRAIN_BYTES: usize = 64 << 10;
const DRAIN_TIME: Duration = Duration::from_secs(1);

/// Reads what follows a stream's finish to the body's end, so that hyper
/// returns its connection to the pool instead of closing it (a closed one
/// costs the next request a new connection); past the bounds it is dropped.
pub async fn drain(body: Incoming) {
    let read = Limited::new(body, DRAIN_BYTES).collect();
    if let Ok(Err(e)) = tokio::time::timeout(DRAIN_TIME, read).await {
        tracing::debug!(error = %e, "the rest of a finished stream was not read");
    }
}

/// How long a pooled connection to the engine may idle: under the 5 s
/// after which llama-server's HTTP server closes one.
const POOL_IDLE: Duration = Duration::from_secs(4);

/// How many times a request the engine closed unanswered is sent again.
const RESENDS: usize = 3;

/// Sends `req` and waits for the answer's head. A request whose connection
/// the server closed before answering a byte is sent again, up to
/// [`RESENDS`] times (`resent` is told each time): that is a kept-alive
/// connection the server closed as the request went out (llama-server's
/// HTTP server ends idle and spent connections), so it never saw the
/// request. More than once, because the next pooled connection may have
/// been closed alike. Only for calls with no effect beyond their answer
/// (the engines' completions, tokenize and template calls). Shared with
/// meshctl's OpenAI client, which resends in the same case, as OpenAI's
/// own clients do.
pub async fn send_resending(
    client: &Client<HttpConnector, Full<Bytes>>,
    mut req: Request<Full<Bytes>>,
    mut resent: impl FnMut(&hyper_util::client::legacy::Error),
) -> Result<http::Response<Incoming>, hyper_util::client::legacy::Error> {
    let mut sent = 0;
    loop {
        let again = (sent < RESENDS).then(|| clone_request(&req));
        match (client.request(req).await, again) {
            (Err(e), Some(again)) if closed_before_answer(&e) => {
                resent(&e);
                sent += 1;
                req = again;
            }
            (answer, _) => return answer,
        }
    }
}

/// A copy of a request with a whole body, to send again.
fn clone_request(req: &Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    let mut copy = Request::new(req.body().clone());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.headers_mut() = req.headers().clone();
    copy
}

/// Whether the connection closed before any byte of an answer arrived
/// (hyper: "connection closed before message completed"), not a refused
/// connection, which sending again would not mend.
fn closed_before_answer(e: &hyper_util::client::legacy::Error) -> bool {
    !e.is_connect()
        && std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<hyper::Error>())
            .is_some_and(hyper::Error::is_incomplete_message)
}

async fn read_bounded(body: Incoming) -> Result<Bytes, UpstreamError> {
    Limited::new(body, MAX_ANSWER_BYTES)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| UpstreamError::Unreachable(format!("reading the answer: {e}")))
}

/// An HTTP error with the engine's message: OpenAI's and llama-server's
/// `{"error": {"message": ...}}`, vLLM's `{"message": ...}`, else the text.
pub fn http_error(status: StatusCode, body: &[u8]) -> UpstreamError {
    let message = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("error").filter(|e| e.is_string()))
                .or_else(|| v.get("detail"))
                .map(|m| {
                    m.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| m.to_string())
                })
        })
        .unwrap_or_else(|| {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            if text.is_empty() {
                status
                    .canonical_reason()
                    .unwrap_or("no message")
                    .to_string()
            } else {
                text.chars().take(512).collect()
            }
        });
    UpstreamError::Http {
        status: status.as_u16(),
        message,
    }
}

/// An error and its sources on one line (hyper's own says only "client
/// error (Connect)").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_must_be_plain_http_with_a_host() {
        let t = Duration::from_secs(1);
        assert!(EngineHttp::new("http://127.0.0.1:8080/", t).is_ok());
        assert_eq!(
            EngineHttp::new("http://h:1/v/", t).unwrap().base(),
            "http://h:1/v"
        );
        let err = EngineHttp::new("https://h:1", t).unwrap_err();
        assert!(err.to_string().contains("only http://"), "{err}");
        assert!(EngineHttp::new("127.0.0.1:8080", t).is_err());
    }

    #[test]
    fn error_messages_are_taken_from_each_engine_shape() {
        let msg = |body: &str| match http_error(StatusCode::BAD_REQUEST, body.as_bytes()) {
            UpstreamError::Http { message, .. } => message,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            msg(r#"{"error":{"code":400,"message":"bad n_predict"}}"#),
            "bad n_predict"
        );
        assert_eq!(
            msg(r#"{"object":"error","message":"too long"}"#),
            "too long"
        );
        assert_eq!(msg("plain words\n"), "plain words");
        assert_eq!(msg(""), "Bad Request");
    }
}
