//! The data structures a pair's state is made of, knowing nothing of handlers or of the state
//! that holds them.

pub(crate) mod disk;
pub(crate) mod engines;
pub(crate) mod events;
pub(crate) mod kv;
pub(crate) mod metrics;
pub(crate) mod roster;
pub(crate) mod updates;
pub(crate) mod witness;

/// Milliseconds since the Unix epoch (for status timestamps).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
