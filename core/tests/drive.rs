//! The step driver against a recording executor: which calls a promotion makes for each mix of
//! standby tiers, and that a driver restarted at any point ends where one uninterrupted run ends,
//! under one epoch.

use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use understudy_core::drive::{
    Completion, Driven, Executor, LeaseClaim, ScaleOrder, ServingOrder, StepOutcome, Target, WakeOrder, drive,
};
use understudy_core::failover::{
    Command, ControlPlane, Event, FailbackPolicy, FailoverConfig, FailoverState, Input, Phase, Step,
};
use understudy_core::quorum::{SleepLevel, StandbyShape};
use understudy_core::{Epoch, Pool};

const NOW: Duration = Duration::from_secs(1_000);
/// How long a promotion here may take before its steps are overdue.
const DEADLINE: Duration = Duration::from_secs(60);

fn config() -> FailoverConfig {
    FailoverConfig {
        suspect_after: 1,
        promote_after: 1,
        hard_promote_after: 1,
        standby_ready_after: 1,
        min_dwell: Duration::ZERO,
        failback: FailbackPolicy::Manual,
        paused: false,
    }
}

/// The recording executor's futures never wait: poll once.
fn now<F: Future>(future: F) -> F::Output {
    match pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the recording executor never waits"),
    }
}

/// One call the driver made.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    AcquireLease(LeaseClaim),
    FenceOld(Target),
    Wake(WakeOrder),
    Scale(ScaleOrder),
    AwaitServing(ServingOrder),
    Route(Target),
    OpenAdmission(Target),
}

/// What lives outside the driver and survives its restarts: the lease and pool B's replicas.
#[derive(Clone, Debug)]
struct World {
    lease: (Pool, Epoch),
    lease_writes: u32,
    asleep: u32,
    running: u32,
    /// Polls of a started pilot-light replica before it serves: its cold start.
    cold_start_polls: u32,
    starting: Vec<u32>,
    routed: Option<Target>,
    calls: Vec<Call>,
}

impl World {
    /// Pool B as the standby of `shape`: its warm replicas asleep, its pilot light not running.
    fn new(shape: StandbyShape) -> World {
        World {
            lease: (Pool::A, Epoch(0)),
            lease_writes: 0,
            asleep: shape.warm,
            running: shape.replicas - shape.pilot_light,
            cold_start_polls: 2,
            starting: Vec::new(),
            routed: None,
            calls: Vec::new(),
        }
    }

    fn serving(&self) -> u32 {
        self.running - self.asleep - u32::try_from(self.starting.len()).unwrap_or(u32::MAX)
    }
}

struct Recorder<'w> {
    world: &'w mut World,
}

type Outcome = StepOutcome<String>;

impl Executor for Recorder<'_> {
    type Wait = String;

    async fn acquire_lease(&mut self, claim: LeaseClaim) -> Outcome {
        self.world.calls.push(Call::AcquireLease(claim));
        if self.world.lease == (claim.holder, claim.epoch) {
            return StepOutcome::Done(Completion::noted("recorder", "already written".to_owned()));
        }
        if self.world.lease.1 != claim.expected {
            return StepOutcome::LostRace;
        }
        self.world.lease = (claim.holder, claim.epoch);
        self.world.lease_writes += 1;
        StepOutcome::Done(Completion::by("recorder"))
    }

    async fn fence_old(&mut self, old: Target) -> Outcome {
        self.world.calls.push(Call::FenceOld(old));
        StepOutcome::Done(Completion::by("recorder"))
    }

    async fn wake(&mut self, order: WakeOrder) -> Outcome {
        self.world.calls.push(Call::Wake(order));
        self.world.asleep = 0;
        StepOutcome::Done(Completion::by("recorder"))
    }

    async fn scale(&mut self, order: ScaleOrder) -> Outcome {
        self.world.calls.push(Call::Scale(order));
        let world = &mut *self.world;
        while world.running < order.replicas {
            world.running += 1;
            world.starting.push(world.cold_start_polls);
        }
        StepOutcome::Done(Completion::by("recorder"))
    }

    async fn await_serving(&mut self, order: ServingOrder) -> Outcome {
        self.world.calls.push(Call::AwaitServing(order));
        let world = &mut *self.world;
        for polls in &mut world.starting {
            *polls = polls.saturating_sub(1);
        }
        world.starting.retain(|polls| *polls > 0);
        if world.serving() >= order.quorum {
            StepOutcome::Done(Completion::by("recorder"))
        } else {
            StepOutcome::NotYet(format!("{} of {} serve", world.serving(), order.quorum))
        }
    }

    async fn route(&mut self, new: Target) -> Outcome {
        self.world.calls.push(Call::Route(new));
        self.world.routed = Some(new);
        StepOutcome::Done(Completion::by("recorder"))
    }

    async fn open_admission(&mut self, new: Target) -> Outcome {
        self.world.calls.push(Call::OpenAdmission(new));
        StepOutcome::Done(Completion::by("recorder"))
    }
}

