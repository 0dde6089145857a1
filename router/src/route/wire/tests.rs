use super::*;
use rand::{Rng, SeedableRng};
use tokenmesh_proto::v1::{Arm, FinishReason, Timings, Usage, WorkerLoad};

fn delta(ids: &[u32], text: &str) -> Delta {
    Delta {
        token_ids: ids.to_vec(),
        text: text.into(),
        logprobs: ids.iter().map(|&i| -(i as f32) / 7.0).collect(),
        usage: Some(Usage {
            prompt_tokens: 12,
            completion_tokens: ids.len() as u32,
        }),
    }
}

fn encoded(seq: u64, event: Option<Event>) -> Bytes {
    Bytes::from(GenerateResponse { seq, event }.encode_to_vec())
}

/// What prost writes for the client: the router's `seq`, the worker's event.
fn expected(seq: u64, d: &Delta) -> Vec<u8> {
    GenerateResponse {
        seq,
        event: Some(Event::Delta(d.clone())),
    }
    .encode_to_vec()
}

fn rewritten(d: &EncodedDelta, seq: u64) -> Vec<u8> {
    let mut out = Vec::new();
    d.encode(seq, &mut out);
    assert_eq!(out.len(), d.encoded_len(seq));
    out
}

fn fast(bytes: Bytes) -> EncodedDelta {
    assert!(
        matches!(scan(&bytes), Some(Shape::Delta { .. })),
        "not the fast path: {bytes:?}"
    );
    match WorkerMessage::parse(bytes).unwrap() {
        WorkerMessage::Delta(d) => d,
        other => panic!("not a delta: {other:?}"),
    }
}

/// Seqs around every varint length boundary.
const SEQS: [u64; 9] = [
    0,
    1,
    127,
    128,
    16_383,
    16_384,
    1 << 35,
    u64::MAX - 1,
    u64::MAX,
];

#[test]
fn a_delta_is_rewritten_to_the_bytes_prost_writes_for_every_seq() {
    for d in [
        delta(&[1, 2, 300, 70_000, u32::MAX], "héllo wörld"),
        delta(&[], ""),
        delta(&[], "text but no token"),
        delta(&[0], ""),
        Delta::default(),
    ] {
        for worker_seq in SEQS {
            let got = fast(encoded(worker_seq, Some(Event::Delta(d.clone()))));
            assert_eq!(got.token_count(), d.token_ids.len());
            assert_eq!(
                got.completion_tokens(),
                d.usage.map(|u| u.completion_tokens)
            );
            assert_eq!(got.token_ids().collect::<Vec<_>>(), d.token_ids);
            assert_eq!(got.decode().unwrap(), d);
            for seq in SEQS {
                assert_eq!(
                    rewritten(&got, seq),
                    expected(seq, &d),
                    "{worker_seq} -> {seq}"
                );
            }
        }
    }
}

#[test]
fn accepted_finished_and_no_event_are_decoded_by_prost() {
    let accepted = Accepted {
        request_id: "r-1".into(),
        model: "m".into(),
        version: "v1".into(),
        arm: Arm::Canary as i32,
        worker_id: "w".into(),
        load: Some(WorkerLoad {
            queue_depth: 3,
            ..Default::default()
        }),
    };
    let finished = Finished {
        finish_reason: FinishReason::Length as i32,
        usage: Some(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
        }),
        timings: Some(Timings {
            queue_ms: 1.5,
            time_to_first_token_ms: 2.5,
            total_ms: 3.5,
        }),
        ..Default::default()
    };
    for seq in SEQS {
        assert_eq!(
            WorkerMessage::parse(encoded(seq, Some(Event::Accepted(accepted.clone())))).unwrap(),
            WorkerMessage::Accepted(accepted.clone())
        );
        assert_eq!(
            WorkerMessage::parse(encoded(seq, Some(Event::Finished(finished.clone())))).unwrap(),
            WorkerMessage::Finished(finished.clone())
        );
        assert_eq!(
            WorkerMessage::parse(encoded(seq, None)).unwrap(),
            WorkerMessage::Empty
        );
    }
    assert_eq!(
        WorkerMessage::parse(Bytes::new()).unwrap(),
        WorkerMessage::Empty
    );
}

/// Appends an unknown field of each wire type (numbers prost's messages
/// do not use) to `buf`.
fn unknown_fields(buf: &mut Vec<u8>) {
    prost::encoding::uint64::encode(9, &300, buf);
    prost::encoding::string::encode(15, &"extra".to_string(), buf);
    prost::encoding::fixed32::encode(20, &7, buf);
    prost::encoding::fixed64::encode(2047, &8, buf);
}

