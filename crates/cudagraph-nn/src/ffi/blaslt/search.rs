//! cuBLASLt's opt-in extra candidates for a plan: split-K variants of its first heuristic
//! algorithms where their grids leave the device idle, and configurations found by searching
//! algorithm ids, tiles and stages (see [`super`]'s module docs for what is kept and why).

use std::ffi::c_int;

use super::super::loader::{Ptr, SUCCESS};
use super::api::*;
use super::{BlasLt, LtConfig, LtShape, Plan, SearchConfig, SplitVariant};
use crate::dtype::Dtype;

/// How many of the first heuristic algorithms get split-K variants.
pub const SPLIT_K_RANKS: usize = 3;

/// The K splits a split-K variant may use (at most four of them per algorithm, eight per shape).
pub const SPLITS: [u8; 6] = [2, 3, 4, 6, 8, 16];

/// How many split-K variants the algorithm of each rank below [`SPLIT_K_RANKS`] may get: eight
/// in all, so that measuring a shape's candidates stays cheap.
pub(super) const SPLITS_PER_RANK: [usize; SPLIT_K_RANKS] = [4, 2, 2];

/// The fewest K elements a split keeps.
pub(super) const MIN_K_PER_SPLIT: usize = 32;

/// The reduction schemes a variant tries, in order: in place (the output buffer, with counters
/// in the workspace that keep the splits in sequence, as the header puts it), then partial
/// results in the workspace in the compute type, then in the output type, each reduced in a
/// separate step (the same type for fp32 products; for a bf16 or f16 output only the compute
/// type is tried). The first one the algorithm supports and `cublasLtMatmulAlgoCheck` accepts
/// within the workspace is kept. None is described as using
/// atomics; the GPU tests check that repeated runs and graph replays give the same bits.
pub(super) const REDUCTION_ORDER: [u32; 3] =
    [REDUCE_INPLACE, REDUCE_COMPUTE_TYPE, REDUCE_OUTPUT_TYPE];

/// How many algorithm ids the search asks `cublasLtMatmulAlgoGetIds` for.
pub(super) const SEARCH_IDS: usize = 128;

/// The most `cublasLtMatmulAlgoCheck` calls the search makes per shape (each a host-side call
/// of microseconds; the shape's plan is searched once).
pub const SEARCH_CHECKS: usize = 256;

/// The most searched configurations a shape keeps (the registry measures them all).
pub const SEARCH_KEPT: usize = 8;

/// The most kept configurations with the same tile (different ids or stage counts), so that
/// the kept ones cover at least four tiles where that many pass the check.
pub const SEARCH_PER_TILE: usize = 2;

/// Where a configuration whose tile is `tile` (rows × columns of cuBLASLt's D, `None` when
/// undefined or unknown) stands in the search's order for a D of `rows` × `cols` on `sms`
/// multiprocessors; smaller is tried first. With a known tile the grid has
/// ⌈rows/tile rows⌉·⌈cols/tile cols⌉ thread blocks: grids of at least one wave come first,
/// ordered by how full they keep the device over their waves (blocks / (waves rounded up ×
/// SMs), in 5 % steps, fuller first), then by larger tiles (more work per block, fewer
/// loads of A and B); grids under one wave come next, more blocks first, then larger tiles;
/// unknown tiles last. Ties keep the enumeration order (algorithm id, tile id, stages id).
pub fn search_rank(
    tile: Option<(usize, usize)>,
    rows: usize,
    cols: usize,
    sms: usize,
) -> (u8, i64, i64) {
    let Some((tr, tc)) = tile.filter(|&(r, c)| r > 0 && c > 0) else {
        return (2, 0, 0);
    };
    let sms = sms.max(1);
    let blocks = rows.div_ceil(tr).saturating_mul(cols.div_ceil(tc));
    let area = -(tr.saturating_mul(tc).min(i64::MAX as usize) as i64);
    if blocks >= sms {
        let slots = blocks.div_ceil(sms).saturating_mul(sms);
        let fill_step = (blocks.saturating_mul(20) / slots) as i64;
        (0, -fill_step, area)
    } else {
        (1, -(blocks as i64), area)
    }
}

