//! `meshctl status | canary | workers | policy`: the Control API from the
//! command line. Human tables by default, `--output json` for scripts.
use crate::client::{channel, resolve_tls_dir};
use crate::render;
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use tokenmesh_proto::v1::{self, control_client::ControlClient};
use tonic::transport::Channel;

/// How meshctl reaches the control plane.
#[derive(Args, Debug, Clone)]
pub struct ControlArgs {
    /// Control plane address.
    #[arg(
        long,
        env = "TOKENMESH_CONTROL",
        default_value = "127.0.0.1:50071",
        global = true
    )]
    pub control: String,
    /// Directory with ca.pem and {role}.pem/{role}.key for mutual TLS
    /// (default: the development certificates of `meshctl up`, if present).
    #[arg(long, env = "TOKENMESH_TLS_DIR", global = true)]
    pub tls_dir: Option<PathBuf>,
    /// Which certificate in --tls-dir to present: operator (read and write)
    /// or auditor (read only). `--role` is the same flag.
    #[arg(
        long,
        visible_alias = "role",
        env = "TOKENMESH_CONTROL_ROLE",
        default_value = "operator",
        global = true
    )]
    pub tls_role: String,
    /// Plaintext, for a control plane started with --insecure (development only).
    #[arg(
        long,
        env = "TOKENMESH_INSECURE",
        conflicts_with = "tls_dir",
        global = true
    )]
    pub insecure: bool,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table", global = true)]
    pub output: Output,
}

/// Output format of the control commands.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Table,
    Json,
}

/// `meshctl canary …`.
#[derive(Subcommand, Debug)]
pub enum CanaryCmd {
    /// Start an automated canary rollout of VERSION (the model's policy names the stable one).
    Start {
        model: String,
        version: String,
        /// Canary weight per step, comma-separated, ascending (default 5,25,50,100).
        #[arg(long, value_delimiter = ',')]
        steps: Vec<u32>,
        /// Seconds each step holds before it may advance (default: the server's).
        #[arg(long)]
        hold: Option<u32>,
        /// Requests per arm in a step before a verdict (default: the server's).
        #[arg(long)]
        min_requests: Option<u32>,
        /// Roll back when canary error rate exceeds stable's by more than this (0.02 = 2 points).
        #[arg(long)]
        max_error_rate_increase: Option<f64>,
        /// Roll back when canary TTFT p99 exceeds stable's times this.
        #[arg(long)]
        max_ttft_p99_ratio: Option<f64>,
        /// ... and by at least this many milliseconds.
        #[arg(long)]
        min_ttft_p99_increase_ms: Option<f64>,
        /// Then follow the rollout as `canary watch` does.
        #[arg(long)]
        watch: bool,
    },
    /// Finish the running rollout now: the canary becomes stable.
    Promote { model: String },
    /// Stop the running rollout now: all traffic back to stable.
    Rollback { model: String },
    /// Follow a rollout live until it ends (exit 0 when promoted, 1 when rolled back).
    Watch { model: String },
    /// Show the rollout and its decisions.
    Get { model: String },
}

/// `meshctl workers …`.
#[derive(Subcommand, Debug)]
pub enum WorkersCmd {
    /// Registered workers with their load and health as the routers see them.
    List {
        /// Only this model's workers.
        #[arg(long)]
        model: Option<String>,
    },
    /// Stop new streams to a worker from every router; in-flight streams finish, then it exits.
    Drain {
        worker_id: String,
        /// Why (stored with the drain request).
        #[arg(long, default_value = "")]
        reason: String,
    },
}

