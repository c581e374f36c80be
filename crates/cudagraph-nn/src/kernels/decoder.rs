//! The decoder's fused inference kernels (`decoder.cu`, its own NVRTC module, compiled after the
//! device-check prologue and `cast.cu`), used by [`crate::serving::decoder`]: token (+ learned
//! position) embedding in one kernel, LayerNorm / RMSNorm of rows picked with a stride (the
//! last token of every row, for the output head), the split of a packed q|k|v product with the
//! rotary embedding and the key/value cache write in one kernel, and SwiGLU over a packed
//! gate|up product. One template per kernel, instantiated for f32, bf16 and f16; f32 math,
//! one rounding on store.
//!
//! Every kernel begins with `CG_PDL_ENTER()` and is launched with programmatic dependent launch
//! inside captures (unless `CUDAGRAPH_PDL=0`; see `kernels::pdl`): the next kernel of a
//! captured decode step is scheduled while this one drains, and waits for it before touching
//! memory.
//!
//! Token ids, positions and cache slots are device data (a captured step stays valid when they
//! change between replays). An id outside the vocabulary, a position outside the table or the
//! cache, or a slot outside the cache is reported through the stream's check record (a typed
//! error at the next synchronisation) and touches no memory outside the buffers.

use std::sync::{Arc, Mutex};

use cudagraph::{
    register_check, Arg, Device, DeviceBuffer, Function, LaunchConfig, Queue, QueueExt,
};

use crate::dtype::{Dtype, Float};
use crate::error::{NnError, Result};
use crate::extent::{need, prod};
use crate::kernels::attention::AttentionShape;
use crate::kernels::pdl::{launch_decode, launch_decode_in};
use crate::kernels::{grid_stride, int, int_loop, ByType};

/// Every kernel of the module, without its type suffix.
#[cfg(any(test, feature = "internals"))]
pub const KERNELS: [&str; 5] = [
    "dec_embed",
    "dec_norm",
    "dec_qkv",
    "dec_swiglu",
    "dec_attend_p4",
];

/// Every kernel of an attention module of one head dimension ([`attend_source`]), without its
/// type suffix.
#[cfg(any(test, feature = "internals"))]
pub const ATTEND_KERNELS: [&str; 5] = [
    "dec_attend_v1",
    "dec_attend_v2",
    "dec_attend_v4",
    "dec_attend_v4o",
    "dec_attend_v1o",
];

/// Threads of the norm kernel (`DEC_ROW_THREADS`).
const ROW_THREADS: u32 = 256;
/// Threads of the attention kernel (`DS_THREADS`).
const ATTEND_THREADS: u32 = 128;

/// The CUDA source of the module.
pub fn source() -> String {
    format!(
        "{}{}{}{}{}{}",
        cudagraph::PDL_CUDA,
        cudagraph::DEVICE_CHECK_CUDA,
        super::cast::SOURCE,
        include_str!("cluster.cu"),
        include_str!("rowops.cu"),
        include_str!("decoder.cu")
    )
}

/// The name and CUDA source of the attention module of head dimension `head_dim` and element
/// type `dtype`: the module's source with `DS_HEAD_DIM` and the type defined, which compiles
/// the 16-byte attention instances of that type alone, for rows of exactly that many elements.
/// With the head dimension a constant the lane layout, the loops over a row and each dot
/// product's shuffles are resolved at compile time (on the H100, ncu: GPT-2 small's attention
/// at batch 1 after 128 tokens 10.8 → 8.6 µs, a Llama-shaped model's at batch 64 after 1024
/// tokens 162 → 109 µs).
pub fn attend_source(head_dim: usize, dtype: Dtype) -> (String, String) {
    let (t, suffix) = match dtype {
        Dtype::F32 => ("float", "f32"),
        Dtype::Bf16 => ("bf16_t", "bf16"),
        Dtype::F16 => ("f16_t", "f16"),
    };
    (
        format!("cudagraph_nn_decoder_attend_d{head_dim}_{suffix}"),
        format!(
            "#define DS_HEAD_DIM {head_dim}\n#define DS_ATTEND_T {t}\n#define DS_ATTEND_S \
             {suffix}\n{}",
            source()
        ),
    )
}

/// The geometry of one packed q|k|v split ([`DecoderKernels::qkv`]): `rows · tokens` tokens of
/// `heads + 2 · kv_heads` heads of `head_dim` components, into caches of `slots` slots of
/// `max_len` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvDims {
    /// Rows (sequences) of the call.
    pub rows: usize,
    /// Tokens per row.
    pub tokens: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Components per head (even).
    pub head_dim: usize,
    /// Slots of the caches.
    pub slots: usize,
    /// Positions per slot.
    pub max_len: usize,
}

impl QkvDims {
    /// `(packed len, query len, cache len)`, checked (every size positive, `head_dim` even,
    /// sizes within the kernel's ints).
    pub fn lens(&self) -> Result<(usize, usize, usize)> {
        let d = self;
        if [
            d.rows, d.tokens, d.heads, d.kv_heads, d.head_dim, d.slots, d.max_len,
        ]
        .contains(&0)
            || d.head_dim % 2 != 0
        {
            return Err(NnError::Shape(format!(
                "decoder qkv: every size positive and head_dim even in {d:?}"
            )));
        }
        let n = prod("decoder qkv tokens", &[d.rows, d.tokens])?;
        let all = d.heads + 2 * d.kv_heads;
        for (w, v) in [
            ("tokens", n),
            ("heads", all),
            ("head_dim", d.head_dim),
            ("slots", d.slots),
            ("max_len", d.max_len),
        ] {
            int(w, v)?;
        }
        Ok((
            prod("decoder qkv", &[n, all, d.head_dim])?,
            prod("decoder queries", &[n, d.heads, d.head_dim])?,
            prod(
                "decoder cache",
                &[d.slots, d.kv_heads, d.max_len, d.head_dim],
            )?,
        ))
    }
}

/// The 16-byte attention kernels of one head dimension and type: one, two and up to four query
/// heads a block, then up to four held to four blocks a multiprocessor and one held to eight.
type AttendVector = Arc<[Function; 5]>;

