//! Tables and JSON for the control commands, the live rollout view, and the
//! words `meshctl generate` ends a reply with.
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::fmt::Write;
use tokenmesh_proto::v1;

fn freshness_note(f: &Option<v1::Freshness>) -> String {
    match f {
        Some(f) if f.stale => format!(
            "STALE: etcd unreachable; this is {:.1} s old ({})\n",
            f.age_ms as f64 / 1000.0,
            f.reason
        ),
        _ => String::new(),
    }
}

fn freshness_json(f: &Option<v1::Freshness>) -> Value {
    let f = f.clone().unwrap_or_default();
    json!({"stale": f.stale, "age_ms": f.age_ms, "reason": f.reason})
}

/// A `Finished.finish_reason` as `meshctl generate` prints it: `eos`,
/// `stop`, `length`, `cancelled` (Worker.Abort) or `kv cache full` (the
/// reply outgrew the worker's whole KV cache).
pub fn finish_reason(reason: i32) -> String {
    match v1::FinishReason::try_from(reason) {
        Ok(v1::FinishReason::KvCacheFull) => "kv cache full".into(),
        Ok(r) => r
            .as_str_name()
            .trim_start_matches("FINISH_REASON_")
            .to_lowercase(),
        Err(_) => format!("unknown finish reason {reason}"),
    }
}

/// `meshctl status` as a table.
pub fn status_table(r: &v1::MeshStatusResponse) -> String {
    let mut s = freshness_note(&r.freshness);
    let _ = writeln!(
        s,
        "{:<24} {:<10} {:<7} {:>6} {:>7} {:>9} {:>7} {:>10}  ROLLOUT",
        "MODEL", "VERSION", "ROLE", "WEIGHT", "READY", "REQ/S", "ERR%", "TTFT p99"
    );
    for v in &r.versions {
        let _ = writeln!(
            s,
            "{:<24} {:<10} {:<7} {:>5}% {:>3}/{:<3} {:>9.1} {:>6.2}% {:>7.0} ms  {}",
            v.model,
            v.version,
            if v.role.is_empty() { "-" } else { &v.role },
            v.weight,
            v.ready_workers,
            v.registered_workers,
            v.requests_per_second,
            v.error_rate * 100.0,
            v.ttft_p99_ms,
            v.rollout
        );
    }
    let _ = writeln!(s, "(rates over the last {:.0} s)", r.window_seconds);
    s
}

/// `meshctl status` as JSON.
pub fn status_json(r: &v1::MeshStatusResponse) -> Value {
    json!({
        "versions": r.versions.iter().map(|v| json!({
            "model": v.model, "version": v.version, "role": v.role, "weight": v.weight,
            "ready_workers": v.ready_workers, "registered_workers": v.registered_workers,
            "requests_per_second": v.requests_per_second, "error_rate": v.error_rate,
            "ttft_p99_ms": v.ttft_p99_ms, "rollout": v.rollout,
        })).collect::<Vec<_>>(),
        "window_seconds": r.window_seconds,
        "freshness": freshness_json(&r.freshness),
    })
}

fn state_name(state: i32) -> String {
    v1::RolloutState::try_from(state)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("ROLLOUT_STATE_")
                .to_lowercase()
        })
        .unwrap_or_else(|_| "unknown".into())
}

fn verdict_name(v: i32) -> String {
    v1::Verdict::try_from(v)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("VERDICT_")
                .to_lowercase()
        })
        .unwrap_or_else(|_| "unknown".into())
}

fn arm_json(a: &Option<v1::ArmStats>) -> Value {
    let a = a.clone().unwrap_or_default();
    json!({"version": a.version, "requests": a.requests, "errors": a.errors,
           "error_rate": a.error_rate, "ttft_p99_ms": a.ttft_p99_ms})
}

fn decision_json(d: &v1::Decision) -> Value {
    json!({
        "at_ms": d.at_ms, "step": d.step, "weight": d.weight,
        "verdict": verdict_name(d.verdict), "reason": d.reason,
        "canary": arm_json(&d.canary), "stable": arm_json(&d.stable),
        "decided_by": d.decided_by,
    })
}

