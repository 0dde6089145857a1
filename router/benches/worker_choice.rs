//! The cost of the cache-aware worker choice (issues 17 and 19): hashing a
//! prompt and deciding among 10, 64, 100, 1,000 and 10,000 ready workers with a warm
//! prefix index, against P2C alone. Criterion gives the mean; a plain timed loop before it
//! prints the p50/p99/p99.9 of single decisions, the figure the issue sets
//! (under 10 µs p99 at 64 workers, issue 17, and at 1,000, issue 19).
//!
//! `cargo bench -p tokenmesh-router --bench worker_choice` (only some
//! fleet sizes: `TOKENMESH_BENCH_WORKERS=1000`)
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_proto::records::WorkerRecord;
use tokenmesh_proto::v1::{ChatMessage, GenerateRequest};
use tokenmesh_router::config::ChannelSettings;
use tokenmesh_router::registry::{Endpoint, Registry};
use tokenmesh_router::route::affinity::{Affinity, AffinitySettings, WorkerChoice};
use tokenmesh_router::route::candidates::Candidates;

/// `n` ready workers of m/v1 with loads 0..8, no worker behind them.
fn workers(rt: &tokio::runtime::Runtime, n: usize) -> (Arc<Registry>, Arc<[Arc<Endpoint>]>) {
    let _guard = rt.enter();
    let reg = Registry::new(
        ChannelSettings {
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(1),
            status_interval: Duration::from_secs(3600),
            status_poll_budget: None,
        },
        None,
    );
    for i in 0..n {
        let record = WorkerRecord::new(format!("http://127.0.0.1:{}", 10_000 + i));
        reg.upsert_worker(&format!("worker-{i}"), "m", "v1", record)
            .expect("a valid address");
    }
    let eps = reg.endpoints("m", "v1");
    for (i, ep) in eps.iter().enumerate() {
        ep.healthy.store(true, Ordering::SeqCst);
        ep.in_flight.store((i % 8) as u32, Ordering::SeqCst);
    }
    (reg, eps)
}

const SYSTEM: &str = "You are a helpful assistant for a travel company. Answer in two or three sentences, \
    name prices in euros, never invent timetables, and say so when you do not know. Keep a friendly tone.";

/// Turn `turn` of conversation `c`: the system prompt, then every earlier
/// turn with a reply, then a new question (about 1.2 KB at turn 4).
fn conversation(c: usize, turn: usize) -> GenerateRequest {
    let mut messages = vec![ChatMessage {
        role: "system".into(),
        content: SYSTEM.into(),
    }];
    for t in 0..=turn {
        messages.push(ChatMessage {
            role: "user".into(),
            content: format!("Conversation {c}, question {t}: which trains run from Lyon to Turin on a Sunday morning?"),
        });
        if t < turn {
            messages.push(ChatMessage {
                role: "assistant".into(),
                content: format!("Reply {t}: two direct trains leave Lyon Part-Dieu in the morning; the journey takes about four hours."),
            });
        }
    }
    GenerateRequest {
        model: "m".into(),
        messages,
        ..Default::default()
    }
}

/// A warm index: 8 conversations per worker, 4 turns each, routed and opened.
fn warm(affinity: &Arc<Affinity>, eps: &Arc<[Arc<Endpoint>]>) -> usize {
    let conversations = eps.len() * 8;
    let mut rng = rand::rng();
    for turn in 0..4 {
        for c in 0..conversations {
            let req = affinity.request(&conversation(c, turn), "v1", None);
            if let Some(ep) = req.choose(&Candidates::all(eps), false, &mut rng).worker {
                req.opened(&ep);
            }
        }
    }
    conversations
}

fn percentiles(
    affinity: &Arc<Affinity>,
    eps: &Arc<[Arc<Endpoint>]>,
    conversations: usize,
    label: &str,
) {
    let requests: Vec<GenerateRequest> = (0..conversations).map(|c| conversation(c, 4)).collect();
    let mut rng = rand::rng();
    let mut times = Vec::with_capacity(50_000);
    let mut digests = Vec::with_capacity(50_000);
    for i in 0..50_000 {
        let req = &requests[i % requests.len()];
        let t = Instant::now();
        let r = affinity.request(req, "v1", None);
        let digested = t.elapsed();
        let choice = r.choose(&Candidates::all(eps), false, &mut rng);
        black_box(&choice.worker);
        times.push(t.elapsed());
        digests.push(digested);
    }
    let at = |v: &mut Vec<Duration>, q: f64| {
        v.sort_unstable();
        v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
    };
    eprintln!(
        "{label}: digest + choose, {} workers, index {} pairs: p50 {:?} p99 {:?} p99.9 {:?} \
         (the digest alone: p50 {:?} p99 {:?})",
        eps.len(),
        affinity.index_pairs(),
        at(&mut times, 0.50),
        at(&mut times, 0.99),
        at(&mut times, 0.999),
        at(&mut digests, 0.50),
        at(&mut digests, 0.99),
    );
}

/// The fleet sizes to run: `TOKENMESH_BENCH_WORKERS` (comma-separated),
/// else 10, 64, 100, 1,000 and 10,000.
fn sizes() -> Vec<usize> {
    std::env::var("TOKENMESH_BENCH_WORKERS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10, 64, 100, 1_000, 10_000])
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let mut group = c.benchmark_group("worker_choice");
    for n in sizes() {
        let (_reg, eps) = workers(&rt, n);
        let aware = Affinity::new(AffinitySettings::default());
        let conversations = warm(&aware, &eps);
        percentiles(&aware, &eps, conversations, "cache-aware");
        let p2c = Affinity::new(AffinitySettings {
            choice: WorkerChoice::P2c,
            ..AffinitySettings::default()
        });
        percentiles(&p2c, &eps, conversations, "p2c");
        let req = conversation(3, 4);
        let mut rng = rand::rng();
        group.bench_with_input(BenchmarkId::new("cache-aware", n), &n, |b, _| {
            b.iter(|| {
                let r = aware.request(&req, "v1", None);
                black_box(r.choose(&Candidates::all(&eps), false, &mut rng).worker)
            })
        });
        group.bench_with_input(BenchmarkId::new("p2c", n), &n, |b, _| {
            b.iter(|| {
                let r = p2c.request(&req, "v1", None);
                black_box(r.choose(&Candidates::all(&eps), false, &mut rng).worker)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
