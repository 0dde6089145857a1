//! The synthetic engine under paused time: rate, capacity, queue limit, stop
//! strings, cancellation and failover continuation.
use super::*;
use crate::engine::sampling::SamplingParams;
use crate::scheduler::SubmitError;
use crate::synthetic::{tokenize, WORDS};

fn config(tokens_per_sec: f64, max_batch: usize, queue_capacity: usize) -> SyntheticConfig {
    SyntheticConfig {
        tokens_per_sec,
        max_batch,
        queue_capacity,
        error_rate: 0.0,
        first_token_delay: Duration::ZERO,
    }
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
        context: tokenize(prompt),
        already_emitted: 0,
        max_tokens,
        sampling: SamplingParams::default(),
        stop: stop.iter().map(|s| s.to_string()).collect(),
        logprobs: false,
        events: tx,
        enqueued: std::time::Instant::now(),
        priority: crate::scheduler::Priority::Normal,
        span: tracing::Span::none(),
    };
    (req, rx)
}

/// Token events (with the tokio time each arrived) and the final event.
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

#[tokio::test(start_paused = true)]
async fn tokens_come_at_the_configured_rate() {
    let engine = start(config(50.0, 4, 8));
    let (req, mut rx) = request("a", "hello world", 10, &[]);
    let submitted = Instant::now();
    engine.submit(req).unwrap();
    let (tokens, end) = drain(&mut rx).await;
    assert_eq!(tokens.len(), 10);
    assert_eq!(tokens[0].2 - submitted, Duration::from_millis(20));
    for pair in tokens.windows(2) {
        assert_eq!(pair[1].2 - pair[0].2, Duration::from_millis(20));
    }
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

#[tokio::test(start_paused = true)]
async fn capacity_is_max_batch_and_the_rest_queue() {
    let engine = start(config(100.0, 2, 8));
    let mut rxs = vec![];
    for id in ["a", "b", "c"] {
        let (req, rx) = request(id, "one two", 5, &[]);
        engine.submit(req).unwrap();
        rxs.push(rx);
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(engine.stats().active.load(Ordering::SeqCst), 2);
    assert_eq!(engine.stats().queued.load(Ordering::SeqCst), 1);
    let start_time = Instant::now();
    let (a, _) = drain(&mut rxs[0]).await;
    let (c, _) = drain(&mut rxs[2]).await;
    // c starts when a and b finish (5 tokens × 10 ms) and takes 5 intervals more.
    assert_eq!(a.last().unwrap().2 - start_time, Duration::from_millis(49));
    assert_eq!(c[0].2 - a.last().unwrap().2, Duration::from_millis(10));
    assert_eq!(c.len(), 5);
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(engine.stats().active.load(Ordering::SeqCst), 0);
    assert_eq!(engine.stats().queued.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_refuses_at_once() {
    let engine = start(config(100.0, 1, 1));
    let (a, _rx_a) = request("a", "x", 100, &[]);
    engine.submit(a).unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await; // a runs
    let (b, _rx_b) = request("b", "x", 100, &[]);
    engine.submit(b).unwrap(); // b waits
    let (c, _rx_c) = request("c", "x", 100, &[]);
    assert!(matches!(
        engine.submit(c),
        Err(SubmitError::QueueFull { capacity: 1 })
    ));
}

#[tokio::test(start_paused = true)]
async fn stops_on_a_stop_string_without_sending_it() {
    let prompt = "stop somewhere";
    let ids = tokenize(prompt);
    // The fourth word this prompt produces is the stop string.
    let fourth = WORDS[output_token(&ids, 3) as usize];
    let engine = start(config(1000.0, 1, 1));
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

#[tokio::test(start_paused = true)]
async fn a_cancelled_sequence_frees_its_slot() {
    let engine = start(config(100.0, 1, 4));
    let (a, rx_a) = request("a", "x", 1000, &[]);
    let (b, mut rx_b) = request("b", "x", 3, &[]);
    engine.submit(a).unwrap();
    engine.submit(b).unwrap();
    tokio::time::sleep(Duration::from_millis(25)).await;
    drop(rx_a); // the client of a goes away
    let (tokens, end) = drain(&mut rx_b).await;
    assert_eq!(tokens.len(), 3);
    assert!(matches!(end, Event::Finished { .. }));
    assert_eq!(engine.stats().active.load(Ordering::SeqCst), 0);

    let (c, _rx_c) = request("c", "x", 1000, &[]);
    engine.submit(c).unwrap();
    tokio::time::sleep(Duration::from_millis(25)).await;
    engine.abort("c");
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(engine.stats().active.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_continuation_yields_what_the_first_worker_would_have() {
    let engine = start(config(1000.0, 2, 4));
    let (whole, mut rx) = request("a", "tell me a story", 12, &[]);
    engine.submit(whole).unwrap();
    let (all, _) = drain(&mut rx).await;
    let ids: Vec<u32> = all.iter().map(|t| t.0).collect();

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

#[tokio::test(start_paused = true)]
async fn injected_faults_fail_before_the_first_token_after_the_delay() {
    let engine = start(SyntheticConfig {
        error_rate: 1.0,
        first_token_delay: Duration::from_millis(300),
        ..config(50.0, 4, 8)
    });
    let (req, mut rx) = request("doomed", "hello world", 10, &[]);
    let submitted = Instant::now();
    engine.submit(req).unwrap();
    let (tokens, end) = drain(&mut rx).await;
    assert!(tokens.is_empty());
    assert!(
        matches!(end, Event::Failed(ref m) if m == FAULT_MESSAGE),
        "{end:?}"
    );
    assert_eq!(Instant::now() - submitted, Duration::from_millis(320));
}

#[tokio::test(start_paused = true)]
async fn the_first_token_delay_adds_to_the_first_interval_only() {
    let engine = start(SyntheticConfig {
        first_token_delay: Duration::from_millis(300),
        ..config(50.0, 4, 8)
    });
    let (req, mut rx) = request("slow", "hello world", 3, &[]);
    let submitted = Instant::now();
    engine.submit(req).unwrap();
    let (tokens, end) = drain(&mut rx).await;
    assert!(matches!(end, Event::Finished { .. }));
    assert_eq!(tokens[0].2 - submitted, Duration::from_millis(320));
    assert_eq!(tokens[2].2 - tokens[0].2, Duration::from_millis(40));
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