/// A rollout as JSON.
pub fn rollout_json(r: &v1::Rollout) -> Value {
    json!({
        "model": r.model, "stable_version": r.stable_version, "canary_version": r.canary_version,
        "steps": r.steps, "step": r.step, "weight": r.steps.get(r.step as usize),
        "hold_seconds": r.hold_seconds, "min_requests": r.min_requests,
        "max_error_rate_increase": r.max_error_rate_increase,
        "max_ttft_p99_ratio": r.max_ttft_p99_ratio,
        "min_ttft_p99_increase_ms": r.min_ttft_p99_increase_ms,
        "state": state_name(r.state), "started_at_ms": r.started_at_ms,
        "step_started_at_ms": r.step_started_at_ms,
        "decisions": r.decisions.iter().map(decision_json).collect::<Vec<_>>(),
        "freshness": freshness_json(&r.freshness),
    })
}

fn decision_line(d: &v1::Decision) -> String {
    let arm = |a: &Option<v1::ArmStats>| {
        let a = a.clone().unwrap_or_default();
        format!(
            "{} {} req {:.2}% err p99 {:.0} ms",
            a.version,
            a.requests,
            a.error_rate * 100.0,
            a.ttft_p99_ms
        )
    };
    format!(
        "step {} @{:>3}%  {:<8} {}  [canary {} | stable {}]  by {}",
        d.step + 1,
        d.weight,
        verdict_name(d.verdict),
        d.reason,
        arm(&d.canary),
        arm(&d.stable),
        d.decided_by
    )
}

/// A rollout and its decisions as text.
pub fn rollout_table(r: &v1::Rollout) -> String {
    let mut s = freshness_note(&r.freshness);
    let _ = writeln!(
        s,
        "model {}: {} -> {}  state {}  step {}/{} ({}%)  steps {:?}  hold {} s  min {} requests  tolerance +{:.1} points errors, {:.2}x and +{:.0} ms TTFT p99",
        r.model,
        r.stable_version,
        r.canary_version,
        state_name(r.state),
        r.step + 1,
        r.steps.len(),
        r.steps.get(r.step as usize).copied().unwrap_or(0),
        r.steps,
        r.hold_seconds,
        r.min_requests,
        r.max_error_rate_increase * 100.0,
        r.max_ttft_p99_ratio,
        r.min_ttft_p99_increase_ms
    );
    for d in &r.decisions {
        let _ = writeln!(s, "  {}", decision_line(d));
    }
    s
}

/// The live view of `canary watch` on a terminal: a bar over the steps, the
/// newest decision as its message, each decision also printed as a line.
pub struct LiveView {
    bar: Option<ProgressBar>,
    printed: usize,
}

impl LiveView {
    /// A live view (plain lines when `live` is false or stdout is no terminal).
    pub fn new(live: bool) -> Self {
        use std::io::IsTerminal;
        Self {
            bar: (live && std::io::stdout().is_terminal()).then(|| {
                let bar = ProgressBar::new(1);
                bar.set_style(
                    ProgressStyle::with_template("{prefix} [{bar:30}] step {pos}/{len}  {msg}")
                        .expect("valid template")
                        .progress_chars("=> "),
                );
                bar
            }),
            printed: 0,
        }
    }

    /// Shows a new state of the rollout.
    pub fn update(&mut self, r: &v1::Rollout) {
        let new = r.decisions.iter().skip(self.printed.min(r.decisions.len()));
        for d in new {
            match &self.bar {
                Some(b) => b.println(decision_line(d)),
                None => println!("{}", decision_line(d)),
            }
        }
        self.printed = r.decisions.len();
        let weight = r.steps.get(r.step as usize).copied().unwrap_or(0);
        let summary = format!(
            "{} {} -> {} at {}% ({})",
            r.model,
            r.stable_version,
            r.canary_version,
            weight,
            state_name(r.state)
        );
        match &self.bar {
            Some(b) => {
                b.set_length(r.steps.len() as u64);
                let done = r.state == v1::RolloutState::Promoted as i32;
                b.set_position(if done {
                    r.steps.len() as u64
                } else {
                    u64::from(r.step)
                });
                b.set_prefix(state_name(r.state));
                b.set_message(summary);
            }
            None => println!("{summary}"),
        }
    }

