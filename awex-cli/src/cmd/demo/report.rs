//! The report: per-update rows, the checks that ran, and the table printed for people.

use crate::cmd::plan::human_bytes;
use serde::Serialize;

/// One update's row of the report.
#[derive(Serialize, Debug, Clone)]
pub struct UpdateRow {
    /// Version.
    pub version: u64,
    /// Seconds from start to commit (or failure).
    pub seconds: f64,
    /// Milliseconds the slowest inference rank's transport took to move its bytes (the data
    /// plane alone, without the gateway's round trips; what `bench ipc` times), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_ms: Option<f64>,
    /// Bytes moved.
    pub bytes: u64,
    /// `--deltas`: bytes a dense update would have moved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dense_bytes: Option<u64>,
    /// `--deltas`: the fraction of the elements sent as deltas that changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub density: Option<f64>,
    /// `--deltas`: the version this update's deltas were taken against, and how many inference
    /// ranks did not hold it (they got every byte).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<(u64, usize)>,
    /// GB/s of the model's bytes: with `--deltas`, the bytes a dense update moves (so a delta
    /// update that moved less in the same time reads faster, not slower).
    pub gbps: f64,
    /// Committed and every inference rank verified every byte.
    pub verified: bool,
    /// Attempts it took.
    pub attempts: u32,
    /// Why it failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Fault drill, the failed attempt: whether the gateway marked the version torn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub torn: Option<bool>,
    /// Fault drill, the failed attempt: whether every inference rank's live tensors still held
    /// the last committed version, byte for byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live_intact: Option<bool>,
    /// Engines left out of this version (commit policies `quorum:K`, `available`): their ranks
    /// were not verified, they do not serve it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub left_out: Vec<u32>,
    /// `--fault-kill-infer-engine`, the fault version: whether the gateway reported the killed
    /// engine behind (not serving this version) once it committed on the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub behind: Option<bool>,
    /// `--fault-kill-infer-engine`, the update after the fault version: whether every engine,
    /// the restarted one too, serves this version (it caught up), every byte verified.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caught_up: Option<bool>,
    /// `--fault-stop-infer-engines`, a failed attempt: whether no engine was reported serving
    /// the version (each kept the version it applied whole, or is shown torn).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub none_serving: Option<bool>,
}

/// The `--json` report.
#[derive(Serialize, Debug)]
pub struct DemoReport {
    /// Every update committed and verified.
    pub verified: bool,
    /// Transport.
    pub transport: String,
    /// Model.
    pub model: String,
    /// Training spec.
    pub training: String,
    /// Inference spec.
    pub inference: String,
    /// Per update.
    pub updates: Vec<UpdateRow>,
    /// Milliseconds from starting the rank processes to every rank joined (the pair ready).
    pub join_ms: f64,
    /// Milliseconds of the first update (start to commit), the rest of the cold path.
    pub first_update_ms: f64,
    /// Single-thread memcpy bandwidth measured in this run, GB/s.
    pub memcpy_gbps: f64,
    /// One device-to-device copy on the demo's GPU, measured in this run, GB/s (cuda-ipc only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_copy_gbps: Option<f64>,
    /// Median update GB/s over the floor: the device copy for cuda-ipc, else memcpy.
    pub ratio: f64,
    /// One loopback TCP stream's bandwidth measured in this run, GB/s (tcp transport only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_loopback_gbps: Option<f64>,
    /// What the run checked, one entry per check that ran.
    pub checks: Checks,
    /// Shared-memory segments of this pair left behind after disconnect.
    pub leaked_segments: Vec<String>,
    /// The prefix of this run's segments (`awex-{pair}-{connect uid}-`): what the
    /// shared-memory check looked for.
    pub segment_prefix: String,
    /// Rank processes that did not exit cleanly.
    pub worker_errors: Vec<String>,
}

/// One check the run made and its outcome.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Check {
    /// It held.
    pub ok: bool,
    /// What was checked, and what was found.
    pub detail: String,
}

impl Check {
    /// A check with its outcome.
    pub fn new(ok: bool, detail: impl Into<String>) -> Check {
        Check {
            ok,
            detail: detail.into(),
        }
    }
}

/// The checks the run made (`checks` in `--json`); those that did not run are absent.
#[derive(Serialize, Debug, Clone)]
pub struct Checks {
    /// Every byte of every inference rank compared with the canonical weights of the version.
    pub every_byte: Check,
    /// Per-bucket checksums compared by the gateway (`--checksums`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checksums: Option<Check>,
    /// No shared memory of the pair left behind after disconnect.
    pub shared_memory: Check,
    /// What `--dump-dir` wrote.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dumps: Option<Check>,
    /// `--deltas`: the updates after the first were deltas against the version every inference
    /// rank held.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deltas: Option<Check>,
    /// `--fault-kill-infer-engine`: the killed engine was left out and reported behind, and
    /// caught up after its restart.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engines: Option<Check>,
    /// `--fault-add-engine` / `--fault-remove-engine`: the engine added mid-run caught up and
    /// serves; the engine removed mid-run left the others' versions whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<Check>,
}

impl Checks {
    /// The checks that ran, in order.
    pub fn list(&self) -> Vec<&Check> {
        let mut v = vec![&self.every_byte];
        v.extend(&self.checksums);
        v.push(&self.shared_memory);
        v.extend(&self.dumps);
        v.extend(&self.deltas);
        v.extend(&self.engines);
        v.extend(&self.fleet);
        v
    }

    /// Every check held.
    pub fn all_ok(&self) -> bool {
        self.list().iter().all(|c| c.ok)
    }
}

/// The table and the checks, for people.
pub fn print_table(report: &DemoReport, gpu: u32) {
    println!(
        "awex demo: {} | {} -> {} | transport {}",
        report.model, report.training, report.inference, report.transport
    );
    let deltas = report.updates.iter().any(|u| u.dense_bytes.is_some());
    println!(
        "version    seconds  data plane ms       moved{}      GB/s  verified",
        if deltas { "       dense  changed" } else { "" }
    );
    for u in &report.updates {
        let delta = if deltas {
            format!(
                "  {:>10}  {:>7}",
                u.dense_bytes
                    .map_or_else(|| "-".to_string(), |d| human_bytes(d as f64)),
                u.density
                    .filter(|_| u.base.is_some())
                    .map_or_else(|| "all".to_string(), |d| format!("{:.2} %", d * 100.0))
            )
        } else {
            String::new()
        };
        println!(
            "{:>7}  {:>9.3}  {:>13}  {:>10}{delta}  {:>8.2}  {}{}",
            u.version,
            u.seconds,
            u.transfer_ms
                .map_or_else(|| "-".to_string(), |t| format!("{t:.2}")),
            human_bytes(u.bytes as f64),
            u.gbps,
            if u.verified { "yes" } else { "NO" },
            u.error
                .as_ref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        );
    }
    match report.device_copy_gbps {
        Some(g) => println!(
            "device copy floor (one 1 GiB cuMemcpyDtoD on GPU {gpu}, same run): {g:.2} GB/s; median update / floor = {:.4}",
            report.ratio
        ),
        None => println!(
            "memcpy floor (1 thread, same run): {:.2} GB/s; median update / floor = {:.2}",
            report.memcpy_gbps, report.ratio
        ),
    }
    if let Some(t) = report.tcp_loopback_gbps {
        println!("one loopback TCP stream (same run): {t:.2} GB/s");
    }
    for e in &report.worker_errors {
        println!("{e}");
    }
    println!("checks:");
    for c in report.checks.list() {
        println!("  {}  {}", if c.ok { "ok    " } else { "FAILED" }, c.detail);
    }
}
