//! What `understudy-gameday plan` answers: how long a policy's standby pool, and each single-tier
//! pool of the same size, takes to serve a share of its capacity after a fault; whether that meets
//! the recovery objective; and which mix of at most two tiers meets it holding the fewest GPUs.
//!
//! The arithmetic is [`understudy_core::recovery`]'s. This module gathers its inputs (a validated
//! policy, and stage times measured in a stage file over the policy's estimates) and lays out the
//! answer, as text for people and JSON for programs. It reads no files, and it never guesses a
//! stage time: a mix that needs one nobody gave is shown as unknown, naming the stage.

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Serialize, Serializer};
use serde_json::Value;

use understudy_api::crd::FailoverPolicySpec;
use understudy_api::policy::{self, PolicyError, ValidatedPolicy};
use understudy_core::duration::{self, ParseDurationError};
use understudy_core::quorum::serving_quorum;
use understudy_core::recovery::{self, MissingStage, Mix, Objective, Stage, StageTimes, Standby, secs};

/// The shares of capacity each mix is timed to.
const SHARES: [f64; 4] = [0.25, 0.5, 0.75, 1.0];

/// Why no plan could be made. Each message carries its cause's, so the causes are not chained
/// as sources as well: a one-line error prints each reason once.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("a stage file is a JSON object of stage names to times, like {{\"weightLoad\": \"65s\"}}")]
    NotAnObject,
    #[error("unknown stage {0:?}: the stages are {names}", names = stage_names())]
    UnknownStage(String),
    #[error("{stage}: {error}")]
    Duration {
        stage: &'static str,
        error: ParseDurationError,
    },
    #[error("{stage}: {value} is not a number of seconds, zero or more")]
    Seconds { stage: &'static str, value: String },
    #[error("{stage}: expected a number of seconds or a duration such as \"70s\", found {found}")]
    NotATime { stage: &'static str, found: String },
    #[error("{0}")]
    Policy(PolicyError),
}

fn stage_names() -> String {
    let names: Vec<&str> = Stage::ALL.iter().map(|stage| stage.as_str()).collect();
    names.join(", ")
}

/// Reads a stage file: a JSON object from stage names (as [`Stage::as_str`] spells them) to
/// times, each a number of seconds or a Go duration such as `"70s"`. A stage left out is not
/// measured; a name that is not a stage is an error, so a misspelt stage is never ignored.
pub fn stage_times_from_json(text: &str) -> Result<StageTimes, PlanError> {
    let Value::Object(entries) = serde_json::from_str(text).map_err(PlanError::NotJson)? else {
        return Err(PlanError::NotAnObject);
    };
    let mut times = StageTimes::new();
    for (name, value) in &entries {
        let stage = Stage::from_name(name).ok_or_else(|| PlanError::UnknownStage(name.clone()))?;
        times.set(stage, stage_time(stage, value)?);
    }
    Ok(times)
}

fn stage_time(stage: Stage, value: &Value) -> Result<Duration, PlanError> {
    let name = stage.as_str();
    match value {
        Value::Number(number) => number
            .as_f64()
            .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
            .ok_or_else(|| PlanError::Seconds {
                stage: name,
                value: number.to_string(),
            }),
        Value::String(text) => {
            duration::parse(text).map_err(|error| PlanError::Duration { stage: name, error })
        }
        other => Err(PlanError::NotATime {
            stage: name,
            found: other.to_string(),
        }),
    }
}

/// Where the share of capacity the objective is judged at comes from.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FractionFrom {
    /// `spec.minServingFraction`.
    Policy,
    /// Not set: the operator routes the promoted pool once a majority of it serves, so the plan
    /// judges at that majority.
    Majority,
}

/// Where a stage time comes from: a measurement wins over the policy's estimate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StageFrom {
    StageFile,
    Policy,
}

#[derive(Debug, Serialize)]
pub struct StageTime {
    pub stage: &'static str,
    /// `None` when neither the stage file nor the policy gives one.
    #[serde(rename = "secs", serialize_with = "option_as_secs")]
    pub time: Option<Duration>,
    pub from: Option<StageFrom>,
}

