//! `cudagraph serve`: a model from safetensors weights and a JSON description, behind HTTP.
//!
//! The HTTP layer only: it parses requests, hands their rows to a [`Batcher`] (which owns the
//! model on its worker thread and batches concurrent requests dynamically), and turns answers
//! and errors into responses. Endpoints:
//!
//! - `POST /predict` — `{"inputs": [[...], ...]}` (rows of the model's input width) →
//!   `{"outputs": [[...], ...]}`; errors are `{"error": "..."}` with a 4xx status for bad
//!   requests (400 malformed or empty, wrong row width, non-finite numbers; 408 a body that did
//!   not arrive within `--body-timeout-s`; 413 more rows than a batch holds or a body over the
//!   size limit) and 5xx for the server's (503 with `Retry-After` past `--max-in-flight`
//!   requests or with the queue full, 503 shutting down, 500 model failure).
//! - `GET /health` — 200 with the model's shape while serving, 503 otherwise.
//! - `GET /metrics` — JSON: requests, rows, batch-size histogram, padding, latency percentiles,
//!   device memory, HTTP rejections.
//! - `POST /shutdown` — only with `--allow-shutdown`: graceful shutdown, as SIGINT/ctrl-c.
//!
//! Memory per request is bounded: a request past `--max-in-flight` is refused before its body
//! is read (not queued), a body is read only up to the size limit and within the timeout, and
//! [`parse_rows`](cudagraph_nn::serving::parse_rows) reads it straight into one flat buffer,
//! stopping at the first row past the width or the row limit.
//!
//! Graceful shutdown stops accepting connections, answers every request already received
//! (the worker keeps running until the HTTP server has finished), then drains the batcher.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::{Args, ValueEnum};
use cudagraph::{BucketPolicy, CacheOptions, Device};
use cudagraph_nn::serving::MetricsSnapshot;
use cudagraph_nn::{load_model, Batcher, BatcherConfig, Dtype, ModelRunner, ServeError};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::Serialize;
use tokio::sync::{oneshot, Notify, Semaphore};

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
    /// `POST /predict` requests handled at once (reading the body, queued or running); more
    /// get 503 with `Retry-After` at once instead of waiting. Each holds at most the body
    /// limit (about 48 bytes per value of the largest request) while it is parsed.
    #[arg(long, default_value_t = DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// Seconds a request body may take to arrive; a slower one gets 408.
    #[arg(long, default_value_t = DEFAULT_BODY_TIMEOUT.as_secs_f64())]
    pub body_timeout_s: f64,
    /// Enable `POST /shutdown` (graceful shutdown over HTTP, for scripts and tests).
    #[arg(long)]
    pub allow_shutdown: bool,
    /// Element type of the products and convolutions: f32 (exact), or bf16 / f16 on tensor
    /// cores (weights cast once at start; requests and responses stay f32 JSON).
    #[arg(long, default_value = "f32")]
    pub dtype: Dtype,
}

/// `--max-in-flight`'s default: two full batches of one-row requests at the default
/// `--max-batch`, so the next batch can gather while one runs.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;

/// `--body-timeout-s`'s default.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// What the HTTP layer needs besides the batcher.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Enable `POST /shutdown`.
    pub allow_shutdown: bool,
    /// Shut down on SIGINT/ctrl-c too.
    pub ctrl_c: bool,
    /// Described in `/health` and `/metrics`.
    pub model: String,
    /// Whether the batcher serves through graphs (described in `/health` and `/metrics`).
    pub graphs: bool,
    /// `POST /predict` requests handled at once; more get 503 with `Retry-After`. At least 1.
    pub max_in_flight: usize,
    /// How long a request body may take to arrive; a slower one gets 408. More than zero.
    pub body_timeout: Duration,
}

#[derive(Default)]
struct HttpCounters {
    received: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
    over_in_flight_limit: AtomicU64,
    body_timeouts: AtomicU64,
}

