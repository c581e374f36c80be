//! Typed device memory: [`Elem`] (the element types a buffer may hold: the plain integers and
//! floats, and the `half` crate's [`bf16`](half::bf16) and [`f16`](half::f16)), [`bytes_for`]
//! (checked sizes) and [`DeviceBuffer`] (a typed view of a [`BlockRef`], its length checked
//! against the block). Blocks themselves are in `block.rs`.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use super::block::BlockRef;
use super::host::{bytes_of, bytes_of_mut};
use crate::error::{Error, Result};
use crate::ids::PoolId;

mod sealed {
    pub trait Sealed {}
}

/// Element types a device buffer can hold: plain numbers, every bit pattern valid.
pub trait Elem: sealed::Sealed + Copy + Default + Send + Sync + fmt::Debug + 'static {
    /// Bytes as they are laid out in memory.
    fn as_bytes(v: &[Self]) -> &[u8];
    /// Mutable bytes of a slice.
    fn as_bytes_mut(v: &mut [Self]) -> &mut [u8];
}

macro_rules! elem {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Elem for $t {
            fn as_bytes(v: &[Self]) -> &[u8] {
                // Plain numbers: reading their bytes is always defined.
                let n = std::mem::size_of_val(v);
                bytes_of(v.as_ptr() as *const u8, n)
            }
            fn as_bytes_mut(v: &mut [Self]) -> &mut [u8] {
                let n = std::mem::size_of_val(v);
                bytes_of_mut(v.as_mut_ptr() as *mut u8, n)
            }
        }
    )*};
}
elem!(f32, f64, i8, u8, i16, u16, i32, u32, i64, u64);
// The `half` crate's 16-bit floats: `#[repr(transparent)]` over a `u16`, so plain numbers with
// the device's layout (every bit pattern is some bf16 or f16 value, NaNs included).
elem!(half::bf16, half::f16);

/// Bytes of `len` elements of `T`, or the typed error for a count that does not fit.
pub fn bytes_for<T>(what: &'static str, len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or(Error::SizeOverflow {
            what,
            count: len,
            elem_size: std::mem::size_of::<T>(),
        })
}

/// A typed device buffer: `len` elements of `T` at the start of a block.
///
/// Invariant: `len * size_of::<T>()` fits in the block, so every byte offset inside the
/// buffer is representable and inside memory the block owns.
///
/// Dropping it returns the block to its pool — unless a graph baked its address in, in which
/// case the graph keeps it until the graph is dropped.
pub struct DeviceBuffer<T: Elem> {
    block: Arc<BlockRef>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Elem> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceBuffer<{}>[{}] @ {:#x} ({})",
            std::any::type_name::<T>(),
            self.len,
            self.block.addr(),
            self.block.pool()
        )
    }
}

impl<T: Elem> DeviceBuffer<T> {
    /// A buffer of `len` elements over `block`; fails unless they fit in it.
    pub fn from_block(block: Arc<BlockRef>, len: usize) -> Result<Self> {
        let bytes = bytes_for::<T>("buffer view", len)?;
        if bytes > block.size() {
            return Err(Error::OutOfRange {
                what: "buffer view of a block",
                start: 0,
                end: bytes,
                len: block.size(),
            });
        }
        Ok(Self {
            block,
            len,
            _t: PhantomData,
        })
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes of the elements (not of the rounded block).
    pub fn bytes(&self) -> usize {
        // Cannot overflow: checked when the buffer was made (see the type's invariant).
        self.len * std::mem::size_of::<T>()
    }

    /// Device address of element 0.
    pub fn addr(&self) -> u64 {
        self.block.addr()
    }

    /// The pool the block came from.
    pub fn pool(&self) -> PoolId {
        self.block.pool()
    }

    /// The shared block, for graph keep-alive and for CUDA libraries called on raw pointers.
    pub fn block(&self) -> &Arc<BlockRef> {
        &self.block
    }

    /// Another handle to the same device memory (it stays allocated while any handle, or a
    /// graph that uses it, is alive). Device memory is not Rust memory, so aliasing is sound;
    /// ordering reads and writes is up to the streams, as for every device buffer.
    pub fn alias(&self) -> DeviceBuffer<T> {
        Self {
            block: self.block.clone(),
            len: self.len,
            _t: PhantomData,
        }
    }

    /// A handle to the first `len` elements (`len` at most `self.len()`), sharing the memory.
    pub fn prefix(&self, len: usize) -> Result<DeviceBuffer<T>> {
        if len > self.len {
            return Err(Error::OutOfRange {
                what: "buffer prefix",
                start: 0,
                end: len,
                len: self.len,
            });
        }
        Ok(Self {
            block: self.block.clone(),
            len,
            _t: PhantomData,
        })
    }

    /// Device address of element `offset` (`offset` at most `len`: one past the end is allowed,
    /// as for slices).
    pub fn addr_at(&self, offset: usize) -> Result<u64> {
        if offset > self.len {
            return Err(Error::OutOfRange {
                what: "buffer offset",
                start: offset,
                end: offset,
                len: self.len,
            });
        }
        // Cannot overflow: offset <= len and len * size fits (the type's invariant).
        Ok(self.block.addr() + (offset * std::mem::size_of::<T>()) as u64)
    }
}
