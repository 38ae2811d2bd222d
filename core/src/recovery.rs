//! Recovery planning: how long a promoted pool takes to serve a share of its capacity, from how
//! long each cold-start stage takes and how its replicas wait, and whether that meets the
//! recovery objective.
//!
//! A replica's time to serve after the decision is the sum of the stages its tier leaves to do:
//! none for a hot replica, a wake and a first token for a warm one, and the whole cold start for
//! a pilot-light one (less the node, when its GPUs are reserved). The pool reaches a fraction `f`
//! of its `n` replicas when the `⌈f·n⌉`-th fastest of them serves. The recovery time adds the
//! detection before the decision. All of it is arithmetic on the stage times given, measured or
//! estimated; nothing here waits.

use std::time::Duration;

use crate::quorum::SleepLevel;

/// One stage of bringing a replica to serve, in the order they happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// A node with free GPUs: provisioning by the cluster autoscaler, then scheduling.
    Node,
    ImagePull,
    /// The image ready → the container process running.
    ContainerStart,
    /// The container running → vLLM starting to load the weights: Python's imports, the engine
    /// core and worker processes starting.
    EngineStart,
    WeightLoad,
    /// Profiling, KV-cache allocation, compilation and graph capture.
    Warmup,
    /// Engine up → the API answers.
    ApiReady,
    /// API ready → the first generated token.
    FirstToken,
    /// A level-1 sleeper's wake: weights back from host memory.
    WakeLevel1,
    /// A level-2 sleeper's wake: weights reloaded from storage.
    WakeLevel2,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 10] = [
        Stage::Node,
        Stage::ImagePull,
        Stage::ContainerStart,
        Stage::EngineStart,
        Stage::WeightLoad,
        Stage::Warmup,
        Stage::ApiReady,
        Stage::FirstToken,
        Stage::WakeLevel1,
        Stage::WakeLevel2,
    ];

    /// The stage [`Stage::as_str`] names.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|stage| stage.as_str() == name)
    }

    /// The name status, metrics and stage files use.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Node => "node",
            Stage::ImagePull => "imagePull",
            Stage::ContainerStart => "containerStart",
            Stage::EngineStart => "engineStart",
            Stage::WeightLoad => "weightLoad",
            Stage::Warmup => "warmup",
            Stage::ApiReady => "apiReady",
            Stage::FirstToken => "firstToken",
            Stage::WakeLevel1 => "wakeLevel1",
            Stage::WakeLevel2 => "wakeLevel2",
        }
    }
}

/// How long each stage takes, measured or estimated. A stage with no figure is unknown, and a
/// plan that needs it says which one is missing rather than guessing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageTimes(Vec<(Stage, Duration)>);

impl StageTimes {
    #[must_use]
    pub fn new() -> StageTimes {
        StageTimes::default()
    }

    /// Sets `stage`'s time.
    #[must_use]
    pub fn with(mut self, stage: Stage, time: Duration) -> StageTimes {
        self.set(stage, time);
        self
    }

    pub fn set(&mut self, stage: Stage, time: Duration) {
        match self.0.iter_mut().find(|(s, _)| *s == stage) {
            Some(entry) => entry.1 = time,
            None => self.0.push((stage, time)),
        }
    }

    #[must_use]
    pub fn get(&self, stage: Stage) -> Option<Duration> {
        self.0.iter().find(|(s, _)| *s == stage).map(|(_, t)| *t)
    }

    /// `self`'s figures, with `fallback`'s where `self` has none: measurements over estimates.
    #[must_use]
    pub fn or(&self, fallback: &StageTimes) -> StageTimes {
        let mut merged = fallback.clone();
        for (stage, time) in &self.0 {
            merged.set(*stage, *time);
        }
        merged
    }
}

/// How a standby replica waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Standby {
    /// Awake: serves at once.
    Hot,
    /// Asleep at this level.
    Warm(SleepLevel),
    /// Not running; `reserved` when placeholder pods hold its GPUs, so no node is provisioned.
    PilotLight { reserved: bool },
}

