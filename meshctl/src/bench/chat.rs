//! `meshctl bench chat`: the multi-turn chat workload of issue 17. N
//! conversations run at once; each shares one system prompt of S words and
//! sends T turns one after another, every turn re-sending the conversation
//! so far with the model's own replies, so that a worker holding the
//! conversation in its KV cache can skip recomputing it. All text is drawn
//! from a seed.
//!
//! It reports time to first token per turn, output tokens/s, how often a
//! turn landed on the worker of the turn before (what a cache-aware router
//! buys), each worker's share of the load, and the hit ratio of an oracle
//! that serves every conversation from the worker holding all of it.
use super::load::router_model;
use super::report::{histogram, percentiles, Format, Percentiles};
use super::transport::{self, TlsArgs};
use anyhow::Context;
use hdrhistogram::Histogram;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{ChatMessage, GenerateRequest, StatusRequest};
use tokio::time::Instant;
use tonic::transport::Channel;

/// Words the prompts are drawn from; most are one token.
const WORDS: &[&str] = &[
    "the", "river", "carries", "light", "over", "stones", "while", "small", "birds", "sing",
    "about", "morning", "bread", "and", "quiet", "streets", "a", "train", "leaves", "town",
    "under", "grey", "clouds", "people", "read", "letters", "from", "old", "friends", "near",
    "warm", "windows",
];

/// The multi-turn chat workload against a router.
#[derive(clap::Args, Debug, Clone)]
pub struct ChatArgs {
    /// Address of the router.
    #[arg(long, env = "TOKENMESH_ROUTER", default_value = "127.0.0.1:50051")]
    pub target: String,
    /// Model name (default: the only model the router serves).
    #[arg(long)]
    pub model: Option<String>,
    /// Conversations in flight at once, each one turn at a time.
    #[arg(long, default_value_t = 8)]
    pub conversations: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Words of the system prompt every conversation shares.
    #[arg(long, default_value_t = 200)]
    pub system_words: usize,
    /// Words of each user turn.
    #[arg(long, default_value_t = 24)]
    pub user_words: usize,
    /// max_tokens of each reply.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Sampling temperature (default: the server's); each request is seeded.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Seed of the text and of each request's sampling.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Labels added to the report, as KEY=VALUE (repeatable), to tell the
    /// arms of a comparison apart.
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Seconds a request may take before it counts as CLIENT_TIMEOUT.
    #[arg(long, default_value_t = 120.0)]
    pub request_timeout: f64,
    /// Workers behind the router (ADDR, comma-separated or repeated) whose
    /// Status counters give the run's real prefix-cache hit ratio; under
    /// mTLS they accept only the router identity (`--tls-role router`).
    #[arg(long = "workers", value_delimiter = ',')]
    pub workers: Vec<String>,
    #[command(flatten)]
    pub tls: TlsArgs,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.into(), v.into())),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

/// What one turn saw.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnSample {
    pub conversation: usize,
    pub turn: usize,
    pub worker: String,
    pub start: Duration,
    pub end: Duration,
    /// None if no token came.
    pub ttft: Option<Duration>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Bytes of the system prompt and of the whole prompt's messages.
    pub system_bytes: usize,
    pub prompt_bytes: usize,
    /// None: finished; else the status code name.
    pub error: Option<String>,
}

/// The figures of one chat run; one JSON line.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatReport {
    pub labels: BTreeMap<String, String>,
    pub window_s: f64,
    /// Successful turns.
    pub requests: u64,
    pub errors: BTreeMap<String, u64>,
    /// Time to first token by turn (1-based).
    pub ttft_ms_by_turn: Vec<Percentiles>,
    /// Time to first token of every turn after the first.
    pub ttft_ms_later_turns: Percentiles,
    pub output_tokens_per_sec: f64,
    pub prompt_tokens: u64,
    /// Turns after the first that went to the worker of the turn before.
    pub same_worker_ratio: f64,
    /// Busy time (streams × seconds) per worker, over the mean.
    pub load_share: BTreeMap<String, f64>,
    /// The largest of `load_share`.
    pub max_over_mean_load: f64,
    /// Prompt tokens an oracle could serve from cache / prompt tokens.
    pub oracle_hit_ratio: f64,
    /// Prompt tokens the workers served from cache / prompt tokens, from
    /// their Status counters (when they report them).
    pub worker_hit_ratio: Option<f64>,
}

