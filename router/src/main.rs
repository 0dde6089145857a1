use clap::Parser;
use tokenmesh_router::config::RouterConfig;

fn main() -> anyhow::Result<()> {
    let cfg = RouterConfig::parse();
    let server = cfg.server.clone();
    tokenmesh_runtime::run_server("tokenmesh-router", &server, |listener| async move {
        Ok(tokenmesh_router::run(cfg, listener, tokenmesh_runtime::shutdown_signal()).await?)
    })
}
