//! JSON records stored in etcd and in the static discovery file.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_defaults_are_permissive() {
        let p: PolicyRecord = serde_json::from_str(r#"{"stable":"v1"}"#).unwrap();
        assert!(p.sticky && p.pin_allowed && p.canary.is_none());
    }

    #[test]
    fn worker_record_minimal() {
        let w: WorkerRecord = serde_json::from_str(r#"{"addr":"http://x:1"}"#).unwrap();
        assert_eq!(w.accelerator, "cpu");
        assert_eq!(w.capacity, 1);
    }
}
