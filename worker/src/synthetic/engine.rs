//! The synthetic engine's scheduler: a tokio task that consumes the same
//! commands as the model's engine thread and paces tokens with timers, so
//! tests can drive it with `tokio::time::pause`.
use super::{fnv1a, output_token, token_bytes, CONTEXT_LENGTH};
use crate::engine::detokenize::TextStream;
use crate::scheduler::{Command, EngineHandle, EngineStats, Event, Finish, SequenceRequest};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Rate and capacity of the synthetic engine.
#[derive(Clone, Debug)]
pub struct SyntheticConfig {
    /// Tokens per second of each running sequence.
    pub tokens_per_sec: f64,
    /// Sequences running at once.
    pub max_batch: usize,
    /// Sequences allowed to wait for a slot.
    pub queue_capacity: usize,
    /// Fault injection: the fraction (0..=1) of new sequences that fail
    /// before their first token.
    pub error_rate: f64,
    /// Extra delay before each sequence's first token.
    pub first_token_delay: Duration,
}

impl SyntheticConfig {
    /// Time between two tokens of one sequence.
    pub fn interval(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.tokens_per_sec)
    }
}

/// The message of an injected fault.
pub const FAULT_MESSAGE: &str = "synthetic fault injected";

/// Whether a request fails under fault injection at `rate`: a hash of its id
/// mapped onto [0, 1), so the choice is the same on every worker and run, and
/// `rate` of all ids fail.
pub fn injects_fault(request_id: &str, rate: f64) -> bool {
    const SCALE: u64 = 1 << 24;
    let point = (fnv1a(request_id.as_bytes()) % SCALE) as f64 / SCALE as f64;
    point < rate
}

/// Starts the synthetic engine on the current tokio runtime.
///
/// Panics if `tokens_per_sec` is not a positive finite number (the worker's
/// configuration checks it first).
pub fn start(cfg: SyntheticConfig) -> EngineHandle {
    assert!(
        cfg.tokens_per_sec.is_finite() && cfg.tokens_per_sec > 0.0,
        "tokens_per_sec must be positive"
    );
    assert!(
        (0.0..=1.0).contains(&cfg.error_rate),
        "error_rate must be in 0..=1"
    );
    let (handle, rx) = EngineHandle::channel(cfg.queue_capacity);
    let engine = Synthetic {
        interval: cfg.interval(),
        error_rate: cfg.error_rate,
        first_token_delay: cfg.first_token_delay,
        max_batch: cfg.max_batch.max(1),
        stats: handle.stats().clone(),
        waiting: VecDeque::new(),
        active: Vec::new(),
    };
    tokio::spawn(engine.run(rx));
    handle
}

struct Active {
    req: SequenceRequest,
    text: TextStream,
    /// Prompt token ids, which fix the output word cycle.
    prompt: Vec<u32>,
    generated: usize,
    next_at: Instant,
    first_token: Option<Duration>,
    /// Fails when its first token is due (fault injection).
    fault: bool,
}

struct Synthetic {
    interval: Duration,
    error_rate: f64,
    first_token_delay: Duration,
    max_batch: usize,
    stats: Arc<EngineStats>,
    waiting: VecDeque<SequenceRequest>,
    active: Vec<Active>,
}

