//! The cache-aware decision, pure: which worker a request goes to, from the
//! conversation's rendezvous worker, the worker (if any) the index says
//! holds more of this conversation, and the load of the eligible workers.
//!
//! 1. The conversation's own worker is the one rendezvous
//!    (highest-random-weight) hashing of the conversation key ranks first
//!    among the eligible workers. Every router computes the same ranking
//!    from the same key and worker ids, so replicas agree without talking,
//!    and each one's index, learning from its own choices, then agrees too.
//! 2. Another worker (the rival) is preferred only when this router's index
//!    says it holds strictly more of the prompt than the rendezvous worker,
//!    and holds this conversation: its match covers the conversation key
//!    (through the first user message). A shorter match may be only what
//!    many conversations share (a system prompt), which is soon on every
//!    worker and no reason to leave the conversation's own; following it
//!    would also let two routers that saw different traffic disagree.
//!    This is how a failover continuation, or a conversation the load guard
//!    moved, keeps its cache.
//! 3. Load guard, two bounds: the preferred worker is overloaded when its
//!    load exceeds the least loaded eligible worker's by more than the
//!    margin (the absolute guard), or when one more stream would
//!    take it past `factor` times the mean load, rounded up (consistent
//!    hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018,
//!    as HAProxy and Vimeo run it, there with factor 1.25; the router's
//!    default is 1.0, which measured better on the multi-turn chat
//!    workload, BENCHMARKS.md). The first catches a
//!    hot worker under heavy load, the second the imbalance of a few
//!    conversations hashed onto a few workers (8 conversations on 4 workers
//!    put 4 or more, twice the mean, on one 45 % of the time), which no absolute
//!    margin catches at one stream per conversation. Then load wins: power
//!    of two choices over all eligible workers (Dynamo, SGLang and Ray all
//!    found that pure affinity overloads a worker).
use std::fmt::Write;

/// A worker the decision weighs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Contender {
    /// Live load (streams in flight from this router + reported queue).
    pub load: u32,
    /// Leading prompt chunks the index says it holds.
    pub matched: usize,
}

/// The eligible workers taken together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// How many there are.
    pub eligible: usize,
    /// The least load among them.
    pub least: u32,
    /// Their loads summed.
    pub total: u64,
}

impl Field {
    /// No worker yet.
    pub const EMPTY: Field = Field {
        eligible: 0,
        least: u32::MAX,
        total: 0,
    };

    /// Counts one more worker, at `load`.
    pub fn add(&mut self, load: u32) {
        self.eligible += 1;
        self.least = self.least.min(load);
        self.total += u64::from(load);
    }
}

/// The load guard's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Guard {
    /// Streams by which the preferred worker may exceed the least loaded.
    pub margin: u32,
    /// Most load as a multiple of the mean (at least 1); 0 turns the bound
    /// off.
    pub factor: f64,
}

/// Why the preferred worker was preferred.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The rendezvous worker, holding as much as any other.
    Rendezvous,
    /// The rival, holding more of this conversation.
    LongestPrefix,
}

/// Which bound the preferred worker broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overload {
    /// Its load exceeds the least loaded's by more than the margin.
    Margin,
    /// One more stream would take it past the bound on the mean.
    Bound {
        /// The most streams a worker may have now.
        cap: u32,
    },
}

/// The outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The rival is the preferred worker (else the rendezvous worker).
    pub rival: bool,
    pub why: Why,
    /// Set when load wins: the caller then picks by power of two choices.
    pub overload: Option<Overload>,
}

/// The most streams a worker may hold, one more included, when `total` are
/// spread over `eligible` workers: ceil(factor × (total + 1) / eligible).
pub fn cap(total: u64, eligible: usize, factor: f64) -> u32 {
    let mean = (total + 1) as f64 / eligible.max(1) as f64;
    (factor * mean).ceil().min(u32::MAX as f64) as u32
}

/// Decides between the rendezvous worker and the rival that holds the most
/// of the prompt (if any), `key_chunks` being the match that shows a worker
/// holds this conversation.
pub fn decide(
    rendezvous: Contender,
    rival: Option<Contender>,
    key_chunks: usize,
    field: Field,
    guard: Guard,
) -> Decision {
    let (preferred, is_rival, why) = match rival {
        Some(r) if r.matched > rendezvous.matched && r.matched >= key_chunks => {
            (r, true, Why::LongestPrefix)
        }
        _ => (rendezvous, false, Why::Rendezvous),
    };
    let overload = if field.eligible < 2 {
        None
    } else if preferred.load > field.least.saturating_add(guard.margin) {
        Some(Overload::Margin)
    } else if guard.factor > 0.0 {
        let cap = cap(field.total, field.eligible, guard.factor);
        (preferred.load.saturating_add(1) > cap).then_some(Overload::Bound { cap })
    } else {
        None
    };
    Decision {
        rival: is_rival,
        why,
        overload,
    }
}

