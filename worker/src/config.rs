//! Command-line configuration of `tokenmesh-worker`.
use clap::Parser;
use std::net::SocketAddr;
use std::time::Duration;
use tokenmesh_runtime::ServerArgs;

/// A tokenmesh worker: runs one GGUF model and streams tokens to routers.
/// With --tls-dir (worker.pem and worker.key, or cert-manager's tls.crt and
/// tls.key) only routers may call, and the certificate's name is this
/// worker's id (--worker-id defaults to it).
/// Without --etcd it runs standalone, unregistered.
#[derive(Parser, Clone, Debug)]
#[command(name = "tokenmesh-worker", version)]
pub struct WorkerConfig {
    /// Run a tool instead of serving.
    #[command(subcommand)]
    pub command: Option<WorkerCommand>,

    #[command(flatten)]
    pub server: ServerArgs<50061>,

    /// Address routers dial, as registered in etcd (default: the listen
    /// address, with 127.0.0.1 for an unspecified host).
    #[arg(long, env = "TOKENMESH_ADVERTISE")]
    pub advertise: Option<String>,

    /// Lease TTL of the registration, in seconds.
    #[arg(long, env = "TOKENMESH_LEASE_TTL", default_value_t = 10)]
    pub lease_ttl: u64,

    /// Engine: `model` runs the GGUF model; `upstream` forwards to an
    /// existing engine at --upstream-url (llama-server, vLLM); `synthetic`
    /// loads no model and emits deterministic words at
    /// --synthetic-tokens-per-sec per sequence, for router tests and
    /// benchmarks (never for serving users).
    #[arg(long, env = "TOKENMESH_ENGINE", value_enum, default_value_t = EngineKind::Model)]
    pub engine: EngineKind,

    #[command(flatten)]
    pub upstream: crate::upstream::UpstreamArgs,

