//! The checks the demo reports after its table: what each one compared and what it found.

use super::report::{Check, UpdateRow};
use crate::cmd::plan::plural;

/// Every byte of every inference rank compared with the canonical weights of each version.
/// With an FP8 inference side (`fp8`: its description), the expected bytes of its FP8 tensors
/// are the reference quantiser's.
pub fn every_byte(
    rows: &[UpdateRow],
    updates: u64,
    ranks: usize,
    engines: u32,
    fp8: Option<&str>,
) -> Check {
    let verified = rows.iter().filter(|u| u.verified).count() as u64;
    Check::new(
        verified == updates,
        format!(
            "every byte of every inference rank ({}, {}) compared with the canonical weights of that version{} after each update: {verified} of {} verified",
            plural(ranks as u64, "rank"),
            plural(engines, "engine"),
            match fp8 {
                Some(d) => format!(
                    " (FP8 tensors and their scales: the CPU reference quantiser, {d}, applied to them)"
                ),
                None => String::new(),
            },
            plural(updates, "update")
        ),
    )
}

/// The gateway compared the senders' and the receivers' per-bucket checksums before each commit.
pub fn checksums(compared: u64, updates: u64) -> Check {
    Check::new(
        compared == updates,
        format!(
            "per-bucket xxh3 checksums verified by every receiver and compared by the gateway (sent = received) before each commit: {compared} of {} compared",
            plural(updates, "update")
        ),
    )
}

/// No shared-memory segment of the pair is left after disconnect.
pub fn shared_memory(leaked: &[String], prefix: &str) -> Check {
    if leaked.is_empty() {
        Check::new(
            true,
            format!("no shared memory left behind (no /dev/shm/{prefix}* after disconnect)"),
        )
    } else {
        Check::new(
            false,
            format!("shared memory LEAKED: {}", leaked.join(", ")),
        )
    }
}