/// `meshctl policy …`.
#[derive(Subcommand, Debug)]
pub enum PolicyCmd {
    /// Show a model's traffic policy and its revision.
    Get { model: String },
    /// Change a model's traffic policy. Fields not given keep their value.
    /// The write is a compare-and-swap on the revision read (or --revision):
    /// if someone else wrote first it fails with ABORTED and exit code 4.
    Set {
        model: String,
        /// Stable version.
        #[arg(long)]
        stable: Option<String>,
        /// Canary version ("" for none).
        #[arg(long)]
        canary: Option<String>,
        /// Canary weight, percent 0..=100.
        #[arg(long)]
        weight: Option<u32>,
        /// Sticky sessions by session id.
        #[arg(long)]
        sticky: Option<bool>,
        /// Whether requests may pin a version.
        #[arg(long)]
        pin_allowed: Option<bool>,
        /// The revision your change is based on (default: the one read just now).
        #[arg(long)]
        revision: Option<i64>,
    },
}

async fn connect(args: &ControlArgs) -> anyhow::Result<ControlClient<Channel>> {
    let dir = resolve_tls_dir(args.tls_dir.as_deref(), args.insecure, &args.tls_role)?;
    let ch = channel(
        &args.control,
        dir.as_deref().map(|d| (d, args.tls_role.as_str())),
        "control plane",
    )
    .await?;
    Ok(ControlClient::new(ch))
}

fn print_json<T: serde::Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// Prints a reply as `--output` asks: `json()` pretty-printed, or `table()`.
fn print_as<T: serde::Serialize>(
    output: Output,
    json: impl FnOnce() -> T,
    table: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    match output {
        Output::Json => print_json(&json()),
        Output::Table => {
            print!("{}", table());
            Ok(())
        }
    }
}

/// `meshctl status`.
pub async fn status(args: &ControlArgs, model: Option<String>) -> anyhow::Result<()> {
    let mut c = connect(args).await?;
    let resp = c
        .mesh_status(v1::MeshStatusRequest {
            model: model.unwrap_or_default(),
        })
        .await?
        .into_inner();
    print_as(
        args.output,
        || render::status_json(&resp),
        || render::status_table(&resp),
    )
}

/// `meshctl canary …`. Returns the process exit code.
pub async fn canary(args: &ControlArgs, cmd: CanaryCmd) -> anyhow::Result<i32> {
    let mut c = connect(args).await?;
    let (rollout, watch_model) = match cmd {
        CanaryCmd::Start {
            model,
            version,
            steps,
            hold,
            min_requests,
            max_error_rate_increase,
            max_ttft_p99_ratio,
            min_ttft_p99_increase_ms,
            watch,
        } => {
            let r = c
                .start_canary(v1::StartCanaryRequest {
                    model: model.clone(),
                    canary_version: version,
                    steps,
                    hold_seconds: hold.unwrap_or(0),
                    min_requests: min_requests.unwrap_or(0),
                    max_error_rate_increase,
                    max_ttft_p99_ratio,
                    min_ttft_p99_increase_ms,
                })
                .await?
                .into_inner();
            (r, watch.then_some(model))
        }
        CanaryCmd::Promote { model } => (
            c.promote(v1::RolloutRequest { model }).await?.into_inner(),
            None,
        ),
        CanaryCmd::Rollback { model } => (
            c.rollback(v1::RolloutRequest { model }).await?.into_inner(),
            None,
        ),
        CanaryCmd::Get { model } => (
            c.get_rollout(v1::RolloutRequest { model })
                .await?
                .into_inner(),
            None,
        ),
        CanaryCmd::Watch { model } => return watch(&mut c, args.output, model).await,
    };
    if let Some(model) = watch_model {
        return watch(&mut c, args.output, model).await;
    }
    match args.output {
        Output::Json => print_json(&render::rollout_json(&rollout))?,
        Output::Table => print!("{}", render::rollout_table(&rollout)),
    }
    Ok(0)
}

/// Follows a rollout until it ends: a live view on a terminal, one JSON
/// object per change otherwise. Exit code 0 when promoted, 1 when rolled back.
async fn watch(
    c: &mut ControlClient<Channel>,
    output: Output,
    model: String,
) -> anyhow::Result<i32> {
    let mut stream = c
        .watch_rollout(v1::RolloutRequest { model })
        .await?
        .into_inner();
    let mut view = render::LiveView::new(output == Output::Table);
    let mut last = None;
    while let Some(r) = stream.message().await? {
        match output {
            Output::Json => println!("{}", serde_json::to_string(&render::rollout_json(&r))?),
            Output::Table => view.update(&r),
        }
        last = Some(r);
    }
    view.finish();
    let state = last.map(|r| r.state).unwrap_or_default();
    Ok(if state == v1::RolloutState::Promoted as i32 {
        0
    } else if state == v1::RolloutState::RolledBack as i32 {
        1
    } else {
        anyhow::bail!("the watch ended while the rollout was still running")
    })
}

