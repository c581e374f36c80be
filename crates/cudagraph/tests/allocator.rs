//! CPU tests of the caching allocator over real host memory (`HostSource`): split and merge,
//! size classes, stream-ordered reuse, pools, limits, statistics, empty_cache and
//! out-of-memory recovery. Every test checks the allocator's internal invariants.

use std::sync::Arc;

use cudagraph::memory::{AllocatorCore, HostSource, MemoryStats, PoolId, SegmentSource};
use cudagraph::Error;

const KB: usize = 1024;
const MB: usize = 1024 * 1024;

/// A source shared between the test and the allocator, so the test can look at host memory.
#[derive(Clone)]
struct Shared(Arc<HostSource>);

impl SegmentSource for Shared {
    fn allocate(&self, bytes: usize) -> cudagraph::Result<u64> {
        self.0.allocate(bytes)
    }
    fn release(&self, addr: u64, bytes: usize) -> cudagraph::Result<()> {
        self.0.release(addr, bytes)
    }
}

fn core_with(src: HostSource) -> (AllocatorCore, Arc<HostSource>) {
    let src = Arc::new(src);
    (AllocatorCore::new(Box::new(Shared(src.clone()))), src)
}

fn core() -> (AllocatorCore, Arc<HostSource>) {
    core_with(HostSource::new())
}

fn ok(c: &AllocatorCore) {
    c.check_invariants().unwrap();
}

#[test]
fn small_requests_round_to_512_and_share_a_2mib_segment() {
    let (mut c, src) = core();
    let a = c.allocate(1, PoolId::DEFAULT, 1).unwrap();
    let b = c.allocate(513, PoolId::DEFAULT, 1).unwrap();
    assert_eq!(a.size, 512);
    assert_eq!(b.size, 1024);
    assert_eq!(src.live_segments(), 1);
    assert_eq!(src.live_bytes(), 2 * MB);
    assert_eq!(
        b.addr,
        a.addr + 512,
        "second block is split off right after the first"
    );
    let s = c.device_stats();
    assert_eq!(
        (s.allocated, s.reserved, s.active_blocks),
        (1536, 2 * MB, 2)
    );
    ok(&c);
}

#[test]
fn blocks_never_overlap_in_real_memory() {
    let (mut c, src) = core();
    let sizes = [100, 4 * KB, 700 * KB, 3 * MB, 12 * MB, 512, MB];
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&s| c.allocate(s, PoolId::DEFAULT, 1).unwrap())
        .collect();
    for (i, (b, &s)) in blocks.iter().zip(&sizes).enumerate() {
        src.fill(b.addr, s, i as u8 + 1);
    }
    for (i, (b, &s)) in blocks.iter().zip(&sizes).enumerate() {
        assert!(
            src.verify(b.addr, s, i as u8 + 1),
            "block {i} was overwritten"
        );
    }
    ok(&c);
}

#[test]
fn size_classes_pick_segment_sizes_like_pytorch() {
    let (mut c, src) = core();
    c.allocate(MB, PoolId::DEFAULT, 1).unwrap(); // small: exactly 1 MiB
    assert_eq!(src.live_bytes(), 2 * MB);
    c.allocate(MB + 1, PoolId::DEFAULT, 1).unwrap(); // large: from a 20 MiB segment
    assert_eq!(src.live_bytes(), 22 * MB);
    // > 10 MiB: a segment of its own, rounded to 2 MiB (on another stream, so the free tail of
    // the 20 MiB segment cannot serve it).
    c.allocate(11 * MB, PoolId::DEFAULT, 2).unwrap();
    assert_eq!(src.live_bytes(), 22 * MB + 12 * MB);
    assert_eq!(src.live_segments(), 3);
    ok(&c);
}

#[test]
fn freed_neighbours_merge_and_the_merged_block_is_reused() {
    let (mut c, _src) = core();
    let a = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    let b = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    let keep = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    c.free(b.addr);
    ok(&c);
    c.free(a.addr);
    ok(&c); // invariants include "no two adjacent free blocks"
    let ab = c.allocate(8 * KB, PoolId::DEFAULT, 1).unwrap();
    assert_eq!(ab.addr, a.addr, "a and b merged into one 8 KiB block");
    c.free(keep.addr);
    c.free(ab.addr);
    ok(&c);
    assert_eq!(c.device_stats().allocated, 0);
}

#[test]
fn large_blocks_split_only_when_the_rest_exceeds_1mib() {
    let (mut c, _src) = core();
    let a = c.allocate(19 * MB + 512 * KB, PoolId::DEFAULT, 1).unwrap();
    // 20 MiB segment - 19.5 MiB = 0.5 MiB left: not worth splitting, so the block is whole.
    assert_eq!(a.size, 20 * MB);
    let b = c.allocate(2 * MB, PoolId::DEFAULT, 1).unwrap();
    assert_ne!(
        a.addr + a.size as u64,
        b.addr,
        "the 0.5 MiB tail was not split off"
    );
    assert_eq!(c.device_stats().reserved, 40 * MB);
    ok(&c);
}

