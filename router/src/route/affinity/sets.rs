//! What the cache-aware choice keeps per candidate set, so that a decision
//! over 1,000 workers touches a few of them rather than every one
//! (issue 19: under 10 µs p99 at 1,000 workers).
//!
//! A candidate set is one version's endpoints as the registry's view shares
//! them (`Arc<[Arc<Endpoint>]>`, rebuilt only when the worker set changes).
//! Per set this keeps:
//! - the workers' id hashes, in the set's order, in one compact array: the
//!   rendezvous top over it is a vector loop ([`super::top`]) of a fraction
//!   of a nanosecond per worker, against a cache miss or two per `Endpoint`
//!   (a large heap struct whose atomics and id hash lie on different cache
//!   lines);
//! - whether the set is sorted by id (the view is), so that a rival named
//!   by the prefix index is found among the candidates by binary search;
//! - a snapshot of the field statistics (eligible count, least and total
//!   load), refreshed by a linear pass at most every `max_age` (1 ms by
//!   default), the way HAProxy's bounded-load consistent hashing reads a
//!   running total rather than scanning the servers per request.
//!
//! The snapshot's staleness is harmless: in `max_age` the total moves by the
//! streams started or ended meanwhile (Δ), so the bound on the mean,
//! ceil(factor × (total + 1) / N), moves by factor × Δ / N, a fraction of a
//! stream at any rate a router sustains in a millisecond over a large set;
//! the least load moves by at most Δ; the eligible count by the workers that
//! turned ready or unready (P2C and the preferred worker's own readiness are
//! read live, so a worker that just went unready is never chosen for it).
//! Streams this router starts within the window make the stale total lower
//! than the live one, so the bound errs on the strict side (load wins
//! sooner), never letting the preferred worker take more than it would with
//! a live total plus Δ / N. The preferred worker's own load is always live.
//!
//! Sets are held by `Weak`: a set no view holds any more drops its endpoints
//! at once (a removed worker's poller stops with its last `Arc`), while the
//! allocation's address, the cache key, cannot be reused as long as the
//! entry holds the `Weak`. At most `capacity` sets are kept, least recently
//! used first out, dead ones dropped on every miss.
use super::decide::Field;
use super::rendezvous_weight;
use crate::registry::Endpoint;
use crate::route::candidates::Candidates;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio::time::Instant;

/// What is kept for one candidate set.
pub struct CandidateSet {
    /// The set itself, only to tell whether a slice is this one.
    set: Weak<[Arc<Endpoint>]>,
    /// `id_hash` of each endpoint, in the set's order.
    hashes: Box<[u64]>,
    /// The set is sorted by id, ids unique (the registry's view is).
    sorted: bool,
    /// Field snapshots: [any worker, token-id capable workers only].
    snapshots: Mutex<[Option<Snapshot>; 2]>,
}

/// The field statistics of a set at one instant.
#[derive(Clone, Copy, Debug)]
struct Snapshot {
    at: Instant,
    field: Field,
}

impl CandidateSet {
    fn new(set: &Arc<[Arc<Endpoint>]>) -> Self {
        Self {
            set: Arc::downgrade(set),
            hashes: set.iter().map(|e| e.id_hash).collect(),
            sorted: set.windows(2).all(|w| w[0].id < w[1].id),
            snapshots: Mutex::new([None, None]),
        }
    }

    fn is(&self, set: &Arc<[Arc<Endpoint>]>) -> bool {
        self.set.as_ptr().cast::<()>() == Arc::as_ptr(set).cast::<()>()
            && self.hashes.len() == set.len()
    }

    /// The index in `set` (the set this was built from) of the worker that
    /// rendezvous hashing ranks first for `key` among all of them, eligible
    /// or not; ties (of 64-bit weights) go to the smaller id, as in the full
    /// pass. None for an empty set.
    pub fn top(&self, set: &[Arc<Endpoint>], key: u64) -> Option<usize> {
        if self.sorted {
            // In id order the first of equal weights has the smaller id.
            return super::top::first_max(&self.hashes, key).map(|(i, _)| i);
        }
        let (&first, rest) = self.hashes.split_first()?;
        let (mut best_w, mut best) = (rendezvous_weight(first, key), 0);
        for (i, &h) in rest.iter().enumerate() {
            let w = rendezvous_weight(h, key);
            if w > best_w || (w == best_w && set[i + 1].id < set[best].id) {
                (best_w, best) = (w, i + 1);
            }
        }
        Some(best)
    }

    /// The field of the workers of `c` that are ready and offer what it
    /// needs (`c.exclude` is not read), as of at most `max_age` ago;
    /// refreshed by a linear pass when older.
    pub fn field(&self, c: &Candidates, now: Instant, max_age: Duration) -> Field {
        let slot = usize::from(c.token_ids);
        if let Some(s) = self.lock()[slot] {
            if now.saturating_duration_since(s.at) <= max_age {
                return s.field;
            }
        }
        let mut field = Field::EMPTY;
        for e in c.endpoints.iter() {
            if c.offers(e) && e.ready() {
                field.add(e.load());
            }
        }
        self.lock()[slot] = Some(Snapshot { at: now, field });
        field
    }

    /// Whether `ep` is one of `set` (the set this was built from): a binary
    /// search by id when it is sorted, then pointer equality (a worker
    /// re-registered under the same id is another endpoint).
    pub fn contains(&self, set: &[Arc<Endpoint>], ep: &Arc<Endpoint>) -> bool {
        if self.sorted {
            set.binary_search_by(|e| e.id.as_str().cmp(&ep.id))
                .is_ok_and(|i| Arc::ptr_eq(&set[i], ep))
        } else {
            set.iter().any(|e| Arc::ptr_eq(e, ep))
        }
    }

    fn lock(&self) -> MutexGuard<'_, [Option<Snapshot>; 2]> {
        self.snapshots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The candidate sets of one router, most recently used first.
pub struct CandidateSets {
    sets: Mutex<Vec<Arc<CandidateSet>>>,
    capacity: usize,
}

impl CandidateSets {
    /// At most `capacity` sets (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            sets: Mutex::new(Vec::new()),
            capacity: capacity.max(1),
        }
    }

    /// What is kept for `set`, built now (a linear pass) if it is new.
    pub fn get(&self, set: &Arc<[Arc<Endpoint>]>) -> Arc<CandidateSet> {
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = sets.iter().position(|s| s.is(set)) {
            if i > 0 {
                sets[..=i].rotate_right(1);
            }
            return sets[0].clone();
        }
        sets.retain(|s| s.set.strong_count() > 0);
        sets.truncate(self.capacity - 1);
        let built = Arc::new(CandidateSet::new(set));
        sets.insert(0, built.clone());
        built
    }

    /// Sets kept now.
    pub fn len(&self) -> usize {
        self.sets.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
