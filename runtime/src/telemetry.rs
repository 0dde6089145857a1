//! Logs, traces and metrics set-up shared by every process, and W3C trace
//! context carried in gRPC metadata (DESIGN.md, "Telemetry").
//!
//! Traces go to an OTLP/gRPC collector when an endpoint is configured,
//! through the SDK's batch processor and tokenmesh's own exporter
//! ([`crate::otlp`]); the batch processor runs in the background, so a
//! collector that is down costs dropped spans, never a slower or failed
//! request. Sampling is
//! `--trace-sampling-ratio` (parent-based: a caller's sampled or unsampled
//! trace context decides, a new trace is sampled at that ratio); without it,
//! the standard `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` variables
//! as the SDK reads them (default: parent-based, always on).
//!
//! The span layer records what the spans say and nothing per poll: no
//! busy/idle timings, no thread or source-location attributes, and no
//! OpenTelemetry context attached on every entry (tokenmesh propagates
//! context from the span itself, [`inject`], in the headers that
//! [`trace_context`] reads and writes). Each of those cost work on every
//! poll of an instrumented task, which for a streaming relay is every token
//! (issue 20).
//!
//! With `--trace-sampling-ratio`, a request's trace is decided before any of
//! its spans exists ([`sampling`]): an unsampled request makes no spans at
//! all (creating and recording them, to be dropped by the sampler at the
//! end, cost about as much as exporting them), and passes an unsampled
//! `traceparent` on so that the next service, parent-based, skips them too.
//! Metrics are recorded for Prometheus
//! when `--metrics-listen` is given; the listener itself, which also answers
//! the health probes, is [`crate::probes`].
use crate::histograms::{MeshRecorder, MetricsHandle};
use crate::otlp::{Headers, OtlpExporter};
use crate::trace_context::{self, TraceIdHex};
use metrics_exporter_prometheus::PrometheusBuilder;
use opentelemetry::trace::{
    Link, SpanContext, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, Sampler, SamplingResult, SdkTracerProvider, ShouldSample,
};
use opentelemetry_sdk::Resource;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;
use tonic::metadata::MetadataMap;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Log line format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Telemetry flags every server binary takes.
#[derive(clap::Args, Clone, Debug)]
pub struct TelemetryArgs {
    /// Log filter (tracing-subscriber EnvFilter syntax).
    #[arg(long, env = "TOKENMESH_LOG", default_value = "info")]
    pub log: String,
    /// Log line format.
    #[arg(long, env = "TOKENMESH_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// OTLP/gRPC endpoint that receives traces, e.g. http://jaeger:4317 (absent or empty: no export).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Headers sent with every export, e.g. a collector's credentials:
    /// comma-separated key=value pairs, values percent-encoded
    /// (authorization=Bearer%20abc,x-tenant=mesh).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_HEADERS")]
    pub otlp_headers: Vec<Headers>,
    /// Time limit of one export attempt, in milliseconds; a failed export
    /// is retried (3 times at most, with backoff) only while less than this
    /// has passed since it began.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TIMEOUT", default_value_t = 10_000)]
    pub otlp_timeout_ms: u64,
    /// Share of new traces to sample, 0.0 to 1.0, parent-based: a request
    /// that carries a trace context keeps its caller's decision (absent: the
    /// standard OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, by default
    /// every trace).
    #[arg(long, env = "TOKENMESH_TRACE_SAMPLING_RATIO", value_parser = sampling_ratio)]
    pub trace_sampling_ratio: Option<f64>,
    /// Plaintext HTTP address that serves Prometheus metrics at /metrics and
    /// the health probes GET /healthz (alive) and GET /readyz (200 when ready
    /// to serve, else 503 and why), for probes that hold no mesh certificate
    /// (absent: no such listener).
    #[arg(long, env = "TOKENMESH_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Trace each request's phases as spans of their own: on a router, its
    /// routing (`route`) and each call to a worker (the client span
    /// `tokenmesh.v1.Worker/Generate`); on a worker, its queue, prefill and
    /// decode. Without it, one span per request and process (`Generate`)
    /// carries their fields and times as attributes, which costs a fraction
    /// of the spans it saves.
    #[arg(long, env = "TOKENMESH_TRACE_PHASES")]
    pub trace_phases: bool,
}

