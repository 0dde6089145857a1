//! W3C Trace Context (`traceparent`, `tracestate`) in gRPC metadata, read
//! and written without the SDK's propagator, and a trace id as the hex of
//! log lines.
//!
//! The SDK's propagator formats the header with `format!` and zero padding,
//! inserts it through a key parsed at every call and always sends a
//! `tracestate`, empty or not (about 5 k instructions per request on the
//! router); it reads one by splitting it into a vector and parsing each part
//! as an integer (about 4 k on the worker). Here the 55 bytes are written
//! from a table under a static key, an empty `tracestate` is left out, as
//! the spec allows, and a header is read in place. Reading follows the spec
//! where the SDK is laxer: ids of exactly 32 and 16 lowercase hex digits.
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
use std::str::FromStr;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Writes `bytes` as lowercase hex into `out`, which holds twice as many.
fn hex_into(out: &mut [u8], bytes: &[u8]) {
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = HEX[usize::from(b >> 4)];
        pair[1] = HEX[usize::from(b & 0xf)];
    }
}

/// A trace id's 32 lowercase hex digits, as its `Display` writes them.
pub struct TraceIdHex([u8; 32]);

impl TraceIdHex {
    /// The hex of `id`.
    pub fn new(id: TraceId) -> Self {
        let mut out = [0; 32];
        hex_into(&mut out, &id.to_bytes());
        Self(out)
    }

