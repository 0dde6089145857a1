//! Automated canary analysis: turns the routers' published counters into
//! per-arm windows (requests, errors, TTFT p99 since a step began) and those
//! into a verdict. Pure functions, so every rule is unit-tested.
use crate::records::{ArmRecord, ByIncarnation, Counters, RolloutRecord, Verdict};
use tokenmesh_proto::records::TTFT_BUCKETS_MS;

impl Counters {
    fn add(&mut self, other: &Counters) {
        self.requests += other.requests;
        self.errors += other.errors;
        add_counts(&mut self.ttft_counts, &other.ttft_counts);
    }

    /// `self - base`, never below zero.
    fn since(&self, base: &Counters) -> Counters {
        let mut ttft = self.ttft_counts.clone();
        for (i, b) in base.ttft_counts.iter().enumerate() {
            if let Some(c) = ttft.get_mut(i) {
                *c = c.saturating_sub(*b);
            }
        }
        Counters {
            requests: self.requests.saturating_sub(base.requests),
            errors: self.errors.saturating_sub(base.errors),
            ttft_counts: ttft,
        }
    }
}

fn add_counts(into: &mut Vec<u64>, from: &[u64]) {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    for (i, c) in from.iter().enumerate() {
        into[i] += c;
    }
}

/// One arm's traffic over a window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ArmWindow {
    pub version: String,
    pub requests: u64,
    pub errors: u64,
    pub ttft_counts: Vec<u64>,
}

impl ArmWindow {
    /// Errors over requests; 0 without requests.
    pub fn error_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.errors as f64 / self.requests as f64
        }
    }

    /// TTFT p99 in milliseconds; 0 when no request reached a first token.
    pub fn ttft_p99_ms(&self) -> f64 {
        quantile_ms(&self.ttft_counts, 0.99)
    }
}

impl From<&ArmWindow> for ArmRecord {
    fn from(w: &ArmWindow) -> Self {
        Self {
            version: w.version.clone(),
            requests: w.requests,
            errors: w.errors,
            error_rate: w.error_rate(),
            ttft_p99_ms: w.ttft_p99_ms(),
        }
    }
}

/// `version`'s traffic between `base` and `now`. A router incarnation absent
/// from `base` started within the window, so all its counts are in it; one
/// absent from `now` has gone and its last window is lost.
pub fn window(now: &ByIncarnation, base: &ByIncarnation, version: &str) -> ArmWindow {
    let mut total = Counters::default();
    for (incarnation, versions) in now {
        let Some(c) = versions.get(version) else {
            continue;
        };
        let d = match base.get(incarnation).and_then(|b| b.get(version)) {
            Some(b) => c.since(b),
            None => c.clone(),
        };
        total.add(&d);
    }
    ArmWindow {
        version: version.to_string(),
        requests: total.requests,
        errors: total.errors,
        ttft_counts: total.ttft_counts,
    }
}

/// The `q` quantile of a TTFT histogram over [`TTFT_BUCKETS_MS`], linearly
/// interpolated within its bucket as Prometheus' `histogram_quantile` does;
/// counts above the largest bound report that bound.
pub fn quantile_ms(counts: &[u64], q: f64) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let rank = q * total as f64;
    let mut seen = 0u64;
    for (i, &c) in counts.iter().enumerate() {
        if c == 0 {
            continue;
        }
        if (seen + c) as f64 >= rank {
            let Some(&upper) = TTFT_BUCKETS_MS.get(i) else {
                return *TTFT_BUCKETS_MS.last().unwrap_or(&0.0);
            };
            let lower = if i == 0 { 0.0 } else { TTFT_BUCKETS_MS[i - 1] };
            let within = (rank - seen as f64) / c as f64;
            return lower + (upper - lower) * within.clamp(0.0, 1.0);
        }
        seen += c;
    }
    *TTFT_BUCKETS_MS.last().unwrap_or(&0.0)
}

/// A verdict with its reason.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub verdict: Verdict,
    pub reason: String,
}

