//! The tokenmesh wire contract (`tokenmesh.v1`): generated stubs, the etcd
//! key and record schema, request validation, the metadata header names and
//! the status-code table. No business logic and no process plumbing live here
//! (start-up, flags, etcd connections and telemetry are in tokenmesh-runtime).
#![forbid(unsafe_code)]

pub mod codes;
pub mod deadline;
pub mod delta;
pub mod keys;
pub mod records;
pub mod validate;

/// Generated protobuf messages and gRPC stubs for `tokenmesh.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("tokenmesh.v1");
}

/// Encoded file descriptor set, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tokenmesh_descriptor");

/// Metadata header names shared by router, workers and clients.
pub mod headers {
    /// Request: pins a version; response: the version that served.
    pub const VERSION: &str = "x-tokenmesh-version";
    /// Response: the worker that served.
    pub const WORKER: &str = "x-tokenmesh-worker";
    /// Request: sticky-session key.
    pub const SESSION: &str = "x-tokenmesh-session";
    /// Worker response: the attempt id naming the stream for `Worker.Abort`
    /// (the caller's own, or the one the worker picked for it).
    pub const ATTEMPT: &str = "x-tokenmesh-attempt";
}
