//! The model's chat template (`tokenizer.chat_template`, a Jinja template
//! written for Hugging Face transformers), rendered with minijinja in the
//! environment transformers renders with (`_compile_jinja_template` in
//! transformers/utils/chat_template_utils.py):
//! - blocks trimmed (`trim_blocks`, `lstrip_blocks`), a final newline of the
//!   source dropped, `{% break %}`/`{% continue %}` (the loopcontrols
//!   extension), dicts kept in insertion order as Python's are;
//! - `tojson` as transformers overrides it (json.dumps, non-ASCII kept, its
//!   `indent`/`separators`/`sort_keys`; see [`pyjson`]);
//! - globals `raise_exception(msg)`, which fails the render with `msg`, and
//!   `strftime_now(format)`, the clock's local time formatted as Python's
//!   strftime does (the clock is injectable, for tests);
//! - Python's str/dict methods (`.strip()`, `.split()`, `.startswith()`,
//!   `.items()`, `.get()`, …) through minijinja-contrib's pycompat;
//! - `{% generation %}` (transformers' assistant-mask tag) rendering its body.
//!
//! The render passes what `apply_chat_template` passes: `messages` (each a
//! `{role, content}` dict with string content), `tools` and `documents` as
//! Python's None (not iterable, unlike minijinja's none; see [`py_none`]),
//! `add_generation_prompt`, `bos_token`, `eos_token`.
//! worker/tests/chat_templates.rs checks the output against Python's jinja2
//! on llama.cpp's collection of real templates.
use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use chrono::format::{Item, StrftimeItems};
use chrono::NaiveDateTime;
use minijinja::syntax::SyntaxConfig;
use minijinja::{context, Environment, Error, ErrorKind, Value};
use std::fmt::Write;
use std::sync::Arc;

mod generation;
mod py_none;
pub mod pyjson;

/// The GGUF key holding the template.
const METADATA_KEY: &str = "tokenizer.chat_template";
/// The name the template is registered under in the environment.
const NAME: &str = "chat";
/// `strftime_now` formats longer than this are refused (a format string
/// comes from the template, and its output is bounded by it).
const MAX_STRFTIME_FORMAT: usize = 256;

