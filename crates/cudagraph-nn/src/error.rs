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
    /// A mixed-precision training setup is invalid: a GradScaler's configuration, an
    /// optimizer's 16-bit copies, a clipping bound.
    #[error(transparent)]
    Amp(#[from] AmpError),
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
    /// A training checkpoint does not match the model, optimizer or scaler it is loaded into.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A dtype name (as a command-line flag gives it) is not one of ours.
    #[error("unknown dtype `{given}`; expected f32, bf16 or f16")]
    DtypeName {
        /// The name as given.
        given: String,
    },
    /// A Hugging Face model folder (`config.json`, safetensors weights) is not one this build
    /// reads (`io::hf`).
    #[error(transparent)]
    Hf(#[from] HfError),
}

/// What is wrong with a Hugging Face model folder (`io::hf`): its `config.json`, its
/// safetensors weights (one file or shards with an index), or the two together.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HfError {
    /// `config.json` is not JSON, or a field is missing or of the wrong type or range.
    #[error("config.json: `{field}` {problem}")]
    Config {
        /// The field, by its name in the file (`""` for the file as a whole).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// `config.json` asks for something this build does not run.
    #[error("config.json: `{field}` = {value} is not supported; supported: {supported}")]
    Unsupported {
        /// The field, by its name in the file (`rope_scaling.rope_type`, ...).
        field: String,
        /// Its value as JSON.
        value: String,
        /// What is supported instead.
        supported: String,
    },
    /// The folder has neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{}: no model.safetensors and no model.safetensors.index.json", dir.display())]
    NoWeights {
        /// The folder.
        dir: PathBuf,
    },
    /// `model.safetensors.index.json` is malformed or does not match its shards.
    #[error("model.safetensors.index.json: {0}")]
    Index(String),
    /// Tensors the model needs are in no weights file.
    #[error("weights: missing tensors: {}", names.join(", "))]
    MissingTensors {
        /// Their names, sorted.
        names: Vec<String>,
    },
    /// The weights hold tensors the model does not use.
    #[error("weights: tensors this {model} model does not use: {}", names.join(", "))]
    ExtraTensors {
        /// The config's `model_type`.
        model: String,
        /// Their names, sorted.
        names: Vec<String>,
    },
    /// A tensor's shape does not match the config.
    #[error("weights: tensor `{name}` has shape {found:?}, but the config needs {expected:?}")]
    Shape {
        /// The tensor's name in the file.
        name: String,
        /// The shape the config implies (as stored in the file).
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype other than F32, BF16 or F16.
    #[error("weights: tensor `{name}` is {found}; supported: F32, BF16, F16")]
    Dtype {
        /// The tensor's name in the file.
        name: String,
        /// Its dtype as the safetensors header spells it.
        found: String,
    },
    /// A generation setting of `generation_config.json` or `config.json` (`eos_token_id`) is
    /// malformed.
    #[error("{file}: `{field}` {problem}")]
    Generation {
        /// The file's name.
        file: String,
        /// The field.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A chat template (`chat_template.jinja` or `tokenizer_config.json`'s `chat_template`)
    /// is malformed, or rendering it failed (a syntax error, the template's own
    /// `raise_exception`, too much work).
    #[error("chat template: {0}")]
    Chat(String),
    /// A `tokenizer.json` could not be read, or text could not be encoded or ids decoded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The same tensor is in two files.
    #[error("weights: tensor `{name}` is in both {first} and {second}")]
    Duplicate {
        /// The tensor's name.
        name: String,
        /// One file.
        first: String,
        /// The other.
        second: String,
    },
}

impl From<IoError> for cudagraph::Error {
    fn from(e: IoError) -> Self {
        cudagraph::Error::External(Box::new(e))
    }
}

/// What is wrong with a mixed-precision training setup (`nn::scaler`, the optimizers' 16-bit
/// copies, `nn::clip`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmpError {
    /// An optimizer's model copies must be 16-bit: the parameters themselves are the f32
    /// masters.
    #[error(
        "optimizer copies must be bf16 or f16 (the parameters are the f32 masters), not {dtype}"
    )]
    CopyDtype {
        /// The dtype asked for (`"f32"`).
        dtype: &'static str,
    },
    /// A GradScaler setting is out of its range.
    #[error("GradScaler: {name} = {value} is invalid; it must be {rule}")]
    ScalerConfig {
        /// The setting, by PyTorch's name (`init_scale`, `growth_factor`, ...).
        name: &'static str,
        /// The value given.
        value: f64,
        /// The range it must lie in.
        rule: &'static str,
    },
    /// More optimizers were stepped between two `update()` calls than a scaler keeps
    /// found-inf flags for.
    #[error("GradScaler: more than {max} optimizers stepped between two update() calls")]
    TooManyOptimizers {
        /// The most a scaler takes.
        max: usize,
    },
    /// The optimizer cannot read the scaler's device flag, so a step could not be skipped
    /// without a host read.
    #[error(
        "GradScaler: this optimizer cannot step under a device-side scaler (Sgd and Adam can)"
    )]
    NotScalable,
    /// Something that needs f32 parameters or gradients was given parameters stored in
    /// 16 bits (pure bf16/f16 training, [`crate::Parameter::to_dtype`]).
    #[error("{what} does not take 16-bit parameters: `{param}` is {dtype}. To fix: {fix}")]
    LowPrecisionParams {
        /// What refused them, e.g. `GradScaler` or `optimizer copies`.
        what: &'static str,
        /// The first 16-bit parameter's name.
        param: String,
        /// Its element type.
        dtype: &'static str,
        /// What to do instead.
        fix: &'static str,
    },
    /// `clip_grad_norm`'s bound must be a number ≥ 0 (infinity: no clipping).
    #[error("clip_grad_norm: max_norm = {0} is invalid; it must be ≥ 0 (inf: no clipping)")]
    MaxNorm(f32),
}

