//! Exponential backoff with jitter for reconnect loops.
//!
//! Every replica that lost etcd at the same moment would otherwise retry in
//! lockstep (200 ms, 400 ms, … for all of them at once); "equal jitter" keeps
//! half of each delay and draws the other half at random, so retries spread
//! out while a delay never collapses to nothing.
use rand::Rng;
use std::time::Duration;
use tokio::sync::watch;

/// Doubling delays from `base` up to `max`, each with jitter.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    /// Delays from `base`, doubling up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        let max = max.max(base);
        Self {
            base,
            max,
            current: base,
        }
    }

    /// The reconnect policy for etcd and other control-path peers: 200 ms
    /// doubling to 5 s.
    pub fn reconnect() -> Self {
        Self::new(Duration::from_millis(200), Duration::from_secs(5))
    }

    /// The next delay (between half and all of the current step), and the
    /// step doubles.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.current;
        self.current = (self.current * 2).min(self.max);
        let half = step / 2;
        let jitter = rand::rng().random_range(0..=half.as_micros() as u64);
        half + Duration::from_micros(jitter)
    }

    /// Back to the first step, after a success.
    pub fn reset(&mut self) {
        self.current = self.base;
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

    #[test]
    fn delays_double_with_jitter_and_cap() {
        let mut b = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        let steps = [200u64, 400, 800, 1600, 3200, 5000, 5000];
        for step in steps {
            let d = b.next_delay();
            let step = Duration::from_millis(step);
            assert!(
                d >= step / 2 && d <= step,
                "{d:?} outside [{:?}, {step:?}]",
                step / 2
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(200));
    }

    #[test]
    fn replicas_do_not_retry_in_lockstep() {
        let delays: std::collections::HashSet<Duration> = (0..16)
            .map(|_| Backoff::new(Duration::from_secs(1), Duration::from_secs(5)).next_delay())
            .collect();
        assert!(delays.len() > 1, "16 replicas drew the same delay");
    }

    #[tokio::test(start_paused = true)]
    async fn wait_returns_false_on_shutdown() {
        let (tx, mut rx) = watch::channel(false);
        let mut b = Backoff::new(Duration::from_secs(10), Duration::from_secs(10));
        let waiter = tokio::spawn(async move { b.wait(&mut rx).await });
        tokio::task::yield_now().await;
        tx.send(true).unwrap();
        assert!(!waiter.await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn wait_sleeps_when_not_shut_down() {
        let (_tx, mut rx) = watch::channel(false);
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(100));
        let start = tokio::time::Instant::now();
        assert!(b.wait(&mut rx).await);
        assert!(start.elapsed() >= Duration::from_millis(50));
    }
}
