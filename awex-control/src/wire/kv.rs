//! Rendezvous values (`PUT`/`GET .../kv/{key}`).

use awex_core::layout::Side;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The key under which a pair holds one side's model description (`ModelSpec` as JSON): the
/// gateway stores both from the connect request before anything else can read the pair, so
/// that a rank that needs the model (one not given it, for a model that is no preset) finds it
/// however early it asks.
pub fn model_key(side: Side) -> String {
    format!("model.{side}")
}

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
