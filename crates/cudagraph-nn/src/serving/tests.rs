//! Unit tests of the batcher and the request parser (CPU only: a model of plain sums).

use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::batcher::lock;
use super::parse::REASON_CHARS;
use super::*;

/// Output row = [sum of the row, number of rows in the batch].
struct Sum {
    width: usize,
    batches: Arc<Mutex<Vec<usize>>>,
    fail_on: Option<f32>,
    delay: Duration,
}

impl BatchRunner for Sum {
    fn input_row(&self) -> usize {
        self.width
    }
    fn output_row(&self) -> usize {
        2
    }
    fn run(&mut self, input: &[f32], rows: usize) -> std::result::Result<BatchOutput, String> {
        std::thread::sleep(self.delay);
        if self.fail_on.is_some_and(|f| input.contains(&f)) {
            return Err("bad value".into());
        }
        if input.contains(&-999.0) {
            panic!("boom");
        }
        lock(&self.batches).push(rows);
        Ok(BatchOutput {
            output: input
                .chunks(self.width)
                .flat_map(|r| [r.iter().sum::<f32>(), rows as f32])
                .collect(),
            padded_rows: rows.next_power_of_two() - rows,
            graphed: true,
        })
    }
}

fn sum_batcher(
    cfg: BatcherConfig,
    delay: Duration,
    fail_on: Option<f32>,
) -> (Batcher, Arc<Mutex<Vec<usize>>>) {
    let batches = Arc::new(Mutex::new(Vec::new()));
    let r = Sum {
        width: 3,
        batches: batches.clone(),
        fail_on,
        delay,
    };
    (Batcher::start(r, cfg).unwrap(), batches)
}

type Answer = std::result::Result<Vec<f32>, ServeError>;

