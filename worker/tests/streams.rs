//! The Worker API's stream names and limits, on the worker's `run()`
//! in-process on 127.0.0.1:0 with the synthetic engine: Abort stops the one
//! stream its (request id, attempt id) names, and finishes it as CANCELLED;
//! a name in use is refused; a worker picks a name for a caller that gives
//! none; and what the KV cache cannot hold is refused by the call itself.
mod support;

use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{
    AbortRequest, FinishReason, Finished, GenerateRequest, GenerateResponse, StatusRequest,
    WorkerGenerateRequest,
};
use tonic::transport::Channel;
use tonic::{Code, Streaming};

const MODEL: &str = "m";

/// A synthetic worker at 200 tokens/s per sequence with 1 MiB of KV cache
/// (1,024 tokens); a client once it answers.
async fn worker() -> WorkerClient<Channel> {
    support::synthetic_worker(
        MODEL,
        &["--synthetic-tokens-per-sec", "200", "--kv-budget-mib", "1"],
    )
    .await
}

/// A call named (`request_id`, `attempt_id`) for `max_tokens` tokens.
fn call(
    request_id: &str,
    attempt_id: &str,
    words: usize,
    max_tokens: u32,
) -> WorkerGenerateRequest {
    WorkerGenerateRequest {
        request: Some(GenerateRequest {
            model: MODEL.into(),
            prompt: "word ".repeat(words),
            max_tokens: Some(max_tokens),
            request_id: request_id.into(),
            ..Default::default()
        }),
        attempt_id: attempt_id.into(),
        ..Default::default()
    }
}

fn abort(request_id: &str, attempt_id: &str) -> AbortRequest {
    AbortRequest {
        request_id: request_id.into(),
        attempt_id: attempt_id.into(),
    }
}

/// Reads until `n` tokens have come.
async fn tokens(stream: &mut Streaming<GenerateResponse>, n: usize) {
    let mut got = 0;
    while got < n {
        let msg = stream.message().await.unwrap().expect("more of the stream");
        if let Some(Event::Delta(d)) = msg.event {
            got += d.token_ids.len();
        }
    }
}

/// The rest of a stream: its tokens and its Finished.
async fn rest(stream: &mut Streaming<GenerateResponse>) -> (usize, Finished) {
    let mut got = 0;
    let mut finished = None;
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event {
            Some(Event::Delta(d)) => got += d.token_ids.len(),
            Some(Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    (got, finished.expect("a Finished"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_stops_only_the_stream_it_names_and_finishes_it_cancelled() {
    let mut w = worker().await;
    // Two streams of one (client-chosen) request id.
    let mut a = w
        .generate(call("shared", "a", 3, 400))
        .await
        .unwrap()
        .into_inner();
    let mut b = w
        .generate(call("shared", "b", 3, 100))
        .await
        .unwrap()
        .into_inner();
    let taken = w.generate(call("shared", "b", 3, 5)).await.unwrap_err();
    assert_eq!(taken.code(), Code::AlreadyExists, "{taken:?}");
    assert!(
        taken.message().contains("attempt_id"),
        "{}",
        taken.message()
    );

    tokens(&mut a, 5).await;
    let refused = w.abort(abort("shared", "")).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        w.abort(abort("shared", "a"))
            .await
            .unwrap()
            .into_inner()
            .found
    );
    let (more, finished) = rest(&mut a).await;
    assert_eq!(finished.finish_reason(), FinishReason::Cancelled);
    let usage = finished.usage.unwrap();
    assert_eq!(usage.completion_tokens as usize, 5 + more);
    assert!(usage.completion_tokens < 400, "{usage:?}");
    assert!(
        !w.abort(abort("shared", "a"))
            .await
            .unwrap()
            .into_inner()
            .found
    );

    // b, of the same request id, was not touched.
    let (all, finished) = rest(&mut b).await;
    assert_eq!(finished.finish_reason(), FinishReason::Length);
    assert_eq!(all, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_without_an_attempt_id_gets_one_to_abort_with() {
    let mut w = worker().await;
    let response = w.generate(call("r", "", 3, 400)).await.unwrap();
    let attempt = response
        .metadata()
        .get(tokenmesh_proto::headers::ATTEMPT)
        .expect("the x-tokenmesh-attempt header")
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(attempt.len(), 32, "{attempt}");
    let mut stream = response.into_inner();
    tokens(&mut stream, 1).await;
    assert!(
        w.abort(abort("r", &attempt))
            .await
            .unwrap()
            .into_inner()
            .found
    );
    let (_, finished) = rest(&mut stream).await;
    assert_eq!(finished.finish_reason(), FinishReason::Cancelled);

    let long = format!("{attempt}{}", "x".repeat(200));
    let refused = w.generate(call("r", &long, 3, 4)).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_kv_cache_cannot_hold_is_refused_by_the_call_itself() {
    let mut w = worker().await;
    let refused = w.generate(call("big", "", 1100, 4)).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().contains("prompt is 1100 tokens")
            && refused.message().contains("holds 1024 tokens"),
        "{}",
        refused.message()
    );
    let status = w.status(StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(
        status.kv_blocks_total, 64,
        "1 MiB at 1 KiB per token, 16 per block"
    );
}
