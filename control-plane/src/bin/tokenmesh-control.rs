use tokenmesh_control::config::ControlConfig;

fn main() -> anyhow::Result<()> {
    let cfg = ControlConfig::parse_args();
    let server = cfg.server.clone();
    tokenmesh_runtime::run_server("tokenmesh-control", &server, |listener| async move {
        Ok(tokenmesh_control::run(cfg, listener, tokenmesh_runtime::shutdown_signal()).await?)
    })
}
