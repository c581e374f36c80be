//! Graphed generation with a [`Decoder`]: sequences join (their prompt prefilled eagerly into a
//! free cache slot), every decode step — the model's forward for one token per row, sampling
//! and the rows' bookkeeping — replays as one captured graph per batch bucket, and sequences
//! leave when their end condition is met on the device. The API is step by step, so a server
//! can let sequences join and leave between steps; [`Generation::generate`] is the loop for a
//! fixed set of prompts.
//!
//! Rows are cache slots: slot `r` is row `r` of every decode step. A step runs the smallest
//! bucket that covers the highest occupied slot (free and finished slots inside it compute a
//! wasted row and change nothing). All buckets' graphs share one pool and are captured largest
//! first, so the smaller ones reuse the larger one's memory. The state the step reads — token
//! ids, positions, sampling settings, the end conditions — lives in device memory and is
//! updated by the step itself, so nothing is read on the host between steps;
//! [`Generation::poll`] reads the finished rows when the caller wants them.
//!
//! The last prompt token of a sequence is fed by its first decode step (prefill writes the
//! cache for the tokens before it), so every generated token comes from the same captured
//! step.
//!
//! With [`GenerationOptions::steps_per_launch`] `k > 1`, each bucket's graph is a WHILE node
//! around the step: one launch runs up to `k` steps and stops early, on the device, after the
//! step in which the last of its rows ended ([`DecodeState::live`]). Sequences join and leave
//! between launches; the tokens are those of `k` single steps.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cudagraph::{CaptureOptions, Graph, Pool, Queue, QueueExt, Stream};

use crate::engine::Engines;
use crate::error::{NnError, Result};
use crate::nn::sampling::{DecodeState, Sampler, SamplingParams};
use crate::random::Generator;
use crate::serving::decoder::{Decoder, DecoderCache, LogitsFor};

/// How a [`Generation`] is set up.
#[derive(Clone, Debug)]
pub struct GenerationOptions {
    /// Sequences at most at once (cache slots; the largest bucket).
    pub slots: usize,
    /// Positions per slot: a sequence's prompt and generated tokens together.
    pub max_len: usize,
    /// Batch sizes with a captured decode step (each at most `slots`; `slots` is added). Empty:
    /// powers of two up to `slots`.
    pub buckets: Vec<usize>,
    /// Replay captured steps (`false`: run every step eagerly, for comparison).
    pub graphs: bool,
    /// Token ids that end a sequence (at most four).
    pub eos: Vec<i32>,
    /// Seed of the sampling generator.
    pub seed: u64,
    /// Decode steps one [`Generation::step`] runs at most (a WHILE node in each captured
    /// step that ends once every row has ended; eager steps read that flag after each step).
    /// At least 1; 1 (the default) captures the plain step.
    pub steps_per_launch: u32,
    /// Before capturing, time each bucket's forward in a graph with the close alternatives of
    /// its products' engines and keep those that make it faster
    /// ([`Engines::tune_graph`](crate::engine::Engines::tune_graph); recorded in the engine
    /// registry, so later processes skip it). Default on; only with `graphs`.
    pub tune: bool,
}

impl GenerationOptions {
    /// `slots` sequences of up to `max_len` positions, power-of-two buckets, graphs on and
    /// tuned, no end token, seed 0.
    pub fn new(slots: usize, max_len: usize) -> Self {
        Self {
            slots,
            max_len,
            buckets: Vec::new(),
            graphs: true,
            eos: Vec::new(),
            seed: 0,
            steps_per_launch: 1,
            tune: true,
        }
    }
}

/// A sequence to start: its prompt ids, how many tokens to generate at most, how to sample.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt token ids (at least one).
    pub prompt: Vec<i32>,
    /// Tokens to generate at most (at least one).
    pub max_new: usize,
    /// Sampling settings of this sequence.
    pub sampling: SamplingParams,
}

/// A sequence that ended: its slot (free again) and the tokens it generated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The slot it occupied.
    pub slot: usize,
    /// Generated tokens (an end token, when one stopped it, is the last).
    pub tokens: Vec<i32>,
}

/// Facts about the captured steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenerationStats {
    /// Captured buckets.
    pub graphs: usize,
    /// Time capturing (and instantiating) them.
    pub capture_time: Duration,
    /// Time tuning their engines ([`GenerationOptions::tune`]).
    pub tune_time: Duration,
    /// Products whose engine the tuning changed.
    pub retuned: usize,
    /// Peak bytes the steps allocate in their shared pool (the largest bucket's working set).
    pub graph_bytes: usize,
    /// Decode steps launched: [`GenerationOptions::steps_per_launch`] for each
    /// [`Generation::step`] that had an occupied slot (those a launch skipped after every row
    /// ended included).
    pub steps: u64,
}

