//! Built-in model presets: each family file lists its own; this module finds them by name.

use super::ModelSpec;
use super::family::{ALL, Family, Preset};

/// Every built-in preset with its family, in family order.
pub fn all() -> impl Iterator<Item = (&'static Family, &'static Preset)> {
    ALL.iter()
        .flat_map(|f| f.presets.iter().map(move |p| (*f, p)))
}

/// Names of every built-in preset.
pub fn names() -> Vec<&'static str> {
    all().map(|(_, p)| p.name).collect()
}

/// A built-in preset by name.
pub fn preset(name: &str) -> Option<ModelSpec> {
    all()
        .find(|(_, p)| p.name == name)
        .map(|(_, p)| (p.spec)(p.name))
}