/// The text of one user turn or of the system prompt.
fn words(rng: &mut StdRng, n: usize) -> String {
    (0..n)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `meshctl bench chat`.
pub async fn main(args: ChatArgs, format: Format) -> anyhow::Result<()> {
    let report = run(&args).await?;
    match format {
        Format::Json => println!("{}", serde_json::to_string(&report)?),
        Format::Table | Format::Markdown => print!("{}", table(&report)),
    }
    Ok(())
}

/// Runs the workload and reports it.
pub async fn run(args: &ChatArgs) -> anyhow::Result<ChatReport> {
    anyhow::ensure!(
        args.conversations >= 1,
        "--conversations must be at least 1"
    );
    anyhow::ensure!(args.turns >= 1, "--turns must be at least 1");
    anyhow::ensure!(
        args.request_timeout > 0.0 && args.request_timeout.is_finite(),
        "--request-timeout must be positive"
    );
    let channel = transport::connect(&args.target, &args.tls).await?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => router_model(channel.clone()).await?,
    };
    let mut workers = Vec::with_capacity(args.workers.len());
    for w in &args.workers {
        workers.push(WorkerClient::new(transport::connect(w, &args.tls).await?));
    }
    let before = cache_counters(&mut workers, &args.workers).await?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let system = words(&mut rng, args.system_words);
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..args.conversations {
        let (args, model, system, channel) =
            (args.clone(), model.clone(), system.clone(), channel.clone());
        tasks.spawn(async move { conversation(&args, &model, &system, c, channel, t0).await });
    }
    let mut samples = Vec::new();
    while let Some(done) = tasks.join_next().await {
        samples.extend(done.context("a conversation task")?);
    }
    let window = t0.elapsed();
    let mut labels: BTreeMap<String, String> = args.labels.iter().cloned().collect();
    labels.insert("target".into(), args.target.clone());
    labels.insert("model".into(), model);
    labels.insert("conversations".into(), args.conversations.to_string());
    labels.insert("turns".into(), args.turns.to_string());
    labels.insert("system_words".into(), args.system_words.to_string());
    let after = cache_counters(&mut workers, &args.workers).await?;
    let hit_ratio = worker_hit_ratio(&before, &after);
    Ok(summarize(&samples, window, labels, hit_ratio))
}

/// Each worker's prefix-cache counters, from its Status.
async fn cache_counters(
    workers: &mut [WorkerClient<Channel>],
    addrs: &[String],
) -> anyhow::Result<Vec<CacheCounters>> {
    let mut out = Vec::with_capacity(workers.len());
    for (w, addr) in workers.iter_mut().zip(addrs) {
        let s = w
            .status(StatusRequest {})
            .await
            .with_context(|| format!("Status of worker {addr}"))?
            .into_inner();
        out.push(CacheCounters {
            prompt_tokens_total: s.prompt_tokens_total,
            prompt_tokens_cached: s.prompt_tokens_cached,
        });
    }
    Ok(out)
}

