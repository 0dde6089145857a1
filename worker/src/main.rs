use clap::Parser;
use tokenmesh_worker::config::{WorkerCommand, WorkerConfig};

fn main() -> anyhow::Result<()> {
    let cfg = WorkerConfig::parse();
    if let Some(WorkerCommand::Tokenize(args)) = &cfg.command {
        let tokenizer = tokenmesh_worker::tokenize::load(args)?;
        let stdin = std::io::stdin().lock();
        let stdout = std::io::BufWriter::new(std::io::stdout().lock());
        tokenmesh_worker::tokenize::run(&tokenizer, args, stdin, stdout)?;
        return Ok(());
    }
    if let Some(n) = cfg.threads {
        // candle's CPU-side operations size their thread pool from this
        // variable (the CPU kernels get --threads directly); it must be set
        // before the model loads, and before any other thread exists.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let server = cfg.server.clone();
    tokenmesh_runtime::run_server("tokenmesh-worker", &server, |listener| async move {
        Ok(tokenmesh_worker::run(cfg, listener, tokenmesh_runtime::shutdown_signal()).await?)
    })
}
