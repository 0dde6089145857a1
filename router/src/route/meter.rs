//! The metrics of one client stream: latencies as tokens arrive, the outcome
//! once, when the stream ends whichever way it ends (also when the client
//! goes away mid-stream, which drops it). Every series carries the `api` it
//! came through (`grpc` or `openai`).
//!
//! The handles of every series are looked up once per worker endpoint and
//! front door ([`StreamSeries`]): a lookup by name and labels hashes and
//! allocates its labels, which per token was a measurable share of the
//! router's CPU, and per request still a few thousand instructions (issue 20).
use super::Api;
use metrics::{Counter, Gauge, Histogram};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tokenmesh_proto::codes::{classify, code_name};
use tracing::Span;

/// How many `tonic::Code`s there are (0 to 16): the per-code request counters.
const CODES: usize = 17;

/// The series one stream records in, for one model version and front door:
/// looked up once, at the first stream, and kept on the worker's endpoint
/// ([`crate::registry::Endpoint::stream_series`]) rather than by name and
/// labels per request (issue 20): a lookup hashes and allocates its labels.
pub struct StreamSeries {
    model: String,
    version: String,
    api: Api,
    active: Gauge,
    ttft: Histogram,
    itl: Histogram,
    tokens: Counter,
    duration: Histogram,
    errors: Counter,
    /// `llm_request_total` by code, each made at its code's first stream.
    totals: [OnceLock<Counter>; CODES],
}

impl std::fmt::Debug for StreamSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSeries")
            .field("model", &self.model)
            .field("version", &self.version)
            .field("api", &self.api)
            .finish_non_exhaustive()
    }
}

impl StreamSeries {
    /// The series of `model`/`version` through `api`.
    pub fn new(model: &str, version: &str, api: Api) -> Self {
        let labels = labels(model, version, api);
        Self {
            model: model.into(),
            version: version.into(),
            api,
            active: metrics::gauge!("llm_active_streams", &labels),
            ttft: metrics::histogram!("llm_time_to_first_token_seconds", &labels),
            itl: metrics::histogram!("llm_inter_token_latency_seconds", &labels),
            tokens: metrics::counter!("llm_tokens_generated_total", &labels),
            duration: metrics::histogram!("llm_request_duration_seconds", &labels),
            errors: metrics::counter!("llm_request_errors_total", &labels),
            totals: Default::default(),
        }
    }

    fn total(&self, code: tonic::Code) -> &Counter {
        let made = || {
            metrics::counter!(
                "llm_request_total",
                "model" => self.model.clone(),
                "version" => self.version.clone(),
                "code" => code_name(code),
                "api" => self.api.as_str()
            )
        };
        // `tonic::Code` is a closed enum of the values 0 to 16.
        self.totals[code as usize].get_or_init(made)
    }
}

/// Records one client stream in the metrics.
pub struct StreamMeter {
    series: Arc<StreamSeries>,
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

fn labels(model: &str, version: &str, api: Api) -> [(&'static str, String); 3] {
    [
        ("model", model.to_string()),
        ("version", version.to_string()),
        ("api", api.as_str().to_string()),
    ]
}

impl StreamMeter {
    /// Starts metering a stream received at `started`, in `series`.
    pub fn new(series: Arc<StreamSeries>, started: Instant, span: Span) -> Self {
        series.active.increment(1.0);
        Self {
            series,
            started,
            last_token: None,
            code: tonic::Code::Cancelled,
            span,
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
                self.series.ttft.record((now - self.started).as_secs_f64());
                if !self.span.is_disabled() {
                    tracing::info!(parent: &self.span, tokens = n, "first token");
                }
            }
            Some(prev) => self
                .series
                .itl
                .record((now - prev).as_secs_f64() / n as f64),
        }
        self.series.tokens.increment(n as u64);
        self.last_token = Some(now);
    }
}

impl Drop for StreamMeter {
    fn drop(&mut self) {
        let s = &self.series;
        s.active.decrement(1.0);
        s.duration.record(self.started.elapsed().as_secs_f64());
        s.total(self.code).increment(1);
        if classify(self.code).is_failure() {
            s.errors.increment(1);
            self.span.record("otel.status_code", "ERROR");
        }
    }
}
