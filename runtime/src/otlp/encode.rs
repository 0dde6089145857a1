//! The SDK's finished spans written straight into OTLP's protobuf wire format
//! (`ExportTraceServiceRequest`, opentelemetry-proto's `trace.proto`), the
//! same bytes prost would write for the message the SDK's own exporter builds.
//!
//! Why not build that message: the SDK's exporter clones the batch, turns
//! every span into owned protobuf structs (a `String` per attribute key and
//! value), and prost then computes each nested message's length once per
//! enclosing level (a span's attribute values five times over). That came to
//! 34–58 k instructions per span on the hosts measured, about half of what
//! tracing costs a request (issue 20, BENCHMARKS.md). Here each message is
//! written once, in place, with its key and length moved in front of it
//! afterwards; the lengths of attributes, the bulk of a span, are added up
//! as they are written.
use opentelemetry::trace::{SpanId, SpanKind, Status};
use opentelemetry::{Array, InstrumentationScope, Value};
use opentelemetry_sdk::trace::SpanData;
use opentelemetry_sdk::Resource;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use std::time::{SystemTime, UNIX_EPOCH};

/// Field numbers of the OTLP messages written here.
mod tag {
    pub const REQUEST_RESOURCE_SPANS: u32 = 1;

    pub const RESOURCE_SPANS_RESOURCE: u32 = 1;
    pub const RESOURCE_SPANS_SCOPE_SPANS: u32 = 2;
    pub const RESOURCE_SPANS_SCHEMA_URL: u32 = 3;
    pub const RESOURCE_ATTRIBUTES: u32 = 1;

    pub const SCOPE_SPANS_SCOPE: u32 = 1;
    pub const SCOPE_SPANS_SPANS: u32 = 2;
    pub const SCOPE_SPANS_SCHEMA_URL: u32 = 3;
    pub const SCOPE_NAME: u32 = 1;
    pub const SCOPE_VERSION: u32 = 2;
    pub const SCOPE_ATTRIBUTES: u32 = 3;

    pub const SPAN_TRACE_ID: u32 = 1;
    pub const SPAN_SPAN_ID: u32 = 2;
    pub const SPAN_TRACE_STATE: u32 = 3;
    pub const SPAN_PARENT_SPAN_ID: u32 = 4;
    pub const SPAN_NAME: u32 = 5;
    pub const SPAN_KIND: u32 = 6;
    pub const SPAN_START: u32 = 7;
    pub const SPAN_END: u32 = 8;
    pub const SPAN_ATTRIBUTES: u32 = 9;
    pub const SPAN_DROPPED_ATTRIBUTES: u32 = 10;
    pub const SPAN_EVENTS: u32 = 11;
    pub const SPAN_DROPPED_EVENTS: u32 = 12;
    pub const SPAN_LINKS: u32 = 13;
    pub const SPAN_DROPPED_LINKS: u32 = 14;
    pub const SPAN_STATUS: u32 = 15;
    pub const SPAN_FLAGS: u32 = 16;

    pub const EVENT_TIME: u32 = 1;
    pub const EVENT_NAME: u32 = 2;
    pub const EVENT_ATTRIBUTES: u32 = 3;
    pub const EVENT_DROPPED_ATTRIBUTES: u32 = 4;

    pub const LINK_TRACE_ID: u32 = 1;
    pub const LINK_SPAN_ID: u32 = 2;
    pub const LINK_TRACE_STATE: u32 = 3;
    pub const LINK_ATTRIBUTES: u32 = 4;
    pub const LINK_DROPPED_ATTRIBUTES: u32 = 5;
    pub const LINK_FLAGS: u32 = 6;

    pub const STATUS_MESSAGE: u32 = 2;
    pub const STATUS_CODE: u32 = 3;

    pub const KEY_VALUE_KEY: u32 = 1;
    pub const KEY_VALUE_VALUE: u32 = 2;
    pub const ANY_STRING: u32 = 1;
    pub const ANY_BOOL: u32 = 2;
    pub const ANY_INT: u32 = 3;
    pub const ANY_DOUBLE: u32 = 4;
    pub const ANY_ARRAY: u32 = 5;
    pub const ARRAY_VALUES: u32 = 1;
}

/// `SpanFlags`: the W3C trace flags in the low byte, and whether the parent
/// is remote (bit 9) is known (bit 8), as the SDK's exporter sets them.
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
const FLAG_IS_REMOTE: u32 = 0x200;

/// The parts of `ResourceSpans` that are the same in every request of a
/// process: its `resource` and `schema_url` fields, encoded once.
#[derive(Clone, Debug, Default)]
pub struct EncodedResource(Vec<u8>);

