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

    /// Prefix of every key (with its trailing slash).
    pub fn root(&self) -> String {
        format!("{}/", self.prefix)
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

    /// Prefix of every drain request.
    pub fn drain_prefix(&self) -> String {
        format!("{}/drain/", self.prefix)
    }

    /// The worker id of a `drain/{worker_id}` key.
    pub fn parse_drain<'a>(&self, key: &'a str) -> Option<&'a str> {
        let id = key.strip_prefix(&self.prefix)?.strip_prefix("/drain/")?;
        (!id.is_empty() && !id.contains('/')).then_some(id)
    }

    /// Prefix of every router's published stats.
    pub fn stats_prefix(&self) -> String {
        format!("{}/stats/", self.prefix)
    }

    /// `stats/{router_id}/{model}/{version}`.
    pub fn stats(&self, router_id: &str, model: &str, version: &str) -> String {
        format!("{}/stats/{router_id}/{model}/{version}", self.prefix)
    }

    /// Splits a stats key into (router_id, model, version).
    pub fn parse_stats<'a>(&self, key: &'a str) -> Option<(&'a str, &'a str, &'a str)> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix("/stats/")?;
        three_parts(rest)
    }

    /// Prefix of every model's rollout.
    pub fn rollouts_prefix(&self) -> String {
        format!("{}/rollouts/", self.prefix)
    }

    /// `rollouts/{model}`.
    pub fn rollout(&self, model: &str) -> String {
        format!("{}/rollouts/{model}", self.prefix)
    }

    /// The model name of a `rollouts/{model}` key.
    pub fn parse_rollout<'a>(&self, key: &'a str) -> Option<&'a str> {
        let model = key.strip_prefix(&self.prefix)?.strip_prefix("/rollouts/")?;
        (!model.is_empty() && !model.contains('/')).then_some(model)
    }

    /// The election the control-plane replicas campaign in to lead the
    /// rollout controller.
    pub fn control_election(&self) -> String {
        format!("{}/control/leader", self.prefix)
    }

    /// Splits a worker key into (model, version, worker_id).
    pub fn parse_worker<'a>(&self, key: &'a str) -> Option<(&'a str, &'a str, &'a str)> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix("/workers/")?;
        three_parts(rest)
    }

    /// The model name of a `models/{model}/policy` key.
    pub fn parse_policy<'a>(&self, key: &'a str) -> Option<&'a str> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix("/models/")?;
        let model = rest.strip_suffix("/policy")?;
        (!model.is_empty() && !model.contains('/')).then_some(model)
    }
}

/// `a/b/c` with no part empty.
fn three_parts(rest: &str) -> Option<(&str, &str, &str)> {
    let mut parts = rest.split('/');
    let (a, b, c) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || a.is_empty() || b.is_empty() || c.is_empty() {
        return None;
    }
    Some((a, b, c))
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

    #[test]
    fn stats_drain_and_rollout_keys_round_trip() {
        let k = Keys::default();
        assert_eq!(
            k.parse_stats(&k.stats("r1", "m", "v2")),
            Some(("r1", "m", "v2"))
        );
        assert_eq!(k.parse_drain(&k.drain("w-1")), Some("w-1"));
        assert_eq!(k.parse_drain("/tokenmesh/drain/"), None);
        assert_eq!(k.parse_rollout(&k.rollout("m")), Some("m"));
    }
}
