//! GPU health: what NVML says about each GPU on a node, the node's verdict, and which GPUs are
//! free for pilot-light capacity.
//!
//! [`GpuInventory`] is the seam: the real implementation reads NVML (`nvml-wrapper`, the default
//! `nvml` cargo feature, loading `libnvidia-ml` at run time; critical Xid and double-bit ECC
//! events come from an NVML event set polled without waiting on each read), [`FakeGpus`] stands
//! in for tests,
//! and [`NoGpus`] is what a node without the NVML library gets: it reports no GPUs, and the
//! reason is said once by whoever opened it. The verdict logic is pure. This module must never
//! change a GPU's state (no resets, no clocks, no persistence mode).

use serde::Serialize;

/// What NVML reports about one GPU at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuState {
    pub index: u32,
    pub uuid: String,
    /// Xid errors seen since the last read (NVML critical events; a double-bit ECC event is
    /// Xid 48).
    pub xid_events: Vec<u64>,
    /// Volatile uncorrectable ECC errors.
    pub ecc_uncorrectable: u64,
    /// A row remap is pending: the GPU needs a reset before its memory is trustworthy.
    pub row_remap_pending: bool,
    /// Retired pages pending (older GPUs without row remapping).
    pub retired_pages_pending: bool,
    pub temperature_c: u32,
    /// Throttle reasons NVML reports active, by name (`hw_slowdown`, `sw_thermal_slowdown`, …).
    pub throttle_reasons: Vec<String>,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// Compute processes running on the GPU.
    pub processes: u32,
    /// The GPU stopped answering (NVML `GPU_IS_LOST`, Xid 79).
    pub fallen_off_bus: bool,
}

/// Why GPUs could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("NVML: {0}")]
    Nvml(String),
}

/// A node's GPUs, read.
pub trait GpuInventory {
    fn read(&mut self) -> Result<Vec<GpuState>, Error>;
}

/// No NVML on this node: no GPUs.
#[derive(Debug, Clone, Default)]
pub struct NoGpus;

impl GpuInventory for NoGpus {
    fn read(&mut self) -> Result<Vec<GpuState>, Error> {
        Ok(Vec::new())
    }
}

/// GPUs a test scripts.
#[derive(Debug, Clone, Default)]
pub struct FakeGpus {
    pub gpus: Vec<GpuState>,
}

impl GpuInventory for FakeGpus {
    fn read(&mut self) -> Result<Vec<GpuState>, Error> {
        Ok(self.gpus.clone())
    }
}

/// Opens NVML when this build has it and the library loads; otherwise [`NoGpus`] and the reason,
/// which the caller says once.
///
/// Open once per process: NVML's handle is kept for the process's life (see `nvml::Nvml`).
pub fn open() -> (Box<dyn GpuInventory + Send>, Option<String>) {
    #[cfg(feature = "nvml")]
    {
        match nvml::Nvml::open() {
            Ok(n) => (Box::new(n), None),
            Err(e) => (Box::new(NoGpus), Some(format!("no GPUs reported: {e}"))),
        }
    }
    #[cfg(not(feature = "nvml"))]
    {
        (
            Box::new(NoGpus),
            Some("no GPUs reported: built without the `nvml` feature".to_owned()),
        )
    }
}

/// Xids that are the application's fault (a bad kernel, an out-of-range access), not the GPU's.
const APPLICATION_XIDS: &[u64] = &[13, 31, 43, 45];

/// Throttle reasons that mean the hardware is protecting itself.
const HARDWARE_THROTTLES: &[&str] = &[
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
];

/// Limits for a GPU's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// At or above this a GPU is degraded.
    pub temperature_c: u32,
    /// A GPU using at most this much memory, with no processes, is free.
    pub free_memory_used_bytes: u64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            temperature_c: 87,
            free_memory_used_bytes: 512 << 20,
        }
    }
}

/// One GPU's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", content = "reasons", rename_all = "kebab-case")]
pub enum GpuVerdict {
    Healthy,
    /// Works, but slower or hotter than it should: weak evidence.
    Degraded(Vec<String>),
    /// Cannot be trusted to compute: the replicas on it have failed.
    Failed(Vec<String>),
}

