//! CPU tests of pools, blocks and buffers over host memory.

use std::sync::Arc;

use super::*;
use crate::error::Error;

fn host_allocator() -> Arc<Allocator> {
    // SAFETY: host memory for CPU tests; no block of it is passed to device work.
    unsafe { Allocator::new(Box::new(HostSource::new()), 0) }
}

#[test]
fn pool_membership_needs_the_same_allocator() {
    let (a, b) = (host_allocator(), host_allocator());
    let (pa, pb) = (Pool::new(&a, None), Pool::new(&b, None));
    assert_eq!(pa.id(), pb.id(), "ids restart in every allocator");
    // As a capture allocates (`allocate_block` refuses graph pools).
    let block = BlockRef::from_allocation(
        &a,
        unsafe { a.allocate_raw(1024, pa.id(), 0) }.unwrap(),
        0,
        1,
    );
    assert!(block.is_in(&pa));
    assert!(
        !block.is_in(&pb),
        "same id, other allocator: not the same pool"
    );
}

#[test]
fn graph_pools_hand_out_no_blocks_outside_captures() {
    let a = host_allocator();
    let pool = Pool::new(&a, None);
    let before = a.stats();
    assert!(matches!(
        unsafe { a.allocate_block_raw(1024, pool.id(), 1, 0) },
        Err(Error::InvalidGraph { .. })
    ));
    assert_eq!(a.stats(), before, "a refused request allocates nothing");
    // The default pool still works, and the pool is usable by captures afterwards.
    let eager = unsafe { a.allocate_block_raw(1024, PoolId::DEFAULT, 1, 0) }.unwrap();
    assert_eq!(eager.pool(), PoolId::DEFAULT);
    let captured = unsafe { a.allocate_raw(1024, pool.id(), 0) }.unwrap();
    assert_eq!(captured.pool, pool.id());
    // SAFETY: a raw allocation of this test, freed once, used by nothing else.
    unsafe { a.free(captured.addr) };
    a.check_invariants().unwrap();
}

#[test]
fn blocks_of_allocators_made_outside_a_device_are_not_device_memory() {
    let a = host_allocator();
    assert!(!a.is_device_allocator());
    let block = unsafe { a.allocate_block_raw(1024, PoolId::DEFAULT, 1, 0) }.unwrap();
    assert_eq!(block.device_ordinal(), 0);
    assert!(
        !block.is_device_memory(),
        "a host allocator's block claims no device (every queue refuses it)"
    );
}

#[test]
fn buffer_views_are_checked_against_the_block() {
    let a = host_allocator();
    let block = BlockRef::from_allocation(
        &a,
        unsafe { a.allocate_raw(1000, PoolId::DEFAULT, 1) }.unwrap(),
        1,
        0,
    );
    assert_eq!(block.size(), 1024);
    // 256 f32 fill the 1024-byte block; 257 do not.
    let buf = DeviceBuffer::<f32>::from_block(block.clone(), 256).unwrap();
    assert!(matches!(
        DeviceBuffer::<f32>::from_block(block.clone(), 257),
        Err(Error::OutOfRange { .. })
    ));
    // A count whose byte size overflows is a typed error, not a wrapped length.
    assert!(matches!(
        DeviceBuffer::<f32>::from_block(block.clone(), usize::MAX / 4 + 2),
        Err(Error::SizeOverflow { .. })
    ));
    assert!(matches!(
        bytes_for::<f64>("x", usize::MAX / 8 + 1),
        Err(Error::SizeOverflow { count, elem_size: 8, .. }) if count == usize::MAX / 8 + 1
    ));
    assert_eq!(buf.addr_at(256).unwrap(), buf.addr() + 1024);
    assert!(matches!(buf.addr_at(257), Err(Error::OutOfRange { .. })));
    assert!(matches!(
        buf.addr_at(usize::MAX),
        Err(Error::OutOfRange { .. })
    ));
    assert!(buf.prefix(257).is_err());
    assert_eq!(buf.prefix(3).unwrap().bytes(), 12);
}