    /// Leaves the final state on screen.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.abandon();
        }
    }
}

/// `meshctl workers list` as a table.
pub fn workers_table(r: &v1::ListWorkersResponse) -> String {
    let mut s = freshness_note(&r.freshness);
    let _ = writeln!(
        s,
        "{:<20} {:<24} {:<8} {:<22} {:<8} {:>8} {:>9} {:>6}  DRAIN",
        "WORKER", "MODEL", "VERSION", "ADDR", "DEVICE", "HEALTHY", "IN-FLIGHT", "QUEUE"
    );
    for w in &r.workers {
        let _ = writeln!(
            s,
            "{:<20} {:<24} {:<8} {:<22} {:<8} {:>4}/{:<3} {:>9} {:>6}  {}",
            w.worker_id,
            w.model,
            w.version,
            w.addr
                .trim_start_matches("http://")
                .trim_start_matches("https://"),
            w.accelerator,
            w.healthy_routers,
            w.seen_by_routers,
            w.in_flight,
            w.queue_depth,
            if w.drain_reason.is_empty() {
                "-"
            } else {
                &w.drain_reason
            }
        );
    }
    s
}

/// One worker as JSON.
pub fn worker_json(w: &v1::WorkerInfo) -> Value {
    json!({
        "worker_id": w.worker_id, "model": w.model, "version": w.version, "addr": w.addr,
        "accelerator": w.accelerator, "device": w.device, "capacity": w.capacity,
        "started_at": w.started_at, "drain_reason": w.drain_reason,
        "healthy_routers": w.healthy_routers, "seen_by_routers": w.seen_by_routers,
        "in_flight": w.in_flight, "queue_depth": w.queue_depth,
    })
}

/// `meshctl workers list` as JSON.
pub fn workers_json(r: &v1::ListWorkersResponse) -> Value {
    json!({
        "workers": r.workers.iter().map(worker_json).collect::<Vec<_>>(),
        "freshness": freshness_json(&r.freshness),
    })
}

/// A policy as text.
pub fn policy_table(r: &v1::PolicyResponse) -> String {
    let mut s = freshness_note(&r.freshness);
    match &r.policy {
        None => {
            let _ = writeln!(
                s,
                "model {}: no traffic policy (the newest ready version serves)",
                r.model
            );
        }
        Some(p) => {
            let canary = if p.canary_version.is_empty() {
                "none".to_string()
            } else {
                format!("{} at {}%", p.canary_version, p.canary_weight)
            };
            let _ = writeln!(
                s,
                "model {}  stable {}  canary {}  sticky {}  pin allowed {}  (revision {})",
                r.model, p.stable_version, canary, p.sticky, p.pin_allowed, r.revision
            );
        }
    }
    s
}

/// A policy as JSON.
pub fn policy_json(r: &v1::PolicyResponse) -> Value {
    json!({
        "model": r.model,
        "policy": r.policy.as_ref().map(|p| json!({
            "stable_version": p.stable_version, "canary_version": p.canary_version,
            "canary_weight": p.canary_weight, "sticky": p.sticky, "pin_allowed": p.pin_allowed,
        })),
        "revision": r.revision,
        "freshness": freshness_json(&r.freshness),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finish_reason_has_its_words() {
        let words = |r: v1::FinishReason| finish_reason(r as i32);
        assert_eq!(words(v1::FinishReason::Eos), "eos");
        assert_eq!(words(v1::FinishReason::Stop), "stop");
        assert_eq!(words(v1::FinishReason::Length), "length");
        assert_eq!(words(v1::FinishReason::Cancelled), "cancelled");
        assert_eq!(words(v1::FinishReason::KvCacheFull), "kv cache full");
        assert_eq!(finish_reason(99), "unknown finish reason 99");
    }
}