fn submit(b: &Batcher, rows: usize, base: f32) -> Receiver<Answer> {
    let (tx, rx) = channel();
    let input: Vec<f32> = (0..rows * 3).map(|i| base + i as f32).collect();
    b.submit(
        input,
        rows,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx
}

#[test]
fn concurrent_requests_are_batched_and_each_gets_its_rows() {
    let cfg = BatcherConfig {
        max_batch_rows: 16,
        max_wait: Duration::from_millis(50),
        queue_capacity: 1000,
    };
    let (b, batches) = sum_batcher(cfg, Duration::ZERO, None);
    let b = Arc::new(b);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                for k in 0..25 {
                    let rows = 1 + (t * 7 + k) % 5;
                    // Disjoint values per request (at most 15 from each base), so every
                    // row of every request has its own sum: a row answered from another
                    // request, or from a stale batch, cannot match.
                    let base = ((t * 25 + k) * 100) as f32;
                    let rx = submit(&b, rows, base);
                    got.push((rows, base, rx));
                }
                for (rows, base, rx) in got {
                    let out = rx.recv().expect("answered").expect("served");
                    assert_eq!(out.len(), rows * 2);
                    for r in 0..rows {
                        let start = base + (r * 3) as f32;
                        assert_eq!(out[r * 2], 3.0 * start + 3.0, "row {r} is this request's");
                        assert!(out[r * 2 + 1] >= rows as f32, "ran in a batch that held it");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let m = b.metrics();
    assert_eq!(m.requests, 200);
    let sizes = lock(&batches).clone();
    assert!(sizes.iter().all(|&s| s <= 16), "{sizes:?}");
    assert!(
        sizes.len() < 200,
        "requests were batched together ({} batches)",
        sizes.len()
    );
    assert_eq!(m.rows, sizes.iter().sum::<usize>() as u64);
    assert_eq!(
        m.batch_size_histogram
            .iter()
            .map(|b| b.batches)
            .sum::<u64>(),
        m.batches
    );
    assert!(m.latency_p50_us > 0.0 && m.latency_p99_us >= m.latency_p50_us);
    assert!(m.padded_rows > 0 && m.padding_fraction > 0.0);
}

#[test]
fn a_lone_request_waits_at_most_max_wait() {
    let cfg = BatcherConfig {
        max_batch_rows: 64,
        max_wait: Duration::from_millis(20),
        queue_capacity: 10,
    };
    let (b, _) = sum_batcher(cfg, Duration::ZERO, None);
    let t0 = Instant::now();
    let out = submit(&b, 2, 0.0).recv().unwrap().unwrap();
    let waited = t0.elapsed();
    assert_eq!(out, vec![3.0, 2.0, 12.0, 2.0]);
    assert!(waited >= Duration::from_millis(20), "{waited:?}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}

#[test]
fn a_full_batch_runs_without_waiting() {
    let cfg = BatcherConfig {
        max_batch_rows: 4,
        max_wait: Duration::from_secs(30),
        queue_capacity: 10,
    };
    let (b, batches) = sum_batcher(cfg, Duration::ZERO, None);
    let t0 = Instant::now();
    let rx = submit(&b, 4, 0.0);
    rx.recv().unwrap().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(*lock(&batches), vec![4]);
}

#[test]
fn invalid_requests_are_refused_with_typed_errors() {
    let (b, _) = sum_batcher(BatcherConfig::default(), Duration::ZERO, None);
    let refuse = |input: Vec<f32>, rows: usize| {
        let (tx, rx) = channel();
        b.submit(input, rows, Box::new(move |r| tx.send(r).unwrap()));
        rx.recv().unwrap().unwrap_err()
    };
    assert_eq!(refuse(vec![], 0), ServeError::Empty);
    assert!(matches!(
        refuse(vec![0.0; 3 * 257], 257),
        ServeError::TooManyRows {
            rows: 257,
            max: 256
        }
    ));
    assert!(matches!(
        refuse(vec![0.0; 4], 1),
        ServeError::RowWidth { expected: 3, .. }
    ));
    let e = refuse(vec![0.0, 1.0, 2.0, 3.0, f32::NAN, 5.0], 2);
    assert_eq!(
        e,
        ServeError::NonFinite {
            row: 1,
            column: 1,
            value: "NaN".into()
        }
    );
    assert!(e.is_client_error());
    // Still serving.
    assert!(submit(&b, 1, 1.0).recv().unwrap().is_ok());
}

#[test]
fn model_errors_reach_every_request_of_the_batch_and_serving_goes_on() {
    let cfg = BatcherConfig {
        max_batch_rows: 8,
        max_wait: Duration::from_millis(1),
        queue_capacity: 100,
    };
    let (b, _) = sum_batcher(cfg, Duration::ZERO, Some(1000.0));
    let bad = submit(&b, 1, 1000.0).recv().unwrap();
    assert!(matches!(bad, Err(ServeError::Model(ref m)) if m.contains("bad value")));
    assert!(submit(&b, 2, 0.0).recv().unwrap().is_ok());
    assert_eq!(b.metrics().errors, 1);
    assert!(b.is_healthy());
}

#[test]
fn a_panicking_model_stops_the_worker_but_every_request_is_answered() {
    let (b, _) = sum_batcher(BatcherConfig::default(), Duration::ZERO, None);
    let (tx, rx) = channel();
    b.submit(
        vec![-999.0, 0.0, 0.0],
        1,
        Box::new(move |r| tx.send(r).unwrap()),
    );
    assert!(matches!(rx.recv().unwrap(), Err(ServeError::Model(m)) if m.contains("panicked")));
    assert!(!b.is_healthy());
    assert!(matches!(
        submit(&b, 1, 0.0).recv().unwrap(),
        Err(ServeError::WorkerStopped(_))
    ));
}

#[test]
fn shutdown_answers_queued_requests_then_refuses_new_ones() {
    let cfg = BatcherConfig {
        max_batch_rows: 2,
        max_wait: Duration::from_millis(1),
        queue_capacity: 100,
    };
    let (b, _) = sum_batcher(cfg, Duration::from_millis(5), None);
    let pending: Vec<_> = (0..20).map(|i| submit(&b, 1, i as f32)).collect();
    b.shutdown();
    for rx in pending {
        assert!(rx.recv().unwrap().is_ok(), "queued work is answered");
    }
    assert_eq!(
        submit(&b, 1, 0.0).recv().unwrap(),
        Err(ServeError::ShuttingDown)
    );
    assert!(!b.is_healthy());
}

#[test]
fn a_full_queue_pushes_back() {
    let cfg = BatcherConfig {
        max_batch_rows: 1,
        max_wait: Duration::ZERO,
        queue_capacity: 2,
    };
    let (b, _) = sum_batcher(cfg, Duration::from_millis(50), None);
    let rxs: Vec<_> = (0..10).map(|i| submit(&b, 1, i as f32)).collect();
    let answers: Vec<Answer> = rxs.into_iter().map(|r| r.recv().unwrap()).collect();
    assert!(answers
        .iter()
        .any(|a| matches!(a, Err(ServeError::Busy { capacity: 2 }))));
    assert!(answers.iter().any(|a| a.is_ok()));
}

fn parse(body: &str) -> std::result::Result<Rows, ServeError> {
    parse_rows(body.as_bytes(), 3, 4)
}

fn malformed(body: &str) -> String {
    match parse(body) {
        Err(ServeError::Malformed { reason, width: 3 }) => reason,
        other => panic!("{body:?}: expected Malformed, got {other:?}"),
    }
}

#[test]
fn parse_rows_reads_rows_into_one_flat_buffer() {
    let r = parse(" {\n\"inputs\" : [[1, 2, 3], [-1.5e0, 0.25, 4E2], [0,0,-0]] } \n").unwrap();
    assert_eq!(r.rows, 3);
    assert_eq!(
        r.values,
        vec![1.0, 2.0, 3.0, -1.5, 0.25, 400.0, 0.0, 0.0, -0.0]
    );
    // Exactly at the limits.
    let full = format!("{{\"inputs\": [{}]}}", ["[1,2,3]"; 4].join(","));
    assert_eq!(parse(&full).unwrap().rows, 4);
    // f32 rounding as `as f32` does it.
    let r = parse(r#"{"inputs": [[0.1, 16777217, 3.4028235e38]]}"#).unwrap();
    assert_eq!(r.values, vec![0.1f32, 16777216.0, f32::MAX]);
    // Width 0: rows of nothing.
    let r = parse_rows(br#"{"inputs": [[], []]}"#, 0, 4).unwrap();
    assert_eq!((r.rows, r.values.len()), (2, 0));
}

#[test]
fn parse_rows_stops_at_the_first_value_past_the_width() {
    // What follows the fourth value is not JSON: the parser never reads it.
    assert_eq!(
        parse(r#"{"inputs": [[1, 2, 3, 4, this is not JSON"#),
        Err(ServeError::RowTooLong {
            row: 0,
            expected: 3
        })
    );
    assert_eq!(
        parse(r#"{"inputs": [[1, 2, 3], [4, 5, 6], [7, 8, 9, "x"], [oops"#),
        Err(ServeError::RowTooLong {
            row: 2,
            expected: 3
        })
    );
    // A huge row costs nothing: no more than `width` values are kept.
    let huge = format!("{{\"inputs\": [[{}1]]}}", "1,".repeat(1 << 20));
    assert_eq!(
        parse(&huge),
        Err(ServeError::RowTooLong {
            row: 0,
            expected: 3
        })
    );
    let e = parse(&huge).unwrap_err().to_string();
    assert!(e.contains("more than 3 values"), "{e}");
    // Short rows say how short.
    assert_eq!(
        parse(r#"{"inputs": [[1, 2, 3], [1, 2]]}"#),
        Err(ServeError::RowWidth {
            row: 1,
            expected: 3,
            got: 2
        })
    );
    assert_eq!(
        parse(r#"{"inputs": [[]]}"#),
        Err(ServeError::RowWidth {
            row: 0,
            expected: 3,
            got: 0
        })
    );
}

#[test]
fn parse_rows_stops_at_the_first_row_past_the_limit() {
    // Four rows fit; the fifth is refused before it is read (it is not JSON).
    let body = format!("{{\"inputs\": [{}, [garbage", ["[1,2,3]"; 4].join(","));
    assert_eq!(parse(&body), Err(ServeError::RowLimit { max: 4 }));
    let many = format!("{{\"inputs\": [{}]}}", ["[1,2,3]"; 100_000].join(","));
    assert_eq!(parse(&many), Err(ServeError::RowLimit { max: 4 }));
    let e = parse(&many).unwrap_err();
    assert!(e.is_client_error());
    assert!(e.to_string().contains("at most 4 rows"), "{e}");
    assert_eq!(parse(r#"{"inputs": []}"#), Err(ServeError::Empty));
}

#[test]
fn parse_rows_keeps_at_most_the_limit_in_memory() {
    // Padding cannot make the buffer grow past what the limits allow.
    let padded = format!("{{\"inputs\": [[1,2,3]]{}}}", " ".repeat(1 << 20));
    let r = parse(&padded).unwrap();
    assert_eq!(r.values, vec![1.0, 2.0, 3.0]);
    assert!(r.values.capacity() <= 3 * 4, "{}", r.values.capacity());
    // Nor can a short body make it reserve the whole limit.
    let r = parse_rows(br#"{"inputs": [[7]]}"#, 1, 1 << 30).unwrap();
    assert!(r.values.capacity() <= 16, "{}", r.values.capacity());
}

#[test]
fn parse_rows_refuses_values_that_are_not_finite_f32_numbers() {
    // Beyond f32's range: typed, with where and what.
    match parse(r#"{"inputs": [[1, 2, 3], [4, -1e39, 6]]}"#) {
        Err(ServeError::NonFinite { row, column, value }) => {
            assert_eq!((row, column), (1, 1));
            assert!(value.contains("-1e39"), "{value}");
        }
        other => panic!("{other:?}"),
    }
    // JSON has no NaN or infinity (as before: malformed), nor numbers beyond f64.
    for body in [
        r#"{"inputs": [[1, 2, NaN]]}"#,
        r#"{"inputs": [[1, 2, Infinity]]}"#,
        r#"{"inputs": [[1, 2, -inf]]}"#,
        r#"{"inputs": [[1, 2, 1e400]]}"#,
    ] {
        malformed(body);
    }
    // Values that are not numbers, with the place.
    for (body, says) in [
        (r#"{"inputs": [[1, 2, "3"]]}"#, "invalid type: string"),
        (r#"{"inputs": [[1, null, 3]]}"#, "invalid type: null"),
        (r#"{"inputs": [[true, 2, 3]]}"#, "invalid type: boolean"),
        (r#"{"inputs": [[1, [2], 3]]}"#, "invalid type: sequence"),
        (r#"{"inputs": [[1, {}, 3]]}"#, "invalid type: map"),
        (r#"{"inputs": [1, 2, 3]}"#, "a row of 3 numbers"),
        (r#"{"inputs": {"a": 1}}"#, "an array of rows"),
    ] {
        let reason = malformed(body);
        assert!(reason.contains(says), "{body}: {reason}");
        assert!(reason.contains("column"), "{body}: {reason}");
    }
}

#[test]
fn parse_rows_refuses_bodies_of_another_shape() {
    for (body, says) in [
        ("", "empty body"),
        (" \r\n\t ", "empty body"),
        ("{}", "missing field `inputs`"),
        (r#"{"input": [[1,2,3]]}"#, "unknown field `input`"),
        (
            r#"{"inputs": [[1,2,3]], "inputs": [[1,2,3]]}"#,
            "duplicate field `inputs`",
        ),
        (r#"{"inputs": [[1,2,3]]} trailing"#, "trailing characters"),
        (r#"{"inputs": [[1,2,3]]"#, "EOF"),
        (r#"{"inputs": [[1, 2"#, "EOF"),
        ("[[1, 2, 3]]", "an object"),
        ("42", "an object"),
        ("\u{feff}{}", "expected value"),
        ("\u{0}", "expected value"),
    ] {
        let reason = malformed(body);
        assert!(reason.contains(says), "{body:?}: {reason}");
    }
    // Unknown fields are refused before their value is read.
    malformed(r#"{"junk": [[[[[[[[ not JSON"#);
    // A message never repeats a huge input back.
    let long_key = format!("{{\"{}\": 1}}", "k".repeat(100_000));
    let reason = malformed(&long_key);
    assert!(
        reason.chars().count() <= REASON_CHARS + 1,
        "{}",
        reason.len()
    );
    let e = parse(&long_key).unwrap_err();
    assert!(e.is_client_error());
    assert!(e.to_string().contains("rows of 3 numbers"), "{e}");
}

#[test]
fn parse_rows_survives_deeply_nested_garbage() {
    // Deep nesting where a body, a row list, a row or a value is expected: refused at
    // the first bracket that does not fit, without recursing into the rest.
    let deep = "[".repeat(1 << 20);
    for body in [
        deep.clone(),
        format!("{{\"inputs\": {deep}"),
        format!("{{\"inputs\": [{deep}"),
        format!("{{\"inputs\": [[1, {deep}"),
        format!("{}{}", "{\"a\":".repeat(1 << 16), "1"),
        format!("{{\"inputs\": [[1, {}", "{\"a\":".repeat(1 << 16)),
    ] {
        malformed(&body);
    }
}

#[test]
fn a_batcher_parses_requests_with_its_own_limits() {
    let cfg = BatcherConfig {
        max_batch_rows: 2,
        ..BatcherConfig::default()
    };
    let (b, _) = sum_batcher(cfg, Duration::ZERO, None);
    let r = b
        .parse_request(br#"{"inputs": [[1,2,3],[4,5,6]]}"#)
        .unwrap();
    assert_eq!(r.rows, 2);
    assert_eq!(
        b.parse_request(br#"{"inputs": [[1,2,3],[4,5,6],[7"#),
        Err(ServeError::RowLimit { max: 2 })
    );
    assert_eq!(
        b.parse_request(br#"{"inputs": [[1,2,3,4"#),
        Err(ServeError::RowTooLong {
            row: 0,
            expected: 3
        })
    );
}

#[test]
fn percentiles_use_nearest_rank() {
    let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
    assert_eq!(percentile(&v, 0.5), 50.0);
    assert_eq!(percentile(&v, 0.99), 99.0);
    assert_eq!(percentile(&v, 1.0), 100.0);
    assert_eq!(percentile(&[], 0.5), 0.0);
    assert_eq!(percentile(&[7.0], 0.01), 7.0);
}