#[test]
fn half_floats_are_two_byte_elements_with_their_bit_patterns_as_bytes() {
    assert_eq!(bytes_for::<bf16>("x", 0).unwrap(), 0);
    assert_eq!(bytes_for::<bf16>("x", 3).unwrap(), 6);
    assert_eq!(bytes_for::<f16>("x", 1000).unwrap(), 2000);
    assert!(matches!(
        bytes_for::<bf16>("x", usize::MAX / 2 + 1),
        Err(Error::SizeOverflow { count, elem_size: 2, .. }) if count == usize::MAX / 2 + 1
    ));
    assert!(matches!(
        bytes_for::<f16>("x", usize::MAX),
        Err(Error::SizeOverflow { elem_size: 2, .. })
    ));

    // The bytes are the little-endian bit patterns, every one of them a value (NaNs included),
    // and writing bytes back gives the same values.
    let b = [
        bf16::from_f32(1.0),
        bf16::from_f32(-2.5),
        bf16::NAN,
        bf16::INFINITY,
        bf16::from_bits(0x0001),
    ];
    let bytes = bf16::as_bytes(&b).to_vec();
    assert_eq!(bytes.len(), 10);
    assert_eq!(&bytes[..4], &[0x80, 0x3f, 0x20, 0xc0]);
    for (v, pair) in b.iter().zip(bytes.chunks(2)) {
        assert_eq!(v.to_bits(), u16::from_le_bytes([pair[0], pair[1]]));
    }
    let mut back = [bf16::ZERO; 5];
    bf16::as_bytes_mut(&mut back).copy_from_slice(&bytes);
    assert_eq!(
        back.map(|v| v.to_bits()),
        b.map(|v| v.to_bits()),
        "bit for bit"
    );

    let h = [
        f16::from_f32(1.0),
        f16::from_f32(-2.5),
        f16::MAX,
        f16::NEG_INFINITY,
        f16::from_bits(0x7e01),
    ];
    let bytes = f16::as_bytes(&h).to_vec();
    assert_eq!(&bytes[..4], &[0x00, 0x3c, 0x00, 0xc1]);
    let mut back = [f16::ZERO; 5];
    f16::as_bytes_mut(&mut back).copy_from_slice(&bytes);
    assert_eq!(back.map(|v| v.to_bits()), h.map(|v| v.to_bits()));
    // Every bit pattern round-trips through the byte view.
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let mut again = vec![f16::ZERO; all.len()];
    f16::as_bytes_mut(&mut again).copy_from_slice(f16::as_bytes(&all));
    assert!(all
        .iter()
        .zip(&again)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn half_float_buffer_views_count_two_bytes_an_element() {
    let a = host_allocator();
    let block = BlockRef::from_allocation(
        &a,
        unsafe { a.allocate_raw(1000, PoolId::DEFAULT, 1) }.unwrap(),
        1,
        0,
    );
    assert_eq!(block.size(), 1024);
    let buf = DeviceBuffer::<bf16>::from_block(block.clone(), 512).unwrap();
    assert_eq!(buf.bytes(), 1024);
    assert!(matches!(
        DeviceBuffer::<f16>::from_block(block.clone(), 513),
        Err(Error::OutOfRange { end: 1026, .. })
    ));
    assert!(matches!(
        DeviceBuffer::<f16>::from_block(block.clone(), usize::MAX / 2 + 1),
        Err(Error::SizeOverflow { elem_size: 2, .. })
    ));
    assert_eq!(buf.addr_at(10).unwrap(), buf.addr() + 20);
    assert_eq!(buf.prefix(7).unwrap().bytes(), 14);
}

#[test]
fn a_block_used_on_another_stream_waits_for_its_fence() {
    use std::sync::atomic::{AtomicBool, Ordering};
    struct Flag(Arc<AtomicBool>);
    impl Fence for Flag {
        fn is_complete(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }
    let a = host_allocator();
    let first = unsafe { a.allocate_raw(4096, PoolId::DEFAULT, 1) }.unwrap();
    let done = Arc::new(AtomicBool::new(false));
    // SAFETY: `first` is a raw allocation nothing else refers to.
    unsafe { a.free_after(first.addr, vec![Box::new(Flag(done.clone()))]) };
    let second = unsafe { a.allocate_raw(4096, PoolId::DEFAULT, 1) }.unwrap();
    assert_ne!(
        second.addr, first.addr,
        "reissued while foreign work is pending"
    );
    done.store(true, Ordering::SeqCst);
    let third = unsafe { a.allocate_raw(4096, PoolId::DEFAULT, 1) }.unwrap();
    assert_eq!(third.addr, first.addr, "reusable once the fence completed");
    // SAFETY: raw allocations nothing else refers to, freed once.
    unsafe {
        a.free(second.addr);
        a.free(third.addr);
    }
    a.check_invariants().unwrap();
}