struct AppState {
    batcher: Arc<Batcher>,
    opts: ServerOptions,
    stop: Arc<Notify>,
    counters: HttpCounters,
    /// One permit per `POST /predict` in flight.
    in_flight: Arc<Semaphore>,
    body_limit: usize,
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
    /// `POST /predict` requests being handled now, and the limit.
    in_flight: usize,
    max_in_flight: usize,
    /// Requests refused with 503 because `max_in_flight` were being handled.
    over_in_flight_limit: u64,
    /// Requests answered 408 because the body did not arrive in time.
    body_timeouts: u64,
    body_limit_bytes: usize,
    body_timeout_s: f64,
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
        ServeError::TooManyRows { .. } | ServeError::RowLimit { .. } => {
            StatusCode::PAYLOAD_TOO_LARGE
        }
        e if e.is_client_error() => StatusCode::BAD_REQUEST,
        ServeError::Model(_) => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// `response` with a header added.
fn with_header(mut response: Response, name: header::HeaderName, value: &'static str) -> Response {
    response
        .headers_mut()
        .insert(name, HeaderValue::from_static(value));
    response
}

/// A refusal the client should retry after a second (503 past the in-flight limit or with
/// the queue full).
fn retry_later(st: &AppState, message: String) -> Response {
    with_header(
        error_response(st, StatusCode::SERVICE_UNAVAILABLE, message),
        header::RETRY_AFTER,
        "1",
    )
}

/// A refusal before the whole body was read: the connection cannot be reused.
fn refuse_unread(st: &AppState, status: StatusCode, message: String) -> Response {
    with_header(
        error_response(st, status, message),
        header::CONNECTION,
        "close",
    )
}

/// Reads the body of `req`: at most the body limit (a larger declared length is refused
/// before reading), within the body timeout.
async fn read_body(st: &AppState, req: Request) -> Result<Bytes, Response> {
    let limit = st.body_limit;
    let too_large = || {
        refuse_unread(
            st,
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the body is over the length limit of {limit} bytes (about 48 bytes per value of \
                 a request of {} rows of {}); send fewer rows per request",
                st.batcher.config().max_batch_rows,
                st.batcher.input_row()
            ),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let read = Limited::new(req.into_body(), limit).collect();
    match tokio::time::timeout(st.opts.body_timeout, read).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) => Err(refuse_unread(
            st,
            StatusCode::BAD_REQUEST,
            format!("could not read the request body: {e}"),
        )),
        Err(_) => {
            st.counters.body_timeouts.fetch_add(1, Ordering::Relaxed);
            Err(refuse_unread(
                st,
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {:.1} s (--body-timeout-s); send \
                     the whole body at once",
                    st.opts.body_timeout.as_secs_f64()
                ),
            ))
        }
    }
}

