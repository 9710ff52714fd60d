//! The typed settings of the transports, filled by the caller: the binary and the Python
//! package read the `AWEX_*` variables ([`TransportConfig::from_vars`]) and hand the result to
//! [`crate::rank::make_transport`]; this crate reads no environment.

use awex_gpu::cuda::tiles::DEFAULT_TILE_BYTES;
use awex_gpu::cuda::{CopyMethod, CopyOrder};
use std::ffi::OsString;

/// The settings of every transport a rank may build (each transport reads its own).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransportConfig {
    /// The `tcp` transport's.
    pub tcp: TcpConfig,
    /// The `cuda-ipc` transport's.
    pub cuda_ipc: CudaIpcConfig,
    /// The NCCL library the `nccl` transport loads first (`AWEX_NCCL_LIBRARY`), before
    /// `libnccl.so.2` and `libnccl.so`.
    pub nccl_library: Option<OsString>,
}

/// The `tcp` transport's settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TcpConfig {
    /// The address its listener binds (`AWEX_TCP_BIND`); `None`: the rank's advertised host,
    /// any port.
    pub bind: Option<String>,
    /// With delta updates, the most threads that encode (training) or apply (inference) one
    /// peer's buckets side by side (`AWEX_TCP_DELTA_THREADS`, 1 to 64); `None`: the cores, up
    /// to 16. Each thread holds about one bucket.
    pub delta_threads: Option<usize>,
}

/// Which linear copies of a `cuda-ipc` receiver go through the driver's device copy instead of
/// awex's copy kernel (`AWEX_IPC_DRIVER_MIN_MIB`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DriverMin {
    /// Copies of at least 16 MiB out of allocations of at most 4 GiB (measured on an H200; see
    /// the `cuda-ipc` transport).
    #[default]
    Auto,
    /// None (`off`).
    Off,
    /// Copies of at least these bytes, whatever the allocation.
    AtLeast(u64),
}

/// How a `cuda-ipc` receiver takes its peers' copies (`AWEX_IPC_PEERS`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PeerOrder {
    /// Every peer's graph on its own stream, all at once (`concurrent`, the default): two
    /// receivers that read the same two senders load both senders' links together, instead of
    /// both reading the first sender, then both the second (`docs/simulate.md`: qwen3-30b-a3b
    /// colocated on 8 GPUs, 1.96 x its NVLink bound peer after peer).
    #[default]
    Concurrent,
    /// One peer after the other, in plan order (`sequential`, the order before).
    Sequential,
}

/// The `cuda-ipc` receivers' settings: the defaults are what measured fastest on an H200
/// (`docs/benchmarks.md`); the rest are there to measure alternatives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaIpcConfig {
    /// Copy method (`AWEX_IPC_COPY`: `kernel`, the default, or `driver`).
    pub copy: CopyMethod,
    /// Streams of the copy engine (`AWEX_IPC_STREAMS`, 1..=32, default 16): 8 measured 1-2 %
    /// faster than 4 on an H200 once the copies are replayed from a graph, and 16 another 2.7 %
    /// faster than 8 for qwen3-30b-a3b's 12,727 copies (33.17 -> 32.27 ms) while qwen3-8b's 371
    /// did not change (8.25 / 8.29 ms; `docs/benchmarks.md`, 2026-12-01 19:11-19:17 UTC).
    pub streams: usize,
    /// The order copies are issued in (`AWEX_IPC_ORDER`: `largest`, the default, or
    /// `submission`).
    pub order: CopyOrder,
    /// Tile size of the tile kernel that moves a captured batch in one launch; `None` launches
    /// per copy (`AWEX_IPC_KERNEL=copies`; `AWEX_IPC_TILE_KIB`, 1..=65,536, default 64).
    pub tiles: Option<u64>,
    /// Whether regular series of boxes become pitched copies (`AWEX_IPC_MERGE_PITCHED=0`: no).
    pub merge_pitched: bool,
    /// Linear copies are cut into pieces of this size, spread over the streams
    /// (`AWEX_IPC_SPLIT_MIB`, 1..=65,536, default 256, the `bench ipc` default: one copy-kernel
    /// launch over a whole large IPC mapping is slow).
    pub split_bytes: u64,
    /// Which copies go through the driver (`AWEX_IPC_DRIVER_MIN_MIB`).
    pub driver_min: DriverMin,
    /// From how many copies on a peer they are captured into a CUDA graph at join and replayed
    /// per update (`AWEX_IPC_GRAPH_MIN`, default 1: always; 0: never). Launching each copy
    /// costs the host a few microseconds, and even qwen3-8b's 371 copies ran 3-4 % faster
    /// replayed from a graph on an H200 (`docs/benchmarks.md`, 2026-12-01).
    pub graph_min: usize,
    /// Threads that open a peer's IPC handles (`AWEX_IPC_OPEN_THREADS`, 1..=64, default 1).
    pub open_threads: usize,
    /// How the peers' captured copies are replayed (`AWEX_IPC_PEERS`).
    pub peers: PeerOrder,
    /// Whether an FP8 inference rank quantises the blocks one training rank holds whole
    /// straight out of that rank's memory (`AWEX_IPC_FP8`: `fused`, the default, or `staged`:
    /// every FP8 tensor copied into a bf16 staging first, then quantised).
    pub fuse_fp8: bool,
}