/// Tile shapes of `cublasLtMatmulTile_t` by id, from 1 (`CUBLASLT_MATMUL_TILE_8x8`) on, as
/// rows × columns of cuBLASLt's D matrix (the header's order, unchanged from cuBLASLt 12.6 to
/// 13.4, which append new ids; 0 is `UNDEFINED`).
pub(super) const TILE_SHAPES: &str = "\
    8x8 8x16 16x8 8x32 16x16 32x8 8x64 16x32 32x16 64x8 32x32 32x64 64x32 32x128 64x64 128x32 \
    64x128 128x64 64x256 128x128 256x64 64x512 128x256 256x128 512x64 64x96 96x64 96x128 128x160 \
    160x128 192x128 128x192 128x96 32x256 256x32 8x128 8x192 8x256 8x320 8x384 8x448 8x512 8x576 \
    8x640 8x704 8x768 16x64 16x128 16x192 16x256 16x320 16x384 16x448 16x512 16x576 16x640 16x704 \
    16x768 24x64 24x128 24x192 24x256 24x320 24x384 24x448 24x512 24x576 24x640 24x704 24x768 \
    32x192 32x320 32x384 32x448 32x512 32x576 32x640 32x704 32x768 40x64 40x128 40x192 40x256 \
    40x320 40x384 40x448 40x512 40x576 40x640 40x704 40x768 48x64 48x128 48x192 48x256 48x320 \
    48x384 48x448 48x512 48x576 48x640 48x704 48x768 56x64 56x128 56x192 56x256 56x320 56x384 \
    56x448 56x512 56x576 56x640 56x704 56x768 64x192 64x320 64x384 64x448 64x576 64x640 64x704 \
    64x768 72x64 72x128 72x192 72x256 72x320 72x384 72x448 72x512 72x576 72x640 80x64 80x128 \
    80x192 80x256 80x320 80x384 80x448 80x512 80x576 88x64 88x128 88x192 88x256 88x320 88x384 \
    88x448 88x512 96x192 96x256 96x320 96x384 96x448 96x512 104x64 104x128 104x192 104x256 \
    104x320 104x384 104x448 112x64 112x128 112x192 112x256 112x320 112x384 120x64 120x128 120x192 \
    120x256 120x320 120x384 128x320 128x384 136x64 136x128 136x192 136x256 136x320 144x64 144x128 \
    144x192 144x256 144x320 152x64 152x128 152x192 152x256 152x320 160x64 160x192 160x256 168x64 \
    168x128 168x192 168x256 176x64 176x128 176x192 176x256 184x64 184x128 184x192 184x256 192x64 \
    192x192 192x256 200x64 200x128 200x192 208x64 208x128 208x192 216x64 216x128 216x192 224x64 \
    224x128 224x192 232x64 232x128 232x192 240x64 240x128 240x192 248x64 248x128 248x192 256x192 \
    264x64 264x128 272x64 272x128 280x64 280x128 288x64 288x128 296x64 296x128 304x64 304x128 \
    312x64 312x128 320x64 320x128 328x64 328x128 336x64 336x128 344x64 344x128 352x64 352x128 \
    360x64 360x128 368x64 368x128 376x64 376x128 384x64 384x128 392x64 400x64 408x64 416x64 \
    424x64 432x64 440x64 448x64 456x64 464x64 472x64 480x64 488x64 496x64 504x64 520x64 528x64 \
    536x64 544x64 552x64 560x64 568x64 576x64 584x64 592x64 600x64 608x64 616x64 624x64 632x64 \
    640x64 648x64 656x64 664x64 672x64 680x64 688x64 696x64 704x64 712x64 720x64 728x64 736x64 \
    744x64 752x64 760x64 768x64 64x16 64x24 64x40 64x48 64x56 64x72 64x80 64x88 64x104 64x112 \
    64x120 64x136 64x144 64x152 64x160 64x168 64x176 64x184 64x200 64x208 64x216 64x224 64x232 \
    64x240 64x248 64x264 64x272 64x280 64x288 64x296 64x304 64x312 64x328 64x336 64x344 64x352 \
    64x360 64x368 64x376 64x392 64x400 64x408 64x416 64x424 64x432 64x440 64x456 64x464 64x472 \
    64x480 64x488 64x496 64x504 64x520 64x528 64x536 64x544 64x552 64x560 64x568 64x584 64x592 \
    64x600 64x608 64x616 64x624 64x632 64x648 64x656 64x664 64x672 64x680 64x688 64x696 64x712 \
    64x720 64x728 64x736 64x744 64x752 64x760 128x8 128x16 128x24 128x40 128x48 128x56 128x72 \
    128x80 128x88 128x104 128x112 128x120 128x136 128x144 128x152 128x168 128x176 128x184 128x200 \
    128x208 128x216 128x224 128x232 128x240 128x248 128x264 128x272 128x280 128x288 128x296 \
    128x304 128x312 128x328 128x336 128x344 128x352 128x360 128x368 128x376 128x392 128x400 \
    128x408 128x416 128x424 128x432 128x440 128x448 128x456 128x464 128x472 128x480 128x488 \
    128x496 128x504 128x512 192x8 192x16 192x24 192x32 192x40 192x48 192x56 192x72 192x80 192x88 \
    192x96 192x104 192x112 192x120 192x136 192x144 192x152 192x160 192x168 192x176 192x184 \
    192x200 192x208 192x216 192x224 192x232 192x240 192x248 192x264 192x272 192x280 192x288 \
    192x296 192x304 192x312 192x320 192x328 192x336 256x8 256x16 256x24 256x40 256x48 256x56 \
    256x72 256x80 256x88 256x96 256x104 256x112 256x120 256x136 256x144 256x152 256x160 256x168 \
    256x176 256x184 256x200 256x208 256x216 256x224 256x232 256x240 256x248 256x256 320x8 320x16 \
    320x24 320x32 320x40 320x48 320x56 320x72 320x80 320x88 320x96 320x104 320x112 320x120 \
    320x136 320x144 320x152 320x160 320x168 320x176 320x184 320x192 320x200 384x8 384x16 384x24 \
    384x32 384x40 384x48 384x56 384x72 384x80 384x88 384x96 384x104 384x112 384x120 384x136 \
    384x144 384x152 384x160 384x168 448x8 448x16 448x24 448x32 448x40 448x48 448x56 448x72 448x80 \
    448x88 448x96 448x104 448x112 448x120 448x128 448x136 448x144 512x8 512x16 512x24 512x32 \
    512x40 512x48 512x56 512x72 512x80 512x88 512x96 512x104 512x112 512x120 512x128 576x8 576x16 \
    576x24 576x32 576x40 576x48 576x56 576x72 576x80 576x88 576x96 576x104 576x112 640x8 640x16 \
    640x24 640x32 640x40 640x48 640x56 640x72 640x80 640x88 640x96 704x8 704x16 704x24 704x32 \
    704x40 704x48 704x56 704x72 704x80 704x88 768x8 768x16 768x24 768x32 768x40 768x48 768x56 \
    768x72 768x80 256x512 256x1024 512x512 512x1024 4x1 8x1 16x1 24x1 32x1 40x1 48x1 64x1 128x1 \
    192x1 256x1";