/// The step-by-step generation loop over one [`Decoder`] (see the module documentation).
pub struct Generation {
    decoder: Arc<Decoder>,
    cache: DecoderCache,
    sampler: Sampler,
    state: DecodeState,
    gen: Generator,
    /// The step's inputs, one per slot: token id, position, cache slot (the identity).
    ids: cudagraph::DeviceBuffer<i32>,
    positions: cudagraph::DeviceBuffer<i32>,
    slot_of_row: cudagraph::DeviceBuffer<i32>,
    logits: cudagraph::DeviceBuffer<f32>,
    tokens: cudagraph::DeviceBuffer<i32>,
    /// The captured step of each bucket (none without graphs).
    graphs: BTreeMap<usize, Graph>,
    sizes: Vec<usize>,
    /// Host view of the slots: occupied by a sequence that has not been polled as finished.
    occupied: Vec<bool>,
    opts: GenerationOptions,
    stats: GenerationStats,
}

fn invalid(msg: String) -> NnError {
    NnError::Shape(msg)
}

/// Checks `opts` for a model of `positions` positions (`limit` says what bounds them) and
/// `vocab` tokens and returns its bucket sizes: sorted, unique, each in `1..=slots`, `slots`
/// included. Refuses no slots, `max_len` 0 or above the positions, an end token outside the
/// vocabulary, `steps_per_launch` 0 and a bucket outside `1..=slots`.
fn checked_buckets(
    opts: &GenerationOptions,
    (positions, limit): (usize, &str),
    vocab: usize,
) -> Result<Vec<usize>> {
    if opts.slots == 0 {
        return Err(invalid("generation: at least one slot is needed".into()));
    }
    if opts.max_len == 0 || opts.max_len > positions {
        return Err(invalid(format!(
            "generation: max_len {} is not in 1..={positions} ({limit})",
            opts.max_len
        )));
    }
    if let Some(&bad) = opts.eos.iter().find(|&&t| t < 0 || t as usize >= vocab) {
        return Err(invalid(format!(
            "generation: end token {bad} is outside the vocabulary of {vocab}"
        )));
    }
    if opts.steps_per_launch == 0 {
        return Err(invalid(
            "generation: steps_per_launch is 0; one launch runs at least one step".into(),
        ));
    }
    let mut sizes = if opts.buckets.is_empty() {
        let mut v = Vec::new();
        let mut b = 1;
        while b < opts.slots {
            v.push(b);
            b *= 2;
        }
        v
    } else {
        opts.buckets.clone()
    };
    if let Some(&bad) = sizes.iter().find(|&&b| b == 0 || b > opts.slots) {
        return Err(invalid(format!(
            "generation: bucket {bad} is not in 1..={} (the slots)",
            opts.slots
        )));
    }
    sizes.push(opts.slots);
    sizes.sort_unstable();
    sizes.dedup();
    Ok(sizes)
}

