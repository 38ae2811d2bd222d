//! Why a reconcile of a FailoverPolicy failed: one variant per stage, and a bounded category
//! for metrics and Events.

use std::time::Duration;

use kube::runtime::finalizer;
use understudy_core::failover::Step;

use crate::clusters::ClusterError;
use crate::lease::LeaseError;
use crate::reconciler::StatusWrite;
use crate::reserve::ReserveError;

/// Why a reconcile failed. One variant per phase of the pipeline.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object lacks a namespace, name or uid; the API server always sets them.
    #[error("the object has no {0}")]
    MissingObjectKey(&'static str),
    /// The epoch Lease is malformed or the API server refused a Lease request.
    #[error("epoch lease: {0}")]
    Lease(#[source] LeaseError),
    /// The epoch Lease names a holder that is neither pool of the policy (a pool was renamed).
    #[error("the epoch lease names {holder:?}, which is neither of the policy's pools")]
    LeaseHolderUnknown { holder: String },
    /// Somebody else moved the epoch Lease first. Nothing was written after it.
    #[error("lost the compare-and-set on the epoch lease; acting on nothing until it is read again")]
    LostRace,
    /// The Lease could not be read or written: control actions are paused.
    #[error("the control plane cannot be reached, control actions are paused: {0}")]
    ControlPlaneUnreachable(#[source] LeaseError),
    /// Scaling a pool's workload or reading its replicas failed.
    #[error("{step:?} on workload {workload}: {source}")]
    Workload {
        step: Step,
        workload: String,
        #[source]
        source: kube::Error,
    },
    /// The status could not be written.
    #[error("status patch: {0}")]
    StatusPatch(#[source] kube::Error),
    /// The status patch got no answer in time.
    #[error("status patch got no answer within {0:?}")]
    StatusTimeout(Duration),
    /// Reading the standby's workload, or applying or deleting a GPU reserve, failed.
    #[error("GPU reserve: {object}: {source}")]
    Reserve {
        object: String,
        #[source]
        source: kube::Error,
    },
    /// The standby's workload does not say what a replica requests.
    #[error("GPU reserve: {0}")]
    ReserveShape(#[source] ReserveError),
    /// A Deployment that is not this policy's reserve already has the reserve's name; it is left
    /// as it is.
    #[error(
        "GPU reserve: Deployment {deployment} exists and is not this policy's reserve; it is left as \
         it is, and no GPUs are held until it is renamed or removed"
    )]
    ReserveNameTaken { deployment: String },
    /// The operator's record could not be serialized.
    #[error("the operator's record cannot be serialized: {0}")]
    Record(#[source] serde_json::Error),
    /// A pool's cluster cannot be reached.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// Adding or removing the finalizer failed, or the wrapped reconcile did.
    #[error("{0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
}

impl Error {
    /// The phase that failed, from a closed list: a metrics label and an Event reason.
    #[must_use]
    pub fn category(&self) -> &'static str {
        match self {
            Error::MissingObjectKey(_) => "object",
            Error::Lease(_) => "lease",
            Error::LeaseHolderUnknown { .. } => "lease_holder",
            Error::LostRace => "lost_race",
            Error::ControlPlaneUnreachable(_) => "control_plane_unreachable",
            Error::Workload { .. } => "workload",
            Error::Cluster(_) => "cluster",
            Error::Reserve { .. } | Error::ReserveShape(_) | Error::ReserveNameTaken { .. } => "reserve",
            Error::StatusPatch(_) | Error::StatusTimeout(_) => "status",
            Error::Record(_) => "record",
            Error::Finalizer(inner) => match inner.as_ref() {
                finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e) => e.category(),
                _ => "finalizer",
            },
        }
    }
}

impl From<StatusWrite> for Error {
    fn from(failed: StatusWrite) -> Self {
        match failed {
            StatusWrite::Patch(error) => Error::StatusPatch(error),
            StatusWrite::Timeout(after) => Error::StatusTimeout(after),
        }
    }
}
