//! Automatic prefix caching with the real model, in-process: whatever the
//! cache serves, every greedy and seeded reply is token for token the one an
//! engine without it produces (the reference: cache off, a pool large
//! enough never to preempt), for prompts sharing prefixes of many lengths
//! (one ending mid-block), under eviction in a tiny pool, when a sequence
//! whose blocks are shared is preempted or cancelled, and for a failover
//! continuation; and the cache does serve them (the counters Status
//! reports), down to the exact number of tokens where the order is fixed.
mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_worker::engine::chat_template::ChatTurn;
use tokenmesh_worker::engine::sampling::SamplingParams;
use tokenmesh_worker::engine::LoadedModel;
use tokenmesh_worker::scheduler::{
    EngineHandle, Event, Finish, Priority, SchedulerConfig, SequenceRequest,
};
use tokio::sync::mpsc;

const BLOCK: usize = 16;

fn model() -> Arc<LoadedModel> {
    Arc::new(LoadedModel::load(&common::model_path(), &device()).expect("model loads"))
}

/// An engine of `kv_tokens` tokens of KV cache, prefix caching on or off.
fn engine(m: &Arc<LoadedModel>, kv_tokens: usize, cache: bool) -> EngineHandle {
    let per_token = m.backend.config().kv_shape().bytes_per_token();
    let cfg = SchedulerConfig {
        max_batch: 8,
        queue_capacity: 64,
        max_tokens_per_step: 64,
        step_latency_target: None,
        kv_budget_bytes: kv_tokens * per_token,
        kv_block_size: BLOCK,
        priority_aging: Duration::from_secs(60),
        prefix_cache: cache.then(|| format!("{}:test", m.digest)),
        labels: vec![],
        phase_spans: false,
    };
    EngineHandle::start(m.clone(), cfg).unwrap()
}

/// The reference: no cache, room for everything.
fn reference(m: &Arc<LoadedModel>) -> EngineHandle {
    engine(m, 8192, false)
}

/// One request: its context, of which the last `emitted` tokens were
/// delivered before a failover, and how to sample.
#[derive(Clone, Debug)]
struct Job {
    context: Vec<u32>,
    emitted: usize,
    max_tokens: usize,
    sampling: SamplingParams,
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(seed),
        ..Default::default()
    }
}

fn submit(engine: &EngineHandle, job: &Job) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    engine
        .submit(SequenceRequest {
            request_id: format!("job-{}", job.context.len()),
            attempt_id: String::new(),
            context: job.context.clone(),
            already_emitted: job.emitted,
            max_tokens: job.max_tokens,
            sampling: job.sampling.clone(),
            stop: vec![],
            logprobs: false,
            events: tx,
            enqueued: Instant::now(),
            priority: Priority::Normal,
            span: tracing::Span::none(),
        })
        .unwrap();
    rx
}

/// The tokens a sequence sent and how it ended.
async fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, Finish) {
    let mut out = Vec::new();
    while let Some(e) = rx.recv().await {
        match e {
            Event::Token { id, .. } => out.push(id),
            Event::Finished { reason, .. } => return (out, reason),
            Event::Failed(m) | Event::Rejected(m) => panic!("{m}"),
            Event::Status(s) => panic!("{s}"),
            Event::Started { .. } | Event::PromptCounted { .. } => {}
            Event::Text { .. } => panic!("the worker's own engine always gives ids"),
        }
    }
    panic!("stream ended without Finished")
}

/// Runs `jobs` one after another.
async fn one_by_one(engine: &EngineHandle, jobs: &[Job]) -> Vec<(Vec<u32>, Finish)> {
    let mut out = Vec::new();
    for j in jobs {
        out.push(collect(submit(engine, j)).await);
    }
    out
}

/// Runs `jobs` all at once.
async fn together(engine: &EngineHandle, jobs: &[Job]) -> Vec<(Vec<u32>, Finish)> {
    let rxs: Vec<_> = jobs.iter().map(|j| submit(engine, j)).collect();
    let mut out = Vec::new();
    for rx in rxs {
        out.push(collect(rx).await);
    }
    out
}

