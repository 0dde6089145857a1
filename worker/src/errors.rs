//! Worker errors and their one mapping to gRPC statuses.
use crate::scheduler::SubmitError;
use tokenmesh_proto::validate::InvalidField;
use tonic::{Code, Status};

/// Everything that can go wrong serving one request.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
    #[error("model {asked:?} is not served here; this worker serves {served:?}")]
    UnknownModel { asked: String, served: String },
    #[error("messages: {0}")]
    Template(String),
    #[error("prompt: {0}")]
    Tokenize(String),
    #[error("prompt is {prompt} tokens but the context window is {context}; shorten it")]
    PromptTooLong { prompt: usize, context: usize },
    #[error(
        "prompt is {prompt} tokens but this worker's KV cache holds {capacity} tokens per \
         sequence; shorten it (or serve the model from workers with a larger --kv-budget-mib)"
    )]
    PromptExceedsKvCache { prompt: usize, capacity: usize },
    /// `limit` is the smaller of the context window and the KV cache, which
    /// `bound` names.
    #[error("max_tokens: {max_tokens} is beyond {bound} of {limit} tokens")]
    MaxTokensTooLarge {
        max_tokens: usize,
        limit: usize,
        bound: &'static str,
    },
    /// A Generate named a stream this worker is still streaming.
    #[error(
        "attempt_id: request_id {request_id:?} with attempt_id {attempt_id:?} is already \
         streaming on this worker; give each call its own attempt_id"
    )]
    StreamExists {
        request_id: String,
        attempt_id: String,
    },
    #[error("emitted_token_ids: {0}")]
    BadContinuation(String),
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error("the model failed: {0}")]
    Engine(String),
    /// An upstream engine's failure, with the code it maps to.
    #[error(transparent)]
    Upstream(#[from] crate::upstream::UpstreamError),
}

impl WorkerError {
    /// The status a client sees.
    pub fn into_status(self) -> Status {
        let code = match &self {
            WorkerError::Invalid(_)
            | WorkerError::Template(_)
            | WorkerError::Tokenize(_)
            | WorkerError::PromptTooLong { .. }
            | WorkerError::PromptExceedsKvCache { .. }
            | WorkerError::MaxTokensTooLarge { .. }
            | WorkerError::BadContinuation(_) => Code::InvalidArgument,
            WorkerError::UnknownModel { .. } => Code::NotFound,
            WorkerError::StreamExists { .. } => Code::AlreadyExists,
            WorkerError::Submit(SubmitError::QueueFull { .. }) => Code::ResourceExhausted,
            WorkerError::Submit(_) => Code::Unavailable,
            WorkerError::Engine(_) => Code::Internal,
            WorkerError::Upstream(e) => e.code(),
        };
        Status::new(code, self.to_string())
    }
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Self {
        e.into_status()
    }
}