#[test]
fn unknown_fields_are_kept_and_skipped() {
    let d = delta(&[5, 6, 7], "abc");
    // Unknown fields inside the Delta, and around it in the message.
    let mut body = d.encode_to_vec();
    unknown_fields(&mut body);
    let mut msg = Vec::new();
    unknown_fields(&mut msg);
    prost::encoding::uint64::encode(1, &42, &mut msg);
    prost::encoding::bytes::encode(3, &body, &mut msg);
    unknown_fields(&mut msg);
    let got = fast(Bytes::from(msg.clone()));
    assert_eq!(got.token_ids().collect::<Vec<_>>(), [5, 6, 7]);
    assert_eq!(got.decode().unwrap(), d);
    for seq in SEQS {
        let out = rewritten(&got, seq);
        // The worker's seq is gone, the router's is in, the rest is as sent.
        let back = GenerateResponse::decode(&out[..]).unwrap();
        assert_eq!(
            back,
            GenerateResponse::decode(&expected(seq, &d)[..]).unwrap()
        );
        assert_eq!(
            out.len(),
            seq_len(seq) + msg.len() - 2,
            "only seq 42 (2 bytes) removed"
        );
        let kept = out.windows(5).filter(|w| *w == b"extra").count();
        assert_eq!(kept, 2 + 1, "{out:?}");
    }
}

#[test]
fn token_ids_sent_unpacked_or_in_several_fields_are_all_read() {
    let mut body = Vec::new();
    for id in [1u32, 200, 70_000] {
        prost::encoding::uint32::encode(1, &id, &mut body);
    }
    prost::encoding::string::encode(2, &"x".to_string(), &mut body);
    prost::encoding::uint32::encode_packed(1, &[9, 10], &mut body);
    prost::encoding::uint32::encode_packed(1, &[], &mut body);
    let mut msg = Vec::new();
    prost::encoding::uint64::encode(1, &3, &mut msg);
    prost::encoding::bytes::encode(3, &body, &mut msg);
    let got = fast(Bytes::from(msg.clone()));
    assert_eq!(got.token_count(), 5);
    assert_eq!(got.token_ids().collect::<Vec<_>>(), [1, 200, 70_000, 9, 10]);
    assert_eq!(got.decode().unwrap().token_ids, [1, 200, 70_000, 9, 10]);
    let prost_view = GenerateResponse::decode(&msg[..]).unwrap();
    let out = rewritten(&got, 8);
    assert_eq!(
        GenerateResponse::decode(&out[..]).unwrap(),
        GenerateResponse {
            seq: 8,
            ..prost_view
        }
    );
}

#[test]
fn a_token_id_past_u32_is_truncated_as_prost_truncates_it() {
    let mut body = Vec::new();
    prost::encoding::uint64::encode(1, &((1u64 << 40) + 5), &mut body);
    let mut msg = Vec::new();
    prost::encoding::bytes::encode(3, &body, &mut msg);
    let prost_ids = Delta::decode(&body[..]).unwrap().token_ids;
    let got = fast(Bytes::from(msg));
    assert_eq!(got.token_ids().collect::<Vec<_>>(), prost_ids);
}

/// Parses `msg` both ways: prost's answer, and ours as a decoded message.
fn same_as_prost(msg: Vec<u8>) {
    let ours = WorkerMessage::parse(Bytes::from(msg.clone()));
    match GenerateResponse::decode(&msg[..]) {
        Ok(m) => {
            let ours = ours.unwrap_or_else(|e| panic!("prost read {m:?}, we failed: {e}"));
            let event = match ours {
                WorkerMessage::Accepted(a) => Some(Event::Accepted(a)),
                WorkerMessage::Finished(f) => Some(Event::Finished(f)),
                WorkerMessage::Delta(d) => {
                    assert_eq!(
                        d.token_ids().collect::<Vec<_>>(),
                        d.decode().unwrap().token_ids
                    );
                    assert_eq!(
                        d.completion_tokens(),
                        d.decode().unwrap().usage.map(|u| u.completion_tokens)
                    );
                    let out = rewritten(&d, m.seq);
                    assert_eq!(GenerateResponse::decode(&out[..]).unwrap(), m);
                    Some(Event::Delta(d.decode().unwrap()))
                }
                WorkerMessage::Empty => None,
            };
            assert_eq!(event, m.event, "{msg:?}");
        }
        Err(e) => assert_eq!(ours.unwrap_err().to_string(), e.to_string(), "{msg:?}"),
    }
}