/// The decoder kernels of one device (a [`Device::extension`]).
pub struct DecoderKernels {
    embed: ByType,
    norm: ByType,
    qkv: ByType,
    swiglu: ByType,
    /// 16-byte loads ([`AttendVector`]) by head dimension and type (compiled on first use,
    /// [`attend_source`]).
    attend_v: Mutex<Vec<((usize, Dtype), AttendVector)>>,
    /// Pair loads, up to four query heads a block.
    attend_p: ByType,
    id_check: u32,
    pos_check: u32,
    cache_pos_check: u32,
    slot_check: u32,
}

impl DecoderKernels {
    /// The kernels of `device`, compiled on first use.
    pub fn get(device: &Device) -> Result<Arc<Self>> {
        Ok(device.extension(|d| {
            let m = cudagraph::runtime::with_relaxed_capture(|| {
                d.compile(
                    "cudagraph_nn_decoder",
                    &super::module_source("cudagraph_nn_decoder"),
                )
            })?;
            Ok(DecoderKernels {
                embed: ByType::load(&m, "dec_embed")?,
                norm: ByType::load(&m, "dec_norm")?,
                qkv: ByType::load(&m, "dec_qkv")?,
                swiglu: ByType::load(&m, "dec_swiglu")?,
                attend_v: Mutex::new(Vec::new()),
                attend_p: ByType::load(&m, "dec_attend_p4")?,
                id_check: register_check("decoder token id"),
                pos_check: register_check("decoder position embedding"),
                cache_pos_check: register_check("attention position"),
                slot_check: register_check("attention cache slot"),
            })
        })?)
    }

