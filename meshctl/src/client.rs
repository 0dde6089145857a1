//! A small Inference client for `meshctl generate` and `meshctl models`.
use anyhow::Context;
use std::io::Write;
use std::path::PathBuf;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::{
    generate_response::Event, ChatMessage, GenerateRequest, ListModelsRequest, ListModelsResponse,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// How meshctl reaches the router.
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectArgs {
    /// Router address.
    #[arg(long, env = "TOKENMESH_ROUTER", default_value = "127.0.0.1:50051")]
    pub router: String,
    /// Directory with ca.pem and {role}.pem/{role}.key for mutual TLS
    /// (default: the development certificates of `meshctl up`, if present).
    #[arg(long, env = "TOKENMESH_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Which certificate in --tls-dir to present: client or operator.
    /// `--role` is the same flag.
    #[arg(
        long,
        visible_alias = "role",
        env = "TOKENMESH_TLS_ROLE",
        default_value = "client"
    )]
    pub tls_role: String,
    /// Plaintext, for a router started with --insecure (development only).
    #[arg(long, env = "TOKENMESH_INSECURE", conflicts_with = "tls_dir")]
    pub insecure: bool,
}

/// Where `meshctl up` keeps development certificates unless told otherwise.
pub fn default_dev_certs() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".config/tokenmesh/dev-certs")
}

impl ConnectArgs {
    /// The TLS directory to use, or `None` for plaintext.
    fn tls_dir(&self) -> anyhow::Result<Option<PathBuf>> {
        resolve_tls_dir(self.tls_dir.as_deref(), self.insecure, &self.tls_role)
    }
}

/// The TLS directory for `role`: the one given, else the development
/// certificates of `meshctl up` when they hold that role's certificate;
/// `None` for plaintext.
pub fn resolve_tls_dir(
    given: Option<&std::path::Path>,
    insecure: bool,
    role: &str,
) -> anyhow::Result<Option<PathBuf>> {
    if insecure {
        return Ok(None);
    }
    if let Some(d) = given {
        return Ok(Some(d.to_path_buf()));
    }
    let dev = default_dev_certs();
    if dev.join(format!("{role}.pem")).is_file() {
        return Ok(Some(dev));
    }
    anyhow::bail!(
        "no certificates: give --tls-dir DIR (ca.pem, {role}.pem, {role}.key), run `meshctl up` once to create development certificates in {}, or --insecure for a plaintext server",
        dev.display()
    )
}

/// A gRPC channel to `addr`, over mutual TLS presenting `role`'s certificate
/// from `dir`, or plaintext when `tls` is `None`. `what` names the server in errors.
pub async fn channel(
    addr: &str,
    tls: Option<(&std::path::Path, &str)>,
    what: &str,
) -> anyhow::Result<Channel> {
    let host = addr.split("://").last().unwrap_or(addr);
    let url = match tls {
        Some(_) => format!("https://{host}"),
        None => format!("http://{host}"),
    };
    let mut endpoint = Channel::from_shared(url.clone())?;
    if let Some((dir, role)) = tls {
        let role: tokenmesh_certs::Role =
            role.parse().with_context(|| format!("--tls-role {role}"))?;
        // tokenmesh-certs' names or cert-manager's, as the servers take them.
        let paths = tokenmesh_certs::tls::TlsPaths::find(dir, role)?;
        let read = |p: &std::path::Path| {
            std::fs::read(p).with_context(|| format!("reading {}", p.display()))
        };
        endpoint = endpoint.tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(read(&paths.ca)?))
                .identity(Identity::from_pem(read(&paths.cert)?, read(&paths.key)?)),
        )?;
    }
    endpoint
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the {what} at {url}: {e}"))
}

/// Connects to a router, over mutual TLS with the certificates in `tls_dir`
/// or plaintext when it is `None`.
pub async fn connect_with(
    addr: &str,
    tls: Option<(&std::path::Path, &str)>,
) -> anyhow::Result<InferenceClient<Channel>> {
    Ok(InferenceClient::new(channel(addr, tls, "router").await?))
}

/// Connects as the command line says.
pub async fn connect(args: &ConnectArgs) -> anyhow::Result<InferenceClient<Channel>> {
    let dir = args.tls_dir()?;
    connect_with(
        &args.router,
        dir.as_deref().map(|d| (d, args.tls_role.as_str())),
    )
    .await
}

/// What `generate` asks for.
#[derive(Debug, Clone)]
pub struct GenerateArgs {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub system: Option<String>,
    pub user: Option<String>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
}

/// The model to use when none is named: the only one, or an error listing them.
pub async fn default_model(client: &mut InferenceClient<Channel>) -> anyhow::Result<String> {
    let models = client.list_models(ListModelsRequest {}).await?.into_inner();
    match models.models.as_slice() {
        [one] => Ok(one.name.clone()),
        [] => anyhow::bail!("the router knows no models yet"),
        many => anyhow::bail!(
            "several models are served; choose one with --model: {}",
            many.iter()
                .map(|m| m.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Streams a reply to `out`; returns a one-line summary.
pub async fn generate(
    client: &mut InferenceClient<Channel>,
    args: GenerateArgs,
    out: &mut impl Write,
) -> anyhow::Result<String> {
    let model = match args.model {
        Some(m) => m,
        None => default_model(client).await?,
    };
    let mut req = GenerateRequest {
        model,
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..Default::default()
    };
    match (args.prompt, args.user) {
        (Some(p), None) => req.prompt = p,
        (None, Some(u)) => {
            if let Some(s) = args.system {
                req.messages.push(ChatMessage {
                    role: "system".into(),
                    content: s,
                });
            }
            req.messages.push(ChatMessage {
                role: "user".into(),
                content: u,
            });
        }
        _ => anyhow::bail!("give a chat message (the positional argument) or --prompt, not both"),
    }
    let mut stream = client.generate(req).await?.into_inner();
    let mut worker = String::new();
    let mut version = String::new();
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(Event::Accepted(a)) => {
                worker = a.worker_id;
                version = a.version;
            }
            Some(Event::Delta(d)) => {
                write!(out, "{}", d.text)?;
                out.flush()?;
            }
            Some(Event::Finished(f)) => {
                let usage = f.usage.unwrap_or_default();
                let t = f.timings.unwrap_or_default();
                let reason = crate::render::finish_reason(f.finish_reason);
                return Ok(format!(
                    "[{reason}; {} prompt + {} completion tokens; worker {} ({version}); first token {:.0} ms, total {:.0} ms]",
                    usage.prompt_tokens, usage.completion_tokens, f.worker_id, t.time_to_first_token_ms, t.total_ms
                ));
            }
            None => {}
        }
    }
    anyhow::bail!("the stream ended without a Finished message (worker {worker})")
}

/// Lists models as a table.
pub fn models_table(resp: &ListModelsResponse) -> String {
    let mut s = format!(
        "{:<28} {:<10} {:>7} {:>6}  {}\n",
        "MODEL", "VERSION", "WEIGHT", "READY", "WORKERS"
    );
    for m in &resp.models {
        for v in &m.versions {
            s.push_str(&format!(
                "{:<28} {:<10} {:>6}% {:>6}  {}\n",
                m.name,
                v.version,
                v.weight,
                v.ready_workers,
                v.worker_ids.join(",")
            ));
        }
    }
    s
}
