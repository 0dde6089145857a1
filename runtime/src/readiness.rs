//! Whether a server is ready to serve, and if not, why: one signal that drives
//! both `grpc.health` (SERVING / NOT_SERVING) and the plaintext `/readyz`
//! probe, so the two can never disagree.
//!
//! Readiness is a set of named conditions that hold it back ("model": loading
//! the model, "drain": draining, ...); the server is ready when none is set.
//! Each part of a process sets and clears its own condition without knowing
//! the others, so a worker that re-registers in etcd while it drains stays
//! not ready.
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;

/// The conditions holding a server back, by name, with their reasons.
type Conditions = BTreeMap<&'static str, String>;

/// A cloneable handle on one server's readiness.
#[derive(Clone, Debug)]
pub struct Readiness {
    conditions: Arc<watch::Sender<Conditions>>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self {
            conditions: Arc::new(watch::channel(Conditions::new()).0),
        }
    }
}

impl Readiness {
    /// A server that is ready until a condition is set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Holds the server back for `condition`, saying why; replaces the reason
    /// if it is already set.
    pub fn not_ready(&self, condition: &'static str, reason: impl Into<String>) {
        let reason = reason.into();
        self.conditions.send_if_modified(|c| {
            if c.get(condition) == Some(&reason) {
                return false;
            }
            c.insert(condition, reason);
            true
        });
    }

    /// `condition` no longer holds the server back.
    pub fn ready(&self, condition: &'static str) {
        self.conditions
            .send_if_modified(|c| c.remove(condition).is_some());
    }

    /// Sets `condition` from a result: cleared when `Ok`, set to the error
    /// when `Err`.
    pub fn set(&self, condition: &'static str, state: Result<(), String>) {
        match state {
            Ok(()) => self.ready(condition),
            Err(reason) => self.not_ready(condition, reason),
        }
    }

    /// Ok when ready; otherwise every reason, `; `-separated.
    pub fn check(&self) -> Result<(), String> {
        reasons(&self.conditions.borrow())
    }

    /// Follows changes: [`Readiness::check`]'s value now and after each change.
    pub fn subscribe(&self) -> ReadinessWatch {
        ReadinessWatch {
            rx: self.conditions.subscribe(),
        }
    }
}

/// A subscription to a [`Readiness`].
pub struct ReadinessWatch {
    rx: watch::Receiver<Conditions>,
}

impl ReadinessWatch {
    /// The state now, marking it seen.
    pub fn current(&mut self) -> Result<(), String> {
        reasons(&self.rx.borrow_and_update())
    }

    /// Waits for the next change; false once the readiness is gone.
    pub async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }
}

fn reasons(c: &Conditions) -> Result<(), String> {
    if c.is_empty() {
        return Ok(());
    }
    Err(c.values().cloned().collect::<Vec<_>>().join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_no_condition_holds_it_back() {
        let r = Readiness::new();
        assert_eq!(r.check(), Ok(()));
        r.not_ready("model", "loading the model");
        r.not_ready("drain", "draining");
        assert_eq!(r.check(), Err("draining; loading the model".into()));
        r.ready("model");
        assert_eq!(r.check(), Err("draining".into()));
        // Another part clearing its own condition does not lift the drain.
        r.set("etcd", Ok(()));
        assert_eq!(r.check(), Err("draining".into()));
        r.set("drain", Ok(()));
        assert_eq!(r.check(), Ok(()));
    }

    #[tokio::test]
    async fn a_watch_sees_each_change_but_not_repeats() {
        let r = Readiness::new();
        let mut w = r.subscribe();
        assert_eq!(w.current(), Ok(()));
        r.not_ready("etcd", "etcd is unreachable");
        assert!(w.changed().await);
        assert_eq!(w.current(), Err("etcd is unreachable".into()));
        // The same reason again is no change.
        r.not_ready("etcd", "etcd is unreachable");
        r.ready("etcd");
        assert!(w.changed().await);
        assert_eq!(w.current(), Ok(()));
    }
}
