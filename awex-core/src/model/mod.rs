//! The canonical model: its spec (from an HF `config.json` or a preset) and its tensor catalogue.

mod catalogue;
mod checkpoint;
pub mod family;
mod file;
mod names;
pub mod part;
pub mod presets;
mod spec;

pub(crate) use catalogue::NameHasher;
pub use catalogue::{CanonicalTensor, Catalogue, CatalogueSummary};
pub use checkpoint::{Checkpoint, CheckpointError};
pub use family::Family;
pub use names::{Canon, HfNames, LLAMA_NAMES};
pub use part::{Fusion, Part, Role, Split};
pub use spec::{Architecture, LinearAttnSpec, MlaSpec, ModelSpec, MoeSpec, NotMoved};

/// Appends `i` in decimal (as Python prints it in a parameter name), without `format!`: the
/// planner builds many names with indices in them.
pub fn push_index(s: &mut String, i: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut v = i;
    loop {
        at -= 1;
        digits[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    s.extend(digits[at..].iter().map(|&d| char::from(d)));
}

#[cfg(test)]
mod push_index_tests {
    #[test]
    fn appends_what_display_prints() {
        for i in [0u64, 7, 10, 99, 1_000_003, u64::MAX] {
            let mut s = String::from("layers.");
            super::push_index(&mut s, i);
            assert_eq!(s, format!("layers.{i}"));
        }
    }
}

/// Why a model could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelError {
    /// `architectures[0]` is not supported.
    #[error("unsupported architecture `{found}`; supported: {}", supported.join(", "))]
    UnknownArchitecture {
        /// what the config says
        found: String,
        /// what awex supports
        supported: Vec<&'static str>,
    },
    /// A required field is absent.
    #[error("config.json has no `{0}`")]
    MissingField(&'static str),
    /// A field has the wrong type or value.
    #[error("config.json field `{field}`: {message}")]
    BadField {
        /// the field
        field: &'static str,
        /// what is wrong
        message: String,
    },
    /// Sizes disagree with each other.
    #[error("inconsistent model sizes: {0}")]
    Inconsistent(String),
    /// The text is not JSON.
    #[error("config.json is not valid JSON: {0}")]
    Json(String),
    /// The file could not be read.
    #[error("cannot read {path}: {message}")]
    Io {
        /// the path
        path: String,
        /// the OS error
        message: String,
    },
    /// A size is above awex's limits ([`crate::limits`]). (Its text is in the message and it
    /// is not the error's `source`, so that a report of the whole chain (`{:#}`) says it once.)
    #[error("model {0}")]
    Limit(crate::limits::LimitError),
    /// Neither a preset nor a path.
    #[error("`{arg}` is neither a built-in preset nor an existing config.json or HF directory; presets: {}", presets.join(", "))]
    UnknownModel {
        /// the argument
        arg: String,
        /// the presets
        presets: Vec<&'static str>,
    },
}

impl From<crate::limits::LimitError> for ModelError {
    fn from(e: crate::limits::LimitError) -> Self {
        Self::Limit(e)
    }
}