/// A sampling ratio: a number from 0 to 1.
fn sampling_ratio(s: &str) -> Result<f64, String> {
    let r: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number; give a ratio from 0.0 to 1.0, e.g. 0.1"))?;
    if (0.0..=1.0).contains(&r) {
        Ok(r)
    } else {
        Err(format!(
            "{r} is outside 0.0..=1.0; give a ratio, e.g. 0.1 for one trace in ten"
        ))
    }
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter: {0}")]
    Exporter(String),
    #[error("metrics recorder: {0}")]
    Metrics(String),
    #[error("log filter {filter:?}: {message}")]
    Filter { filter: String, message: String },
}

/// Flushes and stops the trace exporter when dropped.
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Flushes and stops the trace exporter, the runtime running meanwhile:
    /// the exporter's connection is driven by it, which on the
    /// single-threaded scheduler only happens while this thread is not
    /// blocked. [`crate::run_server`] calls it once `serve` has returned.
    pub async fn shutdown(mut self) {
        if let Some(p) = self.provider.take() {
            let _ = tokio::task::spawn_blocking(move || p.shutdown()).await;
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            // Not shut down by `shutdown` (an early return): shutdown blocks
            // on the exporter; keep it off any runtime thread.
            let _ = std::thread::spawn(move || p.shutdown()).join();
        }
    }
}

/// Latency buckets in seconds: LLM requests span milliseconds to minutes.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Batch size buckets.
pub const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// The buckets Prometheus' own clients use for a histogram nobody chose
/// buckets for.
const DEFAULT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The buckets of the histogram `name`: latencies (`*_seconds`), batch
/// sizes, else Prometheus' defaults.
fn buckets(name: &str) -> &'static [f64] {
    if name.ends_with("_seconds") {
        LATENCY_BUCKETS
    } else if name == "llm_batch_size" {
        BATCH_BUCKETS
    } else {
        DEFAULT_BUCKETS
    }
}

/// The process's metrics, once [`init`] installed their recorder.
static METRICS: OnceLock<MetricsHandle> = OnceLock::new();

/// What `/metrics` renders: the recorder [`init`] installed for
/// `--metrics-listen`, if any (metrics are process-global, like the recorder).
pub fn metrics_handle() -> Option<MetricsHandle> {
    METRICS.get().cloned()
}

/// Installs logging, tracing export and, with `--metrics-listen`, the
/// metrics recorder. Call once, inside the tokio runtime.
pub fn init(service: &str, args: &TelemetryArgs) -> Result<TelemetryGuard, TelemetryError> {
    // The exporter's own gRPC client must not trace itself.
    let filter_str = format!(
        "{},h2=warn,hyper=warn,tower=warn,opentelemetry=warn",
        args.log
    );
    let filter = EnvFilter::try_new(&filter_str).map_err(|e| TelemetryError::Filter {
        filter: args.log.clone(),
        message: e.to_string(),
    })?;

    // An empty value (OTEL_EXPORTER_OTLP_ENDPOINT= in a compose file) means no export.
    let endpoint = args.otlp_endpoint.as_ref().filter(|e| !e.trim().is_empty());
    let provider = match endpoint {
        Some(endpoint) => {
            let exporter = OtlpExporter::new(
                endpoint,
                args.otlp_headers.iter().flat_map(|h| &h.0),
                Duration::from_millis(args.otlp_timeout_ms.max(1)),
            )
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
            let mut builder = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(
                    Resource::builder()
                        .with_service_name(service.to_string())
                        .build(),
                );
            if let Some(ratio) = args.trace_sampling_ratio {
                builder = builder.with_sampler(Gated::new(ratio));
                let _ = GATE_RATIO.set(ratio);
            }
            Some(builder.build())
        }
        None => None,
    };
    let otel_layer = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(service.to_string()))
            .with_tracked_inactivity(false)
            .with_threads(false)
            .with_location(false)
            .with_context_activation(false)
            .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                m.target().starts_with("tokenmesh")
            }))
    });
    let fmt_layer = match args.log_format {
        LogFormat::Text => {
            let mut layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
            // Colours only on a terminal (where the crate's default, which
            // honours NO_COLOR, stands): escape codes in a log file or a
            // container's log are noise, and writing them around every field
            // of every span is work the request path pays for (issue 20).
            if !std::io::stderr().is_terminal() {
                layer = layer.with_ansi(false);
            }
            layer.boxed()
        }
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(otel_layer)
        .with(fmt_layer.with_filter(filter))
        .init();

    if args.metrics_listen.is_some() {
        // Histograms are kept apart (`histograms`), so the exporter has no
        // samples to fold and needs no upkeep task.
        let recorder = MeshRecorder::new(PrometheusBuilder::new().build_recorder(), buckets);
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder)
            .map_err(|e| TelemetryError::Metrics(e.to_string()))?;
        let _ = METRICS.set(handle);
    }
    Ok(TelemetryGuard { provider })
}

