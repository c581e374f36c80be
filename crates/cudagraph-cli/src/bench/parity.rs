//! `cudagraph bench parity`: our decoder's logits against Hugging Face's, from a reference file
//! written by `bench/hf_reference.py` (safetensors: `ids.{b}` [len_b] and `logits.{b}`
//! [len_b, vocab] per row, metadata `rows`, `prompt_lens`, `decode_steps`).
//!
//! Three checks, each failing the command:
//! 1. **alone**: each row by itself — its prompt prefilled in one call, then one call per
//!    continuation token (teacher forcing) — every logit row within the tolerance;
//! 2. **batched**: all rows in one batch of mixed lengths (prompts padded to the longest), the
//!    same comparison, and each row of the batch against the same row run alone (`vs alone`,
//!    the same tolerance: batching mixes nothing);
//! 3. **generated**: greedy generation through [`Generation`] (captured decode steps) from the
//!    prompts equals Hugging Face's greedy tokens up to the first step whose top-2 margin is
//!    within twice the tolerance (after it the two may diverge legitimately).
//!
//! Error measure, per logit row: `max |ours - ref| / max |ref|`. A row's greedy token is
//! compared where the reference's top-2 margin exceeds twice the allowed absolute error
//! (`tol · max |ref|`): then no error within the tolerance can change the argmax.
//!
//! A 16-bit reference may also hold Hugging Face's logits of the same ids computed in f32 from
//! the same (16-bit) weights (`logits_f32.{b}`); then the command also prints, for context
//! and without failing on them, how far our rows (alone) and the reference's own 16-bit rows
//! are from those. It may also hold the logits of the same ids through PyTorch's math backend
//! of `scaled_dot_product_attention` instead of the default one (`logits_math.{b}`); then the
//! command prints how far those are from the reference: the spread between the reference's
//! own implementations, to read our error against.
//!
//! `--save FILE` writes our teacher-forced logits (each row alone) in the reference's layout.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use cudagraph::{Device, QueueExt, Stream};
use cudagraph_nn::Dtype;
use cudagraph_nn::SamplingParams;
use cudagraph_nn::{Decoder, Generation, GenerationOptions, LogitsFor, Request};
use safetensors::{Dtype as StDtype, SafeTensors};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct ParityArgs {
    /// The Hugging Face model folder the reference was computed from.
    #[arg(long)]
    pub model: PathBuf,
    /// The reference file (bench/hf_reference.py).
    #[arg(long)]
    pub reference: PathBuf,
    /// Element type to run in (the reference's, normally).
    #[arg(long, default_value = "f32")]
    pub dtype: Dtype,
    /// Relative tolerance on the logits (default: 1e-4 for f32, 2e-2 for bf16/f16).
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// Also write our teacher-forced logits (each row alone) to this file, in the reference's
    /// layout (safetensors: `ids.{b}`, `logits.{b}` in f32, the same metadata), to compare
    /// them with other implementations or runs; it is itself a valid `--reference`.
    #[arg(long)]
    pub save: Option<PathBuf>,
}

/// One row of the reference.
struct RefRow {
    ids: Vec<i32>,
    prompt: usize,
    /// `[ids.len(), vocab]`.
    logits: Vec<f32>,
    /// The same in f32 arithmetic, where the reference has it.
    exact: Option<Vec<f32>>,
    /// The same through another attention implementation of the reference (PyTorch's math
    /// backend of `scaled_dot_product_attention`), where it has them: how far the reference's
    /// own implementations are apart.
    math: Option<Vec<f32>>,
}

/// `name` of the reference as F32 `[len, ·]` values; the width.
fn f32_rows(st: &SafeTensors, name: &str, len: usize) -> AnyResult<(Vec<f32>, usize)> {
    let l = st.tensor(name)?;
    if l.dtype() != StDtype::F32 || l.shape().len() != 2 || l.shape()[0] != len {
        return Err(format!(
            "{name}: {:?} {:?}, expected F32 [{len}, vocab]",
            l.dtype(),
            l.shape(),
        )
        .into());
    }
    let v = l
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((v, l.shape()[1]))
}

