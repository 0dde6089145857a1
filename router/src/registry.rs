//! What the router knows: models, their traffic policies, and one endpoint per
//! worker with its channel and live load. Discovery backends write it; the
//! request path reads it.
use crate::config::ChannelSettings;
use crate::route::meter::StreamSeries;
use crate::route::Api;
use crate::stats::{Stats, WorkerViews};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;
use tokenmesh_certs::tls::{Identity, MeshTls, Role};
use tokenmesh_proto::records::{PolicyRecord, WorkerRecord, WorkerView};
use tokenmesh_proto::v1::worker_client::WorkerClient;
use tokenmesh_proto::v1::{StatusRequest, WorkerLoad};
use tokio::sync::Notify;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint as TonicEndpoint};

/// One worker as the router sees it.
#[derive(Debug)]
pub struct Endpoint {
    pub id: String,
    /// xxh3 of `id`, hashed once at registration: the cache-aware choice
    /// weighs every candidate of every request by it.
    pub id_hash: u64,
    /// xxh3 of the id, address and `started_at` of this registration,
    /// hashed once: the prefix index names a worker's cache by it (with its
    /// spells of unhealthiness), on every decision, without reading the
    /// record's strings.
    pub registration_hash: u64,
    pub model: String,
    pub version: String,
    pub record: WorkerRecord,
    pub channel: Channel,
    /// Streams from this router that have not ended yet.
    pub in_flight: AtomicU32,
    /// Queue depth from the worker's last Status.
    pub reported_queue: AtomicU32,
    /// The last Status poll succeeded.
    pub healthy: AtomicBool,
    /// Times it went from healthy to unhealthy: the cache-aware index
    /// names a worker's cache by its registration and this count, since a
    /// worker that stopped answering may have lost its cache.
    pub unhealthy_spells: AtomicU32,
    /// The worker said it is draining.
    pub draining: AtomicBool,
    /// A `drain/{worker_id}` key asks every router to stop sending new
    /// streams here; streams already here continue.
    pub drain_requested: AtomicBool,
    /// When the worker last answered, by a Status poll or in-band at the end
    /// of a stream (milliseconds since `epoch`; 0: never): its next poll is
    /// due one poll interval after this.
    heard_at_ms: AtomicU64,
    epoch: Instant,
    /// The `llm_queue_depth` and `llm_endpoint_healthy` series, looked up
    /// once: in-band reports set them once per stream.
    queue_gauge: metrics::Gauge,
    healthy_gauge: metrics::Gauge,
    /// The series of the streams it serves, by front door (gRPC, OpenAI),
    /// each made at its first stream.
    stream_series: [OnceLock<Arc<StreamSeries>>; 2],
    /// The registry's readiness watcher, woken when draining changes.
    changes: Arc<Notify>,
    /// Wakes this endpoint's poller to poll now (a call found the worker
    /// unreachable).
    recheck: Arc<Notify>,
    /// Dropped when the endpoint leaves the registry: stops its poller.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Endpoint {
    /// The metric series of a stream of this model version through `api`.
    pub fn stream_series(&self, api: Api) -> Arc<StreamSeries> {
        let slot = match api {
            Api::Grpc => &self.stream_series[0],
            Api::Openai => &self.stream_series[1],
        };
        slot.get_or_init(|| Arc::new(StreamSeries::new(&self.model, &self.version, api)))
            .clone()
    }

    /// Whether new streams may go here.
    pub fn ready(&self) -> bool {
        self.healthy.load(Ordering::SeqCst) && !self.is_draining()
    }

    /// Sets whether its polls answer; true if that changed it.
    pub fn set_healthy(&self, healthy: bool) -> bool {
        let was = self.healthy.swap(healthy, Ordering::SeqCst);
        if was && !healthy {
            self.unhealthy_spells.fetch_add(1, Ordering::SeqCst);
        }
        was != healthy
    }

    /// A call to the worker failed below gRPC (connection refused or reset,
    /// an HTTP/2 GOAWAY or reset stream; `error` says which): it is
    /// unhealthy at once, so the next decisions skip it, rather than after
    /// its next Status poll fails, which for an idle worker may be N /
    /// budget away (5 s at 1,000 workers and the default budget). Its
    /// poller polls it now, then as after any failed poll (the base
    /// interval, doubling), so it is ready again as soon as it answers.
    /// True if it was healthy.
    pub fn unreachable(&self, error: &str) -> bool {
        let was = self.set_healthy(false);
        if was {
            self.healthy_gauge.set(0.0);
            self.changes.notify_one();
            tracing::warn!(worker = %self.id, addr = %self.record.addr, error, "worker unreachable: a call to it failed in transport; no streams go to it until its status poll answers");
        }
        self.recheck.notify_one();
        was
    }