impl Generation {
    /// Sets up `opts.slots` slots of `opts.max_len` positions on `stream`'s device and (with
    /// `opts.graphs`) captures one decode step per bucket, largest first, into one pool.
    /// Errors: no slots, `max_len` 0 or above the model's positions, a bucket outside
    /// `1..=slots`, `steps_per_launch` 0, more than four end tokens, or an end token outside
    /// the vocabulary.
    pub fn new(
        stream: &mut Stream,
        decoder: Arc<Decoder>,
        opts: GenerationOptions,
    ) -> Result<Self> {
        let vocab = decoder.vocab();
        let limit = decoder.positions_limit();
        let sizes = checked_buckets(&opts, (decoder.max_positions(), &limit), vocab)?;
        let n = opts.slots;
        let q: &Stream = stream;
        let cache = decoder.new_cache(q, n, opts.max_len)?;
        let sampler = Sampler::new(q, n, vocab)?;
        let state = DecodeState::new(q, n, opts.max_len, &opts.eos)?;
        let gen = Generator::new(q, opts.seed)?;
        let slot_ids: Vec<i32> = (0..n as i32).collect();
        let mut g = Self {
            cache,
            sampler,
            state,
            gen,
            ids: q.alloc_zeroed::<i32>(n)?,
            positions: q.alloc_zeroed::<i32>(n)?,
            slot_of_row: q.alloc_from_host(&slot_ids)?,
            logits: q.alloc_zeroed::<f32>(n.checked_mul(vocab).ok_or_else(|| {
                invalid(format!("generation: {n} slots × {vocab} logits overflow"))
            })?)?,
            tokens: q.alloc_zeroed::<i32>(n)?,
            graphs: BTreeMap::new(),
            sizes,
            occupied: vec![false; n],
            decoder,
            opts,
            stats: GenerationStats::default(),
        };
        // Every slot starts finished (`DecodeState::new`): a step over a free slot changes
        // nothing.
        if g.opts.graphs {
            // One eager forward per bucket first: the engine registry measures the step's
            // products outside the capture (a capture runs what was measured). Only the
            // forward: sampling would move the generator, so that graphed and eager
            // generation would draw different numbers.
            for &size in &g.sizes {
                g.forward_step(q, size)?;
            }
            q.synchronize()?;
            let pool = q.device().graph_pool_handle();
            if g.opts.tune {
                // The forward only, as above; its replays write the free slots' cache rows
                // and the logits, which nothing reads before a join or step rewrites them.
                let eng = Engines::get(q.device())?;
                for size in g.sizes.clone().into_iter().rev() {
                    let this = &g;
                    let r = eng.tune_graph(stream, &pool, &mut |cs| this.forward_step(cs, size))?;
                    g.stats.tune_time += r.time;
                    g.stats.retuned += r.changed.len();
                }
            }
            for size in g.sizes.clone().into_iter().rev() {
                g.capture(stream, &pool, size)?;
            }
        }
        Ok(g)
    }

    /// The model's part of the decode step for rows `0..rows`: one token per row, logits.
    fn forward_step(&self, q: &dyn Queue, rows: usize) -> Result<()> {
        let vocab = self.decoder.vocab();
        let logits = self.logits.prefix(rows * vocab)?;
        self.decoder.forward(
            q,
            &self.cache,
            &self.ids,
            &self.positions,
            &self.slot_of_row,
            (rows, 1),
            LogitsFor::Last,
            &logits,
        )
    }

    /// The decode step for rows `0..rows`: forward for one token per row, sampling, bookkeeping.
    fn step_on(&self, q: &dyn Queue, rows: usize) -> Result<()> {
        self.forward_step(q, rows)?;
        self.sampler
            .sample(q, &self.logits, rows, &self.gen, &self.tokens)?;
        self.state
            .advance(q, &self.tokens, rows, &self.ids, &self.positions)
    }

    /// Up to `steps_per_launch` steps for rows `0..rows`, stopping after the step in which the
    /// last row ended; eager (reads the flag after each step, a synchronisation).
    fn steps_eager(&self, s: &Stream, rows: usize) -> Result<()> {
        for i in 0..self.opts.steps_per_launch {
            self.step_on(s, rows)?;
            if i + 1 < self.opts.steps_per_launch && s.to_vec(self.state.live())?[0] == 0 {
                break;
            }
        }
        Ok(())
    }

    fn capture(&mut self, stream: &mut Stream, pool: &Pool, size: usize) -> Result<()> {
        let opts = CaptureOptions::new().pool(pool).upload(true);
        let this = &*self;
        let k = this.opts.steps_per_launch;
        let (graph, ()) = Graph::capture(stream, opts, |cs| {
            if k == 1 {
                return Ok(this.step_on(cs, size)?);
            }
            // The first step always runs (the flag may hold the last launch's 0); each step's
            // advance then says whether another is needed.
            let live = this.state.live();
            cs.fill32(live, 0, 1, 1u32)?;
            cs.while_loop_capped(live, k, |body| Ok(this.step_on(body, size)?))
        })
        .map_err(NnError::from)?;
        let info = graph.info();
        self.stats.capture_time += info.capture_time + info.instantiate_time;
        self.stats.graph_bytes = self.stats.graph_bytes.max(info.memory.peak_allocated);
        self.graphs.insert(size, graph);
        Ok(())
    }

    /// The decoder.
    pub fn decoder(&self) -> &Arc<Decoder> {
        &self.decoder
    }

    /// Capture and step counts, capture time and the steps' pool memory.
    pub fn stats(&self) -> GenerationStats {
        GenerationStats {
            graphs: self.graphs.len(),
            ..self.stats
        }
    }

    /// The batch sizes with a captured step.
    pub fn buckets(&self) -> &[usize] {
        &self.sizes
    }

    /// Slots free for a new sequence.
    pub fn free_slots(&self) -> usize {
        self.occupied.iter().filter(|o| !**o).count()
    }

