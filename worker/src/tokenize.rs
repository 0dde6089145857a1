//! `tokenmesh-worker tokenize`: a GGUF file's tokenizer on the command line.
//! Reads only the metadata, so vocabulary-only files (no tensors, as
//! llama.cpp's `models/ggml-vocab-*.gguf`) work as well as models.
use crate::engine::gguf_header;
use crate::engine::tokenizer::{EncodeOptions, GgufTokenizer, TokenizerError};
use crate::model_cache::{FetchError, ModelSource};
use std::io::{BufRead, Read, Write};
use std::path::PathBuf;

/// The longest input line accepted, in bytes; past it the command fails
/// rather than buffer without bound.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// Flags of the `tokenize` subcommand.
#[derive(clap::Args, Clone, Debug)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub source: ModelSource,

    /// Print one JSON object per line, {"text": ..., "ids": [...]}, instead
    /// of the ids alone.
    #[arg(long, env = "TOKENMESH_TOKENIZE_JSON")]
    pub json: bool,

    /// Add BOS/EOS where the vocabulary asks for them, as for prompts
    /// (llama.cpp's add_special); false for the text alone.
    #[arg(
        long,
        env = "TOKENMESH_TOKENIZE_ADD_SPECIAL",
        value_name = "BOOL",
        default_value = "true",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set
    )]
    pub add_special: bool,

    /// Turn control-token texts such as "<|im_start|>" into their ids, as
    /// for prompts (llama.cpp's parse_special); false spells them out.
    #[arg(
        long,
        env = "TOKENMESH_TOKENIZE_PARSE_SPECIAL",
        value_name = "BOOL",
        default_value = "true",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set
    )]
    pub parse_special: bool,
}

/// Why `tokenize` failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error("cannot read {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Gguf {
        path: PathBuf,
        source: crate::engine::gguf_header::HeaderError,
    },
    #[error("{path}: {source}")]
    Tokenizer {
        path: PathBuf,
        source: TokenizerError,
    },
    #[error("input line {line} is not valid UTF-8")]
    NotUtf8 { line: usize },
    #[error("input line {line} is longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong { line: usize },
    #[error("reading input or writing output: {0}")]
    Io(#[from] std::io::Error),
}

/// Loads the tokenizer of the GGUF file `args` names.
pub fn load(args: &TokenizeArgs) -> Result<GgufTokenizer, TokenizeError> {
    let path = args.source.resolve()?;
    let mut file = std::fs::File::open(&path).map_err(|source| TokenizeError::Open {
        path: path.clone(),
        source,
    })?;
    let content = gguf_header::read(&mut file).map_err(|source| TokenizeError::Gguf {
        path: path.clone(),
        source,
    })?;
    GgufTokenizer::from_gguf(&content).map_err(|source| TokenizeError::Tokenizer { path, source })
}

/// Tokenizes each line of `input` (without its line ending) and writes one
/// line of output for it.
pub fn run(
    tokenizer: &GgufTokenizer,
    args: &TokenizeArgs,
    mut input: impl BufRead,
    mut output: impl Write,
) -> Result<(), TokenizeError> {
    let opts = EncodeOptions {
        add_special: args.add_special,
        parse_special: args.parse_special,
    };
    let mut buf = Vec::new();
    for line in 1.. {
        buf.clear();
        let limit = MAX_LINE_BYTES as u64 + 1;
        let n = input.by_ref().take(limit).read_until(b'\n', &mut buf)?;
        if n == 0 {
            break;
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
        } else if n as u64 == limit {
            return Err(TokenizeError::LineTooLong { line });
        }
        let text = std::str::from_utf8(&buf).map_err(|_| TokenizeError::NotUtf8 { line })?;
        let ids = tokenizer
            .encode_with(text, opts)
            .map_err(|source| TokenizeError::Tokenizer {
                path: PathBuf::from("<stdin>"),
                source,
            })?;
        if args.json {
            let record = serde_json::json!({ "text": text, "ids": ids });
            writeln!(output, "{record}")?;
        } else {
            let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
            writeln!(output, "{}", ids.join(" "))?;
        }
    }
    output.flush()?;
    Ok(())
}
