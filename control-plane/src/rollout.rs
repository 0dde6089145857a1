//! Canary rollouts: the record stored at `rollouts/{model}` and the state
//! changes a verdict makes to it and to the model's traffic policy.
use crate::records::{ArmRecord, ByIncarnation, Decision, RolloutRecord, State, Verdict};
use tokenmesh_proto::records::{CanaryPolicy, PolicyRecord};
use tokenmesh_proto::v1;

/// Decisions kept in a record; older ones are dropped first.
const MAX_DECISIONS: usize = 200;

/// Values a StartCanary request may leave unset.
#[derive(Clone, Debug)]
pub struct RolloutDefaults {
    pub steps: Vec<u32>,
    pub hold_s: u32,
    pub min_requests: u32,
    pub max_error_rate_increase: f64,
    pub max_ttft_p99_ratio: f64,
    pub min_ttft_p99_increase_ms: f64,
}

/// Why a rollout request is malformed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum InvalidRollout {
    #[error("steps: each weight must be 1..=100, got {0}")]
    StepOutOfRange(u32),
    #[error("steps: weights must increase, got {0:?}")]
    NotAscending(Vec<u32>),
    #[error("max_error_rate_increase must be within 0..=1, got {0}")]
    ErrorTolerance(f64),
    #[error("max_ttft_p99_ratio must be at least 1, got {0}")]
    TtftTolerance(f64),
    #[error("min_ttft_p99_increase_ms must be at least 0, got {0}")]
    TtftSlack(f64),
}

impl RolloutRecord {
    /// A new running rollout at its first step, checked for sense.
    pub fn start(
        req: &v1::StartCanaryRequest,
        stable: &str,
        defaults: &RolloutDefaults,
        now_ms: u64,
        baseline: ByIncarnation,
    ) -> Result<Self, InvalidRollout> {
        let steps = if req.steps.is_empty() {
            defaults.steps.clone()
        } else {
            req.steps.clone()
        };
        if let Some(&bad) = steps.iter().find(|&&w| w == 0 || w > 100) {
            return Err(InvalidRollout::StepOutOfRange(bad));
        }
        if steps.windows(2).any(|w| w[0] >= w[1]) {
            return Err(InvalidRollout::NotAscending(steps));
        }
        let err_tol = req
            .max_error_rate_increase
            .unwrap_or(defaults.max_error_rate_increase);
        if !(0.0..=1.0).contains(&err_tol) {
            return Err(InvalidRollout::ErrorTolerance(err_tol));
        }
        let ttft_tol = req
            .max_ttft_p99_ratio
            .unwrap_or(defaults.max_ttft_p99_ratio);
        if ttft_tol.is_nan() || ttft_tol < 1.0 {
            return Err(InvalidRollout::TtftTolerance(ttft_tol));
        }
        let ttft_slack = req
            .min_ttft_p99_increase_ms
            .unwrap_or(defaults.min_ttft_p99_increase_ms);
        if ttft_slack.is_nan() || ttft_slack < 0.0 {
            return Err(InvalidRollout::TtftSlack(ttft_slack));
        }
        Ok(Self {
            stable: stable.to_string(),
            canary: req.canary_version.clone(),
            steps,
            step: 0,
            hold_s: if req.hold_seconds == 0 {
                defaults.hold_s
            } else {
                req.hold_seconds
            },
            min_requests: if req.min_requests == 0 {
                defaults.min_requests
            } else {
                req.min_requests
            },
            max_error_rate_increase: err_tol,
            max_ttft_p99_ratio: ttft_tol,
            min_ttft_p99_increase_ms: ttft_slack,
            state: State::Running,
            started_at_ms: now_ms,
            step_started_at_ms: now_ms,
            baseline,
            stable_reference: None,
            decisions: Vec::new(),
        })
    }

    /// Applies a decision: moves the rollout on and returns the traffic
    /// policy it implies (from `policy`, the model's current one).
    pub fn apply(
        &mut self,
        decision: Decision,
        policy: &PolicyRecord,
        now_counters: ByIncarnation,
    ) -> PolicyRecord {
        let mut next = policy.clone();
        match decision.verdict {
            Verdict::Hold => {}
            Verdict::Advance => {
                if decision.stable.requests >= u64::from(self.min_requests) {
                    self.stable_reference = Some(decision.stable.clone());
                }
                self.step += 1;
                self.step_started_at_ms = decision.at_ms;
                self.baseline = now_counters;
            }
            Verdict::Promote => {
                self.state = State::Promoted;
                next.stable = self.canary.clone();
            }
            Verdict::Rollback => {
                self.state = State::RolledBack;
                next.stable = self.stable.clone();
            }
        }
        next.canary = match self.state {
            State::Running => Some(CanaryPolicy {
                version: self.canary.clone(),
                weight: self.weight(),
            }),
            State::Promoted | State::RolledBack => None,
        };
        // Consecutive holds of one step by one decider keep only the newest,
        // so the record reads as a history of changes with current numbers.
        let repeats_hold = decision.verdict == Verdict::Hold
            && self.decisions.last().is_some_and(|last| {
                last.verdict == Verdict::Hold
                    && last.step == decision.step
                    && last.decided_by == decision.decided_by
            });
        if repeats_hold {
            self.decisions.pop();
        }
        self.decisions.push(decision);
        if self.decisions.len() > MAX_DECISIONS {
            let drop = self.decisions.len() - MAX_DECISIONS;
            self.decisions.drain(..drop);
        }
        next
    }

