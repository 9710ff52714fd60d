//! A pair's rendezvous values.

use crate::wire::*;
use serde_json::Value;
use std::collections::BTreeMap;

/// The rendezvous values of one pair.
#[derive(Default)]
pub(crate) struct KvStore {
    pub(crate) values: BTreeMap<String, (Value, u64)>,
    pub(crate) revision: u64,
}

impl KvStore {
    /// Every value, for the roster.
    pub(crate) fn values(&self) -> BTreeMap<String, Value> {
        self.values
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect()
    }

    pub(crate) fn get(&self, key: &str) -> Option<KvEntry> {
        self.values.get(key).map(|(v, r)| KvEntry {
            key: key.to_string(),
            value: v.clone(),
            revision: *r,
        })
    }
}