    /// Synthetic engine only: tokens per second of each running sequence
    /// (capacity is --max-batch, the queue --queue-capacity).
    #[arg(
        long,
        env = "TOKENMESH_SYNTHETIC_TOKENS_PER_SEC",
        default_value_t = 50.0
    )]
    pub synthetic_tokens_per_sec: f64,

    /// Synthetic engine only, fault injection for load tests: the fraction
    /// (0 to 1) of requests that fail with INTERNAL "synthetic fault
    /// injected" before their first token, chosen by a hash of the request
    /// id (so the same request fails on every such worker).
    #[arg(
        long,
        env = "TOKENMESH_SYNTHETIC_ERROR_RATE",
        value_name = "F",
        value_parser = parse_fraction
    )]
    pub synthetic_error_rate: Option<f64>,

    /// Synthetic engine only: extra delay before each sequence's first token,
    /// in milliseconds (at most one hour).
    #[arg(
        long,
        env = "TOKENMESH_SYNTHETIC_FIRST_TOKEN_DELAY_MS",
        value_name = "N",
        value_parser = clap::value_parser!(u64).range(0..=3_600_000)
    )]
    pub synthetic_first_token_delay_ms: Option<u64>,

    #[command(flatten)]
    pub source: crate::model_cache::ModelSource,

    /// Name the model is served under (default: from the GGUF metadata;
    /// `synthetic` for the synthetic engine). Like --model-version and
    /// --worker-id, a segment of the worker's etcd key: 1-128 bytes of ASCII
    /// letters, digits and . _ - : @ +.
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

    /// CPU device: run the SIMD (AVX2) kernels where the CPU has them;
    /// false (or 0) runs the portable loops, to test or compare them.
    #[arg(
        long,
        env = "TOKENMESH_CPU_SIMD",
        value_name = "BOOL",
        default_value = "true",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set
    )]
    pub cpu_simd: bool,

    /// CPU device: run the AVX-512 VNNI variants of the integer kernels where
    /// the CPU has them (same results, fewer instructions); false (or 0)
    /// keeps plain AVX2, to compare.
    #[arg(
        long,
        env = "TOKENMESH_CPU_VNNI",
        value_name = "BOOL",
        default_value = "true",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set
    )]
    pub cpu_vnni: bool,

    /// Sequences decoded together in one step.
    #[arg(long, env = "TOKENMESH_MAX_BATCH", default_value_t = 8)]
    pub max_batch: usize,

    /// Requests allowed to wait for a batch slot; beyond it RESOURCE_EXHAUSTED.
    #[arg(long, env = "TOKENMESH_QUEUE_CAPACITY", default_value_t = 64)]
    pub queue_capacity: usize,

    /// Tokens run through the model per step: one per decoding sequence, the
    /// rest for prompt chunks (long prompts are read in pieces of this size).
    #[arg(long, env = "TOKENMESH_MAX_TOKENS_PER_STEP", default_value_t = 256)]
    pub max_tokens_per_step: usize,

    /// Target duration of one step in milliseconds; prompt chunks shrink when
    /// steps run slower (0 = no target).
    #[arg(long, env = "TOKENMESH_STEP_LATENCY_TARGET_MS", default_value_t = 0)]
    pub step_latency_target_ms: u64,

    /// Memory for the KV cache pool, in MiB (allocated at start-up). It is
    /// also the most one sequence can hold: longer prompts and larger
    /// max_tokens are refused, and a reply that outgrows it ends as
    /// KV_CACHE_FULL (the default model: 5,824 tokens at 256 MiB).
    #[arg(long, env = "TOKENMESH_KV_BUDGET_MIB", default_value_t = 256)]
    pub kv_budget_mib: usize,

    /// Tokens per KV cache block.
    #[arg(long, env = "TOKENMESH_KV_BLOCK_SIZE", default_value_t = 16)]
    pub kv_block_size: usize,

    /// Automatic prefix caching: `on` keeps full KV blocks after their
    /// sequence ends and lets later requests with the same prompt prefix
    /// (a shared system prompt, earlier chat turns, a failover continuation)
    /// reuse them instead of computing them again; cached blocks are evicted,
    /// least recently used first, when the pool needs room. `off` frees every
    /// block with its sequence (to compare). Also true/false, yes/no, 1/0.
    #[arg(
        long,
        env = "TOKENMESH_PREFIX_CACHE",
        value_name = "on|off",
        default_value = "on",
        hide_possible_values = true,
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set
    )]
    pub prefix_cache: bool,

    /// A waiting request moves up one priority class per this many
    /// milliseconds, so LOW is never starved.
    #[arg(long, env = "TOKENMESH_PRIORITY_AGING_MS", default_value_t = 2_000)]
    pub priority_aging_ms: u64,

    /// max_tokens when a request leaves it unset.
    #[arg(long, env = "TOKENMESH_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    pub default_max_tokens: usize,

    /// On SIGTERM or a drain key, how long in-flight streams may take to
    /// finish, in seconds.
    #[arg(long, env = "TOKENMESH_DRAIN_TIMEOUT", default_value_t = 30)]
    pub drain_timeout: u64,

    /// When drained through its etcd key `drain/{worker_id}`, keep running
    /// (refusing new requests) instead of exiting once in-flight streams end.
    #[arg(long, env = "TOKENMESH_STAY_DRAINED")]
    pub stay_drained: bool,
}

/// Tools of the worker binary besides serving.
#[derive(clap::Subcommand, Clone, Debug)]
pub enum WorkerCommand {
    /// Tokenize text with a GGUF file's tokenizer: each line of stdin (its
    /// \n or \r\n removed) becomes one line of token ids on stdout. Reads
    /// only the metadata, so vocabulary-only GGUF files work too.
    Tokenize(crate::tokenize::TokenizeArgs),
}

/// A number in 0..=1.
fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("{s} is not a fraction between 0 and 1"))
    }
}

/// Which engine generates tokens.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// The GGUF model (the default).
    Model,
    /// An existing engine behind its HTTP API (--upstream-url).
    Upstream,
    /// Deterministic words at a set rate, no model; for tests and benchmarks.
    Synthetic,
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
