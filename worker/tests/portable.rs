//! The portable kernels (what a CPU without AVX2 runs) end to end: with the
//! SIMD kernels turned off (`--cpu-simd false`), the model answers the
//! reference chat prompt as the SIMD kernels and llama.cpp do.
mod common;

use tokenmesh_worker::engine::backend::Backend;
use tokenmesh_worker::engine::{CpuKernels, LoadOptions, LoadedModel};

#[test]
fn portable_kernels_answer_like_the_simd_ones() {
    let opts = LoadOptions {
        cpu_kernels: CpuKernels::new(false, true),
        ..Default::default()
    };
    let model = LoadedModel::load_with(&common::model_path(), &candle_core::Device::Cpu, &opts)
        .expect("model loads");
    let Backend::Cpu(cpu) = &model.backend else {
        panic!("the CPU backend");
    };
    assert_eq!(cpu.kernels(), CpuKernels::portable());
    assert_eq!(
        common::france_reply(&model),
        "The capital of France is Paris."
    );
}
