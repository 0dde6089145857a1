//! The model the suites run: one place that knows where the test model is, for
//! this crate and for tokenmesh-worker's own tests and benchmarks (a
//! dev-dependency there).
use std::path::PathBuf;

/// The model file: `TOKENMESH_TEST_MODEL`, else the default model in the
/// model cache (`TOKENMESH_MODEL_CACHE`, else `~/.cache/tokenmesh/models`).
/// A missing file fails the caller: model-backed checks must not skip.
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("TOKENMESH_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let cache = std::env::var_os("TOKENMESH_MODEL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".cache/tokenmesh/models"));
    // tokenmesh_worker::model_cache::DEFAULT_FILE; not imported, because the
    // worker's tests depend on this crate.
    let p = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model file {} is missing: run scripts/test.sh or `meshctl fetch-model` (they fetch it), \
         or set TOKENMESH_TEST_MODEL",
        p.display()
    );
    p
}

/// The name the default model is served under.
pub const MODEL: &str = "smollm2-135m-instruct";