#[test]
fn reuse_is_stream_ordered_in_the_default_pool() {
    let (mut c, _src) = core();
    let a = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    c.free(a.addr);
    let other = c.allocate(4 * KB, PoolId::DEFAULT, 2).unwrap();
    assert_ne!(
        other.addr, a.addr,
        "stream 2 must not get stream 1's freed block"
    );
    assert_eq!(c.device_stats().segments, 2);
    let same = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    assert_eq!(same.addr, a.addr, "stream 1 reuses its own freed block");
    ok(&c);
}

#[test]
fn graph_pools_are_separate_and_ignore_streams() {
    let (mut c, _src) = core();
    let p = c.create_pool(None);
    let d = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    let g = c.allocate(4 * KB, p, 7).unwrap();
    assert_eq!(g.pool, p);
    assert_eq!(c.device_stats().segments, 2, "pools never share a segment");
    c.free(g.addr);
    let g2 = c.allocate(4 * KB, p, 9).unwrap();
    assert_eq!(
        g2.addr, g.addr,
        "a later capture into the pool reuses the freed block"
    );
    let (ps, ds) = (c.pool_stats(p), c.pool_stats(PoolId::DEFAULT));
    assert_eq!(ps.allocated + ds.allocated, c.device_stats().allocated);
    assert_eq!(ps.reserved + ds.reserved, c.device_stats().reserved);
    c.free(d.addr);
    ok(&c);
}

#[test]
fn pool_limit_is_enforced_with_a_typed_error() {
    let (mut c, _src) = core();
    let p = c.create_pool(Some(4 * MB));
    let a = c.allocate(MB, p, 0).unwrap();
    let b = c.allocate(MB, p, 0).unwrap(); // first 2 MiB segment full
    let _c2 = c.allocate(MB, p, 0).unwrap(); // second 2 MiB segment: 4 MiB reserved
    let _c3 = c.allocate(MB, p, 0).unwrap();
    let err = c.allocate(MB, p, 0).unwrap_err();
    match err {
        Error::PoolLimitExceeded {
            pool,
            limit,
            reserved,
            requested,
        } => {
            assert_eq!(
                (pool, limit, reserved, requested),
                (p, 4 * MB, 4 * MB, 2 * MB)
            );
        }
        e => panic!("expected PoolLimitExceeded, got {e}"),
    }
    assert!(err_message_mentions_limit(&c, p));
    // Freeing inside the limit makes room again; the failed call left nothing behind.
    c.free(a.addr);
    c.free(b.addr);
    c.allocate(MB, p, 0).unwrap();
    assert_eq!(c.pool_stats(p).reserved, 4 * MB);
    ok(&c);
}

fn err_message_mentions_limit(c: &AllocatorCore, p: PoolId) -> bool {
    let e = Error::PoolLimitExceeded {
        pool: p,
        limit: c.limit(p).unwrap(),
        reserved: 1,
        requested: 2,
    };
    e.to_string().contains("limited to") && e.to_string().contains("raise the limit")
}

#[test]
fn bounded_pool_takes_a_tight_large_segment_instead_of_20mib() {
    let (mut c, src) = core();
    let p = c.create_pool(Some(8 * MB));
    let a = c.allocate(3 * MB, p, 0).unwrap();
    assert!(src.live_bytes() <= 8 * MB, "segment fits the limit");
    assert!(a.size >= 3 * MB);
    ok(&c);
}

#[test]
fn empty_cache_releases_only_idle_segments_of_pools_without_graphs() {
    let (mut c, src) = core();
    let p = c.create_pool(None);
    let live = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    let idle = c.allocate(4 * KB, PoolId::DEFAULT, 2).unwrap();
    let g = c.allocate(4 * KB, p, 0).unwrap();
    c.free(idle.addr);
    c.free(g.addr);
    c.add_graph(p); // a graph replays from p: its free segment must stay mapped
    assert_eq!(src.live_segments(), 3);
    let released = c.release_free_segments(None).unwrap();
    assert_eq!(released, 2 * MB);
    assert_eq!(
        src.live_segments(),
        2,
        "only stream 2's idle segment went back"
    );
    c.remove_graph(p);
    assert_eq!(c.release_free_segments(None).unwrap(), 2 * MB);
    c.free(live.addr);
    assert_eq!(c.release_free_segments(None).unwrap(), 2 * MB);
    assert_eq!(src.live_bytes(), 0);
    assert_eq!(c.device_stats().reserved, 0);
    ok(&c);
}

#[test]
fn closing_a_pool_returns_its_memory_when_the_last_block_comes_back() {
    let (mut c, src) = core();
    let p = c.create_pool(None);
    let a = c.allocate(4 * KB, p, 0).unwrap();
    c.close_pool(p);
    assert_eq!(src.live_segments(), 1, "a live block keeps its segment");
    c.free(a.addr);
    assert_eq!(src.live_segments(), 0);
    assert!(
        !c.pool_ids().contains(&p),
        "an empty closed pool is forgotten"
    );
    ok(&c);
}