    /// The digits.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

/// The `traceparent` value of `cx`, version 00: `00-{trace id}-{span id}-{flags}`,
/// with only the sampled flag passed on, as the SDK's propagator does.
fn traceparent(cx: &SpanContext) -> [u8; 55] {
    let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
    hex_into(&mut out[3..35], &cx.trace_id().to_bytes());
    hex_into(&mut out[36..52], &cx.span_id().to_bytes());
    hex_into(
        &mut out[53..55],
        &[(cx.trace_flags() & TraceFlags::SAMPLED).to_u8()],
    );
    out
}

/// Writes `cx` into outgoing metadata (nothing when it is invalid).
pub fn write(cx: &SpanContext, md: &mut MetadataMap) {
    if !cx.is_valid() {
        return;
    }
    if let Ok(v) = MetadataValue::try_from(&traceparent(cx)[..]) {
        md.insert(MetadataKey::from_static("traceparent"), v);
    }
    let state = cx.trace_state().header();
    if state.is_empty() {
        return;
    }
    if let Ok(v) = MetadataValue::try_from(state.as_str()) {
        md.insert(MetadataKey::from_static("tracestate"), v);
    }
}

/// The value of one lowercase hex digit.
fn digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// The `N` bytes that `2 * N` lowercase hex digits spell.
fn bytes<const N: usize>(hex: &[u8]) -> Option<[u8; N]> {
    let mut out = [0; N];
    if hex.len() != 2 * N {
        return None;
    }
    for (b, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        *b = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// The caller's trace context in incoming metadata, as a remote span
/// context; none when `traceparent` is absent or invalid (then the spec
/// says to start a new trace). A version above 00 is read for the fields
/// version 00 defines, as the spec asks; `ff` is invalid. An invalid
/// `tracestate` is dropped, as the SDK does.
pub fn read(md: &MetadataMap) -> Option<SpanContext> {
    let v = md.get("traceparent")?.to_str().ok()?.trim().as_bytes();
    let [version] = bytes::<1>(v.get(..2)?)?;
    let rest_ok = match version {
        0xff => false,
        0 => v.len() == 55,
        _ => v.len() == 55 || v.get(55) == Some(&b'-'),
    };
    if !rest_ok || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let trace_id = TraceId::from_bytes(bytes(&v[3..35])?);
    let span_id = SpanId::from_bytes(bytes(&v[36..52])?);
    let [flags] = bytes::<1>(&v[53..55])?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let state = md
        .get("tracestate")
        .and_then(|s| s.to_str().ok())
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    let flags = TraceFlags::new(flags) & TraceFlags::SAMPLED;
    Some(SpanContext::new(trace_id, span_id, flags, true, state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::propagation::{Injector, TextMapPropagator};
    use opentelemetry::trace::{SpanId, TraceContextExt, TraceState};
    use opentelemetry::Context;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use std::collections::HashMap;
    use std::str::FromStr;

    #[derive(Default)]
    struct Map(HashMap<String, String>);

    impl Injector for Map {
        fn set(&mut self, key: &str, value: String) {
            self.0.insert(key.into(), value);
        }
    }

    /// What the SDK's propagator writes for `cx`.
    fn sdk(cx: &SpanContext) -> HashMap<String, String> {
        let mut map = Map::default();
        let cx = Context::new().with_remote_span_context(cx.clone());
        TraceContextPropagator::new().inject_context(&cx, &mut map);
        map.0
    }

    fn ours(cx: &SpanContext) -> HashMap<String, String> {
        let mut md = MetadataMap::new();
        write(cx, &mut md);
        md.into_headers()
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string()))
            .collect()
    }

    #[test]
    fn the_headers_are_the_sdk_propagator_s_without_an_empty_tracestate() {
        let ids = [
            (1, 1),
            (u128::MAX, u64::MAX),
            (0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331),
            (0x00000000000000000000000000000a0b, 0x0000000000000c0d),
        ];
        let states = [
            TraceState::default(),
            TraceState::from_str("vendor=abc,other=x-1").unwrap(),
        ];
        for (trace, span) in ids {
            for flags in [0x00, 0x01, 0xff] {
                for state in &states {
                    let cx = SpanContext::new(
                        TraceId::from(trace),
                        SpanId::from(span),
                        TraceFlags::new(flags),
                        false,
                        state.clone(),
                    );
                    let mut want = sdk(&cx);
                    want.retain(|_, v| !v.is_empty());
                    assert_eq!(ours(&cx), want, "{trace:x} {span:x} {flags:x} {state:?}");
                }
            }
        }
        assert!(ours(&SpanContext::empty_context()).is_empty());
    }

    /// Incoming metadata with these `traceparent` and `tracestate` values.
    fn incoming(parent: &str, state: Option<&str>) -> MetadataMap {
        let mut md = MetadataMap::new();
        md.insert("traceparent", parent.parse().unwrap());
        if let Some(s) = state {
            md.insert("tracestate", s.parse().unwrap());
        }
        md
    }

    /// What the SDK's propagator reads from `md`, `None` where it starts a
    /// new trace.
    fn sdk_read(md: &MetadataMap) -> Option<SpanContext> {
        struct Headers<'a>(&'a MetadataMap);
        impl opentelemetry::propagation::Extractor for Headers<'_> {
            fn get(&self, key: &str) -> Option<&str> {
                self.0.get(key).and_then(|v| v.to_str().ok())
            }
            fn keys(&self) -> Vec<&str> {
                vec![]
            }
        }
        let cx = TraceContextPropagator::new().extract(&Headers(md));
        let sc = cx.span().span_context().clone();
        sc.is_valid().then_some(sc)
    }

    #[test]
    fn reading_agrees_with_the_sdk_s_propagator_on_what_the_spec_allows() {
        let id = "0af7651916cd43dd8448eb211c80319c";
        let parents = [
            format!("00-{id}-b7ad6b7169203331-01"),
            format!("00-{id}-b7ad6b7169203331-00"),
            format!("00-{id}-b7ad6b7169203331-ff"),
            format!(" 00-{id}-b7ad6b7169203331-01 "),
            format!("01-{id}-b7ad6b7169203331-01"),
            format!("01-{id}-b7ad6b7169203331-01-what-comes-later"),
            format!("ff-{id}-b7ad6b7169203331-01"),
            format!("00-{id}-b7ad6b7169203331-01-extra"),
            format!("00-{}-b7ad6b7169203331-01", "0".repeat(32)),
            format!("00-{id}-0000000000000000-01"),
            format!("00-{}-b7ad6b7169203331-01", id.to_uppercase()),
            format!("00-{id}-B7AD6B7169203331-01"),
            format!("00-{id}-b7ad6b7169203331-0A"),
            format!("00-{id}-b7ad6b7169203331-0g"),
            format!("00-{id}-b7ad6b7169203331"),
            format!("00_{id}_b7ad6b7169203331_01"),
            "".to_string(),
            "garbage".to_string(),
        ];
        let states = [
            None,
            Some("vendor=abc,other=x-1"),
            Some("not a state"),
            Some(""),
        ];
        for parent in &parents {
            for state in states {
                let md = incoming(parent, state);
                assert_eq!(read(&md), sdk_read(&md), "{parent:?} {state:?}");
            }
        }
        assert_eq!(read(&MetadataMap::new()), None);
    }

    #[test]
    fn ids_of_the_wrong_length_are_refused_where_the_sdk_pads_them() {
        // The spec fixes the lengths; the SDK parses the parts as integers.
        for parent in [
            "00-abc-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad-01",
            "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
        ] {
            let md = incoming(parent, None);
            assert!(sdk_read(&md).is_some(), "the SDK takes {parent}");
            assert_eq!(read(&md), None, "{parent}");
        }
    }

    #[test]
    fn what_is_written_is_read_back() {
        let cx = SpanContext::new(
            TraceId::from(0x0af7651916cd43dd8448eb211c80319c),
            SpanId::from(0xb7ad6b7169203331),
            TraceFlags::SAMPLED,
            true,
            TraceState::from_str("a=1").unwrap(),
        );
        let mut md = MetadataMap::new();
        write(&cx, &mut md);
        assert_eq!(read(&md), Some(cx));
    }

    #[test]
    fn a_trace_id_s_hex_is_its_display() {
        for id in [1, u128::MAX, 0x0af7651916cd43dd8448eb211c80319c] {
            let id = TraceId::from(id);
            assert_eq!(TraceIdHex::new(id).as_str(), id.to_string());
        }
    }
}