    /// Starts `requests` in free slots (lowest first) and returns their slots: their prompts
    /// (all but each one's last token) are prefilled together in one eager forward, rows padded
    /// to the longest prompt (padding writes only cache positions the sequence overwrites
    /// before it reads them). Checked first, nothing runs on error: an empty prompt, a token
    /// outside the vocabulary, `max_new` 0, a prompt and `max_new` longer than `max_len`, bad
    /// sampling settings, or more requests than free slots.
    pub fn join(&mut self, s: &Stream, requests: &[Request]) -> Result<Vec<usize>> {
        let vocab = self.decoder.vocab();
        for (i, r) in requests.iter().enumerate() {
            if r.prompt.is_empty() || r.max_new == 0 {
                return Err(invalid(format!(
                    "generation: request {i} has an empty prompt or max_new 0"
                )));
            }
            if let Some(&bad) = r.prompt.iter().find(|&&t| t < 0 || t as usize >= vocab) {
                return Err(invalid(format!(
                    "generation: request {i}: token {bad} is outside the vocabulary of {vocab}"
                )));
            }
            if r.prompt.len() + r.max_new > self.opts.max_len {
                return Err(invalid(format!(
                    "generation: request {i}: prompt {} + max_new {} exceeds max_len {}",
                    r.prompt.len(),
                    r.max_new,
                    self.opts.max_len
                )));
            }
            r.sampling.validate()?;
        }
        let free: Vec<usize> = (0..self.opts.slots)
            .filter(|&i| !self.occupied[i])
            .take(requests.len())
            .collect();
        if free.len() < requests.len() {
            return Err(invalid(format!(
                "generation: {} requests for {} free slots",
                requests.len(),
                free.len()
            )));
        }
        // Prefill the tokens before each prompt's last one, rows padded to the longest.
        let longest = requests
            .iter()
            .map(|r| r.prompt.len() - 1)
            .max()
            .unwrap_or(0);
        if longest > 0 {
            let rows = requests.len();
            let mut ids = Vec::with_capacity(rows * longest);
            let mut pos = Vec::with_capacity(rows * longest);
            for r in requests {
                let body = &r.prompt[..r.prompt.len() - 1];
                for t in 0..longest {
                    ids.push(body.get(t).copied().unwrap_or(0));
                    // Padding continues the positions past the body: those cache positions
                    // are written again by the sequence's own steps before it reads them.
                    pos.push(t as i32);
                }
            }
            let slots: Vec<i32> = free.iter().map(|&i| i as i32).collect();
            let ids = s.alloc_from_host(&ids)?;
            let pos = s.alloc_from_host(&pos)?;
            let slots = s.alloc_from_host(&slots)?;
            let scratch = s.alloc::<f32>(rows * vocab)?;
            self.decoder.forward(
                s,
                &self.cache,
                &ids,
                &pos,
                &slots,
                (rows, longest),
                LogitsFor::Last,
                &scratch,
            )?;
        }
        for (r, &slot) in requests.iter().zip(&free) {
            let last = r.prompt.len() - 1;
            let one_id = s.alloc_from_host(&[r.prompt[last]])?;
            let one_pos = s.alloc_from_host(&[last as i32])?;
            s.copy_range(&one_id, 0, &self.ids, slot, 1)?;
            s.copy_range(&one_pos, 0, &self.positions, slot, 1)?;
            self.sampler.set(s, slot, &r.sampling)?;
            self.state
                .start_row(s, slot, r.prompt.len() as i32, r.max_new as i32)?;
            self.occupied[slot] = true;
        }
        Ok(free)
    }

    /// Ends the sequence in `slot` now (its tokens so far are dropped) and frees the slot.
    pub fn leave(&mut self, s: &Stream, slot: usize) -> Result<()> {
        if slot >= self.opts.slots {
            return Err(invalid(format!(
                "generation: slot {slot} of {}",
                self.opts.slots
            )));
        }
        self.state.stop_row(s, slot)?;
        self.occupied[slot] = false;
        Ok(())
    }

    /// One launch of decode steps for every occupied slot — one step, or up to
    /// [`GenerationOptions::steps_per_launch`], fewer when every row ends before — through the
    /// captured step of the smallest bucket that covers the highest occupied slot (eager
    /// without graphs). Nothing to do when no slot is occupied.
    pub fn step(&mut self, s: &Stream) -> Result<()> {
        let Some(highest) = self.occupied.iter().rposition(|o| *o) else {
            return Ok(());
        };
        let rows = self
            .sizes
            .iter()
            .copied()
            .find(|&b| b > highest)
            .expect("slots is the largest bucket");
        self.stats.steps += u64::from(self.opts.steps_per_launch);
        match self.graphs.get(&rows) {
            Some(g) => Ok(g.replay(s)?),
            None => self.steps_eager(s, rows),
        }
    }

