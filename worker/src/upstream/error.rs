//! What can go wrong talking to an upstream engine, each kind with the gRPC
//! code it maps to and the `kind` label it is counted under in
//! `tokenmesh_worker_upstream_errors_total`.
use tonic::Code;

/// One failure of a call to the engine.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection, or it broke before the engine answered.
    #[error("the upstream engine is unreachable: {0}")]
    Unreachable(String),
    /// The connection broke mid-stream (the engine went away).
    #[error("the upstream engine's stream broke after {tokens} tokens: {reason}")]
    Broken { tokens: usize, reason: String },
    /// The engine answered with an HTTP error.
    #[error("the upstream engine answered HTTP {status}: {message}")]
    Http { status: u16, message: String },
    /// An answer that is not what the engine's API promises.
    #[error("the upstream engine sent a malformed answer: {0}")]
    Malformed(String),
    /// The stream ended without a finish.
    #[error("the upstream engine ended the stream without finishing, after {tokens} tokens")]
    Unfinished { tokens: usize },
    /// An error event inside the stream.
    #[error("the upstream engine failed the request: {0}")]
    Failed(String),
    /// The engine did not answer in time.
    #[error("the upstream engine did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The caller's deadline passed before the engine answered.
    #[error("deadline exceeded waiting for the upstream engine")]
    Deadline,
}

impl UpstreamError {
    /// The status code a client sees. Losing the engine, or its stream, is
    /// UNAVAILABLE, which the router retries or fails over (the tokens
    /// delivered so far continue elsewhere); the engine refusing the request
    /// itself is the client's to fix; a broken answer is INTERNAL.
    pub fn code(&self) -> Code {
        match self {
            Self::Unreachable(_)
            | Self::Broken { .. }
            | Self::Unfinished { .. }
            | Self::Timeout(_) => Code::Unavailable,
            Self::Http { status, .. } => match status {
                400 | 413 | 422 => Code::InvalidArgument,
                404 => Code::NotFound,
                429 => Code::ResourceExhausted,
                502..=504 => Code::Unavailable,
                _ => Code::Internal,
            },
            Self::Malformed(_) | Self::Failed(_) => Code::Internal,
            Self::Deadline => Code::DeadlineExceeded,
        }
    }

    /// The `kind` label of the error counter.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unreachable(_) => "unreachable",
            Self::Broken { .. } => "broken_stream",
            Self::Http { status, .. } if *status < 500 => "http_4xx",
            Self::Http { .. } => "http_5xx",
            Self::Malformed(_) => "malformed",
            Self::Unfinished { .. } => "unfinished",
            Self::Failed(_) => "stream_error",
            Self::Timeout(_) => "timeout",
            Self::Deadline => "deadline",
        }
    }

    /// Counts this error for the worker `labels` name.
    pub fn count(&self, labels: &[(&'static str, String)]) {
        let with_kind = crate::series::with_label(labels, "kind", self.kind());
        metrics::counter!("tokenmesh_worker_upstream_errors_total", &with_kind).increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_who_can_mend_it() {
        let http = |status| UpstreamError::Http {
            status,
            message: String::new(),
        };
        assert_eq!(http(400).code(), Code::InvalidArgument);
        assert_eq!(http(503).code(), Code::Unavailable);
        assert_eq!(http(500).code(), Code::Internal);
        assert_eq!(http(429).code(), Code::ResourceExhausted);
        assert_eq!(
            UpstreamError::Unreachable("refused".into()).code(),
            Code::Unavailable
        );
        assert_eq!(
            UpstreamError::Unfinished { tokens: 3 }.code(),
            Code::Unavailable
        );
        assert_eq!(UpstreamError::Malformed("x".into()).code(), Code::Internal);
        assert_eq!(http(503).kind(), "http_5xx");
        assert_eq!(http(422).kind(), "http_4xx");
    }
}
