//! Worker choice (DESIGN.md, "Routing", step 3): power of two choices on live
//! load over the ready workers of one version.
//!
//! A small chooser of our own rather than tower's `p2c::Balance`: a request
//! here must be able to exclude the workers it already tried (retries and
//! failover) and the load includes the worker's reported queue, neither of
//! which fits `Balance`'s readiness-driven `Service` interface.
use crate::registry::Endpoint;
use rand::seq::IndexedRandom;
use rand::Rng;
use std::sync::Arc;

/// Random draws [`pick`] makes before it falls back to filtering every
/// candidate: with most workers eligible, two draws nearly always do.
const DRAWS: usize = 8;

/// Picks a worker among `candidates` that is ready and not in `exclude`:
/// the less loaded of two drawn at random (the first drawn on a tie), or the
/// only one left.
///
/// The two are drawn by index, rejecting ineligible ones, so a decision over
/// 1,000 workers reads a few of them rather than all; only when draws keep
/// hitting ineligible workers does it filter the whole list. Both ways draw
/// each pair of eligible workers with the same chance.
pub fn pick(
    candidates: &[Arc<Endpoint>],
    exclude: &[String],
    rng: &mut impl Rng,
) -> Option<Arc<Endpoint>> {
    pick_where(candidates, |e| e.ready() && !exclude.contains(&e.id), rng)
}

/// [`pick`] among the `candidates` for which `eligible` holds (a
/// continuation's, say: ready, not tried, and continuing from token ids).
pub fn pick_where(
    candidates: &[Arc<Endpoint>],
    eligible: impl Fn(&Endpoint) -> bool,
    rng: &mut impl Rng,
) -> Option<Arc<Endpoint>> {
    let n = candidates.len();
    if n >= 2 {
        let mut first: Option<usize> = None;
        for _ in 0..DRAWS {
            let i = rng.random_range(0..n);
            if first == Some(i) || !eligible(&candidates[i]) {
                continue;
            }
            match first {
                None => first = Some(i),
                Some(a) => return Some(lower(&candidates[a], &candidates[i]).clone()),
            }
        }
    }
    let ready: Vec<&Arc<Endpoint>> = candidates.iter().filter(|e| eligible(e)).collect();
    match ready.len() {
        0 => None,
        1 => Some(ready[0].clone()),
        _ => {
            let two: Vec<&&Arc<Endpoint>> = ready.choose_multiple(rng, 2).collect();
            Some(lower(two[0], two[1]).clone())
        }
    }
}

/// The less loaded of `a` and `b`, `a` on a tie.
fn lower<'a>(a: &'a Arc<Endpoint>, b: &'a Arc<Endpoint>) -> &'a Arc<Endpoint> {
    if b.load() < a.load() {
        b
    } else {
        a
    }
}

/// Why [`pick`] chose what it chose, for the `route` span: with more than one
/// eligible worker it compared loads, else it took what was left.
pub fn reason(candidates: &[Arc<Endpoint>], exclude: &[String]) -> &'static str {
    reason_where(candidates, |e| e.ready() && !exclude.contains(&e.id))
}