/// The verdict on one GPU.
pub fn gpu_verdict(gpu: &GpuState, limits: &Thresholds) -> GpuVerdict {
    let mut failed = Vec::new();
    if gpu.fallen_off_bus {
        failed.push("fallen off the bus".to_owned());
    }
    for xid in gpu.xid_events.iter().filter(|x| !APPLICATION_XIDS.contains(x)) {
        failed.push(format!("Xid {xid}"));
    }
    if gpu.ecc_uncorrectable > 0 {
        failed.push(format!("{} uncorrectable ECC error(s)", gpu.ecc_uncorrectable));
    }
    if gpu.row_remap_pending {
        failed.push("row remap pending".to_owned());
    }
    if gpu.retired_pages_pending {
        failed.push("retired pages pending".to_owned());
    }
    if !failed.is_empty() {
        return GpuVerdict::Failed(failed);
    }
    let mut degraded = Vec::new();
    if gpu.temperature_c >= limits.temperature_c {
        degraded.push(format!("{} °C", gpu.temperature_c));
    }
    for reason in gpu
        .throttle_reasons
        .iter()
        .filter(|r| HARDWARE_THROTTLES.contains(&r.as_str()))
    {
        degraded.push(format!("throttled: {reason}"));
    }
    if degraded.is_empty() {
        GpuVerdict::Healthy
    } else {
        GpuVerdict::Degraded(degraded)
    }
}

/// A node's GPUs judged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeHealth {
    pub gpus: Vec<(String, GpuVerdict)>,
    /// Healthy GPUs with no processes and next to no memory used: pilot-light capacity.
    pub free: Vec<String>,
}

impl NodeHealth {
    pub fn judge(gpus: &[GpuState], limits: &Thresholds) -> NodeHealth {
        let verdicts: Vec<(String, GpuVerdict)> = gpus
            .iter()
            .map(|g| (g.uuid.clone(), gpu_verdict(g, limits)))
            .collect();
        let free = gpus
            .iter()
            .zip(&verdicts)
            .filter(|(g, (_, v))| {
                *v == GpuVerdict::Healthy
                    && g.processes == 0
                    && g.memory_used_bytes <= limits.free_memory_used_bytes
            })
            .map(|(g, _)| g.uuid.clone())
            .collect();
        NodeHealth { gpus: verdicts, free }
    }

    /// The replicas that have failed because a GPU they use has: a replica lists its GPU UUIDs
    /// (from the device plugin's `NVIDIA_VISIBLE_DEVICES`).
    pub fn failed_replicas<'a>(&self, replicas: &'a [(String, Vec<String>)]) -> Vec<&'a str> {
        replicas
            .iter()
            .filter(|(_, uuids)| {
                uuids.iter().any(|u| {
                    self.gpus
                        .iter()
                        .any(|(gpu, verdict)| gpu == u && matches!(verdict, GpuVerdict::Failed(_)))
                })
            })
            .map(|(name, _)| name.as_str())
            .collect()
    }
}

#[cfg(feature = "nvml")]
mod nvml {
    //! The real inventory, on `nvml-wrapper`. NVML is loaded at run time, so a build with this
    //! feature still starts on a machine without the driver; [`Nvml::open`] then fails.

    use std::collections::HashMap;

    use nvml_wrapper::EventSet;
    use nvml_wrapper::bitmasks::device::ThrottleReasons;
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
    use nvml_wrapper::enums::event::XidError;
    use nvml_wrapper::error::NvmlError;

    use super::{Error, GpuInventory, GpuState};

    /// The critical events read: Xid errors, and double-bit ECC errors (reported as Xid 48,
    /// NVIDIA's Xid for a double-bit ECC error, so the verdict treats both alike).
    const CRITICAL: EventTypes = EventTypes::CRITICAL_XID_ERROR.union(EventTypes::DOUBLE_BIT_ECC_ERROR);
    const XID_DOUBLE_BIT_ECC: u64 = 48;
    /// An Xid NVML could not name is still a critical event; 0 is no Xid NVIDIA uses.
    const XID_UNNAMED: u64 = 0;
    /// At most this many events are drained per read, so a GPU storming events cannot hold a
    /// read up; the rest wait for the next read.
    const EVENTS_PER_READ: usize = 1024;

