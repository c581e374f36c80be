//! Page-locked host buffers: [`PinnedBuffer`] is host memory the device copies to and from with
//! DMA. Transfers are issued inside `Stream::pinned_scope` (in [`crate::device`]), which keeps
//! the buffers borrowed until the stream has synchronised.

use std::fmt;
use std::marker::PhantomData;

use super::{bytes_for, Elem};
use crate::error::Result;
use std::sync::Arc;

use crate::runtime::memory::PinnedAlloc;
use crate::runtime::primary::ContextHandle;

/// `len` elements of `T` in page-locked host memory, zero-initialised.
pub struct PinnedBuffer<T: Elem> {
    raw: PinnedAlloc,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Elem> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PinnedBuffer<{}>[{}]",
            std::any::type_name::<T>(),
            self.len
        )
    }
}

impl<T: Elem> PinnedBuffer<T> {
    pub(crate) fn new(len: usize, ctx: &Arc<ContextHandle>) -> Result<Self> {
        let bytes = bytes_for::<T>("pinned allocation", len)?;
        Ok(Self {
            raw: PinnedAlloc::new(bytes, ctx)?,
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

    pub(crate) fn raw(&self) -> &PinnedAlloc {
        &self.raw
    }

    /// The contents.
    pub fn as_slice(&self) -> &[T] {
        typed(&self.raw, self.len)
    }

    /// The contents, writable.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: `&mut self` is the only access to the allocation; transfers borrow the
        // buffer for their whole scope, so none is in flight while this borrow exists.
        unsafe { typed_mut(&self.raw, self.len) }
    }
}

/// The first `len` elements of `raw` as `T`. Panics if they do not fit (callers size the
/// allocation from the same length). Only read when no device copy into it is in flight.
pub(crate) fn typed<T: Elem>(raw: &PinnedAlloc, len: usize) -> &[T] {
    assert!(
        len.checked_mul(std::mem::size_of::<T>())
            .is_some_and(|b| b <= raw.len()),
        "pinned view of {len} elements exceeds {} bytes",
        raw.len()
    );
    // SAFETY: cuMemHostAlloc returns page-aligned memory, so the alignment of any Elem holds;
    // the memory is initialised (zeroed at allocation) and every bit pattern is a valid Elem;
    // the length is checked above; the slice borrows `raw`.
    unsafe { std::slice::from_raw_parts(raw.as_ptr() as *const T, len) }
}

/// The first `len` elements of `raw` as `T`, writable through a shared handle.
///
/// # Safety
/// For the lifetime of the returned slice no other slice of this allocation may exist and no
/// device copy from or into it may be in flight.
#[allow(clippy::mut_from_ref)]
pub(crate) unsafe fn typed_mut<T: Elem>(raw: &PinnedAlloc, len: usize) -> &mut [T] {
    assert!(
        len.checked_mul(std::mem::size_of::<T>())
            .is_some_and(|b| b <= raw.len()),
        "pinned view of {len} elements exceeds {} bytes",
        raw.len()
    );
    std::slice::from_raw_parts_mut(raw.as_ptr() as *mut T, len)
}
