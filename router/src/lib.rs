//! The router: understudy's data path.
//!
//! Two roles, one crate. The **gateway** ([`gateway`]) is a reverse proxy for the
//! OpenAI-compatible API in front of the current primary pool: it takes route updates on an
//! admin API ([`admin`]) only when their fencing epoch is not older than the highest it has seen
//! ([`highest_epoch`], [`table`]), retries refused connections before the first byte within a
//! budget ([`retry`]), holds requests in a waiting room while a promotion is under way
//! ([`waiting_room`]), admits work by priority and a ramping budget after a new route
//! ([`admission`]), ejects failing endpoints and publishes what it saw as passive signals
//! ([`endpoint`], [`signals`]), keeps a sample of request shapes for load proofs ([`shapes`]), and
//! never lets a cut stream look finished ([`body`]): it ends
//! retryable, or is carried on by another endpoint ([`continuation`]). The **fence** sidecar
//! ([`fence_sidecar`]) runs beside each vLLM replica and refuses generation when its pool does not
//! hold the epoch Lease. Routes are the contract of `understudy_api::route`, which the operator
//! pushes. The command line that runs either role is [`cli`].

pub mod admin;
pub mod admission;
pub mod balance;
pub mod body;
pub mod break_glass;
pub mod cli;
pub mod continuation;
pub mod endpoint;
pub mod fence_fault;
pub mod fence_sidecar;
pub mod gateway;
pub mod grant;
pub mod highest_epoch;
pub mod metrics;
pub mod path;
pub mod refusal;
pub mod retry;
pub mod shapes;
pub mod signals;
pub mod table;
pub mod upstream;
pub mod waiting_room;
