//! `cudagraph bench serve`: load on `cudagraph serve`, graph vs eager in one run.
//!
//! Starts the server in this process (on 127.0.0.1, an ephemeral port) once with graphs and
//! once eagerly (`--no-graph`), and drives each with N concurrent HTTP clients for a fixed
//! time. Each client sends requests whose row counts are drawn uniformly from
//! `--min-rows..=--max-rows`, picked from a set of request templates whose inputs were run
//! eagerly beforehand, and checks every answer against that eager result: relative L2 error
//! at most 1e-5 (fp32; a batch of a different size may take another GEMM tiling, so
//! bit-identity is not expected). Reports throughput and client-side p50/p95/p99 latency,
//! whether every request was answered exactly once (client counts against the server's), and
//! device memory at the start and end of the load.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use cudagraph::{BatchModel, Device, MemoryStats};
use cudagraph_nn::io::ModelDescription;
use cudagraph_nn::serving::percentile;
use cudagraph_nn::{load_model, Batched, Batcher, BatcherConfig, HostRng, ModelRunner, Sequential};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;

use crate::report::{device_report, DeviceReport};
use crate::serve::{start, Buckets, ServerOptions, DEFAULT_BODY_TIMEOUT};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Largest relative L2 error between a served answer and the eager reference.
pub const TOLERANCE: f64 = 1e-5;

/// A minimal HTTP/1.1 client on one kept-alive connection (hyper).
pub struct Client {
    sender: SendRequest<Full<Bytes>>,
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> std::io::Result<Client> {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(async move {
            // Ends when the server closes the connection; nothing to report.
            let _ = conn.await;
        });
        Ok(Client { sender })
    }

    async fn send(&mut self, req: Request<Full<Bytes>>) -> std::io::Result<Response<Bytes>> {
        self.sender.ready().await.map_err(std::io::Error::other)?;
        let resp = self
            .sender
            .send_request(req)
            .await
            .map_err(std::io::Error::other)?;
        let (head, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map_err(std::io::Error::other)?
            .to_bytes();
        Ok(Response::from_parts(head, body))
    }

    /// `POST path` with a JSON body: the whole response, headers included.
    pub async fn post_response(
        &mut self,
        path: &str,
        body: Bytes,
    ) -> std::io::Result<Response<Bytes>> {
        let req = Request::post(path)
            .header(hyper::header::HOST, "localhost")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(std::io::Error::other)?;
        self.send(req).await
    }

    /// `POST path` with a JSON body.
    pub async fn post(&mut self, path: &str, body: Bytes) -> std::io::Result<(StatusCode, Bytes)> {
        let resp = self.post_response(path, body).await?;
        Ok((resp.status(), resp.into_body()))
    }

    /// `GET path`.
    pub async fn get(&mut self, path: &str) -> std::io::Result<(StatusCode, Bytes)> {
        let req = Request::get(path)
            .header(hyper::header::HOST, "localhost")
            .body(Full::new(Bytes::new()))
            .map_err(std::io::Error::other)?;
        let resp = self.send(req).await?;
        Ok((resp.status(), resp.into_body()))
    }
}

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// A model to serve (see `cudagraph serve --model`); default: an MLP 64→256→256→256→256→10
    /// with seeded weights.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Concurrent clients (one kept-alive connection each).
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Seconds of load per mode.
    #[arg(long, default_value_t = 30.0)]
    pub duration_s: f64,
    /// Seconds of the same load before measuring, so the allocator's cache has seen the batch
    /// sizes dynamic batching forms (memory is then checked to stay flat).
    #[arg(long, default_value_t = 3.0)]
    pub warmup_s: f64,
    /// Smallest request, in rows.
    #[arg(long, default_value_t = 1)]
    pub min_rows: usize,
    /// Largest request, in rows (also the largest batch).
    #[arg(long, default_value_t = 256)]
    pub max_rows: usize,
    /// How long the first request of a batch waits for more, in microseconds.
    #[arg(long, default_value_t = 500)]
    pub max_wait_us: u64,
    /// Batch sizes that get a graph.
    #[arg(long, value_enum, default_value_t = Buckets::Steps8)]
    pub buckets: Buckets,
    /// Distinct request inputs (each checked against its eager result).
    #[arg(long, default_value_t = 512)]
    pub templates: usize,
    /// Run only this mode (`graph` or `eager`); default both.
    #[arg(long)]
    pub only: Option<String>,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The default model: five linear layers (launch-bound at small batches).
pub fn default_description() -> ModelDescription {
    ModelDescription::from_json(
        r#"{"input": [64], "layers": [
            {"linear": [64, 256]}, "relu", {"linear": [256, 256]}, "relu",
            {"linear": [256, 256]}, "relu", {"linear": [256, 256]}, "relu",
            {"linear": [256, 10]}]}"#,
    )
    .expect("the built-in description is valid")
}

