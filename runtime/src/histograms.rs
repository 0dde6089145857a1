//! The process's metrics recorder: counters and gauges kept by
//! metrics-exporter-prometheus, histograms by [`Histograms`], fixed-bucket
//! Prometheus histograms where an observation is one atomic add to its
//! bucket and one to the sum.
//!
//! Why not the exporter's own histograms: it keeps every observation in a
//! lock-free list and folds them into buckets later, about 300 instructions
//! per observation in all. The inter-token latency is observed per token on
//! the router and on the worker, which made histograms about a tenth of
//! telemetry's cost per request (issue 20). Buckets are fixed per metric
//! name ([`Histograms::new`]), as the exporter's were.
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use metrics_exporter_prometheus::formatting::{
    sanitize_description, sanitize_label_key, sanitize_label_value, sanitize_metric_name,
};
use metrics_exporter_prometheus::{PrometheusHandle, PrometheusRecorder};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

/// One histogram series: a count per bucket (not cumulative; the last is
/// above every bound) and the sum of the observations as `f64` bits.
#[derive(Debug)]
pub struct FixedHistogram {
    bounds: &'static [f64],
    counts: Box<[AtomicU64]>,
    sum: AtomicU64,
}

impl FixedHistogram {
    /// An empty histogram over `bounds` (ascending upper bounds, `le`).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// The cumulative count at each bound, then the total count and the sum.
    pub fn snapshot(&self) -> (Vec<u64>, u64, f64) {
        let mut total = 0;
        let mut cumulative: Vec<u64> = self
            .counts
            .iter()
            .map(|c| {
                total += c.load(Relaxed);
                total
            })
            .collect();
        // The last count is the one above every bound: only in the total.
        cumulative.pop();
        (cumulative, total, f64::from_bits(self.sum.load(Relaxed)))
    }
}

impl HistogramFn for FixedHistogram {
    fn record(&self, value: f64) {
        if value.is_nan() {
            return;
        }
        // The first bucket whose bound is at least the value (`le`).
        let bucket = self.bounds.partition_point(|b| *b < value);
        self.counts[bucket].fetch_add(1, Relaxed);
        let mut seen = self.sum.load(Relaxed);
        loop {
            let next = (f64::from_bits(seen) + value).to_bits();
            match self.sum.compare_exchange_weak(seen, next, Relaxed, Relaxed) {
                Ok(_) => break,
                Err(now) => seen = now,
            }
        }
    }
}

/// Every histogram series of the process, by key, and how to render them.
#[derive(Debug)]
pub struct Histograms {
    buckets: fn(&str) -> &'static [f64],
    series: Mutex<HashMap<Key, Arc<FixedHistogram>>>,
    help: Mutex<HashMap<String, String>>,
}

impl Histograms {
    /// No series yet; a series named `n` gets the bounds `buckets(n)`.
    pub fn new(buckets: fn(&str) -> &'static [f64]) -> Self {
        Self {
            buckets,
            series: Mutex::default(),
            help: Mutex::default(),
        }
    }

    /// The series of `key`, made on first use.
    pub fn series(&self, key: &Key) -> Arc<FixedHistogram> {
        let mut series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        series
            .entry(key.clone())
            .or_insert_with(|| Arc::new(FixedHistogram::new((self.buckets)(key.name()))))
            .clone()
    }

    fn describe(&self, name: &str, description: &str) {
        self.help
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_string(), description.to_string());
    }

    /// Every series in the Prometheus text format, by name and then labels.
    pub fn render(&self, out: &mut String) {
        let mut by_name: BTreeMap<String, Vec<(String, Arc<FixedHistogram>)>> = BTreeMap::new();
        for (key, h) in self
            .series
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            let labels = key
                .labels()
                .map(|l| {
                    format!(
                        "{}=\"{}\"",
                        sanitize_label_key(l.key()),
                        sanitize_label_value(l.value())
                    )
                })
                .collect::<Vec<_>>()
                .join(",");
            by_name
                .entry(sanitize_metric_name(key.name()))
                .or_default()
                .push((labels, h.clone()));
        }
        let help = self.help.lock().unwrap_or_else(PoisonError::into_inner);
        for (name, mut series) in by_name {
            series.sort_by(|a, b| a.0.cmp(&b.0));
            if let Some(d) = help.get(&name) {
                let _ = writeln!(out, "# HELP {name} {}", sanitize_description(d));
            }
            let _ = writeln!(out, "# TYPE {name} histogram");
            for (labels, h) in series {
                let (cumulative, count, sum) = h.snapshot();
                // `{labels}` for the sum and count; the buckets add `le`.
                let (braced, sep) = if labels.is_empty() {
                    (String::new(), "")
                } else {
                    (format!("{{{labels}}}"), ",")
                };
                for (bound, n) in h.bounds.iter().zip(cumulative) {
                    let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {n}");
                }
                let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
                let _ = writeln!(out, "{name}_sum{braced} {sum}");
                let _ = writeln!(out, "{name}_count{braced} {count}");
            }
            out.push('\n');
        }
    }
}

