//! PyTorch's size classes, with checked arithmetic: requests round up to 512 bytes; requests
//! up to 1 MiB are small and come from 2 MiB segments; larger ones come from 20 MiB segments,
//! or from a segment of their own (rounded to 2 MiB) above 10 MiB. Small and large blocks never
//! share a segment. Only sizes live here; which block serves a request is in `alloc.rs`.

use crate::error::{Error, Result};

pub(crate) const ROUND: usize = 512;
pub(crate) const SMALL_MAX: usize = 1 << 20;
pub(crate) const SMALL_SEGMENT: usize = 2 << 20;
pub(crate) const LARGE_SEGMENT: usize = 20 << 20;
pub(crate) const LARGE_ROUND: usize = 2 << 20;
pub(crate) const LARGE_SHARED_MAX: usize = 10 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Class {
    Small,
    Large,
}

pub(super) fn overflow(bytes: usize) -> Error {
    Error::SizeOverflow {
        what: "allocation",
        count: bytes,
        elem_size: 1,
    }
}

/// Rounded request size and its class.
pub(super) fn classify(bytes: usize) -> Result<(usize, Class)> {
    let size = bytes
        .max(1)
        .checked_next_multiple_of(ROUND)
        .ok_or_else(|| overflow(bytes))?;
    Ok(if size <= SMALL_MAX {
        (size, Class::Small)
    } else {
        (size, Class::Large)
    })
}

/// The smallest segment that can hold a rounded request of `size` bytes.
pub(super) fn tight_segment(size: usize, class: Class, bytes: usize) -> Result<usize> {
    match class {
        Class::Small => Ok(SMALL_SEGMENT),
        Class::Large => size
            .checked_next_multiple_of(LARGE_ROUND)
            .ok_or_else(|| overflow(bytes)),
    }
}

/// Segment size for a rounded request (`bytes` is the request, for the error).
pub(super) fn segment_size(size: usize, class: Class, bytes: usize) -> Result<usize> {
    match class {
        Class::Large if size <= LARGE_SHARED_MAX => Ok(LARGE_SEGMENT),
        _ => tight_segment(size, class, bytes),
    }
}

/// Whether `used + extra` bytes stay within `limit` (an overflowing sum does not).
pub(super) fn fits(used: usize, extra: usize, limit: usize) -> bool {
    used.checked_add(extra).is_some_and(|total| total <= limit)
}

/// Whether a free remainder of `rest` bytes is worth splitting off.
pub(super) fn should_split(rest: usize, class: Class) -> bool {
    match class {
        Class::Small => rest >= ROUND,
        Class::Large => rest > SMALL_MAX,
    }
}
