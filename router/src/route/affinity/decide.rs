//! The cache-aware decision, pure: which of the eligible workers a request
//! goes to, from each one's load, the prompt prefix it is estimated to
//! hold, and the conversation's rendezvous ranking.
//!
//! 1. The conversation's own worker is the one rendezvous
//!    (highest-random-weight) hashing of the conversation key ranks first
//!    among the eligible workers. Every router computes the same ranking
//!    from the same key and worker ids, so replicas agree without talking,
//!    and each one's index, learning from its own choices, then agrees too.
//! 2. Another worker is preferred only when this router's index says it
//!    holds strictly more of the prompt than the rendezvous worker, and
//!    holds this conversation: its match covers the conversation key
//!    (through the first user message). A shorter match may be only what
//!    many conversations share (a system prompt), which is soon on every
//!    worker and no reason to leave the conversation's own; following it
//!    would also let two routers that saw different traffic disagree.
//!    Among the longest holders, rendezvous rank breaks the tie. This is
//!    how a failover continuation, or a conversation the load guard moved,
//!    keeps its cache.
//! 3. Load guard: if the preferred worker's load exceeds the least loaded
//!    eligible worker's by more than the margin, load wins: power of two
//!    choices over all eligible workers (Dynamo, SGLang and Ray all found
//!    that pure affinity overloads a worker).
use std::fmt::Write;

/// One eligible worker, as the decision sees it.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    /// Live load (streams in flight from this router + reported queue).
    pub load: u32,
    /// Leading prompt chunks the index says it holds.
    pub matched: usize,
    /// Its rendezvous weight for the conversation (higher ranks first).
    pub weight: u64,
}

/// Why a worker was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The rendezvous worker, holding as much as any other.
    Rendezvous,
    /// Another worker holding more of this conversation.
    LongestPrefix,
    /// The preferred one (the index) was overloaded: lower load of two random.
    LoadGuard {
        /// The candidate that would have been chosen.
        preferred: usize,
    },
}

/// The outcome: an index into the candidates, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub chosen: usize,
    pub why: Why,
}

/// Decides among `candidates` (not empty): `key_chunks` is the match that
/// shows a worker holds this conversation, `margin` the load guard's, and
/// `draw` picks two distinct random indices below its argument for the
/// fallback.
pub fn decide(
    candidates: &[Candidate],
    key_chunks: usize,
    margin: u32,
    draw: impl FnOnce(usize) -> (usize, usize),
) -> Decision {
    debug_assert!(!candidates.is_empty());
    let rank = |i: usize| (candidates[i].matched, candidates[i].weight);
    let rendezvous = (0..candidates.len())
        .max_by_key(|&i| candidates[i].weight)
        .unwrap_or(0);
    let longest = (0..candidates.len()).max_by_key(|&i| rank(i)).unwrap_or(0);
    let best = candidates[longest].matched;
    let (preferred, why) = if best > candidates[rendezvous].matched && best >= key_chunks {
        (longest, Why::LongestPrefix)
    } else {
        (rendezvous, Why::Rendezvous)
    };
    let least = candidates.iter().map(|c| c.load).min().unwrap_or(0);
    if candidates.len() > 1 && candidates[preferred].load > least.saturating_add(margin) {
        let (a, b) = draw(candidates.len());
        let chosen = if candidates[b].load < candidates[a].load {
            b
        } else {
            a
        };
        return Decision {
            chosen,
            why: Why::LoadGuard { preferred },
        };
    }
    Decision {
        chosen: preferred,
        why,
    }
}

