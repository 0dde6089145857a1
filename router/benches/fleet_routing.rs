//! The routing decision at fleet sizes (issue 19, "Fleet scale"): what one
//! request costs the router between admission and the call to a worker, with
//! 10, 100 and 1,000 registered workers of one model.
//!
//! The decision is the request path's own code, step for step as
//! `Router::route` and `Attempts::open` run it: the model lookup, the model's
//! entry, the version choice, the version's endpoints, the `candidates`
//! description written on the `route` span, power of two choices and the
//! reason recorded for it. The endpoints are real: every id is registered at
//! one in-process synthetic worker and is ready because its Status poll
//! answered (the poll interval is an hour, so no poll runs while the decision
//! is measured).
//!
//! Criterion reports the mean; the target is a tail (under 10 µs p99 at
//! 1,000 workers), so `decision_tail` also times 20,000 single decisions one
//! by one and prints p50, p99 and p99.9. `aware_tail` does the same for the
//! default cache-aware choice (`Affinity::choose` with the `route` span's
//! explanation, as `Attempts::open` calls it), over a warm prefix index of 8
//! conversations per worker.
use clap::Parser;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_proto::records::{PolicyRecord, WorkerRecord};
use tokenmesh_proto::v1::{ChatMessage, GenerateRequest};
use tokenmesh_router::config::ChannelSettings;
use tokenmesh_router::registry::Registry;
use tokenmesh_router::route::affinity::{Affinity, AffinitySettings};
use tokenmesh_router::route::attempt::describe;
use tokenmesh_router::route::candidates::Candidates;
use tokenmesh_router::route::p2c;
use tokenmesh_router::route::version::{choose_version, VersionAsk};
use tokenmesh_worker::config::WorkerConfig;

const MODEL: &str = "m";
const SIZES: [usize; 4] = [10, 64, 100, 1_000];

/// One synthetic worker on a runtime of its own, and its address.
fn start_worker() -> (tokio::runtime::Runtime, String) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the worker");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("worker address");
    let cfg = WorkerConfig::try_parse_from([
        "tokenmesh-worker",
        "--insecure",
        "--engine",
        "synthetic",
        "--model-name",
        MODEL,
        "--worker-id",
        "bench-worker",
    ])
    .expect("worker flags");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("worker runtime");
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("worker listener");
        if let Err(e) = tokenmesh_worker::run(cfg, listener, std::future::pending()).await {
            eprintln!("bench worker failed: {e}");
        }
    });
    (runtime, format!("http://{addr}"))
}

/// A registry holding `n` ready workers of `MODEL`/v1 (all at `addr`) and a
/// policy, once every one has answered its first Status poll.
fn fleet(rt: &tokio::runtime::Runtime, n: usize, addr: &str) -> Arc<Registry> {
    rt.block_on(async {
        let reg = Registry::new(
            ChannelSettings {
                keepalive_interval: Duration::from_secs(30),
                keepalive_timeout: Duration::from_secs(10),
                connect_timeout: Duration::from_secs(5),
                status_interval: Duration::from_secs(3_600),
                status_poll_budget: None,
            },
            None,
        );
        reg.set_policy(
            MODEL,
            Some(PolicyRecord {
                stable: "v1".into(),
                ..Default::default()
            }),
        );
        for i in 0..n {
            let record = WorkerRecord {
                device: "cpu".into(),
                capacity: 8,
                ..WorkerRecord::new(addr)
            };
            reg.upsert_worker(&format!("worker-{i:05}"), MODEL, "v1", record)
                .expect("a valid address");
        }
        while reg.ready_workers() < n {
            tokio::time::timeout(Duration::from_secs(30), reg.changed())
                .await
                .expect("every worker answers its first Status poll within 30 s");
        }
        reg
    })
}

/// One routing decision, as `Router::route` and `Attempts::open` make it.
fn decide(reg: &Registry, rng: &mut impl rand::Rng) -> usize {
    assert!(reg.has_model(MODEL));
    let entry = reg.model(MODEL).expect("the model is known");
    let choice = choose_version(MODEL, &entry, VersionAsk::default(), rng).expect("a version");
    let candidates = reg.endpoints(MODEL, &choice.version);
    let described = describe(&candidates);
    let picked = p2c::pick(&candidates, &[], rng).expect("a ready worker");
    let reason = p2c::reason(&candidates, &[]);
    described.len() + picked.id.len() + reason.len()
}

