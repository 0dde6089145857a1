//! The scheduler's state without its thread: each test submits sequences and
//! runs `tick` (one loop turn) itself, over a tiny model whose next token is
//! the last one plus one, so every output is known in advance and a
//! recomputation can be checked token for token.
use super::*;
use crate::engine::model::Logits;
use crate::engine::sampling::SamplingParams;
use crate::scheduler::Priority;

const VOCAB: u32 = 16;
/// The test model's end-of-turn token.
const EOS: u32 = 15;

/// Next token = last token + 1 (mod VOCAB), and the one after it a distant
/// second (30 nats lower: a weight of 0 at temperature 1, so sampling is as
/// certain as greedy until the first is masked); KV blocks are accounting only,
/// one byte per token, so `kv_budget_bytes` counts tokens. It records the
/// chunks of every step and fails the sequences whose id starts with "fail".
struct CountingModel {
    /// Per step: (request id, tokens fed) of each sequence.
    steps: Vec<Vec<(String, usize)>>,
    bytes: Vec<Vec<u8>>,
    /// The published counters, read at each step as Status would read them.
    stats: Option<Arc<EngineStats>>,
    /// Per step: (active, queued) as published when the step began.
    seen: Vec<(u32, u32)>,
}

impl CountingModel {
    fn new() -> Self {
        Self {
            steps: vec![],
            bytes: (0..VOCAB).map(|t| format!(" t{t}").into_bytes()).collect(),
            stats: None,
            seen: vec![],
        }
    }
}

impl StepModel for CountingModel {
    type SeqState = String;

    fn context_length(&self) -> usize {
        64
    }

    fn eos_token_ids(&self) -> &[u32] {
        &[EOS]
    }

    fn token_bytes(&self, id: u32) -> &[u8] {
        &self.bytes[id as usize]
    }

    fn kv_pool(&self, budget_bytes: usize, block_size: usize) -> candle_core::Result<KvPool> {
        Ok(KvPool::accounting(1, budget_bytes, block_size))
    }

    fn start_seq(&self, seq: SeqStart<'_>) -> String {
        seq.request_id.to_string()
    }

    fn step(
        &mut self,
        pool: &mut KvPool,
        batch: &mut [BatchSeq<'_, String>],
    ) -> Result<StepOutput, ModelError> {
        if let Some(st) = &self.stats {
            let active = st.active.load(Ordering::SeqCst);
            self.seen.push((active, st.queued.load(Ordering::SeqCst)));
        }
        let v = VOCAB as usize;
        let mut values = vec![f32::NEG_INFINITY; batch.len() * v];
        let mut failed = vec![];
        let mut log = vec![];
        for (j, b) in batch.iter_mut().enumerate() {
            let s = &b.step;
            assert_eq!(
                pool.shortfall(s.cache, s.cache.len() + s.tokens.len()),
                0,
                "blocks reserved before the step"
            );
            log.push((b.state.clone(), s.tokens.len()));
            if b.state.starts_with("fail") {
                failed.push((j, "model fault".to_string()));
                continue;
            }
            let next = (s.tokens.last().unwrap() + 1) % VOCAB;
            values[j * v + next as usize] = 0.0;
            values[j * v + ((next + 1) % VOCAB) as usize] = -30.0;
            b.step.cache.advance(b.step.tokens.len());
        }
        self.steps.push(log);
        Ok(StepOutput {
            logits: Logits::new(values, v),
            failed,
        })
    }
}

fn config(max_batch: usize, kv_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch,
        queue_capacity: 64,
        max_tokens_per_step: 64,
        step_latency_target: None,
        kv_budget_bytes: kv_tokens,
        kv_block_size: 4,
        prefix_cache: None,
        priority_aging: Duration::from_secs(1),
        labels: vec![],
        phase_spans: false,
    }
}

fn scheduler(cfg: SchedulerConfig) -> Scheduler<CountingModel> {
    Scheduler::new(CountingModel::new(), cfg, Arc::default()).unwrap()
}

