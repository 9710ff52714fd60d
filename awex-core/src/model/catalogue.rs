//! The canonical catalogue: names, shapes and dtypes of a model's HF safetensors checkpoint.

use super::ModelSpec;
use super::family::{self, Sink};
use super::names::{Canon, HfNames};
use super::part::Part;
use super::spec::NotMoved;
use crate::dims::Dims;
use crate::dtype::DType;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// One tensor of the canonical (HF checkpoint) model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanonicalTensor {
    /// HF name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    /// Full shape.
    pub shape: Dims,
    /// Checkpoint dtype.
    pub dtype: DType,
}

impl CanonicalTensor {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.numel()
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }
}

/// All canonical tensors of a model, in a fixed order, indexed by name.
#[derive(Clone, Debug)]
pub struct Catalogue {
    tensors: Vec<CanonicalTensor>,
    index: HashMap<String, u32, BuildHasherDefault<NameHasher>>,
    /// whether every name appears once (else a name's index is the one the index keeps)
    unique: bool,
    /// what a checkpoint of the model may hold beyond these tensors, not moved
    not_moved: Vec<NotMoved>,
}

/// A fast hash of tensor names (8 bytes per multiply) for the catalogue's index and the
/// planner's tables.
///
/// The keys are the model's own tensor names (or addresses), not input an adversary picks, so
/// these tables need no protection against collisions chosen on purpose (what SipHash, the
/// default, pays for).
#[derive(Default)]
pub(crate) struct NameHasher(u64);

impl NameHasher {
    const K: u64 = 0xf135_7aea_2e62_a9c5;

    fn mix(&mut self, word: u64) {
        self.0 = (self.0 ^ word).wrapping_mul(Self::K).rotate_left(26);
    }
}

impl Hasher for NameHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.mix(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        self.mix(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
    }

    fn write_u8(&mut self, b: u8) {
        self.mix(u64::from(b));
    }

    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }

    fn write_u32(&mut self, n: u32) {
        self.mix(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }

    fn finish(&self) -> u64 {
        // the table takes its bucket from the low bits and its tag from the high ones
        let x = self.0;
        (x ^ (x >> 32)).wrapping_mul(Self::K) ^ (x >> 29)
    }
}

/// A compact summary of a catalogue, comparable across processes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogueSummary {
    /// Number of tensors.
    pub tensors: u64,
    /// Total bytes in the checkpoint dtype.
    pub bytes: u64,
    /// xxh3 over every (name, shape, dtype) in order.
    pub digest: String,
}

impl Catalogue {
    /// Builds a catalogue from tensors (order kept).
    pub fn new(tensors: Vec<CanonicalTensor>) -> Self {
        let index: HashMap<String, u32, BuildHasherDefault<NameHasher>> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i as u32))
            .collect();
        let unique = index.len() == tensors.len();
        Catalogue {
            tensors,
            index,
            unique,
            not_moved: Vec::new(),
        }
    }

    /// The canonical tensors of an HF checkpoint of `spec`: its family's parts, named as the
    /// family names them.
    pub fn of(spec: &ModelSpec) -> Self {
        /// Names and shapes each part the family lists.
        struct Build {
            names: &'static HfNames,
            dtype: DType,
            out: Vec<CanonicalTensor>,
        }
        impl Build {
            fn push(&mut self, c: Canon, shape: Dims, dtype: DType) {
                // a family lists only parts its names spell (a test checks every family)
                if let Some(name) = self.names.name(c) {
                    self.out.push(CanonicalTensor { name, shape, dtype });
                }
            }
        }
        impl Sink for Build {
            fn part(&mut self, c: Canon, shape: Dims) {
                self.push(c, shape, self.dtype);
            }
            fn part_as(&mut self, c: Canon, shape: Dims, dtype: DType) {
                self.push(c, shape, dtype);
            }
            fn experts(&mut self, l: u64, count: u64, parts: &[(Part, Dims)]) {
                for e in 0..count {
                    for (p, shape) in parts {
                        self.push(Canon::expert_at(*p, l, e), *shape, self.dtype);
                    }
                }
            }
        }
        let (tensors, _) = spec.catalogue_size();
        let mut b = Build {
            names: spec.names(),
            dtype: spec.dtype,
            out: Vec::with_capacity(usize::try_from(tensors).unwrap_or(0)),
        };
        family::walk(spec, &mut b);
        let mut cat = Catalogue::new(b.out);
        cat.not_moved = spec.not_moved();
        cat
    }

    /// Tensors in catalogue order.
    pub fn tensors(&self) -> &[CanonicalTensor] {
        &self.tensors
    }

    /// What a checkpoint of the model may hold beyond the catalogue and is not moved
    /// ([`ModelSpec::not_moved`]; empty for a catalogue not built from a spec).
    pub fn not_moved(&self) -> &[NotMoved] {
        &self.not_moved
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the catalogue is empty.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Index of a tensor by name.
    pub fn id(&self, name: &str) -> Option<u32> {
        self.index.get(name).copied()
    }

    /// Index of a tensor by name, looked for first among the few tensors just after `near`
    /// (callers that walk names roughly in catalogue order, e.g. a rank's placements, pass the
    /// previous name's index); the same answer as [`Catalogue::id`].
    pub fn id_near(&self, name: &str, near: Option<u32>) -> Option<u32> {
        if let Some(n) = near.filter(|_| self.unique) {
            let start = n as usize + 1;
            let end = (start + 3).min(self.tensors.len());
            if let Some(i) = (start..end).find(|&i| self.tensors[i].name == name) {
                return Some(i as u32);
            }
        }
        self.id(name)
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&CanonicalTensor> {
        self.id(name).map(|i| &self.tensors[i as usize])
    }

    /// A tensor by index.
    pub fn by_id(&self, id: u32) -> &CanonicalTensor {
        &self.tensors[id as usize]
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes()).sum()
    }

    /// Summary (count, bytes, digest) for comparing two catalogues over the wire.
    pub fn summary(&self) -> CatalogueSummary {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for t in &self.tensors {
            h.update(t.name.as_bytes());
            h.update(&[0]);
            for d in t.shape.as_slice() {
                h.update(&d.to_le_bytes());
            }
            h.update(t.dtype.as_str().as_bytes());
            h.update(&[0xff]);
        }
        CatalogueSummary {
            tensors: self.tensors.len() as u64,
            bytes: self.total_bytes(),
            digest: format!("{:016x}", h.digest()),
        }
    }

    /// The first tensor that differs between two catalogues (by name, shape, or dtype), described for a person.
    pub fn first_difference(&self, other: &Catalogue) -> Option<String> {
        for t in &self.tensors {
            match other.get(&t.name) {
                None => return Some(format!("`{}` is missing from the other side", t.name)),
                Some(o) if o.shape != t.shape => {
                    return Some(format!(
                        "`{}` has shape {} here and {} on the other side",
                        t.name, t.shape, o.shape
                    ));
                }
                Some(o) if o.dtype != t.dtype => {
                    return Some(format!(
                        "`{}` has dtype {} here and {} on the other side",
                        t.name, t.dtype, o.dtype
                    ));
                }
                _ => {}
            }
        }
        other
            .tensors
            .iter()
            .find(|t| self.get(&t.name).is_none())
            .map(|t| format!("`{}` exists only on the other side", t.name))
    }
}