#[test]
fn odd_shapes_mean_what_they_mean_to_prost() {
    let d1 = delta(&[1, 2], "a");
    let d2 = delta(&[3], "b");
    let two_deltas = [
        GenerateResponse {
            seq: 4,
            event: Some(Event::Delta(d1.clone())),
        }
        .encode_to_vec(),
        GenerateResponse {
            seq: 5,
            event: Some(Event::Delta(d2.clone())),
        }
        .encode_to_vec(),
    ]
    .concat();
    // Two Delta fields merge: the token ids of both, the later text.
    assert_eq!(scan(&two_deltas), None);
    same_as_prost(two_deltas);
    let delta_then_finished = [
        encoded(1, Some(Event::Delta(d1.clone()))).to_vec(),
        encoded(2, Some(Event::Finished(Finished::default()))).to_vec(),
    ]
    .concat();
    same_as_prost(delta_then_finished);
    let finished_then_delta = [
        encoded(2, Some(Event::Finished(Finished::default()))).to_vec(),
        encoded(1, Some(Event::Delta(d1.clone()))).to_vec(),
    ]
    .concat();
    same_as_prost(finished_then_delta);
    // seq after the event, and twice.
    let mut late_seq = encoded(0, Some(Event::Delta(d1.clone()))).to_vec();
    prost::encoding::uint64::encode(1, &77, &mut late_seq);
    same_as_prost(late_seq.clone());
    prost::encoding::uint64::encode(1, &78, &mut late_seq);
    same_as_prost(late_seq);
}

#[test]
fn broken_messages_fail_as_prost_fails() {
    let good = encoded(300, Some(Event::Delta(delta(&[1, 2, 3], "abc")))).to_vec();
    // Every truncation of a valid message.
    for cut in 0..good.len() {
        same_as_prost(good[..cut].to_vec());
    }
    let mut bad_utf8 = Vec::new();
    prost::encoding::bytes::encode(2, &vec![0xffu8, 0xfe], &mut bad_utf8);
    let mut bad_floats = Vec::new();
    prost::encoding::bytes::encode(3, &vec![1u8, 2, 3], &mut bad_floats);
    let mut seq_wrong_type = Vec::new();
    prost::encoding::string::encode(1, &"seq".to_string(), &mut seq_wrong_type);
    let mut usage_wrong_type = Vec::new();
    prost::encoding::fixed32::encode(4, &1, &mut usage_wrong_type);
    let mut group = Vec::new();
    prost::encoding::encode_key(30, WireType::StartGroup, &mut group);
    prost::encoding::encode_key(30, WireType::EndGroup, &mut group);
    for body in [
        bad_utf8,
        bad_floats,
        seq_wrong_type.clone(),
        usage_wrong_type,
        group.clone(),
    ] {
        let mut msg = Vec::new();
        prost::encoding::bytes::encode(3, &body, &mut msg);
        same_as_prost(msg);
    }
    same_as_prost(seq_wrong_type);
    let mut delta_as_varint = Vec::new();
    prost::encoding::uint64::encode(3, &1, &mut delta_as_varint);
    same_as_prost(delta_as_varint);
    same_as_prost([group, good].concat());
    // A length past the end, and a varint longer than ten bytes.
    same_as_prost(vec![0x1a, 0x05, 0x08]);
    same_as_prost(vec![
        0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
    ]);
}

#[test]
fn random_deltas_round_trip_exactly() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    for _ in 0..2_000 {
        let n = rng.random_range(0..40);
        let ids: Vec<u32> = (0..n)
            .map(|_| rng.random::<u32>() >> rng.random_range(0..32u32))
            .collect();
        let text: String = (0..rng.random_range(0..20))
            .map(|_| char::from_u32(rng.random_range(32..0x3000)).unwrap_or('?'))
            .collect();
        let mut d = delta(&ids, &text);
        if rng.random_bool(0.5) {
            d.logprobs.clear();
        }
        if rng.random_bool(0.3) {
            d.usage = None;
        }
        let worker_seq = rng.random::<u64>() >> rng.random_range(0..64u32);
        let seq = rng.random::<u64>() >> rng.random_range(0..64u32);
        let got = fast(encoded(worker_seq, Some(Event::Delta(d.clone()))));
        assert_eq!(got.token_ids().collect::<Vec<_>>(), d.token_ids);
        assert_eq!(rewritten(&got, seq), expected(seq, &d));
        assert_eq!(
            Outgoing::Delta { seq, delta: got }.into_message().unwrap(),
            GenerateResponse {
                seq,
                event: Some(Event::Delta(d.clone()))
            }
        );
        let made = EncodedDelta::new(&d);
        assert_eq!(rewritten(&made, seq), expected(seq, &d));
        assert_eq!(made.token_ids().collect::<Vec<_>>(), d.token_ids);
    }
}
