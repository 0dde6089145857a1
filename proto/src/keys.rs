//! etcd key layout (DESIGN.md, "etcd keys"). All keys live under a configurable prefix.

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "/tokenmesh";

/// Builds keys under one prefix.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix` (a trailing slash is ignored).
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }

    /// Prefix of every worker registration.
    pub fn workers_prefix(&self) -> String {
        format!("{}/workers/", self.prefix)
    }

    /// `workers/{model}/{version}/{worker_id}`.
    pub fn worker(&self, model: &str, version: &str, worker_id: &str) -> String {
        format!("{}/workers/{model}/{version}/{worker_id}", self.prefix)
    }

    /// Prefix of every model's keys.
    pub fn models_prefix(&self) -> String {
        format!("{}/models/", self.prefix)
    }

    /// `models/{model}/policy`.
    pub fn policy(&self, model: &str) -> String {
        format!("{}/models/{model}/policy", self.prefix)
    }

    /// `drain/{worker_id}`.
    pub fn drain(&self, worker_id: &str) -> String {
        format!("{}/drain/{worker_id}", self.prefix)
    }

    /// Splits a worker key into (model, version, worker_id).
    pub fn parse_worker<'a>(&self, key: &'a str) -> Option<(&'a str, &'a str, &'a str)> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix("/workers/")?;
        let mut parts = rest.split('/');
        let (model, version, id) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || model.is_empty() || version.is_empty() || id.is_empty() {
            return None;
        }
        Some((model, version, id))
    }

    /// The model name of a `models/{model}/policy` key.
    pub fn parse_policy<'a>(&self, key: &'a str) -> Option<&'a str> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix("/models/")?;
        let model = rest.strip_suffix("/policy")?;
        (!model.is_empty() && !model.contains('/')).then_some(model)
    }
}

impl Default for Keys {
    fn default() -> Self {
        Self::new(DEFAULT_PREFIX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_keys_round_trip() {
        let k = Keys::new("/tokenmesh/");
        let key = k.worker("smollm2", "v1", "w-1");
        assert_eq!(key, "/tokenmesh/workers/smollm2/v1/w-1");
        assert_eq!(k.parse_worker(&key), Some(("smollm2", "v1", "w-1")));
        assert_eq!(k.parse_worker("/tokenmesh/workers/a/b"), None);
        assert_eq!(k.parse_worker("/other/workers/a/b/c"), None);
    }

    #[test]
    fn policy_keys_round_trip() {
        let k = Keys::default();
        assert_eq!(k.parse_policy(&k.policy("m")), Some("m"));
        assert_eq!(k.parse_policy("/tokenmesh/models/m/rollout"), None);
    }
}
