//! Launchers of the elementwise and reduction kernels (`elementwise.cu`, `reduce.cu`): the
//! bias and activation epilogues, ReLU, in-place addition, and the column and per-channel sums
//! of bias gradients.

use cudagraph::QueueExt;
use cudagraph::{args, LaunchConfig, Queue};

use super::{elems, int, int_loop, launch, long, need, prod, Buf, Kernels};
use crate::error::Result;

/// How [`Kernels::channel_sum`] splits each channel's `n·hw` elements: `(parts, chunk)`, about
/// two blocks per multiprocessor over all channels, each part at least 4096 elements (one part
/// — a block per channel writing the result itself — when that is all the size allows), at most
/// 1024 parts.
pub fn channel_sum_plan(n: usize, c: usize, hw: usize, multiprocessors: u32) -> (usize, usize) {
    let total = n.saturating_mul(hw);
    let by_size = (total / 4096).max(1);
    let want = (2 * multiprocessors.max(1) as usize).div_ceil(c.max(1));
    let parts = want.min(by_size).clamp(1, 1024);
    let chunk = total.div_ceil(parts).max(1);
    (total.div_ceil(chunk).max(1), chunk)
}

impl Kernels {
    /// `y[r, c] = act(y[r, c] + b[c])` over `rows × cols`.
    pub fn bias_act(
        &self,
        q: &dyn Queue,
        y: &Buf,
        b: &Buf,
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> Result<()> {
        let n = prod("bias_act", &[rows, cols])?;
        need("bias_act y", y, n)?;
        need("bias_act bias", b, cols)?;
        let (r, c) = (int("rows", rows)?, int("cols", cols)?);
        long(n)?;
        // SAFETY: y holds rows·cols elements and b holds cols: exactly what the kernel indexes.
        unsafe { launch(q, &self.bias_act, elems(n), args![y, b, r, c, relu as i32]) }
    }

    /// `y = max(x, 0)` over the first `n` elements.
    pub fn relu_fwd(&self, q: &dyn Queue, x: &Buf, y: &Buf, n: usize) -> Result<()> {
        need("relu x", x, n)?;
        need("relu y", y, n)?;
        // SAFETY: x and y hold n elements; the kernel touches i < n.
        unsafe { launch(q, &self.relu_fwd, elems(n), args![x, y, long(n)?]) }
    }

    /// `dx = dy` where `y > 0`, else 0 (first `n` elements).
    pub fn relu_bwd(&self, q: &dyn Queue, dy: &Buf, y: &Buf, dx: &Buf, n: usize) -> Result<()> {
        need("relu dy", dy, n)?;
        need("relu y", y, n)?;
        need("relu dx", dx, n)?;
        // SAFETY: all three hold n elements; the kernel touches i < n.
        unsafe { launch(q, &self.relu_bwd, elems(n), args![dy, y, dx, long(n)?]) }
    }

    /// `y[n, c, p] += b[c]` over `n` images of `c` planes of `hw` elements (a convolution's
    /// NCHW output and its bias).
    pub fn bias_planes(
        &self,
        q: &dyn Queue,
        y: &Buf,
        b: &Buf,
        n: usize,
        c: usize,
        hw: usize,
    ) -> Result<()> {
        let total = prod("bias_planes", &[n, c, hw])?;
        need("bias_planes y", y, total)?;
        need("bias_planes bias", b, c)?;
        if total == 0 {
            return Ok(());
        }
        let vec = hw % 4 == 0 && y.addr() % 16 == 0;
        let wide = total > i32::MAX as usize;
        let threads = if vec { total / 4 } else { total };
        // SAFETY: y holds n·c·hw elements and b holds c (checked); the kernel touches
        // y[e .. e + 4) (vec: hw and so the total a multiple of 4, y 16-byte aligned) or y[e]
        // for e < total, and b[(e / hw) % c] < c.
        unsafe {
            launch(
                q,
                &self.bias_planes,
                elems(threads),
                args![
                    y,
                    b,
                    long(total)?,
                    int("bias_planes hw", hw)?,
                    int("bias_planes c", c)?,
                    vec as i32,
                    wide as i32
                ],
            )
        }
    }

    /// `a += b` over all of `a` (`b` at least as long).
    pub fn add_inplace(&self, q: &dyn Queue, a: &Buf, b: &Buf) -> Result<()> {
        let n = a.len();
        need("add b", b, n)?;
        // SAFETY: a and b hold n elements; the kernel touches i < n.
        unsafe { launch(q, &self.add_inplace, elems(n), args![a, b, long(n)?]) }
    }

    /// `db[c] = Σ_r dy[r, c]`.
    pub fn col_sum(
        &self,
        q: &dyn Queue,
        dy: &Buf,
        db: &Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        need("col_sum dy", dy, prod("col_sum", &[rows, cols])?)?;
        need("col_sum db", db, cols)?;
        if cols == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig::linear(u32::try_from(cols).unwrap_or(u32::MAX), 256);
        // SAFETY: one block per column c < cols reading dy[r·cols + c] for r < rows, writing
        // db[c]; both buffers were checked for those extents.
        unsafe {
            launch(
                q,
                &self.col_sum,
                cfg,
                args![dy, db, int_loop("rows", rows, 256)?, int("cols", cols)?],
            )
        }
    }

    /// `db[ch] = Σ_{n, p} dy[n, ch, p]` over `n × c × hw`.
    pub fn channel_sum(
        &self,
        q: &dyn Queue,
        dy: &Buf,
        db: &Buf,
        n: usize,
        c: usize,
        hw: usize,
    ) -> Result<()> {
        need("channel_sum dy", dy, prod("channel_sum", &[n, c, hw])?)?;
        need("channel_sum db", db, c)?;
        if c == 0 {
            return Ok(());
        }
        if n == 0 || hw == 0 {
            // Nothing to sum (and the kernel divides by hw).
            return q.memset_zero(&db.prefix(c)?).map_err(Into::into);
        }
        let (ni, ci, hwi) = (int("n", n)?, int("c", c)?, int("hw", hw)?);
        let (parts, chunk) = channel_sum_plan(n, c, hw, q.device().info().multiprocessors);
        let partial = if parts > 1 {
            Some(q.alloc::<f32>(prod("channel_sum parts", &[parts, c])?)?)
        } else {
            None
        };
        let out = partial.as_ref().unwrap_or(db);
        let cfg = LaunchConfig {
            grid: (ci as u32, parts as u32, 1),
            block: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: block (ch, z), ch < c, z < parts, reads dy[b, ch, p] for flat indices b·hw + p
        // below n·hw (dy holds n·c·hw, checked) and writes out[z·c + ch]: db (c elements,
        // checked) with one part, else `partial` (parts·c elements, allocated so).
        unsafe {
            launch(
                q,
                &self.channel_sum,
                cfg,
                args![dy, out, ni, ci, hwi, chunk as i64],
            )?;
        }
        if let Some(partial) = &partial {
            // SAFETY: thread e < c reads partial[z·c + e] for z < parts (parts·c elements) and
            // writes db[e] (c elements, checked).
            unsafe {
                launch(
                    q,
                    &self.sum_parts,
                    LaunchConfig::for_elements(c, 256),
                    args![partial, int("parts", parts)?, db, ci],
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::channel_sum_plan;

    #[test]
    fn bias_gradients_split_only_what_is_large() {
        // 16 channels of 2 × 224²: 17 parts per channel (about two blocks per SM), each part at
        // least 4096 elements; the parts cover every element.
        let (parts, chunk) = channel_sum_plan(2, 16, 224 * 224, 132);
        assert_eq!(parts, 17);
        assert!(chunk >= 4096 && parts * chunk >= 2 * 224 * 224);
        assert!((parts - 1) * chunk < 2 * 224 * 224);
        // Small planes: one part, the block writes the result itself.
        assert_eq!(channel_sum_plan(4, 8, 49, 132), (1, 196));
        // Many channels fill the device alone.
        assert_eq!(channel_sum_plan(128, 512, 7 * 7, 132).0, 1);
        // Nothing to sum still gives one part of one element (a block writing 0).
        assert_eq!(channel_sum_plan(0, 3, 10, 132), (1, 1));
        // Never more than 1024 parts.
        assert_eq!(channel_sum_plan(1 << 20, 1, 1 << 10, 132).0, 264);
        assert!(channel_sum_plan(1 << 30, 1, 1 << 20, 1 << 20).0 <= 1024);
    }
}
