//! Control API errors and their one mapping to gRPC statuses.
use crate::rollout::InvalidRollout;
use crate::store::StoreError;
use tonic::{Code, Status};

/// Everything the Control API can refuse a request for.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    InvalidRollout(#[from] InvalidRollout),
    #[error("model {0:?} not found: no traffic policy and no registered workers")]
    UnknownModel(String),
    #[error("version {version:?} of model {model:?} has no registered workers (registered: {registered})")]
    UnknownVersion {
        model: String,
        version: String,
        registered: String,
    },
    #[error("worker {0:?} is not registered")]
    UnknownWorker(String),
    #[error("model {0:?} has no rollout")]
    NoRollout(String),
    #[error("{0}")]
    Precondition(String),
    #[error("a rollout of model {model:?} to {canary:?} is already running (step {step}); promote or roll it back first")]
    RolloutRunning {
        model: String,
        canary: String,
        step: u32,
    },
    #[error("{identity} may read but not change the mesh: the operator role is required")]
    ReadOnly { identity: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<ControlError> for Status {
    fn from(e: ControlError) -> Self {
        let code = match &e {
            ControlError::Invalid(_) | ControlError::InvalidRollout(_) => Code::InvalidArgument,
            ControlError::UnknownModel(_)
            | ControlError::UnknownVersion { .. }
            | ControlError::UnknownWorker(_)
            | ControlError::NoRollout(_) => Code::NotFound,
            ControlError::Precondition(_) => Code::FailedPrecondition,
            ControlError::RolloutRunning { .. } => Code::AlreadyExists,
            ControlError::ReadOnly { .. } => Code::PermissionDenied,
            ControlError::Store(StoreError::Conflict { .. }) => Code::Aborted,
            ControlError::Store(StoreError::Unavailable(_)) => Code::Unavailable,
            ControlError::Store(StoreError::Encode(_)) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
