//! The `Control` gRPC service. Reads go to etcd and fall back to the last
//! good snapshot (marked stale) when it is unreachable; writes are
//! compare-and-swap transactions and need the operator role.
use crate::analysis;
use crate::controller::commit_decision;
use crate::errors::ControlError;
use crate::records::{ArmRecord, Decision, RolloutRecord, State, Verdict};
use crate::rollout::{now_ms, RolloutDefaults};
use crate::store::{Freshness, Guarded, Snapshot, Store, Versioned};
use crate::views::{self, History};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokenmesh_certs::tls::{Identity, Role};
use tokenmesh_proto::records::{CanaryPolicy, PolicyRecord};
use tokenmesh_proto::v1::{self, control_server::Control};
use tokenmesh_proto::validate::{check_name, check_reason};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// How often WatchRollout looks for changes.
const WATCH_POLL: Duration = Duration::from_millis(250);

/// The Control API over one store.
#[derive(Clone)]
pub struct ControlService {
    store: Store,
    history: History,
    defaults: RolloutDefaults,
}

impl ControlService {
    /// A service over `store`; `history` feeds the status rates.
    pub fn new(store: Store, history: History, defaults: RolloutDefaults) -> Self {
        Self {
            store,
            history,
            defaults,
        }
    }

    async fn read(&self) -> Result<(Arc<Snapshot>, Freshness), ControlError> {
        Ok(self.store.read().await?)
    }

    /// A fresh snapshot for a write: a write never acts on stale data.
    async fn read_for_write(&self) -> Result<Arc<Snapshot>, ControlError> {
        Ok(self.store.read_live().await?)
    }
}

/// Who is writing, for decision records: the certificate identity, or
/// `insecure` on a plaintext server. Auditors are refused.
fn writer<T>(req: &Request<T>) -> Result<String, ControlError> {
    match req.extensions().get::<Identity>() {
        Some(id) if id.role == Role::Operator => Ok(id.uri()),
        Some(id) => Err(ControlError::ReadOnly {
            identity: format!("{} (role {})", id.uri(), id.role),
        }),
        None => Ok("insecure".into()),
    }
}

fn require_model(model: &str) -> Result<(), ControlError> {
    if model.is_empty() {
        return Err(ControlError::Invalid("model: required".into()));
    }
    name("model", model)
}

/// A model, version or worker name from a request: what it may be is what a
/// worker may register (proto's `check_name`), so a refusal never echoes a
/// long string and nothing else reaches a key, a log line or a record.
fn name(field: &'static str, value: &str) -> Result<(), ControlError> {
    check_name(field, value).map_err(|e| ControlError::Invalid(e.to_string()))
}

/// An optional model filter: empty, or a name.
fn model_filter(model: &str) -> Result<(), ControlError> {
    if model.is_empty() {
        Ok(())
    } else {
        name("model", model)
    }
}

fn registered_version(snap: &Snapshot, model: &str, version: &str) -> Result<(), ControlError> {
    let versions = snap.registered_versions(model);
    if versions.iter().any(|v| v == version) {
        return Ok(());
    }
    Err(ControlError::UnknownVersion {
        model: model.into(),
        version: version.into(),
        registered: if versions.is_empty() {
            "none".into()
        } else {
            versions.join(", ")
        },
    })
}

fn policy_to_proto(p: &PolicyRecord) -> v1::TrafficPolicy {
    v1::TrafficPolicy {
        stable_version: p.stable.clone(),
        canary_version: p
            .canary
            .as_ref()
            .map(|c| c.version.clone())
            .unwrap_or_default(),
        canary_weight: p.canary.as_ref().map(|c| c.weight).unwrap_or(0),
        sticky: p.sticky,
        pin_allowed: p.pin_allowed,
    }
}

