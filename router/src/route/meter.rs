//! The metrics of one client stream: latencies as tokens arrive, the outcome
//! once, when the stream ends whichever way it ends (also when the client
//! goes away mid-stream, which drops it). Every series carries the `api` it
//! came through (`grpc` or `openai`).
//!
//! The handles of the per-token series are looked up once, when the stream
//! starts: a lookup by name and labels hashes and allocates its labels, which
//! per token was a measurable share of the router's CPU (issue 20).
use super::Api;
use metrics::{Counter, Gauge, Histogram};
use std::time::Instant;
use tokenmesh_proto::codes::{classify, code_name};
use tracing::Span;

/// Records one client stream in the metrics.
pub struct StreamMeter {
    model: String,
    version: String,
    api: Api,
    started: Instant,
    last_token: Option<Instant>,
    /// The outcome; a stream dropped without one was cancelled by its client.
    pub code: tonic::Code,
    /// The request's `Generate` span: the first token is an event on it and
    /// a failed stream marks it as an error.
    span: Span,
    active: Gauge,
    ttft: Histogram,
    itl: Histogram,
    tokens: Counter,
}

/// Counts a request refused before it had a stream (bad input, unknown
/// model, admission, no worker): the same counters a stream ends in, with
/// no version.
pub fn refused(model: &str, api: Api, code: tonic::Code) {
    metrics::counter!("llm_request_total", "model" => model.to_string(), "version" => "", "code" => code_name(code), "api" => api.as_str())
        .increment(1);
    if classify(code).is_failure() {
        metrics::counter!("llm_request_errors_total", "model" => model.to_string(), "version" => "", "api" => api.as_str())
            .increment(1);
    }
}

fn labels(model: &str, version: &str, api: Api) -> [(&'static str, String); 3] {
    [
        ("model", model.to_string()),
        ("version", version.to_string()),
        ("api", api.as_str().to_string()),
    ]
}

impl StreamMeter {
    /// Starts metering a stream of `model`/`version` received at `started`
    /// through `api`.
    pub fn new(model: &str, version: &str, started: Instant, span: Span, api: Api) -> Self {
        let labels = labels(model, version, api);
        let active = metrics::gauge!("llm_active_streams", &labels);
        active.increment(1.0);
        Self {
            model: model.into(),
            version: version.into(),
            api,
            started,
            last_token: None,
            code: tonic::Code::Cancelled,
            span,
            active,
            ttft: metrics::histogram!("llm_time_to_first_token_seconds", &labels),
            itl: metrics::histogram!("llm_inter_token_latency_seconds", &labels),
            tokens: metrics::counter!("llm_tokens_generated_total", &labels),
        }
    }

    /// `n` more tokens reached the client.
    pub fn tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            None => {
                self.ttft.record((now - self.started).as_secs_f64());
                tracing::info!(parent: &self.span, tokens = n, "first token");
            }
            Some(prev) => self.itl.record((now - prev).as_secs_f64() / n as f64),
        }
        self.tokens.increment(n as u64);
        self.last_token = Some(now);
    }
}

impl Drop for StreamMeter {
    fn drop(&mut self) {
        self.active.decrement(1.0);
        let labels = labels(&self.model, &self.version, self.api);
        metrics::histogram!("llm_request_duration_seconds", &labels)
            .record(self.started.elapsed().as_secs_f64());
        metrics::counter!(
            "llm_request_total",
            "model" => self.model.clone(),
            "version" => self.version.clone(),
            "code" => code_name(self.code),
            "api" => self.api.as_str()
        )
        .increment(1);
        if classify(self.code).is_failure() {
            metrics::counter!("llm_request_errors_total", &labels).increment(1);
            self.span.record("otel.status_code", "ERROR");
        }
    }
}
