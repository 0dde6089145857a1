//! The load generator's OpenAI-compatible transport (`--api openai`): the
//! router's `POST /v1/completions` with `"stream": true`, read as Server-Sent
//! Events, so that the HTTP front door and gRPC are measured by one tool.
//!
//! HTTP/1.1 over a pool of keep-alive connections (one per stream in flight,
//! as OpenAI's clients do), or with `--http2` all streams multiplexed over
//! HTTP/2 (prior knowledge) like gRPC. Each content chunk counts as one
//! token (one chunk per token is what the router sends; a chunk held back
//! for a stop string or a multi-byte character joins the next), and the
//! final usage (`stream_options.include_usage`) books any difference at the
//! end of the stream.
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use std::time::Duration;
use tokenmesh_proto::v1::GenerateRequest;

/// One HTTP client for every stream of a run.
#[derive(Clone)]
pub struct OpenAi {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    /// Fields set on every completion body (`--extra-body`).
    extra: ExtraBody,
}

/// Fields `--extra-body` adds to every completion request.
pub type ExtraBody = serde_json::Map<String, serde_json::Value>;

/// Parses `--extra-body`: a JSON object.
pub fn parse_extra_body(text: &str) -> Result<ExtraBody, String> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(other) => Err(format!(
            "a JSON object is needed, e.g. '{{\"cache_prompt\": false}}', not {other}"
        )),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// What one stream delivers, event by event.
pub enum Tick {
    /// Tokens arrived.
    Tokens(u32),
    /// The stream finished with `[DONE]`.
    Done,
}

/// A streaming response being read.
pub struct SseStream {
    body: hyper::body::Incoming,
    buf: Vec<u8>,
    counted: u32,
    usage: Option<u32>,
    /// The body ended.
    eof: bool,
    /// `[DONE]` was read.
    done: bool,
}

#[derive(serde::Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
    error: Option<ErrorBody>,
}

#[derive(serde::Deserialize)]
struct Choice {
    text: Option<String>,
}

#[derive(serde::Deserialize)]
struct Usage {
    completion_tokens: u32,
}

#[derive(serde::Deserialize)]
struct ErrorBody {
    code: Option<String>,
}

/// Why a stream failed: the status-code name the reports count, and what
/// was said (the HTTP error's chain of causes, the answer's status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: String,
    pub detail: String,
}

impl Failure {
    fn new(code: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            detail: detail.into(),
        }
    }
}

/// An error and its sources on one line (hyper's own says only "client
/// error (SendRequest)").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The status-code name an HTTP status stands for, as the reports list errors.
fn code_of(status: u16) -> String {
    match status {
        400 => "INVALID_ARGUMENT".into(),
        401 => "UNAUTHENTICATED".into(),
        403 => "PERMISSION_DENIED".into(),
        404 => "NOT_FOUND".into(),
        429 => "RESOURCE_EXHAUSTED".into(),
        503 => "UNAVAILABLE".into(),
        504 => "DEADLINE_EXCEEDED".into(),
        s => format!("HTTP_{s}"),
    }
}

impl OpenAi {
    /// A client of the router's HTTP API at `addr` (`host:port` or an
    /// `http://` URL).
    pub fn new(addr: &str, http2: bool, extra: ExtraBody) -> anyhow::Result<Self> {
        let base = super::transport::url(addr);
        anyhow::ensure!(
            base.starts_with("http://"),
            "{base}: --api openai speaks plaintext HTTP only (TLS is not supported by the load generator yet)"
        );
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .http2_only(http2)
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Ok(Self {
            client,
            base: base.trim_end_matches('/').to_string(),
            extra,
        })
    }

