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
//! - [`sets`]: what is kept per candidate set, so that a decision touches
//!   a few workers, not all.
//!
//! A decision reads each candidate's id hash from a compact array kept per
//! candidate set (the rendezvous top is a tight loop over it), the field's
//! loads from a snapshot at most a millisecond old, and live only the
//! rendezvous worker and the few workers holding this conversation's next
//! chunk (from the index; a binary search of the sorted set tells whether
//! each is a candidate). A retry, a failover, a set of fewer than
//! [`AffinitySettings::snapshot_from`] workers, or a rendezvous worker that
//! is not eligible (unready, tried, unable to continue from token ids) takes
//! one pass over every candidate instead, with the same result. A fleet
//! that shares a system prompt does not make the decision cost workers ×
//! chunks.
//!
//! Estimated cached tokens are matched bytes times a tokens-per-byte ratio
//! learned per model from finished requests (prompt tokens / prompt bytes),
//! starting from [`INITIAL_TOKENS_PER_BYTE`]. With `--worker-choice p2c`
//! nothing is hashed or recorded and the choice is [`super::p2c`]'s.
pub mod decide;
pub mod digest;
pub mod index;
pub mod sets;
mod top;

use super::candidates::Candidates;
use super::p2c;
use crate::registry::Endpoint;
use decide::{Contender, Decision, Field, Guard};
use digest::{PromptDigest, CHUNK_BYTES};
use index::{Holder, PrefixIndex};
use rand::Rng;
use sets::{CandidateSet, CandidateSets};
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokenmesh_proto::v1::GenerateRequest;
use tokio::time::Instant;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// How a worker of the chosen version is picked (`--worker-choice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WorkerChoice {
    /// The worker holding the longest prefix of the prompt, by conversation
    /// affinity, unless its load is past the guard.
    #[default]
    CacheAware,
    /// Power of two choices on live load alone.
    P2c,
}

/// Settings of the worker choice (from the router's flags).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AffinitySettings {
    pub choice: WorkerChoice,
    /// Streams by which the preferred worker's load may exceed the least
    /// loaded one's before load wins.
    pub load_margin: u32,
    /// Most load of the preferred worker, one more stream included, as a
    /// multiple of the mean load of the eligible workers (0: no such bound).
    pub load_factor: f64,
    /// Most (chunk, worker) pairs the index holds.
    pub index_pairs: usize,
    /// Candidate sets of at least this many workers read the field's load
    /// from a snapshot ([`sets`]); smaller ones by a pass per decision,
    /// which costs them little.
    pub snapshot_from: usize,
    /// How old that snapshot may be.
    pub snapshot_max_age: Duration,
}

