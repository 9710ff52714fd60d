//! The rank settings the binary takes from the environment (`AWEX_TCP_BIND`, `AWEX_IPC_*`,
//! `AWEX_NCCL_LIBRARY`, `AWEX_GATEWAY_LOST_S`; docs/architecture.md lists them): read here and
//! handed to the libraries as typed configs.

use awex_runtime::transport::TransportConfig;
use std::time::Duration;

/// The transports' settings from the `AWEX_*` variables; a value a variable does not take is an
/// error naming both.
pub fn transports() -> anyhow::Result<TransportConfig> {
    Ok(TransportConfig::from_vars(|k| std::env::var(k).ok())?)
}

/// How long a rank retries a lost gateway (`AWEX_GATEWAY_LOST_S`).
pub fn gateway_lost() -> anyhow::Result<Duration> {
    let v = std::env::var("AWEX_GATEWAY_LOST_S").ok();
    Ok(awex_runtime::rank::gateway_lost_from(v.as_deref())?)
}