    /// Draining, by the worker's own report or a drain key.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst) || self.drain_requested.load(Ordering::SeqCst)
    }

    /// Live load: streams in flight from this router plus the worker's queue.
    pub fn load(&self) -> u32 {
        self.in_flight.load(Ordering::SeqCst) + self.reported_queue.load(Ordering::SeqCst)
    }

    /// Metric labels of this endpoint.
    pub fn labels(&self) -> [(&'static str, String); 3] {
        [
            ("model", self.model.clone()),
            ("version", self.version.clone()),
            ("worker", self.id.clone()),
        ]
    }

    /// A gRPC client over the endpoint's shared channel.
    pub fn client(&self) -> WorkerClient<Channel> {
        WorkerClient::new(self.channel.clone())
    }

    /// Takes the load a worker sent in-band on one of its streams
    /// (`Accepted.load` as it starts, `Finished.load` as it ends), so that
    /// traffic itself keeps a busy worker's load and draining fresh. A
    /// `Finished` (`ended`) also proves the worker serves, and puts its next
    /// Status poll off by a whole interval: a busy worker is seldom polled.
    /// An `Accepted` does not, since a worker whose engine has failed still
    /// accepts and then fails the stream, which only a poll reports; nor is
    /// its queue taken, since that queue still holds the very stream it
    /// accepts, which `in_flight` already counts (the stream would count
    /// twice, and a conversation's worker look overloaded by its own turn).
    pub fn note_load(&self, load: Option<&WorkerLoad>, ended: bool) {
        let Some(load) = load else { return };
        if self.draining.swap(load.draining, Ordering::SeqCst) != load.draining {
            self.changes.notify_one();
        }
        if ended {
            self.reported_queue
                .store(load.queue_depth, Ordering::SeqCst);
            self.queue_gauge.set(load.queue_depth as f64);
            self.heard();
        }
    }

    /// The worker answered now.
    fn heard(&self) {
        // At least 1: 0 means never.
        let ms = self.epoch.elapsed().as_millis().max(1) as u64;
        self.heard_at_ms.store(ms, Ordering::SeqCst);
    }

    /// How long ago the worker last answered, if it ever did.
    fn heard_ago(&self, now: Instant) -> Option<Duration> {
        match self.heard_at_ms.load(Ordering::SeqCst) {
            0 => None,
            ms => Some(now.saturating_duration_since(self.epoch + Duration::from_millis(ms))),
        }
    }
}

/// When Status polls happen (`--status-interval-ms`, `--status-poll-budget`).
///
/// Every router polls every worker it knows, so a fixed interval makes the
/// fleet's poll load grow as routers × workers: 1,000 workers at 1 s are
/// 1,000 polls a second per router. Instead each router spends at most a
/// budget of polls per second across all its workers, each worker's
/// interval is `max(base, workers / budget)`, jittered so that the polls
/// spread evenly, and a worker that answered in-band (a stream ended) is not
/// polled before a whole interval has passed since. The load of a busy
/// worker comes from its streams; polls keep idle workers' health, draining
/// and queue fresh, and HTTP/2 keepalive detects a dead connection between
/// them (BENCHMARKS.md, "Fleet scale").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PollPlan {
    /// The shortest interval between two polls of one worker.
    pub base: Duration,
    /// Polls per second this router spends on all its workers together;
    /// `None`: no limit, every worker is polled every `base`.
    pub budget: Option<f64>,
}

/// A worker's interval varies by up to this fraction either way, so that
/// polls registered together do not stay in step.
pub const POLL_JITTER: f64 = 0.2;

impl PollPlan {
    /// The interval between two polls of one worker when `workers` are
    /// registered.
    pub fn interval(&self, workers: usize) -> Duration {
        match self.budget {
            Some(budget) if budget > 0.0 => self
                .base
                .max(Duration::from_secs_f64(workers as f64 / budget)),
            _ => self.base,
        }
    }

    /// The wait before a worker's next poll, `interval` scaled by `jitter`
    /// (in `-1.0..=1.0`, drawn by the caller) times [`POLL_JITTER`]; after
    /// `failures` failed polls in a row, shorter (`base` doubled per
    /// failure, up to the interval), so that a worker that has just
    /// registered, or just failed one poll, is retried soon without many
    /// unanswering workers taking the whole budget.
    pub fn wait(&self, interval: Duration, failures: u32, jitter: f64) -> Duration {
        let interval = match failures {
            0 => interval,
            n => interval.min(self.base.saturating_mul(1 << (n - 1).min(20))),
        };
        interval.mul_f64(1.0 + POLL_JITTER * jitter.clamp(-1.0, 1.0))
    }

    /// When a worker last heard from `heard_ago` is next due, given the
    /// `wait` after its last poll (`since_poll` ago): not before `wait` has
    /// passed since both. `Duration::ZERO`: due now.
    pub fn due_in(wait: Duration, since_poll: Duration, heard_ago: Option<Duration>) -> Duration {
        let since = heard_ago.map_or(since_poll, |h| h.min(since_poll));
        wait.saturating_sub(since)
    }
}

/// What every poller of one registry shares.
struct Polling {
    plan: PollPlan,
    /// Workers registered now, for [`PollPlan::interval`].
    workers: AtomicUsize,
    /// Woken whenever a worker may have become ready or unready.
    changes: Arc<Notify>,
}