/// The rows × columns of D that tile `id` covers, if it is a known tile.
pub(super) fn tile_shape(id: u32) -> Option<(usize, usize)> {
    let name = TILE_SHAPES
        .split_ascii_whitespace()
        .nth(usize::try_from(id).ok()?.checked_sub(1)?)?;
    let (r, c) = name.split_once('x')?;
    let (r, c) = (r.parse().ok()?, c.parse().ok()?);
    (r > 0 && c > 0).then_some((r, c))
}

/// The K splits to try for an algorithm whose grid fills `fill` of one wave of the device
/// (thread blocks / multiprocessors): none when it fills it (`fill` ≥ 1, or not a number);
/// otherwise those of [`SPLITS`] that keep at least 32 elements of K per split and make at most
/// two waves, the `most` nearest to one full wave (by ratio), in increasing order.
pub fn split_choices(fill: f64, k: usize, most: usize) -> Vec<u8> {
    if !(fill > 0.0 && fill < 1.0) {
        return Vec::new();
    }
    let mut v: Vec<u8> = SPLITS
        .into_iter()
        .filter(|&s| k / s as usize >= MIN_K_PER_SPLIT && fill * s as f64 <= 2.0)
        .collect();
    v.sort_by(|a, b| {
        let off = |s: u8| (fill * s as f64).ln().abs();
        off(*a).total_cmp(&off(*b))
    });
    v.truncate(most);
    v.sort_unstable();
    v
}

