//! The communicator's unique id, and how it travels through the gateway's kv.
//!
//! Training rank 0 creates the id ([`super::Library::unique_id`]) and stores it under
//! [`UID_KEY`] as 256 hex digits; every other rank of the pair reads it (waiting for it to
//! appear) before it initialises the communicator.

use super::NcclError;
use super::ffi::{RawUniqueId, UNIQUE_ID_BYTES};
use awex_core::layout::{RankId, Side};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// The kv key under which the pair's NCCL unique id is published.
pub const UID_KEY: &str = "nccl.uid";

/// The rank that creates the unique id: training rank 0.
pub const UID_CREATOR: (Side, RankId) = (Side::Training, RankId::train(0));

/// Whether `(side, rank)` creates and publishes the unique id.
pub fn creates_uid(side: Side, rank: RankId) -> bool {
    (side, rank) == UID_CREATOR
}

/// `ncclUniqueId`: 128 opaque bytes, carried as hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    pub(crate) fn from_raw(raw: &RawUniqueId) -> Self {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        for (o, &c) in b.iter_mut().zip(raw.internal.iter()) {
            *o = c as u8;
        }
        UniqueId(b)
    }

    pub(crate) fn to_raw(self) -> RawUniqueId {
        let mut raw = RawUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        for (o, &c) in raw.internal.iter_mut().zip(self.0.iter()) {
            *o = c as std::ffi::c_char;
        }
        raw
    }

    /// The 256 lowercase hex digits stored in the kv.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// Parses 256 hex digits (either case).
    pub fn from_hex(s: &str) -> Result<UniqueId, NcclError> {
        let bad = || NcclError::BadUniqueId(s.chars().take(300).collect());
        if s.len() != 2 * UNIQUE_ID_BYTES || !s.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; UNIQUE_ID_BYTES];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(UniqueId(out))
    }

    /// The kv value: a JSON string of hex digits.
    pub fn to_kv(&self) -> serde_json::Value {
        serde_json::Value::String(self.to_hex())
    }

    /// Reads the kv value written by [`UniqueId::to_kv`].
    pub fn from_kv(v: &serde_json::Value) -> Result<UniqueId, NcclError> {
        match v.as_str() {
            Some(s) => Self::from_hex(s),
            None => Err(NcclError::BadUniqueId(v.to_string())),
        }
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({})", self.to_hex())
    }
}

impl FromStr for UniqueId {
    type Err = NcclError;
    fn from_str(s: &str) -> Result<Self, NcclError> {
        Self::from_hex(s)
    }
}

impl Serialize for UniqueId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for UniqueId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_hex(&s).map_err(serde::de::Error::custom)
    }
}