impl Standby {
    /// The stages a promotion takes this replica through, in order.
    #[must_use]
    pub fn stages(self) -> &'static [Stage] {
        use Stage::*;
        match self {
            Standby::Hot => &[],
            Standby::Warm(1) => &[WakeLevel1, FirstToken],
            Standby::Warm(_) => &[WakeLevel2, FirstToken],
            Standby::PilotLight { reserved: true } => &[
                ImagePull,
                ContainerStart,
                EngineStart,
                WeightLoad,
                Warmup,
                ApiReady,
                FirstToken,
            ],
            Standby::PilotLight { reserved: false } => &[
                Node,
                ImagePull,
                ContainerStart,
                EngineStart,
                WeightLoad,
                Warmup,
                ApiReady,
                FirstToken,
            ],
        }
    }

    /// Whether the replica holds its GPUs while it waits: a sleeping vLLM keeps its pod and so
    /// its GPUs; an unreserved pilot light holds none.
    #[must_use]
    pub fn holds_gpus(self) -> bool {
        !matches!(self, Standby::PilotLight { reserved: false })
    }

    /// How reports name it.
    #[must_use]
    pub fn label(self) -> String {
        match self {
            Standby::Hot => "hot".to_owned(),
            Standby::Warm(level) => format!("warm (level {level})"),
            Standby::PilotLight { reserved: true } => "pilot light (GPUs reserved)".to_owned(),
            Standby::PilotLight { reserved: false } => "pilot light".to_owned(),
        }
    }

    /// Every way of waiting, fastest first.
    pub const ALL: [Standby; 5] = [
        Standby::Hot,
        Standby::Warm(1),
        Standby::Warm(2),
        Standby::PilotLight { reserved: true },
        Standby::PilotLight { reserved: false },
    ];
}

/// A stage the plan needs and has no figure for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no time for the {} stage, which a {} replica goes through", .stage.as_str(), .standby.label())]
pub struct MissingStage {
    pub stage: Stage,
    pub standby: Standby,
}

/// How long one replica waiting as `standby` takes to serve after the decision, and its slowest
/// stage (none for a hot replica).
pub fn time_to_serve(
    standby: Standby,
    times: &StageTimes,
) -> Result<(Duration, Option<Stage>), MissingStage> {
    let mut total = Duration::ZERO;
    let mut slowest: Option<(Stage, Duration)> = None;
    for &stage in standby.stages() {
        let time = times.get(stage).ok_or(MissingStage { stage, standby })?;
        total += time;
        if slowest.is_none_or(|(_, t)| time > t) {
            slowest = Some((stage, time));
        }
    }
    Ok((total, slowest.map(|(stage, _)| stage)))
}

/// A pool's replicas by how they wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mix(pub Vec<(Standby, u32)>);

impl Mix {
    /// The same pool with `n` of its level-1 sleepers sleeping at level 2 instead (as many as it
    /// has, at most).
    #[must_use]
    pub fn deeper(&self, n: u32) -> Mix {
        let mut left = n;
        let mut mix: Vec<(Standby, u32)> = Vec::with_capacity(self.0.len() + 1);
        let mut moved = 0;
        for &(standby, count) in &self.0 {
            let take = if standby == Standby::Warm(1) {
                count.min(left)
            } else {
                0
            };
            left -= take;
            moved += take;
            if count > take {
                mix.push((standby, count - take));
            }
        }
        if moved > 0 {
            match mix.iter_mut().find(|(standby, _)| *standby == Standby::Warm(2)) {
                Some((_, count)) => *count += moved,
                None => mix.push((Standby::Warm(2), moved)),
            }
        }
        Mix(mix)
    }

    #[must_use]
    pub fn replicas(&self) -> u32 {
        self.0.iter().map(|(_, n)| n).sum()
    }

    /// GPUs held while the pool stands by.
    #[must_use]
    pub fn gpus_held(&self, gpus_per_replica: u32) -> u32 {
        self.0
            .iter()
            .filter(|(standby, _)| standby.holds_gpus())
            .map(|(_, n)| n * gpus_per_replica)
            .sum()
    }

    /// How people read it: `4 × warm (level 1) + 4 × pilot light`.
    #[must_use]
    pub fn label(&self) -> String {
        let parts: Vec<String> = self
            .0
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(standby, n)| format!("{n} × {}", standby.label()))
            .collect();
        parts.join(" + ")
    }

    /// How many replicas make `fraction` of the pool: [`needed`].
    #[must_use]
    pub fn needed(&self, fraction: f64) -> u32 {
        needed(self.replicas(), fraction)
    }

    /// When `fraction` of the replicas serve, counted from the decision, and the replica and stage
    /// that make it that late.
    pub fn time_to(&self, fraction: f64, times: &StageTimes) -> Result<Reached, MissingStage> {
        let mut ready = Vec::new();
        for &(standby, n) in &self.0 {
            let (time, slowest) = time_to_serve(standby, times)?;
            ready.extend(std::iter::repeat_n((time, standby, slowest), n as usize));
        }
        ready.sort_by_key(|(time, _, _)| *time);
        let needed = self.needed(fraction) as usize;
        let (after, standby, slowest) =
            ready
                .get(needed.saturating_sub(1))
                .copied()
                .unwrap_or((Duration::ZERO, Standby::Hot, None));
        Ok(Reached {
            after,
            standby,
            slowest,
        })
    }
}

