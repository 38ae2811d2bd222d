//! The GameDay's dealings with its FailoverPolicy: reading it, who holds it, giving it a command
//! (with a compare-and-set on its resourceVersion) and letting it go.

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use understudy_api::FIELD_MANAGER;

use super::context::Context;
use super::error::Error;
use crate::command::COMMAND_ANNOTATION;
use crate::crd::{FailoverPolicy, GameDay};
use crate::gameday::PolicyCommand;

/// The annotation on a FailoverPolicy naming the game day whose run gave it a command.
pub const GAME_DAY_ANNOTATION: &str = "understudy.dev/game-day";

pub(super) async fn read_policy(
    ctx: &Context,
    namespace: &str,
    name: &str,
) -> Result<Option<FailoverPolicy>, Error> {
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.shell.client.clone(), namespace);
    api.get_opt(name).await.map_err(|source| Error::Read {
        object: format!("FailoverPolicy {name}"),
        source,
    })
}

/// The other game day holding `policy` with a run under way, if any. A hold left by a game day
/// that was deleted, or whose run is over, is stale and holds nothing.
pub(super) async fn holder(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    me: &str,
) -> Result<Option<String>, Error> {
    let Some(other) = policy.annotations().get(GAME_DAY_ANNOTATION) else {
        return Ok(None);
    };
    if other == me {
        return Ok(None);
    }
    let api: Api<GameDay> = Api::namespaced(ctx.shell.client.clone(), namespace);
    let found = api.get_opt(other).await.map_err(|source| Error::Read {
        object: format!("GameDay {other}"),
        source,
    })?;
    let running = found
        .and_then(|g| g.status)
        .and_then(|s| s.current_run)
        .is_some_and(|run| (run.command.is_some() || run.injected.is_some()) && !run.phase.is_final());
    Ok(running.then(|| other.clone()))
}

/// Gives the policy its command and names this game day as its holder, in one merge patch
/// conditional on the resourceVersion the run judged: a policy changed since is judged again.
pub(super) async fn give_command(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    gameday: &str,
    command: &PolicyCommand,
) -> Result<(), Error> {
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.shell.client.clone(), namespace);
    // A fault that is not a command only claims the policy.
    let mut annotations = serde_json::json!({ GAME_DAY_ANNOTATION: gameday });
    if let Some(value) = command.value() {
        annotations[COMMAND_ANNOTATION] = value.into();
    }
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": policy.metadata.resource_version,
            "annotations": annotations,
        }
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    match tokio::time::timeout(
        ctx.shell.write_timeout,
        api.patch_metadata(&policy.name_any(), &params, &Patch::Merge(&patch)),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(kube::Error::Api(status))) if status.code == 409 => Err(Error::PolicyChanged),
        Ok(Err(error)) => Err(Error::Command(error)),
        Err(_) => Err(Error::StatusTimeout(ctx.shell.write_timeout)),
    }
}

/// Takes this game day's name off the policy once its run is over, conditional on the policy as
/// read (another game day may claim it as soon as this run's end is recorded); best effort, since
/// a hold whose run is over is stale to every other game day anyway.
pub(super) async fn release(ctx: &Context, namespace: &str, policy: &FailoverPolicy, gameday: &str) {
    if policy.annotations().get(GAME_DAY_ANNOTATION).map(String::as_str) != Some(gameday) {
        return;
    }
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.shell.client.clone(), namespace);
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": policy.metadata.resource_version,
            "annotations": { GAME_DAY_ANNOTATION: null },
        }
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let released = tokio::time::timeout(
        ctx.shell.write_timeout,
        api.patch_metadata(&policy.name_any(), &params, &Patch::Merge(&patch)),
    )
    .await;
    if !matches!(released, Ok(Ok(_))) {
        tracing::warn!(%namespace, policy = %policy.name_any(), %gameday, "could not release the game-day hold");
    }
}