struct Template {
    rows: usize,
    body: Bytes,
    expected: Vec<f32>,
}

#[derive(Default)]
struct ClientStats {
    sent: u64,
    ok: u64,
    rows: u64,
    http_errors: u64,
    transport_errors: u64,
    mismatches: u64,
    max_rel_err: f64,
    latencies_us: Vec<f64>,
    first_problem: Option<String>,
}

#[derive(Serialize, Clone, Copy, Default)]
struct Mem {
    allocated: usize,
    reserved: usize,
}

impl From<MemoryStats> for Mem {
    fn from(s: MemoryStats) -> Self {
        Mem {
            allocated: s.allocated,
            reserved: s.reserved,
        }
    }
}

#[derive(Serialize)]
struct ModeReport {
    mode: &'static str,
    seconds: f64,
    requests: u64,
    requests_per_s: f64,
    rows_per_s: f64,
    latency_p50_us: f64,
    latency_p95_us: f64,
    latency_p99_us: f64,
    latency_max_us: f64,
    server_requests: u64,
    server_batches: u64,
    mean_batch_rows: f64,
    padding_fraction: f64,
    http_errors: u64,
    transport_errors: u64,
    mismatches: u64,
    max_rel_err: f64,
    answered_exactly_once: bool,
    memory_start: Mem,
    memory_end: Mem,
    memory_flat: bool,
    graphs_captured: usize,
    first_problem: Option<String>,
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    device: DeviceReport,
    model: String,
    clients: usize,
    rows: (usize, usize),
    max_wait_us: u64,
    tolerance: f64,
    modes: Vec<ModeReport>,
    graph_vs_eager_throughput: Option<f64>,
    graph_vs_eager_p99: Option<f64>,
    passed: bool,
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        let (g, w) = (*g as f64, *w as f64);
        num += (g - w) * (g - w);
        den += w * w;
    }
    if !num.is_finite() {
        return f64::INFINITY;
    }
    (num / den.max(1e-30)).sqrt()
}

/// Request templates: inputs, their JSON bodies, and the eager result for each.
fn templates(
    dev: &Device,
    model: &Sequential,
    desc: &ModelDescription,
    a: &ServeBenchArgs,
) -> AnyResult<Vec<Template>> {
    let s = dev.new_stream()?;
    let batched = Batched {
        module: model.clone(),
        row_shape: desc.input().to_vec(),
        output_row: desc.output_row(),
    };
    let (irow, orow) = (desc.input_row(), desc.output_row());
    let mut rng = HostRng::new(a.seed);
    let span = (a.max_rows - a.min_rows + 1) as u64;
    let mut out = Vec::with_capacity(a.templates);
    for _ in 0..a.templates.max(1) {
        let rows = a.min_rows + (rng.next_u64() % span) as usize;
        let input = rng.vec_normal(rows * irow);
        let x = s.alloc_from_host(&input)?;
        let y = batched.forward(&s, &x, rows)?;
        let expected = s.to_vec(&y)?;
        let body_rows: Vec<&[f32]> = input.chunks(irow).collect();
        let body = serde_json::to_vec(&serde_json::json!({ "inputs": body_rows }))?;
        debug_assert_eq!(expected.len(), rows * orow);
        out.push(Template {
            rows,
            body: Bytes::from(body),
            expected,
        });
    }
    Ok(out)
}

