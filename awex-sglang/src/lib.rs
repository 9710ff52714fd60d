//! awex backend for sglang.

/// The crate's name; referencing it links the crate (and its backend registration) into a binary.
pub const CRATE: &str = env!("CARGO_PKG_NAME");
