//! The shutdown signal a server's `main` passes to its `run`.

/// Resolves on SIGTERM or Ctrl-C: what a server's `main` passes as its
/// shutdown signal.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        // Without a SIGTERM handler, Ctrl-C still stops the server.
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
