//! Choosing capture sizes: from a histogram of request sizes and a memory budget, the set of
//! batch sizes to capture that minimises expected padding, exactly.
//!
//! A request of n rows runs on the smallest captured size b ≥ n and wastes b − n padded rows.
//! Every optimal plan uses observed sizes only (moving a bucket down to the largest request
//! it serves cuts both waste and memory), so the candidates are the distinct observed sizes,
//! and the largest must be captured (no request falls back). Memory is modelled per graph:
//! `bytes_per_graph + bytes_per_row × size`, calibrated from a capture (see
//! [`crate::GraphCache::entries`]). A dynamic program over candidates keeps, for each possible
//! largest-bucket-so-far, the Pareto frontier of (memory, waste) pairs; the answer is the least
//! waste within the budget. Tested against brute force over all subsets.

use std::collections::BTreeMap;
use std::fmt;

use crate::error::{Error, Result};

/// Request sizes seen, with counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SizeHistogram {
    counts: BTreeMap<usize, u64>,
}

impl SizeHistogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one request of `rows` rows (0 is ignored).
    pub fn record(&mut self, rows: usize) {
        if rows > 0 {
            *self.counts.entry(rows).or_default() += 1;
        }
    }

    /// Requests by size, smallest size first.
    pub fn counts(&self) -> &BTreeMap<usize, u64> {
        &self.counts
    }

    /// Requests recorded.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }
}

impl FromIterator<usize> for SizeHistogram {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        let mut h = SizeHistogram::new();
        for n in iter {
            h.record(n);
        }
        h
    }
}

/// The memory model of one captured graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphCost {
    /// Bytes every graph costs whatever its size.
    pub bytes_per_graph: usize,
    /// Bytes each row of batch size adds.
    pub bytes_per_row: usize,
}

impl GraphCost {
    /// Modelled bytes of a graph of `size` rows (saturating: a cost beyond the address space
    /// fits no budget).
    pub fn bytes(&self, size: usize) -> usize {
        self.bytes_per_graph
            .saturating_add(self.bytes_per_row.saturating_mul(size))
    }
}

/// A chosen set of capture sizes and what it costs.
#[derive(Clone, Debug, PartialEq)]
pub struct CapturePlan {
    /// The sizes to capture, ascending.
    pub sizes: Vec<usize>,
    /// Padded rows over all recorded requests.
    pub padded_rows: u64,
    /// Padded rows per request.
    pub padding_per_request: f64,
    /// Share of computed rows that are padding.
    pub padding_fraction: f64,
    /// Modelled bytes of all the chosen graphs together ([`GraphCost::bytes`]).
    pub memory_bytes: usize,
}

impl fmt::Display for CapturePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "capture {} sizes {:?}: {:.2} padded rows per request ({:.1}% of computed rows), {:.2} MB",
            self.sizes.len(),
            self.sizes,
            self.padding_per_request,
            100.0 * self.padding_fraction,
            self.memory_bytes as f64 / 1048576.0
        )
    }
}

/// Padded rows and computed rows when serving `hist` with `sizes` (sorted); `None` if a request
/// is larger than every size.
pub fn padding_of(hist: &SizeHistogram, sizes: &[usize]) -> Option<(u64, u64)> {
    let (mut waste, mut computed) = (0u64, 0u64);
    for (&n, &c) in &hist.counts {
        let b = *sizes.iter().find(|&&s| s >= n)?;
        // Saturating: row counts beyond u64 only arise from absurd histograms.
        waste = waste.saturating_add(((b - n) as u64).saturating_mul(c));
        computed = computed.saturating_add((b as u64).saturating_mul(c));
    }
    Some((waste, computed))
}

