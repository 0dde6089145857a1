use anyhow::Context;
use clap::Parser;
use tokenmesh_router::config::RouterConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = RouterConfig::parse();
    let _telemetry = tokenmesh_proto::telemetry::init("tokenmesh-router", &cfg.telemetry)?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    tokenmesh_router::run(
        cfg,
        listener,
        tokenmesh_proto::server_support::shutdown_signal(),
    )
    .await?;
    Ok(())
}