impl Synthetic {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        let mut open = true;
        loop {
            if !open && self.active.is_empty() && self.waiting.is_empty() {
                return;
            }
            let next = self.active.iter().map(|a| a.next_at).min();
            tokio::select! {
                cmd = rx.recv(), if open => match cmd {
                    Some(cmd) => self.handle(cmd),
                    // The handle is gone: finish what runs, then stop.
                    None => open = false,
                },
                _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                    self.emit_due(Instant::now());
                }
            }
            self.drop_cancelled();
            self.admit();
            self.stats
                .active
                .store(self.active.len() as u32, Ordering::SeqCst);
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(req) => self.waiting.push_back(*req),
            Command::Abort(id) => {
                self.remove_waiting(|r| r.request_id == id);
                self.active.retain(|a| a.req.request_id != id);
            }
        }
    }

    fn drop_cancelled(&mut self) {
        self.remove_waiting(|r| r.events.is_closed());
        self.active.retain(|a| !a.req.events.is_closed());
    }

    fn remove_waiting(&mut self, gone: impl Fn(&SequenceRequest) -> bool) {
        let before = self.waiting.len();
        self.waiting.retain(|r| !gone(r));
        let removed = (before - self.waiting.len()) as u32;
        self.stats.queued.fetch_sub(removed, Ordering::SeqCst);
    }

    fn admit(&mut self) {
        while self.active.len() < self.max_batch {
            let Some(req) = self.waiting.pop_front() else {
                break;
            };
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            let emitted_from = req.context.len() - req.already_emitted;
            let prompt = req.context[..emitted_from].to_vec();
            // Replay what was delivered before a failover, as the real engine
            // does, so stop-string prefixes are where the client left them.
            let mut text = TextStream::new(req.stop.clone());
            for &t in &req.context[emitted_from..] {
                text.push(&token_bytes(t));
            }
            let _ = req.events.send(Event::Started {
                queued: req.enqueued.elapsed(),
            });
            // Faults hit new requests only; a continuation after a failover
            // already had its first token.
            let fault = req.already_emitted == 0
                && self.error_rate > 0.0
                && injects_fault(&req.request_id, self.error_rate);
            self.active.push(Active {
                generated: req.already_emitted,
                text,
                prompt,
                next_at: Instant::now() + self.first_token_delay + self.interval,
                first_token: None,
                fault,
                req,
            });
        }
    }

    /// Emits every token that is due by `now`. Deadlines advance by the
    /// interval from the previous deadline, not from `now`, so a late wake-up
    /// does not lower the rate.
    fn emit_due(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.active.len() {
            let a = &mut self.active[i];
            let mut ended = None;
            while a.next_at <= now && ended.is_none() {
                ended = emit_one(a, &self.stats);
                a.next_at += self.interval;
            }
            match ended {
                Some(end) => {
                    let a = self.active.remove(i);
                    finish(a, end);
                }
                None => i += 1,
            }
        }
    }
}

/// How a sequence ended: a finish reason with its stop string, an injected
/// fault, or gone (the client stopped listening).
enum End {
    Finished(Finish, Option<String>),
    Fault,
    Gone,
}

fn emit_one(a: &mut Active, stats: &EngineStats) -> Option<End> {
    if a.fault {
        return Some(End::Fault);
    }
    let id = output_token(&a.prompt, a.generated);
    if a.first_token.is_none() {
        a.first_token = Some(a.req.enqueued.elapsed());
    }
    a.generated += 1;
    stats.tokens_generated.fetch_add(1, Ordering::Relaxed);
    a.req.context.push(id);
    let released = a.text.push(&token_bytes(id));
    let sent = a.req.events.send(Event::Token {
        id,
        text: released.text,
        // Synthetic tokens are certain.
        logprob: a.req.logprobs.then_some(0.0),
    });
    if sent.is_err() {
        return Some(End::Gone);
    }
    if let Some(stop) = released.stop {
        Some(End::Finished(Finish::Stop, Some(stop)))
    } else if a.generated >= a.req.max_tokens || a.req.context.len() + 1 >= CONTEXT_LENGTH {
        Some(End::Finished(Finish::Length, None))
    } else {
        None
    }
}

fn finish(mut a: Active, end: End) {
    let (reason, stop) = match end {
        End::Finished(reason, stop) => (reason, stop),
        End::Fault => {
            tracing::debug!(request_id = %a.req.request_id, "synthetic fault injected");
            let _ = a.req.events.send(Event::Failed(FAULT_MESSAGE.into()));
            return;
        }
        End::Gone => return,
    };
    let tail = if reason == Finish::Stop {
        String::new()
    } else {
        a.text.finish()
    };
    let _ = a.req.events.send(Event::Finished {
        reason,
        stop,
        tail,
        completion_tokens: a.generated as u32,
        first_token: a.first_token,
        total: a.req.enqueued.elapsed(),
    });
}

#[cfg(test)]
mod tests;