/// `meshctl workers …`.
pub async fn workers(args: &ControlArgs, cmd: WorkersCmd) -> anyhow::Result<()> {
    let mut c = connect(args).await?;
    match cmd {
        WorkersCmd::List { model } => {
            let resp = c
                .list_workers(v1::ListWorkersRequest {
                    model: model.unwrap_or_default(),
                })
                .await?
                .into_inner();
            print_as(
                args.output,
                || render::workers_json(&resp),
                || render::workers_table(&resp),
            )
        }
        WorkersCmd::Drain { worker_id, reason } => {
            let resp = c
                .drain_worker(v1::DrainWorkerRequest { worker_id, reason })
                .await?
                .into_inner();
            let w = resp.worker.unwrap_or_default();
            match args.output {
                Output::Json => print_json(&render::worker_json(&w)),
                Output::Table => {
                    println!(
                        "draining {} ({} {}): {}",
                        w.worker_id, w.model, w.version, w.drain_reason
                    );
                    Ok(())
                }
            }
        }
    }
}

/// `meshctl policy …`.
pub async fn policy(args: &ControlArgs, cmd: PolicyCmd) -> anyhow::Result<()> {
    let mut c = connect(args).await?;
    let resp = match cmd {
        PolicyCmd::Get { model } => c
            .get_policy(v1::GetPolicyRequest { model })
            .await?
            .into_inner(),
        PolicyCmd::Set {
            model,
            stable,
            canary,
            weight,
            sticky,
            pin_allowed,
            revision,
        } => {
            let current = c
                .get_policy(v1::GetPolicyRequest {
                    model: model.clone(),
                })
                .await?
                .into_inner();
            let mut p = current.policy.unwrap_or(v1::TrafficPolicy {
                sticky: true,
                pin_allowed: true,
                ..Default::default()
            });
            if let Some(s) = stable {
                p.stable_version = s;
            }
            if let Some(cv) = canary {
                if cv.is_empty() {
                    p.canary_weight = 0;
                }
                p.canary_version = cv;
            }
            if let Some(w) = weight {
                p.canary_weight = w;
            }
            if let Some(s) = sticky {
                p.sticky = s;
            }
            if let Some(a) = pin_allowed {
                p.pin_allowed = a;
            }
            c.set_policy(v1::SetPolicyRequest {
                model,
                policy: Some(p),
                expected_revision: revision.unwrap_or(current.revision),
            })
            .await?
            .into_inner()
        }
    };
    print_as(
        args.output,
        || render::policy_json(&resp),
        || render::policy_table(&resp),
    )
}

/// The exit code for a failed command: scripts can tell a conflict from a
/// refusal from an outage.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    let Some(status) = e.downcast_ref::<tonic::Status>() else {
        return 1;
    };
    use tonic::Code::*;
    match status.code() {
        InvalidArgument | OutOfRange => 2,
        NotFound => 3,
        Aborted | AlreadyExists | FailedPrecondition => 4,
        Unauthenticated | PermissionDenied => 5,
        Unavailable | DeadlineExceeded => 6,
        _ => 1,
    }
}

/// What exit codes mean, for `--help`.
pub const EXIT_CODES: &str =
    "Exit codes: 0 ok; 1 other error (or a watched rollout was rolled back); \
2 invalid argument; 3 not found; 4 conflict (ABORTED: someone wrote first, read again and retry; \
ALREADY_EXISTS; FAILED_PRECONDITION); 5 not allowed (UNAUTHENTICATED, PERMISSION_DENIED); \
6 unavailable (control plane or etcd unreachable).";
