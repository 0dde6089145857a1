//! The engine with the real model, in-process: batching, chunked prefill and
//! preemption change no token; priorities order the queue; cancellation frees
//! KV blocks.
mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_worker::engine::sampling::SamplingParams;
use tokenmesh_worker::engine::LoadedModel;
use tokenmesh_worker::scheduler::{
    EngineHandle, Event, Priority, SchedulerConfig, SequenceRequest,
};
use tokio::sync::mpsc;

fn model() -> Arc<LoadedModel> {
    Arc::new(LoadedModel::load(&common::model_path(), &device()).expect("model loads"))
}

fn config(max_batch: usize, kv_mib: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch,
        queue_capacity: 64,
        max_tokens_per_step: 64,
        step_latency_target: None,
        kv_budget_bytes: kv_mib << 20,
        kv_block_size: 16,
        prefix_cache: None,
        priority_aging: Duration::from_secs(60),
        labels: vec![],
        phase_spans: false,
    }
}

struct Job {
    prompt: String,
    max_tokens: usize,
    seed: Option<u64>,
    priority: Priority,
}

fn submit(engine: &EngineHandle, m: &LoadedModel, job: &Job) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    let context = m.tokenizer.encode(&job.prompt).unwrap();
    engine
        .submit(SequenceRequest {
            request_id: job.prompt.clone(),
            attempt_id: String::new(),
            context,
            already_emitted: 0,
            max_tokens: job.max_tokens,
            sampling: SamplingParams {
                temperature: if job.seed.is_some() { 0.8 } else { 0.0 },
                seed: job.seed,
                ..Default::default()
            },
            stop: vec![],
            logprobs: false,
            events: tx,
            enqueued: Instant::now(),
            priority: job.priority,
            span: tracing::Span::none(),
        })
        .unwrap();
    rx
}

async fn tokens(mut rx: mpsc::UnboundedReceiver<Event>) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(e) = rx.recv().await {
        match e {
            Event::Token { id, .. } => out.push(id),
            Event::Finished { .. } => return out,
            Event::Failed(m) | Event::Rejected(m) => panic!("{m}"),
            Event::Status(s) => panic!("{s}"),
            Event::Started { .. } | Event::PromptCounted { .. } => {}
            Event::Text { .. } => panic!("the worker's own engine always gives ids"),
        }
    }
    panic!("stream ended without Finished")
}

/// Submits all `jobs` at once to `engine`; each must yield its `expected`
/// tokens (`how` says what the engine does differently, for the message).
async fn same_tokens(
    engine: &EngineHandle,
    m: &LoadedModel,
    jobs: &[Job],
    expected: &[Vec<u32>],
    how: &str,
) {
    let rxs: Vec<_> = jobs.iter().map(|j| submit(engine, m, j)).collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        assert_eq!(
            tokens(rx).await,
            expected[i],
            "job {i} ({:?}) changed {how}",
            jobs[i].prompt
        );
    }
}

