//! The engine thread: continuous batching over a paged KV cache, driving any
//! [`StepModel`] (the GGUF model, or the synthetic engine, which thus runs
//! the same queue, batching and KV accounting).
//!
//! Each step:
//! 1. commands are applied and sequences whose client left are dropped (their
//!    KV blocks go back to the pool);
//! 2. waiting sequences join, by priority with aging, while the batch has
//!    room and the pool has blocks for their first prompt chunk; with prefix
//!    caching, a sequence first takes up the cached full blocks its context
//!    starts with and reads only the rest (a preempted sequence or a
//!    failover continuation too: its tokens so far are its context);
//! 3. every decoding sequence gets room for one more token; if the pool is
//!    full the youngest sequence is preempted (its blocks freed, its tokens
//!    kept) and goes back to the head of the queue, to be recomputed later;
//!    a sequence whose next token would not fit even in the whole pool ends
//!    as [`Finish::KvCacheFull`] (preempting others would not help);
//! 4. prompts are read in chunks that fit the step's token budget, so running
//!    streams keep getting a token every step while a long prompt is read;
//! 5. one forward pass runs every sequence's share; sequences whose context is
//!    fully read sample their next token (a sequence the model failed leaves
//!    with its error); blocks the step filled are registered in the prefix
//!    cache before any sequence ends, so an ending sequence leaves them cached.
use super::queue::PriorityQueue;
use super::series::EngineSeries;
use super::{Command, EngineStats, Event, Finish, SchedulerConfig, SequenceRequest, StreamKey};
use crate::engine::detokenize::TextStream;
use crate::engine::kv::{KvCache, KvPool};
use crate::engine::model::{BatchSeq, ModelError, SeqStart, SeqStep, StepModel, StepOutput};
use crate::engine::sampling::{logprob, Sampler, PENALTY_WINDOW};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A phase span (`queue`, `prefill`, `decode`) under the request's span, with
/// `--trace-phases`; none without it, or for a request that has no span (not
/// sampled): a child of none is a root.
macro_rules! phase_span {
    ($on:expr, $parent:expr, $($rest:tt)+) => {
        if !$on || $parent.is_disabled() {
            tracing::Span::none()
        } else {
            tracing::info_span!(parent: $parent, $($rest)+)
        }
    };
}

/// One sequence, waiting or running. It keeps its sampler, decoder and model
/// state across a preemption, so recomputation continues exactly where it
/// stopped.
struct Seq<S> {
    req: SequenceRequest,
    cache: KvCache,
    sampler: Sampler,
    text: TextStream,
    /// Completion tokens so far (including those before a failover).
    generated: usize,
    first_token: Option<Duration>,
    started: bool,
    /// `queue`, then `prefill`, then `decode`.
    phase: tracing::Span,
    prefilling: bool,
    /// Tokens of `req.context` this step feeds (set while planning).
    chunk: usize,
    /// What the model keeps for this sequence.
    state: S,
}

/// How a running sequence ends.
enum End {
    Finished(Finish, Option<String>),
    /// The model failed it.
    Failed(String),
}

impl<S> Seq<S> {
    /// Context tokens not yet in the KV cache.
    fn pending(&self) -> usize {
        self.req.context.len() - self.cache.len()
    }
}

/// The engine's state: the queue, the batch and the pool. Each method is one
/// part of a step, so tests can run them without the thread.
pub(super) struct Scheduler<M: StepModel> {
    model: M,
    cfg: SchedulerConfig,
    stats: Arc<EngineStats>,
    pool: KvPool,
    waiting: PriorityQueue<Seq<M::SeqState>>,
    /// Running sequences, oldest admission first.
    active: Vec<Seq<M::SeqState>>,
    /// Smoothed seconds per token of recent steps, for the latency target.
    secs_per_token: f64,
    series: EngineSeries,
}

