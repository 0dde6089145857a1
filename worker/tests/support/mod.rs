//! Start-up shared by the worker's in-process API tests.
use clap::Parser;
use std::time::Duration;
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::StatusRequest;
use tokenmesh_worker::config::WorkerConfig;
use tonic::transport::Channel;

/// A synthetic worker serving `model` on 127.0.0.1:0, started with `extra`
/// flags after `--insecure --engine synthetic --model-name MODEL`; a client
/// once its Status answers.
pub async fn synthetic_worker(model: &str, extra: &[&str]) -> WorkerClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let base = [
        "tokenmesh-worker",
        "--insecure",
        "--engine",
        "synthetic",
        "--model-name",
        model,
    ];
    let cfg = WorkerConfig::try_parse_from(base.iter().chain(extra)).unwrap();
    tokio::spawn(tokenmesh_worker::run(cfg, listener, std::future::pending()));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let mut client = WorkerClient::new(channel);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while client.status(StatusRequest {}).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "worker not serving");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client
}