/// Counts one stream against an endpoint's load until dropped (that is, until
/// the stream ends, not when its headers arrive).
pub struct InFlight(Arc<Endpoint>);

impl InFlight {
    /// Starts counting.
    pub fn new(ep: Arc<Endpoint>) -> Self {
        ep.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(ep)
    }

    /// The endpoint counted.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One model's versions and policy.
#[derive(Debug, Default, Clone)]
pub struct ModelEntry {
    pub policy: Option<PolicyRecord>,
    /// version -> endpoints; shared slices, so cloning an entry is cheap.
    pub versions: BTreeMap<String, Arc<[Arc<Endpoint>]>>,
}

/// Every model with its versions' endpoints, as the request path reads it:
/// built once after a change and shared, so that a routing decision costs
/// the same with 10 or 1,000 workers (BENCHMARKS.md, "Fleet scale").
struct View {
    /// The registry's generation this view was built at.
    generation: u64,
    models: Arc<BTreeMap<String, ModelEntry>>,
}

/// The shared routing state.
pub struct Registry {
    settings: ChannelSettings,
    /// Mutual TLS towards workers; `None` dials plaintext (`--insecure`).
    tls: Option<MeshTls>,
    workers: RwLock<HashMap<String, Arc<Endpoint>>>,
    policies: RwLock<HashMap<String, PolicyRecord>>,
    /// Worker ids with a drain key, also those not (yet) registered.
    drained: RwLock<HashSet<String>>,
    /// What this router's requests did, per version.
    stats: Arc<Stats>,
    /// True once discovery delivered its first full view (the static file,
    /// or etcd's snapshot); before it, an unknown model proves nothing.
    loaded: tokio::sync::watch::Sender<bool>,
    /// Woken whenever a worker may have become ready or unready.
    changes: Arc<Notify>,
    polling: Arc<Polling>,
    /// Bumped after every change of the workers or policies: a [`View`]
    /// of an older generation is rebuilt before it is read.
    generation: AtomicU64,
    view: RwLock<Option<View>>,
}

/// Why a worker could not be added.
#[derive(Debug, thiserror::Error)]
#[error("worker {id}: invalid address {addr:?}: {reason}")]
pub struct BadAddress {
    pub id: String,
    pub addr: String,
    pub reason: String,
}

impl Registry {
    /// An empty registry whose channels use `settings`.
    pub fn new(settings: ChannelSettings, tls: Option<MeshTls>) -> Arc<Self> {
        let changes = Arc::new(Notify::new());
        let polling = Arc::new(Polling {
            plan: PollPlan {
                base: settings.status_interval,
                budget: settings.status_poll_budget,
            },
            workers: AtomicUsize::new(0),
            changes: changes.clone(),
        });
        Arc::new(Self {
            settings,
            tls,
            workers: RwLock::new(HashMap::new()),
            policies: RwLock::new(HashMap::new()),
            drained: RwLock::new(HashSet::new()),
            stats: Arc::new(Stats::default()),
            loaded: tokio::sync::watch::channel(false).0,
            changes,
            polling,
            generation: AtomicU64::new(0),
            view: RwLock::new(None),
        })
    }

    /// Marks the view stale; called after (never before) a change, so a view
    /// built at the new generation sees it. The stale view is dropped at once:
    /// it holds the endpoints, and a removed endpoint's poller stops only
    /// when the last of them goes.
    fn changed_view(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        *self.view.write().expect("registry lock") = None;
        let workers = self.workers.read().expect("registry lock").len();
        self.polling.workers.store(workers, Ordering::SeqCst);
    }

    /// How often each worker is polled now (before jitter).
    pub fn poll_interval(&self) -> Duration {
        self.polling
            .plan
            .interval(self.polling.workers.load(Ordering::SeqCst))
    }

    /// The current view, rebuilt if a change made it stale.
    fn view(&self) -> Arc<BTreeMap<String, ModelEntry>> {
        let generation = self.generation.load(Ordering::SeqCst);
        if let Some(v) = &*self.view.read().expect("registry lock") {
            if v.generation == generation {
                return v.models.clone();
            }
        }
        let models = Arc::new(self.build_view());
        let mut slot = self.view.write().expect("registry lock");
        // Kept only if no change came while it was built (that change's
        // `changed_view` then runs after this store and drops it, or before
        // it and bumped the generation).
        if self.generation.load(Ordering::SeqCst) == generation {
            *slot = Some(View {
                generation,
                models: models.clone(),
            });
        }
        models
    }

