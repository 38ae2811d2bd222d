//! The changes a person makes to a policy by hand, as the patch that carries each: a switchover or
//! a failback through the command annotation (the operator consumes each value once and records
//! it, so a token makes every request new), a pause or a resume through `spec.paused`.
//!
//! A change the policy's status says cannot happen is refused here with why, before anything is
//! written; whatever the operator then decides is the operator's, and `describe` shows it.

use serde_json::{Value, json};
use understudy_api::COMMAND_ANNOTATION;
use understudy_api::crd::{ConditionStatus, FailoverPolicy, condition_type};

/// What a person asks of a policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Make `to` the primary; with `force`, even if nothing proves it.
    Switchover { to: String, force: bool },
    /// Give the primary role back to the home pool, the policy's first.
    Failback,
    /// Stop the operator promoting on its own.
    Pause,
    /// Let it again.
    Resume,
    /// Prove the standby at the primary's load now.
    ProveLoad,
}

/// A change ready to be confirmed and written.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    /// What will happen, asked of the person before it is written.
    pub question: String,
    /// The merge patch that does it.
    pub patch: Value,
    /// What to say once it is written.
    pub done: String,
}

/// Why a change is refused before anything is written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

fn command_patch(word: &str, token: &str) -> Value {
    json!({"metadata": {"annotations": {COMMAND_ANNOTATION: format!("{word}@{token}")}}})
}

/// `change` for `policy`, with `token` (a time, say) making the command's value new.
///
/// # Errors
/// When the policy's spec or status says the change cannot happen: an unknown pool, a pool that
/// is the primary already, a promotion under way, a pause or resume that changes nothing.
pub fn plan(policy: &FailoverPolicy, change: &Change, token: &str) -> Result<Planned, Refused> {
    let name = policy.metadata.name.as_deref().unwrap_or_default();
    let status = policy.status.clone().unwrap_or_default();
    let primary = status.primary_pool.as_deref();
    let pools: Vec<&str> = policy.spec.pools.iter().map(|p| p.name.as_str()).collect();
    let promoting = status.state.as_deref() == Some("Promoting");
    match change {
        Change::Switchover { to, force } => {
            if !pools.contains(&to.as_str()) {
                return Err(Refused(format!(
                    "{name} has no pool {to}; its pools are {}",
                    pools.join(" and ")
                )));
            }
            let Some(from) = primary else {
                return Err(Refused(format!(
                    "{name} has no primary in its status yet: the operator has not run it"
                )));
            };
            if from == to {
                return Err(Refused(format!("{to} is the primary of {name} already")));
            }
            if promoting {
                return Err(Refused(format!("{name} is promoting now; wait until it serves")));
            }
            let epoch = status.epoch.unwrap_or(0);
            let mut question = format!(
                "Switch {name} over from {from} to {to}? The epoch Lease moves to epoch {}, and {from} is fenced.",
                epoch + 1
            );
            let proven = status.conditions.get(condition_type::STANDBY_PROVEN);
            if !proven.is_some_and(|c| c.status == ConditionStatus::True) {
                let why = proven.map_or("not reported", |c| c.message.as_str());
                if *force {
                    question.push_str(&format!(
                        " Nothing proves {to} ({why}): it is promoted all the same."
                    ));
                } else {
                    return Err(Refused(format!(
                        "{to} is not proven ({why}), so the operator would refuse it; --force promotes it all the same"
                    )));
                }
            }
            let word = if *force { "force-failover" } else { "failover" };
            Ok(Planned {
                question,
                patch: command_patch(word, token),
                done: format!(
                    "Asked {name} to switch over to {to}; `kubectl understudy describe {name}` shows the timeline."
                ),
            })
        }
        Change::Failback => {
            let home = pools.first().copied().unwrap_or_default();
            if primary == Some(home) {
                return Err(Refused(format!(
                    "{home}, the home pool of {name}, is the primary already: nothing to fail back"
                )));
            }
            if promoting {
                return Err(Refused(format!("{name} is promoting now; wait until it serves")));
            }
            Ok(Planned {
                question: format!(
                    "Fail {name} back to {home}, its home pool? The operator moves it only once {home} is healthy."
                ),
                patch: command_patch("failback", token),
                done: format!(
                    "Asked {name} to fail back to {home}; `kubectl understudy describe {name}` shows the timeline."
                ),
            })
        }
        Change::ProveLoad => {
            let Some(proof) = &policy.spec.load_proof else {
                return Err(Refused(format!(
                    "{name} sets no spec.loadProof: nothing says how to prove its standby at load"
                )));
            };
            if policy.spec.paused {
                return Err(Refused(format!(
                    "{name} is paused: a load proof runs only between promotions of a policy that is not"
                )));
            }
            if status.state.as_deref() != Some("Serving") {
                return Err(Refused(format!(
                    "{name} is not serving between promotions ({}): a load proof runs only then",
                    status.state.as_deref().unwrap_or("no state yet")
                )));
            }
            let standby = pools
                .iter()
                .find(|p| Some(**p) != primary)
                .copied()
                .unwrap_or_default();
            Ok(Planned {
                question: format!(
                    "Replay {name}'s recorded traffic against {standby} now, for {} at {} of the primary's rate? \
                     A sleeping standby is woken for it and put back to sleep after.",
                    proof.duration, proof.rate_share
                ),
                patch: command_patch("prove-load", token),
                done: format!(
                    "Asked {name} to prove {standby} at load; `kubectl understudy describe {name}` shows the result when it ends."
                ),
            })
        }
        Change::Pause | Change::Resume => {
            let pause = *change == Change::Pause;
            if policy.spec.paused == pause {
                let state = if pause { "paused" } else { "not paused" };
                return Err(Refused(format!("{name} is {state} already")));
            }
            let (question, done) = if pause {
                (
                    format!(
                        "Pause {name}? The operator keeps probing and reporting, and promotes nothing on its own until it is resumed."
                    ),
                    format!("Paused {name}."),
                )
            } else {
                (
                    format!("Resume {name}? The operator promotes on its own again when the primary fails."),
                    format!("Resumed {name}."),
                )
            };
            Ok(Planned {
                question,
                patch: json!({"spec": {"paused": pause}}),
                done,
            })
        }
    }
}