/// A switchover to B just decided: the machine's first step pending.
fn promoting() -> FailoverState {
    let (state, _) = FailoverState::new().step(
        &config(),
        NOW,
        &Input::Check {
            pool: Pool::B,
            result: understudy_core::failover::CheckResult::Pass,
        },
    );
    let (state, _) = state.step(&config(), NOW, &Input::Command(Command::Failover));
    assert!(matches!(state.phase, Phase::Promoting(_)), "{:?}", state.phase);
    state
}

fn shapes(b: StandbyShape) -> [StandbyShape; 2] {
    [StandbyShape::hot(b.replicas), b]
}

/// One drive call, as a fresh driver would make it over `world`.
fn drive_once(state: &FailoverState, shape: StandbyShape, world: &mut World) -> Option<Driven<String>> {
    drive_at(state, shape, world, NOW)
}

/// One drive call with the clock at `at`.
fn drive_at(
    state: &FailoverState,
    shape: StandbyShape,
    world: &mut World,
    at: Duration,
) -> Option<Driven<String>> {
    now(drive(
        state,
        &config(),
        || at,
        &shapes(shape),
        DEADLINE,
        &mut Recorder { world },
    ))
}

/// Drives until the promotion is finished, calling again after each wait as a home's next round
/// would; returns the end state.
fn drive_to_the_end(state: FailoverState, shape: StandbyShape, world: &mut World) -> FailoverState {
    drive_to_the_end_at(state, shape, world, NOW)
}

fn warm(replicas: u32, level: SleepLevel) -> StandbyShape {
    StandbyShape {
        replicas,
        warm: replicas,
        sleep_level: level,
        pilot_light: 0,
        min_serving: None,
    }
}

fn pilot_light(replicas: u32) -> StandbyShape {
    StandbyShape {
        replicas,
        warm: 0,
        sleep_level: 1,
        pilot_light: replicas,
        min_serving: None,
    }
}

fn four_warm_four_pilot_light() -> StandbyShape {
    StandbyShape {
        replicas: 8,
        warm: 4,
        sleep_level: 1,
        pilot_light: 4,
        min_serving: None,
    }
}

fn calls_of_one_promotion(shape: StandbyShape) -> (Vec<Call>, FailoverState, World) {
    let mut world = World::new(shape);
    let end = drive_to_the_end(promoting(), shape, &mut world);
    (world.calls.clone(), end, world)
}

const EPOCH: Epoch = Epoch(1);
const B: Target = Target {
    pool: Pool::B,
    epoch: EPOCH,
    overdue: None,
};
const A: Target = Target {
    pool: Pool::A,
    epoch: EPOCH,
    overdue: None,
};
const CLAIM: LeaseClaim = LeaseClaim {
    expected: Epoch(0),
    holder: Pool::B,
    epoch: EPOCH,
};

fn serving(quorum: u32, replicas: u32) -> Call {
    Call::AwaitServing(ServingOrder {
        pool: Pool::B,
        epoch: EPOCH,
        quorum,
        replicas,
        overdue: None,
    })
}

fn scale(replicas: u32, pilot_light: u32) -> Call {
    Call::Scale(ScaleOrder {
        pool: Pool::B,
        epoch: EPOCH,
        replicas,
        pilot_light,
        overdue: None,
    })
}

