//! Version choice (DESIGN.md, "Routing", step 2), by the model's traffic
//! policy: pin, then sticky hash of the session onto the weight split, then a
//! weighted random choice. A version with no ready worker is skipped.
use crate::errors::RouterError;
use crate::registry::ModelEntry;
use rand::Rng;
use tokenmesh_proto::records::PolicyRecord;
use tokenmesh_proto::v1::Arm;

/// The version a request goes to, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionChoice {
    pub version: String,
    pub arm: Arm,
}

/// The arm's name as spans record it (its `Debug` name), without a formatter.
pub fn arm_name(arm: Arm) -> &'static str {
    match arm {
        Arm::Unspecified => "Unspecified",
        Arm::Stable => "Stable",
        Arm::Canary => "Canary",
        Arm::Pinned => "Pinned",
    }
}

/// What the request asks for.
#[derive(Debug, Default, Clone, Copy)]
pub struct VersionAsk<'a> {
    pub pin: Option<&'a str>,
    pub session: Option<&'a str>,
}

/// Picks the version of `model` for one request.
pub fn choose_version(
    model: &str,
    entry: &ModelEntry,
    ask: VersionAsk<'_>,
    rng: &mut impl Rng,
) -> Result<VersionChoice, RouterError> {
    let ready = |v: &str| {
        entry
            .versions
            .get(v)
            .is_some_and(|eps| eps.iter().any(|e| e.ready()))
    };
    if let Some(pin) = ask.pin {
        if entry.policy.as_ref().is_some_and(|p| !p.pin_allowed) {
            return Err(RouterError::PinNotAllowed(model.into()));
        }
        if !entry.versions.contains_key(pin) {
            return Err(RouterError::UnknownVersion {
                model: model.into(),
                version: pin.into(),
                available: entry.versions.keys().cloned().collect(),
            });
        }
        return Ok(VersionChoice {
            version: pin.into(),
            arm: Arm::Pinned,
        });
    }
    let Some(policy) = &entry.policy else {
        // Without a policy the newest ready version (by natural order of the
        // labels) is the stable one.
        let version = entry
            .versions
            .keys()
            .filter(|v| ready(v))
            .max_by(|a, b| natural_cmp(a, b))
            .ok_or_else(|| RouterError::NoWorker {
                model: model.into(),
                version: None,
            })?;
        return Ok(VersionChoice {
            version: version.clone(),
            arm: Arm::Stable,
        });
    };
    let canary = policy.canary.as_ref().filter(|c| c.weight > 0);
    let want_canary = match canary {
        None => false,
        Some(c) => {
            let point = match (policy.sticky, ask.session) {
                (true, Some(s)) if !s.is_empty() => sticky_point(model, s),
                _ => rng.random_range(0..100),
            };
            point < c.weight.min(100)
        }
    };
    let stable = VersionChoice {
        version: policy.stable.clone(),
        arm: Arm::Stable,
    };
    let canary = canary.map(|c| VersionChoice {
        version: c.version.clone(),
        arm: Arm::Canary,
    });
    let (first, second) = if want_canary {
        (canary, Some(stable))
    } else {
        (Some(stable), canary)
    };
    first
        .into_iter()
        .chain(second)
        .find(|c| ready(&c.version))
        .ok_or_else(|| RouterError::NoWorker {
            model: model.into(),
            version: Some(policy.stable.clone()),
        })
}

/// A session's fixed point in 0..100, the same on every router replica.
pub fn sticky_point(model: &str, session: &str) -> u32 {
    // FNV-1a: stable across processes, platforms and Rust versions, unlike
    // the standard library's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in model.bytes().chain([0]).chain(session.bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % 100) as u32
}

/// Orders version labels so that v10 > v9.
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let key = |s: &str| -> (Vec<u64>, String) {
        let nums = s
            .split(|c: char| !c.is_ascii_digit())
            .filter(|p| !p.is_empty())
            .filter_map(|p| p.parse().ok())
            .collect();
        (nums, s.to_string())
    };
    key(a).cmp(&key(b))
}

/// True if the policy sends any share to a canary.
pub fn has_canary(p: &PolicyRecord) -> bool {
    p.canary.as_ref().is_some_and(|c| c.weight > 0)
}

