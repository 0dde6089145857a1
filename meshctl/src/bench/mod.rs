//! `meshctl bench`: the load generator, `meshctl bench sweep`, a grid of
//! configurations over processes it starts itself, and `meshctl bench chat`,
//! the multi-turn chat workload.
pub mod chat;
pub mod heatmap;
pub mod load;
pub mod openai;
pub mod report;
pub mod sweep;
pub mod transport;
pub mod workload;

use report::Format;
use std::collections::BTreeMap;
use std::io::IsTerminal;

/// Send load to a router or a worker and report throughput and latency.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchCmd {
    #[command(subcommand)]
    pub sweep: Option<SweepCmd>,
    #[command(flatten)]
    pub load: load::LoadArgs,
    /// Runs of the same load, one report each.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `meshctl bench sweep`.
#[derive(clap::Subcommand, Debug)]
pub enum SweepCmd {
    /// Start workers and a router for each point of a concurrency × max batch ×
    /// workers grid, load each, and write JSON lines and heatmaps.
    Sweep(sweep::SweepArgs),
    /// Multi-turn chat: concurrent conversations sharing a system prompt,
    /// each turn re-sending the conversation so far; TTFT per turn, load
    /// shares, and the oracle's cache hit ratio.
    Chat(chat::ChatArgs),
}

/// How results are shown.
#[derive(clap::Args, Debug, Clone)]
pub struct OutputArgs {
    /// Report format.
    #[arg(long, value_enum, default_value_t = Format::Table, global = true)]
    pub output: Format,
    /// No progress bar (it is drawn only on a terminal anyway).
    #[arg(long, global = true)]
    pub no_progress: bool,
}

impl OutputArgs {
    fn progress(&self) -> bool {
        !self.no_progress && std::io::stderr().is_terminal()
    }
}

/// Runs `meshctl bench`.
pub async fn main(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd.sweep {
        Some(SweepCmd::Sweep(args)) => return sweep::run(args, &cmd.output).await,
        Some(SweepCmd::Chat(args)) => return chat::main(args, cmd.output.output).await,
        None => {}
    }
    anyhow::ensure!(cmd.repeat >= 1, "--repeat must be at least 1");
    let mut reports = Vec::new();
    for rep in 1..=cmd.repeat {
        let run = load::run(&cmd.load, cmd.output.progress()).await?;
        let mut labels = labels(&cmd.load, &run.model);
        if cmd.repeat > 1 {
            labels.insert("rep".into(), rep.to_string());
        }
        let report = report::summarize(&run, labels);
        // JSON lines and tables go out as each run ends; Markdown is one table.
        if cmd.output.output != Format::Markdown {
            print!(
                "{}",
                report::render(std::slice::from_ref(&report), cmd.output.output)
            );
        }
        reports.push(report);
    }
    if cmd.output.output == Format::Markdown {
        print!("{}", report::render(&reports, Format::Markdown));
    }
    Ok(())
}

/// What a single run is, as report labels.
fn labels(args: &load::LoadArgs, model: &str) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    l.insert("target".into(), args.target.clone());
    let api = match (args.direct, args.api) {
        (true, _) => "worker",
        (false, load::Api::Grpc) => "router",
        (false, load::Api::Openai) if args.http2 => "openai-h2",
        (false, load::Api::Openai) => "openai",
    };
    l.insert("api".into(), api.into());
    l.insert("model".into(), model.into());
    match args.rate {
        Some(r) => l.insert("rate".into(), format!("{r}")),
        None => l.insert("concurrency".into(), args.concurrency.to_string()),
    };
    l.insert("max_tokens".into(), args.shape.max_tokens.to_string());
    l.insert("prompt_words".into(), args.shape.prompt_words.to_string());
    l
}
