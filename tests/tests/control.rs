//! The control plane end to end: real etcd, synthetic workers, routers that
//! publish stats, and `tokenmesh-control` replicas. Canary rollouts are
//! promoted and rolled back on the routers' numbers; policy writes are
//! compare-and-swap; a dead leader is replaced; drains stop new streams.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenmesh_proto::v1::{
    self, control_client::ControlClient, generate_response::Event, GenerateRequest,
};
use tokenmesh_tests::control::{ControlOpts, ControlProc};
use tokenmesh_tests::{
    collect, collect_rest, eventually, Collected, Etcd, EtcdCluster, RouterProc, WorkerOpts,
    WorkerProc,
};
use tonic::transport::Channel;
use tonic::Code;

const MODEL: &str = "synth";

/// etcd, the given synthetic workers (id, version, extra flags), one router
/// publishing stats every 300 ms, and one control replica.
struct Mesh {
    etcd: Etcd,
    _workers: Vec<WorkerProc>,
    router: RouterProc,
    control: ControlProc,
    _dirs: Vec<tempfile::TempDir>,
}

async fn worker(
    etcd: &str,
    id: &str,
    version: &str,
    extra: &[&str],
    dir: &std::path::Path,
) -> WorkerProc {
    let mut o = WorkerOpts::new(id);
    o.version = version.into();
    o.etcd = Some(etcd.into());
    o.synthetic_tokens_per_sec = Some(2000.0);
    o.extra = ["--model-name", MODEL]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    WorkerProc::start(o, dir).await.expect("worker starts")
}

async fn router(etcd: &Etcd, id: &str) -> (RouterProc, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = [
        "--etcd",
        &etcd.url,
        "--router-id",
        id,
        "--stats-interval-ms",
        "300",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let r = RouterProc::start(&args, dir.path())
        .await
        .expect("router starts");
    (r, dir)
}

impl Mesh {
    async fn start(workers: &[(&str, &str, &[&str])]) -> Mesh {
        let etcd = Etcd::start().await.expect("etcd starts");
        let dir = tempfile::tempdir().unwrap();
        let mut ws = Vec::new();
        for (id, version, extra) in workers {
            ws.push(worker(&etcd.url, id, version, extra, dir.path()).await);
        }
        let (router, rdir) = router(&etcd, "r1").await;
        router
            .wait_ready_workers(MODEL, ws.len(), Duration::from_secs(20))
            .await
            .expect("workers ready behind the router");
        let control = ControlProc::start(ControlOpts::new("cp-a", &etcd.url), dir.path())
            .await
            .expect("control plane starts");
        Mesh {
            etcd,
            _workers: ws,
            router,
            control,
            _dirs: vec![dir, rdir],
        }
    }

    async fn set_stable(&self, version: &str) -> v1::PolicyResponse {
        let mut c = self.control.client().await;
        let current = get_policy(&mut c).await.expect("model known");
        c.set_policy(v1::SetPolicyRequest {
            model: MODEL.into(),
            policy: Some(v1::TrafficPolicy {
                stable_version: version.into(),
                sticky: true,
                pin_allowed: true,
                ..Default::default()
            }),
            expected_revision: current.revision,
        })
        .await
        .expect("policy written")
        .into_inner()
    }
}

fn request() -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        prompt: "hello".into(),
        max_tokens: Some(2),
        ..Default::default()
    }
}

/// Sends requests from `n` tasks until `stop`, counting versions served.
fn load(
    router: &RouterProc,
    n: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<(u64, u64)>> {
    (0..n)
        .map(|_| {
            let addr = router.addr.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let ch = tokenmesh_tests::channel(&addr, None).await.unwrap();
                let mut c = v1::inference_client::InferenceClient::new(ch);
                let (mut ok, mut failed) = (0, 0);
                while !stop.load(Ordering::SeqCst) {
                    match collect(&mut c, request()).await {
                        Ok(r) if r.finished.is_some() => ok += 1,
                        _ => failed += 1,
                    }
                }
                (ok, failed)
            })
        })
        .collect()
}

