//! One engine step on the real model, without gRPC or the scheduler: a
//! decode step for 1, 4 and 16 sequences (each with 64 tokens of context),
//! and a 128-token prompt chunk. Needs the default model
//! (`TOKENMESH_TEST_MODEL`, else the model cache); `scripts/test.sh` fetches it.
//!
//! Run: `cargo bench -p tokenmesh-worker --bench engine_step`
//! (`TOKENMESH_THREADS` sets the compute threads, as the worker's
//! `--threads` does, default every core; `TOKENMESH_CPU_SIMD=0` and
//! `TOKENMESH_CPU_VNNI=0` turn kernels off, as `--cpu-simd` and `--cpu-vnni`
//! do).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tokenmesh_tests::model_path;
use tokenmesh_worker::engine::kv::{KvCache, KvPool};
use tokenmesh_worker::engine::model::SeqStep;
use tokenmesh_worker::engine::{CpuKernels, LoadOptions, LoadedModel};

/// A kernel switch: on unless the variable says 0 or false, as the worker's
/// `--cpu-simd` and `--cpu-vnni` read it.
fn switch(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| !matches!(v.trim(), "0" | "false"))
}

/// `n` sequences, each with `context` tokens already in its cache.
fn prefilled(model: &LoadedModel, pool: &mut KvPool, n: usize, context: usize) -> Vec<KvCache> {
    let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + i * 7 % 5000).collect();
    (0..n)
        .map(|_| {
            let mut c = KvCache::default();
            pool.reserve(&mut c, context + 64).unwrap();
            model
                .backend
                .forward(
                    pool,
                    &mut [SeqStep {
                        tokens: &prompt,
                        cache: &mut c,
                    }],
                )
                .unwrap();
            c
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let path = model_path();
    if !path.is_file() {
        eprintln!("{} is missing: run scripts/test.sh first", path.display());
        return;
    }
    // The benchmark is a binary: its settings come from the environment at
    // this edge, under the worker's variable names, and are passed down.
    let threads = std::env::var("TOKENMESH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok());
    let opts = LoadOptions {
        threads,
        cpu_kernels: CpuKernels::new(switch("TOKENMESH_CPU_SIMD"), switch("TOKENMESH_CPU_VNNI")),
    };
    let model =
        LoadedModel::load_with(&path, &candle_core::Device::Cpu, &opts).expect("model loads");
    let mut group = c.benchmark_group("decode_step");
    for n in [1usize, 4, 16] {
        let mut pool = model.backend.kv_pool(256 << 20, 16).unwrap();
        let mut caches = prefilled(&model, &mut pool, n, 64);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                let tokens = [42u32];
                let mut batch: Vec<SeqStep<'_>> = caches
                    .iter_mut()
                    .map(|cache| SeqStep {
                        tokens: &tokens,
                        cache,
                    })
                    .collect();
                model.backend.forward(&mut pool, &mut batch).unwrap();
                // Rewind, so every iteration decodes at position 64.
                for s in batch.iter_mut() {
                    s.cache.truncate(64);
                }
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("prefill_chunk");
    group.sample_size(10);
    let chunk: Vec<u32> = (0..128u32).map(|i| 200 + i * 13 % 7000).collect();
    let mut pool = model.backend.kv_pool(64 << 20, 16).unwrap();
    group.throughput(Throughput::Elements(chunk.len() as u64));
    group.bench_function("128", |b| {
        b.iter(|| {
            let mut cache = KvCache::default();
            pool.reserve(&mut cache, chunk.len()).unwrap();
            model
                .backend
                .forward(
                    &mut pool,
                    &mut [SeqStep {
                        tokens: &chunk,
                        cache: &mut cache,
                    }],
                )
                .unwrap();
            pool.release(&mut cache);
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
