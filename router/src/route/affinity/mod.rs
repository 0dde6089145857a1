//! Cache-aware worker choice (DESIGN.md, "Routing", step 3, issue 17): a
//! request goes to the worker estimated to hold the longest part of its
//! prompt in its KV cache, unless that worker is overloaded.
//!
//! - [`digest`]: the prompt as chained hashes of fixed-size byte chunks (no
//!   tokenizing in the router) and the conversation's key;
//! - [`index`]: this router's bounded index of which worker it sent which
//!   chunks to;
//! - [`decide`]: the pure decision (rendezvous worker, longest prefix, load
//!   guard).
//!
//! Estimated cached tokens are matched bytes times a tokens-per-byte ratio
//! learned per model from finished requests (prompt tokens / prompt bytes),
//! starting from [`INITIAL_TOKENS_PER_BYTE`]. With `--worker-choice p2c`
//! nothing is hashed or recorded and the choice is [`super::p2c`]'s.
pub mod decide;
pub mod digest;
pub mod index;

use super::p2c;
use crate::registry::Endpoint;
use decide::{Candidate, Decision};
use digest::{PromptDigest, CHUNK_BYTES};
use index::PrefixIndex;
use rand::seq::index::sample;
use rand::Rng;
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tokenmesh_proto::v1::GenerateRequest;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// How a worker of the chosen version is picked (`--worker-choice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WorkerChoice {
    /// The worker holding the longest prefix of the prompt, by conversation
    /// affinity, unless its load is past the margin.
    #[default]
    CacheAware,
    /// Power of two choices on live load alone.
    P2c,
}

/// Settings of the worker choice (from the router's flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffinitySettings {
    pub choice: WorkerChoice,
    /// Streams by which the preferred worker's load may exceed the least
    /// loaded one's before load wins.
    pub load_margin: u32,
    /// Most (chunk, worker) pairs the index holds.
    pub index_pairs: usize,
}

impl Default for AffinitySettings {
    fn default() -> Self {
        Self {
            choice: WorkerChoice::CacheAware,
            load_margin: 4,
            index_pairs: 1 << 18,
        }
    }
}

/// Tokens per byte of rendering before any request of a model has
/// finished: about four bytes per token, as BPE vocabularies give English.
pub const INITIAL_TOKENS_PER_BYTE: f64 = 0.25;

/// Weight of each finished request in the tokens-per-byte average.
const RATIO_WEIGHT: f64 = 0.05;

/// Candidates shown on the `route` span at most (there may be a thousand).
const SHOWN: usize = 16;

/// The router-wide state of the worker choice.
pub struct Affinity {
    settings: AffinitySettings,
    state: Mutex<State>,
}

struct State {
    index: PrefixIndex,
    /// Model -> learned tokens per byte.
    ratios: HashMap<String, f64>,
}

/// What [`RequestAffinity::choose`] chose, and what the `route` span shows.
pub struct Choice {
    /// None: no eligible worker.
    pub worker: Option<Arc<Endpoint>>,
    /// Why it was chosen.
    pub reason: String,
    /// The candidates, their loads and (cache-aware) estimated cached tokens.
    pub candidates: String,
}

impl Affinity {
    /// The worker choice of one router.
    pub fn new(settings: AffinitySettings) -> Arc<Self> {
        Arc::new(Self {
            settings,
            state: Mutex::new(State {
                index: PrefixIndex::new(settings.index_pairs),
                ratios: HashMap::new(),
            }),
        })
    }

    /// The settings it runs with.
    pub fn settings(&self) -> AffinitySettings {
        self.settings
    }

    /// The choice for one request routed to `version`, with its sticky
    /// session key if any; hashes the prompt once, for every attempt.
    pub fn request(
        self: &Arc<Self>,
        request: &GenerateRequest,
        version: &str,
        session: Option<&str>,
    ) -> RequestAffinity {
        let digest = (self.settings.choice == WorkerChoice::CacheAware)
            .then(|| digest::digest(request, version, session));
        RequestAffinity {
            shared: self.clone(),
            digest,
            model: request.model.clone(),
        }
    }

    /// (chunk, worker) pairs in the index now.
    pub fn index_pairs(&self) -> usize {
        self.lock().index.pairs()
    }

