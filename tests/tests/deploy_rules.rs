//! The shipped alert and recording rules pass promtool's checks and unit tests
//! (they fire on a failing synthetic series and stay silent on a healthy one),
//! and every metric the Grafana dashboard and the rules query is one that a
//! real router and worker export: both are started, serve a request and a
//! refused one, and their `/metrics` are scraped. Renaming a metric in code,
//! or moving it from one process to the other, fails this test. The compose
//! file's health checks ask each process's `/readyz`.
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use tokenmesh_proto::v1::{GenerateRequest, WorkerGenerateRequest};
use tokenmesh_tests::*;

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

/// A series a PromQL expression selects, and the `job` label it pins, if any.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Selector {
    name: String,
    /// `job="worker"` → `worker`; `job=~"$job"` → `$job`.
    job: Option<String>,
}

/// Words of PromQL that are never metrics: operators, modifiers, and the
/// aggregations, which may be followed by `by (...)` before their parentheses.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Keywords followed by a parenthesised list of label names, not metrics.
const GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The index just past the bracket that closes the one at `open`, skipping
/// brackets inside quoted strings.
fn close(chars: &[char], open: usize) -> usize {
    let (o, c) = (chars[open], matching(chars[open]));
    let mut depth = 0;
    let mut i = open;
    while i < chars.len() {
        match chars[i] {
            '"' | '\'' | '`' => {
                i = past_string(chars, i);
                continue;
            }
            x if x == o => depth += 1,
            x if x == c => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    chars.len()
}

fn matching(open: char) -> char {
    match open {
        '(' => ')',
        '[' => ']',
        _ => '}',
    }
}

/// The index just past the string literal that starts at `start`.
fn past_string(chars: &[char], start: usize) -> usize {
    let quote = chars[start];
    let mut i = start + 1;
    while i < chars.len() && chars[i] != quote {
        i += if chars[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}

/// The value of an equality or regex matcher on `job` in a `{...}` block.
fn job_matcher(block: &str) -> Option<String> {
    block.split(',').find_map(|m| {
        let (label, value) = m.split_once('=')?;
        (label.trim() == "job").then(|| {
            value
                .trim_start_matches('~')
                .trim()
                .trim_matches('"')
                .to_string()
        })
    })
}

/// Every series `expr` selects: identifiers that are not functions,
/// aggregations, keywords, label names of a grouping, or inside strings,
/// label matchers and ranges. Grafana's variables only appear inside those.
fn selectors(expr: &str) -> Vec<Selector> {
    let chars: Vec<char> = expr.chars().collect();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            i = past_string(&chars, i);
        } else if matches!(c, '[' | '{') {
            i = close(&chars, i);
        } else if c.is_ascii_digit() || c == '.' {
            // A number or a duration (0.99, 5m): never a name.
            while i < chars.len() && (ident(chars[i]) || chars[i] == '.') {
                i += 1;
            }
        } else if ident(c) {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let at = |ch: char| chars.get(next) == Some(&ch);
            if GROUPING.contains(&word.as_str()) {
                if at('(') {
                    i = close(&chars, next);
                }
            } else if KEYWORDS.contains(&word.as_str()) || at('(') {
                // A keyword, or a function or aggregation being called.
            } else {
                let job = if at('{') {
                    i = close(&chars, next);
                    job_matcher(&chars[next + 1..i - 1].iter().collect::<String>())
                } else {
                    None
                };
                out.push(Selector { name: word, job });
            }
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn selectors_finds_the_series_an_expression_reads() {
    let expr = r#"histogram_quantile(0.99, sum by (le, job) (rate(a_bucket{model=~"$m", job="worker"}[5m]))) > 3"#;
    assert_eq!(
        selectors(expr),
        vec![Selector {
            name: "a_bucket".into(),
            job: Some("worker".into())
        }]
    );
    let names: Vec<String> = selectors("x / on (worker) y > 0.92 and z offset 5m")
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["x", "y", "z"]);
    assert_eq!(selectors("ns:rec:rate5m / ns:other")[1].name, "ns:other");
}

/// PromQL expressions, each with where it was read (for failure messages).
type Exprs = Vec<(String, String)>;

/// The values each custom dashboard variable (`$job`) can take.
type Custom = BTreeMap<String, Vec<String>>;

/// The PromQL of every panel target and query variable of the dashboard, and
/// its custom variables.
fn dashboard() -> (Exprs, Custom) {
    let path = deploy().join("grafana/tokenmesh-dashboard.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).expect("dashboard JSON");
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 10);
    let mut exprs = Vec::new();
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            let title = format!("panel {}", p["title"]);
            exprs.push((title, t["expr"].as_str().unwrap().to_string()));
        }
    }
    let mut custom = BTreeMap::new();
    for v in dash["templating"]["list"].as_array().unwrap() {
        let (name, query) = (v["name"].as_str().unwrap(), v["query"].as_str().unwrap());
        match v["type"].as_str().unwrap() {
            // Grafana's label_values(SELECTOR, LABEL): the selector is PromQL.
            "query" => {
                let inner = query
                    .strip_prefix("label_values(")
                    .and_then(|q| q.rsplit_once(','))
                    .map(|(sel, _)| sel.to_string())
                    .unwrap_or_else(|| query.to_string());
                exprs.push((format!("variable ${name}"), inner));
            }
            "custom" => {
                let values = query.split(',').map(|s| s.trim().to_string()).collect();
                custom.insert(format!("${name}"), values);
            }
            _ => {}
        }
    }
    (exprs, custom)
}

/// Each `expr:` of a rules file with the name of its rule, and the names the
/// recording rules define. A small reader for this layout (`- alert:` or
/// `- record:`, then `expr:` inline or as a `|` block), cross-checked by
/// counting: no rule's expression can be skipped silently.
fn rules(file: &str) -> (Exprs, BTreeSet<String>) {
    let text = std::fs::read_to_string(deploy().join("prometheus").join(file)).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let (mut exprs, mut recorded) = (Vec::new(), BTreeSet::new());
    let mut rule = String::new();
    let mut rule_count = 0;
    for (n, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        for key in ["- alert:", "- record:"] {
            if let Some(name) = t.strip_prefix(key) {
                rule = name.trim().to_string();
                rule_count += 1;
                if key == "- record:" {
                    recorded.insert(rule.clone());
                }
            }
        }
        let Some(rest) = t.strip_prefix("expr:") else {
            continue;
        };
        let rest = rest.trim();
        let expr = if rest.starts_with('|') || rest.starts_with('>') {
            let indent = line.len() - t.len();
            lines[n + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            rest.to_string()
        };
        exprs.push((format!("{file} rule {rule}"), expr));
    }
    assert_eq!(exprs.len(), rule_count, "{file}: one expr per rule");
    (exprs, recorded)
}

/// Metrics only an accelerator with memory reporting exports (the worker's
/// CUDA path); a CPU test machine cannot scrape them, so for these alone the
/// check falls back to the worker's source naming them.
const ACCELERATOR_ONLY: &[&str] = &["gpu_memory_used_bytes", "gpu_memory_total_bytes"];

fn worker_source_names(metric: &str) -> bool {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../worker/src");
    let needle = format!("\"{metric}\"");
    fn walk(dir: &std::path::Path, needle: &str) -> bool {
        std::fs::read_dir(dir).unwrap().flatten().any(|e| {
            let p = e.path();
            if p.is_dir() {
                walk(&p, needle)
            } else {
                p.extension().is_some_and(|x| x == "rs")
                    && std::fs::read_to_string(&p).is_ok_and(|s| s.contains(needle))
            }
        })
    }
    walk(&src, &needle)
}

/// What is missing for `sel` (read in `place`): the jobs whose scrape lacks it.
fn missing(
    sel: &Selector,
    place: &str,
    scraped: &BTreeMap<&str, BTreeSet<String>>,
    recorded: &BTreeSet<String>,
    custom: &Custom,
) -> Option<String> {
    if recorded.contains(&sel.name) {
        return None;
    }
    if ACCELERATOR_ONLY.contains(&sel.name.as_str()) {
        return (!worker_source_names(&sel.name))
            .then(|| format!("{place}: {} is named nowhere in worker/src", sel.name));
    }
    // A pinned job must export it; `$job` means every value the variable offers;
    // no job, any process.
    let jobs: Vec<String> = match &sel.job {
        Some(j) if j.starts_with('$') => custom.get(j).cloned().unwrap_or_default(),
        Some(j) => vec![j.clone()],
        None => vec![],
    };
    let has = |job: &str| scraped.get(job).is_some_and(|s| s.contains(&sel.name));
    let lacking: Vec<&str> = if jobs.is_empty() {
        if scraped.keys().any(|j| has(j)) {
            vec![]
        } else {
            scraped.keys().copied().collect()
        }
    } else {
        jobs.iter()
            .map(String::as_str)
            .filter(|j| !has(j))
            .collect()
    };
    (!lacking.is_empty()).then(|| format!("{place}: {} not exported by {lacking:?}", sel.name))
}

#[tokio::test(flavor = "multi_thread")]
async fn dashboard_and_rules_query_only_exported_metrics() {
    let (mut exprs, custom) = dashboard();
    let mut recorded = BTreeSet::new();
    for file in ["alerts.yml", "recording.yml"] {
        let (e, r) = rules(file);
        exprs.extend(e);
        recorded.extend(r);
    }
    assert!(exprs.len() >= 25, "{exprs:#?}");

    // The real model, not the synthetic engine: only the scheduler the model
    // runs on exports the batch and KV-cache metrics.
    let dir = tempfile::tempdir().unwrap();
    let worker_metrics = format!("127.0.0.1:{}", free_port());
    let router_metrics = format!("127.0.0.1:{}", free_port());
    let worker = real_worker(
        "w-scraped",
        &["--metrics-listen", &worker_metrics],
        dir.path(),
    )
    .await;
    let router = static_router(
        dir.path(),
        &[&worker],
        &["--metrics-listen", &router_metrics],
    )
    .await;
    // One request served, so every labelled series exists, and one refused by
    // each process, so the error counters do too.
    let mut client = router.client().await;
    collect(&mut client, france_request(4)).await.unwrap();
    let refused = GenerateRequest {
        max_tokens: Some(0),
        ..france_request(1)
    };
    assert!(collect(&mut client, refused.clone()).await.is_err());
    let direct = worker
        .client()
        .await
        .generate(WorkerGenerateRequest {
            request: Some(refused),
            ..Default::default()
        })
        .await;
    assert!(direct.is_err(), "the worker refuses max_tokens 0");

    // Some series (endpoint health, queue depth) appear on the next status
    // poll: scrape until nothing is missing, then report what still is.
    let selected: Vec<(&String, Selector)> = exprs
        .iter()
        .flat_map(|(place, e)| {
            let sels = selectors(e);
            assert!(!sels.is_empty(), "{place}: no metric in {e}");
            sels.into_iter().map(move |s| (place, s))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (problems, scraped) = loop {
        let scraped = BTreeMap::from([
            (
                "worker",
                series_names(&scrape_text(&worker_metrics).await.unwrap()),
            ),
            (
                "router",
                series_names(&scrape_text(&router_metrics).await.unwrap()),
            ),
        ]);
        let problems: Vec<String> = selected
            .iter()
            .filter_map(|(place, s)| missing(s, place, &scraped, &recorded, &custom))
            .collect();
        if problems.is_empty() || Instant::now() > deadline {
            break (problems, scraped);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        problems.is_empty(),
        "queried but not exported:\n{}\n\nexported: {scraped:#?}",
        problems.join("\n")
    );
}

/// Every tokenmesh process in the compose file is health-checked through
/// `GET /readyz` on its own plaintext metrics listener
/// (`tokenmesh-entrypoint ready PORT`), never by a TLS handshake with its
/// gRPC port, which a draining worker still completes; the command itself is
/// run against real processes in tests/tests/health.rs.
#[test]
fn compose_health_checks_ask_each_process_s_readyz() {
    let compose = std::fs::read_to_string(deploy().join("docker-compose.yml")).unwrap();
    let metrics_ports: BTreeSet<String> = compose
        .lines()
        .filter_map(|l| l.trim().strip_prefix("TOKENMESH_METRICS_LISTEN: 0.0.0.0:"))
        .map(str::to_string)
        .collect();
    assert_eq!(
        metrics_ports,
        BTreeSet::from(["9464".into(), "9465".into(), "9466".into()]),
        "router, worker and control plane each have a metrics listener"
    );
    let checks: Vec<&str> = compose
        .lines()
        .filter(|l| l.trim().starts_with("test:") && l.contains("tokenmesh-entrypoint"))
        .collect();
    let ready_ports: BTreeSet<String> = checks
        .iter()
        .map(|l| {
            let rest = l
                .split_once(r#""tokenmesh-entrypoint", "ready", ""#)
                .unwrap_or_else(|| panic!("not a /readyz check: {l}"))
                .1;
            rest.split('"').next().unwrap().to_string()
        })
        .collect();
    assert_eq!(ready_ports, metrics_ports, "{checks:#?}");
    let entrypoint = std::fs::read_to_string(deploy().join("entrypoint.sh")).unwrap();
    assert!(
        entrypoint.contains("GET /readyz"),
        "entrypoint.sh's ready check"
    );
}
