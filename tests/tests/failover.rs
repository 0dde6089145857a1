//! Failover: a worker killed mid-stream is replaced without the client noticing.
use tokenmesh_proto::v1::generate_response::Event;
use tokenmesh_proto::v1::GenerateRequest;
use tokenmesh_tests::*;

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_mid_stream_continues_on_another_worker_token_for_token() {
    let dir = tempfile::tempdir().unwrap();
    let a = real_worker("w-1", &[], dir.path()).await;
    let b = real_worker("w-2", &[], dir.path()).await;
    let router = static_router(dir.path(), &[&a, &b], &[]).await;
    let mut client = router.client().await;
    let req = GenerateRequest {
        model: MODEL.into(),
        messages: vec![tokenmesh_proto::v1::ChatMessage {
            role: "user".into(),
            content: "Write a short story about a lighthouse keeper.".into(),
        }],
        max_tokens: Some(60),
        temperature: Some(0.0),
        ..Default::default()
    };
    let reference = collect(&mut client, req.clone()).await.unwrap();
    assert!(reference.token_ids.len() > 20, "{:?}", reference.text);

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
                victim = Some(if acc.worker_id == a.id { &a } else { &b });
            }
            Some(Event::Delta(d)) => {
                ids.extend(d.token_ids);
                text.push_str(&d.text);
                if ids.len() == 10 {
                    victim
                        .unwrap()
                        .proc
                        .signal(nix::sys::signal::Signal::SIGKILL);
                }
            }
            Some(Event::Finished(f)) => finished = Some(f),
            None => {}
        }
    }
    let finished = finished.expect("the stream finishes");
    assert_eq!(finished.failovers, 1);
    assert_ne!(finished.worker_id, victim.unwrap().id);
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    assert_eq!(ids, reference.token_ids, "no token lost or repeated");
    assert_eq!(text, reference.text);
    assert_eq!(
        finished.usage.unwrap().completion_tokens as usize,
        reference.token_ids.len()
    );
}
