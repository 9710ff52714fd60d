//! Reading the pair kv values a transport needs, accepted only once the transport verified them.

use crate::RuntimeError;
use crate::transport::Transport;
use awex_control::client::Client;
use std::time::{Duration, Instant};

/// Reads the pair kv value a transport needs after joining ([`Transport::kv_after_join`]) or
/// before a retry, accepted only once `check` passes: a value that fails it (a forged or
/// replayed NCCL id) is refused, and the read waits for a genuine one (the publisher's write
/// replaces it) until `wait` has passed, then fails with the refusal. Its publisher puts it
/// right after joining and every rank has joined, so it is there unless the publisher is not
/// running this transport; the wait is bounded all the same.
pub async fn read_checked_kv(
    client: &Client,
    pair: &str,
    key: &str,
    wait: Duration,
    check: impl Fn(&serde_json::Value) -> Result<(), RuntimeError>,
) -> Result<serde_json::Value, RuntimeError> {
    let end = Instant::now() + wait;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let value = match client.get_kv(pair, key, left).await {
            Ok(e) => e.value,
            Err(e) if e.status() == Some(404) => {
                return Err(RuntimeError::MissingKv {
                    pair: pair.to_string(),
                    key: key.to_string(),
                    waited: wait,
                });
            }
            Err(source) => {
                return Err(RuntimeError::Gateway {
                    what: "pair kv",
                    source,
                });
            }
        };
        match check(&value) {
            Ok(()) => return Ok(value),
            Err(e) if Instant::now() >= end => {
                return Err(RuntimeError::UnverifiedKv {
                    waited: wait,
                    cause: Box::new(e),
                });
            }
            Err(e) => {
                tracing::warn!(pair, key, error = %e, "refused a pair kv value; waiting for the genuine one");
                tokio::time::sleep(Duration::from_millis(100).min(left)).await;
            }
        }
    }
}

/// [`Transport::check_kv`] of a transport held behind a mutex (the check runs between awaits,
/// and a transport is not `Sync`).
pub(super) fn checked(
    t: &std::sync::Mutex<Box<dyn Transport>>,
    key: &str,
    v: &serde_json::Value,
) -> Result<(), RuntimeError> {
    t.lock().unwrap_or_else(|e| e.into_inner()).check_kv(key, v)
}
