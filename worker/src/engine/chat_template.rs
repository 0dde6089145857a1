//! The model's chat template (`tokenizer.chat_template`, a Jinja template
//! written for Hugging Face transformers), rendered with minijinja.
//!
//! The environment imitates the one transformers renders with: blocks trimmed
//! (`trim_blocks`, `lstrip_blocks`), Python string/dict methods such as
//! `.strip()` available, and a `raise_exception(msg)` function that fails the
//! render. Not provided (minijinja features the workspace does not enable):
//! the `tojson` filter and `{% break %}`/`{% continue %}`, used mainly by
//! tool-calling templates; such a template fails to load or render with an error.
use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use minijinja::syntax::SyntaxConfig;
use minijinja::{context, Environment, Error, ErrorKind, Value};

/// The GGUF key holding the template.
const METADATA_KEY: &str = "tokenizer.chat_template";
/// The name the template is registered under in the environment.
const NAME: &str = "chat";

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

    /// Compiles `source`. A missing BOS/EOS text renders as an empty string,
    /// so a template that prints it does not print "none".
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
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
        env.add_template_owned(NAME, source.to_string())
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
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        let template = self.env.get_template(NAME).map_err(TemplateError::Render)?;
        template
            .render(context! {
                messages,
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

    #[test]
    fn loop_controls_are_a_compile_error() {
        let src = "{% for m in messages %}{% break %}{% endfor %}";
        assert!(matches!(
            ChatTemplate::new(src, None, None),
            Err(TemplateError::Compile(_))
        ));
    }

    #[test]
    fn template_is_shareable_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }
}
