//! The rollout records stored in etcd (`rollouts/{model}`) and the counters
//! they carry: plain data that the store reads and writes, analysis judges
//! and rollout changes. Kept apart so that those three depend on the records
//! and not on each other.
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Cumulative counters of one version as one router incarnation saw them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Requests finished, any outcome.
    pub requests: u64,
    /// Of those, the ones that ended in a serving error.
    pub errors: u64,
    /// Time to first token per bucket of
    /// [`tokenmesh_proto::records::TTFT_BUCKETS_MS`], as the routers publish it.
    pub ttft_counts: Vec<u64>,
}

/// Counters per router incarnation (`router_id@started_at_ms`), then per version.
pub type ByIncarnation = BTreeMap<String, BTreeMap<String, Counters>>;

/// Where a rollout stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Running,
    Promoted,
    RolledBack,
}

/// What the controller (or an operator) decided at one point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Hold,
    Advance,
    Promote,
    Rollback,
}

/// The traffic of one arm during a step, as recorded with a decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct ArmRecord {
    /// The arm's model version.
    pub version: String,
    /// Requests in the window.
    pub requests: u64,
    /// Of those, errors.
    pub errors: u64,
    /// `errors / requests`, 0 without requests.
    pub error_rate: f64,
    /// Time to first token, 99th percentile, in milliseconds.
    pub ttft_p99_ms: f64,
}

/// One decision, with the numbers it was based on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// When, in Unix milliseconds.
    pub at_ms: u64,
    /// The step (0-based) it was taken at.
    pub step: u32,
    /// The canary weight of that step, in percent.
    pub weight: u32,
    pub verdict: Verdict,
    /// Why, in words an operator reads in `meshctl rollout status`.
    pub reason: String,
    pub canary: ArmRecord,
    pub stable: ArmRecord,
    /// The controller replica's id, or the operator's identity.
    pub decided_by: String,
}

/// `rollouts/{model}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RolloutRecord {
    /// The version traffic returns to on rollback.
    pub stable: String,
    /// The version being rolled out.
    pub canary: String,
    /// Canary weights in percent, increasing; the last is usually 100.
    pub steps: Vec<u32>,
    /// Index of the current step in `steps`.
    pub step: u32,
    /// How long each step holds before it may advance, in seconds.
    pub hold_s: u32,
    /// Requests an arm needs before it is judged.
    pub min_requests: u32,
    /// Error-rate points (0..=1) the canary may exceed stable by.
    pub max_error_rate_increase: f64,
    /// How many times stable's TTFT p99 the canary's may be...
    pub max_ttft_p99_ratio: f64,
    /// ...and by how many milliseconds at least, so that noise on a fast
    /// model does not roll back.
    #[serde(default)]
    pub min_ttft_p99_increase_ms: f64,
    pub state: State,
    /// When the rollout began, Unix milliseconds.
    pub started_at_ms: u64,
    /// When the current step began, Unix milliseconds.
    pub step_started_at_ms: u64,
    /// Each router incarnation's counters per version when the step began,
    /// so any replica that leads next measures the same window.
    #[serde(default)]
    pub baseline: ByIncarnation,
    /// Stable's traffic from the last step in which it had enough requests:
    /// the reference once the canary takes all traffic.
    #[serde(default)]
    pub stable_reference: Option<ArmRecord>,
    /// The decisions so far, oldest first (bounded; see `rollout`).
    #[serde(default)]
    pub decisions: Vec<Decision>,
}

impl RolloutRecord {
    /// The canary weight of the current step.
    pub fn weight(&self) -> u32 {
        self.steps.get(self.step as usize).copied().unwrap_or(100)
    }

    /// Whether the current step is the last.
    pub fn at_last_step(&self) -> bool {
        self.step as usize + 1 >= self.steps.len()
    }
}