/// When a share of a pool's capacity serves, counted from the fault.
#[derive(Debug, Serialize)]
pub struct Share {
    pub fraction: f64,
    #[serde(rename = "after_fault_secs", serialize_with = "as_secs")]
    pub after_fault: Duration,
}

/// One mix of standby tiers, timed and judged.
#[derive(Debug, Serialize)]
pub struct MixPlan {
    pub mix: String,
    /// Whether this is the policy's own mix.
    pub policy: bool,
    pub gpus_held: u32,
    /// Empty when a stage time is missing.
    pub reached: Vec<Share>,
    /// Detection plus the time to the objective's share; `None` when a stage time is missing.
    #[serde(rename = "recovery_secs", serialize_with = "option_as_secs")]
    pub recovery: Option<Duration>,
    pub meets: Option<bool>,
    /// The stage with no time that this mix needs.
    pub missing_stage: Option<&'static str>,
}

/// The mix that meets the objective holding the fewest GPUs.
#[derive(Debug, Serialize)]
pub struct Cheapest {
    pub mix: String,
    pub gpus_held: u32,
    #[serde(rename = "recovery_secs", serialize_with = "as_secs")]
    pub recovery: Duration,
}

/// Everything `plan` prints.
#[derive(Debug, Serialize)]
pub struct Plan {
    /// The policy's standby pool, the one planned for.
    pub pool: String,
    pub replicas: u32,
    pub gpus_per_replica: u32,
    #[serde(rename = "objective_secs", serialize_with = "as_secs")]
    pub objective: Duration,
    /// The share of the pool that must serve within the objective.
    pub fraction: f64,
    pub fraction_from: FractionFrom,
    /// Replicas that make that share.
    pub needed: u32,
    #[serde(rename = "detection_secs", serialize_with = "as_secs")]
    pub detection: Duration,
    pub stages: Vec<StageTime>,
    /// The policy's own mix first, then every single-tier mix of the same size, fastest first.
    pub mixes: Vec<MixPlan>,
    /// `None` when no mix of at most two tiers meets the objective.
    pub cheapest: Option<Cheapest>,
    /// The policy's own mix judged, in a sentence.
    pub verdict: String,
    #[serde(skip)]
    detection_basis: String,
}

/// Plans for `spec`'s standby pool with `measured` stage times over the policy's estimates.
pub fn plan(
    spec: &FailoverPolicySpec,
    measured: &StageTimes,
    gpus_per_replica: u32,
) -> Result<Plan, PlanError> {
    let validated = policy::validate(spec).map_err(PlanError::Policy)?;
    // A validated spec has exactly two pools; the second is the home standby.
    let pool = spec
        .pools
        .get(1)
        .ok_or(PlanError::Policy(PolicyError::PoolCount {
            found: spec.pools.len(),
        }))?;
    let own = pool.standby_mix();
    let replicas = own.replicas();
    let times = measured.or(&validated.estimates);
    let (fraction, fraction_from) = match validated.min_serving_fraction {
        Some(fraction) => (fraction, FractionFrom::Policy),
        None => (
            f64::from(serving_quorum(replicas)) / f64::from(replicas.max(1)),
            FractionFrom::Majority,
        ),
    };
    let objective = Objective {
        objective: validated.recovery_objective,
        detection: validated.detection(),
        fraction,
    };

    let mut mixes = vec![mix_plan(&own, true, &times, &objective, gpus_per_replica)];
    mixes.extend(Standby::ALL.iter().map(|&standby| {
        mix_plan(
            &Mix(vec![(standby, replicas)]),
            false,
            &times,
            &objective,
            gpus_per_replica,
        )
    }));
    let cheapest =
        recovery::cheapest_meeting(replicas, gpus_per_replica, &times, &objective).map(|judged| Cheapest {
            mix: judged.mix.label(),
            gpus_held: judged.mix.gpus_held(gpus_per_replica),
            recovery: judged.recovery,
        });
    let verdict = match recovery::judge(&own, &times, &objective) {
        Ok(judged) => judged.message(&objective),
        Err(missing) => format!("{} cannot be judged: {missing}", own.label()),
    };
    Ok(Plan {
        pool: pool.name.clone(),
        replicas,
        gpus_per_replica,
        objective: objective.objective,
        fraction,
        fraction_from,
        needed: own.needed(fraction),
        detection: objective.detection,
        stages: stage_rows(measured, &validated.estimates),
        mixes,
        cheapest,
        verdict,
        detection_basis: detection_basis(&validated),
    })
}