fn read_reference(path: &PathBuf) -> AnyResult<(Vec<RefRow>, usize)> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)?;
    let meta: HashMap<String, String> = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| {
        meta.get(k)
            .cloned()
            .ok_or_else(|| format!("{}: metadata has no `{k}`", path.display()))
    };
    let rows: usize = get("rows")?.parse()?;
    let prompts: Vec<usize> = get("prompt_lens")?
        .split(',')
        .map(|x| x.trim().parse())
        .collect::<Result<_, _>>()?;
    if prompts.len() != rows {
        return Err(format!(
            "{}: {} prompt lengths for {rows} rows",
            path.display(),
            prompts.len()
        )
        .into());
    }
    let st = SafeTensors::deserialize(&bytes)?;
    let mut out = Vec::new();
    let mut vocab = 0;
    for (b, &prompt) in prompts.iter().enumerate() {
        let ids = st.tensor(&format!("ids.{b}"))?;
        let ids: Vec<i32> = match ids.dtype() {
            StDtype::I32 => ids
                .data()
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDtype::I64 => ids
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as i32)
                .collect(),
            d => return Err(format!("ids.{b}: dtype {d:?}, expected I32 or I64").into()),
        };
        let (logits, width) = f32_rows(&st, &format!("logits.{b}"), ids.len())?;
        vocab = width;
        if prompt == 0 || prompt > ids.len() {
            return Err(format!("row {b}: prompt length {prompt} of {} ids", ids.len()).into());
        }
        // Optional rows of the same shape as `logits.{b}`.
        let optional = |name: String| -> AnyResult<Option<Vec<f32>>> {
            if !st.names().iter().any(|n| **n == name) {
                return Ok(None);
            }
            let (v, width) = f32_rows(&st, &name, ids.len())?;
            if width != vocab {
                return Err(format!("{name}: {width} columns, logits.{b} {vocab}").into());
            }
            Ok(Some(v))
        };
        let exact = optional(format!("logits_f32.{b}"))?;
        let math = optional(format!("logits_math.{b}"))?;
        out.push(RefRow {
            ids,
            prompt,
            logits,
            exact,
            math,
        });
    }
    Ok((out, vocab))
}

/// The comparison of logit rows against the reference.
#[derive(Default)]
struct Tally {
    rows: usize,
    worst: f64,
    greedy_checked: usize,
    greedy_failed: usize,
    failed_rows: usize,
}

fn argmax(v: &[f32]) -> (usize, f32, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    let mut second = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best.1 {
            second = best.1;
            best = (i, x);
        } else if x > second {
            second = x;
        }
    }
    (best.0, best.1, second)
}

impl Tally {
    fn row(&mut self, ours: &[f32], reference: &[f32], tol: f64) {
        let scale = reference.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
        let err = ours
            .iter()
            .zip(reference)
            .fold(0f64, |m, (&a, &r)| m.max((a as f64 - r as f64).abs()))
            / scale.max(f64::MIN_POSITIVE);
        let err = if ours.iter().any(|x| !x.is_finite()) {
            f64::INFINITY
        } else {
            err
        };
        self.rows += 1;
        self.worst = self.worst.max(err);
        if err > tol {
            self.failed_rows += 1;
        }
        let (want, top, second) = argmax(reference);
        if (top - second) as f64 > 2.0 * tol * scale {
            self.greedy_checked += 1;
            if argmax(ours).0 != want {
                self.greedy_failed += 1;
            }
        }
    }

    /// Every row of `measured` (`[rows, vocab]`) against the same row of `against`.
    fn rows_of(&mut self, measured: &[f32], against: &[f32], vocab: usize, tol: f64) {
        for (a, b) in measured
            .chunks_exact(vocab)
            .zip(against.chunks_exact(vocab))
        {
            self.row(a, b, tol);
        }
    }

    fn ok(&self) -> bool {
        self.failed_rows == 0 && self.greedy_failed == 0
    }
}

/// Our logit row `ours` of reference row `r`'s token `t`, against the reference (into
/// `tally`) and against its f32 logits where it has them (into `exact`).
fn compare((tally, exact): (&mut Tally, &mut Tally), ours: &[f32], r: &RefRow, t: usize, tol: f64) {
    let vocab = ours.len();
    tally.row(ours, &r.logits[t * vocab..(t + 1) * vocab], tol);
    if let Some(e) = &r.exact {
        exact.row(ours, &e[t * vocab..(t + 1) * vocab], tol);
    }
}

