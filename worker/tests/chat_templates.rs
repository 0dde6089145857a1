//! Python's jinja2, set up as Hugging Face transformers sets it up
//! (tests/python/render_chat_template.py), as the judge of the worker's chat
//! templates: every template in llama.cpp's collection
//! (`src/models/templates/*.jinja` under `TOKENMESH_LLAMA_CPP`) renders a
//! set of conversations (with and without a system message, multi-turn,
//! with and without the generation prompt, non-ASCII text, quotes, newlines,
//! tabs) in both, with the same special tokens and the same fixed clock, and
//! the texts must be equal.
//!
//! The families the worker is meant to serve ([`REQUIRED`]) must render
//! every conversation, identically. Every other template must agree too (the
//! same text, or both refusing the conversation), except those in
//! [`KNOWN_DIFFERENCES`], listed with the reason; a listed one that comes to
//! agree fails the test until it is taken off the list.
//!
//! Python: `TOKENMESH_PYTHON` (else `python3`) with jinja2 installed.
use chrono::NaiveDate;
use serde_json::{json, Value as Json};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use tokenmesh_worker::engine::chat_template::{ChatTemplate, ChatTurn, Clock};

/// Templates that must render every conversation exactly as Python does.
const REQUIRED: &[&str] = &[
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "microsoft-Phi-3.5-mini-instruct",
    "HuggingFaceTB-SmolLM3-3B",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "ibm-granite-granite-3.3-2B-Instruct",
    "ibm-granite-granite-4.0",
];

/// Templates known to render differently, with the reason (none at
/// present: the tool-use templates that loop over `tools` unguarded used to
/// be here, until `tools` became Python's None, which fails to iterate on
/// both sides).
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[];

/// The date `strftime_now` sees on both sides.
fn fixed_clock() -> Clock {
    let date = NaiveDate::from_ymd_opt(2024, 7, 26).expect("a date");
    Arc::new(move || date.and_hms_opt(10, 30, 0).expect("a time"))
}
const FIXED_NOW: &str = "2024-07-26T10:30:00";

/// The family's BOS and EOS texts, as its tokenizer_config gives them to
/// transformers (first match on the lowercased file name).
fn special_tokens(name: &str) -> (&'static str, &'static str) {
    const TABLE: &[(&str, &str, &str)] = &[
        (
            "deepseek",
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
        ),
        ("llama-3", "<|begin_of_text|>", "<|eot_id|>"),
        ("firefunction", "<|begin_of_text|>", "<|eot_id|>"),
        ("functionary", "<|begin_of_text|>", "<|eot_id|>"),
        ("qwen", "", "<|im_end|>"),
        ("qwq", "", "<|im_end|>"),
        ("smollm3", "", "<|im_end|>"),
        ("phi-3", "<s>", "<|endoftext|>"),
        ("granite", "<|end_of_text|>", "<|end_of_text|>"),
        ("gemma", "<bos>", "<eos>"),
    ];
    let lower = name.to_lowercase();
    TABLE
        .iter()
        .find(|(key, _, _)| lower.contains(key))
        .map(|&(_, bos, eos)| (bos, eos))
        .unwrap_or(("<s>", "</s>"))
}

/// One conversation and whether the generation prompt is asked for.
struct Conversation {
    label: &'static str,
    turns: Vec<(&'static str, &'static str)>,
    add_generation_prompt: bool,
}

