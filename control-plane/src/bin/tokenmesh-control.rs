use tokenmesh_control::config::ControlConfig;

fn main() -> anyhow::Result<()> {
    let cfg = ControlConfig::parse_args();
    cfg.server.runtime()?.block_on(async move {
        let (telemetry, listener) =
            tokenmesh_runtime::start("tokenmesh-control", &cfg.server).await?;
        let served =
            tokenmesh_control::run(cfg, listener, tokenmesh_runtime::shutdown_signal()).await;
        telemetry.shutdown().await;
        Ok(served?)
    })
}
