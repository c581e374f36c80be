//! `cudagraph serve`: a model from safetensors weights and a JSON description, behind HTTP.
//!
//! The HTTP layer only: it parses requests, hands their rows to a [`Batcher`] (which owns the
//! model on its worker thread and batches concurrent requests dynamically), and turns answers
//! and errors into responses. Endpoints:
//!
//! - `POST /predict` — `{"inputs": [[...], ...]}` (rows of the model's input width) →
//!   `{"outputs": [[...], ...]}`; errors are `{"error": "..."}` with a 4xx status for bad
//!   requests (400 malformed or empty, wrong row width, non-finite numbers; 413 more rows than
//!   a batch holds or a body over the size limit) and 5xx for the server's (503 queue full or
//!   shutting down, 500 model failure).
//! - `GET /health` — 200 with the model's shape while serving, 503 otherwise.
//! - `GET /metrics` — JSON: requests, rows, batch-size histogram, padding, latency percentiles,
//!   device memory, HTTP rejections.
//! - `POST /shutdown` — only with `--allow-shutdown`: graceful shutdown, as SIGINT/ctrl-c.
//!
//! Graceful shutdown stops accepting connections, answers every request already received
//! (the worker keeps running until the HTTP server has finished), then drains the batcher.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::{Args, ValueEnum};
use cudagraph::{BucketPolicy, Device};
use cudagraph_nn::serving::MetricsSnapshot;
use cudagraph_nn::{load_model, Batcher, BatcherConfig, ModelRunner, ServeError};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Notify};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Which batch sizes get a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Buckets {
    /// 1, 2, 4, 8, then every multiple of 8 up to the largest batch (vLLM's choice).
    Steps8,
    /// Powers of two up to the largest batch.
    Pow2,
}

impl Buckets {
    pub fn policy(self, max: usize) -> BucketPolicy {
        match self {
            Buckets::Steps8 => BucketPolicy::Steps8 { max },
            Buckets::Pow2 => BucketPolicy::PowersOfTwo { max },
        }
    }
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The model: a directory with model.json and model.safetensors, or the path of either
    /// file (the other has the same stem). `bench/export_pytorch.py` writes such files.
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: SocketAddr,
    /// Rows in the largest batch (and the largest request).
    #[arg(long, default_value_t = 256)]
    pub max_batch: usize,
    /// How long the first request of a batch waits for more, in microseconds.
    #[arg(long, default_value_t = 500)]
    pub max_wait_us: u64,
    /// Run every batch eagerly instead of through the graph cache.
    #[arg(long)]
    pub no_graph: bool,
    /// Batch sizes that get a graph (captured at start, largest first, one shared pool).
    #[arg(long, value_enum, default_value_t = Buckets::Steps8)]
    pub buckets: Buckets,
    /// Requests that may wait for the worker; more get 503.
    #[arg(long, default_value_t = 4096)]
    pub queue: usize,
    /// Enable `POST /shutdown` (graceful shutdown over HTTP, for scripts and tests).
    #[arg(long)]
    pub allow_shutdown: bool,
}

/// What the HTTP layer needs besides the batcher.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Enable `POST /shutdown`.
    pub allow_shutdown: bool,
    /// Shut down on SIGINT/ctrl-c too.
    pub ctrl_c: bool,
    /// Described in `/health` and `/metrics`.
    pub model: String,
    pub graphs: bool,
}

#[derive(Default)]
struct HttpCounters {
    received: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
}

struct AppState {
    batcher: Arc<Batcher>,
    opts: ServerOptions,
    stop: Arc<Notify>,
    counters: HttpCounters,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PredictRequest {
    inputs: Vec<Vec<f32>>,
}

#[derive(Serialize)]
struct PredictResponse<'a> {
    outputs: Vec<&'a [f32]>,
}

#[derive(Serialize)]
struct HttpMetrics {
    received: u64,
    client_errors: u64,
    server_errors: u64,
}