impl Default for CudaIpcConfig {
    fn default() -> Self {
        CudaIpcConfig {
            copy: CopyMethod::Kernel,
            streams: 16,
            order: CopyOrder::LargestFirst,
            tiles: Some(DEFAULT_TILE_BYTES),
            merge_pitched: true,
            split_bytes: 256 << 20,
            driver_min: DriverMin::Auto,
            graph_min: 1,
            open_threads: 1,
            peers: PeerOrder::Concurrent,
            fuse_fp8: true,
        }
    }
}

/// A setting variable whose value awex cannot use.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{var}={value:?} is not {expected}")]
pub struct SettingError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What it takes.
    pub expected: &'static str,
}

/// Every variable [`TransportConfig::from_vars`] reads.
pub const TRANSPORT_VARS: [&str; 15] = [
    "AWEX_TCP_BIND",
    "AWEX_TCP_DELTA_THREADS",
    "AWEX_NCCL_LIBRARY",
    "AWEX_IPC_COPY",
    "AWEX_IPC_STREAMS",
    "AWEX_IPC_ORDER",
    "AWEX_IPC_KERNEL",
    "AWEX_IPC_TILE_KIB",
    "AWEX_IPC_MERGE_PITCHED",
    "AWEX_IPC_SPLIT_MIB",
    "AWEX_IPC_DRIVER_MIN_MIB",
    "AWEX_IPC_GRAPH_MIN",
    "AWEX_IPC_OPEN_THREADS",
    "AWEX_IPC_PEERS",
    "AWEX_IPC_FP8",
];

/// Parses `var`'s value (`None`: unset, the default) as a whole number in `range`.
fn number(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    range: std::ops::RangeInclusive<u64>,
    expected: &'static str,
) -> Result<Option<u64>, SettingError> {
    let Some(v) = get(var) else {
        return Ok(None);
    };
    match v.trim().parse::<u64>() {
        Ok(n) if range.contains(&n) => Ok(Some(n)),
        _ => Err(SettingError {
            var,
            value: v,
            expected,
        }),
    }
}

/// Parses `var`'s value (`None`: unset) as one of `choices` (case-insensitive).
fn choice<T: Copy>(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    choices: &[(&str, T)],
    expected: &'static str,
) -> Result<Option<T>, SettingError> {
    let Some(v) = get(var) else {
        return Ok(None);
    };
    let t = v.trim();
    match choices
        .iter()
        .find(|(name, _)| t.eq_ignore_ascii_case(name))
    {
        Some(&(_, c)) => Ok(Some(c)),
        None => Err(SettingError {
            var,
            value: v,
            expected,
        }),
    }
}

