//! Identities (DESIGN.md, "Identities"): a leaf certificate names its holder
//! with one SAN URI `spiffe://tokenmesh/{role}/{name}`.
use std::fmt;
use std::str::FromStr;
use x509_parser::extensions::GeneralName;

/// The URI scheme and trust domain every identity starts with.
pub const SPIFFE_PREFIX: &str = "spiffe://tokenmesh/";

/// What a certificate holder may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Client,
    Operator,
    Auditor,
    Router,
    Worker,
    Control,
}

impl Role {
    /// Every role, in the order of DESIGN.md.
    pub const ALL: [Role; 6] = [
        Role::Client,
        Role::Operator,
        Role::Auditor,
        Role::Router,
        Role::Worker,
        Role::Control,
    ];

    /// The role's name in identities and file names.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Operator => "operator",
            Role::Auditor => "auditor",
            Role::Router => "router",
            Role::Worker => "worker",
            Role::Control => "control",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = IdentityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| IdentityError::UnknownRole(s.to_string()))
    }
}

/// A verified peer: its role and its name within the role (for a worker, its
/// `worker_id`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub role: Role,
    pub name: String,
}

/// Why a certificate carries no usable identity.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum IdentityError {
    #[error("unknown role {0:?} (roles: client, operator, auditor, router, worker, control)")]
    UnknownRole(String),
    #[error("{0:?} is not a tokenmesh identity (want spiffe://tokenmesh/ROLE/NAME)")]
    NotTokenmesh(String),
    #[error("identity name {0:?} must be non-empty and contain no '/'")]
    BadName(String),
    #[error("certificate is not valid X.509: {0}")]
    Parse(String),
    #[error("certificate has no spiffe://tokenmesh/ROLE/NAME SAN URI")]
    Missing,
    #[error("certificate has {0} spiffe://tokenmesh SAN URIs; exactly one is allowed")]
    Ambiguous(usize),
}

impl Identity {
    /// An identity, checking the name.
    pub fn new(role: Role, name: impl Into<String>) -> Result<Self, IdentityError> {
        let name = name.into();
        if name.is_empty() || name.contains('/') {
            return Err(IdentityError::BadName(name));
        }
        Ok(Self { role, name })
    }

    /// `spiffe://tokenmesh/{role}/{name}`.
    pub fn uri(&self) -> String {
        format!("{SPIFFE_PREFIX}{}/{}", self.role, self.name)
    }

    /// Parses `spiffe://tokenmesh/{role}/{name}`.
    pub fn parse_uri(uri: &str) -> Result<Self, IdentityError> {
        let rest = uri
            .strip_prefix(SPIFFE_PREFIX)
            .ok_or_else(|| IdentityError::NotTokenmesh(uri.to_string()))?;
        let (role, name) = rest
            .split_once('/')
            .ok_or_else(|| IdentityError::NotTokenmesh(uri.to_string()))?;
        Identity::new(role.parse()?, name)
    }

    /// The identity in a DER certificate's SAN. Exactly one tokenmesh URI is
    /// allowed, so a certificate can never stand for two identities.
    pub fn from_cert_der(der: &[u8]) -> Result<Self, IdentityError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| IdentityError::Parse(e.to_string()))?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| IdentityError::Parse(e.to_string()))?;
        let uris: Vec<&str> = san
            .map(|ext| ext.value.general_names.iter())
            .into_iter()
            .flatten()
            .filter_map(|n| match n {
                GeneralName::URI(u) if u.starts_with(SPIFFE_PREFIX) => Some(*u),
                _ => None,
            })
            .collect();
        match uris.as_slice() {
            [] => Err(IdentityError::Missing),
            [one] => Identity::parse_uri(one),
            many => Err(IdentityError::Ambiguous(many.len())),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.role, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_round_trip() {
        let id = Identity::new(Role::Worker, "w-1").unwrap();
        assert_eq!(id.uri(), "spiffe://tokenmesh/worker/w-1");
        assert_eq!(Identity::parse_uri(&id.uri()).unwrap(), id);
    }

    #[test]
    fn rejects_foreign_and_malformed_uris() {
        assert!(matches!(
            Identity::parse_uri("spiffe://other/worker/w"),
            Err(IdentityError::NotTokenmesh(_))
        ));
        assert!(matches!(
            Identity::parse_uri("spiffe://tokenmesh/admin/x"),
            Err(IdentityError::UnknownRole(_))
        ));
        assert!(matches!(
            Identity::parse_uri("spiffe://tokenmesh/worker/a/b"),
            Err(IdentityError::BadName(_))
        ));
        assert!(matches!(
            Identity::parse_uri("spiffe://tokenmesh/worker/"),
            Err(IdentityError::BadName(_))
        ));
    }
}
