//! `cudagraph`: device information and eager-vs-graph benchmarks.
//!
//! The commands hold presentation only (argument parsing, tables, JSON); everything a library
//! user would also need lives in the `cudagraph` crate.

/// `println!` that ends the process quietly when stdout is closed (`cudagraph ... | head`)
/// instead of panicking on the broken pipe.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
        }
    }};
}

mod bench;
mod copy_task;
mod generate;
mod inspect;
mod launch;
mod report;
mod serve;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cudagraph",
    version,
    about = "CUDA Graphs for Rust: device info and benchmarks"
)]
struct Cli {
    /// CUDA device ordinal.
    #[arg(long, global = true, default_value_t = 0)]
    device: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the device, its memory and the driver.
    Info {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks, eager vs graph. Without a subcommand: the seed workloads (MLP inference,
    /// Linear training with SGD and Adam, two models in one bounded pool, nine batch sizes in
    /// one pool).
    #[command(args_conflicts_with_subcommands = true)]
    Bench {
        #[command(subcommand)]
        which: Option<BenchCommand>,
        #[command(flatten)]
        workloads: bench::workloads::WorkloadArgs,
    },
    /// Train a small CNN (or MLP) on the UCI handwritten digits, eager or graphed, with
    /// per-phase memory logs; `train copy`: a GPT-2-shaped model on a synthetic copy task.
    #[command(args_conflicts_with_subcommands = true)]
    Train {
        #[command(subcommand)]
        which: Option<TrainCommand>,
        #[command(flatten)]
        args: train::TrainArgs,
    },
    /// Capture a workload and show its graph: node counts, memory, times, DOT (and SVG).
    Inspect(inspect::InspectArgs),
    /// Serve a model (safetensors weights + JSON description) over HTTP with dynamic batching
    /// through a graph cache (`--no-graph`: eager).
    Serve(serve::ServeArgs),
    /// Generate tokens from a Hugging Face decoder (GPT-2, Llama family): the prompt prefilled
    /// eagerly, every decode step replayed from a captured graph.
    Generate(generate::GenerateArgs),
    /// Start the local processes of a distributed job, like torchrun: `cudagraph launch
    /// --nproc 2 -- <command...>` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    /// MASTER_PORT for each, prefixes their output with the rank, and stops them all when one
    /// fails (exiting with its status).
    Launch(launch::LaunchArgs),
}

#[derive(Subcommand)]
enum TrainCommand {
    /// A GPT-2-shaped model (4 layers by default) learns to repeat a block of random tokens,
    /// the whole step (bf16 autocast forward, backward, clipping, AdamW) in one CUDA graph.
    Copy(copy_task::CopyArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// A chain of k tiny kernels: launch overhead eager vs one graph launch.
    Chain(bench::chain::ChainArgs),
    /// The seed MLP at random batch sizes: eager vs a GraphCache (padding, buckets).
    Cache(bench::cache::CacheArgs),
    /// New input buffer per request: copy-in vs rebind (exec update) vs re-capture.
    Rebind(bench::rebind::RebindArgs),
    /// What ordering replays across streams costs: graphs of one pool on one stream and on
    /// two, graphs of separate pools, a graph cache served from one stream and from two.
    Streams(bench::streams::StreamsArgs),
    /// The workloads' matrix products on each engine family; `--dtype bf16|f16`: half-precision
    /// products on tensor cores (squares to 8192³ and the workloads' shapes, TFLOP/s).
    Gemm(bench::gemm::GemmArgs),
    /// Convolutions at real image sizes (ResNet-50 at batch 32) in f32, bf16 or f16: µs,
    /// TFLOP/s and the engine (and layout) the registry chose, per direction.
    Conv(bench::conv::ConvArgs),
    /// The seed workloads (the default).
    Workloads(bench::workloads::WorkloadArgs),
    /// A long run (10^6 training-step replays and graph-cache requests) that must leave memory flat.
    Soak(bench::soak::SoakArgs),
    /// Load on `cudagraph serve` (in process): N clients, random request sizes, fixed time;
    /// throughput and latency percentiles, graph vs eager, every answer checked.
    Serve(bench::serve::ServeBenchArgs),
    /// Shapes beyond the seeds, graphed forward and training (beside bench/pytorch_sweep.py).
    Sweep(bench::sweep::SweepArgs),
    /// The engine registry's choices (cuDNN, cuBLASLt, cuBLAS, ours) for representative shapes.
    Engines(bench::engines::EnginesArgs),
    /// Decode steps of a Hugging Face decoder (one captured step per batch) after prompts of
    /// given lengths: ms per step and tokens/s (beside bench/decode_torch.py).
    Decode(bench::decode::DecodeArgs),
    /// Our decoder's logits and greedy tokens against Hugging Face's (bench/hf_reference.py).
    Parity(bench::parity::ParityArgs),
    /// Data-parallel training on 1 and 2 GPUs (one process per GPU, NCCL), eager vs graph.
    Ddp(bench::ddp::DdpArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<(), Box<dyn std::error::Error>> = match cli.command {
        Command::Info { json } => report::info(cli.device, json).map_err(Into::into),
        Command::Bench { which, workloads } => match which {
            Some(BenchCommand::Chain(args)) => {
                bench::chain::run(cli.device, &args).map_err(Into::into)
            }
            Some(BenchCommand::Cache(args)) => bench::cache::run(cli.device, &args),
            Some(BenchCommand::Rebind(args)) => bench::rebind::run(cli.device, &args),
            Some(BenchCommand::Streams(args)) => bench::streams::run(cli.device, &args),
            Some(BenchCommand::Gemm(args)) => bench::gemm::run(cli.device, &args),
            Some(BenchCommand::Conv(args)) => bench::conv::run(cli.device, &args),
            Some(BenchCommand::Workloads(args)) => bench::workloads::run(cli.device, &args),
            Some(BenchCommand::Soak(args)) => bench::soak::run(cli.device, &args),
            Some(BenchCommand::Serve(args)) => bench::serve::run(cli.device, &args),
            Some(BenchCommand::Sweep(args)) => bench::sweep::run(cli.device, &args),
            Some(BenchCommand::Engines(args)) => bench::engines::run(cli.device, &args),
            Some(BenchCommand::Ddp(args)) => bench::ddp::run(&args),
            Some(BenchCommand::Decode(args)) => bench::decode::run(cli.device, &args),
            Some(BenchCommand::Parity(args)) => bench::parity::run(cli.device, &args),
            None => bench::workloads::run(cli.device, &workloads),
        },
        Command::Train { which, args } => match which {
            Some(TrainCommand::Copy(copy)) => copy_task::run(cli.device, &copy),
            None => train::run(cli.device, &args),
        },
        Command::Inspect(args) => inspect::run(cli.device, &args),
        Command::Serve(args) => serve::run(cli.device, &args),
        Command::Generate(args) => generate::run(cli.device, &args),
        Command::Launch(args) => match launch::run(&args) {
            // The job's own status, as torchrun passes it on.
            Ok(code) => return ExitCode::from(code.clamp(0, 255) as u8),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
