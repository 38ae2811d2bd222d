//! Commands a person or a game day gives through the annotation `understudy.dev/command`.
//!
//! A command is consumed once: the operator records the annotation value it handled in status
//! (`status.failover.handledCommand`, beside the state machine's record and read on its own, so a
//! garbled machine record does not make a command run again), and a value already handled is
//! never replayed, whatever else changes on the object. To give the same command again, change
//! the value: anything after an `@` is a token the operator ignores, e.g.
//! `failover@2024-06-01T10:00`. Pure parsing only; nothing here reads or writes Kubernetes.

use serde::{Deserialize, Serialize};
use understudy_core::failover::Command;

pub use understudy_api::COMMAND_ANNOTATION;

/// The annotation value of the last command handled, kept in status so that a restarted operator
/// does not replay it.
///
/// Keyed on the value alone: a spec edit bumps the generation, and a command left on the object
/// must not run again because of it. Records written with a `generation` still read; it is
/// ignored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HandledCommand {
    pub value: String,
}

/// What the annotation asks for, if anything new.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommandRequest {
    /// A command not handled before.
    New {
        command: Command,
        handled: HandledCommand,
    },
    /// A value that names no command; reported once, then recorded as handled.
    Unknown { handled: HandledCommand },
    /// `prove-load`: run the standby's load proof now (`spec.loadProof`), whatever its schedule
    /// says. Not the state machine's: it moves nothing.
    ProveLoad { handled: HandledCommand },
}

/// The words the annotation understands, as a reminder in messages.
pub const COMMAND_WORDS: &str = "failover, failback, force-failover or prove-load";

/// Reads the command annotation against the last handled one.
///
/// `None` when there is no annotation or its value was handled already.
#[must_use]
pub fn pending_command(annotation: Option<&str>, last: Option<&HandledCommand>) -> Option<CommandRequest> {
    let value = annotation?.trim();
    if value.is_empty() || last.is_some_and(|last| last.value == value) {
        return None;
    }
    let handled = HandledCommand {
        value: value.to_owned(),
    };
    let word = value.split_once('@').map_or(value, |(word, _token)| word);
    let command = match word.trim().to_ascii_lowercase().as_str() {
        "failover" => Command::Failover,
        "failback" => Command::Failback,
        "force-failover" => Command::ForceFailover,
        "prove-load" => return Some(CommandRequest::ProveLoad { handled }),
        _ => return Some(CommandRequest::Unknown { handled }),
    };
    Some(CommandRequest::New { command, handled })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn handled(value: &str) -> HandledCommand {
        HandledCommand {
            value: value.to_owned(),
        }
    }

    #[test]
    fn prove_load_is_a_command_of_its_own_not_the_machines() {
        assert_eq!(
            pending_command(Some("prove-load@t1"), None),
            Some(CommandRequest::ProveLoad {
                handled: handled("prove-load@t1")
            })
        );
        assert_eq!(
            pending_command(Some("prove-load@t1"), Some(&handled("prove-load@t1"))),
            None
        );
    }

    #[test]
    fn commands_are_read_with_or_without_a_token() {
        for (value, command) in [
            ("failover", Command::Failover),
            ("Failback", Command::Failback),
            ("force-failover", Command::ForceFailover),
            ("failover@game-day-12", Command::Failover),
            (" failback@2 ", Command::Failback),
            ("Force-Failover@outage-3", Command::ForceFailover),
        ] {
            assert_eq!(
                pending_command(Some(value), None),
                Some(CommandRequest::New {
                    command,
                    handled: handled(value.trim())
                }),
                "{value}"
            );
        }
    }

    #[test]
    fn a_handled_command_is_not_replayed() {
        assert_eq!(
            pending_command(Some("failover"), Some(&handled("failover"))),
            None
        );
        assert_eq!(
            pending_command(Some(" force-failover@x "), Some(&handled("force-failover@x"))),
            None
        );
    }

    #[test]
    fn a_record_written_with_a_generation_still_stops_a_replay() {
        // Earlier records keyed the command on the generation too; a spec edit must not replay it.
        let last: HandledCommand = serde_json::from_str(r#"{"value":"failover","generation":1}"#).unwrap();
        assert_eq!(pending_command(Some("failover"), Some(&last)), None);
    }

    #[test]
    fn the_same_command_is_new_again_only_with_a_new_token() {
        let last = handled("failover");
        assert!(matches!(
            pending_command(Some("failover@again"), Some(&last)),
            Some(CommandRequest::New {
                command: Command::Failover,
                ..
            })
        ));
        assert!(matches!(
            pending_command(Some("force-failover"), Some(&last)),
            Some(CommandRequest::New {
                command: Command::ForceFailover,
                ..
            })
        ));
    }

    #[test]
    fn no_annotation_or_an_empty_one_asks_for_nothing() {
        assert_eq!(pending_command(None, None), None);
        assert_eq!(pending_command(Some("  "), None), None);
    }

    #[test]
    fn an_unknown_value_is_reported_once() {
        assert_eq!(
            pending_command(Some("promote"), None),
            Some(CommandRequest::Unknown {
                handled: handled("promote")
            })
        );
        assert_eq!(pending_command(Some("promote"), Some(&handled("promote"))), None);
    }
}
