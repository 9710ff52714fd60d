//! How the gateway runs: its token, limits and timeouts, and why it could not start.

use std::net::SocketAddr;
use std::time::Duration;

/// How the gateway runs: its token, limits and timeouts.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Bearer token every `/v1` and `/metrics` request must carry; `None` serves without auth
    /// (allowed only on a loopback address).
    pub token: Option<String>,
    /// Largest request body in bytes; bigger bodies get 413.
    pub body_limit: usize,
    /// Most live (not disconnected) pairs.
    pub max_pairs: usize,
    /// Timeout of one call to an inference engine (`pause_generation` / `continue_generation`).
    pub engine_timeout: Duration,
    /// How long a disconnected pair stays visible (its event stream ends with `disconnect`).
    pub tombstone: Duration,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            token: None,
            body_limit: 8 * 1024 * 1024,
            max_pairs: 1024,
            engine_timeout: Duration::from_secs(10),
            tombstone: Duration::from_secs(60),
        }
    }
}

/// Why the gateway could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A non-loopback address without a token would expose an unauthenticated control plane.
    #[error(
        "refusing to serve on {addr} without a token: a non-loopback address needs --token-file or AWEX_TOKEN (or bind 127.0.0.1)"
    )]
    NoTokenOnPublicAddress {
        /// the address
        addr: SocketAddr,
    },
    /// The token is empty or contains characters that cannot appear in an HTTP header.
    #[error("the gateway token must be 1 to 4096 visible ASCII characters without spaces")]
    BadToken,
    /// The listener or the server failed.
    #[error("gateway I/O error: {0}")]
    Io(#[from] std::io::Error),
}
