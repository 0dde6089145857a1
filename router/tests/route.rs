//! Component tests of the request path: the router's `run()` in-process on
//! 127.0.0.1:0 over a static discovery file, in front of real workers (the
//! synthetic engine, whose output is a pure function of the prompt) that also
//! run in-process (`support`), so that a test can kill one outright.
//!
//! The tests run on a current-thread runtime, so a thread-local tracing
//! subscriber sees every span the router makes, and can check the routing
//! facts written on the `route` spans (`--trace-phases`).
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenmesh_proto::codes::classify;
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{
    AbortRequest, FinishReason, Finished, GenerateRequest, ListModelsRequest,
};
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

mod support;
use support::{spawn_router, Router, Worker, MODEL};

/// The support router with `--trace-phases`: the routing facts these tests
/// check are written on `route` spans and `worker.Generate` client spans,
/// which are attributes of `Generate` without it.
async fn router(workers: &[&Worker], extra: &[&str]) -> Router {
    let mut args = vec!["--trace-phases"];
    args.extend_from_slice(extra);
    support::router(workers, &args).await
}

fn request(max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        prompt: "tell me about lighthouses and their keepers".into(),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// What one stream delivered.
#[derive(Debug, Default)]
struct Output {
    seqs: Vec<u64>,
    worker: String,
    token_ids: Vec<u32>,
    text: String,
    finished: Option<Finished>,
}

/// Reads a whole stream; `on_tokens` sees the token count after each delta.
async fn collect(
    client: &mut InferenceClient<Channel>,
    req: GenerateRequest,
    mut on_tokens: impl FnMut(&str, usize),
) -> Result<Output, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Output::default();
    while let Some(msg) = stream.message().await? {
        out.seqs.push(msg.seq);
        match msg.event {
            Some(Event::Accepted(a)) => out.worker = a.worker_id,
            Some(Event::Delta(d)) => {
                out.token_ids.extend(d.token_ids);
                out.text.push_str(&d.text);
                on_tokens(&out.worker, out.token_ids.len());
            }
            Some(Event::Finished(f)) => out.finished = Some(f),
            None => {}
        }
    }
    Ok(out)
}

/// The fields recorded on one closed `route` span, and its parent's name.
#[derive(Debug, Clone)]
struct RouteSpan {
    parent: String,
    fields: BTreeMap<String, String>,
}

/// Captures every `route` span's fields, whenever they were recorded, and
/// the fields each `worker.Generate` client span opens with.
#[derive(Clone, Default)]
struct Capture {
    routes: Arc<Mutex<Vec<RouteSpan>>>,
    calls: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
}

struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() == "worker.Generate" {
            let mut fields = Fields(BTreeMap::new());
            attrs.record(&mut fields);
            self.calls.lock().unwrap().push(fields.0);
        }
        if attrs.metadata().name() == "route" {
            let mut fields = Fields(BTreeMap::new());
            attrs.record(&mut fields);
            ctx.span(id).unwrap().extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let mut extensions = span.extensions_mut();
        if let Some(fields) = extensions.get_mut::<Fields>() {
            values.record(fields);
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).unwrap();
        let fields = span.extensions_mut().remove::<Fields>();
        if let Some(fields) = fields {
            let parent = span
                .parent()
                .map(|p| p.name().to_string())
                .unwrap_or_default();
            self.routes.lock().unwrap().push(RouteSpan {
                parent,
                fields: fields.0,
            });
        }
    }
}

impl Capture {
    /// Installs the capture for this thread.
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    /// The closed `route` spans, once at least `n` have closed.
    async fn routes(&self, n: usize) -> Vec<RouteSpan> {
        for _ in 0..200 {
            let routes = self.routes.lock().unwrap().clone();
            if routes.len() >= n {
                return routes;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "fewer than {n} route spans closed: {:?}",
            self.routes.lock().unwrap()
        );
    }

    /// The calls to workers so far: each one's worker and attempt id, in order.
    fn calls(&self) -> Vec<(String, String)> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .map(|f| (f["worker"].clone(), f["attempt_id"].clone()))
            .collect()
    }
}