/// Prompt tokens the cache served so far.
fn cached(engine: &EngineHandle) -> u64 {
    engine.stats().prompt_tokens_cached.load(Ordering::Relaxed)
}

/// Tokens a sequence reading `context` finds cached when `earlier` (a
/// context whose full blocks are all cached) ran before it: the full
/// blocks of their common prefix, leaving at least one token to compute.
fn expected_hit(earlier: &[u32], context: &[u32]) -> usize {
    let common = earlier
        .iter()
        .zip(context)
        .take_while(|(a, b)| a == b)
        .count();
    common.min(context.len() - 1) / BLOCK * BLOCK
}

fn chat(m: &LoadedModel, system: &str, user: &str) -> Vec<u32> {
    let turns = [
        ChatTurn {
            role: "system".into(),
            content: system.into(),
        },
        ChatTurn {
            role: "user".into(),
            content: user.into(),
        },
    ];
    m.tokenizer.encode(&common::render_chat(m, &turns)).unwrap()
}

const SYSTEM: &str = "You are a careful assistant for a lighthouse museum on a windy coast. \
    Answer visitors' questions in plain words, mention the museum's opening hours (nine to five, \
    closed on Mondays) when it helps, and never invent facts about the lighthouse's history.";

fn assert_same(got: &[(Vec<u32>, Finish)], want: &[(Vec<u32>, Finish)], jobs: &[Job], how: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g,
            w,
            "job {i} ({} context tokens, {:?}) changed {how}",
            jobs[i].context.len(),
            jobs[i].sampling
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn prompts_sharing_prefixes_get_the_same_tokens_from_the_cache() {
    let m = model();
    let questions = [
        "When is the museum open?",
        "How tall is the lighthouse?",
        "Can I bring my dog?",
        "Write a short poem about the sea.",
        "Is it open on Mondays?",
    ];
    let mut jobs: Vec<Job> = questions
        .iter()
        .enumerate()
        .map(|(i, q)| Job {
            context: chat(&m, SYSTEM, q),
            emitted: 0,
            max_tokens: 24,
            sampling: if i % 2 == 0 {
                greedy()
            } else {
                seeded(i as u64)
            },
        })
        .collect();
    // Raw text whose prefix ends mid-block, and longer prompts that start
    // with it: they share its full blocks only.
    let text = m
        .tokenizer
        .encode(
            "The keeper climbed the one hundred and twelve stairs of the old stone tower \
             every single evening, just before the sun went down, to light the great lamp above \
             the rocks",
        )
        .unwrap();
    let short = text.len();
    assert!(
        short > 2 * BLOCK && !short.is_multiple_of(BLOCK),
        "{short} tokens: two blocks and part of one"
    );
    let more = m
        .tokenizer
        .encode(" and watch the ships pass the rocks in the fog, counting the bells of the harbour")
        .unwrap();
    for (n, sampling) in [
        (short, greedy()),
        (short + 9, seeded(7)),
        (short + more.len(), greedy()),
    ] {
        let context = [&text[..], &more[..]].concat()[..n].to_vec();
        jobs.push(Job {
            context,
            emitted: 0,
            max_tokens: 16,
            sampling,
        });
    }
    let want = one_by_one(&reference(&m), &jobs).await;

    let on = engine(&m, 8192, true);
    // The first alone: the second must find the shared system prompt.
    let first = one_by_one(&on, &jobs[..2]).await;
    assert_same(&first, &want[..2], &jobs, "with the cache, one by one");
    let hit = expected_hit(&jobs[0].context, &jobs[1].context);
    assert!(hit >= 2 * BLOCK, "the chat prompts share {hit} tokens");
    assert_eq!(
        cached(&on) as usize,
        hit,
        "the second prompt's cached tokens"
    );
    // The raw prompt, then the ones extending it, in turn.
    let before = cached(&on);
    let raw = one_by_one(&on, &jobs[5..]).await;
    assert_same(
        &raw,
        &want[5..],
        &jobs[5..],
        "extending a prompt ending mid-block",
    );
    let shared = expected_hit(&jobs[5].context, &jobs[6].context)
        + expected_hit(&jobs[6].context, &jobs[7].context);
    assert!(shared >= 2 * (short / BLOCK) * BLOCK);
    // Each also finds what its predecessor generated if it matches; at
    // least the common prompt's full blocks are found.
    assert!(cached(&on) - before >= shared as u64);
    // Everything at once, after all of it is cached.
    let again = together(&on, &jobs).await;
    assert_same(&again, &want, &jobs, "with the cache, all at once");
    let stats = on.stats();
    let total = stats.prompt_tokens_total.load(Ordering::Relaxed);
    let served = cached(&on);
    eprintln!("prompt tokens {total}, served from the cache {served}");
    assert!(served * 2 > total, "most prompt tokens came from the cache");

    // Without the cache nothing is served, and nothing changes either.
    let off = engine(&m, 8192, false);
    assert_same(
        &together(&off, &jobs).await,
        &want,
        &jobs,
        "with the cache off",
    );
    assert_eq!(cached(&off), 0);
    assert_eq!(off.stats().kv_blocks_cached.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tiny_pool_evicts_the_least_recently_used_and_changes_no_token() {
    let m = model();
    let story = |topic: &str| {
        m.tokenizer
            .encode(&format!(
                "{topic} Here is a long account of it, told slowly and with care, one \
                 detail after another, so that nobody who reads it forgets how it went: first"
            ))
            .unwrap()
    };
    let jobs: Vec<Job> = [
        "Alpha: the storm that closed the harbour for a week.",
        "Bravo: how the new lens was carried up the tower.",
        "Charlie: the winter the keeper's logbook froze solid.",
    ]
    .iter()
    .enumerate()
    .map(|(i, t)| Job {
        context: story(t),
        emitted: 0,
        max_tokens: 16,
        sampling: if i == 1 { seeded(3) } else { greedy() },
    })
    .collect();
    let blocks = |j: &Job| (j.context.len() + j.max_tokens).div_ceil(BLOCK);
    // Room for the first two: running the third evicts the first (the least
    // recently used, tail first), and running the third again evicts more.
    let pool = blocks(&jobs[0]) + blocks(&jobs[1]);
    let order = [0, 1, 2, 2, 0];
    let sequence: Vec<Job> = order.iter().map(|&i| jobs[i].clone()).collect();
    let want = one_by_one(&reference(&m), &sequence).await;

    let on = engine(&m, pool * BLOCK, true);
    let mut hits = Vec::new();
    for (i, job) in sequence.iter().enumerate() {
        let before = cached(&on);
        let got = collect(submit(&on, job)).await;
        assert_eq!(got, want[i], "run {i} (prompt {}) changed", order[i]);
        hits.push((cached(&on) - before) as usize);
    }
    let evicted = on.stats().kv_blocks_evicted.load(Ordering::SeqCst);
    eprintln!("pool of {pool} blocks: hits per run {hits:?}, {evicted} blocks evicted");
    assert!(evicted > 0, "the tiny pool never evicted");
    // Distinct prompts share nothing; the third again is all cached.
    assert_eq!(hits[..3], [0, 0, 0]);
    let all = |j: &Job| (j.context.len() - 1) / BLOCK * BLOCK;
    assert_eq!(
        hits[3],
        all(&jobs[2]),
        "the most recent prompt stays cached"
    );
    // The first lost its blocks to the third and is computed again.
    assert!(
        hits[4] < all(&jobs[0]),
        "the least recently used was evicted"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn preempting_or_cancelling_a_sequence_whose_blocks_are_shared_changes_no_token() {
    let m = model();
    let asks = [
        "Tell me a long story about the lighthouse keeper and the storm.",
        "Describe, at length, a day in the life of the lighthouse.",
        "Write a long letter from the keeper to his sister.",
        "Explain in detail how the lamp of a lighthouse works.",
    ];
    let jobs: Vec<Job> = asks
        .iter()
        .enumerate()
        .map(|(i, a)| Job {
            context: chat(&m, SYSTEM, a),
            emitted: 0,
            max_tokens: 48,
            sampling: seeded(10 + i as u64),
        })
        .collect();
    let warm = Job {
        context: chat(&m, SYSTEM, "Hello."),
        emitted: 0,
        max_tokens: 1,
        sampling: greedy(),
    };
    let want = together(&reference(&m), &jobs).await;

    // After the warm-up every job takes up the system prompt's blocks. The
    // pool holds those and each job's own prompt blocks with one to spare,
    // so their replies cannot all grow: the youngest are preempted while
    // the others hold the blocks they shared.
    let shared = expected_hit(&warm.context, &jobs[0].context) / BLOCK;
    let own: usize = jobs
        .iter()
        .map(|j| j.context.len().div_ceil(BLOCK) - shared)
        .sum();
    let pool = shared + own + 1;
    let longest = jobs
        .iter()
        .map(|j| j.context.len() + j.max_tokens)
        .max()
        .unwrap();
    assert!(longest.div_ceil(BLOCK) <= pool, "each fits alone");
    let on = engine(&m, pool * BLOCK, true);
    collect(submit(&on, &warm)).await;
    let got = together(&on, &jobs).await;
    assert_same(&got, &want, &jobs, "by preemption with shared blocks");
    let preempted = on.stats().preemptions.load(Ordering::Relaxed);
    eprintln!("pool of {pool} blocks ({shared} shared): {preempted} preemptions");
    assert!(preempted > 0, "the pool never preempted");

    // A sequence sharing those blocks is cancelled mid-reply: the others
    // keep theirs.
    let on = engine(&m, 8192, true);
    collect(submit(&on, &warm)).await;
    let mut rxs: Vec<_> = jobs.iter().map(|j| submit(&on, j)).collect();
    let mut doomed = rxs.remove(0);
    loop {
        match doomed.recv().await {
            Some(Event::Token { .. }) => break,
            Some(Event::Started { .. }) => {}
            other => panic!("the doomed job ended before its first token: {other:?}"),
        }
    }
    drop(doomed);
    for (i, rx) in rxs.into_iter().enumerate() {
        assert_eq!(
            collect(rx).await,
            want[i + 1],
            "job {} changed by a cancellation",
            i + 1
        );
    }
    // And the cancelled one's full blocks stayed cached for its retry.
    let before = cached(&on);
    assert_eq!(collect(submit(&on, &jobs[0])).await, want[0]);
    assert_eq!(
        (cached(&on) - before) as usize,
        (jobs[0].context.len() - 1) / BLOCK * BLOCK
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_continuation_reads_the_first_run_from_the_cache() {
    let m = model();
    // The prompt of continuation.rs, whose seeded reply runs 40 tokens.
    let turn = ChatTurn {
        role: "user".into(),
        content: "Write a short story about a lighthouse keeper.".into(),
    };
    let prompt = m
        .tokenizer
        .encode(&common::render_chat(&m, &[turn]))
        .unwrap();
    let whole = Job {
        context: prompt.clone(),
        emitted: 0,
        max_tokens: 40,
        sampling: seeded(1234),
    };
    let (tokens, end) = collect(submit(&reference(&m), &whole)).await;
    assert_eq!(tokens.len(), 40, "a reply long enough to cut");

    let on = engine(&m, 8192, true);
    assert_eq!(collect(submit(&on, &whole)).await, (tokens.clone(), end));
    for n in [1, 10, 25, 39] {
        // What a worker gets after a failover: the prompt and the n tokens
        // the client has; the first run cached all of it but its last token.
        let cont = Job {
            context: [&prompt[..], &tokens[..n]].concat(),
            emitted: n,
            ..whole.clone()
        };
        let before = cached(&on);
        let (rest, reason) = collect(submit(&on, &cont)).await;
        assert_eq!(rest, tokens[n..], "continued after {n} tokens");
        assert_eq!(reason, end);
        let hit = (cached(&on) - before) as usize;
        assert_eq!(hit, (cont.context.len() - 1) / BLOCK * BLOCK, "after {n}");
    }
}

/// `TOKENMESH_TEST_DEVICE` (e.g. cuda:0 in a `--features cuda` build), else cpu.
fn device() -> candle_core::Device {
    let spec = std::env::var("TOKENMESH_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    tokenmesh_worker::accelerator::Accelerator::open(&spec)
        .expect("test device")
        .device
}