async fn watch_to_end(c: &mut ControlClient<Channel>, timeout: Duration) -> v1::Rollout {
    let mut stream = c
        .watch_rollout(v1::RolloutRequest {
            model: MODEL.into(),
        })
        .await
        .expect("watch starts")
        .into_inner();
    let mut last = None;
    let end = tokio::time::timeout(timeout, async {
        while let Some(r) = stream.message().await.expect("watch stream") {
            last = Some(r);
        }
    })
    .await;
    assert!(
        end.is_ok(),
        "rollout did not end within {timeout:?}: {last:#?}"
    );
    last.expect("at least one rollout state")
}

/// The model's policy as the control plane answers it.
async fn get_policy(c: &mut ControlClient<Channel>) -> Result<v1::PolicyResponse, tonic::Status> {
    let req = v1::GetPolicyRequest {
        model: MODEL.into(),
    };
    Ok(c.get_policy(req).await?.into_inner())
}

/// The stored policy's (stable, canary) versions.
async fn policy_arms(c: &mut ControlClient<Channel>) -> (String, String) {
    let p = get_policy(c)
        .await
        .expect("policy readable")
        .policy
        .expect("model has a policy");
    (p.stable_version, p.canary_version)
}

/// A rollout of v2 through `steps` (percent), holding each for
/// `hold_seconds` and judging a step once it saw `min_requests` canary requests.
fn canary_v2(steps: &[u32], hold_seconds: u32, min_requests: u32) -> v1::StartCanaryRequest {
    v1::StartCanaryRequest {
        model: MODEL.into(),
        canary_version: "v2".into(),
        steps: steps.to_vec(),
        hold_seconds,
        min_requests,
        ..Default::default()
    }
}