    fn build_view(&self) -> BTreeMap<String, ModelEntry> {
        let mut versions: BTreeMap<String, BTreeMap<String, Vec<Arc<Endpoint>>>> = BTreeMap::new();
        for ep in self.workers.read().expect("registry lock").values() {
            versions
                .entry(ep.model.clone())
                .or_default()
                .entry(ep.version.clone())
                .or_default()
                .push(ep.clone());
        }
        let mut out: BTreeMap<String, ModelEntry> = versions
            .into_iter()
            .map(|(model, vs)| {
                let versions = vs
                    .into_iter()
                    .map(|(v, mut eps)| {
                        // A stable order, whatever the hash map's.
                        eps.sort_by(|a, b| a.id.cmp(&b.id));
                        (v, Arc::from(eps))
                    })
                    .collect();
                (
                    model,
                    ModelEntry {
                        policy: None,
                        versions,
                    },
                )
            })
            .collect();
        for (model, policy) in self.policies.read().expect("registry lock").iter() {
            out.entry(model.clone()).or_default().policy = Some(policy.clone());
        }
        out
    }

    /// How many workers may take new streams now.
    pub fn ready_workers(&self) -> usize {
        self.workers
            .read()
            .expect("registry lock")
            .values()
            .filter(|ep| ep.ready())
            .count()
    }

    /// Resolves after the next change that may make a worker ready or
    /// unready (one waiter; a change before the call is not lost).
    pub async fn changed(&self) {
        self.changes.notified().await;
    }

    /// Discovery has delivered its first full view.
    pub fn mark_loaded(&self) {
        self.loaded.send_replace(true);
    }

    /// Whether discovery has delivered its first full view.
    pub fn is_loaded(&self) -> bool {
        *self.loaded.borrow()
    }

    /// Resolves once discovery has delivered its first full view.
    pub async fn wait_loaded(&self) {
        let mut rx = self.loaded.subscribe();
        // The sender lives as long as the registry, which we borrow.
        let _ = rx.wait_for(|loaded| *loaded).await;
    }

    /// The per-version counters the request path writes.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Marks or unmarks a worker as drained by a drain key; applies to a
    /// worker that registers later too.
    pub fn set_drain(&self, id: &str, drained: bool) {
        let mut set = self.drained.write().expect("registry lock");
        let changed = if drained {
            set.insert(id.to_string())
        } else {
            set.remove(id)
        };
        if let Some(ep) = self.workers.read().expect("registry lock").get(id) {
            ep.drain_requested.store(drained, Ordering::SeqCst);
        }
        self.changes.notify_one();
        if changed {
            tracing::info!(worker = %id, drained, "drain request");
        }
    }

    /// Replaces every drain request (after a full resynchronisation).
    pub fn set_drained(&self, ids: HashSet<String>) {
        let mut set = self.drained.write().expect("registry lock");
        for (id, ep) in self.workers.read().expect("registry lock").iter() {
            ep.drain_requested.store(ids.contains(id), Ordering::SeqCst);
        }
        *set = ids;
        self.changes.notify_one();
    }

    /// Adds or replaces a worker. An unchanged registration keeps its channel.
    pub fn upsert_worker(
        &self,
        id: &str,
        model: &str,
        version: &str,
        record: WorkerRecord,
    ) -> Result<(), BadAddress> {
        if let Some(existing) = self.workers.read().expect("registry lock").get(id) {
            if existing.record == record && existing.model == model && existing.version == version {
                return Ok(());
            }
        }
        let bad = |reason: String| BadAddress {
            id: id.into(),
            addr: record.addr.clone(),
            reason,
        };
        let s = &self.settings;
        let uri = dial_uri(&record.addr, self.tls.is_some()).map_err(bad)?;
        let endpoint = TonicEndpoint::from_shared(uri)
            .map_err(|e| bad(e.to_string()))?
            .connect_timeout(s.connect_timeout)
            .http2_keep_alive_interval(s.keepalive_interval)
            .keep_alive_timeout(s.keepalive_timeout)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        let channel = match &self.tls {
            // The worker must prove it is the worker_id it registered under:
            // an impostor fails the handshake, its Status polls fail, and it
            // stays unhealthy, so no request is ever routed to it.
            Some(tls) => {
                let expected = Identity::new(Role::Worker, id).map_err(|e| bad(e.to_string()))?;
                let connector = tls.connector_to(expected).map_err(|e| bad(e.to_string()))?;
                endpoint.connect_with_connector_lazy(connector)
            }
            None => endpoint.connect_lazy(),
        };
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let recheck = Arc::new(Notify::new());
        let labels = [
            ("model", model.to_string()),
            ("version", version.to_string()),
            ("worker", id.to_string()),
        ];
        let ep = Arc::new(Endpoint {
            id: id.into(),
            id_hash: xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
            registration_hash: {
                use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
                let seed = xxh3_64_with_seed(id.as_bytes(), xxh3_64(record.addr.as_bytes()));
                xxh3_64_with_seed(record.started_at.as_bytes(), seed)
            },
            model: model.into(),
            version: version.into(),
            record,
            channel,
            in_flight: AtomicU32::new(0),
            reported_queue: AtomicU32::new(0),
            healthy: AtomicBool::new(false),
            unhealthy_spells: AtomicU32::new(0),
            draining: AtomicBool::new(false),
            drain_requested: AtomicBool::new(false),
            heard_at_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            queue_gauge: metrics::gauge!("llm_queue_depth", &labels),
            healthy_gauge: metrics::gauge!("llm_endpoint_healthy", &labels),
            stream_series: Default::default(),
            changes: self.changes.clone(),
            recheck: recheck.clone(),
            _stop: stop_tx,
        });
        tokio::spawn(poll_status(
            Arc::downgrade(&ep),
            self.polling.clone(),
            recheck,
            stop_rx,
        ));
        // Under the drain lock, so a drain request cannot slip between the
        // check and the insert.
        let drained = self.drained.read().expect("registry lock");
        ep.drain_requested
            .store(drained.contains(id), Ordering::SeqCst);
        tracing::info!(worker = %id, model, version, addr = %ep.record.addr, drained = drained.contains(id), "worker added");
        self.workers
            .write()
            .expect("registry lock")
            .insert(id.into(), ep);
        self.changed_view();
        self.changes.notify_one();
        Ok(())
    }

