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

/// A stored value as served: a rank's rendezvous value (`rdv.*`) without its claim id
/// (`incarnation`), which binds the rank's reports and writes to it and so is never handed out.
fn served(key: &str, v: &RawValue) -> Value {
    let mut value = parsed(v);
    if key.starts_with("rdv.") {
        if let Some(o) = value.as_object_mut() {
            o.remove("incarnation");
        }
    }
    value
}

impl KvStore {
    /// Every value, for the roster.
    pub(crate) fn values(&self) -> BTreeMap<String, Value> {
        self.values
            .iter()
            .map(|(k, (v, _))| (k.clone(), served(k, v)))
            .collect()
    }

    pub(crate) fn get(&self, key: &str) -> Option<KvEntry> {
        self.values.get(key).map(|(v, r)| KvEntry {
            key: key.to_string(),
            value: served(key, v),
            revision: *r,
        })
    }
}
