//! Command-line configuration of `tokenmesh-router`.
use crate::route::affinity::{AffinitySettings, WorkerChoice};
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use tokenmesh_runtime::ServerArgs;

/// The tokenmesh router: one gRPC endpoint in front of every worker. With
/// --tls-dir (router.pem, router.key), clients need a client or operator
/// certificate and workers must present their worker_id's certificate.
#[derive(Parser, Clone, Debug)]
#[command(name = "tokenmesh-router", version)]
pub struct RouterConfig {
    #[command(flatten)]
    pub server: ServerArgs<50051>,

    /// This router's id in etcd: its stats are published under
    /// `stats/{router_id}/{model}/{version}` (default: <hostname>-<pid>).
    #[arg(long, env = "TOKENMESH_ROUTER_ID")]
    pub router_id: Option<String>,

    /// How often per-version stats (requests, errors, time to first token,
    /// workers) are published to etcd, in milliseconds (with --etcd only).
    #[arg(
        long,
        env = "TOKENMESH_STATS_INTERVAL_MS",
        default_value_t = 5_000,
        value_parser = clap::value_parser!(u64).range(10..)
    )]
    pub stats_interval_ms: u64,

    /// How long the published stats of a version outlive its last request
    /// once no worker of it is registered and no policy names it, in
    /// seconds; then its key is deleted and its counters dropped.
    #[arg(
        long,
        env = "TOKENMESH_STATS_RETENTION_S",
        default_value_t = 600,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub stats_retention_s: u64,

    /// Static discovery: a TOML file listing workers and traffic policies
    /// (instead of --etcd).
    #[arg(
        long = "static",
        env = "TOKENMESH_STATIC",
        value_name = "FILE",
        conflicts_with = "etcd"
    )]
    pub static_file: Option<PathBuf>,

    /// HTTP/2 keepalive ping interval to workers, in milliseconds.
    #[arg(
        long,
        env = "TOKENMESH_KEEPALIVE_INTERVAL_MS",
        default_value_t = 30_000
    )]
    pub keepalive_interval_ms: u64,

    /// How long a keepalive ping may go unanswered, in milliseconds.
    #[arg(long, env = "TOKENMESH_KEEPALIVE_TIMEOUT_MS", default_value_t = 10_000)]
    pub keepalive_timeout_ms: u64,

    /// Connect timeout to a worker, in milliseconds.
    #[arg(long, env = "TOKENMESH_CONNECT_TIMEOUT_MS", default_value_t = 2_000)]
    pub connect_timeout_ms: u64,

    /// How often each worker's Status (load, draining) is polled at most,
    /// in milliseconds; longer in a fleet past --status-poll-budget.
    #[arg(long, env = "TOKENMESH_STATUS_INTERVAL_MS", default_value_t = 1_000)]
    pub status_interval_ms: u64,

    /// Status polls per second this router spends on all its workers
    /// together: with N workers each is polled every
    /// max(--status-interval-ms, N / budget), and not while its streams
    /// report its load in-band. 0: no limit.
    #[arg(
        long,
        env = "TOKENMESH_STATUS_POLL_BUDGET",
        default_value_t = DEFAULT_STATUS_POLL_BUDGET,
        value_parser = parse_budget
    )]
    pub status_poll_budget: f64,

    /// Workers tried for one request before the first token.
    #[arg(long, env = "TOKENMESH_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: u32,

    /// Times a stream may move to another worker after tokens were sent.
    #[arg(long, env = "TOKENMESH_MAX_FAILOVERS", default_value_t = 2)]
    pub max_failovers: u32,

    /// Retry budget, per model version: retries and failovers allowed per
    /// request received (0.2 = one in five, up to 1000), over the last
    /// --retry-budget-ttl-s seconds. Past it a request fails with its last
    /// error rather than being retried.
    #[arg(
        long,
        env = "TOKENMESH_RETRY_BUDGET_RATIO",
        default_value_t = 0.2,
        value_parser = parse_ratio
    )]
    pub retry_budget_ratio: f32,

    /// Retries per second the budget allows whatever the traffic, so a quiet
    /// version can still retry.
    #[arg(
        long,
        env = "TOKENMESH_RETRY_BUDGET_MIN_PER_SEC",
        default_value_t = 10,
        value_parser = clap::value_parser!(u32).range(0..=1_000_000)
    )]
    pub retry_budget_min_per_sec: u32,

    /// How long a request counts towards the retry budget, in seconds (1 to 60).
    #[arg(
        long,
        env = "TOKENMESH_RETRY_BUDGET_TTL_S",
        default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(1..=60)
    )]
    pub retry_budget_ttl_s: u64,

    /// Backoff before the first retry of a request, in milliseconds; it
    /// doubles per retry up to --retry-backoff-max-ms, and each wait is drawn
    /// at random below that (full jitter).
    #[arg(long, env = "TOKENMESH_RETRY_BACKOFF_BASE_MS", default_value_t = 10)]
    pub retry_backoff_base_ms: u64,

    /// Longest backoff between two attempts of a request, in milliseconds.
    #[arg(long, env = "TOKENMESH_RETRY_BACKOFF_MAX_MS", default_value_t = 200)]
    pub retry_backoff_max_ms: u64,

    /// Streams in flight through this router; beyond it requests queue.
    #[arg(long, env = "TOKENMESH_MAX_IN_FLIGHT", default_value_t = 1024)]
    pub max_in_flight: usize,

    /// Streams in flight for one caller identity; beyond it RESOURCE_EXHAUSTED.
    #[arg(
        long,
        env = "TOKENMESH_MAX_IN_FLIGHT_PER_IDENTITY",
        default_value_t = 256
    )]
    pub max_in_flight_per_identity: usize,

    /// Requests that may wait for an in-flight slot; beyond it RESOURCE_EXHAUSTED.
    #[arg(long, env = "TOKENMESH_MAX_QUEUED", default_value_t = 256)]
    pub max_queued: usize,

    /// Longest a request waits in that queue, in milliseconds.
    #[arg(long, env = "TOKENMESH_MAX_QUEUE_WAIT_MS", default_value_t = 2_000)]
    pub max_queue_wait_ms: u64,

    /// Server-side HTTP/2 keepalive ping interval to clients, in milliseconds.
    #[arg(
        long,
        env = "TOKENMESH_SERVER_KEEPALIVE_INTERVAL_MS",
        default_value_t = 30_000
    )]
    pub server_keepalive_interval_ms: u64,

    /// Close client connections after this age, in seconds (0 = never), so
    /// that clients rebalance over router replicas.
    #[arg(long, env = "TOKENMESH_MAX_CONNECTION_AGE_S", default_value_t = 0)]
    pub max_connection_age_s: u64,

    /// Grace period for streams on a connection closed for its age, in seconds.
    #[arg(
        long,
        env = "TOKENMESH_MAX_CONNECTION_AGE_GRACE_S",
        default_value_t = 300
    )]
    pub max_connection_age_grace_s: u64,

    #[command(flatten)]
    pub http: HttpArgs,

    #[command(flatten)]
    pub worker_choice: WorkerChoiceArgs,
}