impl<M: StepModel> Scheduler<M> {
    pub(super) fn new(
        model: M,
        cfg: SchedulerConfig,
        stats: Arc<EngineStats>,
    ) -> Result<Self, candle_core::Error> {
        let mut pool = model.kv_pool(cfg.kv_budget_bytes, cfg.kv_block_size)?;
        if let Some(identity) = &cfg.prefix_cache {
            pool.enable_prefix_cache(identity);
        }
        stats
            .kv_blocks_total
            .store(pool.total_blocks() as u32, Ordering::SeqCst);
        Ok(Self {
            series: EngineSeries::new(&cfg.labels, cfg.prefix_cache.is_some()),
            waiting: PriorityQueue::new(cfg.priority_aging),
            model,
            cfg,
            stats,
            pool,
            active: Vec::new(),
            secs_per_token: 0.0,
        })
    }

    /// Tokens of context one sequence can hold: the whole pool.
    pub(super) fn kv_capacity(&self) -> usize {
        self.pool.total_blocks() * self.pool.block_size()
    }

    pub(super) fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                match rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    // Every handle is gone: the worker is shutting down.
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            self.tick();
        }
    }

    /// One turn of the loop after the commands: drop the departed, admit,
    /// step, publish the counters.
    pub(super) fn tick(&mut self) {
        self.drop_cancelled();
        self.admit();
        if !self.active.is_empty() {
            // Admission moved sequences out of `queued`: publish before the
            // step so Status never shows them in neither count while a long
            // prefill runs, nor a first token before its sequence.
            self.publish();
            self.step();
        }
        self.publish();
    }

    pub(super) fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(req) => self.submit(*req),
            Command::Abort(key) => self.abort(&key),
        }
    }

    /// Ends the sequence `key` names, waiting or running, as cancelled, with
    /// the tokens it has so far.
    fn abort(&mut self, key: &StreamKey) {
        let named = |s: &Seq<M::SeqState>| {
            s.req.request_id == key.request_id && s.req.attempt_id == key.attempt_id
        };
        if let Some(i) = self.active.iter().position(named) {
            self.finish(i, End::Finished(Finish::Cancelled, None));
        }
        // A waiting sequence (new, or preempted) holds no blocks.
        for mut s in self.waiting.take_where(named) {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            let event = finished(&mut s, Finish::Cancelled, None);
            let _ = s.req.events.send(event);
        }
    }

    /// Queues a submitted sequence, or rejects one that could never fit.
    /// (Request preparation refuses such prompts before they get here.)
    fn submit(&mut self, req: SequenceRequest) {
        let total = self.pool.total_blocks();
        if req.already_emitted > 0 && self.pool.blocks_for(req.context.len()) > total {
            // A continuation longer than the pool: the first worker's cache
            // was full by this token, so it ends here as it would have there.
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = req.events.send(Event::Finished {
                reason: Finish::KvCacheFull,
                stop: None,
                tail: String::new(),
                completion_tokens: req.already_emitted as u32,
                first_token: None,
                total: req.enqueued.elapsed(),
            });
            return;
        }
        let needed = self.pool.blocks_for(req.context.len() + 1);
        if req.already_emitted == 0 && needed > total {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = req.events.send(Event::Rejected(format!(
                "the prompt needs {needed} KV cache blocks but the worker's pool has {total}; \
                 shorten the prompt or raise the worker's --kv-budget-mib"
            )));
            return;
        }
        let mut text = TextStream::new(req.stop.clone());
        // Replay what was delivered before a failover so that held-back
        // bytes and stop-string prefixes are where the client left them.
        let emitted_from = req.context.len() - req.already_emitted;
        for &t in &req.context[emitted_from..] {
            text.push(self.model.token_bytes(t));
        }
        let state = self.model.start_seq(SeqStart {
            request_id: &req.request_id,
            prompt: &req.context[..emitted_from],
            emitted: &req.context[emitted_from..],
        });
        let phase = phase_span!(self.cfg.phase_spans, &req.span, "queue", priority = ?req.priority);
        let (priority, at) = (req.priority, req.enqueued);
        let seq = Seq {
            cache: KvCache::default(),
            sampler: Sampler::new(req.sampling.clone()),
            text,
            generated: req.already_emitted,
            first_token: None,
            started: false,
            phase,
            prefilling: true,
            chunk: 0,
            state,
            req,
        };
        self.waiting.push(priority, at, seq);
    }

    fn drop_cancelled(&mut self) {
        self.remove_waiting(|s| s.req.events.is_closed());
        self.remove_active(|s| s.req.events.is_closed());
    }

    fn remove_waiting(&mut self, gone: impl Fn(&Seq<M::SeqState>) -> bool) {
        // Preempted sequences hold no blocks, so nothing to release here.
        let removed = self.waiting.remove_where(|s| gone(s)) as u32;
        self.stats.queued.fetch_sub(removed, Ordering::SeqCst);
    }

    fn remove_active(&mut self, gone: impl Fn(&Seq<M::SeqState>) -> bool) {
        let mut i = 0;
        while i < self.active.len() {
            if gone(&self.active[i]) {
                let mut s = self.active.remove(i);
                self.pool.release(&mut s.cache);
            } else {
                i += 1;
            }
        }
    }

    /// Prompt tokens the next step may read, after one token per decoding sequence.
    fn step_budget(&self) -> usize {
        let mut budget = self.cfg.max_tokens_per_step.max(1);
        if let (Some(target), true) = (self.cfg.step_latency_target, self.secs_per_token > 0.0) {
            budget = budget.min((target.as_secs_f64() / self.secs_per_token).max(1.0) as usize);
        }
        budget
    }

    fn admit(&mut self) {
        let now = Instant::now();
        while self.active.len() < self.cfg.max_batch.max(1) {
            let Some(mut s) = self.waiting.pop(now) else {
                break;
            };
            // Cached leading blocks are taken first: the first chunk starts
            // after them, and they are no longer evictable to make its room.
            let cached = self.pool.take_cached_prefix(&mut s.cache, &s.req.context);
            let first_chunk = s.pending().min(self.step_budget());
            if self
                .pool
                .reserve(&mut s.cache, cached + first_chunk)
                .is_err()
            {
                // New work waits for blocks; it keeps its place at the head
                // (and its cached blocks, released, are now the most recent).
                self.pool.release(&mut s.cache);
                self.waiting.push_front(s.req.priority, s.req.enqueued, s);
                break;
            }
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            self.count_prompt(s.req.context.len(), cached);
            if !s.started {
                s.started = true;
                let _ = s.req.events.send(Event::Started {
                    queued: now - s.req.enqueued,
                    prompt_tokens_cached: Some(cached as u32),
                });
            }
            s.phase = phase_span!(
                self.cfg.phase_spans,
                &s.req.span,
                "prefill",
                tokens = s.req.context.len(),
                prompt_tokens_cached = cached
            );
            s.prefilling = true;
            self.active.push(s);
        }
    }

    /// Counts an admission's context tokens and those the cache served.
    fn count_prompt(&self, tokens: usize, cached: usize) {
        let st = &self.stats;
        st.prompt_tokens_total
            .fetch_add(tokens as u64, Ordering::Relaxed);
        st.prompt_tokens_cached
            .fetch_add(cached as u64, Ordering::Relaxed);
        self.series.prompt_tokens.increment(tokens as u64);
        self.series.prefix_hit_tokens.increment(cached as u64);
    }

    /// Gives every decoding sequence room for its next token, preempting the
    /// youngest sequences while the pool is short.
    fn reserve_decode(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            let s = &self.active[i];
            if s.pending() == 1 && !s.prefilling {
                let need = s.cache.len() + 1;
                if self.pool.blocks_for(need) > self.pool.total_blocks() {
                    // Not even the whole pool holds its next token: freeing
                    // others would not help, so it ends here, saying why.
                    self.finish(i, End::Finished(Finish::KvCacheFull, None));
                    continue;
                }
                loop {
                    let s = &mut self.active[i];
                    if self.pool.reserve(&mut s.cache, need).is_ok() {
                        break;
                    }
                    debug_assert!(self.active.len() > 1, "alone, it fits the pool");
                    let youngest = self.active.len() - 1;
                    self.preempt(youngest);
                    if youngest == i {
                        break;
                    }
                }
            }
            i += 1;
        }
    }

    fn preempt(&mut self, i: usize) {
        let mut s = self.active.remove(i);
        self.pool.release(&mut s.cache);
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        tracing::info!(request_id = %s.req.request_id, tokens = s.req.context.len(), "preempted: KV pool full; will recompute");
        s.phase = phase_span!(self.cfg.phase_spans, &s.req.span, "queue", preempted = true);
        self.stats.queued.fetch_add(1, Ordering::SeqCst);
        self.waiting.push_front(s.req.priority, s.req.enqueued, s);
    }

    /// Decides each running sequence's chunk for this step.
    fn plan(&mut self) {
        self.reserve_decode();
        let mut budget = self.step_budget();
        for s in &mut self.active {
            s.chunk = 0;
            if !s.prefilling && s.pending() == 1 {
                s.chunk = 1;
            }
        }
        for i in 0..self.active.len() {
            let s = &mut self.active[i];
            if s.chunk > 0 || budget == 0 {
                continue;
            }
            let want = s.pending().min(budget);
            // Take what the pool can give now; the rest waits for a later step.
            let free_tokens = self.pool.free_blocks() * self.pool.block_size()
                + (s.cache.blocks() * self.pool.block_size() - s.cache.len());
            let chunk = want.min(free_tokens);
            if chunk == 0 {
                continue;
            }
            let total = s.cache.len() + chunk;
            if self.pool.reserve(&mut s.cache, total).is_ok() {
                s.chunk = chunk;
                budget -= chunk;
            }
        }
    }

    fn step(&mut self) {
        self.plan();
        let started = Instant::now();
        let stepping: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].chunk > 0)
            .collect();
        if stepping.is_empty() {
            // Nothing fits yet; the pool frees up as sequences end.
            std::thread::sleep(Duration::from_millis(1));
            return;
        }
        self.series.batch_size.record(stepping.len() as f64);
        let output = match self.forward() {
            Ok(output) => output,
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed");
                for mut s in self.active.drain(..) {
                    self.pool.release(&mut s.cache);
                    let _ = s.req.events.send(Event::Failed(e.to_string()));
                }
                return;
            }
        };
        // Before any sequence ends (and lets go of its blocks): what this
        // step wrote completes blocks the prefix cache can now keep.
        for &i in &stepping {
            let s = &mut self.active[i];
            self.pool.register_full_blocks(&mut s.cache, &s.req.context);
        }
        let tokens: usize = self.active.iter().map(|s| s.chunk).sum();
        let per_token = started.elapsed().as_secs_f64() / tokens.max(1) as f64;
        self.secs_per_token = if self.secs_per_token == 0.0 {
            per_token
        } else {
            0.8 * self.secs_per_token + 0.2 * per_token
        };
        self.emit(&stepping, output);
    }

    /// Runs the model over every sequence's chunk.
    fn forward(&mut self) -> Result<StepOutput, ModelError> {
        let mut batch: Vec<BatchSeq<'_, M::SeqState>> = self
            .active
            .iter_mut()
            .filter(|s| s.chunk > 0)
            .map(|s| {
                let from = s.cache.len();
                BatchSeq {
                    step: SeqStep {
                        tokens: &s.req.context[from..from + s.chunk],
                        cache: &mut s.cache,
                    },
                    state: &mut s.state,
                }
            })
            .collect();
        self.model.step(&mut self.pool, &mut batch)
    }

    /// Samples and sends the next token of every sequence `stepping` (indices
    /// into the batch) names whose context is now fully read, and ends those
    /// that are done or that the model failed.
    fn emit(&mut self, stepping: &[usize], output: StepOutput) {
        let StepOutput { mut logits, failed } = output;
        let mut failed: Vec<Option<String>> = {
            let mut by_row = vec![None; stepping.len()];
            for (row, why) in failed {
                if let Some(slot) = by_row.get_mut(row) {
                    *slot = Some(why);
                }
            }
            by_row
        };
        let mut done = Vec::new();
        for ((&i, row), why) in stepping.iter().zip(logits.rows_mut()).zip(&mut failed) {
            let end = match why.take() {
                Some(why) => Some(End::Failed(why)),
                None => next_token(&mut self.active[i], row, &self.model, &self.stats),
            };
            if let Some(end) = end {
                done.push((i, end));
            }
        }
        for (i, end) in done.into_iter().rev() {
            self.finish(i, end);
        }
    }

    /// Ends running sequence `i` and frees its blocks.
    fn finish(&mut self, i: usize, end: End) {
        let mut s = self.active.remove(i);
        self.pool.release(&mut s.cache);
        s.phase.record("tokens", s.generated);
        let event = match end {
            End::Finished(reason, stop) => finished(&mut s, reason, stop),
            End::Failed(why) => Event::Failed(why),
        };
        let _ = s.req.events.send(event);
    }

    fn publish(&self) {
        let st = &self.stats;
        st.active.store(self.active.len() as u32, Ordering::SeqCst);
        let depths = self.waiting.depths();
        for (slot, d) in st.queued_by_priority.iter().zip(depths) {
            slot.store(d as u32, Ordering::SeqCst);
        }
        let used = self.pool.total_blocks() - self.pool.free_blocks();
        st.kv_blocks_used.store(used as u32, Ordering::SeqCst);
        let cached = self.pool.cached_blocks();
        st.kv_blocks_cached.store(cached as u32, Ordering::SeqCst);
        let evicted = self.pool.evicted_blocks();
        st.kv_blocks_evicted.store(evicted, Ordering::SeqCst);
        let series = &self.series;
        for (gauge, d) in series.queue_depth.iter().zip(depths) {
            gauge.set(d as f64);
        }
        series
            .kv_cache_usage
            .set(used as f64 / self.pool.total_blocks().max(1) as f64);
        if let Some(prefix) = &series.prefix {
            prefix.blocks.set(cached as f64);
            prefix.evictions.absolute(evicted);
            let total = st.prompt_tokens_total.load(Ordering::Relaxed);
            let hits = st.prompt_tokens_cached.load(Ordering::Relaxed);
            prefix.hit_ratio.set(hits as f64 / total.max(1) as f64);
        }
    }
}