    /// The 16-byte attention kernels for rows of `head_dim` elements of `T` ([`AttendVector`]),
    /// compiling their module on the first call for that head dimension and type.
    fn attend_vector<T: Float>(&self, device: &Device, head_dim: usize) -> Result<AttendVector> {
        let key = (head_dim, T::DTYPE);
        let mut all = self.attend_v.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, k)) = all.iter().find(|(d, _)| *d == key) {
            return Ok(k.clone());
        }
        let (name, src) = attend_source(head_dim, T::DTYPE);
        let m = cudagraph::runtime::with_relaxed_capture(|| device.compile(&name, &src))?;
        let f = |k: &str| m.function(&format!("{k}_{}", T::DTYPE.name()));
        let k = Arc::new([
            f("dec_attend_v1")?,
            f("dec_attend_v2")?,
            f("dec_attend_v4")?,
            f("dec_attend_v4o")?,
            f("dec_attend_v1o")?,
        ]);
        all.push((key, k.clone()));
        Ok(k)
    }

    /// `y[t, :] = wte[ids[t], :]` (`+ wpe[pos[t], :]` with `wpe`) for `t < tokens`
    /// (`wte: [vocab, dim]`, `wpe: [npos, dim]`). Launched without programmatic dependent
    /// launch: it begins a forward, and starts only when everything before it on `q` is
    /// done, so the forward's later kernels may read what that work wrote before their wait
    /// (see [`Self::attend_qkv_early`]).
    #[allow(clippy::too_many_arguments)]
    pub fn embed<T: Float>(
        &self,
        q: &dyn Queue,
        ids: &DeviceBuffer<i32>,
        wte: &DeviceBuffer<T>,
        wpe: Option<(&DeviceBuffer<T>, &DeviceBuffer<i32>, usize)>,
        y: &DeviceBuffer<T>,
        (tokens, dim, vocab): (usize, usize, usize),
    ) -> Result<()> {
        let n = prod("decoder embedding", &[tokens, dim])?;
        need("decoder token ids", ids, tokens)?;
        need("decoder token embedding", wte, prod("wte", &[vocab, dim])?)?;
        need("decoder embedding output", y, n)?;
        let npos = match wpe {
            Some((w, pos, npos)) => {
                need("decoder position embedding", w, prod("wpe", &[npos, dim])?)?;
                need("decoder positions", pos, tokens)?;
                npos
            }
            None => 0,
        };
        if n == 0 {
            return Ok(());
        }
        let args = [
            ids.into(),
            wte.into(),
            Arg::opt(wpe.map(|w| w.0)),
            Arg::opt(wpe.map(|w| w.1)),
            y.into(),
            Arg::I32(int("decoder tokens", tokens)?),
            Arg::I32(int("decoder width", dim)?),
            Arg::I32(int("decoder vocabulary", vocab)?),
            Arg::I32(int("decoder positions", npos)?),
            q.check_flag_arg()?,
            Arg::U32(self.id_check),
            Arg::U32(self.pos_check),
        ];
        // SAFETY: dec_embed_*(ids, wte, wpe, pos, y, tokens, dim, vocab, npos, flag, id_check,
        // pos_check) runs i < tokens·dim (y's extent, checked), reads ids[t] (t < tokens,
        // checked), wte[id·dim + c] only for 0 ≤ id < vocab (vocab·dim checked) and, with wpe
        // (not null only with pos), pos[t] and wpe[p·dim + c] only for 0 ≤ p < npos (checked);
        // sizes fit int (checked), the element index is long long. A plain launch: its
        // CG_PDL_ENTER() does nothing then.
        unsafe {
            q.launch(
                self.embed.of::<T>("decoder embedding")?,
                grid_stride(n),
                &args,
            )?;
        }
        Ok(())
    }

    /// `y[r, :]` = LayerNorm (`b` given or not, `rms` false) or RMSNorm (`rms`, no bias) of
    /// row `r · stride + off` of `x` (`[·, cols]`), for `r < rows`; `w`, `b`: `[cols]` f32.
    /// With `add` (laid out as `x`), that row of `add` is first added into `x`'s — the sum
    /// rounded to `T` and written back into `x` (the residual add) — and the sum is
    /// normalised; rows of `x` that are not picked are left as they are.
    #[allow(clippy::too_many_arguments)]
    pub fn norm<T: Float>(
        &self,
        q: &dyn Queue,
        x: &DeviceBuffer<T>,
        add: Option<&DeviceBuffer<T>>,
        (w, b): (&DeviceBuffer<f32>, Option<&DeviceBuffer<f32>>),
        y: &DeviceBuffer<T>,
        (rows, cols): (usize, usize),
        (stride, off): (usize, usize),
        (eps, rms): (f32, bool),
    ) -> Result<()> {
        if rows == 0 || cols == 0 || stride == 0 || off >= stride {
            return Err(NnError::Shape(format!(
                "decoder norm: {rows} rows of {cols}, stride {stride}, offset {off}"
            )));
        }
        // The last row read is (rows - 1)·stride + off.
        let x_rows = (rows - 1)
            .checked_mul(stride)
            .and_then(|v| v.checked_add(off + 1))
            .ok_or_else(|| NnError::Shape("decoder norm: rows overflow".into()))?;
        need(
            "decoder norm input",
            x,
            prod("decoder norm input", &[x_rows, cols])?,
        )?;
        need(
            "decoder norm output",
            y,
            prod("decoder norm output", &[rows, cols])?,
        )?;
        if let Some(a) = add {
            need(
                "decoder norm residual",
                a,
                prod("decoder norm residual", &[x_rows, cols])?,
            )?;
        }
        need("decoder norm weight", w, cols)?;
        if let Some(b) = b {
            if rms {
                return Err(NnError::Shape("decoder norm: RMSNorm has no bias".into()));
            }
            need("decoder norm bias", b, cols)?;
        }
        let grid = u32::try_from(rows)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| NnError::Shape(format!("decoder norm: {rows} rows exceed the grid")))?;
        let args = [
            x.into(),
            Arg::opt(add),
            w.into(),
            Arg::opt(b),
            y.into(),
            Arg::I32(int_loop("decoder norm cols", cols, ROW_THREADS as usize)?),
            Arg::F32(eps),
            Arg::I32(rms as i32),
            Arg::I32(int("decoder norm stride", stride)?),
            Arg::I32(int("decoder norm offset", off)?),
        ];
        // SAFETY: dec_norm_*(x, a, w, b, y, cols, eps, rms, stride, off): block r < rows
        // reads x[(r·stride + off)·cols + c] (below x_rows·cols, checked) and, with a (null:
        // not read), a at the same index (x_rows·cols checked) and then writes that element of
        // x (each element by the one thread that reads it), w[c], b[c] (b null: not read) and
        // writes y[r·cols + c] for c < cols (rows·cols checked); 256 threads, the kernel's
        // shared array; cols plus the loop step within int.
        unsafe {
            launch_decode(
                q,
                self.norm.of::<T>("decoder norm")?,
                LaunchConfig::linear(grid, ROW_THREADS),
                &args,
            )
        }
    }

    /// Splits `qkv` (`[rows·tokens, heads + 2·kv_heads, head_dim]`) into `q_out`
    /// (`[rows·tokens, heads, head_dim]`) and the caches (`[slots, kv_heads, max_len,
    /// head_dim]`) at slot `slots[b]` and position `positions[n]`; with `inv_freq`
    /// (`head_dim / 2` frequencies) queries and keys are rotated (rotate-half).
    #[allow(clippy::too_many_arguments)]
    pub fn qkv<T: Float>(
        &self,
        q: &dyn Queue,
        d: &QkvDims,
        qkv: &DeviceBuffer<T>,
        inv_freq: Option<&DeviceBuffer<f32>>,
        (positions, slots): (&DeviceBuffer<i32>, &DeviceBuffer<i32>),
        q_out: &DeviceBuffer<T>,
        (k_cache, v_cache): (&DeviceBuffer<T>, &DeviceBuffer<T>),
    ) -> Result<()> {
        let (pl, ql, cl) = d.lens()?;
        need("decoder qkv", qkv, pl)?;
        need("decoder queries", q_out, ql)?;
        need("decoder key cache", k_cache, cl)?;
        need("decoder value cache", v_cache, cl)?;
        need("decoder positions", positions, d.rows * d.tokens)?;
        need("decoder cache slots", slots, d.rows)?;
        if let Some(f) = inv_freq {
            need("decoder rotary frequencies", f, d.head_dim / 2)?;
        }
        let i = |v: usize| Arg::I32(v as i32);
        let args = [
            qkv.into(),
            Arg::opt(inv_freq),
            positions.into(),
            slots.into(),
            q_out.into(),
            k_cache.into(),
            v_cache.into(),
            i(d.rows * d.tokens),
            i(d.tokens),
            i(d.heads),
            i(d.kv_heads),
            i(d.head_dim),
            i(d.slots),
            i(d.max_len),
            q.check_flag_arg()?,
            Arg::U32(self.cache_pos_check),
            Arg::U32(self.slot_check),
        ];
        // SAFETY: dec_qkv_*(qkv, inv_freq, pos, slot, q_out, kc, vc, N, Tq, H, Hkv, D, S, Tmax,
        // flag, pos_check, slot_check) runs i < N·(H + 2Hkv)·D/2; thread (n, hh, j) reads
        // qkv[(n·(H+2Hkv) + hh)·D + j (+ D/2)] (< pl, checked), pos[n] (N checked), slot[n/Tq]
        // (rows checked), inv_freq[j] (j < D/2, checked when not null), writes q_out at
        // (n·H + hh)·D + j (+ D/2) (< ql, checked) or the caches at ((sl·Hkv + kvh)·Tmax + p)·D
        // + j (+ D/2) only for 0 ≤ sl < S, 0 ≤ p < Tmax (< cl, checked); every size fits int
        // (checked), the element index is long long; D even (checked).
        unsafe {
            launch_decode(
                q,
                self.qkv.of::<T>("decoder qkv")?,
                grid_stride(pl / 2),
                &args,
            )
        }
    }

    /// `y[r, c] = silu(gu[r, c]) · gu[r, m + c]` for `gu: [rows, 2m]`, `y: [rows, m]`.
    pub fn swiglu<T: Float>(
        &self,
        q: &dyn Queue,
        gu: &DeviceBuffer<T>,
        y: &DeviceBuffer<T>,
        (rows, m): (usize, usize),
    ) -> Result<()> {
        let n = prod("decoder swiglu", &[rows, m])?;
        need(
            "decoder swiglu input",
            gu,
            prod("decoder swiglu input", &[n, 2])?,
        )?;
        need("decoder swiglu output", y, n)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gu.into(),
            y.into(),
            Arg::I32(int("decoder swiglu rows", rows)?),
            Arg::I32(int("decoder swiglu width", prod("decoder swiglu", &[m, 2])?)? / 2),
        ];
        // SAFETY: dec_swiglu_*(gu, y, N, M) runs i < N·M (y's extent, checked), reads
        // gu[r·2M + c] and gu[r·2M + M + c] for r < N, c < M (2·N·M checked); N and 2M fit int.
        unsafe {
            launch_decode(
                q,
                self.swiglu.of::<T>("decoder swiglu")?,
                grid_stride(n),
                &args,
            )
        }
    }
}