    /// Starts one streamed completion.
    pub async fn generate(&self, req: &GenerateRequest) -> Result<SseStream, Failure> {
        let mut body = serde_json::json!({
            "model": req.model,
            "prompt": req.prompt,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(n) = req.max_tokens {
            body["max_tokens"] = n.into();
        }
        if let Some(t) = req.temperature {
            body["temperature"] = t.into();
        }
        if req.ignore_eos {
            body["ignore_eos"] = true.into();
        }
        for (k, v) in &self.extra {
            body[k] = v.clone();
        }
        let body = Bytes::from(body.to_string());
        let request = http::Request::post(format!("{}/v1/completions", self.base))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| Failure::new("CLIENT_ERROR", e.to_string()))?;
        let response = tokenmesh_worker::upstream::send_resending(&self.client, request, |_| {})
            .await
            .map_err(|e| Failure::new("UNAVAILABLE", error_chain(&e)))?;
        let status = response.status();
        if !status.is_success() {
            // The answer's message, bounded, for the report's example.
            let body = http_body_util::Limited::new(response.into_body(), 4096)
                .collect()
                .await
                .map(|c| String::from_utf8_lossy(&c.to_bytes()).into_owned())
                .unwrap_or_default();
            return Err(Failure::new(
                code_of(status.as_u16()),
                format!("HTTP {status}: {}", body.trim()),
            ));
        }
        Ok(SseStream {
            body: response.into_body(),
            buf: Vec::new(),
            counted: 0,
            usage: None,
            eof: false,
            done: false,
        })
    }

    /// The only model the router lists, as `meshctl bench` asks when no
    /// `--model` is given.
    pub async fn default_model(&self) -> anyhow::Result<String> {
        let request =
            http::Request::get(format!("{}/v1/models", self.base)).body(Full::new(Bytes::new()))?;
        let response = self.client.request(request).await?;
        anyhow::ensure!(
            response.status().is_success(),
            "GET /v1/models: {}",
            response.status()
        );
        let body = response.into_body().collect().await?.to_bytes();
        let list: serde_json::Value = serde_json::from_slice(&body)?;
        let names: Vec<&str> = list["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["id"].as_str())
            .filter(|id| !id.contains('@'))
            .collect();
        match names.as_slice() {
            [one] => Ok(one.to_string()),
            [] => anyhow::bail!("the router knows no models yet"),
            _ => anyhow::bail!("several models are served; choose one with --model"),
        }
    }
}

impl SseStream {
    /// The next event; `Ok(None)` when the stream ended without `[DONE]`.
    pub async fn next(&mut self) -> Result<Option<Tick>, Failure> {
        loop {
            if let Some(end) = find(&self.buf, b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..end + 2).collect();
                if let Some(tick) = self.event(&event[..end])? {
                    return Ok(Some(tick));
                }
                continue;
            }
            if self.eof || self.done {
                return Ok(None);
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => {
                    return Err(Failure::new(
                        "UNAVAILABLE",
                        format!("reading the stream: {}", error_chain(&e)),
                    ))
                }
                None => self.eof = true,
            }
        }
    }

    fn event(&mut self, event: &[u8]) -> Result<Option<Tick>, Failure> {
        let Some(data) = event.strip_prefix(b"data: ") else {
            return Ok(None);
        };
        if data == b"[DONE]" {
            // The usage books what the chunks did not show.
            let rest = self.usage.unwrap_or(0).saturating_sub(self.counted);
            self.counted += rest;
            self.done = true;
            self.buf.clear();
            return Ok(Some(if rest > 0 {
                Tick::Tokens(rest)
            } else {
                Tick::Done
            }));
        }
        let chunk: Chunk =
            serde_json::from_slice(data).map_err(|e| Failure::new("BAD_CHUNK", e.to_string()))?;
        if let Some(e) = chunk.error {
            let code = match e.code.as_deref() {
                Some("timeout") => "DEADLINE_EXCEEDED",
                Some("rate_limit_exceeded") => "RESOURCE_EXHAUSTED",
                _ => "STREAM_ERROR",
            };
            return Err(Failure::new(code, String::from_utf8_lossy(data)));
        }
        if let Some(u) = chunk.usage {
            self.usage = Some(u.completion_tokens);
        }
        let content = chunk
            .choices
            .iter()
            .any(|c| c.text.as_deref().is_some_and(|t| !t.is_empty()));
        if content {
            self.counted += 1;
            return Ok(Some(Tick::Tokens(1)));
        }
        Ok(None)
    }

    /// Whether `[DONE]` was read after the last `Tokens`.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Reads the body past `[DONE]` to its end (bounded), as OpenAI's
    /// clients do, so that hyper pools the connection for the next request
    /// instead of closing it.
    pub async fn finish(mut self) {
        let mut left = 64usize << 10;
        let read = async {
            while let Some(Ok(frame)) = self.body.frame().await {
                let n = frame.data_ref().map_or(0, |d| d.len());
                left = match left.checked_sub(n) {
                    Some(l) => l,
                    None => return,
                };
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), read).await;
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_read_as_the_codes_the_reports_list() {
        assert_eq!(code_of(429), "RESOURCE_EXHAUSTED");
        assert_eq!(code_of(504), "DEADLINE_EXCEEDED");
        assert_eq!(code_of(418), "HTTP_418");
    }

    #[test]
    fn extra_bodies_are_json_objects() {
        let extra = parse_extra_body(r#"{"cache_prompt": false, "n_probs": 0}"#).unwrap();
        assert_eq!(extra["cache_prompt"], false);
        assert_eq!(extra.len(), 2);
        let err = parse_extra_body("[1]").unwrap_err();
        assert!(err.contains("a JSON object is needed"), "{err}");
        assert!(parse_extra_body("{cache_prompt")
            .unwrap_err()
            .starts_with("not JSON"));
    }
}
