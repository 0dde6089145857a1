//! Exponential backoff with full jitter, for reconnect loops and for the
//! router's retries alike.
//!
//! Every replica that lost etcd at the same moment, or every request that
//! failed on the same worker, would otherwise come back in lockstep (200 ms,
//! 400 ms, … for all of them at once). With full jitter the n-th wait is drawn
//! uniformly in `[0, min(max, base * 2^(n-1))]`, which spreads them out.
use rand::Rng;
use std::time::Duration;
use tokio::sync::watch;

/// Doubling waits from `base` up to `max`, each drawn with full jitter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Ceiling of the first wait.
    pub base: Duration,
    /// Ceiling of any wait.
    pub max: Duration,
}

impl Backoff {
    /// The reconnect policy for etcd and other control-path peers: 200 ms
    /// doubling to 5 s.
    pub const RECONNECT: Backoff = Backoff {
        base: Duration::from_millis(200),
        max: Duration::from_secs(5),
    };

    /// The longest wait before the `n`-th retry (1 for the first).
    pub fn ceiling(&self, n: u32) -> Duration {
        let doublings = n.saturating_sub(1).min(30);
        self.base.saturating_mul(1 << doublings).min(self.max)
    }

    /// A wait before the `n`-th retry, drawn uniformly below the ceiling.
    pub fn delay(&self, n: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(n).as_micros() as u64;
        Duration::from_micros(rng.random_range(0..=ceiling))
    }

    /// A loop's successive waits under this policy.
    pub fn retries(self) -> Retries {
        Retries {
            backoff: self,
            failures: 0,
        }
    }
}

/// The state of one retry loop: how many times in a row it failed.
#[derive(Clone, Debug)]
pub struct Retries {
    backoff: Backoff,
    failures: u32,
}

impl Retries {
    /// The wait after one more failure.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.backoff.delay(self.failures, &mut rand::rng())
    }

    /// Back to the first step, after a success.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Sleeps for the next delay; false if `shutdown` turned true (or its
    /// sender went away) first.
    pub async fn wait(&mut self, shutdown: &mut watch::Receiver<bool>) -> bool {
        let sleep = tokio::time::sleep(self.next_delay());
        tokio::pin!(sleep);
        loop {
            if *shutdown.borrow_and_update() {
                return false;
            }
            tokio::select! {
                _ = &mut sleep => return true,
                changed = shutdown.changed() => if changed.is_err() {
                    return false;
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn ceilings_double_up_to_the_cap() {
        let b = Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(50),
        };
        let ceilings: Vec<u64> = (1..=5).map(|n| b.ceiling(n).as_millis() as u64).collect();
        assert_eq!(ceilings, [10, 20, 40, 50, 50]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_millis(50));
    }

    #[test]
    fn full_jitter_spreads_over_the_whole_range() {
        let b = Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(50),
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let delays: Vec<Duration> = (0..1_000).map(|_| b.delay(3, &mut rng)).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(40)));
        assert!(delays.iter().any(|d| *d < Duration::from_millis(5)));
        assert!(delays.iter().any(|d| *d > Duration::from_millis(35)));
    }

    #[test]
    fn zero_backoff_never_waits() {
        let b = Backoff {
            base: Duration::ZERO,
            max: Duration::from_secs(1),
        };
        assert_eq!(b.delay(4, &mut rand::rng()), Duration::ZERO);
    }

    #[test]
    fn retries_grow_and_reset() {
        let mut r = Backoff::RECONNECT.retries();
        for _ in 0..10 {
            assert!(r.next_delay() <= Duration::from_secs(5));
        }
        r.reset();
        assert!(r.next_delay() <= Duration::from_millis(200));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_returns_false_on_shutdown() {
        let (tx, mut rx) = watch::channel(false);
        let mut r = Backoff {
            base: Duration::from_secs(10),
            max: Duration::from_secs(10),
        }
        .retries();
        let waiter = tokio::spawn(async move { r.wait(&mut rx).await });
        tokio::task::yield_now().await;
        tx.send(true).unwrap();
        assert!(!waiter.await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn wait_sleeps_when_not_shut_down() {
        let (_tx, mut rx) = watch::channel(false);
        let mut r = Backoff::RECONNECT.retries();
        assert!(r.wait(&mut rx).await);
    }
}
