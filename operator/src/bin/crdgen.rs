//! Prints the FailoverPolicy CustomResourceDefinition as YAML, for `crds/failoverpolicy.yaml`.
//!
//! `cargo run -q -p understudy-operator --bin crdgen > crds/failoverpolicy.yaml`

use kube::CustomResourceExt;
use understudy_operator::crd::FailoverPolicy;

fn main() -> anyhow::Result<()> {
    print!("{}", serde_yaml::to_string(&FailoverPolicy::crd())?);
    Ok(())
}
