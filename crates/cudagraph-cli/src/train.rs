//! `cudagraph train [--graph]`: seed 000's training run on a real dataset (the UCI handwritten
//! digits shipped with cudagraph-nn), eager or with the whole step in one CUDA graph, logging
//! memory per phase and every `--log-every` steps in the seed's format, with a progress bar.
//!
//! `--steps-per-launch K` keeps the epoch's data on the device and captures a WHILE node that
//! runs up to K steps per graph launch, each loading its batch with a kernel (a device-side
//! cursor picks it). `--skip-nonfinite` wraps the optimizer step in an IF node taken only when
//! the loss and every gradient are finite (GradScaler's check, without a host read).
//!
//! Data-parallel: `--nproc N` starts N processes (one per GPU, as `cudagraph launch` does);
//! a process started by a launcher (`RANK`/`WORLD_SIZE` set) trains its shard of every batch
//! with `DistributedDataParallel`, the all-reduces inside the graph with `--graph`.

use std::sync::Arc;
use std::time::Instant;

use clap::{Args, ValueEnum};
use cudagraph::memory::{format_memory_full, format_memory_line};
use cudagraph::Fork;
use cudagraph::{CaptureOptions, Device, Graph, Queue, QueueExt};
use cudagraph_nn::dist::{DistEnv, DistOptions};
use cudagraph_nn::io::datasets::{digits, permutation, Dataset};
use cudagraph_nn::{
    autocast, cross_entropy, no_grad, step_if_finite, Adam, Conv2d, DeviceBatches, Dtype,
    GradScaler, GradScalerConfig, HostRng, Layer, Linear, NnModule, Optimizer, Sequential, Tensor,
};
use cudagraph_nn::{Communicator, DdpOptions, DistributedDataParallel};
use indicatif::{ProgressBar, ProgressStyle};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ModelKind {
    /// Conv(1→16, 3×3) → ReLU → MaxPool 2 → Linear(256→64) → ReLU → Linear(64→10).
    Cnn,
    /// Linear(64→128) → ReLU → Linear(128→10).
    Mlp,
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Capture the whole training step (forward, backward, Adam step) into one CUDA graph.
    #[arg(long)]
    pub graph: bool,
    #[arg(long, value_enum, default_value_t = ModelKind::Cnn)]
    pub model: ModelKind,
    #[arg(long, default_value_t = 30)]
    pub epochs: usize,
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f32,
    /// Log loss and memory every this many steps.
    #[arg(long, default_value_t = 50)]
    pub log_every: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Element type of the products and convolutions: `f32`, or `bf16` / `f16` (forward pass
    /// and loss inside `autocast`; parameters and optimizer state stay f32).
    #[arg(long, default_value = "f32")]
    pub dtype: Dtype,
    /// Element type the parameters are stored in: `f32` (the default), or `bf16` for pure
    /// bf16 training (PyTorch's `model.to(torch.bfloat16)`: no f32 masters, Adam's moments
    /// in f32, each new parameter rounded once). Needs `--dtype bf16`; one GPU.
    #[arg(long, default_value = "f32")]
    pub params: Dtype,
    /// Run up to K training steps per graph launch (implies --graph): the epoch's data stays
    /// on the device and a WHILE node loops over the steps, loading each batch with a kernel.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..))]
    pub steps_per_launch: Option<u32>,
    /// In the captured step, skip the optimizer step (an IF node) when the loss or a gradient
    /// is not finite.
    #[arg(long)]
    pub skip_nonfinite: bool,
    /// Train data-parallel on this many GPUs of this machine (one process each, as
    /// `cudagraph launch --nproc N -- cudagraph train ...`). `--batch-size` is per GPU.
    #[arg(long, default_value_t = 0)]
    pub nproc: usize,
    /// Testing aid: the rank that fails at `--fail-at-step` (see `--fail-mode`).
    #[arg(long, hide = true)]
    pub fail_rank: Option<usize>,
    #[arg(long, hide = true, default_value_t = 20)]
    pub fail_at_step: usize,
    #[arg(long, hide = true, value_enum, default_value_t = FailMode::Exit)]
    pub fail_mode: FailMode,
}

/// How `--fail-rank` fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FailMode {
    /// The process exits at once (status 3), as if it crashed.
    Exit,
    /// The process stops making progress but stays alive (a stalled rank).
    Hang,
}

