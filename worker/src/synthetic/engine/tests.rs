//! The synthetic engine behind the real scheduler: rate, capacity, queue
//! limit, stop strings, cancellation, failover continuation, faults, and KV
//! accounting with preemption.
//!
//! The engine runs on the scheduler's own thread, so these tests run on the
//! real clock. Lower bounds on time are exact (a step never ends before its
//! tick, and ticks are one interval apart); upper bounds allow `SLACK` for a
//! loaded machine.
use super::*;
use crate::engine::sampling::SamplingParams;
use crate::scheduler::{Event, Finish, Priority, SequenceRequest, StreamKey, SubmitError};
use crate::synthetic::{output_token, tokenize, WORDS};
use std::sync::atomic::Ordering;
use tokio::sync::mpsc;

/// What a loaded machine may add to a timing.
const SLACK: Duration = Duration::from_millis(200);

fn config(tokens_per_sec: f64) -> SyntheticConfig {
    SyntheticConfig {
        tokens_per_sec,
        error_rate: 0.0,
        first_token_delay: Duration::ZERO,
    }
}

/// 50 tokens a second after a first-token delay of 300 ms, failing
/// `error_rate` of the requests.
fn slow_start(error_rate: f64) -> SyntheticConfig {
    SyntheticConfig {
        error_rate,
        first_token_delay: Duration::from_millis(300),
        ..config(50.0)
    }
}

fn scheduler(max_batch: usize, queue_capacity: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch,
        queue_capacity,
        max_tokens_per_step: 256,
        step_latency_target: None,
        kv_budget_bytes: 256 << 20,
        kv_block_size: 16,
        prefix_cache: None,
        priority_aging: Duration::from_secs(2),
        labels: vec![],
        phase_spans: false,
    }
}

fn engine(cfg: SyntheticConfig, max_batch: usize, queue_capacity: usize) -> EngineHandle {
    start(cfg, scheduler(max_batch, queue_capacity)).expect("an accounting pool")
}

fn request(
    id: &str,
    prompt: &str,
    max_tokens: usize,
    stop: &[&str],
) -> (SequenceRequest, mpsc::UnboundedReceiver<Event>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let req = SequenceRequest {
        request_id: id.into(),
        attempt_id: format!("attempt-{id}"),
        context: tokenize(prompt),
        already_emitted: 0,
        max_tokens,
        sampling: SamplingParams::default(),
        stop: stop.iter().map(|s| s.to_string()).collect(),
        logprobs: false,
        events: tx,
        enqueued: Instant::now(),
        priority: Priority::Normal,
        span: tracing::Span::none(),
    };
    (req, rx)
}

/// Token events (with the time each arrived) and the final event.
async fn drain(rx: &mut mpsc::UnboundedReceiver<Event>) -> (Vec<(u32, String, Instant)>, Event) {
    let mut tokens = vec![];
    loop {
        match rx.recv().await.expect("the engine ends every sequence") {
            Event::Started { .. } => {}
            Event::Token { id, text, .. } => tokens.push((id, text, Instant::now())),
            end => return (tokens, end),
        }
    }
}

/// Submits one request without stop strings: when it was submitted, its
/// tokens (as `drain` gives them) and its final event.
async fn run_one(
    engine: &EngineHandle,
    id: &str,
    prompt: &str,
    max_tokens: usize,
) -> (Instant, Vec<(u32, String, Instant)>, Event) {
    let (req, mut rx) = request(id, prompt, max_tokens, &[]);
    let submitted = Instant::now();
    engine.submit(req).unwrap();
    let (tokens, end) = drain(&mut rx).await;
    (submitted, tokens, end)
}