fn wake(replicas: u32, needed: u32, level: SleepLevel) -> Call {
    Call::Wake(WakeOrder {
        pool: Pool::B,
        epoch: EPOCH,
        replicas,
        needed,
        level,
        overdue: None,
        left: DEADLINE,
    })
}

#[test]
fn a_hot_standby_is_promoted_by_a_route_switch_with_nobody_asleep_to_wake() {
    let (calls, end, world) = calls_of_one_promotion(StandbyShape::hot(4));
    assert_eq!(
        calls,
        vec![
            Call::AcquireLease(CLAIM),
            Call::FenceOld(A),
            wake(0, 0, 1),
            scale(4, 0),
            serving(3, 4),
            Call::Route(B),
            Call::OpenAdmission(B),
        ]
    );
    assert_eq!(
        (end.primary, end.epoch, end.phase),
        (Pool::B, EPOCH, Phase::Serving)
    );
    assert_eq!(world.routed, Some(B));
}

#[test]
fn a_warm_standby_at_level_one_is_woken_then_routed() {
    let (calls, ..) = calls_of_one_promotion(warm(4, 1));
    assert_eq!(
        calls,
        vec![
            Call::AcquireLease(CLAIM),
            Call::FenceOld(A),
            wake(4, 3, 1),
            scale(4, 0),
            serving(3, 4),
            Call::Route(B),
            Call::OpenAdmission(B),
        ]
    );
}

#[test]
fn a_warm_standby_at_level_two_is_woken_at_level_two_so_its_weights_are_reloaded() {
    let (calls, ..) = calls_of_one_promotion(warm(4, 2));
    assert_eq!(calls[2], wake(4, 3, 2));
    assert_eq!(calls.len(), 7, "{calls:?}");
}

#[test]
fn a_pilot_light_standby_grows_and_is_routed_only_once_a_quorum_has_cold_started() {
    let (calls, end, _) = calls_of_one_promotion(pilot_light(4));
    assert_eq!(
        calls,
        vec![
            Call::AcquireLease(CLAIM),
            Call::FenceOld(A),
            wake(0, 0, 1),
            scale(4, 4),
            // Two polls of cold start: the first finds nobody serving and waits.
            serving(3, 4),
            serving(3, 4),
            Call::Route(B),
            Call::OpenAdmission(B),
        ]
    );
    assert_eq!(end.phase, Phase::Serving);
}

#[test]
fn four_warm_and_four_pilot_light_route_on_the_woken_four_and_a_fifth_cold_start() {
    let (calls, ..) = calls_of_one_promotion(four_warm_four_pilot_light());
    assert_eq!(
        calls,
        vec![
            Call::AcquireLease(CLAIM),
            Call::FenceOld(A),
            wake(4, 4, 1),
            scale(8, 4),
            serving(5, 8),
            serving(5, 8),
            Call::Route(B),
            Call::OpenAdmission(B),
        ]
    );
}

#[test]
fn with_half_as_the_serving_share_four_warm_and_four_pilot_light_route_on_the_woken_four() {
    // `minServingFraction: 0.5`: four of eight serve once the warm four are awake, so the route
    // moves without waiting for any cold start.
    let shape = StandbyShape {
        min_serving: Some(4),
        ..four_warm_four_pilot_light()
    };
    let (calls, ..) = calls_of_one_promotion(shape);
    assert_eq!(
        calls,
        vec![
            Call::AcquireLease(CLAIM),
            Call::FenceOld(A),
            wake(4, 4, 1),
            scale(8, 4),
            serving(4, 8),
            Call::Route(B),
            Call::OpenAdmission(B),
        ]
    );
}

#[test]
fn a_step_that_waits_stops_the_driver_at_that_step_with_the_homes_reason() {
    let shape = pilot_light(4);
    let mut world = World::new(shape);
    let mut state = promoting();
    let driven = loop {
        let driven = drive_once(&state, shape, &mut world).unwrap_or_else(|| panic!("nothing pending"));
        state = driven.state.clone();
        if !driven.carries_on() {
            break driven;
        }
    };
    assert_eq!(driven.step, Step::AwaitServing);
    assert_eq!(driven.outcome, StepOutcome::NotYet("0 of 3 serve".to_owned()));
    assert!(matches!(&state.phase, Phase::Promoting(p) if p.step == Step::AwaitServing));
    // Nobody may serve while the promoted pool waits: the router's waiting room holds requests.
    assert_eq!(state.routable(), None);
}

