use clap::Parser;
use tokenmesh_router::config::RouterConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = RouterConfig::parse();
    let (_telemetry, listener) = tokenmesh_runtime::start("tokenmesh-router", &cfg.server).await?;
    tokenmesh_router::run(cfg, listener, tokenmesh_runtime::shutdown_signal()).await?;
    Ok(())
}
