//! [`HostRng`]: the small deterministic generator on the host that initialises weights (with
//! PyTorch's default initialisation) and makes synthetic data. Random numbers on the device —
//! dropout masks, `rand`/`randn` — come from [`super::Generator`] instead.

/// A small deterministic generator (SplitMix64) on the host, for weights and synthetic data.
#[derive(Clone, Debug)]
pub struct HostRng(u64);

impl HostRng {
    /// A generator whose sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        HostRng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-bound, bound).
    pub fn symmetric(&mut self, bound: f32) -> f32 {
        (self.uniform() * 2.0 - 1.0) * bound
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }

    /// `n` standard normal values.
    pub fn vec_normal(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }

    /// `n` values uniform in [-bound, bound).
    pub fn vec_symmetric(&mut self, n: usize, bound: f32) -> Vec<f32> {
        (0..n).map(|_| self.symmetric(bound)).collect()
    }
}