/// The `Finished` event of `s`: a stop string's text is not sent, any
/// other end releases the text held back so far.
fn finished<S>(s: &mut Seq<S>, reason: Finish, stop: Option<String>) -> Event {
    let tail = if reason == Finish::Stop {
        String::new()
    } else {
        s.text.finish()
    };
    Event::Finished {
        reason,
        stop,
        tail,
        completion_tokens: s.generated as u32,
        first_token: s.first_token,
        total: s.req.enqueued.elapsed(),
    }
}

/// Samples `s`'s next token from `row` when its context is fully read, sends
/// it, and says whether the sequence has ended.
fn next_token<M: StepModel>(
    s: &mut Seq<M::SeqState>,
    row: &mut [f32],
    model: &M,
    stats: &EngineStats,
) -> Option<End> {
    if s.pending() > 0 {
        return None; // mid-prompt: these logits are not a prediction we need
    }
    // The context is the prompt and every completion token so far (those of
    // a continuation's first worker included), so the penalty window and the
    // position are what an undisturbed run has at this token.
    let ctx = &s.req.context;
    let recent = &ctx[ctx.len().saturating_sub(PENALTY_WINDOW)..];
    if s.req.sampling.ignore_eos {
        // Masked before the draw, as llama.cpp does, so that the token is
        // still a function of (seed, position, logits) on a continuation.
        for &eos in model.eos_token_ids() {
            if let Some(logit) = row.get_mut(eos as usize) {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
    let token = s.sampler.sample(row, recent, s.generated);
    if s.prefilling {
        s.prefilling = false;
        // A decode span follows a prefill span, where phases are spans.
        let on = !s.phase.is_disabled();
        s.phase = phase_span!(on, &s.req.span, "decode", tokens = tracing::field::Empty);
    }
    if s.first_token.is_none() {
        s.first_token = Some(s.req.enqueued.elapsed());
    }
    // The end-of-turn token is not part of the output or its usage.
    if model.eos_token_ids().contains(&token) {
        return Some(End::Finished(Finish::Eos, None));
    }
    s.generated += 1;
    stats.tokens_generated.fetch_add(1, Ordering::Relaxed);
    let released = s.text.push(model.token_bytes(token));
    let _ = s.req.events.send(Event::Token {
        id: token,
        text: released.text,
        logprob: s.req.logprobs.then(|| logprob(row, token)),
    });
    s.req.context.push(token);
    if let Some(stop) = released.stop {
        Some(End::Finished(Finish::Stop, Some(stop)))
    } else if s.generated >= s.req.max_tokens || s.req.context.len() >= model.context_length() {
        Some(End::Finished(Finish::Length, None))
    } else {
        None
    }
}

#[cfg(test)]
mod tests;