/// One conversation, turn after turn; stops at its first failed turn (the
/// next would re-send a history it never got).
async fn conversation(
    args: &ChatArgs,
    model: &str,
    system: &str,
    c: usize,
    channel: Channel,
    t0: Instant,
) -> Vec<TurnSample> {
    let mut rng =
        StdRng::seed_from_u64(args.seed ^ (c as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut client = InferenceClient::new(channel);
    let mut messages = vec![ChatMessage {
        role: "system".into(),
        content: system.into(),
    }];
    let mut out = Vec::new();
    for turn in 0..args.turns {
        messages.push(ChatMessage {
            role: "user".into(),
            content: words(&mut rng, args.user_words),
        });
        let req = GenerateRequest {
            model: model.into(),
            messages: messages.clone(),
            max_tokens: Some(args.max_tokens),
            temperature: args.temperature,
            seed: Some(args.seed.wrapping_add((c * 1_000 + turn) as u64)),
            ..Default::default()
        };
        let mut sample = TurnSample {
            conversation: c,
            turn,
            worker: String::new(),
            start: t0.elapsed(),
            end: Duration::ZERO,
            ttft: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            system_bytes: system.len(),
            prompt_bytes: messages.iter().map(|m| m.content.len()).sum(),
            error: None,
        };
        let mut reply = String::new();
        let timeout = Duration::from_secs_f64(args.request_timeout);
        let outcome = tokio::time::timeout(timeout, async {
            let mut stream = client.generate(req).await?.into_inner();
            let mut count = tokenmesh_proto::delta::TokenCount::default();
            while let Some(msg) = stream.message().await? {
                match msg.event {
                    Some(Event::Accepted(a)) => sample.worker = a.worker_id,
                    Some(Event::Delta(d)) => {
                        if count.add(&d) > 0 && sample.ttft.is_none() {
                            sample.ttft = Some(t0.elapsed() - sample.start);
                        }
                        reply.push_str(&d.text);
                    }
                    Some(Event::Finished(f)) => {
                        let usage = f.usage.unwrap_or_default();
                        sample.prompt_tokens = usage.prompt_tokens;
                        sample.completion_tokens = usage.completion_tokens;
                        return Ok(true);
                    }
                    None => {}
                }
            }
            Ok::<bool, tonic::Status>(false)
        })
        .await;
        sample.end = t0.elapsed();
        sample.error = match outcome {
            Ok(Ok(true)) => None,
            Ok(Ok(false)) => Some("INCOMPLETE".into()),
            Ok(Err(status)) => Some(tokenmesh_proto::codes::code_name(status.code()).into()),
            Err(_) => Some("CLIENT_TIMEOUT".into()),
        };
        let failed = sample.error.is_some();
        out.push(sample);
        if failed {
            break;
        }
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: reply,
        });
    }
    out
}

/// Prompt tokens an oracle router could have served from cache, with
/// caches that never evict: every turn after the first finds the turn
/// before (its prompt and reply) on the worker that served it, and every
/// first turn but one per worker finds the shared system prompt. The
/// system prompt's tokens are estimated from its share of the first turn's
/// bytes (the router and this tool do not tokenize).
pub fn oracle_cached_tokens(samples: &[TurnSample], workers: usize) -> u64 {
    let mut by_conversation: BTreeMap<usize, Vec<&TurnSample>> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.error.is_none()) {
        by_conversation.entry(s.conversation).or_default().push(s);
    }
    let mut cached = 0u64;
    let mut first_turns = 0usize;
    let mut system_tokens = u64::MAX;
    for turns in by_conversation.values_mut() {
        turns.sort_by_key(|s| s.turn);
        for (i, s) in turns.iter().enumerate() {
            if s.turn == 0 {
                first_turns += 1;
                let share = s.system_bytes as f64 / s.prompt_bytes.max(1) as f64;
                system_tokens = system_tokens.min((s.prompt_tokens as f64 * share) as u64);
            } else if i > 0 && turns[i - 1].turn + 1 == s.turn {
                let before = turns[i - 1];
                let held = (before.prompt_tokens + before.completion_tokens) as u64;
                cached += held.min(s.prompt_tokens as u64);
            }
        }
    }
    if system_tokens != u64::MAX {
        cached += first_turns.saturating_sub(workers.max(1)) as u64 * system_tokens;
    }
    cached
}

/// A worker's prefix-cache counters (StatusResponse `prompt_tokens_total`,
/// `prompt_tokens_cached`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheCounters {
    pub prompt_tokens_total: u64,
    pub prompt_tokens_cached: u64,
}

