//! Discovery backends: where the registry's workers and policies come from.
//! `etcd` watches the cluster's keys; `static_file` reads a TOML file (the
//! embedded default for one machine, no etcd needed).
pub mod etcd;
pub mod static_file;

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("cannot read static discovery file {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("static discovery file {path}: {message}")]
    Parse {
        path: std::path::PathBuf,
        message: String,
    },
}
