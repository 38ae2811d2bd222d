//! The one rule for how many of a pool's replicas must serve: to pass a round of generating probes
//! in the role it holds, and to be routed when it is promoted. The operator and the local game day
//! both judge their pools by it, so a quorum bug shows in a rehearsal as it would on a cluster.
//!
//! One quorum per role. As the primary, a pool passes with the replicas it was routed at (the
//! policy's `minServingFraction` of all of them, else a majority, and never more than a majority):
//! the number a promotion moves the route at is the number the pool is judged by afterwards, so a
//! new primary whose pilot light is still growing is not failed for replicas that are not due yet. As the standby, a pool passes
//! with a majority of the replicas that run while it waits: the hot and warm ones (a warm replica
//! is asleep and counts as up: its round reports `Asleep`, which the state machine takes as a pass
//! for a standby and a failure for a primary), not the pilot light, which runs only once a
//! promotion grows it.

/// A vLLM sleep level: 1 keeps the weights in host memory, 2 discards them (a wake reloads them).
pub type SleepLevel = u8;

/// How one pool's replicas wait while it is the standby, which is what a promotion of it has to
/// bring up: hot replicas are awake already, warm ones sleep, pilot-light ones are not running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StandbyShape {
    /// Replicas the pool serves with as the primary.
    pub replicas: u32,
    /// Replicas asleep through vLLM's sleep mode.
    pub warm: u32,
    /// The deepest level the warm replicas sleep at; a level-2 wake also serves level 1.
    pub sleep_level: SleepLevel,
    /// Replicas not running, grown on promotion.
    pub pilot_light: u32,
    /// Replicas that must serve before the pool is routed, when the policy says
    /// (`minServingFraction`); a majority otherwise.
    pub min_serving: Option<u32>,
}

impl StandbyShape {
    /// A pool whose every replica waits awake.
    #[must_use]
    pub fn hot(replicas: u32) -> StandbyShape {
        StandbyShape {
            replicas,
            warm: 0,
            sleep_level: 1,
            pilot_light: 0,
            min_serving: None,
        }
    }

    /// This shape with the policy's `minServingFraction` as its serving quorum, when the policy
    /// has one: [`recovery::needed`](crate::recovery::needed) of the pool's replicas. Every home
    /// builds its shapes through this, so the operator and the local game day count alike.
    #[must_use]
    pub fn serving_at(self, fraction: Option<f64>) -> StandbyShape {
        StandbyShape {
            min_serving: fraction.map(|fraction| crate::recovery::needed(self.replicas, fraction)),
            ..self
        }
    }

    /// How many of the warm replicas must be awake before a promotion goes on: what the serving
    /// quorum needs beyond the hot replicas, and no more than sleep.
    #[must_use]
    pub fn warm_needed(&self) -> u32 {
        let hot = self.replicas.saturating_sub(self.warm + self.pilot_light);
        self.serving_quorum().saturating_sub(hot).min(self.warm)
    }

    /// Replicas that must serve before the promoted pool is routed, and for it to pass a round
    /// as the primary after: the policy's share, else [`serving_quorum`] of all.
    #[must_use]
    pub fn serving_quorum(&self) -> u32 {
        self.min_serving.map_or_else(
            || serving_quorum(self.replicas),
            |n| n.clamp(1, self.replicas.max(1)),
        )
    }
}

/// Of `replicas`, how many must serve for the pool to serve: more than half. Waiting for the last
/// pilot-light replica's cold start would stretch the outage, and the admission window shields a
/// partly grown primary.
#[must_use]
pub fn serving_quorum(replicas: u32) -> u32 {
    replicas / 2 + 1
}

/// The role a pool holds while its replicas are probed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// It serves user traffic: every replica should be up.
    Primary,
    /// It waits: its pilot-light replicas are not running.
    Standby,
}

impl Role {
    /// `Primary` when `is_primary`, else `Standby`.
    #[must_use]
    pub fn of(is_primary: bool) -> Role {
        if is_primary { Role::Primary } else { Role::Standby }
    }
}

impl StandbyShape {
    /// How many of the pool's probed replicas must pass a round for the pool to pass in `role`.
    /// The primary: its [`serving_quorum`](Self::serving_quorum), the count its route moved at,
    /// and never more than a majority of all its replicas: a share above one half says when a
    /// promoted pool is worth routing to, and judging the primary by it would fail it over for
    /// one replica restarting. The standby: a majority ([`serving_quorum`]) of the replicas that
    /// run while it waits; one that is all pilot light still needs one replica, since a pool with
    /// nothing running cannot be vouched for.
    #[must_use]
    pub fn round_quorum(&self, role: Role) -> u32 {
        match role {
            Role::Primary => self.serving_quorum().min(serving_quorum(self.replicas)),
            Role::Standby => serving_quorum(self.replicas.saturating_sub(self.pilot_light)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_serves_once_a_majority_of_its_replicas_is_ready() {
        assert_eq!(serving_quorum(1), 1);
        assert_eq!(serving_quorum(2), 2);
        assert_eq!(serving_quorum(4), 3);
        assert_eq!(serving_quorum(5), 3);
        assert_eq!(StandbyShape::hot(8).serving_quorum(), 5);
    }

    #[test]
    fn a_primary_needs_a_majority_of_all_its_replicas_and_a_standby_of_those_not_pilot_light() {
        let east = StandbyShape::hot(4);
        let west = StandbyShape {
            replicas: 8,
            warm: 2,
            sleep_level: 1,
            pilot_light: 5,
            min_serving: None,
        };
        assert_eq!(east.round_quorum(Role::Primary), 3);
        assert_eq!(west.round_quorum(Role::Primary), 5);
        assert_eq!(west.round_quorum(Role::Standby), 2);
        assert_eq!(east.round_quorum(Role::Standby), 3, "no tiers: all hot");
    }

    #[test]
    fn a_primary_is_judged_by_the_count_its_route_moved_at() {
        // Seed 004's worked example: four warm, four pilot light, routed at half capacity.
        let west = StandbyShape {
            replicas: 8,
            warm: 4,
            sleep_level: 1,
            pilot_light: 4,
            min_serving: None,
        };
        let half = west.serving_at(Some(0.5));
        assert_eq!(half.serving_quorum(), 4);
        assert_eq!(
            half.round_quorum(Role::Primary),
            4,
            "the four warm pass it while the pilot light grows"
        );
        assert_eq!(
            half.round_quorum(Role::Standby),
            3,
            "a majority of the four that run"
        );
        assert_eq!(half.warm_needed(), 4, "all four warm before the route at four");
        assert_eq!(west.serving_at(None), west);
        assert_eq!(
            west.round_quorum(Role::Primary),
            5,
            "no fraction: a majority of all"
        );
        let all = west.serving_at(Some(1.0));
        assert_eq!(all.serving_quorum(), 8, "routed once all eight serve");
        assert_eq!(
            all.round_quorum(Role::Primary),
            5,
            "and judged by a majority: one restart is no failure"
        );
    }

    #[test]
    fn a_standby_that_is_all_pilot_light_still_needs_one_replica() {
        let all_pilot = StandbyShape {
            pilot_light: 4,
            ..StandbyShape::hot(4)
        };
        assert_eq!(all_pilot.round_quorum(Role::Standby), 1);
        assert_eq!(all_pilot.round_quorum(Role::Primary), 3);
    }
}
