//! The cluster an update is predicted on: nodes, GPUs, link bandwidths, latencies, and where
//! each training and inference rank runs.
//!
//! A topology is a TOML file ([`Topology::from_toml`]) or a preset ([`Topology::preset`]).
//! Bandwidths are GB/s (10^9 bytes per second) per direction; a GPU's links are its NVLink
//! port (to GPUs of its node), its NIC (to other nodes; one per GPU unless `nics_per_node`
//! says otherwise, GPU `g` of a node then using NIC `g * nics_per_node / gpus_per_node`), and
//! its memory (copies inside one GPU). The fabric between NICs is taken as non-blocking.

use crate::SimError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Where the two sides' ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Training ranks on devices `0..T`, inference ranks on their own nodes after them.
    Separate,
    /// Inference ranks on the devices right after the training ranks (they may share a node).
    Packed,
    /// Inference rank `i` (all engines, in order) on the device of training rank `i % T`.
    Colocated,
}

impl FromStr for Placement {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        match s {
            "separate" => Ok(Placement::Separate),
            "packed" => Ok(Placement::Packed),
            "colocated" => Ok(Placement::Colocated),
            _ => Err(SimError::Topology(format!(
                "unknown placement `{s}`; choose separate, packed or colocated"
            ))),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Placement::Separate => "separate",
            Placement::Packed => "packed",
            Placement::Colocated => "colocated",
        })
    }
}

/// What a rank runs on: GPUs, or processes of CPU hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceKind {
    /// Each rank owns a GPU (or shares one when colocated).
    Gpu,
    /// Each rank is a process on a CPU host; its bytes live in host memory.
    Cpu,
}

/// A cluster and the placement of a pair's ranks on it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// What the topology describes, in words.
    pub name: String,
    /// GPUs or CPU hosts.
    #[serde(default = "default_kind")]
    pub kind: DeviceKind,
    /// Nodes available; 0 means as many as the placement needs.
    #[serde(default)]
    pub nodes: u32,
    /// Devices per node (GPUs; for CPU hosts, rank processes per host).
    pub gpus_per_node: u32,
    /// NVLink bandwidth per GPU and direction, GB/s (what NCCL reaches, not the line rate).
    #[serde(default)]
    pub nvlink_gbps: f64,
    /// NIC bandwidth per NIC and direction, GB/s.
    #[serde(default)]
    pub nic_gbps: f64,
    /// NICs per node; 0 means one per GPU.
    #[serde(default)]
    pub nics_per_node: u32,
    /// Copy bandwidth inside one GPU's memory, GB/s of bytes copied (device-to-device).
    #[serde(default)]
    pub copy_gbps: f64,
    /// Host memory copy bandwidth of one CPU host, all its processes together, GB/s.
    #[serde(default)]
    pub host_copy_gbps: f64,
    /// What one process's copy loop reaches on a CPU host, GB/s.
    #[serde(default)]
    pub thread_copy_gbps: f64,
    /// Per-message latency (one NCCL group step, one bucket frame), microseconds.
    #[serde(default)]
    pub latency_us: f64,
    /// Host cost of issuing one device copy (cuda-ipc), microseconds.
    #[serde(default)]
    pub launch_us: f64,
    /// The control plane's share of one update (start request to commit), milliseconds.
    #[serde(default)]
    pub control_ms: f64,
    /// Where the ranks run.
    #[serde(default = "default_placement")]
    pub placement: Placement,
    /// Where the figures come from.
    #[serde(default)]
    pub source: String,
}

fn default_kind() -> DeviceKind {
    DeviceKind::Gpu
}

fn default_placement() -> Placement {
    Placement::Separate
}

/// The largest topology file read (a real one is a few hundred bytes).
const MAX_TOPOLOGY_BYTES: u64 = 1 << 20;

/// Names of the presets, with a line each.
pub const PRESETS: &[(&str, &str)] = &[
    (
        "h100x8",
        "8 x H100 per node, 400 Gb/s (50 GB/s) NIC per GPU",
    ),
    (
        "h200x8",
        "8 x H200 per node, 400 Gb/s (50 GB/s) NIC per GPU",
    ),
    (
        "cpu-vm",
        "the 2-core development VM: every rank a process on one host",
    ),
];

