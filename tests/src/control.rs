//! Control-plane processes for the end-to-end suites.
use crate::pki::{channel, Creds};
use crate::process::{bin, free_port, transport_args, wait_serving, Proc};
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokenmesh_proto::v1::control_client::ControlClient;
use tokenmesh_proto::v1::ListWorkersRequest;
use tonic::transport::Channel;

/// A `tokenmesh-control` replica.
pub struct ControlProc {
    /// Its `--control-id`.
    pub id: String,
    /// `http://127.0.0.1:PORT` of the Control API.
    pub addr: String,
    pub proc: Proc,
    /// What the harness's own clients present (mTLS only).
    pub creds: Option<Creds>,
}

/// Options for a control-plane replica.
#[derive(Clone, Debug)]
pub struct ControlOpts {
    /// `--control-id`.
    pub id: String,
    /// `--etcd` URL.
    pub etcd: String,
    /// `--tls-dir` of the replica and the credentials the harness probes with.
    pub tls: Option<(PathBuf, Creds)>,
    /// `--election-ttl-s`: short, so that failover tests do not wait long.
    pub election_ttl_s: u64,
    /// `--analysis-interval-ms`.
    pub analysis_interval_ms: u64,
    /// Further flags, appended last.
    pub extra: Vec<String>,
}

impl ControlOpts {
    /// A plaintext replica named `id` on `etcd`, with test-speed timings.
    pub fn new(id: &str, etcd: &str) -> Self {
        Self {
            id: id.into(),
            etcd: etcd.into(),
            tls: None,
            election_ttl_s: 2,
            analysis_interval_ms: 300,
            extra: vec![],
        }
    }
}

impl ControlProc {
    /// Starts a replica and waits until it answers.
    pub async fn start(opts: ControlOpts, dir: &Path) -> Result<Self> {
        let port = free_port();
        let mut args = transport_args(opts.tls.as_ref().map(|t| t.0.as_path()));
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--etcd".into(),
            opts.etcd.clone(),
            "--control-id".into(),
            opts.id.clone(),
            "--election-ttl-s".into(),
            opts.election_ttl_s.to_string(),
            "--analysis-interval-ms".into(),
            opts.analysis_interval_ms.to_string(),
        ]);
        args.extend(opts.extra.iter().cloned());
        let mut proc = Proc::spawn(&opts.id, &bin("tokenmesh-control"), &args, dir)?;
        let addr = format!("http://127.0.0.1:{port}");
        let creds = opts.tls.as_ref().map(|t| t.1.clone());
        let what = format!("control plane {}", opts.id);
        let serving = (addr.as_str(), creds.as_ref());
        wait_serving(
            &mut proc,
            &what,
            Duration::from_secs(30),
            serving,
            |ch| async move {
                let probe = ListWorkersRequest::default();
                ControlClient::new(ch).list_workers(probe).await.is_ok()
            },
        )
        .await?;
        Ok(Self {
            id: opts.id,
            addr,
            proc,
            creds,
        })
    }

    /// A Control client with the harness's credentials.
    pub async fn client(&self) -> ControlClient<Channel> {
        self.client_as(self.creds.as_ref()).await
    }

    /// A Control client presenting `creds`.
    pub async fn client_as(&self, creds: Option<&Creds>) -> ControlClient<Channel> {
        ControlClient::new(
            channel(&self.addr, creds)
                .await
                .expect("connecting to the control plane"),
        )
    }
}
