//! llama.cpp's own vocabulary test suite as the judge of the worker's
//! tokenizers: every `models/ggml-vocab-NAME.gguf` listed below with its
//! `.inp`/`.out` cases, consumed as llama.cpp's tests/test-tokenizer-0.cpp
//! consumes them (cases separated by "\n__ggml_vocab_test__\n", one line of
//! ids per case, add_special and parse_special off), must tokenize exactly;
//! decoding must give the text back and streamed deltas stay valid UTF-8.
//! Also the `tokenize` subcommand, run as a binary on vocabulary-only files.
//!
//! The llama.cpp sources are found through `TOKENMESH_LLAMA_CPP` (the
//! directory holding `src/models`; scripts/test.sh sets it).
use candle_core::quantized::gguf_file::Content;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use tokenmesh_worker::engine::detokenize::TextStream;
use tokenmesh_worker::engine::tokenizer::{EncodeOptions, GgufTokenizer};

/// The text-model vocabularies of llama.cpp's suite the worker supports.
const VOCABS: &[&str] = &[
    "llama-bpe",
    "llama-spm",
    "qwen2",
    "qwen35",
    "phi-3",
    "gpt-2",
    "starcoder",
    "refact",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "mpt",
    "command-r",
];

/// Vocabularies known not to be exact yet, with the reason. Their
/// mismatches are still counted and printed; one that becomes exact fails
/// the test until it is taken off this list.
const KNOWN_EXCEPTIONS: &[(&str, &str)] = &[];

fn models_dir() -> PathBuf {
    let root = std::env::var_os("TOKENMESH_LLAMA_CPP").unwrap_or_else(|| {
        panic!(
            "TOKENMESH_LLAMA_CPP is not set: point it at the llama.cpp sources (the directory \
             with src/models/ggml-vocab-*.gguf; scripts/llama-cpp.sh prepares target/llama.cpp)"
        )
    });
    let dir = Path::new(&root).join("src/models");
    assert!(
        dir.join("ggml-vocab-gpt-2.gguf").is_file(),
        "{} has no ggml-vocab-*.gguf files: TOKENMESH_LLAMA_CPP must name the llama.cpp \
         sources (with src/models)",
        dir.display()
    );
    dir
}

fn vocab_path(name: &str) -> PathBuf {
    models_dir().join(format!("ggml-vocab-{name}.gguf"))
}

fn load(path: &Path) -> GgufTokenizer {
    let mut file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let content = Content::read(&mut file).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    GgufTokenizer::from_gguf(&content).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every listed vocabulary, loaded once for all tests of this binary.
fn tokenizers() -> &'static BTreeMap<&'static str, GgufTokenizer> {
    static ALL: OnceLock<BTreeMap<&'static str, GgufTokenizer>> = OnceLock::new();
    ALL.get_or_init(|| {
        std::thread::scope(|s| {
            let handles: Vec<_> = VOCABS
                .iter()
                .map(|&name| s.spawn(move || (name, load(&vocab_path(name)))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("loading a vocabulary"))
                .collect()
        })
    })
}

/// The cases of a vocabulary, read as test-tokenizer-0.cpp reads them.
fn cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let gguf = vocab_path(name);
    let read = |ext: &str| {
        let p = PathBuf::from(format!("{}.{ext}", gguf.display()));
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    // As the C++ loop: no case after a separator that ends the file.
    let raw = read("inp");
    let mut inputs: Vec<String> = Vec::new();
    let mut rest = raw.as_str();
    while !rest.is_empty() {
        let (case, next) = rest
            .split_once("\n__ggml_vocab_test__\n")
            .unwrap_or((rest, ""));
        inputs.push(case.to_string());
        rest = next;
    }
    let outputs: Vec<Vec<u32>> = read("out")
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|id| {
                    id.parse()
                        .unwrap_or_else(|e| panic!("{name}.out: {id:?}: {e}"))
                })
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out disagree on the case count"
    );
    assert!(!inputs.is_empty(), "{name}: no cases");
    inputs.into_iter().zip(outputs).collect()
}

#[test]
fn every_vocabulary_tokenizes_as_llama_cpp() {
    let mut unexpected = Vec::new();
    let mut report = Vec::new();
    for (&name, tok) in tokenizers() {
        let cases = cases(name);
        let mut mismatches = Vec::new();
        for (text, expected) in &cases {
            let got = tok.encode_with(text, EncodeOptions::TEXT).expect("encode");
            if &got != expected {
                mismatches.push(format!(
                    "  {text:?}\n    expected {expected:?}\n    got      {got:?}"
                ));
            }
        }
        report.push(format!(
            "{name}: {}/{} cases exact",
            cases.len() - mismatches.len(),
            cases.len()
        ));
        let known = KNOWN_EXCEPTIONS.iter().find(|(n, _)| *n == name);
        match (known, mismatches.is_empty()) {
            (Some((_, why)), false) => report.push(format!(
                "  known exception ({why}): {} mismatches\n{}",
                mismatches.len(),
                mismatches.join("\n")
            )),
            (Some(_), true) => {
                unexpected.push(format!("{name} is exact now: take it off KNOWN_EXCEPTIONS"))
            }
            (None, false) => unexpected.push(format!(
                "{name}: {} mismatches\n{}",
                mismatches.len(),
                mismatches.join("\n")
            )),
            (None, true) => {}
        }
    }
    println!("{}", report.join("\n"));
    assert!(unexpected.is_empty(), "{}", unexpected.join("\n"));
}

