//! Admission (DESIGN.md, "Routing", step 1): global and per-identity limits on
//! streams in flight and a bounded wait queue. Past them a request is refused
//! at once with RESOURCE_EXHAUSTED and a retry hint; nothing waits without
//! bound, in count or in time.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Limits of the admission stage.
#[derive(Clone, Debug)]
pub struct AdmissionConfig {
    /// Streams in flight through this router.
    pub max_in_flight: usize,
    /// Streams in flight for one identity (client certificate name, or the
    /// peer address without TLS).
    pub max_in_flight_per_identity: usize,
    /// Requests that may wait for a global slot.
    pub max_queued: usize,
    /// Longest a queued request waits before it is refused.
    pub max_queue_wait: Duration,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Rejected {
    #[error("router overloaded: {in_flight} streams in flight and {queued} waiting (limits {max_in_flight} and {max_queued}); retry after {retry_after_ms} ms")]
    Global {
        in_flight: usize,
        queued: usize,
        max_in_flight: usize,
        max_queued: usize,
        retry_after_ms: u64,
    },
    #[error("identity {identity:?} has {limit} streams in flight, its limit; retry after {retry_after_ms} ms")]
    PerIdentity {
        identity: String,
        limit: usize,
        retry_after_ms: u64,
    },
    #[error("router overloaded: no slot within {waited_ms} ms; retry after {retry_after_ms} ms")]
    QueueTimeout { waited_ms: u64, retry_after_ms: u64 },
}

impl Rejected {
    /// Suggested client back-off.
    pub fn retry_after_ms(&self) -> u64 {
        match self {
            Rejected::Global { retry_after_ms, .. }
            | Rejected::PerIdentity { retry_after_ms, .. }
            | Rejected::QueueTimeout { retry_after_ms, .. } => *retry_after_ms,
        }
    }
}

/// The admission stage, shared by all requests of one router.
pub struct Admission {
    cfg: AdmissionConfig,
    slots: Arc<Semaphore>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    queued: usize,
    per_identity: HashMap<String, usize>,
}

/// Holds a request's slots until dropped (when its stream ends).
pub struct Permit {
    _slot: OwnedSemaphorePermit,
    identity: String,
    admission: Arc<Admission>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut st = self.admission.state.lock().expect("admission lock");
        if let Some(n) = st.per_identity.get_mut(&self.identity) {
            *n -= 1;
            if *n == 0 {
                st.per_identity.remove(&self.identity);
            }
        }
    }
}

/// Back-off hint: long enough for some streams to finish.
const RETRY_AFTER_MS: u64 = 1_000;

impl Admission {
    /// A stage with these limits.
    pub fn new(cfg: AdmissionConfig) -> Arc<Self> {
        Arc::new(Self {
            slots: Arc::new(Semaphore::new(cfg.max_in_flight.max(1))),
            cfg,
            state: Mutex::new(State::default()),
        })
    }

    /// Admits one request of `identity`, waiting at most `max_queue_wait` in a
    /// bounded queue for a global slot.
    pub async fn admit(self: &Arc<Self>, identity: &str) -> Result<Permit, Rejected> {
        {
            let mut st = self.state.lock().expect("admission lock");
            let mine = st.per_identity.get(identity).copied().unwrap_or(0);
            if mine >= self.cfg.max_in_flight_per_identity {
                return Err(Rejected::PerIdentity {
                    identity: identity.into(),
                    limit: self.cfg.max_in_flight_per_identity,
                    retry_after_ms: RETRY_AFTER_MS,
                });
            }
            *st.per_identity.entry(identity.into()).or_default() += 1;
        }
        // From here on the per-identity count is ours; give it back on failure.
        let release_identity = |s: &Self| {
            let mut st = s.state.lock().expect("admission lock");
            if let Some(n) = st.per_identity.get_mut(identity) {
                *n -= 1;
                if *n == 0 {
                    st.per_identity.remove(identity);
                }
            }
        };
        let slot = match self.slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                {
                    let mut st = self.state.lock().expect("admission lock");
                    if st.queued >= self.cfg.max_queued {
                        let queued = st.queued;
                        drop(st);
                        release_identity(self);
                        return Err(Rejected::Global {
                            in_flight: self.cfg.max_in_flight - self.slots.available_permits(),
                            queued,
                            max_in_flight: self.cfg.max_in_flight,
                            max_queued: self.cfg.max_queued,
                            retry_after_ms: RETRY_AFTER_MS,
                        });
                    }
                    st.queued += 1;
                }
                let waited = tokio::time::timeout(
                    self.cfg.max_queue_wait,
                    self.slots.clone().acquire_owned(),
                )
                .await;
                self.state.lock().expect("admission lock").queued -= 1;
                match waited {
                    Ok(Ok(slot)) => slot,
                    _ => {
                        release_identity(self);
                        return Err(Rejected::QueueTimeout {
                            waited_ms: self.cfg.max_queue_wait.as_millis() as u64,
                            retry_after_ms: RETRY_AFTER_MS,
                        });
                    }
                }
            }
        };
        Ok(Permit {
            _slot: slot,
            identity: identity.into(),
            admission: self.clone(),
        })
    }

    /// Streams in flight and requests waiting, for status and tests.
    pub fn load(&self) -> (usize, usize) {
        let st = self.state.lock().expect("admission lock");
        (
            self.cfg.max_in_flight - self.slots.available_permits(),
            st.queued,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(global: usize, per: usize, queue: usize) -> Arc<Admission> {
        Admission::new(AdmissionConfig {
            max_in_flight: global,
            max_in_flight_per_identity: per,
            max_queued: queue,
            max_queue_wait: Duration::from_secs(2),
        })
    }

    #[tokio::test]
    async fn per_identity_limit_refuses_at_once() {
        let a = admission(10, 2, 0);
        let _p1 = a.admit("alice").await.unwrap();
        let _p2 = a.admit("alice").await.unwrap();
        let err = a.admit("alice").await.err().unwrap();
        assert!(
            matches!(err, Rejected::PerIdentity { limit: 2, .. }),
            "{err}"
        );
        // Others are unaffected.
        let _p3 = a.admit("bob").await.unwrap();
    }

    #[tokio::test]
    async fn full_queue_refuses_at_once_and_slots_come_back() {
        let a = admission(1, 10, 1);
        let p1 = a.admit("a").await.unwrap();
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.admit("b").await.map(|_| ()) })
        };
        while a.load().1 == 0 {
            tokio::task::yield_now().await;
        }
        let err = a.admit("c").await.err().unwrap();
        assert!(matches!(err, Rejected::Global { .. }), "{err}");
        drop(p1);
        waiter.await.unwrap().unwrap();
        assert_eq!(a.load(), (0, 0));
        let _again = a.admit("c").await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn queued_request_waits_a_bounded_time() {
        let a = admission(1, 10, 5);
        let _p1 = a.admit("a").await.unwrap();
        let err = a.admit("b").await.err().unwrap();
        assert!(
            matches!(
                err,
                Rejected::QueueTimeout {
                    waited_ms: 2000,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(a.load(), (1, 0));
    }
}
