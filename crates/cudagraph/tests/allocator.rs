//! CPU tests of the caching allocator over real host memory (`HostSource`): split and merge,
//! size classes, stream-ordered reuse, pools, limits, statistics, empty_cache and
//! out-of-memory recovery, sizes at the top of the address space, reuse behind fences, the
//! decide/commit phases, teardown, and the thread-safe wrapper over a slow source (no lock
//! across source calls, no release while a capture window is open). Every test checks the
//! allocator's internal invariants.

// SAFETY (every `allocate_raw`/`allocate_block_raw` below): host memory, and stream ids the
// tests only use as labels; nothing runs on a device.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use cudagraph::memory::{
    AllocStep, Allocator, AllocatorCore, Fence, HostSource, MemoryStats, PoolId, SegmentSource,
};
use cudagraph::Error;

const KB: usize = 1024;
const MB: usize = 1024 * 1024;

/// A source shared between the test and the allocator, so the test can look at host memory.
#[derive(Clone)]
struct Shared(Arc<HostSource>);

// SAFETY: forwards to `HostSource`, which owns each region exclusively until it is released.
unsafe impl SegmentSource for Shared {
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
        src.fill(b.addr, s, i as u8 + 1).unwrap();
    }
    for (i, (b, &s)) in blocks.iter().zip(&sizes).enumerate() {
        assert!(
            src.verify(b.addr, s, i as u8 + 1).unwrap(),
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
                    src.fill(a.addr, size.min(4096), tag).unwrap();
                    live.push((a.addr, size.min(4096), tag));
                }
                Err(Error::PoolLimitExceeded { .. }) => {}
                Err(e) => panic!("unexpected error at step {step}: {e}"),
            }
        } else {
            let i = (next() as usize) % live.len();
            let (addr, len, tag) = live.swap_remove(i);
            assert!(
                src.verify(addr, len, tag).unwrap(),
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
        assert!(src.verify(addr, len, tag).unwrap());
        c.free(addr);
    }
    c.release_free_segments(None).unwrap();
    assert_eq!(c.device_stats().allocated, 0);
    assert_eq!(src.live_bytes(), 0);
}

#[test]
fn graph_pools_hand_out_blocks_only_to_captures() {
    // SAFETY: host memory for CPU tests; no block of it is passed to device work.
    let (a, b) = unsafe {
        (
            Allocator::new(Box::new(HostSource::new()), 0),
            Allocator::new(Box::new(HostSource::new()), 0),
        )
    };
    let (pa, pb) = (a.new_pool(None), b.new_pool(None));
    assert_eq!(pa.id(), pb.id(), "ids restart in every allocator");
    // A graph pool's free blocks may be a live graph's temporaries: no eager block from it.
    assert!(matches!(
        unsafe { a.allocate_block_raw(1024, pa.id(), 0, 0) },
        Err(Error::InvalidGraph { .. })
    ));
    assert_eq!(a.pool_stats(pa.id()), MemoryStats::default());
    let block = unsafe { a.allocate_block_raw(1024, PoolId::DEFAULT, 1, 0) }.unwrap();
    assert!(!block.is_in(&pa) && !block.is_in(&pb));
    assert!(
        !block.is_device_memory(),
        "an allocator made with Allocator::new hands out no device memory"
    );
    a.check_invariants().unwrap();
}

// ----- sizes at the top of the address space -------------------------------------------------

#[test]
fn host_source_access_outside_live_segments_is_an_error() {
    let src = HostSource::new();
    let base = src.allocate(4 * KB).unwrap();
    src.fill(base, 4 * KB, 7).unwrap();
    assert!(src.verify(base, 4 * KB, 7).unwrap());
    // An end that wraps around the address space used to pass the check in release builds
    // (`addr + len` overflowed to a small number) and then write far outside the segment.
    let wrap = usize::MAX - 15;
    assert!(matches!(
        src.fill(base + 16, wrap, 1),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        src.verify(base + 16, wrap, 1),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        src.fill(u64::MAX - 8, 64, 1),
        Err(Error::OutOfRange { .. })
    ));
    // One byte past the segment, before it, and a released segment are refused too.
    assert!(src.fill(base, 4 * KB + 1, 1).is_err());
    assert!(src.fill(base - 1, 2, 1).is_err());
    assert!(src.verify(base, 4 * KB, 7).unwrap(), "nothing was written");
    src.release(base, 4 * KB).unwrap();
    assert!(matches!(
        src.fill(base, 1, 1),
        Err(Error::OutOfRange { .. })
    ));
}