/// The name of the server span whose trace [`sampling`] decides up front.
pub const GATED_SPAN: &str = "Generate";

/// The ratio [`sampling`] applies to new traces: set by [`init`] when
/// `--trace-sampling-ratio` is given and traces are exported.
static GATE_RATIO: OnceLock<f64> = OnceLock::new();

/// Whether a request's spans are made, decided before the first one is.
#[derive(Clone, Debug, PartialEq)]
pub enum Sampling {
    /// Make and record them; the exporter's sampler has the last word.
    Record,
    /// Not sampled: make no span (use `tracing::Span::none()`), and pass this
    /// unsampled context on so that services further down, parent-based,
    /// make none either.
    Skip(Unsampled),
}

/// The trace context of a request that is not sampled and has no span.
#[derive(Clone, Debug, PartialEq)]
pub struct Unsampled(SpanContext);

impl Unsampled {
    /// Writes it (`traceparent` with the sampled flag clear) into outgoing
    /// metadata.
    pub fn inject(&self, md: &mut MetadataMap) {
        trace_context::write(&self.0, md);
    }
}

/// Decides a request's trace from the caller's trace context in `md`
/// (parent-based: the caller's decision stands) or, for a new trace, at
/// `--trace-sampling-ratio`. Without that flag (or without export) every
/// request is [`Sampling::Record`] and the SDK's sampler decides, as the
/// standard variables configure it.
pub fn sampling(md: &MetadataMap) -> Sampling {
    match GATE_RATIO.get() {
        Some(&ratio) => decide(md, ratio, &RandomIdGenerator::default()),
        None => Sampling::Record,
    }
}

fn decide(md: &MetadataMap, ratio: f64, ids: &impl IdGenerator) -> Sampling {
    let parent = trace_context::read(md).unwrap_or_else(SpanContext::empty_context);
    let (trace_id, state) = if parent.is_valid() {
        if parent.is_sampled() {
            return Sampling::Record;
        }
        (parent.trace_id(), parent.trace_state().clone())
    } else {
        // Drawn here rather than from the trace id the SDK would generate:
        // a recorded request's root span is then taken as sampled ([`Gated`]).
        if rand::random::<f64>() < ratio {
            return Sampling::Record;
        }
        (ids.new_trace_id(), TraceState::default())
    };
    Sampling::Skip(Unsampled(SpanContext::new(
        trace_id,
        ids.new_span_id(),
        TraceFlags::default(),
        false,
        state,
    )))
}

/// The SDK's sampler under `--trace-sampling-ratio`: parent-based at the
/// ratio, except for a root [`GATED_SPAN`], whose request [`sampling`]
/// already drew at the ratio (drawing again would sample ratio² of them).
#[derive(Clone, Debug)]
struct Gated {
    ratio: Sampler,
    always: Sampler,
}

impl Gated {
    fn new(ratio: f64) -> Self {
        Self {
            ratio: Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio))),
            always: Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        }
    }
}

impl ShouldSample for Gated {
    fn should_sample(
        &self,
        parent: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let sampler = if name == GATED_SPAN {
            &self.always
        } else {
            &self.ratio
        };
        sampler.should_sample(parent, trace_id, name, kind, attributes, links)
    }
}

/// Writes the span's trace context (`traceparent`, and `tracestate` when
/// there is one) into outgoing metadata.
pub fn inject(span: &tracing::Span, md: &mut MetadataMap) {
    trace_context::write(span.context().span().span_context(), md);
}