fn build(
    s: &cudagraph::Stream,
    kind: ModelKind,
    rng: &mut HostRng,
) -> cudagraph_nn::Result<Sequential> {
    Ok(match kind {
        ModelKind::Cnn => Sequential::new(vec![
            Layer::Conv2d(Conv2d::new(s, 1, 16, 3, 1, 1, rng)?),
            Layer::ReLU,
            Layer::MaxPool2d {
                kernel: 2,
                stride: 2,
            },
            Layer::Flatten,
            Layer::Linear(Linear::new(s, 256, 64, rng)?),
            Layer::ReLU,
            Layer::Linear(Linear::new(s, 64, 10, rng)?),
        ]),
        ModelKind::Mlp => Sequential::new(vec![
            Layer::Linear(Linear::new(s, 64, 128, rng)?),
            Layer::ReLU,
            Layer::Linear(Linear::new(s, 128, 10, rng)?),
        ]),
    })
}

fn input_shape(kind: ModelKind, b: usize) -> Vec<usize> {
    match kind {
        ModelKind::Cnn => vec![b, 1, 8, 8],
        ModelKind::Mlp => vec![b, 64],
    }
}

fn accuracy(
    s: &cudagraph::Stream,
    model: &Sequential,
    kind: ModelKind,
    test: &Dataset,
    dtype: Dtype,
) -> AnyResult<(usize, usize)> {
    let x = Tensor::from_host(s, &test.images, &input_shape(kind, test.len()))?;
    let logits = no_grad(|| autocast(dtype, || model.forward(s, &x)))?.to_vec(s)?;
    let correct = logits
        .chunks(test.classes)
        .zip(&test.labels)
        .filter(|(row, &label)| {
            let arg = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i)
                .unwrap_or(0);
            arg as i32 == label
        })
        .count();
    Ok((correct, test.len()))
}

/// `--params`: f32, or bf16 with `--dtype bf16` on one GPU without `--skip-nonfinite`.
fn check_params(a: &TrainArgs) -> AnyResult<()> {
    match a.params {
        Dtype::F32 => Ok(()),
        Dtype::F16 => Err(
            "--params f16 is not offered: pure f16 needs a loss scaler, which \
                           works on f32 masters; use --dtype f16 (f32 parameters, the scaler)"
                .into(),
        ),
        Dtype::Bf16 if a.dtype != Dtype::Bf16 => Err(
            "--params bf16 needs --dtype bf16 (the f32 images are cast in the forward pass)".into(),
        ),
        Dtype::Bf16 if a.skip_nonfinite => Err("--params bf16 does not take --skip-nonfinite \
             (its finiteness check reads f32 gradients)"
            .into()),
        Dtype::Bf16 if a.nproc > 0 => {
            Err("--params bf16 trains on one GPU (data-parallel reduction is f32)".into())
        }
        Dtype::Bf16 => Ok(()),
    }
}

