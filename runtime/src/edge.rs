//! Statuses at the transport edge. tonic answers a request it cannot decode
//! before any handler runs: INTERNAL for a message that is not the method's
//! protobuf (garbage, invalid UTF-8 in a string, a truncated message, a body
//! that ends inside a frame), OUT_OF_RANGE for one over the size limit. Both
//! are the caller's doing, so [`layer`] rewrites them, on every server, to
//! INVALID_ARGUMENT and to RESOURCE_EXHAUSTED naming the limit (the gRPC
//! convention for a message too large).
//!
//! tonic sends these refusals as trailers-only responses (the status in the
//! headers, no message); so does a handler's own error, which is told apart
//! by tonic's and prost's fixed texts (the edge tests in tests/tests/edge.rs
//! pin them, so an upgrade that changes one fails there). A response that
//! streams carries its status in the trailers and is not looked at.
use tonic::body::Body;
use tonic::{Code, Status};
use tower::util::MapResponseLayer;

/// The largest request message the router and the control plane accept
/// (tonic's default, stated explicitly so the limit and its refusal agree).
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// The largest request message a worker accepts: a client's request as the
/// router forwards it plus the token ids already delivered when a stream
/// continues after a failover, with room to spare.
pub const MAX_WORKER_REQUEST_BYTES: usize = 2 * MAX_REQUEST_BYTES;

/// What tonic and prost say when a request does not decode.
const UNDECODABLE: &[&str] = &[
    // prost's DecodeError (garbage, invalid UTF-8, a truncated message).
    "failed to decode Protobuf message",
    // The body ended inside a gRPC frame.
    "Unexpected EOF decoding stream.",
    // A unary or server-streaming call without a message.
    "Missing request message.",
    // The frame's first byte is neither 0 nor 1.
    "protocol error: received message with invalid compression flag",
];

/// tonic's refusal of a frame over the limit.
const TOO_LARGE: &str = "Error, decoded message length too large";

/// The header of a trailers-only response's status code.
const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
/// ... and of its message.
const GRPC_MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");

/// The layer every server mounts (runtime's [`crate::Server`]).
pub type EdgeLayer = MapResponseLayer<fn(http::Response<Body>) -> http::Response<Body>>;

/// Rewrites tonic's refusals of undecodable and oversize requests.
pub fn layer() -> EdgeLayer {
    MapResponseLayer::new(rewrite as fn(http::Response<Body>) -> http::Response<Body>)
}

/// The response with tonic's decoding refusal, if it is one, replaced by the
/// client status; any other response as it is.
pub fn rewrite(mut response: http::Response<Body>) -> http::Response<Body> {
    let code = response.headers().get(GRPC_STATUS).map(|v| v.as_bytes());
    // Cheap test first: only INTERNAL (13) and OUT_OF_RANGE (11) can be one.
    if !matches!(code, Some(b"13") | Some(b"11")) {
        return response;
    }
    let Some(status) = Status::from_header_map(response.headers()) else {
        return response;
    };
    let Some(client) = client_status(&status) else {
        return response;
    };
    let headers = response.headers_mut();
    headers.remove(GRPC_MESSAGE);
    if client.add_header(headers).is_ok() {
        response.extensions_mut().insert(client);
    }
    response
}

/// The client status for tonic's refusal `status`, or None when `status` is
/// not one (a handler's own INTERNAL stays INTERNAL).
fn client_status(status: &Status) -> Option<Status> {
    let message = status.message();
    match status.code() {
        Code::Internal if UNDECODABLE.iter().any(|m| message.starts_with(m)) => Some(
            Status::invalid_argument(format!("request does not decode: {message}")),
        ),
        Code::OutOfRange if message.starts_with(TOO_LARGE) => {
            Some(Status::resource_exhausted(too_large(message)))
        }
        _ => None,
    }
}

