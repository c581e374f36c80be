//! Plain f64 CPU references for every NN operation and optimizer, used by the tests to check the
//! GPU kernels (and checked themselves against finite differences on the CPU).

/// `y[m×n] = x[m×k] · w[n×k]ᵀ + b`.
pub fn linear(x: &[f64], w: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = b.get(j).copied().unwrap_or(0.0);
            for p in 0..k {
                acc += x[i * k + p] * w[j * k + p];
            }
            y[i * n + j] = acc;
        }
    }
    y
}

/// Gradients of `linear` given `dy`: (dx, dw, db).
pub fn linear_backward(
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    m: usize,
    k: usize,
    n: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dx = vec![0.0; m * k];
    let mut dw = vec![0.0; n * k];
    let mut db = vec![0.0; n];
    for i in 0..m {
        for j in 0..n {
            let g = dy[i * n + j];
            db[j] += g;
            for p in 0..k {
                dx[i * k + p] += g * w[j * k + p];
                dw[j * k + p] += g * x[i * k + p];
            }
        }
    }
    (dx, dw, db)
}

/// `max(x, 0)` elementwise.
pub fn relu(x: &[f64]) -> Vec<f64> {
    x.iter().map(|v| v.max(0.0)).collect()
}

/// Squared error, summed (`mean = false`) or averaged.
pub fn mse(p: &[f64], t: &[f64], mean: bool) -> f64 {
    let s: f64 = p.iter().zip(t).map(|(a, b)| (a - b) * (a - b)).sum();
    if mean {
        s / p.len() as f64
    } else {
        s
    }
}

/// Gradient of [`mse`] with respect to `p`: `2·(p − t)`, divided by the length when `mean`.
pub fn mse_grad(p: &[f64], t: &[f64], mean: bool) -> Vec<f64> {
    let scale = if mean { 1.0 / p.len() as f64 } else { 1.0 };
    p.iter()
        .zip(t)
        .map(|(a, b)| 2.0 * scale * (a - b))
        .collect()
}

/// Mean softmax cross-entropy and its gradient with respect to the logits.
pub fn cross_entropy(z: &[f64], tgt: &[usize], m: usize, c: usize) -> (f64, Vec<f64>) {
    let mut loss = 0.0;
    let mut dz = vec![0.0; m * c];
    for r in 0..m {
        let row = &z[r * c..(r + 1) * c];
        let mx = row.iter().cloned().fold(f64::MIN, f64::max);
        let s: f64 = row.iter().map(|v| (v - mx).exp()).sum();
        loss += s.ln() + mx - row[tgt[r]];
        for j in 0..c {
            let p = (row[j] - mx).exp() / s;
            dz[r * c + j] = (p - if j == tgt[r] { 1.0 } else { 0.0 }) / m as f64;
        }
    }
    (loss / m as f64, dz)
}

/// Convolution geometry: (n, c, h, w, oc, k, stride, pad).
#[derive(Clone, Copy, Debug)]
pub struct Conv {
    /// Batch size.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub oc: usize,
    /// Side of the square kernel.
    pub k: usize,
    /// Stride, the same along both axes.
    pub stride: usize,
    /// Zero padding on each side.
    pub pad: usize,
}

impl Conv {
    /// Output height and width (the kernel must fit the padded input).
    pub fn out_hw(&self) -> (usize, usize) {
        (
            (self.h + 2 * self.pad - self.k) / self.stride + 1,
            (self.w + 2 * self.pad - self.k) / self.stride + 1,
        )
    }

    fn input_at(&self, oh: usize, ow: usize, kh: usize, kw: usize) -> Option<(usize, usize)> {
        let ih = (oh * self.stride + kh) as isize - self.pad as isize;
        let iw = (ow * self.stride + kw) as isize - self.pad as isize;
        (ih >= 0 && iw >= 0 && (ih as usize) < self.h && (iw as usize) < self.w)
            .then_some((ih as usize, iw as usize))
    }

    /// `y[n, oc, oh, ow]` from NCHW `x`, OIHW weights `wt` and bias `b` (one per output channel).
    pub fn forward(&self, x: &[f64], wt: &[f64], b: &[f64]) -> Vec<f64> {
        let (oh_n, ow_n) = self.out_hw();
        let mut y = vec![0.0; self.n * self.oc * oh_n * ow_n];
        for n in 0..self.n {
            for oc in 0..self.oc {
                for oh in 0..oh_n {
                    for ow in 0..ow_n {
                        let mut acc = b[oc];
                        for c in 0..self.c {
                            for kh in 0..self.k {
                                for kw in 0..self.k {
                                    if let Some((ih, iw)) = self.input_at(oh, ow, kh, kw) {
                                        acc += x[((n * self.c + c) * self.h + ih) * self.w + iw]
                                            * wt[((oc * self.c + c) * self.k + kh) * self.k + kw];
                                    }
                                }
                            }
                        }
                        y[((n * self.oc + oc) * oh_n + oh) * ow_n + ow] = acc;
                    }
                }
            }
        }
        y
    }