    /// Removes a worker; streams already on it continue.
    pub fn remove_worker(&self, id: &str) {
        if self
            .workers
            .write()
            .expect("registry lock")
            .remove(id)
            .is_some()
        {
            tracing::info!(worker = %id, "worker removed");
            self.changed_view();
            self.changes.notify_one();
        }
    }

    /// Keeps only the listed worker ids (after a full resynchronisation).
    pub fn retain_workers(&self, keep: &std::collections::HashSet<String>) {
        self.workers
            .write()
            .expect("registry lock")
            .retain(|id, _| keep.contains(id));
        self.changed_view();
        self.changes.notify_one();
    }

    /// Sets or clears a model's traffic policy.
    pub fn set_policy(&self, model: &str, policy: Option<PolicyRecord>) {
        let mut p = self.policies.write().expect("registry lock");
        match policy {
            Some(policy) => {
                tracing::info!(model, ?policy, "traffic policy");
                p.insert(model.into(), policy);
            }
            None => {
                p.remove(model);
            }
        }
        drop(p);
        self.changed_view();
    }

    /// A model's traffic policy, if it has one.
    pub fn policy(&self, model: &str) -> Option<PolicyRecord> {
        self.policies
            .read()
            .expect("registry lock")
            .get(model)
            .cloned()
    }

    /// Keeps only the listed policies (after a full resynchronisation).
    pub fn retain_policies(&self, keep: &std::collections::HashSet<String>) {
        self.policies
            .write()
            .expect("registry lock")
            .retain(|m, _| keep.contains(m));
        self.changed_view();
    }

    /// Every model known from workers or policies, with its endpoints.
    pub fn models(&self) -> BTreeMap<String, ModelEntry> {
        (*self.view()).clone()
    }

    /// Whether any worker or policy knows `name`.
    pub fn has_model(&self, name: &str) -> bool {
        self.view().contains_key(name)
    }

    /// The workers of `model`/`version` (ready or not), sorted by id.
    pub fn endpoints(&self, model: &str, version: &str) -> Arc<[Arc<Endpoint>]> {
        self.view()
            .get(model)
            .and_then(|m| m.versions.get(version))
            .cloned()
            .unwrap_or_else(|| Arc::from(Vec::new()))
    }

    /// One model's entry, if it is known.
    pub fn model(&self, name: &str) -> Option<ModelEntry> {
        self.view().get(name).cloned()
    }
}

impl WorkerViews for Registry {
    fn worker_views(&self) -> BTreeMap<(String, String), BTreeMap<String, WorkerView>> {
        let mut out: BTreeMap<(String, String), BTreeMap<String, WorkerView>> = BTreeMap::new();
        for ep in self.workers.read().expect("registry lock").values() {
            out.entry((ep.model.clone(), ep.version.clone()))
                .or_default()
                .insert(
                    ep.id.clone(),
                    WorkerView {
                        healthy: ep.healthy.load(Ordering::SeqCst),
                        draining: ep.is_draining(),
                        in_flight: ep.in_flight.load(Ordering::SeqCst),
                        queue_depth: ep.reported_queue.load(Ordering::SeqCst),
                    },
                );
        }
        out
    }