async fn client_loop(
    addr: SocketAddr,
    templates: Arc<Vec<Template>>,
    until: Instant,
    seed: u64,
    orow: usize,
) -> ClientStats {
    let mut st = ClientStats::default();
    let mut rng = HostRng::new(seed);
    let mut client = match Client::connect(addr).await {
        Ok(c) => c,
        Err(e) => {
            st.transport_errors += 1;
            st.first_problem = Some(format!("connect: {e}"));
            return st;
        }
    };
    while Instant::now() < until {
        let t = &templates[(rng.next_u64() % templates.len() as u64) as usize];
        st.sent += 1;
        let t0 = Instant::now();
        let answer = client.post("/predict", t.body.clone()).await;
        let us = t0.elapsed().as_secs_f64() * 1e6;
        match answer {
            Ok((StatusCode::OK, body)) => {
                st.latencies_us.push(us);
                st.ok += 1;
                st.rows += t.rows as u64;
                let got: Option<Vec<f32>> = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| {
                        let rows = v.get("outputs")?.as_array()?.clone();
                        let mut flat = Vec::with_capacity(rows.len() * orow);
                        for r in rows {
                            for x in r.as_array()? {
                                flat.push(x.as_f64()? as f32);
                            }
                        }
                        Some(flat)
                    });
                let err = got.map_or(f64::INFINITY, |g| rel_err(&g, &t.expected));
                st.max_rel_err = st.max_rel_err.max(err);
                if err > TOLERANCE {
                    st.mismatches += 1;
                    st.first_problem.get_or_insert_with(|| {
                        format!("a {}-row answer differs from eager by {err:.3e}", t.rows)
                    });
                }
            }
            Ok((status, body)) => {
                st.http_errors += 1;
                st.first_problem.get_or_insert_with(|| {
                    format!("HTTP {status}: {}", String::from_utf8_lossy(&body))
                });
            }
            Err(e) => {
                st.transport_errors += 1;
                st.first_problem.get_or_insert_with(|| e.to_string());
                match Client::connect(addr).await {
                    Ok(c) => client = c,
                    Err(_) => break,
                }
            }
        }
    }
    st
}

async fn server_metrics(addr: SocketAddr) -> AnyResult<serde_json::Value> {
    let mut c = Client::connect(addr).await?;
    let (status, body) = c.get("/metrics").await?;
    if status != StatusCode::OK {
        return Err(format!("GET /metrics: {status}").into());
    }
    Ok(serde_json::from_slice(&body)?)
}

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v.get(k).and_then(|x| x.as_u64()).unwrap_or(0)
}