/// The decision as the `route` span's `reason` says it; `ids` names the
/// candidates, `cached` their estimated cached tokens.
pub fn explain(d: &Decision, ids: &[&str], cached: &[u64], loads: &[u32], margin: u32) -> String {
    let mut out = String::new();
    let _ = match d.why {
        Why::Rendezvous => write!(
            out,
            "cache-aware: the conversation's rendezvous worker, est. {} cached tokens, as many as any",
            cached[d.chosen]
        ),
        Why::LongestPrefix => write!(
            out,
            "cache-aware: longest cached prefix, est. {} tokens, beyond the rendezvous worker's",
            cached[d.chosen]
        ),
        Why::LoadGuard { preferred } => write!(
            out,
            "load guard: {} (est. {} cached tokens) at load {} exceeds the least loaded by more than {margin}; lower load of two random ready workers",
            ids[preferred], cached[preferred], loads[preferred]
        ),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(load: u32, matched: usize, weight: u64) -> Candidate {
        Candidate {
            load,
            matched,
            weight,
        }
    }

    fn never(_: usize) -> (usize, usize) {
        panic!("the load guard must not fire")
    }

    #[test]
    fn with_no_match_or_only_a_shared_prefix_the_rendezvous_worker_wins() {
        let none = [c(0, 0, 5), c(0, 0, 9), c(0, 0, 1)];
        let d = decide(&none, 1, 2, never);
        assert_eq!((d.chosen, d.why), (1, Why::Rendezvous));
        // Another worker holds the system prompt (3 chunks), short of the
        // conversation's key (4), the rendezvous worker nothing yet: the
        // conversation still goes to its own worker.
        let shared = [c(0, 3, 5), c(0, 0, 9), c(0, 3, 1)];
        assert_eq!(decide(&shared, 4, 2, never).chosen, 1);
        // With the key covered, it is this conversation: that worker wins.
        assert_eq!(decide(&shared, 3, 2, never).why, Why::LongestPrefix);
    }

    #[test]
    fn a_worker_holding_more_of_the_conversation_wins_ties_by_rank() {
        let more = [c(0, 7, 5), c(1, 4, 9), c(0, 7, 6)];
        let d = decide(&more, 4, 2, never);
        assert_eq!((d.chosen, d.why), (2, Why::LongestPrefix));
        // Holding as much as the rendezvous worker is no reason to leave it.
        let equal = [c(0, 4, 5), c(1, 4, 9)];
        assert_eq!(decide(&equal, 4, 2, never).why, Why::Rendezvous);
    }

    #[test]
    fn past_the_margin_load_wins_and_within_it_the_cache_does() {
        // Preferred at load 3, least 1: within a margin of 2.
        let within = [c(3, 9, 9), c(1, 0, 1), c(2, 0, 2)];
        assert_eq!(decide(&within, 0, 2, never).chosen, 0);
        // At load 4 it is past it: of the two drawn, the less loaded.
        let past = [c(4, 9, 9), c(1, 0, 1), c(2, 0, 2)];
        let d = decide(&past, 0, 2, |n| {
            assert_eq!(n, 3);
            (0, 2)
        });
        assert_eq!((d.chosen, d.why), (2, Why::LoadGuard { preferred: 0 }));
        let d = decide(&past, 0, 2, |_| (1, 0));
        assert_eq!(d.chosen, 1);
        // A margin of zero: any imbalance moves it.
        let tie = [c(1, 9, 9), c(1, 0, 1)];
        assert_eq!(decide(&tie, 0, 0, never).chosen, 0);
        assert!(matches!(
            decide(&[c(2, 9, 9), c(1, 0, 1)], 0, 0, |_| (0, 1)).why,
            Why::LoadGuard { .. }
        ));
        // Alone, a worker is taken whatever its load.
        assert_eq!(decide(&[c(1_000, 0, 1)], 0, 0, never).chosen, 0);
    }

    #[test]
    fn the_reason_names_the_rule_and_the_numbers() {
        let ids = ["a", "b"];
        let d = Decision {
            chosen: 1,
            why: Why::LoadGuard { preferred: 0 },
        };
        let r = explain(&d, &ids, &[480, 0], &[9, 1], 2);
        assert!(
            r.starts_with("load guard: a (est. 480 cached tokens) at load 9"),
            "{r}"
        );
        let d = Decision {
            chosen: 0,
            why: Why::LongestPrefix,
        };
        assert!(explain(&d, &ids, &[480, 0], &[9, 1], 2).contains("480 tokens"));
    }
}
