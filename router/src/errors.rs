//! Router errors and their one mapping to gRPC statuses.
use tokenmesh_proto::validate::InvalidField;
use tonic::{Code, Status};

/// Everything the router itself can refuse a request for.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
    #[error("the router has not read its etcd snapshot of the workers yet; retry in a moment")]
    NotLoaded,
    #[error("model {asked:?} not found; available: {}", list(available))]
    UnknownModel {
        asked: String,
        available: Vec<String>,
    },
    #[error(
        "version {version:?} of model {model:?} not found; available: {}",
        list(available)
    )]
    UnknownVersion {
        model: String,
        version: String,
        available: Vec<String>,
    },
    #[error("version: pinning is disabled by the traffic policy of model {0:?}")]
    PinNotAllowed(String),
    #[error("no ready worker for model {model:?}{}", version.as_ref().map(|v| format!(" version {v:?}")).unwrap_or_default())]
    NoWorker {
        model: String,
        version: Option<String>,
    },
    #[error("worker lost after {delivered} tokens were delivered and no other worker could continue: {reason}")]
    StreamLost { delivered: usize, reason: String },
    #[error(transparent)]
    Overloaded(#[from] crate::admission::Rejected),
    #[error("deadline exceeded after {delivered} tokens were delivered")]
    DeadlineExceeded { delivered: usize },
    /// Every worker tried refused with a retryable status; the client gets
    /// the last one's code.
    #[error("no worker could take the request: {message}")]
    AttemptsFailed { code: Code, message: String },
    /// A retry was due but the version's retry budget was spent; the client
    /// gets the last error's code (UNAVAILABLE if there was none, after a
    /// stream was lost).
    #[error("retry budget exhausted, not retrying{}", last.as_ref().map(|(_, m)| format!("; last error: {m}")).unwrap_or_default())]
    RetryBudgetExhausted { last: Option<(Code, String)> },
    /// A worker refused with a status that no other worker would change; it
    /// reaches the client as the worker sent it.
    #[error("{}", .0.message())]
    Worker(Status),
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

impl RouterError {
    /// The status a client sees.
    pub fn into_status(self) -> Status {
        let retry_after = match &self {
            RouterError::Overloaded(r) => Some(r.retry_after_ms()),
            _ => None,
        };
        let code = match &self {
            RouterError::Worker(status) => status.code(),
            RouterError::AttemptsFailed { code, .. } => *code,
            RouterError::RetryBudgetExhausted { last } => {
                last.as_ref().map_or(Code::Unavailable, |(code, _)| *code)
            }
            RouterError::Invalid(_) | RouterError::PinNotAllowed(_) => Code::InvalidArgument,
            RouterError::UnknownModel { .. } | RouterError::UnknownVersion { .. } => Code::NotFound,
            RouterError::NotLoaded
            | RouterError::NoWorker { .. }
            | RouterError::StreamLost { .. } => Code::Unavailable,
            RouterError::Overloaded(_) => Code::ResourceExhausted,
            RouterError::DeadlineExceeded { .. } => Code::DeadlineExceeded,
        };
        let mut status = match self {
            RouterError::Worker(status) => return status,
            other => Status::new(code, other.to_string()),
        };
        if let Some(ms) = retry_after {
            if let Ok(v) = ms.to_string().parse() {
                status.metadata_mut().insert("retry-after-ms", v);
            }
        }
        status
    }
}

impl From<RouterError> for Status {
    fn from(e: RouterError) -> Self {
        e.into_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_failures_keep_the_last_workers_code_and_say_why() {
        let s = RouterError::RetryBudgetExhausted {
            last: Some((Code::ResourceExhausted, "queue full".into())),
        }
        .into_status();
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(
            s.message(),
            "retry budget exhausted, not retrying; last error: queue full"
        );
        let s = RouterError::RetryBudgetExhausted { last: None }.into_status();
        assert_eq!(
            (s.code(), s.message()),
            (Code::Unavailable, "retry budget exhausted, not retrying")
        );
        let s = RouterError::AttemptsFailed {
            code: Code::Internal,
            message: "boom".into(),
        }
        .into_status();
        assert_eq!(
            (s.code(), s.message()),
            (Code::Internal, "no worker could take the request: boom")
        );
    }

    #[test]
    fn a_workers_own_refusal_passes_through_unchanged() {
        let mut refusal = Status::invalid_argument("emitted_token_ids: too long");
        refusal
            .metadata_mut()
            .insert("x-why", "because".parse().unwrap());
        let s = RouterError::Worker(refusal).into_status();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "emitted_token_ids: too long");
        assert_eq!(s.metadata().get("x-why").unwrap(), "because");
    }
}
