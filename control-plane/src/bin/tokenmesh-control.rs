use anyhow::Context;
use clap::Parser;
use tokenmesh_control::config::ControlConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = ControlConfig::parse();
    let _telemetry = tokenmesh_proto::telemetry::init("tokenmesh-control", &cfg.telemetry)?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    tokenmesh_control::run(
        cfg,
        listener,
        tokenmesh_proto::server_support::shutdown_signal(),
    )
    .await?;
    Ok(())
}