#[tokio::test]
async fn a_stream_whose_worker_dies_continues_on_another_token_for_token() {
    let capture = Capture::default();
    let _guard = capture.install();
    let mut workers = [Worker::start("w1"), Worker::start("w2")];
    // P2C, whose reasons the spans are checked for below (the cache-aware
    // choice's are checked in tests/cache_aware.rs).
    let mut r = router(&[&workers[0], &workers[1]], &["--worker-choice", "p2c"]).await;
    let reference = collect(&mut r.client, request(60), |_, _| {})
        .await
        .unwrap();
    assert_eq!(reference.token_ids.len(), 60);

    let mut victim = None;
    let out = collect(&mut r.client, request(60), |worker, tokens| {
        if tokens >= 10 && victim.is_none() {
            let i = workers.iter().position(|w| w.id == worker).unwrap();
            workers[i].kill();
            victim = Some(worker.to_string());
        }
    })
    .await
    .unwrap();
    let victim = victim.unwrap();
    let finished = out.finished.expect("the stream finishes");
    assert_eq!(finished.failovers, 1);
    assert_ne!(finished.worker_id, victim);
    assert_eq!(out.seqs, (0..out.seqs.len() as u64).collect::<Vec<_>>());
    assert_eq!(
        out.token_ids, reference.token_ids,
        "no token lost or repeated"
    );
    assert_eq!(out.text, reference.text);
    assert_eq!(finished.usage.unwrap().completion_tokens, 60);

    // The reference's route, the stream's first route and its failover's,
    // each with the routing facts on its own span under Generate.
    let routes = capture.routes(3).await;
    let failover = routes
        .iter()
        .find(|r| r.fields.get("failover").map(String::as_str) == Some("1"))
        .unwrap_or_else(|| panic!("no failover route span: {routes:#?}"));
    assert_eq!(failover.parent, "Generate");
    let f = &failover.fields;
    assert_eq!(f["version"], "v1");
    assert_eq!(f["worker"], finished.worker_id);
    assert_eq!(f["reason"], "only ready worker left");
    assert_eq!(f["attempts"], "2", "{f:?}");
    assert!(f["candidates"].contains(&finished.worker_id), "{f:?}");
    let first: Vec<_> = routes
        .iter()
        .filter(|r| !r.fields.contains_key("failover"))
        .collect();
    assert_eq!(first.len(), 2, "{routes:#?}");
    for r in first {
        assert_eq!(r.parent, "Generate");
        assert_eq!(r.fields["attempts"], "1");
        assert_eq!(r.fields["reason"], "lower load of two random ready workers");
    }
}

/// Two workers, one of them dead (killed after the router saw it healthy,
/// with status polls too rare to notice): calls to it are refused.
async fn one_dead_worker(extra: &[&str]) -> (Router, [Worker; 2]) {
    let mut workers = [Worker::start("w-dead"), Worker::start("w-live")];
    let mut args = vec!["--status-interval-ms", "600000"];
    args.extend_from_slice(extra);
    let r = router(&[&workers[0], &workers[1]], &args).await;
    workers[0].kill();
    (r, workers)
}

#[tokio::test]
async fn a_refused_call_is_retried_on_another_worker_before_the_first_token() {
    let capture = Capture::default();
    let _guard = capture.install();
    let (mut r, _workers) = one_dead_worker(&[]).await;
    // P2C tries the dead worker first in about half of the requests.
    const N: usize = 20;
    for _ in 0..N {
        let out = collect(&mut r.client, request(2), |_, _| {}).await.unwrap();
        let finished = out.finished.unwrap();
        assert_eq!(
            (finished.worker_id.as_str(), finished.failovers),
            ("w-live", 0)
        );
    }
    let routes = capture.routes(N).await;
    let retried: Vec<_> = routes
        .iter()
        .filter(|r| r.fields["attempts"] == "2")
        .collect();
    assert!(
        !retried.is_empty(),
        "no request tried the dead worker: {routes:#?}"
    );
    for r in retried {
        assert_eq!(r.fields["worker"], "w-live");
        assert_eq!(r.fields["reason"], "only ready worker left");
    }
}

