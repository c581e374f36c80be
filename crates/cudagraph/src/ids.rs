//! Identifiers shared by every layer. This module imports nothing from the crate, so the error
//! type (which names pools) and the memory layer (which owns them) do not depend on each other.

use std::fmt;

/// Identifies a memory pool: `PoolId::DEFAULT` for eager work, one id per graph pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u64);

impl PoolId {
    /// The pool that eager (non-captured) allocations come from.
    pub const DEFAULT: PoolId = PoolId(0);
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == PoolId::DEFAULT {
            write!(f, "default pool")
        } else {
            write!(f, "graph pool #{}", self.0)
        }
    }
}