/// For every reference row where `pair` gives two blocks of logit rows `(measured,
/// against)`, each row of `measured` against the same row of `against`.
fn spread<'r>(
    reference: &'r [RefRow],
    pair: impl Fn(&'r RefRow) -> Option<(&'r [f32], &'r [f32])>,
    vocab: usize,
    tol: f64,
) -> Tally {
    let mut t = Tally::default();
    for (measured, against) in reference.iter().filter_map(pair) {
        t.rows_of(measured, against, vocab, tol);
    }
    t
}

/// Our logits of every reference row in `rows` (`[len, vocab]` each, in the reference's order)
/// with teacher forcing through `decoder`: prompts prefilled in one call (padded to the
/// longest), then one call per continuation token.
fn teacher_forced(
    s: &Stream,
    decoder: &Decoder,
    reference: &[&RefRow],
    vocab: usize,
) -> AnyResult<Vec<Vec<f32>>> {
    let n = reference.len();
    let max_len = reference.iter().map(|r| r.ids.len()).max().unwrap_or(1);
    let cache = decoder.new_cache(s, n, max_len)?;
    let slots = s.alloc_from_host(&(0..n as i32).collect::<Vec<_>>())?;
    let mut kept: Vec<Vec<f32>> = vec![Vec::new(); n];
    let longest = reference.iter().map(|r| r.prompt).max().unwrap_or(1);
    let (mut ids, mut pos) = (Vec::new(), Vec::new());
    for r in reference {
        for t in 0..longest {
            ids.push(if t < r.prompt { r.ids[t] } else { 0 });
            pos.push(t as i32);
        }
    }
    let logits = s.alloc::<f32>(n * longest * vocab)?;
    decoder.forward(
        s,
        &cache,
        &s.alloc_from_host(&ids)?,
        &s.alloc_from_host(&pos)?,
        &slots,
        (n, longest),
        LogitsFor::All,
        &logits,
    )?;
    let host = s.to_vec(&logits)?;
    for (b, r) in reference.iter().enumerate() {
        for t in 0..r.prompt {
            let at = (b * longest + t) * vocab;
            kept[b].extend_from_slice(&host[at..at + vocab]);
        }
    }
    // Continuation tokens, one call per step; a row whose continuation ended repeats its last
    // token (not compared).
    let steps = reference
        .iter()
        .map(|r| r.ids.len() - r.prompt)
        .max()
        .unwrap_or(0);
    let logits = s.alloc::<f32>(n * vocab)?;
    for j in 0..steps {
        let (mut ids, mut pos) = (Vec::new(), Vec::new());
        for r in reference {
            let t = (r.prompt + j).min(r.ids.len() - 1);
            ids.push(r.ids[t]);
            pos.push(t as i32);
        }
        decoder.forward(
            s,
            &cache,
            &s.alloc_from_host(&ids)?,
            &s.alloc_from_host(&pos)?,
            &slots,
            (n, 1),
            LogitsFor::All,
            &logits,
        )?;
        let host = s.to_vec(&logits)?;
        for (b, r) in reference.iter().enumerate() {
            let t = r.prompt + j;
            if t < r.ids.len() {
                kept[b].extend_from_slice(&host[b * vocab..(b + 1) * vocab]);
            }
        }
    }
    Ok(kept)
}

/// Our rows `ours` (from [`teacher_forced`]) of the reference rows `reference`, each logit row
/// against the reference and against its f32 logits where it has them (the second tally).
fn tally(ours: &[Vec<f32>], reference: &[&RefRow], vocab: usize, tol: f64) -> (Tally, Tally) {
    let (mut tally, mut exact) = (Tally::default(), Tally::default());
    for (rows, r) in ours.iter().zip(reference) {
        for (t, row) in rows.chunks_exact(vocab).enumerate() {
            compare((&mut tally, &mut exact), row, r, t, tol);
        }
    }
    (tally, exact)
}