#[test]
fn host_source_access_never_races_a_release() {
    // `fill` and `verify` hold the source's lock while they touch memory, so a concurrent
    // `release` (which takes the lock) cannot free it under them: each access either finds the
    // region live and completes, or is refused. (Before, the lock was dropped between the
    // check and the write: a use after free of the host heap.)
    use std::sync::atomic::AtomicU64;
    let src = Arc::new(HostSource::new());
    let last = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (src, last, stop) = (src.clone(), last.clone(), stop.clone());
        thread::spawn(move || {
            let mut rounds = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let a = src.allocate(64 * KB).unwrap();
                last.store(a, Ordering::SeqCst);
                thread::yield_now();
                src.release(a, 64 * KB).unwrap();
                rounds += 1;
            }
            rounds
        })
    };
    let (mut hits, mut refused) = (0usize, 0usize);
    let t0 = Instant::now();
    while (hits == 0 || refused == 0) && t0.elapsed() < Duration::from_secs(5)
        || hits + refused < 10_000
    {
        let a = last.load(Ordering::SeqCst);
        if a == 0 {
            continue;
        }
        match src.fill(a, 64 * KB, 0x5a) {
            Ok(()) => hits += 1,
            Err(Error::OutOfRange { .. }) => refused += 1,
            Err(e) => panic!("unexpected error: {e}"),
        }
        let _ = src.verify(a, 64 * KB, 0x5a);
    }
    stop.store(true, Ordering::SeqCst);
    assert!(churn.join().unwrap() > 0);
    assert_eq!(src.live_segments(), 0);
    assert!(hits + refused >= 10_000);
}

fn is_overflow(e: &Error, bytes: usize) -> bool {
    matches!(e, Error::SizeOverflow { what: "allocation", count, elem_size: 1 } if *count == bytes)
}

#[test]
fn impossible_sizes_fail_with_a_typed_error_and_change_nothing() {
    let (mut c, src) = core_with(HostSource::with_capacity(64 * MB));
    let keep = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    let before = c.device_stats();
    // usize::MAX and usize::MAX - 510 cannot round up to 512; usize::MAX - 511 is a multiple
    // of 512 but cannot round up to a 2 MiB segment.
    for bytes in [
        usize::MAX,
        usize::MAX - 510,
        usize::MAX - 511,
        usize::MAX - MB,
    ] {
        let err = c.allocate(bytes, PoolId::DEFAULT, 1).unwrap_err();
        assert!(is_overflow(&err, bytes), "{bytes}: {err}");
        ok(&c);
    }
    // The largest size that rounds: a segment of 2^64 - 2 MiB, which the source cannot give.
    let top = usize::MAX - (2 * MB - 1);
    let err = c.allocate(top, PoolId::DEFAULT, 1).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { requested, .. } if requested == top),
        "{err}"
    );
    let after = c.device_stats();
    assert_eq!(
        (after.allocated, after.reserved, after.active_blocks),
        (before.allocated, before.reserved, before.active_blocks)
    );
    assert_eq!(src.live_bytes(), 2 * MB);
    ok(&c);
    c.free(keep.addr);
    c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    ok(&c);
}

#[test]
fn limits_near_usize_max_do_not_wrap() {
    let (mut c, _src) = core_with(HostSource::with_capacity(64 * MB));
    let p = c.create_pool(Some(usize::MAX));
    let a = c.allocate(4 * KB, p, 0).unwrap(); // 2 MiB reserved
                                               // 2 MiB reserved + a 2^64 - 2 MiB segment overflows: over the limit, never wrapped below it.
    let top = usize::MAX - (2 * MB - 1);
    match c.allocate(top, p, 0).unwrap_err() {
        Error::PoolLimitExceeded {
            limit,
            reserved,
            requested,
            ..
        } => assert_eq!((limit, reserved, requested), (usize::MAX, 2 * MB, top)),
        e => panic!("expected PoolLimitExceeded, got {e}"),
    }
    ok(&c);
    // Within a huge limit the source decides: out of memory, typed.
    let half = usize::MAX / 2 + 1 - 2 * MB;
    let err = c.allocate(half, p, 0).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    // A limit of usize::MAX - 1 on the default pool behaves the same; a limit of 0 refuses all.
    c.set_limit(PoolId::DEFAULT, Some(usize::MAX - 1));
    assert!(is_overflow(
        &c.allocate(usize::MAX, PoolId::DEFAULT, 1).unwrap_err(),
        usize::MAX
    ));
    c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    let z = c.create_pool(Some(0));
    assert!(matches!(
        c.allocate(1, z, 0),
        Err(Error::PoolLimitExceeded { limit: 0, .. })
    ));
    c.free(a.addr);
    ok(&c);
    assert_eq!(c.pool_stats(p).allocated, 0);
}