/// The f32 partial sums, (max, sum) pairs and arrival counters a split attention
/// ([`DecoderKernels::attend`]) merges through; [`DecoderKernels::attend_scratch`] sizes them
/// for one shape (reusable by every call of that shape on the stream it was made on, one call
/// at a time: the counters are zero between calls).
pub struct AttendScratch {
    splits: usize,
    groups: usize,
    /// Few blocks (see [`few_blocks`]): the splits of one token and head group form a
    /// thread-block cluster and merge through distributed shared memory (sm_90+; `part`,
    /// `stat` and `count` are then unused), and one-token steps read early where the caller
    /// allows it.
    few: bool,
    /// More blocks than the device holds at once of the kernel with its full registers: the
    /// instances held to fewer registers (`v4o`, `v1o`) run them.
    waves: bool,
    part: DeviceBuffer<f32>,
    stat: DeviceBuffer<f32>,
    count: DeviceBuffer<u32>,
}

impl AttendScratch {
    /// Whether its shape's attention has more blocks than the device holds at once of the
    /// kernel with its full registers, so that the instances held to fewer registers run it.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    pub fn waves(&self) -> bool {
        self.waves
    }
}

/// Query heads one attention block serves at most (the `GM` of `dec_attend_v4`/`_p4`; the one-
/// and two-head instances serve key/value heads shared by that many query heads).
const ATTEND_HEADS: usize = 4;
/// Valid keys per split in use (`DS_SPLIT_KEYS`: the kernel uses at most one split per this
/// many valid keys, so a cache of `max_len` positions never uses more than
/// `ceil(max_len / SPLIT_KEYS)`).
const SPLIT_KEYS: usize = 64;
/// Keys a split holds at most when the cache is full, unless `MAX_SPLITS` caps it.
const LONG_SPLIT_KEYS: usize = 256;
/// The most splits along the keys (`DS_MAX_SPLITS`).
const MAX_SPLITS: usize = 64;
/// The most splits along the keys when they merge inside a thread-block cluster
/// (`DS_MAX_CLUSTER`, the portable cluster size).
const MAX_CLUSTER_SPLITS: usize = 8;
/// The most (token, head group) pairs of an attention with few blocks that does not split.
const FEW_PAIRS: usize = 16;

/// (token, head group) pairs of `s`: the attention's blocks per split. Below 2⁶³ for a shape
/// `AttentionShape::validate` accepts (at most the query's length).
fn pairs(s: &AttentionShape) -> usize {
    s.batch * s.tokens * s.kv_heads * head_groups(s)
}

/// Which of an [`AttendVector`]'s instances serves `per_kv` query heads per key/value head:
/// one, two or up to four heads a block, held to fewer registers (`v1o`, `v4o`) where the grid
/// is more than the device holds at once (`waves`).
fn vector_instance(per_kv: usize, waves: bool) -> usize {
    match per_kv.min(3) {
        3 if waves => 3,
        1 if waves => 4,
        n => n - 1,
    }
}

/// Blocks of one key/value head per token: `ceil((heads / kv_heads) / ATTEND_HEADS)`.
fn head_groups(s: &AttentionShape) -> usize {
    (s.heads / s.kv_heads).div_ceil(ATTEND_HEADS)
}

/// Splits along the keys for `s` on a device of `sms` multiprocessors: enough for four blocks
/// a multiprocessor, and enough that a full cache gives no split more than `LONG_SPLIT_KEYS`
/// keys; at most one per `SPLIT_KEYS` keys of the cache (more would never be used: blocks that
/// only idle, and in a cluster wait at its barriers) and `MAX_SPLITS`. Host data only, so a
/// captured step keeps its split while the cache grows (the kernel spreads the valid keys over
/// it).
pub fn attend_splits(sms: usize, s: &AttentionShape) -> usize {
    (4 * sms.max(1) / pairs(s))
        .max(s.max_len.div_ceil(LONG_SPLIT_KEYS))
        .min(s.max_len.div_ceil(SPLIT_KEYS))
        .clamp(1, MAX_SPLITS)
}

/// Whether an attention of `s` split `splits` ways has few blocks, on a device that holds
/// `resident` blocks of its kernel at once: every block resident at once (one wave), at most
/// `MAX_CLUSTER_SPLITS` splits (a short cache), and a split — or, unsplit, at most `FEW_PAIRS`
/// (token, head group) pairs. Such a step is bound by its chain of memory round trips, not by
/// bandwidth, so there the splits merge inside a thread-block cluster (a barrier instead of a
/// fence, a counter and two reads of global memory) and one-token steps read early. Measured
/// on the H100 (ours, ms per step, two rounds in one call): faster in one wave (GPT-2 small
/// after 128 tokens at batch 1 0.367 / 0.375 → 0.341 / 0.340, at batch 8 0.470 / 0.469 → 0.443
/// / 0.443, after 1024 tokens at batch 8 0.573 / 0.574 → 0.545 / 0.545; the Llama-shaped
/// model after 128 tokens at batch 8 1.427 / 1.422 → 1.343 / 1.341), slower beyond it (the
/// Llama-shaped model after 1024 tokens at batch 8, 512 blocks where 396 fit, 1.567 / 1.572 →
/// 1.670 / 1.677; after 128 tokens at batch 32 1.553 → 1.617; GPT-2 small after 1024 tokens at
/// batch 32 1.021 → 1.086: a cluster's blocks hold their multiprocessors until its slowest
/// block has merged) or with more splits than a cluster holds (the Llama-shaped model at batch
/// 1 after 1024 tokens 1.365 → 1.399). Unsplit, only the early reads remain, and with many
/// blocks they measured no faster (GPT-2 small at batch 32 after 128 tokens 0.537 → 0.540).
pub fn few_blocks(s: &AttentionShape, splits: usize, resident: usize) -> bool {
    splits <= MAX_CLUSTER_SPLITS
        && !beyond_one_wave(s, splits, resident)
        && (splits > 1 || pairs(s) <= FEW_PAIRS)
}

