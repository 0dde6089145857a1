//! What a server's `main` does before it calls the process's `run`.
use crate::args::ServerArgs;
use crate::telemetry::{TelemetryError, TelemetryGuard};
use std::future::Future;
use std::net::SocketAddr;
use tokio::net::TcpListener;

/// Why a server could not get as far as `run`.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Telemetry(#[from] TelemetryError),
    #[error("binding --listen {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Starts telemetry as `service` and binds `--listen`. Keep the guard for
/// the life of the process: dropping it flushes the trace exporter.
pub async fn start<const PORT: u16>(
    service: &str,
    args: &ServerArgs<PORT>,
) -> Result<(TelemetryGuard, TcpListener), StartError> {
    let telemetry = crate::telemetry::init(service, &args.telemetry)?;
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|source| StartError::Bind {
            addr: args.listen,
            source,
        })?;
    Ok((telemetry, listener))
}

/// A server binary's whole `main`: builds the runtime `--runtime-threads`
/// asks for, starts telemetry as `service`, binds `--listen`, runs `serve`
/// with the listener until it returns, then flushes telemetry while the
/// runtime still runs (on the single-threaded scheduler nothing else would
/// drive the exporter's connection).
pub fn run_server<const PORT: u16, E, Fut>(
    service: &str,
    args: &ServerArgs<PORT>,
    serve: impl FnOnce(TcpListener) -> Fut,
) -> Result<(), E>
where
    Fut: Future<Output = Result<(), E>>,
    E: From<StartError> + From<std::io::Error>,
{
    args.runtime()?.block_on(async {
        let (telemetry, listener) = start(service, args).await?;
        let served = serve(listener).await;
        telemetry.shutdown().await;
        served
    })
}
