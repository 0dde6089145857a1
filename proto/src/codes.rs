//! gRPC status codes: their canonical names, as metric labels and reports use
//! them (`RESOURCE_EXHAUSTED`), and the one table that says what an outcome
//! means, used by the router's retries and failover, its per-version stats
//! and both processes' error metrics.
//!
//! | class            | codes                                                        | retried on another worker | stats error of the version | `llm_request_errors_total` |
//! | ---------------- | ------------------------------------------------------------ | ------------------------- | -------------------------- | -------------------------- |
//! | `Ok`             | OK                                                           | no                        | no                         | no                         |
//! | `Cancelled`      | CANCELLED                                                    | no                        | no                         | no                         |
//! | `ClientError`    | INVALID_ARGUMENT, NOT_FOUND, OUT_OF_RANGE                    | no                        | no                         | yes                        |
//! | `Retryable`      | UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNKNOWN  | yes                       | yes                        | yes                        |
//! | `ServingError`   | every other code (DEADLINE_EXCEEDED, FAILED_PRECONDITION, PERMISSION_DENIED, UNAUTHENTICATED, UNIMPLEMENTED, ALREADY_EXISTS, DATA_LOSS) | no | yes | yes |
//!
//! Why these rows:
//! - INTERNAL and UNKNOWN are retried: from a worker they mean its engine
//!   failed (a model error, the synthetic engine's injected fault) or the
//!   connection failed in a way tonic reports as UNKNOWN (a worker that
//!   refuses connections comes back as UNKNOWN "transport error", as the
//!   router's component tests show); another worker may well succeed, and a stream that breaks with them after tokens were sent
//!   continues elsewhere (a client then sees UNAVAILABLE only if no worker
//!   can continue, as the end-to-end stats and canary tests expect).
//! - The client-error rows are the caller's own doing: the next worker would
//!   refuse it the same way, and it says nothing about the version's health.
//! - DEADLINE_EXCEEDED is the serving side being too slow (a stats error) but
//!   not retried: the caller's time is spent.
//! - The Prometheus error counter counts every failed request, also the
//!   client's mistakes (an alert on it sees a client sending garbage); only
//!   a cancel, which is the client's decision, is not a failure.
use tonic::Code;

/// What an outcome with a status code means; see the table in the module
/// documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusClass {
    /// Success.
    Ok,
    /// The caller cancelled or went away.
    Cancelled,
    /// The request itself is wrong; any worker would refuse it.
    ClientError,
    /// The serving side failed in a way another worker may not.
    Retryable,
    /// The serving side failed, and trying elsewhere would not help.
    ServingError,
}

impl StatusClass {
    /// Whether the request may be tried on another worker (before the first
    /// token) or continued on one (after it).
    pub fn is_retryable(self) -> bool {
        self == StatusClass::Retryable
    }

    /// Whether the outcome counts against the serving version (router stats,
    /// canary analysis).
    pub fn is_serving_error(self) -> bool {
        matches!(self, StatusClass::Retryable | StatusClass::ServingError)
    }

    /// Whether the request failed, for `llm_request_errors_total`: anything
    /// but success or the caller's own cancel.
    pub fn is_failure(self) -> bool {
        !matches!(self, StatusClass::Ok | StatusClass::Cancelled)
    }
}

/// The class of an outcome with `code`.
pub fn classify(code: Code) -> StatusClass {
    match code {
        Code::Ok => StatusClass::Ok,
        Code::Cancelled => StatusClass::Cancelled,
        Code::InvalidArgument | Code::NotFound | Code::OutOfRange => StatusClass::ClientError,
        Code::Unavailable
        | Code::ResourceExhausted
        | Code::Aborted
        | Code::Internal
        | Code::Unknown => StatusClass::Retryable,
        Code::DeadlineExceeded
        | Code::AlreadyExists
        | Code::PermissionDenied
        | Code::FailedPrecondition
        | Code::Unimplemented
        | Code::DataLoss
        | Code::Unauthenticated => StatusClass::ServingError,
    }
}

/// The canonical upper-case name of a status code.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_canonical() {
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
        assert_eq!(code_name(Code::Unavailable), "UNAVAILABLE");
        assert_eq!(code_name(Code::DeadlineExceeded), "DEADLINE_EXCEEDED");
    }

    /// Every code with the class the doc table gives it, written out one by
    /// one (not as a second copy of `classify`'s match).
    const TABLE: [(Code, StatusClass); 17] = [
        (Code::Ok, StatusClass::Ok),
        (Code::Cancelled, StatusClass::Cancelled),
        (Code::Unknown, StatusClass::Retryable),
        (Code::InvalidArgument, StatusClass::ClientError),
        (Code::DeadlineExceeded, StatusClass::ServingError),
        (Code::NotFound, StatusClass::ClientError),
        (Code::AlreadyExists, StatusClass::ServingError),
        (Code::PermissionDenied, StatusClass::ServingError),
        (Code::ResourceExhausted, StatusClass::Retryable),
        (Code::FailedPrecondition, StatusClass::ServingError),
        (Code::Aborted, StatusClass::Retryable),
        (Code::OutOfRange, StatusClass::ClientError),
        (Code::Unimplemented, StatusClass::ServingError),
        (Code::Internal, StatusClass::Retryable),
        (Code::Unavailable, StatusClass::Retryable),
        (Code::DataLoss, StatusClass::ServingError),
        (Code::Unauthenticated, StatusClass::ServingError),
    ];

    #[test]
    fn the_table_as_documented() {
        for (code, class) in TABLE {
            assert_eq!(classify(code), class, "{}", code_name(code));
        }
    }

    #[test]
    fn retryable_implies_serving_error_implies_failure() {
        for (code, _) in TABLE {
            let class = classify(code);
            if class.is_retryable() {
                assert!(class.is_serving_error(), "{}", code_name(code));
            }
            if class.is_serving_error() {
                assert!(class.is_failure(), "{}", code_name(code));
            }
        }
    }

    #[test]
    fn what_stats_and_metrics_count() {
        // The README's stats rule: a worker error status other than
        // INVALID_ARGUMENT, NOT_FOUND, OUT_OF_RANGE or CANCELLED.
        for code in [
            Code::Ok,
            Code::Cancelled,
            Code::InvalidArgument,
            Code::NotFound,
            Code::OutOfRange,
        ] {
            assert!(!classify(code).is_serving_error(), "{}", code_name(code));
        }
        assert!(classify(Code::DeadlineExceeded).is_serving_error());
        assert!(!classify(Code::DeadlineExceeded).is_retryable());
        // The error counter: a client's bad request is a failed request, its
        // cancel is not.
        assert!(classify(Code::InvalidArgument).is_failure());
        assert!(!classify(Code::Cancelled).is_failure());
        assert!(!classify(Code::Ok).is_failure());
    }
}