    /// The tokens-per-byte ratio of `model` as learned so far.
    pub fn tokens_per_byte(&self, model: &str) -> f64 {
        self.lock()
            .ratios
            .get(model)
            .copied()
            .unwrap_or(INITIAL_TOKENS_PER_BYTE)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is consistent after every statement a panic could
        // interrupt; a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cache-aware choice among `candidates` not in `exclude`; with
    /// `explain`, also the reason and the candidates as the `route` span
    /// shows them (formatting them costs more than the choice itself).
    pub fn choose(
        &self,
        d: &PromptDigest,
        model: &str,
        candidates: &[Arc<Endpoint>],
        exclude: &[String],
        explain: bool,
        rng: &mut impl Rng,
    ) -> Choice {
        let eligible: Vec<&Arc<Endpoint>> = candidates
            .iter()
            .filter(|e| e.ready() && !exclude.contains(&e.id))
            .collect();
        let fingerprints: Vec<u64> = eligible.iter().map(|e| fingerprint(e)).collect();
        let mut matched = Vec::with_capacity(eligible.len());
        let ratio = {
            let mut state = self.lock();
            // A worker that stopped answering may have lost its cache (a
            // restart): what it was sent no longer counts.
            for e in candidates.iter() {
                if !e.healthy.load(Ordering::SeqCst) {
                    state.index.forget(&e.id);
                }
            }
            let holders: Vec<Option<index::Holder>> = eligible
                .iter()
                .zip(&fingerprints)
                .map(|(e, &f)| state.index.holder(&e.id, f))
                .collect();
            state.index.matched(&d.chunks, &holders, &mut matched);
            state
                .ratios
                .get(model)
                .copied()
                .unwrap_or(INITIAL_TOKENS_PER_BYTE)
        };
        let cached = |m: usize| ((m * CHUNK_BYTES).min(d.bytes) as f64 * ratio).round() as u64;
        let cands: Vec<Candidate> = eligible
            .iter()
            .zip(&matched)
            .map(|(e, &m)| Candidate {
                load: e.load(),
                matched: m,
                weight: rendezvous_weight(&e.id, d.conversation),
            })
            .collect();
        let mut shown = String::new();
        for (i, e) in candidates
            .iter()
            .enumerate()
            .take(if explain { SHOWN } else { 0 })
        {
            if i > 0 {
                shown.push(',');
            }
            match eligible.iter().position(|x| Arc::ptr_eq(x, e)) {
                Some(j) => {
                    let _ = write!(
                        shown,
                        "{}:{}:~{}t",
                        e.id,
                        cands[j].load,
                        cached(cands[j].matched)
                    );
                }
                None => {
                    let why = if e.ready() { "(tried)" } else { "(not ready)" };
                    let _ = write!(shown, "{}:{}{why}", e.id, e.load());
                }
            }
        }
        if explain && candidates.len() > SHOWN {
            let _ = write!(shown, ",+{} more", candidates.len() - SHOWN);
        }
        let (worker, reason) = match eligible.len() {
            0 => (None, "no ready worker left".to_string()),
            1 => (
                Some(eligible[0].clone()),
                "only ready worker left".to_string(),
            ),
            _ => {
                let margin = self.settings.load_margin;
                let decision: Decision = decide::decide(&cands, d.key_chunks, margin, |n| {
                    let two = sample(rng, n, 2);
                    (two.index(0), two.index(1))
                });
                let reason = if explain {
                    let ids: Vec<&str> = eligible.iter().map(|e| e.id.as_str()).collect();
                    let est: Vec<u64> = cands.iter().map(|c| cached(c.matched)).collect();
                    let loads: Vec<u32> = cands.iter().map(|c| c.load).collect();
                    decide::explain(&decision, &ids, &est, &loads, margin)
                } else {
                    String::new()
                };
                (Some(eligible[decision.chosen].clone()), reason)
            }
        };
        Choice {
            worker,
            reason,
            candidates: shown,
        }
    }

    /// Records that `ep` was sent the prompt of `d`.
    pub fn record(&self, d: &PromptDigest, ep: &Endpoint) {
        self.lock().index.record(&ep.id, fingerprint(ep), &d.chunks);
    }

    /// Learns from a finished request of `model` whose `bytes` of rendering
    /// were `prompt_tokens` tokens.
    pub fn observe(&self, model: &str, bytes: usize, prompt_tokens: u32) {
        if bytes == 0 || prompt_tokens == 0 {
            return;
        }
        let sample = (prompt_tokens as f64 / bytes as f64).clamp(0.01, 4.0);
        let mut state = self.lock();
        let r = state
            .ratios
            .entry(model.to_string())
            .or_insert(INITIAL_TOKENS_PER_BYTE);
        *r += RATIO_WEIGHT * (sample - *r);
    }
}

/// One request's worker choice, across its retries and failovers.
pub struct RequestAffinity {
    shared: Arc<Affinity>,
    /// None under `--worker-choice p2c`.
    digest: Option<PromptDigest>,
    model: String,
}

impl RequestAffinity {
    /// Picks a ready worker among `candidates` not in `exclude`; with
    /// `explain`, says why (see [`Affinity::choose`]).
    pub fn choose(
        &self,
        candidates: &[Arc<Endpoint>],
        exclude: &[String],
        explain: bool,
        rng: &mut impl Rng,
    ) -> Choice {
        match &self.digest {
            Some(d) => self
                .shared
                .choose(d, &self.model, candidates, exclude, explain, rng),
            None => Choice {
                worker: p2c::pick(candidates, exclude, rng),
                reason: if explain {
                    p2c::reason(candidates, exclude).to_string()
                } else {
                    String::new()
                },
                candidates: if explain {
                    crate::route::attempt::describe(candidates)
                } else {
                    String::new()
                },
            },
        }
    }

