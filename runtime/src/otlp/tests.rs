use super::*;
use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status as SpanStatus, TraceFlags};
use opentelemetry::trace::{TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

/// A collector that records what it gets and answers with the codes it is
/// given, then OK.
#[derive(Clone, Default)]
struct Collector {
    got: Arc<Mutex<Vec<(MetadataMap, ExportTraceServiceRequest)>>>,
    fail_with: Arc<Mutex<Vec<Code>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, Status> {
        let md = request.metadata().clone();
        self.got.lock().unwrap().push((md, request.into_inner()));
        if let Some(code) = self.fail_with.lock().unwrap().pop() {
            return Err(Status::new(code, "told to fail"));
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// Serves `c` on an ephemeral loopback port until the test ends.
async fn serve(c: Collector) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(c))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    format!("http://{addr}")
}

fn span(name: &'static str) -> SpanData {
    let now = SystemTime::now();
    SpanData {
        span_context: SpanContext::new(
            TraceId::from(7u128),
            SpanId::from(9u64),
            TraceFlags::SAMPLED,
            false,
            TraceState::NONE,
        ),
        parent_span_id: SpanId::INVALID,
        parent_span_is_remote: false,
        span_kind: SpanKind::Server,
        name: Cow::Borrowed(name),
        start_time: now,
        end_time: now,
        attributes: vec![KeyValue::new("model", "smollm2")],
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: SpanStatus::Unset,
        instrumentation_scope: InstrumentationScope::builder("tokenmesh-test").build(),
    }
}

fn header(s: &str) -> Header {
    s.parse().unwrap()
}

#[tokio::test]
async fn spans_resource_and_headers_reach_the_collector() {
    let c = Collector::default();
    let endpoint = serve(c.clone()).await;
    let mut exporter = OtlpExporter::new(
        &endpoint,
        &[
            header("Authorization=Bearer%20abc"),
            header("x-tenant=mesh"),
        ],
        Duration::from_secs(10),
    )
    .unwrap();
    exporter.set_resource(
        &Resource::builder()
            .with_service_name("tokenmesh-worker")
            .build(),
    );
    exporter
        .export(vec![span("Generate"), span("queue")])
        .await
        .unwrap();

    let got = c.got.lock().unwrap();
    assert_eq!(got.len(), 1);
    let (md, req) = &got[0];
    assert_eq!(md.get("authorization").unwrap(), "Bearer abc");
    assert_eq!(md.get("x-tenant").unwrap(), "mesh");
    let rs = &req.resource_spans[0];
    let service = rs
        .resource
        .as_ref()
        .unwrap()
        .attributes
        .iter()
        .find(|kv| kv.key == "service.name");
    assert!(
        format!("{service:?}").contains("tokenmesh-worker"),
        "{service:?}"
    );
    let names: Vec<_> = rs.scope_spans[0]
        .spans
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(names, ["Generate", "queue"]);
    assert_eq!(
        rs.scope_spans[0].scope.as_ref().unwrap().name,
        "tokenmesh-test"
    );
}

#[tokio::test]
async fn unavailable_is_retried_and_a_rejected_request_is_not() {
    let c = Collector::default();
    let endpoint = serve(c.clone()).await;
    let exporter = OtlpExporter::new(&endpoint, &[], Duration::from_secs(10)).unwrap();

    *c.fail_with.lock().unwrap() = vec![Code::Unavailable];
    exporter.export(vec![span("Generate")]).await.unwrap();
    assert_eq!(
        c.got.lock().unwrap().len(),
        2,
        "one failed attempt, one retry"
    );

    c.got.lock().unwrap().clear();
    *c.fail_with.lock().unwrap() = vec![Code::InvalidArgument];
    let err = exporter.export(vec![span("Generate")]).await.unwrap_err();
    assert_eq!(c.got.lock().unwrap().len(), 1, "not retried");
    assert!(err.to_string().contains("InvalidArgument"), "{err}");

    // Four attempts at most: the first and three retries.
    c.got.lock().unwrap().clear();
    *c.fail_with.lock().unwrap() = vec![Code::Unavailable; 6];
    exporter.export(vec![span("Generate")]).await.unwrap_err();
    assert_eq!(c.got.lock().unwrap().len(), 4);
}

#[tokio::test]
async fn a_shut_down_exporter_sends_nothing() {
    let c = Collector::default();
    let endpoint = serve(c.clone()).await;
    let exporter = OtlpExporter::new(&endpoint, &[], Duration::from_secs(10)).unwrap();
    exporter.shutdown().unwrap();
    assert!(exporter.export(vec![span("Generate")]).await.is_err());
    assert!(c.got.lock().unwrap().is_empty());
}

#[tokio::test]
async fn endpoints_other_than_plain_http_are_refused_with_what_to_give() {
    let err = OtlpExporter::new("https://collector:4317", &[], Duration::from_secs(1)).unwrap_err();
    assert!(err.to_string().contains("use http://"), "{err}");
    let err = OtlpExporter::new("collector:4317", &[], Duration::from_secs(1)).unwrap_err();
    assert!(err.to_string().contains("http://collector:4317"), "{err}");
}

#[test]
fn headers_are_key_value_pairs_with_percent_decoded_values() {
    let h = header(" Authorization = Basic%20dXNlcjpwYXNz ");
    assert_eq!(h.key.as_str(), "authorization");
    assert_eq!(h.value, "Basic dXNlcjpwYXNz");
    assert_eq!(header("k=a=b").value, "a=b");
    for bad in ["novalue", "bad key=v", "k=%0a"] {
        assert!(bad.parse::<Header>().is_err(), "{bad}");
    }
    let list: Headers = "a=1, b=2,".parse().unwrap();
    assert_eq!(list.0.len(), 2);
    assert!("".parse::<Headers>().unwrap().0.is_empty());
    assert!("a=1,novalue".parse::<Headers>().is_err());
}
