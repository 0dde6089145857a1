//! The edges of the mesh (issue 18): a request that does not decode or is too
//! large gets a client status, not INTERNAL or OUT_OF_RANGE, at the router,
//! the worker and the control plane; every client-chosen string and sampling
//! field is bounded before it reaches a log, a span, a metric label or etcd.
use prost::Message;
use std::time::Duration;
use tokenmesh_proto::v1::{self, ChatMessage, GenerateRequest, WorkerGenerateRequest};
use tokenmesh_tests::control::{ControlOpts, ControlProc};
use tokenmesh_tests::*;
use tonic::Code;

/// The documented request-size limits (README, "Calling the mesh").
const ROUTER_LIMIT: usize = 4 * 1024 * 1024;
const WORKER_LIMIT: usize = 8 * 1024 * 1024;
/// The documented bound of ids and names.
const NAME_LIMIT: usize = 128;

/// A status message that does not echo a long client string.
const SHORT_MESSAGE: usize = 400;

/// Bytes of a message with an invalid UTF-8 string (0xC3 0x28) as field 1
/// (`model` of a GenerateRequest, `service`/`model` elsewhere).
fn invalid_utf8_field_1() -> Vec<u8> {
    vec![0x0a, 0x02, 0xc3, 0x28]
}

/// A valid encoding of `m`, cut short in the middle of its last field.
fn truncated(m: &impl Message) -> Vec<u8> {
    let mut b = m.encode_to_vec();
    b.truncate(b.len() - 3);
    b
}

/// A synthetic worker serving MODEL (no etcd) and a router over it.
async fn synthetic_mesh(dir: &std::path::Path, router_extra: &[&str]) -> (WorkerProc, RouterProc) {
    let opts = WorkerOpts {
        extra: vec!["--model-name".into(), MODEL.into()],
        synthetic_tokens_per_sec: Some(1000.0),
        ..WorkerOpts::new("w-edge")
    };
    let w = WorkerProc::start(opts, dir).await.expect("worker starts");
    let router = static_router(dir, &[&w], router_extra).await;
    (w, router)
}