    /// Reads the rows' end flags (a synchronisation) and returns the sequences that ended since
    /// the last poll, freeing their slots.
    pub fn poll(&mut self, s: &Stream) -> Result<Vec<Finished>> {
        let (finished, generated, history) = self.state.read(s)?;
        let width = self.opts.max_len;
        let mut done = Vec::new();
        for slot in 0..self.opts.slots {
            if self.occupied[slot] && finished[slot] != 0 {
                let n = generated[slot].max(0) as usize;
                let row = &history[slot * width..slot * width + n.min(width)];
                done.push(Finished {
                    slot,
                    tokens: row.to_vec(),
                });
                self.occupied[slot] = false;
            }
        }
        Ok(done)
    }

    /// Generates for `requests` (at most the free slots) until every one has ended, polling
    /// every `poll_every` launches ([`Generation::step`]); returns each request's tokens in
    /// request order.
    pub fn generate(
        &mut self,
        s: &Stream,
        requests: &[Request],
        poll_every: usize,
    ) -> Result<Vec<Vec<i32>>> {
        let slots = self.join(s, requests)?;
        let mut out: Vec<Option<Vec<i32>>> = vec![None; requests.len()];
        let mut left = requests.len();
        let most = requests.iter().map(|r| r.max_new).max().unwrap_or(0);
        let mut steps = 0usize;
        let per_poll = poll_every
            .max(1)
            .saturating_mul(self.opts.steps_per_launch as usize);
        while left > 0 {
            for _ in 0..poll_every.max(1) {
                self.step(s)?;
            }
            steps = steps.saturating_add(per_poll);
            for f in self.poll(s)? {
                if let Some(i) = slots.iter().position(|&x| x == f.slot) {
                    out[i] = Some(f.tokens);
                    left -= 1;
                }
            }
            if steps > most.saturating_add(per_poll) && left > 0 {
                return Err(NnError::Unsupported(format!(
                    "generation: {left} sequences did not end after {steps} steps"
                )));
            }
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_up_to_the_slots_or_the_given_sizes() {
        let sizes = |slots, buckets: Vec<usize>| {
            checked_buckets(
                &GenerationOptions {
                    buckets,
                    ..GenerationOptions::new(slots, 8)
                },
                (64, "the model's 64 positions"),
                97,
            )
        };
        assert_eq!(sizes(1, vec![]).unwrap(), vec![1]);
        assert_eq!(sizes(6, vec![]).unwrap(), vec![1, 2, 4, 6]);
        assert_eq!(sizes(8, vec![]).unwrap(), vec![1, 2, 4, 8]);
        assert_eq!(sizes(8, vec![3, 3, 1]).unwrap(), vec![1, 3, 8]);
        assert!(sizes(8, vec![0]).is_err());
        assert!(sizes(8, vec![9]).is_err());
    }

    #[test]
    fn bad_options_are_refused_naming_what_is_wrong() {
        let ok = GenerationOptions::new(2, 8);
        let bad = [
            (GenerationOptions::new(0, 8), "slot"),
            (GenerationOptions::new(2, 0), "max_len"),
            (GenerationOptions::new(2, 65), "max_len"),
            (
                GenerationOptions {
                    eos: vec![97],
                    ..ok.clone()
                },
                "end token 97",
            ),
            (
                GenerationOptions {
                    eos: vec![-1],
                    ..ok.clone()
                },
                "end token -1",
            ),
            (
                GenerationOptions {
                    steps_per_launch: 0,
                    ..ok.clone()
                },
                "steps_per_launch",
            ),
        ];
        for (o, what) in bad {
            let e = checked_buckets(&o, (64, "limit"), 97)
                .unwrap_err()
                .to_string();
            assert!(e.contains(what), "{o:?}: {e}");
        }
        assert!(checked_buckets(&ok, (64, "limit"), 97).is_ok());
        let o = GenerationOptions::new(1, 65);
        let e = checked_buckets(&o, (64, "the model's sliding window of 64 positions"), 97)
            .unwrap_err()
            .to_string();
        assert!(e.contains("1..=64 (the model's sliding window"), "{e}");
    }
}