/// Checks a requested policy as every reader of the stored one does
/// ([`PolicyRecord::validate`]), then against the registered versions.
fn policy_from_proto(
    snap: &Snapshot,
    model: &str,
    p: &v1::TrafficPolicy,
) -> Result<PolicyRecord, ControlError> {
    if p.canary_version.is_empty() && p.canary_weight > 0 {
        return Err(ControlError::Invalid(
            "policy.canary_weight is set but policy.canary_version is empty".into(),
        ));
    }
    let record = PolicyRecord {
        stable: p.stable_version.clone(),
        canary: (!p.canary_version.is_empty()).then(|| CanaryPolicy {
            version: p.canary_version.clone(),
            weight: p.canary_weight,
        }),
        sticky: p.sticky,
        pin_allowed: p.pin_allowed,
    };
    record
        .validate()
        .map_err(|e| ControlError::Invalid(e.to_string()))?;
    if !snap.knows_model(model) {
        return Err(ControlError::UnknownModel(model.into()));
    }
    registered_version(snap, model, &p.stable_version)?;
    if !p.canary_version.is_empty() {
        registered_version(snap, model, &p.canary_version)?;
    }
    Ok(record)
}

fn rollout_response(
    snap: &Snapshot,
    model: &str,
    freshness: Freshness,
) -> Result<v1::Rollout, ControlError> {
    let r = snap
        .rollouts
        .get(model)
        .ok_or_else(|| ControlError::NoRollout(model.into()))?;
    let mut out = r.value.to_proto(model);
    out.freshness = Some(freshness.into());
    Ok(out)
}

type RolloutStream = Pin<Box<dyn Stream<Item = Result<v1::Rollout, Status>> + Send>>;

#[tonic::async_trait]
impl Control for ControlService {
    async fn get_policy(
        &self,
        req: Request<v1::GetPolicyRequest>,
    ) -> Result<Response<v1::PolicyResponse>, Status> {
        let model = req.into_inner().model;
        require_model(&model)?;
        let (snap, fresh) = self.read().await?;
        if !snap.knows_model(&model) {
            return Err(ControlError::UnknownModel(model).into());
        }
        // A stored policy that fails validation is shown as none, at its
        // revision, so that `policy set` can replace it.
        let (policy, revision) = match snap.policies.get(&model) {
            Some(p) => (Some(policy_to_proto(&p.value)), p.mod_revision),
            None => (
                None,
                snap.invalid_policies.get(&model).copied().unwrap_or(0),
            ),
        };
        Ok(Response::new(v1::PolicyResponse {
            model,
            policy,
            revision,
            freshness: Some(fresh.into()),
        }))
    }

    async fn set_policy(
        &self,
        req: Request<v1::SetPolicyRequest>,
    ) -> Result<Response<v1::PolicyResponse>, Status> {
        let who = writer(&req)?;
        let r = req.into_inner();
        require_model(&r.model)?;
        let wanted = r
            .policy
            .ok_or_else(|| ControlError::Invalid("policy: required".into()))?;
        let snap = self.read_for_write().await?;
        let record = policy_from_proto(&snap, &r.model, &wanted)?;
        let revision = self
            .store
            .commit(vec![Guarded {
                key: self.store.keys().policy(&r.model),
                expected: r.expected_revision,
                value: Some(json(&record)?),
            }])
            .await
            .map_err(ControlError::from)?;
        tracing::info!(model = %r.model, by = %who, revision, policy = ?record, "traffic policy written");
        Ok(Response::new(v1::PolicyResponse {
            model: r.model,
            policy: Some(policy_to_proto(&record)),
            revision,
            freshness: Some(Freshness::default().into()),
        }))
    }

    async fn start_canary(
        &self,
        req: Request<v1::StartCanaryRequest>,
    ) -> Result<Response<v1::Rollout>, Status> {
        let who = writer(&req)?;
        let r = req.into_inner();
        require_model(&r.model)?;
        if r.canary_version.is_empty() {
            return Err(ControlError::Invalid("canary_version: required".into()).into());
        }
        name("canary_version", &r.canary_version)?;
        let snap = self.read_for_write().await?;
        let policy = startable(&snap, &r)?;
        let baseline = snap.counters(&r.model);
        let mut rollout =
            RolloutRecord::start(&r, &policy.value.stable, &self.defaults, now_ms(), baseline)
                .map_err(ControlError::from)?;
        let mut next_policy = policy.value.clone();
        next_policy.canary = Some(CanaryPolicy {
            version: rollout.canary.clone(),
            weight: rollout.weight(),
        });
        rollout.decisions.push(Decision {
            at_ms: rollout.started_at_ms,
            step: 0,
            weight: rollout.weight(),
            verdict: Verdict::Hold,
            reason: format!(
                "rollout started: {} -> {} in steps {:?}, hold {}s, min {} requests",
                rollout.stable, rollout.canary, rollout.steps, rollout.hold_s, rollout.min_requests
            ),
            canary: ArmRecord::default(),
            stable: ArmRecord::default(),
            decided_by: who.clone(),
        });
        let keys = self.store.keys();
        self.store
            .commit(vec![
                Guarded {
                    key: keys.rollout(&r.model),
                    expected: snap
                        .rollouts
                        .get(&r.model)
                        .map(|x| x.mod_revision)
                        .unwrap_or(0),
                    value: Some(json(&rollout)?),
                },
                Guarded {
                    key: keys.policy(&r.model),
                    expected: policy.mod_revision,
                    value: Some(json(&next_policy)?),
                },
            ])
            .await
            .map_err(ControlError::from)?;
        tracing::info!(model = %r.model, by = %who, canary = %rollout.canary, steps = ?rollout.steps, "canary rollout started");
        Ok(Response::new(rollout.to_proto(&r.model)))
    }

