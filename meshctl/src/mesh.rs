//! What `meshctl up` and `meshctl bench sweep` share when they start a mesh
//! of processes: the model it serves, the static discovery file for the
//! workers they started, and the wait until the router sees them all ready.
use crate::children::Children;
use anyhow::bail;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokenmesh_proto::v1::ListModelsRequest;
use tokenmesh_worker::model_cache::ModelSource;

/// The model file (fetching the default model on first use) and the name it
/// is served under.
pub async fn model(source: &ModelSource) -> anyhow::Result<(PathBuf, String)> {
    let source = source.clone();
    let path = tokio::task::spawn_blocking(move || source.resolve()).await??;
    let name = tokenmesh_worker::engine::default_name_of(&path)?;
    Ok((path, name))
}

/// A worker as the router's static discovery file lists it.
pub struct StaticWorker {
    pub id: String,
    pub port: u16,
    /// Its batch capacity, for the router's load estimate (None: 1).
    pub capacity: Option<u32>,
}

/// The static discovery file: every worker serves `model` version v1, the
/// stable version.
pub fn static_discovery(model: &str, workers: &[StaticWorker]) -> String {
    let mut toml = String::new();
    for w in workers {
        let _ = writeln!(
            toml,
            "[[workers]]\nid = \"{}\"\nmodel = \"{model}\"\nversion = \"v1\"\naddr = \"http://127.0.0.1:{}\"",
            w.id, w.port
        );
        if let Some(c) = w.capacity {
            let _ = writeln!(toml, "capacity = {c}");
        }
        toml.push('\n');
    }
    let _ = writeln!(toml, "[models.\"{model}\"]\nstable = \"v1\"");
    toml
}

/// Polls the router at `router` until it reports `workers` ready workers of
/// `model`, failing fast if one of `procs` dies or `within` passes.
pub async fn wait_ready(
    procs: &mut Children,
    router: &str,
    certs: Option<&Path>,
    model: &str,
    workers: u32,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(what) = procs.exited() {
            bail!("{what}");
        }
        if Instant::now() > deadline {
            bail!("the mesh was not ready within {} s", within.as_secs());
        }
        if let Ok(mut client) =
            crate::client::connect_with(router, certs.map(|d| (d, "client"))).await
        {
            if let Ok(resp) = client.list_models(ListModelsRequest {}).await {
                let ready: u32 = resp
                    .into_inner()
                    .models
                    .iter()
                    .filter(|m| m.name == model)
                    .flat_map(|m| m.versions.iter().map(|v| v.ready_workers))
                    .sum();
                if ready >= workers {
                    return Ok(());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_discovery_lists_every_worker_under_a_stable_v1() {
        let toml = static_discovery(
            "m",
            &[
                StaticWorker {
                    id: "a".into(),
                    port: 1,
                    capacity: None,
                },
                StaticWorker {
                    id: "b".into(),
                    port: 2,
                    capacity: Some(4),
                },
            ],
        );
        assert_eq!(
            toml,
            "[[workers]]\nid = \"a\"\nmodel = \"m\"\nversion = \"v1\"\naddr = \"http://127.0.0.1:1\"\n\n\
             [[workers]]\nid = \"b\"\nmodel = \"m\"\nversion = \"v1\"\naddr = \"http://127.0.0.1:2\"\ncapacity = 4\n\n\
             [models.\"m\"]\nstable = \"v1\"\n"
        );
    }
}
