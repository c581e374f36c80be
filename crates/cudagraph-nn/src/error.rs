//! Errors of the NN layer: shape problems, cuBLAS/cuDNN/cuBLASLt failures, configuration
//! mistakes, and everything from the core.

/// Result alias for the NN layer.
pub type Result<T, E = NnError> = std::result::Result<T, E>;

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
    Cublas { call: &'static str, status: String },
    /// `backward` was called on something that is not a scalar.
    #[error("backward() needs a scalar (one-element) tensor, got shape {0:?}")]
    NotScalar(Vec<usize>),
    /// A call into a CUDA library loaded at run time (cuDNN, cuBLASLt) failed.
    #[error("{library}: {call} failed: {status}")]
    Library {
        library: &'static str,
        call: &'static str,
        status: String,
    },
    /// A configuration value (an environment variable such as `CUDAGRAPH_GEMM`) is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// A data file could not be read or parsed.
    #[error("dataset: {0}")]
    Data(String),
    /// A model's files (description or safetensors weights) are unreadable or do not match.
    #[error(transparent)]
    Io(#[from] crate::io::IoError),
    /// Multi-GPU work failed: NCCL, the launch environment, the rendezvous, or a peer.
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
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