/// How the detection time adds up, as [`ValidatedPolicy::detection`] counts it.
fn detection_basis(policy: &ValidatedPolicy) -> String {
    format!(
        "a hang: {} failed probe rounds of {} and one {} probe timeout; a crash is seen in {}",
        policy.failover.promote_after,
        secs(policy.probe.interval),
        secs(policy.probe.timeout),
        secs(policy.crash_detection()),
    )
}

fn stage_rows(measured: &StageTimes, estimates: &StageTimes) -> Vec<StageTime> {
    Stage::ALL
        .iter()
        .map(|&stage| {
            let (time, from) = match (measured.get(stage), estimates.get(stage)) {
                (Some(time), _) => (Some(time), Some(StageFrom::StageFile)),
                (None, Some(time)) => (Some(time), Some(StageFrom::Policy)),
                (None, None) => (None, None),
            };
            StageTime {
                stage: stage.as_str(),
                time,
                from,
            }
        })
        .collect()
}

fn mix_plan(
    mix: &Mix,
    policy: bool,
    times: &StageTimes,
    objective: &Objective,
    gpus_per_replica: u32,
) -> MixPlan {
    let timed = || -> Result<(Vec<Share>, recovery::Judged), MissingStage> {
        let reached = SHARES
            .iter()
            .map(|&fraction| {
                let reached = mix.time_to(fraction, times)?;
                Ok(Share {
                    fraction,
                    after_fault: objective.detection + reached.after,
                })
            })
            .collect::<Result<_, MissingStage>>()?;
        Ok((reached, recovery::judge(mix, times, objective)?))
    };
    let (reached, recovery, meets, missing_stage) = match timed() {
        Ok((reached, judged)) => (reached, Some(judged.recovery), Some(judged.met), None),
        Err(missing) => (Vec::new(), None, None, Some(missing.stage.as_str())),
    };
    MixPlan {
        mix: mix.label(),
        policy,
        gpus_held: mix.gpus_held(gpus_per_replica),
        reached,
        recovery,
        meets,
        missing_stage,
    }
}

impl Plan {
    /// The plan as plain aligned text.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        let share = match self.fraction_from {
            FractionFrom::Policy => format!("minServingFraction {}", self.fraction),
            FractionFrom::Majority => "a majority: minServingFraction is not set".to_owned(),
        };
        let _ = writeln!(
            out,
            "pool {}: {} replicas of {} GPU{} each",
            self.pool,
            self.replicas,
            self.gpus_per_replica,
            if self.gpus_per_replica == 1 { "" } else { "s" }
        );
        let _ = writeln!(
            out,
            "objective: {} of {} replicas serving within {} of a fault ({share})",
            self.needed,
            self.replicas,
            secs(self.objective)
        );
        let _ = writeln!(
            out,
            "detection: {} ({})",
            secs(self.detection),
            self.detection_basis
        );

        out.push('\n');
        let mut stages = vec![vec!["stage".to_owned(), "time".to_owned(), "from".to_owned()]];
        for row in &self.stages {
            let from = match row.from {
                Some(StageFrom::StageFile) => "stage file",
                Some(StageFrom::Policy) => "policy estimate",
                None => "",
            };
            let time = row.time.map_or_else(|| "unknown".to_owned(), secs);
            stages.push(vec![row.stage.to_owned(), time, from.to_owned()]);
        }
        out.push_str(&table(&stages, &[false, true, false]));

        out.push('\n');
        let mut header = vec!["".to_owned(), "mix".to_owned(), "GPUs held".to_owned()];
        header.extend(SHARES.iter().map(|share| format!("{:.0}%", share * 100.0)));
        header.push("objective".to_owned());
        let mut rows = vec![header];
        for mix in &self.mixes {
            let mut row = vec![
                if mix.policy { "policy" } else { "" }.to_owned(),
                mix.mix.clone(),
                mix.gpus_held.to_string(),
            ];
            match mix.missing_stage {
                Some(stage) => row.push(format!("unknown (no {stage} time)")),
                None => {
                    row.extend(mix.reached.iter().map(|share| secs(share.after_fault)));
                    row.push(
                        if mix.meets == Some(true) {
                            "meets"
                        } else {
                            "misses"
                        }
                        .to_owned(),
                    );
                }
            }
            rows.push(row);
        }
        out.push_str(&table(
            &rows,
            &[false, false, true, true, true, true, true, false],
        ));

        out.push('\n');
        match &self.cheapest {
            Some(cheapest) => {
                let _ = writeln!(
                    out,
                    "cheapest mix that meets the objective: {}, {} GPUs held, {} of {} replicas serving {} after a fault",
                    cheapest.mix,
                    cheapest.gpus_held,
                    self.needed,
                    self.replicas,
                    secs(cheapest.recovery)
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "no mix of up to two tiers of {} replicas meets the objective with the stage times known",
                    self.replicas
                );
            }
        }
        let _ = writeln!(out, "the policy: {}", self.verdict);
        out
    }
}