/// Waits (up to a second) until `check` holds.
async fn until(what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(1);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn within(got: Duration, at_least: Duration) {
    assert!(
        got >= at_least && got <= at_least + SLACK,
        "{got:?}, expected {at_least:?} (+ up to {SLACK:?})"
    );
}

#[tokio::test]
async fn tokens_come_at_the_configured_rate() {
    let engine = engine(config(50.0), 4, 8);
    let (submitted, tokens, end) = run_one(&engine, "a", "hello world", 10).await;
    assert_eq!(tokens.len(), 10);
    // One 20 ms step per token, the first a step after admission.
    within(tokens[0].2 - submitted, Duration::from_millis(20));
    within(tokens[9].2 - submitted, Duration::from_millis(200));
    let Event::Finished {
        reason,
        completion_tokens,
        tail,
        ..
    } = end
    else {
        panic!("expected Finished, got {end:?}");
    };
    assert_eq!(reason, Finish::Length);
    assert_eq!(completion_tokens, 10);
    assert!(tail.is_empty());
    let text: String = tokens.iter().map(|t| t.1.as_str()).collect();
    assert_eq!(text.split_whitespace().count(), 10);
}

#[tokio::test]
async fn capacity_is_max_batch_and_the_rest_queue() {
    let engine = engine(config(100.0), 2, 8);
    let start_time = Instant::now();
    let mut rxs = vec![];
    for id in ["a", "b", "c"] {
        let (req, rx) = request(id, "one two", 5, &[]);
        engine.submit(req).unwrap();
        rxs.push(rx);
    }
    let stats = engine.stats().clone();
    until("two running", || stats.active.load(Ordering::SeqCst) == 2).await;
    assert_eq!(stats.queued.load(Ordering::SeqCst), 1);
    let (a, _) = drain(&mut rxs[0]).await;
    let (c, _) = drain(&mut rxs[2]).await;
    // c starts when a or b finishes (5 steps of 10 ms) and takes 5 more.
    assert!(a.last().unwrap().2 - start_time >= Duration::from_millis(50));
    within(c[0].2 - start_time, Duration::from_millis(60));
    assert!(c[4].2 - start_time >= Duration::from_millis(100));
    assert_eq!(c.len(), 5);
    until("an idle engine", || {
        stats.active.load(Ordering::SeqCst) == 0 && stats.kv_blocks_used.load(Ordering::SeqCst) == 0
    })
    .await;
    assert_eq!(stats.queued.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_full_queue_refuses_at_once() {
    let engine = engine(config(100.0), 1, 1);
    let (a, _rx_a) = request("a", "x", 100, &[]);
    engine.submit(a).unwrap();
    let stats = engine.stats().clone();
    until("a running", || stats.active.load(Ordering::SeqCst) == 1).await;
    let (b, _rx_b) = request("b", "x", 100, &[]);
    engine.submit(b).unwrap(); // b waits
    let (c, _rx_c) = request("c", "x", 100, &[]);
    assert!(matches!(
        engine.submit(c),
        Err(SubmitError::QueueFull { capacity: 1 })
    ));
}

#[tokio::test]
async fn stops_on_a_stop_string_without_sending_it() {
    let prompt = "stop somewhere";
    let ids = tokenize(prompt);
    // The fourth word this prompt produces is the stop string.
    let fourth = WORDS[output_token(&ids, 3) as usize];
    let engine = engine(config(1000.0), 1, 1);
    let (req, mut rx) = request("a", prompt, 50, &[fourth]);
    engine.submit(req).unwrap();
    let (tokens, end) = drain(&mut rx).await;
    assert_eq!(tokens.len(), 4);
    let text: String = tokens.iter().map(|t| t.1.as_str()).collect();
    let expected: String = (0..3)
        .map(|i| format!(" {}", WORDS[output_token(&ids, i) as usize]))
        .collect::<String>()
        + " ";
    assert_eq!(text, expected);
    match end {
        Event::Finished { reason, stop, .. } => {
            assert_eq!(reason, Finish::Stop);
            assert_eq!(stop.as_deref(), Some(fourth));
        }
        other => panic!("expected Finished, got {other:?}"),
    }
}

#[tokio::test]
async fn a_cancelled_sequence_frees_its_slot() {
    let engine = engine(config(100.0), 1, 4);
    let stats = engine.stats().clone();
    let (a, mut rx_a) = request("a", "x", 1000, &[]);
    let (b, mut rx_b) = request("b", "x", 3, &[]);
    engine.submit(a).unwrap();
    engine.submit(b).unwrap();
    // a holds the only slot once it has a token.
    while !matches!(rx_a.recv().await, Some(Event::Token { .. })) {}
    drop(rx_a); // the client of a goes away
                // Had a kept its slot, b would wait for a's 1,000 tokens (10 s).
    let (tokens, end) = tokio::time::timeout(Duration::from_secs(2), drain(&mut rx_b))
        .await
        .expect("b got the slot a's client left");
    assert_eq!(tokens.len(), 3);
    assert!(matches!(end, Event::Finished { .. }));
    until("no sequence", || stats.active.load(Ordering::SeqCst) == 0).await;

    let (c, _rx_c) = request("c", "x", 1000, &[]);
    engine.submit(c).unwrap();
    until("c holding blocks", || {
        stats.kv_blocks_used.load(Ordering::SeqCst) > 0
    })
    .await;
    engine.abort(StreamKey {
        request_id: "c".into(),
        attempt_id: "attempt-c".into(),
    });
    until("c's blocks back", || {
        stats.active.load(Ordering::SeqCst) == 0 && stats.kv_blocks_used.load(Ordering::SeqCst) == 0
    })
    .await;
}

#[tokio::test]
async fn a_continuation_yields_what_the_first_worker_would_have() {
    let engine = engine(config(1000.0), 2, 4);
    let (whole, mut rx) = request("a", "tell me a story", 12, &[]);
    engine.submit(whole).unwrap();
    let (all, _) = drain(&mut rx).await;
    let ids: Vec<u32> = all.iter().map(|t| t.0).collect();
    let prompt = tokenize("tell me a story");
    assert_eq!(
        ids,
        (0..12)
            .map(|i| output_token(&prompt, i))
            .collect::<Vec<_>>()
    );

    let (mut cont, mut rx) = request("b", "tell me a story", 12, &[]);
    cont.context.extend_from_slice(&ids[..5]);
    cont.already_emitted = 5;
    engine.submit(cont).unwrap();
    let (rest, end) = drain(&mut rx).await;
    assert_eq!(rest.iter().map(|t| t.0).collect::<Vec<_>>(), ids[5..]);
    assert!(matches!(
        end,
        Event::Finished {
            completion_tokens: 12,
            ..
        }
    ));
}

#[tokio::test]
async fn injected_faults_fail_before_the_first_token_after_the_delay() {
    let engine = engine(slow_start(1.0), 4, 8);
    let (submitted, tokens, end) = run_one(&engine, "doomed", "hello world", 10).await;
    assert!(tokens.is_empty());
    assert!(
        matches!(end, Event::Failed(ref m) if m == FAULT_MESSAGE),
        "{end:?}"
    );
    within(submitted.elapsed(), Duration::from_millis(320));
    let stats = engine.stats().clone();
    until("the failed sequence's blocks back", || {
        stats.kv_blocks_used.load(Ordering::SeqCst) == 0
    })
    .await;
}

#[tokio::test]
async fn the_first_token_delay_adds_to_the_first_interval_only() {
    let engine = engine(slow_start(0.0), 4, 8);
    let (submitted, tokens, end) = run_one(&engine, "slow", "hello world", 3).await;
    assert!(matches!(end, Event::Finished { .. }));
    within(tokens[0].2 - submitted, Duration::from_millis(320));
    // The delay is not paid again (SLACK is shorter than it).
    within(tokens[2].2 - submitted, Duration::from_millis(360));
}

#[tokio::test]
async fn a_small_kv_budget_preempts_and_recomputes_the_same_words() {
    // 4 blocks of 16 tokens; three sequences growing to 52 tokens each.
    let engine = start(
        config(2000.0),
        SchedulerConfig {
            kv_budget_bytes: KV_BYTES_PER_TOKEN * 16 * 4,
            ..scheduler(3, 8)
        },
    )
    .unwrap();
    let stats = engine.stats().clone();
    assert_eq!(stats.kv_blocks_total.load(Ordering::SeqCst), 4);
    let prompts = [
        "one two three four",
        "five six seven eight",
        "nine ten eleven twelve",
    ];
    let mut rxs = vec![];
    for (i, p) in prompts.iter().enumerate() {
        let (req, rx) = request(&format!("r{i}"), p, 48, &[]);
        engine.submit(req).unwrap();
        rxs.push(rx);
    }
    for (p, rx) in prompts.iter().zip(&mut rxs) {
        let (tokens, end) = drain(rx).await;
        assert!(matches!(end, Event::Finished { .. }), "{end:?}");
        let ids = tokenize(p);
        let want: Vec<u32> = (0..48).map(|i| output_token(&ids, i)).collect();
        assert_eq!(tokens.iter().map(|t| t.0).collect::<Vec<_>>(), want);
    }
    assert!(stats.preemptions.load(Ordering::Relaxed) > 0);
    until("every block back", || {
        stats.kv_blocks_used.load(Ordering::SeqCst) == 0
    })
    .await;
}

#[tokio::test]
async fn a_prompt_larger_than_the_pool_is_rejected() {
    let engine = start(
        config(1000.0),
        SchedulerConfig {
            kv_budget_bytes: KV_BYTES_PER_TOKEN * 16,
            ..scheduler(1, 8)
        },
    )
    .unwrap();
    let (req, mut rx) = request("big", &"word ".repeat(16), 4, &[]);
    engine.submit(req).unwrap();
    let (_, end) = drain(&mut rx).await;
    assert!(matches!(end, Event::Rejected(_)), "{end:?}");
}

#[test]
fn fault_choice_is_deterministic_and_close_to_the_rate() {
    assert!(!injects_fault("any", 0.0));
    assert!(injects_fault("any", 1.0));
    assert_eq!(injects_fault("req-7", 0.5), injects_fault("req-7", 0.5));
    let failed = (0..10_000)
        .filter(|i| injects_fault(&format!("request-{i}"), 0.3))
        .count();
    assert!(
        (2_700..=3_300).contains(&failed),
        "{failed} of 10000 at 0.3"
    );
}
