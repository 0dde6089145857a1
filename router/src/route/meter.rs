//! The metrics of one client stream: latencies as tokens arrive, the outcome
//! once, when the stream ends whichever way it ends (also when the client
//! goes away mid-stream, which drops it). Every series carries the `api` it
//! came through (`grpc` or `openai`).
use super::Api;
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

impl StreamMeter {
    /// Starts metering a stream of `model`/`version` received at `started`
    /// through `api`.
    pub fn new(model: &str, version: &str, started: Instant, span: Span, api: Api) -> Self {
        let meter = Self {
            model: model.into(),
            version: version.into(),
            api,
            started,
            last_token: None,
            code: tonic::Code::Cancelled,
            span,
        };
        metrics::gauge!("llm_active_streams", &meter.labels()).increment(1.0);
        meter
    }

    fn labels(&self) -> [(&'static str, String); 3] {
        [
            ("model", self.model.clone()),
            ("version", self.version.clone()),
            ("api", self.api.as_str().to_string()),
        ]
    }

    /// `n` more tokens reached the client.
    pub fn tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        let labels = self.labels();
        match self.last_token {
            None => {
                metrics::histogram!("llm_time_to_first_token_seconds", &labels)
                    .record((now - self.started).as_secs_f64());
                tracing::info!(parent: &self.span, tokens = n, "first token");
            }
            Some(prev) => metrics::histogram!("llm_inter_token_latency_seconds", &labels)
                .record((now - prev).as_secs_f64() / n as f64),
        }
        metrics::counter!("llm_tokens_generated_total", &labels).increment(n as u64);
        self.last_token = Some(now);
    }
}

impl Drop for StreamMeter {
    fn drop(&mut self) {
        let labels = self.labels();
        metrics::gauge!("llm_active_streams", &labels).decrement(1.0);
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
