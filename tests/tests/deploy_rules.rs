//! The shipped alert and recording rules pass promtool's checks and unit tests
//! (they fire on a failing synthetic series and stay silent on a healthy one),
//! and the Grafana dashboard only queries metrics the processes export.
use std::path::PathBuf;
use std::process::Command;

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(deploy().join("prometheus"))
        .output()
        .expect("promtool is installed (Debian package prometheus; scripts/test.sh installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn rules_pass_promtool_check() {
    let out = promtool(&["check", "rules", "alerts.yml", "recording.yml"]);
    assert!(out.contains("SUCCESS: 3 rules found"), "{out}");
}

#[test]
fn rules_pass_promtool_unit_tests() {
    let out = promtool(&["test", "rules", "rules_test.yml"]);
    assert!(out.contains("SUCCESS"), "{out}");
}

/// Metric names the router and workers export (DESIGN.md, "Telemetry").
const EXPORTED: &[&str] = &[
    "llm_request_total",
    "llm_request_errors_total",
    "llm_request_duration_seconds",
    "llm_time_to_first_token_seconds",
    "llm_inter_token_latency_seconds",
    "llm_tokens_generated_total",
    "llm_active_streams",
    "llm_queue_depth",
    "llm_batch_size",
    "llm_kv_cache_usage_ratio",
    "gpu_memory_used_bytes",
    "gpu_memory_total_bytes",
    "llm_endpoint_healthy",
];

#[test]
fn dashboard_queries_exported_metrics() {
    let path = deploy().join("grafana/tokenmesh-dashboard.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).expect("dashboard JSON");
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 10);
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            let names: Vec<&str> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .filter(|w| w.starts_with("llm_") || w.starts_with("gpu_"))
                .map(|w| {
                    w.trim_end_matches("_bucket")
                        .trim_end_matches("_count")
                        .trim_end_matches("_sum")
                })
                .collect();
            assert!(!names.is_empty(), "{expr}");
            for n in names {
                assert!(
                    EXPORTED.contains(&n),
                    "panel {:?} queries unknown metric {n}",
                    p["title"]
                );
            }
        }
    }
}
