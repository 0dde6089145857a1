//! Turns a run's samples into the reported figures and prints them as a
//! table, JSON lines or Markdown.
use super::load::Run;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// The latency bound of the normalised throughput: tokens/s count fully while
/// the p99 inter-token latency stays within it.
pub const NORMALISATION_BOUND_MS: f64 = 100.0;

/// Percentiles of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

/// The figures of one run; one JSON line each.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Report {
    /// Free-form labels: target, mode, and for sweeps workers and max_batch.
    pub labels: BTreeMap<String, String>,
    /// Length of the measurement window, seconds.
    pub window_s: f64,
    /// Successful requests started after the warm-up.
    pub requests: u64,
    /// Failed requests started after the warm-up, by status code.
    pub errors: BTreeMap<String, u64>,
    /// What the first failure of each code said, where it said something.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub error_examples: BTreeMap<String, String>,
    /// Successful requests that ended inside the window, per second.
    pub requests_per_sec: f64,
    /// Tokens that arrived inside the window, per second.
    pub output_tokens_per_sec: f64,
    pub ttft_ms: Percentiles,
    /// Gap between consecutive tokens of one stream.
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// output_tokens_per_sec × min(1, 100 ms / p99 inter-token latency).
    pub normalised_tokens_per_sec: f64,
}

/// Microsecond histogram from 1 µs to 1 hour with 3 significant figures.
/// Fixed bounds, because `saturating_record` does not grow an auto-resizing
/// histogram: it clamps to its current top.
pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn us(d: Duration) -> u64 {
    d.as_micros().max(1) as u64
}

/// The percentiles of a microsecond histogram, in milliseconds.
pub(crate) fn percentiles(h: &Histogram<u64>) -> Percentiles {
    if h.is_empty() {
        return Percentiles::default();
    }
    let ms = |v: u64| v as f64 / 1000.0;
    Percentiles {
        p50: ms(h.value_at_quantile(0.50)),
        p90: ms(h.value_at_quantile(0.90)),
        p99: ms(h.value_at_quantile(0.99)),
        mean: h.mean() / 1000.0,
    }
}

/// Computes the report of `run`.
pub fn summarize(run: &Run, labels: BTreeMap<String, String>) -> Report {
    let (from, to) = run.window;
    let window = (to - from).as_secs_f64();
    let (mut ttft, mut itl, mut e2e) = (histogram(), histogram(), histogram());
    let mut errors = BTreeMap::new();
    let mut error_examples = BTreeMap::new();
    let mut requests = 0;
    let mut tokens_in_window = 0u64;
    let mut ended_in_window = 0u64;
    for s in &run.samples {
        tokens_in_window += s
            .tokens
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|(_, n)| *n as u64)
            .sum::<u64>();
        if s.error.is_none() && s.end >= from && s.end <= to {
            ended_in_window += 1;
        }
        if s.start < from {
            continue; // warm-up
        }
        if let Some(code) = &s.error {
            *errors.entry(code.clone()).or_insert(0) += 1;
            if let Some(detail) = &s.detail {
                error_examples
                    .entry(code.clone())
                    .or_insert_with(|| detail.clone());
            }
            continue;
        }
        requests += 1;
        e2e.saturating_record(us(s.end - s.start));
        if let Some((first, _)) = s.tokens.first() {
            ttft.saturating_record(us(*first - s.start));
        }
        for pair in s.tokens.windows(2) {
            let (prev, (at, n)) = (pair[0].0, pair[1]);
            // A delta with several tokens spreads its gap over them.
            let gap = (at - prev) / n.max(1);
            itl.saturating_record_n(us(gap), n as u64);
        }
    }
    let tokens_per_sec = tokens_in_window as f64 / window;
    let itl_ms = percentiles(&itl);
    let factor = if itl_ms.p99 > 0.0 {
        (NORMALISATION_BOUND_MS / itl_ms.p99).min(1.0)
    } else {
        1.0
    };
    Report {
        labels,
        window_s: window,
        requests,
        errors,
        error_examples,
        requests_per_sec: ended_in_window as f64 / window,
        output_tokens_per_sec: tokens_per_sec,
        ttft_ms: percentiles(&ttft),
        itl_ms,
        e2e_ms: percentiles(&e2e),
        normalised_tokens_per_sec: tokens_per_sec * factor,
    }
}

/// How reports are printed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A table for people.
    Table,
    /// One JSON object per line.
    Json,
    /// A Markdown table, ready for BENCHMARKS.md.
    Markdown,
}