#[allow(clippy::too_many_arguments)]
async fn run_mode(
    mode: &'static str,
    dev: &Device,
    model: &Sequential,
    desc: &ModelDescription,
    templates: Arc<Vec<Template>>,
    a: &ServeBenchArgs,
) -> AnyResult<ModeReport> {
    let graphs = mode == "graph";
    let runner = {
        let (dev, model, desc) = (dev.clone(), model.clone(), desc.clone());
        let policy = graphs.then(|| a.buckets.policy(a.max_rows));
        tokio::task::spawn_blocking(move || {
            ModelRunner::new(
                dev.new_stream()?,
                model,
                desc.input().to_vec(),
                desc.output_row(),
                policy,
            )
        })
        .await??
    };
    let captured = runner.cache().map(|c| c.entries().len()).unwrap_or(0);
    let batcher = Arc::new(Batcher::start(
        runner,
        BatcherConfig {
            max_batch_rows: a.max_rows,
            max_wait: Duration::from_micros(a.max_wait_us),
            queue_capacity: a.clients.max(1) * 4,
        },
    )?);
    let opts = ServerOptions {
        allow_shutdown: false,
        ctrl_c: false,
        model: "bench".into(),
        graphs,
        // Each client has one request in flight; room for a reconnecting client's old one.
        max_in_flight: a.clients.max(1) * 2,
        body_timeout: DEFAULT_BODY_TIMEOUT,
    };
    let server = start(batcher, "127.0.0.1:0".parse()?, opts).await?;
    let addr = server.addr;
    let orow = desc.output_row();
    // Warm-up: every template once, so the allocator has seen every size before measuring.
    {
        let mut warm = Vec::new();
        let per = templates.len().div_ceil(a.clients.max(1));
        for c in 0..a.clients.max(1) {
            let t = templates.clone();
            warm.push(tokio::spawn(async move {
                let mut client = Client::connect(addr).await?;
                for i in (c * per)..((c + 1) * per).min(t.len()) {
                    client.post("/predict", t[i].body.clone()).await?;
                }
                Ok::<_, std::io::Error>(())
            }));
        }
        for w in warm {
            w.await??;
        }
        // Then the measured load pattern itself, unmeasured.
        let until = Instant::now() + Duration::from_secs_f64(a.warmup_s.max(0.0));
        let tasks: Vec<_> = (0..a.clients.max(1))
            .map(|i| {
                tokio::spawn(client_loop(
                    addr,
                    templates.clone(),
                    until,
                    a.seed ^ 0x5eed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9),
                    orow,
                ))
            })
            .collect();
        for t in tasks {
            t.await?;
        }
    }
    let before = server_metrics(addr).await?;
    let memory_start = Mem::from(dev.memory_stats());
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs_f64(a.duration_s);
    let tasks: Vec<_> = (0..a.clients.max(1))
        .map(|i| {
            tokio::spawn(client_loop(
                addr,
                templates.clone(),
                until,
                a.seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9),
                orow,
            ))
        })
        .collect();
    let mut all = ClientStats::default();
    for t in tasks {
        let s = t.await?;
        all.sent += s.sent;
        all.ok += s.ok;
        all.rows += s.rows;
        all.http_errors += s.http_errors;
        all.transport_errors += s.transport_errors;
        all.mismatches += s.mismatches;
        all.max_rel_err = all.max_rel_err.max(s.max_rel_err);
        all.latencies_us.extend(s.latencies_us);
        if all.first_problem.is_none() {
            all.first_problem = s.first_problem;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let after = server_metrics(addr).await?;
    let memory_end = Mem::from(dev.memory_stats());
    server.stop();
    server.wait().await?;
    all.latencies_us.sort_by(f64::total_cmp);
    let server_requests = u(&after, "requests") - u(&before, "requests");
    let server_batches = u(&after, "batches") - u(&before, "batches");
    let server_rows = u(&after, "rows") - u(&before, "rows");
    let server_padded = u(&after, "padded_rows") - u(&before, "padded_rows");
    Ok(ModeReport {
        mode,
        seconds,
        requests: all.ok,
        requests_per_s: all.ok as f64 / seconds,
        rows_per_s: all.rows as f64 / seconds,
        latency_p50_us: percentile(&all.latencies_us, 0.50),
        latency_p95_us: percentile(&all.latencies_us, 0.95),
        latency_p99_us: percentile(&all.latencies_us, 0.99),
        latency_max_us: all.latencies_us.last().copied().unwrap_or(0.0),
        server_requests,
        server_batches,
        mean_batch_rows: server_rows as f64 / server_batches.max(1) as f64,
        padding_fraction: server_padded as f64 / (server_rows + server_padded).max(1) as f64,
        http_errors: all.http_errors,
        transport_errors: all.transport_errors,
        mismatches: all.mismatches,
        max_rel_err: all.max_rel_err,
        answered_exactly_once: all.sent == all.ok && server_requests == all.ok,
        memory_start,
        memory_end,
        memory_flat: memory_end.allocated == memory_start.allocated
            && memory_end.reserved <= memory_start.reserved + (2 << 20),
        graphs_captured: captured,
        first_problem: all.first_problem,
    })
}

pub fn run(ordinal: usize, a: &ServeBenchArgs) -> AnyResult<()> {
    if a.min_rows == 0 || a.min_rows > a.max_rows {
        return Err(format!(
            "--min-rows {} and --max-rows {} must satisfy 1 <= min <= max",
            a.min_rows, a.max_rows
        )
        .into());
    }
    let modes: Vec<&'static str> = match a.only.as_deref() {
        None => vec!["graph", "eager"],
        Some("graph") => vec!["graph"],
        Some("eager") => vec!["eager"],
        Some(other) => return Err(format!("--only {other}: use graph or eager").into()),
    };
    let dev = Device::open(ordinal)?;
    let s = dev.new_stream()?;
    let (desc, model, model_name) = match &a.model {
        Some(p) => {
            let (d, m) = load_model(&s, p)?;
            (d, m, p.display().to_string())
        }
        None => {
            let d = default_description();
            let m = d.init(&s, &mut HostRng::new(a.seed))?;
            (d, m, "built-in MLP 64-256-256-256-256-10".to_string())
        }
    };
    s.synchronize()?;
    let templates = Arc::new(templates(&dev, &model, &desc, a)?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut reports = Vec::new();
    for mode in modes {
        let r = rt.block_on(run_mode(mode, &dev, &model, &desc, templates.clone(), a))?;
        reports.push(r);
    }
    let find = |m: &str| reports.iter().find(|r| r.mode == m);
    let (tp, p99) = match (find("graph"), find("eager")) {
        (Some(g), Some(e)) => (
            Some(g.requests_per_s / e.requests_per_s.max(1e-9)),
            Some(g.latency_p99_us / e.latency_p99_us.max(1e-9)),
        ),
        _ => (None, None),
    };
    let passed = reports.iter().all(|r| {
        r.answered_exactly_once
            && r.mismatches == 0
            && r.http_errors == 0
            && r.transport_errors == 0
            && r.memory_flat
    });
    let report = Report {
        benchmark: "serve",
        device: device_report(&dev)?,
        model: model_name,
        clients: a.clients,
        rows: (a.min_rows, a.max_rows),
        max_wait_us: a.max_wait_us,
        tolerance: TOLERANCE,
        modes: reports,
        graph_vs_eager_throughput: tp,
        graph_vs_eager_p99: p99,
        passed,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    if !passed {
        return Err("bench serve: some check failed (see the table)".into());
    }
    Ok(())
}

fn print_table(r: &Report) {
    const MIB: f64 = 1048576.0;
    outln!(
        "bench serve on {} — {}; {} clients, requests of {}-{} rows, max wait {} us",
        r.device.name,
        r.model,
        r.clients,
        r.rows.0,
        r.rows.1,
        r.max_wait_us
    );
    outln!(
        "| mode | requests | req/s | rows/s | p50 us | p95 us | p99 us | max us | rows/batch | padding | errors | mismatches (max rel err) | exactly once | memory alloc start→end MiB | reserved start→end MiB |"
    );
    outln!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|");
    for m in &r.modes {
        outln!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1}% | {} | {} ({:.1e}) | {} | {:.2}→{:.2} | {:.2}→{:.2}{} |",
            if m.graphs_captured > 0 {
                format!("graph ({} sizes)", m.graphs_captured)
            } else {
                m.mode.to_string()
            },
            m.requests,
            m.requests_per_s,
            m.rows_per_s,
            m.latency_p50_us,
            m.latency_p95_us,
            m.latency_p99_us,
            m.latency_max_us,
            m.mean_batch_rows,
            100.0 * m.padding_fraction,
            m.http_errors + m.transport_errors,
            m.mismatches,
            m.max_rel_err,
            if m.answered_exactly_once { "yes" } else { "NO" },
            m.memory_start.allocated as f64 / MIB,
            m.memory_end.allocated as f64 / MIB,
            m.memory_start.reserved as f64 / MIB,
            m.memory_end.reserved as f64 / MIB,
            if m.memory_flat { "" } else { " (NOT flat)" }
        );
        if let Some(p) = &m.first_problem {
            outln!("  {}: first problem: {p}", m.mode);
        }
    }
    if let (Some(tp), Some(p99)) = (r.graph_vs_eager_throughput, r.graph_vs_eager_p99) {
        outln!(
            "graph vs eager: throughput {tp:.2}x, p99 latency {p99:.2}x ({})",
            if tp > 1.0 && p99 < 1.0 {
                "graph better on both"
            } else {
                "graph NOT better on both"
            }
        );
    }
    outln!(
        "checks (every request answered exactly once and within {:.0e} of eager, no errors, memory flat): {}",
        r.tolerance,
        if r.passed { "passed" } else { "FAILED" }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_is_a_norm_ratio() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(
            (rel_err(&[3.0, 4.0], &[3.0, 4.5]) - 0.5 / (3f64 * 3.0 + 4.5 * 4.5).sqrt()).abs()
                < 1e-12
        );
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[f32::NAN], &[1.0]), f64::INFINITY);
    }

    #[test]
    fn the_default_model_is_launch_bound_and_valid() {
        let d = default_description();
        assert_eq!((d.input_row(), d.output_row()), (64, 10));
        assert_eq!(d.parameters().len(), 10);
    }
}