#[test]
fn decoding_round_trips_and_streams_valid_utf8() {
    let mut failures = Vec::new();
    let mut byte_tokens_seen = 0;
    for (&name, tok) in tokenizers() {
        for (text, _) in cases(name) {
            let ids = tok.encode_with(&text, EncodeOptions::TEXT).expect("encode");
            let decoded = tok.decode(&ids);
            if decoded != text {
                failures.push(format!("{name}: {text:?} decoded as {decoded:?}"));
            }
            // Streaming one token at a time: every delta is whole characters
            // (a String), and together they are the text, byte tokens included.
            let mut stream = TextStream::new(Vec::new());
            let mut streamed = String::new();
            for &id in &ids {
                let piece = tok.token_bytes(id);
                if piece.len() == 1 && !piece[0].is_ascii() {
                    byte_tokens_seen += 1;
                }
                streamed.push_str(&stream.push(piece).text);
            }
            streamed.push_str(&stream.finish());
            let all: Vec<u8> = ids
                .iter()
                .flat_map(|&id| tok.token_bytes(id))
                .copied()
                .collect();
            assert_eq!(streamed.as_bytes(), &all[..], "{name}: {text:?}");
        }
    }
    assert!(
        byte_tokens_seen > 0,
        "no case produced a token carrying part of a character: the streaming check proved nothing"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn sentencepiece_byte_fallback_spells_unknown_characters_in_bytes() {
    let tok = &tokenizers()["llama-spm"];
    // U+10FFFF is in no vocabulary: four <0xXX> tokens after the "▁" piece.
    let ids = tok.encode_with("\u{10FFFF}", EncodeOptions::TEXT).unwrap();
    let texts: Vec<&str> = ids.iter().map(|&id| tok.token_text(id).unwrap()).collect();
    assert_eq!(texts, ["▁", "<0xF4>", "<0x8F>", "<0xBF>", "<0xBF>"]);
    assert_eq!(tok.decode(&ids), "\u{10FFFF}");
    // Prompts get Llama 2's BOS; a BOS the text already starts with is not doubled.
    assert_eq!(tok.encode("Hi").unwrap()[0], 1);
    let ids = tok.encode("<s>Hi").unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1, "{ids:?}");
}

#[test]
fn llama3_prompts_start_with_begin_of_text_and_parse_headers() {
    let tok = &tokenizers()["llama-bpe"];
    assert!(tok.adds_bos());
    let ids = tok
        .encode("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
        .unwrap();
    let texts: Vec<&str> = ids.iter().map(|&id| tok.token_text(id).unwrap()).collect();
    assert_eq!(
        texts,
        [
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "user",
            "<|end_header_id|>",
            "ĊĊ",
            "Hi",
            "<|eot_id|>"
        ]
    );
    let eot = ids[ids.len() - 1];
    assert!(
        tok.eos_token_ids().contains(&eot),
        "<|eot_id|> ends generation"
    );
}

fn worker(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tokenmesh-worker"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tokenmesh-worker");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("tokenmesh-worker output")
}

#[test]
fn tokenize_subcommand_reads_vocabulary_only_files() {
    let path = vocab_path("llama-bpe");
    let model = path.to_str().unwrap();
    let tok = &tokenizers()["llama-bpe"];
    let lines = ["Hello world", "", " this is 🦙.cpp", "<|eot_id|> 333333"];
    let input = lines.join("\n") + "\n";

    let out = worker(
        &[
            "tokenize",
            "--model",
            model,
            "--add-special",
            "false",
            "--parse-special",
            "false",
        ],
        &input,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let got: Vec<&str> = stdout.lines().collect();
    assert_eq!(got.len(), lines.len(), "{stdout}");
    for (line, text) in got.iter().zip(lines) {
        let ids: Vec<String> = tok
            .encode_with(text, EncodeOptions::TEXT)
            .unwrap()
            .iter()
            .map(u32::to_string)
            .collect();
        assert_eq!(*line, ids.join(" "), "{text:?}");
    }

    // Defaults are the prompt's: BOS first, control texts as their ids.
    let out = worker(&["tokenize", "--model", model, "--json"], &input);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let records: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(records.len(), lines.len());
    for (record, text) in records.iter().zip(lines) {
        assert_eq!(record["text"], *text);
        let ids: Vec<u32> = serde_json::from_value(record["ids"].clone()).unwrap();
        assert_eq!(ids, tok.encode_with(text, EncodeOptions::PROMPT).unwrap());
        assert_eq!(ids[0], 128000, "BOS of {text:?}");
    }
    assert_eq!(records[3]["ids"][1], 128009, "<|eot_id|> parsed");
}

#[test]
fn tokenize_subcommand_refuses_unsupported_and_broken_files() {
    // A BERT (WordPiece) vocabulary: named, with what is supported.
    let bert = models_dir().join("ggml-vocab-bert-bge.gguf");
    let out = worker(&["tokenize", "--model", bert.to_str().unwrap()], "hi\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("tokenizer.ggml.model = bert") && stderr.contains("supported are"),
        "{stderr}"
    );
    // A file cut short inside its vocabulary.
    let dir = std::env::temp_dir().join(format!("tokenmesh-tokenize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = std::fs::read(vocab_path("gpt-2")).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let out = worker(&["tokenize", "--model", cut.to_str().unwrap()], "hi\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    std::fs::remove_dir_all(&dir).ok();
    assert!(!out.status.success());
    assert!(stderr.contains("not a readable GGUF file"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn truncated_vocabularies_are_errors_not_panics() {
    let bytes = std::fs::read(vocab_path("llama-spm")).unwrap();
    for cut in (1..16)
        .map(|i| bytes.len() * i / 16)
        .chain([0, 3, 10, 30, 100])
    {
        let mut reader = std::io::Cursor::new(&bytes[..cut]);
        if let Ok(content) = Content::read(&mut reader) {
            // Whatever metadata survived must be refused or make a tokenizer.
            let _ = GgufTokenizer::from_gguf(&content);
        }
    }
}