/// "request message is N bytes; this server accepts at most L bytes (M MiB)"
/// from tonic's "… found N bytes, the limit is: L bytes".
fn too_large(message: &str) -> String {
    let number_after = |label: &str| -> Option<usize> {
        let rest = &message[message.find(label)? + label.len()..];
        rest.trim_start()
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    match (number_after("found"), number_after("the limit is:")) {
        (Some(found), Some(limit)) => {
            const MIB: usize = 1024 * 1024;
            let mib = if limit % MIB == 0 {
                format!(" ({} MiB)", limit / MIB)
            } else {
                String::new()
            };
            format!(
                "request message is {found} bytes; this server accepts at most {limit} bytes{mib}"
            )
        }
        _ => format!("request message too large: {message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_health::pb::health_server::HealthServer;
    use tonic_health::server::HealthReporter;
    use tower::{Layer, ServiceExt};

    /// A gRPC frame: compression flag, big-endian length, payload.
    fn frame(flag: u8, len: u32, payload: &[u8]) -> Vec<u8> {
        let mut b = vec![flag];
        b.extend(len.to_be_bytes());
        b.extend(payload);
        b
    }

    /// `body` sent to grpc.health's Check through tonic's real server path
    /// (limit: 64 bytes) behind the layer; the status it ends with.
    async fn check(body: Vec<u8>) -> Status {
        let health = HealthServer::new(tonic_health::server::HealthService::from_health_reporter(
            HealthReporter::new(),
        ))
        .max_decoding_message_size(64);
        let routes = layer().layer(tonic::service::Routes::new(health));
        let request = http::Request::builder()
            .method("POST")
            .uri("http://edge/grpc.health.v1.Health/Check")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Body::new(http_body_util::Full::new(bytes::Bytes::from(
                body,
            ))))
            .unwrap();
        let response = routes.oneshot(request).await.unwrap();
        Status::from_header_map(response.headers()).expect("a trailers-only status")
    }

    #[tokio::test]
    async fn undecodable_requests_are_invalid_argument() {
        let cases = [
            ("garbage", frame(0, 8, &[0xff; 8])),
            ("invalid UTF-8", frame(0, 4, &[0x0a, 0x02, 0xc3, 0x28])),
            ("truncated message", frame(0, 3, &[0x0a, 0x05, b'a'])),
            ("body ends inside the frame", frame(0, 20, &[0x0a, 0x02])),
            ("no message", vec![]),
            ("invalid compression flag", frame(7, 0, &[])),
        ];
        for (what, body) in cases {
            let status = check(body).await;
            assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
            assert!(
                status.message().starts_with("request does not decode: "),
                "{what}: {status:?}"
            );
        }
    }

    #[tokio::test]
    async fn an_oversize_request_is_resource_exhausted_naming_the_limit() {
        let status = check(frame(0, 65, &[0; 65])).await;
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert_eq!(
            status.message(),
            "request message is 65 bytes; this server accepts at most 64 bytes"
        );
        // The header alone is refused: tonic does not buffer what it refuses.
        let status = check(frame(0, u32::MAX, &[])).await;
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("4294967295 bytes"), "{status:?}");
    }

    #[tokio::test]
    async fn the_services_own_statuses_pass_unchanged() {
        // Health's NOT_FOUND for a service it does not know.
        let unknown = frame(0, 4, &[0x0a, 0x02, b'n', b'o']);
        let status = check(unknown).await;
        assert_eq!(status.code(), Code::NotFound, "{status:?}");
        // A handler's INTERNAL, OUT_OF_RANGE and a streaming response.
        for status in [
            Status::internal("the model failed: boom"),
            Status::out_of_range("step 9 is out of range"),
        ] {
            let out = rewrite(status.clone().into_http());
            let got = Status::from_header_map(out.headers()).unwrap();
            assert_eq!(
                (got.code(), got.message()),
                (status.code(), status.message())
            );
        }
        let streaming = http::Response::new(Body::empty());
        assert!(rewrite(streaming).headers().is_empty());
    }
}
