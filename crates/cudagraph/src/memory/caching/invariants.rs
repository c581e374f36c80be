//! The consistency check of the allocator's bookkeeping, run by the tests after every step:
//! blocks tile their segments, free blocks are merged and in the free set, and every counter
//! agrees with the blocks. It reads the state and changes nothing.

use std::collections::BTreeMap;

use crate::ids::PoolId;

use super::state::AllocatorCore;
use super::stats::MemoryStats;

impl AllocatorCore {
    /// Checks every internal invariant; used by tests.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let add = |a: usize, b: usize| {
            a.checked_add(b)
                .ok_or_else(|| "byte counts overflow".to_string())
        };
        let mut per_pool: BTreeMap<PoolId, MemoryStats> = BTreeMap::new();
        for (&base, seg) in &self.segments {
            let counted = per_pool.entry(seg.pool).or_default();
            counted.reserved = add(counted.reserved, seg.size)?;
            counted.segments += 1;
            let end = base
                .checked_add(seg.size as u64)
                .ok_or_else(|| format!("segment {base:#x} wraps the address space"))?;
            let mut at = base;
            let mut prev_free = false;
            for (&addr, b) in self.blocks.range(base..end) {
                if addr != at {
                    return Err(format!("gap or overlap at {addr:#x} in segment {base:#x}"));
                }
                if b.segment != base {
                    return Err(format!("block {addr:#x} names the wrong segment"));
                }
                let key = (seg.pool, seg.stream, seg.class, b.size, addr);
                if seg.releasing {
                    if b.allocated || b.size != seg.size || self.free.contains(&key) {
                        return Err(format!("releasing segment {base:#x} is not detached whole"));
                    }
                } else if !b.allocated {
                    if prev_free {
                        return Err(format!("adjacent free blocks not merged at {addr:#x}"));
                    }
                    if !self.free.contains(&key) {
                        return Err(format!("free block {addr:#x} missing from the free set"));
                    }
                    if self.pending.contains_key(&addr) {
                        return Err(format!("pending block {addr:#x} is free"));
                    }
                } else {
                    counted.allocated = add(counted.allocated, b.size)?;
                    counted.active_blocks += 1;
                    if self.pending.contains_key(&addr) {
                        counted.pending_blocks += 1;
                    }
                }
                prev_free = !b.allocated;
                at = add(addr as usize, b.size)? as u64;
            }
            if at != end {
                return Err(format!("segment {base:#x} not covered by its blocks"));
            }
        }
        if self
            .blocks
            .values()
            .any(|b| !self.segments.contains_key(&b.segment))
        {
            return Err("block outside any segment".into());
        }
        if let Some(addr) = self
            .pending
            .keys()
            .find(|a| !self.blocks.get(a).is_some_and(|b| b.allocated))
        {
            return Err(format!("pending block {addr:#x} is not a live block"));
        }
        let same = |what: String, s: &MemoryStats, c: &MemoryStats| {
            let got = (
                s.allocated,
                s.reserved,
                s.active_blocks,
                s.pending_blocks,
                s.segments,
            );
            let want = (
                c.allocated,
                c.reserved,
                c.active_blocks,
                c.pending_blocks,
                c.segments,
            );
            match got == want {
                true => Ok(()),
                false => Err(format!(
                    "{what} stats say (allocated, reserved, active, pending, segments) = \
                     {got:?}, the blocks say {want:?}"
                )),
            }
        };
        let mut total = MemoryStats::default();
        for (pool, counted) in &per_pool {
            let Some(state) = self.pools.get(pool) else {
                return Err(format!("segments of {pool}, which no longer exists"));
            };
            same(pool.to_string(), &state.stats, counted)?;
            total.allocated = add(total.allocated, counted.allocated)?;
            total.reserved = add(total.reserved, counted.reserved)?;
            total.active_blocks += counted.active_blocks;
            total.pending_blocks += counted.pending_blocks;
            total.segments += counted.segments;
        }
        for (pool, state) in &self.pools {
            if !per_pool.contains_key(pool) {
                same(pool.to_string(), &state.stats, &MemoryStats::default())?;
            }
            if state.stats.peak_allocated < state.stats.allocated
                || state.stats.peak_reserved < state.stats.reserved
            {
                return Err(format!("{pool}: a peak is below the current value"));
            }
        }
        same("device".into(), &self.device, &total)?;
        if self.device.pending_blocks != self.pending.len() {
            return Err("pending count differs from the pending list".into());
        }
        let free_blocks = self
            .blocks
            .iter()
            .filter(|(_, b)| !b.allocated)
            .filter(|(_, b)| !self.segments[&b.segment].releasing)
            .count();
        if self.free.len() != free_blocks {
            return Err("free set has stale entries".into());
        }
        let windows = self.pools.values().filter(|p| p.window.is_some()).count();
        if windows != self.captures_open {
            return Err(format!(
                "{windows} windows open, {} counted",
                self.captures_open
            ));
        }
        Ok(())
    }
}