#[tokio::test]
async fn an_exhausted_retry_budget_stops_retries() {
    let capture = Capture::default();
    let _guard = capture.install();
    // No share of the traffic and no floor: not a single retry is allowed.
    let budget = [
        "--retry-budget-ratio",
        "0",
        "--retry-budget-min-per-sec",
        "0",
    ];
    let (mut r, _workers) = one_dead_worker(&budget).await;
    let mut refused = None;
    for _ in 0..40 {
        match collect(&mut r.client, request(2), |_, _| {}).await {
            Ok(out) => assert_eq!(out.finished.unwrap().worker_id, "w-live"),
            Err(status) => {
                refused = Some(status);
                break;
            }
        }
    }
    let status = refused.expect("a request that hit the dead worker first fails");
    // The dead worker's own refusal: tonic reports a refused connection as
    // UNKNOWN "transport error".
    assert!(classify(status.code()).is_retryable(), "{status:?}");
    assert!(
        status
            .message()
            .starts_with("retry budget exhausted, not retrying; last error: "),
        "{}",
        status.message()
    );
    let routes = capture.routes(1).await;
    assert!(
        routes.iter().all(|r| r.fields["attempts"] == "1"),
        "{routes:#?}"
    );
}

#[tokio::test]
async fn a_lost_stream_is_not_failed_over_past_the_retry_budget() {
    let budget = [
        "--retry-budget-ratio",
        "0",
        "--retry-budget-min-per-sec",
        "0",
    ];
    let mut workers = [Worker::start("w1"), Worker::start("w2")];
    let mut r = router(&[&workers[0], &workers[1]], &budget).await;
    let mut delivered = 0;
    let out = collect(&mut r.client, request(60), |worker, tokens| {
        if tokens >= 10 && delivered == 0 {
            delivered = tokens;
            workers.iter_mut().find(|w| w.id == worker).unwrap().kill();
        }
    })
    .await;
    let status = out.expect_err("no failover is allowed");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let want = format!("worker lost after {delivered} tokens were delivered and no other worker could continue: retry budget exhausted, not retrying");
    assert_eq!(status.message(), want);
}

/// A synthetic prompt of `n` tokens (one per word).
fn words(n: usize, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: "word ".repeat(n),
        ..request(max_tokens)
    }
}

#[tokio::test]
async fn what_the_kv_cache_cannot_hold_is_refused_before_accepted_and_a_full_cache_says_so() {
    let capture = Capture::default();
    let _guard = capture.install();
    // 1 MiB of synthetic KV cache holds 1,024 tokens, a 32nd of the context
    // window: a prompt that fits the window but not the cache.
    let small = ["--kv-budget-mib", "1"];
    let workers = [
        Worker::launch("w1", "v1", Some("w1"), 200, &small),
        Worker::launch("w2", "v1", Some("w2"), 200, &small),
    ];
    let mut r = router(&[&workers[0], &workers[1]], &[]).await;

    // Refused by the call itself, so no Accepted reached the client.
    let refused = r.client.generate(words(1100, 16)).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let m = refused.message();
    assert!(
        m.contains("prompt is 1100 tokens") && m.contains("KV cache holds 1024 tokens"),
        "{m}"
    );
    let refused = r.client.generate(words(4, 1025)).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(
        refused.message(),
        "max_tokens: 1025 is beyond the worker's KV cache of 1024 tokens"
    );
    // A client error: one worker asked, no other tried.
    let routes = capture.routes(2).await;
    assert!(
        routes.iter().all(|r| r.fields["attempts"] == "1"),
        "{routes:#?}"
    );

    // 1,000 prompt tokens leave room for 24 more in the cache, so 25
    // completion tokens (the last is never stored), not the 200 asked for.
    let out = collect(&mut r.client, words(1000, 200), |_, _| {})
        .await
        .unwrap();
    let finished = out.finished.expect("the stream finishes");
    assert_eq!(
        finished.finish_reason(),
        FinishReason::KvCacheFull,
        "{finished:?}"
    );
    assert_eq!(finished.usage.unwrap().completion_tokens, 25);
    assert_eq!(out.token_ids.len(), 25);
    assert_eq!(finished.failovers, 0, "a normal finish, not a failure");
}