    async fn promote(
        &self,
        req: Request<v1::RolloutRequest>,
    ) -> Result<Response<v1::Rollout>, Status> {
        self.end_rollout(req, Verdict::Promote).await
    }

    async fn rollback(
        &self,
        req: Request<v1::RolloutRequest>,
    ) -> Result<Response<v1::Rollout>, Status> {
        self.end_rollout(req, Verdict::Rollback).await
    }

    async fn get_rollout(
        &self,
        req: Request<v1::RolloutRequest>,
    ) -> Result<Response<v1::Rollout>, Status> {
        let model = req.into_inner().model;
        require_model(&model)?;
        let (snap, fresh) = self.read().await?;
        Ok(Response::new(rollout_response(&snap, &model, fresh)?))
    }

    type WatchRolloutStream = RolloutStream;

    async fn watch_rollout(
        &self,
        req: Request<v1::RolloutRequest>,
    ) -> Result<Response<Self::WatchRolloutStream>, Status> {
        let model = req.into_inner().model;
        require_model(&model)?;
        let (snap, fresh) = self.read().await?;
        let first = rollout_response(&snap, &model, fresh)?;
        let store = self.store.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let mut last_rev = snap.rollouts.get(&model).map(|r| r.mod_revision);
            let mut running = first.state == v1::RolloutState::Running as i32;
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            while running {
                tokio::select! {
                    _ = tokio::time::sleep(WATCH_POLL) => {}
                    _ = tx.closed() => return,
                }
                // One key per poll, not the whole snapshot.
                let stored = match store.rollout(&model).await {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        let _ = tx
                            .send(Err(ControlError::NoRollout(model.clone()).into()))
                            .await;
                        return;
                    }
                    Err(_) => continue,
                };
                if Some(stored.mod_revision) == last_rev {
                    continue;
                }
                last_rev = Some(stored.mod_revision);
                let mut r = stored.value.to_proto(&model);
                r.freshness = Some(Freshness::default().into());
                running = r.state == v1::RolloutState::Running as i32;
                if tx.send(Ok(r)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn list_workers(
        &self,
        req: Request<v1::ListWorkersRequest>,
    ) -> Result<Response<v1::ListWorkersResponse>, Status> {
        let model = req.into_inner().model;
        model_filter(&model)?;
        let (snap, fresh) = self.read().await?;
        if !model.is_empty() && !snap.knows_model(&model) {
            return Err(ControlError::UnknownModel(model).into());
        }
        Ok(Response::new(v1::ListWorkersResponse {
            workers: views::workers(&snap, &model),
            freshness: Some(fresh.into()),
        }))
    }

    async fn drain_worker(
        &self,
        req: Request<v1::DrainWorkerRequest>,
    ) -> Result<Response<v1::DrainWorkerResponse>, Status> {
        let who = writer(&req)?;
        let r = req.into_inner();
        if r.worker_id.is_empty() {
            return Err(ControlError::Invalid("worker_id: required".into()).into());
        }
        name("worker_id", &r.worker_id)?;
        // The reason is stored in etcd and logged.
        check_reason("reason", &r.reason).map_err(|e| ControlError::Invalid(e.to_string()))?;
        let snap = self.read_for_write().await?;
        let Some(mut info) = views::worker_info(&snap, &r.worker_id) else {
            return Err(ControlError::UnknownWorker(r.worker_id).into());
        };
        let reason = if r.reason.is_empty() {
            format!("drained by {who}")
        } else {
            format!("{} (by {who})", r.reason)
        };
        self.store
            .put(&self.store.keys().drain(&r.worker_id), &reason)
            .await
            .map_err(ControlError::from)?;
        tracing::info!(worker = %r.worker_id, by = %who, reason = %reason, "worker drain requested");
        info.drain_reason = reason;
        Ok(Response::new(v1::DrainWorkerResponse {
            worker: Some(info),
        }))
    }

    async fn mesh_status(
        &self,
        req: Request<v1::MeshStatusRequest>,
    ) -> Result<Response<v1::MeshStatusResponse>, Status> {
        let model = req.into_inner().model;
        model_filter(&model)?;
        let (snap, fresh) = self.read().await?;
        if !model.is_empty() && !snap.knows_model(&model) {
            return Err(ControlError::UnknownModel(model).into());
        }
        let (versions, window_seconds) = views::mesh_status(&snap, &self.history, &model);
        Ok(Response::new(v1::MeshStatusResponse {
            versions,
            window_seconds,
            freshness: Some(fresh.into()),
        }))
    }
}

impl ControlService {
    /// An operator's promote or rollback of the running rollout.
    async fn end_rollout(
        &self,
        req: Request<v1::RolloutRequest>,
        verdict: Verdict,
    ) -> Result<Response<v1::Rollout>, Status> {
        let who = writer(&req)?;
        let model = req.into_inner().model;
        require_model(&model)?;
        let snap = self.read_for_write().await?;
        let Some(stored) = snap.rollouts.get(&model) else {
            return Err(ControlError::NoRollout(model).into());
        };
        let r = &stored.value;
        if r.state != State::Running {
            return Err(ControlError::Precondition(format!(
                "the rollout of model {model:?} has already ended ({:?})",
                r.state
            ))
            .into());
        }
        let now = snap.counters(&model);
        let canary = analysis::window(&now, &r.baseline, &r.canary);
        let stable = analysis::window(&now, &r.baseline, &r.stable);
        let decision = Decision {
            at_ms: now_ms(),
            step: r.step,
            weight: r.weight(),
            verdict,
            reason: format!(
                "{} by operator",
                if verdict == Verdict::Promote {
                    "promoted"
                } else {
                    "rolled back"
                }
            ),
            canary: ArmRecord::from(&canary),
            stable: ArmRecord::from(&stable),
            decided_by: who.clone(),
        };
        let rollout = commit_decision(&self.store, &snap, &model, stored, decision, now)
            .await
            .map_err(ControlError::from)?;
        tracing::info!(model = %model, by = %who, verdict = ?verdict, "rollout ended by operator");
        Ok(Response::new(rollout.to_proto(&model)))
    }
}

/// The model's traffic policy, when `r` may start a rollout on `snap`: the
/// model is known and has a policy, no rollout of it runs, and the canary is
/// a registered version other than stable.
fn startable<'a>(
    snap: &'a Snapshot,
    r: &v1::StartCanaryRequest,
) -> Result<&'a Versioned<PolicyRecord>, ControlError> {
    if !snap.knows_model(&r.model) {
        return Err(ControlError::UnknownModel(r.model.clone()));
    }
    if let Some(existing) = snap.rollouts.get(&r.model) {
        if existing.value.state == State::Running {
            return Err(ControlError::RolloutRunning {
                model: r.model.clone(),
                canary: existing.value.canary.clone(),
                step: existing.value.step + 1,
            });
        }
    }
    let Some(policy) = snap.policies.get(&r.model) else {
        return Err(ControlError::Precondition(format!(
            "model {:?} has no traffic policy yet; set its stable version first (meshctl policy set {} --stable VERSION)",
            r.model, r.model
        )));
    };
    if r.canary_version == policy.value.stable {
        return Err(ControlError::Invalid(format!(
            "canary_version {:?} is already the stable version",
            r.canary_version
        )));
    }
    if let Err(e) = registered_version(snap, &r.model, &r.canary_version) {
        return Err(ControlError::Precondition(e.to_string()));
    }
    Ok(policy)
}

/// A record as JSON.
fn json<T: serde::Serialize>(v: &T) -> Result<String, ControlError> {
    serde_json::to_string(v).map_err(|e| ControlError::Store(e.into()))
}
