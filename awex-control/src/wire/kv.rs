//! Rendezvous values (`PUT`/`GET .../kv/{key}`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `PUT /v1/pairs/{name}/kv/{key}` body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvPut {
    /// Any JSON value, at most 64 KiB serialised.
    pub value: Value,
}

/// A rendezvous value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvEntry {
    /// The key.
    pub key: String,
    /// The value.
    pub value: Value,
    /// Increases every time any key of the pair is written.
    pub revision: u64,
}