async fn predict(State(st): State<Arc<AppState>>, req: Request<Body>) -> Response {
    st.counters.received.fetch_add(1, Ordering::Relaxed);
    // Refused at once, not queued: the permit is held until the answer is ready, so at most
    // `max_in_flight` bodies are held or parsed at a time.
    let Ok(_permit) = st.in_flight.clone().try_acquire_owned() else {
        st.counters
            .over_in_flight_limit
            .fetch_add(1, Ordering::Relaxed);
        return retry_later(
            &st,
            format!(
                "the server is handling {} requests, its limit (--max-in-flight); retry later",
                st.opts.max_in_flight
            ),
        );
    };
    let body = match read_body(&st, req).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let parsed = st.batcher.parse_request(&body);
    drop(body);
    let rows = match parsed {
        Ok(r) => r,
        Err(e) => return error_response(&st, status_of(&e), e.to_string()),
    };
    let (tx, rx) = oneshot::channel();
    st.batcher.submit(
        rows.values,
        rows.rows,
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
        Ok(Err(e @ ServeError::Busy { .. })) => retry_later(&st, e.to_string()),
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
            in_flight: st.opts.max_in_flight - st.in_flight.available_permits(),
            max_in_flight: st.opts.max_in_flight,
            over_in_flight_limit: c.over_in_flight_limit.load(Ordering::Relaxed),
            body_timeouts: c.body_timeouts.load(Ordering::Relaxed),
            body_limit_bytes: st.body_limit,
            body_timeout_s: st.opts.body_timeout.as_secs_f64(),
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
    // `/predict` reads its body itself (limit, timeout); the others read none.
    Router::new()
        .route("/predict", post(predict))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/shutdown", post(shutdown))
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

/// Binds `addr` and serves `batcher` until stopped. Refuses options out of range
/// (`max_in_flight` 0, a zero body timeout) with `InvalidInput`.
pub async fn start(
    batcher: Arc<Batcher>,
    addr: SocketAddr,
    opts: ServerOptions,
) -> std::io::Result<ServerHandle> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    if opts.max_in_flight == 0 || opts.max_in_flight > Semaphore::MAX_PERMITS {
        return Err(invalid(format!(
            "max in-flight requests {}: use 1 to {}",
            opts.max_in_flight,
            Semaphore::MAX_PERMITS
        )));
    }
    if opts.body_timeout.is_zero() {
        return Err(invalid(
            "the body timeout is zero: every request would time out; give it some time".into(),
        ));
    }
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(Notify::new());
    let state = Arc::new(AppState {
        batcher: batcher.clone(),
        opts: opts.clone(),
        stop: stop.clone(),
        counters: HttpCounters::default(),
        in_flight: Arc::new(Semaphore::new(opts.max_in_flight)),
        body_limit: body_limit(&batcher),
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
    let body_timeout = match Duration::try_from_secs_f64(a.body_timeout_s) {
        Ok(t) if !t.is_zero() => t,
        _ => {
            return Err(format!(
                "--body-timeout-s {}: give a positive number of seconds",
                a.body_timeout_s
            )
            .into())
        }
    };
    if a.max_in_flight == 0 {
        return Err("--max-in-flight 0 would refuse every request; give at least 1".into());
    }
    let dev = Device::open(ordinal)?;
    let s = dev.new_stream()?;
    let (desc, model) = load_model(&s, &a.model)?;
    let t0 = std::time::Instant::now();
    let buckets = (!a.no_graph).then(|| a.buckets.policy(a.max_batch));
    let options = CacheOptions {
        selection: cudagraph::Selection::Measure,
        ..CacheOptions::default()
    };
    let runner = ModelRunner::with_dtype(
        s,
        model,
        (desc.input().to_vec(), desc.output_row()),
        buckets,
        options,
        a.dtype,
    )?;
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
        max_in_flight: a.max_in_flight,
        body_timeout,
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
        fake_server_with(delay, allow_shutdown, 64, Duration::from_secs(10)).await
    }

    async fn fake_server_with(
        delay: Duration,
        allow_shutdown: bool,
        max_in_flight: usize,
        body_timeout: Duration,
    ) -> ServerHandle {
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
            max_in_flight,
            body_timeout,
        };
        start(Arc::new(b), "127.0.0.1:0".parse().unwrap(), opts)
            .await
            .unwrap()
    }

    /// A raw connection that sent a `/predict` head declaring `length` body bytes and then
    /// only `partial` of them (a client that stalls).
    fn stalled_request(addr: SocketAddr, length: usize, partial: &str) -> std::net::TcpStream {
        use std::io::Write;
        let mut tcp = std::net::TcpStream::connect(addr).unwrap();
        write!(
            tcp,
            "POST /predict HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {length}\r\n\r\n{partial}"
        )
        .unwrap();
        tcp.flush().unwrap();
        tcp
    }

    /// What the server sends on `tcp` until it closes the connection; fails after `within`.
    fn response_until_close(tcp: &mut std::net::TcpStream, within: Duration) -> String {
        use std::io::Read;
        tcp.set_read_timeout(Some(within)).unwrap();
        let mut got = Vec::new();
        if let Err(e) = tcp.read_to_end(&mut got) {
            panic!(
                "no complete answer within {within:?} ({e}); got {:?}",
                String::from_utf8_lossy(&got)
            );
        }
        String::from_utf8_lossy(&got).into_owned()
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
                "{\"inputs\": [[1,2,3],[1,2,3,4, not JSON".into(),
                StatusCode::BAD_REQUEST,
                "row 1 has more than 3 values",
            ),
            (
                "{\"inputs\": [[1,2,3]], \"extra\": 1}".into(),
                StatusCode::BAD_REQUEST,
                "unknown field `extra`",
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
            (
                format!("{{\"inputs\": [{}, [oops", ["[1,2,3]"; 8].join(",")),
                StatusCode::PAYLOAD_TOO_LARGE,
                "more than 8 rows",
            ),
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
            let err = json(&resp)["error"].as_str().unwrap().to_string();
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
        assert_eq!(m["http"]["client_errors"], 14);
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_in_flight_limit_requests_get_503_with_retry_after_at_once() {
        // Bodies that never finish hold both permits; the timeout is far beyond the test.
        let server = fake_server_with(Duration::ZERO, false, 2, Duration::from_secs(60)).await;
        let addr = server.addr;
        let stalled: Vec<_> = (0..2)
            .map(|_| stalled_request(addr, 100, "{\"inputs\": [[1,"))
            .collect();
        let mut c = Client::connect(addr).await.unwrap();
        let ok_body = || Bytes::from_static(b"{\"inputs\": [[1,2,3]]}");
        // Wait until both stalled requests hold their permits (on a loaded machine their
        // connections may take seconds to reach the handler); then a third is refused.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (status, body) = c.get("/metrics").await.unwrap();
            assert_eq!(status, StatusCode::OK);
            if json(&body)["http"]["in_flight"] == 2 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the two stalled requests never held their permits"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let t0 = std::time::Instant::now();
        let resp = c.post_response("/predict", ok_body()).await.unwrap();
        let took = t0.elapsed();
        assert_eq!(
            resp.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "a third request in flight is refused"
        );
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        let err = json(resp.body())["error"].as_str().unwrap().to_string();
        assert!(
            err.contains("handling 2 requests") && err.contains("--max-in-flight"),
            "{err}"
        );
        // Refused at once, not queued behind the stalled ones.
        assert!(took < Duration::from_secs(5), "{took:?}");
        // Health and metrics stay available past the limit.
        let (status, body) = c.get("/metrics").await.unwrap();
        assert_eq!(status, StatusCode::OK);
        let m = json(&body);
        assert_eq!(m["http"]["in_flight"], 2);
        assert_eq!(m["http"]["max_in_flight"], 2);
        assert!(m["http"]["over_in_flight_limit"].as_u64().unwrap() >= 1);
        assert_eq!(c.get("/health").await.unwrap().0, StatusCode::OK);
        // The stalled clients go away: their permits come back and requests pass again.
        drop(stalled);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (status, body) = c.post("/predict", ok_body()).await.unwrap();
            if status == StatusCode::OK {
                assert_eq!(json(&body)["outputs"], serde_json::json!([[6.0, 3.0]]));
                break;
            }
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert!(
                std::time::Instant::now() < deadline,
                "permits are released when a request ends"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        server.stop();
        server.wait().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_body_gets_408_and_frees_its_place() {
        let timeout = Duration::from_millis(300);
        // One request in flight at most: the next request passes only if the stalled one
        // gave its permit back.
        let server = fake_server_with(Duration::ZERO, false, 1, timeout).await;
        let addr = server.addr;
        for partial in ["{\"inputs\": [[1, 2", ""] {
            let t0 = std::time::Instant::now();
            let mut tcp = stalled_request(addr, 100, partial);
            let answer = response_until_close(&mut tcp, Duration::from_secs(10));
            let took = t0.elapsed();
            assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
            assert!(answer.contains("did not arrive within 0.3 s"), "{answer}");
            assert!(
                took >= timeout,
                "answered after {took:?}, before the timeout"
            );
            let mut c = Client::connect(addr).await.unwrap();
            let (status, _) = c
                .post("/predict", "{\"inputs\": [[1,2,3]]}".into())
                .await
                .unwrap();
            assert_eq!(status, StatusCode::OK, "after a stalled body ({partial:?})");
        }
        let mut c = Client::connect(addr).await.unwrap();
        let (_, body) = c.get("/metrics").await.unwrap();
        let m = json(&body);
        assert_eq!(m["http"]["body_timeouts"], 2);
        assert_eq!(m["http"]["in_flight"], 0);
        server.stop();
        server.wait().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_declared_body_over_the_limit_is_refused_before_it_is_read() {
        // The timeout is far beyond the test: an answer proves nothing waited for the body.
        let server = fake_server_with(Duration::ZERO, false, 4, Duration::from_secs(60)).await;
        let mut tcp = stalled_request(server.addr, 1 << 30, "{\"inputs\": [[");
        let answer = response_until_close(&mut tcp, Duration::from_secs(10));
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("length limit"), "{answer}");
        server.stop();
        server.wait().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn out_of_range_options_are_refused() {
        let b = || {
            let fake = Fake {
                width: 3,
                delay: Duration::ZERO,
            };
            Arc::new(Batcher::start(fake, BatcherConfig::default()).unwrap())
        };
        let opts = |max_in_flight, body_timeout| ServerOptions {
            allow_shutdown: false,
            ctrl_c: false,
            model: "fake".into(),
            graphs: false,
            max_in_flight,
            body_timeout,
        };
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        for o in [opts(0, Duration::from_secs(1)), opts(1, Duration::ZERO)] {
            let e = start(b(), addr, o).await.err().expect("refused");
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        }
    }
}