/// The least padding over every subset of the observed sizes that includes the largest and
/// fits `budget`, found by trying them all: the reference [`plan_capture_sizes`] is tested
/// against. `None` when even the largest size alone does not fit, or when there are more than
/// 20 distinct sizes (too many subsets to try).
#[doc(hidden)]
pub fn least_padding_exhaustive(
    hist: &SizeHistogram,
    cost: GraphCost,
    budget: usize,
) -> Option<u64> {
    let cand: Vec<usize> = hist.counts().keys().copied().collect();
    let (&last, rest) = cand.split_last()?;
    if rest.len() >= 20 {
        return None;
    }
    let mut best: Option<u64> = None;
    for mask in 0u32..(1 << rest.len()) {
        let mut sizes: Vec<usize> = (0..rest.len())
            .filter(|b| mask & (1 << b) != 0)
            .map(|b| rest[b])
            .collect();
        sizes.push(last);
        let mem = sizes
            .iter()
            .try_fold(0usize, |m, &s| m.checked_add(cost.bytes(s)));
        if mem.is_none_or(|m| m > budget) {
            continue;
        }
        let (w, _) = padding_of(hist, &sizes)?;
        best = Some(best.map_or(w, |b| b.min(w)));
    }
    best
}

/// The capture sizes with least padding whose modelled memory fits `budget` bytes.
pub fn plan_capture_sizes(
    hist: &SizeHistogram,
    cost: GraphCost,
    budget: usize,
) -> Result<CapturePlan> {
    let cand: Vec<usize> = hist.counts.keys().copied().collect();
    if cand.is_empty() {
        return Err(Error::InvalidGraph {
            problem: "the request histogram is empty: record some requests first".into(),
        });
    }
    let count: Vec<u64> = cand.iter().map(|n| hist.counts[n]).collect();
    // waste(i, j): requests with sizes cand[i..=j] served by bucket cand[j].
    let waste = |i: usize, j: usize| -> u64 {
        (i..=j).fold(0u64, |w, t| {
            w.saturating_add(((cand[j] - cand[t]) as u64).saturating_mul(count[t]))
        })
    };
    // front[j]: Pareto frontier of (memory, waste, previous (j', index)) with cand[j] the largest
    // bucket so far and every request ≤ cand[j] served.
    type Point = (usize, u64, Option<(usize, usize)>);
    let mut front: Vec<Vec<Point>> = Vec::with_capacity(cand.len());
    for (j, &size_j) in cand.iter().enumerate() {
        let mem_j = cost.bytes(size_j);
        let mut pts: Vec<Point> = Vec::new();
        if mem_j <= budget {
            pts.push((mem_j, waste(0, j), None));
            for (i, prev) in front.iter().enumerate().take(j) {
                let w = waste(i + 1, j);
                for (k, &(m, pw, _)) in prev.iter().enumerate() {
                    if let Some(total) = m.checked_add(mem_j).filter(|&t| t <= budget) {
                        pts.push((total, pw.saturating_add(w), Some((i, k))));
                    }
                }
            }
        }
        // Keep the non-dominated points: sorted by memory, strictly decreasing waste.
        pts.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut kept: Vec<Point> = Vec::new();
        for p in pts {
            if kept.last().is_none_or(|l| p.1 < l.1) {
                kept.push(p);
            }
        }
        front.push(kept);
    }
    let last = cand.len() - 1;
    let best = front[last]
        .iter()
        .enumerate()
        .min_by(|a, b| a.1 .1.cmp(&b.1 .1).then(a.1 .0.cmp(&b.1 .0)))
        .map(|(k, _)| k)
        .ok_or_else(|| Error::PoolLimitExceeded {
            pool: crate::PoolId::DEFAULT,
            limit: budget,
            reserved: 0,
            requested: cost.bytes(cand[last]),
        })?;
    let mut sizes = Vec::new();
    let (mut j, mut k) = (last, best);
    loop {
        sizes.push(cand[j]);
        match front[j][k].2 {
            Some((pj, pk)) => {
                j = pj;
                k = pk;
            }
            None => break,
        }
    }
    sizes.reverse();
    let (padded, computed) = padding_of(hist, &sizes).expect("largest size covers all");
    Ok(CapturePlan {
        memory_bytes: sizes.iter().map(|&s| cost.bytes(s)).sum(),
        padding_per_request: padded as f64 / hist.total() as f64,
        padding_fraction: padded as f64 / computed.max(1) as f64,
        padded_rows: padded,
        sizes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planner_is_optimal_against_brute_force() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for case in 0..300 {
            let distinct = 1 + (next() % 10) as usize;
            let mut hist = SizeHistogram::new();
            for _ in 0..distinct {
                let size = 1 + (next() % 64) as usize;
                for _ in 0..(1 + next() % 20) {
                    hist.record(size);
                }
            }
            let cost = GraphCost {
                bytes_per_graph: (next() % 1000) as usize,
                bytes_per_row: 1 + (next() % 100) as usize,
            };
            let max = *hist.counts().keys().last().unwrap();
            let budget = cost.bytes(max) + (next() % 8000) as usize;
            let want = least_padding_exhaustive(&hist, cost, budget);
            let got = plan_capture_sizes(&hist, cost, budget).ok();
            assert_eq!(
                got.as_ref().map(|p| p.padded_rows),
                want,
                "case {case}: {hist:?} {cost:?} {budget}"
            );
            if let Some(p) = got {
                assert!(p.memory_bytes <= budget);
                assert_eq!(*p.sizes.last().unwrap(), max);
            }
        }
    }

    #[test]
    fn unlimited_budget_captures_every_observed_size() {
        let hist: SizeHistogram = [1, 3, 3, 7, 20].into_iter().collect();
        let p = plan_capture_sizes(
            &hist,
            GraphCost {
                bytes_per_graph: 1,
                bytes_per_row: 1,
            },
            usize::MAX / 2,
        )
        .unwrap();
        assert_eq!(p.sizes, vec![1, 3, 7, 20]);
        assert_eq!(p.padded_rows, 0);
    }

    #[test]
    fn tight_budget_keeps_only_the_largest() {
        let hist: SizeHistogram = [1, 2, 8].into_iter().collect();
        let cost = GraphCost {
            bytes_per_graph: 0,
            bytes_per_row: 10,
        };
        let p = plan_capture_sizes(&hist, cost, 80).unwrap();
        assert_eq!(p.sizes, vec![8]);
        assert_eq!(p.padded_rows, 7 + 6);
        assert!(p.to_string().starts_with("capture 1 sizes [8]"));
        assert!(matches!(
            plan_capture_sizes(&hist, cost, 79),
            Err(Error::PoolLimitExceeded { .. })
        ));
        assert!(plan_capture_sizes(&SizeHistogram::new(), cost, 100).is_err());
    }

    #[test]
    fn costs_beyond_the_address_space_fit_no_budget_and_do_not_overflow() {
        let hist: SizeHistogram = [1, 2, usize::MAX / 2].into_iter().collect();
        let huge = GraphCost {
            bytes_per_graph: usize::MAX - 1,
            bytes_per_row: usize::MAX / 3,
        };
        assert_eq!(huge.bytes(3), usize::MAX);
        assert!(matches!(
            plan_capture_sizes(&hist, huge, usize::MAX - 1),
            Err(Error::PoolLimitExceeded { .. })
        ));
        // Two graphs whose sum would wrap: only the largest alone fits.
        let big = GraphCost {
            bytes_per_graph: usize::MAX / 2 + 1,
            bytes_per_row: 0,
        };
        let hist: SizeHistogram = [1, 2].into_iter().collect();
        let p = plan_capture_sizes(&hist, big, usize::MAX).unwrap();
        assert_eq!(p.sizes, vec![2]);
    }

    #[test]
    fn padding_of_huge_sizes_saturates_instead_of_overflowing() {
        let hist: SizeHistogram = [1, usize::MAX / 2, usize::MAX / 2].into_iter().collect();
        let cost = GraphCost {
            bytes_per_graph: 0,
            bytes_per_row: 0,
        };
        let p = plan_capture_sizes(&hist, cost, 0).unwrap();
        assert_eq!(p.sizes, vec![1, usize::MAX / 2]);
        assert_eq!(padding_of(&hist, &[usize::MAX / 2]).unwrap().1, u64::MAX);
    }
}
