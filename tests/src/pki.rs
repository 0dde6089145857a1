//! A throw-away certificate authority for the suites, the credentials a test
//! client presents, and gRPC channels with or without them.
use anyhow::Result;
use std::path::PathBuf;
use tokenmesh_certs::{Ca, Identity, LeafSpec, Role};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity as TlsIdentity};

/// A test CA in a temporary directory that issues `--tls-dir` directories.
pub struct Pki {
    /// Holds the CA and every issued directory; removed when dropped.
    pub dir: tempfile::TempDir,
    pub ca: Ca,
}

impl Pki {
    /// A fresh CA.
    pub fn new() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let ca = Ca::load_or_create(dir.path())?;
        Ok(Self { dir, ca })
    }

    /// A directory `{role}-{name}` holding ca.pem, {role}.pem and {role}.key
    /// for `spiffe://tokenmesh/{role}/{name}`, valid for a day.
    pub fn issue(&self, role: Role, name: &str) -> Result<PathBuf> {
        self.issue_spec(LeafSpec::new(Identity::new(role, name)?, 1))
    }

    /// Like [`Pki::issue`] with a custom spec (validity, SANs).
    pub fn issue_spec(&self, spec: LeafSpec) -> Result<PathBuf> {
        let role = spec.identity.role;
        let dir = self
            .dir
            .path()
            .join(format!("{role}-{}", spec.identity.name));
        tokenmesh_certs::write_leaf(&dir, role.as_str(), &self.ca.issue(&spec)?, &self.ca)?;
        Ok(dir)
    }

    /// Client credentials from a directory this CA issued.
    pub fn creds(&self, role: Role, name: &str) -> Result<Creds> {
        Ok(Creds::new(self.issue(role, name)?, role))
    }

    /// A worker's `--tls-dir` (its certificate names `id`) and the router
    /// credentials the harness probes it with.
    pub fn worker_tls(&self, id: &str) -> Result<(PathBuf, Creds)> {
        Ok((
            self.issue(Role::Worker, id)?,
            self.creds(Role::Router, "probe")?,
        ))
    }

    /// A router's `--tls-dir` (named `router`) and the credentials of the
    /// client `client` the harness calls it as.
    pub fn router_tls(&self, client: &str) -> Result<(PathBuf, Creds)> {
        Ok((
            self.issue(Role::Router, "router")?,
            self.creds(Role::Client, client)?,
        ))
    }
}

/// What a test client presents: a `--tls-dir`-style directory and the role
/// whose certificate in it to use.
#[derive(Clone, Debug)]
pub struct Creds {
    /// A `--tls-dir`-style directory.
    pub dir: PathBuf,
    /// Whose `{role}.pem` and `{role}.key` in it to present.
    pub role: Role,
}

impl Creds {
    /// Credentials in `dir` for `role`.
    pub fn new(dir: PathBuf, role: Role) -> Self {
        Self { dir, role }
    }

    /// tonic's client TLS config: trusts ca.pem, presents {role}.pem.
    pub fn tls_config(&self) -> Result<ClientTlsConfig> {
        let read = |name: String| std::fs::read(self.dir.join(name));
        Ok(ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("ca.pem".into())?))
            .identity(TlsIdentity::from_pem(
                read(format!("{}.pem", self.role))?,
                read(format!("{}.key", self.role))?,
            )))
    }
}

/// A channel to `addr` (`http://host:port`): mutual TLS with `creds`, or
/// plaintext without.
pub async fn channel(addr: &str, creds: Option<&Creds>) -> Result<Channel> {
    Ok(match creds {
        Some(c) => {
            Channel::from_shared(addr.replacen("http://", "https://", 1))?
                .tls_config(c.tls_config()?)?
                .connect()
                .await?
        }
        None => Channel::from_shared(addr.to_string())?.connect().await?,
    })
}