#[tokio::test]
async fn an_aborted_stream_finishes_cancelled_on_its_worker_and_is_not_failed_over() {
    let capture = Capture::default();
    let _guard = capture.install();
    let workers = [Worker::start("w1"), Worker::start("w2")];
    let mut r = router(&[&workers[0], &workers[1]], &[]).await;
    let req = GenerateRequest {
        request_id: "chosen-by-the-client".into(),
        // Two seconds at 200 tokens/s.
        ..request(400)
    };
    let mut stream = r.client.generate(req).await.unwrap().into_inner();
    let mut tokens = 0;
    let mut accepted = None;
    let mut finished = None;
    let mut aborted = None;
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event {
            Some(Event::Accepted(a)) => accepted = Some(a),
            Some(Event::Delta(d)) => {
                tokens += d.token_ids.len();
                if tokens >= 5 && aborted.is_none() {
                    // The stream's name on its worker, from the router's
                    // client span of the call.
                    let [(worker, attempt_id)] = capture.calls().try_into().unwrap();
                    let w = workers.iter().find(|w| w.id == worker).unwrap();
                    let mut wc = WorkerClient::connect(format!("http://{}", w.addr))
                        .await
                        .unwrap();
                    let abort = AbortRequest {
                        request_id: "chosen-by-the-client".into(),
                        attempt_id,
                    };
                    let found = wc.abort(abort.clone()).await.unwrap().into_inner().found;
                    assert!(found, "the stream runs on {worker}");
                    aborted = Some((wc, abort));
                }
            }
            Some(Event::Finished(f)) => finished = Some(f),
            None => {}
        }
    }
    let finished = finished.expect("the stream finishes");
    assert_eq!(
        finished.finish_reason(),
        FinishReason::Cancelled,
        "{finished:?}"
    );
    assert_eq!(finished.failovers, 0, "an abort is not a worker failure");
    assert_eq!(finished.worker_id, accepted.unwrap().worker_id);
    assert_eq!(finished.usage.unwrap().completion_tokens as usize, tokens);
    assert!(tokens < 400, "stopped early: {tokens} tokens");
    assert_eq!(capture.calls().len(), 1, "no other worker was called");
    // Over now, so not found again.
    let (mut wc, abort) = aborted.unwrap();
    assert!(!wc.abort(abort).await.unwrap().into_inner().found);
}

#[tokio::test]
async fn finished_names_the_worker_as_accepted_does_also_after_a_failover() {
    // Listed in the static file as reg-1 and reg-2; each worker, started
    // without --worker-id, calls itself worker-<random>.
    let mut workers = [
        Worker::launch("reg-1", "v1", None, 200, &[]),
        Worker::launch("reg-2", "v1", None, 200, &[]),
    ];
    let mut r = router(&[&workers[0], &workers[1]], &[]).await;
    let calm = collect(&mut r.client, request(3), |_, _| {}).await.unwrap();
    assert!(calm.worker.starts_with("reg-"), "{}", calm.worker);
    assert_eq!(calm.finished.unwrap().worker_id, calm.worker);

    let mut victim = None;
    let out = collect(&mut r.client, request(60), |worker, tokens| {
        if tokens >= 10 && victim.is_none() {
            workers.iter_mut().find(|w| w.id == worker).unwrap().kill();
            victim = Some(worker.to_string());
        }
    })
    .await
    .unwrap();
    let finished = out.finished.expect("the stream finishes");
    assert_eq!(finished.failovers, 1);
    let survivor = if victim.unwrap() == "reg-1" {
        "reg-2"
    } else {
        "reg-1"
    };
    assert_eq!(finished.worker_id, survivor, "the worker that finished it");
}