#[test]
fn the_driven_step_that_finishes_the_promotion_returns_its_whole_timeline() {
    let shape = StandbyShape::hot(2);
    let mut world = World::new(shape);
    let mut state = promoting();
    let mut finished = None;
    while let Some(driven) = drive_once(&state, shape, &mut world) {
        state = driven.state;
        if driven.finished.is_some() {
            assert!(
                driven
                    .events
                    .iter()
                    .any(|e| matches!(e, Event::PromotionFinished { .. }))
            );
            finished = driven.finished;
        }
    }
    let finished = finished.unwrap_or_else(|| panic!("no promotion finished"));
    let steps: Vec<Step> = finished.done.iter().map(|(step, _)| *step).collect();
    assert_eq!(steps, Step::ALL);
}

#[test]
fn a_driver_restarted_after_every_step_ends_where_one_run_ends_under_one_epoch() {
    let shape = four_warm_four_pilot_light();
    let (_, uninterrupted, _) = calls_of_one_promotion(shape);
    for crash_after in 1..=9 {
        let mut world = World::new(shape);
        let mut state = promoting();
        for _ in 0..crash_after {
            match drive_once(&state, shape, &mut world) {
                Some(driven) => state = driven.state,
                None => break,
            }
        }
        // The process dies; a new one reads back the state recorded after the last step.
        let recorded = serde_json::to_string(&state).unwrap_or_else(|e| panic!("{e}"));
        let restarted: FailoverState = serde_json::from_str(&recorded).unwrap_or_else(|e| panic!("{e}"));
        let end = drive_to_the_end(restarted, shape, &mut world);
        assert_eq!(end, uninterrupted, "restarted after {crash_after} step(s)");
        assert_eq!(world.lease, (Pool::B, EPOCH));
        assert_eq!(world.lease_writes, 1, "restarted after {crash_after} step(s)");
    }
}

#[test]
fn a_step_whose_record_was_lost_is_called_again_and_done_once() {
    let shape = four_warm_four_pilot_light();
    let (_, uninterrupted, _) = calls_of_one_promotion(shape);
    for lost in 0..8 {
        let mut world = World::new(shape);
        let mut state = promoting();
        for _ in 0..lost {
            if let Some(driven) = drive_once(&state, shape, &mut world) {
                state = driven.state;
            }
        }
        // The step takes effect, and the process dies before its outcome is recorded.
        let _lost_record = drive_once(&state, shape, &mut world);
        let end = drive_to_the_end(state, shape, &mut world);
        assert_eq!(end, uninterrupted, "record of step {} lost", lost + 1);
        assert_eq!(world.lease_writes, 1, "record of step {} lost", lost + 1);
        assert_eq!(world.running, 8);
    }
}

#[test]
fn after_a_lost_race_the_driver_calls_nothing_until_the_lease_is_read_again() {
    let shape = StandbyShape::hot(2);
    let mut world = World::new(shape);
    world.lease = (Pool::A, Epoch(3)); // somebody else moved it
    let driven = drive_once(&promoting(), shape, &mut world).unwrap_or_else(|| panic!("nothing pending"));
    assert_eq!(driven.outcome, StepOutcome::LostRace);
    assert!(driven.events.contains(&Event::LostRace { epoch: EPOCH }));
    assert!(!driven.state.lease_known);
    let calls = world.calls.len();
    assert!(drive_once(&driven.state, shape, &mut world).is_none());
    assert_eq!(world.calls.len(), calls);
    assert_eq!(world.lease_writes, 0);
}

/// An executor whose control plane is gone.
struct Partitioned;