fn conversations() -> Vec<Conversation> {
    const SYSTEM: &str = "You are a concise assistant.\nAnswer in one sentence.";
    const SYSTEM_FR: &str = "Tu es un assistant « précis ».\nRéponds en français.";
    const Q1: &str = "What is the capital of France?";
    const A1: &str = "The capital of France is Paris.";
    const Q2: &str = "And of Japan?";
    const TRICKY_Q: &str = "Écris \"bonjour\" en 日本語 — puis 'au revoir'.\n\tMerci ! 🙂 \\n";
    const TRICKY_A: &str = "« Bonjour » se dit こんにちは.\n\n\"Au revoir\" : さようなら\n";
    let c = |label, turns: &[(&'static str, &'static str)], add_generation_prompt| Conversation {
        label,
        turns: turns.to_vec(),
        add_generation_prompt,
    };
    vec![
        c("one user turn", &[("user", Q1)], true),
        c(
            "multi-turn",
            &[("user", Q1), ("assistant", A1), ("user", Q2)],
            true,
        ),
        c(
            "multi-turn, no generation prompt",
            &[("user", Q1), ("assistant", A1), ("user", Q2)],
            false,
        ),
        c(
            "system, multi-turn",
            &[
                ("system", SYSTEM),
                ("user", Q1),
                ("assistant", A1),
                ("user", Q2),
            ],
            true,
        ),
        c(
            "system, ends with the assistant",
            &[("system", SYSTEM), ("user", Q1), ("assistant", A1)],
            false,
        ),
        c(
            "non-ASCII, quotes, newlines",
            &[
                ("system", SYSTEM_FR),
                ("user", TRICKY_Q),
                ("assistant", TRICKY_A),
                ("user", TRICKY_Q),
            ],
            true,
        ),
        c(
            "non-ASCII without system",
            &[("user", TRICKY_Q), ("assistant", TRICKY_A), ("user", Q2)],
            false,
        ),
    ]
}

/// What one renderer made of one case.
#[derive(Debug, PartialEq)]
enum Outcome {
    Text(String),
    Error(String),
}

fn templates_dir() -> Option<PathBuf> {
    let Some(root) = std::env::var_os("TOKENMESH_LLAMA_CPP") else {
        eprintln!(
            "SKIPPED: TOKENMESH_LLAMA_CPP is not set; point it at the llama.cpp sources (the \
             directory with src/models/templates; scripts/llama-cpp.sh prepares target/llama.cpp)"
        );
        return None;
    };
    let dir = Path::new(&root).join("src/models/templates");
    assert!(
        dir.is_dir(),
        "{} is missing: TOKENMESH_LLAMA_CPP must name the llama.cpp sources",
        dir.display()
    );
    Some(dir)
}

fn template_files(dir: &Path) -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
        .map(|p| {
            let name = p
                .file_stem()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            let source =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (name, source)
        })
        .collect();
    files.sort();
    files
}

/// Every case rendered by tests/python/render_chat_template.py, in order.
fn python_outcomes(cases: &[Json]) -> Vec<Outcome> {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/render_chat_template.py");
    let python = std::env::var("TOKENMESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut child = Command::new(&python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {python} {}: {e}", script.display()));
    let input = serde_json::to_vec(cases).expect("cases as JSON");
    let mut stdin = child.stdin.take().expect("stdin");
    // Written from a thread so a large reply cannot block both pipes.
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("the renderer's output");
    writer
        .join()
        .expect("the writer")
        .expect("writing the cases");
    assert!(
        out.status.success(),
        "{python} {} failed ({}; is jinja2 installed?):\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let replies: Vec<Json> = serde_json::from_slice(&out.stdout).expect("the renderer's JSON");
    assert_eq!(replies.len(), cases.len(), "one reply per case");
    replies
        .into_iter()
        .map(|r| match (r["text"].as_str(), r["error"].as_str()) {
            (Some(text), _) => Outcome::Text(text.to_string()),
            (_, Some(error)) => Outcome::Error(error.to_string()),
            _ => panic!("a reply with neither text nor error: {r}"),
        })
        .collect()
}

