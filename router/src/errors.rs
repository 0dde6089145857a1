//! Router errors and their one mapping to gRPC statuses.
use tokenmesh_proto::validate::InvalidField;
use tonic::{Code, Status};

/// Everything the router itself can refuse a request for.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
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
        let code = match &self {
            RouterError::Invalid(_) | RouterError::PinNotAllowed(_) => Code::InvalidArgument,
            RouterError::UnknownModel { .. } | RouterError::UnknownVersion { .. } => Code::NotFound,
            RouterError::NoWorker { .. } | RouterError::StreamLost { .. } => Code::Unavailable,
            RouterError::Overloaded(_) => Code::ResourceExhausted,
            RouterError::DeadlineExceeded { .. } => Code::DeadlineExceeded,
        };
        let mut status = Status::new(code, self.to_string());
        if let RouterError::Overloaded(r) = &self {
            if let Ok(v) = r.retry_after_ms().to_string().parse() {
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

/// Whether an upstream failure may be retried on another worker: the worker
/// was unreachable, overloaded or draining, as opposed to a request the next
/// worker would refuse just the same.
pub fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::Unknown
            | Code::Internal
            | Code::Aborted
    )
}