/// How many of `replicas` make `fraction` of them: `⌈fraction·replicas⌉`, at least one.
#[must_use]
pub fn needed(replicas: u32, fraction: f64) -> u32 {
    let exact = f64::from(replicas) * fraction.clamp(0.0, 1.0);
    // Within a rounding error of a whole number, that number: 0.7 × 10 is 7, not 8.
    let needed = if (exact - exact.round()).abs() < 1e-9 {
        exact.round()
    } else {
        exact.ceil()
    };
    // In 0..=replicas after the clamp above, so the cast neither truncates nor wraps.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let needed = needed as u32;
    needed.clamp(1, replicas.max(1))
}

/// When a share of the pool serves, and what decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reached {
    /// From the decision.
    pub after: Duration,
    /// How the replica that completes the share waited.
    pub standby: Standby,
    /// That replica's slowest stage.
    pub slowest: Option<Stage>,
}

/// What a recovery must do: reach `fraction` of capacity within `objective` of the fault, of
/// which `detection` goes before the decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Objective {
    pub objective: Duration,
    pub detection: Duration,
    pub fraction: f64,
}

/// A mix judged against an objective.
#[derive(Clone, Debug, PartialEq)]
pub struct Judged {
    pub mix: Mix,
    pub reached: Reached,
    /// Detection plus the time to the fraction.
    pub recovery: Duration,
    pub met: bool,
}

impl Judged {
    /// One plain sentence: met or not, when, and the stage that breaks it.
    #[must_use]
    pub fn message(&self, objective: &Objective) -> String {
        let serving = format!(
            "{} of {} replicas serving",
            self.mix.needed(objective.fraction),
            self.mix.replicas()
        );
        let recovery = secs(self.recovery);
        let limit = secs(objective.objective);
        let detection = secs(objective.detection);
        let mix = self.mix.label();
        match (self.met, self.reached.slowest) {
            (true, _) => format!(
                "{mix} has {serving} {recovery} after a fault (detection {detection}), within the \
                 {limit} objective"
            ),
            (false, Some(stage)) => format!(
                "{mix} has {serving} only {recovery} after a fault (detection {detection}), past the \
                 {limit} objective: the {} replicas' {} stage breaks it",
                self.reached.standby.label(),
                stage.as_str()
            ),
            (false, None) => {
                format!("{mix} cannot meet the {limit} objective: detection alone takes {detection}")
            }
        }
    }
}

/// Judges `mix` against `objective`.
pub fn judge(mix: &Mix, times: &StageTimes, objective: &Objective) -> Result<Judged, MissingStage> {
    let reached = mix.time_to(objective.fraction, times)?;
    let recovery = objective.detection + reached.after;
    Ok(Judged {
        mix: mix.clone(),
        reached,
        recovery,
        met: recovery <= objective.objective,
    })
}

/// Every mix of `replicas` with at most two ways of waiting, `k` of the faster and the rest of
/// the slower, the single-tier mixes included.
#[must_use]
pub fn two_tier_mixes(replicas: u32) -> Vec<Mix> {
    let mut mixes: Vec<Mix> = Standby::ALL.iter().map(|&s| Mix(vec![(s, replicas)])).collect();
    for (i, &fast) in Standby::ALL.iter().enumerate() {
        for &slow in &Standby::ALL[i + 1..] {
            for k in 1..replicas {
                mixes.push(Mix(vec![(fast, k), (slow, replicas - k)]));
            }
        }
    }
    mixes
}

/// Of the mixes of `replicas` that meet `objective`, the one that holds the fewest GPUs; of those,
/// the one with the fewest replicas awake (a sleeping replica holds its GPUs but not their memory
/// or power), then the fastest. `None` when no mix meets it. Mixes that need a stage with no
/// figure are left out.
#[must_use]
pub fn cheapest_meeting(
    replicas: u32,
    gpus_per_replica: u32,
    times: &StageTimes,
    objective: &Objective,
) -> Option<Judged> {
    two_tier_mixes(replicas)
        .iter()
        .filter_map(|mix| judge(mix, times, objective).ok())
        .filter(|judged| judged.met)
        .min_by_key(|judged| {
            let awake: u32 = judged
                .mix
                .0
                .iter()
                .filter(|(s, _)| *s == Standby::Hot)
                .map(|(_, n)| n)
                .sum();
            (judged.mix.gpus_held(gpus_per_replica), awake, judged.recovery)
        })
}

