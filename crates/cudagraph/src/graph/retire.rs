//! Deferred release: what a graph lets go of while one of its replays may still run (its
//! driver objects and buffers when it is dropped, an executable graph or buffers rebind
//! replaced) waits here for the replay's completion event. Nothing is released before the
//! event has completed; a thread that is capturing never even asks it (that would invalidate
//! its capture).

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::runtime::{capturing_on_this_thread, Event};

/// Resources waiting for a replay to finish before they may be released.
struct Retired {
    done: Event,
    _what: Box<dyn Any + Send>,
}

static RETIRED: Mutex<Vec<Retired>> = Mutex::new(Vec::new());
static RETIRED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Releases `what` once `done` has completed: now if it has, after waiting if this thread may
/// wait, else later (see [`drain_retired`]).
pub(super) fn retire(done: &Event, what: Box<dyn Any + Send>) {
    // On a capturing thread even querying the event would invalidate the capture: defer.
    if !capturing_on_this_thread() {
        match done.synchronize() {
            // Finished, or the context is lost and nothing runs any more: release.
            Ok(()) => return,
            Err(e) if e.is_context_lost() => return,
            // The wait failed for another reason (another thread's global-mode capture, a
            // host callback that drops the graph): the replay may still run. Keep it all and
            // ask the event again later (`drain_retired`).
            Err(_) => {}
        }
    }
    let mut r = RETIRED.lock().unwrap_or_else(|p| p.into_inner());
    r.push(Retired {
        done: done.clone(),
        _what: what,
    });
    RETIRED_COUNT.store(r.len(), Ordering::Release);
}

/// Releases retired resources whose replays have finished. Cheap when there are none.
pub(crate) fn drain_retired() {
    if RETIRED_COUNT.load(Ordering::Acquire) == 0 || capturing_on_this_thread() {
        return;
    }
    let done: Vec<Retired> = {
        let mut r = RETIRED.lock().unwrap_or_else(|p| p.into_inner());
        let (done, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut *r)
            .into_iter()
            // Released once the event says done (or the context is lost); kept while it
            // cannot say.
            .partition(|x| x.done.query().unwrap_or_else(|e| e.is_context_lost()));
        *r = keep;
        RETIRED_COUNT.store(r.len(), Ordering::Release);
        done
    };
    drop(done);
}