impl Executor for Partitioned {
    type Wait = &'static str;
    async fn acquire_lease(&mut self, _: LeaseClaim) -> StepOutcome<&'static str> {
        StepOutcome::Unreachable("no route to the API server")
    }
    async fn fence_old(&mut self, _: Target) -> StepOutcome<&'static str> {
        unreachable!("only the lease step is pending")
    }
    async fn wake(&mut self, _: WakeOrder) -> StepOutcome<&'static str> {
        unreachable!("only the lease step is pending")
    }
    async fn scale(&mut self, _: ScaleOrder) -> StepOutcome<&'static str> {
        unreachable!("only the lease step is pending")
    }
    async fn await_serving(&mut self, _: ServingOrder) -> StepOutcome<&'static str> {
        unreachable!("only the lease step is pending")
    }
    async fn route(&mut self, _: Target) -> StepOutcome<&'static str> {
        unreachable!("only the lease step is pending")
    }
    async fn open_admission(&mut self, _: Target) -> StepOutcome<&'static str> {
        unreachable!("only the lease step is pending")
    }
}

#[test]
fn an_unreachable_control_plane_pauses_the_promotion_at_its_step_until_it_is_back() {
    let shapes = shapes(StandbyShape::hot(2));
    let driven = now(drive(
        &promoting(),
        &config(),
        || NOW,
        &shapes,
        DEADLINE,
        &mut Partitioned,
    ))
    .unwrap_or_else(|| panic!("nothing pending"));
    assert_eq!(driven.state.control_plane, ControlPlane::Unreachable);
    assert!(driven.events.contains(&Event::ControlPlaneUnreachable));
    assert!(matches!(&driven.state.phase, Phase::Promoting(p) if p.step == Step::AcquireLease));
    assert!(
        now(drive(
            &driven.state,
            &config(),
            || NOW,
            &shapes,
            DEADLINE,
            &mut Partitioned
        ))
        .is_none()
    );
}

#[test]
fn a_promotion_past_its_deadline_tells_every_step_it_is_overdue() {
    let shape = four_warm_four_pilot_light();
    let mut world = World::new(shape);
    // Started at NOW; every call made a second before the deadline, then at it.
    let mut state = promoting();
    let mut orders = Vec::new();
    for at in [NOW + DEADLINE - Duration::from_secs(1), NOW + DEADLINE] {
        let driven = drive_at(&state, shape, &mut world, at).unwrap_or_else(|| panic!("nothing pending"));
        state = driven.state;
        orders.push(world.calls.last().cloned());
    }
    assert_eq!(orders[0], Some(Call::AcquireLease(CLAIM)));
    assert_eq!(
        orders[1],
        Some(Call::FenceOld(Target {
            overdue: Some(DEADLINE),
            ..A
        }))
    );
    let overdue_from_here = drive_to_the_end_at(state, shape, &mut world, NOW + DEADLINE);
    assert_eq!(overdue_from_here.phase, Phase::Serving);
    for call in &world.calls[2..] {
        let overdue = match call {
            Call::Wake(order) => order.overdue,
            Call::Scale(order) => order.overdue,
            Call::AwaitServing(order) => order.overdue,
            Call::Route(target) | Call::OpenAdmission(target) | Call::FenceOld(target) => target.overdue,
            Call::AcquireLease(_) => None,
        };
        assert_eq!(overdue, Some(DEADLINE), "{call:?}");
    }
}

/// As [`drive_to_the_end`], with the clock at `at`.
fn drive_to_the_end_at(
    mut state: FailoverState,
    shape: StandbyShape,
    world: &mut World,
    at: Duration,
) -> FailoverState {
    for _ in 0..32 {
        match drive_at(&state, shape, world, at) {
            Some(driven) => state = driven.state,
            None => return state,
        }
    }
    panic!("the promotion did not finish in 32 calls: {:?}", state.phase);
}

#[test]
fn the_deadline_is_what_the_objective_leaves_after_detection_and_at_least_one_round() {
    use understudy_core::drive::promotion_deadline;
    let s = Duration::from_secs;
    assert_eq!(promotion_deadline(s(300), s(45), s(10)), s(255));
    assert_eq!(
        promotion_deadline(s(30), s(45), s(10)),
        s(10),
        "detection spent it all"
    );
}
