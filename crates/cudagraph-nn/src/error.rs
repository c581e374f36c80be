//! Errors of the NN layer: shape problems, cuBLAS/cuDNN/cuBLASLt failures, configuration
//! mistakes, model files (`IoError`, re-exported by `io`), multi-GPU work (`DistError`,
//! re-exported by `dist`), and everything from the core. Every error type lives here, below the
//! modules that return them.

use std::path::PathBuf;

/// Result alias for the NN layer.
pub type Result<T, E = NnError> = std::result::Result<T, E>;

/// Every error of the NN layer; [`Result`]'s default error type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NnError {
    /// An error from the core (driver, allocator, capture).
    #[error(transparent)]
    Core(#[from] cudagraph::Error),
    /// Tensor shapes that an operation cannot combine.
    #[error("shape error: {0}")]
    Shape(String),
    /// A cuBLAS call failed.
    #[error("{call} failed: {status}")]
    Cublas {
        /// The cuBLAS function that failed, e.g. `cublasSgemm_v2`.
        call: &'static str,
        /// The `cublasStatus_t` it returned, as text.
        status: String,
    },
    /// `backward` was called on something that is not a scalar.
    #[error("backward() needs a scalar (one-element) tensor, got shape {0:?}")]
    NotScalar(Vec<usize>),
    /// A call came out of the order its object needs: a [`crate::GraphedModule`] forward
    /// while the previous forward's output still waits for its backward, or a backward
    /// through a graph that an earlier backward already freed.
    #[error("{call} called out of order: {problem}. To fix: {fix}")]
    OutOfOrder {
        /// The method called out of order.
        call: &'static str,
        /// What state made the call invalid.
        problem: &'static str,
        /// What the caller should do instead.
        fix: &'static str,
    },
    /// A call into a CUDA library loaded at run time (cuDNN, cuBLASLt) failed.
    #[error("{library}: {call} failed: {status}")]
    Library {
        /// The library, e.g. `cuDNN` or `cuBLASLt`.
        library: &'static str,
        /// The library function that failed.
        call: &'static str,
        /// The status it returned, as text.
        status: String,
    },
    /// A tensor or buffer of another element type than the operation takes.
    #[error(
        "{what} holds {found} elements where {expected} was needed; convert it with \
         `Tensor::to_dtype`, or run the operation inside `autocast`"
    )]
    Dtype {
        /// What had the wrong type, e.g. `tensor` or `linear: weight`.
        what: &'static str,
        /// The element type needed (`f32`, `bf16` or `f16`).
        expected: &'static str,
        /// The element type given.
        found: &'static str,
    },
    /// A configuration value (an environment variable such as `CUDAGRAPH_GEMM`) is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// The device cannot run what was asked (e.g. thread-block clusters before sm_90).
    #[error("not supported on this device: {0}")]
    Unsupported(String),
    /// An operation was asked for something it does not do on any device: element types it
    /// does not take (`engine::gemm_lowp` with f32 operands), an epilogue its engines lack
    /// (GELU in an f32 product).
    #[error("{op}: {what} is not supported. To fix: {fix}")]
    NotSupported {
        /// The operation, e.g. `gemm_lowp`.
        op: &'static str,
        /// What it was asked for, e.g. `operands of f32`.
        what: String,
        /// What the caller should do instead.
        fix: &'static str,
    },
    /// A data file could not be read or parsed.
    #[error("dataset: {0}")]
    Data(String),
    /// A model's files (description or safetensors weights) are unreadable or do not match.
    #[error(transparent)]
    Io(#[from] IoError),
    /// Multi-GPU work failed: NCCL, the launch environment, the rendezvous, or a peer.
    #[error(transparent)]
    Dist(#[from] DistError),
}

/// Lets NN code run inside `Graph::capture` closures with `?`.
impl From<NnError> for cudagraph::Error {
    fn from(e: NnError) -> Self {
        match e {
            NnError::Core(e) => e,
            other => cudagraph::Error::External(Box::new(other)),
        }
    }
}

/// What can be wrong with a model's files (the description or the weights).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a safetensors file.
    #[error("{what} is not a valid safetensors file: {detail}")]
    Format {
        /// Which file or buffer, for the message.
        what: String,
        /// What is wrong with its bytes.
        detail: String,
    },
    /// The description as a whole is malformed (not JSON, missing `input` or `layers`).
    #[error("model description: {0}")]
    Description(String),
    /// One layer of the description is malformed or does not fit the shape before it.
    #[error("model description, layer {layer} ({kind}): {problem}")]
    Layer {
        /// The layer's index in the description's `layers` list (from 0).
        layer: usize,
        /// The layer's `type` (e.g. `linear`, `conv2d`).
        kind: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A parameter the model needs is not in the weights file.
    #[error("weights: tensor `{name}` (layer {layer}) is missing; the file has {available}. Was the state_dict saved from the nn.Sequential itself (names like `0.weight`)?")]
    MissingTensor {
        /// The tensor's name, e.g. `0.weight`.
        name: String,
        /// The index of the layer that needs it.
        layer: usize,
        /// The names the file does have, comma-separated.
        available: String,
    },
    /// The weights file has tensors the model does not use.
    #[error("weights: the file has tensors the description does not use: {}; check the layer list (every module of the nn.Sequential, in order, including relu/max_pool2d/flatten)", names.join(", "))]
    ExtraTensors {
        /// The unused tensors' names.
        names: Vec<String>,
    },
    /// A parameter has another shape than the description implies.
    #[error("weights: tensor `{name}` has shape {found:?}, but layer {layer} needs {expected:?}")]
    ShapeMismatch {
        /// The tensor's name.
        name: String,
        /// The index of the layer that owns it.
        layer: usize,
        /// The shape the layer needs.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor's dtype is not one the weights may have: F32, BF16 or F16 (`io::Dtype`).
    #[error("weights: tensor `{name}` is {found}, but the supported dtypes are F32 (torch.float32), BF16 (torch.bfloat16) and F16 (torch.float16); convert it (`model.float()`) before saving")]
    DtypeMismatch {
        /// The tensor's name.
        name: String,
        /// Its dtype as the safetensors header spells it (e.g. `F64`).
        found: String,
    },
    /// Saving in a narrower dtype (`dtype`: `"bf16"` or `"f16"`, whose largest finite value is
    /// `max`): element `index` of tensor `name` is finite but would become infinite.
    #[error("weights: tensor `{name}` element {index} is {value}, which overflows {dtype} (largest finite value {max}); save it in f32 or bf16, or scale the weights")]
    Overflow {
        /// The tensor's name.
        name: String,
        /// The target dtype, `"bf16"` or `"f16"`.
        dtype: &'static str,
        /// The target dtype's largest finite value.
        max: f32,
        /// The flat index of the first element that overflows.
        index: usize,
        /// That element's f32 value.
        value: f32,
    },
    /// A dtype name (as a command-line flag gives it) is not one of ours.
    #[error("unknown dtype `{given}`; expected f32, bf16 or f16")]
    DtypeName {
        /// The name as given.
        given: String,
    },
}

impl From<IoError> for cudagraph::Error {
    fn from(e: IoError) -> Self {
        cudagraph::Error::External(Box::new(e))
    }
}

/// Errors of multi-GPU work: NCCL, the launch environment, the rendezvous, peers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// The NCCL library could not be loaded, lacks a function we call, or is too old.
    #[error("NCCL is not available: {detail}. Install NCCL 2.13 or newer so that libnccl.so is on the loader path, or set CUDAGRAPH_NCCL_LIB to the library's path")]
    NcclMissing {
        /// Why loading failed (the loader's message or the missing symbol).
        detail: String,
    },

    /// An NCCL call failed.
    #[error("{call} failed: {name} ({code}){detail}")]
    Nccl {
        /// The NCCL function that failed, e.g. `ncclAllReduce`.
        call: &'static str,
        /// The `ncclResult_t` it returned.
        code: i32,
        /// That code's name (from `ncclGetErrorString`).
        name: String,
        /// Extra context (NCCL's last error message), empty or starting with a separator.
        detail: String,
    },

    /// A launch variable is missing or malformed.
    #[error("environment variable {var}: {problem}")]
    Env {
        /// The variable's name, e.g. `RANK`.
        var: &'static str,
        /// What is wrong with it.
        problem: String,
    },

    /// The rendezvous failed (wrong world size, duplicate rank, unreachable rank 0...).
    #[error("rendezvous at {addr}: {problem}")]
    Rendezvous {
        /// The rendezvous address (`host:port` of rank 0).
        addr: String,
        /// What went wrong.
        problem: String,
    },

    /// Something did not finish in time.
    #[error("{what} did not finish within {secs:.0} s: {hint}")]
    Timeout {
        /// The operation that timed out.
        what: String,
        /// The time limit, in seconds.
        secs: f64,
        /// What to check or which variable raises the limit.
        hint: String,
    },

    /// Another rank failed or disappeared.
    #[error("a peer failed: {0}")]
    PeerFailed(String),

    /// The communicator was aborted (after an error, a timeout or a failed peer); it cannot
    /// be used any more. Exit the process: the device may still hold work that waits for a
    /// peer.
    #[error("the NCCL communicator was aborted: {reason}")]
    Aborted {
        /// The error, timeout or peer failure that caused the abort.
        reason: String,
    },

    /// Ranks disagree about something that must be identical (the model's parameters).
    #[error("ranks disagree: {0}")]
    Mismatch(String),

    /// A call that cannot work as made.
    #[error("{0}")]
    Usage(String),
}