/// Whether the grid of `shape` split `splits` ways is more blocks than the device holds at once
/// (`resident`): more than one wave ([`AttendScratch::waves`]).
fn beyond_one_wave(s: &AttentionShape, splits: usize, resident: usize) -> bool {
    pairs(s).saturating_mul(splits) > resident
}

/// Whether a one-token step split `splits` ways reads its first keys before its wait (where
/// the caller allows it): with few blocks (`few`, [`few_blocks`] on a device with clusters),
/// and with the keys split and every block resident at once (not `waves`) — one wave of more
/// splits than a cluster holds, merged through global memory (H100, batch 1 after 1024
/// tokens: GPT-2 small 0.346 → 0.330 ms, the Llama-shaped model 1.273 → 1.242). Unsplit
/// shapes of many blocks read after their wait: early reads measured no faster there.
fn early_reads(few: bool, splits: usize, waves: bool) -> bool {
    few || (splits > 1 && !waves)
}

/// Which instance of the attention kernel serves `head_dim` for `T` over buffers at `addrs`
/// (the query and the caches): the one with 16-byte loads (`true`) when rows are a whole
/// number of them (at most 32 lanes of one or two loads) and every buffer is 16-byte aligned,
/// the one with pair loads otherwise (at most 32 lanes of four pairs, buffers aligned to two
/// elements); an error for odd or larger head dimensions and for buffers not aligned to two
/// elements.
fn vector_loads<T: Float>(head_dim: usize, addrs: &[u64]) -> Result<bool> {
    let size = std::mem::size_of::<T>();
    let per_load = 16 / size;
    let loads_per_lane = if per_load == 4 { 2 } else { 1 };
    let aligned = |bytes: usize| addrs.iter().all(|a| a % bytes as u64 == 0);
    if head_dim % per_load == 0 && head_dim / per_load <= 32 * loads_per_lane && aligned(16) {
        return Ok(true);
    }
    if head_dim % 2 != 0 || head_dim / 2 > 32 * 4 {
        return Err(NnError::Shape(format!(
            "decoder attention: head dimension {head_dim} (even, at most 256)"
        )));
    }
    if !aligned(2 * size) {
        return Err(NnError::Shape(format!(
            "decoder attention: the query and caches (at {addrs:#x?}) must be aligned to two \
             elements ({} bytes)",
            2 * size
        )));
    }
    Ok(false)
}