    fn policy_versions(&self) -> std::collections::BTreeSet<(String, String)> {
        let mut out = std::collections::BTreeSet::new();
        for (model, p) in self.policies.read().expect("registry lock").iter() {
            out.insert((model.clone(), p.stable.clone()));
            if let Some(c) = &p.canary {
                out.insert((model.clone(), c.version.clone()));
            }
        }
        out
    }
}

/// The URI tonic dials for a registered address. TLS towards workers is
/// decided by the router's own flags, not by the address: under mutual TLS
/// the connector wraps the TCP stream itself, so `https://` (what a user of
/// an mTLS mesh naturally writes) and `http://` both dial it; a plaintext
/// router refuses `https://`, which would promise an encryption it does not
/// do. A bare `HOST:PORT` is taken as `http://`.
pub fn dial_uri(addr: &str, tls: bool) -> Result<String, String> {
    let (scheme, rest) = match addr.split_once("://") {
        Some((scheme, rest)) => (Some(scheme.to_ascii_lowercase()), rest),
        None => (None, addr),
    };
    match scheme.as_deref() {
        None | Some("http") => Ok(format!("http://{rest}")),
        Some("https") if tls => Ok(format!("http://{rest}")),
        Some("https") => Err(
            "https:// but this router runs --insecure, in plaintext to its workers; \
             write http:// or start the router with --tls-dir"
                .into(),
        ),
        Some(other) => Err(format!(
            "scheme {other}:// is not supported; write http://HOST:PORT or https://HOST:PORT"
        )),
    }
}

/// Polls a worker's Status until the endpoint is dropped: health, load and
/// draining come from here, and between polls from the worker's streams
/// ([`Endpoint::note_load`]); when, [`PollPlan`] says. The first poll is at
/// once, so a new worker is ready as soon as it answers, and so is the one
/// after a call found the worker unreachable (`recheck`,
/// [`Endpoint::unreachable`]). Each change of health is logged once, a
/// worker that never answers included, with the error.
async fn poll_status(
    ep: std::sync::Weak<Endpoint>,
    polling: Arc<Polling>,
    recheck: Arc<Notify>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let plan = polling.plan;
    // A poll may take a whole base interval (at least 500 ms), not the
    // longer interval of a large fleet: a slow answer is a failed one.
    let timeout = plan.base.max(Duration::from_millis(500));
    let polls = |outcome: &'static str| metrics::counter!("llm_router_status_polls_total", "outcome" => outcome);
    let (ok, failed, deferred) = (polls("ok"), polls("failed"), polls("deferred"));
    // What was last logged: None until the first poll has answered or failed.
    let mut logged: Option<bool> = None;
    let mut failures = 0u32;
    let mut polled_at: Option<Instant> = None;
    loop {
        if let Some(at) = polled_at {
            let interval = plan.interval(polling.workers.load(Ordering::SeqCst));
            let wait = plan.wait(interval, failures, rand::random_range(-1.0..=1.0));
            // Put off while the worker answers in-band; re-checked after
            // each sleep, since a stream may have ended meanwhile. Each
            // sleep past the poll's own time is one poll saved.
            loop {
                let (due_in, by_poll) = {
                    let Some(ep) = ep.upgrade() else { return };
                    let now = Instant::now();
                    let heard = ep
                        .healthy
                        .load(Ordering::SeqCst)
                        .then(|| ep.heard_ago(now))
                        .flatten();
                    let since_poll = now - at;
                    (
                        PollPlan::due_in(wait, since_poll, heard),
                        wait.saturating_sub(since_poll),
                    )
                };
                if due_in.is_zero() {
                    break;
                }
                if by_poll.is_zero() {
                    deferred.increment(1);
                }
                tokio::select! {
                    _ = tokio::time::sleep(due_in) => {}
                    _ = recheck.notified() => break,
                    _ = &mut stop => return,
                }
            }
        }
        let Some(ep) = ep.upgrade() else { return };
        polled_at = Some(Instant::now());
        let mut client = ep.client();
        let mut req = tonic::Request::new(StatusRequest {});
        req.set_timeout(timeout);
        let answer = tokio::select! {
            a = client.status(req) => a,
            _ = &mut stop => return,
        };
        match answer {
            Ok(resp) => {
                ok.increment(1);
                failures = 0;
                let s = resp.into_inner();
                ep.queue_gauge.set(s.queue_depth as f64);
                ep.healthy_gauge.set(1.0);
                ep.reported_queue.store(s.queue_depth, Ordering::SeqCst);
                ep.heard();
                let was_draining = ep.draining.swap(s.draining, Ordering::SeqCst);
                let became_healthy = ep.set_healthy(true);
                if became_healthy || was_draining != s.draining {
                    polling.changes.notify_one();
                }
                if logged != Some(true) {
                    tracing::info!(worker = %ep.id, "worker healthy");
                    logged = Some(true);
                }
            }
            Err(e) => {
                failed.increment(1);
                failures = failures.saturating_add(1);
                ep.healthy_gauge.set(0.0);
                if ep.set_healthy(false) {
                    polling.changes.notify_one();
                }
                if logged != Some(false) {
                    tracing::warn!(
                        worker = %ep.id,
                        addr = %ep.record.addr,
                        code = ?e.code(),
                        error = %error_chain(&e),
                        "worker unhealthy: its status poll failed; no streams go to it until it answers"
                    );
                    logged = Some(false);
                }
            }
        }
    }
}

/// A status's message and the errors beneath it ("transport error" alone
/// says nothing about a refused connection or a wrong certificate).
fn error_chain(e: &tonic::Status) -> String {
    let mut out = e.message().to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        source = s.source();
    }
    out
}

