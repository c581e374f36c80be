//! Ordering of work that shares memory across streams: [`LastUse`] remembers the stream that
//! last used a resource (a graph pool's memory, a graph, a graph cache's static buffers), and a
//! use from another stream first waits — stream-ordered, with no host wait — for everything
//! that stream had enqueued. Uses on the same stream cost a lock and a comparison.

use std::sync::{Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::runtime::{StreamRef, WeakStream};

/// The stream that last used a shared resource (see the module docs).
#[derive(Default)]
pub(crate) struct LastUse {
    last: Mutex<Option<WeakStream>>,
}

/// Held while work that uses the resource is being enqueued: no other stream's use can
/// interleave, so the next use from another stream is ordered after all of it.
pub(crate) struct UseGuard<'a> {
    _last: MutexGuard<'a, Option<WeakStream>>,
}

impl LastUse {
    /// Orders work about to be enqueued on `stream` after all the work enqueued so far on the
    /// stream of the last use, when that is another stream, and makes `stream` the last user.
    /// Keep the guard until the work is enqueued.
    ///
    /// Fails (enqueuing nothing) when the last user's stream is part of a capture this crate
    /// did not begin (another library's): no event can say when its work is done.
    #[track_caller]
    pub(crate) fn enter(&self, stream: StreamRef<'_>) -> Result<UseGuard<'_>> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match last.as_ref() {
            Some(prev) if prev.id() == stream.id() => {}
            Some(prev) => {
                if !prev.is_done() {
                    let fence = prev.fence().ok_or_else(|| Error::InvalidGraph {
                        problem: format!(
                            "cannot order this use on stream #{} after the last use on stream #{}: \
                             that stream is part of a capture another library began; end it first",
                            stream.id(),
                            prev.id()
                        ),
                    })?;
                    stream.wait_event(&fence)?;
                }
                *last = Some(stream.downgrade());
            }
            None => *last = Some(stream.downgrade()),
        }
        Ok(UseGuard { _last: last })
    }
}
