//! A real single-node etcd on free loopback ports, plaintext or with mutual TLS.
use crate::pki::{Creds, Pki};
use crate::process::{eventually, free_port, which, Proc};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokenmesh_certs::Role;

/// A single-node etcd from Debian's etcd-server package.
pub struct Etcd {
    /// The client URL, `http://` or `https://`.
    pub url: String,
    /// With TLS: what [`Etcd::client`] presents.
    pub creds: Option<Creds>,
    _proc: Proc,
    _dir: tempfile::TempDir,
}

/// etcd client options, with mutual TLS when `creds` are given.
fn etcd_options(creds: Option<&Creds>) -> Result<Option<etcd_client::ConnectOptions>> {
    Ok(match creds {
        Some(c) => Some(etcd_client::ConnectOptions::new().with_tls(c.tls_config()?)),
        None => None,
    })
}

impl Etcd {
    /// Starts etcd on free loopback ports and waits until it answers.
    pub async fn start() -> Result<Self> {
        Self::start_opts(None).await
    }

    /// Starts etcd serving `https://` and demanding client certificates of
    /// `pki`'s CA (etcd's own client-certificate auth).
    pub async fn start_tls(pki: &Pki) -> Result<Self> {
        // etcd is no mesh role: any leaf of the mesh CA with its address in
        // the SANs can serve it; a `control` leaf named etcd is used.
        let server = pki.issue(Role::Control, "etcd")?;
        let probe = pki.creds(Role::Client, "etcd-probe")?;
        Self::start_opts(Some((server, probe))).await
    }

    async fn start_opts(tls: Option<(PathBuf, Creds)>) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let (client, peer) = (free_port(), free_port());
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let args: Vec<String> = [
            "--name",
            "test",
            "--data-dir",
            &dir.path().join("data").display().to_string(),
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &format!("test={peer_url}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut args = args;
        if let Some((server, _)) = &tls {
            let f = |n: &str| server.join(n).display().to_string();
            args.extend([
                "--cert-file".into(),
                f("control.pem"),
                "--key-file".into(),
                f("control.key"),
                "--trusted-ca-file".into(),
                f("ca.pem"),
                "--client-cert-auth".into(),
            ]);
        }
        let creds = tls.map(|t| t.1);
        let etcd = which("etcd").context("etcd is not installed (apt-get install etcd-server)")?;
        let mut proc = Proc::spawn("etcd", &etcd, &args, dir.path())?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) =
                etcd_client::Client::connect([url.as_str()], etcd_options(creds.as_ref())?).await
            {
                if c.get("probe", None).await.is_ok() {
                    break;
                }
            }
            if !proc.running() || Instant::now() > deadline {
                bail!("etcd did not start:\n{}", proc.log_text());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            url,
            creds,
            _proc: proc,
            _dir: dir,
        })
    }

    /// Stops etcd (SIGKILL), as an outage.
    pub fn kill(&mut self) {
        self._proc.signal(nix::sys::signal::Signal::SIGKILL);
        let _ = self._proc.wait_exit(Duration::from_secs(5));
    }

    /// Every key under `prefix` with its value and lease id.
    pub async fn get_prefix(&self, prefix: &str) -> Vec<(String, String, i64)> {
        let resp = self
            .client()
            .await
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .expect("reading the test etcd");
        resp.kvs()
            .iter()
            .map(|kv| {
                (
                    kv.key_str().unwrap_or_default().to_string(),
                    kv.value_str().unwrap_or_default().to_string(),
                    kv.lease(),
                )
            })
            .collect()
    }

    /// Waits up to `timeout` until `key` is absent; false if it is still there.
    pub async fn wait_gone(&self, key: &str, timeout: Duration) -> bool {
        let kv = self.client().await;
        eventually(timeout, || {
            let mut kv = kv.clone();
            async move {
                kv.get(key, None)
                    .await
                    .map(|r| r.kvs().is_empty())
                    .unwrap_or(false)
            }
        })
        .await
    }

    /// A client.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect(
            [self.url.as_str()],
            etcd_options(self.creds.as_ref()).expect("etcd client credentials"),
        )
        .await
        .expect("connecting to the test etcd")
    }
}

/// One member of an [`EtcdCluster`].
struct Member {
    name: String,
    url: String,
    args: Vec<String>,
    proc: Option<Proc>,
    starts: u32,
}

/// A real three-member etcd cluster on loopback (plaintext), whose members
/// can be stopped and started again with their data.
pub struct EtcdCluster {
    members: Vec<Member>,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts three members and waits until each answers.
    pub async fn start() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let members = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                let name = format!("m{i}");
                let url = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let data = dir.path().join(&name).display().to_string();
                let args = [
                    "--name",
                    &name,
                    "--data-dir",
                    &data,
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                    "--listen-peer-urls",
                    &peer_url,
                    "--initial-advertise-peer-urls",
                    &peer_url,
                    "--initial-cluster",
                    &cluster,
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                Member {
                    name,
                    url,
                    args,
                    proc: None,
                    starts: 0,
                }
            })
            .collect();
        let mut c = Self { members, dir };
        // All three first: none answers before a quorum is up.
        for i in 0..3 {
            c.spawn(i)?;
        }
        for i in 0..3 {
            c.wait_answers(i).await?;
        }
        Ok(c)
    }

    /// Every member's client URL, comma-separated (an `--etcd` value).
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| m.url.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Stops member `i` (SIGKILL), as an outage.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.members[i].proc.take() {
            p.signal(nix::sys::signal::Signal::SIGKILL);
            let _ = p.wait_exit(Duration::from_secs(5));
        }
    }

    /// Waits until every running member answers a linearizable read, which
    /// needs a leader: after a kill, the rest have elected one.
    pub async fn wait_quorum(&mut self) -> Result<()> {
        for i in 0..self.members.len() {
            if self.members[i].proc.is_some() {
                self.wait_answers(i).await?;
            }
        }
        Ok(())
    }

    /// Starts member `i` again on its data and waits until it answers.
    pub async fn restart(&mut self, i: usize) -> Result<()> {
        self.spawn(i)?;
        self.wait_answers(i).await
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let etcd = which("etcd").context("etcd is not installed (apt-get install etcd-server)")?;
        let m = &mut self.members[i];
        m.starts += 1;
        let log = format!("etcd-{}-{}", m.name, m.starts);
        m.proc = Some(Proc::spawn(&log, &etcd, &m.args, self.dir.path())?);
        Ok(())
    }

    async fn wait_answers(&mut self, i: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let url = self.members[i].url.clone();
        loop {
            if let Ok(mut c) = etcd_client::Client::connect([url.as_str()], None).await {
                if c.get("probe", None).await.is_ok() {
                    return Ok(());
                }
            }
            let m = &mut self.members[i];
            let proc = m.proc.as_mut().context("the member is stopped")?;
            if !proc.running() || Instant::now() > deadline {
                bail!("etcd member {} did not start:\n{}", m.name, proc.log_text());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
