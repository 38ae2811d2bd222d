//! understudy's tests that span components: the cluster tier, the chart, the operator against a
//! real router. The tests live in `tests/tests/`; the emulated GPU nodes of the cluster tier live
//! here, in [`nodes`].

pub mod cluster;
pub mod nodes;
pub mod process;
