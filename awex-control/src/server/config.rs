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
    /// Most connections open at once; beyond it a connection gets 503 and is closed. With a
    /// token, connections that have not presented it hold at most three quarters of them.
    pub max_connections: usize,
    /// Time a request head (request line and headers) has to arrive whole, from its first byte
    /// (for a new connection: from its start), however its bytes trickle in.
    pub header_timeout: Duration,
    /// Time a request body has to arrive whole once its head arrived.
    pub body_timeout: Duration,
    /// Time a connection may stay silent in both directions (longer than the longest long-poll).
    pub idle_timeout: Duration,
    /// Most long-polls (event polls, joins waiting for the other ranks, update-status and kv
    /// reads with `timeout_ms`) open at once on one pair; beyond it a request gets 503 at once.
    /// `None`: 4 per rank of the pair plus 16.
    pub max_long_polls_per_pair: Option<usize>,
    /// Directory of the durable state (pairs, rosters, rendezvous values, updates, events):
    /// written through on every change and read back at start, so that a restarted gateway
    /// loses nothing. `None` keeps everything in memory (the library default; `awex-cli serve`
    /// defaults to a directory under the user's home). The directory is created mode 0700; one
    /// another user owns or can read is refused.
    pub state_dir: Option<std::path::PathBuf>,
}

/// The default connection limit: what the process's open-file limit leaves room for (minus
/// descriptors for everything else), at most 8192.
fn default_max_connections() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    };
    soft.saturating_sub(128).clamp(16, 8192)
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            token: None,
            body_limit: 8 * 1024 * 1024,
            max_pairs: 1024,
            engine_timeout: Duration::from_secs(10),
            tombstone: Duration::from_secs(60),
            max_connections: default_max_connections(),
            header_timeout: Duration::from_secs(10),
            // 8 MiB (the default body limit) at 1 Mbit/s takes a minute
            body_timeout: Duration::from_secs(60),
            // longer than the longest long-poll and than clients' pool idle time (reqwest: 90 s),
            // so that a client never reuses a connection the gateway is closing
            idle_timeout: Duration::from_millis(crate::wire::MAX_WAIT_MS) + Duration::from_secs(60),
            max_long_polls_per_pair: None,
            state_dir: None,
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
    /// The state directory could not be used (in use by another gateway, unreadable).
    #[error(transparent)]
    State(#[from] crate::server::store::disk::StoreError),
}
