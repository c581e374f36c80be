//! CPU test, in its own process (the library is loaded once per process): an NCCL that
//! cannot be loaded is one clear error naming what was tried and how to fix it.

use cudagraph_nn::dist::{self, DistError};

#[test]
fn a_missing_nccl_is_one_clear_error() {
    // Before anything in this process loads NCCL: the explicit path wins over the search.
    std::env::set_var("CUDAGRAPH_NCCL_LIB", "/nonexistent/libnccl.so.2");
    let e = dist::nccl_version().unwrap_err();
    assert!(matches!(e, DistError::NcclMissing { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("/nonexistent/libnccl.so.2"), "{msg}");
    assert!(msg.contains("NCCL 2.13 or newer"), "{msg}");
    // Asking again gives the same answer (no retry storm, no panic).
    assert_eq!(dist::nccl_version().unwrap_err().to_string(), msg);
}