/// The workers' hit ratio over a run, from their counters before and after
/// it (same order); None when they served no prompt token in between.
pub fn worker_hit_ratio(before: &[CacheCounters], after: &[CacheCounters]) -> Option<f64> {
    let (mut total, mut cached) = (0u64, 0u64);
    for (b, a) in before.iter().zip(after) {
        total += a.prompt_tokens_total.saturating_sub(b.prompt_tokens_total);
        cached += a
            .prompt_tokens_cached
            .saturating_sub(b.prompt_tokens_cached);
    }
    (total > 0).then(|| cached as f64 / total as f64)
}

/// The report of a run's turns.
pub fn summarize(
    samples: &[TurnSample],
    window: Duration,
    labels: BTreeMap<String, String>,
    worker_hit_ratio: Option<f64>,
) -> ChatReport {
    let turns = samples.iter().map(|s| s.turn + 1).max().unwrap_or(0);
    let mut by_turn: Vec<Histogram<u64>> = (0..turns).map(|_| histogram()).collect();
    let mut later = histogram();
    let mut errors = BTreeMap::new();
    let (mut requests, mut tokens, mut prompt_tokens) = (0u64, 0u64, 0u64);
    let mut busy: BTreeMap<String, f64> = BTreeMap::new();
    let mut previous: BTreeMap<(usize, usize), &str> = BTreeMap::new();
    for s in samples {
        if let Some(e) = &s.error {
            *errors.entry(e.clone()).or_insert(0) += 1;
            continue;
        }
        requests += 1;
        tokens += s.completion_tokens as u64;
        prompt_tokens += s.prompt_tokens as u64;
        if let Some(t) = s.ttft {
            let us = t.as_micros().max(1) as u64;
            by_turn[s.turn].saturating_record(us);
            if s.turn > 0 {
                later.saturating_record(us);
            }
        }
        *busy.entry(s.worker.clone()).or_default() += (s.end - s.start).as_secs_f64();
        previous.insert((s.conversation, s.turn), &s.worker);
    }
    let (mut stayed, mut moved) = (0u64, 0u64);
    for (&(c, t), w) in &previous {
        if t > 0 {
            match previous.get(&(c, t - 1)) {
                Some(p) if p == w => stayed += 1,
                Some(_) => moved += 1,
                None => {}
            }
        }
    }
    let mean = busy.values().sum::<f64>() / busy.len().max(1) as f64;
    let load_share: BTreeMap<String, f64> = busy
        .iter()
        .map(|(w, b)| (w.clone(), if mean > 0.0 { b / mean } else { 0.0 }))
        .collect();
    let max_over_mean_load = load_share.values().copied().fold(0.0, f64::max);
    let oracle = oracle_cached_tokens(samples, busy.len());
    let secs = window.as_secs_f64().max(1e-9);
    ChatReport {
        labels,
        window_s: window.as_secs_f64(),
        requests,
        errors,
        ttft_ms_by_turn: by_turn.iter().map(percentiles).collect(),
        ttft_ms_later_turns: percentiles(&later),
        output_tokens_per_sec: tokens as f64 / secs,
        prompt_tokens,
        same_worker_ratio: if stayed + moved > 0 {
            stayed as f64 / (stayed + moved) as f64
        } else {
            0.0
        },
        load_share,
        max_over_mean_load,
        oracle_hit_ratio: if prompt_tokens > 0 {
            oracle as f64 / prompt_tokens as f64
        } else {
            0.0
        },
        worker_hit_ratio,
    }
}