/// Writes `logits` (one `[len, vocab]` block per row of `reference`) to `path` in the
/// reference's layout, with the reference's ids and metadata (`dtype`: ours).
fn save_logits(
    path: &PathBuf,
    reference: &[RefRow],
    logits: &[Vec<f32>],
    (vocab, dtype): (usize, Dtype),
) -> AnyResult<()> {
    use safetensors::tensor::TensorView;
    let bytes: Vec<(Vec<u8>, Vec<u8>)> = reference
        .iter()
        .zip(logits)
        .map(|(r, l)| {
            (
                r.ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
                l.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let mut views = Vec::new();
    for (b, (r, (ids, l))) in reference.iter().zip(&bytes).enumerate() {
        views.push((
            format!("ids.{b}"),
            TensorView::new(StDtype::I32, vec![r.ids.len()], ids)?,
        ));
        views.push((
            format!("logits.{b}"),
            TensorView::new(StDtype::F32, vec![r.ids.len(), vocab], l)?,
        ));
    }
    let prompts: Vec<String> = reference.iter().map(|r| r.prompt.to_string()).collect();
    let meta = HashMap::from([
        ("rows".to_string(), reference.len().to_string()),
        ("prompt_lens".to_string(), prompts.join(",")),
        ("dtype".to_string(), dtype.to_string()),
    ]);
    let out = safetensors::serialize(views, Some(meta))?;
    std::fs::write(path, out).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

/// Greedy generation through captured steps, against the reference's continuation up to the
/// first step whose reference margin is within `2 · tol · max |ref|`. Returns (tokens
/// compared, tokens that differ).
fn generated(
    s: &mut Stream,
    decoder: &Arc<Decoder>,
    reference: &[RefRow],
    vocab: usize,
    tol: f64,
) -> AnyResult<(usize, usize)> {
    let max_len = reference.iter().map(|r| r.ids.len()).max().unwrap_or(1);
    let mut gen = Generation::new(
        s,
        decoder.clone(),
        GenerationOptions::new(reference.len(), max_len),
    )?;
    let requests: Vec<Request> = reference
        .iter()
        .map(|r| Request {
            prompt: r.ids[..r.prompt].to_vec(),
            max_new: r.ids.len() - r.prompt,
            sampling: SamplingParams::greedy(),
        })
        .collect();
    let out = gen.generate(s, &requests, 8)?;
    let (mut compared, mut differ) = (0, 0);
    for (r, ours) in reference.iter().zip(&out) {
        for (j, &tok) in ours.iter().enumerate() {
            let t = r.prompt + j;
            // Logits at position t - 1 chose token t.
            let row = &r.logits[(t - 1) * vocab..t * vocab];
            let scale = row.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
            let (_, top, second) = argmax(row);
            if ((top - second) as f64) <= 2.0 * tol * scale || t >= r.ids.len() {
                break;
            }
            compared += 1;
            if tok != r.ids[t] {
                differ += 1;
                break;
            }
        }
    }
    Ok((compared, differ))
}

pub fn run(device: usize, a: &ParityArgs) -> AnyResult<()> {
    let tol = a.tolerance.unwrap_or(match a.dtype {
        Dtype::F32 => 1e-4,
        _ => 2e-2,
    });
    let (reference, vocab) = read_reference(&a.reference)?;
    let dev = Device::open(device)?;
    let mut s = dev.new_stream()?;
    let decoder = Arc::new(Decoder::load(&s, &a.model, a.dtype)?);
    if decoder.vocab() != vocab {
        return Err(format!(
            "the reference has {vocab} logits per token, the model a vocabulary of {}",
            decoder.vocab()
        )
        .into());
    }
    outln!(
        "{}: {} rows (prompts {}), {}, tolerance {tol:e} relative to each row's largest logit",
        a.model.display(),
        reference.len(),
        reference
            .iter()
            .map(|r| r.prompt.to_string())
            .collect::<Vec<_>>()
            .join(","),
        a.dtype
    );
    let mut ok = true;
    let mut report = |what: &str, t: &Tally| {
        outln!(
            "{what:<10} {:>5} logit rows, worst error {:.2e}, {} over tolerance; greedy {} of {} checked agree",
            t.rows,
            t.worst,
            t.failed_rows,
            t.greedy_checked - t.greedy_failed,
            t.greedy_checked
        );
        ok &= t.ok();
    };
    let all: Vec<&RefRow> = reference.iter().collect();
    let mut ours = Vec::new();
    for r in &all {
        ours.extend(teacher_forced(&s, &decoder, &[r], vocab)?);
    }
    let (alone, exact) = tally(&ours, &all, vocab, tol);
    report("alone", &alone);
    if let Some(path) = &a.save {
        save_logits(path, &reference, &ours, (vocab, a.dtype))?;
        outln!(
            "{:<10} our logits (alone) written to {}",
            "saved",
            path.display()
        );
    }
    let together = teacher_forced(&s, &decoder, &all, vocab)?;
    report("batched", &tally(&together, &all, vocab, tol).0);
    // Batching mixes nothing: each row of the batch against the same row run alone.
    let mut mixed = Tally::default();
    for (batched, alone) in together.iter().zip(&ours) {
        mixed.rows_of(batched, alone, vocab, tol);
    }
    report("vs alone", &mixed);
    if exact.rows > 0 {
        // Context, not a check: both 16-bit runs against the f32 run of the same weights.
        let theirs = spread(
            &reference,
            |r| Some((&r.logits, r.exact.as_deref()?)),
            vocab,
            tol,
        );
        for (what, t) in [("ours", &exact), ("reference", &theirs)] {
            outln!(
                "{:<10} against f32: {what:<9} worst error {:.2e}, {} of {} rows over tolerance",
                "context",
                t.worst,
                t.failed_rows,
                t.rows
            );
        }
    }
    let math = spread(
        &reference,
        |r| Some((r.math.as_deref()?, &r.logits)),
        vocab,
        tol,
    );
    if math.rows > 0 {
        // Context, not a check: the reference's own other attention implementation against it.
        outln!(
            "{:<10} the reference's math attention against it: worst error {:.2e}, {} of {} rows over tolerance",
            "context",
            math.worst,
            math.failed_rows,
            math.rows
        );
    }
    let (compared, differ) = generated(&mut s, &decoder, &reference, vocab, tol)?;
    outln!(
        "{:<10} {compared} greedy tokens compared (up to each row's first low-margin step), {differ} differ",
        "generated"
    );
    ok &= differ == 0;
    if ok {
        outln!("parity: ok");
        Ok(())
    } else {
        Err("parity: logits or greedy tokens differ from the reference beyond the tolerance".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn le<T: Copy>(v: &[T], f: fn(T) -> [u8; 4]) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }

    /// A reference file of one row (3 ids, prompt 2, vocab 2) at `path`; `exact`: the width of
    /// its `logits_f32.0` (none when `None`).
    fn write(path: &std::path::Path, exact: Option<usize>) {
        let ids = le(&[5i32, 6, 7], i32::to_le_bytes);
        let logits = le(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], f32::to_le_bytes);
        let exact_data = exact.map(|w| le(&vec![0.5f32; 3 * w], f32::to_le_bytes));
        let mut views = vec![
            (
                "ids.0".to_string(),
                TensorView::new(StDtype::I32, vec![3], &ids).unwrap(),
            ),
            (
                "logits.0".to_string(),
                TensorView::new(StDtype::F32, vec![3, 2], &logits).unwrap(),
            ),
        ];
        if let (Some(w), Some(d)) = (exact, exact_data.as_ref()) {
            views.push((
                "logits_f32.0".to_string(),
                TensorView::new(StDtype::F32, vec![3, w], d).unwrap(),
            ));
        }
        let meta = HashMap::from([
            ("rows".to_string(), "1".to_string()),
            ("prompt_lens".to_string(), "2".to_string()),
        ]);
        let bytes = safetensors::serialize(views, Some(meta)).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn a_reference_reads_with_and_without_its_f32_logits() {
        let dir = std::env::temp_dir().join(format!("cg-parity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ref.safetensors");
        write(&path, None);
        let (rows, vocab) = read_reference(&path).unwrap();
        assert_eq!((rows.len(), vocab), (1, 2));
        assert_eq!(
            (rows[0].ids.as_slice(), rows[0].prompt),
            (&[5, 6, 7][..], 2)
        );
        assert_eq!(rows[0].logits[5], 6.0);
        assert!(rows[0].exact.is_none());
        write(&path, Some(2));
        let (rows, _) = read_reference(&path).unwrap();
        assert_eq!(rows[0].exact.as_deref(), Some(&[0.5f32; 6][..]));
        // f32 logits of another width than the reference's are refused.
        write(&path, Some(3));
        let err = read_reference(&path).err().expect("a width mismatch");
        assert!(err.to_string().contains("logits_f32.0"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn saved_logits_read_back_as_a_reference() {
        let dir = std::env::temp_dir().join(format!("cg-parity-save-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (path, saved) = (dir.join("ref.safetensors"), dir.join("ours.safetensors"));
        write(&path, None);
        let (rows, vocab) = read_reference(&path).unwrap();
        let ours = vec![vec![-1.5f32, 0.25, 3.0, 4.5, 5.0, -6.0]];
        save_logits(&saved, &rows, &ours, (vocab, Dtype::Bf16)).unwrap();
        let (back, width) = read_reference(&saved).unwrap();
        assert_eq!((back.len(), width), (1, 2));
        assert_eq!(
            (back[0].ids.as_slice(), back[0].prompt),
            (&[5, 6, 7][..], 2)
        );
        assert_eq!(back[0].logits, ours[0]);
        // Logits of another length than the row's ids are refused, not written short.
        let short = vec![vec![0.0f32; 4]];
        assert!(save_logits(&saved, &rows, &short, (vocab, Dtype::Bf16)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_tally_measures_each_row_against_its_largest_logit() {
        let mut t = Tally::default();
        // Error 0.1 against a largest |logit| of 4: 2.5e-2, over a tolerance of 2e-2; the
        // margin (4 - 1 = 3) is clear, and the argmax agrees.
        t.row(&[4.1, 1.0], &[4.0, 1.0], 2e-2);
        assert_eq!((t.rows, t.failed_rows, t.greedy_checked), (1, 1, 1));
        assert!((t.worst - 0.025).abs() < 1e-6, "{}", t.worst);
        let mut u = Tally::default();
        // A non-finite value is an infinite error; a flipped argmax with a clear margin fails.
        u.row(&[f32::NAN, 0.0], &[1.0, 0.0], 2e-2);
        u.row(&[0.0, 5.0], &[5.0, 0.0], 2e-2);
        assert_eq!((u.greedy_checked, u.greedy_failed), (2, 2));
        // The same two rows into the first tally, row by row.
        t.rows_of(&[f32::NAN, 0.0, 0.0, 5.0], &[1.0, 0.0, 5.0, 0.0], 2, 2e-2);
        assert_eq!((t.rows, t.failed_rows, t.greedy_failed), (3, 3, 2));
        assert!(t.worst.is_infinite() && !t.ok());
        // compare() feeds the second tally only where the reference has f32 logits.
        let r = RefRow {
            ids: vec![1, 2],
            prompt: 1,
            logits: vec![1.0, 0.0, 2.0, 0.0],
            exact: Some(vec![1.0, 0.0, 2.5, 0.0]),
            math: Some(vec![1.0, 0.1, 2.0, 0.0]),
        };
        let (mut a, mut e) = (Tally::default(), Tally::default());
        compare((&mut a, &mut e), &[2.0, 0.0], &r, 1, 2e-2);
        assert_eq!((a.rows, a.failed_rows, e.rows, e.failed_rows), (1, 0, 1, 1));
        // spread() measures the first block against the second, row by row: the math rows
        // against the reference (0.1 off a largest |logit| of 1 in the first row), the
        // reference against its f32 rows (0.5 off 2.5 in the second).
        let rows = std::slice::from_ref(&r);
        let m = spread(rows, |r| Some((r.math.as_deref()?, &r.logits)), 2, 2e-2);
        assert_eq!((m.rows, m.failed_rows), (2, 1));
        assert!((m.worst - 0.1).abs() < 1e-6, "{}", m.worst);
        let x = spread(rows, |r| Some((&r.logits, r.exact.as_deref()?)), 2, 2e-2);
        assert!((x.worst - 0.2).abs() < 1e-6, "{}", x.worst);
        let plain = RefRow {
            exact: None,
            math: None,
            ..r
        };
        compare((&mut a, &mut e), &[2.0, 0.0], &plain, 1, 2e-2);
        assert_eq!((a.rows, e.rows), (2, 1));
        let none = spread(
            std::slice::from_ref(&plain),
            |r| Some((r.math.as_deref()?, &r.logits)),
            2,
            2e-2,
        );
        assert_eq!(none.rows, 0);
    }
}