pub fn run(ordinal: usize, a: &TrainArgs) -> AnyResult<()> {
    if a.batch_size == 0 || a.log_every == 0 {
        return Err("--batch-size and --log-every must be at least 1".into());
    }
    if a.skip_nonfinite && a.dtype == Dtype::F16 {
        return Err(
            "--dtype f16 trains with a loss scaler, which already skips steps with \
                    inf or NaN gradients: leave out --skip-nonfinite"
                .into(),
        );
    }
    check_params(a)?;
    if a.nproc > 0 {
        return launch_ranks(a);
    }
    if let Some(env) = DistEnv::from_env()? {
        return run_distributed(&env, a);
    }
    let graphed = a.graph || a.steps_per_launch.is_some();
    let mode = match a.steps_per_launch {
        Some(_) => "cudagraph-loop",
        None if a.graph => "cudagraph",
        None => "basic",
    };
    outln!(
        "#### {mode} ({:?} on UCI digits, {}, batch {}, Adam lr {})",
        a.model,
        match (a.dtype, a.params) {
            (Dtype::F32, _) => "f32".to_string(),
            (d, Dtype::F32) => format!("{d} autocast"),
            (d, p) => format!("{d} autocast, {p} parameters"),
        },
        a.batch_size,
        a.lr
    );
    let data = digits()?;
    let (train, test) = data.split(0.2, a.seed);
    let dev = Device::open(ordinal)?;
    let mut s = dev.new_stream()?;
    outln!("- dataloader {}", format_memory_line(&dev.memory_stats()));
    let mut rng = HostRng::new(a.seed + 1);
    let mut model = build(&s, a.model, &mut rng)?;
    // Pure bf16: the parameters are stored in bf16 before the optimizer takes them.
    model.to_dtype(&s, a.params)?;
    let mut opt = Adam::new(&s, model.parameters(), a.lr, 0.0, false)?;
    outln!("- model ready {}", format_memory_line(&dev.memory_stats()));
    let b = a.batch_size;
    let steps_per_epoch = train.len() / b;
    if steps_per_epoch == 0 {
        return Err(format!(
            "--batch-size {b} is larger than the {} training images",
            train.len()
        )
        .into());
    }
    // Static input and target buffers: each step copies its batch into them.
    let before = dev.memory_stats().allocated;
    outln!(
        "- before static input {}",
        format_memory_line(&dev.memory_stats())
    );
    let x_static = s.alloc_zeroed::<f32>(b * 64)?;
    let y_static = Arc::new(s.alloc_zeroed::<i32>(b)?);
    let x = Tensor::from_buffer(Arc::new(x_static.alias()), &input_shape(a.model, b))?;
    outln!("- static input {}", format_memory_line(&dev.memory_stats()));
    outln!(
        "- static input allocated delta {:.4} MB",
        (dev.memory_stats().allocated - before) as f64 / 1048576.0
    );
    // f16 trains with a loss scaler (f16's range ends at 65504; bf16 and f32 need none): the
    // scale, the inf check and the skipped steps all on the device.
    let scaler = GradScaler::new(
        &s,
        GradScalerConfig {
            enabled: a.dtype == Dtype::F16,
            ..GradScalerConfig::default()
        },
    )?;
    let scaler = std::cell::RefCell::new(scaler);
    let step = |q: &dyn Queue, opt: &mut Adam| -> cudagraph_nn::Result<Tensor> {
        opt.zero_grad(q, true)?;
        let loss = autocast(a.dtype, || {
            cross_entropy(q, &model.forward(q, &x)?, &y_static)
        })?;
        let mut scaler = scaler.borrow_mut();
        scaler.scale(q, &loss)?.backward(q)?;
        scaler.step(q, opt)?;
        scaler.update(q)?;
        Ok(loss)
    };
    // Warm-up: three steps on the first batch, on a side stream (seed 001), in both modes, so
    // eager and graphed runs train along the same trajectory.
    QueueExt::copy_range(
        &s,
        &s.alloc_from_host(&train.images[..b * 64])?,
        0,
        &x_static,
        0,
        b * 64,
    )?;
    QueueExt::copy_range(
        &s,
        &s.alloc_from_host(&train.labels[..b])?,
        0,
        &y_static,
        0,
        b,
    )?;
    let side = dev.new_stream()?;
    cudagraph::warmup(&s, &side, 3, |q| {
        step(q, &mut opt).map(|_| ()).map_err(Into::into)
    })?;
    s.synchronize()?;
    outln!("- warm-up done {}", format_memory_line(&dev.memory_stats()));
    // The captured step: with --skip-nonfinite the optimizer step sits in an IF node.
    let graph_step =
        |cs: &cudagraph::CaptureStream<'_>, opt: &mut Adam| -> cudagraph_nn::Result<Tensor> {
            if !a.skip_nonfinite {
                return step(cs, opt);
            }
            opt.zero_grad(cs, true)?;
            let loss = autocast(a.dtype, || {
                cross_entropy(cs, &model.forward(cs, &x)?, &y_static)
            })?;
            loss.backward(cs)?;
            step_if_finite(cs, opt, &loss)?;
            Ok(loss)
        };
    // With --steps-per-launch: the epoch's data on the device, batches picked by a kernel.
    let resident = match a.steps_per_launch {
        Some(_) => Some(DeviceBatches::new(&s, &train.images, &train.labels, 64, b)?),
        None => None,
    };
    let graph = if graphed {
        let t = Instant::now();
        let mut loss_holder = None;
        let (g, loss) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
            Ok(match (&resident, a.steps_per_launch) {
                (Some(r), Some(k)) => r.train_steps(cs, k, &x_static, &y_static, |body| {
                    graph_step(body, &mut opt)
                })?,
                _ => graph_step(cs, &mut opt)?,
            })
        })?;
        loss_holder.replace(loss);
        outln!(
            "- **graph capture** done in {:.1} ms ({} nodes) {}",
            t.elapsed().as_secs_f64() * 1e3,
            g.node_count(),
            format_memory_line(&dev.memory_stats())
        );
        Some((g, loss_holder.expect("set above")))
    } else {
        None
    };
    outln!("- training {}", format_memory_full(&dev.memory_stats()));

    let total_steps = steps_per_epoch * a.epochs;
    let pb = ProgressBar::new(total_steps as u64);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg} [{elapsed}<{eta}]")
            .expect("valid template"),
    );
    let mut global = 0usize;
    let mut last_loss = f32::NAN;
    let t_train = Instant::now();
    for epoch in 1..=a.epochs {
        pb.println(format!("Epoch {epoch}/{}\n---", a.epochs));
        // Shuffle on the host, upload the epoch's order once; batches are contiguous slices.
        let order = permutation(train.len(), a.seed * 1000 + epoch as u64);
        let ep = train.select(&order);
        if let (Some(r), Some(k), Some((g, loss))) = (&resident, a.steps_per_launch, &graph) {
            // K steps per launch from the resident epoch: one upload per epoch, no per-step
            // host work.
            r.reload(&s, &ep.images, &ep.labels)?;
            let mut done = 0;
            while done < r.batches() {
                g.replay(&s)?;
                let n = (k as usize).min(r.batches() - done);
                done += n;
                let before = global;
                global += n;
                pb.inc(n as u64);
                if global / a.log_every > before / a.log_every {
                    last_loss = loss.to_vec(&s)?[0];
                    pb.set_message(format!("loss {last_loss:.4}"));
                    pb.println(format!(
                        "Training {epoch}/{}, step {global}, Loss:{last_loss:.4}, {}",
                        a.epochs,
                        format_memory_line(&dev.memory_stats())
                    ));
                }
            }
            continue;
        }
        let xs = s.alloc_from_host(&ep.images)?;
        let ys = s.alloc_from_host(&ep.labels)?;
        for i in 0..steps_per_epoch {
            QueueExt::copy_range(&s, &xs, i * b * 64, &x_static, 0, b * 64)?;
            QueueExt::copy_range(&s, &ys, i * b, &y_static, 0, b)?;
            let loss = match &graph {
                Some((g, loss)) => {
                    g.replay(&s)?;
                    loss.clone()
                }
                None => step(&s, &mut opt)?,
            };
            global += 1;
            pb.inc(1);
            if global % a.log_every == 0 {
                last_loss = loss.to_vec(&s)?[0];
                pb.set_message(format!("loss {last_loss:.4}"));
                pb.println(format!(
                    "Training {epoch}/{}, step {global}, Loss:{last_loss:.4}, {}",
                    a.epochs,
                    format_memory_line(&dev.memory_stats())
                ));
            }
        }
    }
    s.synchronize()?;
    let secs = t_train.elapsed().as_secs_f64();
    pb.finish_and_clear();
    outln!("training {}", format_memory_full(&dev.memory_stats()));
    if last_loss.is_nan() {
        if let Some((_, loss)) = &graph {
            last_loss = loss.to_vec(&s)?[0];
        }
    }
    let (correct, n) = accuracy(&s, &model, a.model, &test, a.dtype)?;
    outln!(
        "{mode}: {total_steps} steps in {:.3} s ({:.1} us/step, data copies included), last logged loss {last_loss:.4}",
        secs,
        secs * 1e6 / total_steps as f64
    );
    outln!(
        "test accuracy: {:.2}% ({correct}/{n})",
        100.0 * correct as f64 / n as f64
    );
    outln!(
        "throughput: {:.0} steps/s ({})",
        total_steps as f64 / secs,
        match a.steps_per_launch {
            Some(k) => format!("up to {k} steps per graph launch, batches loaded on the device"),
            None if a.graph => "1 step per graph launch, batches copied by the host".into(),
            None => "eager".into(),
        }
    );
    Ok(())
}

