//! The OpenAI-compatible HTTP API (issue 16) through real clients: the
//! official `openai` Python library, LangChain's `ChatOpenAI` and `curl -N`,
//! against a real router and real workers (the real model where the output
//! is compared, the synthetic engine where only the plumbing matters).
use nix::sys::signal::Signal;
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::time::Duration;
use tokenmesh_certs::Role;
use tokenmesh_proto::v1::{ChatMessage, FinishReason, GenerateRequest};
use tokenmesh_tests::*;

const SYSTEM: &str = "You are a helpful assistant.";

/// The chat openai_client.py sends: its system message and `prompt`.
fn chat_request(prompt: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        messages: vec![
            ChatMessage {
                role: "system".into(),
                content: SYSTEM.into(),
            },
            ChatMessage {
                role: "user".into(),
                content: prompt.into(),
            },
        ],
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// A synthetic worker of `version` (no etcd) at `rate` tokens/s.
async fn synthetic(id: &str, version: &str, rate: f64, dir: &Path) -> WorkerProc {
    let opts = WorkerOpts {
        version: version.into(),
        extra: vec!["--model-name".into(), MODEL.into()],
        synthetic_tokens_per_sec: Some(rate),
        ..WorkerOpts::new(id)
    };
    WorkerProc::start(opts, dir).await.expect("worker starts")
}

/// OpenAI's `finish_reason` for a gRPC one.
fn openai_reason(f: &tokenmesh_proto::v1::Finished) -> &'static str {
    match f.finish_reason() {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// The error object of an openai_client.py error result (the library keeps
/// the inner object as `body`).
fn error_body(j: &serde_json::Value) -> &serde_json::Value {
    let body = &j["body"];
    if body["error"].is_object() {
        &body["error"]
    } else {
        body
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_openai_library_gets_what_grpc_gets_token_for_token() {
    let dir = tempfile::tempdir().unwrap();
    let w = real_worker("w-1", &[], dir.path()).await;
    let r = http_router(dir.path(), &[&w], &[]).await;
    let base = r.base_url();
    let mut grpc = r.router.client().await;
    let prompt = "What is the capital of France?";
    let reference = collect(&mut grpc, chat_request(prompt, 12)).await.unwrap();
    let finished = reference.finished.clone().unwrap();
    let greedy = ["--max-tokens", "12", "--temperature", "0"];

    let j = openai_client("chat", &base, &greedy);
    assert_eq!(j["text"], reference.text.as_str(), "{j}");
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["role"], "assistant");
    assert_eq!(j["model"], MODEL);
    assert_eq!(j["finish_reason"], openai_reason(&finished));
    let usage = finished.usage.unwrap();
    assert_eq!(j["usage"]["prompt_tokens"], usage.prompt_tokens);
    assert_eq!(j["usage"]["completion_tokens"], usage.completion_tokens);
    assert_eq!(
        j["usage"]["total_tokens"],
        usage.prompt_tokens + usage.completion_tokens
    );
    assert_eq!((&j["version"], &j["worker"]), (&"v1".into(), &"w-1".into()));
    assert_eq!(j["system_fingerprint"], "v1");
    let id = j["id"].as_str().unwrap();
    assert_eq!(Some(&id["chatcmpl-".len()..]), j["request_id"].as_str());

    let mut streamed = greedy.to_vec();
    streamed.extend(["--stream", "--include-usage"]);
    let j = openai_client("chat", &base, &streamed);
    assert_eq!(j["text"], reference.text.as_str(), "{j}");
    assert_eq!(j["object"], "chat.completion.chunk");
    assert_eq!(j["role"], "assistant");
    assert_eq!(j["finish_reason"], openai_reason(&finished));
    assert_eq!(j["usage"]["completion_tokens"], usage.completion_tokens);
    assert!(j["chunks"].as_u64().unwrap() > 3, "{j}");

    // The legacy completions endpoint, both ways.
    let text_prompt = "The capital of France is";
    let req = GenerateRequest {
        temperature: Some(0.0),
        ..prompt_request(text_prompt, 8)
    };
    let reference = collect(&mut grpc, req).await.unwrap();
    let args = [
        "--prompt",
        text_prompt,
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    ];
    let j = openai_client("completion", &base, &args);
    assert_eq!(j["text"], reference.text.as_str(), "{j}");
    assert_eq!(j["object"], "text_completion");
    let mut streamed = args.to_vec();
    streamed.push("--stream");
    let j = openai_client("completion", &base, &streamed);
    assert_eq!(j["text"], reference.text.as_str(), "{j}");
    assert_eq!(j["usage"], serde_json::Value::Null, "no usage unless asked");

    // A seeded, sampled request is reproduced, and is gRPC's.
    let seeded = ["--max-tokens", "10", "--temperature", "0.9", "--seed", "7"];
    let a = openai_client("chat", &base, &seeded);
    let b = openai_client("chat", &base, &seeded);
    assert_eq!(a["text"], b["text"]);
    let req = GenerateRequest {
        temperature: Some(0.9),
        seed: Some(7),
        ..chat_request(prompt, 10)
    };
    let reference = collect(&mut grpc, req).await.unwrap();
    assert_eq!(a["text"], reference.text.as_str());

    // A reply that ends at the end-of-turn token, asked with ignore_eos
    // (vLLM's extension), runs to max_tokens by the model's next choices,
    // the same on both APIs.
    let ends = collect(&mut grpc, chat_request(prompt, 40)).await.unwrap();
    let ended = ends.finished.clone().unwrap();
    assert_eq!(ended.finish_reason(), FinishReason::Eos, "{ends:?}");
    let req = GenerateRequest {
        ignore_eos: true,
        ..chat_request(prompt, 40)
    };
    let goes_on = collect(&mut grpc, req).await.unwrap();
    let finished = goes_on.finished.clone().unwrap();
    assert_eq!(finished.finish_reason(), FinishReason::Length);
    assert_eq!(finished.usage.unwrap().completion_tokens, 40);
    assert_eq!(goes_on.token_ids.len(), 40);
    assert!(
        goes_on.token_ids.starts_with(&ends.token_ids),
        "greedy up to where the first reply ended: {:?} then {:?}",
        ends.token_ids,
        goes_on.token_ids
    );
    let j = openai_client(
        "chat",
        &base,
        &["--max-tokens", "40", "--temperature", "0", "--ignore-eos"],
    );
    assert_eq!(j["text"], goes_on.text.as_str(), "{j}");
    assert_eq!(j["finish_reason"], "length");
    assert_eq!(j["usage"]["completion_tokens"], 40);

    // Errors surface as the library's exception classes.
    let j = openai_client("chat", &base, &["--max-tokens", "0"]);
    assert_eq!(
        (&j["error"], &j["status"]),
        (&"BadRequestError".into(), &400.into()),
        "{j}"
    );
    assert_eq!(error_body(&j)["param"], "max_tokens");
    // argparse takes the last --model.
    let j = openai_client("chat", &base, &["--model", "no-such-model"]);
    assert_eq!(
        (&j["error"], &j["status"]),
        (&"NotFoundError".into(), &404.into()),
        "{j}"
    );
    let e = error_body(&j);
    assert_eq!(e["param"], "model");
    assert!(e["message"].as_str().unwrap().contains(MODEL), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn curl_reads_sse_and_a_client_that_leaves_frees_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let w = synthetic("w-1", "v1", 50.0, dir.path()).await;
    let r = http_router(dir.path(), &[&w], &[]).await;
    let mut grpc = r.router.client().await;
    let reference = collect(&mut grpc, chat_request("hello there", 6))
        .await
        .unwrap();
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"system","content":"{SYSTEM}"}},
        {{"role":"user","content":"hello there"}}],"max_tokens":6,"temperature":0,
        "stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let url = r.url("/v1/chat/completions");
    let (code, out, _) = curl(&[
        "-N",
        "-D",
        "-",
        &url,
        "-H",
        "Content-Type: application/json",
        "-d",
        &body,
    ]);
    assert_eq!(code, 200, "{out}");
    let (head, sse) = out.split_once("\r\n\r\n").unwrap();
    let head = head.to_ascii_lowercase();
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    assert!(head.contains("x-tokenmesh-version: v1"), "{head}");
    assert!(head.contains("x-tokenmesh-worker: w-1"), "{head}");
    let frames: Vec<&str> = sse
        .split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|f| {
            f.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data frame: {f:?}"))
        })
        .collect();
    assert_eq!(frames.last(), Some(&"[DONE]"));
    let chunks: Vec<serde_json::Value> = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, reference.text);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 6, "{usage}");
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );

    // A client that goes away mid-stream: the worker frees the sequence. The
    // prompt asks for a long reply: a greeting's reply ends at EOS within
    // tens of milliseconds, sometimes before the Status below is read.
    let long = body
        .replace("\"max_tokens\":6", "\"max_tokens\":2000")
        .replace(
            "hello there",
            "Write a very long story about a lighthouse keeper, at least two thousand words.",
        );
    let mut child = std::process::Command::new("curl")
        .args([
            "-sS",
            "-N",
            &url,
            "-H",
            "Content-Type: application/json",
            "-d",
            &long,
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for _ in 0..3 {
        let line = lines.next().unwrap().unwrap();
        assert!(line.is_empty() || line.starts_with("data: {"), "{line}");
    }
    let mut wc = w.client().await;
    let active = wc
        .status(tokenmesh_proto::v1::StatusRequest {})
        .await
        .unwrap();
    assert_eq!(active.into_inner().active_sequences, 1);
    child.kill().unwrap();
    let _ = child.wait();
    assert!(
        wait_idle(&w, Duration::from_secs(5)).await,
        "the worker still runs the sequence of a client that left"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn langchain_chat_openai_streams_a_reply() {
    let dir = tempfile::tempdir().unwrap();
    let w = synthetic("w-1", "v1", 200.0, dir.path()).await;
    let r = http_router(dir.path(), &[&w], &[]).await;
    let mut grpc = r.router.client().await;
    let reference = collect(&mut grpc, chat_request("Tell me a story.", 8))
        .await
        .unwrap();
    let j = openai_client(
        "langchain",
        &r.base_url(),
        &[
            "--prompt",
            "Tell me a story.",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],
    );
    assert_eq!(j["text"], reference.text.as_str(), "{j}");
    assert!(j["chunks"].as_u64().unwrap() > 1, "{j}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_killed_mid_stream_is_invisible_to_an_openai_stream() {
    let dir = tempfile::tempdir().unwrap();
    let a = real_worker("w-1", &[], dir.path()).await;
    let b = real_worker("w-2", &[], dir.path()).await;
    let r = http_router(dir.path(), &[&a, &b], &[]).await;
    let prompt = "Write a short story about a lighthouse keeper.";
    let mut grpc = r.router.client().await;
    let reference = collect(&mut grpc, chat_request(prompt, 60)).await.unwrap();
    assert!(reference.token_ids.len() > 20, "{:?}", reference.text);

    let args = [
        "--prompt",
        prompt,
        "--max-tokens",
        "60",
        "--temperature",
        "0",
        "--stream",
        "--include-usage",
        "--print-chunks",
    ];
    let mut child = openai_spawn("chat", &r.base_url(), &args);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let head: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let serving = head["headers"]["worker"].as_str().unwrap().to_string();
    let victim = if serving == a.id { &a } else { &b };
    let mut chunks = 0;
    let mut last = String::new();
    for line in lines {
        let line = line.unwrap();
        if line.starts_with("{\"chunk\"") {
            chunks += 1;
            if chunks == 10 {
                victim.proc.signal(Signal::SIGKILL);
            }
        }
        last = line;
    }
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
    assert!(status.success(), "{stderr}");
    let j: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert!(j.get("error").is_none(), "{j}");
    assert!(
        chunks > 10,
        "the worker was killed after 10 of {chunks} chunks"
    );
    assert_eq!(
        j["text"],
        reference.text.as_str(),
        "no token lost or repeated"
    );
    let finished = reference.finished.unwrap();
    assert_eq!(j["finish_reason"], openai_reason(&finished));
    assert_eq!(
        j["usage"]["completion_tokens"],
        reference.token_ids.len() as u64
    );
    assert!(
        r.router
            .proc
            .log_text()
            .contains("stream continues on another worker"),
        "the stream did fail over"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_canary_split_pins_and_sticky_sessions_hold_through_http() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = synthetic("w-v1", "v1", 500.0, dir.path()).await;
    let v2 = synthetic("w-v2", "v2", 500.0, dir.path()).await;
    let toml = format!(
        "[[workers]]\nid = \"w-v1\"\nmodel = \"{MODEL}\"\nversion = \"v1\"\naddr = \"{}\"\n\n\
         [[workers]]\nid = \"w-v2\"\nmodel = \"{MODEL}\"\nversion = \"v2\"\naddr = \"{}\"\n\n\
         [models.\"{MODEL}\"]\nstable = \"v1\"\ncanary = {{ version = \"v2\", weight = 50 }}\n",
        v1.addr, v2.addr
    );
    let file = dir.path().join("canary.toml");
    std::fs::write(&file, toml).unwrap();
    let args = vec!["--static".to_string(), file.display().to_string()];
    let r = http_router_with(dir.path(), args, None, 2).await;
    let base = r.base_url();
    let few = ["--max-tokens", "2"];

    let j = openai_client("versions", &base, &[&few[..], &["--count", "40"]].concat());
    let (n1, n2) = (
        j["versions"]["v1"].as_u64().unwrap_or(0),
        j["versions"]["v2"].as_u64().unwrap_or(0),
    );
    assert_eq!(n1 + n2, 40, "{j}");
    assert!(n1 >= 6 && n2 >= 6, "a 50 % canary split served {j}");

    for session in ["alice", "bob", "carol"] {
        let j = openai_client(
            "versions",
            &base,
            &[&few[..], &["--count", "8", "--session", session]].concat(),
        );
        let served = j["versions"].as_object().unwrap();
        assert_eq!(served.len(), 1, "session {session} moved: {j}");
    }

    let chat = |model: &str| {
        format!(
            r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}"#
        )
    };
    let url = r.url("/v1/chat/completions");
    for _ in 0..5 {
        let (code, j) = post_json(&url, &chat(&format!("{MODEL}@v2")), &[]);
        assert_eq!((code, &j["system_fingerprint"]), (200, &"v2".into()), "{j}");
        let (code, j) = post_json(&url, &chat(MODEL), &["x-tokenmesh-version: v1"]);
        assert_eq!((code, &j["system_fingerprint"]), (200, &"v1".into()), "{j}");
    }
    let (code, j) = post_json(&url, &chat(&format!("{MODEL}@v9")), &[]);
    assert_eq!(code, 404, "{j}");

    let j = openai_client("models", &base, &[]);
    let ids: Vec<&str> = j["ids"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    for want in [
        MODEL.to_string(),
        format!("{MODEL}@v1"),
        format!("{MODEL}@v2"),
    ] {
        assert!(ids.contains(&want.as_str()), "{ids:?}");
    }
}

/// The sum of a counter's samples whose labels include every one of `labels`.
fn counter(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_a_4xx_naming_the_field_and_the_router_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let w = synthetic("w-1", "v1", 500.0, dir.path()).await;
    let metrics = format!("127.0.0.1:{}", free_port());
    let r = http_router(dir.path(), &[&w], &["--metrics-listen", &metrics]).await;
    let chat = r.url("/v1/chat/completions");
    let completions = r.url("/v1/completions");
    let with = |field: &str| {
        format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],{field}}}"#)
    };
    let ok = with(r#""max_tokens":2"#);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (&chat, r#"{"model":"#.into(), 400, ""),
        (&chat, with(r#""max_tokens":"ten""#), 400, "max_tokens"),
        (&chat, with(r#""temperature":-1"#), 400, "temperature"),
        (&chat, with(r#""n":2"#), 400, "n"),
        (&chat, with(r#""foo":1"#), 400, "foo"),
        (
            &chat,
            with(r#""tools":[{"type":"function"}]"#),
            400,
            "tools",
        ),
        (
            &chat,
            with(r#""presence_penalty":1.5"#),
            400,
            "presence_penalty",
        ),
        (
            &chat,
            format!(r#"{{"model":"{MODEL}","messages":[]}}"#),
            400,
            "messages",
        ),
        (
            &chat,
            format!(
                r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":[{{"type":"image_url"}}]}}]}}"#
            ),
            400,
            "messages[0].content[0].type",
        ),
        (&chat, ok.replace(MODEL, "gpt-4o"), 404, "model"),
        (
            &completions,
            format!(r#"{{"model":"{MODEL}","prompt":["a","b"]}}"#),
            400,
            "prompt",
        ),
    ];
    for (url, body, want, param) in &cases {
        let (code, j) = post_json(url, body, &[]);
        assert_eq!(code, *want, "{body}: {j}");
        let e = &j["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{j}");
        assert!(e["type"].is_string(), "{j}");
        if !param.is_empty() {
            assert_eq!(e["param"], *param, "{body}: {j}");
        }
    }
    let (code, j) = post_json(&chat, &ok.replace(MODEL, "gpt-4o"), &[]);
    assert!(
        j["error"]["message"].as_str().unwrap().contains(MODEL),
        "{code} {j}"
    );

    // A wrong content type.
    let (code, body, _) = curl(&[&chat, "-H", "Content-Type: text/plain", "-d", &ok]);
    assert_eq!(code, 415, "{body}");
    assert!(body.contains("Content-Type"), "{body}");

    // 10 MB, declared (refused before it is read) and chunked.
    let big = dir.path().join("big.json");
    let filler = "x".repeat(10 << 20);
    std::fs::write(
        &big,
        format!(r#"{{"model":"{MODEL}","prompt":"{filler}"}}"#),
    )
    .unwrap();
    let at = format!("@{}", big.display());
    let (code, body, _) = curl(&[
        &completions,
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        &at,
    ]);
    assert_eq!(code, 413, "{body}");
    let (code, body, _) = curl(&[
        &completions,
        "-H",
        "Content-Type: application/json",
        "-H",
        "Transfer-Encoding: chunked",
        "--data-binary",
        &at,
    ]);
    assert_eq!(code, 413, "chunked: {body}");

    // Unknown paths and methods.
    let (code, body, _) = curl(&[&r.url("/v1/embeddings"), "-d", "{}"]);
    assert_eq!(code, 404, "{body}");
    let (code, body, _) = curl(&[&chat]);
    assert_eq!(code, 405, "{body}");

    // Still serving, and every refusal was counted under api="openai".
    let (code, j) = post_json(&chat, &ok, &[]);
    assert_eq!(code, 200, "{j}");
    let mut grpc = r.router.client().await;
    collect(&mut grpc, chat_request("hi", 2)).await.unwrap();
    let s = scrape(&metrics).await;
    let openai = [("api", "openai")];
    assert!(
        counter(
            &s,
            "llm_request_total",
            &[openai[0], ("code", "INVALID_ARGUMENT")]
        ) >= 9.0
    );
    assert!(counter(&s, "llm_request_total", &[openai[0], ("code", "NOT_FOUND")]) >= 2.0);
    assert_eq!(
        counter(&s, "llm_request_total", &[openai[0], ("code", "OK")]),
        1.0
    );
    assert_eq!(
        counter(&s, "llm_request_total", &[("api", "grpc"), ("code", "OK")]),
        1.0
    );
    assert!(counter(&s, "llm_tokens_generated_total", &openai) >= 2.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deadline_is_504_and_a_stream_cut_short_ends_with_an_error_event() {
    let dir = tempfile::tempdir().unwrap();
    let w = synthetic("w-1", "v1", 50.0, dir.path()).await;
    let r = http_router(dir.path(), &[&w], &[]).await;
    let url = r.url("/v1/chat/completions");
    let body = |stream: bool| {
        format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":200,"stream":{stream}}}"#
        )
    };
    let (code, j) = post_json(&url, &body(false), &["x-tokenmesh-timeout-ms: 300"]);
    assert_eq!(code, 504, "{j}");
    assert_eq!(j["error"]["code"], "timeout");
    let (code, out, _) = curl(&[
        "-N",
        &url,
        "-H",
        "Content-Type: application/json",
        "-H",
        "x-tokenmesh-timeout-ms: 300",
        "-d",
        &body(true),
    ]);
    assert_eq!(code, 200, "the stream had started: {out}");
    let frames: Vec<&str> = out.split("\n\n").filter(|f| !f.trim().is_empty()).collect();
    let last = frames.last().unwrap();
    assert!(
        !out.contains("[DONE]"),
        "a failed stream must not end with [DONE]: {out}"
    );
    assert!(frames.len() > 3, "{out}");
    let e: serde_json::Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(e["error"]["code"], "timeout", "{last}");
    assert!(wait_idle(&w, Duration::from_secs(5)).await);
}

fn key_file(dir: &Path, keys: &[(&str, &str, &str)]) -> String {
    let mut toml = String::new();
    for (key, name, role) in keys {
        let sha = hex::encode(Sha256::digest(key.as_bytes()));
        toml.push_str(&format!(
            "[[keys]]\nsha256 = \"{sha}\"\nname = \"{name}\"\nrole = \"{role}\"\n\n"
        ));
    }
    let path = dir.join("api-keys.toml");
    std::fs::write(&path, toml).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn api_keys_401_403_and_per_identity_limits() {
    let dir = tempfile::tempdir().unwrap();
    let w = synthetic("w-1", "v1", 50.0, dir.path()).await;
    let keys = key_file(
        dir.path(),
        &[
            ("sk-alice", "alice", "client"),
            ("sk-bob", "bob", "operator"),
            ("sk-audit", "audit", "auditor"),
        ],
    );
    let extra = ["--api-keys", &keys, "--max-in-flight-per-identity", "1"];
    let r = http_router(dir.path(), &[&w], &extra).await;
    let url = r.url("/v1/chat/completions");
    let ok = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}"#
    );
    for (headers, want, kind) in [
        (vec![], 401, "authentication_error"),
        (
            vec!["Authorization: Bearer sk-wrong"],
            401,
            "authentication_error",
        ),
        (
            vec!["Authorization: Basic c2stYWxpY2U="],
            401,
            "authentication_error",
        ),
        (
            vec!["Authorization: Bearer sk-audit"],
            403,
            "permission_error",
        ),
    ] {
        let (code, j) = post_json(&url, &ok, &headers);
        assert_eq!(
            (code, &j["error"]["type"]),
            (want, &kind.into()),
            "{headers:?}: {j}"
        );
    }
    let (code, j) = post_json(&url, &ok, &["Authorization: Bearer sk-alice"]);
    assert_eq!(code, 200, "{j}");
    let (code, body, _) = curl(&[&r.url("/v1/models")]);
    assert_eq!(code, 401, "{body}");

    let base = r.base_url();
    let j = openai_client("chat", &base, &["--api-key", "sk-nope"]);
    assert_eq!(
        (&j["error"], &j["status"]),
        (&"AuthenticationError".into(), &401.into()),
        "{j}"
    );
    let j = openai_client("chat", &base, &["--api-key", "sk-audit"]);
    assert_eq!(
        (&j["error"], &j["status"]),
        (&"PermissionDeniedError".into(), &403.into()),
        "{j}"
    );
    let j = openai_client("chat", &base, &["--api-key", "sk-bob", "--max-tokens", "3"]);
    assert!(j.get("error").is_none(), "{j}");

    // The key's identity is what the per-identity limit counts.
    let long = ok.replace("\"max_tokens\":2", "\"max_tokens\":2000,\"stream\":true");
    let mut held = std::process::Command::new("curl")
        .args(["-sS", "-N", &url, "-H", "Content-Type: application/json"])
        .args(["-H", "Authorization: Bearer sk-alice", "-d", &long])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(held.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    let (code, body, _) = curl(&[
        "-D",
        "-",
        &url,
        "-H",
        "Content-Type: application/json",
        "-H",
        "Authorization: Bearer sk-alice",
        "-d",
        &ok,
    ]);
    assert_eq!(code, 429, "{body}");
    assert!(
        body.to_ascii_lowercase().contains("retry-after: 1"),
        "{body}"
    );
    assert!(body.contains("client/alice"), "{body}");
    let (code, j) = post_json(&url, &ok, &["Authorization: Bearer sk-bob"]);
    assert_eq!(code, 200, "another identity is not limited: {j}");
    held.kill().unwrap();
    let _ = held.wait();
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_on_the_http_port_client_certificates_or_api_keys() {
    let pki = Pki::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = WorkerOpts {
        extra: vec!["--model-name".into(), MODEL.into()],
        synthetic_tokens_per_sec: Some(500.0),
        tls: Some(pki.worker_tls("w-tls").unwrap()),
        ..WorkerOpts::new("w-tls")
    };
    let w = WorkerProc::start(opts, dir.path()).await.unwrap();
    let client = pki.issue(Role::Client, "carol").unwrap();
    let worker_cert = pki.issue(Role::Worker, "mallory").unwrap();
    let ca = client.join("ca.pem").display().to_string();
    let cert = |d: &Path, role: &str| {
        (
            d.join(format!("{role}.pem")).display().to_string(),
            d.join(format!("{role}.key")).display().to_string(),
        )
    };
    let (client_pem, client_key) = cert(&client, "client");
    let (worker_pem, worker_key) = cert(&worker_cert, "worker");
    let ok = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}"#
    );
    let post = |url: &str, extra: &[&str]| {
        let mut args = vec![
            url,
            "--cacert",
            ca.as_str(),
            "-H",
            "Content-Type: application/json",
            "-d",
            ok.as_str(),
        ];
        args.extend(extra);
        curl(&args)
    };

    // mTLS: a client certificate is required at the handshake.
    let static_toml = static_file(dir.path(), &[&w]);
    let mtls = http_router_with(
        dir.path(),
        vec!["--static".into(), static_toml.clone()],
        Some(pki.router_tls("harness").unwrap()),
        1,
    )
    .await;
    let url = format!("https://{}/v1/chat/completions", mtls.http);
    let (code, body, _) = post(&url, &["--cert", &client_pem, "--key", &client_key]);
    assert_eq!(code, 200, "{body}");
    let (code, _, out) = post(&url, &[]);
    assert_eq!(code, 0, "no certificate, no connection");
    assert!(!out.status.success());
    let (code, body, _) = post(&url, &["--cert", &worker_pem, "--key", &worker_key]);
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("role worker"), "{body}");
    let (code, body, _) = post(
        &url,
        &["--http1.1", "--cert", &client_pem, "--key", &client_key],
    );
    assert_eq!(code, 200, "HTTP/1.1 too: {body}");

    // TLS with API keys: a certificate becomes optional.
    let keys = key_file(dir.path(), &[("sk-carol", "carol", "client")]);
    let keyed = http_router_with(
        dir.path(),
        vec!["--static".into(), static_toml, "--api-keys".into(), keys],
        Some(pki.router_tls("harness").unwrap()),
        1,
    )
    .await;
    let url = format!("https://{}/v1/chat/completions", keyed.http);
    let (code, body, _) = post(&url, &["-H", "Authorization: Bearer sk-carol"]);
    assert_eq!(code, 200, "{body}");
    let (code, body, _) = post(&url, &[]);
    assert_eq!(code, 401, "{body}");
    let (code, body, _) = post(&url, &["--cert", &client_pem, "--key", &client_key]);
    assert_eq!(code, 200, "a client certificate still serves: {body}");
    let base = format!("https://{}/v1", keyed.http);
    let j = openai_client(
        "chat",
        &base,
        &["--ca", &ca, "--api-key", "sk-carol", "--stream"],
    );
    assert!(
        j.get("error").is_none() && j["chunks"].as_u64().unwrap() > 0,
        "{j}"
    );
}
