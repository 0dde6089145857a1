//! The rollout controller: on the leading replica only, every analysis
//! interval, each running rollout is analysed and its verdict written,
//! together with the traffic policy it implies, in one compare-and-swap
//! transaction. Every decision is stored with its numbers, logged, and
//! recorded as a span event.
use crate::analysis::{self, Outcome};
use crate::records::{ArmRecord, ByIncarnation, Decision, RolloutRecord, State, Verdict};
use crate::rollout::now_ms;
use crate::store::{Guarded, Snapshot, Store, StoreError, Versioned};
use std::time::Duration;
use tokenmesh_proto::records::PolicyRecord;
use tokio::sync::watch;

/// Runs until `shutdown`; analyses only while `leading` is true.
pub async fn run(
    store: Store,
    id: String,
    interval: Duration,
    mut leading: watch::Receiver<bool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = leading.changed() => continue,
            _ = shutdown.changed() => return,
        }
        if !*leading.borrow() {
            continue;
        }
        let snapshot = match store.read_live().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "rollout analysis skipped: etcd unreadable");
                continue;
            }
        };
        for (model, rollout) in &snapshot.rollouts {
            if rollout.value.state != State::Running {
                continue;
            }
            if let Err(e) = analyse(&store, &snapshot, model, &id).await {
                tracing::warn!(model = %model, error = %e, "rollout analysis not applied");
            }
        }
    }
}

/// One analysis round of `model`'s running rollout.
#[tracing::instrument(name = "canary_analysis", skip(store, snapshot, id), fields(model = %model))]
async fn analyse(
    store: &Store,
    snapshot: &Snapshot,
    model: &str,
    id: &str,
) -> Result<(), StoreError> {
    let Some(stored) = snapshot.rollouts.get(model) else {
        return Ok(());
    };
    let now = snapshot.counters(model);
    let r = &stored.value;
    let canary = analysis::window(&now, &r.baseline, &r.canary);
    let stable = analysis::window(&now, &r.baseline, &r.stable);
    let outcome = analysis::decide(r, &canary, &stable, now_ms());
    let decision = Decision {
        at_ms: now_ms(),
        step: r.step,
        weight: r.weight(),
        verdict: outcome.verdict,
        reason: outcome.reason.clone(),
        canary: ArmRecord::from(&canary),
        stable: ArmRecord::from(&stable),
        decided_by: id.to_string(),
    };
    commit_decision(store, snapshot, model, stored, decision, now).await?;
    log_decision(model, &outcome, &canary, &stable);
    Ok(())
}

/// Writes `decision` into `stored` (the model's rollout as read in
/// `snapshot`) and the policy it implies, guarded by both keys' revisions.
pub async fn commit_decision(
    store: &Store,
    snapshot: &Snapshot,
    model: &str,
    stored: &Versioned<RolloutRecord>,
    decision: Decision,
    counters_now: ByIncarnation,
) -> Result<RolloutRecord, StoreError> {
    let keys = store.keys();
    let (policy, policy_rev) = snapshot
        .policies
        .get(model)
        .map(|p| (p.value.clone(), p.mod_revision))
        .unwrap_or_else(|| {
            (
                PolicyRecord {
                    stable: stored.value.stable.clone(),
                    sticky: true,
                    pin_allowed: true,
                    canary: None,
                },
                0,
            )
        });
    let mut rollout = stored.value.clone();
    let verdict = decision.verdict;
    let next_policy = rollout.apply(decision, &policy, counters_now);
    let mut changes = vec![Guarded {
        key: keys.rollout(model),
        expected: stored.mod_revision,
        value: Some(serde_json::to_string(&rollout)?),
    }];
    // A hold changes no traffic: leave the policy key (and its revision) alone.
    if verdict != Verdict::Hold || next_policy != policy {
        changes.push(Guarded {
            key: keys.policy(model),
            expected: policy_rev,
            value: Some(serde_json::to_string(&next_policy)?),
        });
    }
    store.commit(changes).await?;
    Ok(rollout)
}

fn log_decision(
    model: &str,
    outcome: &Outcome,
    canary: &analysis::ArmWindow,
    stable: &analysis::ArmWindow,
) {
    let verdict = format!("{:?}", outcome.verdict).to_lowercase();
    metrics::counter!(
        "tokenmesh_canary_decisions_total",
        "model" => model.to_string(),
        "verdict" => verdict.clone()
    )
    .increment(1);
    tracing::info!(
        model,
        verdict = %verdict,
        reason = %outcome.reason,
        canary.version = %canary.version,
        canary.requests = canary.requests,
        canary.errors = canary.errors,
        canary.ttft_p99_ms = canary.ttft_p99_ms(),
        stable.version = %stable.version,
        stable.requests = stable.requests,
        stable.errors = stable.errors,
        stable.ttft_p99_ms = stable.ttft_p99_ms(),
        "canary decision"
    );
}
