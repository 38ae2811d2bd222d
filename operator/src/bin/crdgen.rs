//! Prints a CustomResourceDefinition as YAML: the FailoverPolicy's by default, the GameDay's with
//! `gameday`.
//!
//! `cargo run -q -p understudy-operator --bin crdgen > crds/failoverpolicy.yaml`
//! `cargo run -q -p understudy-operator --bin crdgen -- gameday > crds/gameday.yaml`

use anyhow::bail;
use kube::CustomResourceExt;
use understudy_operator::crd::{FailoverPolicy, GameDay};

fn main() -> anyhow::Result<()> {
    let crd = match std::env::args().nth(1).as_deref() {
        None | Some("failoverpolicy") => FailoverPolicy::crd(),
        Some("gameday") => GameDay::crd(),
        Some(other) => bail!("unknown CRD {other:?}: failoverpolicy or gameday"),
    };
    print!("{}", serde_yaml::to_string(&crd)?);
    Ok(())
}
