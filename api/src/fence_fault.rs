//! The wire contract of the faults a game day has a fence play (the fence is the router crate's
//! `fence_fault`; the operator's GameDay controller sets them): the path, the call, its answer
//! and the bounds on how long a fault lasts. Written once here, so that the operator does not link
//! the data path to speak to a fence.

use serde::{Deserialize, Serialize};

/// The fence's own path for faults; no vLLM path starts with `/understudy`.
pub const FAULT_PATH: &str = "/understudy/fault";

/// How long a fault lasts when the call does not say.
pub const DEFAULT_FAULT_SECONDS: u64 = 600;

/// The longest a fault may be asked to last.
pub const MAX_FAULT_SECONDS: u64 = 3_600;

/// The text of every answer under `wrong-answers`.
pub const WRONG_ANSWER: &str = "understudy game day: this replica answers wrongly";

/// A fault the fence plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FenceFault {
    /// Hold every request but control calls, unanswered, until the fault ends.
    Hang,
    /// Answer every completion with [`WRONG_ANSWER`].
    WrongAnswers,
}

/// A call to [`FAULT_PATH`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultCall {
    /// The fault to play; `null` takes the current one away.
    pub fault: Option<FenceFault>,
    /// How long it lasts, from now.
    #[serde(default)]
    pub seconds: Option<u64>,
}

/// What [`FAULT_PATH`] answers: the fault in play and the seconds it has left.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FaultState {
    pub fault: Option<FenceFault>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds_left: Option<u64>,
}
