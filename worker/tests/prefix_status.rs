//! Prefix caching as a router sees it: `Worker.Status` of the worker's
//! `run()` in-process on 127.0.0.1:0 (synthetic engine, whose accounting
//! pool caches as the model's does) reports the prompt tokens it served
//! from the cache and the blocks it keeps, and `--prefix-cache off` turns
//! both off.
mod support;

use std::time::Duration;

use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{GenerateRequest, StatusRequest, StatusResponse, WorkerGenerateRequest};
use tonic::transport::Channel;

const MODEL: &str = "m";
/// One synthetic token per word.
const PROMPT_WORDS: usize = 100;

/// A synthetic worker started with `extra` flags; a client once it answers.
async fn worker(extra: &[&str]) -> WorkerClient<Channel> {
    let flags = [&["--synthetic-tokens-per-sec", "500"][..], extra].concat();
    support::synthetic_worker(MODEL, &flags).await
}

/// Runs one request to its end.
async fn generate(w: &mut WorkerClient<Channel>, prompt: &str) {
    let call = WorkerGenerateRequest {
        request: Some(GenerateRequest {
            model: MODEL.into(),
            prompt: prompt.into(),
            max_tokens: Some(4),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = w.generate(call).await.unwrap().into_inner();
    let mut finished = false;
    while let Some(msg) = stream.message().await.unwrap() {
        finished |= matches!(msg.event, Some(Event::Finished(_)));
    }
    assert!(finished, "the stream ended with a Finished");
}

/// Status once the engine has published the step that ended the last
/// request (nothing running).
async fn settled(w: &mut WorkerClient<Channel>) -> StatusResponse {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = w.status(StatusRequest {}).await.unwrap().into_inner();
        if s.active_sequences == 0 && s.kv_blocks_used == 0 {
            return s;
        }
        assert!(tokio::time::Instant::now() < deadline, "still busy: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_the_prompt_tokens_served_from_the_cache() {
    let mut w = worker(&[]).await;
    let shared = "lighthouse ".repeat(PROMPT_WORDS);
    generate(&mut w, &shared).await;
    let first = settled(&mut w).await;
    assert_eq!(
        (first.prompt_tokens_total, first.prompt_tokens_cached),
        (PROMPT_WORDS as u64, 0)
    );
    // The full blocks of 16 of the prompt and the reply tokens fed (103).
    assert_eq!(first.kv_blocks_cached, 6, "{first:?}");

    generate(&mut w, &format!("{shared}keeper storm")).await;
    let second = settled(&mut w).await;
    assert_eq!(second.prompt_tokens_total, (2 * PROMPT_WORDS + 2) as u64);
    assert_eq!(
        second.prompt_tokens_cached,
        (PROMPT_WORDS / 16 * 16) as u64,
        "every full block of the shared prompt: {second:?}"
    );
    assert_eq!(second.kv_blocks_evicted, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_prefix_cache_off_nothing_is_served_or_kept() {
    let mut w = worker(&["--prefix-cache", "off"]).await;
    let shared = "lighthouse ".repeat(PROMPT_WORDS);
    generate(&mut w, &shared).await;
    generate(&mut w, &shared).await;
    let s = settled(&mut w).await;
    assert_eq!(s.prompt_tokens_total, 2 * PROMPT_WORDS as u64);
    assert_eq!((s.prompt_tokens_cached, s.kv_blocks_cached), (0, 0));
}
