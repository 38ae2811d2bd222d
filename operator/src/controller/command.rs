//! Commands a person or a game day gives through the annotation `understudy.dev/command`.
//!
//! A command is consumed once: the operator records the annotation value and the object's
//! generation it handled in its own record in status, and a value already handled is never
//! replayed. To give the same command again, change the value: anything after an `@` is a token
//! the operator ignores, e.g. `failover@2024-06-01T10:00`. Pure parsing only; nothing here reads
//! or writes Kubernetes.

use serde::{Deserialize, Serialize};
use understudy_core::failover::Command;

/// The annotation that carries a command.
pub const COMMAND_ANNOTATION: &str = "understudy.dev/command";

/// The annotation value and generation of the last command handled, kept in status so that a
/// restarted operator does not replay it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HandledCommand {
    pub value: String,
    pub generation: i64,
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
}

/// Reads the command annotation against the last handled one.
///
/// `None` when there is no annotation or its value was handled at this generation already.
#[must_use]
pub fn pending_command(
    annotation: Option<&str>,
    generation: i64,
    last: Option<&HandledCommand>,
) -> Option<CommandRequest> {
    let value = annotation?.trim();
    if value.is_empty() {
        return None;
    }
    let handled = HandledCommand {
        value: value.to_owned(),
        generation,
    };
    if last == Some(&handled) {
        return None;
    }
    let word = value.split_once('@').map_or(value, |(word, _token)| word);
    Some(match word.trim().to_ascii_lowercase().as_str() {
        "failover" => CommandRequest::New {
            command: Command::Failover,
            handled,
        },
        "failback" => CommandRequest::New {
            command: Command::Failback,
            handled,
        },
        _ => CommandRequest::Unknown { handled },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handled(value: &str, generation: i64) -> HandledCommand {
        HandledCommand {
            value: value.to_owned(),
            generation,
        }
    }

    #[test]
    fn failover_and_failback_are_read_with_or_without_a_token() {
        for (value, command) in [
            ("failover", Command::Failover),
            ("Failback", Command::Failback),
            ("failover@game-day-12", Command::Failover),
            (" failback@2 ", Command::Failback),
        ] {
            assert_eq!(
                pending_command(Some(value), 3, None),
                Some(CommandRequest::New {
                    command,
                    handled: handled(value.trim(), 3)
                }),
                "{value}"
            );
        }
    }

    #[test]
    fn a_handled_command_is_not_replayed_at_the_same_generation() {
        let last = handled("failover", 3);
        assert_eq!(pending_command(Some("failover"), 3, Some(&last)), None);
    }

    #[test]
    fn the_same_command_is_new_again_with_a_new_token_or_generation() {
        let last = handled("failover", 3);
        assert!(matches!(
            pending_command(Some("failover@again"), 3, Some(&last)),
            Some(CommandRequest::New { .. })
        ));
        assert!(matches!(
            pending_command(Some("failover"), 4, Some(&last)),
            Some(CommandRequest::New { .. })
        ));
    }

    #[test]
    fn no_annotation_or_an_empty_one_asks_for_nothing() {
        assert_eq!(pending_command(None, 1, None), None);
        assert_eq!(pending_command(Some("  "), 1, None), None);
    }

    #[test]
    fn an_unknown_value_is_reported_once() {
        assert_eq!(
            pending_command(Some("promote"), 2, None),
            Some(CommandRequest::Unknown {
                handled: handled("promote", 2)
            })
        );
        assert_eq!(
            pending_command(Some("promote"), 2, Some(&handled("promote", 2))),
            None
        );
    }
}