    /// NVML with an event set registered for every GPU's critical events.
    ///
    /// The NVML handle is leaked on open: an [`EventSet`] borrows it, NVML stays initialised for
    /// the life of a prober anyway, and a `'static` borrow is how the set lives beside it
    /// without `unsafe` (which this workspace forbids).
    pub struct Nvml {
        nvml: &'static nvml_wrapper::Nvml,
        /// `None` when no GPU supports the critical events (or registering failed for all).
        events: Option<EventSet<'static>>,
    }

    impl std::fmt::Debug for Nvml {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Nvml")
                .field("events", &self.events.is_some())
                .finish()
        }
    }

    impl Nvml {
        pub fn open() -> Result<Nvml, Error> {
            let nvml = nvml_wrapper::Nvml::init().map_err(|e| Error::Nvml(e.to_string()))?;
            let nvml: &'static nvml_wrapper::Nvml = Box::leak(Box::new(nvml));
            Ok(Nvml {
                nvml,
                events: register_critical_events(nvml),
            })
        }

        /// Xid events that arrived since the last read, by GPU index: polled without waiting.
        fn drain_xids(&self) -> HashMap<u32, Vec<u64>> {
            let mut xids: HashMap<u32, Vec<u64>> = HashMap::new();
            let Some(set) = &self.events else {
                return xids;
            };
            for _ in 0..EVENTS_PER_READ {
                // Timeout (nothing pending), a lost GPU (the device read below reports it) and
                // any other error all end this read's draining.
                let Ok(event) = set.wait(0) else { break };
                let Ok(index) = event.device.index() else {
                    continue;
                };
                if let Some(xid) = xid_of(event.event_type, event.event_data) {
                    xids.entry(index).or_default().push(xid);
                }
            }
            xids
        }
    }

    /// The Xid a critical event stands for; `None` for an event that is not critical.
    pub(super) fn xid_of(kind: EventTypes, data: Option<XidError>) -> Option<u64> {
        if kind.contains(EventTypes::CRITICAL_XID_ERROR) {
            Some(match data {
                Some(XidError::Value(xid)) => xid,
                Some(XidError::Unknown) | None => XID_UNNAMED,
            })
        } else if kind.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
            Some(XID_DOUBLE_BIT_ECC)
        } else {
            None
        }
    }

    /// One event set with every GPU's supported critical events registered. A failed
    /// registration consumes the set, so the set is rebuilt without the GPU that failed; a GPU
    /// that cannot be registered is read without events (its counters still judge it).
    fn register_critical_events(nvml: &'static nvml_wrapper::Nvml) -> Option<EventSet<'static>> {
        let count = nvml.device_count().ok()?;
        let mut skipped = Vec::new();
        'attempt: loop {
            let mut set = nvml.create_event_set().ok()?;
            let mut registered = 0;
            for index in (0..count).filter(|i| !skipped.contains(i)) {
                let Ok(device) = nvml.device_by_index(index) else {
                    continue;
                };
                let types = device.supported_event_types().unwrap_or(EventTypes::empty()) & CRITICAL;
                if types.is_empty() {
                    continue;
                }
                match device.register_events(types, set) {
                    Ok(s) => {
                        set = s;
                        registered += 1;
                    }
                    Err(_) => {
                        skipped.push(index);
                        continue 'attempt;
                    }
                }
            }
            return (registered > 0).then_some(set);
        }
    }

    fn throttle_names(r: ThrottleReasons) -> Vec<String> {
        let mut names = Vec::new();
        for (flag, name) in [
            (ThrottleReasons::HW_SLOWDOWN, "hw_slowdown"),
            (ThrottleReasons::HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
            (
                ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN,
                "hw_power_brake_slowdown",
            ),
            (ThrottleReasons::SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
            (ThrottleReasons::SW_POWER_CAP, "sw_power_cap"),
        ] {
            if r.contains(flag) {
                names.push(name.to_owned());
            }
        }
        names
    }

    impl GpuInventory for Nvml {
        fn read(&mut self) -> Result<Vec<GpuState>, Error> {
            let mut xids = self.drain_xids();
            let count = self.nvml.device_count().map_err(|e| Error::Nvml(e.to_string()))?;
            let mut gpus = Vec::new();
            for index in 0..count {
                let device = match self.nvml.device_by_index(index) {
                    Ok(d) => d,
                    Err(NvmlError::GpuLost) => {
                        gpus.push(lost(index));
                        continue;
                    }
                    Err(e) => return Err(Error::Nvml(e.to_string())),
                };
                let lost_now = matches!(
                    device.temperature(TemperatureSensor::Gpu),
                    Err(NvmlError::GpuLost)
                );
                if lost_now {
                    gpus.push(lost(index));
                    continue;
                }
                let memory = device.memory_info().ok();
                gpus.push(GpuState {
                    index,
                    uuid: device.uuid().unwrap_or_else(|_| format!("gpu-{index}")),
                    xid_events: xids.remove(&index).unwrap_or_default(),
                    ecc_uncorrectable: device
                        .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                        .unwrap_or(0),
                    // nvml-wrapper 0.11 has no safe call for nvmlDeviceGetRemappedRows, and this
                    // workspace forbids `unsafe`; pending retired pages stand in on this path.
                    row_remap_pending: false,
                    retired_pages_pending: device.are_pages_pending_retired().unwrap_or(false),
                    temperature_c: device.temperature(TemperatureSensor::Gpu).unwrap_or(0),
                    throttle_reasons: device
                        .current_throttle_reasons()
                        .map(throttle_names)
                        .unwrap_or_default(),
                    memory_used_bytes: memory.as_ref().map_or(0, |m| m.used),
                    memory_total_bytes: memory.as_ref().map_or(0, |m| m.total),
                    processes: device.running_compute_processes().map_or(0, |p| p.len() as u32),
                    fallen_off_bus: false,
                });
            }
            Ok(gpus)
        }
    }

    fn lost(index: u32) -> GpuState {
        GpuState {
            index,
            uuid: format!("gpu-{index}"),
            xid_events: vec![79],
            ecc_uncorrectable: 0,
            row_remap_pending: false,
            retired_pages_pending: false,
            temperature_c: 0,
            throttle_reasons: Vec::new(),
            memory_used_bytes: 0,
            memory_total_bytes: 0,
            processes: 0,
            fallen_off_bus: true,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn gpu(index: u32) -> GpuState {
        GpuState {
            index,
            uuid: format!("GPU-{index:08x}-aaaa-bbbb-cccc-000000000000"),
            xid_events: vec![],
            ecc_uncorrectable: 0,
            row_remap_pending: false,
            retired_pages_pending: false,
            temperature_c: 45,
            throttle_reasons: vec![],
            memory_used_bytes: 300 << 20,
            memory_total_bytes: 80 << 30,
            processes: 0,
            fallen_off_bus: false,
        }
    }

    #[test]
    fn hardware_faults_fail_a_gpu_and_application_xids_do_not() {
        let limits = Thresholds::default();
        assert_eq!(gpu_verdict(&gpu(0), &limits), GpuVerdict::Healthy);
        let cases: Vec<(GpuState, &str)> = vec![
            (
                GpuState {
                    fallen_off_bus: true,
                    ..gpu(0)
                },
                "fallen off the bus",
            ),
            (
                GpuState {
                    xid_events: vec![13, 79],
                    ..gpu(0)
                },
                "Xid 79",
            ),
            (
                GpuState {
                    ecc_uncorrectable: 2,
                    ..gpu(0)
                },
                "2 uncorrectable ECC error(s)",
            ),
            (
                GpuState {
                    row_remap_pending: true,
                    ..gpu(0)
                },
                "row remap pending",
            ),
            (
                GpuState {
                    retired_pages_pending: true,
                    ..gpu(0)
                },
                "retired pages pending",
            ),
        ];
        for (state, reason) in cases {
            assert_eq!(
                gpu_verdict(&state, &limits),
                GpuVerdict::Failed(vec![reason.to_owned()])
            );
        }
        assert_eq!(
            gpu_verdict(
                &GpuState {
                    xid_events: vec![13, 43],
                    ..gpu(0)
                },
                &limits
            ),
            GpuVerdict::Healthy
        );
    }

    #[test]
    fn heat_and_hardware_throttling_degrade_but_a_power_cap_does_not() {
        let limits = Thresholds::default();
        let hot = GpuState {
            temperature_c: 90,
            throttle_reasons: vec!["hw_thermal_slowdown".into()],
            ..gpu(0)
        };
        assert_eq!(
            gpu_verdict(&hot, &limits),
            GpuVerdict::Degraded(vec!["90 °C".into(), "throttled: hw_thermal_slowdown".into()])
        );
        let capped = GpuState {
            throttle_reasons: vec!["sw_power_cap".into()],
            ..gpu(0)
        };
        assert_eq!(gpu_verdict(&capped, &limits), GpuVerdict::Healthy);
    }

    #[test]
    fn a_failed_gpu_fails_the_replicas_on_it_and_only_idle_healthy_gpus_are_free() {
        let mut fake = FakeGpus {
            gpus: vec![
                GpuState {
                    processes: 1,
                    memory_used_bytes: 70 << 30,
                    ..gpu(0)
                },
                GpuState {
                    processes: 1,
                    memory_used_bytes: 70 << 30,
                    ecc_uncorrectable: 1,
                    ..gpu(1)
                },
                gpu(2),
                GpuState {
                    row_remap_pending: true,
                    ..gpu(3)
                },
                GpuState {
                    memory_used_bytes: 2 << 30,
                    ..gpu(4)
                },
            ],
        };
        let node = NodeHealth::judge(&fake.read().unwrap(), &Thresholds::default());
        let uuid = |i: u32| gpu(i).uuid;
        let replicas = vec![
            ("qwen-a-0".to_owned(), vec![uuid(0)]),
            ("qwen-a-1".to_owned(), vec![uuid(1)]),
            ("qwen-tp2-0".to_owned(), vec![uuid(2), uuid(3)]),
        ];
        assert_eq!(node.failed_replicas(&replicas), vec!["qwen-a-1", "qwen-tp2-0"]);
        assert_eq!(
            node.free,
            vec![uuid(2)],
            "busy, failed and memory-holding GPUs are not free"
        );
    }

    #[cfg(feature = "nvml")]
    #[test]
    fn critical_nvml_events_become_xids_that_fail_the_gpu_and_others_are_ignored() {
        use nvml_wrapper::bitmasks::event::EventTypes;
        use nvml_wrapper::enums::event::XidError;

        use super::nvml::xid_of;

        assert_eq!(
            xid_of(EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(79))),
            Some(79)
        );
        assert_eq!(xid_of(EventTypes::DOUBLE_BIT_ECC_ERROR, None), Some(48));
        let unnamed = xid_of(EventTypes::CRITICAL_XID_ERROR, Some(XidError::Unknown)).unwrap();
        assert!(matches!(
            gpu_verdict(
                &GpuState {
                    xid_events: vec![unnamed],
                    ..gpu(0)
                },
                &Thresholds::default()
            ),
            GpuVerdict::Failed(_)
        ));
        assert_eq!(xid_of(EventTypes::PSTATE_CHANGE, None), None);
        assert_eq!(xid_of(EventTypes::SINGLE_BIT_ECC_ERROR, None), None);
    }

    #[test]
    fn without_nvml_there_are_no_gpus_and_the_reason_is_given() {
        let (mut inventory, notice) = open();
        if cfg!(feature = "nvml") && notice.is_none() {
            return; // a machine with a driver: nothing to say
        }
        assert_eq!(inventory.read().unwrap(), vec![]);
        assert!(notice.unwrap().starts_with("no GPUs reported"));
    }
}
