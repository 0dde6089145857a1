//! The request path, in DESIGN.md's order ("Routing, in order"), one step per
//! file:
//!
//! 1. admission ([`crate::admission`]): concurrency limits and a bounded
//!    queue, before anything is chosen;
//! 2. [`version`]: pin, sticky session, weighted split, on the registry as it
//!    is once the request is admitted;
//! 3. [`affinity`]: the worker, by the prompt prefix it is estimated to hold
//!    against its load, or [`p2c`] (power of two choices) alone;
//! 4. the channel ([`crate::registry`]): one connection per worker;
//! 5. [`attempt`]: the call to the worker, retried on another before the first
//!    token with backoff, paid from the version's [`retry_budget`]; after it,
//!    [`failover`] continues the stream on another worker;
//! 6. [`failover`] also drops the upstream stream when the client leaves or
//!    its deadline passes; [`meter`] records the stream's metrics; [`pump`]
//!    runs the relay inside the client's stream, in the task that sends it;
//!    [`wire`] keeps the worker's `Delta`s encoded on the way through.
//!
//! [`Router::route`] runs the steps; the gRPC service in `server.rs` and the
//! OpenAI-compatible HTTP API in `openai/` only turn a request into an
//! [`Incoming`] and the result into a response.
pub mod affinity;
pub mod attempt;
pub mod candidates;
pub mod failover;
pub mod meter;
pub mod p2c;
pub mod pump;
pub mod retry_budget;
pub mod version;
pub mod wire;

use crate::admission::Admission;
use crate::errors::RouterError;
use crate::registry::{ModelEntry, Registry};
use affinity::{Affinity, AffinitySettings};
use attempt::{AttemptLimits, Attempts, CallContext};
use failover::FailoverContext;
use retry_budget::{RetryBudgetConfig, RetryBudgets};
use std::sync::Arc;
use std::time::Instant;
use tokenmesh_proto::v1::{Accepted, GenerateRequest, GenerateResponse};
use tokenmesh_proto::validate::MAX_NAME_BYTES;
use tokenmesh_runtime::telemetry::{self, Sampling, Unsampled};
use tokenmesh_runtime::Backoff;
use tonic::metadata::MetadataMap;
use tonic::Status;
use tracing::Span;
use version::{choose_version, VersionAsk, VersionChoice};

/// Request-path settings (from the router's flags).
#[derive(Clone, Debug)]
pub struct RouteSettings {
    /// Workers tried for one request before the first token.
    pub max_attempts: u32,
    /// Times a stream may move to another worker after tokens were sent.
    pub max_failovers: u32,
    /// Wait between the attempts of one request.
    pub backoff: Backoff,
    /// The shape of each version's retry budget.
    pub retry_budget: RetryBudgetConfig,
    /// How a worker of the version is chosen.
    pub affinity: AffinitySettings,
    /// Routing and each call to a worker as spans of their own
    /// (`--trace-phases`), rather than attributes of `Generate`.
    pub phase_spans: bool,
}

/// Which front door a request came through: the `api` label of the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `tokenmesh.v1.Inference` over gRPC.
    Grpc,
    /// The OpenAI-compatible HTTP API.
    Openai,
}

impl Api {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Grpc => "grpc",
            Api::Openai => "openai",
        }
    }
}

/// One request as an edge (gRPC or HTTP) hands it over: validated, with a
/// request id.
#[derive(Debug)]
pub struct Incoming {
    /// The client's request, with its `request_id` set.
    pub request: GenerateRequest,
    /// The caller, for per-identity limits.
    pub identity: String,
    /// A version pin, from the request or its header.
    pub pin: Option<String>,
    /// The sticky-session key, from the request or its header.
    pub session: Option<String>,
    /// When the caller's deadline (grpc-timeout) expires, if it set one.
    pub deadline: Option<tokio::time::Instant>,
    /// When the router received the request.
    pub started: Instant,
    /// The front door it came through.
    pub api: Api,
    /// The trace context passed on to workers when the request is not
    /// sampled and so has no span ([`request_trace`]).
    pub unsampled: Option<Unsampled>,
}

/// The client's messages, numbered, across failovers, as they go out: the
/// relay runs as the stream is read.
pub type ClientEvents = pump::Pump<Result<wire::Outgoing, Status>>;

/// The client's messages, numbered, across failovers, decoded: a stream of
/// `GenerateResponse`s. The gRPC edge writes the [`ClientEvents`] within
/// ([`ClientMessages::encoded`]) without decoding the worker's `Delta`s.
pub struct ClientMessages(ClientEvents);