/// Submits as the handle does (counting it as queued).
fn submit(
    s: &mut Scheduler<CountingModel>,
    id: &str,
    prompt: &[u32],
    max_tokens: usize,
    priority: Priority,
    enqueued: Instant,
) -> mpsc::UnboundedReceiver<Event> {
    submit_as(s, (id, ""), prompt, max_tokens, priority, enqueued)
}

/// Submits as `submit` does, under a (request id, attempt id) name.
fn submit_as(
    s: &mut Scheduler<CountingModel>,
    (request_id, attempt_id): (&str, &str),
    prompt: &[u32],
    max_tokens: usize,
    priority: Priority,
    enqueued: Instant,
) -> mpsc::UnboundedReceiver<Event> {
    let (mut req, rx) = request(request_id, prompt, max_tokens);
    req.attempt_id = attempt_id.into();
    req.priority = priority;
    req.enqueued = enqueued;
    submit_request(s, req);
    rx
}

/// A NORMAL request with the default sampling, enqueued now, and the
/// receiver of its events: for tests that set other fields themselves.
fn request(id: &str, context: &[u32], max_tokens: usize) -> (SequenceRequest, Rx) {
    let (tx, rx) = mpsc::unbounded_channel();
    let req = SequenceRequest {
        request_id: id.into(),
        attempt_id: String::new(),
        context: context.to_vec(),
        already_emitted: 0,
        max_tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        logprobs: false,
        events: tx,
        enqueued: Instant::now(),
        priority: Priority::Normal,
        span: tracing::Span::none(),
    };
    (req, rx)
}

/// Submits `req` as the handle does (counting it as queued).
fn submit_request(s: &mut Scheduler<CountingModel>, req: SequenceRequest) {
    s.stats.queued.fetch_add(1, Ordering::SeqCst);
    s.handle(Command::Submit(Box::new(req)));
}

fn normal(s: &mut Scheduler<CountingModel>, id: &str, prompt: &[u32], max_tokens: usize) -> Rx {
    submit(s, id, prompt, max_tokens, Priority::Normal, Instant::now())
}

type Rx = mpsc::UnboundedReceiver<Event>;

/// Everything sent so far: the token ids, and the final event if any.
fn received(rx: &mut Rx) -> (Vec<u32>, Option<Event>) {
    let mut tokens = vec![];
    while let Ok(e) = rx.try_recv() {
        match e {
            Event::Started { .. } => {}
            Event::Token { id, .. } => tokens.push(id),
            end => return (tokens, Some(end)),
        }
    }
    (tokens, None)
}

fn ids(s: &Scheduler<CountingModel>) -> Vec<&str> {
    s.active.iter().map(|q| q.req.request_id.as_str()).collect()
}

/// Ticks until nothing runs or waits (at most `limit` times).
fn run_out(s: &mut Scheduler<CountingModel>, limit: usize) {
    for _ in 0..limit {
        if s.active.is_empty() && s.waiting.is_empty() {
            return;
        }
        s.tick();
    }
    panic!("still busy after {limit} ticks");
}

#[test]
fn admission_is_by_priority_with_aging() {
    let mut s = scheduler(config(1, 256));
    let now = Instant::now();
    let long_ago = now - Duration::from_secs(5);
    let mut normal = submit(&mut s, "normal", &[1], 1, Priority::Normal, now);
    let mut high = submit(&mut s, "high", &[1], 1, Priority::High, now);
    // Waiting five aging periods lifts LOW to the top, ahead of a newer HIGH.
    let mut low = submit(&mut s, "low", &[1], 1, Priority::Low, long_ago);
    let mut order = vec![];
    for _ in 0..3 {
        s.tick();
        for (name, rx) in [
            ("normal", &mut normal),
            ("high", &mut high),
            ("low", &mut low),
        ] {
            if let (_, Some(Event::Finished { .. })) = received(rx) {
                order.push(name);
            }
        }
    }
    assert_eq!(order, ["low", "high", "normal"]);
    assert_eq!(s.stats.queued.load(Ordering::SeqCst), 0);
}

