//! A pair's rendezvous values, kept as their compact JSON text: a value costs its JSON size
//! (plus the key), not the many times more of a parsed `serde_json::Value` tree.

use crate::wire::*;
use serde_json::Value;
use serde_json::value::RawValue;
use std::collections::BTreeMap;

/// The rendezvous values of one pair.
#[derive(Default)]
pub(crate) struct KvStore {
    pub(crate) values: BTreeMap<String, (Box<RawValue>, u64)>,
    pub(crate) revision: u64,
}

/// A stored value as a JSON tree (for answers).
fn parsed(v: &RawValue) -> Value {
    serde_json::from_str(v.get()).unwrap_or(Value::Null)
}

impl KvStore {
    /// Every value, for the roster.
    pub(crate) fn values(&self) -> BTreeMap<String, Value> {
        self.values
            .iter()
            .map(|(k, (v, _))| (k.clone(), parsed(v)))
            .collect()
    }

    pub(crate) fn get(&self, key: &str) -> Option<KvEntry> {
        self.values.get(key).map(|(v, r)| KvEntry {
            key: key.to_string(),
            value: parsed(v),
            revision: *r,
        })
    }
}
