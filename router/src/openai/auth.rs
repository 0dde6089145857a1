//! Who calls the HTTP API. OpenAI's clients authenticate with
//! `Authorization: Bearer KEY`; the router maps the SHA-256 of a key to an
//! identity and role from `--api-keys FILE`, so the key itself is never
//! stored. A client certificate (mutual TLS, as on the gRPC port) is an
//! identity too. Either way the identity feeds the per-identity admission
//! limits and the trace, and only the roles the gRPC API admits (`client`,
//! `operator`) may call.
//!
//! The file (TOML):
//!
//! ```toml
//! [[keys]]
//! sha256 = "…"        # echo -n "$KEY" | sha256sum
//! name = "alice"
//! role = "client"     # client or operator may call; others get 403
//! ```
use super::errors::ApiError;
use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use tokenmesh_certs::tls::{Identity, Role};
use tonic::Code;

/// The roles that may call the router (as on its gRPC port).
pub const ADMITTED: [Role; 2] = [Role::Client, Role::Operator];

/// Why the key file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ApiKeysError {
    #[error("--api-keys {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--api-keys {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("--api-keys {path}: keys[{index}]: {reason}")]
    Entry {
        path: PathBuf,
        index: usize,
        reason: String,
    },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    keys: Vec<Entry>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    sha256: String,
    name: String,
    role: String,
}

/// API keys by the SHA-256 of the key.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    by_hash: HashMap<[u8; 32], Identity>,
}

impl ApiKeys {
    /// Reads and checks `path`; the error names the entry at fault.
    pub fn load(path: &Path) -> Result<Self, ApiKeysError> {
        let text = std::fs::read_to_string(path).map_err(|source| ApiKeysError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            ParseError::Toml(message) => ApiKeysError::Parse {
                path: path.into(),
                message,
            },
            ParseError::Entry(index, reason) => ApiKeysError::Entry {
                path: path.into(),
                index,
                reason,
            },
        })
    }

    fn parse(text: &str) -> Result<Self, ParseError> {
        let file: File = toml::from_str(text).map_err(|e| ParseError::Toml(e.to_string()))?;
        let mut by_hash = HashMap::new();
        for (i, e) in file.keys.into_iter().enumerate() {
            let bad = |reason: String| ParseError::Entry(i, reason);
            let hash: [u8; 32] = hex::decode(e.sha256.trim())
                .ok()
                .and_then(|h| h.try_into().ok())
                .ok_or_else(|| {
                    bad("sha256: want 64 hex digits (echo -n \"$KEY\" | sha256sum)".into())
                })?;
            let role: Role = e.role.parse().map_err(|e| bad(format!("role: {e}")))?;
            let identity = Identity::new(role, e.name).map_err(|e| bad(format!("name: {e}")))?;
            if by_hash.insert(hash, identity).is_some() {
                return Err(bad("sha256: the same key is listed twice".into()));
            }
        }
        Ok(Self { by_hash })
    }

    /// The identity a presented key stands for.
    fn lookup(&self, key: &str) -> Option<&Identity> {
        let hash: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        self.by_hash.get(&hash)
    }

    /// How many keys the file lists.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether it lists none.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

enum ParseError {
    Toml(String),
    Entry(usize, String),
}

/// What the connection says about its peer.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    /// The peer's address.
    pub peer: SocketAddr,
    /// The identity in its verified client certificate, if it presented one
    /// (or why the certificate names none).
    pub cert: Option<Result<Identity, String>>,
}