impl TransportConfig {
    /// The settings the variables of [`TRANSPORT_VARS`] ask for, each read through `get`
    /// (`std::env::var(name).ok()` in the binary); unset ones keep their defaults, and a value
    /// that is not one the variable takes is an error naming both.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, SettingError> {
        let d = CudaIpcConfig::default();
        let kernel = choice(
            &get,
            "AWEX_IPC_KERNEL",
            &[("tiles", true), ("copies", false)],
            "`tiles` or `copies`",
        )?;
        let tile = number(
            &get,
            "AWEX_IPC_TILE_KIB",
            1..=65_536,
            "a tile size in KiB from 1 to 65536",
        )?;
        let tiles = match kernel {
            Some(false) => None,
            Some(true) | None => Some(tile.map_or(DEFAULT_TILE_BYTES, |k| k << 10)),
        };
        let driver_min = match get("AWEX_IPC_DRIVER_MIN_MIB") {
            None => DriverMin::Auto,
            Some(v) if v.trim() == "off" => DriverMin::Off,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(mib) => DriverMin::AtLeast(mib.saturating_mul(1 << 20)),
                Err(_) => {
                    return Err(SettingError {
                        var: "AWEX_IPC_DRIVER_MIN_MIB",
                        value: v,
                        expected: "a size in MiB or `off`",
                    });
                }
            },
        };
        let cuda_ipc = CudaIpcConfig {
            copy: choice(
                &get,
                "AWEX_IPC_COPY",
                &[
                    ("kernel", CopyMethod::Kernel),
                    ("driver", CopyMethod::Driver),
                ],
                "`kernel` or `driver`",
            )?
            .unwrap_or(d.copy),
            streams: number(
                &get,
                "AWEX_IPC_STREAMS",
                1..=32,
                "a stream count from 1 to 32",
            )?
            .map_or(d.streams, |n| n as usize),
            order: choice(
                &get,
                "AWEX_IPC_ORDER",
                &[
                    ("largest", CopyOrder::LargestFirst),
                    ("largest-first", CopyOrder::LargestFirst),
                    ("submission", CopyOrder::Submission),
                ],
                "`largest` or `submission`",
            )?
            .unwrap_or(d.order),
            tiles,
            merge_pitched: choice(
                &get,
                "AWEX_IPC_MERGE_PITCHED",
                &[("0", false), ("1", true)],
                "0 or 1",
            )?
            .unwrap_or(d.merge_pitched),
            split_bytes: number(
                &get,
                "AWEX_IPC_SPLIT_MIB",
                1..=65_536,
                "a size in MiB from 1 to 65536",
            )?
            .map_or(d.split_bytes, |m| m << 20),
            driver_min,
            graph_min: number(&get, "AWEX_IPC_GRAPH_MIN", 0..=u64::MAX, "a copy count")?
                .map_or(d.graph_min, |n| n as usize),
            open_threads: number(
                &get,
                "AWEX_IPC_OPEN_THREADS",
                1..=64,
                "a thread count from 1 to 64",
            )?
            .map_or(d.open_threads, |n| n as usize),
            peers: choice(
                &get,
                "AWEX_IPC_PEERS",
                &[
                    ("concurrent", PeerOrder::Concurrent),
                    ("sequential", PeerOrder::Sequential),
                ],
                "`concurrent` or `sequential`",
            )?
            .unwrap_or(d.peers),
            fuse_fp8: choice(
                &get,
                "AWEX_IPC_FP8",
                &[("fused", true), ("staged", false)],
                "`fused` or `staged`",
            )?
            .unwrap_or(d.fuse_fp8),
        };
        Ok(TransportConfig {
            tcp: TcpConfig {
                bind: get("AWEX_TCP_BIND").filter(|v| !v.trim().is_empty()),
                delta_threads: number(
                    &get,
                    "AWEX_TCP_DELTA_THREADS",
                    1..=64,
                    "a thread count from 1 to 64",
                )?
                .map(|n| n as usize),
            },
            cuda_ipc,
            nccl_library: get("AWEX_NCCL_LIBRARY")
                .filter(|v| !v.is_empty())
                .map(OsString::from),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)]) -> Result<TransportConfig, SettingError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TransportConfig::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn no_variables_give_the_measured_defaults() {
        let c = from(&[]).unwrap();
        assert_eq!(c, TransportConfig::default());
        assert_eq!(c.cuda_ipc.streams, 16);
        assert_eq!(c.cuda_ipc.tiles, Some(64 << 10));
        assert_eq!(c.cuda_ipc.split_bytes, 256 << 20);
        assert_eq!(c.tcp.bind, None);
    }

    #[test]
    fn every_variable_keeps_its_name_and_meaning() {
        let c = from(&[
            ("AWEX_TCP_BIND", "0.0.0.0:7000"),
            ("AWEX_TCP_DELTA_THREADS", "8"),
            ("AWEX_NCCL_LIBRARY", "/opt/nccl/libnccl.so.2"),
            ("AWEX_IPC_COPY", "driver"),
            ("AWEX_IPC_STREAMS", "4"),
            ("AWEX_IPC_ORDER", "submission"),
            ("AWEX_IPC_TILE_KIB", "128"),
            ("AWEX_IPC_MERGE_PITCHED", "0"),
            ("AWEX_IPC_SPLIT_MIB", "64"),
            ("AWEX_IPC_DRIVER_MIN_MIB", "8"),
            ("AWEX_IPC_GRAPH_MIN", "0"),
            ("AWEX_IPC_OPEN_THREADS", "8"),
            ("AWEX_IPC_PEERS", "sequential"),
            ("AWEX_IPC_FP8", "staged"),
        ])
        .unwrap();
        assert_eq!(c.tcp.bind.as_deref(), Some("0.0.0.0:7000"));
        assert_eq!(c.tcp.delta_threads, Some(8));
        assert_eq!(
            c.nccl_library,
            Some(OsString::from("/opt/nccl/libnccl.so.2"))
        );
        let i = c.cuda_ipc;
        assert_eq!(
            (i.copy, i.streams, i.order, i.tiles),
            (
                CopyMethod::Driver,
                4,
                CopyOrder::Submission,
                Some(128 << 10)
            )
        );
        assert_eq!(
            (i.merge_pitched, i.split_bytes, i.driver_min),
            (false, 64 << 20, DriverMin::AtLeast(8 << 20))
        );
        assert_eq!((i.graph_min, i.open_threads), (0, 8));
        assert_eq!(i.peers, PeerOrder::Sequential);
        assert!(!i.fuse_fp8);
        assert!(from(&[]).unwrap().cuda_ipc.fuse_fp8);
        let c = from(&[("AWEX_IPC_ORDER", "largest")]).unwrap();
        assert_eq!(c.cuda_ipc.order, CopyOrder::LargestFirst);
        let c = from(&[
            ("AWEX_IPC_KERNEL", "copies"),
            ("AWEX_IPC_DRIVER_MIN_MIB", "off"),
        ])
        .unwrap();
        assert_eq!(
            (c.cuda_ipc.tiles, c.cuda_ipc.driver_min),
            (None, DriverMin::Off)
        );
    }

    #[test]
    fn a_value_a_variable_does_not_take_is_refused_with_what_it_takes() {
        let e = from(&[("AWEX_IPC_STREAMS", "64")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "AWEX_IPC_STREAMS=\"64\" is not a stream count from 1 to 32"
        );
        let e = from(&[("AWEX_TCP_DELTA_THREADS", "0")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "AWEX_TCP_DELTA_THREADS=\"0\" is not a thread count from 1 to 64"
        );
        let e = from(&[("AWEX_IPC_KERNEL", "tile")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "AWEX_IPC_KERNEL=\"tile\" is not `tiles` or `copies`"
        );
        let e = from(&[("AWEX_IPC_DRIVER_MIN_MIB", "4M")]).unwrap_err();
        assert_eq!(e.var, "AWEX_IPC_DRIVER_MIN_MIB");
    }
}
