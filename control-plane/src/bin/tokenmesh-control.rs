use tokenmesh_control::config::ControlConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = ControlConfig::parse_args();
    let (_telemetry, listener) = tokenmesh_runtime::start("tokenmesh-control", &cfg.server).await?;
    tokenmesh_control::run(cfg, listener, tokenmesh_runtime::shutdown_signal()).await?;
    Ok(())
}