/// Decides one analysis round of a running rollout.
///
/// Rolls back at once, whatever the hold time, when the canary has enough
/// requests and its error rate or TTFT p99 is worse than stable's beyond the
/// tolerance. Advances (or promotes at the last step) only when the step has
/// held long enough and the canary has enough requests. Otherwise holds.
/// When stable has too few requests of its own (at 100 % canary, say), the
/// stable reference is its traffic from the last step where it had enough.
pub fn decide(r: &RolloutRecord, canary: &ArmWindow, stable: &ArmWindow, now_ms: u64) -> Outcome {
    let min = u64::from(r.min_requests);
    let reference = if stable.requests >= min {
        Some(ArmRecord::from(stable))
    } else {
        r.stable_reference.clone()
    };
    if canary.requests >= min {
        if let Some(rollback) = regression(r, canary, reference.as_ref()) {
            return rollback;
        }
    }
    let held_ms = now_ms.saturating_sub(r.step_started_at_ms);
    let hold_ms = u64::from(r.hold_s) * 1000;
    if held_ms < hold_ms {
        return Outcome {
            verdict: Verdict::Hold,
            reason: format!(
                "holding step {} at {}%: {}s of {}s, canary {} requests",
                r.step + 1,
                r.weight(),
                held_ms / 1000,
                r.hold_s,
                canary.requests
            ),
        };
    }
    if canary.requests < min {
        return Outcome {
            verdict: Verdict::Hold,
            reason: format!(
                "waiting for samples: canary has {} of {} requests",
                canary.requests, min
            ),
        };
    }
    move_on(r, canary, reference.as_ref())
}

/// A rollback when the canary is worse than the stable `reference` beyond the
/// rollout's tolerances: its error rate, then its TTFT p99. Without a
/// reference, errors compare against none and TTFT is not judged.
fn regression(
    r: &RolloutRecord,
    canary: &ArmWindow,
    reference: Option<&ArmRecord>,
) -> Option<Outcome> {
    let canary_err = canary.error_rate();
    let stable_err = reference.map(|s| s.error_rate).unwrap_or(0.0);
    if canary_err > stable_err + r.max_error_rate_increase {
        return Some(Outcome {
            verdict: Verdict::Rollback,
            reason: format!(
                "canary error rate {:.2}% ({} of {}) exceeds stable {:.2}% by more than {:.2} points",
                canary_err * 100.0,
                canary.errors,
                canary.requests,
                stable_err * 100.0,
                r.max_error_rate_increase * 100.0
            ),
        });
    }
    let canary_p99 = canary.ttft_p99_ms();
    let s = reference.filter(|s| s.ttft_p99_ms > 0.0)?;
    // The ratio alone would fail a fast model on noise of a few milliseconds.
    let limit =
        (s.ttft_p99_ms * r.max_ttft_p99_ratio).max(s.ttft_p99_ms + r.min_ttft_p99_increase_ms);
    (canary_p99 > limit).then(|| Outcome {
        verdict: Verdict::Rollback,
        reason: format!(
            "canary TTFT p99 {:.0} ms exceeds stable's {:.0} ms by more than {:.1}x and {:.0} ms",
            canary_p99, s.ttft_p99_ms, r.max_ttft_p99_ratio, r.min_ttft_p99_increase_ms
        ),
    })
}