#[tokio::test]
async fn a_queued_request_gets_the_version_that_is_ready_when_it_is_admitted() {
    // Without a policy the newest ready version serves: v2, while it lives.
    let old = Worker::of_version("w-v1", "v1");
    let mut new = Worker::of_version("w-v2", "v2");
    let flags = [
        "--max-in-flight",
        "1",
        "--max-queue-wait-ms",
        "10000",
        "--status-interval-ms",
        "50",
    ];
    let mut r = router(&[&old, &new], &flags).await;
    // A long stream on v1 takes the only slot...
    let pinned = GenerateRequest {
        version: Some("v1".into()),
        ..request(400)
    };
    let mut first = r.client.generate(pinned).await.unwrap().into_inner();
    first.message().await.unwrap().unwrap();
    // ...so the next request waits in the queue, while v2 goes away.
    let mut c = r.client.clone();
    let queued = tokio::spawn(async move { collect(&mut c, request(2), |_, _| {}).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    new.kill();
    loop {
        let models = r.client.list_models(ListModelsRequest {}).await.unwrap();
        let v2 = models.into_inner().models[0]
            .versions
            .iter()
            .find(|v| v.version == "v2")
            .map(|v| v.ready_workers);
        if v2 == Some(0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!queued.is_finished(), "the request was not kept waiting");
    // Chosen before admission it would have gone to v2 and failed; chosen
    // after, it is served by v1 once the slot is free.
    while first.message().await.unwrap().is_some() {}
    let out = queued
        .await
        .unwrap()
        .expect("served by the version still ready");
    assert_eq!(out.worker, "w-v1");
}

/// The health of `service` ("" for the whole server), once the server answers.
async fn health(channel: &Channel, service: &str) -> ServingStatus {
    let mut client = HealthClient::new(channel.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let asked = client
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await;
        match asked {
            Ok(r) => return r.into_inner().status(),
            Err(e) if e.code() == Code::Unavailable => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "router never answered: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("health check of {service:?}: {e}"),
        }
    }
}

// A router before its first discovery view must not call a real model
// missing: UNAVAILABLE (a client retries), not NOT_FOUND or an empty list
// (a client gives up), and NOT_SERVING on grpc.health.
#[tokio::test]
async fn before_its_first_etcd_snapshot_the_router_says_unavailable_not_not_found() {
    // An etcd endpoint where nothing listens: the snapshot never arrives.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let argv = [
        "tokenmesh-router".into(),
        "--insecure".into(),
        "--etcd".into(),
        format!("http://127.0.0.1:{port}"),
    ];
    let (channel, _stop) = spawn_router(&argv).await;
    assert_eq!(health(&channel, "").await, ServingStatus::NotServing);
    assert_eq!(
        health(&channel, "tokenmesh.v1.Inference").await,
        ServingStatus::NotServing
    );
    let mut client = InferenceClient::new(channel);
    let refused = client.generate(request(4)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("not read its etcd snapshot"),
        "{}",
        refused.message()
    );
    let listed = client.list_models(ListModelsRequest {}).await.unwrap_err();
    assert_eq!(listed.code(), Code::Unavailable, "{listed:?}");
}

#[tokio::test]
async fn with_a_static_file_the_router_serves_at_once_and_unknown_models_are_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("static.toml");
    std::fs::write(
        &path,
        "[[workers]]\nid = \"w\"\nmodel = \"m\"\nversion = \"v1\"\naddr = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    let argv = [
        "tokenmesh-router".into(),
        "--insecure".into(),
        "--static".into(),
        path.display().to_string(),
    ];
    let (channel, _stop) = spawn_router(&argv).await;
    // The view is in at once, but nothing listens at the worker's address:
    // with no ready worker the router is not ready (the same signal as its
    // /readyz), though it answers.
    assert_eq!(health(&channel, "").await, ServingStatus::NotServing);
    assert_eq!(
        health(&channel, "tokenmesh.v1.Inference").await,
        ServingStatus::NotServing
    );
    let mut client = InferenceClient::new(channel);
    let unknown = client
        .generate(GenerateRequest {
            model: "nope".into(),
            ..request(4)
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
    assert!(
        unknown.message().contains("available: m"),
        "{}",
        unknown.message()
    );
}
