//! The fencing epoch: a number that grows by one with every change of primary.
//!
//! The epoch is raised in the same compare-and-set write that names the new primary, and every
//! resource that acts on it (router, fence sidecar) remembers the highest epoch it has seen and
//! refuses anything older. This type never decreases on its own: the only way up is [`Epoch::next`].

use std::fmt;

use serde::{Deserialize, Serialize};

/// A fencing epoch. Epoch 0 is the first primary's, before any failover.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl Epoch {
    /// The epoch a promotion claims: one above this one.
    #[must_use]
    pub fn next(self) -> Epoch {
        Epoch(self.0 + 1)
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for Epoch {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.trim().parse().map(Epoch)
    }
}