fn verdict(d: &v1::Decision) -> v1::Verdict {
    v1::Verdict::try_from(d.verdict).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn healthy_canary_is_promoted_and_the_split_follows_each_step() {
    let mesh = Mesh::start(&[("s1", "v1", &[]), ("c1", "v2", &[])]).await;
    mesh.set_stable("v1").await;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = load(&mesh.router, 4, stop.clone());
    let mut c = mesh.control.client().await;
    let started = c
        .start_canary(canary_v2(&[20, 50, 100], 3, 30))
        .await
        .expect("rollout starts")
        .into_inner();
    assert_eq!(started.steps, vec![20, 50, 100]);
    let end = watch_to_end(&mut c, Duration::from_secs(60)).await;
    stop.store(true, Ordering::SeqCst);
    let mut failed = 0;
    for t in tasks {
        failed += t.await.unwrap().1;
    }
    assert_eq!(failed, 0, "no request failed during the rollout");
    assert_eq!(end.state, v1::RolloutState::Promoted as i32, "{end:#?}");

    // The numbers each step was judged on are the routers' observed split.
    let judged: Vec<&v1::Decision> = end
        .decisions
        .iter()
        .filter(|d| matches!(verdict(d), v1::Verdict::Advance | v1::Verdict::Promote))
        .collect();
    assert_eq!(
        judged.len(),
        3,
        "one verdict per step: {:#?}",
        end.decisions
    );
    for d in judged {
        let (canary, stable) = (d.canary.clone().unwrap(), d.stable.clone().unwrap());
        let total = (canary.requests + stable.requests) as f64;
        let share = canary.requests as f64 / total * 100.0;
        eprintln!(
            "step at {}%: canary took {share:.1}% of {total} requests",
            d.weight
        );
        // The window opens when the controller moves the weight, so a few
        // hundred milliseconds of the previous weight's traffic are in it.
        assert!(
            (share - d.weight as f64).abs() <= 12.0,
            "step at {}%: canary took {share:.1}% of {total} requests",
            d.weight
        );
        assert_eq!(canary.errors, 0);
    }
    assert_eq!(policy_arms(&mut c).await, ("v2".into(), String::new()));
    // And the router follows: everything now goes to v2.
    let mut client = mesh.router.client().await;
    assert!(
        eventually(Duration::from_secs(5), || {
            let mut client = client.clone();
            async move {
                collect(&mut client, request())
                    .await
                    .ok()
                    .and_then(|r| r.accepted)
                    .is_some_and(|a| a.version == "v2")
            }
        })
        .await
    );
    let r = collect(&mut client, request()).await.unwrap();
    assert_eq!(r.accepted.unwrap().version, "v2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_canary_is_rolled_back_within_one_analysis_interval() {
    let last = rolled_back(&["--synthetic-error-rate", "1.0"]).await;
    let canary = last.canary.clone().unwrap();
    // Every finished canary attempt failed; the 4 load tasks may each have
    // one attempt in flight, counted in requests but not yet failed.
    assert!(
        canary.errors + 4 >= canary.requests && canary.error_rate > 0.9,
        "{last:#?}"
    );
    assert!(last.reason.contains("error rate"), "{}", last.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_canary_is_rolled_back_on_time_to_first_token() {
    let last = rolled_back(&["--synthetic-first-token-delay-ms", "300"]).await;
    let (canary, stable) = (last.canary.clone().unwrap(), last.stable.clone().unwrap());
    assert_eq!(canary.errors, 0, "{last:#?}");
    assert!(
        canary.ttft_p99_ms >= 250.0 && stable.ttft_p99_ms < 50.0,
        "{last:#?}"
    );
    assert!(last.reason.contains("TTFT"), "{}", last.reason);
}

/// Runs a rollout whose canary worker has `faults`; checks that it is rolled
/// back at the first analysis round with enough requests, and returns that
/// decision.
async fn rolled_back(faults: &[&str]) -> v1::Decision {
    let mesh = Mesh::start(&[("s1", "v1", &[]), ("c1", "v2", faults)]).await;
    mesh.set_stable("v1").await;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = load(&mesh.router, 4, stop.clone());
    let mut c = mesh.control.client().await;
    let t0 = Instant::now();
    // A long hold: the rollback must not wait for it.
    c.start_canary(canary_v2(&[25, 100], 600, 20))
        .await
        .expect("rollout starts");
    let end = watch_to_end(&mut c, Duration::from_secs(30)).await;
    let took = t0.elapsed();
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(end.state, v1::RolloutState::RolledBack as i32, "{end:#?}");
    assert!(took < Duration::from_secs(20), "rolled back after {took:?}");
    let last = end.decisions.last().unwrap().clone();
    assert_eq!(verdict(&last), v1::Verdict::Rollback);
    assert!(last.canary.as_ref().unwrap().requests >= 20, "{last:#?}");
    assert_eq!(last.decided_by, "cp-a");
    // Within one analysis interval: no round before the rollback saw enough
    // canary requests and let it pass.
    for d in &end.decisions[..end.decisions.len() - 1] {
        let seen = d.canary.as_ref().map(|a| a.requests).unwrap_or(0);
        assert!(
            seen < 20,
            "a round with {seen} canary requests did not roll back: {d:#?}"
        );
    }
    assert_eq!(policy_arms(&mut c).await, ("v1".into(), String::new()));
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_policy_writes_one_wins_the_other_is_aborted() {
    let mesh = Mesh::start(&[("s1", "v1", &[]), ("c1", "v2", &[])]).await;
    let base = mesh.set_stable("v1").await;
    let write = |weight: u32| {
        let addr = mesh.control.addr.clone();
        let rev = base.revision;
        async move {
            let mut c = ControlClient::new(tokenmesh_tests::channel(&addr, None).await.unwrap());
            c.set_policy(v1::SetPolicyRequest {
                model: MODEL.into(),
                policy: Some(v1::TrafficPolicy {
                    stable_version: "v1".into(),
                    canary_version: "v2".into(),
                    canary_weight: weight,
                    sticky: true,
                    pin_allowed: true,
                }),
                expected_revision: rev,
            })
            .await
        }
    };
    let (a, b) = tokio::join!(write(10), write(90));
    let (winner, loser) = match (&a, &b) {
        (Ok(w), Err(l)) => (w.get_ref().clone(), l.clone()),
        (Err(l), Ok(w)) => (w.get_ref().clone(), l.clone()),
        _ => panic!("exactly one write must win: {a:?} / {b:?}"),
    };
    assert_eq!(loser.code(), Code::Aborted, "{loser:?}");
    assert!(
        loser.message().contains("read it again and retry"),
        "{}",
        loser.message()
    );
    let now = get_policy(&mut mesh.control.client().await).await.unwrap();
    assert_eq!(now.revision, winner.revision);
    assert_eq!(now.policy, winner.policy);

    // Bad input, each with its precise status.
    let mut c = mesh.control.client().await;
    let bad_weight = c
        .set_policy(v1::SetPolicyRequest {
            model: MODEL.into(),
            policy: Some(v1::TrafficPolicy {
                stable_version: "v1".into(),
                canary_version: "v2".into(),
                canary_weight: 101,
                ..Default::default()
            }),
            expected_revision: now.revision,
        })
        .await
        .unwrap_err();
    assert_eq!(bad_weight.code(), Code::InvalidArgument, "{bad_weight:?}");
    let unknown_model = c
        .get_policy(v1::GetPolicyRequest {
            model: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown_model.code(), Code::NotFound);
    let unknown_version = c
        .set_policy(v1::SetPolicyRequest {
            model: MODEL.into(),
            policy: Some(v1::TrafficPolicy {
                stable_version: "v9".into(),
                ..Default::default()
            }),
            expected_revision: now.revision,
        })
        .await
        .unwrap_err();
    assert_eq!(
        unknown_version.code(),
        Code::NotFound,
        "{unknown_version:?}"
    );
    let no_workers = c
        .start_canary(v1::StartCanaryRequest {
            model: MODEL.into(),
            canary_version: "v3".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        no_workers.code(),
        Code::FailedPrecondition,
        "{no_workers:?}"
    );
    let start = || v1::StartCanaryRequest {
        model: MODEL.into(),
        canary_version: "v2".into(),
        hold_seconds: 600,
        ..Default::default()
    };
    let descending = || v1::StartCanaryRequest {
        steps: vec![50, 20],
        ..start()
    };
    // The policy names v2 as canary already; a rollout takes it over.
    c.start_canary(start()).await.expect("first rollout starts");
    let again = c.start_canary(start()).await.unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    let bad_steps = c.start_canary(descending()).await.unwrap_err();
    assert!(
        matches!(
            bad_steps.code(),
            Code::InvalidArgument | Code::AlreadyExists
        ),
        "{bad_steps:?}"
    );
    c.rollback(v1::RolloutRequest {
        model: MODEL.into(),
    })
    .await
    .expect("operator rollback");
    let bad_steps = c.start_canary(descending()).await.unwrap_err();
    assert_eq!(bad_steps.code(), Code::InvalidArgument, "{bad_steps:?}");

    // etcd unreachable: writes are UNAVAILABLE, reads say how stale they are.
    let mut mesh = mesh;
    mesh.etcd.kill();
    let write = c
        .set_policy(v1::SetPolicyRequest {
            model: MODEL.into(),
            policy: now.policy.clone(),
            expected_revision: now.revision,
        })
        .await
        .unwrap_err();
    assert_eq!(write.code(), Code::Unavailable, "{write:?}");
    let stale = get_policy(&mut c)
        .await
        .expect("reads fall back to the last snapshot");
    let f = stale.freshness.unwrap();
    assert!(f.stale && !f.reason.is_empty(), "{f:?}");
    assert_eq!(stale.policy.unwrap().stable_version, "v1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_leader_takes_over_the_running_rollout_within_the_ttl() {
    let mesh = Mesh::start(&[("s1", "v1", &[]), ("c1", "v2", &[])]).await;
    mesh.set_stable("v1").await;
    let dir = tempfile::tempdir().unwrap();
    let mut b = ControlProc::start(ControlOpts::new("cp-b", &mesh.etcd.url), dir.path())
        .await
        .expect("second replica starts");
    let etcd = mesh.etcd.client().await;
    let leader_of = |etcd: etcd_client::Client| async move {
        let mut etcd = etcd;
        etcd.leader("/tokenmesh/control/leader")
            .await
            .ok()
            .and_then(|l| l.kv().map(|kv| kv.value_str().unwrap_or("").to_string()))
            .unwrap_or_default()
    };
    assert!(
        eventually(Duration::from_secs(10), || {
            let e = etcd.clone();
            async move { leader_of(e).await == "cp-a" }
        })
        .await,
        "cp-a, started first, leads"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = load(&mesh.router, 2, stop.clone());
    let mut c = b.client().await;
    c.start_canary(canary_v2(&[30, 100], 2, 10))
        .await
        .expect("rollout starts through the follower");
    // Let the leader decide at least once, then kill it.
    let decided_by_a = eventually(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move {
            c.get_rollout(v1::RolloutRequest {
                model: MODEL.into(),
            })
            .await
            .map(|r| {
                r.into_inner()
                    .decisions
                    .iter()
                    .any(|d| d.decided_by == "cp-a")
            })
            .unwrap_or(false)
        }
    })
    .await;
    assert!(decided_by_a, "the leader analyses the rollout");
    let a = mesh.control;
    a.proc.signal(nix::sys::signal::Signal::SIGKILL);
    let killed = Instant::now();
    assert!(
        eventually(Duration::from_secs(6), || {
            let e = etcd.clone();
            async move { leader_of(e).await == "cp-b" }
        })
        .await,
        "cp-b takes over"
    );
    // The lease lapses at most one TTL after its last renewal, which came
    // before the kill; etcd checks expiry every 500 ms, and two tests share
    // the machine's two cores.
    let takeover = killed.elapsed();
    eprintln!("cp-b took over {takeover:?} after cp-a was killed (TTL 2 s)");
    assert!(
        takeover <= Duration::from_millis(2_000 + 1_000),
        "took over after {takeover:?} (TTL 2 s)"
    );
    let end = watch_to_end(&mut c, Duration::from_secs(30)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(end.state, v1::RolloutState::Promoted as i32, "{end:#?}");
    assert_eq!(end.decisions.last().unwrap().decided_by, "cp-b");
    b.proc.terminate(Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drained_worker_gets_no_new_streams_and_finishes_its_own() {
    let etcd = Etcd::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Slow enough that a 60-token stream is still running when the drain lands.
    let slow = |id: &'static str| {
        let mut o = WorkerOpts::new(id);
        o.etcd = Some(etcd.url.clone());
        o.synthetic_tokens_per_sec = Some(30.0);
        o.extra = vec!["--model-name".into(), MODEL.into()];
        o
    };
    let mut a = WorkerProc::start(slow("wa"), dir.path()).await.unwrap();
    let _b = WorkerProc::start(slow("wb"), dir.path()).await.unwrap();
    let (router, _rdir) = router(&etcd, "r1").await;
    router
        .wait_ready_workers(MODEL, 2, Duration::from_secs(20))
        .await
        .unwrap();
    let control = ControlProc::start(ControlOpts::new("cp-a", &etcd.url), dir.path())
        .await
        .unwrap();
    // A long stream pinned on wa: start streams until one lands there.
    let mut client = router.client().await;
    let mut long = None;
    for _ in 0..20 {
        let mut s = client
            .generate(GenerateRequest {
                max_tokens: Some(60),
                ..request()
            })
            .await
            .unwrap()
            .into_inner();
        let first = s.message().await.unwrap().unwrap();
        match first.event {
            Some(Event::Accepted(acc)) if acc.worker_id == "wa" => {
                long = Some(s);
                break;
            }
            _ => drop(s),
        }
    }
    let mut long = long.expect("a stream landed on wa");
    let mut c = control.client().await;
    let drained = c
        .drain_worker(v1::DrainWorkerRequest {
            worker_id: "wa".into(),
            reason: "kernel upgrade".into(),
        })
        .await
        .expect("drain accepted")
        .into_inner()
        .worker
        .unwrap();
    assert!(drained.drain_reason.contains("kernel upgrade"));
    let unknown = c
        .drain_worker(v1::DrainWorkerRequest {
            worker_id: "nope".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    // New streams all go to wb.
    let served = Arc::new(AtomicU64::new(0));
    for _ in 0..10 {
        let r = collect(&mut client, request()).await.expect("served");
        assert_eq!(r.accepted.unwrap().worker_id, "wb");
        served.fetch_add(1, Ordering::SeqCst);
    }
    // The in-flight stream on wa completes, gapless.
    let taken = Collected {
        seqs: vec![0],
        ..Default::default()
    };
    let rest = collect_rest(&mut long, taken)
        .await
        .expect("in-flight stream survives the drain");
    let f = rest.finished.expect("Finished");
    assert_eq!(f.worker_id, "wa");
    assert_eq!(f.failovers, 0);
    assert_eq!(rest.token_ids.len(), 60);
    // Then wa leaves on its own, and its keys go with it.
    let status = a
        .proc
        .wait_exit(Duration::from_secs(20))
        .expect("drained worker exits");
    assert!(status.success(), "{status:?}");
    let mut e = etcd.client().await;
    let left = e
        .get(
            "/tokenmesh/",
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    let keys: Vec<String> = left
        .kvs()
        .iter()
        .map(|k| k.key_str().unwrap().to_string())
        .collect();
    assert!(
        !keys.iter().any(|k| k.ends_with("/wa")),
        "wa's registration and drain key are gone: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auditors_read_operators_write_others_are_refused() {
    use tokenmesh_certs::Role;
    let pki = tokenmesh_tests::Pki::new().unwrap();
    let etcd = Etcd::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let _w = worker(&etcd.url, "s1", "v1", &[], dir.path()).await;
    let mut opts = ControlOpts::new("cp-a", &etcd.url);
    opts.tls = Some((
        pki.issue(Role::Control, "cp-a").unwrap(),
        pki.creds(Role::Operator, "ops").unwrap(),
    ));
    let control = ControlProc::start(opts, dir.path()).await.unwrap();
    let set = |c: ControlClient<Channel>| async move {
        let mut c = c;
        c.set_policy(v1::SetPolicyRequest {
            model: MODEL.into(),
            policy: Some(v1::TrafficPolicy {
                stable_version: "v1".into(),
                ..Default::default()
            }),
            expected_revision: 0,
        })
        .await
    };
    let auditor = pki.creds(Role::Auditor, "audit").unwrap();
    let mut a = control.client_as(Some(&auditor)).await;
    let denied = set(a.clone()).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(denied.message().contains("auditor"), "{}", denied.message());
    set(control.client().await)
        .await
        .expect("the operator writes");
    let read = get_policy(&mut a).await.expect("the auditor reads");
    assert_eq!(read.policy.unwrap().stable_version, "v1");
    let client = pki.creds(Role::Client, "app").unwrap();
    let refused = control
        .client_as(Some(&client))
        .await
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
}

/// Writes the policy `n` times in a row (sticky toggled each time, each a
/// compare-and-swap on the revision the previous one returned); the first
/// failure, with how many went through before it.
async fn write_policy(c: &mut ControlClient<Channel>, n: usize) -> Result<(), String> {
    for i in 0..n {
        let current = get_policy(c)
            .await
            .map_err(|e| format!("read {i}: {e:?}"))?;
        if let Some(f) = current.freshness.filter(|f| f.stale) {
            return Err(format!("read {i} of {n} is stale: {}", f.reason));
        }
        c.set_policy(v1::SetPolicyRequest {
            model: MODEL.into(),
            policy: Some(v1::TrafficPolicy {
                stable_version: "v1".into(),
                sticky: i % 2 == 0,
                ..Default::default()
            }),
            expected_revision: current.revision,
        })
        .await
        .map_err(|e| format!("write {i} of {n}: {e:?}"))?;
    }
    Ok(())
}

/// With one etcd member of three down, or back after an outage, no read is
/// stale and no write fails: a request its member could not take goes to
/// another. (Writes that fail while the rest elect a leader are UNAVAILABLE,
/// as etcd's own client reports them: they may have been applied.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_go_through_while_an_etcd_member_is_down_and_after_it_returns() {
    let mut etcd = EtcdCluster::start().await.expect("etcd cluster starts");
    let dir = tempfile::tempdir().unwrap();
    let _w = worker(&etcd.endpoints(), "s1", "v1", &[], dir.path()).await;
    let control = ControlProc::start(ControlOpts::new("cp-a", &etcd.endpoints()), dir.path())
        .await
        .expect("control plane starts");
    let mut c = control.client().await;
    assert!(
        eventually(Duration::from_secs(20), || {
            let mut c = c.clone();
            async move {
                let workers = c.list_workers(v1::ListWorkersRequest::default()).await;
                workers.is_ok_and(|w| !w.into_inner().workers.is_empty())
            }
        })
        .await,
        "the worker never registered"
    );
    write_policy(&mut c, 5)
        .await
        .expect("writes, all members up");

    etcd.kill(0);
    etcd.wait_quorum()
        .await
        .expect("the other two elect a leader");
    write_policy(&mut c, 30)
        .await
        .expect("writes with one member of three down");

    etcd.restart(0).await.expect("the member starts again");
    write_policy(&mut c, 30)
        .await
        .expect("writes after the member is back");
}
