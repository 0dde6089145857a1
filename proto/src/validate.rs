//! Field checks of a `GenerateRequest` that need no model: both the router (to
//! fail fast) and the worker apply them. Model-dependent limits (context
//! window) are checked by the worker.
//!
//! Every bound a client can hit lives here, as a constant, and README's error
//! list ("Calling the mesh") states the same numbers. Strings a client
//! chooses reach logs, spans, metric labels and etcd keys, so each is bounded
//! and a refusal never echoes a long one back.
use crate::v1::{GenerateRequest, Priority};

/// At most this many bytes in an id or a name a client chooses: `request_id`,
/// `session_id`, `model`, `version`, and in the Control API model, version
/// and worker names.
pub const MAX_NAME_BYTES: usize = 128;

/// At most this many stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;

/// At most this many bytes in one stop string.
pub const MAX_STOP_BYTES: usize = 256;

/// At most this many bytes in all stop strings of a request together.
pub const MAX_STOP_TOTAL_BYTES: usize = 1024;

/// At most this many bytes in a free-text reason an operator gives (the
/// Control API's drain reason, stored in etcd and logged).
pub const MAX_REASON_BYTES: usize = 512;

/// `temperature` is in `[0, MAX_TEMPERATURE]`; 0 is greedy.
pub const MAX_TEMPERATURE: f32 = 100.0;

/// `repetition_penalty` is in `(0, MAX_REPETITION_PENALTY]`; 1 is off.
pub const MAX_REPETITION_PENALTY: f32 = 100.0;

/// The characters of a name that becomes a segment of an etcd key (model,
/// version, worker id) and a metric label, as [`check_name`] states them.
pub const NAME_CHARSET: &str = "ASCII letters, digits and . _ - : @ +";

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

/// `s` quoted when it is short enough to show in a refusal, else its length:
/// a refusal never carries a long client string into a log line.
fn shown(s: &str) -> String {
    if s.len() <= 32 {
        format!("{s:?}")
    } else {
        format!("a string of {} bytes", s.len())
    }
}

fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':' | '@' | '+')
}

/// A name that becomes a segment of an etcd key and a metric label (model,
/// version, worker id): 1 to [`MAX_NAME_BYTES`] bytes of [`NAME_CHARSET`].
pub fn check_name(field: &'static str, name: &str) -> Result<(), InvalidField> {
    if name.is_empty() {
        return Err(bad(field, "must not be empty"));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(bad(
            field,
            format!("{} bytes; at most {MAX_NAME_BYTES}", name.len()),
        ));
    }
    if !name.chars().all(name_char) {
        return Err(bad(
            field,
            format!("{} may contain only {NAME_CHARSET}", shown(name)),
        ));
    }
    Ok(())
}

/// A client-chosen id (`request_id`, `session_id`): at most
/// [`MAX_NAME_BYTES`] bytes and no control characters (a newline would forge
/// log lines). Empty is allowed: the caller decides what empty means.
pub fn check_id(field: &'static str, id: &str) -> Result<(), InvalidField> {
    if id.len() > MAX_NAME_BYTES {
        return Err(bad(
            field,
            format!("{} bytes; at most {MAX_NAME_BYTES}", id.len()),
        ));
    }
    if id.chars().any(char::is_control) {
        return Err(bad(field, "must not contain a control character"));
    }
    Ok(())
}

/// Free text an operator gives (a drain reason): at most
/// [`MAX_REASON_BYTES`] bytes, no control characters.
pub fn check_reason(field: &'static str, text: &str) -> Result<(), InvalidField> {
    if text.len() > MAX_REASON_BYTES {
        return Err(bad(
            field,
            format!("{} bytes; at most {MAX_REASON_BYTES}", text.len()),
        ));
    }
    if text.chars().any(char::is_control) {
        return Err(bad(field, "must not contain a control character"));
    }
    Ok(())
}

/// What is wrong with a float that must be a finite number, if anything.
fn not_finite(x: f32) -> Option<&'static str> {
    if x.is_nan() {
        Some("is not a number")
    } else if x.is_infinite() {
        Some("is not finite")
    } else {
        None
    }
}

