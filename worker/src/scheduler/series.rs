//! The engine's metric series, looked up once when the engine starts: the
//! engine publishes its gauges twice a step, and a lookup by name and labels
//! (the labels cloned into a key, hashed, found in the registry) cost far
//! more than setting the value (issue 20: two thirds of the worker's
//! telemetry cost, before).
use crate::series::with_label;
use metrics::{Counter, Gauge, Histogram};

/// The series the engine thread records.
pub(super) struct EngineSeries {
    /// `llm_queue_depth` by priority: high, normal, low.
    pub queue_depth: [Gauge; 3],
    pub kv_cache_usage: Gauge,
    pub batch_size: Histogram,
    pub prompt_tokens: Counter,
    pub prefix_hit_tokens: Counter,
    /// Only with prefix caching on, as before: a worker without it shows
    /// no cache series.
    pub prefix: Option<PrefixSeries>,
}

/// The prefix cache's gauges.
pub(super) struct PrefixSeries {
    pub blocks: Gauge,
    pub evictions: Counter,
    pub hit_ratio: Gauge,
}

impl EngineSeries {
    /// The series of a worker with these labels (model, version, worker), in
    /// the recorder installed now (none installed: handles that do nothing).
    pub(super) fn new(labels: &[(&'static str, String)], prefix_cache: bool) -> Self {
        let by_priority =
            |p| metrics::gauge!("llm_queue_depth", &with_label(labels, "priority", p));
        Self {
            queue_depth: [
                by_priority("high"),
                by_priority("normal"),
                by_priority("low"),
            ],
            kv_cache_usage: metrics::gauge!("llm_kv_cache_usage_ratio", labels),
            batch_size: metrics::histogram!("llm_batch_size", labels),
            prompt_tokens: metrics::counter!("llm_prompt_tokens_total", labels),
            prefix_hit_tokens: metrics::counter!("llm_prefix_cache_hit_tokens_total", labels),
            prefix: prefix_cache.then(|| PrefixSeries {
                blocks: metrics::gauge!("llm_prefix_cache_blocks", labels),
                evictions: metrics::counter!("llm_prefix_cache_evictions_total", labels),
                hit_ratio: metrics::gauge!("llm_prefix_cache_hit_ratio", labels),
            }),
        }
    }
}