/// Why a chat template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("GGUF metadata `{METADATA_KEY}` is not a string")]
    NotAString,
    #[error("chat template does not compile: {0}")]
    Compile(#[source] Error),
    #[error("chat template failed to render: {0}")]
    Render(#[source] Error),
}

/// One message of a conversation.
#[derive(Clone, Debug)]
pub struct ChatTurn {
    /// "system", "user", "assistant", ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// The time `strftime_now` formats: Python's naive `datetime.now()`.
pub type Clock = Arc<dyn Fn() -> NaiveDateTime + Send + Sync>;

/// The local wall-clock time, as transformers' `datetime.now()`.
pub fn system_clock() -> Clock {
    Arc::new(|| chrono::Local::now().naive_local())
}

/// A compiled chat template plus the special-token texts it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Loads the template stored in the GGUF metadata; `Ok(None)` when the
    /// model has none.
    pub fn from_gguf(
        content: &Content,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Option<Self>, TemplateError> {
        match content.metadata.get(METADATA_KEY) {
            None => Ok(None),
            Some(GgufValue::String(source)) => Self::new(source, bos_token, eos_token).map(Some),
            Some(_) => Err(TemplateError::NotAString),
        }
    }

    /// Compiles `source` with the system clock. A missing BOS/EOS text
    /// renders as an empty string, so a template that prints it does not
    /// print "None".
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, TemplateError> {
        Self::with_clock(source, bos_token, eos_token, system_clock())
    }

    /// Compiles `source`; `strftime_now` reads `clock`.
    pub fn with_clock(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        clock: Clock,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks; templates
        // are written for that, and their whitespace is part of the prompt.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(TemplateError::Compile)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", move |format: String| {
            strftime(clock(), &format)
        });
        env.add_filter("tojson", pyjson::tojson);
        // minijinja iterates none (and undefined) as empty; Python does not,
        // and templates guard `tools | length` with `tools is iterable`.
        env.add_test("iterable", |v: &Value| {
            !v.is_none() && !v.is_undefined() && v.try_iter().is_ok()
        });
        env.add_test("none", py_none::test_none);
        py_none::register_sequence_filters(&mut env);
        let source = generation::rewrite_generation_tags(source).into_owned();
        env.add_template_owned(NAME, source)
            .map_err(TemplateError::Compile)?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// Renders `messages` into the prompt text; with `add_generation_prompt`
    /// the text ends with the header of the assistant's reply.
    pub fn render(
        &self,
        messages: &[ChatTurn],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        // Role before content, the order of the dicts transformers is given
        // (a template may iterate or tojson a message).
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        let template = self.env.get_template(NAME).map_err(TemplateError::Render)?;
        template
            .render(context! {
                messages,
                // apply_chat_template passes these as None when not given;
                // templates test `tools is not none`.
                tools => py_none::value(),
                documents => py_none::value(),
                add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(TemplateError::Render)
    }
}

/// transformers' `raise_exception(message)`: templates call it to reject a
/// conversation they cannot format (e.g. roles out of order).
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `now.strftime(format)`: chrono's specifiers are glibc's, which Python's
/// strftime calls on Linux. An unknown specifier is an error rather than
/// text Python would print differently.
fn strftime(now: NaiveDateTime, format: &str) -> Result<String, Error> {
    let fail = |why: &str| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now({format:?}): {why}"),
        )
    };
    if format.len() > MAX_STRFTIME_FORMAT {
        return Err(fail(&format!(
            "the format is longer than {MAX_STRFTIME_FORMAT} bytes"
        )));
    }
    let items: Vec<Item> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(fail("unsupported format specifier"));
    }
    let mut out = String::new();
    write!(out, "{}", now.format_with_items(items.iter()))
        .map_err(|_| fail("a specifier needs a time zone, which the local time has none of"))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenmesh_tests::model_path;

    fn model_template() -> ChatTemplate {
        let mut file = std::fs::File::open(model_path()).expect("open the model");
        let content = Content::read(&mut file).expect("read GGUF metadata");
        ChatTemplate::from_gguf(&content, Some("<|im_start|>"), Some("<|im_end|>"))
            .expect("the template compiles")
            .expect("the model has a template")
    }

    fn turn(role: &str, content: &str) -> ChatTurn {
        ChatTurn {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn model_template_renders_chatml() {
        let t = model_template();
        let text = t
            .render(
                &[
                    turn("system", "You are a helpful assistant."),
                    turn("user", "What is the capital of France?"),
                ],
                true,
            )
            .unwrap();
        println!("with system:\n{text:?}");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn model_template_adds_default_system_prompt() {
        let t = model_template();
        let msgs = [turn("user", "What is the capital of France?")];
        let text = t.render(&msgs, true).unwrap();
        println!("without system:\n{text:?}");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_prompt = t.render(&msgs, false).unwrap();
        assert!(no_prompt.ends_with("<|im_end|>\n"));
    }

    #[test]
    fn python_methods_and_special_tokens_are_available() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m.content.strip() | upper }}{% endfor %}{{ eos_token }}",
            Some("<s>"),
            None,
        )
        .unwrap();
        assert_eq!(t.render(&[turn("user", "  hi  ")], false).unwrap(), "<s>HI");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}",
            None,
            None,
        )
        .unwrap();
        let err = t.render(&[turn("user", "hi")], true).unwrap_err();
        assert!(matches!(err, TemplateError::Render(_)));
        assert!(err.to_string().contains("system first"), "{err}");
    }

    #[test]
    fn broken_template_is_an_error() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m.content }", None, None)
            .err()
            .expect("a syntax error");
        assert!(matches!(err, TemplateError::Compile(_)), "{err}");
    }

    fn fixed_clock() -> Clock {
        let date = chrono::NaiveDate::from_ymd_opt(2024, 7, 6).expect("a date");
        Arc::new(move || date.and_hms_opt(9, 5, 0).expect("a time"))
    }

    #[test]
    fn loop_controls_break_and_continue() {
        let src = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
                   {{ m.content }}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let msgs = [
            turn("system", "S"),
            turn("user", "a"),
            turn("assistant", "b"),
            turn("user", "c"),
        ];
        // loop.index counts the skipped system message: "b" is the third.
        assert_eq!(t.render(&msgs, false).unwrap(), "ab");
    }

    #[test]
    fn strftime_now_reads_the_clock_with_python_specifiers() {
        let src = "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%B %d, %Y') }}|{{ strftime_now('%Y-%m-%d %H:%M') }}";
        let t = ChatTemplate::with_clock(src, None, None, fixed_clock()).unwrap();
        assert_eq!(
            t.render(&[], false).unwrap(),
            "06 Jul 2024|July 06, 2024|2024-07-06 09:05"
        );
        let bad = ChatTemplate::with_clock("{{ strftime_now('%Q') }}", None, None, fixed_clock())
            .unwrap();
        let err = bad.render(&[], false).unwrap_err();
        assert!(
            err.to_string().contains("unsupported format specifier"),
            "{err}"
        );
    }

    #[test]
    fn tojson_is_json_dumps_and_messages_keep_their_key_order() {
        let src = "{{ messages[0] | tojson }}|{{ {'b': [1, 2.5], 'a': none} | tojson(indent=2) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let text = t.render(&[turn("user", "Ça \"va\"?\n")], false).unwrap();
        assert_eq!(
            text,
            "{\"role\": \"user\", \"content\": \"Ça \\\"va\\\"?\\n\"}|{\n  \"b\": [\n    1,\n    2.5\n  ],\n  \"a\": null\n}|{\"a\": 2, \"b\": 1}"
        );
    }

    #[test]
    fn tools_is_none_and_generation_tags_render_their_body() {
        let src =
            "{% if tools is not none %}tools{% endif %}{% if tools is defined %}defined{% endif %}\
                   {% if not tools %}|falsy {{ tools }} {{ documents | tojson }}|{% endif %}\
                   {%- generation -%} x {%- endgeneration %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "defined|falsy None null|x");
    }

    #[test]
    fn looping_over_absent_tools_fails_as_in_python() {
        for src in [
            "{% for t in tools %}{{ t }}{% endfor %}",
            "{{ tools | length }}",
            "{{ documents | join(', ') }}",
        ] {
            let t = ChatTemplate::new(src, None, None).unwrap();
            let err = t.render(&[], false).unwrap_err();
            assert!(matches!(err, TemplateError::Render(_)), "{src}: {err}");
        }
        let guarded = "{% if tools is iterable %}{{ tools | length }}{% else %}none{% endif %}\
                       {% if tools is none %}!{% endif %}";
        let t = ChatTemplate::new(guarded, None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "none!");
        // jinja2's sequence filters give nothing for a falsy value.
        let filtered = "{{ tools | selectattr('type', 'equalto', 'x') | list | length }}\
                        {{ tools | rejectattr('type') | list }}{{ documents | map(attribute='t') | list }}\
                        {{ tools | select | list }}{{ tools | reject('none') | list }}\
                        {{ messages | map(attribute='role') | join(',') }}";
        let t = ChatTemplate::new(filtered, None, None).unwrap();
        assert_eq!(
            t.render(&[turn("user", "a"), turn("assistant", "b")], false)
                .unwrap(),
            "0[][][][]user,assistant"
        );
    }

    #[test]
    fn template_is_shareable_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }
}