/// `--nproc N`: this command again, once per GPU, under the launcher.
fn launch_ranks(a: &TrainArgs) -> AnyResult<()> {
    let exe = std::env::current_exe()?;
    let model = a
        .model
        .to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_else(|| "cnn".into());
    let mut command: Vec<std::ffi::OsString> = vec![exe.into(), "train".into()];
    let mut push = |k: &str, v: String| {
        command.push(k.into());
        command.push(v.into());
    };
    push("--model", model);
    push("--epochs", a.epochs.to_string());
    push("--batch-size", a.batch_size.to_string());
    push("--lr", a.lr.to_string());
    push("--log-every", a.log_every.to_string());
    push("--seed", a.seed.to_string());
    if let Some(r) = a.fail_rank {
        push("--fail-rank", r.to_string());
        push("--fail-at-step", a.fail_at_step.to_string());
        let mode = match a.fail_mode {
            FailMode::Exit => "exit",
            FailMode::Hang => "hang",
        };
        push("--fail-mode", mode.to_string());
    }
    if a.graph {
        command.push("--graph".into());
    }
    let args = crate::launch::LaunchArgs {
        nproc: a.nproc,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        command,
    };
    let out = crate::launch::launch(&args, crate::launch::print_sink())?;
    match out.failure {
        None => Ok(()),
        Some((rank, how)) => Err(format!("rank {rank} {how}; the job failed").into()),
    }
}

