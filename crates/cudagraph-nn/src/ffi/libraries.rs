//! [`Libraries`]: the one owner of a device's library handles — cuBLAS, cuBLASLt, cuDNN and
//! cuDNN's graph API. A [`Device::extension`], so the handles live as long as the device and
//! are destroyed with it. The engine registry (`engine::Engines`) reaches every library through
//! it and decides which ones its policy allows.
//!
//! cuBLAS's handle is made on first request (`Nn::get` makes it with the NN kernels, so a
//! failure to create it surfaces there); cuBLASLt and cuDNN are opened on first eager use, never
//! inside a capture (opening may allocate or synchronise), and a missing library prints a
//! one-line notice and is reported as absent from then on.

use std::sync::{Arc, Mutex, Once, OnceLock};

use cudagraph::memory::Allocator;
use cudagraph::runtime::Context;
use cudagraph::{Device, Queue};

use super::blas::Blas;
use super::blaslt::{self, BlasLt};
use super::cudnn::{self, Cudnn};
use super::cudnn_graph::CudnnGraph;
use super::loader::FIRST_USE_PATIENCE;
use crate::error::{NnError, Result};

/// Which library a notice is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Library {
    Cudnn,
    CudnnGraph,
    CublasLt,
}

/// Prints once per library why it is unavailable and what runs instead — for cuDNN's graph
/// API only when cuDNN itself is there (a missing cuDNN is reported once, by its legacy API).
fn notice_once(lib: Library, why: &str) {
    static CUDNN: Once = Once::new();
    static GRAPH: Once = Once::new();
    static LT: Once = Once::new();
    let (once, text) = match lib {
        Library::Cudnn => (&CUDNN, "cuDNN"),
        Library::CudnnGraph => (&GRAPH, "cuDNN graph API"),
        Library::CublasLt => (&LT, "cuBLASLt"),
    };
    if lib == Library::CudnnGraph && cudnn::version().is_err() {
        return;
    }
    once.call_once(|| {
        let then = match lib {
            Library::Cudnn => "convolutions run on cudagraph's own kernels",
            Library::CudnnGraph => {
                "convolutions use cuDNN's legacy API and cudagraph's own kernels"
            }
            Library::CublasLt => "products run on cuBLAS and cudagraph's own kernels",
        };
        eprintln!("cudagraph-nn: {text} unavailable ({why}); {then}");
    });
}

/// The library handles of one device (see the module docs).
pub struct Libraries {
    ctx: Context,
    alloc: Arc<Allocator>,
    /// The device's compute capability major (cuBLASLt's workspace size depends on it).
    major: u32,
    blas: OnceLock<Blas>,
    /// Held while the cuBLAS handle is made: one handle per device; a failed attempt leaves
    /// none, and the next request tries again.
    blas_init: Mutex<()>,
    cudnn: OnceLock<Option<Cudnn>>,
    cudnn_graph: OnceLock<Option<CudnnGraph>>,
    cublaslt: OnceLock<Option<BlasLt>>,
}

impl Libraries {
    /// The handles of `device` (none is opened until first asked for).
    pub fn get(device: &Device) -> Result<Arc<Libraries>> {
        device
            .extension(|d| {
                Ok(Libraries {
                    ctx: d.context().clone(),
                    alloc: d.allocator().clone(),
                    major: d.info().compute_capability.0,
                    blas: OnceLock::new(),
                    blas_init: Mutex::new(()),
                    cudnn: OnceLock::new(),
                    cudnn_graph: OnceLock::new(),
                    cublaslt: OnceLock::new(),
                })
            })
            .map_err(NnError::from)
    }

    /// The cuBLAS handle, made on first use (works inside a capture too; see [`Blas::new`]).
    pub fn blas(&self) -> Result<&Blas> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        let _making = self.blas_init.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        let b = Blas::new(&self.ctx, &self.alloc)?;
        Ok(self.blas.get_or_init(|| b))
    }

    /// Runs `f` with other threads' captures of this device held off (see
    /// `Context::with_captures_held_off`): opening a library may synchronise the device behind
    /// our back, which would invalidate those captures. Only for such leaf calls: `f` must not
    /// wait for anything a thread about to begin a capture may hold.
    fn held_off<R>(&self, f: impl FnOnce() -> R) -> R {
        self.ctx.with_captures_held_off(FIRST_USE_PATIENCE, f)
    }

    /// cuDNN, when installed (opened on first use; a missing library prints one notice).
    pub fn cudnn(&self) -> Option<&Cudnn> {
        self.cudnn
            .get_or_init(|| match self.held_off(|| Cudnn::open(&self.ctx)) {
                Ok(c) => Some(c),
                Err(why) => {
                    notice_once(Library::Cudnn, &why);
                    None
                }
            })
            .as_ref()
    }

    /// cuDNN for work on `q`: as [`Self::cudnn`], except that inside a capture a library not
    /// opened yet stays closed (opening it may allocate or synchronise, which a capture
    /// forbids).
    pub(crate) fn cudnn_for(&self, q: &dyn Queue) -> Option<&Cudnn> {
        if q.is_capturing() && self.cudnn.get().is_none() {
            return None;
        }
        self.cudnn()
    }

    /// cuDNN's graph API, when cuDNN 9 is installed (opened on first use; an unavailable API
    /// prints one notice).
    pub fn cudnn_graph(&self) -> Option<&CudnnGraph> {
        self.cudnn_graph
            .get_or_init(|| match self.held_off(|| CudnnGraph::open(&self.ctx)) {
                Ok(c) => Some(c),
                Err(why) => {
                    notice_once(Library::CudnnGraph, &why);
                    None
                }
            })
            .as_ref()
    }

    /// cuDNN's graph API for work on `q` (not opened inside a capture).
    pub(crate) fn cudnn_graph_for(&self, q: &dyn Queue) -> Option<&CudnnGraph> {
        if q.is_capturing() && self.cudnn_graph.get().is_none() {
            return None;
        }
        self.cudnn_graph()
    }

    /// cuBLASLt, when installed (opened on first use with the device's workspace size,
    /// [`blaslt::workspace_for`]; a missing library prints one notice).
    pub fn cublaslt(&self) -> Option<&BlasLt> {
        self.cublaslt
            .get_or_init(|| {
                let ws = blaslt::workspace_for(self.major);
                match self.held_off(|| BlasLt::open(&self.ctx, ws)) {
                    Ok(l) => Some(l),
                    Err(why) => {
                        notice_once(Library::CublasLt, &why);
                        None
                    }
                }
            })
            .as_ref()
    }

    /// cuBLASLt for work on `q` (not opened inside a capture).
    pub(crate) fn cublaslt_for(&self, q: &dyn Queue) -> Option<&BlasLt> {
        if q.is_capturing() && self.cublaslt.get().is_none() {
            return None;
        }
        self.cublaslt()
    }
}
