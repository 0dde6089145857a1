//! Failover: a worker killed mid-stream is replaced without the client noticing.
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::{ChatMessage, Finished, GenerateRequest};
use tokenmesh_tests::*;

/// The story request every case streams.
fn story(temperature: f32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        messages: vec![ChatMessage {
            role: "user".into(),
            content: "Write a short story about a lighthouse keeper.".into(),
        }],
        max_tokens: Some(60),
        temperature: Some(temperature),
        ..Default::default()
    }
}

/// What a stream disturbed by a kill delivered.
struct Disturbed {
    ids: Vec<u32>,
    text: String,
    finished: Finished,
    /// The worker that was killed.
    victim: String,
}

/// Streams `req`, SIGKILLs the worker serving it (one of `workers`) once
/// `at` tokens have arrived, and reads the stream to its end; checks that the
/// `seq` numbers have no gaps and that one failover moved it elsewhere.
async fn kill_mid_stream(
    client: &mut tokenmesh_proto::v1::inference_client::InferenceClient<tonic::transport::Channel>,
    req: GenerateRequest,
    workers: &[&WorkerProc],
    at: usize,
) -> Disturbed {
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut seqs = Vec::new();
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut finished = None;
    let mut victim: Option<&WorkerProc> = None;
    while let Some(msg) = stream.message().await.unwrap() {
        seqs.push(msg.seq);
        match msg.event {
            Some(Event::Accepted(acc)) => {
                victim = workers.iter().copied().find(|w| w.id == acc.worker_id);
            }
            Some(Event::Delta(d)) => {
                let before = ids.len();
                ids.extend(d.token_ids);
                text.push_str(&d.text);
                if before < at && ids.len() >= at {
                    victim
                        .expect("the accepting worker is one of ours")
                        .proc
                        .signal(nix::sys::signal::Signal::SIGKILL);
                }
            }
            Some(Event::Finished(f)) => finished = Some(f),
            None => {}
        }
    }
    let finished = finished.expect("the stream finishes");
    let victim = victim.unwrap().id.clone();
    assert_eq!(finished.failovers, 1);
    assert_ne!(finished.worker_id, victim);
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    Disturbed {
        ids,
        text,
        finished,
        victim,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_mid_stream_continues_on_another_worker_token_for_token() {
    let dir = tempfile::tempdir().unwrap();
    let a = real_worker("w-1", &[], dir.path()).await;
    let b = real_worker("w-2", &[], dir.path()).await;
    let router = static_router(dir.path(), &[&a, &b], &[]).await;
    let mut client = router.client().await;
    let req = story(0.0);
    let reference = collect(&mut client, req.clone()).await.unwrap();
    assert!(reference.token_ids.len() > 20, "{:?}", reference.text);

    let got = kill_mid_stream(&mut client, req, &[&a, &b], 10).await;
    assert_eq!(got.ids, reference.token_ids, "no token lost or repeated");
    assert_eq!(got.text, reference.text);
    assert_eq!(
        got.finished.usage.unwrap().completion_tokens as usize,
        reference.token_ids.len()
    );
}

/// Seeded sampling draws by (seed, position), so the worker that takes over
/// draws what the killed one would have: the disturbed streams equal
/// undisturbed runs token for token.
#[tokio::test(flavor = "multi_thread")]
async fn seeded_sampling_survives_sigkill_token_for_token() {
    let dir = tempfile::tempdir().unwrap();
    let a = real_worker("w-1", &[], dir.path()).await;
    let b = real_worker("w-2", &[], dir.path()).await;
    let c = real_worker("w-3", &[], dir.path()).await;
    let workers = [&a, &b, &c];
    let router = static_router(dir.path(), &workers, &[]).await;
    let mut client = router.client().await;
    let seeded = |seed| GenerateRequest {
        top_p: Some(0.95),
        seed: Some(seed),
        ..story(0.8)
    };
    // Undisturbed first, while every worker lives; then one kill per stream,
    // at different points, each leaving the rest to another worker.
    let mut references = Vec::new();
    for seed in [7, 8] {
        let reference = collect(&mut client, seeded(seed)).await.unwrap();
        assert!(reference.token_ids.len() > 30, "{:?}", reference.text);
        references.push(reference);
    }
    let mut victims = Vec::new();
    for ((seed, at), reference) in [(7, 8), (8, 20)].into_iter().zip(&references) {
        let alive: Vec<&WorkerProc> = workers
            .iter()
            .copied()
            .filter(|w| !victims.contains(&w.id))
            .collect();
        let got = kill_mid_stream(&mut client, seeded(seed), &alive, at).await;
        assert_eq!(
            got.ids, reference.token_ids,
            "seed {seed}, killed after {at} tokens: the stream differs from the undisturbed run"
        );
        assert_eq!(got.text, reference.text);
        assert_eq!(
            got.finished.finish_reason,
            reference.finished.as_ref().unwrap().finish_reason
        );
        victims.push(got.victim);
    }
}