// ----- reuse behind fences -------------------------------------------------------------------

/// A simulated event: complete once the test says so.
#[derive(Clone, Default)]
struct SimFence(Arc<AtomicBool>);

impl SimFence {
    fn boxed(&self) -> Box<dyn Fence> {
        Box::new(self.clone())
    }
    fn complete(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Fence for SimFence {
    fn is_complete(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[test]
fn free_after_defers_reuse_until_every_fence_completes() {
    let (mut c, src) = core();
    let a = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    src.fill(a.addr, 4 * KB, 0xa5).unwrap();
    let (f1, f2) = (SimFence::default(), SimFence::default());
    c.free_after(a.addr, vec![f1.boxed(), f2.boxed()]);
    let s = c.device_stats();
    assert_eq!(
        (s.allocated, s.active_blocks, s.pending_blocks),
        (4 * KB, 1, 1),
        "a pending block is still allocated"
    );
    assert_eq!(c.pool_stats(PoolId::DEFAULT).pending_blocks, 1);
    ok(&c);
    let b = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    assert_ne!(b.addr, a.addr, "no fence has completed");
    f1.complete();
    let b2 = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    assert_ne!(b2.addr, a.addr, "one fence is still running");
    assert!(
        src.verify(a.addr, 4 * KB, 0xa5).unwrap(),
        "the pending block was not touched"
    );
    f2.complete();
    let again = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    assert_eq!(again.addr, a.addr, "all fences done: the block is reused");
    assert_eq!(c.device_stats().pending_blocks, 0);
    ok(&c);
    // No fences: the same as free.
    c.free_after(b.addr, Vec::new());
    assert_eq!(c.device_stats().active_blocks, 2);
    for x in [b2.addr, again.addr] {
        c.free(x);
    }
    assert_eq!(c.release_free_segments(None).unwrap(), 2 * MB);
    ok(&c);
}

#[test]
fn pending_blocks_are_polled_by_free_and_empty_cache() {
    let (mut c, src) = core();
    let a = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    let other = c.allocate(4 * KB, PoolId::DEFAULT, 2).unwrap();
    let f = SimFence::default();
    c.free_after(a.addr, vec![f.boxed()]);
    assert_eq!(
        c.release_free_segments(None).unwrap(),
        0,
        "pending keeps it"
    );
    f.complete();
    c.free(other.addr); // polls: a is freed as well
    assert_eq!(c.device_stats().allocated, 0);
    assert_eq!(c.device_stats().pending_blocks, 0);
    ok(&c);

    // empty_cache polls too, and then releases the segment the block was in.
    let a = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    let f = SimFence::default();
    c.free_after(a.addr, vec![f.boxed()]);
    f.complete();
    assert_eq!(c.release_free_segments(None).unwrap(), 4 * MB);
    assert_eq!(src.live_bytes(), 0);
    ok(&c);
}

#[test]
fn a_closed_pools_pending_block_releases_its_segment_when_done() {
    let (mut c, src) = core();
    let p = c.create_pool(None);
    let a = c.allocate(4 * KB, p, 0).unwrap();
    let d = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    c.close_pool(p);
    let f = SimFence::default();
    c.free_after(a.addr, vec![f.boxed()]);
    assert_eq!(src.live_segments(), 2, "pending: the segment stays");
    f.complete();
    c.free(d.addr); // the poll frees a; the closed pool's empty segment goes back
    assert_eq!(src.live_segments(), 1);
    assert!(!c.pool_ids().contains(&p));
    ok(&c);
}

// ----- decide/commit phases ------------------------------------------------------------------

fn grow(step: AllocStep) -> cudagraph::memory::GrowPlan {
    match step {
        AllocStep::Grow(plan) => plan,
        AllocStep::Ready(a) => panic!("expected a grow plan, got {a:?}"),
    }
}

#[test]
fn grow_plans_in_flight_count_against_the_limit() {
    let (mut c, src) = core();
    let p = c.create_pool(Some(4 * MB));
    // Two threads missing at once: both plans fit, a third would overshoot the limit.
    let one = grow(c.begin_allocate(MB, p, 0).unwrap());
    let two = grow(c.begin_allocate(MB, p, 0).unwrap());
    assert_eq!((one.segment_bytes(), two.segment_bytes()), (2 * MB, 2 * MB));
    match c.begin_allocate(MB, p, 0).unwrap_err() {
        Error::PoolLimitExceeded { reserved, .. } => assert_eq!(reserved, 4 * MB),
        e => panic!("expected PoolLimitExceeded, got {e}"),
    }
    ok(&c);
    let seg = src.allocate(one.segment_bytes());
    let a = c.finish_grow(one, seg).unwrap();
    assert_eq!(c.pool_stats(p).reserved, 2 * MB);
    c.cancel_grow(two); // its bytes no longer count
    let three = grow(c.begin_allocate(2 * MB - 512, p, 0).unwrap());
    assert_eq!(three.pool(), p);
    // A failed source call undoes the plan and reports a typed out-of-memory error.
    let err = c
        .finish_grow(
            three,
            Err(Error::OutOfMemory {
                requested: 0,
                reserved: 0,
            }),
        )
        .unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { requested, .. } if requested == 2 * MB));
    assert!(matches!(
        c.begin_allocate(MB, p, 0).unwrap(),
        AllocStep::Ready(_)
    ));
    ok(&c);
    c.free(a.addr);
}

#[test]
fn a_bounded_pool_detaches_its_free_segments_before_growing() {
    let (mut c, src) = core();
    let p = c.create_pool(Some(20 * MB));
    let small = c.allocate(4 * KB, p, 0).unwrap();
    c.free(small.addr); // a cached 2 MiB small segment
    let mut plan = grow(c.begin_allocate(19 * MB, p, 0).unwrap());
    assert_eq!(plan.segment_bytes(), 20 * MB);
    let release = plan.take_release();
    assert_eq!(release.bytes(), 2 * MB, "the cached segment must go first");
    assert_eq!(c.releases_in_flight(), 1);
    ok(&c);
    let mut release = release;
    release.execute(&*c.source().clone());
    assert_eq!(c.finish_release(release).unwrap(), 2 * MB);
    assert_eq!(c.releases_in_flight(), 0);
    let seg = src.allocate(plan.segment_bytes());
    let big = c.finish_grow(plan, seg).unwrap();
    assert_eq!(big.size, 20 * MB);
    assert_eq!(src.live_bytes(), 20 * MB);
    ok(&c);
}

#[test]
fn a_release_plan_detaches_and_an_unexecuted_one_puts_back() {
    let (mut c, src) = core();
    let a = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    c.free(a.addr);
    let plan = c.begin_release(None);
    assert_eq!(plan.segments().collect::<Vec<_>>(), vec![(a.addr, 2 * MB)]);
    assert_eq!(
        c.device_stats().reserved,
        2 * MB,
        "still held until released"
    );
    ok(&c);
    // A detached segment is not reusable: the same request now needs a new segment.
    let step = c.begin_allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    c.cancel_grow(grow(step));
    // Finished without executing: back in the cache, nothing released.
    assert_eq!(c.finish_release(plan).unwrap(), 0);
    assert!(matches!(
        c.begin_allocate(4 * KB, PoolId::DEFAULT, 1).unwrap(),
        AllocStep::Ready(b) if b.addr == a.addr
    ));
    assert_eq!(src.live_segments(), 1);
    ok(&c);
}

#[test]
fn a_failed_synchronisation_releases_nothing() {
    struct FailingSync(Arc<HostSource>);
    // SAFETY: forwards allocation and release to `HostSource` (see `Shared`); only
    // `synchronize` fails, and then nothing is released.
    unsafe impl SegmentSource for FailingSync {
        fn allocate(&self, bytes: usize) -> cudagraph::Result<u64> {
            self.0.allocate(bytes)
        }
        fn release(&self, addr: u64, bytes: usize) -> cudagraph::Result<()> {
            self.0.release(addr, bytes)
        }
        fn synchronize(&self) -> cudagraph::Result<()> {
            Err(Error::InvalidGraph {
                problem: "sync failed".into(),
            })
        }
    }
    let src = Arc::new(HostSource::new());
    let mut c = AllocatorCore::new(Box::new(FailingSync(src.clone())));
    let a = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
    c.free(a.addr);
    assert!(c.release_free_segments(None).is_err());
    assert_eq!(src.live_segments(), 1);
    assert_eq!(c.releases_in_flight(), 0);
    assert_eq!(c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap().addr, a.addr);
    ok(&c);
}

/// A source that, while `busy` (a capture of the device open elsewhere, for a device's
/// source), refuses to release: `may_release` says so when `honest`, and `exclusive` always
/// does (the race where a capture begins after the allocator asked).
struct Gated {
    host: Arc<HostSource>,
    busy: Arc<AtomicBool>,
    honest: bool,
}

// SAFETY: forwards allocation and release to `HostSource` (see `Shared`); `exclusive` runs
// the release at most once.
unsafe impl SegmentSource for Gated {
    fn allocate(&self, bytes: usize) -> cudagraph::Result<u64> {
        self.host.allocate(bytes)
    }
    fn release(&self, addr: u64, bytes: usize) -> cudagraph::Result<()> {
        self.host.release(addr, bytes)
    }
    fn may_release(&self) -> bool {
        !(self.honest && self.busy.load(Ordering::SeqCst))
    }
    fn exclusive(&self, _wait: bool, release: &mut dyn FnMut()) -> bool {
        if self.busy.load(Ordering::SeqCst) {
            return false;
        }
        release();
        true
    }
}

fn gated(honest: bool) -> (AllocatorCore, Arc<HostSource>, Arc<AtomicBool>) {
    let host = Arc::new(HostSource::new());
    let busy = Arc::new(AtomicBool::new(false));
    let src = Gated {
        host: host.clone(),
        busy: busy.clone(),
        honest,
    };
    (AllocatorCore::new(Box::new(src)), host, busy)
}

#[test]
fn nothing_is_released_while_the_source_is_busy_and_closed_pools_are_retried_later() {
    for honest in [true, false] {
        let (mut c, src, busy) = gated(honest);
        let p = c.create_pool(None);
        let a = c.allocate(4 * KB, p, 0).unwrap();
        c.free(a.addr);
        let d = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
        c.free(d.addr);
        assert_eq!(src.live_segments(), 2);
        busy.store(true, Ordering::SeqCst);
        c.close_pool(p);
        assert_eq!(
            src.live_segments(),
            2,
            "released while busy (honest {honest})"
        );
        assert_eq!(c.release_free_segments(None).unwrap(), 0);
        assert_eq!(src.live_segments(), 2);
        assert_eq!(c.releases_in_flight(), 0);
        ok(&c);
        // Still busy: a free retries the closed pool and keeps it.
        let e = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
        c.free(e.addr);
        assert_eq!(src.live_segments(), 2);
        ok(&c);
        // Once the source may release again, the next free gives the closed pool's segment back.
        busy.store(false, Ordering::SeqCst);
        let f = c.allocate(4 * KB, PoolId::DEFAULT, 1).unwrap();
        c.free(f.addr);
        assert_eq!(src.live_segments(), 1, "honest {honest}");
        assert_eq!(c.pool_stats(p).reserved, 0);
        ok(&c);
    }
}

#[test]
fn a_bounded_pool_that_must_release_to_grow_fails_cleanly_while_the_source_is_busy() {
    for honest in [true, false] {
        let (mut c, src, busy) = gated(honest);
        let p = c.create_pool(Some(20 * MB));
        let small = c.allocate(4 * KB, p, 0).unwrap();
        c.free(small.addr);
        busy.store(true, Ordering::SeqCst);
        let err = c.allocate(19 * MB, p, 0).unwrap_err();
        match honest {
            true => assert!(matches!(err, Error::PoolLimitExceeded { .. }), "{err:?}"),
            false => assert!(
                matches!(err, Error::NotSupported { ref detail, .. } if detail.contains("retry")),
                "{err:?}"
            ),
        }
        assert_eq!(src.live_bytes(), 2 * MB);
        assert_eq!(c.releases_in_flight(), 0);
        ok(&c);
        busy.store(false, Ordering::SeqCst);
        let big = c.allocate(19 * MB, p, 0).unwrap();
        assert_eq!(big.size, 20 * MB);
        assert_eq!(src.live_bytes(), 20 * MB);
        ok(&c);
    }
}

#[test]
fn allocating_from_a_closed_pool_is_an_error() {
    let (mut c, _src) = core();
    let p = c.create_pool(None);
    let a = c.allocate(4 * KB, p, 0).unwrap();
    c.close_pool(p);
    assert!(matches!(
        c.allocate(4 * KB, p, 0),
        Err(Error::InvalidGraph { .. })
    ));
    c.free(a.addr);
    assert!(matches!(
        c.allocate(4 * KB, p, 0),
        Err(Error::InvalidGraph { .. })
    ));
    ok(&c);
}

// ----- the thread-safe wrapper ---------------------------------------------------------------

/// A source that takes `delay` in every call (like cuMemAlloc, cuMemFree, cuCtxSynchronize on
/// a busy device) and records what is happening.
struct Slow {
    host: HostSource,
    delay: Duration,
    allocating: AtomicUsize,
    syncing: AtomicBool,
    releases: AtomicUsize,
    syncs: AtomicUsize,
    /// Set by a test while it holds a capture window open.
    window_open: AtomicBool,
    /// Source calls that freed memory or synchronised while a window was open.
    violations: AtomicUsize,
}

impl Slow {
    fn new(delay: Duration) -> Arc<Self> {
        Arc::new(Self {
            host: HostSource::new(),
            delay,
            allocating: AtomicUsize::new(0),
            syncing: AtomicBool::new(false),
            releases: AtomicUsize::new(0),
            syncs: AtomicUsize::new(0),
            window_open: AtomicBool::new(false),
            violations: AtomicUsize::new(0),
        })
    }
    fn check_no_window(&self) {
        if self.window_open.load(Ordering::SeqCst) {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }
}

struct SlowHandle(Arc<Slow>);

// SAFETY: forwards to `HostSource` (see `Shared`), only slower.
unsafe impl SegmentSource for SlowHandle {
    fn allocate(&self, bytes: usize) -> cudagraph::Result<u64> {
        self.0.allocating.fetch_add(1, Ordering::SeqCst);
        thread::sleep(self.0.delay);
        let r = self.0.host.allocate(bytes);
        self.0.allocating.fetch_sub(1, Ordering::SeqCst);
        r
    }
    fn release(&self, addr: u64, bytes: usize) -> cudagraph::Result<()> {
        self.0.check_no_window();
        thread::sleep(self.0.delay);
        self.0.check_no_window();
        let r = self.0.host.release(addr, bytes);
        self.0.releases.fetch_add(1, Ordering::SeqCst);
        r
    }
    fn synchronize(&self) -> cudagraph::Result<()> {
        self.0.check_no_window();
        self.0.syncing.store(true, Ordering::SeqCst);
        thread::sleep(self.0.delay);
        self.0.syncing.store(false, Ordering::SeqCst);
        self.0.syncs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out: {what}");
        thread::yield_now();
    }
}

#[test]
fn a_cache_hit_is_not_blocked_behind_another_threads_slow_allocate() {
    const SLEEP: Duration = Duration::from_millis(20);
    let slow = Slow::new(SLEEP);
    // SAFETY: host memory for CPU tests; no block of it is passed to device work.
    let alloc = unsafe { Allocator::new(Box::new(SlowHandle(slow.clone())), 0) };
    let warm = unsafe { alloc.allocate_raw(4 * KB, PoolId::DEFAULT, 1) }.unwrap();
    // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
    unsafe { alloc.free(warm.addr) }; // stream 1 now hits in its cached segment
    let mut timings = Vec::new();
    let mut passed = false;
    // Each attempt: another thread misses (a new stream) and sits in the source's allocate;
    // meanwhile this thread's hit must return, and return fast. Retried because a loaded
    // machine may deschedule us for the whole sleep; with the lock held across allocate no
    // attempt could pass.
    for attempt in 0..10u64 {
        let other = alloc.clone();
        let miss = thread::spawn(move || unsafe {
            other.allocate_raw(4 * KB, PoolId::DEFAULT, 100 + attempt)
        });
        wait_until("the miss enters the source", || {
            slow.allocating.load(Ordering::SeqCst) > 0
        });
        let t0 = Instant::now();
        let hit = unsafe { alloc.allocate_raw(4 * KB, PoolId::DEFAULT, 1) }.unwrap();
        let took = t0.elapsed();
        let during = slow.allocating.load(Ordering::SeqCst) > 0;
        // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
        unsafe { alloc.free(hit.addr) };
        let m = miss.join().unwrap().unwrap();
        // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
        unsafe { alloc.free(m.addr) };
        timings.push(took);
        if during && took < SLEEP / 4 {
            passed = true;
            break;
        }
    }
    eprintln!("cache-hit latency while another thread allocates: {timings:?}");
    assert!(
        passed,
        "the hit waited for the other thread's segment: {timings:?}"
    );
    alloc.check_invariants().unwrap();
}

#[test]
fn open_window_waits_for_an_in_flight_release() {
    let slow = Slow::new(Duration::from_millis(30));
    // SAFETY: host memory for CPU tests; no block of it is passed to device work.
    let alloc = unsafe { Allocator::new(Box::new(SlowHandle(slow.clone())), 0) };
    let a = unsafe { alloc.allocate_raw(4 * KB, PoolId::DEFAULT, 1) }.unwrap();
    // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
    unsafe { alloc.free(a.addr) };
    let pool = alloc.create_pool(None);
    let emptier = {
        let alloc = alloc.clone();
        thread::spawn(move || alloc.empty_cache())
    };
    wait_until("the release synchronises", || {
        slow.syncing.load(Ordering::SeqCst)
    });
    assert!(alloc.open_window(pool));
    // open_window returned only once the release was done: its segment is gone already.
    assert_eq!(slow.releases.load(Ordering::SeqCst), 1);
    slow.window_open.store(true, Ordering::SeqCst);
    assert_eq!(emptier.join().unwrap().unwrap(), 2 * MB);
    // While the window is open nothing is released, not even by empty_cache.
    let b = unsafe { alloc.allocate_raw(4 * KB, PoolId::DEFAULT, 1) }.unwrap();
    // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
    unsafe { alloc.free(b.addr) };
    assert_eq!(alloc.empty_cache().unwrap(), 0);
    slow.window_open.store(false, Ordering::SeqCst);
    // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
    unsafe { alloc.close_window(pool) };
    assert_eq!(alloc.empty_cache().unwrap(), 2 * MB);
    assert_eq!(slow.violations.load(Ordering::SeqCst), 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn threads_allocate_and_free_while_another_empties_the_cache() {
    let slow = Slow::new(Duration::from_millis(20));
    // SAFETY: host memory for CPU tests; no block of it is passed to device work.
    let alloc = unsafe { Allocator::new(Box::new(SlowHandle(slow.clone())), 0) };
    let bounded = alloc.create_pool(Some(8 * MB));
    let workers = 4;
    let done = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(workers + 2));
    let mut handles = Vec::new();
    for w in 0..workers {
        let (alloc, done, start) = (alloc.clone(), done.clone(), start.clone());
        handles.push(thread::spawn(move || {
            start.wait();
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (w as u64 + 1);
            let mut live = Vec::new();
            for i in 0..80 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let size = match x % 8 {
                    0 => (x % (3 * MB as u64)) as usize + 1,
                    _ => (x % (64 * KB as u64)) as usize + 1,
                };
                let pool = if w == 0 && i % 2 == 0 {
                    bounded
                } else {
                    PoolId::DEFAULT
                };
                match unsafe { alloc.allocate_raw(size, pool, w as u64 + 1) } {
                    Ok(a) => live.push(a.addr),
                    Err(Error::PoolLimitExceeded { .. }) => {}
                    Err(e) => panic!("worker {w}: {e}"),
                }
                if i % 5 == 4 {
                    // Everything back: the segments become releasable.
                    for addr in live.drain(..) {
                        // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
                        unsafe { alloc.free(addr) };
                    }
                    thread::sleep(Duration::from_millis(3));
                } else if live.len() > 3 || x % 3 == 0 {
                    let addr = live.swap_remove((x as usize) % live.len().max(1));
                    // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
                    unsafe { alloc.free(addr) };
                }
            }
            for addr in live {
                // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
                unsafe { alloc.free(addr) };
            }
            done.fetch_add(1, Ordering::SeqCst);
        }));
    }
    let emptier = {
        let (alloc, done, start) = (alloc.clone(), done.clone(), start.clone());
        thread::spawn(move || {
            start.wait();
            let mut calls = 0;
            while done.load(Ordering::SeqCst) < workers {
                alloc.empty_cache().unwrap();
                calls += 1;
                thread::sleep(Duration::from_millis(1));
            }
            calls
        })
    };
    // A "capturing" thread: windows opened and closed while the others run; no release may
    // happen while one is open.
    let capturer = {
        let (alloc, done, slow) = (alloc.clone(), done.clone(), slow.clone());
        let pool = alloc.create_pool(None);
        thread::spawn(move || {
            start.wait();
            let mut windows = 0;
            while done.load(Ordering::SeqCst) < workers {
                assert!(alloc.open_window(pool));
                slow.window_open.store(true, Ordering::SeqCst);
                let a = unsafe { alloc.allocate_raw(16 * KB, pool, 0) }.unwrap();
                thread::sleep(Duration::from_millis(5));
                // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
                unsafe { alloc.free(a.addr) };
                slow.window_open.store(false, Ordering::SeqCst);
                // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
                unsafe { alloc.close_window(pool) };
                windows += 1;
                thread::sleep(Duration::from_millis(10));
            }
            // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
            unsafe { alloc.close_pool(pool) };
            windows
        })
    };
    for h in handles {
        h.join().unwrap();
    }
    let calls = emptier.join().unwrap();
    let windows = capturer.join().unwrap();
    eprintln!(
        "{calls} empty_cache calls, {windows} windows, {} releases, {} syncs",
        slow.releases.load(Ordering::SeqCst),
        slow.syncs.load(Ordering::SeqCst)
    );
    assert_eq!(slow.violations.load(Ordering::SeqCst), 0);
    alloc.check_invariants().unwrap();
    let s = alloc.stats();
    assert_eq!((s.allocated, s.active_blocks), (0, 0));
    // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
    unsafe { alloc.close_pool(bounded) };
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved, 0);
    assert_eq!(slow.host.live_bytes(), 0);
}

#[test]
fn dropping_the_allocator_synchronises_once_and_returns_everything() {
    let slow = Slow::new(Duration::ZERO);
    // SAFETY: host memory for CPU tests; no block of it is passed to device work.
    let alloc = unsafe { Allocator::new(Box::new(SlowHandle(slow.clone())), 3) };
    assert_eq!(alloc.ordinal(), 3);
    let pool = alloc.new_pool(Some(64 * MB));
    let _leaked = unsafe { alloc.allocate_raw(12 * MB, PoolId::DEFAULT, 1) }.unwrap();
    let pending = unsafe { alloc.allocate_raw(4 * KB, PoolId::DEFAULT, 2) }.unwrap();
    // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
    unsafe { alloc.free_after(pending.addr, vec![SimFence::default().boxed()]) };
    // As a capture allocates (left live: teardown returns it too).
    let _captured = unsafe { alloc.allocate_raw(4 * KB, pool.id(), 0) }.unwrap();
    alloc.add_graph(pool.id());
    assert_eq!(alloc.stats().pending_blocks, 1);
    assert_eq!(slow.host.live_segments(), 3);
    assert!(format!("{alloc:?}").contains("device 3"));
    drop(pool);
    let syncs = slow.syncs.load(Ordering::SeqCst);
    drop(alloc);
    assert_eq!(slow.syncs.load(Ordering::SeqCst), syncs + 1);
    assert_eq!(slow.host.live_bytes(), 0, "teardown returned every segment");
}

#[test]
fn wrapper_pools_limits_and_graphs() {
    let src = Arc::new(HostSource::new());
    // SAFETY: host memory for CPU tests; no block of it is passed to device work.
    let alloc = unsafe { Allocator::new(Box::new(Shared(src.clone())), 0) };
    let pool = alloc.new_pool(None);
    assert_eq!(pool.limit(), None);
    pool.set_limit(Some(4 * MB));
    assert_eq!(alloc.limit(pool.id()), Some(4 * MB));
    // As a capture allocates, and frees when the block's last holder goes.
    let b = unsafe { alloc.allocate_raw(MB, pool.id(), 0) }.unwrap();
    alloc.add_graph(pool.id());
    // SAFETY: a raw allocation of this test, freed once, used by nothing else.
    unsafe { alloc.free(b.addr) };
    assert_eq!(
        alloc.empty_cache().unwrap(),
        0,
        "a graph replays from the pool"
    );
    // SAFETY: a raw allocation/pool of this test, released once, used by nothing else.
    unsafe { alloc.remove_graph(pool.id()) };
    let id = pool.id();
    drop(pool); // closed, no graphs, nothing live: memory goes back at once
    assert_eq!(src.live_bytes(), 0);
    assert_eq!(alloc.pool_stats(id), MemoryStats::default());
    alloc.reset_peak();
    assert_eq!(alloc.stats().peak_reserved, 0);
    // Library blocks of the default pool carry the id of the capture that allocated them.
    let w = unsafe { alloc.allocate_block_raw(MB, PoolId::DEFAULT, 1, 7) }.unwrap();
    assert_eq!((w.capture_id(), w.pool()), (7, PoolId::DEFAULT));
    drop(w);
    alloc.empty_cache().unwrap();
    assert_eq!(src.live_bytes(), 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_limit_that_is_not_a_multiple_of_2mib_keeps_blocks_aligned() {
    // Found by allocator_props: a segment cut to "whatever room the limit leaves" had an odd
    // size, and so did the block that took all of it.
    let (mut c, _src) = core();
    let p = c.create_pool(Some(8 * MB + 1));
    let a = c.allocate(MB + 1, p, 0).unwrap();
    assert_eq!(a.size % 512, 0);
    assert_eq!(c.pool_stats(p).reserved, 8 * MB);
    let b = c.allocate(2 * MB, p, 0).unwrap(); // split off the same segment
    assert_eq!(b.addr, a.addr + a.size as u64);
    assert_eq!((b.addr % 512, b.size % 512), (0, 0));
    ok(&c);
}
