//! CPU tests of the allocator's bookkeeping: checked sizes and sums, and releases that race
//! with the source handing an address out again.

use std::sync::Arc;

use super::sizes::*;
use super::*;
use crate::error::{Error, Result};

#[test]
fn rounding_is_checked_at_the_top_of_the_address_space() {
    assert_eq!(classify(0).unwrap(), (512, Class::Small));
    assert_eq!(classify(SMALL_MAX).unwrap(), (SMALL_MAX, Class::Small));
    assert_eq!(
        classify(usize::MAX - 511).unwrap(),
        (usize::MAX - 511, Class::Large),
        "already a multiple of 512"
    );
    for bytes in [usize::MAX, usize::MAX - 510] {
        assert!(
            matches!(
                classify(bytes),
                Err(Error::SizeOverflow { what: "allocation", count, elem_size: 1 }) if count == bytes
            ),
            "{bytes} rounds past the maximum"
        );
    }
    let (size, class) = classify(usize::MAX - 511).unwrap();
    assert!(matches!(
        segment_size(size, class, usize::MAX - 511),
        Err(Error::SizeOverflow { .. })
    ));
    let top = usize::MAX - (LARGE_ROUND - 1); // the largest multiple of 2 MiB
    assert_eq!(segment_size(top, Class::Large, top).unwrap(), top);
    assert_eq!(
        segment_size(MB + 512, Class::Large, 0).unwrap(),
        LARGE_SEGMENT
    );
    assert_eq!(segment_size(512, Class::Small, 0).unwrap(), SMALL_SEGMENT);
}

#[test]
fn limit_sums_do_not_wrap() {
    assert!(fits(usize::MAX - 1, 1, usize::MAX));
    assert!(
        !fits(usize::MAX, 1, usize::MAX),
        "overflowing sum does not fit"
    );
    assert!(!fits(2, usize::MAX - 1, usize::MAX));
    assert!(!fits(3, 3, 5));
    assert!(fits(0, 0, 0));
}

#[test]
fn stats_saturate_instead_of_wrapping() {
    let mut s = MemoryStats {
        allocated: usize::MAX - 1,
        ..Default::default()
    };
    s.on_alloc(10);
    assert_eq!(s.allocated, usize::MAX);
    s.on_free(usize::MAX);
    s.on_free(1);
    assert_eq!((s.allocated, s.active_blocks), (0, 0));
    s.on_segment_release(5);
    assert_eq!((s.reserved, s.cached()), (0, 0));
}

/// A source that hands back the address it released last (as the driver may), from a
/// range it never touches (the core only does bookkeeping).
struct Reusing {
    next: std::sync::Mutex<Vec<u64>>,
}

// SAFETY: the addresses are bookkeeping only in this test (nothing reads or writes them);
// a range is handed out again only after its release.
unsafe impl SegmentSource for Reusing {
    fn allocate(&self, bytes: usize) -> Result<u64> {
        let mut next = self.next.lock().unwrap();
        match next.pop() {
            Some(a) => Ok(a),
            None => Err(Error::OutOfMemory {
                requested: bytes,
                reserved: 0,
            }),
        }
    }
    fn release(&self, addr: u64, _bytes: usize) -> Result<()> {
        self.next.lock().unwrap().push(addr);
        Ok(())
    }
}

/// One thread's `empty_cache` releases a segment and, before it takes the lock back to
/// finish, another thread's allocation gets the same address from the source for a new
/// segment: the old plan must not remove the new segment (it did: the next allocation
/// found a free block without a segment and panicked).
#[test]
fn a_release_finished_after_its_address_came_back_leaves_the_new_segment() {
    let source = Arc::new(Reusing {
        next: std::sync::Mutex::new(vec![0x4000_0000]),
    });
    let mut core = AllocatorCore::new(Box::new(ArcSource(source.clone())));
    let a = core.allocate(4096, PoolId::DEFAULT, 0).unwrap();
    core.free(a.addr);
    assert_eq!(core.device_stats().segments, 1);
    // Thread 1: detach and release (no lock), not finished yet.
    let mut plan = core.begin_release(None);
    assert_eq!(plan.segments().count(), 1);
    plan.execute(&*source);
    // Thread 2: misses the cache, the source hands the same address back.
    let grow = match core.begin_allocate(4096, PoolId::DEFAULT, 0).unwrap() {
        AllocStep::Grow(g) => g,
        AllocStep::Ready(_) => panic!("the segment was detached: the cache is empty"),
    };
    let seg = source.allocate(grow.segment_bytes());
    let b = core.finish_grow(grow, seg).unwrap();
    assert_eq!(b.addr, 0x4000_0000);
    core.check_invariants().unwrap();
    // Thread 1 finishes: the old segment's bytes are reported, the new one stays.
    assert_eq!(core.finish_release(plan).unwrap(), SMALL_SEGMENT);
    core.check_invariants().unwrap();
    let stats = core.device_stats();
    assert_eq!((stats.segments, stats.reserved), (1, SMALL_SEGMENT));
    // The new segment's rest serves the next request; both free back into it.
    let c = core.allocate(4096, PoolId::DEFAULT, 0).unwrap();
    core.free(b.addr);
    core.free(c.addr);
    core.check_invariants().unwrap();
    assert_eq!(core.release_free_segments(None).unwrap(), SMALL_SEGMENT);
    assert_eq!(core.device_stats().segments, 0);
}

/// Shares a test source with the core.
struct ArcSource(Arc<Reusing>);

// SAFETY: forwards to the wrapped source.
unsafe impl SegmentSource for ArcSource {
    fn allocate(&self, bytes: usize) -> Result<u64> {
        self.0.allocate(bytes)
    }
    fn release(&self, addr: u64, bytes: usize) -> Result<()> {
        self.0.release(addr, bytes)
    }
}

const MB: usize = 1 << 20;