    /// The stream to `ep` is open: it now holds the prompt.
    pub fn opened(&self, ep: &Endpoint) {
        if let Some(d) = &self.digest {
            self.shared.record(d, ep);
        }
    }

    /// The request finished with `prompt_tokens` prompt tokens.
    pub fn finished(&self, prompt_tokens: u32) {
        if let Some(d) = &self.digest {
            self.shared.observe(&self.model, d.bytes, prompt_tokens);
        }
    }
}

/// A worker's rendezvous weight for conversation `key`.
pub fn rendezvous_weight(worker_id: &str, key: u64) -> u64 {
    xxh3_64_with_seed(worker_id.as_bytes(), key)
}

/// Names one registration of a worker: a worker re-registered under the
/// same id (a restart, a new address) is a new holder in the index.
fn fingerprint(ep: &Endpoint) -> u64 {
    let r = &ep.record;
    xxh3_64_with_seed(r.started_at.as_bytes(), xxh3_64(r.addr.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::testing::{add, registry};
    use rand::SeedableRng;
    use tokenmesh_proto::v1::ChatMessage;

    fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(7)
    }

    fn chat(c: usize, turns: usize) -> GenerateRequest {
        let mut messages = vec![ChatMessage {
            role: "system".into(),
            content: "Be brief and kind; say when you do not know. ".repeat(8),
        }];
        for t in 0..turns {
            messages.push(ChatMessage {
                role: "user".into(),
                content: format!("conversation {c}, question {t}: tell me more about the harbour"),
            });
            messages.push(ChatMessage {
                role: "assistant".into(),
                content: format!("answer {t}: the harbour was built of grey stone long ago"),
            });
        }
        messages.pop();
        GenerateRequest {
            model: "m".into(),
            messages,
            ..Default::default()
        }
    }

    fn cache_aware(margin: u32) -> Arc<Affinity> {
        Affinity::new(AffinitySettings {
            load_margin: margin,
            ..AffinitySettings::default()
        })
    }

    #[tokio::test]
    async fn two_routers_choose_alike_without_talking_and_conversations_spread() {
        let reg = registry();
        let mut eps: Vec<Arc<Endpoint>> = (0..4)
            .map(|i| add(&reg, &format!("w{i}"), "m", "v1", true))
            .collect();
        let (a, b) = (cache_aware(4), cache_aware(4));
        let mut used = std::collections::BTreeSet::new();
        for c in 0..16 {
            // Router a routes turns 1 and 3, router b turn 2, over the
            // candidates in another order.
            let mut on = Vec::new();
            for turn in 1..=3 {
                let (router, order): (&Arc<Affinity>, Vec<Arc<Endpoint>>) = if turn == 2 {
                    (&b, eps.iter().rev().cloned().collect())
                } else {
                    (&a, eps.clone())
                };
                let req = router.request(&chat(c, turn), "v1", None);
                let ep = req.choose(&order, &[], true, &mut rng()).worker.unwrap();
                req.opened(&ep);
                on.push(ep.id.clone());
            }
            assert!(on.iter().all(|w| w == &on[0]), "conversation {c}: {on:?}");
            used.insert(on[0].clone());
        }
        assert!(used.len() >= 3, "{used:?}");
        // A worker added later takes its share of new conversations, and
        // keeps none of the old ones from the workers that hold them.
        eps.push(add(&reg, "w4", "m", "v1", true));
        for c in 0..16 {
            let req = a.request(&chat(c, 4), "v1", None);
            let ep = req.choose(&eps, &[], true, &mut rng()).worker.unwrap();
            assert_ne!(ep.id, "w4", "conversation {c} left the worker holding it");
        }
    }

    #[tokio::test]
    async fn a_continuation_prefers_another_worker_holding_the_prefix() {
        let reg = registry();
        let eps: Vec<Arc<Endpoint>> = (0..4)
            .map(|i| add(&reg, &format!("w{i}"), "m", "v1", true))
            .collect();
        let aff = cache_aware(4);
        let req = aff.request(&chat(1, 3), "v1", None);
        let first = req.choose(&eps, &[], true, &mut rng()).worker.unwrap();
        req.opened(&first);
        // The conversation was also sent to the worker rendezvous ranks last
        // (the load guard moved a turn, say).
        let conversation = req.digest.as_ref().unwrap().conversation;
        let last = eps
            .iter()
            .min_by_key(|e| rendezvous_weight(&e.id, conversation))
            .unwrap();
        assert_ne!(last.id, first.id);
        req.opened(last);
        // Its stream is lost on the first: the continuation goes to the other
        // holder, not to the rendezvous runner-up.
        let choice = req.choose(&eps, std::slice::from_ref(&first.id), true, &mut rng());
        assert_eq!(choice.worker.unwrap().id, last.id);
        assert!(
            choice
                .reason
                .starts_with("cache-aware: longest cached prefix"),
            "{}",
            choice.reason
        );
        assert!(
            choice
                .candidates
                .contains(&format!("{}:0(tried)", first.id)),
            "{}",
            choice.candidates
        );
    }

    #[tokio::test]
    async fn an_unhealthy_worker_is_forgotten_and_p2c_records_nothing() {
        let reg = registry();
        let eps: Vec<Arc<Endpoint>> = (0..2)
            .map(|i| add(&reg, &format!("w{i}"), "m", "v1", true))
            .collect();
        let aff = cache_aware(4);
        let req = aff.request(&chat(0, 2), "v1", None);
        let ep = req.choose(&eps, &[], true, &mut rng()).worker.unwrap();
        req.opened(&ep);
        let pairs = aff.index_pairs();
        assert!(pairs > 0);
        let shown = req.choose(&eps, &[], true, &mut rng()).candidates;
        assert!(!shown.contains(&format!("{}:0:~0t", ep.id)), "{shown}");
        ep.healthy.store(false, Ordering::SeqCst);
        let choice = req.choose(&eps, &[], true, &mut rng());
        assert_eq!(choice.reason, "only ready worker left");
        assert!(
            choice.candidates.contains("(not ready)"),
            "{}",
            choice.candidates
        );
        ep.healthy.store(true, Ordering::SeqCst);
        let shown = req.choose(&eps, &[], true, &mut rng()).candidates;
        assert!(shown.contains(&format!("{}:0:~0t", ep.id)), "{shown}");

        let p2c = Affinity::new(AffinitySettings {
            choice: WorkerChoice::P2c,
            ..AffinitySettings::default()
        });
        let req = p2c.request(&chat(0, 2), "v1", None);
        let choice = req.choose(&eps, &[], true, &mut rng());
        req.opened(&choice.worker.unwrap());
        req.finished(100);
        assert_eq!(p2c.index_pairs(), 0);
        assert_eq!(choice.reason, "lower load of two random ready workers");
        assert_eq!(p2c.tokens_per_byte("m"), INITIAL_TOKENS_PER_BYTE);
    }

    #[test]
    fn the_tokens_per_byte_ratio_is_learned_per_model() {
        let aff = cache_aware(4);
        for _ in 0..200 {
            aff.observe("m", 1_000, 500);
        }
        assert!((aff.tokens_per_byte("m") - 0.5).abs() < 0.01);
        assert_eq!(aff.tokens_per_byte("other"), INITIAL_TOKENS_PER_BYTE);
        // Nonsense is ignored or bounded.
        aff.observe("m", 0, 10);
        aff.observe("m", 10, 0);
        assert!((aff.tokens_per_byte("m") - 0.5).abs() < 0.01);
    }
}
