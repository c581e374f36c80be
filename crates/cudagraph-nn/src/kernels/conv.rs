//! Launchers of the direct convolution and pooling kernels (`conv.cu`, `pool.cu`): forward
//! (with compile-time 1×1, 3×3 and 5×5 twins for small ones), backward-data, backward-filter,
//! and max pooling with its backward.

use cudagraph::{args, Arg, DeviceBuffer, LaunchConfig, Queue};

use super::{elems, int, launch, long, need, prod, Buf, ConvGeom, Kernels};
use crate::error::{NnError, Result};

/// The eleven integers every conv kernel takes, checked to fit (the weight index is
/// computed in 32 bits on the device, so the weight count must fit too).
pub(super) fn conv_ints(g: &ConvGeom) -> Result<[i32; 11]> {
    let (oh, ow) = g.out_hw()?;
    int("conv2d weight count", g.weight_len()?)?;
    Ok([
        int("n", g.n)?,
        int("c", g.c)?,
        int("h", g.h)?,
        int("w", g.w)?,
        int("oc", g.oc)?,
        int("kh", g.kh)?,
        int("kw", g.kw)?,
        int("oh", oh)?,
        int("ow", ow)?,
        int("stride", g.stride)?,
        int("pad", g.pad)?,
    ])
}

fn conv_args<'a>(bufs: &[Arg<'a>], ints: [i32; 11]) -> Vec<Arg<'a>> {
    let mut v = bufs.to_vec();
    v.extend(ints.map(Arg::I32));
    v
}

impl Kernels {
    /// Direct NCHW convolution `y = conv(x, w) + b`.
    pub fn conv2d_fwd(
        &self,
        q: &dyn Queue,
        g: &ConvGeom,
        x: &Buf,
        w: &Buf,
        b: Option<&Buf>,
        y: &Buf,
    ) -> Result<()> {
        let ints = conv_ints(g)?;
        need("conv2d x", x, g.input_len()?)?;
        need("conv2d w", w, g.weight_len()?)?;
        need("conv2d y", y, g.output_len()?)?;
        if let Some(b) = b {
            need("conv2d bias", b, g.oc)?;
        }
        let (oh, ow) = g.out_hw()?;
        let ckk = g.c * g.kh * g.kw;
        let weights_bytes = g.weight_len()? * 4;
        let bufs = [x.into(), w.into(), Arg::opt(b), y.into()];
        if ckk <= 32 && weights_bytes <= 48 * 1024 {
            let mut cfg = LaunchConfig::for_elements(prod("conv2d", &[g.n, oh, ow])?, 128);
            cfg.shared_mem_bytes = weights_bytes as u32;
            // The compile-time twins take the same arguments (their sizes equal kh, kw).
            let f = match (g.kh, g.kw) {
                (1, 1) => &self.conv2d_fwd_small_k1,
                (3, 3) => &self.conv2d_fwd_small_k3,
                (5, 5) => &self.conv2d_fwd_small_k5,
                _ => &self.conv2d_fwd_small,
            };
            // SAFETY: one thread per (n, oh, ow) reads x inside [0, H)×[0, W) of its image,
            // copies all oc·ckk weights (≤ 32 taps each, checked) into the shared memory sized
            // for them, writes every channel of its pixel in y; extents checked above. The
            // twins chosen above use sizes equal to the kh, kw passed.
            unsafe { launch(q, f, cfg, &conv_args(&bufs, ints)) }
        } else {
            // SAFETY: one thread per output element; reads of x are bounds-checked against H, W
            // in the kernel; w, b and y were checked for the geometry's extents.
            unsafe {
                launch(
                    q,
                    &self.conv2d_fwd,
                    elems(g.output_len()?),
                    &conv_args(&bufs, ints),
                )
            }
        }
    }