fn assert_status(got: Result<usize, tonic::Status>, code: Code, words: &[&str], what: &str) {
    let err = got.expect_err(&format!("{what} must fail"));
    assert_eq!(err.code(), code, "{what}: {}", err.message());
    for w in words {
        assert!(
            err.message().contains(w),
            "{what}: {:?} lacks {w:?}",
            err.message()
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn undecodable_and_oversize_requests_get_client_statuses() {
    let dir = tempfile::tempdir().unwrap();
    let (w, router) = synthetic_mesh(dir.path(), &[]).await;
    let rch = channel(&router.addr, None).await.unwrap();
    let wch = channel(&w.addr, None).await.unwrap();
    let ok = prompt_request("hello there", 2);
    let nested_bad_utf8 = {
        let inner = invalid_utf8_field_1();
        let mut outer = vec![0x0a, inner.len() as u8];
        outer.extend(inner);
        outer
    };
    let worker_ok = WorkerGenerateRequest {
        request: Some(ok.clone()),
        emitted_token_ids: vec![],
        ..Default::default()
    };
    let undecodable: Vec<(&str, &'static str, Vec<u8>)> = vec![
        (
            "garbage",
            "/tokenmesh.v1.Inference/Generate",
            vec![0xff; 32],
        ),
        (
            "invalid UTF-8",
            "/tokenmesh.v1.Inference/Generate",
            invalid_utf8_field_1(),
        ),
        (
            "truncated",
            "/tokenmesh.v1.Inference/Generate",
            truncated(&ok),
        ),
        (
            "garbage (unary)",
            "/tokenmesh.v1.Inference/ListModels",
            vec![0xff; 32],
        ),
        (
            "worker garbage",
            "/tokenmesh.v1.Worker/Generate",
            vec![0xff; 32],
        ),
        (
            "worker invalid UTF-8",
            "/tokenmesh.v1.Worker/Generate",
            nested_bad_utf8,
        ),
        (
            "worker truncated",
            "/tokenmesh.v1.Worker/Generate",
            truncated(&worker_ok),
        ),
        (
            "worker garbage (unary)",
            "/tokenmesh.v1.Worker/Status",
            vec![0xff; 32],
        ),
    ];
    for (what, path, bytes) in undecodable {
        let ch = if path.starts_with("/tokenmesh.v1.Worker") {
            wch.clone()
        } else {
            rch.clone()
        };
        let got = raw_call(ch, path, bytes).await;
        assert_status(got, Code::InvalidArgument, &["does not decode"], what);
    }

    // Over the limit: RESOURCE_EXHAUSTED naming the limit, at the router's
    // 4 MiB and the worker's 8 MiB (a client's request plus its continuation).
    let got = raw_call(
        rch.clone(),
        "/tokenmesh.v1.Inference/Generate",
        vec![0; ROUTER_LIMIT + 1],
    )
    .await;
    assert_status(
        got,
        Code::ResourceExhausted,
        &[&ROUTER_LIMIT.to_string(), &(ROUTER_LIMIT + 1).to_string()],
        "router oversize",
    );
    let got = raw_call(
        wch.clone(),
        "/tokenmesh.v1.Worker/Generate",
        vec![0; WORKER_LIMIT + 1],
    )
    .await;
    assert_status(
        got,
        Code::ResourceExhausted,
        &[&WORKER_LIMIT.to_string()],
        "worker oversize",
    );
    // gRPC health, mounted by runtime on every server, has the same edge.
    let got = raw_call(
        rch.clone(),
        "/grpc.health.v1.Health/Check",
        invalid_utf8_field_1(),
    )
    .await;
    assert_status(got, Code::InvalidArgument, &["does not decode"], "health");

    // Errors of the services themselves keep their codes, and both serve on.
    let mut client = router.client().await;
    let unknown = GenerateRequest {
        model: "no-such-model".into(),
        ..ok.clone()
    };
    assert_eq!(
        collect(&mut client, unknown).await.unwrap_err().code(),
        Code::NotFound
    );
    assert!(collect(&mut client, ok.clone())
        .await
        .unwrap()
        .finished
        .is_some());
    let valid = worker_ok.encode_to_vec();
    assert!(
        raw_call(wch, "/tokenmesh.v1.Worker/Generate", valid)
            .await
            .unwrap()
            > 1
    );
    for log in [w.proc.log_text(), router.proc.log_text()] {
        assert!(!log.contains("panicked"), "{log}");
    }
}

/// Requests with one field out of bounds, and words the refusal must contain.
fn out_of_bounds() -> Vec<(&'static str, GenerateRequest, Vec<String>)> {
    let ok = prompt_request("hello there", 2);
    let limit = NAME_LIMIT.to_string();
    let over = "x".repeat(NAME_LIMIT + 1);
    let huge = "y".repeat(1 << 20);
    let with = |f: &dyn Fn(&mut GenerateRequest)| {
        let mut r = ok.clone();
        f(&mut r);
        r
    };
    let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        (
            "request_id over the limit",
            with(&|r| r.request_id = over.clone()),
            words(&["request_id", &limit]),
        ),
        (
            "request_id of 1 MB",
            with(&|r| r.request_id = huge.clone()),
            words(&["request_id", &limit]),
        ),
        (
            "request_id with a newline",
            with(&|r| r.request_id = "a\nb".into()),
            words(&["request_id", "control character"]),
        ),
        (
            "session_id of 1 MB",
            with(&|r| r.session_id = huge.clone()),
            words(&["session_id", &limit]),
        ),
        (
            "model of 1 MB",
            with(&|r| r.model = huge.clone()),
            words(&["model", &limit]),
        ),
        (
            "model with a slash",
            with(&|r| r.model = "a/b".into()),
            words(&["model", "letters"]),
        ),
        (
            "version over the limit",
            with(&|r| r.version = Some(over.clone())),
            words(&["version", &limit]),
        ),
        (
            "role of 1 MB",
            with(&|r| {
                r.prompt.clear();
                r.messages = vec![ChatMessage {
                    role: huge.clone(),
                    content: "hi".into(),
                }];
            }),
            words(&["messages.role", "system, user, assistant or tool"]),
        ),
        (
            "empty stop string",
            with(&|r| r.stop = vec!["".into()]),
            words(&["stop", "empty"]),
        ),
        (
            "long stop string",
            with(&|r| r.stop = vec!["z".repeat(257)]),
            words(&["stop", "256"]),
        ),
        (
            "stop strings over the total",
            with(&|r| r.stop = (0..8).map(|i| format!("{i}").repeat(200)).collect()),
            words(&["stop", "1024"]),
        ),
        (
            "too many stop strings",
            with(&|r| r.stop = (0..17).map(|i| format!("s{i}")).collect()),
            words(&["stop", "16"]),
        ),
        (
            "priority outside the enum",
            with(&|r| r.priority = 7),
            words(&["priority", "7", "HIGH"]),
        ),
        (
            "temperature NaN",
            with(&|r| r.temperature = Some(f32::NAN)),
            words(&["temperature", "not a number", "[0, 100]"]),
        ),
        (
            "temperature infinite",
            with(&|r| r.temperature = Some(f32::INFINITY)),
            words(&["temperature", "not finite", "[0, 100]"]),
        ),
        (
            "temperature absurd",
            with(&|r| r.temperature = Some(1000.0)),
            words(&["temperature", "[0, 100]"]),
        ),
        (
            "repetition_penalty NaN",
            with(&|r| r.repetition_penalty = Some(f32::NAN)),
            words(&["repetition_penalty", "not a number", "(0, 100]"]),
        ),
        (
            "repetition_penalty absurd",
            with(&|r| r.repetition_penalty = Some(1e9)),
            words(&["repetition_penalty", "(0, 100]"]),
        ),
    ]
}

fn assert_refused(what: &str, err: &tonic::Status, words: &[String]) {
    assert_eq!(
        err.code(),
        Code::InvalidArgument,
        "{what}: {}",
        err.message()
    );
    for w in words {
        assert!(
            err.message().contains(w.as_str()),
            "{what}: {:?} lacks {w:?}",
            err.message()
        );
    }
    assert!(
        err.message().len() < SHORT_MESSAGE,
        "{what}: the refusal echoes the client's string ({} bytes)",
        err.message().len()
    );
    assert!(
        !err.message().contains("negative"),
        "{what}: {}",
        err.message()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn client_strings_and_sampling_fields_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let (w, router) = synthetic_mesh(dir.path(), &["--metrics-listen", &metrics]).await;
    let mut client = router.client().await;
    let mut worker = w.client().await;
    for (what, req, words) in out_of_bounds() {
        let err = collect(&mut client, req.clone())
            .await
            .expect_err(&format!("the router must refuse {what}"));
        assert_refused(what, &err, &words);
        // The worker applies the same checks to what reaches it directly.
        let direct = WorkerGenerateRequest {
            request: Some(req),
            emitted_token_ids: vec![],
            ..Default::default()
        };
        let err = match worker.generate(direct).await {
            Ok(mut s) => s.get_mut().message().await.expect_err(what),
            Err(e) => e,
        };
        assert_refused(&format!("worker: {what}"), &err, &words);
    }

    // Pin and session taken from headers are bounded the same way.
    for header in ["x-tokenmesh-version", "x-tokenmesh-session"] {
        let mut req = tonic::Request::new(prompt_request("hello there", 2));
        req.metadata_mut()
            .insert(header, "h".repeat(NAME_LIMIT + 1).parse().unwrap());
        let err = client.generate(req).await.expect_err(header);
        assert_refused(header, &err, &[header.to_string(), NAME_LIMIT.to_string()]);
    }

    // Bounds that are not refusals: a huge top_k keeps every token, and ids
    // and stops at their limits pass.
    let at_limits = GenerateRequest {
        top_k: Some(u32::MAX),
        request_id: "r".repeat(NAME_LIMIT),
        session_id: "s".repeat(NAME_LIMIT),
        stop: vec!["q".repeat(256), "never".into()],
        temperature: Some(100.0),
        repetition_penalty: Some(100.0),
        priority: v1::Priority::Low as i32,
        ..prompt_request("hello there", 2)
    };
    let out = collect(&mut client, at_limits).await.unwrap();
    assert!(out.finished.is_some());

    // A model the client names is a metric label only once it is known.
    let unknown = GenerateRequest {
        model: "no-such-model-label".into(),
        ..prompt_request("hello there", 2)
    };
    let err = collect(&mut client, unknown).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let text = scrape_text(&metrics).await.unwrap();
    assert!(
        text.contains("llm_request_total"),
        "the refusals are counted:\n{text}"
    );
    assert!(
        !text.contains("no-such-model-label") && !text.contains(&"y".repeat(NAME_LIMIT)),
        "a client's model string became a metric label:\n{text}"
    );
    for log in [w.proc.log_text(), router.proc.log_text()] {
        assert!(
            !log.contains(&"y".repeat(NAME_LIMIT + 1)),
            "a 1 MB client string reached a log"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn control_api_bounds_names_and_its_transport_edge() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start().await.unwrap();
    let control = ControlProc::start(ControlOpts::new("c-edge", &etcd.url), dir.path())
        .await
        .unwrap();
    let mut c = control.client().await;
    let huge = "m".repeat(1 << 20);
    let over = "v".repeat(NAME_LIMIT + 1);
    let limit = NAME_LIMIT.to_string();
    let check = |what: &str, got: Result<(), tonic::Status>, words: &[&str]| {
        let err = got.expect_err(what);
        let words: Vec<String> = words.iter().map(|s| s.to_string()).collect();
        assert_refused(what, &err, &words);
    };
    let got = c
        .get_policy(v1::GetPolicyRequest {
            model: huge.clone(),
        })
        .await;
    check("GetPolicy, 1 MB model", got.map(drop), &["model", &limit]);
    let got = c
        .get_policy(v1::GetPolicyRequest {
            model: "a/b".into(),
        })
        .await;
    check(
        "GetPolicy, model with a slash",
        got.map(drop),
        &["model", "letters"],
    );
    let got = c
        .list_workers(v1::ListWorkersRequest {
            model: huge.clone(),
        })
        .await;
    check("ListWorkers, 1 MB model", got.map(drop), &["model", &limit]);
    let got = c
        .mesh_status(v1::MeshStatusRequest {
            model: huge.clone(),
        })
        .await;
    check("MeshStatus, 1 MB model", got.map(drop), &["model", &limit]);
    let got = c
        .drain_worker(v1::DrainWorkerRequest {
            worker_id: over.clone(),
            reason: String::new(),
        })
        .await;
    check(
        "DrainWorker, long worker_id",
        got.map(drop),
        &["worker_id", &limit],
    );
    let got = c
        .drain_worker(v1::DrainWorkerRequest {
            worker_id: "w-1".into(),
            reason: "r".repeat(10_000),
        })
        .await;
    check(
        "DrainWorker, long reason",
        got.map(drop),
        &["reason", "512"],
    );
    let got = c
        .start_canary(v1::StartCanaryRequest {
            model: MODEL.into(),
            canary_version: over.clone(),
            ..Default::default()
        })
        .await;
    check(
        "StartCanary, long version",
        got.map(drop),
        &["canary_version", &limit],
    );
    let got = c
        .set_policy(v1::SetPolicyRequest {
            model: MODEL.into(),
            policy: Some(v1::TrafficPolicy {
                stable_version: over.clone(),
                ..Default::default()
            }),
            expected_revision: 0,
        })
        .await;
    check(
        "SetPolicy, long stable_version",
        got.map(drop),
        &["stable_version", &limit],
    );

    let ch = channel(&control.addr, None).await.unwrap();
    let got = raw_call(
        ch.clone(),
        "/tokenmesh.v1.Control/GetPolicy",
        invalid_utf8_field_1(),
    )
    .await;
    assert_status(
        got,
        Code::InvalidArgument,
        &["does not decode"],
        "control invalid UTF-8",
    );
    let got = raw_call(
        ch.clone(),
        "/tokenmesh.v1.Control/WatchRollout",
        vec![0xff; 32],
    )
    .await;
    assert_status(
        got,
        Code::InvalidArgument,
        &["does not decode"],
        "control garbage",
    );
    let got = raw_call(
        ch,
        "/tokenmesh.v1.Control/GetPolicy",
        vec![0; ROUTER_LIMIT + 1],
    )
    .await;
    assert_status(
        got,
        Code::ResourceExhausted,
        &[&ROUTER_LIMIT.to_string()],
        "control oversize",
    );
    assert!(!control.proc.log_text().contains(&huge[..NAME_LIMIT + 1]));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_refuses_names_that_cannot_be_etcd_key_segments() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str]); 3] = [
        ("--model-name", &["--model-name", "a/b"]),
        (
            "--model-version",
            &["--model-name", MODEL, "--model-version", "v 1"],
        ),
        (
            "--worker-id",
            &[
                "--model-name",
                MODEL,
                "--worker-id",
                &"w".repeat(NAME_LIMIT + 1),
            ],
        ),
    ];
    for (i, (flag, flags)) in cases.into_iter().enumerate() {
        let mut args: Vec<String> = [
            "--insecure",
            "--listen",
            "127.0.0.1:0",
            "--engine",
            "synthetic",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if !flags.contains(&"--worker-id") {
            args.extend(["--worker-id".into(), format!("w-{i}")]);
        }
        args.extend(flags.iter().map(|s| s.to_string()));
        let mut p = Proc::spawn(
            &format!("bad-{i}"),
            &bin("tokenmesh-worker"),
            &args,
            dir.path(),
        )
        .unwrap();
        let status = p.wait_exit(Duration::from_secs(20));
        let log = p.log_text();
        assert!(
            status.is_some_and(|s| !s.success()),
            "{flag}: the worker must refuse to start:\n{log}"
        );
        assert!(
            log.contains(flag),
            "{flag}: the refusal names the flag:\n{log}"
        );
    }
}
