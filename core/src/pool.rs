//! The two pools a failover policy names.
//!
//! A policy always has exactly two pools. `A` is the first one listed and the home primary,
//! `B` the second. Which of them is primary at any moment is state, not identity: the names a
//! user chose live in the policy, and status maps [`Pool`] back to them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One of the two pools of a policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Pool {
    /// The first pool of the policy: the home primary.
    A,
    /// The second pool of the policy: the home standby.
    B,
}

impl Pool {
    /// The other pool.
    #[must_use]
    pub fn other(self) -> Pool {
        match self {
            Pool::A => Pool::B,
            Pool::B => Pool::A,
        }
    }

    /// Position of this pool in the policy's list of pools.
    #[must_use]
    pub fn index(self) -> usize {
        match self {
            Pool::A => 0,
            Pool::B => 1,
        }
    }
}

impl fmt::Display for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pool::A => "A",
            Pool::B => "B",
        })
    }
}