/// Flags of the worker choice (issue 17).
#[derive(clap::Args, Clone, Debug)]
pub struct WorkerChoiceArgs {
    /// How a worker of the chosen version is picked: `cache-aware` sends a
    /// request to the worker estimated to hold the longest prefix of its
    /// prompt in its KV cache (a conversation stays on one worker, the same
    /// one from every router), unless that worker's load is past
    /// --cache-aware-load-margin; `p2c`: power of two choices on load alone.
    #[arg(
        long,
        env = "TOKENMESH_WORKER_CHOICE",
        value_enum,
        default_value_t = WorkerChoice::CacheAware
    )]
    pub worker_choice: WorkerChoice,

    /// Cache-aware choice: streams by which the preferred worker's load
    /// (streams in flight from this router + its reported queue) may exceed
    /// the least loaded worker's before load wins (power of two choices).
    #[arg(long, env = "TOKENMESH_CACHE_AWARE_LOAD_MARGIN", default_value_t = 4)]
    pub cache_aware_load_margin: u32,

    /// Cache-aware choice: load wins also when one more stream would take
    /// the preferred worker past this multiple of the mean load of the
    /// eligible workers, rounded up (consistent hashing with bounded loads;
    /// at least 1, or 0 for no such bound). Catches a few conversations
    /// hashed onto one worker, which the margin does not.
    #[arg(
        long,
        env = "TOKENMESH_CACHE_AWARE_LOAD_FACTOR",
        default_value_t = 1.0,
        value_parser = parse_load_factor
    )]
    pub cache_aware_load_factor: f64,

    /// Cache-aware choice: most (prompt chunk, worker) pairs the router's
    /// prefix index holds (a chunk is 128 bytes of prompt; about 100 bytes
    /// of memory each); past it the least recently used chunks are dropped.
    #[arg(
        long,
        env = "TOKENMESH_PREFIX_INDEX_ENTRIES",
        default_value_t = 1 << 18,
        value_parser = clap::value_parser!(u64).range(1..=(1 << 26))
    )]
    pub prefix_index_entries: u64,
}

