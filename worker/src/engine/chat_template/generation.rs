//! transformers' `{% generation %}…{% endgeneration %}` tag (its
//! AssistantTracker extension marks the assistant's tokens for training
//! masks; when rendering a prompt it outputs its body unchanged). minijinja
//! has no such tag, so the source is rewritten before compiling: the tag
//! becomes `{% if true %}` and its end `{% endif %}`, which keep the same
//! whitespace control (`-`, `+`, trim_blocks, lstrip_blocks) and so render
//! the same text.
use std::borrow::Cow;

/// `source` with every generation tag replaced; borrowed when it has none.
pub fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut changed = false;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        match replace_tag(tag) {
            Some((replaced, consumed)) => {
                out.push_str(&replaced);
                rest = &tag[consumed..];
                changed = true;
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    if changed {
        Cow::Owned(out)
    } else {
        Cow::Borrowed(source)
    }
}

/// For `tag` starting with `{%`: when it is a whole generation tag, the
/// replacement and the bytes of `tag` it stands for.
fn replace_tag(tag: &str) -> Option<(String, usize)> {
    let bytes = tag.as_bytes();
    let mut i = 2;
    let open_end = if matches!(bytes.get(i), Some(b'-' | b'+')) {
        i + 1
    } else {
        i
    };
    i = open_end;
    while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    let word_start = i;
    while bytes
        .get(i)
        .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
    {
        i += 1;
    }
    let replacement = match &tag[word_start..i] {
        "generation" => "if true",
        "endgeneration" => "endif",
        _ => return None,
    };
    let word_end = i;
    while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    if matches!(bytes.get(i), Some(b'-' | b'+')) {
        i += 1;
    }
    if !tag[i..].starts_with("%}") {
        return None;
    }
    let end = i + 2;
    Some((
        format!("{}{replacement}{}", &tag[..word_start], &tag[word_end..end]),
        end,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_become_an_if_block_with_their_whitespace_control() {
        let src = "a{%- generation -%}b{% endgeneration %}c{{ generation }}";
        assert_eq!(
            rewrite_generation_tags(src),
            "a{%- if true -%}b{% endif %}c{{ generation }}"
        );
    }

    #[test]
    fn other_tags_and_plain_text_are_untouched() {
        for src in [
            "{% if generation %}x{% endif %}",
            "{% set generation = 1 %}",
            "text about generation {%",
        ] {
            assert!(
                matches!(rewrite_generation_tags(src), Cow::Borrowed(_)),
                "{src}"
            );
        }
    }
}