impl EncodedResource {
    /// Encodes `resource` as the SDK's exporter sends it.
    pub fn new(resource: &Resource) -> Self {
        let mut out = Vec::new();
        // The SDK always sends a resource, even an empty one.
        nested(tag::RESOURCE_SPANS_RESOURCE, &mut out, |b| {
            for (k, v) in resource.iter() {
                key_value(tag::RESOURCE_ATTRIBUTES, k.as_str(), v, b);
            }
        });
        if let Some(url) = resource.schema_url() {
            string(tag::RESOURCE_SPANS_SCHEMA_URL, url, &mut out);
        }
        Self(out)
    }
}

/// Writes an `ExportTraceServiceRequest` holding `spans` under `resource`
/// into `out`: one `ResourceSpans`, one `ScopeSpans` per instrumentation
/// scope in the order the scopes first appear, as the SDK's exporter groups
/// them.
pub fn export_request(spans: &[SpanData], resource: &EncodedResource, out: &mut Vec<u8>) {
    let mut scopes: Vec<&InstrumentationScope> = Vec::new();
    for s in spans {
        if !scopes.contains(&&s.instrumentation_scope) {
            scopes.push(&s.instrumentation_scope);
        }
    }
    nested(tag::REQUEST_RESOURCE_SPANS, out, |rs| {
        rs.extend_from_slice(&resource.0);
        for sc in scopes {
            nested(tag::RESOURCE_SPANS_SCOPE_SPANS, rs, |ss| {
                nested(tag::SCOPE_SPANS_SCOPE, ss, |b| scope(sc, b));
                for s in spans.iter().filter(|s| s.instrumentation_scope == *sc) {
                    nested(tag::SCOPE_SPANS_SPANS, ss, |b| span(s, b));
                }
                if let Some(url) = sc.schema_url() {
                    string(tag::SCOPE_SPANS_SCHEMA_URL, url, ss);
                }
            });
        }
    });
}

/// An `InstrumentationScope` message body.
fn scope(s: &InstrumentationScope, out: &mut Vec<u8>) {
    string(tag::SCOPE_NAME, s.name(), out);
    string(tag::SCOPE_VERSION, s.version().unwrap_or_default(), out);
    for kv in s.attributes() {
        key_value(tag::SCOPE_ATTRIBUTES, kv.key.as_str(), &kv.value, out);
    }
}

/// A `Span` message body.
fn span(s: &SpanData, out: &mut Vec<u8>) {
    let cx = &s.span_context;
    bytes(tag::SPAN_TRACE_ID, &cx.trace_id().to_bytes(), out);
    bytes(tag::SPAN_SPAN_ID, &cx.span_id().to_bytes(), out);
    trace_state(tag::SPAN_TRACE_STATE, cx, out);
    if s.parent_span_id != SpanId::INVALID {
        bytes(tag::SPAN_PARENT_SPAN_ID, &s.parent_span_id.to_bytes(), out);
    }
    string(tag::SPAN_NAME, &s.name, out);
    uint(tag::SPAN_KIND, kind(&s.span_kind), out);
    fixed64(tag::SPAN_START, nanos(s.start_time), out);
    fixed64(tag::SPAN_END, nanos(s.end_time), out);
    for kv in &s.attributes {
        key_value(tag::SPAN_ATTRIBUTES, kv.key.as_str(), &kv.value, out);
    }
    uint(
        tag::SPAN_DROPPED_ATTRIBUTES,
        s.dropped_attributes_count.into(),
        out,
    );
    for e in &s.events.events {
        nested(tag::SPAN_EVENTS, out, |b| {
            fixed64(tag::EVENT_TIME, nanos(e.timestamp), b);
            string(tag::EVENT_NAME, &e.name, b);
            for kv in &e.attributes {
                key_value(tag::EVENT_ATTRIBUTES, kv.key.as_str(), &kv.value, b);
            }
            uint(
                tag::EVENT_DROPPED_ATTRIBUTES,
                e.dropped_attributes_count.into(),
                b,
            );
        });
    }
    uint(tag::SPAN_DROPPED_EVENTS, s.events.dropped_count.into(), out);
    for l in &s.links.links {
        let lcx = &l.span_context;
        nested(tag::SPAN_LINKS, out, |b| {
            bytes(tag::LINK_TRACE_ID, &lcx.trace_id().to_bytes(), b);
            bytes(tag::LINK_SPAN_ID, &lcx.span_id().to_bytes(), b);
            trace_state(tag::LINK_TRACE_STATE, lcx, b);
            for kv in &l.attributes {
                key_value(tag::LINK_ATTRIBUTES, kv.key.as_str(), &kv.value, b);
            }
            uint(
                tag::LINK_DROPPED_ATTRIBUTES,
                l.dropped_attributes_count.into(),
                b,
            );
            fixed32(
                tag::LINK_FLAGS,
                flags(lcx.is_remote(), lcx.trace_flags().to_u8()),
                b,
            );
        });
    }
    uint(tag::SPAN_DROPPED_LINKS, s.links.dropped_count.into(), out);
    // Always present, as the SDK's exporter sends it.
    let (code, text) = match &s.status {
        Status::Unset => (0, ""),
        Status::Ok => (1, ""),
        Status::Error { description } => (2, description.as_ref()),
    };
    nested(tag::SPAN_STATUS, out, |b| {
        string(tag::STATUS_MESSAGE, text, b);
        uint(tag::STATUS_CODE, code, b);
    });
    fixed32(
        tag::SPAN_FLAGS,
        flags(s.parent_span_is_remote, cx.trace_flags().to_u8()),
        out,
    );
}

