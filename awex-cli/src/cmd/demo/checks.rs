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

/// No shared-memory segment of the pair's connect is left after disconnect (`leaked`: what
/// /dev/shm holds under `prefix`, or why it could not be read).
pub fn shared_memory(leaked: &Result<Vec<String>, String>, prefix: &str) -> Check {
    let leaked = match leaked {
        Ok(l) => l,
        Err(e) => return Check::new(false, format!("shared memory NOT checked: {e}")),
    };
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

/// `--deltas`: every verified update that followed a verified one was a delta against it,
/// held by every inference rank (each verified byte for byte like the rest). An update after a
/// failed attempt is not counted: the ranks it may have torn get every byte; nor is
/// `catch_up`, the version in which a drill's engine catches up (added mid-run, or killed or
/// stopped in the version before: its ranks hold none, so they get every byte).
pub fn deltas(rows: &[UpdateRow], catch_up: Option<u64>) -> Check {
    let mut later = 0usize;
    let mut deltas = 0usize;
    let (mut moved, mut dense) = (0u64, 0u64);
    for w in rows.windows(2) {
        if !(w[0].verified && w[1].verified) || Some(w[1].version) == catch_up {
            continue;
        }
        later += 1;
        if w[1].base == Some((w[0].version, 0)) {
            deltas += 1;
            moved += w[1].bytes;
            dense += w[1].dense_bytes.unwrap_or(0);
        }
    }
    let share = if dense > 0 {
        format!(
            ": {} of {} dense bytes moved ({:.2} %)",
            crate::cmd::plan::human_bytes(moved as f64),
            crate::cmd::plan::human_bytes(dense as f64),
            moved as f64 * 100.0 / dense as f64
        )
    } else {
        String::new()
    };
    Check::new(
        deltas == later,
        format!(
            "delta updates: {deltas} of the {} that followed a verified one sent only the elements that changed since the version every inference rank held{share}",
            plural(later as u64, "verified update")
        ),
    )
}

/// `--fault-kill-infer-engine E`: the version the rank was killed in committed on the other
/// engines with E left out and reported behind, and E caught up in the next update (every byte
/// verified on every engine).
pub fn engines(rows: &[UpdateRow], engine: u32, fault_version: u64) -> Check {
    let fault = rows
        .iter()
        .find(|u| u.version == fault_version && u.verified);
    let next = rows
        .iter()
        .find(|u| u.version == fault_version + 1 && u.verified);
    let left_out = fault.is_some_and(|u| u.left_out == [engine]);
    let behind = fault.and_then(|u| u.behind) == Some(true);
    let caught_up = next.is_some_and(|u| u.left_out.is_empty() && u.caught_up == Some(true));
    Check::new(
        left_out && behind && caught_up,
        format!(
            "engine {engine}'s rank killed in version {fault_version}: the version {} on the other engines with engine {engine} left out ({}), engine {engine} {} behind; restarted, it {} in version {}",
            if fault.is_some() {
                "committed, verified,"
            } else {
                "did NOT commit"
            },
            if left_out {
                "only it"
            } else {
                "NOT as expected"
            },
            if behind { "reported" } else { "NOT reported" },
            if caught_up {
                "caught up, every byte verified,"
            } else {
                "did NOT catch up"
            },
            fault_version + 1
        ),
    )
}

/// `--fault-add-engine`: engine `engine` (a spare slot) was left out of every version before
/// `fault_version`, took part in that one (`serving`: the gateway then reported it serving that
/// version) and every byte of it was verified.
pub fn added(rows: &[UpdateRow], engine: u32, fault_version: u64, serving: bool) -> Check {
    let before = rows
        .iter()
        .filter(|u| u.version < fault_version && u.verified)
        .all(|u| u.left_out == [engine]);
    let fault = rows
        .iter()
        .find(|u| u.version == fault_version && u.verified);
    let took_part = fault.is_some_and(|u| u.left_out.is_empty());
    Check::new(
        before && took_part && serving,
        format!(
            "engine {engine} added to the running pair before version {fault_version}: out of the versions before ({}), its first version {} ({}), then reported {}",
            if before {
                "as expected"
            } else {
                "NOT as expected"
            },
            if fault.is_some() {
                "committed"
            } else {
                "did NOT commit"
            },
            if took_part {
                "it took part; every byte of it verified"
            } else {
                "it did NOT take part"
            },
            if serving {
                "serving that version"
            } else {
                "NOT serving"
            }
        ),
    )
}

/// `--fault-remove-engine E`: removed while `fault_version` ran, the version committed and was
/// verified on the other engines, and so was the next one, with only E out; E's slot is free
/// (`absent`) and its rank processes exited (`exited`).
pub fn removed(
    rows: &[UpdateRow],
    engine: u32,
    fault_version: u64,
    absent: bool,
    exited: bool,
) -> Check {
    let ok = |v: u64| {
        rows.iter()
            .find(|u| u.version == v)
            .is_some_and(|u| u.verified && u.attempts == 1 && u.left_out == [engine])
    };
    let (fault, next) = (ok(fault_version), ok(fault_version + 1));
    Check::new(
        fault && next && absent && exited,
        format!(
            "engine {engine} removed while version {fault_version} ran: that version {} on the other engines, the next {}; its slot {}, its ranks {}",
            if fault {
                "committed at once, every byte verified,"
            } else {
                "did NOT commit at once, verified,"
            },
            if next {
                "too, without it"
            } else {
                "NOT (or not without it alone)"
            },
            if absent { "is free" } else { "is NOT free" },
            if exited { "exited" } else { "did NOT exit" }
        ),
    )
}