    /// `dx` of a convolution (gather form).
    pub fn conv2d_bwd_input(
        &self,
        q: &dyn Queue,
        g: &ConvGeom,
        dy: &Buf,
        w: &Buf,
        dx: &Buf,
    ) -> Result<()> {
        let ints = conv_ints(g)?;
        need("conv2d dy", dy, g.output_len()?)?;
        need("conv2d w", w, g.weight_len()?)?;
        need("conv2d dx", dx, g.input_len()?)?;
        // SAFETY: one thread per input element; dy is read only at oh < OH, ow < OW (checked in
        // the kernel); extents of dy, w, dx checked above.
        unsafe {
            launch(
                q,
                &self.conv2d_bwd_input,
                elems(g.input_len()?),
                &conv_args(&[dy.into(), w.into(), dx.into()], ints),
            )
        }
    }

    /// `dw` of a convolution (one block per weight).
    pub fn conv2d_bwd_weight(
        &self,
        q: &dyn Queue,
        g: &ConvGeom,
        dy: &Buf,
        x: &Buf,
        dw: &Buf,
    ) -> Result<()> {
        let ints = conv_ints(g)?;
        let nw = g.weight_len()?;
        need("conv2d dy", dy, g.output_len()?)?;
        need("conv2d x", x, g.input_len()?)?;
        need("conv2d dw", dw, nw)?;
        let cfg = LaunchConfig::linear(u32::try_from(nw).unwrap_or(u32::MAX), 256);
        // SAFETY: block b < oc·c·kh·kw writes dw[b]; reads of x are bounds-checked in the
        // kernel, dy below n·oc·oh·ow; extents checked above.
        unsafe {
            launch(
                q,
                &self.conv2d_bwd_weight,
                cfg,
                &conv_args(&[dy.into(), x.into(), dw.into()], ints),
            )
        }
    }

    /// Max pooling of `planes` planes of `h × w` with window `k`, stride `s`; `idx` keeps the
    /// argmax of every output.
    #[allow(clippy::too_many_arguments)]
    pub fn maxpool_fwd(
        &self,
        q: &dyn Queue,
        x: &Buf,
        y: &Buf,
        idx: &DeviceBuffer<i32>,
        planes: usize,
        (h, w): (usize, usize),
        k: usize,
        s: usize,
    ) -> Result<(usize, usize)> {
        if k == 0 || s == 0 || h < k || w < k {
            return Err(NnError::Shape(format!(
                "max_pool2d: {h}×{w} input, window {k}, stride {s}"
            )));
        }
        let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
        let n_in = prod("max_pool2d input", &[planes, h, w])?;
        let n_out = prod("max_pool2d output", &[planes, oh, ow])?;
        int("max_pool2d input size", n_in)?;
        need("max_pool2d x", x, n_in)?;
        need("max_pool2d y", y, n_out)?;
        need("max_pool2d idx", idx, n_out)?;
        // SAFETY: one thread per output (< planes·oh·ow, the extent of y and idx) reads x at
        // h < H, w < W of its plane (< planes·h·w, checked, and fits the kernel's int index).
        unsafe {
            launch(
                q,
                &self.maxpool_fwd,
                elems(n_out),
                args![
                    x,
                    y,
                    idx,
                    int("planes", planes)?,
                    h as i32,
                    w as i32,
                    k as i32,
                    s as i32,
                    oh as i32,
                    ow as i32
                ],
            )?;
        }
        Ok((oh, ow))
    }

    /// Scatters `dy` into `dx` at the argmax positions `idx` (clamped into `dx`).
    pub fn maxpool_bwd(
        &self,
        q: &dyn Queue,
        dy: &Buf,
        idx: &DeviceBuffer<i32>,
        dx: &Buf,
        n_out: usize,
    ) -> Result<()> {
        need("max_pool2d dy", dy, n_out)?;
        need("max_pool2d idx", idx, n_out)?;
        if dx.is_empty() {
            return Err(NnError::Shape("max_pool2d: empty input gradient".into()));
        }
        // SAFETY: i < n_out indexes dy and idx (checked); the write index is clamped into
        // [0, dx.len()) in the kernel.
        unsafe {
            launch(
                q,
                &self.maxpool_bwd,
                elems(n_out),
                args![dy, idx, dx, long(n_out)?, long(dx.len())?],
            )
        }
    }
}
