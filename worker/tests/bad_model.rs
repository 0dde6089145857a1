//! Model files the worker must refuse cleanly: an architecture it does not
//! run (the binary exits non-zero with one message naming what it found and
//! what it supports), a truncated file, a header declaring a 2^40-element
//! tensor, a context of 0, an absurd layer count. None may panic or allocate
//! what the header claims; each is a crafted tiny llama model (candle's GGUF
//! writer, the test model's tokenizer) with one thing broken.
mod common;

use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{forward_one, model_path};
use std::io::Cursor;
use std::path::Path;
use std::process::Command;
use tokenmesh_worker::engine::backend::{Backend, LoadOptions};
use tokenmesh_worker::engine::candle::CandleLlama;
use tokenmesh_worker::engine::kv::KvCache;
use tokenmesh_worker::engine::model::ModelError;

const HIDDEN: usize = 32;
const FFN: usize = 64;

/// A tiny llama model, GGUF bytes: `arch` as its architecture, the
/// metadata `edit` leaves, and the test model's tokenizer when `tokenizer`.
fn tiny_model(arch: &str, tokenizer: bool, edit: impl Fn(&mut Vec<(String, Value)>)) -> Vec<u8> {
    let mut md: Vec<(String, Value)> = Vec::new();
    let mut vocab = 256;
    if tokenizer {
        let mut f = std::fs::File::open(model_path()).unwrap();
        let real = Content::read(&mut f).unwrap();
        for (k, v) in real.metadata {
            if k.starts_with("tokenizer.") {
                if k == "tokenizer.ggml.tokens" {
                    vocab = v.to_vec().unwrap().len();
                }
                md.push((k, v));
            }
        }
    }
    md.push(("general.architecture".into(), Value::String(arch.into())));
    for (k, v) in [
        ("context_length", Value::U32(64)),
        ("embedding_length", Value::U32(HIDDEN as u32)),
        ("block_count", Value::U32(1)),
        ("feed_forward_length", Value::U32(FFN as u32)),
        ("attention.head_count", Value::U32(2)),
        ("attention.head_count_kv", Value::U32(1)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("rope.freq_base", Value::F32(10000.0)),
    ] {
        md.push((format!("{arch}.{k}"), v));
    }
    edit(&mut md);
    let kv = HIDDEN / 2;
    let shapes: Vec<(String, Vec<usize>)> = vec![
        ("token_embd.weight".into(), vec![vocab, HIDDEN]),
        ("output_norm.weight".into(), vec![HIDDEN]),
        ("blk.0.attn_norm.weight".into(), vec![HIDDEN]),
        ("blk.0.attn_q.weight".into(), vec![HIDDEN, HIDDEN]),
        ("blk.0.attn_k.weight".into(), vec![kv, HIDDEN]),
        ("blk.0.attn_v.weight".into(), vec![kv, HIDDEN]),
        ("blk.0.attn_output.weight".into(), vec![HIDDEN, HIDDEN]),
        ("blk.0.ffn_norm.weight".into(), vec![HIDDEN]),
        ("blk.0.ffn_gate.weight".into(), vec![FFN, HIDDEN]),
        ("blk.0.ffn_up.weight".into(), vec![FFN, HIDDEN]),
        ("blk.0.ffn_down.weight".into(), vec![HIDDEN, FFN]),
    ];
    let tensors: Vec<(String, QTensor)> = shapes
        .into_iter()
        .map(|(name, dims)| {
            let n: usize = dims.iter().product();
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 300.0)
                .collect();
            let t = Tensor::from_vec(values, dims, &Device::Cpu).unwrap();
            (name, QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &md_refs, &t_refs).unwrap();
    out.into_inner()
}

/// Both backends' load of `bytes`: Ok(()) if both load, else the CPU
/// backend's error (candle's must be an error too).
fn load_both(bytes: &[u8]) -> Result<(), String> {
    let mut r = Cursor::new(bytes);
    let content = Content::read(&mut r).map_err(|e| format!("header: {e}"))?;
    let opts = LoadOptions {
        threads: Some(1),
        ..LoadOptions::default()
    };
    let cpu = Backend::load(&content, &mut r, &Device::Cpu, &opts);
    let dense = CandleLlama::load(&content, &mut r, &Device::Cpu);
    match (cpu, dense) {
        (Ok(_), Ok(_)) => Ok(()),
        (Err(e), Err(_)) => Err(e.to_string()),
        (c, d) => panic!(
            "the backends disagree: cpu {:?}, candle {:?}",
            c.err().map(|e| e.to_string()),
            d.err().map(|e| e.to_string())
        ),
    }
}

#[test]
fn the_crafted_model_itself_loads_and_runs() {
    let bytes = tiny_model("llama", false, |_| {});
    load_both(&bytes).expect("the unbroken model loads");
    let mut r = Cursor::new(&bytes);
    let content = Content::read(&mut r).unwrap();
    let backend = Backend::load(&content, &mut r, &Device::Cpu, &LoadOptions::default()).unwrap();
    let mut pool = backend.kv_pool(1 << 20, 16).unwrap();
    let logits = forward_one(&backend, &mut pool, &[1, 2, 3], &mut KvCache::default());
    assert_eq!(logits.len(), 256);
    assert!(logits.iter().all(|x| x.is_finite()));
}

#[test]
fn a_truncated_file_is_refused() {
    let bytes = tiny_model("llama", false, |_| {});
    let len = bytes.len();
    for cut in [len - 1, len - 200, len / 2, 4096, 200, 24, 3] {
        let err = load_both(&bytes[..cut]).expect_err("a truncated file must not load");
        eprintln!("cut at {cut} of {len}: {err}");
    }
}

#[test]
fn a_tensor_of_2_pow_40_elements_is_refused_without_allocating_it() {
    let bytes = tiny_model("llama", false, |_| {});
    for dims in [vec![1usize << 20, 1 << 20], vec![1 << 40, 1 << 40, 1 << 40]] {
        let mut r = Cursor::new(&bytes);
        let mut content = Content::read(&mut r).unwrap();
        content
            .tensor_infos
            .get_mut("blk.0.ffn_down.weight")
            .unwrap()
            .shape = dims.clone().into();
        let opts = LoadOptions::default();
        let cpu = Backend::load(&content, &mut r, &Device::Cpu, &opts).err();
        let dense = CandleLlama::load(&content, &mut r, &Device::Cpu).err();
        for e in [cpu, dense] {
            let e = e.expect("a tensor beyond the file must be refused");
            assert!(
                matches!(&e, ModelError::Shape { name, .. } if name == "blk.0.ffn_down.weight"),
                "{dims:?}: {e}"
            );
        }
    }
}

#[test]
fn absurd_metadata_is_refused() {
    let set = |key: &'static str, v: Value| {
        move |md: &mut Vec<(String, Value)>| {
            for (k, val) in md.iter_mut() {
                if k == key {
                    *val = v.clone();
                }
            }
        }
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "llama.context_length",
            tiny_model("llama", false, set("llama.context_length", Value::U32(0))),
        ),
        (
            "llama.context_length",
            tiny_model(
                "llama",
                false,
                set("llama.context_length", Value::U64(1 << 40)),
            ),
        ),
        (
            "llama.block_count",
            tiny_model(
                "llama",
                false,
                set("llama.block_count", Value::U64(1 << 40)),
            ),
        ),
        (
            "heads",
            tiny_model(
                "llama",
                false,
                set("llama.attention.head_count_kv", Value::U32(0)),
            ),
        ),
        (
            "token_embd.weight",
            tiny_model(
                "llama",
                false,
                set("llama.embedding_length", Value::U32(1 << 30)),
            ),
        ),
    ];
    for (what, bytes) in cases {
        let err = load_both(&bytes).expect_err(what);
        assert!(err.contains(what), "{what}: {err}");
    }
}

