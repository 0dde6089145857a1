//! Component tests of the cache-aware worker choice (issue 17): routers'
//! `run()` in-process on 127.0.0.1:0 over one static discovery file, in front
//! of real workers (the synthetic engine) running in-process on runtimes of
//! their own.
//!
//! Two routers that never talk send every turn of a conversation to the same
//! worker, whichever of them each turn goes through; different conversations
//! spread over the workers; and the load guard moves streams off a preferred
//! worker whose load is past the margin or would pass the mean (the bound),
//! which it does not do with a wide margin and no bound.
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{ChatMessage, GenerateRequest, GenerateResponse, StatusRequest};
use tonic::transport::Channel;
use tonic::Streaming;
use tracing::field::{Field, Visit};
use tracing::span::{Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

mod support;
use support::{router, Router, Worker, MODEL};

/// `n` synthetic workers w0.. of v1 at `tokens_per_sec` per sequence.
fn workers(n: usize, tokens_per_sec: u32) -> Vec<Worker> {
    (0..n)
        .map(|i| {
            let id = format!("w{i}");
            Worker::launch(&id, "v1", Some(&id), tokens_per_sec, &["--max-batch", "16"])
        })
        .collect()
}

/// A router over `pool` polling status every `status_ms`, with `extra` flags.
async fn router_over(pool: &[Worker], status_ms: u32, extra: &[&str]) -> Router {
    let ms = status_ms.to_string();
    let mut flags = vec!["--status-interval-ms", ms.as_str()];
    flags.extend_from_slice(extra);
    router(&pool.iter().collect::<Vec<_>>(), &flags).await
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

/// A system prompt every conversation shares: 5 chunks of the router's hash.
fn system() -> ChatMessage {
    msg(
        "system",
        &"You are a careful assistant; answer briefly and cite the rule you used. ".repeat(9),
    )
}

fn chat(messages: &[ChatMessage], max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        messages: messages.to_vec(),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// Runs one request to its end: the worker that served it and the reply.
async fn turn(client: &mut InferenceClient<Channel>, req: GenerateRequest) -> (String, String) {
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let (mut worker, mut text, mut finished) = (String::new(), String::new(), false);
    while let Some(m) = stream.message().await.unwrap() {
        match m.event {
            Some(Event::Accepted(a)) => worker = a.worker_id,
            Some(Event::Delta(d)) => text.push_str(&d.text),
            Some(Event::Finished(_)) => finished = true,
            None => {}
        }
    }
    assert!(finished, "the stream finished");
    (worker, text)
}

#[tokio::test]
async fn two_routers_send_every_turn_of_a_conversation_to_one_worker_and_spread_conversations() {
    let pool = workers(4, 2_000);
    let a = router_over(&pool, 100, &[]).await;
    let b = router_over(&pool, 100, &[]).await;
    let mut clients = [a.client.clone(), b.client.clone()];
    const CONVERSATIONS: usize = 8;
    let mut histories: Vec<Vec<ChatMessage>> = (0..CONVERSATIONS).map(|_| vec![system()]).collect();
    let mut served: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for t in 0..4 {
        for (c, history) in histories.iter_mut().enumerate() {
            history.push(msg(
                "user",
                &format!("conversation {c}, question {t}: what comes next in the story?"),
            ));
            // Turns alternate between the routers, conversation by conversation.
            let client = &mut clients[(c + t) % 2];
            let (worker, reply) = turn(client, chat(history, 6)).await;
            history.push(msg("assistant", &reply));
            served.entry(c).or_default().push(worker);
        }
    }
    for (c, workers) in &served {
        assert!(
            workers.iter().all(|w| w == &workers[0]),
            "conversation {c} moved between workers: {served:?}"
        );
    }
    let used: BTreeSet<&String> = served.values().map(|w| &w[0]).collect();
    assert!(used.len() >= 3, "conversations did not spread: {served:?}");
}

/// The `reason` recorded on each `route` span, in order.
#[derive(Clone, Default)]
struct Reasons(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> Layer<S> for Reasons {
    fn on_record(&self, _: &Id, values: &Record<'_>, _: Context<'_, S>) {
        struct Visitor<'a>(&'a Mutex<Vec<String>>);
        impl Visit for Visitor<'_> {
            fn record_str(&mut self, field: &Field, value: &str) {
                if field.name() == "reason" {
                    self.0.lock().unwrap().push(value.into());
                }
            }
            fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
        }
        values.record(&mut Visitor(&self.0));
    }
}

/// Opens `n` streams of the same request one after another, each kept open
/// (a slow worker) once its `Accepted` names the worker; returns the workers.
async fn hold(
    client: &mut InferenceClient<Channel>,
    req: &GenerateRequest,
    n: usize,
) -> (Vec<String>, Vec<Streaming<GenerateResponse>>) {
    let (mut workers, mut streams) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let mut stream = client.generate(req.clone()).await.unwrap().into_inner();
        match stream.message().await.unwrap().and_then(|m| m.event) {
            Some(Event::Accepted(a)) => workers.push(a.worker_id),
            other => panic!("expected Accepted first, got {other:?}"),
        }
        streams.push(stream);
    }
    (workers, streams)
}

/// Waits until `w` runs and queues nothing (the streams of a dropped
/// client are cancelled).
async fn idle(w: &Worker) {
    let channel = Channel::from_shared(format!("http://{}", w.addr))
        .unwrap()
        .connect_lazy();
    let mut client = WorkerClient::new(channel);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = client.status(StatusRequest {}).await.unwrap().into_inner();
        if s.active_sequences == 0 && s.queue_depth == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} stays busy: {s:?}",
            w.id
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn count(workers: &[String], id: &str) -> usize {
    workers.iter().filter(|w| *w == id).count()
}

#[tokio::test]
async fn the_load_guard_moves_streams_off_a_preferred_worker_past_the_margin_or_the_bound() {
    let reasons = Reasons::default();
    let _trace =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(reasons.clone()));
    // 20 tokens/s: a stream of 2,000 tokens stays open for the whole test.
    let pool = workers(4, 20);
    let question = msg("user", "one conversation, asked six times at once");
    let req = chat(&[system(), question], 2_000);
    // The routers poll the workers' status once, at start (an hour apart):
    // the load they see is then exactly their own streams in flight, not
    // also a queue the worker reported a moment before admitting them.
    const ONCE: u32 = 3_600_000;

    // A wide margin and no bound on the mean: affinity alone, every stream
    // on the conversation's worker.
    let wide = router_over(
        &pool,
        ONCE,
        &[
            "--cache-aware-load-margin",
            "100",
            "--cache-aware-load-factor",
            "0",
        ],
    )
    .await;
    let (on, streams) = hold(&mut wide.client.clone(), &req, 6).await;
    let preferred = on[0].clone();
    assert_eq!(count(&on, &preferred), 6, "{on:?}");
    drop(streams);
    drop(wide);
    for w in &pool {
        idle(w).await;
    }

    // A margin of 1: the preferred worker takes streams until its load is 2
    // above the least loaded one's; then load wins and the rest spread.
    reasons.0.lock().unwrap().clear();
    let tight = router_over(
        &pool,
        ONCE,
        &[
            "--cache-aware-load-margin",
            "1",
            "--cache-aware-load-factor",
            "0",
        ],
    )
    .await;
    let (on, streams) = hold(&mut tight.client.clone(), &req, 6).await;
    let seen = reasons.0.lock().unwrap().clone();
    assert_eq!(
        on[..2],
        [preferred.clone(), preferred.clone()],
        "{on:?} {seen:#?}"
    );
    assert_ne!(on[2], preferred, "{on:?}");
    assert!(count(&on, &preferred) <= 3, "{on:?}");
    let others: BTreeSet<&String> = on.iter().filter(|w| **w != preferred).collect();
    assert!(others.len() >= 2, "{on:?}");
    assert_eq!(seen.len(), 6, "{seen:?}");
    assert!(
        seen[0].starts_with("cache-aware: the conversation's rendezvous worker"),
        "{seen:?}"
    );
    assert!(
        seen[2].starts_with(&format!("load guard: {preferred} ")),
        "{seen:?}"
    );
    drop(streams);
    drop(tight);
    for w in &pool {
        idle(w).await;
    }

    // The default bound on the mean, margin wide: one more stream may not
    // take the preferred worker past ceil(1.0 x (streams + 1) / 4), so
    // after six it holds at most ceil(6 / 4) = 2.
    reasons.0.lock().unwrap().clear();
    let bounded = router_over(&pool, ONCE, &["--cache-aware-load-margin", "100"]).await;
    let (on, _streams) = hold(&mut bounded.client.clone(), &req, 6).await;
    let seen = reasons.0.lock().unwrap().clone();
    assert_eq!(on[0], preferred, "{on:?}");
    assert!(count(&on, &preferred) <= 2, "{on:?} {seen:#?}");
    assert!(
        seen.iter()
            .any(|r| r.starts_with(&format!("load guard: {preferred} "))
                && r.contains("1.00 times the mean load")),
        "{seen:#?}"
    );
}