/// [`reason`] for [`pick_where`].
pub fn reason_where(
    candidates: &[Arc<Endpoint>],
    eligible: impl Fn(&Endpoint) -> bool,
) -> &'static str {
    // Stops at the second eligible worker: that is all the answer needs.
    let several = candidates.iter().filter(|e| eligible(e)).nth(1).is_some();
    if several {
        "lower load of two random ready workers"
    } else {
        "only ready worker left"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::testing::{add, registry};
    use rand::SeedableRng;
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;

    fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(7)
    }

    fn ids(eps: &[Arc<Endpoint>]) -> Vec<String> {
        eps.iter().map(|e| e.id.clone()).collect()
    }

    #[tokio::test]
    async fn of_two_the_less_loaded_wins() {
        let reg = registry();
        let busy = add(&reg, "busy", "m", "v1", true);
        let idle = add(&reg, "idle", "m", "v1", true);
        busy.in_flight.store(3, Ordering::SeqCst);
        // The worker's reported queue counts as load too.
        idle.reported_queue.store(2, Ordering::SeqCst);
        let eps = vec![busy, idle];
        let mut rng = rng();
        for _ in 0..100 {
            assert_eq!(pick(&eps, &[], &mut rng).unwrap().id, "idle");
        }
        assert_eq!(reason(&eps, &[]), "lower load of two random ready workers");
    }

    #[tokio::test]
    async fn the_most_loaded_of_many_is_never_picked_and_the_rest_share() {
        let reg = registry();
        let eps: Vec<_> = (0..4)
            .map(|i| {
                let ep = add(&reg, &format!("w{i}"), "m", "v1", true);
                ep.in_flight.store(i, Ordering::SeqCst);
                ep
            })
            .collect();
        let mut rng = rng();
        let mut counts: HashMap<String, u32> = HashMap::new();
        for _ in 0..3_000 {
            *counts
                .entry(pick(&eps, &[], &mut rng).unwrap().id.clone())
                .or_default() += 1;
        }
        assert!(!counts.contains_key("w3"), "{counts:?}");
        // The least loaded wins every pair it is drawn into: half of them.
        assert!((1_350..1_650).contains(&counts["w0"]), "{counts:?}");
        assert!(
            counts["w0"] > counts["w1"] && counts["w1"] > counts["w2"],
            "{counts:?}"
        );
    }

    #[tokio::test]
    async fn unhealthy_draining_and_tried_workers_are_excluded() {
        let reg = registry();
        let sick = add(&reg, "sick", "m", "v1", false);
        let draining = add(&reg, "draining", "m", "v1", true);
        draining.draining.store(true, Ordering::SeqCst);
        let drained = add(&reg, "drained", "m", "v1", true);
        reg.set_drain("drained", true);
        let tried = add(&reg, "tried", "m", "v1", true);
        let good = add(&reg, "good", "m", "v1", true);
        // The excluded ones are idle, the good one is not: load does not
        // bring an excluded worker back.
        good.in_flight.store(9, Ordering::SeqCst);
        let eps = vec![sick, draining, drained, tried, good];
        let mut rng = rng();
        for _ in 0..50 {
            let exclude = ["tried".to_string()];
            assert_eq!(pick(&eps, &exclude, &mut rng).unwrap().id, "good");
        }
        assert_eq!(reason(&eps, &["tried".into()]), "only ready worker left");
        assert!(pick(&eps, &ids(&eps), &mut rng).is_none());
    }

    #[tokio::test]
    async fn at_fleet_size_every_eligible_worker_is_drawn_evenly() {
        let reg = registry();
        // 100 idle workers, of which 30 are excluded one way or another.
        let eps: Vec<_> = (0..100)
            .map(|i| add(&reg, &format!("w{i:03}"), "m", "v1", i % 10 != 0))
            .collect();
        for ep in eps.iter().filter(|e| e.id.ends_with('1')) {
            ep.draining.store(true, Ordering::SeqCst);
        }
        let exclude: Vec<String> = eps
            .iter()
            .filter(|e| e.id.ends_with('2'))
            .map(|e| e.id.clone())
            .collect();
        let mut rng = rng();
        let mut counts: HashMap<String, u32> = HashMap::new();
        for _ in 0..14_000 {
            let id = pick(&eps, &exclude, &mut rng).unwrap().id.clone();
            *counts.entry(id).or_default() += 1;
        }
        // 70 eligible, 200 picks each on average (ties go to the first
        // drawn, which is uniform).
        assert_eq!(counts.len(), 70, "{counts:?}");
        assert!(
            counts.values().all(|&c| (130..280).contains(&c)),
            "{counts:?}"
        );
        assert!(counts.keys().all(|id| !id.ends_with(['0', '1', '2'])));
    }

    #[tokio::test]
    async fn with_nearly_every_worker_excluded_the_few_left_are_found() {
        let reg = registry();
        let eps: Vec<_> = (0..200)
            .map(|i| add(&reg, &format!("w{i:03}"), "m", "v1", i == 17 || i == 150))
            .collect();
        let mut rng = rng();
        let mut seen: HashMap<String, u32> = HashMap::new();
        for _ in 0..200 {
            *seen
                .entry(pick(&eps, &[], &mut rng).unwrap().id.clone())
                .or_default() += 1;
        }
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(seen.contains_key("w017") && seen.contains_key("w150"));
        assert_eq!(reason(&eps, &[]), "lower load of two random ready workers");
        assert_eq!(reason(&eps, &["w017".into()]), "only ready worker left");
    }

    #[tokio::test]
    async fn a_single_candidate_is_taken_whatever_its_load_and_none_gives_none() {
        let reg = registry();
        let only = add(&reg, "only", "m", "v1", true);
        only.in_flight.store(1_000, Ordering::SeqCst);
        let eps = vec![only];
        assert_eq!(pick(&eps, &[], &mut rng()).unwrap().id, "only");
        assert_eq!(reason(&eps, &[]), "only ready worker left");
        assert!(pick(&[], &[], &mut rng()).is_none());
    }
}
