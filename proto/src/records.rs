//! JSON records stored in etcd and in the static discovery file.
use crate::validate::check_name;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A worker's registration, `workers/{model}/{version}/{worker_id}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Address the router dials, e.g. `http://127.0.0.1:50061`.
    pub addr: String,
    /// sha256 of the model file, hex.
    #[serde(default)]
    pub model_digest: String,
    /// `cpu`, `cuda` or `npu`.
    #[serde(default = "default_accelerator")]
    pub accelerator: String,
    /// Device name, e.g. `cpu` or `NVIDIA H200`.
    #[serde(default)]
    pub device: String,
    /// Sequences the worker runs at once.
    #[serde(default = "default_capacity")]
    pub capacity: u32,
    /// Free-form labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// RFC 3339 start time.
    #[serde(default)]
    pub started_at: String,
    /// Whether a stream can continue here from token ids: a failover's
    /// continuation sends the prompt and the tokens already emitted as ids.
    /// Routers end a stream lost mid-way with UNAVAILABLE rather than move
    /// it between workers that cannot. Absent in older records: true.
    #[serde(default = "yes")]
    pub continues_from_token_ids: bool,
    /// The engine an upstream worker fronts (`llama-server`, `vllm`); empty
    /// for the worker's own engine.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub engine: String,
    /// The model as that engine names it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub engine_model: String,
}

impl WorkerRecord {
    /// A record of a worker at `addr` with every other field as an absent
    /// one reads (the serde defaults), for code that registers by hand.
    pub fn new(addr: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            model_digest: String::new(),
            accelerator: default_accelerator(),
            device: String::new(),
            capacity: default_capacity(),
            labels: BTreeMap::new(),
            started_at: String::new(),
            continues_from_token_ids: yes(),
            engine: String::new(),
            engine_model: String::new(),
        }
    }
}

fn default_accelerator() -> String {
    "cpu".into()
}

fn default_capacity() -> u32 {
    1
}

/// A canary arm of a traffic policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanaryPolicy {
    /// The canary version.
    pub version: String,
    /// Percent of traffic, 0..=100.
    pub weight: u32,
}

/// The traffic policy of one model, `models/{model}/policy`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct PolicyRecord {
    /// The version that takes the traffic the canary does not.
    pub stable: String,
    /// Optional canary arm.
    #[serde(default)]
    pub canary: Option<CanaryPolicy>,
    /// Sticky sessions by `session_id`.
    #[serde(default = "yes")]
    pub sticky: bool,
    /// Whether requests may pin a version.
    #[serde(default = "yes")]
    pub pin_allowed: bool,
}

fn yes() -> bool {
    true
}

/// Why a traffic policy cannot be served; the message names the field as the
/// Control API does (`policy.canary_weight`, ...).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidPolicy(pub String);

impl PolicyRecord {
    /// The shape checks every reader and writer applies: the Control API's
    /// SetPolicy before it writes, routers and the control plane when they
    /// read one from etcd or a static file (where anyone may have written
    /// it). Whether the versions have registered workers depends on the
    /// moment and is SetPolicy's own check.
    pub fn validate(&self) -> Result<(), InvalidPolicy> {
        let bad = |m: String| Err(InvalidPolicy(m));
        if self.stable.is_empty() {
            return bad("policy.stable_version: required".into());
        }
        // Versions are etcd key segments and metric labels.
        check_name("policy.stable_version", &self.stable)
            .map_err(|e| InvalidPolicy(e.to_string()))?;
        let Some(canary) = &self.canary else {
            return Ok(());
        };
        if !canary.version.is_empty() {
            check_name("policy.canary_version", &canary.version)
                .map_err(|e| InvalidPolicy(e.to_string()))?;
        }
        if canary.weight > 100 {
            return bad(format!(
                "policy.canary_weight must be 0..=100, got {}",
                canary.weight
            ));
        }
        if canary.version.is_empty() {
            return bad("policy.canary_version: required when a canary is given".into());
        }
        if canary.version == self.stable {
            return bad("policy.canary_version must differ from policy.stable_version".into());
        }
        Ok(())
    }
}