    /// (dx, dw, db) from dy.
    pub fn backward(&self, x: &[f64], wt: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (oh_n, ow_n) = self.out_hw();
        let mut dx = vec![0.0; x.len()];
        let mut dw = vec![0.0; wt.len()];
        let mut db = vec![0.0; self.oc];
        for n in 0..self.n {
            for oc in 0..self.oc {
                for oh in 0..oh_n {
                    for ow in 0..ow_n {
                        let g = dy[((n * self.oc + oc) * oh_n + oh) * ow_n + ow];
                        db[oc] += g;
                        for c in 0..self.c {
                            for kh in 0..self.k {
                                for kw in 0..self.k {
                                    if let Some((ih, iw)) = self.input_at(oh, ow, kh, kw) {
                                        let xi = ((n * self.c + c) * self.h + ih) * self.w + iw;
                                        let wi = ((oc * self.c + c) * self.k + kh) * self.k + kw;
                                        dx[xi] += g * wt[wi];
                                        dw[wi] += g * x[xi];
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        (dx, dw, db)
    }
}

/// Max pooling over planes of h×w: (output, argmax index per output), as PyTorch's kernels:
/// each window starts from −inf at its first element and takes a value that is greater or
/// NaN, so a window with NaN gives NaN (index: its last NaN), a window of −inf gives −inf
/// (index: its first element), and every index lies inside its window.
pub fn max_pool(
    x: &[f64],
    planes: usize,
    h: usize,
    w: usize,
    k: usize,
    s: usize,
) -> (Vec<f64>, Vec<usize>) {
    let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
    let mut y = Vec::with_capacity(planes * oh * ow);
    let mut idx = Vec::with_capacity(planes * oh * ow);
    for p in 0..planes {
        for i in 0..oh {
            for j in 0..ow {
                let mut best = (f64::NEG_INFINITY, (p * h + i * s) * w + j * s);
                for a in 0..k {
                    for b in 0..k {
                        let at = (p * h + i * s + a) * w + j * s + b;
                        if x[at] > best.0 || x[at].is_nan() {
                            best = (x[at], at);
                        }
                    }
                }
                y.push(best.0);
                idx.push(best.1);
            }
        }
    }
    (y, idx)
}

/// One SGD step (PyTorch semantics, momentum buffer starting at zero).
pub fn sgd_step(w: &mut [f64], g: &[f64], buf: &mut [f64], lr: f64, momentum: f64, wd: f64) {
    for i in 0..w.len() {
        let mut d = g[i] + wd * w[i];
        if momentum != 0.0 {
            buf[i] = momentum * buf[i] + d;
            d = buf[i];
        }
        w[i] -= lr * d;
    }
}

/// One Adam(W) step at step number `t` (1-based).
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    w: &mut [f64],
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
    t: i32,
    lr: f64,
    wd: f64,
    decoupled: bool,
) {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
    for i in 0..w.len() {
        let mut gi = g[i];
        if decoupled {
            w[i] -= lr * wd * w[i];
        } else {
            gi += wd * w[i];
        }
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        let mh = m[i] / (1.0 - b1.powi(t));
        let vh = v[i] / (1.0 - b2.powi(t));
        w[i] -= lr * mh / (vh.sqrt() + eps);
    }
}

/// ‖a − b‖ / ‖b‖ (the error measure the tests use).
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    if a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    (num / den.max(1e-300)).sqrt()
}

/// Widens every value to f64.
pub fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[cfg(test)]
mod tests {
    //! The references' own gradients against central finite differences (f64).
    use super::*;

    fn numeric(f: &dyn Fn(&[f64]) -> f64, x: &[f64]) -> Vec<f64> {
        let h = 1e-6;
        (0..x.len())
            .map(|i| {
                let (mut a, mut b) = (x.to_vec(), x.to_vec());
                a[i] += h;
                b[i] -= h;
                (f(&a) - f(&b)) / (2.0 * h)
            })
            .collect()
    }

    fn close(a: &[f64], b: &[f64]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    fn data(n: usize, seed: u64) -> Vec<f64> {
        let mut r = crate::random::HostRng::new(seed);
        (0..n).map(|_| r.normal() as f64).collect()
    }

    #[test]
    fn linear_gradients_match_finite_differences() {
        let (m, k, n) = (3, 4, 5);
        let (x, w, b, dy) = (data(m * k, 1), data(n * k, 2), data(n, 3), data(m * n, 4));
        let loss = |x: &[f64], w: &[f64], b: &[f64]| {
            linear(x, w, b, m, k, n)
                .iter()
                .zip(&dy)
                .map(|(a, g)| a * g)
                .sum::<f64>()
        };
        let (dx, dw, db) = linear_backward(&x, &w, &dy, m, k, n);
        close(&dx, &numeric(&|v| loss(v, &w, &b), &x));
        close(&dw, &numeric(&|v| loss(&x, v, &b), &w));
        close(&db, &numeric(&|v| loss(&x, &w, v), &b));
    }

    #[test]
    fn conv_gradients_match_finite_differences() {
        let cv = Conv {
            n: 2,
            c: 2,
            h: 5,
            w: 4,
            oc: 3,
            k: 3,
            stride: 2,
            pad: 1,
        };
        let (oh, ow) = cv.out_hw();
        let (x, w, b) = (data(2 * 2 * 5 * 4, 5), data(3 * 2 * 9, 6), data(3, 7));
        let dy = data(2 * 3 * oh * ow, 8);
        let loss = |x: &[f64], w: &[f64], b: &[f64]| {
            cv.forward(x, w, b)
                .iter()
                .zip(&dy)
                .map(|(a, g)| a * g)
                .sum::<f64>()
        };
        let (dx, dw, db) = cv.backward(&x, &w, &dy);
        close(&dx, &numeric(&|v| loss(v, &w, &b), &x));
        close(&dw, &numeric(&|v| loss(&x, v, &b), &w));
        close(&db, &numeric(&|v| loss(&x, &w, v), &b));
    }

    #[test]
    fn losses_match_finite_differences() {
        let (p, t) = (data(12, 9), data(12, 10));
        for mean in [false, true] {
            close(&mse_grad(&p, &t, mean), &numeric(&|v| mse(v, &t, mean), &p));
        }
        let tgt = [2, 0, 3];
        let z = data(12, 11);
        let (_, dz) = cross_entropy(&z, &tgt, 3, 4);
        close(&dz, &numeric(&|v| cross_entropy(v, &tgt, 3, 4).0, &z));
    }

    #[test]
    fn max_pool_picks_the_window_maximum() {
        let x: Vec<f64> = (0..16).map(|v| ((v * 7) % 16) as f64).collect();
        let (y, idx) = max_pool(&x, 1, 4, 4, 2, 2);
        assert_eq!(y.len(), 4);
        for (v, i) in y.iter().zip(&idx) {
            assert_eq!(*v, x[*i]);
        }
        assert_eq!(y, vec![12.0, 14.0, 15.0, 13.0]);
    }

    /// PyTorch's max-pool (CPU and CUDA kernels alike) starts from −inf at the window's first
    /// element and takes a value when it is greater or NaN: a window with NaN gives NaN at its
    /// last NaN, a window of −inf gives −inf at its first element; never −FLT_MAX, never an
    /// index outside the window (issue 26, item 5).
    #[test]
    fn max_pool_propagates_nan_and_keeps_indices_inside_the_window() {
        let (nan, ninf) = (f64::NAN, f64::NEG_INFINITY);
        // Two planes of 4×4, windows 2×2 with stride 2 (top-left, top-right, bottom-left,
        // bottom-right of each plane).
        #[rustfmt::skip]
        let x = vec![
            // plane 0: NaN among numbers | two NaNs | only −inf | NaN among −inf
            1.0, nan,   nan, 5.0,
            3.0, 2.0,   0.0, nan,
            ninf, ninf, ninf, ninf,
            ninf, ninf, nan,  ninf,
            // plane 1: +inf with NaN after it | numbers | −inf then a number | all equal
            f64::INFINITY, 0.0,  -7.0, -3.0,
            nan,  1.0,           -5.0, -4.0,
            ninf, ninf,          2.0, 2.0,
            ninf, -1.0,          2.0, 2.0,
        ];
        let (y, idx) = max_pool(&x, 2, 4, 4, 2, 2);
        let window = |o: usize| {
            let (p, r, c) = (o / 4, (o % 4) / 2, o % 2);
            let first = (p * 4 + 2 * r) * 4 + 2 * c;
            [first, first + 1, first + 4, first + 5]
        };
        for (o, &i) in idx.iter().enumerate() {
            assert!(
                window(o).contains(&i),
                "output {o}: index {i} outside its window"
            );
            assert!(y[o].to_bits() == x[i].to_bits() || (y[o].is_nan() && x[i].is_nan()));
        }
        assert!(y[0].is_nan() && idx[0] == 1, "NaN among numbers");
        assert!(y[1].is_nan() && idx[1] == 7, "the last of two NaNs");
        assert_eq!(
            (y[2], idx[2]),
            (ninf, 8),
            "a window of −inf: its first element"
        );
        assert!(y[3].is_nan() && idx[3] == 14, "NaN among −inf");
        assert!(y[4].is_nan() && idx[4] == 20, "NaN after +inf");
        assert_eq!((y[5], idx[5]), (-3.0, 19));
        assert_eq!((y[6], idx[6]), (-1.0, 29));
        assert_eq!((y[7], idx[7]), (2.0, 26), "ties: the first");
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        let mut w = vec![1.0, -2.0];
        let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
        adam_step(&mut w, &[0.5, -3.0], &mut m, &mut v, 1, 0.1, 0.0, false);
        // Bias-corrected first step: w -= lr * sign(g) (up to eps).
        close(&w, &[0.9, -1.9]);
    }
}
