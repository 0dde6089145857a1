//! Pieces every tokenmesh server mounts the same way.
use tonic_reflection::server::{v1, v1alpha, Builder};

/// gRPC server reflection over the tokenmesh and health services, in both
/// protocol versions: grpcurl 1.8 asks for v1alpha only, newer clients for v1.
pub fn reflection() -> (
    v1::ServerReflectionServer<impl v1::ServerReflection>,
    v1alpha::ServerReflectionServer<impl v1alpha::ServerReflection>,
) {
    let builder = || {
        Builder::configure()
            .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    (
        builder()
            .build_v1()
            .expect("the embedded descriptor sets are valid"),
        builder()
            .build_v1alpha()
            .expect("the embedded descriptor sets are valid"),
    )
}

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