/// Upper bounds, in milliseconds, of the time-to-first-token buckets routers
/// publish in [`StatsRecord`]. Same range as the Prometheus LLM buckets.
pub const TTFT_BUCKETS_MS: &[f64] = &[
    5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
];

/// What one router saw of one model version,
/// `stats/{router_id}/{model}/{version}`, kept under the router's lease.
///
/// Counters are cumulative since `started_at_ms`, so a reader takes the
/// difference between two reads of the same router incarnation
/// (`router_id@started_at_ms`); a new `started_at_ms` means the counters
/// restarted from zero: the router restarted, or dropped the version's
/// counters while it was idle and unregistered and then saw it again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct StatsRecord {
    /// Unix milliseconds when these counters began: when the router first
    /// counted an attempt on the version (the router's start for a version
    /// it has only seen workers of).
    pub started_at_ms: u64,
    /// Unix milliseconds of this snapshot.
    pub updated_at_ms: u64,
    /// Upstream attempts sent to workers of this version.
    pub requests: u64,
    /// Attempts that failed on the serving side: a worker error status, a
    /// broken stream, or a deadline. Client cancellations and invalid
    /// requests are not errors of the version.
    pub errors: u64,
    /// Time to first token per bucket of [`TTFT_BUCKETS_MS`] (not cumulative);
    /// one more entry than the bounds, the last counting everything above.
    #[serde(default)]
    pub ttft_counts: Vec<u64>,
    /// Workers of this version as this router sees them, by worker id.
    #[serde(default)]
    pub workers: BTreeMap<String, WorkerView>,
}

/// One router's view of one worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct WorkerView {
    /// Answering health checks and not ejected.
    pub healthy: bool,
    /// Draining, by the worker's own report or a `drain/` key.
    pub draining: bool,
    /// Streams in flight from this router.
    pub in_flight: u32,
    /// Queue depth the worker last reported.
    pub queue_depth: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_defaults_are_permissive() {
        let p: PolicyRecord = serde_json::from_str(r#"{"stable":"v1"}"#).unwrap();
        assert!(p.sticky && p.pin_allowed && p.canary.is_none());
    }

    #[test]
    fn policies_are_checked_as_the_control_api_checks_them() {
        let policy = |json: &str| serde_json::from_str::<PolicyRecord>(json).unwrap();
        assert_eq!(policy(r#"{"stable":"v1"}"#).validate(), Ok(()));
        let ok = r#"{"stable":"v1","canary":{"version":"v2","weight":100}}"#;
        assert_eq!(policy(ok).validate(), Ok(()));
        for (json, names) in [
            (r#"{"stable":""}"#, "policy.stable_version"),
            (
                r#"{"stable":"v1","canary":{"version":"v2","weight":250}}"#,
                "0..=100, got 250",
            ),
            (
                r#"{"stable":"v1","canary":{"version":"","weight":5}}"#,
                "policy.canary_version",
            ),
            (
                r#"{"stable":"v1","canary":{"version":"v1","weight":5}}"#,
                "must differ",
            ),
        ] {
            let e = policy(json).validate().unwrap_err();
            assert!(e.0.contains(names), "{json}: {e}");
        }
    }

    #[test]
    fn worker_record_minimal() {
        let w: WorkerRecord = serde_json::from_str(r#"{"addr":"http://x:1"}"#).unwrap();
        assert_eq!(w.accelerator, "cpu");
        assert_eq!(w.capacity, 1);
        // Records written before the field existed continue from token ids.
        assert!(w.continues_from_token_ids);
        assert!(w.engine.is_empty());
        let text = serde_json::to_string(&w).unwrap();
        assert!(
            !text.contains("engine"),
            "empty engine fields are left out: {text}"
        );
    }
}
