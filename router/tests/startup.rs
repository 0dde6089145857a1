//! A router before its first discovery view: it must not call a real model
//! missing. With etcd away at start-up, Generate and ListModels answer
//! UNAVAILABLE (a client retries) instead of NOT_FOUND or an empty list (a
//! client gives up), and grpc.health says NOT_SERVING; with a static file the
//! view is loaded before the router serves, and it reports SERVING at once.
use clap::Parser;
use std::time::Duration;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::{GenerateRequest, ListModelsRequest};
use tokenmesh_router::config::RouterConfig;
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Starts the router with `args` on 127.0.0.1:0; a channel to it and the
/// sender that stops it.
async fn start(args: &[String]) -> (Channel, tokio::sync::oneshot::Sender<()>) {
    let mut argv = vec!["tokenmesh-router".to_string(), "--insecure".into()];
    argv.extend(args.iter().cloned());
    let cfg = RouterConfig::try_parse_from(argv).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(tokenmesh_router::run(cfg, listener, async {
        let _ = stopped.await;
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    (channel, stop)
}

/// The health of `service` ("" for the whole server), once the server answers.
async fn health(channel: &Channel, service: &str) -> ServingStatus {
    let mut client = HealthClient::new(channel.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let asked = client
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await;
        match asked {
            Ok(r) => return r.into_inner().status(),
            Err(e) if e.code() == Code::Unavailable => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "router never answered: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("health check of {service:?}: {e}"),
        }
    }
}

fn request() -> GenerateRequest {
    GenerateRequest {
        model: "m".into(),
        prompt: "hello".into(),
        max_tokens: Some(4),
        ..Default::default()
    }
}

#[tokio::test]
async fn before_its_first_etcd_snapshot_the_router_says_unavailable_not_not_found() {
    // An etcd endpoint where nothing listens: the snapshot never arrives.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (channel, _stop) = start(&["--etcd".into(), format!("http://127.0.0.1:{port}")]).await;
    assert_eq!(health(&channel, "").await, ServingStatus::NotServing);
    assert_eq!(
        health(&channel, "tokenmesh.v1.Inference").await,
        ServingStatus::NotServing
    );
    let mut client = InferenceClient::new(channel);
    let refused = client.generate(request()).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("not loaded"),
        "{}",
        refused.message()
    );
    let listed = client.list_models(ListModelsRequest {}).await.unwrap_err();
    assert_eq!(listed.code(), Code::Unavailable, "{listed:?}");
}

#[tokio::test]
async fn with_a_static_file_the_router_serves_at_once_and_unknown_models_are_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("static.toml");
    std::fs::write(
        &path,
        "[[workers]]\nid = \"w\"\nmodel = \"m\"\nversion = \"v1\"\naddr = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    let (channel, _stop) = start(&["--static".into(), path.display().to_string()]).await;
    assert_eq!(health(&channel, "").await, ServingStatus::Serving);
    assert_eq!(
        health(&channel, "tokenmesh.v1.Inference").await,
        ServingStatus::Serving
    );
    let mut client = InferenceClient::new(channel);
    let unknown = client
        .generate(GenerateRequest {
            model: "nope".into(),
            ..request()
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
    assert!(
        unknown.message().contains("available: m"),
        "{}",
        unknown.message()
    );
}
