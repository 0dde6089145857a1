//! The synthetic engine's model: a [`StepModel`] whose every step lasts one
//! tick of `1 / tokens_per_sec` and whose logits are one-hot on the next word
//! of the synthetic rule. The scheduler's own thread runs it, so queueing,
//! batching, KV accounting, preemption, sampling and stop strings are the
//! real ones; only the forward pass is made up.
use super::{fnv1a, seed_of, word, WORDS};
use crate::engine::kv::KvPool;
use crate::engine::model::{BatchSeq, Logits, ModelError, SeqStart, StepModel, StepOutput};
use crate::scheduler::{EngineHandle, SchedulerConfig};
use std::time::{Duration, Instant};

/// Rate and faults of the synthetic engine (its capacity and queue are the
/// scheduler's `--max-batch` and `--queue-capacity`).
#[derive(Clone, Debug)]
pub struct SyntheticConfig {
    /// Tokens per second of each running sequence.
    pub tokens_per_sec: f64,
    /// Fault injection: the fraction (0..=1) of new sequences that fail
    /// before their first token.
    pub error_rate: f64,
    /// Extra delay before each sequence's first token.
    pub first_token_delay: Duration,
}

impl SyntheticConfig {
    /// Time between two tokens of one sequence: the length of a step.
    pub fn interval(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.tokens_per_sec)
    }
}

/// The message of an injected fault.
pub const FAULT_MESSAGE: &str = "synthetic fault injected";

/// KV cache bytes a synthetic token is counted at against `--kv-budget-mib`
/// (nothing is stored): the default 256 MiB holds 262,144 tokens.
pub const KV_BYTES_PER_TOKEN: usize = 1024;

/// Whether a request fails under fault injection at `rate`: a hash of its id
/// mapped onto [0, 1), so the choice is the same on every worker and run, and
/// `rate` of all ids fail.
pub fn injects_fault(request_id: &str, rate: f64) -> bool {
    const SCALE: u64 = 1 << 24;
    let point = (fnv1a(request_id.as_bytes()) % SCALE) as f64 / SCALE as f64;
    point < rate
}

/// Starts the scheduler's engine thread over the synthetic model; fails
/// only where the scheduler's own start does.
///
/// Panics if `tokens_per_sec` is not a positive finite number or
/// `error_rate` is outside 0..=1 (the worker's configuration checks both
/// first).
pub fn start(
    cfg: SyntheticConfig,
    scheduler: SchedulerConfig,
) -> Result<EngineHandle, candle_core::Error> {
    EngineHandle::start(SyntheticStepModel::new(cfg), scheduler)
}

/// The synthetic model as the scheduler drives it.
pub struct SyntheticStepModel {
    interval: Duration,
    error_rate: f64,
    first_token_delay: Duration,
    /// The bytes of every word's token.
    bytes: Vec<Vec<u8>>,
    /// When the last step ended, to keep the cadence of back-to-back steps.
    last_tick: Option<Instant>,
}

/// What the synthetic model keeps for one sequence.
pub struct SyntheticSeq {
    /// The prompt's hash, which fixes the output word cycle.
    seed: usize,
    prompt_len: usize,
    /// Completion index of the first token this worker emits (after a
    /// failover, the tokens before it were emitted elsewhere).
    first: usize,
    /// Fails when its first token is due (fault injection).
    fault: bool,
    /// When its first token may come: set by the first step that could
    /// produce it, `first_token_delay` after that step's end.
    due: Option<Instant>,
}

impl SyntheticStepModel {
    /// Panics on a rate or error rate the worker's configuration refuses.
    pub fn new(cfg: SyntheticConfig) -> Self {
        assert!(
            cfg.tokens_per_sec.is_finite() && cfg.tokens_per_sec > 0.0,
            "tokens_per_sec must be positive"
        );
        assert!(
            (0.0..=1.0).contains(&cfg.error_rate),
            "error_rate must be in 0..=1"
        );
        Self {
            interval: cfg.interval(),
            error_rate: cfg.error_rate,
            first_token_delay: cfg.first_token_delay,
            bytes: (0..WORDS.len() as u32).map(super::token_bytes).collect(),
            last_tick: None,
        }
    }

    /// Sleeps until the end of this step and returns it. Back-to-back steps
    /// end one interval after the previous end, not after now, so a late
    /// wake-up does not lower the rate; after an idle spell (or falling a
    /// whole interval behind) the cadence restarts from now.
    fn tick(&mut self) -> Instant {
        let now = Instant::now();
        let base = match self.last_tick {
            Some(last) if now <= last + self.interval => last,
            _ => now,
        };
        let end = base + self.interval;
        std::thread::sleep(end.saturating_duration_since(now));
        self.last_tick = Some(end);
        end
    }
}

impl StepModel for SyntheticStepModel {
    type SeqState = SyntheticSeq;

    fn context_length(&self) -> usize {
        super::CONTEXT_LENGTH
    }

    fn eos_token_ids(&self) -> &[u32] {
        // Sequences end on max_tokens, a stop string or the context window.
        &[]
    }

    fn token_bytes(&self, id: u32) -> &[u8] {
        &self.bytes[id as usize % WORDS.len()]
    }

    fn kv_pool(&self, budget_bytes: usize, block_size: usize) -> candle_core::Result<KvPool> {
        Ok(KvPool::accounting(
            KV_BYTES_PER_TOKEN,
            budget_bytes,
            block_size,
        ))
    }

    fn start_seq(&self, seq: SeqStart<'_>) -> SyntheticSeq {
        SyntheticSeq {
            seed: seed_of(seq.prompt),
            prompt_len: seq.prompt.len(),
            first: seq.emitted.len(),
            // Faults hit new requests only; a continuation after a failover
            // already had its first token.
            fault: seq.emitted.is_empty()
                && self.error_rate > 0.0
                && injects_fault(seq.request_id, self.error_rate),
            due: None,
        }
    }

    fn step(
        &mut self,
        _pool: &mut KvPool,
        batch: &mut [BatchSeq<'_, SyntheticSeq>],
    ) -> Result<StepOutput, ModelError> {
        let end = self.tick();
        let vocab = WORDS.len();
        let mut values = vec![f32::NEG_INFINITY; batch.len() * vocab];
        let mut failed = Vec::new();
        for (j, b) in batch.iter_mut().enumerate() {
            let s = &mut *b.state;
            // Positions read once this step is done; the row predicts the next.
            let read = b.step.cache.len() + b.step.tokens.len();
            if read == s.prompt_len + s.first {
                let due = *s.due.get_or_insert(end + self.first_token_delay);
                if end < due {
                    // Not yet: all but the last token are read, so the step
                    // comes again and waiting costs the step's budget one
                    // token.
                    b.step.cache.advance(b.step.tokens.len() - 1);
                    continue;
                }
                if s.fault {
                    tracing::debug!("synthetic fault injected");
                    failed.push((j, FAULT_MESSAGE.to_string()));
                    continue;
                }
            }
            b.step.cache.advance(b.step.tokens.len());
            if let Some(index) = read.checked_sub(s.prompt_len) {
                values[j * vocab + word(s.seed, index) as usize] = 0.0;
            }
        }
        Ok(StepOutput {
            logits: Logits::new(values, vocab),
            failed,
        })
    }
}

#[cfg(test)]
mod tests;
