use clap::Parser;
use tokenmesh_router::config::RouterConfig;

fn main() -> anyhow::Result<()> {
    let cfg = RouterConfig::parse();
    cfg.server.runtime()?.block_on(async move {
        let (telemetry, listener) =
            tokenmesh_runtime::start("tokenmesh-router", &cfg.server).await?;
        let served =
            tokenmesh_router::run(cfg, listener, tokenmesh_runtime::shutdown_signal()).await;
        telemetry.shutdown().await;
        Ok(served?)
    })
}
