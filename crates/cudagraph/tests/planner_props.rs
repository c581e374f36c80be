//! Property tests of batch-size bucketing and the capture-size planner: `bucket_for` picks the
//! smallest size that holds a request, `BucketPolicy::sizes` is a clean sorted set, and
//! `plan_capture_sizes` is optimal (equal to a brute force over all subsets on small
//! instances) and consistent with what it reports.

use cudagraph::graph::planner::{least_padding_exhaustive, padding_of};
use cudagraph::{bucket_for, plan_capture_sizes, BucketPolicy, Error, GraphCost, SizeHistogram};
use proptest::prelude::*;

fn is_clean(v: &[usize]) -> bool {
    v.windows(2).all(|w| w[0] < w[1]) && v.iter().all(|&s| s > 0)
}

fn policy() -> impl Strategy<Value = (BucketPolicy, Option<usize>)> {
    prop_oneof![
        prop::collection::vec(0usize..300, 0..12).prop_map(|v| {
            let max = v.iter().copied().max().filter(|&m| m > 0);
            (BucketPolicy::Sizes(v), max)
        }),
        (0usize..5000).prop_map(|max| (BucketPolicy::PowersOfTwo { max }, Some(max))),
        (0usize..5000).prop_map(|max| (BucketPolicy::Steps8 { max }, Some(max))),
        (usize::MAX - 16..=usize::MAX)
            .prop_map(|max| (BucketPolicy::PowersOfTwo { max }, Some(max))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn bucket_for_is_the_smallest_size_that_holds_the_request(
        raw in prop::collection::vec(1usize..1000, 0..16),
        rows in 0usize..1100,
    ) {
        let mut sizes = raw;
        sizes.sort_unstable();
        sizes.dedup();
        let want = sizes.iter().copied().filter(|&s| s >= rows).min();
        prop_assert_eq!(bucket_for(&sizes, rows), want);
        if let Some(&max) = sizes.last() {
            prop_assert_eq!(bucket_for(&sizes, max + 1), None, "above the largest");
            prop_assert_eq!(bucket_for(&sizes, max), Some(max));
        }
    }

    #[test]
    fn bucket_policy_sizes_are_sorted_unique_nonzero_and_reach_max(
        (policy, max) in policy(),
        rows in 1usize..6000,
    ) {
        let sizes = policy.sizes();
        prop_assert!(is_clean(&sizes), "{:?} -> {:?}", policy, sizes);
        match max.filter(|&m| m > 0) {
            Some(m) => prop_assert_eq!(sizes.last(), Some(&m), "{:?}", policy),
            None => prop_assert!(sizes.is_empty(), "{:?} -> {:?}", policy, sizes),
        }
        match &policy {
            BucketPolicy::PowersOfTwo { max } => {
                prop_assert!(sizes.iter().all(|&s| s.is_power_of_two() || s == *max));
            }
            BucketPolicy::Steps8 { max } => {
                prop_assert!(sizes.iter().all(|&s| s <= 8 || s % 8 == 0 || s == *max));
            }
            BucketPolicy::Sizes(v) => {
                prop_assert!(sizes.iter().all(|s| v.contains(s)));
                prop_assert!(v.iter().all(|&s| s == 0 || sizes.contains(&s)));
            }
        }
        // Every request up to the largest size has a bucket.
        if let Some(&largest) = sizes.last() {
            let b = bucket_for(&sizes, rows.min(largest));
            prop_assert!(b.is_some_and(|b| b >= rows.min(largest)));
        }
    }

    #[test]
    fn plan_capture_sizes_matches_brute_force(
        requests in prop::collection::vec((1usize..64, 1u64..20), 1..10),
        per_graph in 0usize..1000,
        per_row in 1usize..100,
        slack in 0usize..8000,
    ) {
        let mut hist = SizeHistogram::new();
        for &(size, n) in &requests {
            for _ in 0..n {
                hist.record(size);
            }
        }
        let cost = GraphCost { bytes_per_graph: per_graph, bytes_per_row: per_row };
        let max = *hist.counts().keys().last().expect("non-empty");
        // Budgets around the largest graph's cost: some below it (infeasible), most above.
        let budget = (cost.bytes(max) + slack).saturating_sub(1000);
        let want = least_padding_exhaustive(&hist, cost, budget);
        match plan_capture_sizes(&hist, cost, budget) {
            Ok(plan) => {
                prop_assert_eq!(Some(plan.padded_rows), want);
                prop_assert!(is_clean(&plan.sizes));
                prop_assert_eq!(plan.sizes.last(), Some(&max));
                prop_assert!(plan.sizes.iter().all(|s| hist.counts().contains_key(s)));
                let memory: usize = plan.sizes.iter().map(|&s| cost.bytes(s)).sum();
                prop_assert_eq!(plan.memory_bytes, memory);
                prop_assert!(memory <= budget);
                let (padded, _) = padding_of(&hist, &plan.sizes).expect("largest covers all");
                prop_assert_eq!(plan.padded_rows, padded);
            }
            Err(e) => {
                prop_assert_eq!(want, None, "planner failed but a plan exists: {}", e);
                prop_assert!(matches!(e, Error::PoolLimitExceeded { .. }), "{}", e);
            }
        }
    }
}
