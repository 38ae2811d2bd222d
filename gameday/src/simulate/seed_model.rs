//! Seed 002's `failover/model.mjs`, transliterated line by line, as the reference the simulator
//! must agree with. Its constants (promotion rounds, failback threshold) are parameters here.
//! Nothing in the product calls this: it exists so tests can compare against the definition.

use super::{Condition, Faults};

#[derive(Debug, Default, PartialEq, Eq)]
pub struct SeedOutcome {
    pub dropped: u32,
    pub silent: u32,
    pub failovers: u32,
    pub false_failovers: u32,
    pub failbacks: u32,
    pub window: u32,
}

pub struct SeedParams {
    pub rounds: u32,
    pub threshold: u32,
    pub automatic_failback: bool,
    pub promotion: u32,
    pub failback_threshold: u32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Active {
    A,
    B,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Failover,
    Failback,
}

pub fn run(faults: &Faults, params: &SeedParams) -> SeedOutcome {
    let is_responsive = |t| matches!(faults.condition(t), Condition::Up | Condition::HalfFailed);
    let is_healthy = |t| faults.condition(t) == Condition::Up;
    let mut s = SeedOutcome::default();
    let (mut active, mut consecutive, mut healthy) = (Active::A, 0, 0);
    let mut done_at: Option<(u32, Direction)> = None;
    for t in 1..=params.rounds {
        let responds = if active == Active::A {
            is_responsive(t)
        } else {
            true
        };
        if let Some((at, direction)) = done_at {
            s.window += 1;
            s.dropped += 1;
            if t == at {
                if direction == Direction::Failover && is_responsive(t + 1) {
                    s.false_failovers += 1;
                }
                active = if direction == Direction::Failover {
                    Active::B
                } else {
                    Active::A
                };
                done_at = None;
                consecutive = 0;
                healthy = 0;
            }
            continue;
        }
        if active == Active::A && !responds {
            consecutive += 1;
            s.dropped += 1;
            if consecutive >= params.threshold {
                done_at = Some((t + params.promotion, Direction::Failover));
                s.failovers += 1;
            }
            continue;
        }
        consecutive = 0;
        if active == Active::B && params.automatic_failback {
            healthy = if is_responsive(t) { healthy + 1 } else { 0 };
            if healthy >= params.failback_threshold {
                done_at = Some((t + params.promotion, Direction::Failback));
                s.failbacks += 1;
                healthy = 0;
                continue;
            }
        }
        if active == Active::A && !is_healthy(t) {
            s.silent += 1;
        }
    }
    s
}
