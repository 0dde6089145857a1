//! `tokenmesh-certs`: issue, list and renew the mesh's certificates.
use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use std::net::IpAddr;
use std::path::PathBuf;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tokenmesh_certs::{Ca, Identity, LeafSpec, Role, DEFAULT_LEAF_DAYS};

/// Certificates for a tokenmesh: one CA and a leaf per role with the SAN URI
/// spiffe://tokenmesh/{role}/{name}. A directory written here is what the
/// servers' --tls-dir expects: ca.pem, {role}.pem, {role}.key (keys 0600).
#[derive(Parser, Debug)]
#[command(name = "tokenmesh-certs", version)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Issue a leaf certificate (creating the CA in --ca-dir if there is none).
    Issue(IssueArgs),
    /// List the certificates in a directory: subject, SANs, validity.
    List {
        /// Directory to list.
        #[arg(long, env = "TOKENMESH_TLS_DIR")]
        dir: PathBuf,
    },
    /// Re-issue certificates in a directory with the same identity and SANs,
    /// a new key and a new validity. Running servers pick them up on their own.
    Renew {
        /// Directory holding {role}.pem and {role}.key.
        #[arg(long, env = "TOKENMESH_TLS_DIR")]
        dir: PathBuf,
        /// Directory holding ca.pem and ca.key (default: --dir).
        #[arg(long, env = "TOKENMESH_CA_DIR")]
        ca_dir: Option<PathBuf>,
        /// Renew only this role's certificate (default: every leaf in --dir).
        #[arg(long)]
        role: Option<Role>,
        /// Validity of the renewed certificates, in days.
        #[arg(long, env = "TOKENMESH_CERT_DAYS", default_value_t = DEFAULT_LEAF_DAYS)]
        days: i64,
    },
}

#[derive(clap::Args, Debug)]
struct IssueArgs {
    /// Directory to write {role}.pem, {role}.key and ca.pem into.
    #[arg(long, env = "TOKENMESH_TLS_DIR")]
    dir: PathBuf,
    /// Directory holding ca.pem and ca.key, created there if absent (default: --dir).
    #[arg(long, env = "TOKENMESH_CA_DIR")]
    ca_dir: Option<PathBuf>,
    /// Role: client, operator, auditor, router, worker or control.
    #[arg(long)]
    role: Role,
    /// Name within the role (for a worker: its worker_id; default: the role's name).
    #[arg(long)]
    name: Option<String>,
    /// Extra DNS SAN (repeatable).
    #[arg(long = "dns", value_name = "NAME")]
    dns: Vec<String>,
    /// Extra IP SAN (repeatable).
    #[arg(long = "ip", value_name = "ADDR")]
    ips: Vec<IpAddr>,
    /// Leave out the default SANs localhost and 127.0.0.1.
    #[arg(long)]
    no_default_sans: bool,
    /// Validity in days from now.
    #[arg(long, env = "TOKENMESH_CERT_DAYS", default_value_t = DEFAULT_LEAF_DAYS)]
    days: i64,
    /// Start of validity, RFC 3339 (overrides the default of now).
    #[arg(long, value_parser = parse_time)]
    not_before: Option<OffsetDateTime>,
    /// End of validity, RFC 3339 (overrides --days; a past time issues an
    /// already-expired certificate, for tests).
    #[arg(long, value_parser = parse_time)]
    not_after: Option<OffsetDateTime>,
}

fn parse_time(s: &str) -> Result<OffsetDateTime, String> {
    OffsetDateTime::parse(s, &Rfc3339).map_err(|e| format!("{s:?} is not RFC 3339: {e}"))
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Issue(a) => issue(a),
        Cmd::List { dir } => {
            let certs = tokenmesh_certs::list(&dir)
                .with_context(|| format!("listing {}", dir.display()))?;
            for c in certs {
                let name = c.path.file_name().unwrap_or_default().to_string_lossy();
                let state = if c.expired() { "EXPIRED" } else { "valid" };
                println!(
                    "{name}: {}{}\n  subject: {}\n  SAN: {}\n  valid: {} .. {} ({state})",
                    c.identity.map(|i| i.uri()).unwrap_or_default(),
                    if c.is_ca { "CA" } else { "" },
                    c.subject,
                    c.sans.join(", "),
                    c.not_before.format(&Rfc3339)?,
                    c.not_after.format(&Rfc3339)?,
                );
            }
            Ok(())
        }
        Cmd::Renew {
            dir,
            ca_dir,
            role,
            days,
        } => {
            let ca = Ca::load(ca_dir.as_ref().unwrap_or(&dir))?;
            let stems: Vec<String> = match role {
                Some(r) => vec![r.to_string()],
                None => Role::ALL
                    .iter()
                    .map(|r| r.to_string())
                    .filter(|s| dir.join(format!("{s}.pem")).exists())
                    .collect(),
            };
            if stems.is_empty() {
                bail!("no leaf certificates ({{role}}.pem) in {}", dir.display());
            }
            for stem in stems {
                let id = tokenmesh_certs::renew(&ca, &dir, &stem, days)?;
                println!(
                    "renewed {} ({})",
                    dir.join(format!("{stem}.pem")).display(),
                    id.uri()
                );
            }
            Ok(())
        }
    }
}

fn issue(a: IssueArgs) -> anyhow::Result<()> {
    let name = match (a.name, a.role) {
        (Some(n), _) => n,
        (None, Role::Worker) => {
            bail!("--name is required for a worker: it is the worker's --worker-id")
        }
        (None, r) => r.to_string(),
    };
    let ca = Ca::load_or_create(a.ca_dir.as_ref().unwrap_or(&a.dir))?;
    let mut spec = LeafSpec::new(Identity::new(a.role, name)?, a.days);
    if a.no_default_sans {
        spec.dns.clear();
        spec.ips.clear();
    }
    spec.dns.extend(a.dns);
    spec.ips.extend(a.ips);
    if let Some(t) = a.not_before {
        spec.not_before = t;
    }
    if let Some(t) = a.not_after {
        spec.not_after = t;
    }
    let issued = ca.issue(&spec)?;
    // Worker files are always worker.pem/worker.key: the name lives in the SAN.
    tokenmesh_certs::write_leaf(&a.dir, a.role.as_str(), &issued, &ca)?;
    println!(
        "issued {} -> {}",
        spec.identity.uri(),
        a.dir.join(format!("{}.pem", a.role)).display()
    );
    Ok(())
}