impl BlasLt {
    /// The split-K variants of the plan's first [`SPLIT_K_RANKS`] algorithms (its descriptor
    /// holds the epilogue its algorithms were asked for). An algorithm gets variants only if it
    /// is not split already, supports split-K, and its grid leaves multiprocessors idle: with
    /// a known tile, ⌈n/rows⌉·⌈m/cols⌉ thread blocks (cuBLASLt's D is n × m) fewer than the
    /// device's multiprocessors; with an undefined or unknown tile, cuBLASLt's `wavesCount`
    /// below 1. The splits are [`split_choices`]'s. Anything cuBLASLt refuses drops the
    /// variant; a library without the functions gives none.
    pub(super) fn split_variants(&self, handle: Ptr, p: &Plan, s: &LtShape) -> Vec<SplitVariant> {
        let Some(api) = self.api.split_k.as_ref() else {
            return Vec::new();
        };
        let sms = self.ctx.info().multiprocessors.max(1) as f64;
        let u32_of = |v: Option<[u8; 4]>| v.map(u32::from_ne_bytes);
        let mut out: Vec<SplitVariant> = Vec::new();
        for (rank, base) in p.algos.iter().enumerate().take(SPLIT_K_RANKS) {
            if !matches!(
                u32_of(api.config(&base.algo, CONFIG_SPLITK_NUM)),
                Some(0 | 1)
            ) {
                continue; // already split (or unreadable)
            }
            let supported = api
                .cap(&base.algo, CAP_SPLITK_SUPPORT)
                .is_some_and(|v| i32::from_ne_bytes(v) != 0);
            let mask = u32_of(api.cap(&base.algo, CAP_REDUCTION_SCHEME_MASK)).unwrap_or(0);
            if !supported || mask & (REDUCE_INPLACE | REDUCE_COMPUTE_TYPE | REDUCE_OUTPUT_TYPE) == 0
            {
                continue;
            }
            let tile = u32_of(api.config(&base.algo, CONFIG_TILE_ID)).and_then(tile_shape);
            let fill = match tile {
                Some((rows, cols)) => {
                    (s.n.div_ceil(rows) as f64) * (s.m.div_ceil(cols) as f64) / sms
                }
                None => base.waves_count as f64,
            };
            for split in split_choices(fill, s.k, SPLITS_PER_RANK[rank]) {
                // With a 16-bit D, only partial sums kept in the compute type (f32): the other
                // schemes add them in the output type.
                let narrow = p.types.cd != Dtype::F32;
                let accepted = REDUCTION_ORDER
                    .into_iter()
                    .filter(|&scheme| mask & scheme != 0)
                    .filter(|&scheme| !narrow || scheme == REDUCE_COMPUTE_TYPE)
                    .find_map(|scheme| self.check_variant(api, handle, p, s, base, split, scheme));
                let Some(result) = accepted else { continue };
                let duplicate = p.algos.iter().any(|a| a.algo == result.algo)
                    || out.iter().any(|v| v.result.algo == result.algo);
                if !duplicate {
                    out.push(SplitVariant {
                        rank: rank as u8,
                        split,
                        result,
                    });
                }
            }
        }
        out
    }

    /// `base` with `split` K splits reduced by `scheme`, if cuBLASLt takes the configuration,
    /// its alignment needs are within the plan's and `cublasLtMatmulAlgoCheck` accepts it for
    /// the plan's descriptors with a workspace within ours.
    #[allow(clippy::too_many_arguments)]
    fn check_variant(
        &self,
        api: &SplitKApi,
        handle: Ptr,
        p: &Plan,
        s: &LtShape,
        base: &HeuristicResult,
        split: u8,
        scheme: u32,
    ) -> Option<HeuristicResult> {
        let mut algo = base.algo;
        if !api.set_config(&mut algo, CONFIG_SPLITK_NUM, split as u32)
            || !api.set_config(&mut algo, CONFIG_REDUCTION_SCHEME, scheme)
        {
            return None;
        }
        self.validate(api, handle, p, s, algo)
    }

    /// `algo` as `cublasLtMatmulAlgoCheck` reports on it, if its alignment needs are within the
    /// plan's and the check accepts it for the plan's descriptors with a workspace within ours.
    fn validate(
        &self,
        api: &SplitKApi,
        handle: Ptr,
        p: &Plan,
        s: &LtShape,
        algo: [u64; 8],
    ) -> Option<HeuristicResult> {
        // A, B, C and D: the pointers are aligned to `s.align` bytes (checked at each call).
        for i in 0..4 {
            let need = u32::from_ne_bytes(api.cap(&algo, CAP_MIN_ALIGNMENT_A + i)?);
            if need > s.align {
                return None;
            }
        }
        let mut result = HeuristicResult::default();
        // SAFETY: the handle, descriptor and layouts are live (the caller holds the state
        // lock); `algo` is a whole algorithm struct read by the call; `result` is a writable
        // cublasLtMatmulHeuristicResult_t (layout checked by a test).
        let st = unsafe { (api.check)(handle, p.desc, p.a, p.b, p.c, p.c, &algo, &mut result) };
        if st != SUCCESS || result.state != SUCCESS || result.workspace_size > self.ws_bytes {
            return None;
        }
        result.algo = algo; // the check reports on `algo` but never writes it back
        Some(result)
    }

