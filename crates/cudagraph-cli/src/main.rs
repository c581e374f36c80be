//! `cudagraph`: device information and eager-vs-graph benchmarks.
//!
//! The commands hold presentation only (argument parsing, tables, JSON); everything a library
//! user would also need lives in the `cudagraph` crate.

mod bench;
mod report;

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
    /// Benchmarks: eager vs graph.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// A chain of k tiny kernels: launch overhead eager vs one graph launch.
    Chain(bench::chain::ChainArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info { json } => report::info(cli.device, json),
        Command::Bench { which } => match which {
            BenchCommand::Chain(args) => bench::chain::run(cli.device, &args),
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