impl Default for AffinitySettings {
    fn default() -> Self {
        Self {
            choice: WorkerChoice::CacheAware,
            load_margin: 4,
            load_factor: 1.0,
            index_pairs: 1 << 18,
            snapshot_from: 64,
            snapshot_max_age: Duration::from_millis(1),
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

/// Holders of the conversation's next chunk weighed per decision at most.
/// They are normally one or two (the workers this conversation was sent
/// to); the bound keeps a prompt that every worker was sent from making
/// the decision cost grow with the fleet.
const RIVALS: usize = 32;

/// Candidate sets kept (one per model version, and one more per change of
/// a version's workers while requests still hold the older view).
const SETS: usize = 32;

/// The router-wide state of the worker choice.
pub struct Affinity {
    settings: AffinitySettings,
    state: Mutex<State>,
    sets: CandidateSets,
}

struct State {
    index: PrefixIndex,
    /// Holder -> the endpoint it names, for the holders in the index.
    endpoints: HashMap<Holder, Weak<Endpoint>>,
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

/// A worker weighed by one decision.
struct Weighed {
    ep: Arc<Endpoint>,
    weight: u64,
    contender: Contender,
}

impl Affinity {
    /// The worker choice of one router.
    pub fn new(settings: AffinitySettings) -> Arc<Self> {
        Arc::new(Self {
            settings,
            state: Mutex::new(State {
                index: PrefixIndex::new(settings.index_pairs),
                endpoints: HashMap::new(),
                ratios: HashMap::new(),
            }),
            sets: CandidateSets::new(SETS),
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

    fn guard(&self) -> Guard {
        Guard {
            margin: self.settings.load_margin,
            factor: self.settings.load_factor,
        }
    }

    /// The rendezvous worker of `d` among the eligible of `c` (its index in
    /// `c.endpoints`) and the field of the eligible workers: from the set's
    /// cache when its top is eligible and nothing is excluded, else by one
    /// pass over every candidate (retries, failovers, small sets, an
    /// unready top).
    fn rendezvous(
        &self,
        d: &PromptDigest,
        c: &Candidates,
        set: &CandidateSet,
    ) -> Option<(usize, Field)> {
        let s = &self.settings;
        if c.exclude.is_empty() && c.endpoints.len() >= s.snapshot_from {
            if let Some(i) = set
                .top(c.endpoints, d.conversation)
                .filter(|&i| c.eligible(&c.endpoints[i]))
            {
                let mut field = set.field(c, Instant::now(), s.snapshot_max_age);
                // Never fewer than the one just read ready (the snapshot
                // may predate it).
                field.eligible = field.eligible.max(1);
                return Some((i, field));
            }
        }
        full_pass(d, c)
    }

    /// The cache-aware choice among the eligible of `c`; with `explain`,
    /// also the reason and the candidates as the `route` span shows them
    /// (formatting them costs more than the choice itself).
    pub fn choose(
        &self,
        d: &PromptDigest,
        model: &str,
        c: &Candidates,
        explain: bool,
        rng: &mut impl Rng,
    ) -> Choice {
        let set = self.sets.get(c.endpoints);
        let Some((top, field)) = self.rendezvous(d, c, &set) else {
            return Choice {
                worker: None,
                reason: "no ready worker left".to_string(),
                candidates: self.shown(d, model, c, explain),
            };
        };
        let top_ep = &c.endpoints[top];
        let (rendezvous, rivals) = {
            let state = self.lock();
            let own = holder(top_ep);
            let rendezvous = Weighed {
                ep: top_ep.clone(),
                weight: rendezvous_weight(top_ep.id_hash, d.conversation),
                contender: Contender {
                    // Live, whatever the field's snapshot.
                    load: top_ep.load(),
                    matched: state.index.depth(&d.chunks, own),
                },
            };
            // Any worker holding more of the prompt than the rendezvous
            // worker, through the conversation key, holds this chunk.
            let at = rendezvous
                .contender
                .matched
                .max(d.key_chunks.saturating_sub(1));
            let mut rivals = Vec::new();
            if let Some(&chunk) = d.chunks.get(at) {
                for &h in state.index.holders_of(chunk).iter().take(RIVALS) {
                    let Some(ep) = state.endpoints.get(&h).and_then(Weak::upgrade) else {
                        continue;
                    };
                    // A stale name (it restarted or went unhealthy since),
                    // or not a candidate of this request (it left the
                    // registry, or cannot continue from token ids).
                    if h == own
                        || holder(&ep) != h
                        || !c.eligible(&ep)
                        || !set.contains(c.endpoints, &ep)
                    {
                        continue;
                    }
                    let weight = rendezvous_weight(ep.id_hash, d.conversation);
                    let contender = Contender {
                        load: ep.load(),
                        matched: state.index.depth(&d.chunks, h),
                    };
                    rivals.push(Weighed {
                        ep,
                        weight,
                        contender,
                    });
                }
            }
            (rendezvous, rivals)
        };
        let rival = rivals
            .into_iter()
            .max_by_key(|r| (r.contender.matched, r.weight));
        let guard = self.guard();
        let decision: Decision = decide::decide(
            rendezvous.contender,
            rival.as_ref().map(|r| r.contender),
            d.key_chunks,
            field,
            guard,
        );
        let preferred = match (&rival, decision.rival) {
            (Some(r), true) => r,
            _ => &rendezvous,
        };
        let worker = if field.eligible == 1 {
            Some(preferred.ep.clone())
        } else if decision.overload.is_some() {
            // Load wins: P2C among the others, so that a draw of the
            // preferred worker (tied for the lower load of the two) does
            // not undo the guard.
            let preferred_ep = &preferred.ep;
            p2c::pick_where(
                c.endpoints,
                |e| c.eligible(e) && !std::ptr::eq(e, &**preferred_ep),
                rng,
            )
            .or_else(|| Some(preferred_ep.clone()))
        } else {
            Some(preferred.ep.clone())
        };
        let reason = if !explain {
            String::new()
        } else if field.eligible == 1 {
            "only ready worker left".to_string()
        } else {
            let cached = estimate(
                preferred.contender.matched,
                d.bytes,
                self.tokens_per_byte(model),
            );
            decide::explain(
                &decision,
                &preferred.ep.id,
                cached,
                preferred.contender.load,
                guard,
            )
        };
        Choice {
            worker,
            reason,
            candidates: self.shown(d, model, c, explain),
        }
    }

    /// The first [`SHOWN`] candidates as the `route` span shows them: id,
    /// load and estimated cached tokens, or why it was not eligible.
    fn shown(&self, d: &PromptDigest, model: &str, c: &Candidates, explain: bool) -> String {
        let mut shown = String::new();
        if !explain {
            return shown;
        }
        let candidates = c.offered();
        let state = self.lock();
        let ratio = state
            .ratios
            .get(model)
            .copied()
            .unwrap_or(INITIAL_TOKENS_PER_BYTE);
        for (i, e) in candidates.iter().take(SHOWN).enumerate() {
            if i > 0 {
                shown.push(',');
            }
            if !e.ready() {
                let _ = write!(shown, "{}:{}(not ready)", e.id, e.load());
            } else if c.exclude.contains(&e.id) {
                let _ = write!(shown, "{}:{}(tried)", e.id, e.load());
            } else {
                let matched = state.index.depth(&d.chunks, holder(e));
                let _ = write!(
                    shown,
                    "{}:{}:~{}t",
                    e.id,
                    e.load(),
                    estimate(matched, d.bytes, ratio)
                );
            }
        }
        if candidates.len() > SHOWN {
            let _ = write!(shown, ",+{} more", candidates.len() - SHOWN);
        }
        shown
    }

    /// Records that `ep` was sent the prompt of `d`.
    pub fn record(&self, d: &PromptDigest, ep: &Arc<Endpoint>) {
        if d.chunks.is_empty() {
            return;
        }
        let h = holder(ep);
        let mut state = self.lock();
        state.index.record(&ep.id, h, &d.chunks);
        for gone in state.index.take_gone() {
            state.endpoints.remove(&gone);
        }
        state.endpoints.insert(h, Arc::downgrade(ep));
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

/// The rendezvous worker of `d` among the eligible of `c` (its index) and
/// the field of the eligible workers, by one pass over every candidate.
fn full_pass(d: &PromptDigest, c: &Candidates) -> Option<(usize, Field)> {
    let mut field = Field::EMPTY;
    let mut top: Option<(u64, usize)> = None;
    for (i, e) in c.endpoints.iter().enumerate() {
        if !c.eligible(e) {
            continue;
        }
        field.add(e.load());
        let w = rendezvous_weight(e.id_hash, d.conversation);
        if top.is_none_or(|(tw, t)| w > tw || (w == tw && e.id < c.endpoints[t].id)) {
            top = Some((w, i));
        }
    }
    top.map(|(_, i)| (i, field))
}

/// Estimated cached tokens of `matched` leading chunks of a `bytes`-long
/// rendering.
fn estimate(matched: usize, bytes: usize, tokens_per_byte: f64) -> u64 {
    ((matched * CHUNK_BYTES).min(bytes) as f64 * tokens_per_byte).round() as u64
}

/// One request's worker choice, across its retries and failovers.
pub struct RequestAffinity {
    shared: Arc<Affinity>,
    /// None under `--worker-choice p2c`.
    digest: Option<PromptDigest>,
    model: String,
}

impl RequestAffinity {
    /// Picks an eligible worker of `c`; with `explain`, says why (see
    /// [`Affinity::choose`]).
    pub fn choose(&self, c: &Candidates, explain: bool, rng: &mut impl Rng) -> Choice {
        match &self.digest {
            Some(d) => self.shared.choose(d, &self.model, c, explain, rng),
            None => {
                let eligible = |e: &Endpoint| c.eligible(e);
                Choice {
                    worker: p2c::pick_where(c.endpoints, eligible, rng),
                    reason: if explain {
                        p2c::reason_where(c.endpoints, eligible).to_string()
                    } else {
                        String::new()
                    },
                    candidates: if explain {
                        crate::route::attempt::describe(&c.offered())
                    } else {
                        String::new()
                    },
                }
            }
        }
    }

    /// The stream to `ep` is open: it now holds the prompt.
    pub fn opened(&self, ep: &Arc<Endpoint>) {
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

/// A worker's rendezvous weight for conversation `key`, from the hash of its
/// id ([`Endpoint::id_hash`]): a fixed bijective 64-bit mix (MurmurHash3's
/// finalizer) of the two, so every router ranks workers alike, and cheap
/// enough to weigh a thousand candidates per request.
pub fn rendezvous_weight(id_hash: u64, key: u64) -> u64 {
    let mut h = id_hash ^ key;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Names a worker's cache in the index: its id, its registration and its
/// spells of unhealthiness. A worker re-registered under the same id (a
/// restart, a new address), or one that stopped answering for a while (it
/// may have restarted: a static file's record does not change), is a new
/// holder; ids multiplexed over one address are separate holders.
fn holder(ep: &Endpoint) -> Holder {
    // The registration's hash is kept on the endpoint: only its atomics'
    // cache line is read here, not the record's strings.
    let spells = ep.unhealthy_spells.load(Ordering::SeqCst);
    xxh3_64_with_seed(&spells.to_le_bytes(), ep.registration_hash)
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

    /// `n` ready workers w0.. of m/v1 (the registry keeps them), as the
    /// registry's view shares them.
    fn ready(n: usize) -> (Arc<crate::registry::Registry>, Arc<[Arc<Endpoint>]>) {
        let reg = registry();
        for i in 0..n {
            add(&reg, &format!("w{i}"), "m", "v1", true);
        }
        let eps = reg.endpoints("m", "v1");
        (reg, eps)
    }

    /// Every one of `eps`, none tried.
    fn all(eps: &Arc<[Arc<Endpoint>]>) -> Candidates<'_> {
        Candidates::all(eps)
    }

    fn cache_aware(margin: u32) -> Arc<Affinity> {
        Affinity::new(AffinitySettings {
            load_margin: margin,
            ..AffinitySettings::default()
        })
    }

    #[tokio::test]
    async fn two_routers_choose_alike_without_talking_and_conversations_spread() {
        let (reg, mut eps) = ready(4);
        let (a, b) = (cache_aware(4), cache_aware(4));
        let mut used = std::collections::BTreeSet::new();
        for c in 0..16 {
            // Router a routes turns 1 and 3, router b turn 2, over the
            // candidates in another order.
            let mut on = Vec::new();
            for turn in 1..=3 {
                let (router, order): (&Arc<Affinity>, Arc<[Arc<Endpoint>]>) = if turn == 2 {
                    (&b, eps.iter().rev().cloned().collect())
                } else {
                    (&a, eps.clone())
                };
                let req = router.request(&chat(c, turn), "v1", None);
                let ep = req.choose(&all(&order), true, &mut rng()).worker.unwrap();
                req.opened(&ep);
                on.push(ep.id.clone());
            }
            assert!(on.iter().all(|w| w == &on[0]), "conversation {c}: {on:?}");
            used.insert(on[0].clone());
        }
        assert!(used.len() >= 3, "{used:?}");
        // A worker added later takes its share of new conversations, and
        // keeps none of the old ones from the workers that hold them.
        add(&reg, "w4", "m", "v1", true);
        eps = reg.endpoints("m", "v1");
        assert_eq!(eps.len(), 5);
        for c in 0..16 {
            let req = a.request(&chat(c, 4), "v1", None);
            let ep = req.choose(&all(&eps), true, &mut rng()).worker.unwrap();
            assert_ne!(ep.id, "w4", "conversation {c} left the worker holding it");
        }
    }

    #[tokio::test]
    async fn a_continuation_prefers_another_worker_holding_the_prefix() {
        let (_reg, eps) = ready(4);
        let aff = cache_aware(4);
        let req = aff.request(&chat(1, 3), "v1", None);
        let first = req.choose(&all(&eps), true, &mut rng()).worker.unwrap();
        req.opened(&first);
        // The conversation was also sent to the worker rendezvous ranks last
        // (the load guard moved a turn, say).
        let conversation = req.digest.as_ref().unwrap().conversation;
        let last = eps
            .iter()
            .min_by_key(|e| rendezvous_weight(e.id_hash, conversation))
            .unwrap();
        assert_ne!(last.id, first.id);
        let last = last.clone();
        req.opened(&last);
        // Its stream is lost on the first: the continuation goes to the other
        // holder, not to the rendezvous runner-up.
        let tried = Candidates {
            exclude: std::slice::from_ref(&first.id),
            ..all(&eps)
        };
        let choice = req.choose(&tried, true, &mut rng());
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
        let (_reg, eps) = ready(2);
        let aff = cache_aware(4);
        let req = aff.request(&chat(0, 2), "v1", None);
        let ep = req.choose(&all(&eps), true, &mut rng()).worker.unwrap();
        req.opened(&ep);
        let pairs = aff.index_pairs();
        assert!(pairs > 0);
        let shown = req.choose(&all(&eps), true, &mut rng()).candidates;
        assert!(!shown.contains(&format!("{}:0:~0t", ep.id)), "{shown}");
        ep.set_healthy(false);
        let choice = req.choose(&all(&eps), true, &mut rng());
        assert_eq!(choice.reason, "only ready worker left");
        assert!(
            choice.candidates.contains("(not ready)"),
            "{}",
            choice.candidates
        );
        ep.set_healthy(true);
        let shown = req.choose(&all(&eps), true, &mut rng()).candidates;
        assert!(shown.contains(&format!("{}:0:~0t", ep.id)), "{shown}");

        let p2c = Affinity::new(AffinitySettings {
            choice: WorkerChoice::P2c,
            ..AffinitySettings::default()
        });
        let req = p2c.request(&chat(0, 2), "v1", None);
        let choice = req.choose(&all(&eps), true, &mut rng());
        req.opened(&choice.worker.unwrap());
        req.finished(100);
        assert_eq!(p2c.index_pairs(), 0);
        assert_eq!(choice.reason, "lower load of two random ready workers");
        assert_eq!(p2c.tokens_per_byte("m"), INITIAL_TOKENS_PER_BYTE);
    }

    #[tokio::test]
    async fn a_few_conversations_on_one_worker_are_spread_past_the_bound_on_the_mean() {
        let (_reg, eps) = ready(4);
        let aff = cache_aware(4);
        let req = aff.request(&chat(5, 2), "v1", None);
        let own = req.choose(&all(&eps), true, &mut rng()).worker.unwrap();
        req.opened(&own);
        // Its worker has 3 streams, every other 1: within the margin of 4,
        // but a fourth would pass ceil(1.0 x 7 / 4) = 2.
        for e in eps.iter() {
            let load = if Arc::ptr_eq(e, &own) { 3 } else { 1 };
            e.in_flight.store(load, Ordering::SeqCst);
        }
        for seed in 0..20 {
            let mut r = rand::rngs::StdRng::seed_from_u64(seed);
            let choice = req.choose(&all(&eps), true, &mut r);
            assert_ne!(choice.worker.unwrap().id, own.id);
            assert!(
                choice
                    .reason
                    .starts_with(&format!("load guard: {} ", own.id))
                    && choice.reason.contains("would pass 2, 1.00 times the mean"),
                "{}",
                choice.reason
            );
        }
        // At 1 stream, as many as every other, it takes its conversation
        // again (a second is within ceil(1.0 x 5 / 4) = 2).
        own.in_flight.store(1, Ordering::SeqCst);
        let choice = req.choose(&all(&eps), true, &mut rng());
        assert_eq!(choice.worker.unwrap().id, own.id, "{}", choice.reason);
        // Without the bound, the margin alone lets it.
        let margin_only = Affinity::new(AffinitySettings {
            load_factor: 0.0,
            ..AffinitySettings::default()
        });
        own.in_flight.store(3, Ordering::SeqCst);
        let req = margin_only.request(&chat(5, 2), "v1", None);
        assert_eq!(
            req.choose(&all(&eps), true, &mut rng()).worker.unwrap().id,
            own.id
        );
    }

    #[tokio::test]
    async fn the_load_guard_never_hands_the_worker_it_turned_down_back() {
        // Two workers at load 2 and a bound of ceil(0.5 x 5 / 2) = 2 streams:
        // the preferred one is turned down, and P2C over the two, tied,
        // would draw it again about half the time.
        let (_reg, eps) = ready(2);
        let aff = Affinity::new(AffinitySettings {
            load_factor: 0.5,
            ..AffinitySettings::default()
        });
        let req = aff.request(&chat(5, 2), "v1", None);
        let own = req.choose(&all(&eps), true, &mut rng()).worker.unwrap();
        for e in eps.iter() {
            e.in_flight.store(2, Ordering::SeqCst);
        }
        for seed in 0..40 {
            let mut r = rand::rngs::StdRng::seed_from_u64(seed);
            let choice = req.choose(&all(&eps), true, &mut r);
            assert!(
                choice.reason.starts_with("load guard: "),
                "{}",
                choice.reason
            );
            assert_ne!(choice.worker.unwrap().id, own.id, "seed {seed}");
        }
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

    /// `n` workers x0000.. of m/v1, ready, the even ones able to continue
    /// from token ids, as the registry's view shares them.
    fn fleet(n: usize) -> (Arc<crate::registry::Registry>, Arc<[Arc<Endpoint>]>) {
        let reg = registry();
        for i in 0..n {
            let record = tokenmesh_proto::records::WorkerRecord {
                continues_from_token_ids: i % 2 == 0,
                ..tokenmesh_proto::records::WorkerRecord::new("http://127.0.0.1:9")
            };
            reg.upsert_worker(&format!("x{i:04}"), "m", "v1", record)
                .unwrap();
        }
        let eps = reg.endpoints("m", "v1");
        for e in eps.iter() {
            e.set_healthy(true);
        }
        (reg, eps)
    }

    /// The set cache and snapshot on every set (`max_age` old at most), or
    /// never (the full pass on every decision).
    fn snapshots(max_age: Option<Duration>) -> Arc<Affinity> {
        Affinity::new(AffinitySettings {
            snapshot_from: if max_age.is_some() { 0 } else { usize::MAX },
            snapshot_max_age: max_age.unwrap_or_default(),
            ..AffinitySettings::default()
        })
    }

    #[tokio::test]
    async fn a_set_is_kept_until_the_worker_set_changes_and_does_not_keep_it_alive() {
        let (reg, eps) = ready(3);
        let sets = CandidateSets::new(4);
        let kept = sets.get(&eps);
        assert!(
            Arc::ptr_eq(&kept, &sets.get(&eps)),
            "the same view, the same set"
        );
        // A copy of the same endpoints is another slice: another set.
        let copy: Arc<[Arc<Endpoint>]> = eps.iter().cloned().collect();
        assert!(!Arc::ptr_eq(&kept, &sets.get(&copy)));
        assert_eq!(sets.len(), 2);
        // A change of the workers: a new view, a new set, built afresh.
        add(&reg, "w3", "m", "v1", true);
        let changed = reg.endpoints("m", "v1");
        let rebuilt = sets.get(&changed);
        assert!(!Arc::ptr_eq(&kept, &rebuilt));
        assert_eq!(rebuilt.top(&changed, 1).map(|i| i < 4), Some(true));
        // A removed worker is dropped once no view holds it, though its
        // old set is still cached (held by Weak).
        let gone = Arc::downgrade(&eps[0]);
        reg.remove_worker("w0");
        drop((eps, copy, changed));
        assert!(
            gone.upgrade().is_none(),
            "the cache kept a removed worker alive"
        );
        assert_eq!(sets.len(), 3);
        // Dead sets go on the next miss; at most `capacity` are kept.
        let fresh = reg.endpoints("m", "v1");
        sets.get(&fresh);
        assert_eq!(sets.len(), 1, "only the fresh view is alive");
        let more: Vec<Arc<[Arc<Endpoint>]>> =
            (0..6).map(|_| fresh.iter().cloned().collect()).collect();
        for m in &more {
            sets.get(m);
        }
        assert_eq!(sets.len(), 4);
    }

    #[tokio::test]
    async fn the_field_snapshot_is_at_most_max_age_old_and_then_refreshed() {
        let (_reg, eps) = fleet(100);
        let sets = CandidateSets::new(4);
        let set = sets.get(&eps);
        let age = Duration::from_millis(1);
        let t0 = Instant::now();
        let c = Candidates::all(&eps);
        let f = set.field(&c, t0, age);
        assert_eq!((f.eligible, f.least, f.total), (100, 0, 0));
        eps[3].in_flight.store(5, Ordering::SeqCst);
        eps[4].set_healthy(false);
        // Within max_age: the snapshot, as it was.
        assert_eq!(set.field(&c, t0 + age, age), f);
        // Past it: refreshed by a pass.
        let later = set.field(&c, t0 + age + Duration::from_nanos(1), age);
        assert_eq!((later.eligible, later.least, later.total), (99, 0, 5));
        // A continuation's field counts the workers continuing from ids
        // only (the even ones, w4 unready among them), in its own snapshot.
        let ids = Candidates {
            token_ids: true,
            ..c
        };
        let f = set.field(&ids, t0 + age * 2, age);
        assert_eq!((f.eligible, f.total), (49, 0));
        eps[3].in_flight.store(0, Ordering::SeqCst);
        eps[4].set_healthy(true);
    }

    #[tokio::test]
    async fn the_cached_choice_is_the_full_pass_s_whatever_is_unready_or_excluded() {
        let (_reg, eps) = fleet(200);
        // Loads 0..7, a few workers unready.
        for (i, e) in eps.iter().enumerate() {
            e.in_flight.store((i % 8) as u32, Ordering::SeqCst);
            e.set_healthy(i % 13 != 5);
        }
        // max_age zero: every snapshot is fresh, so the two must agree
        // exactly, the guard's P2C draws included (same seed).
        let (cached, full) = (snapshots(Some(Duration::ZERO)), snapshots(None));
        let mut unready_tops = 0;
        for conv in 0..300 {
            let request = chat(conv, 2);
            let (a, b) = (
                cached.request(&request, "v1", None),
                full.request(&request, "v1", None),
            );
            let d = a.digest.as_ref().unwrap();
            let set = cached.sets.get(&eps);
            let top = set.top(&eps, d.conversation).unwrap();
            // The full pass's rendezvous worker: the cached top when it is
            // eligible, another when it is not.
            let (full_top, field) = full_pass(d, &Candidates::all(&eps)).unwrap();
            assert_eq!(field.eligible, eps.iter().filter(|e| e.ready()).count());
            if eps[top].ready() {
                assert_eq!(top, full_top, "conversation {conv}");
            } else {
                unready_tops += 1;
                assert_ne!(top, full_top);
            }
            let tried = [eps[full_top].id.clone()];
            for c in [
                Candidates::all(&eps),
                Candidates {
                    exclude: &tried,
                    ..Candidates::all(&eps)
                },
                Candidates {
                    token_ids: true,
                    ..Candidates::all(&eps)
                },
            ] {
                let seed = conv as u64;
                let x = a.choose(&c, true, &mut rand::rngs::StdRng::seed_from_u64(seed));
                let y = b.choose(&c, true, &mut rand::rngs::StdRng::seed_from_u64(seed));
                let (x, y) = (x.worker.unwrap(), y.worker.unwrap());
                assert_eq!(x.id, y.id, "conversation {conv}, {:?}", c.exclude);
                assert!(c.eligible(&x), "{} is not eligible", x.id);
            }
            a.opened(&eps[full_top]);
            b.opened(&eps[full_top]);
        }
        assert!(unready_tops > 5, "only {unready_tops} unready tops");
    }

    #[tokio::test]
    async fn a_continuation_goes_only_to_workers_that_continue_from_token_ids() {
        let (_reg, eps) = fleet(100);
        let aff = snapshots(Some(Duration::from_millis(1)));
        let c = Candidates {
            token_ids: true,
            ..Candidates::all(&eps)
        };
        for conv in 0..200 {
            let req = aff.request(&chat(conv, 3), "v1", None);
            // The conversation was sent to an odd worker, which cannot
            // continue: it is no rival either.
            let odd = &eps[2 * (conv % 50) + 1];
            req.opened(odd);
            let choice = req.choose(&c, true, &mut rng());
            let ep = choice.worker.unwrap();
            assert!(ep.record.continues_from_token_ids, "{}", ep.id);
            assert!(
                !choice.candidates.contains(&odd.id),
                "{}",
                choice.candidates
            );
        }
        // Uneven loads, an idle odd worker: when load wins, P2C still keeps
        // to the capable ones.
        for (i, e) in eps.iter().enumerate() {
            let load = if i % 2 == 1 {
                0
            } else {
                (i as u32 / 2 % 10) * 3
            };
            e.in_flight.store(load, Ordering::SeqCst);
        }
        let aff = snapshots(Some(Duration::ZERO));
        let mut guarded = 0;
        for conv in 0..50 {
            let req = aff.request(&chat(conv, 3), "v1", None);
            let choice = req.choose(&c, true, &mut rng());
            let ep = choice.worker.unwrap();
            assert!(ep.record.continues_from_token_ids, "{}", ep.id);
            guarded += usize::from(choice.reason.starts_with("load guard"));
        }
        assert!(guarded > 10, "only {guarded} decisions went to P2C");
        let p2c = Affinity::new(AffinitySettings {
            choice: WorkerChoice::P2c,
            ..AffinitySettings::default()
        });
        for conv in 0..50 {
            let req = p2c.request(&chat(conv, 3), "v1", None);
            let ep = req.choose(&c, false, &mut rng()).worker.unwrap();
            assert!(ep.record.continues_from_token_ids, "{}", ep.id);
        }
    }
}
