//! Static discovery from a TOML file:
//!
//! ```toml
//! [[workers]]
//! id = "worker-1"
//! model = "smollm2-135m-instruct"
//! version = "v1"
//! addr = "http://127.0.0.1:50061"
//!
//! [models."smollm2-135m-instruct"]   # optional traffic policy
//! stable = "v1"
//! canary = { version = "v2", weight = 10 }
//! ```
use super::DiscoveryError;
use crate::registry::Registry;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use tokenmesh_proto::records::{PolicyRecord, WorkerRecord};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticFile {
    #[serde(default)]
    workers: Vec<StaticWorker>,
    #[serde(default)]
    models: BTreeMap<String, PolicyRecord>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticWorker {
    id: String,
    model: String,
    version: String,
    addr: String,
    #[serde(default)]
    capacity: Option<u32>,
    /// false for a worker whose engine cannot continue a stream from token
    /// ids (see `WorkerRecord::continues_from_token_ids`).
    #[serde(default)]
    continues_from_token_ids: Option<bool>,
}

/// Loads the file into the registry.
pub fn load(path: &Path, registry: &Registry) -> Result<(), DiscoveryError> {
    let text = std::fs::read_to_string(path).map_err(|source| DiscoveryError::Read {
        path: path.into(),
        source,
    })?;
    let parse = |message: String| DiscoveryError::Parse {
        path: path.into(),
        message,
    };
    let file: StaticFile = toml::from_str(&text).map_err(|e| parse(e.to_string()))?;
    for w in file.workers {
        let record = WorkerRecord {
            addr: w.addr,
            model_digest: String::new(),
            accelerator: "cpu".into(),
            device: String::new(),
            capacity: w.capacity.unwrap_or(1),
            labels: Default::default(),
            started_at: String::new(),
            continues_from_token_ids: w.continues_from_token_ids.unwrap_or(true),
            engine: String::new(),
            engine_model: String::new(),
        };
        registry
            .upsert_worker(&w.id, &w.model, &w.version, record)
            .map_err(|e| parse(e.to_string()))?;
    }
    for (model, policy) in file.models {
        policy
            .validate()
            .map_err(|e| parse(format!("models.{model:?}: {e}")))?;
        registry.set_policy(&model, Some(policy));
    }
    registry.mark_loaded();
    Ok(())
}
