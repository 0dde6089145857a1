//! The portable kernels (what a CPU without AVX2 runs) end to end: with
//! `TOKENMESH_CPU_SIMD=0` the model answers the reference chat prompt as the
//! SIMD kernels and llama.cpp do. Its own test binary, so the setting is in
//! place before any kernel runs.
mod common;

use tokenmesh_worker::engine::cpu::matmul::simd_available;
use tokenmesh_worker::engine::LoadedModel;

#[test]
fn portable_kernels_answer_like_the_simd_ones() {
    std::env::set_var("TOKENMESH_CPU_SIMD", "0");
    assert!(!simd_available());
    let model =
        LoadedModel::load(&common::model_path(), &candle_core::Device::Cpu).expect("model loads");
    assert_eq!(
        common::france_reply(&model),
        "The capital of France is Paris."
    );
}
