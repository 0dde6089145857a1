//! The per-request metric series of this worker, looked up once when the
//! service is built rather than by name and labels on every request (each
//! lookup clones the labels into a key and hashes it; issue 20). The router
//! does the same per endpoint (`Endpoint::stream_series`).
use metrics::{Counter, Gauge, Histogram};
use std::sync::OnceLock;
use tokenmesh_proto::codes::code_name;
use tonic::Code;

/// The labels of a worker's metrics.
pub(crate) fn worker_labels(
    model: &str,
    version: &str,
    worker: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("model", model.to_string()),
        ("version", version.to_string()),
        ("worker", worker.to_string()),
    ]
}

/// `labels` and one more, for a series split by a further label.
pub(crate) fn with_label(
    labels: &[(&'static str, String)],
    key: &'static str,
    value: &str,
) -> Vec<(&'static str, String)> {
    let mut l = labels.to_vec();
    l.push((key, value.to_string()));
    l
}

/// One worker's request series (labels model, version, worker).
pub(crate) struct RequestSeries {
    labels: Vec<(&'static str, String)>,
    pub active: Gauge,
    pub duration: Histogram,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub tokens: Counter,
    pub errors: Counter,
    pub status_polls: Counter,
    /// `llm_request_total{code}`, made on a code's first use.
    by_code: [OnceLock<Counter>; 17],
}

impl RequestSeries {
    /// The series for `labels`, in the recorder installed now (none: handles
    /// that do nothing).
    pub(crate) fn new(labels: Vec<(&'static str, String)>) -> Self {
        Self {
            active: metrics::gauge!("llm_active_streams", &labels),
            duration: metrics::histogram!("llm_request_duration_seconds", &labels),
            ttft: metrics::histogram!("llm_time_to_first_token_seconds", &labels),
            itl: metrics::histogram!("llm_inter_token_latency_seconds", &labels),
            tokens: metrics::counter!("llm_tokens_generated_total", &labels),
            errors: metrics::counter!("llm_request_errors_total", &labels),
            status_polls: metrics::counter!("llm_status_requests_total", &labels),
            by_code: Default::default(),
            labels,
        }
    }

    /// Counts one request's outcome.
    pub(crate) fn outcome(&self, code: Code) {
        // `tonic::Code` is a closed enum of the values 0 to 16.
        let slot = &self.by_code[code as usize];
        slot.get_or_init(|| {
            let with_code = with_label(&self.labels, "code", code_name(code));
            metrics::counter!("llm_request_total", &with_code)
        })
        .increment(1);
        if tokenmesh_proto::codes::classify(code).is_failure() {
            self.errors.increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_own_slot() {
        // `code as usize` indexes the slots: the codes are 0..=16.
        for c in 0..=16 {
            assert_eq!(Code::from_i32(c) as usize, c as usize);
        }
    }
}