#[test]
fn the_batch_holds_max_batch_and_the_rest_wait() {
    let mut s = scheduler(config(2, 256));
    let _rxs: Vec<Rx> = ["a", "b", "c"]
        .iter()
        .map(|id| normal(&mut s, id, &[1, 2], 5))
        .collect();
    s.tick();
    assert_eq!(ids(&s), ["a", "b"]);
    assert_eq!(s.waiting.len(), 1);
    assert_eq!(s.stats.active.load(Ordering::SeqCst), 2);
    assert_eq!(s.stats.queued.load(Ordering::SeqCst), 1);
    assert_eq!(s.stats.queued_by_priority[1].load(Ordering::SeqCst), 1);
    // Each step ran both running sequences together.
    assert_eq!(s.model.steps[0].len(), 2);
}

#[test]
fn admitted_sequences_are_counted_before_their_first_step() {
    // Status read during a long prefill must see the admitted sequences as
    // running; they have already left the queue.
    let stats = Arc::new(EngineStats::default());
    let mut model = CountingModel::new();
    model.stats = Some(stats.clone());
    let mut s = Scheduler::new(model, config(2, 256), stats).unwrap();
    let _rxs: Vec<Rx> = ["a", "b", "c"]
        .iter()
        .map(|id| normal(&mut s, id, &[1, 2], 5))
        .collect();
    s.tick();
    assert_eq!(s.model.seen, [(2, 1)]);
}

#[test]
fn a_long_prompt_is_read_in_chunks_while_a_stream_decodes() {
    let mut s = scheduler(SchedulerConfig {
        max_tokens_per_step: 8,
        ..config(4, 256)
    });
    let mut running = normal(&mut s, "running", &[1], 10);
    s.tick(); // its prompt, and its first token
    let prompt: Vec<u32> = (0..20).map(|i| i % 10).collect();
    let mut long = normal(&mut s, "long", &prompt, 2);
    for _ in 0..3 {
        s.tick();
    }
    let steps: Vec<_> = s.model.steps[1..4].to_vec();
    let running_step = ("running".to_string(), 1);
    assert_eq!(
        steps,
        [
            vec![running_step.clone(), ("long".into(), 8)],
            vec![running_step.clone(), ("long".into(), 8)],
            vec![running_step, ("long".into(), 4)],
        ]
    );
    // The stream got a token every step; the long prompt's first came with
    // its last chunk.
    assert_eq!(received(&mut running).0, [2, 3, 4, 5]);
    assert_eq!(received(&mut long).0, [10]);
}

