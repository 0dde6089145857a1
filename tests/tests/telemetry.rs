//! Observability with real processes: one trace across router and worker,
//! requests unaffected by a collector that is down, and Prometheus counters
//! that match the traffic.
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenmesh_tests::*;
use tonic::{Request, Response, Status};

/// An OTLP/gRPC trace receiver: keeps every span with its service name.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(Value::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push((service.clone(), span));
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn start_receiver() -> (Receiver, String) {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = TraceServiceServer::new(receiver.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (receiver, format!("http://{addr}"))
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn attr_str(span: &Span, key: &str) -> String {
    match attr(span, key) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_trace_crosses_router_and_worker() {
    // The batch span processor exports every 5 s by default; the child
    // processes inherit this shorter delay so the test need not wait.
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let (receiver, endpoint) = start_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    // Phases as spans of their own here; the default (their times and
    // fields as attributes) is checked in the tests after this one.
    let phases = ["--otlp-endpoint", &endpoint, "--trace-phases"];
    let w = real_worker("w-traced", &phases, dir.path()).await;
    let router = static_router(dir.path(), &[&w], &phases).await;

    // The client's own trace context is honoured.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let mut req = Request::new(france_request(12));
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{client_span}-01").parse().unwrap(),
    );
    let mut client = router.client().await;
    let mut stream = client.generate(req).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}

    let spans = spans_of_trace(
        &receiver,
        trace_id,
        &["route", "queue", "prefill", "decode"],
    )
    .await;
    let by_id: HashMap<String, &(String, Span)> =
        spans.iter().map(|e| (hex(&e.1.span_id), e)).collect();
    let find = |service: &str, name: &str| {
        spans
            .iter()
            .find(|(svc, s)| svc == service && s.name == name)
            .map(|(_, s)| s)
            .unwrap_or_else(|| panic!("no {name} span from {service}"))
    };
    let parent_name = |s: &Span| {
        by_id
            .get(&hex(&s.parent_span_id))
            .map(|(svc, p)| format!("{svc}/{}", p.name))
            .unwrap_or_else(|| hex(&s.parent_span_id))
    };
    let router_gen = find("tokenmesh-router", "Generate");
    assert_eq!(
        hex(&router_gen.parent_span_id),
        client_span,
        "router span is the client's child"
    );
    for key in [
        "model",
        "version",
        "worker",
        "arm",
        "request_id",
        "identity",
    ] {
        assert!(
            !attr_str(router_gen, key).is_empty(),
            "router Generate lacks {key}"
        );
    }
    let route = find("tokenmesh-router", "route");
    assert_eq!(parent_name(route), "tokenmesh-router/Generate");
    for key in ["version", "arm", "candidates", "worker", "reason"] {
        assert!(!attr_str(route, key).is_empty(), "route lacks {key}");
    }
    let call = find("tokenmesh-router", "tokenmesh.v1.Worker/Generate");
    assert_eq!(parent_name(call), "tokenmesh-router/route");
    let worker_gen = find("tokenmesh-worker", "Generate");
    assert_eq!(
        parent_name(worker_gen),
        "tokenmesh-router/tokenmesh.v1.Worker/Generate"
    );
    assert!(
        attr_str(worker_gen, "prompt_tokens")
            .parse::<u32>()
            .unwrap()
            > 10
    );
    assert!(
        attr_str(worker_gen, "completion_tokens")
            .parse::<u32>()
            .unwrap()
            > 0
    );
    assert_eq!(attr_str(worker_gen, "finish_reason"), "Eos");
    for name in ["queue", "prefill", "decode"] {
        assert_eq!(
            parent_name(find("tokenmesh-worker", name)),
            "tokenmesh-worker/Generate"
        );
    }
    assert!(
        attr_str(find("tokenmesh-worker", "decode"), "tokens")
            .parse::<u32>()
            .unwrap()
            > 0
    );
    // The request's span lasts as long as its stream: it starts before the
    // call that made the worker's span and ends after the worker's decode
    // began, since it relayed the stream's end (tracing-opentelemetry ends a
    // span at its last exit, so a span entered only while routing ended
    // before the prefill). Only causal orders are checked: the worker ends
    // its own spans just after it sends the last message.
    let decode = find("tokenmesh-worker", "decode");
    assert!(router_gen.start_time_unix_nano <= worker_gen.start_time_unix_nano);
    assert!(
        router_gen.end_time_unix_nano >= decode.start_time_unix_nano,
        "router Generate ends {} ns before the worker's decode begins",
        decode.start_time_unix_nano - router_gen.end_time_unix_nano
    );
    // The first token is an event on the router's span.
    assert!(
        router_gen.events.iter().any(|e| e.name == "first token"),
        "{:?}",
        router_gen.events
    );
    // Log lines carry the trace id.
    assert!(router.proc.log_text().contains(trace_id) || w.proc.log_text().contains(trace_id));
}

/// The spans of `trace_id` once both Generate spans (router and worker) and
/// every span named in `want` have arrived; fails after 10 s listing those
/// that did.
async fn spans_of_trace(receiver: &Receiver, trace_id: &str, want: &[&str]) -> Vec<(String, Span)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let spans: Vec<(String, Span)> = receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| hex(&s.trace_id) == trace_id)
            .cloned()
            .collect();
        let names: Vec<&str> = spans.iter().map(|(_, s)| s.name.as_str()).collect();
        let generates = names.iter().filter(|n| **n == "Generate").count();
        if generates == 2 && want.iter().all(|w| names.contains(w)) {
            return spans;
        }
        assert!(Instant::now() < deadline, "spans so far: {names:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_succeed_with_the_collector_down() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let dir = tempfile::tempdir().unwrap();
    let w = real_worker("w-nocollector", &["--otlp-endpoint", &dead], dir.path()).await;
    let router = static_router(dir.path(), &[&w], &["--otlp-endpoint", &dead]).await;
    let mut client = router.client().await;
    for _ in 0..5 {
        let t = Instant::now();
        let out = collect(&mut client, france_request(8)).await.unwrap();
        assert!(out.finished.is_some());
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }
}