/// One rank of a data-parallel run. On any error the communicator is aborted (the other ranks
/// hear of it at once) and the process exits without tearing the device down: work queued on
/// it may wait for a lost peer.
fn run_distributed(env: &DistEnv, a: &TrainArgs) -> AnyResult<()> {
    let dev = Device::open(env.local_rank)?;
    let comm = Communicator::init(&dev, env, &DistOptions::from_env()?)?;
    match train_rank(&dev, &comm, env, a) {
        Ok(()) => Ok(()),
        Err(e) => {
            let msg = e.to_string();
            comm.abort(&msg);
            eprintln!("error: rank {}: {msg}", env.rank);
            std::process::exit(1);
        }
    }
}

/// Order-sensitive checksum of every parameter's bits.
fn checksum(s: &cudagraph::Stream, model: &Sequential) -> AnyResult<i64> {
    let mut h: u64 = 0;
    for p in model.parameters() {
        for v in p.to_vec(s)? {
            h = h
                .wrapping_mul(0x100_0000_01b3)
                .wrapping_add(v.to_bits() as u64);
        }
    }
    Ok((h & i64::MAX as u64) as i64)
}

fn train_rank(dev: &Device, comm: &Communicator, env: &DistEnv, a: &TrainArgs) -> AnyResult<()> {
    let (rank, world) = (env.rank, env.world_size);
    let lead = rank == 0;
    let mode = if a.graph { "cudagraph" } else { "basic" };
    if lead {
        outln!(
            "#### {mode} DDP x{world} ({:?} on UCI digits, batch {} per GPU = {} per step, Adam lr {})",
            a.model,
            a.batch_size,
            a.batch_size * world,
            a.lr
        );
    }
    outln!(
        "rank {rank}/{world}: {} (device {}), NCCL {}",
        dev.info().name,
        dev.ordinal(),
        cudagraph_nn::dist::nccl_version()?
    );
    let data = digits()?;
    let (train, test) = data.split(0.2, a.seed);
    let mut s = dev.new_stream()?;
    let mut rng = HostRng::new(a.seed + 1);
    let model = build(&s, a.model, &mut rng)?;
    let mut ddp =
        DistributedDataParallel::new(&s, comm, model.parameters(), DdpOptions::default())?;
    let mut opt = Adam::new(&s, model.parameters(), a.lr, 0.0, false)?;
    let b = a.batch_size;
    let global = b * world;
    let steps_per_epoch = train.len() / global;
    if steps_per_epoch == 0 {
        return Err(format!(
            "--batch-size {b} on {world} GPUs is larger than the {} training images",
            train.len()
        )
        .into());
    }
    if lead {
        outln!(
            "- model ready, {} buckets {}",
            ddp.buckets().len(),
            format_memory_line(&dev.memory_stats())
        );
    }
    let x_static = s.alloc_zeroed::<f32>(b * 64)?;
    let y_static = Arc::new(s.alloc_zeroed::<i32>(b)?);
    let x = Tensor::from_buffer(Arc::new(x_static.alias()), &input_shape(a.model, b))?;
    let step = |q: &dyn Fork,
                opt: &mut Adam,
                ddp: &mut DistributedDataParallel|
     -> cudagraph_nn::Result<Tensor> {
        opt.zero_grad(q.as_queue(), true)?;
        let logits = model.forward(q.as_queue(), &x)?;
        let loss = cross_entropy(q.as_queue(), &logits, &y_static)?;
        ddp.backward(q, &loss)?;
        opt.step(q.as_queue())?;
        Ok(loss)
    };
    // This rank's rows of global batch `i` of an epoch's data on the device.
    let load = |s: &cudagraph::Stream,
                xs: &cudagraph::DeviceBuffer<f32>,
                ys: &cudagraph::DeviceBuffer<i32>,
                i: usize|
     -> AnyResult<()> {
        let row = i * global + rank * b;
        QueueExt::copy_range(s, xs, row * 64, &x_static, 0, b * 64)?;
        QueueExt::copy_range(s, ys, row, &y_static, 0, b)?;
        Ok(())
    };
    // Warm-up on a side stream (the first global batch), as in the one-GPU run.
    {
        let xs = s.alloc_from_host(&train.images[..global * 64])?;
        let ys = s.alloc_from_host(&train.labels[..global])?;
        load(&s, &xs, &ys, 0)?;
        let side = dev.new_stream()?;
        cudagraph::warmup(&s, &side, 3, |q| {
            step(q, &mut opt, &mut ddp).map(|_| ()).map_err(Into::into)
        })?;
        ddp.synchronize(&s)?;
    }
    let graph = if a.graph {
        let t = Instant::now();
        let (g, loss) = Graph::capture(&mut s, CaptureOptions::new().upload(true), |cs| {
            Ok(step(cs, &mut opt, &mut ddp)?)
        })?;
        if lead {
            outln!(
                "- **graph capture** done in {:.1} ms ({} nodes, all-reduces included) {}",
                t.elapsed().as_secs_f64() * 1e3,
                g.node_count(),
                format_memory_line(&dev.memory_stats())
            );
        }
        Some((g, loss))
    } else {
        None
    };
    let total_steps = steps_per_epoch * a.epochs;
    let mut global_step = 0usize;
    let mut last_loss = f32::NAN;
    ddp.synchronize(&s)?;
    let t_train = Instant::now();
    for epoch in 1..=a.epochs {
        // Uploading from pageable host memory waits for the stream: wait through the
        // watchdog first, so a lost peer is an error here rather than a hang in the copy.
        ddp.synchronize(&s)?;
        // The same shuffle on every rank (same seed): each takes its rows of each batch.
        let order = permutation(train.len(), a.seed * 1000 + epoch as u64);
        let ep = train.select(&order);
        let xs = s.alloc_from_host(&ep.images)?;
        let ys = s.alloc_from_host(&ep.labels)?;
        for i in 0..steps_per_epoch {
            load(&s, &xs, &ys, i)?;
            let loss = match &graph {
                Some((g, loss)) => {
                    g.replay(&s)?;
                    loss.clone()
                }
                None => step(&s, &mut opt, &mut ddp)?,
            };
            global_step += 1;
            if a.fail_rank == Some(rank) && global_step == a.fail_at_step {
                match a.fail_mode {
                    FailMode::Exit => {
                        eprintln!("rank {rank}: injected failure: exiting at step {global_step}");
                        std::process::exit(3);
                    }
                    FailMode::Hang => {
                        eprintln!("rank {rank}: injected failure: hanging at step {global_step}");
                        loop {
                            std::thread::sleep(std::time::Duration::from_secs(3600));
                        }
                    }
                }
            }
            if global_step % a.log_every == 0 {
                // The watchdog wait: a lost or stalled peer is an error here, not a hang.
                ddp.synchronize(&s)?;
                last_loss = loss.to_vec(&s)?[0];
                if lead {
                    outln!(
                        "Training {epoch}/{}, step {global_step}/{total_steps}, Loss:{last_loss:.4}, {}",
                        a.epochs,
                        format_memory_line(&dev.memory_stats())
                    );
                }
            }
        }
    }
    ddp.synchronize(&s)?;
    let secs = t_train.elapsed().as_secs_f64();
    // Every rank must hold the same weights: compare checksums over the communicator.
    let sum = checksum(&s, &model)?;
    let same = comm.all_agree(&s, &[sum])?;
    let (correct, n) = accuracy(&s, &model, a.model, &test, a.dtype)?;
    outln!(
        "rank {rank}: {mode} DDP x{world}: {total_steps} steps in {secs:.3} s ({:.1} us/step, {:.0} images/s, data copies included), last logged loss {last_loss:.4}, test accuracy {:.2}% ({correct}/{n}), parameters identical on all ranks: {}",
        secs * 1e6 / total_steps as f64,
        (total_steps * global) as f64 / secs,
        100.0 * correct as f64 / n as f64,
        if same { "yes" } else { "NO" }
    );
    if !same {
        return Err("the ranks' parameters differ after training".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainArgs,
    }

    fn check(args: &[&str]) -> Result<(), String> {
        let cli = Cli::try_parse_from(std::iter::once("train").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        check_params(&cli.args).map_err(|e| e.to_string())
    }

    #[test]
    fn params_bf16_needs_dtype_bf16_one_gpu_and_no_skip_nonfinite() {
        check(&[]).unwrap();
        check(&["--params", "bf16", "--dtype", "bf16", "--graph"]).unwrap();
        let e = check(&["--params", "bf16"]).unwrap_err();
        assert!(e.contains("--dtype bf16"), "{e}");
        let e = check(&["--params", "f16", "--dtype", "f16"]).unwrap_err();
        assert!(e.contains("loss scaler"), "{e}");
        let e = check(&["--params", "bf16", "--dtype", "bf16", "--skip-nonfinite"]).unwrap_err();
        assert!(e.contains("--skip-nonfinite"), "{e}");
        let e = check(&["--params", "bf16", "--dtype", "bf16", "--nproc", "2"]).unwrap_err();
        assert!(e.contains("one GPU"), "{e}");
        assert!(check(&["--params", "f64"]).is_err());
    }
}