/// The recorder [`crate::telemetry::init`] installs: histograms to
/// [`Histograms`], everything else to the Prometheus exporter.
pub struct MeshRecorder {
    prometheus: PrometheusRecorder,
    histograms: Arc<Histograms>,
}

impl MeshRecorder {
    /// Over `prometheus`, with histograms bucketed by `buckets`.
    pub fn new(prometheus: PrometheusRecorder, buckets: fn(&str) -> &'static [f64]) -> Self {
        Self {
            prometheus,
            histograms: Arc::new(Histograms::new(buckets)),
        }
    }

    /// What renders `/metrics`.
    pub fn handle(&self) -> MetricsHandle {
        MetricsHandle {
            prometheus: self.prometheus.handle(),
            histograms: self.histograms.clone(),
        }
    }
}

impl Recorder for MeshRecorder {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_counter(key, unit, description)
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_gauge(key, unit, description)
    }

    fn describe_histogram(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.histograms
            .describe(&sanitize_metric_name(key.as_str()), &description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.prometheus.register_counter(key, metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.prometheus.register_gauge(key, metadata)
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.histograms.series(key))
    }
}

/// Renders the process's metrics for `/metrics`.
#[derive(Clone)]
pub struct MetricsHandle {
    prometheus: PrometheusHandle,
    histograms: Arc<Histograms>,
}

impl MetricsHandle {
    /// Counters and gauges, then histograms, in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = self.prometheus.render();
        self.histograms.render(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: &[f64] = &[0.001, 0.01, 0.1, 1.0];

    #[test]
    fn an_observation_counts_in_the_first_bucket_at_or_above_it() {
        let h = FixedHistogram::new(BOUNDS);
        for v in [0.0005, 0.001, 0.002, 0.1, 5.0, f64::NAN] {
            h.record(v);
        }
        let (cumulative, count, sum) = h.snapshot();
        // `le` is inclusive: 0.001 is in the first bucket.
        assert_eq!(cumulative, [2, 3, 4, 4]);
        assert_eq!(count, 5);
        assert!((sum - 5.1035).abs() < 1e-12, "{sum}");
    }

    #[test]
    fn observations_from_many_threads_are_all_counted() {
        let h = Arc::new(FixedHistogram::new(BOUNDS));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let h = h.clone();
                std::thread::spawn(move || (0..10_000).for_each(|_| h.record(0.5)))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let (cumulative, count, sum) = h.snapshot();
        assert_eq!((cumulative[3], count, sum), (40_000, 40_000, 20_000.0));
    }

    #[test]
    fn renders_the_prometheus_text_format() {
        let hs = Histograms::new(|name| if name == "b" { BOUNDS } else { &[1.0] });
        hs.describe("b", "what b \"is\"");
        let key = Key::from_parts("b", vec![metrics::Label::new("model", "m\"1")]);
        hs.series(&key).record(0.05);
        hs.series(&Key::from_name("a_seconds")).record(2.0);
        let mut out = String::new();
        hs.render(&mut out);
        let want = "\
# TYPE a_seconds histogram
a_seconds_bucket{le=\"1\"} 0
a_seconds_bucket{le=\"+Inf\"} 1
a_seconds_sum 2
a_seconds_count 1

# HELP b what b \"is\"
# TYPE b histogram
b_bucket{model=\"m\\\"1\",le=\"0.001\"} 0
b_bucket{model=\"m\\\"1\",le=\"0.01\"} 0
b_bucket{model=\"m\\\"1\",le=\"0.1\"} 1
b_bucket{model=\"m\\\"1\",le=\"1\"} 1
b_bucket{model=\"m\\\"1\",le=\"+Inf\"} 1
b_sum{model=\"m\\\"1\"} 0.05
b_count{model=\"m\\\"1\"} 1

";
        assert_eq!(out, want);
    }
}