#[test]
fn a_full_pool_preempts_the_youngest_which_recomputes_the_same_tokens() {
    // 4 blocks of 4 tokens; two sequences growing to 4 + 8 tokens each.
    let mut s = scheduler(config(2, 16));
    assert_eq!(s.pool.total_blocks(), 4);
    let mut a = normal(&mut s, "a", &[0, 1, 2, 3], 8);
    let mut b = normal(&mut s, "b", &[4, 5, 6, 7], 8);
    let mut ticks = 0;
    while s.stats.preemptions.load(Ordering::Relaxed) == 0 {
        s.tick();
        ticks += 1;
        assert!(ticks < 20, "never preempted");
    }
    // b came second, so it is the one sent back to wait, holding nothing.
    assert_eq!(ids(&s), ["a"]);
    assert_eq!(s.waiting.len(), 1);
    assert_eq!(s.pool.free_blocks(), 4 - s.active[0].cache.blocks());
    run_out(&mut s, 100);
    let (a_tokens, a_end) = received(&mut a);
    let (b_tokens, b_end) = received(&mut b);
    assert_eq!(a_tokens, [4, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(b_tokens, [8, 9, 10, 11, 12, 13, 14]);
    // b's eighth token would be the end-of-turn token.
    assert!(matches!(
        b_end,
        Some(Event::Finished {
            reason: Finish::Eos,
            completion_tokens: 7,
            ..
        })
    ));
    assert!(matches!(
        a_end,
        Some(Event::Finished {
            reason: Finish::Length,
            completion_tokens: 8,
            ..
        })
    ));
    // After the preemption b was read again from its first token on.
    let recompute = s
        .model
        .steps
        .iter()
        .flatten()
        .filter(|(id, n)| id == "b" && *n > 1)
        .count();
    assert_eq!(recompute, 2, "b's prompt, then its recomputation");
    assert_eq!(s.pool.free_blocks(), 4);
}

#[test]
fn a_sequence_whose_receiver_is_dropped_frees_its_blocks() {
    let mut s = scheduler(config(2, 64));
    let rx = normal(&mut s, "gone", &[1, 2, 3, 4, 5], 50);
    let mut stays = normal(&mut s, "stays", &[1], 3);
    s.tick();
    assert!(s.stats.kv_blocks_used.load(Ordering::SeqCst) >= 3);
    drop(rx);
    s.tick();
    assert_eq!(ids(&s), ["stays"]);
    run_out(&mut s, 10);
    assert!(matches!(
        received(&mut stays).1,
        Some(Event::Finished { .. })
    ));
    assert_eq!(s.stats.kv_blocks_used.load(Ordering::SeqCst), 0);
    assert_eq!(s.pool.free_blocks(), s.pool.total_blocks());
}

#[test]
fn a_sequence_needing_more_kv_than_exists_is_rejected() {
    let mut s = scheduler(config(2, 16));
    // 16 prompt tokens and room for one more need 5 blocks of 4; there are 4.
    let mut rx = normal(&mut s, "big", &[1; 16], 4);
    assert!(matches!(received(&mut rx).1, Some(Event::Rejected(_))));
    assert!(s.waiting.is_empty());
    assert_eq!(s.stats.queued.load(Ordering::SeqCst), 0);
    // 15 fit.
    let mut rx = normal(&mut s, "fits", &[1; 15], 1);
    run_out(&mut s, 10);
    assert!(matches!(received(&mut rx).1, Some(Event::Finished { .. })));
}

#[test]
fn a_sequence_the_model_fails_leaves_and_the_rest_carry_on() {
    let mut s = scheduler(config(2, 64));
    let mut doomed = normal(&mut s, "fail-me", &[1, 2], 5);
    let mut fine = normal(&mut s, "fine", &[1, 2], 3);
    run_out(&mut s, 10);
    assert!(
        matches!(received(&mut doomed), (t, Some(Event::Failed(m))) if t.is_empty() && m == "model fault")
    );
    assert_eq!(received(&mut fine).0, [3, 4, 5]);
    assert_eq!(s.pool.free_blocks(), s.pool.total_blocks());
}

#[test]
fn a_sequence_that_outgrows_the_whole_pool_ends_as_kv_cache_full() {
    // 4 blocks of 4 tokens: an 8-token prompt leaves room for 8 more in the
    // cache, so 9 completion tokens (the last is never stored), long before
    // max_tokens or the end-of-turn token (14 tokens away).
    let mut s = scheduler(config(2, 16));
    let mut rx = normal(&mut s, "long", &[1; 8], 50);
    run_out(&mut s, 50);
    let (tokens, end) = received(&mut rx);
    assert_eq!(tokens, (2..=10).collect::<Vec<u32>>());
    assert!(
        matches!(
            end,
            Some(Event::Finished {
                reason: Finish::KvCacheFull,
                completion_tokens: 9,
                ..
            })
        ),
        "{end:?}"
    );
    assert_eq!(s.pool.free_blocks(), s.pool.total_blocks());
}

#[test]
fn a_continuation_past_the_pool_ends_as_kv_cache_full_at_once() {
    // What the first worker sent: 8 prompt tokens and 9 completion tokens,
    // one more than the pool holds; it ended there as KvCacheFull.
    let mut s = scheduler(config(2, 16));
    let mut context = vec![1; 8];
    context.extend(2..=10);
    let (mut req, mut rx) = request("cont", &context, 50);
    req.already_emitted = 9;
    submit_request(&mut s, req);
    assert!(
        matches!(
            received(&mut rx),
            (t, Some(Event::Finished { reason: Finish::KvCacheFull, completion_tokens: 9, .. }))
                if t.is_empty()
        ),
        "a continuation past the pool is a finish, not a refusal"
    );
    assert_eq!(s.stats.queued.load(Ordering::SeqCst), 0);
}

#[test]
fn an_abort_cancels_only_the_stream_it_names() {
    let mut s = scheduler(config(1, 64));
    let now = Instant::now();
    // Two streams of one request id; one slot, so the second waits.
    let mut running = submit_as(&mut s, ("req", "a1"), &[1], 10, Priority::Normal, now);
    let mut waiting = submit_as(&mut s, ("req", "a2"), &[1], 10, Priority::Normal, now);
    let mut other = submit_as(&mut s, ("req", "a3"), &[1], 3, Priority::Normal, now);
    s.tick();
    s.tick();
    s.handle(Command::Abort(StreamKey {
        request_id: "req".into(),
        attempt_id: "a1".into(),
    }));
    let (tokens, end) = received(&mut running);
    assert_eq!(tokens, [2, 3]);
    assert!(
        matches!(
            end,
            Some(Event::Finished {
                reason: Finish::Cancelled,
                completion_tokens: 2,
                ..
            })
        ),
        "{end:?}"
    );
    assert!(s.active.is_empty(), "its slot and blocks are free");
    assert_eq!(s.pool.free_blocks(), s.pool.total_blocks());
    // A waiting stream is cancelled without having run.
    s.handle(Command::Abort(StreamKey {
        request_id: "req".into(),
        attempt_id: "a2".into(),
    }));
    assert!(matches!(
        received(&mut waiting),
        (t, Some(Event::Finished { reason: Finish::Cancelled, completion_tokens: 0, .. }))
            if t.is_empty()
    ));
    assert_eq!(s.stats.queued.load(Ordering::SeqCst), 1);
    // The third, same request id, runs to its end.
    run_out(&mut s, 10);
    assert!(matches!(
        received(&mut other),
        (t, Some(Event::Finished { reason: Finish::Length, .. })) if t == [2, 3, 4]
    ));
}

#[test]
fn ignore_eos_masks_the_end_of_turn_token_and_runs_to_the_length() {
    let mut s = scheduler(config(2, 64));
    let mut ends = normal(&mut s, "ends", &[12], 6);
    let (mut req, mut goes_on) = request("goes-on", &[12], 6);
    req.sampling.ignore_eos = true;
    submit_request(&mut s, req);
    run_out(&mut s, 50);
    let (tokens, end) = received(&mut ends);
    assert_eq!(tokens, [13, 14]);
    assert!(
        matches!(
            end,
            Some(Event::Finished {
                reason: Finish::Eos,
                completion_tokens: 2,
                ..
            })
        ),
        "{end:?}"
    );
    // Where the model's best is the end-of-turn token, its second is taken.
    let (tokens, end) = received(&mut goes_on);
    assert_eq!(tokens, [13, 14, 0, 1, 2, 3]);
    assert!(
        matches!(
            end,
            Some(Event::Finished {
                reason: Finish::Length,
                completion_tokens: 6,
                ..
            })
        ),
        "{end:?}"
    );
}

#[test]
fn under_ignore_eos_a_logprob_is_over_the_tokens_that_could_be_drawn() {
    let mut s = scheduler(config(1, 64));
    let (mut req, mut rx) = request("masked", &[13], 3);
    req.sampling.ignore_eos = true;
    req.logprobs = true;
    submit_request(&mut s, req);
    run_out(&mut s, 50);
    let mut got = vec![];
    while let Ok(e) = rx.try_recv() {
        if let Event::Token { id, logprob, .. } = e {
            got.push((id, logprob.expect("logprobs were asked for")));
        }
    }
    // 14 is the model's best; then the end-of-turn token is masked, and its
    // runner-up (30 nats lower unmasked) is the only token left: certain.
    let ids: Vec<u32> = got.iter().map(|g| g.0).collect();
    assert_eq!(ids, [14, 0, 1]);
    for (id, lp) in got {
        assert!(lp.abs() < 1e-6, "token {id}: logprob {lp}, not 0");
    }
}

mod prefix;