fn errors_text(r: &Report) -> String {
    if r.errors.is_empty() {
        return "none".into();
    }
    r.errors
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn labels_text(r: &Report) -> String {
    r.labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Renders `reports` in `format`.
pub fn render(reports: &[Report], format: Format) -> String {
    match format {
        Format::Json => reports
            .iter()
            .map(|r| serde_json::to_string(r).expect("a report serializes") + "\n")
            .collect(),
        Format::Table => reports.iter().map(table).collect::<Vec<_>>().join("\n"),
        Format::Markdown => markdown(reports),
    }
}

fn table(r: &Report) -> String {
    let row = |name: &str, p: &Percentiles| {
        format!(
            "{name:<22} {:>10.2} {:>10.2} {:>10.2} {:>10.2}\n",
            p.p50, p.p90, p.p99, p.mean
        )
    };
    let mut s = format!("{}\n", labels_text(r));
    s.push_str(&format!(
        "requests {} in {:.1} s, errors: {}\n",
        r.requests,
        r.window_s,
        errors_text(r)
    ));
    for (code, said) in &r.error_examples {
        s.push_str(&format!("  first {code}: {said}\n"));
    }
    s.push_str(&format!(
        "requests/s {:.2}   output tokens/s {:.1}   normalised tokens/s {:.1}\n",
        r.requests_per_sec, r.output_tokens_per_sec, r.normalised_tokens_per_sec
    ));
    s.push_str(&format!(
        "{:<22} {:>10} {:>10} {:>10} {:>10}\n",
        "latency (ms)", "p50", "p90", "p99", "mean"
    ));
    s.push_str(&row("time to first token", &r.ttft_ms));
    s.push_str(&row("inter-token", &r.itl_ms));
    s.push_str(&row("end-to-end", &r.e2e_ms));
    s
}

fn markdown(reports: &[Report]) -> String {
    let mut s = String::from(
        "| run | req/s | tok/s | norm. tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 ms | errors |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    let p = |p: &Percentiles| format!("{:.1} / {:.1} / {:.1}", p.p50, p.p90, p.p99);
    for r in reports {
        s.push_str(&format!(
            "| {} | {:.2} | {:.1} | {:.1} | {} | {} | {} | {} |\n",
            labels_text(r),
            r.requests_per_sec,
            r.output_tokens_per_sec,
            r.normalised_tokens_per_sec,
            p(&r.ttft_ms),
            p(&r.itl_ms),
            p(&r.e2e_ms),
            errors_text(r)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::load::Sample;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// A request that starts at `start` ms and gets one token every `gap` ms.
    fn sample(start: u64, gap: u64, n: u64) -> Sample {
        Sample {
            start: ms(start),
            end: ms(start + gap * n),
            tokens: (1..=n).map(|i| (ms(start + gap * i), 1)).collect(),
            error: None,
            detail: None,
        }
    }

    #[test]
    fn figures_of_a_known_run() {
        // Two back-to-back streams of 10 tokens at 20 ms after a 100 ms warm-up.
        let mut samples = vec![sample(0, 20, 10), sample(200, 20, 10), sample(400, 20, 10)];
        samples.push(Sample {
            start: ms(300),
            end: ms(301),
            tokens: vec![],
            error: Some("RESOURCE_EXHAUSTED".into()),
            detail: Some("the worker's queue is full".into()),
        });
        let run = Run {
            samples,
            window: (ms(100), ms(600)),
            model: "m".into(),
        };
        let r = summarize(&run, BTreeMap::new());
        assert_eq!(r.requests, 2);
        assert_eq!(r.errors.get("RESOURCE_EXHAUSTED"), Some(&1));
        assert_eq!(
            r.error_examples["RESOURCE_EXHAUSTED"],
            "the worker's queue is full"
        );
        // Tokens at 100..=200, 220..=400, 420..=600: 6 + 10 + 10.
        assert!((r.output_tokens_per_sec - 26.0 / 0.5).abs() < 1e-9);
        assert!((r.requests_per_sec - 3.0 / 0.5).abs() < 1e-9);
        assert!((r.itl_ms.p50 - 20.0).abs() < 0.05);
        assert!((r.ttft_ms.p99 - 20.0).abs() < 0.05);
        assert!((r.e2e_ms.p50 - 200.0).abs() < 0.5);
        // p99 ITL of 20 ms is within the 100 ms bound.
        assert_eq!(r.normalised_tokens_per_sec, r.output_tokens_per_sec);
    }

    #[test]
    fn slow_tokens_are_normalised_down() {
        let run = Run {
            samples: vec![sample(0, 200, 5)],
            window: (ms(0), ms(1000)),
            model: "m".into(),
        };
        let r = summarize(&run, BTreeMap::new());
        assert!((r.normalised_tokens_per_sec - r.output_tokens_per_sec * 0.5).abs() < 0.01);
        let md = render(std::slice::from_ref(&r), Format::Markdown);
        assert!(md.lines().count() == 3 && md.contains("| none |"));
        let json: Report = serde_json::from_str(render(&[r], Format::Json).trim()).unwrap();
        assert_eq!(json.requests, 1);
    }
}
