//! Typed reads of `tokenizer.ggml.*` metadata values, each failing with the
//! key it was reading and what it expected.
use super::TokenizerError;
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;

pub(super) type Metadata = HashMap<String, Value>;

pub(super) fn bad(key: &'static str, expected: &'static str) -> TokenizerError {
    TokenizerError::BadValue { key, expected }
}

/// An optional string.
pub(super) fn get_str<'a>(
    md: &'a Metadata,
    key: &'static str,
) -> Result<Option<&'a str>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(bad(key, "a string")),
    }
}

/// An optional bool.
pub(super) fn get_bool(md: &Metadata, key: &'static str) -> Result<Option<bool>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(bad(key, "a bool")),
    }
}

/// A required array of strings.
pub(super) fn get_strings<'a>(
    md: &'a Metadata,
    key: &'static str,
) -> Result<Vec<&'a str>, TokenizerError> {
    let Some(value) = md.get(key) else {
        return Err(TokenizerError::MissingKey(key));
    };
    let Value::Array(items) = value else {
        return Err(bad(key, "an array of strings"));
    };
    items
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.as_str()),
            _ => Err(bad(key, "an array of strings")),
        })
        .collect()
}

/// `tokenizer.ggml.token_type`, one per token; without it every token is an
/// ordinary piece.
pub(super) fn get_token_types(md: &Metadata, n_tokens: usize) -> Result<Vec<i32>, TokenizerError> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let Some(value) = md.get(KEY) else {
        return Ok(vec![super::TYPE_NORMAL; n_tokens]);
    };
    let Value::Array(items) = value else {
        return Err(bad(KEY, "an array of integers"));
    };
    let types = items
        .iter()
        .map(|v| as_i64(v).and_then(|n| i32::try_from(n).ok()))
        .collect::<Option<Vec<_>>>()
        .ok_or(bad(KEY, "an array of integers"))?;
    check_count(KEY, types.len(), n_tokens)?;
    Ok(types)
}

/// `tokenizer.ggml.scores`, one per token (SentencePiece merge priorities);
/// without it every score is 0, as in llama.cpp.
pub(super) fn get_scores(md: &Metadata, n_tokens: usize) -> Result<Vec<f32>, TokenizerError> {
    const KEY: &str = "tokenizer.ggml.scores";
    let Some(value) = md.get(KEY) else {
        return Ok(vec![0.0; n_tokens]);
    };
    let Value::Array(items) = value else {
        return Err(bad(KEY, "an array of numbers"));
    };
    let scores = items
        .iter()
        .map(|v| match *v {
            Value::F32(x) => Some(x),
            Value::F64(x) => Some(x as f32),
            ref v => as_i64(v).map(|n| n as f32),
        })
        .collect::<Option<Vec<_>>>()
        .ok_or(bad(KEY, "an array of numbers"))?;
    check_count(KEY, scores.len(), n_tokens)?;
    Ok(scores)
}

fn check_count(key: &'static str, found: usize, tokens: usize) -> Result<(), TokenizerError> {
    if found == tokens {
        Ok(())
    } else {
        Err(TokenizerError::Count { key, found, tokens })
    }
}

/// An optional token id; writers use various integer widths for these keys.
pub(super) fn get_u32(md: &Metadata, key: &'static str) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    as_i64(v)
        .and_then(|n| u32::try_from(n).ok())
        .map(Some)
        .ok_or(bad(key, "a non-negative 32-bit integer"))
}

fn as_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(n) => Some(i64::from(n)),
        Value::U16(n) => Some(i64::from(n)),
        Value::U32(n) => Some(i64::from(n)),
        Value::U64(n) => i64::try_from(n).ok(),
        Value::I8(n) => Some(i64::from(n)),
        Value::I16(n) => Some(i64::from(n)),
        Value::I32(n) => Some(i64::from(n)),
        Value::I64(n) => Some(n),
        _ => None,
    }
}

/// Splits a merge rule "a b" into its two halves. Searching from the second
/// character keeps a leading space part of the first half, as llama.cpp does.
pub(super) fn split_merge(rule: &str) -> Result<(String, String), TokenizerError> {
    let first_len = rule.chars().next().map_or(0, char::len_utf8);
    match rule[first_len..].find(' ') {
        Some(at) => {
            let (a, b) = rule.split_at(first_len + at);
            Ok((a.to_string(), b[1..].to_string()))
        }
        None => Err(TokenizerError::BadMerge(rule.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_rules_split_on_the_separating_space() {
        assert_eq!(
            split_merge("Ġ t").unwrap(),
            ("Ġ".to_string(), "t".to_string())
        );
        assert_eq!(
            split_merge("  x").unwrap(),
            (" ".to_string(), "x".to_string())
        );
        assert!(split_merge("nospace").is_err());
        assert!(split_merge("").is_err());
    }
}