/// Checks every field that can be checked without the model.
///
/// `top_k` is not bounded: a value at or above the vocabulary size keeps
/// every token, the same as 0 (off).
pub fn check_request(req: &GenerateRequest) -> Result<(), InvalidField> {
    if req.model.trim().is_empty() {
        return Err(bad("model", "must name a model (ListModels shows them)"));
    }
    check_name("model", &req.model)?;
    if let Some(v) = req.version.as_deref().filter(|v| !v.is_empty()) {
        check_name("version", v)?;
    }
    check_id("request_id", &req.request_id)?;
    check_id("session_id", &req.session_id)?;
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
                    "message {i} has role {}; use system, user, assistant or tool",
                    shown(&m.role)
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
        let range = format!("use a value in [0, {MAX_TEMPERATURE}] (0 = greedy)");
        if let Some(what) = not_finite(t) {
            return Err(bad("temperature", format!("{t} {what}; {range}")));
        }
        if t < 0.0 {
            return Err(bad("temperature", format!("{t} is negative; {range}")));
        }
        if t > MAX_TEMPERATURE {
            return Err(bad("temperature", format!("{t} is too large; {range}")));
        }
    }
    if let Some(p) = req.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(bad("top_p", format!("{p} is outside (0, 1]")));
        }
    }
    if let Some(r) = req.repetition_penalty {
        let range = format!("use a value in (0, {MAX_REPETITION_PENALTY}] (1 = off)");
        if let Some(what) = not_finite(r) {
            return Err(bad("repetition_penalty", format!("{r} {what}; {range}")));
        }
        if r <= 0.0 || r > MAX_REPETITION_PENALTY {
            return Err(bad(
                "repetition_penalty",
                format!("{r} is outside; {range}"),
            ));
        }
    }
    check_stops(&req.stop)?;
    if Priority::try_from(req.priority).is_err() {
        return Err(bad(
            "priority",
            format!(
                "{} is not a priority; use 0 (unset: NORMAL), 1 (HIGH), 2 (NORMAL) or 3 (LOW)",
                req.priority
            ),
        ));
    }
    Ok(())
}