/// Rows of cells in aligned columns, two spaces apart; `right[i]` aligns column `i` right. A row
/// shorter than the header ends in a cell that spans the columns it leaves out, so that cell sets
/// no width.
fn table(rows: &[Vec<String>], right: &[bool]) -> String {
    let columns = rows.first().map_or(0, Vec::len);
    let mut widths = vec![0; columns];
    for row in rows {
        let spans = row.len() < columns;
        for (i, cell) in row.iter().enumerate() {
            if spans && i + 1 == row.len() {
                break;
            }
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let width = widths.get(i).copied().unwrap_or(0);
            if right.get(i).copied().unwrap_or(false) {
                let _ = write!(line, "{cell:>width$}");
            } else {
                let _ = write!(line, "{cell:<width$}");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn as_secs<S: Serializer>(time: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(time.as_secs_f64())
}

#[allow(clippy::ref_option)] // serde's `serialize_with` passes a reference to the field.
fn option_as_secs<S: Serializer>(time: &Option<Duration>, serializer: S) -> Result<S::Ok, S::Error> {
    match time {
        Some(time) => serializer.serialize_some(&time.as_secs_f64()),
        None => serializer.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_stage_file_takes_seconds_or_go_durations() {
        let times =
            stage_times_from_json(r#"{"node": 420, "weightLoad": "1m5s", "firstToken": 1.5}"#).unwrap();
        assert_eq!(times.get(Stage::Node), Some(Duration::from_secs(420)));
        assert_eq!(times.get(Stage::WeightLoad), Some(Duration::from_secs(65)));
        assert_eq!(times.get(Stage::FirstToken), Some(Duration::from_millis(1500)));
        assert_eq!(times.get(Stage::Warmup), None);
        assert_eq!(stage_times_from_json("{}").unwrap(), StageTimes::new());
    }

    #[test]
    fn a_stage_file_never_drops_what_it_cannot_read() {
        for (text, message) in [
            (
                r#"{"Node": 420}"#,
                "unknown stage \"Node\": the stages are node, imagePull,",
            ),
            (
                r#"{"node": null}"#,
                "node: expected a number of seconds or a duration",
            ),
            (r#"{"node": -1}"#, "node: -1 is not a number of seconds"),
            (r#"["node"]"#, "a stage file is a JSON object"),
        ] {
            let error = stage_times_from_json(text).unwrap_err().to_string();
            assert!(error.starts_with(message), "{text}: {error}");
        }
    }

    #[test]
    fn a_short_row_spans_the_columns_it_leaves_out() {
        let cells = |cells: &[&str]| cells.iter().map(|&cell| cell.to_owned()).collect::<Vec<_>>();
        let rows = [
            cells(&["mix", "GPUs", "50%"]),
            cells(&["8 × hot", "16", "25s"]),
            cells(&["8 × pilot light", "0", "unknown (no node time)"]),
            cells(&["8 × warm (level 2)", "unknown (no wakeLevel2 time)"]),
        ];
        assert_eq!(
            table(&rows, &[false, true, true]),
            "mix                 GPUs                     50%\n\
             8 × hot               16                     25s\n\
             8 × pilot light        0  unknown (no node time)\n\
             8 × warm (level 2)  unknown (no wakeLevel2 time)\n"
        );
    }
}