/// The verdict of a healthy canary that has held its step long enough:
/// promote at the last step, else advance to the next.
fn move_on(r: &RolloutRecord, canary: &ArmWindow, reference: Option<&ArmRecord>) -> Outcome {
    let comparison = match reference {
        Some(s) => format!(
            "canary {:.2}% errors, TTFT p99 {:.0} ms; stable {:.2}%, {:.0} ms",
            canary.error_rate() * 100.0,
            canary.ttft_p99_ms(),
            s.error_rate * 100.0,
            s.ttft_p99_ms
        ),
        None => format!(
            "canary {:.2}% errors, TTFT p99 {:.0} ms; no stable reference",
            canary.error_rate() * 100.0,
            canary.ttft_p99_ms()
        ),
    };
    if r.at_last_step() {
        Outcome {
            verdict: Verdict::Promote,
            reason: format!("healthy at the last step ({}%): {comparison}", r.weight()),
        }
    } else {
        Outcome {
            verdict: Verdict::Advance,
            reason: format!(
                "healthy at {}%: {comparison}; advancing to {}%",
                r.weight(),
                r.steps[r.step as usize + 1]
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::State;

    /// A running rollout of v2 over v1 at its first step, begun at time 0.
    fn rollout(steps: Vec<u32>) -> RolloutRecord {
        RolloutRecord {
            stable: "v1".into(),
            canary: "v2".into(),
            steps,
            step: 0,
            hold_s: 10,
            min_requests: 50,
            max_error_rate_increase: 0.02,
            max_ttft_p99_ratio: 1.5,
            min_ttft_p99_increase_ms: 50.0,
            state: State::Running,
            started_at_ms: 0,
            step_started_at_ms: 0,
            baseline: Default::default(),
            stable_reference: None,
            decisions: Vec::new(),
        }
    }

    /// `n` requests with `errors` failures, every first token in bucket `b`.
    fn arm(version: &str, n: u64, errors: u64, b: usize) -> ArmWindow {
        let mut ttft = vec![0; TTFT_BUCKETS_MS.len() + 1];
        ttft[b] = n - errors;
        ArmWindow {
            version: version.into(),
            requests: n,
            errors,
            ttft_counts: ttft,
        }
    }

    #[test]
    fn quantile_interpolates_within_the_bucket() {
        let mut c = vec![0; TTFT_BUCKETS_MS.len() + 1];
        c[2] = 100; // 10..25 ms
        assert!((quantile_ms(&c, 0.5) - 17.5).abs() < 1e-9);
        assert!((quantile_ms(&c, 0.99) - 24.85).abs() < 1e-9);
        assert_eq!(quantile_ms(&[], 0.99), 0.0);
        let mut over = vec![0; TTFT_BUCKETS_MS.len() + 1];
        *over.last_mut().unwrap() = 3;
        assert_eq!(quantile_ms(&over, 0.99), 30000.0);
    }

    #[test]
    fn windows_subtract_the_baseline_and_handle_restarts() {
        let c = |r, e| Counters {
            requests: r,
            errors: e,
            ttft_counts: vec![r - e],
        };
        let base: ByIncarnation = [("r1@1".to_string(), [("v2".to_string(), c(10, 1))].into())]
            .into_iter()
            .collect();
        let now: ByIncarnation = [
            ("r1@1".to_string(), [("v2".to_string(), c(30, 3))].into()),
            // r2 restarted (new incarnation): all its counts are new.
            ("r2@9".to_string(), [("v2".to_string(), c(5, 0))].into()),
        ]
        .into_iter()
        .collect();
        let w = window(&now, &base, "v2");
        assert_eq!((w.requests, w.errors, w.ttft_counts), (25, 2, vec![23]));
        assert_eq!(window(&now, &base, "v1").requests, 0);
    }

    #[test]
    fn failing_canary_rolls_back_before_the_hold_ends() {
        let r = rollout(vec![25, 100]);
        let out = decide(&r, &arm("v2", 60, 30, 2), &arm("v1", 200, 0, 2), 1_000);
        assert_eq!(out.verdict, Verdict::Rollback);
        assert!(out.reason.contains("50.00%"), "{}", out.reason);
    }

    #[test]
    fn slow_canary_rolls_back_on_ttft() {
        let r = rollout(vec![25, 100]);
        let out = decide(&r, &arm("v2", 60, 0, 7), &arm("v1", 200, 0, 2), 1_000);
        assert_eq!(out.verdict, Verdict::Rollback);
        assert!(out.reason.contains("TTFT"), "{}", out.reason);
    }

    #[test]
    fn tiny_ttft_differences_on_a_fast_model_pass() {
        let r = rollout(vec![25, 100]);
        // 5-10 ms against 0-5 ms: twice as slow, but only by a few ms.
        let out = decide(&r, &arm("v2", 60, 0, 1), &arm("v1", 200, 0, 0), 20_000);
        assert_eq!(out.verdict, Verdict::Advance, "{}", out.reason);
    }

    #[test]
    fn small_differences_within_tolerance_pass() {
        let r = rollout(vec![25, 100]);
        // 1% more errors than stable, within the 2-point tolerance.
        let out = decide(&r, &arm("v2", 100, 1, 2), &arm("v1", 200, 0, 2), 20_000);
        assert_eq!(out.verdict, Verdict::Advance, "{}", out.reason);
    }

    #[test]
    fn holds_for_time_then_for_samples() {
        let r = rollout(vec![25, 100]);
        let healthy = arm("v2", 60, 0, 2);
        let stable = arm("v1", 200, 0, 2);
        assert_eq!(decide(&r, &healthy, &stable, 5_000).verdict, Verdict::Hold);
        let few = arm("v2", 10, 0, 2);
        let out = decide(&r, &few, &stable, 20_000);
        assert_eq!(out.verdict, Verdict::Hold);
        assert!(out.reason.contains("10 of 50"), "{}", out.reason);
        assert_eq!(
            decide(&r, &healthy, &stable, 20_000).verdict,
            Verdict::Advance
        );
    }

    #[test]
    fn last_step_promotes_against_the_stable_reference() {
        let mut r = rollout(vec![100]);
        assert!(r.at_last_step());
        r.stable_reference = Some(ArmRecord::from(&arm("v1", 200, 0, 2)));
        // Stable gets no traffic at 100%: the reference decides.
        let idle = arm("v1", 0, 0, 2);
        assert_eq!(
            decide(&r, &arm("v2", 60, 0, 2), &idle, 20_000).verdict,
            Verdict::Promote
        );
        assert_eq!(
            decide(&r, &arm("v2", 60, 0, 8), &idle, 20_000).verdict,
            Verdict::Rollback
        );
        assert_eq!(r.state, State::Running);
    }
}
