//! Time to first token of a request whose long system prompt an earlier
//! request already sent, with prefix caching on and off: the real model
//! behind the real scheduler, in-process (no gRPC), one request at a time.
//!
//! For each setting a fresh engine serves a warm-up request (system prompt
//! and question 0), then `REPS` requests with the same system prompt and
//! other questions; the time from submit to the first token of each is
//! recorded. Needs the default model (`TOKENMESH_TEST_MODEL`, else the model
//! cache).
//!
//! Run: `cargo bench -p tokenmesh-worker --bench prefix_cache`
//! (`TOKENMESH_THREADS` sets the compute threads, default every core;
//! `SYSTEM_TOKENS` the system prompt's length, default 1500; `REPS` the
//! measured requests per setting, default 7).
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_tests::model_path;
use tokenmesh_worker::engine::chat_template::ChatTurn;
use tokenmesh_worker::engine::sampling::SamplingParams;
use tokenmesh_worker::engine::{LoadOptions, LoadedModel};
use tokenmesh_worker::scheduler::{
    EngineHandle, Event, Priority, SchedulerConfig, SequenceRequest,
};
use tokio::sync::mpsc;

/// A system prompt of about `tokens` tokens: numbered house rules.
fn system_prompt(model: &LoadedModel, tokens: usize) -> String {
    let mut text =
        String::from("You are the assistant of a lighthouse museum. Follow every rule below.\n");
    let mut i = 1;
    while model.tokenizer.encode(&text).unwrap().len() < tokens {
        text.push_str(&format!(
            "Rule {i}: when a visitor asks about exhibit {i}, explain its history in plain \
             words, give the room number {}, and say whether children may touch it.\n",
            100 + i * 7 % 50
        ));
        i += 1;
    }
    text
}

fn prompt(model: &LoadedModel, system: &str, question: &str) -> Vec<u32> {
    let turns = [
        ChatTurn {
            role: "system".into(),
            content: system.into(),
        },
        ChatTurn {
            role: "user".into(),
            content: question.into(),
        },
    ];
    let text = model
        .template
        .as_ref()
        .unwrap()
        .render(&turns, true)
        .unwrap();
    model.tokenizer.encode(&text).unwrap()
}

/// Time from submit to the first token.
async fn ttft(engine: &EngineHandle, context: Vec<u32>) -> Duration {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    engine
        .submit(SequenceRequest {
            request_id: "bench".into(),
            attempt_id: String::new(),
            context,
            already_emitted: 0,
            max_tokens: 1,
            sampling: SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            stop: vec![],
            logprobs: false,
            events: tx,
            enqueued: start,
            priority: Priority::Normal,
            span: tracing::Span::none(),
        })
        .unwrap();
    let mut first = None;
    while let Some(e) = rx.recv().await {
        match e {
            Event::Token { .. } => first = first.or(Some(start.elapsed())),
            Event::Finished { first_token, .. } => return first.or(first_token).unwrap(),
            Event::Failed(m) | Event::Rejected(m) => panic!("{m}"),
            Event::Status(s) => panic!("{s}"),
            Event::Started { .. } | Event::PromptCounted { .. } => {}
            Event::Text { .. } => panic!("the worker's own engine always gives ids"),
        }
    }
    panic!("stream ended without Finished")
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn env_usize(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let path = model_path();
    if !path.is_file() {
        eprintln!("{} is missing: run scripts/test.sh first", path.display());
        return;
    }
    // A bench is a binary: its settings come from the environment here.
    let opts = LoadOptions {
        threads: std::env::var("TOKENMESH_THREADS")
            .ok()
            .and_then(|v| v.parse().ok()),
        ..Default::default()
    };
    let reps = env_usize("REPS", 7).max(1);
    let model = Arc::new(
        LoadedModel::load_with(&path, &candle_core::Device::Cpu, &opts).expect("model loads"),
    );
    let system = system_prompt(&model, env_usize("SYSTEM_TOKENS", 1500));
    let contexts: Vec<Vec<u32>> = (0..=reps)
        .map(|i| {
            prompt(
                &model,
                &system,
                &format!("Where is exhibit {}?", 3 + i * 11),
            )
        })
        .collect();
    println!(
        "prompt: {} tokens ({} shared), {reps} measured requests per setting",
        contexts[1].len(),
        contexts[0]
            .iter()
            .zip(&contexts[1])
            .take_while(|(a, b)| a == b)
            .count()
    );
    let mut medians = Vec::new();
    for cache in [false, true] {
        let cfg = SchedulerConfig {
            max_batch: 8,
            queue_capacity: 64,
            max_tokens_per_step: 256,
            step_latency_target: None,
            kv_budget_bytes: 256 << 20,
            kv_block_size: 16,
            priority_aging: Duration::from_secs(60),
            prefix_cache: cache.then(|| format!("{}:bench", model.digest)),
            labels: vec![],
            phase_spans: false,
        };
        let engine = EngineHandle::start(model.clone(), cfg).unwrap();
        let warm = ttft(&engine, contexts[0].clone()).await;
        let mut times = Vec::new();
        for c in &contexts[1..] {
            times.push(ttft(&engine, c.clone()).await);
        }
        let stats = engine.stats();
        let hit = stats
            .prompt_tokens_cached
            .load(std::sync::atomic::Ordering::Relaxed);
        let total = stats
            .prompt_tokens_total
            .load(std::sync::atomic::Ordering::Relaxed);
        let ms: Vec<String> = times
            .iter()
            .map(|t| format!("{:.1}", t.as_secs_f64() * 1e3))
            .collect();
        let m = median(&mut times);
        println!(
            "prefix cache {}: first request {:.1} ms; later requests TTFT median {:.1} ms \
             [{}]; prompt tokens {total}, from the cache {hit}",
            if cache { "on " } else { "off" },
            warm.as_secs_f64() * 1e3,
            m.as_secs_f64() * 1e3,
            ms.join(", ")
        );
        medians.push(m);
    }
    println!(
        "TTFT off / on: {:.1}x",
        medians[0].as_secs_f64() / medians[1].as_secs_f64()
    );
}
