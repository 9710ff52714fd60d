//! The gateway retry policy of a rank: which failures are transient, how long a lost gateway
//! is retried ([`DEFAULT_GATEWAY_LOST`]) and the backoff between tries ([`retry_gateway`]).

use super::RankError;
use crate::transport::SettingError;
use awex_control::client::ClientError;
use std::time::{Duration, Instant};

/// How long an idle rank (waiting for work) keeps retrying a gateway it lost before it gives up,
/// unless told ([`RankConfig::gateway_lost`](super::RankConfig::gateway_lost)).
pub const DEFAULT_GATEWAY_LOST: Duration = Duration::from_secs(300);

/// [`RankConfig::gateway_lost`](super::RankConfig::gateway_lost) from the value of `AWEX_GATEWAY_LOST_S` (seconds; `None`:
/// unset, [`DEFAULT_GATEWAY_LOST`]).
pub fn gateway_lost_from(value: Option<&str>) -> Result<Duration, SettingError> {
    match value {
        None => Ok(DEFAULT_GATEWAY_LOST),
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| SettingError {
                var: "AWEX_GATEWAY_LOST_S",
                value: v.to_string(),
                expected: "a whole number of seconds",
            }),
    }
}

/// Whether a gateway failure may be transient (the gateway restarting, overloaded, or the
/// network): no connection, a failed exchange, or a 5xx answer.
pub fn transient(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Connect { .. } | ClientError::Transport { .. }
    ) || e.status().is_some_and(|s| s >= 500)
}

/// Calls `f` until it succeeds, fails for good, or transient failures ([`transient`]) have
/// lasted `limit`; waits with capped exponential backoff (0.2 s doubling up to 5 s) between
/// tries and logs each retry on stderr. `doing` names the wait in the log and the error.
pub async fn retry_gateway<T, F, Fut>(
    gateway: &str,
    doing: &str,
    limit: Duration,
    mut f: F,
) -> Result<T, RankError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let start = Instant::now();
    let mut backoff = Duration::from_millis(200);
    let mut tries = 0u32;
    loop {
        match f().await {
            Ok(v) => {
                if tries > 0 {
                    tracing::info!(
                        "awex rank: the gateway at {gateway} answers again after {:.1} s ({doing})",
                        start.elapsed().as_secs_f64()
                    );
                }
                return Ok(v);
            }
            Err(e) if transient(&e) => {
                let waited = start.elapsed();
                if waited >= limit {
                    return Err(RankError::GatewayLost {
                        gateway: gateway.to_string(),
                        doing: doing.to_string(),
                        waited_s: waited.as_secs(),
                        limit_s: limit.as_secs(),
                        last: e.to_string(),
                    });
                }
                tries += 1;
                let pause = backoff.min(limit - waited);
                tracing::warn!(
                    "awex rank: gateway at {gateway} failed while {doing} (try {tries}, {:.1} s of at most {} s): {e}; retrying in {:.1} s",
                    waited.as_secs_f64(),
                    limit.as_secs(),
                    pause.as_secs_f64()
                );
                tokio::time::sleep(pause).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
