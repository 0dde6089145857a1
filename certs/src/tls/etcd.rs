//! mTLS towards etcd, for clusters whose etcd demands client certificates
//! (`--client-cert-auth --trusted-ca-file`): the process presents its own
//! mesh certificate and trusts the mesh CA. Used only for `https://` etcd
//! endpoints. The files are read on every (re)connection, so a renewed
//! certificate is used from the next reconnection on.
use crate::tls::material::{TlsError, TlsPaths};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// True when any endpoint asks for TLS.
pub fn wants_tls(endpoints: &[String]) -> bool {
    endpoints.iter().any(|e| e.starts_with("https://"))
}

/// The certificate files a process presents to etcd: its own mesh TLS
/// material when it has some and an endpoint is `https://`, else none.
pub fn client_paths(tls: Option<&crate::tls::MeshTls>, endpoints: &[String]) -> Option<TlsPaths> {
    tls.filter(|_| wants_tls(endpoints))
        .map(|t| t.store.paths().clone())
}

/// The client TLS config for etcd from `paths` (etcd-client's `TlsOptions`
/// is tonic's `ClientTlsConfig`).
pub fn client_tls(paths: &TlsPaths) -> Result<ClientTlsConfig, TlsError> {
    let read = |path: &std::path::Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.into(),
            source,
        })
    };
    Ok(ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(&paths.ca)?))
        .identity(Identity::from_pem(read(&paths.cert)?, read(&paths.key)?)))
}
