use anyhow::Context;
use clap::Parser;
use tokenmesh_worker::config::WorkerConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = WorkerConfig::parse();
    let _telemetry = tokenmesh_proto::telemetry::init("tokenmesh-worker", &cfg.telemetry)?;
    if let Some(n) = cfg.threads {
        // candle's CPU-side operations size their thread pool from this
        // variable (the CPU kernels get --threads directly); it must be set
        // before the model loads.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    tokenmesh_worker::run(
        cfg,
        listener,
        tokenmesh_proto::server_support::shutdown_signal(),
    )
    .await?;
    Ok(())
}