impl ClientMessages {
    /// The messages as they go out, `Delta`s in the worker's encoding.
    pub fn encoded(self) -> ClientEvents {
        self.0
    }
}

impl From<ClientEvents> for ClientMessages {
    fn from(events: ClientEvents) -> Self {
        Self(events)
    }
}

impl futures::Stream for ClientMessages {
    type Item = Result<GenerateResponse, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.0)
            .poll_next(cx)
            .map(|m| m.map(|m| m.and_then(wire::Outgoing::into_message)))
    }
}

/// A request routed to its first worker; the stream carries it on.
pub struct Routed {
    /// The version serving the request.
    pub version: String,
    /// The first worker serving it (a failover may move it).
    pub worker_id: String,
    /// The client's messages, numbered, across failovers.
    pub stream: ClientMessages,
}

/// The request path of one router.
pub struct Router {
    registry: Arc<Registry>,
    admission: Arc<Admission>,
    budgets: RetryBudgets,
    settings: RouteSettings,
    affinity: Arc<Affinity>,
}

/// The server span of one request (`Generate`, whichever API it came
/// through), with every field the request path records; the model is
/// recorded once the request has been checked.
pub fn request_span(api: Api) -> Span {
    let span = tracing::info_span!(
        "Generate",
        otel.name = "Generate",
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        api = api.as_str(),
        model = tracing::field::Empty,
        request_id = tracing::field::Empty,
        identity = tracing::field::Empty,
        version = tracing::field::Empty,
        arm = tracing::field::Empty,
        worker = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        error = tracing::field::Empty,
        // The `route` span's, recorded here without `--trace-phases`.
        policy = tracing::field::Empty,
        pin = tracing::field::Empty,
        sticky = tracing::field::Empty,
        candidates = tracing::field::Empty,
        reason = tracing::field::Empty,
        attempts = tracing::field::Empty,
        failover = tracing::field::Empty,
    );
    span
}

/// A request's trace: its `Generate` span, or, when its trace is not
/// sampled, no span and the context to pass on.
pub struct RequestTrace {
    /// The `Generate` span (none when not sampled).
    pub span: Span,
    /// The context sent on to workers when there is no span.
    pub unsampled: Option<Unsampled>,
}

/// The request's `Generate` span, child of the caller's trace context in
/// `md`; or, when that trace is not sampled ([`telemetry::sampling`]), no
/// span and the context to pass on: an unsampled request records nothing.
pub fn request_trace(api: Api, md: &MetadataMap) -> RequestTrace {
    match telemetry::sampling(md) {
        Sampling::Record => {
            let span = request_span(api);
            telemetry::adopt_parent(&span, md);
            RequestTrace {
                span,
                unsampled: None,
            }
        }
        Sampling::Skip(unsampled) => RequestTrace {
            span: Span::none(),
            unsampled: Some(unsampled),
        },
    }
}

/// The span a routing is recorded on. With `phases` (`--trace-phases`), a
/// `route` span, child of the request's `Generate` span, with every field the
/// request path records: one for the first routing, one per failover; none
/// when the request has no span (a child of none would be a root). Without,
/// `Generate` itself, which declares the same fields: a span fewer per
/// request, as in proxies that make one span per hop (issue 20).
pub fn route_span(generate: &Span, phases: bool) -> Span {
    if !phases {
        return generate.clone();
    }
    if generate.is_disabled() {
        return Span::none();
    }
    tracing::info_span!(
        parent: generate,
        "route",
        policy = tracing::field::Empty,
        pin = tracing::field::Empty,
        sticky = tracing::field::Empty,
        version = tracing::field::Empty,
        arm = tracing::field::Empty,
        candidates = tracing::field::Empty,
        worker = tracing::field::Empty,
        reason = tracing::field::Empty,
        attempts = tracing::field::Empty,
        failover = tracing::field::Empty,
    )
}

impl Router {
    /// A request path over a registry that discovery keeps up to date.
    pub fn new(
        registry: Arc<Registry>,
        admission: Arc<Admission>,
        settings: RouteSettings,
    ) -> Self {
        Self {
            budgets: RetryBudgets::new(settings.retry_budget),
            affinity: Affinity::new(settings.affinity),
            registry,
            admission,
            settings,
        }
    }

    /// What the router knows.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Counts a request refused before it had a stream, whichever API it
    /// came through. The model label is the one asked for only when the
    /// registry knows it: a client's string would make a series per name.
    pub fn count_refusal(&self, asked: &str, api: Api, code: tonic::Code) {
        let known = asked.len() <= MAX_NAME_BYTES && self.registry.has_model(asked);
        meter::refused(if known { asked } else { "" }, api, code);
    }

