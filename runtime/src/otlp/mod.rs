//! The OTLP/gRPC span exporter behind `--otlp-endpoint`: the SDK's batch
//! processor hands it finished spans, [`encode`] writes them as one
//! `ExportTraceServiceRequest`, and it sends that to the collector's
//! `TraceService/Export`.
//!
//! It does what the SDK's tonic exporter did (plaintext gRPC, the
//! `OTEL_EXPORTER_OTLP_HEADERS` headers, a time limit per attempt, the OTLP
//! specification's retryable codes retried with backoff while the export is
//! younger than that limit, a partial success logged) at a fraction of the
//! work per span (issue 20).
pub mod encode;

use crate::backoff::Backoff;
use bytes::{BufMut, Bytes};
use encode::EncodedResource;
use http::uri::PathAndQuery;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};
use tonic_prost::{ProstCodec, ProstDecoder};

/// The collector's method.
const EXPORT: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// Retries after the first attempt, and their backoff: the SDK exporter's
/// recommended policy.
const RETRIES: u32 = 3;
const BACKOFF: Backoff = Backoff {
    base: Duration::from_millis(100),
    max: Duration::from_millis(1600),
};

/// Why the exporter could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    #[error("endpoint {endpoint:?}: {message}")]
    Endpoint { endpoint: String, message: String },
}

/// One `key=value` of `OTEL_EXPORTER_OTLP_HEADERS`, the value
/// percent-decoded as the OpenTelemetry specification has it.
#[derive(Clone, Debug)]
pub struct Header {
    key: MetadataKey<tonic::metadata::Ascii>,
    value: MetadataValue<tonic::metadata::Ascii>,
}

impl std::str::FromStr for Header {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (k, v) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?} is not key=value, e.g. authorization=Bearer%20abc"))?;
        let key = MetadataKey::from_bytes(k.trim().to_ascii_lowercase().as_bytes())
            .map_err(|_| format!("{k:?} is not a valid header name"))?;
        let decoded = percent_encoding::percent_decode_str(v.trim())
            .decode_utf8()
            .map_err(|_| format!("the value of {k:?} is not UTF-8 once percent-decoded"))?;
        let value = MetadataValue::try_from(decoded.as_ref()).map_err(|_| {
            format!("the value of {k:?} holds characters a header value cannot carry")
        })?;
        Ok(Self { key, value })
    }
}

/// `OTEL_EXPORTER_OTLP_HEADERS`: comma-separated [`Header`]s; empty items
/// (an empty variable, a trailing comma) are skipped.
#[derive(Clone, Debug, Default)]
pub struct Headers(pub Vec<Header>);

impl std::str::FromStr for Headers {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.split(',')
            .filter(|h| !h.trim().is_empty())
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

/// Sends spans to an OTLP/gRPC collector.
#[derive(Debug)]
pub struct OtlpExporter {
    channel: Channel,
    headers: MetadataMap,
    timeout: Duration,
    resource: EncodedResource,
    shut_down: AtomicBool,
}

impl OtlpExporter {
    /// An exporter towards `endpoint` (`http://host:4317`), connecting on
    /// first use. Call inside the tokio runtime, which drives the
    /// connection.
    pub fn new<'a>(
        endpoint: &str,
        headers: impl IntoIterator<Item = &'a Header>,
        timeout: Duration,
    ) -> Result<Self, OtlpError> {
        let bad = |message: String| OtlpError::Endpoint {
            endpoint: endpoint.to_string(),
            message,
        };
        let ep = Endpoint::from_shared(endpoint.to_string())
            .map_err(|e| bad(format!("{e}; give a URL such as http://collector:4317")))?;
        match ep.uri().scheme_str() {
            Some("http") => {}
            Some("https") => return Err(bad(
                "TLS towards the collector is not supported; use http:// (a sidecar collector, \
                     or one on a trusted network)"
                    .into(),
            )),
            _ => return Err(bad("give a URL such as http://collector:4317".into())),
        }
        let mut md = MetadataMap::new();
        for h in headers {
            md.insert(h.key.clone(), h.value.clone());
        }
        Ok(Self {
            channel: ep.timeout(timeout).connect_lazy(),
            headers: md,
            timeout,
            resource: EncodedResource::default(),
            shut_down: AtomicBool::new(false),
        })
    }

    /// One attempt.
    async fn send(
        &self,
        body: Bytes,
        left: Duration,
    ) -> Result<ExportTraceServiceResponse, Status> {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("collector connection: {e}")))?;
        let mut req = Request::new(body);
        *req.metadata_mut() = self.headers.clone();
        req.set_timeout(left);
        grpc.unary(req, PathAndQuery::from_static(EXPORT), ExportCodec)
            .await
            .map(tonic::Response::into_inner)
    }
}

/// The codes the OTLP specification says to retry.
fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::OutOfRange
            | Code::Unavailable
            | Code::DataLoss
    )
}

/// Waits between attempts. The batch processor drives `export` on a thread
/// of its own with no tokio runtime, where blocking is how to wait.
async fn pause(d: Duration) {
    if tokio::runtime::Handle::try_current().is_ok() {
        tokio::time::sleep(d).await;
    } else {
        std::thread::sleep(d);
    }
}

impl SpanExporter for OtlpExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        if self.shut_down.load(Ordering::Relaxed) {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        let mut buf = Vec::with_capacity(batch.len() * 768 + 256);
        encode::export_request(&batch, &self.resource, &mut buf);
        drop(batch);
        let body = Bytes::from(buf);
        let start = Instant::now();
        let mut retries = BACKOFF.retries();
        let mut attempt = 0;
        loop {
            let left = self.timeout.saturating_sub(start.elapsed());
            let status = match self.send(body.clone(), left).await {
                Ok(resp) => {
                    if let Some(p) = resp.partial_success {
                        if p.rejected_spans > 0 || !p.error_message.is_empty() {
                            tracing::warn!(
                                rejected_spans = p.rejected_spans,
                                message = %p.error_message,
                                "the trace collector rejected part of an export"
                            );
                        }
                    }
                    return Ok(());
                }
                Err(status) => status,
            };
            attempt += 1;
            let wait = retries.next_delay();
            if attempt > RETRIES
                || !retryable(status.code())
                || start.elapsed() + wait >= self.timeout
            {
                // The collector's message may echo credentials: the code only.
                return Err(OTelSdkError::InternalFailure(format!(
                    "OTLP export failed after {attempt} attempt(s): {:?}",
                    status.code()
                )));
            }
            pause(wait).await;
        }
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        if self.shut_down.swap(true, Ordering::Relaxed) {
            Err(OTelSdkError::AlreadyShutdown)
        } else {
            Ok(())
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = EncodedResource::new(resource);
    }
}

/// Sends an encoded request as it is and reads the response with prost.
#[derive(Debug, Clone, Copy)]
struct ExportCodec;

impl Codec for ExportCodec {
    type Encode = Bytes;
    type Decode = ExportTraceServiceResponse;
    type Encoder = BytesEncoder;
    type Decoder = ProstDecoder<ExportTraceServiceResponse>;

    fn encoder(&mut self) -> Self::Encoder {
        BytesEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<ExportTraceServiceResponse, ExportTraceServiceResponse>::default().decoder()
    }
}

/// Writes bytes that already are an encoded message.
#[derive(Debug, Clone, Copy)]
struct BytesEncoder;

impl Encoder for BytesEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