/// `93s` as `1m33s`, `45.5s` as `45.5s`: how the planner prints times, to a tenth of a second.
#[must_use]
pub fn secs(d: Duration) -> String {
    // Rounded once, before the split, so 119.97 s is `2m` and never `1m60s`.
    let tenths = (d.as_secs_f64() * 10.0).round() as u64;
    let (minutes, tenths) = (tenths / 600, tenths % 600);
    let rest = if tenths % 10 == 0 {
        format!("{}s", tenths / 10)
    } else {
        format!("{}.{}s", tenths / 10, tenths % 10)
    };
    match (minutes, tenths) {
        (0, _) => rest,
        (m, 0) => format!("{m}m"),
        (m, _) => format!("{m}m{rest}"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    /// Seed 004's team: a 70B model, 140 GB of weights from network storage at 2 GB/s, nodes that
    /// take minutes to provision.
    fn seed_004() -> StageTimes {
        StageTimes::new()
            .with(Stage::Node, s(360))
            .with(Stage::ImagePull, s(120))
            .with(Stage::ContainerStart, s(1))
            .with(Stage::EngineStart, s(9))
            .with(Stage::WeightLoad, s(70))
            .with(Stage::Warmup, s(60))
            .with(Stage::ApiReady, s(5))
            .with(Stage::FirstToken, s(2))
            .with(Stage::WakeLevel1, s(25))
            .with(Stage::WakeLevel2, s(75))
    }

    #[test]
    fn a_deeper_mix_moves_level_one_sleepers_to_level_two_and_no_more_than_there_are() {
        let mix = Mix(vec![
            (Standby::Hot, 1),
            (Standby::Warm(1), 2),
            (Standby::Warm(2), 1),
        ]);
        assert_eq!(
            mix.deeper(1),
            Mix(vec![
                (Standby::Hot, 1),
                (Standby::Warm(1), 1),
                (Standby::Warm(2), 2)
            ])
        );
        assert_eq!(mix.deeper(5), Mix(vec![(Standby::Hot, 1), (Standby::Warm(2), 3)]));
        assert_eq!(mix.deeper(0), mix);
    }

    fn objective(fraction: f64) -> Objective {
        Objective {
            objective: s(300),
            detection: s(30),
            fraction,
        }
    }

    #[test]
    fn each_tier_goes_through_its_own_stages() {
        let times = seed_004();
        assert_eq!(time_to_serve(Standby::Hot, &times), Ok((Duration::ZERO, None)));
        assert_eq!(
            time_to_serve(Standby::Warm(1), &times),
            Ok((s(27), Some(Stage::WakeLevel1)))
        );
        assert_eq!(
            time_to_serve(Standby::Warm(2), &times),
            Ok((s(77), Some(Stage::WakeLevel2)))
        );
        let reserved = time_to_serve(Standby::PilotLight { reserved: true }, &times);
        assert_eq!(reserved, Ok((s(267), Some(Stage::ImagePull))));
        let cold = time_to_serve(Standby::PilotLight { reserved: false }, &times);
        assert_eq!(cold, Ok((s(627), Some(Stage::Node))));
    }

    #[test]
    fn a_missing_stage_is_named_never_guessed() {
        let times = seed_004();
        let mut partial = StageTimes::new().with(Stage::FirstToken, s(2));
        partial.set(Stage::WakeLevel1, s(20));
        assert!(time_to_serve(Standby::Warm(1), &partial).is_ok());
        let missing = time_to_serve(Standby::PilotLight { reserved: false }, &partial);
        assert_eq!(
            missing,
            Err(MissingStage {
                stage: Stage::Node,
                standby: Standby::PilotLight { reserved: false }
            })
        );
        assert_eq!(
            missing.unwrap_err().to_string(),
            "no time for the node stage, which a pilot light replica goes through"
        );
        // Measurements win over estimates, stage by stage.
        let merged = partial.or(&times);
        assert_eq!(merged.get(Stage::WakeLevel1), Some(s(20)));
        assert_eq!(merged.get(Stage::Node), Some(s(360)));
    }

    #[test]
    fn a_fraction_needs_the_ceiling_of_its_share_of_replicas() {
        let mix = Mix(vec![(Standby::Hot, 8)]);
        assert_eq!(mix.needed(0.5), 4);
        assert_eq!(mix.needed(0.51), 5);
        assert_eq!(mix.needed(1.0), 8);
        assert_eq!(mix.needed(0.01), 1);
        assert_eq!(Mix(vec![(Standby::Hot, 10)]).needed(0.8), 8);
        assert_eq!(Mix(vec![(Standby::Hot, 10)]).needed(0.7), 7);
    }

    /// Seed 004's worked example: pilot light alone misses a five-minute objective because of
    /// node provisioning; four warm and four pilot light reach half capacity in about a minute,
    /// and nothing holding fewer GPUs meets it.
    #[test]
    fn seed_004_four_warm_and_four_pilot_light_meet_five_minutes_where_pilot_light_misses() {
        let times = seed_004();
        let half = objective(0.5);

        let pilot = judge(
            &Mix(vec![(Standby::PilotLight { reserved: false }, 8)]),
            &times,
            &half,
        )
        .unwrap();
        assert!(!pilot.met);
        assert_eq!(pilot.recovery, s(30 + 627));
        assert_eq!(pilot.reached.slowest, Some(Stage::Node));
        assert!(
            pilot.message(&half).contains("node stage breaks it"),
            "{}",
            pilot.message(&half)
        );

        let chosen = Mix(vec![
            (Standby::Warm(1), 4),
            (Standby::PilotLight { reserved: false }, 4),
        ]);
        let judged = judge(&chosen, &times, &half).unwrap();
        assert!(judged.met);
        assert_eq!(judged.recovery, s(30 + 27), "about a minute");
        assert_eq!(chosen.gpus_held(2), 8);

        let cheapest = cheapest_meeting(8, 2, &times, &half).unwrap();
        assert_eq!(cheapest.mix, chosen);
        // The rest of the pool arrives with the pilot light, past the objective: admission
        // control shields the half that serves until then.
        let whole = judge(&chosen, &times, &objective(1.0)).unwrap();
        assert!(!whole.met);
    }

    #[test]
    fn the_message_names_the_replicas_serving_and_what_breaks_the_objective() {
        let times = seed_004();
        let chosen = Mix(vec![
            (Standby::Warm(1), 4),
            (Standby::PilotLight { reserved: false }, 4),
        ]);
        let majority = objective(5.0 / 8.0);
        let judged = judge(&chosen, &times, &majority).unwrap();
        assert_eq!(
            judged.message(&majority),
            "4 × warm (level 1) + 4 × pilot light has 5 of 8 replicas serving only 10m57s after a \
             fault (detection 30s), past the 5m objective: the pilot light replicas' node stage breaks it"
        );
        let blind = Objective {
            detection: s(400),
            ..majority
        };
        let hot = judge(&Mix(vec![(Standby::Hot, 8)]), &times, &blind).unwrap();
        assert_eq!(
            hot.message(&blind),
            "8 × hot cannot meet the 5m objective: detection alone takes 6m40s"
        );
    }

    #[test]
    fn hot_replicas_meet_any_objective_longer_than_detection_and_none_meets_a_shorter_one() {
        let slow = seed_004().with(Stage::FirstToken, s(400));
        let hot = judge(&Mix(vec![(Standby::Hot, 8)]), &slow, &objective(1.0)).unwrap();
        assert!(hot.met);
        let cheapest = cheapest_meeting(8, 2, &slow, &objective(0.5)).unwrap();
        assert_eq!(
            cheapest.mix,
            Mix(vec![
                (Standby::Hot, 4),
                (Standby::PilotLight { reserved: false }, 4)
            ])
        );
        let too_slow_to_notice = Objective {
            detection: s(301),
            ..objective(0.5)
        };
        assert_eq!(cheapest_meeting(8, 2, &slow, &too_slow_to_notice), None);
    }

    #[test]
    fn stage_names_read_back() {
        for stage in Stage::ALL {
            assert_eq!(Stage::from_name(stage.as_str()), Some(stage));
        }
        assert_eq!(Stage::from_name("weight-load"), None);
    }

    #[test]
    fn times_print_as_minutes_and_seconds() {
        assert_eq!(secs(s(57)), "57s");
        assert_eq!(secs(s(657)), "10m57s");
        assert_eq!(secs(s(300)), "5m");
        assert_eq!(secs(Duration::from_millis(45_500)), "45.5s");
        assert_eq!(secs(Duration::from_millis(119_970)), "2m");
        assert_eq!(secs(Duration::from_millis(59_970)), "1m");
        assert_eq!(secs(Duration::ZERO), "0s");
    }
}