fn flags(remote: bool, trace_flags: u8) -> u32 {
    let mut f = u32::from(trace_flags) | FLAG_HAS_IS_REMOTE;
    if remote {
        f |= FLAG_IS_REMOTE;
    }
    f
}

/// `Span.SpanKind` as numbered in trace.proto.
fn kind(k: &SpanKind) -> u64 {
    match k {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn trace_state(tag: u32, cx: &opentelemetry::trace::SpanContext, out: &mut Vec<u8>) {
    let state = cx.trace_state();
    // `header` allocates; most spans carry no trace state.
    if *state != opentelemetry::trace::TraceState::NONE {
        string(tag, &state.header(), out);
    }
}

/// A scalar an `AnyValue` holds (an attribute's value or an array element).
#[derive(Clone, Copy)]
enum Scalar<'a> {
    Bool(bool),
    Int(i64),
    Double(f64),
    Str(&'a str),
}

impl Scalar<'_> {
    /// Length of the `AnyValue` message body holding it.
    fn any_len(self) -> usize {
        match self {
            Scalar::Bool(_) => 2,
            Scalar::Int(i) => 1 + encoded_len_varint(i as u64),
            Scalar::Double(_) => 9,
            // A oneof member is written even when empty.
            Scalar::Str(s) => 1 + encoded_len_varint(s.len() as u64) + s.len(),
        }
    }

    fn write_any(self, out: &mut Vec<u8>) {
        match self {
            Scalar::Bool(b) => {
                encode_key(tag::ANY_BOOL, WireType::Varint, out);
                encode_varint(u64::from(b), out);
            }
            Scalar::Int(i) => {
                encode_key(tag::ANY_INT, WireType::Varint, out);
                encode_varint(i as u64, out);
            }
            Scalar::Double(d) => {
                encode_key(tag::ANY_DOUBLE, WireType::SixtyFourBit, out);
                out.extend_from_slice(&d.to_le_bytes());
            }
            Scalar::Str(s) => {
                length_prefix(tag::ANY_STRING, s.len(), out);
                out.extend_from_slice(s.as_bytes());
            }
        }
    }
}

/// The elements of an array value, as scalars.
fn elements(a: &Array) -> Box<dyn Iterator<Item = Scalar<'_>> + '_> {
    match a {
        Array::Bool(v) => Box::new(v.iter().map(|&b| Scalar::Bool(b))),
        Array::I64(v) => Box::new(v.iter().map(|&i| Scalar::Int(i))),
        Array::F64(v) => Box::new(v.iter().map(|&d| Scalar::Double(d))),
        Array::String(v) => Box::new(v.iter().map(|s| Scalar::Str(s.as_str()))),
        // `Array` is non-exhaustive; a kind added later is sent empty.
        _ => Box::new(std::iter::empty()),
    }
}

fn scalar(v: &Value) -> Option<Scalar<'_>> {
    Some(match v {
        Value::Bool(b) => Scalar::Bool(*b),
        Value::I64(i) => Scalar::Int(*i),
        Value::F64(d) => Scalar::Double(*d),
        Value::String(s) => Scalar::Str(s.as_str()),
        _ => return None,
    })
}

/// Length of an `ArrayValue` message body.
fn array_len(a: &Array) -> usize {
    elements(a)
        .map(|e| field_len(tag::ARRAY_VALUES, e.any_len()))
        .sum()
}