    /// Admits and routes one request and opens its first worker stream; the
    /// rest of the stream is carried by the failover relay inside `span`, the
    /// request's `Generate` span, as the returned stream is read.
    pub async fn route(&self, incoming: Incoming, span: &Span) -> Result<Routed, RouterError> {
        // An unknown model is the caller's mistake, refused before it takes
        // an admission slot.
        if !self.registry.has_model(&incoming.request.model) {
            return Err(self.unknown(&incoming.request.model));
        }
        let route = route_span(span, self.settings.phase_spans);
        // Each attribute costs a few thousand instructions to record and
        // export; the usual values (no pin, no session) are left out.
        if let Some(pin) = &incoming.pin {
            route.record("pin", pin.as_str());
        }
        if incoming.session.is_some() {
            route.record("sticky", true);
        }
        let permit = self.admission.admit(&incoming.identity).await?;
        // After any wait in the queue, on the registry as it is now.
        let choice = self.choose(&incoming, &route, span)?;
        let model = incoming.request.model.clone();
        let request_id = incoming.request.request_id.clone();
        let budget = self.budgets.get(&model, &choice.version);
        budget.deposit();
        let limits = AttemptLimits {
            max_attempts: self.settings.max_attempts,
            backoff: self.settings.backoff,
        };
        let affinity = self.affinity.request(
            &incoming.request,
            &choice.version,
            incoming.session.as_deref(),
        );
        let mut attempts = Attempts::new(
            self.registry.clone(),
            incoming.request,
            choice.version.clone(),
            limits,
            budget,
            affinity,
            CallContext {
                deadline: incoming.deadline,
                unsampled: incoming.unsampled,
                phase_spans: self.settings.phase_spans,
            },
        );
        let upstream = attempts.open(&[], &route).await?;
        drop(route);
        let worker_id = upstream.guard.endpoint().id.clone();
        if self.settings.phase_spans {
            // Without phases, `route` is this span and has it already.
            span.record("worker", worker_id.as_str());
        }
        let accepted = Accepted {
            request_id,
            model,
            version: choice.version.clone(),
            arm: choice.arm as i32,
            worker_id: worker_id.clone(),
            load: None,
        };
        let ctx = FailoverContext {
            attempts,
            accepted,
            max_failovers: self.settings.max_failovers,
            started: incoming.started,
            permit,
            span: span.clone(),
            api: incoming.api,
        };
        let stream = ClientMessages(pump::Pump::new(|out| failover::run(ctx, upstream, out)));
        Ok(Routed {
            version: choice.version,
            worker_id,
            stream,
        })
    }

    /// UNAVAILABLE until discovery has delivered its first view: before it,
    /// what the registry lacks proves nothing.
    pub fn ensure_loaded(&self) -> Result<(), RouterError> {
        if self.registry.is_loaded() {
            Ok(())
        } else {
            Err(RouterError::NotLoaded)
        }
    }

    /// The model's versions and policy; NOT_FOUND for a model no worker or
    /// policy knows, once discovery has loaded (UNAVAILABLE before: a router
    /// that has just started must not tell a client a real model is missing).
    fn known(&self, model: &str) -> Result<ModelEntry, RouterError> {
        self.registry
            .model(model)
            .ok_or_else(|| self.unknown(model))
    }

    /// Why `model`, which the registry lacks, cannot be served.
    fn unknown(&self, model: &str) -> RouterError {
        match self.ensure_loaded() {
            Err(not_loaded) => not_loaded,
            Ok(()) => RouterError::UnknownModel {
                asked: model.into(),
                available: self.registry.models().keys().cloned().collect(),
            },
        }
    }

    /// Step 2: the version, recorded on the `route` and `Generate` spans.
    fn choose(
        &self,
        incoming: &Incoming,
        route: &Span,
        span: &Span,
    ) -> Result<VersionChoice, RouterError> {
        let model = &incoming.request.model;
        // The model may have gone while the request waited for admission.
        let entry = self.known(model)?;
        let policy = entry.policy.as_ref().map(version::policy_summary);
        let ask = VersionAsk {
            pin: incoming.pin.as_deref(),
            session: incoming.session.as_deref(),
        };
        let choice = choose_version(model, &entry, ask, &mut rand::rng())?;
        // One record call for all three: each call is a dispatch through
        // every layer, about 1 k instructions before its values (issue 20).
        // Without phases, `route` is `span`: recorded once.
        let (version, arm) = (choice.version.as_str(), version::arm_name(choice.arm));
        tracing::record_all!(route, policy = policy.as_deref(), version, arm);
        if self.settings.phase_spans {
            tracing::record_all!(span, version, arm);
        }
        Ok(choice)
    }
}