/// The policy in a few words, for the routing's span: `stable v1`, then
/// `canary v2 10%` when it has one, and `sticky` / `no pins` where they
/// apply. Its `Debug` text, recorded per request before, was several times
/// longer, and each byte is formatted and exported per request (issue 20).
pub fn policy_summary(p: &PolicyRecord) -> String {
    let mut s = format!("stable {}", p.stable);
    if let Some(c) = p.canary.as_ref().filter(|_| has_canary(p)) {
        s.push_str(&format!(", canary {} {}%", c.version, c.weight));
    }
    if p.sticky {
        s.push_str(", sticky");
    }
    if !p.pin_allowed {
        s.push_str(", no pins");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_summary_says_what_routes() {
        let mut p = PolicyRecord {
            stable: "v1".into(),
            canary: Some(CanaryPolicy {
                version: "v2".into(),
                weight: 10,
            }),
            sticky: true,
            pin_allowed: false,
        };
        assert_eq!(
            policy_summary(&p),
            "stable v1, canary v2 10%, sticky, no pins"
        );
        p.canary.as_mut().unwrap().weight = 0;
        p.sticky = false;
        p.pin_allowed = true;
        assert_eq!(policy_summary(&p), "stable v1");
    }

    #[test]
    fn sticky_point_is_stable_and_spread() {
        assert_eq!(sticky_point("m", "alice"), sticky_point("m", "alice"));
        let below_30 = (0..10_000)
            .filter(|i| sticky_point("m", &format!("s{i}")) < 30)
            .count();
        assert!((2_700..3_300).contains(&below_30), "{below_30}");
    }

    use crate::registry::{testing, Registry};
    use rand::SeedableRng;
    use tokenmesh_proto::records::CanaryPolicy;

    /// A registry with one worker per version; `ready` says which answer.
    fn registry(ready: &[(&str, bool)], policy: Option<PolicyRecord>) -> std::sync::Arc<Registry> {
        let reg = testing::registry();
        for (v, r) in ready {
            testing::add(&reg, &format!("w-{v}"), "m", v, *r);
        }
        reg.set_policy("m", policy);
        reg
    }

    fn canary(weight: u32) -> PolicyRecord {
        PolicyRecord {
            stable: "v1".into(),
            canary: Some(CanaryPolicy {
                version: "v2".into(),
                weight,
            }),
            sticky: true,
            pin_allowed: true,
        }
    }

    #[tokio::test]
    async fn weighted_split_follows_the_policy() {
        let reg = registry(&[("v1", true), ("v2", true)], Some(canary(30)));
        let entry = reg.model("m").unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let canaries = (0..10_000)
            .filter(|_| {
                choose_version("m", &entry, VersionAsk::default(), &mut rng)
                    .unwrap()
                    .arm
                    == Arm::Canary
            })
            .count();
        assert!((2_800..3_200).contains(&canaries), "{canaries}");
    }

    #[tokio::test]
    async fn sticky_sessions_keep_their_version() {
        let reg = registry(&[("v1", true), ("v2", true)], Some(canary(50)));
        let entry = reg.model("m").unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        for s in 0..50 {
            let session = format!("user-{s}");
            let ask = VersionAsk {
                pin: None,
                session: Some(&session),
            };
            let first = choose_version("m", &entry, ask, &mut rng).unwrap();
            for _ in 0..5 {
                assert_eq!(choose_version("m", &entry, ask, &mut rng).unwrap(), first);
            }
        }
    }

    #[tokio::test]
    async fn canary_without_ready_workers_falls_back_to_stable() {
        let reg = registry(&[("v1", true), ("v2", false)], Some(canary(100)));
        let entry = reg.model("m").unwrap();
        let c = choose_version("m", &entry, VersionAsk::default(), &mut rand::rng()).unwrap();
        assert_eq!((c.version.as_str(), c.arm), ("v1", Arm::Stable));
    }

    #[tokio::test]
    async fn pins_are_honoured_or_refused_with_a_reason() {
        let reg = registry(&[("v1", true), ("v2", true)], Some(canary(0)));
        let entry = reg.model("m").unwrap();
        let pin = |v: &'static str| VersionAsk {
            pin: Some(v),
            session: None,
        };
        let c = choose_version("m", &entry, pin("v2"), &mut rand::rng()).unwrap();
        assert_eq!((c.version.as_str(), c.arm), ("v2", Arm::Pinned));
        let err = choose_version("m", &entry, pin("v9"), &mut rand::rng()).unwrap_err();
        assert!(matches!(err, RouterError::UnknownVersion { .. }), "{err}");
        let mut no_pin = canary(0);
        no_pin.pin_allowed = false;
        reg.set_policy("m", Some(no_pin));
        let entry = reg.model("m").unwrap();
        let err = choose_version("m", &entry, pin("v2"), &mut rand::rng()).unwrap_err();
        assert!(matches!(err, RouterError::PinNotAllowed(_)), "{err}");
    }

    #[tokio::test]
    async fn without_a_policy_the_newest_ready_version_serves() {
        let reg = registry(&[("v9", true), ("v10", true), ("v11", false)], None);
        let entry = reg.model("m").unwrap();
        let c = choose_version("m", &entry, VersionAsk::default(), &mut rand::rng()).unwrap();
        assert_eq!(c.version, "v10");
        let reg = registry(&[("v1", false)], None);
        let entry = reg.model("m").unwrap();
        let err = choose_version("m", &entry, VersionAsk::default(), &mut rand::rng()).unwrap_err();
        assert!(matches!(err, RouterError::NoWorker { .. }), "{err}");
    }

    #[test]
    fn natural_order_of_versions() {
        assert_eq!(natural_cmp("v10", "v9"), std::cmp::Ordering::Greater);
        assert_eq!(natural_cmp("v1", "v2"), std::cmp::Ordering::Less);
    }
}
