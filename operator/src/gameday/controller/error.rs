//! Why a reconcile of a GameDay failed: one variant per stage, and a bounded category.

use std::time::Duration;

use crate::reconciler::StatusWrite;

/// Why a reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object lacks a namespace or name; the API server always sets them.
    #[error("the object has no {0}")]
    MissingObjectKey(&'static str),
    /// Reading the FailoverPolicy, or the game day holding it, failed.
    #[error("reading {object}: {source}")]
    Read {
        object: String,
        #[source]
        source: kube::Error,
    },
    /// The policy changed after the steady state was judged; the command was not given.
    #[error("the FailoverPolicy changed before the command could be given; judging it again")]
    PolicyChanged,
    /// Giving the policy its command failed.
    #[error("giving the FailoverPolicy its command: {0}")]
    Command(#[source] kube::Error),
    /// A fault that is not a command could not be injected; the run waits out `maxRecovery`.
    #[error("injecting the fault: {0}")]
    Inject(String),
    /// The status was written against a GameDay that has changed since it was read: the
    /// reconcile saw a stale copy and starts again from the current one.
    #[error("the GameDay changed since it was read; reading it again")]
    StatusConflict,
    /// The status could not be written.
    #[error("status patch: {0}")]
    StatusPatch(#[source] kube::Error),
    /// The status patch got no answer in time.
    #[error("status patch got no answer within {0:?}")]
    StatusTimeout(Duration),
}

impl Error {
    /// The phase that failed, from a closed list.
    #[must_use]
    pub fn category(&self) -> &'static str {
        match self {
            Error::MissingObjectKey(_) => "object",
            Error::Read { .. } => "read",
            Error::PolicyChanged => "policy_changed",
            Error::Command(_) => "command",
            Error::Inject(_) => "inject",
            Error::StatusConflict | Error::StatusPatch(_) | Error::StatusTimeout(_) => "status",
        }
    }
}

impl From<StatusWrite> for Error {
    fn from(failed: StatusWrite) -> Self {
        match failed {
            StatusWrite::Patch(kube::Error::Api(status)) if status.code == 409 => Error::StatusConflict,
            StatusWrite::Patch(error) => Error::StatusPatch(error),
            StatusWrite::Timeout(after) => Error::StatusTimeout(after),
        }
    }
}
