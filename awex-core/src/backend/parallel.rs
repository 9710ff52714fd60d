//! Parallel configurations (`tp=2,pp=2`) and backend specs (`megatron:tp=2,pp=2`).

use crate::layout::Side;
use crate::limits::LimitError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// One key a backend accepts in its parallel config.
#[derive(Clone, Copy, Debug)]
pub struct ParallelKey {
    /// The key (`tp`).
    pub name: &'static str,
    /// Its default, or `None` when absent means "not set".
    pub default: Option<u64>,
    /// What it means.
    pub help: &'static str,
}

/// A parallel configuration: named non-negative integers (`tp`, `pp`, `dp`, ...).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ParallelConfig(pub BTreeMap<String, u64>);

impl ParallelConfig {
    /// A config from pairs.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, u64)>) -> Self {
        ParallelConfig(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
    }

    /// Checks every value against its limit in [`crate::limits`] (`backend` names it in the message).
    pub fn check_limits(&self, backend: &str) -> Result<(), LimitError> {
        crate::limits::check_parallel(backend, self.0.iter().map(|(k, v)| (k.as_str(), *v)))
    }

    /// A value, if set.
    pub fn get(&self, key: &str) -> Option<u64> {
        self.0.get(key).copied()
    }

    /// A value, or `default`.
    pub fn get_or(&self, key: &str, default: u64) -> u64 {
        self.get(key).unwrap_or(default)
    }

    /// Checks every key is known to the backend and every value within [`crate::limits`], and
    /// fills in defaults.
    pub fn checked(
        &self,
        keys: &[ParallelKey],
        backend: &str,
    ) -> Result<ParallelConfig, SpecError> {
        for k in self.0.keys() {
            if !keys.iter().any(|p| p.name == k) {
                return Err(SpecError::UnknownKey {
                    backend: backend.to_string(),
                    key: k.clone(),
                    known: keys.iter().map(|p| p.name).collect(),
                });
            }
        }
        self.check_limits(backend)?;
        let mut out = self.clone();
        for k in keys {
            if let (Some(d), false) = (k.default, out.0.contains_key(k.name)) {
                out.0.insert(k.name.to_string(), d);
            }
        }
        Ok(out)
    }
}

impl fmt::Display for ParallelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{k}={v}")?;
        }
        Ok(())
    }
}

/// A backend and its parallel config, as written on the command line: `megatron:tp=2,pp=2`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendSpec {
    /// Backend name.
    pub backend: String,
    /// Parallel config.
    pub parallel: ParallelConfig,
}

/// A malformed backend spec, unknown backend or unknown key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    /// Not `backend:k=v,...`.
    #[error("bad backend spec `{spec}`: {message} (expected e.g. `megatron:tp=2,pp=2`)")]
    Syntax {
        /// the spec
        spec: String,
        /// what is wrong
        message: String,
    },
    /// No registered backend of that name.
    #[error("no {side} backend named `{name}`; registered: {}", if known.is_empty() { "none".to_string() } else { known.join(", ") })]
    UnknownBackend {
        /// the side
        side: Side,
        /// the name
        name: String,
        /// registered names
        known: Vec<&'static str>,
    },
    /// A value above its limit.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// A key the backend does not accept.
    #[error("backend `{backend}` has no parallel key `{key}`; keys: {}", known.join(", "))]
    UnknownKey {
        /// the backend
        backend: String,
        /// the key
        key: String,
        /// accepted keys
        known: Vec<&'static str>,
    },
}

impl FromStr for BackendSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let syntax = |message: String| SpecError::Syntax {
            spec: s.to_string(),
            message,
        };
        let (backend, rest) = match s.split_once(':') {
            Some((b, r)) => (b.trim(), r.trim()),
            None => (s.trim(), ""),
        };
        if backend.is_empty()
            || !backend
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(syntax(format!("`{backend}` is not a backend name")));
        }
        let mut map = BTreeMap::new();
        for item in rest.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| syntax(format!("`{item}` is not key=value")))?;
            let (k, v) = (k.trim(), v.trim());
            let v: u64 = v.parse().map_err(|_| {
                syntax(format!(
                    "value of `{k}` must be a non-negative integer, found `{v}`"
                ))
            })?;
            if map.insert(k.to_string(), v).is_some() {
                return Err(syntax(format!("`{k}` is given twice")));
            }
        }
        Ok(BackendSpec {
            backend: backend.to_string(),
            parallel: ParallelConfig(map),
        })
    }
}

impl fmt::Display for BackendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.backend, self.parallel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs_and_rejects_garbage() {
        let s: BackendSpec = "megatron:tp=2, pp=4".parse().unwrap();
        assert_eq!(s.backend, "megatron");
        assert_eq!(s.parallel.get("pp"), Some(4));
        assert_eq!(s.to_string(), "megatron:pp=4,tp=2");
        let bare: BackendSpec = "sglang".parse().unwrap();
        assert!(bare.parallel.0.is_empty());
        assert!(matches!(
            "megatron:tp".parse::<BackendSpec>(),
            Err(SpecError::Syntax { .. })
        ));
        assert!(matches!(
            "megatron:tp=-1".parse::<BackendSpec>(),
            Err(SpecError::Syntax { .. })
        ));
        assert!(matches!(
            "megatron:tp=1,tp=2".parse::<BackendSpec>(),
            Err(SpecError::Syntax { .. })
        ));
        assert!(matches!(
            ":tp=1".parse::<BackendSpec>(),
            Err(SpecError::Syntax { .. })
        ));
    }

    #[test]
    fn checked_fills_defaults_and_rejects_unknown_keys() {
        const KEYS: &[ParallelKey] = &[
            ParallelKey {
                name: "tp",
                default: Some(1),
                help: "",
            },
            ParallelKey {
                name: "first",
                default: None,
                help: "",
            },
        ];
        let p = ParallelConfig::from_pairs([("first", 3)])
            .checked(KEYS, "x")
            .unwrap();
        assert_eq!((p.get("tp"), p.get("first")), (Some(1), Some(3)));
        let e = ParallelConfig::from_pairs([("zz", 3)])
            .checked(KEYS, "x")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "backend `x` has no parallel key `zz`; keys: tp, first"
        );
    }
}
