//! Stage 3: feed the command the annotation gives, once per value, and the tick on which the
//! machine decides.

use kube::ResourceExt;
use understudy_core::failover::Input;

use super::events::Notice;
use super::run::Run;
use crate::command::{COMMAND_ANNOTATION, CommandRequest, HandledCommand, pending_command};
use crate::crd::FailoverPolicy;

/// Feeds the command the annotation gives, once per value, and the tick on which the machine
/// decides.
pub(super) fn decide(run: &mut Run<'_>, policy: &FailoverPolicy, command_record_readable: bool) {
    let annotation = policy
        .annotations()
        .get(COMMAND_ANNOTATION)
        .map(|value| value.trim())
        .filter(|value| !value.is_empty());
    match annotation {
        // Removing the annotation forgets the command, so the same value given later is new.
        None => run.handled_command = None,
        Some(value) if !command_record_readable => {
            // Whether this value ran already is unknown: never risk running it twice.
            run.notices.push(Notice::CommandNotRun {
                value: value.to_owned(),
            });
            run.handled_command = Some(HandledCommand {
                value: value.to_owned(),
            });
        }
        Some(value) => match pending_command(Some(value), run.handled_command.as_ref()) {
            Some(CommandRequest::New { command, handled }) => {
                run.feed(Input::Command(command));
                run.handled_command = Some(handled);
            }
            Some(CommandRequest::ProveLoad { handled }) => {
                run.prove_load_now = true;
                run.handled_command = Some(handled);
            }
            Some(CommandRequest::Unknown { handled }) => {
                run.notices.push(Notice::UnknownCommand {
                    value: handled.value.clone(),
                });
                run.handled_command = Some(handled);
            }
            None => {}
        },
    }
    run.feed(Input::Tick);
}