/// The caller's identity for the admission limits and the trace, or the
/// refusal: 401 for a missing or unknown key (or a certificate naming no
/// identity), 403 for a role that may not call.
///
/// With `--api-keys`, an `Authorization` header is checked whenever it is
/// present; without one a verified client certificate is used, else the
/// request is refused. Without `--api-keys` the header is ignored (OpenAI's
/// clients always send one) and the identity is the client certificate's
/// (mutual TLS, required at the handshake) or, in plaintext, the peer's IP
/// address, as on the gRPC port.
pub fn authenticate(
    keys: Option<&ApiKeys>,
    conn: &ConnInfo,
    headers: &HeaderMap,
) -> Result<String, ApiError> {
    if let Some(keys) = keys {
        if let Some(value) = headers.get(header::AUTHORIZATION) {
            let key = value
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .ok_or_else(|| unauthenticated("Authorization: expected \"Bearer KEY\""))?;
            let identity = keys
                .lookup(key)
                .ok_or_else(|| unauthenticated("Authorization: unknown API key"))?;
            return admitted(identity);
        }
    }
    match &conn.cert {
        Some(Ok(identity)) => admitted(identity),
        Some(Err(why)) => Err(unauthenticated(&format!(
            "client certificate has no identity: {why}"
        ))),
        None if keys.is_some() => Err(unauthenticated(
            "Authorization: missing; send \"Authorization: Bearer KEY\" with a key of --api-keys",
        )),
        None => Ok(conn.peer.ip().to_string()),
    }
}

fn unauthenticated(message: &str) -> ApiError {
    ApiError::new(Code::Unauthenticated, message)
        .param("Authorization")
        .reason("invalid_api_key")
}

fn admitted(identity: &Identity) -> Result<String, ApiError> {
    if ADMITTED.contains(&identity.role) {
        return Ok(identity.to_string());
    }
    Err(ApiError::new(
        Code::PermissionDenied,
        format!(
            "{} (role {}) may not call the router: role client or operator required",
            identity.uri(),
            identity.role
        ),
    )
    .reason("permission_denied"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(key: &str) -> String {
        hex::encode(Sha256::digest(key.as_bytes()))
    }

    fn keys() -> ApiKeys {
        let text = format!(
            "[[keys]]\nsha256 = \"{}\"\nname = \"alice\"\nrole = \"client\"\n\n\
             [[keys]]\nsha256 = \"{}\"\nname = \"audit\"\nrole = \"auditor\"\n",
            sha("sk-alice"),
            sha("sk-audit")
        );
        ApiKeys::parse(&text).ok().unwrap()
    }

    fn conn() -> ConnInfo {
        ConnInfo {
            peer: "127.0.0.1:9".parse().unwrap(),
            cert: None,
        }
    }

    fn bearer(key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {key}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn a_known_key_is_its_identity_and_others_are_refused() {
        let k = keys();
        assert_eq!(k.len(), 2);
        let ok = authenticate(Some(&k), &conn(), &bearer("sk-alice")).unwrap();
        assert_eq!(ok, "client/alice");
        let e = authenticate(Some(&k), &conn(), &bearer("sk-nope")).unwrap_err();
        assert_eq!(e.status.as_u16(), 401);
        let e = authenticate(Some(&k), &conn(), &HeaderMap::new()).unwrap_err();
        assert_eq!(e.status.as_u16(), 401);
        let e = authenticate(Some(&k), &conn(), &bearer("sk-audit")).unwrap_err();
        assert_eq!(e.status.as_u16(), 403);
        assert!(e.message.contains("role auditor"), "{}", e.message);
    }

    #[test]
    fn without_a_key_file_the_header_is_ignored() {
        let id = authenticate(None, &conn(), &bearer("anything")).unwrap();
        assert_eq!(id, "127.0.0.1");
    }

    #[test]
    fn a_bad_entry_is_named() {
        let Err(ParseError::Entry(0, reason)) =
            ApiKeys::parse("[[keys]]\nsha256 = \"abc\"\nname = \"a\"\nrole = \"client\"\n")
        else {
            panic!("accepted a short hash");
        };
        assert!(reason.starts_with("sha256"), "{reason}");
        let Err(ParseError::Entry(0, reason)) = ApiKeys::parse(&format!(
            "[[keys]]\nsha256 = \"{}\"\nname = \"a\"\nrole = \"admin\"\n",
            sha("k")
        )) else {
            panic!("accepted an unknown role");
        };
        assert!(reason.starts_with("role"), "{reason}");
    }
}