impl Topology {
    /// A preset by name (see [`PRESETS`]).
    pub fn preset(name: &str) -> Result<Topology, SimError> {
        let gpu = |name: &str, copy: f64, source: &str| Topology {
            name: name.to_string(),
            kind: DeviceKind::Gpu,
            nodes: 0,
            gpus_per_node: 8,
            nvlink_gbps: 353.9,
            nic_gbps: 50.0,
            nics_per_node: 0,
            copy_gbps: copy,
            host_copy_gbps: 0.0,
            thread_copy_gbps: 0.0,
            latency_us: 20.0,
            launch_us: 1.0,
            control_ms: 1.5,
            placement: Placement::Separate,
            source: source.to_string(),
        };
        match name {
            "h200x8" | "8xh200" => Ok(gpu(
                "8 x H200 per node, 400 Gb/s per GPU",
                2133.0,
                "NVLink: raw NCCL send/recv GPU 0 -> GPU 1 measured on 2 x H200, 2026-11-29 \
                 (353.9 GB/s median); copy: one cuMemcpyDtoD of 16.38 GB in 7.68 ms on one H200, \
                 2026-11-29; NIC: 400 Gb/s line rate; control: the cuda-ipc demo's 10.1 ms \
                 against bench ipc's 8.56 ms copies, 2026-11-29; latency: per NCCL group, a \
                 round figure",
            )),
            "h100x8" | "8xh100" => Ok(gpu(
                "8 x H100 per node, 400 Gb/s per GPU",
                1500.0,
                "NVLink 4 as on H200 (the measured H200 figure); copy: H100 HBM3 \
                 (3.35 TB/s) scaled by the H200's measured copy/peak ratio; NIC: 400 Gb/s line \
                 rate; not measured on an H100",
            )),
            "cpu-vm" => Ok(Topology {
                name: "2-core development VM, ranks as processes on one host".into(),
                kind: DeviceKind::Cpu,
                nodes: 1,
                gpus_per_node: 64,
                nvlink_gbps: 0.0,
                nic_gbps: 2.31,
                nics_per_node: 1,
                copy_gbps: 0.0,
                host_copy_gbps: 8.69,
                thread_copy_gbps: 8.69,
                latency_us: 5.0,
                launch_us: 0.0,
                control_ms: 1.0,
                placement: Placement::Packed,
                source: "one thread's memcpy of 256 MiB measured in the demo's own run, \
                         2026-11-29 16:12 UTC (8.69 GB/s); loopback TCP stream 2.31 GB/s, \
                         2026-11-29"
                    .into(),
            }),
            _ => Err(SimError::Topology(format!(
                "unknown topology preset `{name}`; choose one of {}, or give a TOML file",
                PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    /// Parses a topology file.
    pub fn from_toml(text: &str) -> Result<Topology, SimError> {
        let t: Topology =
            toml::from_str(text).map_err(|e| SimError::Topology(format!("topology file: {e}")))?;
        t.check()?;
        Ok(t)
    }

    /// A preset name, or the path of a TOML file.
    pub fn resolve(spec: &str) -> Result<Topology, SimError> {
        if PRESETS.iter().any(|p| p.0 == spec) || spec == "8xh100" || spec == "8xh200" {
            return Topology::preset(spec);
        }
        // a regular file of bounded size: a FIFO is refused, not waited on
        match awex_core::file::read_regular_text(std::path::Path::new(spec), MAX_TOPOLOGY_BYTES) {
            Ok(text) => Topology::from_toml(&text),
            Err(e) => Err(SimError::Topology(format!(
                "`{spec}` is neither a topology preset ({}) nor a readable TOML file: {e}",
                PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    /// Checks that the figures make sense for the device kind.
    pub fn check(&self) -> Result<(), SimError> {
        let bad = |what: &str, why: &str| Err(SimError::Topology(format!("{what}: {why}")));
        if self.gpus_per_node == 0 {
            return bad("gpus_per_node", "must be at least 1");
        }
        for (what, v) in [
            ("nvlink_gbps", self.nvlink_gbps),
            ("nic_gbps", self.nic_gbps),
            ("copy_gbps", self.copy_gbps),
            ("host_copy_gbps", self.host_copy_gbps),
            ("thread_copy_gbps", self.thread_copy_gbps),
            ("latency_us", self.latency_us),
            ("launch_us", self.launch_us),
            ("control_ms", self.control_ms),
        ] {
            if !v.is_finite() || v < 0.0 {
                return bad(what, &format!("{v} is not a non-negative number"));
            }
        }
        if self.nics_per_node > self.gpus_per_node {
            return bad(
                "nics_per_node",
                &format!(
                    "{} NICs for {} GPUs per node; at most one NIC per GPU",
                    self.nics_per_node, self.gpus_per_node
                ),
            );
        }
        match self.kind {
            DeviceKind::Gpu => {
                if self.copy_gbps <= 0.0 {
                    return bad(
                        "copy_gbps",
                        "a GPU topology needs the device copy bandwidth",
                    );
                }
            }
            DeviceKind::Cpu => {
                if self.host_copy_gbps <= 0.0 || self.thread_copy_gbps <= 0.0 {
                    return bad(
                        "host_copy_gbps / thread_copy_gbps",
                        "a CPU topology needs both copy bandwidths",
                    );
                }
            }
        }
        Ok(())
    }

    /// NICs per node (one per GPU when not stated).
    pub fn nics(&self) -> u32 {
        if self.nics_per_node == 0 {
            self.gpus_per_node
        } else {
            self.nics_per_node
        }
    }

    /// Device indices of the training ranks (`t` of them) and the inference ranks (`i`), and
    /// the nodes they need.
    pub fn place(&self, t: usize, i: usize) -> Result<(Vec<u32>, Vec<u32>, u32), SimError> {
        let gpn = self.gpus_per_node as usize;
        let train: Vec<u32> = (0..t as u32).collect();
        let infer: Vec<u32> = match self.placement {
            Placement::Colocated => {
                if t == 0 {
                    return Err(SimError::Topology(
                        "colocated placement needs training ranks".into(),
                    ));
                }
                (0..i).map(|k| (k % t) as u32).collect()
            }
            Placement::Packed => (t..t + i).map(|k| k as u32).collect(),
            Placement::Separate => {
                let first = t.div_ceil(gpn) * gpn;
                (first..first + i).map(|k| k as u32).collect()
            }
        };
        let used = train
            .iter()
            .chain(&infer)
            .map(|&g| g + 1)
            .max()
            .unwrap_or(0) as usize;
        let need = used.div_ceil(gpn) as u32;
        if self.nodes != 0 && need > self.nodes {
            return Err(SimError::Topology(format!(
                "{t} training and {i} inference ranks placed {} need {need} nodes of {gpn} devices, but the topology has {}",
                self.placement, self.nodes
            )));
        }
        Ok((train, infer, need))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_check_and_files_parse_with_errors_named() {
        for (p, _) in PRESETS {
            Topology::preset(p).unwrap().check().unwrap();
        }
        let t = Topology::from_toml(
            "name = \"x\"\ngpus_per_node = 4\nnic_gbps = 25\ncopy_gbps = 1000\nplacement = \"packed\"\n",
        )
        .unwrap();
        assert_eq!(t.placement, Placement::Packed);
        assert_eq!(t.nics(), 4);
        let e = Topology::from_toml("name = \"x\"\ngpus_per_node = 4\n").unwrap_err();
        assert!(e.to_string().contains("copy_gbps"), "{e}");
        let e = Topology::from_toml("name = \"x\"\ngpus_per_node = 4\nnic_gpbs = 1\n").unwrap_err();
        assert!(e.to_string().contains("nic_gpbs"), "{e}");
        let e = Topology::resolve("h300x8").unwrap_err();
        assert!(e.to_string().contains("h200x8"), "{e}");
    }

    #[test]
    fn placements_put_ranks_where_they_say() {
        let mut t = Topology::preset("h200x8").unwrap();
        assert_eq!(t.place(3, 2).unwrap(), (vec![0, 1, 2], vec![8, 9], 2));
        t.placement = Placement::Packed;
        assert_eq!(t.place(3, 2).unwrap(), (vec![0, 1, 2], vec![3, 4], 1));
        t.placement = Placement::Colocated;
        assert_eq!(t.place(2, 3).unwrap(), (vec![0, 1], vec![0, 1, 0], 1));
        t.nodes = 1;
        t.placement = Placement::Separate;
        let e = t.place(8, 1).unwrap_err();
        assert!(e.to_string().contains("need 2 nodes"), "{e}");
    }
}
