//! Prefix caching in the scheduler: a sequence reads only what the cache
//! does not hold, one token is always computed, blocks shared with a
//! preempted sequence stay with the one still running, and the counters
//! Status reports add up.
use super::*;

/// `config` with prefix caching on (blocks of 4 tokens).
fn cached(max_batch: usize, kv_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        prefix_cache: Some("counting:v1".into()),
        ..config(max_batch, kv_tokens)
    }
}

/// The tokens each step fed `id`, in order.
fn chunks(s: &Scheduler<CountingModel>, id: &str) -> Vec<usize> {
    s.model
        .steps
        .iter()
        .flatten()
        .filter(|(who, _)| who == id)
        .map(|&(_, n)| n)
        .collect()
}

#[test]
fn a_second_prompt_reads_only_what_follows_the_cached_blocks() {
    let mut s = scheduler(cached(2, 256));
    // 10 tokens: two full blocks and two more.
    let first: Vec<u32> = (0..10).collect();
    let mut a = normal(&mut s, "a", &first, 2);
    run_out(&mut s, 10);
    assert_eq!(received(&mut a).0, [10, 11]);
    assert_eq!(s.stats.prompt_tokens_cached.load(Ordering::Relaxed), 0);
    // a's context in the cache: 10 prompt tokens and its first token, so
    // blocks [0..4) and [4..8) are full and now cached.
    assert_eq!(s.stats.kv_blocks_cached.load(Ordering::SeqCst), 2);
    assert_eq!(s.stats.kv_blocks_used.load(Ordering::SeqCst), 0);

    // The same two blocks, then other tokens: 8 cached, 3 read.
    let second: Vec<u32> = [&first[..8], &[3, 3, 3]].concat();
    let mut b = normal(&mut s, "b", &second, 2);
    run_out(&mut s, 10);
    assert_eq!(received(&mut b).0, [4, 5]);
    assert_eq!(chunks(&s, "b"), [3, 1]);
    // A prompt that is exactly the two cached blocks leaves its last block
    // to compute (the step must yield logits).
    let mut c = normal(&mut s, "c", &first[..8], 1);
    run_out(&mut s, 10);
    assert_eq!(received(&mut c).0, [8]);
    assert_eq!(chunks(&s, "c"), [4]);
    // One that ends mid-block reuses its full blocks only.
    let mut d = normal(&mut s, "d", &first[..6], 1);
    run_out(&mut s, 10);
    assert_eq!(received(&mut d).0, [6]);
    assert_eq!(chunks(&s, "d"), [2]);

    let st = &s.stats;
    assert_eq!(
        st.prompt_tokens_total.load(Ordering::Relaxed),
        10 + 11 + 8 + 6
    );
    assert_eq!(st.prompt_tokens_cached.load(Ordering::Relaxed), 8 + 4 + 4);
    assert_eq!(st.kv_blocks_evicted.load(Ordering::SeqCst), 0);
    assert_eq!(s.pool.free_blocks(), s.pool.total_blocks());
}

#[test]
fn with_prefix_caching_off_every_prompt_is_read_in_full() {
    let mut s = scheduler(config(2, 256));
    let first: Vec<u32> = (0..10).collect();
    for id in ["a", "b"] {
        let mut rx = normal(&mut s, id, &first, 2);
        run_out(&mut s, 10);
        assert_eq!(received(&mut rx).0, [10, 11]);
        assert_eq!(chunks(&s, id)[0], 10);
    }
    assert_eq!(s.stats.prompt_tokens_cached.load(Ordering::Relaxed), 0);
    assert_eq!(s.stats.kv_blocks_cached.load(Ordering::SeqCst), 0);
}

#[test]
fn a_preempted_sequence_leaves_shared_blocks_to_the_other_and_returns_through_the_cache() {
    // 4 blocks of 4 tokens. a runs first, so b shares a's first block.
    let mut s = scheduler(cached(2, 16));
    let mut a = normal(&mut s, "a", &[0, 1, 2, 3, 4], 8);
    s.tick();
    let mut b = normal(&mut s, "b", &[0, 1, 2, 3, 5], 8);
    s.tick();
    assert_eq!(chunks(&s, "b"), [1], "b read only its fifth token");
    let shared = s.active[0].cache.block_hashes()[0];
    assert_eq!(s.active[1].cache.block_hashes()[0], shared);
    let mut ticks = 0;
    while s.stats.preemptions.load(Ordering::Relaxed) == 0 {
        s.tick();
        ticks += 1;
        assert!(ticks < 20, "never preempted");
    }
    // b went back to wait; the block it shared is still a's.
    assert_eq!(ids(&s), ["a"]);
    assert_eq!(s.active[0].cache.block_hashes()[0], shared);
    run_out(&mut s, 100);
    assert_eq!(received(&mut a).0, (5..13).collect::<Vec<u32>>());
    assert_eq!(received(&mut b).0, (6..14).collect::<Vec<u32>>());
    // b came back with 8 of its 9 tokens cached (a's block and its own
    // second one), so every step of b, its return included, read one token.
    assert!(
        chunks(&s, "b").iter().all(|&n| n == 1),
        "{:?}",
        chunks(&s, "b")
    );
    let st = &s.stats;
    assert_eq!(st.prompt_tokens_total.load(Ordering::Relaxed), 5 + 5 + 9);
    assert_eq!(st.prompt_tokens_cached.load(Ordering::Relaxed), 4 + 8);
    assert!(st.kv_blocks_evicted.load(Ordering::SeqCst) > 0);
    assert_eq!(s.pool.free_blocks(), 4, "cached blocks count as free");
    assert_eq!(st.kv_blocks_used.load(Ordering::SeqCst), 0);
}
