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

/// Picks a worker among `candidates` that is ready and not in `exclude`.
pub fn pick(
    candidates: &[Arc<Endpoint>],
    exclude: &[String],
    rng: &mut impl Rng,
) -> Option<Arc<Endpoint>> {
    let ready: Vec<&Arc<Endpoint>> = candidates
        .iter()
        .filter(|e| e.ready() && !exclude.contains(&e.id))
        .collect();
    match ready.len() {
        0 => None,
        1 => Some(ready[0].clone()),
        _ => {
            let two: Vec<&&Arc<Endpoint>> = ready.choose_multiple(rng, 2).collect();
            let (a, b) = (two[0], two[1]);
            Some(if b.load() < a.load() {
                (*b).clone()
            } else {
                (*a).clone()
            })
        }
    }
}