/// Makes `span` a child of the caller's trace context, if the metadata carries
/// one, and records the trace id on it so log lines carry it.
pub fn adopt_parent(span: &tracing::Span, md: &MetadataMap) {
    let trace_id = if let Some(parent) = trace_context::read(md) {
        let trace_id = parent.trace_id();
        let _ = span.set_parent(Context::new().with_remote_span_context(parent));
        // The child's trace is its parent's: asking the span would start it,
        // and a started span takes each later attribute through the SDK
        // span's lock instead of into its builder.
        trace_id
    } else {
        // A root's trace id is drawn when the span starts.
        span.context().span().span_context().trace_id()
    };
    if trace_id != TraceId::INVALID {
        span.record("trace_id", TraceIdHex::new(trace_id).as_str());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn traceparent(flags: &str) -> MetadataMap {
        let mut md = MetadataMap::new();
        let v = format!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-{flags}");
        md.insert("traceparent", v.parse().unwrap());
        md
    }

    #[test]
    fn a_caller_s_decision_stands_and_an_unsampled_one_is_passed_on() {
        let ids = RandomIdGenerator::default();
        // Sampled by the caller: recorded even at ratio 0.
        assert_eq!(decide(&traceparent("01"), 0.0, &ids), Sampling::Record);
        // Not sampled by the caller: skipped even at ratio 1, same trace.
        let Sampling::Skip(cx) = decide(&traceparent("00"), 1.0, &ids) else {
            panic!("an unsampled parent must be skipped");
        };
        assert_eq!(
            cx.0.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert!(!cx.0.is_sampled() && cx.0.is_valid());
        let mut out = MetadataMap::new();
        cx.inject(&mut out);
        let sent = out.get("traceparent").unwrap().to_str().unwrap();
        assert!(
            sent.starts_with("00-0af7651916cd43dd8448eb211c80319c-") && sent.ends_with("-00"),
            "{sent}"
        );
    }

    #[test]
    fn new_traces_are_sampled_at_the_ratio() {
        let ids = RandomIdGenerator::default();
        let none = MetadataMap::new();
        assert_eq!(decide(&none, 1.0, &ids), Sampling::Record);
        assert!(matches!(decide(&none, 0.0, &ids), Sampling::Skip(_)));
        let n = 20_000;
        let recorded = (0..n)
            .filter(|_| decide(&none, 0.1, &ids) == Sampling::Record)
            .count();
        // 2,000 expected; the bounds are over 9 standard deviations wide.
        assert!((1_600..2_400).contains(&recorded), "{recorded} of {n}");
    }

    #[test]
    fn only_a_root_generate_span_is_taken_as_already_drawn() {
        let gated = Gated::new(0.0);
        let id = TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap();
        let at = |name: &str| {
            gated
                .should_sample(None, id, name, &SpanKind::Internal, &[], &[])
                .decision
        };
        use opentelemetry_sdk::trace::SamplingDecision;
        assert_eq!(at(GATED_SPAN), SamplingDecision::RecordAndSample);
        assert_eq!(at("canary_analysis"), SamplingDecision::Drop);
    }

    #[derive(Parser, Debug)]
    struct Cfg {
        #[command(flatten)]
        telemetry: TelemetryArgs,
    }

    #[test]
    fn the_sampling_ratio_is_a_share_from_zero_to_one() {
        // `=`: a separate "-0.1" would read as a flag.
        let parse =
            |v: &str| Cfg::try_parse_from(["t".to_string(), format!("--trace-sampling-ratio={v}")]);
        assert_eq!(
            parse("0.1").unwrap().telemetry.trace_sampling_ratio,
            Some(0.1)
        );
        assert_eq!(
            parse("0").unwrap().telemetry.trace_sampling_ratio,
            Some(0.0)
        );
        assert_eq!(
            parse("1").unwrap().telemetry.trace_sampling_ratio,
            Some(1.0)
        );
        for bad in ["1.5", "-0.1", "ten", "NaN"] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains("0.0") && err.contains("1.0"), "{bad}: {err}");
        }
        let unset = Cfg::try_parse_from(["t"]).unwrap();
        assert_eq!(unset.telemetry.trace_sampling_ratio, None);
    }
}
