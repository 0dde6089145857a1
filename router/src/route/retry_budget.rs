//! The retry budget (DESIGN.md, "Routing", step 5): retries and failovers may
//! add only a bounded share to the load, so an outage of some workers cannot
//! multiply the traffic on the rest by the attempt limit.
//!
//! tower's [`TpsBudget`]: every request deposits, every call to a worker after
//! a request's first (a retry before the first token, or a failover after it)
//! withdraws; a share `ratio` of the recent requests, plus a floor of
//! `min_per_sec` for quiet periods, may be retried, counted over `ttl`. An
//! empty budget means no retry: the request fails with its last error.
//!
//! One budget per model version: retries and failovers stay within the
//! request's version, and a failing canary must not spend stable's budget.
use metrics::Counter;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::retry::budget::{Budget, TpsBudget};

/// The shape of every version's budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryBudgetConfig {
    /// Retries allowed per request deposited (0.2: one in five), 0..=1000.
    pub ratio: f32,
    /// Retries allowed per second regardless of traffic.
    pub min_per_sec: u32,
    /// How long a deposit counts, 1..=60 s.
    pub ttl: Duration,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            min_per_sec: 10,
            ttl: Duration::from_secs(10),
        }
    }
}

/// Why a request calls a worker again, as the `reason` label of
/// `llm_router_retries_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryReason {
    /// The previous worker refused the call before the first token.
    Refused,
    /// The previous worker's stream broke; the request fails over.
    StreamLost,
}

impl RetryReason {
    fn label(self) -> &'static str {
        match self {
            RetryReason::Refused => "refused",
            RetryReason::StreamLost => "stream_lost",
        }
    }
}

/// The budget of one model version, with its counters looked up once.
pub struct RetryBudget {
    budget: TpsBudget,
    model: String,
    version: String,
    refused: Counter,
    stream_lost: Counter,
    exhausted: Counter,
}

impl std::fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryBudget")
            .field("model", &self.model)
            .field("version", &self.version)
            .field("budget", &self.budget)
            .finish()
    }
}

impl RetryBudget {
    /// A budget for `model`/`version`.
    ///
    /// # Panics
    /// If `cfg` is outside the ranges [`RetryBudgetConfig`] documents (the
    /// flags are checked when parsed).
    pub fn new(cfg: RetryBudgetConfig, model: &str, version: &str) -> Self {
        let retries = |reason: RetryReason| metrics::counter!("llm_router_retries_total", "model" => model.to_string(), "version" => version.to_string(), "reason" => reason.label());
        Self {
            budget: TpsBudget::new(cfg.ttl, cfg.min_per_sec, cfg.ratio),
            refused: retries(RetryReason::Refused),
            stream_lost: retries(RetryReason::StreamLost),
            exhausted: metrics::counter!("llm_router_retry_budget_exhausted_total", "model" => model.to_string(), "version" => version.to_string()),
            model: model.into(),
            version: version.into(),
        }
    }

    /// One request arrived: it earns the version `ratio` retries.
    pub fn deposit(&self) {
        self.budget.deposit();
    }

    /// Takes one retry from the budget; false (and counted) when it is spent.
    pub fn withdraw(&self, reason: RetryReason) -> bool {
        if self.budget.withdraw() {
            match reason {
                RetryReason::Refused => &self.refused,
                RetryReason::StreamLost => &self.stream_lost,
            }
            .increment(1);
            true
        } else {
            self.exhausted.increment(1);
            false
        }
    }
}

/// Every version's budget, created on first use.
pub struct RetryBudgets {
    cfg: RetryBudgetConfig,
    budgets: Mutex<HashMap<(String, String), Arc<RetryBudget>>>,
}

impl RetryBudgets {
    /// Budgets shaped by `cfg`.
    pub fn new(cfg: RetryBudgetConfig) -> Self {
        Self {
            cfg,
            budgets: Mutex::new(HashMap::new()),
        }
    }

    /// The budget of `model`/`version`.
    pub fn get(&self, model: &str, version: &str) -> Arc<RetryBudget> {
        self.budgets
            .lock()
            .expect("retry budget lock")
            .entry((model.to_string(), version.to_string()))
            .or_insert_with(|| Arc::new(RetryBudget::new(self.cfg, model, version)))
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(ratio: f32, min_per_sec: u32) -> RetryBudget {
        let cfg = RetryBudgetConfig {
            ratio,
            min_per_sec,
            ttl: Duration::from_secs(10),
        };
        RetryBudget::new(cfg, "m", "v1")
    }

    fn withdrawals(b: &RetryBudget) -> usize {
        (0..1_000)
            .take_while(|_| b.withdraw(RetryReason::Refused))
            .count()
    }

    #[tokio::test(start_paused = true)]
    async fn a_share_of_the_requests_may_be_retried() {
        let b = budget(0.2, 0);
        assert_eq!(withdrawals(&b), 0, "nothing deposited, no floor");
        for _ in 0..10 {
            b.deposit();
        }
        assert_eq!(withdrawals(&b), 2, "one in five of ten requests");
    }

    #[tokio::test(start_paused = true)]
    async fn the_floor_allows_retries_without_traffic() {
        // 1 per second over a 10 s window.
        assert_eq!(withdrawals(&budget(0.2, 1)), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn zero_ratio_and_floor_allow_no_retry() {
        let b = budget(0.0, 0);
        for _ in 0..100 {
            b.deposit();
        }
        assert_eq!(withdrawals(&b), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn deposits_expire_after_the_ttl() {
        let b = budget(1.0, 0);
        for _ in 0..5 {
            b.deposit();
        }
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(withdrawals(&b), 0);
        b.deposit();
        assert_eq!(withdrawals(&b), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn each_version_has_its_own_budget() {
        let budgets = RetryBudgets::new(RetryBudgetConfig {
            ratio: 1.0,
            min_per_sec: 0,
            ttl: Duration::from_secs(10),
        });
        let canary = budgets.get("m", "v2");
        canary.deposit();
        assert_eq!(withdrawals(&canary), 1);
        let stable = budgets.get("m", "v1");
        stable.deposit();
        assert!(stable.withdraw(RetryReason::StreamLost));
        // The same budget comes back for the same version.
        budgets.get("m", "v2").deposit();
        assert_eq!(withdrawals(&canary), 1);
    }
}
