//! The model: GGUF weights, tokenizer and chat template, loaded once and
//! shared read-only by the engine thread and the request handlers.
pub mod backend;
pub mod candle;
pub mod chat_template;
pub mod cpu;
pub mod detokenize;
pub mod gguf_header;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod tokenizer;

pub use backend::LoadOptions;
pub use cpu::CpuKernels;

use backend::Backend;
use candle_core::Device;
use chat_template::ChatTemplate;
use kv::KvPool;
use model::{BatchSeq, ModelError, SeqStart, SeqStep, StepModel, StepOutput};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokenizer::GgufTokenizer;

/// Errors while loading a model file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Gguf {
        path: PathBuf,
        source: crate::engine::gguf_header::HeaderError,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] tokenizer::TokenizerError),
    #[error(transparent)]
    Template(#[from] chat_template::TemplateError),
}

/// Everything the worker knows about its model.
pub struct LoadedModel {
    pub backend: Backend,
    pub tokenizer: GgufTokenizer,
    /// None when the GGUF file carries no chat template.
    pub template: Option<ChatTemplate>,
    /// `general.name` from the metadata, if any.
    pub metadata_name: Option<String>,
    /// sha256 of the file, hex.
    pub digest: String,
    pub path: PathBuf,
}

impl LoadedModel {
    /// Reads and prepares a GGUF model on `device`, with every core as a
    /// compute thread on the CPU and the fastest kernels it has.
    pub fn load(path: &Path, device: &Device) -> Result<Self, LoadError> {
        Self::load_with(path, device, &LoadOptions::default())
    }

    /// Reads and prepares a GGUF model on `device`, the CPU backend set up
    /// by `opts`.
    pub fn load_with(path: &Path, device: &Device, opts: &LoadOptions) -> Result<Self, LoadError> {
        let io = |source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let digest = sha256(&mut file).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        let content = gguf_header::read(&mut file).map_err(|source| LoadError::Gguf {
            path: path.to_path_buf(),
            source,
        })?;
        // The architecture and shape first: a file the worker cannot run is
        // refused with that reason, before its tokenizer is built.
        model::LlamaConfig::from_gguf(&content)?;
        let tokenizer = GgufTokenizer::from_gguf(&content)?;
        let template =
            ChatTemplate::from_gguf(&content, tokenizer.bos_token(), tokenizer.eos_token())?;
        let metadata_name = content
            .metadata
            .get("general.name")
            .and_then(|v| v.to_string().ok())
            .cloned();
        let backend = Backend::load(&content, &mut file, device, opts)?;
        Ok(Self {
            backend,
            tokenizer,
            template,
            metadata_name,
            digest,
            path: path.to_path_buf(),
        })
    }

    /// The name the model is served under when `--model-name` is not given
    /// (see `normalize_name`).
    pub fn default_name(&self) -> String {
        normalize_name(self.metadata_name.as_deref(), &self.path)
    }
}

/// The real model as the scheduler drives it: the backend's forward pass,
/// the tokenizer's bytes and end-of-turn tokens.
impl StepModel for Arc<LoadedModel> {
    type SeqState = ();

    fn context_length(&self) -> usize {
        self.backend.config().context_length
    }

    fn eos_token_ids(&self) -> &[u32] {
        self.tokenizer.eos_token_ids()
    }

    fn token_bytes(&self, id: u32) -> &[u8] {
        self.tokenizer.token_bytes(id)
    }

    fn kv_pool(&self, budget_bytes: usize, block_size: usize) -> candle_core::Result<KvPool> {
        self.backend.kv_pool(budget_bytes, block_size)
    }

    fn start_seq(&self, _: SeqStart<'_>) {}

    fn step(
        &mut self,
        pool: &mut KvPool,
        batch: &mut [BatchSeq<'_, ()>],
    ) -> Result<StepOutput, ModelError> {
        let mut steps: Vec<SeqStep<'_>> = batch.iter_mut().map(|b| b.step.reborrow()).collect();
        Ok(self.backend.forward(pool, &mut steps)?.into())
    }
}

fn sha256(file: &mut std::fs::File) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// The name a model file is served under by default, read from the GGUF
/// header alone (no weights are loaded).
pub fn default_name_of(path: &Path) -> Result<String, LoadError> {
    let mut file = std::fs::File::open(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let content = gguf_header::read(&mut file).map_err(|source| LoadError::Gguf {
        path: path.to_path_buf(),
        source,
    })?;
    let name = content
        .metadata
        .get("general.name")
        .and_then(|v| v.to_string().ok())
        .cloned();
    Ok(normalize_name(name.as_deref(), path))
}

/// The served name: the file name up to its first dot (so the quantization
/// suffix goes: `SmolLM2-135M-Instruct.Q4_1.gguf` serves as
/// `smollm2-135m-instruct`), lower case, whitespace as dashes. File names are
/// what operators choose and see; GGUF `general.name` values are often
/// training-run labels. The metadata name is the fallback.
fn normalize_name(metadata_name: Option<&str>, path: &Path) -> String {
    let stem = path
        .file_name()
        .map(|s| {
            s.to_string_lossy()
                .split('.')
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .filter(|s| !s.trim().is_empty());
    let raw = stem
        .or_else(|| metadata_name.map(str::to_string))
        .unwrap_or_else(|| "model".into());
    raw.trim()
        .to_lowercase()
        .split(|c: char| c.is_whitespace() || c == '/')
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_name_comes_from_the_file_name() {
        let p = Path::new("/m/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert_eq!(
            normalize_name(Some("Smollm2 135M 8k"), p),
            "smollm2-135m-instruct"
        );
        assert_eq!(
            normalize_name(Some("My Model"), Path::new("/m/.gguf")),
            "my-model"
        );
    }
}
