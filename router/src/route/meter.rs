//! The metrics of one client stream: latencies as tokens arrive, the outcome
//! once, when the stream ends whichever way it ends (also when the client
//! goes away mid-stream, which drops it).
use std::time::Instant;
use tokenmesh_proto::codes::{classify, code_name};
use tracing::Span;

/// Records one client stream in the metrics.
pub struct StreamMeter {
    model: String,
    version: String,
    started: Instant,
    last_token: Option<Instant>,
    /// The outcome; a stream dropped without one was cancelled by its client.
    pub code: tonic::Code,
    /// The request's `Generate` span: the first token is an event on it and
    /// a failed stream marks it as an error.
    span: Span,
}

impl StreamMeter {
    /// Starts metering a stream of `model`/`version` received at `started`.
    pub fn new(model: &str, version: &str, started: Instant, span: Span) -> Self {
        metrics::gauge!("llm_active_streams", "model" => model.to_string(), "version" => version.to_string())
            .increment(1.0);
        Self {
            model: model.into(),
            version: version.into(),
            started,
            last_token: None,
            code: tonic::Code::Cancelled,
            span,
        }
    }

    fn labels(&self) -> [(&'static str, String); 2] {
        [
            ("model", self.model.clone()),
            ("version", self.version.clone()),
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
            "code" => code_name(self.code)
        )
        .increment(1);
        if classify(self.code).is_failure() {
            metrics::counter!("llm_request_errors_total", &labels).increment(1);
            self.span.record("otel.status_code", "ERROR");
        }
    }
}