    /// The wire form.
    pub fn to_proto(&self, model: &str) -> v1::Rollout {
        v1::Rollout {
            model: model.to_string(),
            stable_version: self.stable.clone(),
            canary_version: self.canary.clone(),
            steps: self.steps.clone(),
            step: self.step,
            hold_seconds: self.hold_s,
            min_requests: self.min_requests,
            max_error_rate_increase: self.max_error_rate_increase,
            max_ttft_p99_ratio: self.max_ttft_p99_ratio,
            min_ttft_p99_increase_ms: self.min_ttft_p99_increase_ms,
            state: match self.state {
                State::Running => v1::RolloutState::Running,
                State::Promoted => v1::RolloutState::Promoted,
                State::RolledBack => v1::RolloutState::RolledBack,
            } as i32,
            started_at_ms: self.started_at_ms,
            step_started_at_ms: self.step_started_at_ms,
            decisions: self.decisions.iter().map(Decision::to_proto).collect(),
            freshness: None,
        }
    }
}

impl Decision {
    fn to_proto(&self) -> v1::Decision {
        let arm = |a: &ArmRecord| v1::ArmStats {
            version: a.version.clone(),
            requests: a.requests,
            errors: a.errors,
            error_rate: a.error_rate,
            ttft_p99_ms: a.ttft_p99_ms,
        };
        v1::Decision {
            at_ms: self.at_ms,
            step: self.step,
            weight: self.weight,
            verdict: match self.verdict {
                Verdict::Hold => v1::Verdict::Hold,
                Verdict::Advance => v1::Verdict::Advance,
                Verdict::Promote => v1::Verdict::Promote,
                Verdict::Rollback => v1::Verdict::Rollback,
            } as i32,
            reason: self.reason.clone(),
            canary: Some(arm(&self.canary)),
            stable: Some(arm(&self.stable)),
            decided_by: self.decided_by.clone(),
        }
    }
}

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> RolloutDefaults {
        RolloutDefaults {
            steps: vec![5, 25, 50, 100],
            hold_s: 60,
            min_requests: 100,
            max_error_rate_increase: 0.02,
            max_ttft_p99_ratio: 1.5,
            min_ttft_p99_increase_ms: 50.0,
        }
    }

    fn req(steps: Vec<u32>) -> v1::StartCanaryRequest {
        v1::StartCanaryRequest {
            model: "m".into(),
            canary_version: "v2".into(),
            steps,
            ..Default::default()
        }
    }

    fn decision(verdict: Verdict) -> Decision {
        Decision {
            at_ms: 10,
            step: 0,
            weight: 5,
            verdict,
            reason: String::new(),
            canary: ArmRecord::default(),
            stable: ArmRecord {
                requests: 500,
                ..Default::default()
            },
            decided_by: "t".into(),
        }
    }

    #[test]
    fn start_validates_steps_and_tolerances() {
        let d = defaults();
        assert_eq!(
            RolloutRecord::start(&req(vec![5, 0]), "v1", &d, 0, Default::default()),
            Err(InvalidRollout::StepOutOfRange(0))
        );
        assert_eq!(
            RolloutRecord::start(&req(vec![50, 25]), "v1", &d, 0, Default::default()),
            Err(InvalidRollout::NotAscending(vec![50, 25]))
        );
        let mut r = req(vec![]);
        r.max_ttft_p99_ratio = Some(0.5);
        assert!(RolloutRecord::start(&r, "v1", &d, 0, Default::default()).is_err());
        let ok = RolloutRecord::start(&req(vec![]), "v1", &d, 7, Default::default()).unwrap();
        assert_eq!(ok.steps, vec![5, 25, 50, 100]);
        assert_eq!((ok.weight(), ok.hold_s, ok.state), (5, 60, State::Running));
    }

    #[test]
    fn advance_then_promote_moves_the_policy() {
        let d = defaults();
        let mut r =
            RolloutRecord::start(&req(vec![50, 100]), "v1", &d, 0, Default::default()).unwrap();
        let policy = PolicyRecord {
            stable: "v1".into(),
            ..Default::default()
        };
        let p = r.apply(decision(Verdict::Advance), &policy, Default::default());
        assert_eq!(p.canary.as_ref().map(|c| c.weight), Some(100));
        assert_eq!(r.stable_reference.as_ref().map(|s| s.requests), Some(500));
        assert!(r.at_last_step());
        let p = r.apply(decision(Verdict::Promote), &p, Default::default());
        assert_eq!((p.stable.as_str(), p.canary), ("v2", None));
        assert_eq!(r.state, State::Promoted);
        assert_eq!(r.decisions.len(), 2);
    }

    #[test]
    fn rollback_restores_stable_only() {
        let d = defaults();
        let mut r =
            RolloutRecord::start(&req(vec![5, 100]), "v1", &d, 0, Default::default()).unwrap();
        let policy = PolicyRecord {
            stable: "v1".into(),
            canary: Some(CanaryPolicy {
                version: "v2".into(),
                weight: 5,
            }),
            sticky: false,
            pin_allowed: true,
        };
        let p = r.apply(decision(Verdict::Rollback), &policy, Default::default());
        assert_eq!((p.stable.as_str(), p.canary), ("v1", None));
        assert!(!p.sticky, "other policy fields are kept");
        assert_eq!(r.state, State::RolledBack);
    }

    #[test]
    fn repeated_holds_keep_only_the_newest() {
        let d = defaults();
        let mut r =
            RolloutRecord::start(&req(vec![5, 100]), "v1", &d, 0, Default::default()).unwrap();
        let policy = PolicyRecord::default();
        let mut hold = decision(Verdict::Hold);
        hold.decided_by = "operator".into();
        r.apply(hold.clone(), &policy, Default::default());
        for n in 0..3 {
            let mut h = decision(Verdict::Hold);
            h.at_ms = n;
            r.apply(h, &policy, Default::default());
        }
        assert_eq!(r.decisions.len(), 2);
        assert_eq!(r.decisions[1].at_ms, 2);
    }
}
