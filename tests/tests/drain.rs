//! Draining a worker through its etcd key `drain/{worker_id}` (issue 8):
//! routers send it no new stream at once, streams in flight on it finish, and
//! the worker deregisters and exits on its own, taking the key with it (or,
//! with --stay-drained, stays up refusing work).
use std::time::Duration;
use tokenmesh_proto::keys::Keys;
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::{FinishReason, GenerateRequest, StatusRequest, WorkerGenerateRequest};
use tokenmesh_tests::*;
use tonic::Code;

fn words(max_tokens: u32) -> GenerateRequest {
    prompt_request("keep talking please", max_tokens)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_drain_key_moves_new_streams_away_and_the_worker_exits_after_its_streams() {
    const LONG: u32 = 100; // 5 s at 20 tokens/s
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start().await.unwrap();
    let keys = Keys::default();
    let mut workers = Vec::new();
    for id in ["w-a", "w-b"] {
        let opts = WorkerOpts::synthetic(id, "v1", 20.0, &etcd.url, &[]);
        workers.push(WorkerProc::start(opts, dir.path()).await.unwrap());
    }
    let router = etcd_router(dir.path(), &etcd, 2, &[]).await;
    let mut client = router.client().await;

    // A long stream; whichever worker serves it is the one drained.
    let response = client.generate(words(LONG)).await.unwrap();
    let header = response
        .metadata()
        .get("x-tokenmesh-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut stream = response.into_inner();
    let first = stream.message().await.unwrap().expect("Accepted");
    assert_eq!(first.seq, 0);
    let accepted = match first.event {
        Some(Event::Accepted(a)) => a,
        other => panic!("the first message must be Accepted: {other:?}"),
    };
    assert_eq!(header.as_deref(), Some(accepted.worker_id.as_str()));
    let (a, b) = if accepted.worker_id == "w-a" {
        (0, 1)
    } else {
        (1, 0)
    };
    let (a_id, b_id) = (workers[a].id.clone(), workers[b].id.clone());
    // The rest of it, checked for gapless seq numbers from the Accepted on.
    let long = tokio::spawn(async move {
        let taken = Collected {
            seqs: vec![0],
            ..Default::default()
        };
        collect_rest(&mut stream, taken)
            .await
            .expect("the drained stream continues")
    });

    let mut kv = etcd.client().await;
    kv.put(keys.drain(&a_id), "test: drain", None)
        .await
        .unwrap();
    let ready = router
        .wait_ready_workers(MODEL, 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(ready, vec![b_id.clone()]);
    for _ in 0..6 {
        let out = collect(&mut client, words(2)).await.unwrap();
        assert_eq!(
            out.accepted.unwrap().worker_id,
            b_id,
            "no new stream to a drained worker"
        );
        assert_eq!(out.finished.unwrap().worker_id, b_id);
    }
    assert!(
        workers[a].proc.running(),
        "the drained worker waits for its stream"
    );

    let rest = tokio::time::timeout(Duration::from_secs(30), long)
        .await
        .expect("the drained stream finishes")
        .unwrap();
    let finished = rest.finished.expect("Finished");
    assert_eq!(
        rest.token_ids.len(),
        LONG as usize,
        "every token of the drained stream"
    );
    assert_eq!(finished.finish_reason, FinishReason::Length as i32);
    assert_eq!(finished.worker_id, a_id, "finished where it started");
    assert_eq!(finished.failovers, 0);

    let status = workers[a]
        .proc
        .wait_exit(Duration::from_secs(20))
        .expect("the drained worker exits on its own");
    let log = workers[a].proc.log_text();
    assert!(status.success(), "exit {status:?}:\n{log}");
    assert!(log.contains("drain requested through etcd"), "{log}");
    assert_eq!(
        etcd.get_prefix(&keys.worker(MODEL, "v1", &a_id)).await,
        vec![],
        "registration gone"
    );
    assert_eq!(
        etcd.get_prefix(&keys.drain(&a_id)).await,
        vec![],
        "the worker deletes its drain key on exit"
    );
    assert!(workers[b].proc.running());
    assert_eq!(
        etcd.get_prefix(&keys.worker(MODEL, "v1", &b_id))
            .await
            .len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn stay_drained_keeps_the_worker_up_refusing_work_even_when_the_key_came_first() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start().await.unwrap();
    let keys = Keys::default();
    let mut kv = etcd.client().await;
    kv.put(keys.drain("w-c"), "before start", None)
        .await
        .unwrap();
    let opts = WorkerOpts::synthetic("w-c", "v1", 50.0, &etcd.url, &["--stay-drained"]);
    let mut w = WorkerProc::start(opts, dir.path()).await.unwrap();
    let wc = w.client().await;
    let drained = eventually(Duration::from_secs(10), || {
        let mut wc = wc.clone();
        async move {
            wc.status(StatusRequest {})
                .await
                .is_ok_and(|s| s.into_inner().draining)
        }
    })
    .await;
    assert!(drained, "Status reports draining:\n{}", w.proc.log_text());
    let gone = eventually(Duration::from_secs(10), || async {
        etcd.get_prefix(&keys.worker(MODEL, "v1", "w-c"))
            .await
            .is_empty()
            && w.proc.log_text().contains("staying up")
    })
    .await;
    assert!(gone, "deregistered and staying up:\n{}", w.proc.log_text());
    assert!(w.proc.running());
    let Err(refused) = wc
        .clone()
        .generate(WorkerGenerateRequest {
            request: Some(words(2)),
            ..Default::default()
        })
        .await
    else {
        panic!("a drained worker refuses new requests")
    };
    assert_eq!(refused.code(), Code::Unavailable);
    assert!(
        refused.message().contains("worker is draining"),
        "{refused:?}"
    );

    let status = w.proc.terminate(Duration::from_secs(15));
    assert!(status.success(), "{}", w.proc.log_text());
    assert_eq!(etcd.get_prefix(&keys.drain("w-c")).await, vec![]);
}