/// `--cache-aware-load-factor`: 0, or a finite number of at least 1.
fn parse_load_factor(s: &str) -> Result<f64, String> {
    let f: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if f == 0.0 || (f.is_finite() && f >= 1.0) {
        Ok(f)
    } else {
        Err(format!(
            "{s} is below 1 (a worker could never take the mean load); give at least 1, or 0 for no bound"
        ))
    }
}

/// Flags of the OpenAI-compatible HTTP API.
#[derive(clap::Args, Clone, Debug)]
pub struct HttpArgs {
    /// Address of the OpenAI-compatible HTTP API (POST /v1/chat/completions,
    /// POST /v1/completions, GET /v1/models; DESIGN.md's port is 8080). Off
    /// when not given. Under --tls-dir it serves TLS with the router's
    /// certificate and requires a client certificate, unless --api-keys is
    /// given, when a certificate is optional and a request without one needs
    /// an API key.
    #[arg(long, env = "TOKENMESH_HTTP_LISTEN", value_name = "ADDR")]
    pub http_listen: Option<std::net::SocketAddr>,

    /// API keys of the HTTP API: a TOML file of [[keys]] entries with
    /// sha256 (hex SHA-256 of the key), name and role (client or operator
    /// may call). Requests then need `Authorization: Bearer KEY` (or a
    /// client certificate): 401 without a known key, 403 for another role.
    #[arg(long, env = "TOKENMESH_API_KEYS", value_name = "FILE")]
    pub api_keys: Option<PathBuf>,

    /// Largest HTTP request body, in bytes; a larger one is refused with 413
    /// before it is read.
    #[arg(long, env = "TOKENMESH_HTTP_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    pub http_max_body_bytes: usize,
}

impl RouterConfig {
    /// `--router-id`, or `<hostname>-<pid>`: unique per process and stable
    /// for its life.
    pub fn router_id(&self) -> String {
        self.router_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().replace('/', "_"))
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "router".into());
            format!("{host}-{}", std::process::id())
        })
    }

    /// Admission limits.
    pub fn admission(&self) -> crate::admission::AdmissionConfig {
        crate::admission::AdmissionConfig {
            max_in_flight: self.max_in_flight.max(1),
            max_in_flight_per_identity: self.max_in_flight_per_identity.max(1),
            max_queued: self.max_queued,
            max_queue_wait: Duration::from_millis(self.max_queue_wait_ms),
        }
    }

    /// Request-path settings: attempts, failovers, backoff, retry budget.
    pub fn routing(&self) -> crate::route::RouteSettings {
        crate::route::RouteSettings {
            max_attempts: self.max_attempts,
            max_failovers: self.max_failovers,
            backoff: tokenmesh_runtime::Backoff {
                base: Duration::from_millis(self.retry_backoff_base_ms),
                max: Duration::from_millis(self.retry_backoff_max_ms),
            },
            retry_budget: crate::route::retry_budget::RetryBudgetConfig {
                ratio: self.retry_budget_ratio,
                min_per_sec: self.retry_budget_min_per_sec,
                ttl: Duration::from_secs(self.retry_budget_ttl_s),
            },
            affinity: AffinitySettings {
                choice: self.worker_choice.worker_choice,
                load_margin: self.worker_choice.cache_aware_load_margin,
                load_factor: self.worker_choice.cache_aware_load_factor,
                index_pairs: self.worker_choice.prefix_index_entries as usize,
                ..AffinitySettings::default()
            },
            phase_spans: self.server.telemetry.trace_phases,
        }
    }

    /// Channel settings for worker connections.
    pub fn channel(&self) -> ChannelSettings {
        ChannelSettings {
            keepalive_interval: Duration::from_millis(self.keepalive_interval_ms),
            keepalive_timeout: Duration::from_millis(self.keepalive_timeout_ms),
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            status_interval: Duration::from_millis(self.status_interval_ms),
            status_poll_budget: (self.status_poll_budget > 0.0).then_some(self.status_poll_budget),
        }
    }
}