/// The decision as the `route` span's `reason` says it: `preferred` names
/// the preferred worker, `cached` its estimated cached tokens, `load` its
/// load.
pub fn explain(d: &Decision, preferred: &str, cached: u64, load: u32, guard: Guard) -> String {
    let mut out = String::new();
    let _ = match (d.overload, d.why) {
        (None, Why::Rendezvous) => write!(
            out,
            "cache-aware: the conversation's rendezvous worker, est. {cached} cached tokens, as many as any"
        ),
        (None, Why::LongestPrefix) => write!(
            out,
            "cache-aware: longest cached prefix, est. {cached} tokens, beyond the rendezvous worker's"
        ),
        (Some(Overload::Margin), _) => write!(
            out,
            "load guard: {preferred} (est. {cached} cached tokens) at load {load} exceeds the least loaded by more than {}; lower load of two random ready workers",
            guard.margin
        ),
        (Some(Overload::Bound { cap }), _) => write!(
            out,
            "load guard: {preferred} (est. {cached} cached tokens) at load {load} would pass {cap}, {:.2} times the mean load; lower load of two random ready workers",
            guard.factor
        ),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(load: u32, matched: usize) -> Contender {
        Contender { load, matched }
    }

    fn field(eligible: usize, least: u32, total: u64) -> Field {
        Field {
            eligible,
            least,
            total,
        }
    }

    const MARGIN_ONLY: Guard = Guard {
        margin: 2,
        factor: 0.0,
    };

    #[test]
    fn with_no_match_or_only_a_shared_prefix_the_rendezvous_worker_wins() {
        let idle = field(3, 0, 0);
        let d = decide(c(0, 0), None, 1, idle, MARGIN_ONLY);
        assert_eq!((d.rival, d.why, d.overload), (false, Why::Rendezvous, None));
        // The rival holds the system prompt (3 chunks), short of the
        // conversation's key (4), the rendezvous worker nothing yet: the
        // conversation still goes to its own worker.
        assert!(!decide(c(0, 0), Some(c(0, 3)), 4, idle, MARGIN_ONLY).rival);
        // With the key covered, it is this conversation: the rival wins.
        let d = decide(c(0, 0), Some(c(0, 3)), 3, idle, MARGIN_ONLY);
        assert_eq!((d.rival, d.why), (true, Why::LongestPrefix));
        // Holding as much as the rendezvous worker is no reason to leave it.
        assert!(!decide(c(0, 4), Some(c(1, 4)), 4, idle, MARGIN_ONLY).rival);
    }

    #[test]
    fn past_the_margin_load_wins_and_within_it_the_cache_does() {
        // Preferred at load 3, least 1: within a margin of 2.
        let f = field(3, 1, 6);
        assert_eq!(decide(c(3, 9), None, 0, f, MARGIN_ONLY).overload, None);
        // At load 4 it is past it.
        let d = decide(c(4, 9), None, 0, field(3, 1, 7), MARGIN_ONLY);
        assert_eq!(d.overload, Some(Overload::Margin));
        // The rival is guarded alike.
        let d = decide(c(0, 1), Some(c(4, 9)), 0, field(3, 0, 4), MARGIN_ONLY);
        assert_eq!((d.rival, d.overload), (true, Some(Overload::Margin)));
        // A margin of zero: any imbalance moves it.
        let zero = Guard {
            margin: 0,
            factor: 0.0,
        };
        assert_eq!(
            decide(c(1, 9), None, 0, field(2, 1, 2), zero).overload,
            None
        );
        assert!(decide(c(2, 9), None, 0, field(2, 1, 3), zero)
            .overload
            .is_some());
        // Alone, a worker is taken whatever its load.
        assert_eq!(
            decide(c(1_000, 0), None, 0, field(1, 1_000, 1_000), zero).overload,
            None
        );
    }

    #[test]
    fn the_bound_on_the_mean_caps_a_worker_where_the_margin_does_not() {
        let guard = Guard {
            margin: 4,
            factor: 1.25,
        };
        // 8 streams on 4 workers, one new: the cap is ceil(1.25 × 9 / 4) = 3.
        assert_eq!(cap(8, 4, 1.25), 3);
        assert_eq!(cap(0, 4, 1.25), 1);
        assert_eq!(cap(3, 1, 1.0), 4);
        // A worker at 2 may take a third; at 3, within the margin of the
        // least loaded (0), it may not take a fourth.
        assert_eq!(
            decide(c(2, 5), None, 0, field(4, 1, 8), guard).overload,
            None
        );
        let d = decide(c(3, 5), None, 0, field(4, 0, 8), guard);
        assert_eq!(d.overload, Some(Overload::Bound { cap: 3 }));
        // An idle mesh: the first stream goes anywhere.
        assert_eq!(
            decide(c(0, 5), None, 0, field(4, 0, 0), guard).overload,
            None
        );
        // Factor 0 turns the bound off.
        let off = Guard {
            factor: 0.0,
            ..guard
        };
        assert_eq!(decide(c(3, 5), None, 0, field(4, 0, 8), off).overload, None);
        // Huge totals do not overflow.
        assert_eq!(cap(u64::MAX - 1, 1, 2.0), u32::MAX);
    }

    #[test]
    fn the_reason_names_the_rule_and_the_numbers() {
        let guard = Guard {
            margin: 2,
            factor: 1.25,
        };
        let d = Decision {
            rival: false,
            why: Why::Rendezvous,
            overload: Some(Overload::Margin),
        };
        let r = explain(&d, "a", 480, 9, guard);
        assert!(
            r.starts_with("load guard: a (est. 480 cached tokens) at load 9 exceeds"),
            "{r}"
        );
        let d = Decision {
            overload: Some(Overload::Bound { cap: 3 }),
            ..d
        };
        assert!(explain(&d, "a", 480, 3, guard).contains("would pass 3, 1.25 times the mean"));
        let d = Decision {
            rival: true,
            why: Why::LongestPrefix,
            overload: None,
        };
        assert!(explain(&d, "b", 480, 1, guard).contains("480 tokens"));
    }
}