impl DecoderKernels {
    /// The scratch of a split attention of `shape` over elements of `T` on `q` (the splits
    /// from [`attend_splits`] and the device's multiprocessors; on sm_90+ the splits of a
    /// token merge inside a thread-block cluster where [`few_blocks`]; the instance that runs
    /// it from whether its grid fits the device at once, [`AttendScratch::waves`] — so this
    /// compiles the attention module of the head dimension on its first call), from `q`'s
    /// allocator; the counters are zeroed on `q`. No memory when the attention does not split
    /// or the splits merge in a cluster.
    pub fn attend_scratch<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &AttentionShape,
    ) -> Result<AttendScratch> {
        shape.validate()?;
        let sms = q.device().info().multiprocessors as usize;
        let splits = attend_splits(sms, shape);
        // The blocks the device holds at once of the instance with its full registers (the
        // one-, two- or four-head one of 16-byte loads where the head dimension allows them).
        let kernel = if vector_loads::<T>(shape.head_dim, &[])? {
            let v = self.attend_vector::<T>(q.device(), shape.head_dim)?;
            v[vector_instance(shape.heads / shape.kv_heads, false)].clone()
        } else {
            self.attend_p.of::<T>("decoder attention")?.clone()
        };
        let resident = sms * kernel.max_active_blocks(ATTEND_THREADS, 0)? as usize;
        let few = q.device().supports_clusters() && few_blocks(shape, splits, resident);
        let groups = shape.kv_heads * head_groups(shape);
        let tokens = prod("attention tokens", &[shape.batch, shape.tokens])?;
        let (parts, stats, counts) = if splits == 1 || few {
            (1, 1, 1)
        } else {
            let rows = prod("attention rows", &[tokens, shape.heads, splits])?;
            (
                prod("attention partial sums", &[rows, shape.head_dim])?,
                prod("attention partial maxima", &[rows, 2])?,
                prod("attention counters", &[tokens, groups])?,
            )
        };
        let count = q.alloc::<u32>(counts)?;
        if splits > 1 && !few {
            q.memset_zero(&count)?;
        }
        Ok(AttendScratch {
            splits,
            groups,
            few,
            waves: beyond_one_wave(shape, splits, resident),
            part: q.alloc::<f32>(parts)?,
            stat: q.alloc::<f32>(stats)?,
            count,
        })
    }

    /// `out = softmax(q·kᵀ · scale) · v` per query token and head over the positions
    /// `0..=positions[b·tokens + t]` of the slot `slots[b]`: the result of
    /// [`AttentionKernels::attend`](crate::kernels::attention::AttentionKernels::attend) (same
    /// layouts, checks and reports), computed by blocks that read each key and value row once
    /// for the query heads sharing it and split the keys `scratch.splits()` ways, merged by the
    /// last block of each token to finish (flash decoding). `scratch` comes from
    /// [`Self::attend_scratch`] for this shape.
    #[allow(clippy::too_many_arguments)]
    pub fn attend<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &AttentionShape,
        query: &DeviceBuffer<T>,
        caches: (&DeviceBuffer<T>, &DeviceBuffer<T>),
        at: (&DeviceBuffer<i32>, &DeviceBuffer<i32>),
        out: &DeviceBuffer<T>,
        scale: f32,
        scratch: &AttendScratch,
    ) -> Result<()> {
        shape.validate()?;
        shape.check_buffers(query, out, caches, at.0)?;
        let io = (query, None);
        // SAFETY: not early: the kernel waits for the previous kernel before any memory access.
        unsafe { self.launch_attend(q, shape, io, caches, at, out, scale, scratch, false) }
    }

    /// [`Self::qkv`] followed by [`Self::attend`] in one kernel, for steps of one token a row
    /// (`shape.tokens == 1`, else a `Shape` error): reads the packed product `qkv`
    /// (`[rows, heads + 2·kv_heads, head_dim]`), writes each row's key and value (rotated with
    /// `inv_freq` as [`Self::qkv`] does) into the caches at its slot and position and attends
    /// over the slot's positions up to it. The same bits as the two calls.
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    pub fn attend_qkv<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &AttentionShape,
        qkv: &DeviceBuffer<T>,
        inv_freq: Option<&DeviceBuffer<f32>>,
        caches: (&DeviceBuffer<T>, &DeviceBuffer<T>),
        at: (&DeviceBuffer<i32>, &DeviceBuffer<i32>),
        out: &DeviceBuffer<T>,
        scale: f32,
        scratch: &AttendScratch,
    ) -> Result<()> {
        let (f, c) = (inv_freq, caches);
        // SAFETY: not early: the kernel waits for the previous kernel before any memory access.
        unsafe { self.attend_qkv_early(q, shape, qkv, f, c, at, out, scale, scratch, false) }
    }

    /// [`Self::attend_qkv`]; with `early`, where the shape has few blocks ([`few_blocks`]) or
    /// splits the keys in one wave (other shapes ignore it), each block reads its token's
    /// position and slot, the rotary frequencies and its first cache rows before it waits for
    /// the previous kernel (programmatic dependent launch), so that those reads overlap that
    /// kernel's end. The same bits either way.
    ///
    /// # Safety
    /// With `early`: no kernel that can still be running when this one starts writes the
    /// positions or slots of `at`, `inv_freq`, or the cache rows of a row's slot below the
    /// row's position. A kernel launched with PDL starts while the kernel before it runs, and
    /// that one may have started before its own predecessor finished, so the guarantee comes
    /// from the work since the last kernel launched without PDL on `q`: none of it may write
    /// those (the decoder's forward launches its embedding that way and writes none of them
    /// before attention).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_qkv_early<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &AttentionShape,
        qkv: &DeviceBuffer<T>,
        inv_freq: Option<&DeviceBuffer<f32>>,
        caches: (&DeviceBuffer<T>, &DeviceBuffer<T>),
        at: (&DeviceBuffer<i32>, &DeviceBuffer<i32>),
        out: &DeviceBuffer<T>,
        scale: f32,
        scratch: &AttendScratch,
        early: bool,
    ) -> Result<()> {
        if shape.tokens != 1 {
            return Err(NnError::Shape(format!(
                "decoder attention over the packed q|k|v product: one token a row, not {} \
                 (split the product with DecoderKernels::qkv, then attend)",
                shape.tokens
            )));
        }
        shape.validate()?;
        // The output has the queries' length; the packed product is checked below.
        shape.check_buffers(out, out, caches, at.0)?;
        let s = shape;
        let packed = prod(
            "decoder qkv",
            &[s.batch, s.heads + 2 * s.kv_heads, s.head_dim],
        )?;
        need("decoder qkv", qkv, packed)?;
        if let Some(f) = inv_freq {
            need("decoder rotary frequencies", f, s.head_dim / 2)?;
        }
        let fresh = (qkv, Some(inv_freq));
        // SAFETY: the caller's promise for `early`.
        unsafe { self.launch_attend(q, shape, fresh, caches, at, out, scale, scratch, early) }
    }

    /// The attention kernel over `query` (`[tokens, heads, head_dim]`) or, with
    /// `Some(inv_freq)`, over the packed one-token q|k|v product, for a shape and buffers the
    /// caller validated and checked: the remaining checks and the launch.
    ///
    /// # Safety
    /// With `early` (only with the packed product), that of [`Self::attend_qkv_early`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_attend<T: Float>(
        &self,
        q: &dyn Queue,
        shape: &AttentionShape,
        (query, fresh): (&DeviceBuffer<T>, Option<Option<&DeviceBuffer<f32>>>),
        (k_cache, v_cache): (&DeviceBuffer<T>, &DeviceBuffer<T>),
        (positions, slots): (&DeviceBuffer<i32>, &DeviceBuffer<i32>),
        out: &DeviceBuffer<T>,
        scale: f32,
        scratch: &AttendScratch,
        early: bool,
    ) -> Result<()> {
        let pl = shape.positions_len()?;
        need("attention cache slots", slots, shape.batch)?;
        let s = shape;
        let (splits, groups) = (scratch.splits, scratch.groups);
        if groups != s.kv_heads * head_groups(s) || splits == 0 || splits > MAX_SPLITS {
            return Err(NnError::Shape(format!(
                "decoder attention: scratch of {splits} splits for {groups} head groups, made \
                 for another shape than {s:?}"
            )));
        }
        if splits > 1 && !scratch.few {
            let rows = prod("attention rows", &[pl, s.heads, splits])?;
            need(
                "attention partial sums",
                &scratch.part,
                prod("attention partial sums", &[rows, s.head_dim])?,
            )?;
            need("attention partial maxima", &scratch.stat, rows * 2)?;
            need(
                "attention counters",
                &scratch.count,
                prod("attention counters", &[pl, groups])?,
            )?;
        }
        let grid_x = u32::try_from(pl)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| NnError::Shape(format!("decoder attention: {pl} tokens")))?;
        // The packed product is read element by element; a query, 16 bytes a load.
        let addrs = match fresh {
            None => vec![query.addr(), k_cache.addr(), v_cache.addr()],
            Some(_) => vec![k_cache.addr(), v_cache.addr()],
        };
        let v;
        let kernel = if vector_loads::<T>(s.head_dim, &addrs)? {
            // Up to four query heads a block at 145 registers a thread leave room for three
            // blocks a multiprocessor; held to 128 registers, four (`v4o`); one head a block,
            // 80 registers, held to 64, eight (`v1o`). A grid of more blocks than the device
            // holds at once streams the cache faster held, one wave's latency chain is shorter
            // with the registers (H100, ours, ms a step; the Llama-shaped model: batch 64 after
            // 1024 tokens 3.14 → 3.01 held, batch 1 after 128 tokens 1.153 → 1.170 held, batch
            // 1 after 1024 tokens, 272 blocks where 396 fit, 1.291 / 1.297 held → 1.264 not,
            // batch 8 after 1024 tokens, 512 blocks, 1.567 / 1.572 held → 1.618 not; GPT-2
            // small at batch 64: 0.714 / 0.715 → 0.688 / 0.687 held after 128 tokens, 1.595 /
            // 1.593 → 1.536 / 1.541 after 1024).
            v = self.attend_vector::<T>(q.device(), s.head_dim)?;
            &v[vector_instance(s.heads / s.kv_heads, scratch.waves)]
        } else {
            self.attend_p.of::<T>("decoder attention")?
        };
        let cfg = LaunchConfig {
            grid: (grid_x, groups as u32, splits as u32),
            block: (ATTEND_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let i = |v: usize| Arg::I32(v as i32);
        let cluster = scratch.few && splits > 1;
        let early = early && early_reads(scratch.few, splits, scratch.waves) && fresh.is_some();
        // SAFETY: dec_attend_{v,p}_*(q, kc, vc, pos, slot, out, part, stat, count, Tq, H, Hkv,
        // S, Tmax, D, scale, splits, fresh, early, cluster, inv_freq, flag, check, slot_check):
        // block (n, y, s)
        // with n < B·Tq, y < Hkv·hg (hg = ceil((H/Hkv)/4): groups, checked against the
        // scratch), s < splits reads pos[n] (< positions_len, checked), slot[n / Tq] (< batch,
        // checked); without fresh it reads q at rows n·H + h for h < H of D elements
        // (query_len, checked), with fresh (Tq = 1, checked) the packed rows n·(H + 2Hkv) + hh
        // of D elements (checked) and inv_freq[j], j < D/2 (checked when not null), and writes
        // the cache rows ((sl·Hkv + kvh)·Tmax + p)·D only for 0 ≤ sl < S and 0 ≤ p < Tmax; it
        // writes out at rows n·H + h (query_len, checked), reads cache rows ((sl·Hkv +
        // kvh)·Tmax + j)·D, j ≤ p, only for 0 ≤ sl < S and 0 ≤ p < Tmax (cache_len =
        // S·Hkv·Tmax·D, checked for both caches); D ≤ 256 (vector_loads); with splits > 1
        // it writes part[(row·splits + s)·D + d] and stat[(row·splits + s)·2 + {0, 1}] for
        // row < B·Tq·H (sizes checked) and counts in count[n·groups + y] (checked); the loads
        // are 16-byte (vector instance: D a multiple of 16 bytes of T) or pair loads (D even)
        // at offsets that are multiples of their size in buffers aligned to it (addresses
        // checked by vector_loads), at most 32 lanes a row; every size fits i32 and the grid
        // its limits (validated: H, Hkv, Tmax, S, Tq ≤ 65535 where they are grid sizes,
        // splits ≤ 64); a vector instance comes from the module of D (`attend_vector`), whose
        // compile-time head dimension is this D; 128 threads, the kernel's static shared
        // memory (≤ 34 KB). With `cluster` the splits (≤ 8, the scratch's) are one cluster and
        // part, stat and count are not touched; with `early` (fresh only) it reads pos, slot,
        // inv_freq and cache rows below a token's position before its wait: the caller's
        // promise.
        unsafe {
            launch_decode_in(
                q,
                kernel,
                cfg,
                cluster.then_some((1, 1, splits as u32)),
                &[
                    query.into(),
                    k_cache.into(),
                    v_cache.into(),
                    positions.into(),
                    slots.into(),
                    out.into(),
                    (&scratch.part).into(),
                    (&scratch.stat).into(),
                    (&scratch.count).into(),
                    i(s.tokens),
                    i(s.heads),
                    i(s.kv_heads),
                    i(s.slots),
                    i(s.max_len),
                    i(s.head_dim),
                    Arg::F32(scale),
                    i(splits),
                    i(usize::from(fresh.is_some())),
                    i(usize::from(early)),
                    i(usize::from(cluster)),
                    Arg::opt(fresh.flatten()),
                    q.check_flag_arg()?,
                    Arg::U32(self.cache_pos_check),
                    Arg::U32(self.slot_check),
                ],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_instantiated_for_three_types() {
        let src = source();
        for k in KERNELS {
            let attend = k.strip_prefix("dec_attend_");
            let found = match attend {
                Some(name) => src.contains(&format!("DEC_ATTEND(T, S, {name},")),
                None => src.contains(&format!("{k}_##S(")),
            };
            assert!(found, "{k}");
        }
        assert!(src.contains("dec_attend_##NAME##_##S("));
        // The vector instances: in the module of one head dimension, fixed to it.
        let (name, fixed) = attend_source(80, Dtype::Bf16);
        assert_eq!(name, "cudagraph_nn_decoder_attend_d80_bf16");
        assert!(fixed.starts_with(
            "#define DS_HEAD_DIM 80\n#define DS_ATTEND_T bf16_t\n#define DS_ATTEND_S bf16\n"
        ));
        for k in ATTEND_KERNELS {
            let v = k.strip_prefix("dec_attend_").unwrap();
            let inst = format!("DEC_ATTEND(T, S, {v}, 16 / sizeof(T), DS_VEC_LOADS(T),");
            assert!(fixed.contains(&inst), "{k}");
        }
        assert!(fixed.contains("DEC_ATTEND_FIXED(DS_ATTEND_T, DS_ATTEND_S)"));
        assert!(src.contains("#define DS_MAX_SPLITS 64"));
        for inst in [
            "DEC_INSTANCES(float, f32)",
            "DEC_INSTANCES(bf16_t, bf16)",
            "DEC_INSTANCES(f16_t, f16)",
        ] {
            assert!(src.contains(inst), "{inst}");
        }
        assert!(!src.contains("#include"));
        assert!(src.contains("#define DEC_ROW_THREADS 256"));
        assert!(src.contains("#define DS_THREADS 128"));
        assert!(src.contains("DEC_ATTEND(T, S, p4, 2, 4, 4, 0, 1)"));
        assert_eq!(MAX_SPLITS, 64);
        assert_eq!((ROW_THREADS, ATTEND_THREADS, ATTEND_HEADS), (256, 128, 4));
    }

    #[test]
    fn qkv_geometry_is_checked() {
        let d = QkvDims {
            rows: 2,
            tokens: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            slots: 4,
            max_len: 32,
        };
        assert_eq!(d.lens().unwrap(), (6 * 8 * 16, 6 * 4 * 16, 4 * 2 * 32 * 16));
        for bad in [
            QkvDims { head_dim: 15, ..d },
            QkvDims { rows: 0, ..d },
            QkvDims {
                max_len: 1 << 40,
                ..d
            },
        ] {
            assert!(bad.lens().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn splits_fill_the_device_and_stay_within_the_cache() {
        let shape = |batch, heads, kv_heads, max_len| AttentionShape {
            batch,
            slots: batch,
            tokens: 1,
            heads,
            kv_heads,
            max_len,
            head_dim: 64,
        };
        // GPT-2 small at batch 1 on 132 multiprocessors: 12 blocks, 44 splits would fill 528,
        // but a cache of 2048 uses at most 32.
        assert_eq!(attend_splits(132, &shape(1, 12, 12, 2048)), 32);
        assert_eq!(attend_splits(132, &shape(1, 12, 12, 4096)), 44);
        assert_eq!(attend_splits(132, &shape(8, 32, 8, 2048)), 8);
        // Capped by the cache (one split per 64 keys) and by MAX_SPLITS.
        assert_eq!(attend_splits(132, &shape(1, 12, 12, 100)), 2);
        assert_eq!(attend_splits(132, &shape(1, 12, 12, 200)), 4);
        // Long caches split even when the batch fills the device: 256 keys a split.
        assert_eq!(attend_splits(132, &shape(64, 12, 12, 1100)), 5);
        assert_eq!(attend_splits(1000, &shape(1, 1, 1, 1 << 20)), MAX_SPLITS);
        // Eight query heads a key/value head: two blocks of four.
        assert_eq!(head_groups(&shape(1, 8, 1, 64)), 2);
        assert_eq!(head_groups(&shape(1, 6, 1, 64)), 2);
        assert_eq!(head_groups(&shape(1, 32, 8, 64)), 1);
        // Enough blocks already and a short cache: no split.
        assert_eq!(attend_splits(132, &shape(64, 32, 8, 256)), 1);
        assert_eq!(attend_splits(132, &shape(2, 12, 12, 2048)), 22);
        assert_eq!(attend_splits(132, &shape(48, 12, 12, 200)), 1);
        assert_eq!(attend_splits(0, &shape(1, 1, 1, 64)), 1);
        // Few blocks: one wave, at most 8 splits, and split or at most 16 (token, head group)
        // pairs.
        assert!(few_blocks(&shape(1, 12, 12, 200), 7, 396));
        assert!(few_blocks(&shape(2, 32, 8, 200), 8, 396));
        assert!(few_blocks(&shape(8, 32, 8, 200), 3, 396));
        assert!(few_blocks(&shape(16, 32, 8, 200), 3, 396));
        assert!(!few_blocks(&shape(17, 32, 8, 200), 3, 396));
        assert!(!few_blocks(&shape(1, 12, 12, 2048), 44, 396));
        assert!(!few_blocks(&shape(8, 32, 8, 1100), 9, 1000));
        assert!(few_blocks(&shape(1, 32, 8, 60), 1, 396));
        assert!(few_blocks(&shape(2, 32, 8, 60), 1, 396));
        assert!(!few_blocks(&shape(3, 32, 8, 60), 1, 396));
        assert!(!few_blocks(&shape(usize::MAX / 8, 1, 1, 60), 2, 396));
        // Early reads: few blocks, or split in one wave (GPT-2 small at batch 1 after 1024
        // tokens: 18 splits of 12 blocks, more than a cluster holds); not unsplit with many
        // blocks, nor beyond one wave (batch 8 of four heads a block, 512 blocks where 396 fit).
        let long = shape(1, 12, 12, 1096);
        let splits = attend_splits(132, &long);
        assert_eq!(splits, 18);
        assert!(!few_blocks(&long, splits, 792));
        assert!(!beyond_one_wave(&long, splits, 792));
        assert!(early_reads(false, splits, false));
        assert!(early_reads(true, 4, false));
        let wide = shape(32, 12, 12, 200);
        assert_eq!(attend_splits(132, &wide), 1);
        assert!(!early_reads(false, 1, beyond_one_wave(&wide, 1, 792)));
        let many = shape(8, 32, 8, 1100);
        assert_eq!(attend_splits(132, &many), 8);
        assert!(beyond_one_wave(&many, 8, 396));
        assert!(!early_reads(false, 8, true));
        assert!(beyond_one_wave(&shape(usize::MAX / 8, 1, 1, 60), 2, 396));
        // Instances: v1, v2, v4 in one wave; v1o and v4o beyond it (two heads keep v2).
        let one_wave: Vec<usize> = [1, 2, 3, 4, 8].map(|h| vector_instance(h, false)).to_vec();
        let waves: Vec<usize> = [1, 2, 3, 4, 8].map(|h| vector_instance(h, true)).to_vec();
        assert_eq!(one_wave, [0, 1, 2, 2, 2]);
        assert_eq!(waves, [4, 1, 3, 3, 3]);
        assert_eq!(ATTEND_KERNELS[4], "dec_attend_v1o");
        assert_eq!(ATTEND_KERNELS[3], "dec_attend_v4o");
    }

    #[test]
    fn head_dimensions_pick_their_loads() {
        use half::{bf16, f16};
        let a = [256, 512, 768];
        assert!(vector_loads::<bf16>(64, &a).unwrap());
        assert!(vector_loads::<f16>(256, &a).unwrap());
        assert!(vector_loads::<f32>(256, &a).unwrap());
        assert!(vector_loads::<f32>(96, &a).unwrap());
        assert!(!vector_loads::<bf16>(6, &a).unwrap());
        assert!(!vector_loads::<f32>(250, &a).unwrap());
        assert!(vector_loads::<bf16>(7, &a).is_err());
        assert!(vector_loads::<bf16>(264, &a).is_err());
        assert!(vector_loads::<f32>(258, &a).is_err());
        // A buffer off 16 bytes takes pair loads; off two elements, an error.
        assert!(!vector_loads::<bf16>(64, &[256, 516, 768]).unwrap());
        assert!(!vector_loads::<f32>(64, &[256, 512, 776]).unwrap());
        assert!(vector_loads::<bf16>(64, &[258, 512, 768]).is_err());
        assert!(vector_loads::<f32>(64, &[256, 516, 768]).is_err());
    }
}
