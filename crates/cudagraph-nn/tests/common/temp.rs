//! A fresh empty folder for a test's files.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A new empty folder under the system's temporary directory, named after `tag`, the process
/// and a counter (so tests running at once get folders of their own).
pub fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "cudagraph-{tag}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