fn jobs() -> Vec<Job> {
    let prompts = [
        "1, 2, 3, 4, 5,",
        "Once upon a time, there was a little",
        "The French word for 'thank you' is",
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):",
        "The three primary colors are",
        "In 1492, Columbus",
    ];
    (0..16)
        .map(|i| Job {
            prompt: format!("{}{}", if i >= 8 { "Note: " } else { "" }, prompts[i % 8]),
            max_tokens: 8 + (i * 5) % 24,
            seed: (i % 3 == 0).then_some(i as u64),
            priority: Priority::Normal,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn batching_and_preemption_change_no_token() {
    let m = model();
    let jobs = jobs();
    // Alone: one sequence at a time.
    let alone = EngineHandle::start(m.clone(), config(1, 64)).unwrap();
    let mut expected = Vec::new();
    for j in &jobs {
        expected.push(tokens(submit(&alone, &m, j)).await);
    }
    // Together: 16 sequences share every step.
    let together = EngineHandle::start(m.clone(), config(16, 64)).unwrap();
    same_tokens(&together, &m, &jobs, &expected, "in a batch").await;
    // A pool of 4 MiB (about 90 tokens): sequences are preempted and recomputed.
    let tiny = EngineHandle::start(m.clone(), config(16, 4)).unwrap();
    same_tokens(&tiny, &m, &jobs, &expected, "by preemption").await;
    let preempted = tiny.stats().preemptions.load(Ordering::Relaxed);
    assert!(preempted > 0, "the tiny pool never preempted");
    // The engine publishes its counters after the step that sent the last
    // Finished, so the test can read them a moment before that.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tiny.stats().kv_blocks_used.load(Ordering::SeqCst) != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(tiny.stats().kv_blocks_used.load(Ordering::SeqCst), 0);
    eprintln!("preemptions with a 4 MiB pool: {preempted}");
}

#[tokio::test(flavor = "multi_thread")]
async fn long_prompt_is_read_in_chunks_while_streams_continue() {
    let m = model();
    let engine = EngineHandle::start(m.clone(), config(4, 256)).unwrap();
    let mut running = submit(
        &engine,
        &m,
        &Job {
            prompt: "1, 2, 3, 4, 5,".into(),
            max_tokens: 400,
            seed: None,
            priority: Priority::Normal,
        },
    );
    // Wait until it decodes.
    while !matches!(running.recv().await, Some(Event::Token { .. })) {}
    let long_prompt = "The quick brown fox jumps over the lazy dog. ".repeat(200);
    let prompt_tokens = m.tokenizer.encode(&long_prompt).unwrap().len();
    assert!(prompt_tokens >= 2000, "{prompt_tokens}");
    let mut long = submit(
        &engine,
        &m,
        &Job {
            prompt: long_prompt,
            max_tokens: 2,
            seed: None,
            priority: Priority::Normal,
        },
    );
    // Count the running stream's tokens until the long prompt's first token.
    let mut during = 0;
    loop {
        tokio::select! {
            e = long.recv() => if matches!(e, Some(Event::Token { .. })) { break },
            e = running.recv() => if matches!(e, Some(Event::Token { .. })) { during += 1 },
        }
    }
    // 64 tokens per step: the prompt takes about prompt_tokens / 63 steps, and
    // the running stream gets a token in every one of them.
    let steps = prompt_tokens / 64;
    assert!(
        during >= steps - 2,
        "{during} tokens during {steps} prefill steps"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn high_priority_overtakes_and_cancel_frees_blocks() {
    let m = model();
    let engine = EngineHandle::start(m.clone(), config(1, 64)).unwrap();
    let job = |p: &str, priority| Job {
        prompt: p.into(),
        max_tokens: 3,
        seed: None,
        priority,
    };
    let busy = submit(
        &engine,
        &m,
        &Job {
            max_tokens: 30,
            ..job("1, 2, 3,", Priority::Normal)
        },
    );
    let mut low = submit(&engine, &m, &job("Low", Priority::Low));
    let mut high = submit(&engine, &m, &job("High", Priority::High));
    let mut order = Vec::new();
    for _ in 0..2 {
        tokio::select! {
            Some(Event::Started { .. }) = low.recv() => order.push("low"),
            Some(Event::Started { .. }) = high.recv() => order.push("high"),
        }
    }
    assert_eq!(order, vec!["high", "low"]);
    drop(busy);
    // A cancelled sequence leaves within a step and its blocks go back.
    let mut long = submit(
        &engine,
        &m,
        &Job {
            max_tokens: 300,
            ..job("1, 2, 3,", Priority::Normal)
        },
    );
    while !matches!(long.recv().await, Some(Event::Token { .. })) {}
    // Stats are published at the end of the step that sent the token.
    let deadline = Instant::now() + Duration::from_secs(2);
    while engine.stats().kv_blocks_used.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < deadline,
            "a running sequence holds no blocks"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(long);
    let deadline = Instant::now() + Duration::from_secs(2);
    while engine.stats().kv_blocks_used.load(Ordering::SeqCst) > 0 {
        assert!(Instant::now() < deadline, "blocks not freed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `TOKENMESH_TEST_DEVICE` (e.g. cuda:0 in a `--features cuda` build), else cpu.
fn device() -> candle_core::Device {
    let spec = std::env::var("TOKENMESH_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    tokenmesh_worker::accelerator::Accelerator::open(&spec)
        .expect("test device")
        .device
}
