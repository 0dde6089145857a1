//! The mTLS benchmark: what mutual TLS costs. Starts one worker and one router
//! (real processes, the real model) in plaintext and then in mTLS, and
//! measures from a client: handshakes per second (new TLS connections, no
//! request), new connections with one ListModels per second, and time to
//! the first token of a one-token Generate on a fresh connection and on a
//! reused one. Results go to stdout as a Markdown table (BENCHMARKS.md, "Cost of mutual TLS").
use anyhow::Context;
use clap::Parser;
use rustls::pki_types::ServerName;
use std::time::{Duration, Instant};
use tokenmesh_certs::{Identity, Role};
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::ListModelsRequest;
use tokenmesh_tests::*;

/// Measure the cost of mTLS against plaintext on a local router and worker.
#[derive(Parser, Debug)]
#[command(name = "tls")]
struct Args {
    /// Connections opened per connection-rate measurement.
    #[arg(long, env = "TOKENMESH_BENCH_CONNECTIONS", default_value_t = 300)]
    connections: usize,
    /// Generate calls per time-to-first-token measurement.
    #[arg(long, env = "TOKENMESH_BENCH_REQUESTS", default_value_t = 30)]
    requests: usize,
    /// Passed by `cargo bench` to every benchmark binary; nothing to do.
    #[arg(long, hide = true)]
    bench: bool,
}

struct Mesh {
    _worker: WorkerProc,
    router: RouterProc,
    _dir: tempfile::TempDir,
}

async fn mesh(pki: Option<&Pki>) -> anyhow::Result<Mesh> {
    let dir = tempfile::tempdir()?;
    let opts = WorkerOpts {
        tls: pki.map(|p| p.worker_tls("w-bench")).transpose()?,
        ..WorkerOpts::new("w-bench")
    };
    let worker = WorkerProc::start(opts, dir.path()).await?;
    let file = static_file(dir.path(), &[&worker]);
    let tls = pki.map(|p| p.router_tls("bench")).transpose()?;
    let router = RouterProc::start_tls(&["--static".into(), file], tls, dir.path()).await?;
    router
        .wait_ready_workers(MODEL, 1, Duration::from_secs(30))
        .await?;
    Ok(Mesh {
        _worker: worker,
        router,
        _dir: dir,
    })
}

/// Bare TLS handshakes per second (TCP connect + mutual-TLS handshake).
async fn handshakes_per_s(addr: &str, creds: &Creds, n: usize) -> anyhow::Result<f64> {
    let me = tokenmesh_certs::tls::MeshTls::load(&creds.dir, creds.role)?;
    let cfg = tokenmesh_certs::tls::connector::peer_client_config(
        me.store.clone(),
        me.roots.clone(),
        Identity::new(Role::Router, "router")?,
    )?;
    let connector = tokio_rustls::TlsConnector::from(cfg);
    let host = addr.trim_start_matches("http://");
    let start = Instant::now();
    for _ in 0..n {
        let tcp = tokio::net::TcpStream::connect(host).await?;
        let tls = connector
            .connect(ServerName::try_from("localhost")?, tcp)
            .await?;
        drop(tls);
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// New gRPC connections per second, each with one ListModels.
async fn connections_per_s(addr: &str, creds: Option<&Creds>, n: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    for _ in 0..n {
        let mut c = InferenceClient::new(channel(addr, creds).await?);
        c.list_models(ListModelsRequest {}).await?;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// Time from `start` to the first Delta of a one-token Generate.
async fn ttft(
    client: &mut InferenceClient<tonic::transport::Channel>,
    start: Instant,
) -> anyhow::Result<Duration> {
    let mut s = client.generate(france_request(1)).await?.into_inner();
    while let Some(m) = s.message().await? {
        if let Some(Event::Delta(_)) = m.event {
            let t = start.elapsed();
            while s.message().await?.is_some() {}
            return Ok(t);
        }
    }
    anyhow::bail!("no token")
}

fn median_p90(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    (
        ms(v[v.len() / 2]),
        ms(v[(v.len() * 9 / 10).min(v.len() - 1)]),
    )
}

struct Row {
    mode: &'static str,
    handshakes: Option<f64>,
    conns: f64,
    connect: (f64, f64),
    fresh: (f64, f64),
    reused: (f64, f64),
}

async fn measure(mode: &'static str, pki: Option<&Pki>, args: &Args) -> anyhow::Result<Row> {
    let m = mesh(pki)
        .await
        .with_context(|| format!("starting the {mode} mesh"))?;
    let (addr, creds) = (&m.router.addr, m.router.creds.as_ref());
    // Warm up the router's worker channel and the model.
    let mut reused = m.router.client().await;
    for _ in 0..3 {
        ttft(&mut reused, Instant::now()).await?;
    }
    let handshakes = match creds {
        Some(c) => Some(handshakes_per_s(addr, c, args.connections).await?),
        None => None,
    };
    let conns = connections_per_s(addr, creds, args.connections).await?;
    let mut fresh = vec![];
    let mut warm = vec![];
    let mut connect = vec![];
    for _ in 0..args.requests {
        // A fresh connection: TCP, the handshake and HTTP/2 set-up are
        // inside the measurement.
        let start = Instant::now();
        let mut c = InferenceClient::new(channel(addr, creds).await?);
        connect.push(start.elapsed());
        fresh.push(ttft(&mut c, start).await?);
        warm.push(ttft(&mut reused, Instant::now()).await?);
    }
    Ok(Row {
        mode,
        handshakes,
        conns,
        connect: median_p90(connect),
        fresh: median_p90(fresh),
        reused: median_p90(warm),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pki = Pki::new()?;
    let plain = measure("plaintext", None, &args).await?;
    let mtls = measure("mTLS", Some(&pki), &args).await?;
    println!(
        "| transport | TLS handshakes/s | new connections + 1 RPC /s | connect, median / p90 ms | TTFT fresh connection, median / p90 ms | TTFT reused connection, median / p90 ms |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in [&plain, &mtls] {
        println!(
            "| {} | {} | {:.0} | {:.2} / {:.2} | {:.1} / {:.1} | {:.1} / {:.1} |",
            r.mode,
            r.handshakes
                .map(|h| format!("{h:.0}"))
                .unwrap_or_else(|| "—".into()),
            r.conns,
            r.connect.0,
            r.connect.1,
            r.fresh.0,
            r.fresh.1,
            r.reused.0,
            r.reused.1
        );
    }
    println!(
        "\nadded by mTLS: connect {:+.2} ms, TTFT on a fresh connection {:+.1} ms, on a reused connection {:+.1} ms (medians)",
        mtls.connect.0 - plain.connect.0,
        mtls.fresh.0 - plain.fresh.0,
        mtls.reused.0 - plain.reused.0
    );
    Ok(())
}