/// At most [`MAX_STOP_STRINGS`] non-empty stop strings of at most
/// [`MAX_STOP_BYTES`] bytes each, [`MAX_STOP_TOTAL_BYTES`] in all.
fn check_stops(stop: &[String]) -> Result<(), InvalidField> {
    if stop.len() > MAX_STOP_STRINGS {
        return Err(bad(
            "stop",
            format!("{} stop strings; at most {MAX_STOP_STRINGS}", stop.len()),
        ));
    }
    for (i, s) in stop.iter().enumerate() {
        if s.is_empty() {
            return Err(bad("stop", format!("stop string {i} is empty")));
        }
        if s.len() > MAX_STOP_BYTES {
            return Err(bad(
                "stop",
                format!(
                    "stop string {i} is {} bytes; at most {MAX_STOP_BYTES}",
                    s.len()
                ),
            ));
        }
    }
    let total: usize = stop.iter().map(String::len).sum();
    if total > MAX_STOP_TOTAL_BYTES {
        return Err(bad(
            "stop",
            format!("the stop strings are {total} bytes in all; at most {MAX_STOP_TOTAL_BYTES}"),
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
            (
                GenerateRequest {
                    temperature: Some(f32::NAN),
                    ..ok()
                },
                "temperature",
            ),
            (
                GenerateRequest {
                    temperature: Some(f32::INFINITY),
                    ..ok()
                },
                "temperature",
            ),
            (
                GenerateRequest {
                    temperature: Some(100.5),
                    ..ok()
                },
                "temperature",
            ),
            (
                GenerateRequest {
                    repetition_penalty: Some(f32::NAN),
                    ..ok()
                },
                "repetition_penalty",
            ),
            (
                GenerateRequest {
                    repetition_penalty: Some(101.0),
                    ..ok()
                },
                "repetition_penalty",
            ),
            (
                GenerateRequest {
                    priority: 4,
                    ..ok()
                },
                "priority",
            ),
            (
                GenerateRequest {
                    priority: -1,
                    ..ok()
                },
                "priority",
            ),
            (
                GenerateRequest {
                    stop: vec!["".into()],
                    ..ok()
                },
                "stop",
            ),
            (
                GenerateRequest {
                    stop: vec!["s".repeat(MAX_STOP_BYTES + 1)],
                    ..ok()
                },
                "stop",
            ),
            (
                GenerateRequest {
                    stop: vec!["s".repeat(MAX_STOP_BYTES); 5],
                    ..ok()
                },
                "stop",
            ),
            (
                GenerateRequest {
                    stop: vec!["s".into(); MAX_STOP_STRINGS + 1],
                    ..ok()
                },
                "stop",
            ),
            (
                GenerateRequest {
                    request_id: "r".repeat(MAX_NAME_BYTES + 1),
                    ..ok()
                },
                "request_id",
            ),
            (
                GenerateRequest {
                    request_id: "a\nb".into(),
                    ..ok()
                },
                "request_id",
            ),
            (
                GenerateRequest {
                    session_id: "s".repeat(1 << 20),
                    ..ok()
                },
                "session_id",
            ),
            (
                GenerateRequest {
                    model: "m".repeat(MAX_NAME_BYTES + 1),
                    ..ok()
                },
                "model",
            ),
            (
                GenerateRequest {
                    model: "a/b".into(),
                    ..ok()
                },
                "model",
            ),
            (
                GenerateRequest {
                    version: Some("v".repeat(MAX_NAME_BYTES + 1)),
                    ..ok()
                },
                "version",
            ),
            (
                GenerateRequest {
                    version: Some("v 1".into()),
                    ..ok()
                },
                "version",
            ),
        ];
        for (req, field) in cases {
            let err = check_request(&req).unwrap_err();
            assert_eq!(err.field, field, "{req:?}");
            // A refusal never echoes a long client string.
            assert!(err.to_string().len() < 200, "{err}");
        }
    }

    #[test]
    fn says_what_is_wrong_and_what_is_accepted() {
        let msg = |req: GenerateRequest| check_request(&req).unwrap_err().to_string();
        let nan = msg(GenerateRequest {
            temperature: Some(f32::NAN),
            ..ok()
        });
        assert!(
            nan.contains("not a number") && !nan.contains("negative"),
            "{nan}"
        );
        assert!(nan.contains("[0, 100]"), "{nan}");
        let inf = msg(GenerateRequest {
            temperature: Some(f32::NEG_INFINITY),
            ..ok()
        });
        assert!(
            inf.contains("not finite") && !inf.contains("negative"),
            "{inf}"
        );
        let rp = msg(GenerateRequest {
            repetition_penalty: Some(f32::INFINITY),
            ..ok()
        });
        assert!(rp.contains("not finite") && rp.contains("(0, 100]"), "{rp}");
        let prio = msg(GenerateRequest {
            priority: 9,
            ..ok()
        });
        assert!(
            prio.contains('9') && prio.contains("HIGH") && prio.contains("LOW"),
            "{prio}"
        );
        let long = msg(GenerateRequest {
            request_id: "r".repeat(1 << 20),
            ..ok()
        });
        assert_eq!(long, "request_id: 1048576 bytes; at most 128");
        let role = msg(GenerateRequest {
            prompt: "".into(),
            messages: vec![ChatMessage {
                role: "r".repeat(1 << 20),
                content: "x".into(),
            }],
            ..ok()
        });
        assert!(role.contains("a string of 1048576 bytes"), "{role}");
    }

    #[test]
    fn accepts_every_value_at_its_bound() {
        let at_bounds = GenerateRequest {
            model: "m".repeat(MAX_NAME_BYTES),
            version: Some("v1.2_rc-3:x@y+z".into()),
            request_id: "r".repeat(MAX_NAME_BYTES),
            session_id: "s s".into(),
            temperature: Some(MAX_TEMPERATURE),
            repetition_penalty: Some(MAX_REPETITION_PENALTY),
            top_k: Some(u32::MAX),
            stop: vec!["s".repeat(MAX_STOP_BYTES); MAX_STOP_TOTAL_BYTES / MAX_STOP_BYTES],
            priority: Priority::Low as i32,
            ..ok()
        };
        assert_eq!(check_request(&at_bounds), Ok(()));
        assert_eq!(
            check_request(&GenerateRequest {
                temperature: Some(0.0),
                stop: vec!["x".into(); MAX_STOP_STRINGS],
                ..ok()
            }),
            Ok(())
        );
    }

    #[test]
    fn names_are_etcd_key_segments() {
        for good in ["smollm2-135m-instruct", "v1", "worker-1", "a.b_c:d@e+f"] {
            assert_eq!(check_name("model", good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "a/b",
            "a b",
            "a\nb",
            "é",
            &"n".repeat(MAX_NAME_BYTES + 1),
        ] {
            assert!(check_name("model", bad).is_err(), "{bad:?}");
        }
        assert!(check_reason("reason", &"r".repeat(MAX_REASON_BYTES)).is_ok());
        assert!(check_reason("reason", &"r".repeat(MAX_REASON_BYTES + 1)).is_err());
        assert!(check_reason("reason", "line\nforged").is_err());
    }
}