/// `--status-poll-budget`'s default: up to 200 workers are polled every
/// second, as before; past them the interval grows (1,000 workers: 5 s).
pub const DEFAULT_STATUS_POLL_BUDGET: f64 = 200.0;

/// `--status-poll-budget`: a finite number of polls per second, 0 or more.
fn parse_budget(s: &str) -> Result<f64, String> {
    let budget: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if budget.is_finite() && budget >= 0.0 {
        Ok(budget)
    } else {
        Err(format!(
            "{budget} is not a number of polls per second, 0 or more"
        ))
    }
}

/// `--retry-budget-ratio`: a finite number in 0..=1000 (what tower's
/// `TpsBudget` accepts).
fn parse_ratio(s: &str) -> Result<f32, String> {
    let ratio: f32 = s.parse().map_err(|e| format!("{e}"))?;
    if ratio.is_finite() && (0.0..=1000.0).contains(&ratio) {
        Ok(ratio)
    } else {
        Err(format!("{ratio} is not in 0..=1000"))
    }
}

/// How the router talks to workers.
#[derive(Clone, Debug)]
pub struct ChannelSettings {
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    pub connect_timeout: Duration,
    /// The shortest interval between two Status polls of one worker.
    pub status_interval: Duration,
    /// Status polls per second for all workers together; `None`: no limit.
    pub status_poll_budget: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_flags_have_small_defaults_and_are_checked() {
        let cfg = RouterConfig::try_parse_from(["tokenmesh-router"]).unwrap();
        let r = cfg.routing();
        assert_eq!(r.retry_budget, Default::default());
        assert_eq!(r.backoff.base, Duration::from_millis(10));
        assert_eq!(r.backoff.max, Duration::from_millis(200));
        for bad in [
            ["--retry-budget-ratio", "-1"],
            ["--retry-budget-ratio", "NaN"],
            ["--retry-budget-ratio", "1001"],
            ["--retry-budget-ttl-s", "0"],
            ["--retry-budget-ttl-s", "61"],
        ] {
            let parsed = RouterConfig::try_parse_from(["tokenmesh-router", bad[0], bad[1]]);
            assert!(parsed.is_err(), "{bad:?}");
        }
        let cfg = RouterConfig::try_parse_from([
            "tokenmesh-router",
            "--retry-budget-ratio",
            "0",
            "--retry-budget-min-per-sec",
            "0",
        ])
        .unwrap();
        assert_eq!(cfg.routing().retry_budget.ratio, 0.0);
    }

    #[test]
    fn the_worker_choice_defaults_to_cache_aware_and_its_flags_are_checked() {
        let cfg = RouterConfig::try_parse_from(["tokenmesh-router"]).unwrap();
        assert_eq!(cfg.routing().affinity, AffinitySettings::default());
        let cfg = RouterConfig::try_parse_from([
            "tokenmesh-router",
            "--worker-choice",
            "p2c",
            "--cache-aware-load-margin",
            "0",
            "--prefix-index-entries",
            "10",
            "--cache-aware-load-factor",
            "0",
        ])
        .unwrap();
        let a = cfg.routing().affinity;
        assert_eq!(
            (a.choice, a.load_margin, a.index_pairs, a.load_factor),
            (WorkerChoice::P2c, 0, 10, 0.0)
        );
        for bad in [
            ["--worker-choice", "random"],
            ["--prefix-index-entries", "0"],
            ["--cache-aware-load-margin", "-1"],
            ["--cache-aware-load-factor", "0.5"],
            ["--cache-aware-load-factor", "inf"],
            ["--cache-aware-load-factor", "NaN"],
        ] {
            let parsed = RouterConfig::try_parse_from(["tokenmesh-router", bad[0], bad[1]]);
            assert!(parsed.is_err(), "{bad:?}");
        }
    }
}