/// Turn `turn` of conversation `c`: a shared system prompt, the earlier
/// turns, a new question.
fn conversation(c: usize, turn: usize) -> GenerateRequest {
    let mut messages = vec![ChatMessage {
        role: "system".into(),
        content: "You are a helpful assistant for a travel company; answer briefly.".repeat(3),
    }];
    for t in 0..=turn {
        messages.push(ChatMessage {
            role: "user".into(),
            content: format!(
                "Conversation {c}, question {t}: which trains run from Lyon to Turin?"
            ),
        });
        if t < turn {
            messages.push(ChatMessage {
                role: "assistant".into(),
                content: format!("Reply {t}: two direct trains leave Lyon in the morning."),
            });
        }
    }
    GenerateRequest {
        model: MODEL.into(),
        messages,
        ..Default::default()
    }
}

/// One cache-aware routing decision for `req`, as `Router::route` and
/// `Attempts::open` make it (the `route` span's explanation included).
fn decide_aware(
    reg: &Registry,
    affinity: &Arc<Affinity>,
    req: &GenerateRequest,
    rng: &mut impl rand::Rng,
) -> usize {
    assert!(reg.has_model(MODEL));
    let entry = reg.model(MODEL).expect("the model is known");
    let choice = choose_version(MODEL, &entry, VersionAsk::default(), rng).expect("a version");
    let candidates = reg.endpoints(MODEL, &choice.version);
    let r = affinity.request(req, &choice.version, None);
    let chosen = r.choose(&Candidates::all(&candidates), true, rng);
    let worker = chosen.worker.expect("a ready worker");
    chosen.candidates.len() + worker.id.len() + chosen.reason.len()
}

/// A cache-aware choice whose index holds 8 conversations × 4 turns per
/// worker of `reg`; returns it and the conversations' next turns.
fn warm(reg: &Registry, n: usize) -> (Arc<Affinity>, Vec<GenerateRequest>) {
    let affinity = Affinity::new(AffinitySettings::default());
    let candidates = reg.endpoints(MODEL, "v1");
    let mut rng = rand::rng();
    for turn in 0..4 {
        for c in 0..n * 8 {
            let r = affinity.request(&conversation(c, turn), "v1", None);
            let chosen = r.choose(&Candidates::all(&candidates), false, &mut rng);
            r.opened(&chosen.worker.expect("a ready worker"));
        }
    }
    (affinity, (0..n * 8).map(|c| conversation(c, 4)).collect())
}

/// p50, p99 and p99.9 of `ns`, in µs.
fn tail(label: &str, n: usize, mut ns: Vec<u64>) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1_000.0;
    println!(
        "{label}/{n}: p50 {:.2} us  p99 {:.2} us  p99.9 {:.2} us",
        at(0.50),
        at(0.99),
        at(0.999)
    );
}

fn bench(c: &mut Criterion) {
    let (_worker, addr) = start_worker();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("bench runtime");
    let fleets: Vec<(usize, Arc<Registry>)> =
        SIZES.iter().map(|&n| (n, fleet(&rt, n, &addr))).collect();
    let mut rng = rand::rng();

    let mut group = c.benchmark_group("route_decision");
    for (n, reg) in &fleets {
        group.bench_with_input(BenchmarkId::from_parameter(n), reg, |b, reg| {
            b.iter(|| black_box(decide(reg, &mut rng)))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("p2c_pick");
    for (n, reg) in &fleets {
        let candidates = reg.endpoints(MODEL, "v1");
        group.bench_with_input(BenchmarkId::from_parameter(n), &candidates, |b, cands| {
            b.iter(|| black_box(p2c::pick(cands, &[], &mut rng)))
        });
    }
    group.finish();

    let aware: Vec<(Arc<Affinity>, Vec<GenerateRequest>)> =
        fleets.iter().map(|(n, reg)| warm(reg, *n)).collect();
    let mut group = c.benchmark_group("route_decision_cache_aware");
    for ((n, reg), (affinity, requests)) in fleets.iter().zip(&aware) {
        let mut i = 0;
        group.bench_with_input(BenchmarkId::from_parameter(n), reg, |b, reg| {
            b.iter(|| {
                i = (i + 1) % requests.len();
                black_box(decide_aware(reg, affinity, &requests[i], &mut rng))
            })
        });
    }
    group.finish();

    // The tail: single decisions timed one by one.
    for (n, reg) in &fleets {
        let ns: Vec<u64> = (0..20_000)
            .map(|_| {
                let t = Instant::now();
                black_box(decide(reg, &mut rng));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        tail("decision_tail", *n, ns);
    }
    for ((n, reg), (affinity, requests)) in fleets.iter().zip(&aware) {
        let ns: Vec<u64> = (0..20_000)
            .map(|i| {
                let req = &requests[i % requests.len()];
                let t = Instant::now();
                black_box(decide_aware(reg, affinity, req, &mut rng));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        tail("aware_tail", *n, ns);
    }
    drop(aware);
    drop(fleets);
    rt.shutdown_background();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(50)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
