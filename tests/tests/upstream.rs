//! Workers that front an existing engine (`--engine upstream`): real
//! llama.cpp `llama-server` processes serving the test model behind the
//! mesh, and a scripted engine for the answers a real one gives only when
//! it breaks. Needs `TOKENMESH_LLAMA_CPP` (scripts/llama-cpp.sh).
use std::collections::BTreeMap;
use std::time::Duration;
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::{ChatMessage, GenerateRequest, StatusRequest, WorkerGenerateRequest};
use tokenmesh_tests::*;

/// A greedy chat request long enough to kill an engine in the middle of.
fn story(max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        messages: vec![ChatMessage {
            role: "user".into(),
            content: "Write a short story about a lighthouse keeper.".into(),
        }],
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// A worker fronting `engine`, with the `extra` flags.
async fn upstream_worker(
    id: &str,
    version: &str,
    engine: &str,
    extra: &[&str],
    dir: &std::path::Path,
) -> WorkerProc {
    let opts = WorkerOpts {
        version: version.into(),
        upstream_url: Some(engine.into()),
        extra: extra.iter().map(|s| s.to_string()).collect(),
        ..WorkerOpts::new(id)
    };
    WorkerProc::start(opts, dir)
        .await
        .expect("upstream worker starts")
}

#[tokio::test(flavor = "multi_thread")]
async fn native_and_upstream_workers_of_one_version_stream_through_the_router() {
    let dir = tempfile::tempdir().unwrap();
    let e1 = LlamaServer::start("llama-1", 2, dir.path()).await.unwrap();
    let e2 = LlamaServer::start("llama-2", 2, dir.path()).await.unwrap();
    let native = real_worker("native", &[], dir.path()).await;
    let u1 = upstream_worker("up-1", "v1", &e1.url(), &[], dir.path()).await;
    let u2 = upstream_worker("up-2", "v1", &e2.url(), &[], dir.path()).await;

    // Each upstream worker reports its engine's model and serves on its own.
    let status = u1.status().await;
    assert_eq!(status.model, MODEL);
    assert_eq!(status.accelerator, "cpu");
    assert_eq!(
        status.max_context, 2048,
        "the engine's context window per slot"
    );
    let direct = collect_worker(&u1, france_request(12)).await;
    assert_eq!(
        direct.ids,
        direct
            .ids
            .iter()
            .filter(|&&t| t < 49152)
            .copied()
            .collect::<Vec<_>>()
    );
    assert!(direct.text.contains("Paris"), "{:?}", direct.text);

    let router = static_router(dir.path(), &[&native, &u1, &u2], &[]).await;
    let client = router.client().await;
    let mut served: BTreeMap<String, Vec<(Vec<u32>, String)>> = BTreeMap::new();
    let mut calls = Vec::new();
    for _ in 0..9 {
        let mut c = client.clone();
        calls.push(tokio::spawn(async move {
            collect(&mut c, france_request(12)).await
        }));
    }
    for call in calls {
        let got = call.await.unwrap().expect("every stream finishes");
        let finished = got.finished.expect("a Finished");
        let usage = finished.usage.unwrap();
        assert_eq!(usage.completion_tokens as usize, got.token_ids.len());
        assert!(usage.prompt_tokens > 10, "{usage:?}");
        assert!(!got.token_ids.is_empty());
        served
            .entry(finished.worker_id)
            .or_default()
            .push((got.token_ids, got.text));
    }
    assert!(
        served.contains_key("up-1") || served.contains_key("up-2"),
        "upstream workers served none of 9: {:?}",
        served.keys()
    );
    // Greedy output of one engine build is one answer, whichever of its
    // workers served it (the native engine's kernels may differ).
    let upstream: Vec<&(Vec<u32>, String)> = ["up-1", "up-2"]
        .iter()
        .flat_map(|w| served.get(*w).into_iter().flatten())
        .collect();
    for r in &upstream {
        assert_eq!(
            r.0, direct.ids,
            "upstream greedy runs agree: {:?} vs {:?}",
            r.1, direct.text
        );
    }
}

/// What a worker streamed for one request.
struct Reply {
    ids: Vec<u32>,
    text: String,
    logprobs: Vec<f32>,
    finished: tokenmesh_proto::v1::Finished,
}

/// Runs `req` on `worker` directly, to its Finished.
async fn collect_worker(worker: &WorkerProc, req: GenerateRequest) -> Reply {
    let mut wc = worker.client().await;
    let call = WorkerGenerateRequest {
        request: Some(req),
        ..Default::default()
    };
    let mut stream = wc.generate(call).await.unwrap().into_inner();
    let (mut ids, mut text, mut logprobs, mut finished) = (vec![], String::new(), vec![], None);
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event {
            Some(Event::Delta(d)) => {
                ids.extend(d.token_ids);
                text.push_str(&d.text);
                logprobs.extend(d.logprobs);
            }
            Some(Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    Reply {
        ids,
        text,
        logprobs,
        finished: finished.expect("the stream finishes"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_an_upstream_engine_mid_stream_fails_over_gapless() {
    let dir = tempfile::tempdir().unwrap();
    let engines = [
        LlamaServer::start("llama-1", 1, dir.path()).await.unwrap(),
        LlamaServer::start("llama-2", 1, dir.path()).await.unwrap(),
    ];
    let u1 = upstream_worker("up-1", "v1", &engines[0].url(), &[], dir.path()).await;
    let u2 = upstream_worker("up-2", "v1", &engines[1].url(), &[], dir.path()).await;
    let router = static_router(dir.path(), &[&u1, &u2], &[]).await;
    let mut client = router.client().await;
    let reference = collect(&mut client, story(48)).await.unwrap();
    assert!(reference.token_ids.len() > 20, "{:?}", reference.text);

    let mut stream = client.generate(story(48)).await.unwrap().into_inner();
    let (mut seqs, mut ids, mut text, mut finished) = (vec![], vec![], String::new(), None);
    let mut serving = None;
    while let Some(msg) = stream.message().await.expect("the client sees no error") {
        seqs.push(msg.seq);
        match msg.event {
            Some(Event::Accepted(a)) => serving = Some(a.worker_id),
            Some(Event::Delta(d)) => {
                let before = ids.len();
                ids.extend(d.token_ids);
                text.push_str(&d.text);
                if before < 10 && ids.len() >= 10 {
                    // The engine, not the worker: the worker stays up and
                    // reports the broken stream.
                    let victim = if serving.as_deref() == Some("up-1") {
                        0
                    } else {
                        1
                    };
                    engines[victim]
                        .proc
                        .signal(nix::sys::signal::Signal::SIGKILL);
                }
            }
            Some(Event::Finished(f)) => finished = Some(f),
            None => {}
        }
    }
    let finished = finished.expect("the stream finishes");
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "no gap in seq"
    );
    assert_eq!(finished.failovers, 1);
    assert_ne!(Some(finished.worker_id.clone()), serving);
    assert_eq!(ids, reference.token_ids, "no token lost or repeated");
    assert_eq!(text, reference.text);
    assert_eq!(
        finished.usage.unwrap().completion_tokens as usize,
        ids.len()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_canary_between_a_native_and_an_upstream_version_splits_as_the_policy_says() {
    let dir = tempfile::tempdir().unwrap();
    let engine = LlamaServer::start("llama", 2, dir.path()).await.unwrap();
    let native = real_worker("native", &[], dir.path()).await;
    let up = upstream_worker("up", "v2", &engine.url(), &[], dir.path()).await;
    let file = dir.path().join("canary.toml");
    std::fs::write(
        &file,
        format!(
            "[[workers]]\nid = \"native\"\nmodel = \"{MODEL}\"\nversion = \"v1\"\naddr = \"{}\"\n\n\
             [[workers]]\nid = \"up\"\nmodel = \"{MODEL}\"\nversion = \"v2\"\naddr = \"{}\"\n\n\
             [models.\"{MODEL}\"]\nstable = \"v1\"\ncanary = {{ version = \"v2\", weight = 50 }}\n",
            native.addr, up.addr
        ),
    )
    .unwrap();
    let args = vec!["--static".to_string(), file.display().to_string()];
    let router = RouterProc::start_ready(&args, None, dir.path(), 2).await;
    let mut client = router.client().await;
    let total = 60;
    let mut on_upstream = 0;
    for i in 0..total {
        let got = collect(&mut client, prompt_request(&format!("Count to {i}:"), 1))
            .await
            .expect("every request is served");
        let accepted = got.accepted.unwrap();
        let worker = got.finished.unwrap().worker_id;
        match accepted.version.as_str() {
            "v2" => {
                assert_eq!(worker, "up");
                on_upstream += 1;
            }
            "v1" => assert_eq!(worker, "native"),
            other => panic!("version {other}"),
        }
    }
    // 50 % of 60 requests: 30 ± 4 standard deviations.
    assert!(
        (15..=45).contains(&on_upstream),
        "{on_upstream} of {total} went to the upstream canary"
    );
}

/// The scripted engine and an upstream worker in front of it, with the
/// worker's metrics address.
async fn scripted_with_metrics(dir: &std::path::Path) -> (Proc, WorkerProc, String) {
    let (engine, url) = scripted_engine(dir).await.unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let worker = upstream_worker("up", "v1", &url, &["--metrics-listen", &metrics], dir).await;
    (engine, worker, metrics)
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_upstream_answers_become_clear_statuses_and_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, worker, metrics) = scripted_with_metrics(dir.path()).await;
    let mut wc = worker.client().await;
    let outcome = |prompt: &str| {
        let mut wc = wc.clone();
        let call = WorkerGenerateRequest {
            request: Some(prompt_request(prompt, 4)),
            ..Default::default()
        };
        async move {
            let mut stream = wc.generate(call).await?.into_inner();
            let mut collected = Collected::default();
            while let Some(msg) = stream.message().await? {
                match msg.event {
                    Some(Event::Delta(d)) => {
                        collected.token_ids.extend(d.token_ids);
                        collected.text.push_str(&d.text);
                    }
                    Some(Event::Finished(f)) => collected.finished = Some(f),
                    _ => {}
                }
            }
            Ok::<_, tonic::Status>(collected)
        }
    };
    let fine = outcome("fine")
        .await
        .expect("a well-formed stream finishes");
    assert_eq!(fine.token_ids, [120, 121]);
    assert_eq!(fine.text, " x y");
    assert_eq!(fine.finished.unwrap().usage.unwrap().prompt_tokens, 4);
    for (prompt, code, says) in [
        (
            "a",
            tonic::Code::Internal,
            "HTTP 500: scripted internal failure",
        ),
        (
            "b",
            tonic::Code::Internal,
            "malformed answer: an event that is not JSON",
        ),
        (
            "c",
            tonic::Code::Unavailable,
            "ended the stream without finishing, after 2 tokens",
        ),
        (
            "d",
            tonic::Code::InvalidArgument,
            "HTTP 400: scripted bad request",
        ),
        ("e", tonic::Code::Unavailable, "HTTP 503: Loading model"),
    ] {
        let status = outcome(prompt).await.expect_err(prompt);
        assert_eq!(status.code(), code, "{prompt}: {status:?}");
        assert!(
            status.message().contains(says),
            "{prompt}: {:?}",
            status.message()
        );
    }
    let _ = wc.status(StatusRequest {}).await.unwrap();
    let text = scrape_text(&metrics).await.unwrap();
    for (kind, n) in [
        ("http_5xx", 2),
        ("malformed", 1),
        ("unfinished", 1),
        ("http_4xx", 1),
    ] {
        let line = text
            .lines()
            .find(|l| {
                l.starts_with("tokenmesh_worker_upstream_errors_total{")
                    && l.contains(&format!("kind=\"{kind}\""))
            })
            .unwrap_or_else(|| panic!("no {kind} errors counted:\n{text}"));
        assert!(line.ends_with(&format!(" {n}")), "{line}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_prompt_goes_as_text_and_a_continuation_as_text_then_ids() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, url) = scripted_engine(dir.path()).await.unwrap();
    let worker = upstream_worker("up", "v1", &url, &[], dir.path()).await;
    let text = collect_worker(&worker, prompt_request("mn", 4)).await.text;
    assert_eq!(text, r#""mn""#, "one completion, the prompt as text");
    let mut wc = worker.client().await;
    let call = WorkerGenerateRequest {
        request: Some(prompt_request("mn", 4)),
        emitted_token_ids: vec![5, 6],
        ..Default::default()
    };
    let mut stream = wc.generate(call).await.unwrap().into_inner();
    let (mut text, mut usage) = (String::new(), None);
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event {
            Some(Event::Delta(d)) => text.push_str(&d.text),
            Some(Event::Finished(f)) => usage = f.usage,
            _ => {}
        }
    }
    assert_eq!(text, r#"["mn", 5, 6]"#);
    // The engine counted 4 (2 characters, 2 ids); the ids are completion.
    let usage = usage.expect("finished");
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (2, 3));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_the_engine_closed_unanswered_is_sent_once_more() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, worker, metrics) = scripted_with_metrics(dir.path()).await;
    let r = collect_worker(&worker, prompt_request("r", 4)).await;
    assert_eq!(
        (r.ids.as_slice(), r.text.as_str()),
        (&[120, 121][..], " x y")
    );
    let text = scrape_text(&metrics).await.unwrap();
    assert_eq!(
        sum_of(&text, "tokenmesh_worker_upstream_resent_total", ""),
        1.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_prompt_cache_flag_is_what_the_engine_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, url) = scripted_engine(dir.path()).await.unwrap();
    for (extra, says) in [
        (&[][..], " cache_prompt=true"),
        (
            &["--upstream-prompt-cache", "false"][..],
            " cache_prompt=false",
        ),
        (
            &["--upstream-prompt-cache", "true"][..],
            " cache_prompt=true",
        ),
    ] {
        let worker = upstream_worker("up", "v1", &url, extra, dir.path()).await;
        let text = collect_worker(&worker, prompt_request("p", 4)).await.text;
        assert_eq!(text, says, "{extra:?}");
    }
}

/// The worker record registered under `key`, if any.
async fn registration(etcd: &Etcd, key: &str) -> Option<serde_json::Value> {
    etcd.get_prefix("/tokenmesh/workers/")
        .await
        .into_iter()
        .find(|(k, _, _)| k == key)
        .map(|(_, v, _)| serde_json::from_str(&v).unwrap())
}

/// The worker record under `key`, once it is registered (within 10 s).
async fn wait_registered(etcd: &Etcd, key: &str) -> serde_json::Value {
    assert!(
        eventually(Duration::from_secs(10), || async {
            registration(etcd, key).await.is_some()
        })
        .await,
        "{key} registered"
    );
    registration(etcd, key).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_deregisters_while_its_engine_is_away_and_returns_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start().await.unwrap();
    let mut engine = LlamaServer::start("llama", 1, dir.path()).await.unwrap();
    let opts = WorkerOpts {
        etcd: Some(etcd.url.clone()),
        upstream_url: Some(engine.url()),
        extra: ["--lease-ttl", "2", "--upstream-poll-ms", "100"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ..WorkerOpts::new("up")
    };
    let _worker = WorkerProc::start(opts, dir.path()).await.unwrap();
    let key = format!("/tokenmesh/workers/{MODEL}/v1/up");
    let registered = || registration(&etcd, &key);
    let record = wait_registered(&etcd, &key).await;
    assert_eq!(record["engine"], "llama-server");
    assert_eq!(record["accelerator"], "cpu");
    assert_eq!(record["continues_from_token_ids"], true);
    assert!(
        record["engine_model"].as_str().unwrap().contains("SmolLM2"),
        "{record}"
    );

    engine.proc.signal(nix::sys::signal::Signal::SIGKILL);
    assert!(
        etcd.wait_gone(&key, Duration::from_secs(10)).await,
        "deregistered once the engine is gone"
    );
    engine.restart(dir.path()).await.unwrap();
    assert!(
        eventually(Duration::from_secs(15), || async {
            registered().await.is_some()
        })
        .await,
        "registered again once the engine answers"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_on_workers_that_cannot_continue_from_token_ids_ends_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let mut workers = Vec::new();
    for id in ["s-1", "s-2"] {
        let opts = WorkerOpts {
            synthetic_tokens_per_sec: Some(50.0),
            extra: vec!["--model-name".into(), MODEL.into()],
            ..WorkerOpts::new(id)
        };
        workers.push(WorkerProc::start(opts, dir.path()).await.unwrap());
    }
    let file = dir.path().join("text-only.toml");
    let mut toml = String::new();
    for w in &workers {
        toml.push_str(&format!(
            "[[workers]]\nid = \"{}\"\nmodel = \"{MODEL}\"\nversion = \"v1\"\naddr = \"{}\"\ncontinues_from_token_ids = false\n\n",
            w.id, w.addr
        ));
    }
    std::fs::write(&file, toml).unwrap();
    let args = vec!["--static".to_string(), file.display().to_string()];
    let router = RouterProc::start_ready(&args, None, dir.path(), 2).await;
    let mut client = router.client().await;
    let mut stream = client
        .generate(prompt_request("one two three", 200))
        .await
        .unwrap()
        .into_inner();
    let mut serving = None;
    let mut tokens = 0;
    let status = loop {
        match stream.message().await {
            Ok(Some(msg)) => match msg.event {
                Some(Event::Accepted(a)) => serving = Some(a.worker_id),
                Some(Event::Delta(d)) => {
                    tokens += d.token_ids.len();
                    if tokens == 3 {
                        let victim = workers
                            .iter()
                            .find(|w| Some(&w.id) == serving.as_ref())
                            .unwrap();
                        victim.proc.signal(nix::sys::signal::Signal::SIGKILL);
                    }
                }
                Some(Event::Finished(f)) => panic!("finished after a loss it cannot mend: {f:?}"),
                None => {}
            },
            Ok(None) => panic!("the stream ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status
            .message()
            .contains("cannot continue a stream from token ids"),
        "{}",
        status.message()
    );
}

/// Flags of a worker fronting llama-server as a generic OpenAI-compatible
/// server. llama-server's /v1/models gives no max_model_len, so the context
/// window is given, as it must be for such a server.
const AS_OPENAI: [&str; 6] = [
    "--upstream-kind",
    "openai",
    "--upstream-context-length",
    "2048",
    "--upstream-accelerator",
    "cpu",
];

#[tokio::test(flavor = "multi_thread")]
async fn an_openai_kind_worker_streams_what_the_llama_server_kind_streams_without_ids() {
    let dir = tempfile::tempdir().unwrap();
    let engine = LlamaServer::start("llama", 2, dir.path()).await.unwrap();
    let native_api = upstream_worker("up-llama", "v1", &engine.url(), &[], dir.path()).await;
    let generic = upstream_worker("up-openai", "v1", &engine.url(), &AS_OPENAI, dir.path()).await;
    let status = generic.status().await;
    assert_eq!(status.model, MODEL);
    assert_eq!(
        (status.accelerator.as_str(), status.max_context),
        ("cpu", 2048)
    );

    let greedy_prompt = GenerateRequest {
        temperature: Some(0.0),
        ..prompt_request("The capital of France is", 8)
    };
    let stopped = GenerateRequest {
        stop: vec![".".into()],
        ..france_request(40)
    };
    let with_logprobs = GenerateRequest {
        logprobs: true,
        ..france_request(6)
    };
    // Chats (rendered by llama-server's template either way) and a plain
    // prompt; cut by max_tokens, by the end of turn, and by a stop string.
    let mut ends = std::collections::BTreeSet::new();
    for (what, req) in [
        ("a chat cut by max_tokens", france_request(6)),
        ("a prompt", greedy_prompt),
        ("a story", story(24)),
        ("a chat to its end of turn", france_request(60)),
        ("a chat to a stop string", stopped),
        ("log-probabilities", with_logprobs),
    ] {
        let native = collect_worker(&native_api, req.clone()).await;
        let plain = collect_worker(&generic, req.clone()).await;
        let (f, g) = (&native.finished, &plain.finished);
        assert!(
            plain.ids.is_empty(),
            "{what}: no token ids from the generic API"
        );
        assert_eq!(plain.text, native.text, "{what}");
        let (u, v) = (f.usage.unwrap(), g.usage.unwrap());
        assert_eq!(u.prompt_tokens, v.prompt_tokens, "{what}");
        assert!(v.prompt_tokens >= 5, "{what}: {v:?}");
        assert_eq!(g.worker_id, "up-openai");
        ends.insert(f.finish_reason);
        match f.finish_reason() {
            tokenmesh_proto::v1::FinishReason::Eos => {
                assert_eq!(g.finish_reason(), f.finish_reason(), "{what}");
                // llama-server's usage counts the end-of-turn token, which
                // the mesh does not output.
                assert!(
                    (u.completion_tokens..=u.completion_tokens + 1).contains(&v.completion_tokens),
                    "{what}: {u:?} {v:?}"
                );
            }
            tokenmesh_proto::v1::FinishReason::Stop => {
                assert_eq!(f.stop, ".");
                // The generic API does not say which stop string matched.
                assert_eq!(
                    (g.finish_reason(), g.stop.as_str()),
                    (f.finish_reason(), "")
                );
            }
            _ => {
                assert_eq!(g.finish_reason(), f.finish_reason(), "{what}");
                assert_eq!(u.completion_tokens, v.completion_tokens, "{what}");
                assert_eq!(native.ids.len(), u.completion_tokens as usize, "{what}");
            }
        }
        if req.logprobs {
            let (lps, lps_too) = (&native.logprobs, &plain.logprobs);
            assert_eq!(lps_too.len(), lps.len(), "{what}: one per token");
            for (a, b) in lps.iter().zip(lps_too) {
                assert!((a - b).abs() < 1e-3, "{what}: {lps:?} vs {lps_too:?}");
            }
        }
    }
    use tokenmesh_proto::v1::FinishReason::{Eos, Length, Stop};
    assert_eq!(
        ends,
        [Length as i32, Eos as i32, Stop as i32].into(),
        "every kind of end was seen"
    );

    // Through a router, which counts the tokens of Deltas without ids from
    // their usage: its metrics see the reply's tokens and its first token.
    let metrics = format!("127.0.0.1:{}", free_port());
    let router = static_router(dir.path(), &[&generic], &["--metrics-listen", &metrics]).await;
    let got = collect(&mut router.client().await, france_request(6))
        .await
        .unwrap();
    let completion = got.finished.unwrap().usage.unwrap().completion_tokens;
    assert_eq!(completion, 6);
    let text = scrape_text(&metrics).await.unwrap();
    assert_eq!(
        sum_of(&text, "llm_tokens_generated_total", ""),
        f64::from(completion),
        "{text}"
    );
    assert_eq!(
        sum_of(&text, "llm_time_to_first_token_seconds_count", ""),
        1.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_from_an_openai_kind_worker_cut_mid_way_ends_unavailable_not_guessed_at() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start().await.unwrap();
    let engine = LlamaServer::start("llama", 1, dir.path()).await.unwrap();
    let mut extra: Vec<String> = AS_OPENAI.iter().map(|s| s.to_string()).collect();
    extra.extend(["--upstream-poll-ms".into(), "100".into()]);
    let generic = WorkerProc::start(
        WorkerOpts {
            etcd: Some(etcd.url.clone()),
            upstream_url: Some(engine.url()),
            extra,
            ..WorkerOpts::new("up-openai")
        },
        dir.path(),
    )
    .await
    .unwrap();
    // A worker that could take a continuation, were one to be guessed at.
    let _native = WorkerProc::start(
        WorkerOpts {
            etcd: Some(etcd.url.clone()),
            ..WorkerOpts::new("native")
        },
        dir.path(),
    )
    .await
    .unwrap();
    let key = format!("/tokenmesh/workers/{MODEL}/v1/up-openai");
    let record = wait_registered(&etcd, &key).await;
    assert_eq!(record["engine"], "openai");
    assert_eq!(record["continues_from_token_ids"], false, "{record}");

    // Sent a continuation anyway, the worker refuses it.
    let mut wc = generic.client().await;
    let call = WorkerGenerateRequest {
        request: Some(story(8)),
        emitted_token_ids: vec![1, 2],
        ..Default::default()
    };
    let refused = wc.generate(call).await.expect_err("a continuation");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("takes no token ids"),
        "{}",
        refused.message()
    );

    let router = etcd_router(dir.path(), &etcd, 2, &[]).await;
    let mut client = router.client().await;
    // Until a stream lands on the generic worker (the router balances).
    for _ in 0..20 {
        let mut stream = client.generate(story(200)).await.unwrap().into_inner();
        let mut on_generic = false;
        let mut chunks = 0;
        let outcome = loop {
            match stream.message().await {
                Ok(Some(msg)) => match msg.event {
                    Some(Event::Accepted(a)) => {
                        on_generic = a.worker_id == "up-openai";
                        if !on_generic {
                            break None;
                        }
                    }
                    Some(Event::Delta(d)) => {
                        assert!(d.token_ids.is_empty());
                        chunks += 1;
                        if chunks == 3 {
                            engine.proc.signal(nix::sys::signal::Signal::SIGKILL);
                        }
                    }
                    Some(Event::Finished(f)) => {
                        panic!("finished after a loss it cannot mend: {f:?}")
                    }
                    None => {}
                },
                Ok(None) => panic!("the stream ended without a status"),
                Err(status) => break Some(status),
            }
        };
        let Some(status) = outcome else { continue };
        assert!(on_generic);
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(
            status
                .message()
                .contains("cannot continue a stream from token ids"),
            "{}",
            status.message()
        );
        return;
    }
    panic!("no stream of 20 was routed to the generic worker");
}
