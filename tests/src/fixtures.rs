//! Requests the suites send and what a Generate stream delivered, checked for
//! `seq` numbering on the way.
use crate::model::MODEL;
use tokenmesh_proto::v1::inference_client::InferenceClient;
use tokenmesh_proto::v1::{
    generate_response::Event, Accepted, ChatMessage, Finished, GenerateRequest, GenerateResponse,
};
use tonic::transport::Channel;
use tonic::Streaming;

/// Everything one Generate stream delivered.
#[derive(Debug, Default)]
pub struct Collected {
    /// The first message.
    pub accepted: Option<Accepted>,
    /// Every delta's text, joined.
    pub text: String,
    /// Every delta's token ids, in order.
    pub token_ids: Vec<u32>,
    /// The last message.
    pub finished: Option<Finished>,
    /// Each message's `seq`, as received.
    pub seqs: Vec<u64>,
}

/// Runs a Generate to its end and collects it; checks seq numbering.
pub async fn collect(
    client: &mut InferenceClient<Channel>,
    req: GenerateRequest,
) -> std::result::Result<Collected, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    collect_rest(&mut stream, Collected::default()).await
}

/// Reads the rest of a Generate stream into `out`, which holds what the test
/// took from it already (the `seqs` of those messages at least), and checks
/// the seq numbering of the whole stream.
pub async fn collect_rest(
    stream: &mut Streaming<GenerateResponse>,
    mut out: Collected,
) -> std::result::Result<Collected, tonic::Status> {
    while let Some(msg) = stream.message().await? {
        out.seqs.push(msg.seq);
        match msg.event {
            Some(Event::Accepted(a)) => out.accepted = Some(a),
            Some(Event::Delta(d)) => {
                out.text.push_str(&d.text);
                out.token_ids.extend(d.token_ids);
            }
            Some(Event::Finished(f)) => out.finished = Some(f),
            None => {}
        }
    }
    let expected: Vec<u64> = (0..out.seqs.len() as u64).collect();
    assert_eq!(out.seqs, expected, "seq must be 0, 1, 2, ... without gaps");
    Ok(out)
}

/// The France chat of the foundation tests, greedy.
pub fn france_request(max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        messages: vec![
            ChatMessage {
                role: "system".into(),
                content: "You are a helpful assistant.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "What is the capital of France?".into(),
            },
        ],
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// A plain prompt for `MODEL`, at the engine's default sampling.
pub fn prompt_request(prompt: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        prompt: prompt.into(),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}
