//! The workers one attempt may go to: a version's endpoints as the
//! registry's view shares them, what each must offer, and the workers this
//! request already tried. Passed whole to the worker choice, so that a
//! continuation does not copy the view into a filtered list (which would
//! also defeat the choice's per-set cache, [`super::affinity::sets`]).
use crate::registry::Endpoint;
use std::sync::Arc;

/// The workers one attempt may choose from.
#[derive(Clone, Copy)]
pub struct Candidates<'a> {
    /// The version's endpoints, ready or not (the registry's view: sorted
    /// by id, shared until the worker set changes).
    pub endpoints: &'a Arc<[Arc<Endpoint>]>,
    /// Only workers that continue from token ids: a continuation after a
    /// failover sends the tokens emitted so far as ids.
    pub token_ids: bool,
    /// Ids of the workers this request already tried.
    pub exclude: &'a [String],
}

impl<'a> Candidates<'a> {
    /// A first attempt's candidates: every endpoint, none tried.
    pub fn all(endpoints: &'a Arc<[Arc<Endpoint>]>) -> Self {
        Self {
            endpoints,
            token_ids: false,
            exclude: &[],
        }
    }

    /// Whether `e` offers what this attempt needs (ready or not).
    pub fn offers(&self, e: &Endpoint) -> bool {
        !self.token_ids || e.record.continues_from_token_ids
    }

    /// Whether `e` may take this attempt now: offers what it needs, is
    /// ready, and was not tried.
    pub fn eligible(&self, e: &Endpoint) -> bool {
        self.offers(e) && e.ready() && !self.exclude.contains(&e.id)
    }

    /// The endpoints offering what this attempt needs, for the `route`
    /// span; a copy only for a continuation (the rare case).
    pub fn offered(&self) -> std::borrow::Cow<'a, [Arc<Endpoint>]> {
        if self.token_ids {
            let endpoints = self.endpoints.iter().filter(|e| self.offers(e));
            std::borrow::Cow::Owned(endpoints.cloned().collect())
        } else {
            std::borrow::Cow::Borrowed(&self.endpoints[..])
        }
    }
}
