//! The shared contracts of understudy: the CRD types and their validation ([`crd`], [`policy`],
//! and [`schema`] for a manifest read offline), the epoch Lease in Kubernetes, in memory and in a
//! file ([`lease`]), the route contract the operator pushes and the router takes ([`route`]), the
//! faults a game day has a fence play ([`fence_fault`]), the standby-first rollout's decision
//! ([`rollout`]), times as status records them ([`time`]), the field manager every write is
//! recorded under ([`FIELD_MANAGER`]), and the annotation people and game days give commands
//! through ([`COMMAND_ANNOTATION`]).
//!
//! Types and their rules only: no controller runtime, no reconcile loop, no data path. The
//! operator, the router and the local game day all link this crate, so that each contract is
//! written once and no side keeps a copy of another's types.

pub mod crd;
pub mod fence_fault;
pub mod grant;
pub mod lease;
pub mod policy;
pub mod rollout;
pub mod route;
pub mod schema;
pub mod time;

/// The field manager every write to Kubernetes is recorded under: server-side apply of status and
/// objects, and the Lease's compare-and-set.
pub const FIELD_MANAGER: &str = "understudy-operator";

/// The annotation that carries a command to a FailoverPolicy or a GameDay (`failover`, `failback`,
/// `force-failover` for a policy; anything after an `@` is a token that makes a value new).
pub const COMMAND_ANNOTATION: &str = "understudy.dev/command";