/// The binary, given a model of another architecture, exits non-zero at
/// start-up with one line naming what it found and what it runs.
#[test]
fn the_worker_refuses_an_unsupported_architecture_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-gemma2.gguf");
    std::fs::write(&path, tiny_model("gemma2", true, |_| {})).unwrap();
    let out = worker_on(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the worker started: {stderr}");
    assert!(
        stderr.contains("\"gemma2\"") && stderr.contains("llama, qwen2, qwen3 and phi3"),
        "the message names the architecture found and those supported:\n{stderr}"
    );
}

/// A weight type the worker does not read (IQ4_XS here) and a tokenizer
/// model it does not implement: each refused at start-up by name, with what
/// is supported.
#[test]
fn the_worker_refuses_unsupported_weight_types_and_tokenizers_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = tiny_model("llama", true, |_| {});
    // The header entry of one tensor: name, dimension count, dimensions,
    // then its type (u32), which is set to ggml's IQ4_XS (23).
    let name = b"blk.0.ffn_down.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("the tensor's header entry");
    let dims_at = at + name.len();
    let n_dims = u32::from_le_bytes(bytes[dims_at..dims_at + 4].try_into().unwrap()) as usize;
    let type_at = dims_at + 4 + 8 * n_dims;
    bytes[type_at..type_at + 4].copy_from_slice(&23u32.to_le_bytes());
    let path = dir.path().join("tiny-iq4.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let out = worker_on(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the worker started: {stderr}");
    assert!(
        stderr.contains("blk.0.ffn_down.weight")
            && stderr.contains("IQ4_XS")
            && stderr.contains("Q4_K"),
        "the message names the tensor, its type and the supported types:\n{stderr}"
    );

    let path = dir.path().join("tiny-wpm.gguf");
    let set_model = |md: &mut Vec<(String, Value)>| {
        for (k, v) in md.iter_mut() {
            if k == "tokenizer.ggml.model" {
                *v = Value::String("bert".into());
            }
        }
    };
    std::fs::write(&path, tiny_model("llama", true, set_model)).unwrap();
    let out = worker_on(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the worker started: {stderr}");
    assert!(
        stderr.contains("bert") && stderr.contains("gpt2"),
        "the message names the tokenizer model found and those supported:\n{stderr}"
    );
}

/// A `general.alignment` of 0 (candle's reader divides by it) is refused at
/// start-up with a message, not a panic.
#[test]
fn the_worker_refuses_an_alignment_of_zero_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-align0.gguf");
    let bytes = tiny_model("llama", true, |md| {
        md.push(("general.alignment".into(), Value::U32(0)));
    });
    std::fs::write(&path, bytes).unwrap();
    let out = worker_on(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the worker started: {stderr}");
    assert!(
        stderr.contains("general.alignment is 0") && !stderr.contains("panicked"),
        "the message names the alignment:\n{stderr}"
    );
}

/// `tokenmesh-worker` on `model` until it exits (it must, at start-up).
fn worker_on(model: &Path) -> std::process::Output {
    let mut child = Command::new(tokenmesh_tests::bin("tokenmesh-worker"))
        .args(["--insecure", "--listen", "127.0.0.1:0", "--threads", "1"])
        .arg("--model")
        .arg(model)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting tokenmesh-worker");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the worker still runs 60 s after start-up on a model it cannot run");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}
