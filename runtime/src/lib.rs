//! What every tokenmesh server shares, so each process crate holds only its
//! own logic: start-up ([`serve`]: health, reflection, the authorization
//! layer, TLS or plaintext, graceful shutdown; [`edge`]: client statuses for
//! requests that do not decode or are too large), readiness ([`readiness`],
//! which drives grpc.health and the plaintext probes of [`probes`]), the common flags
//! ([`args::ServerArgs`]), etcd connections and leases ([`etcd`],
//! [`lease`]), backoff with jitter ([`backoff`]), the async runtime
//! ([`scheduler`]) and telemetry set-up ([`telemetry`], with the metrics
//! recorder of [`histograms`], the span exporter of [`otlp`] and the
//! W3C trace-context headers of [`trace_context`]). No business logic lives here.
#![forbid(unsafe_code)]

pub mod args;
pub mod backoff;
pub mod edge;
pub mod etcd;
pub mod histograms;
pub mod lease;
pub mod otlp;
pub mod probes;
pub mod readiness;
pub mod reflection;
pub mod scheduler;
pub mod serve;
pub mod shutdown;
pub mod start;
pub mod telemetry;
pub mod trace_context;

pub use args::ServerArgs;
pub use backoff::Backoff;
pub use readiness::Readiness;
pub use serve::{ServeError, Server};
pub use shutdown::shutdown_signal;
pub use start::{run_server, start, StartError};