/// Length of the `AnyValue` message body holding `v`.
fn any_len(v: &Value) -> usize {
    match v {
        Value::Array(a) => field_len(tag::ANY_ARRAY, array_len(a)),
        _ => scalar(v).map_or(0, Scalar::any_len),
    }
}

fn write_any(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Array(a) => {
            length_prefix(tag::ANY_ARRAY, array_len(a), out);
            for e in elements(a) {
                length_prefix(tag::ARRAY_VALUES, e.any_len(), out);
                e.write_any(out);
            }
        }
        _ => {
            if let Some(s) = scalar(v) {
                s.write_any(out);
            }
        }
    }
}

/// Length of a `KeyValue` message body.
fn key_value_len(key: &str, v: &Value) -> usize {
    string_len(tag::KEY_VALUE_KEY, key) + field_len(tag::KEY_VALUE_VALUE, any_len(v))
}

/// A `KeyValue` field numbered `tag`.
fn key_value(tag: u32, key: &str, v: &Value, out: &mut Vec<u8>) {
    length_prefix(tag, key_value_len(key, v), out);
    string(tag::KEY_VALUE_KEY, key, out);
    length_prefix(tag::KEY_VALUE_VALUE, any_len(v), out);
    write_any(v, out);
}

/// Length of a length-delimited field whose body is `len` bytes.
fn field_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

fn length_prefix(tag: u32, len: usize, out: &mut Vec<u8>) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(len as u64, out);
}

/// A message field whose body `write` appends to `out`: the body is written
/// in place and its key and length moved in front of it (a few bytes rotated
/// past it), so nothing is measured twice. Attributes, the bulk of a span,
/// have their small lengths added up instead ([`key_value`]).
fn nested(tag: u32, out: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    write(out);
    let len = out.len() - start;
    length_prefix(tag, len, out);
    let prefix = out.len() - start - len;
    out[start..].rotate_right(prefix);
}

// Scalar fields are left out at their default value, as proto3 (and prost)
// leaves them out.

fn bytes(tag: u32, b: &[u8], out: &mut Vec<u8>) {
    if !b.is_empty() {
        length_prefix(tag, b.len(), out);
        out.extend_from_slice(b);
    }
}

fn string(tag: u32, s: &str, out: &mut Vec<u8>) {
    bytes(tag, s.as_bytes(), out);
}

fn string_len(tag: u32, s: &str) -> usize {
    if s.is_empty() {
        0
    } else {
        field_len(tag, s.len())
    }
}

fn uint(tag: u32, v: u64, out: &mut Vec<u8>) {
    if v != 0 {
        encode_key(tag, WireType::Varint, out);
        encode_varint(v, out);
    }
}

