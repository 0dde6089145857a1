//! Failover exactness at the engine, with the real model: a seeded sequence
//! continued from its first N tokens (what a worker runs for a
//! `WorkerGenerateRequest` with `emitted_token_ids`) produces exactly the
//! rest of the undisturbed run: the same tokens, the same text, the same end,
//! under temperature, top-p, the repetition penalty and a stop string.
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_worker::engine::chat_template::ChatTurn;
use tokenmesh_worker::engine::sampling::SamplingParams;
use tokenmesh_worker::engine::LoadedModel;
use tokenmesh_worker::scheduler::{
    EngineHandle, Event, Finish, Priority, SchedulerConfig, SequenceRequest,
};
use tokio::sync::mpsc;

const MAX_TOKENS: usize = 40;

/// What a sequence sent, token by token.
#[derive(Debug)]
struct Run {
    tokens: Vec<u32>,
    /// The text each token released.
    texts: Vec<String>,
    /// The text released by the end.
    tail: String,
    reason: Finish,
    stop: Option<String>,
}

impl Run {
    /// What a client of this run received.
    fn text(&self) -> String {
        self.texts.concat() + &self.tail
    }
}

fn config() -> SchedulerConfig {
    SchedulerConfig {
        max_batch: 8,
        queue_capacity: 64,
        max_tokens_per_step: 64,
        step_latency_target: None,
        kv_budget_bytes: 64 << 20,
        kv_block_size: 16,
        prefix_cache: None,
        priority_aging: Duration::from_secs(60),
        labels: vec![],
        phase_spans: false,
    }
}

/// Submits `prompt` followed by `emitted`, as a continuation of a sequence
/// that already delivered `emitted`.
fn submit(
    engine: &EngineHandle,
    prompt: &[u32],
    emitted: &[u32],
    sampling: &SamplingParams,
    stop: &[String],
) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    engine
        .submit(SequenceRequest {
            request_id: format!("continue-{}", emitted.len()),
            attempt_id: "a".into(),
            context: [prompt, emitted].concat(),
            already_emitted: emitted.len(),
            max_tokens: MAX_TOKENS,
            sampling: sampling.clone(),
            stop: stop.to_vec(),
            logprobs: false,
            events: tx,
            enqueued: Instant::now(),
            priority: Priority::Normal,
            span: tracing::Span::none(),
        })
        .unwrap();
    rx
}

async fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> Run {
    let (mut tokens, mut texts) = (vec![], vec![]);
    while let Some(e) = rx.recv().await {
        match e {
            Event::Token { id, text, .. } => {
                tokens.push(id);
                texts.push(text);
            }
            Event::Finished {
                reason, stop, tail, ..
            } => {
                return Run {
                    tokens,
                    texts,
                    tail,
                    reason,
                    stop,
                }
            }
            Event::Failed(m) | Event::Rejected(m) => panic!("{m}"),
            Event::Status(s) => panic!("{s}"),
            Event::Text { .. } => panic!("the worker's own engine always gives ids"),
            Event::Started { .. } | Event::PromptCounted { .. } => {}
        }
    }
    panic!("stream ended without Finished")
}

/// Runs `sampling` undisturbed, then continues it from each of `cuts`
/// (numbers of tokens already emitted), all at once, and checks every
/// continuation against the undisturbed run.
async fn check_continuations(
    engine: &EngineHandle,
    prompt: &[u32],
    sampling: &SamplingParams,
    stop: &[String],
    cuts: impl Fn(&Run) -> Vec<usize>,
) -> Run {
    let whole = collect(submit(engine, prompt, &[], sampling, stop)).await;
    let cuts = cuts(&whole);
    let rxs: Vec<_> = cuts
        .iter()
        .map(|&n| submit(engine, prompt, &whole.tokens[..n], sampling, stop))
        .collect();
    for (&n, rx) in cuts.iter().zip(rxs) {
        let rest = collect(rx).await;
        assert_eq!(
            rest.tokens,
            whole.tokens[n..],
            "continued after {n} tokens ({sampling:?}): the tokens differ from the undisturbed run"
        );
        assert_eq!(
            whole.texts[..n].concat() + &rest.text(),
            whole.text(),
            "continued after {n} tokens: the text differs"
        );
        assert_eq!((rest.reason, &rest.stop), (whole.reason, &whole.stop));
    }
    whole
}

#[tokio::test(flavor = "multi_thread")]
async fn seeded_continuations_produce_exactly_the_rest() {
    let m = Arc::new(LoadedModel::load(&common::model_path(), &device()).expect("model loads"));
    let engine = EngineHandle::start(m.clone(), config()).unwrap();
    let rendered = common::render_chat(
        &m,
        &[ChatTurn {
            role: "user".into(),
            content: "Write a short story about a lighthouse keeper.".into(),
        }],
    );
    let prompt = m.tokenizer.encode(&rendered).unwrap();
    let nucleus = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(1234),
        ..Default::default()
    };
    let whole = check_continuations(&engine, &prompt, &nucleus, &[], |_| vec![1, 10, 25, 39]).await;
    assert_eq!(whole.tokens.len(), MAX_TOKENS, "{:?}", whole.text());

    // The penalty window spans the first worker's tokens, and the stop
    // string is matched across the cut: its first token was emitted (and
    // its text held back) before the failover, the rest comes after it.
    let penalized = SamplingParams {
        repetition_penalty: 1.3,
        seed: Some(99),
        ..nucleus
    };
    let free = collect(submit(&engine, &prompt, &[], &penalized, &[])).await;
    assert_eq!(free.tokens.len(), MAX_TOKENS, "{:?}", free.text());
    // Two tokens well into the reply, each releasing some text, whose text
    // together appears nowhere before them.
    let text = free.text();
    let at = (20..MAX_TOKENS - 1)
        .find(|&i| {
            let stop = free.texts[i].clone() + &free.texts[i + 1];
            !free.texts[i].trim().is_empty()
                && !free.texts[i + 1].is_empty()
                && text.find(&stop) == Some(free.texts[..i].concat().len())
        })
        .expect("two tokens with text of their own");
    let stop = vec![free.texts[at].clone() + &free.texts[at + 1]];
    let stopped = check_continuations(&engine, &prompt, &penalized, &stop, |run| {
        assert_eq!(run.reason, Finish::Stop, "{stop:?} never matched");
        assert_eq!(run.tokens.len(), at + 2, "{run:?}");
        // Token `at` begins the stop string: the matcher held its text back.
        assert_eq!(run.texts[at], "", "{run:?}");
        vec![1, 12, at + 1]
    })
    .await;
    assert_eq!(stopped.tokens, free.tokens[..at + 2]);
}

/// `TOKENMESH_TEST_DEVICE` (e.g. cuda:0 in a `--features cuda` build), else cpu.
fn device() -> candle_core::Device {
    let spec = std::env::var("TOKENMESH_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    tokenmesh_worker::accelerator::Accelerator::open(&spec)
        .expect("test device")
        .device
}