#[derive(Serialize)]
struct MetricsResponse {
    model: String,
    graphs: bool,
    max_batch_rows: usize,
    max_wait_us: u64,
    #[serde(flatten)]
    batcher: MetricsSnapshot,
    http: HttpMetrics,
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn error_response(st: &AppState, status: StatusCode, message: String) -> Response {
    if status.is_client_error() {
        st.counters.client_errors.fetch_add(1, Ordering::Relaxed);
    } else {
        st.counters.server_errors.fetch_add(1, Ordering::Relaxed);
    }
    let body = serde_json::to_vec(&serde_json::json!({ "error": message }))
        .unwrap_or_else(|_| b"{\"error\": \"unprintable\"}".to_vec());
    json_response(status, body)
}

/// The HTTP status for a batcher's refusal.
pub fn status_of(e: &ServeError) -> StatusCode {
    match e {
        ServeError::TooManyRows { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        e if e.is_client_error() => StatusCode::BAD_REQUEST,
        ServeError::Model(_) => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

async fn predict(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    st.counters.received.fetch_add(1, Ordering::Relaxed);
    let body = match body {
        Ok(b) => b,
        Err(e) => return error_response(&st, e.status(), e.body_text()),
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return error_response(
            &st,
            StatusCode::BAD_REQUEST,
            "empty body; send {\"inputs\": [[...], ...]}".into(),
        );
    }
    let req: PredictRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error_response(
                &st,
                StatusCode::BAD_REQUEST,
                format!("malformed request: {e}; send {{\"inputs\": [[...], ...]}}"),
            )
        }
    };
    let rows = req.inputs.len();
    let width = st.batcher.input_row();
    // Row widths first (the batcher only sees the flattened values).
    if let Some((row, r)) = req
        .inputs
        .iter()
        .enumerate()
        .find(|(_, r)| r.len() != width)
    {
        let e = ServeError::RowWidth {
            row,
            expected: width,
            got: r.len(),
        };
        return error_response(&st, status_of(&e), e.to_string());
    }
    let flat: Vec<f32> = req.inputs.into_iter().flatten().collect();
    if let Err(e) = st.batcher.validate(&flat, rows) {
        return error_response(&st, status_of(&e), e.to_string());
    }
    let (tx, rx) = oneshot::channel();
    st.batcher.submit(
        flat,
        rows,
        Box::new(move |r| {
            // The client may have gone away; nothing to do then.
            let _ = tx.send(r);
        }),
    );
    match rx.await {
        Ok(Ok(out)) => {
            let orow = st.batcher.output_row().max(1);
            let resp = PredictResponse {
                outputs: out.chunks(orow).collect(),
            };
            match serde_json::to_vec(&resp) {
                Ok(b) => json_response(StatusCode::OK, b),
                Err(e) => error_response(&st, StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }
        Ok(Err(e)) => error_response(&st, status_of(&e), e.to_string()),
        Err(_) => error_response(
            &st,
            StatusCode::INTERNAL_SERVER_ERROR,
            "the worker dropped the request without an answer".into(),
        ),
    }
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let b = &st.batcher;
    let healthy = b.is_healthy();
    let body = serde_json::json!({
        "status": if healthy { "ok" } else { "unavailable" },
        "reason": b.stopped_because(),
        "model": st.opts.model,
        "graphs": st.opts.graphs,
        "input_row": b.input_row(),
        "output_row": b.output_row(),
        "max_batch_rows": b.config().max_batch_rows,
    });
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, body.to_string().into_bytes())
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let c = &st.counters;
    let m = MetricsResponse {
        model: st.opts.model.clone(),
        graphs: st.opts.graphs,
        max_batch_rows: st.batcher.config().max_batch_rows,
        max_wait_us: st.batcher.config().max_wait.as_micros() as u64,
        batcher: st.batcher.metrics(),
        http: HttpMetrics {
            received: c.received.load(Ordering::Relaxed),
            client_errors: c.client_errors.load(Ordering::Relaxed),
            server_errors: c.server_errors.load(Ordering::Relaxed),
        },
    };
    match serde_json::to_vec_pretty(&m) {
        Ok(b) => json_response(StatusCode::OK, b),
        Err(e) => error_response(&st, StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn shutdown(State(st): State<Arc<AppState>>) -> Response {
    if !st.opts.allow_shutdown {
        return error_response(
            &st,
            StatusCode::NOT_FOUND,
            "POST /shutdown is disabled; start the server with --allow-shutdown".into(),
        );
    }
    st.stop.notify_one();
    json_response(
        StatusCode::ACCEPTED,
        b"{\"status\": \"shutting down\"}".to_vec(),
    )
}

/// Largest body accepted: the largest request with generously formatted numbers.
fn body_limit(batcher: &Batcher) -> usize {
    batcher
        .config()
        .max_batch_rows
        .saturating_mul(batcher.input_row())
        .saturating_mul(48)
        .saturating_add(64 << 10)
}

fn router(state: Arc<AppState>) -> Router {
    let limit = body_limit(&state.batcher);
    Router::new()
        .route("/predict", post(predict))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/shutdown", post(shutdown))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// A running server (in this process).
pub struct ServerHandle {
    pub addr: SocketAddr,
    stop: Arc<Notify>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    batcher: Arc<Batcher>,
}

impl ServerHandle {
    /// Starts a graceful shutdown (as `POST /shutdown` or ctrl-c would).
    pub fn stop(&self) {
        self.stop.notify_one();
    }

    /// Waits until the server has shut down (after [`Self::stop`], ctrl-c or `POST
    /// /shutdown`): every request received has been answered and the batcher drained.
    pub async fn wait(self) -> std::io::Result<()> {
        let served = self
            .task
            .await
            .map_err(|e| std::io::Error::other(format!("server task failed: {e}")))?;
        let b = self.batcher.clone();
        tokio::task::spawn_blocking(move || b.shutdown())
            .await
            .map_err(|e| std::io::Error::other(format!("batcher shutdown failed: {e}")))?;
        served
    }
}

/// Binds `addr` and serves `batcher` until stopped.
pub async fn start(
    batcher: Arc<Batcher>,
    addr: SocketAddr,
    opts: ServerOptions,
) -> std::io::Result<ServerHandle> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(Notify::new());
    let state = Arc::new(AppState {
        batcher: batcher.clone(),
        opts: opts.clone(),
        stop: stop.clone(),
        counters: HttpCounters::default(),
    });
    let signal = {
        let stop = stop.clone();
        async move {
            if opts.ctrl_c {
                tokio::select! {
                    _ = stop.notified() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            } else {
                stop.notified().await;
            }
        }
    };
    let app = router(state);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(signal)
            .await
    });
    Ok(ServerHandle {
        addr,
        stop,
        task,
        batcher,
    })
}

/// `cudagraph serve`.
pub fn run(ordinal: usize, a: &ServeArgs) -> AnyResult<()> {
    let dev = Device::open(ordinal)?;
    let s = dev.new_stream()?;
    let (desc, model) = load_model(&s, &a.model)?;
    let t0 = std::time::Instant::now();
    let buckets = (!a.no_graph).then(|| a.buckets.policy(a.max_batch));
    let runner = ModelRunner::new(s, model, desc.input().to_vec(), desc.output_row(), buckets)?;
    let captured = runner.cache().map(|c| c.entries().len()).unwrap_or(0);
    let batcher = Arc::new(Batcher::start(
        runner,
        BatcherConfig {
            max_batch_rows: a.max_batch,
            max_wait: Duration::from_micros(a.max_wait_us),
            queue_capacity: a.queue,
        },
    )?);
    let opts = ServerOptions {
        allow_shutdown: a.allow_shutdown,
        ctrl_c: true,
        model: a.model.display().to_string(),
        graphs: !a.no_graph,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let server = start(batcher, a.addr, opts).await?;
        outln!(
            "serving {} ({:?} -> {:?}) on http://{} — {}; batches of up to {} rows, max wait {} us",
            a.model.display(),
            desc.input(),
            desc.output_shape(),
            server.addr,
            if a.no_graph {
                "eager (--no-graph)".to_string()
            } else {
                format!(
                    "{captured} graphs captured in {:.0} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                )
            },
            a.max_batch,
            a.max_wait_us
        );
        server.wait().await?;
        outln!("shut down: every request received was answered");
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::serve::Client;
    use cudagraph_nn::serving::{BatchOutput, BatchRunner};

    /// Output row = [sum, max] of the input row; optional delay per batch.
    struct Fake {
        width: usize,
        delay: Duration,
    }

    impl BatchRunner for Fake {
        fn input_row(&self) -> usize {
            self.width
        }
        fn output_row(&self) -> usize {
            2
        }
        fn run(&mut self, input: &[f32], _rows: usize) -> Result<BatchOutput, String> {
            std::thread::sleep(self.delay);
            if input.contains(&666.0) {
                return Err("unlucky".into());
            }
            Ok(BatchOutput {
                output: input
                    .chunks(self.width)
                    .flat_map(|r| [r.iter().sum(), r.iter().copied().fold(f32::MIN, f32::max)])
                    .collect(),
                padded_rows: 0,
                graphed: false,
            })
        }
    }

    async fn fake_server(delay: Duration, allow_shutdown: bool) -> ServerHandle {
        let b = Batcher::start(
            Fake { width: 3, delay },
            BatcherConfig {
                max_batch_rows: 8,
                max_wait: Duration::from_millis(2),
                queue_capacity: 256,
            },
        )
        .unwrap();
        let opts = ServerOptions {
            allow_shutdown,
            ctrl_c: false,
            model: "fake".into(),
            graphs: false,
        };
        start(Arc::new(b), "127.0.0.1:0".parse().unwrap(), opts)
            .await
            .unwrap()
    }

    fn json(bytes: &[u8]) -> serde_json::Value {
        serde_json::from_slice(bytes)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(bytes)))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn predict_answers_each_request_with_its_rows() {
        let server = fake_server(Duration::ZERO, false).await;
        let mut c = Client::connect(server.addr).await.unwrap();
        let (status, body) = c
            .post(
                "/predict",
                r#"{"inputs": [[1, 2, 3], [-1, 0.5, 4]]}"#.into(),
            )
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            json(&body)["outputs"],
            serde_json::json!([[6.0, 3.0], [3.5, 4.0]])
        );
        let (status, body) = c.get("/health").await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(json(&body)["input_row"], 3);
        let (status, body) = c.get("/metrics").await.unwrap();
        assert_eq!(status, StatusCode::OK);
        let m = json(&body);
        assert_eq!(m["requests"], 1);
        assert_eq!(m["rows"], 2);
        assert!(m["latency_p99_us"].as_f64().unwrap() > 0.0);
        assert!(m["batch_size_histogram"].is_array());
        // Shutdown over HTTP is off unless enabled.
        let (status, _) = c.post("/shutdown", "".into()).await.unwrap();
        assert_eq!(status, StatusCode::NOT_FOUND);
        server.stop();
        server.wait().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving() {
        let server = fake_server(Duration::ZERO, false).await;
        let mut c = Client::connect(server.addr).await.unwrap();
        let nine_rows = format!("{{\"inputs\": [{}]}}", ["[1,2,3]"; 9].join(","));
        let huge = format!("{{\"inputs\": [[{}]]}}", "1,".repeat(200_000) + "1");
        let cases: Vec<(String, StatusCode, &str)> = vec![
            ("".into(), StatusCode::BAD_REQUEST, "empty body"),
            (
                "{\"inputs\": [[1, 2".into(),
                StatusCode::BAD_REQUEST,
                "malformed",
            ),
            ("[1, 2, 3]".into(), StatusCode::BAD_REQUEST, "malformed"),
            (
                "{\"input\": [[1,2,3]]}".into(),
                StatusCode::BAD_REQUEST,
                "malformed",
            ),
            (
                "{\"inputs\": []}".into(),
                StatusCode::BAD_REQUEST,
                "no rows",
            ),
            (
                "{\"inputs\": [[1,2,3],[1,2]]}".into(),
                StatusCode::BAD_REQUEST,
                "row 1 has 2 values",
            ),
            (
                "{\"inputs\": [[1,2,\"x\"]]}".into(),
                StatusCode::BAD_REQUEST,
                "malformed",
            ),
            (
                "{\"inputs\": [[1,2,NaN]]}".into(),
                StatusCode::BAD_REQUEST,
                "malformed",
            ),
            (
                "{\"inputs\": [[1,2,1e39]]}".into(),
                StatusCode::BAD_REQUEST,
                "finite",
            ),
            (nine_rows, StatusCode::PAYLOAD_TOO_LARGE, "at most 8 rows"),
            (huge, StatusCode::PAYLOAD_TOO_LARGE, "length limit"),
            (
                "{\"inputs\": [[666, 0, 0]]}".into(),
                StatusCode::INTERNAL_SERVER_ERROR,
                "unlucky",
            ),
        ];
        for (body, want, msg) in cases {
            let shown = body.chars().take(40).collect::<String>();
            let (status, resp) = c.post("/predict", body.into()).await.unwrap();
            assert_eq!(status, want, "{shown}: {}", String::from_utf8_lossy(&resp));
            let text = String::from_utf8_lossy(&resp).to_string();
            let err = if status == StatusCode::PAYLOAD_TOO_LARGE && msg == "length limit" {
                text
            } else {
                json(&resp)["error"].as_str().unwrap().to_string()
            };
            assert!(err.contains(msg), "{shown}: `{err}` should mention `{msg}`");
            // The server is still up after every bad request (on a fresh connection, since a
            // rejected oversized body may close this one).
            c = Client::connect(server.addr).await.unwrap();
            let (ok, _) = c
                .post("/predict", "{\"inputs\": [[1,2,3]]}".into())
                .await
                .unwrap();
            assert_eq!(ok, StatusCode::OK);
        }
        let (_, body) = c.get("/metrics").await.unwrap();
        let m = json(&body);
        assert_eq!(m["http"]["client_errors"], 11);
        assert_eq!(m["http"]["server_errors"], 1);
        server.stop();
        server.wait().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn graceful_shutdown_answers_every_request_in_flight() {
        let server = fake_server(Duration::from_millis(20), true).await;
        let addr = server.addr;
        let clients: Vec<_> = (0..16)
            .map(|i| {
                tokio::spawn(async move {
                    let mut c = Client::connect(addr).await.unwrap();
                    let body = format!("{{\"inputs\": [[{i}, 1, 1]]}}");
                    let (status, resp) = c.post("/predict", body.into()).await.unwrap();
                    (i, status, resp)
                })
            })
            .collect();
        // Let the requests arrive, then shut down over HTTP while they are queued.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let mut c = Client::connect(addr).await.unwrap();
        let (status, _) = c.post("/shutdown", "".into()).await.unwrap();
        assert_eq!(status, StatusCode::ACCEPTED);
        drop(c);
        for t in clients {
            let (i, status, resp) = t.await.unwrap();
            assert_eq!(status, StatusCode::OK, "request {i}");
            assert_eq!(json(&resp)["outputs"][0][0], (i + 2) as f64);
        }
        server.wait().await.unwrap();
        assert!(
            Client::connect(addr).await.is_err(),
            "no longer listening after shutdown"
        );
    }
}