fn fixed64(tag: u32, v: u64, out: &mut Vec<u8>) {
    if v != 0 {
        encode_key(tag, WireType::SixtyFourBit, out);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn fixed32(tag: u32, v: u32, out: &mut Vec<u8>) {
    if v != 0 {
        encode_key(tag, WireType::ThirtyTwoBit, out);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, TraceFlags, TraceId, TraceState};
    use opentelemetry::{Key, KeyValue, StringValue};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use prost::Message;
    use std::borrow::Cow;
    use std::time::Duration;

    fn cx(trace: u128, span: u64, sampled: bool, remote: bool, state: &str) -> SpanContext {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let state = if state.is_empty() {
            TraceState::NONE
        } else {
            state.parse().unwrap()
        };
        SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            flags,
            remote,
            state,
        )
    }

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(1_765_000_000_000 + ms)
    }

    /// Spans that use every part of the message the mesh can produce, and
    /// the edge cases of each: empty and absent values, every value type,
    /// zeros, negative and large numbers, events, links, each status.
    fn spans() -> Vec<SpanData> {
        let a = InstrumentationScope::builder("tokenmesh-router").build();
        let b = InstrumentationScope::builder("other")
            .with_version("1.2.3")
            .with_schema_url("https://opentelemetry.io/schemas/1.26.0")
            .with_attributes([KeyValue::new("scope.attr", 7)])
            .build();
        let every_value = vec![
            KeyValue::new("api", "grpc"),
            KeyValue::new("empty", ""),
            KeyValue::new("yes", true),
            KeyValue::new("no", false),
            KeyValue::new("zero", 0i64),
            KeyValue::new("negative", -42i64),
            KeyValue::new("big", i64::MAX),
            KeyValue::new("ms", 12.5f64),
            KeyValue::new("nought", 0.0f64),
            KeyValue::new("unicode", "prompt «ünïcødé» ✓"),
            KeyValue::new("long", "x".repeat(300)),
            KeyValue::new(
                Key::from_static_str("bools"),
                Value::Array(Array::Bool(vec![true, false])),
            ),
            KeyValue::new(
                Key::from_static_str("ints"),
                Value::Array(Array::I64(vec![0, -1, 1 << 40])),
            ),
            KeyValue::new(
                Key::from_static_str("doubles"),
                Value::Array(Array::F64(vec![1.5, -0.25])),
            ),
            KeyValue::new(
                Key::from_static_str("strings"),
                Value::Array(Array::String(vec![StringValue::from("a"), "".into()])),
            ),
            KeyValue::new(
                Key::from_static_str("none"),
                Value::Array(Array::I64(vec![])),
            ),
        ];
        let base = SpanData {
            span_context: cx(
                0x0af7651916cd43dd8448eb211c80319c,
                0xb7ad6b7169203331,
                true,
                false,
                "",
            ),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Server,
            name: Cow::Borrowed("Generate"),
            start_time: at(0),
            end_time: at(35),
            attributes: every_value,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: a.clone(),
        };
        let mut child = base.clone();
        child.span_context = cx(
            0x0af7651916cd43dd8448eb211c80319c,
            1,
            true,
            false,
            "k=v,vendor=x1",
        );
        child.parent_span_id = SpanId::from(0xb7ad6b7169203331);
        child.parent_span_is_remote = true;
        child.span_kind = SpanKind::Client;
        child.name = Cow::Owned("tokenmesh.v1.Worker/Generate".into());
        child.attributes = vec![KeyValue::new("worker", "w-1")];
        child.dropped_attributes_count = 3;
        let mut events = SpanEvents::default();
        events.events.push(opentelemetry::trace::Event::new(
            "first token",
            at(7),
            vec![KeyValue::new("tokens", 1i64)],
            2,
        ));
        events
            .events
            .push(opentelemetry::trace::Event::new("", at(9), vec![], 0));
        events.dropped_count = 5;
        child.events = events;
        let mut links = SpanLinks::default();
        links.links.push(opentelemetry::trace::Link::new(
            cx(9, 10, false, true, "a=b"),
            vec![KeyValue::new("link.kind", "failover")],
            1,
        ));
        links.links.push(opentelemetry::trace::Link::new(
            cx(11, 12, true, false, ""),
            vec![],
            0,
        ));
        links.dropped_count = 1;
        child.links = links;
        child.status = Status::error("worker w-1 went away mid-stream");
        let mut ok = base.clone();
        ok.span_context = cx(3, 4, false, false, "");
        ok.attributes = vec![];
        ok.span_kind = SpanKind::Internal;
        ok.status = Status::Ok;
        ok.instrumentation_scope = b;
        let mut producer = ok.clone();
        producer.span_kind = SpanKind::Producer;
        producer.name = Cow::Borrowed("");
        let mut consumer = base.clone();
        consumer.span_kind = SpanKind::Consumer;
        vec![base, child, ok, producer, consumer]
    }

    /// What the SDK's own exporter would send for `spans`.
    fn reference(spans: Vec<SpanData>, resource: &Resource) -> ExportTraceServiceRequest {
        let r = ResourceAttributesWithSchema::from(resource);
        ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(spans, &r),
        }
    }

    fn ours(spans: &[SpanData], resource: &Resource) -> Vec<u8> {
        let mut out = Vec::new();
        export_request(spans, &EncodedResource::new(resource), &mut out);
        out
    }

    #[test]
    fn the_bytes_are_the_message_the_sdk_s_exporter_sends() {
        let resource = Resource::builder()
            .with_service_name("tokenmesh-router")
            .with_attribute(KeyValue::new("host.name", "mesh-1"))
            .build();
        let spans = spans();
        let bytes = ours(&spans, &resource);
        let expected = reference(spans, &resource);
        let decoded = ExportTraceServiceRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(decoded, expected);
        // Byte for byte too: fields are written in prost's order (by field
        // number), and left out where prost leaves them out.
        assert_eq!(bytes, expected.encode_to_vec());
    }

    #[test]
    fn a_schema_url_on_the_resource_and_an_empty_batch() {
        let resource = Resource::builder_empty()
            .with_schema_url([KeyValue::new("service.name", "w")], "https://s/1.0")
            .build();
        let bytes = ours(&[], &resource);
        let decoded = ExportTraceServiceRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(decoded, reference(vec![], &resource));
        let bytes = ours(&spans()[..1], &Resource::builder_empty().build());
        let decoded = ExportTraceServiceRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(
            decoded,
            reference(spans()[..1].to_vec(), &Resource::builder_empty().build())
        );
    }
}