/// Registries and endpoints for unit tests: no worker behind them, and a
/// status poller slow enough never to override the flags a test sets.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use std::time::Duration;

    /// Channel settings with a status interval of an hour.
    pub fn settings() -> ChannelSettings {
        ChannelSettings {
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(1),
            status_interval: Duration::from_secs(3600),
            status_poll_budget: None,
        }
    }

    /// An empty plaintext registry.
    pub fn registry() -> Arc<Registry> {
        Registry::new(settings(), None)
    }

    /// Adds worker `id` of `model`/`version`, healthy if `healthy`.
    pub fn add(
        reg: &Registry,
        id: &str,
        model: &str,
        version: &str,
        healthy: bool,
    ) -> Arc<Endpoint> {
        let record = WorkerRecord::new("http://127.0.0.1:9");
        reg.upsert_worker(id, model, version, record).unwrap();
        let ep = reg.model(model).unwrap().versions[version]
            .iter()
            .find(|e| e.id == id)
            .unwrap()
            .clone();
        ep.set_healthy(healthy);
        ep
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{add as add_to, registry};
    use super::*;

    fn add(reg: &Registry, id: &str) -> Arc<Endpoint> {
        add_to(reg, id, "m", "v1", true)
    }

    #[test]
    fn the_router_s_flags_not_the_address_decide_tls() {
        let tls = true;
        for addr in ["https://w:1", "HTTPS://w:1", "http://w:1", "w:1"] {
            assert_eq!(dial_uri(addr, tls).as_deref(), Ok("http://w:1"), "{addr}");
        }
        assert_eq!(dial_uri("http://w:1", !tls).as_deref(), Ok("http://w:1"));
        let refused = dial_uri("https://w:1", !tls).unwrap_err();
        assert!(refused.contains("--insecure"), "{refused}");
        let refused = dial_uri("grpc://w:1", tls).unwrap_err();
        assert!(refused.contains("grpc://"), "{refused}");
    }

    #[tokio::test]
    async fn ready_workers_counts_and_changes_wake_the_watcher() {
        let reg = registry();
        assert_eq!(reg.ready_workers(), 0);
        let ep = add(&reg, "w1");
        // The add woke it; a drain key does too.
        tokio::time::timeout(std::time::Duration::from_secs(1), reg.changed())
            .await
            .expect("the add is a change");
        assert_eq!(reg.ready_workers(), 1);
        reg.set_drain("w1", true);
        tokio::time::timeout(std::time::Duration::from_secs(1), reg.changed())
            .await
            .expect("the drain key is a change");
        assert_eq!(reg.ready_workers(), 0);
        assert!(!ep.ready());
    }

    #[tokio::test]
    async fn the_shared_view_follows_every_change() {
        let reg = registry();
        assert!(!reg.has_model("m") && reg.model("m").is_none());
        add(&reg, "w2");
        add(&reg, "w1");
        // Read once, so the next reads must see later changes through a
        // rebuilt view, not the cached one.
        let ids = |reg: &Registry| -> Vec<String> {
            reg.endpoints("m", "v1")
                .iter()
                .map(|e| e.id.clone())
                .collect()
        };
        assert_eq!(ids(&reg), ["w1", "w2"]);
        add(&reg, "w3");
        assert_eq!(ids(&reg), ["w1", "w2", "w3"]);
        reg.remove_worker("w2");
        assert_eq!(ids(&reg), ["w1", "w3"]);
        reg.retain_workers(&HashSet::from(["w3".to_string()]));
        assert_eq!(ids(&reg), ["w3"]);
        assert!(reg.endpoints("m", "v9").is_empty());
        reg.set_policy("p", Some(PolicyRecord::default()));
        assert!(reg.has_model("p") && reg.model("p").unwrap().policy.is_some());
        assert_eq!(reg.models().keys().collect::<Vec<_>>(), ["m", "p"]);
        reg.retain_policies(&HashSet::new());
        assert!(!reg.has_model("p"));
        reg.retain_workers(&HashSet::new());
        assert!(!reg.has_model("m") && reg.models().is_empty());
    }

    #[tokio::test]
    async fn a_drain_key_excludes_the_worker_until_deleted() {
        let reg = registry();
        let ep = add(&reg, "w1");
        assert!(ep.ready());
        reg.set_drain("w1", true);
        assert!(!ep.ready() && ep.is_draining());
        // The worker's own Status report does not lift a drain key.
        ep.draining.store(false, Ordering::SeqCst);
        assert!(!ep.ready());
        reg.set_drain("w1", false);
        assert!(ep.ready());
    }

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn the_poll_interval_grows_with_the_fleet_past_the_budget() {
        let plan = PollPlan {
            base: MS(1_000),
            budget: Some(200.0),
        };
        // Up to budget × base workers, the base interval: as before.
        assert_eq!(plan.interval(0), MS(1_000));
        assert_eq!(plan.interval(200), MS(1_000));
        // Past it, N / budget: the router's polls stay at the budget.
        assert_eq!(plan.interval(500), MS(2_500));
        assert_eq!(plan.interval(1_000), MS(5_000));
        assert_eq!(plan.interval(10_000), MS(50_000));
        for n in [300usize, 1_000, 10_000] {
            let per_s = n as f64 / plan.interval(n).as_secs_f64();
            assert!((per_s - 200.0).abs() < 1e-6, "{n} workers: {per_s} polls/s");
        }
        // No budget (0 or None): every worker at the base interval.
        for budget in [None, Some(0.0)] {
            let plan = PollPlan { budget, ..plan };
            assert_eq!(plan.interval(10_000), MS(1_000));
        }
    }

    #[test]
    fn polls_are_jittered_and_retried_sooner_after_failures() {
        let plan = PollPlan {
            base: MS(1_000),
            budget: Some(200.0),
        };
        let interval = plan.interval(1_000);
        assert_eq!(plan.wait(interval, 0, 0.0), MS(5_000));
        assert_eq!(plan.wait(interval, 0, 1.0), MS(6_000));
        assert_eq!(plan.wait(interval, 0, -1.0), MS(4_000));
        assert_eq!(plan.wait(interval, 0, 7.0), MS(6_000), "clamped");
        // base, 2 base, 4 base, then the interval again.
        let after: Vec<Duration> = (1..=5).map(|f| plan.wait(interval, f, 0.0)).collect();
        assert_eq!(
            after,
            [MS(1_000), MS(2_000), MS(4_000), MS(5_000), MS(5_000)]
        );
        assert_eq!(plan.wait(interval, u32::MAX, 0.0), MS(5_000), "no overflow");
    }

    #[test]
    fn an_in_band_answer_puts_the_next_poll_off() {
        let wait = MS(5_000);
        // Polled 5 s ago, never heard otherwise: due.
        assert_eq!(PollPlan::due_in(wait, MS(5_000), None), Duration::ZERO);
        assert_eq!(PollPlan::due_in(wait, MS(2_000), None), MS(3_000));
        // A stream ended 1 s ago: due 5 s after that, not after the poll.
        assert_eq!(
            PollPlan::due_in(wait, MS(5_000), Some(MS(1_000))),
            MS(4_000)
        );
        // Heard before the last poll: the poll counts.
        assert_eq!(
            PollPlan::due_in(wait, MS(1_000), Some(MS(3_000))),
            MS(4_000)
        );
    }

    #[tokio::test]
    async fn in_band_load_updates_the_endpoint_and_only_an_end_counts_as_an_answer_or_a_queue() {
        let reg = registry();
        let ep = add(&reg, "w1");
        assert!(ep.heard_ago(Instant::now()).is_none());
        // Polled: the worker's queue of 2 is its load.
        ep.reported_queue.store(2, Ordering::SeqCst);
        assert_eq!(ep.load(), 2);
        ep.note_load(None, true);
        assert_eq!(ep.load(), 2, "no report, no change");
        assert!(ep.heard_ago(Instant::now()).is_none());

        // Accepted: its queue holds the stream just accepted, counted here
        // already; no proof the engine serves either.
        let load = |queue_depth, draining| WorkerLoad {
            queue_depth,
            active_sequences: 3,
            draining,
        };
        let _stream = InFlight::new(ep.clone());
        ep.note_load(Some(&load(5, false)), false);
        assert_eq!(
            ep.load(),
            3,
            "one stream in flight here, the polled 2 there"
        );
        assert!(ep.heard_ago(Instant::now()).is_none());

        // Finished: the load, and an answer that puts the poll off.
        ep.note_load(Some(&load(4, false)), true);
        assert_eq!(ep.load(), 5, "one stream in flight here, 4 queued there");
        ep.note_load(Some(&load(0, false)), true);
        assert_eq!(ep.load(), 1);
        assert!(ep.heard_ago(Instant::now()).unwrap() < MS(1_000));

        // A worker that starts draining says so in-band; readiness learns.
        // (The add's wake-up is taken first; neither await yields to the
        // poller, whose failing poll of port 9 would mark w1 unhealthy.)
        reg.changed().await;
        ep.note_load(Some(&load(0, true)), true);
        assert!(!ep.ready() && ep.is_draining());
        tokio::time::timeout(MS(1_000), reg.changed())
            .await
            .expect("draining is a change");
        ep.note_load(Some(&load(0, false)), false);
        assert!(ep.ready());
    }

    #[tokio::test]
    async fn the_interval_follows_the_number_of_registered_workers() {
        let reg = Registry::new(
            ChannelSettings {
                status_interval: MS(100),
                status_poll_budget: Some(10.0),
                ..testing::settings()
            },
            None,
        );
        assert_eq!(reg.poll_interval(), MS(100));
        for i in 0..30 {
            add(&reg, &format!("w{i}"));
        }
        assert_eq!(reg.poll_interval(), MS(3_000));
        reg.retain_workers(&HashSet::from(["w1".to_string()]));
        assert_eq!(reg.poll_interval(), MS(100));
    }

    #[tokio::test]
    async fn a_drain_key_before_registration_applies_when_the_worker_arrives() {
        let reg = registry();
        reg.set_drain("w2", true);
        let ep = add(&reg, "w2");
        assert!(!ep.ready());
        // A full resynchronisation without the key un-drains it.
        reg.set_drained(HashSet::new());
        assert!(ep.ready());
        reg.set_drained(HashSet::from(["w2".to_string()]));
        assert!(!ep.ready());
    }
}