fn sum(scrape: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            // A histogram counts as its number of observations (the +Inf bucket).
            prometheus_parse::Value::Histogram(ref buckets) => {
                buckets.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            _ => 0.0,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_the_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let worker_metrics = format!("127.0.0.1:{}", free_port());
    let router_metrics = format!("127.0.0.1:{}", free_port());
    let w = real_worker(
        "w-metered",
        &["--metrics-listen", &worker_metrics],
        dir.path(),
    )
    .await;
    let router = static_router(dir.path(), &[&w], &["--metrics-listen", &router_metrics]).await;
    let mut client = router.client().await;
    let mut tokens = 0;
    for _ in 0..10 {
        tokens += collect(&mut client, france_request(6))
            .await
            .unwrap()
            .token_ids
            .len();
    }
    let bad = tokenmesh_proto::v1::GenerateRequest {
        max_tokens: Some(0),
        ..france_request(1)
    };
    assert!(collect(&mut client, bad).await.is_err());

    let r = scrape(&router_metrics).await;
    assert_eq!(sum(&r, "llm_request_total", Some(("code", "OK"))), 10.0);
    assert_eq!(
        sum(&r, "llm_request_total", Some(("code", "INVALID_ARGUMENT"))),
        1.0
    );
    assert_eq!(sum(&r, "llm_request_errors_total", None), 1.0);
    assert_eq!(sum(&r, "llm_tokens_generated_total", None), tokens as f64);
    assert_eq!(sum(&r, "llm_active_streams", None), 0.0);
    assert_eq!(
        sum(&r, "llm_endpoint_healthy", Some(("worker", "w-metered"))),
        1.0
    );
    assert_eq!(sum(&r, "llm_time_to_first_token_seconds", None), 10.0);
    assert_eq!(sum(&r, "llm_request_duration_seconds", None), 10.0);

    let wm = scrape(&worker_metrics).await;
    assert_eq!(sum(&wm, "llm_request_total", Some(("code", "OK"))), 10.0);
    assert_eq!(sum(&wm, "llm_tokens_generated_total", None), tokens as f64);
    assert!(sum(&wm, "llm_batch_size", None) >= tokens as f64);
    assert_eq!(sum(&wm, "llm_queue_depth", None), 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_openai_http_request_continues_the_callers_trace() {
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let (receiver, endpoint) = start_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let opts = WorkerOpts {
        extra: vec![
            "--model-name".into(),
            MODEL.into(),
            "--otlp-endpoint".into(),
            endpoint.clone(),
        ],
        synthetic_tokens_per_sec: Some(500.0),
        ..WorkerOpts::new("w-http-traced")
    };
    let w = WorkerProc::start(opts, dir.path()).await.unwrap();
    let r = http_router(dir.path(), &[&w], &["--otlp-endpoint", &endpoint]).await;
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let client_span = "b7ad6b7169203331";
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":3,"stream":true}}"#
    );
    let traceparent = format!("traceparent: 00-{trace_id}-{client_span}-01");
    let (code, out, _) = curl(&[
        "-N",
        &r.url("/v1/chat/completions"),
        "-H",
        "Content-Type: application/json",
        "-H",
        &traceparent,
        "-d",
        &body,
    ]);
    assert_eq!(code, 200, "{out}");
    let spans = spans_of_trace(&receiver, trace_id, &[]).await;
    let router_gen = spans
        .iter()
        .find(|(svc, s)| svc == "tokenmesh-router" && s.name == "Generate")
        .map(|(_, s)| s)
        .expect("the router's Generate span");
    assert_eq!(hex(&router_gen.parent_span_id), client_span);
    assert_eq!(attr_str(router_gen, "api"), "openai");
    assert_eq!(attr_str(router_gen, "model"), MODEL);
    assert!(!attr_str(router_gen, "identity").is_empty());
    assert!(spans
        .iter()
        .any(|(svc, s)| svc == "tokenmesh-worker" && s.name == "Generate"));
}

/// A synthetic worker and a plaintext router over it, both with `worker`
/// and `router` flags.
async fn synthetic_mesh(
    id: &str,
    dir: &std::path::Path,
    worker: &[&str],
    router: &[&str],
) -> (WorkerProc, RouterProc) {
    let mut extra = vec!["--model-name".to_string(), MODEL.to_string()];
    extra.extend(worker.iter().map(|s| s.to_string()));
    let opts = WorkerOpts {
        extra,
        synthetic_tokens_per_sec: Some(1000.0),
        ..WorkerOpts::new(id)
    };
    let w = WorkerProc::start(opts, dir).await.unwrap();
    let r = static_router(dir, &[&w], router).await;
    (w, r)
}

/// A collector address that accepts connections and then neither reads nor
/// answers (the HTTP/2 handshake never completes); with how many
/// connections it holds.
async fn black_hole() -> (String, Arc<Mutex<Vec<tokio::net::TcpStream>>>) {
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", hole.local_addr().unwrap());
    let held = Arc::new(Mutex::new(Vec::new()));
    let holder = held.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = hole.accept().await {
            holder.lock().unwrap().push(conn);
        }
    });
    (endpoint, held)
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_do_not_wait_on_a_collector_that_never_answers() {
    // Exports start 100 ms after the first span and then hang for the
    // exporter's whole 60 s timeout, as against a collector whose host
    // black-holes them: the requests meanwhile must not wait on it.
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    std::env::set_var("OTEL_EXPORTER_OTLP_TIMEOUT", "60000");
    let (worker_hole, worker_held) = black_hole().await;
    let (router_hole, router_held) = black_hole().await;
    let dir = tempfile::tempdir().unwrap();
    let (_w, router) = synthetic_mesh(
        "w-blackhole",
        dir.path(),
        &["--otlp-endpoint", &worker_hole],
        &["--otlp-endpoint", &router_hole],
    )
    .await;
    let mut client = router.client().await;
    collect(&mut client, prompt_request("one two three", 4))
        .await
        .unwrap();
    // Both processes' exporters are now stuck in an export.
    for (who, held) in [("worker", &worker_held), ("router", &router_held)] {
        let stuck = eventually(Duration::from_secs(10), || {
            let n = held.lock().unwrap().len();
            async move { n >= 1 }
        })
        .await;
        assert!(
            stuck,
            "the {who}'s exporter never connected to its black hole"
        );
    }
    // 640 requests: the worker's four spans each are more than the
    // exporter's default queue (2,048) holds, so dropping spans past it is
    // on the path too.
    let mut clients = Vec::new();
    for _ in 0..8 {
        let mut client = router.client().await;
        clients.push(tokio::spawn(async move {
            for _ in 0..80 {
                let t = Instant::now();
                let out = collect(&mut client, prompt_request("one two three", 4))
                    .await
                    .unwrap();
                assert!(out.finished.is_some());
                assert!(
                    t.elapsed() < Duration::from_secs(5),
                    "a request waited {:?} with the export hanging",
                    t.elapsed()
                );
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sampling_ratio_of_zero_keeps_only_the_traces_callers_sampled() {
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let (receiver, endpoint) = start_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    // Only the router samples at 0; the worker's default sampler follows
    // the router's decision, which the trace context carries.
    let (_w, router) = synthetic_mesh(
        "w-ratio",
        dir.path(),
        &["--otlp-endpoint", &endpoint],
        &["--otlp-endpoint", &endpoint, "--trace-sampling-ratio", "0"],
    )
    .await;
    let mut client = router.client().await;
    let unsampled_parent = "00-11111111111111111111111111111111-2222222222222222-00";
    for i in 0..6 {
        let mut req = Request::new(prompt_request("one two three", 4));
        if i % 2 == 1 {
            let v = unsampled_parent.parse().unwrap();
            req.metadata_mut().insert("traceparent", v);
        }
        let mut stream = client.generate(req).await.unwrap().into_inner();
        while stream.message().await.unwrap().is_some() {}
    }
    // Last, a request whose caller sampled its trace.
    let trace_id = "5bf92f3577b34da6a3ce929d0e0e4737";
    let mut req = Request::new(prompt_request("one two three", 4));
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-10f067aa0ba902b7-01")
            .parse()
            .unwrap(),
    );
    let mut stream = client.generate(req).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
    // Each process exports its spans in the order they end: once the
    // sampled trace is in from both, any span of the earlier requests
    // would be too.
    let spans = spans_of_trace(&receiver, trace_id, &[]).await;
    // Without --trace-phases the router makes one span per request: its
    // routing and its call to the worker are attributes of `Generate`, whose
    // child the worker's span is.
    let router_spans: Vec<&Span> = spans
        .iter()
        .filter(|(svc, _)| svc == "tokenmesh-router")
        .map(|(_, s)| s)
        .collect();
    assert_eq!(
        router_spans
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>(),
        ["Generate"]
    );
    let router_gen = router_spans[0];
    for key in [
        "version",
        "arm",
        "worker",
        "candidates",
        "reason",
        "attempts",
    ] {
        assert!(
            !attr_str(router_gen, key).is_empty(),
            "router Generate lacks {key}"
        );
    }
    // Recorded several to a call, each value under its own name.
    assert_eq!(attr_str(router_gen, "arm"), "Stable");
    assert_eq!(attr_str(router_gen, "attempts"), "1");
    assert!(attr_str(router_gen, "candidates").contains(&attr_str(router_gen, "worker")));
    // And the worker's phases are attributes of its Generate span.
    let worker_gen = spans
        .iter()
        .find(|(svc, s)| svc == "tokenmesh-worker" && s.name == "Generate")
        .map(|(_, s)| s)
        .unwrap();
    assert_eq!(worker_gen.parent_span_id, router_gen.span_id);
    // The trace id the log lines carry is the trace's.
    for span in [router_gen, worker_gen] {
        assert_eq!(attr_str(span, "trace_id"), trace_id);
    }
    for key in ["queue_ms", "prefill_ms", "decode_ms"] {
        match attr(worker_gen, key) {
            Some(Value::DoubleValue(ms)) => assert!(*ms >= 0.0, "{key} = {ms}"),
            other => panic!("worker Generate {key}: {other:?}"),
        }
    }
    let cached = attr_str(worker_gen, "prompt_tokens_cached");
    assert!(
        cached.parse::<u32>().is_ok(),
        "prompt_tokens_cached {cached:?}"
    );
    let names: Vec<&str> = spans.iter().map(|(_, s)| s.name.as_str()).collect();
    for phase in ["queue", "prefill", "decode"] {
        assert!(
            !names.contains(&phase),
            "{phase} span without --trace-phases: {names:?}"
        );
    }
    let others: Vec<String> = receiver
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| hex(&s.trace_id) != trace_id)
        .map(|(svc, s)| format!("{svc}/{} in {}", s.name, hex(&s.trace_id)))
        .collect();
    assert!(others.is_empty(), "unsampled traces exported: {others:?}");
}

/// Threads of process `pid` that tokio's multi-threaded scheduler named.
fn runtime_worker_threads(pid: nix::unistd::Pid) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("tokio-r"))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn single_threaded_servers_stream_export_their_spans_and_stop_at_once() {
    // `--runtime-threads 1`: the single-threaded scheduler, where the trace
    // exporter's connection is driven only while the runtime's one thread is
    // not blocked, shutdown included.
    // As every test here sets it (the variable is the test process's).
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let (receiver, endpoint) = start_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--runtime-threads", "1", "--otlp-endpoint", &endpoint];
    let (mut w, mut router) = synthetic_mesh("w-one-thread", dir.path(), &flags, &flags).await;
    assert_eq!(runtime_worker_threads(router.proc.pid()), 0);
    assert_eq!(runtime_worker_threads(w.proc.pid()), 0);

    let trace_id = |i: usize| format!("0af7651916cd43dd8448eb211c8031{i:02x}");
    let mut client = router.client().await;
    let mut streams = Vec::new();
    for i in 0..8 {
        let mut req = Request::new(france_request(40));
        req.metadata_mut().insert(
            "traceparent",
            format!("00-{}-00f067aa0ba902b7-01", trace_id(i))
                .parse()
                .unwrap(),
        );
        streams.push(client.generate(req).await.unwrap().into_inner());
    }
    // Eight streams at once, each token once and in order.
    for mut s in streams {
        let mut tokens = 0;
        while let Some(m) = s.message().await.unwrap() {
            if let Some(tokenmesh_proto::v1::generate_response::Event::Delta(d)) = m.event {
                tokens += d.token_ids.len();
            }
        }
        assert_eq!(tokens, 40);
    }
    for i in [0, 7] {
        spans_of_trace(&receiver, &trace_id(i), &[]).await;
    }

    // One more request just before the stop: its spans are most likely
    // still in the exporters' batches (100 ms), which the shutdown flushes.
    let mut req = Request::new(france_request(4));
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{}-00f067aa0ba902b7-01", trace_id(8))
            .parse()
            .unwrap(),
    );
    let mut last = client.generate(req).await.unwrap().into_inner();
    while last.message().await.unwrap().is_some() {}
    let started = Instant::now();
    assert!(router.proc.terminate(Duration::from_secs(10)).success());
    assert!(w.proc.terminate(Duration::from_secs(30)).success());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "stopping took {:?}",
        started.elapsed()
    );
    spans_of_trace(&receiver, &trace_id(8), &[]).await;
}