/// What is wrong with a training checkpoint (`io::checkpoint`) for the model, optimizer and
/// scaler it is loaded into.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The file is not a checkpoint of a version this build reads.
    #[error("checkpoint: format `{format}` version `{version}`; this build reads `cudagraph-checkpoint` version {supported}")]
    Version {
        /// The `format` metadata found (empty when absent).
        format: String,
        /// The `version` metadata found (empty when absent).
        version: String,
        /// The version this build writes and reads.
        supported: u32,
    },
    /// A tensor the model, optimizer or scaler needs is not in the file.
    #[error("checkpoint: tensor `{name}` is missing (the file has {available})")]
    Missing {
        /// The tensor's name, e.g. `optim.exp_avg.3`.
        name: String,
        /// How many tensors the file has, and the first names.
        available: String,
    },
    /// The file has tensors nothing being loaded uses.
    #[error("checkpoint: the file has tensors the model, optimizer and scaler do not use: {}", names.join(", "))]
    Extra {
        /// Their names.
        names: Vec<String>,
    },
    /// A tensor has another shape or dtype than what it is loaded into.
    #[error("checkpoint: tensor `{name}` is {found}, but {expected} is needed")]
    Mismatch {
        /// The tensor's name.
        name: String,
        /// What the loading side needs (dtype and shape).
        expected: String,
        /// What the file has.
        found: String,
    },
    /// The file was saved from another kind of object or setting.
    #[error("checkpoint: {what} was saved as `{found}`, but `{expected}` is being loaded")]
    Kind {
        /// What differs (`optimizer`, `scaler`, `schedule`, ...).
        what: &'static str,
        /// What the loading side has.
        expected: String,
        /// What the file says.
        found: String,
    },
}

impl From<CheckpointError> for NnError {
    fn from(e: CheckpointError) -> Self {
        NnError::Io(IoError::Checkpoint(e))
    }
}

impl From<AmpError> for cudagraph::Error {
    fn from(e: AmpError) -> Self {
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