/// Where two texts part, with a little of each around it.
fn first_difference(ours: &str, python: &str) -> String {
    let at = ours
        .char_indices()
        .zip(python.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(ours.len().min(python.len()));
    let around = |s: &str| {
        let start = s.floor_char_boundary(at.saturating_sub(40));
        let end = s.ceil_char_boundary((at + 40).min(s.len()));
        s[start..end].to_string()
    };
    format!(
        "at byte {at}: worker {:?} / python {:?}",
        around(ours),
        around(python)
    )
}

/// How one template fared.
#[derive(Default)]
struct Verdict {
    /// Cases both rendered to the same text.
    same_text: usize,
    /// Cases both refused.
    both_refused: usize,
    /// Descriptions of the cases that disagreed.
    differences: Vec<String>,
}

#[test]
fn chat_templates_render_as_transformers_renders_them() {
    let Some(dir) = templates_dir() else {
        return;
    };
    let templates = template_files(&dir);
    for name in REQUIRED {
        assert!(
            templates.iter().any(|(n, _)| n == name),
            "required template {name}.jinja is not in {}",
            dir.display()
        );
    }
    let convs = conversations();
    let mut cases = Vec::new();
    for (name, source) in &templates {
        let (bos, eos) = special_tokens(name);
        for conv in &convs {
            let messages: Vec<Json> = conv
                .turns
                .iter()
                .map(|(role, content)| json!({ "role": role, "content": content }))
                .collect();
            cases.push(json!({
                "template": source,
                "messages": messages,
                "add_generation_prompt": conv.add_generation_prompt,
                "bos_token": bos,
                "eos_token": eos,
                "now": FIXED_NOW,
            }));
        }
    }
    let python = python_outcomes(&cases);
    let mut python = python.into_iter();

    let mut verdicts = Vec::new();
    for (name, source) in &templates {
        let (bos, eos) = special_tokens(name);
        let compiled = ChatTemplate::with_clock(source, Some(bos), Some(eos), fixed_clock());
        let mut verdict = Verdict::default();
        for conv in &convs {
            let want = python.next().expect("a Python outcome per case");
            let turns: Vec<ChatTurn> = conv
                .turns
                .iter()
                .map(|(role, content)| ChatTurn {
                    role: role.to_string(),
                    content: content.to_string(),
                })
                .collect();
            let got = match &compiled {
                Ok(t) => match t.render(&turns, conv.add_generation_prompt) {
                    Ok(text) => Outcome::Text(text),
                    Err(e) => Outcome::Error(format!("{e:#}")),
                },
                Err(e) => Outcome::Error(e.to_string()),
            };
            let label = format!(
                "{} (generation prompt {})",
                conv.label, conv.add_generation_prompt
            );
            match (&got, &want) {
                (Outcome::Text(a), Outcome::Text(b)) if a == b => verdict.same_text += 1,
                (Outcome::Text(a), Outcome::Text(b)) => verdict
                    .differences
                    .push(format!("{label}: {}", first_difference(a, b))),
                (Outcome::Error(_), Outcome::Error(_)) => verdict.both_refused += 1,
                (Outcome::Error(e), Outcome::Text(_)) => verdict
                    .differences
                    .push(format!("{label}: the worker refused, Python rendered: {e}")),
                (Outcome::Text(_), Outcome::Error(e)) => verdict
                    .differences
                    .push(format!("{label}: Python refused, the worker rendered: {e}")),
            }
        }
        verdicts.push((name.as_str(), verdict));
    }

    let mut failures = Vec::new();
    let mut agreeing = 0;
    for (name, v) in &verdicts {
        let required = REQUIRED.contains(name);
        let known = KNOWN_DIFFERENCES.iter().find(|(n, _)| n == name);
        let agrees = v.differences.is_empty();
        agreeing += usize::from(agrees);
        eprintln!(
            "{name}: {} of {} cases the same text, {} refused by both{}",
            v.same_text,
            convs.len(),
            v.both_refused,
            if required { " [required]" } else { "" }
        );
        for d in &v.differences {
            eprintln!("    {d}");
        }
        if required && v.same_text != convs.len() {
            failures.push(format!(
                "{name} (required) rendered {} of {} cases as Python does",
                v.same_text,
                convs.len()
            ));
        } else if !agrees && known.is_none() {
            failures.push(format!("{name} renders differently from Python"));
        } else if agrees && known.is_some() {
            failures.push(format!(
                "{name} now agrees with Python: take it off KNOWN_DIFFERENCES"
            ));
        }
        if let Some((_, reason)) = known {
            eprintln!("    known difference: {reason}");
        }
    }
    eprintln!(
        "{agreeing} of {} templates agree with Python on all {} conversations ({} required)",
        verdicts.len(),
        convs.len(),
        REQUIRED.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