/// The report as a table for people.
pub fn table(r: &ChatReport) -> String {
    let mut out = String::new();
    let labels: Vec<String> = r.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    out.push_str(&format!("chat run: {}\n", labels.join(" ")));
    out.push_str(&format!(
        "  {} turns in {:.1} s, errors: {:?}; {:.1} output tokens/s; {} prompt tokens\n",
        r.requests, r.window_s, r.errors, r.output_tokens_per_sec, r.prompt_tokens
    ));
    for (i, p) in r.ttft_ms_by_turn.iter().enumerate() {
        out.push_str(&format!(
            "  turn {:>2}: TTFT p50 {:>8.1} ms  p99 {:>8.1} ms\n",
            i + 1,
            p.p50,
            p.p99
        ));
    }
    out.push_str(&format!(
        "  later turns: TTFT p50 {:.1} ms p99 {:.1} ms; same worker as the turn before: {:.0} %\n",
        r.ttft_ms_later_turns.p50,
        r.ttft_ms_later_turns.p99,
        r.same_worker_ratio * 100.0
    ));
    let shares: Vec<String> = r
        .load_share
        .iter()
        .map(|(w, s)| format!("{w} {s:.2}"))
        .collect();
    out.push_str(&format!(
        "  load over the mean: {} (max {:.2})\n",
        shares.join(", "),
        r.max_over_mean_load
    ));
    let worker = match r.worker_hit_ratio {
        Some(h) => format!("{:.1} %", h * 100.0),
        None => "not reported".into(),
    };
    out.push_str(&format!(
        "  cache hit ratio: workers {worker}; oracle {:.1} %\n",
        r.oracle_hit_ratio * 100.0
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(c: usize, t: usize, worker: &str, prompt: u32, completion: u32) -> TurnSample {
        TurnSample {
            conversation: c,
            turn: t,
            worker: worker.into(),
            start: Duration::from_millis(100 * t as u64),
            end: Duration::from_millis(100 * t as u64 + 50),
            ttft: Some(Duration::from_millis(10 + t as u64)),
            prompt_tokens: prompt,
            completion_tokens: completion,
            system_bytes: 500,
            prompt_bytes: 1_000,
            error: None,
        }
    }

    #[test]
    fn the_oracle_counts_each_turn_before_and_the_system_prompt_once_per_worker() {
        // Two conversations on one worker: turn 1 finds turn 0's 100 + 10.
        let samples = vec![
            turn(0, 0, "a", 100, 10),
            turn(0, 1, "a", 130, 10),
            turn(1, 0, "a", 100, 10),
            turn(1, 1, "a", 125, 10),
        ];
        // Second conversation's first turn: half of 100 tokens is system.
        assert_eq!(oracle_cached_tokens(&samples, 1), 110 + 110 + 50);
        assert_eq!(oracle_cached_tokens(&samples, 2), 220);
        // A failed turn breaks the chain.
        let mut broken = samples.clone();
        broken[0].error = Some("UNAVAILABLE".into());
        assert_eq!(oracle_cached_tokens(&broken, 1), 110);
    }

    #[test]
    fn the_report_has_ttft_per_turn_stickiness_and_load_shares() {
        let samples = vec![
            turn(0, 0, "a", 100, 10),
            turn(0, 1, "a", 130, 10),
            turn(1, 0, "b", 100, 10),
            turn(1, 1, "a", 125, 10),
        ];
        let r = summarize(&samples, Duration::from_secs(2), BTreeMap::new(), None);
        assert_eq!(r.requests, 4);
        assert_eq!(r.ttft_ms_by_turn.len(), 2);
        assert!((r.ttft_ms_by_turn[1].p50 - 11.0).abs() < 0.1, "{r:?}");
        assert_eq!(r.same_worker_ratio, 0.5);
        assert!((r.max_over_mean_load - 1.5).abs() < 1e-9, "{r:?}");
        assert_eq!(r.output_tokens_per_sec, 20.0);
        assert!(table(&r).contains("turn  2"));
    }

    #[test]
    fn the_worker_hit_ratio_is_the_run_s_share_of_cached_prompt_tokens() {
        let c = |t, h| CacheCounters {
            prompt_tokens_total: t,
            prompt_tokens_cached: h,
        };
        assert_eq!(worker_hit_ratio(&[c(0, 0)], &[c(0, 0)]), None);
        let r = worker_hit_ratio(&[c(100, 0), c(50, 10)], &[c(300, 150), c(250, 110)]).unwrap();
        assert!((r - 250.0 / 400.0).abs() < 1e-9);
    }
}
