//! A small Inference client for `meshctl generate` and `meshctl models`.
use std::io::Write;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::{
    generate_response::Event, ChatMessage, FinishReason, GenerateRequest, ListModelsRequest,
    ListModelsResponse,
};
use tonic::transport::Channel;

/// Connects to a router.
pub async fn connect(addr: &str) -> anyhow::Result<InferenceClient<Channel>> {
    let addr = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let channel = Channel::from_shared(addr.clone())?
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the router at {addr}: {e}"))?;
    Ok(InferenceClient::new(channel))
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
                let reason = FinishReason::try_from(f.finish_reason)
                    .map(|r| {
                        r.as_str_name()
                            .trim_start_matches("FINISH_REASON_")
                            .to_lowercase()
                    })
                    .unwrap_or_else(|_| "unknown".into());
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
