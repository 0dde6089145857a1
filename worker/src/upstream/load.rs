//! The engine's health and load, polled in the background: ready only while
//! `/health` answers 200, and the engine's own queue and KV cache use (from
//! its Prometheus `/metrics`, where it serves them) added to what the
//! worker itself holds, so that routers see the engine's real queue depth.
use super::http::EngineHttp;
use super::UpstreamKind;
use crate::scheduler::EngineStats;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokenmesh_runtime::Readiness;
use tokio::sync::watch;

/// The readiness condition of a worker whose engine does not answer.
pub const CONDITION: &str = "upstream";

/// KV cache use is reported to Status as blocks of this many in total
/// (engines report a ratio, not blocks).
pub const KV_SCALE: u32 = 1000;

/// The queue, as the worker and the engine each see it.
#[derive(Debug, Default)]
pub struct Queue {
    /// Requests waiting here for a slot.
    pub local: AtomicU32,
    /// Requests the engine reports waiting.
    pub engine: AtomicU32,
}

impl Queue {
    /// Writes the sum into the stats Status and drains read.
    pub fn publish(&self, stats: &EngineStats) {
        let depth = self.local.load(Ordering::SeqCst) + self.engine.load(Ordering::SeqCst);
        stats.queued.store(depth, Ordering::SeqCst);
        stats.queued_by_priority[1].store(depth, Ordering::SeqCst);
    }
}

/// Which metrics of each engine mean what: the waiting requests, and KV
/// cache use as a ratio (vLLM renamed its gauge in 0.10).
fn metric_names(kind: UpstreamKind) -> (&'static [&'static str], &'static [&'static str]) {
    match kind {
        UpstreamKind::LlamaServer => (&["llamacpp:requests_deferred"], &[]),
        UpstreamKind::Vllm => (
            &["vllm:num_requests_waiting"],
            &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        ),
        // Whichever engine it is: vLLM's names, SGLang's, llama-server's.
        UpstreamKind::Openai => (
            &[
                "vllm:num_requests_waiting",
                "sglang:num_queue_reqs",
                "llamacpp:requests_deferred",
            ],
            &[
                "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc",
                "sglang:token_usage",
            ],
        ),
    }
}

/// The sum over label sets of the first of `names` present in a Prometheus
/// text exposition.
pub fn metric_sum(text: &str, names: &[&str]) -> Option<f64> {
    names.iter().find_map(|name| {
        let mut found = None;
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            let value = match rest.chars().next() {
                Some('{') => rest.rsplit_once('}').map(|(_, v)| v),
                Some(' ') => Some(rest),
                _ => None,
            };
            let Some(v) = value.and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            else {
                continue;
            };
            *found.get_or_insert(0.0) += v;
        }
        found
    })
}

/// Everything the poller touches.
pub struct Poller {
    pub http: EngineHttp,
    pub kind: UpstreamKind,
    pub stats: Arc<EngineStats>,
    pub queue: Arc<Queue>,
    pub readiness: Readiness,
    /// Whether the engine answers, for the registration.
    pub up: watch::Sender<bool>,
    /// The same, for Status.
    pub healthy: Arc<std::sync::atomic::AtomicBool>,
    pub interval: Duration,
    pub labels: Vec<(&'static str, String)>,
}

impl Poller {
    /// Polls until the worker stops.
    pub async fn run(self) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut metrics_served = true;
        loop {
            tick.tick().await;
            let health = self.http.get("/health").await;
            let healthy = matches!(&health, Ok((s, _)) if s.is_success());
            if healthy != *self.up.borrow() {
                if healthy {
                    tracing::info!(url = %self.http.base(), "upstream engine answers; ready");
                    self.readiness.ready(CONDITION);
                } else {
                    let why = match &health {
                        Ok((s, _)) => format!("the upstream engine's /health answers {s}"),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(url = %self.http.base(), error = %why, "upstream engine is away; not ready");
                    self.readiness.not_ready(CONDITION, why);
                }
                self.healthy.store(healthy, Ordering::SeqCst);
                self.up.send_replace(healthy);
            }
            metrics::gauge!("llm_endpoint_healthy", &self.labels).set(if healthy {
                1.0
            } else {
                0.0
            });
            if healthy && metrics_served {
                metrics_served = self.poll_metrics().await;
            }
        }
    }

    /// Reads the engine's metrics; false if it serves none (llama-server
    /// without --metrics), so they are not asked for again.
    async fn poll_metrics(&self) -> bool {
        let (waiting, kv) = metric_names(self.kind);
        let text = match self.http.get("/metrics").await {
            Ok((s, body)) if s.is_success() => String::from_utf8_lossy(&body).into_owned(),
            Ok((s, _)) if s.is_client_error() || s == http::StatusCode::NOT_IMPLEMENTED => {
                tracing::info!(status = %s, "upstream engine serves no /metrics; its queue is not seen");
                return false;
            }
            _ => return true,
        };
        if let Some(w) = metric_sum(&text, waiting) {
            self.queue.engine.store(w.max(0.0) as u32, Ordering::SeqCst);
            self.queue.publish(&self.stats);
        }
        if let Some(ratio) = metric_sum(&text, kv) {
            let ratio = ratio.clamp(0.0, 1.0);
            self.stats.kv_blocks_total.store(KV_SCALE, Ordering::SeqCst);
            self.stats
                .kv_blocks_used
                .store((ratio * KV_SCALE as f64).round() as u32, Ordering::SeqCst);
            metrics::gauge!("llm_kv_cache_usage_ratio", &self.labels).set(ratio);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_values_are_summed_over_label_sets() {
        let text = "# HELP vllm:num_requests_waiting waiting\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2\n\
                    vllm:num_requests_waiting_total 99\n\
                    vllm:gpu_cache_usage_perc{engine=\"0\"} 0.25\n\
                    llamacpp:requests_deferred 4\n";
        assert_eq!(metric_sum(text, &["vllm:num_requests_waiting"]), Some(5.0));
        assert_eq!(
            metric_sum(
                text,
                &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]
            ),
            Some(0.25)
        );
        assert_eq!(metric_sum(text, &["llamacpp:requests_deferred"]), Some(4.0));
        assert_eq!(metric_sum(text, &["absent"]), None);
    }
}
