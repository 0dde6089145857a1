//! Command-line configuration of `tokenmesh-control`.
use clap::{CommandFactory, Parser};
use std::time::Duration;
use tokenmesh_runtime::ServerArgs;

/// The tokenmesh control plane: traffic policy, canary rollouts with automated
/// analysis, and worker operations, all stored in etcd (--etcd is required).
/// With --tls-dir (control.pem, control.key), callers need an operator (read
/// and write) or auditor (read) certificate; with --insecure every caller may
/// write.
#[derive(Parser, Clone, Debug)]
#[command(name = "tokenmesh-control", version)]
pub struct ControlConfig {
    #[command(flatten)]
    pub server: ServerArgs<50071>,

    /// This replica's name in the leader election and in decision records
    /// (default: hostname and process id).
    #[arg(long, env = "TOKENMESH_CONTROL_ID")]
    pub control_id: Option<String>,

    /// Lease TTL of the leader election, in seconds: a dead leader is replaced
    /// within this time.
    #[arg(long, env = "TOKENMESH_ELECTION_TTL_S", default_value_t = 10)]
    pub election_ttl_s: u64,

    /// How often the leader analyses running rollouts, in milliseconds.
    #[arg(long, env = "TOKENMESH_ANALYSIS_INTERVAL_MS", default_value_t = 5_000)]
    pub analysis_interval_ms: u64,

    /// Default hold time of each rollout step, in seconds.
    #[arg(long, env = "TOKENMESH_DEFAULT_HOLD_S", default_value_t = 60)]
    pub default_hold_s: u32,

    /// Default minimum requests per arm in a step before a verdict.
    #[arg(long, env = "TOKENMESH_DEFAULT_MIN_REQUESTS", default_value_t = 100)]
    pub default_min_requests: u32,

    /// Default rollback threshold: canary error rate above stable's by more
    /// than this (absolute; 0.02 = 2 percentage points).
    #[arg(
        long,
        env = "TOKENMESH_DEFAULT_MAX_ERROR_RATE_INCREASE",
        default_value_t = 0.02
    )]
    pub default_max_error_rate_increase: f64,

    /// Default rollback threshold: canary TTFT p99 above stable's times this.
    #[arg(
        long,
        env = "TOKENMESH_DEFAULT_MAX_TTFT_P99_RATIO",
        default_value_t = 1.5
    )]
    pub default_max_ttft_p99_ratio: f64,

    /// Default rollback threshold: ... and above it by at least this many
    /// milliseconds (keeps a few ms of noise on a fast model from failing a rollout).
    #[arg(
        long,
        env = "TOKENMESH_DEFAULT_MIN_TTFT_P99_INCREASE_MS",
        default_value_t = 50.0
    )]
    pub default_min_ttft_p99_increase_ms: f64,

    /// Window over which `MeshStatus` computes rates, in seconds.
    #[arg(long, env = "TOKENMESH_STATUS_WINDOW_S", default_value_t = 60)]
    pub status_window_s: u64,
}

impl ControlConfig {
    /// Parses the command line, exiting with clap's usage error when --etcd
    /// is missing (it is shared with binaries for which it is optional, and
    /// required here: all state lives in etcd).
    pub fn parse_args() -> Self {
        let cfg = Self::parse();
        if cfg.server.etcd.is_empty() {
            Self::command()
                .error(
                    clap::error::ErrorKind::MissingRequiredArgument,
                    "--etcd <URL[,URL...]> is required: the control plane keeps all its state in etcd",
                )
                .exit();
        }
        cfg
    }

    /// This replica's id.
    pub fn id(&self) -> String {
        self.control_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "control".into());
            format!("{host}-{}", std::process::id())
        })
    }

    /// The analysis period.
    pub fn analysis_interval(&self) -> Duration {
        Duration::from_millis(self.analysis_interval_ms.max(50))
    }

    /// Rollout defaults for requests that leave fields unset.
    pub fn rollout_defaults(&self) -> crate::rollout::RolloutDefaults {
        crate::rollout::RolloutDefaults {
            steps: vec![5, 25, 50, 100],
            hold_s: self.default_hold_s,
            min_requests: self.default_min_requests,
            max_error_rate_increase: self.default_max_error_rate_increase,
            max_ttft_p99_ratio: self.default_max_ttft_p99_ratio,
            min_ttft_p99_increase_ms: self.default_min_ttft_p99_increase_ms,
        }
    }
}
