//! Field checks of a `GenerateRequest` that need no model: both the router (to
//! fail fast) and the worker apply them. Model-dependent limits (context
//! window) are checked by the worker.
use crate::v1::GenerateRequest;

/// At most this many stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;

/// A request field that is out of range; the message names the field and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidField {
    /// The offending field, as named in the proto.
    pub field: &'static str,
    /// What is wrong and what is accepted.
    pub reason: String,
}

fn bad(field: &'static str, reason: impl Into<String>) -> InvalidField {
    InvalidField {
        field,
        reason: reason.into(),
    }
}

/// Checks every field that can be checked without the model.
pub fn check_request(req: &GenerateRequest) -> Result<(), InvalidField> {
    if req.model.trim().is_empty() {
        return Err(bad("model", "must name a model (ListModels shows them)"));
    }
    match (req.prompt.is_empty(), req.messages.is_empty()) {
        (true, true) => return Err(bad("prompt", "give a non-empty prompt or chat messages")),
        (false, false) => {
            return Err(bad("prompt", "give either prompt or messages, not both"));
        }
        _ => {}
    }
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(bad(
                "messages.role",
                format!(
                    "message {i} has role {:?}; use system, user, assistant or tool",
                    m.role
                ),
            ));
        }
    }
    if req.messages.iter().all(|m| m.content.is_empty()) && !req.messages.is_empty() {
        return Err(bad("messages", "every message is empty"));
    }
    if req.max_tokens == Some(0) {
        return Err(bad("max_tokens", "must be at least 1"));
    }
    if let Some(t) = req.temperature {
        if !t.is_finite() || t < 0.0 {
            return Err(bad(
                "temperature",
                format!("{t} is negative; use 0 (greedy) or more"),
            ));
        }
    }
    if let Some(p) = req.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(bad("top_p", format!("{p} is outside (0, 1]")));
        }
    }
    if let Some(r) = req.repetition_penalty {
        if !r.is_finite() || r <= 0.0 {
            return Err(bad(
                "repetition_penalty",
                format!("{r} must be positive (1 = off)"),
            ));
        }
    }
    if req.stop.len() > MAX_STOP_STRINGS {
        return Err(bad(
            "stop",
            format!(
                "{} stop strings; at most {MAX_STOP_STRINGS}",
                req.stop.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::ChatMessage;

    fn ok() -> GenerateRequest {
        GenerateRequest {
            model: "m".into(),
            prompt: "hi".into(),
            ..Default::default()
        }
    }

    #[test]
    fn accepts_a_plain_request() {
        assert_eq!(check_request(&ok()), Ok(()));
    }

    #[test]
    fn names_the_field_at_fault() {
        let cases: Vec<(GenerateRequest, &str)> = vec![
            (
                GenerateRequest {
                    prompt: "".into(),
                    ..ok()
                },
                "prompt",
            ),
            (
                GenerateRequest {
                    max_tokens: Some(0),
                    ..ok()
                },
                "max_tokens",
            ),
            (
                GenerateRequest {
                    temperature: Some(-0.5),
                    ..ok()
                },
                "temperature",
            ),
            (
                GenerateRequest {
                    top_p: Some(0.0),
                    ..ok()
                },
                "top_p",
            ),
            (
                GenerateRequest {
                    top_p: Some(1.5),
                    ..ok()
                },
                "top_p",
            ),
            (
                GenerateRequest {
                    repetition_penalty: Some(0.0),
                    ..ok()
                },
                "repetition_penalty",
            ),
            (
                GenerateRequest {
                    model: " ".into(),
                    ..ok()
                },
                "model",
            ),
            (
                GenerateRequest {
                    prompt: "".into(),
                    messages: vec![ChatMessage {
                        role: "robot".into(),
                        content: "x".into(),
                    }],
                    ..ok()
                },
                "messages.role",
            ),
        ];
        for (req, field) in cases {
            assert_eq!(check_request(&req).unwrap_err().field, field, "{req:?}");
        }
    }
}