#[test]
fn closed_pool_with_a_graph_keeps_memory_until_the_graph_goes() {
    let (mut c, src) = core();
    let p = c.create_pool(None);
    let a = c.allocate(4 * KB, p, 0).unwrap();
    c.free(a.addr);
    c.add_graph(p);
    c.close_pool(p);
    assert_eq!(src.live_segments(), 1);
    c.remove_graph(p);
    assert_eq!(src.live_segments(), 0);
    ok(&c);
}

#[test]
fn out_of_memory_frees_cached_segments_and_retries() {
    // 21 MiB of "device": a cached 2 MiB small segment must go for a 20 MiB large one.
    let (mut c, src) = core_with(HostSource::with_capacity(21 * MB));
    let s = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    c.free(s.addr);
    let big = c.allocate(5 * MB, PoolId::DEFAULT, 1).unwrap();
    assert_eq!(src.live_bytes(), 20 * MB);
    ok(&c);
    // Nothing left to free: a typed out-of-memory error, and the allocator is still sound.
    let err = c.allocate(5 * MB, PoolId::DEFAULT, 2).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { requested, .. } if requested == 20 * MB),
        "{err}"
    );
    ok(&c);
    c.free(big.addr);
    ok(&c);
}

#[test]
fn peaks_track_maxima_and_reset() {
    let (mut c, _src) = core();
    let a = c.allocate(MB, PoolId::DEFAULT, 1).unwrap();
    let b = c.allocate(MB, PoolId::DEFAULT, 1).unwrap();
    c.free(a.addr);
    c.free(b.addr);
    let s: MemoryStats = c.device_stats();
    assert_eq!((s.allocated, s.peak_allocated), (0, 2 * MB));
    assert_eq!(
        s.peak_reserved,
        2 * MB,
        "two 1 MiB blocks share one small segment"
    );
    c.reset_peak();
    let s = c.device_stats();
    assert_eq!(s.peak_allocated, 0);
    assert_eq!(s.peak_reserved, s.reserved);
}

#[test]
fn capture_window_measures_peak_and_outputs() {
    let (mut c, _src) = core();
    let p = c.create_pool(None);
    let before = c.allocate(4 * KB, p, 0).unwrap();
    assert!(c.open_window(p));
    assert!(!c.open_window(p), "one capture at a time per pool");
    let tmp = c.allocate(64 * KB, p, 0).unwrap();
    let out = c.allocate(8 * KB, p, 0).unwrap();
    c.free(tmp.addr);
    let w = c.close_window(p);
    assert_eq!(w.peak_allocated, 72 * KB);
    assert_eq!(w.live_at_end, 8 * KB);
    c.free(out.addr);
    c.free(before.addr);
    ok(&c);
}

#[test]
fn segments_are_not_released_while_a_capture_is_open() {
    let (mut c, src) = core();
    let p = c.create_pool(None);
    let a = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    c.free(a.addr);
    assert!(c.open_window(p));
    assert_eq!(c.release_free_segments(None).unwrap(), 0);
    assert_eq!(src.live_segments(), 1);
    c.close_window(p);
    assert_eq!(c.release_free_segments(None).unwrap(), 2 * MB);
}

/// A deterministic random workload over three streams and two pools, checking invariants and
/// memory contents after every step.
#[test]
fn random_workload_keeps_every_invariant() {
    let (mut c, src) = core();
    let pools = [
        PoolId::DEFAULT,
        c.create_pool(None),
        c.create_pool(Some(64 * MB)),
    ];
    let mut live: Vec<(u64, usize, u8)> = Vec::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for step in 0..3000u32 {
        let r = next();
        if live.is_empty() || r % 3 != 0 {
            let size = match r % 10 {
                0 => (next() % (12 * MB as u64)) as usize + 1,
                1..=2 => (next() % (2 * MB as u64)) as usize + 1,
                _ => (next() % (64 * KB as u64)) as usize + 1,
            };
            let pool = pools[(next() % 3) as usize];
            let stream = next() % 3;
            match c.allocate(size, pool, stream) {
                Ok(a) => {
                    let tag = (step % 251) as u8 + 1;
                    src.fill(a.addr, size.min(4096), tag);
                    live.push((a.addr, size.min(4096), tag));
                }
                Err(Error::PoolLimitExceeded { .. }) => {}
                Err(e) => panic!("unexpected error at step {step}: {e}"),
            }
        } else {
            let i = (next() as usize) % live.len();
            let (addr, len, tag) = live.swap_remove(i);
            assert!(
                src.verify(addr, len, tag),
                "block {addr:#x} was overwritten"
            );
            c.free(addr);
        }
        if step % 97 == 0 {
            c.release_free_segments(None).unwrap();
        }
        c.check_invariants()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
    }
    for (addr, len, tag) in live.drain(..) {
        assert!(src.verify(addr, len, tag));
        c.free(addr);
    }
    c.release_free_segments(None).unwrap();
    assert_eq!(c.device_stats().allocated, 0);
    assert_eq!(src.live_bytes(), 0);
}