    /// The searched configurations of the plan (see the module docs): its descriptor holds
    /// the epilogue its algorithms run with, so each check is for exactly what will run.
    pub(super) fn search(&self, handle: Ptr, p: &Plan, s: &LtShape) -> Vec<SearchConfig> {
        let (Some(api), Some(search)) = (self.api.split_k.as_ref(), self.api.search.as_ref())
        else {
            return Vec::new();
        };
        let sms = self.ctx.info().multiprocessors.max(1) as usize;
        // The plan's types: scale f32, A and B, C and D.
        let (ab, cd) = (cuda_type(p.types.ab), cuda_type(p.types.cd));
        let mut ids = [0 as c_int; SEARCH_IDS];
        let mut got: c_int = 0;
        // SAFETY: the handle is live (the caller holds the state lock); cuBLASLt writes at most
        // SEARCH_IDS ids into `ids` and their count into `got`; the types are plain enums.
        let st = unsafe {
            (search.get_ids)(
                handle,
                p.compute,
                R_32F,
                ab,
                ab,
                cd,
                cd,
                SEARCH_IDS as c_int,
                ids.as_mut_ptr(),
                &mut got,
            )
        };
        if st != SUCCESS {
            return Vec::new();
        }
        let ids = &ids[..(got.max(0) as usize).min(SEARCH_IDS)];
        // What the heuristic already offers: (id, tile, stages, splits), splits 0 read as 1.
        let u32_at = |algo: &[u64; 8], attr| api.config(algo, attr).map(u32::from_ne_bytes);
        let signature = |algo: &[u64; 8]| {
            Some((
                i32::from_ne_bytes(api.config(algo, CONFIG_ID)?),
                u32_at(algo, CONFIG_TILE_ID)?,
                u32_at(algo, CONFIG_STAGES_ID)?,
                u32_at(algo, CONFIG_SPLITK_NUM)?.max(1),
            ))
        };
        let offered: Vec<_> = p.algos.iter().filter_map(|r| signature(&r.algo)).collect();
        // Every (id, tile, stages) not offered, with its rank ([`search_rank`]).
        let mut bases: Vec<([u64; 8], bool)> = Vec::new();
        let mut tried = Vec::new();
        for &id in ids {
            let mut algo = [0u64; 8];
            // SAFETY: as above; `algo` is a whole writable cublasLtMatmulAlgo_t.
            let st =
                unsafe { (search.init)(handle, p.compute, R_32F, ab, ab, cd, cd, id, &mut algo) };
            if st != SUCCESS {
                continue;
            }
            let swizzle = api
                .cap(&algo, CAP_CTA_SWIZZLING_SUPPORT)
                .is_some_and(|v| u32::from_ne_bytes(v) != 0);
            let mut tiles = api.cap_list(&algo, CAP_TILE_IDS);
            if tiles.is_empty() {
                tiles.push(0);
            }
            let mut stages = api.cap_list(&algo, CAP_STAGES_IDS);
            if stages.is_empty() {
                stages.push(0);
            }
            let base = bases.len();
            bases.push((algo, swizzle));
            for &tile in &tiles {
                let shape = tile_shape(tile);
                let rank = search_rank(shape, s.n, s.m, sms);
                for &stage in &stages {
                    if !offered.contains(&(id, tile, stage, 1)) {
                        tried.push((rank, id, tile, stage, shape, base));
                    }
                }
            }
        }
        tried.sort_by_key(|&(rank, id, tile, stage, _, _)| (rank, id, tile, stage));
        let mut kept: Vec<SearchConfig> = Vec::new();
        let mut checks = 0;
        for (_, id, tile, stage, shape, base) in tried {
            if kept.len() >= SEARCH_KEPT || checks >= SEARCH_CHECKS {
                break;
            }
            if kept.iter().filter(|c| c.info.tile == tile).count() >= SEARCH_PER_TILE {
                continue;
            }
            let (mut algo, swizzle) = bases[base];
            if !(api.set_config(&mut algo, CONFIG_TILE_ID, tile)
                && api.set_config(&mut algo, CONFIG_STAGES_ID, stage)
                && api.set_config(&mut algo, CONFIG_SPLITK_NUM, 1)
                && api.set_config(&mut algo, CONFIG_CTA_SWIZZLING, 0))
            {
                continue;
            }
            checks += 1;
            let Some(result) = self.validate(api, handle, p, s, algo) else {
                continue;
            };
            let duplicate = p.algos.iter().any(|a| a.algo == result.algo)
                || kept.iter().any(|c| c.result.algo == result.algo);
            if !duplicate {
                kept.push(SearchConfig {
                    info: LtConfig {
                        algo_id: id,
                        tile,
                        tile_shape: shape,
                        stages: stage,
                        swizzle_supported: swizzle,
                        workspace: result.workspace_size,
                        waves: result.waves_count,
                    },
                    result,
                });
            }
        }
        kept
    }
}
