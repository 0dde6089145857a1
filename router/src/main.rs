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
    tokenmesh_router::run(cfg, listener, shutdown_signal()).await?;
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
