//! The layout algebra: boxes of canonical tensors placed inside engine-local tensors.
//!
//! A local tensor of a rank is described by placements: "the box `region` of canonical
//! tensor `canonical` sits at `local_offset` of this tensor". Once both sides of a pair are
//! described this way, moving weights is pure geometry (see [`crate::plan`]).

pub mod check;
pub mod copy;
pub mod fused_tp;
pub(crate) mod ops;
mod region;

pub use crate::dims::{Dims, MAX_DIMS};
pub use ops::{CoverageGap, coverage, materialize, reconstruct, validate_holders, validate_rank};
pub use region::Region;

use crate::dtype::DType;
use crate::encoding::Encoding;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// Which side of a pair a rank is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The training job (sends).
    Training,
    /// The inference engines (receive).
    Inference,
}

impl Side {
    /// The other side.
    pub fn other(self) -> Side {
        match self {
            Side::Training => Side::Inference,
            Side::Inference => Side::Training,
        }
    }

    /// `train` / `infer`, as used on the command line.
    pub fn short(self) -> &'static str {
        match self {
            Side::Training => "train",
            Side::Inference => "infer",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Training => "training",
            Side::Inference => "inference",
        })
    }
}

/// A rank of one side: `engine` is the inference replica (0 on the training side), `rank` the rank within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RankId {
    /// Inference engine (replica) index; 0 for training ranks.
    pub engine: u32,
    /// Rank within the engine (or the global training rank).
    pub rank: u32,
}

impl RankId {
    /// A training rank.
    pub const fn train(rank: u32) -> Self {
        RankId { engine: 0, rank }
    }

    /// An inference rank of engine `engine`.
    pub const fn infer(engine: u32, rank: u32) -> Self {
        RankId { engine, rank }
    }
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.engine, self.rank)
    }
}

/// Where a box of a canonical tensor lives inside a local tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// Canonical (HF) tensor name.
    pub canonical: Arc<str>,
    /// The box of the canonical tensor.
    pub region: Region,
    /// Offset of the box inside the local tensor (local rank; may have more dims than the region,
    /// the region's dims aligning with the trailing local dims).
    pub local_offset: Dims,
    /// Whether the local tensor holds the box with its last two dims swapped: a box of extent
    /// `[.., a, b]` occupies `[.., b, a]` at `local_offset`, box element `(.., i, j)` at
    /// `(.., j, i)` from it (see [`copy::Transpose`]). Inference side only (an engine that
    /// stores an expert stack as `[E, out, in]` where the checkpoint has `[E, in, out]`);
    /// needs a region of at least two dims and a plain (not FP8) local tensor. Left out of the
    /// serialised layout when `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transposed: bool,
}

impl Placement {
    /// A placement of the box as it is (not transposed).
    pub fn new(canonical: Arc<str>, region: Region, local_offset: Dims) -> Self {
        Placement {
            canonical,
            region,
            local_offset,
            transposed: false,
        }
    }

    /// The extent the box occupies in the local tensor's trailing dims: the region's, its last
    /// two dims swapped when [`Placement::transposed`].
    pub fn local_extent(&self) -> Dims {
        if self.transposed {
            copy::swap_last_two(&self.region.extent)
        } else {
            self.region.extent
        }
    }

    /// How a copy from the canonical tensor into the local tensor is oriented.
    pub fn transpose(&self) -> copy::Transpose {
        if self.transposed {
            copy::Transpose::Dst
        } else {
            copy::Transpose::None
        }
    }
}

/// A tensor as one engine rank holds it: native name, local shape, dtype, encoding, and what
/// it contains.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "LocalTensorRepr", into = "LocalTensorRepr")]
pub struct LocalTensor {
    /// Engine-native name (e.g. `decoder.layers.0.self_attention.linear_qkv.weight`).
    pub name: Arc<str>,
    /// Local shape, padding included.
    pub shape: Dims,
    /// Local dtype (the element type of the bytes held: `f8e4m3` for an FP8 block tensor).
    pub dtype: DType,
    /// How the elements are stored: `Plain(dtype)` (every tensor of a side that does not
    /// quantise), or `Fp8Block` (e4m3 elements whose per-block scales are the tensor
    /// [`Fp8Block::scale_name`](crate::encoding::Fp8Block::scale_name) of the same rank).
    pub encoding: Encoding,
    /// What canonical boxes the tensor holds; elements covered by none are padding.
    pub placements: Vec<Placement>,
}

/// [`LocalTensor`] as serialised: `encoding` is left out when it is `Plain(dtype)`, so the
/// layouts of plain sides read and write exactly as before the field existed.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LocalTensorRepr {
    name: Arc<str>,
    shape: Dims,
    dtype: DType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    encoding: Option<Encoding>,
    placements: Vec<Placement>,
}

impl From<LocalTensorRepr> for LocalTensor {
    fn from(r: LocalTensorRepr) -> Self {
        LocalTensor {
            encoding: r.encoding.unwrap_or(Encoding::Plain(r.dtype)),
            name: r.name,
            shape: r.shape,
            dtype: r.dtype,
            placements: r.placements,
        }
    }
}

impl From<LocalTensor> for LocalTensorRepr {
    fn from(t: LocalTensor) -> Self {
        LocalTensorRepr {
            encoding: (t.encoding != Encoding::Plain(t.dtype)).then_some(t.encoding),
            name: t.name,
            shape: t.shape,
            dtype: t.dtype,
            placements: t.placements,
        }
    }
}

impl LocalTensor {
    /// A tensor stored as plain elements of `dtype` (what every backend lays out).
    pub fn plain(name: Arc<str>, shape: Dims, dtype: DType, placements: Vec<Placement>) -> Self {
        LocalTensor {
            name,
            shape,
            dtype,
            encoding: Encoding::Plain(dtype),
            placements,
        }
    }

    /// Size in bytes (saturating; [`validate_rank`] refuses a shape whose bytes do not fit).
    pub fn nbytes(&self) -> u64 {
        self.shape.numel().saturating_mul(self.dtype.size() as u64)
    }
}

/// Every local tensor of one rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankLayout {
    /// The rank.
    pub rank: RankId,
    /// Its tensors, in the engine's order.
    pub tensors: Vec<LocalTensor>,
}

impl RankLayout {
    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&LocalTensor> {
        self.tensors.iter().find(|t| &*t.name == name)
    }

    /// Total bytes of all local tensors.
    pub fn nbytes(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |a, t| a.saturating_add(t.nbytes()))
    }
}

/// One shard of a canonical tensor, held identically by a set of ranks (replicas).
///
/// `holders(canonical)` of a side lists every shard of that canonical tensor: the inverse of
/// the per-rank view, computed without enumerating the world.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// Every rank that holds this shard at the same place of the same-named local tensor.
    pub ranks: Vec<RankId>,
    /// The local tensor's name.
    pub tensor: Arc<str>,
    /// The local tensor's shape.
    pub tensor_shape: Dims,
    /// The local tensor's dtype.
    pub dtype: DType,
    /// The box of the canonical tensor.
    pub region: Region,
    /// Where that box sits in the local tensor.
    pub local_offset: Dims,
    /// Whether the local tensor holds the box transposed ([`Placement::transposed`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transposed: bool,
}

/// A class of tensors one side lays out alike ([`SideLayout::alike`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alike {
    /// Equal for two tensors of one side exactly when the side promises them equal holders
    /// but for the local tensor's name: the layout's own encoding of what it computes the
    /// holders from (compared only with keys of the same layout).
    pub key: AlikeKey,
    /// The local tensor every holder of the tensor names.
    pub tensor: Arc<str>,
}

/// An [`Alike`] class's key.
pub type AlikeKey = [u64; 8];

/// All ranks of one side: a pure function of `(ModelSpec, parallel config)`, queried lazily.
///
/// Implementations answer both directions without building the world: what one rank holds,
/// and who holds (pieces of) one canonical tensor.
pub trait SideLayout: Send + Sync {
    /// Which side this is.
    fn side(&self) -> Side;

    /// Every rank of the side, in a fixed order (engine-major).
    fn ranks(&self) -> Vec<RankId>;

    /// Number of ranks (all engines together).
    fn world_size(&self) -> usize {
        self.ranks().len()
    }

    /// Number of engines (replicas of the whole model) on this side; 1 on the training side.
    fn engines(&self) -> u32 {
        1
    }

    /// The local tensors of `rank`, or `None` if no such rank.
    fn rank_layout(&self, rank: RankId) -> Option<RankLayout>;

    /// Every shard of canonical tensor `canonical`, with the ranks holding each.
    fn holders(&self, canonical: &str) -> Vec<Holder>;

    /// [`Self::holders`] of `canonical`, written over `out`: what the planner asks once per
    /// tensor, handing back the previous tensor's list. A layout that builds many holders
    /// per tensor overrides it to reuse the list's holders (their rank lists) instead of
    /// allocating them anew; the default replaces `out` with [`Self::holders`].
    fn holders_into(&self, canonical: &str, out: &mut Vec<Holder>) {
        *out = self.holders(canonical);
    }

    /// Whether `canonical` is laid out like other tensors of this side, so that a reader of
    /// many tensors (the planner) asks for the holders of one of them only: `Some(alike)`
    /// promises that every tensor of this side answering the same [`Alike::key`] has holders
    /// equal to `canonical`'s ([`Self::holders`]: boxes, ranks, local shapes, dtypes, offsets,
    /// transposition, order) but for the local tensor's name, and that every holder of
    /// `canonical` names one local tensor, [`Alike::tensor`]. `None` (the default): no promise.
    /// A layout answers it from what its holders are computed from, without building them
    /// (`awex-sim/tests/alike.rs` checks the promise for every family and backend).
    fn alike(&self, canonical: &str) -> Option<Alike> {
        let _ = canonical;
        None
    }

    /// Canonical tensors of the model this side holds no copy of because the engine's model
    /// class builds no parameter for them (its loader skips them): an update moves nothing
    /// into them, and `plan` and connect say so. Empty for a side that holds the whole model.
    fn dropped(&self) -> Vec<String> {
        Vec::new()
    }

    /// Calls `f` with the canonical tensor of every placement of `rank`'s local tensors (each
    /// name at least once, in no promised order), or returns `false` if no such rank.
    ///
    /// What the planner needs of a rank's own layout. The default builds [`Self::rank_layout`];
    /// a layout that can name the tensors without building the rank's placements overrides it.
    fn for_each_canonical(&self, rank: RankId, f: &mut dyn FnMut(&str)) -> bool {
        let Some(layout) = self.rank_layout(rank) else {
            return false;
        };
        // an FP8 tensor's scales are written with it, from no canonical tensor of their own
        for t in layout.tensors.iter().filter(|t| !is_scales(t)) {
            for p in &t.placements {
                f(&p.canonical);
            }
        }
        true
    }

    /// The encoding of local tensor `tensor` when it is not plain elements of its holders'
    /// dtype (an FP8 inference side's quantised weights: [`crate::encoding::Fp8Side`]); `None`
    /// (plain) by default. The planner asks it for holders of dtype `f8e4m3` only.
    fn tensor_encoding(&self, tensor: &str) -> Option<Encoding> {
        let _ = tensor;
        None
    }

    /// Parts that this engine's model class also stores as block FP8 when the checkpoint is
    /// block FP8, beyond the linear weights every engine quantises
    /// ([`crate::model::Part::fp8_linear`]), unless `ignored_layers` names their module (vLLM
    /// 0.33's Qwen3-MoE builds its router with the checkpoint's quantisation). Empty by default.
    fn fp8_extra_parts(&self) -> &[crate::model::Part] {
        &[]
    }
}

/// Whether `t` holds the scales of an FP8 tensor (no transfer writes it).
fn is_scales(t: &LocalTensor) -> bool {
    matches!(t.encoding, Encoding::Fp8Scales(_))
}

/// A side given as explicit rank layouts (e.g. reported by live processes), with its inverse index.
#[derive(Clone, Debug)]
pub struct ExplicitSide {
    side: Side,
    engines: u32,
    ranks: Vec<RankLayout>,
    by_canonical: HashMap<Arc<str>, Vec<Holder>>,
    /// the tensors whose encoding is not plain
    encodings: HashMap<Arc<str>, Encoding>,
}

impl ExplicitSide {
    /// Builds a side from rank layouts (order does not matter).
    pub fn new(side: Side, mut ranks: Vec<RankLayout>) -> Self {
        ranks.sort_by_key(|r| r.rank);
        let engines = ranks.iter().map(|r| r.rank.engine + 1).max().unwrap_or(1);
        // group identical shards held by several ranks
        // (canonical, tensor, region, local offset, transposed): one shard
        type ShardKey = (Arc<str>, Arc<str>, Region, Dims, bool);
        let mut by_key: HashMap<ShardKey, usize> = HashMap::new();
        let mut by_canonical: HashMap<Arc<str>, Vec<Holder>> = HashMap::new();
        let mut encodings = HashMap::new();
        for r in &ranks {
            for t in &r.tensors {
                if t.encoding.is_fp8() {
                    encodings.insert(t.name.clone(), t.encoding.clone());
                }
                if is_scales(t) {
                    continue;
                }
                for p in &t.placements {
                    let key = (
                        p.canonical.clone(),
                        t.name.clone(),
                        p.region,
                        p.local_offset,
                        p.transposed,
                    );
                    let list = by_canonical.entry(p.canonical.clone()).or_default();
                    match by_key.get(&key) {
                        Some(&i) if list[i].tensor_shape == t.shape && list[i].dtype == t.dtype => {
                            list[i].ranks.push(r.rank)
                        }
                        _ => {
                            by_key.insert(key, list.len());
                            list.push(Holder {
                                ranks: vec![r.rank],
                                tensor: t.name.clone(),
                                tensor_shape: t.shape,
                                dtype: t.dtype,
                                region: p.region,
                                local_offset: p.local_offset,
                                transposed: p.transposed,
                            });
                        }
                    }
                }
            }
        }
        ExplicitSide {
            side,
            engines,
            ranks,
            by_canonical,
            encodings,
        }
    }

    /// Materialises every rank of a lazily computed side (for tests and small worlds).
    pub fn from_side(layout: &dyn SideLayout) -> Self {
        let ranks = layout
            .ranks()
            .into_iter()
            .filter_map(|r| layout.rank_layout(r))
            .collect();
        ExplicitSide::new(layout.side(), ranks)
    }

    /// The rank layouts, sorted by rank.
    pub fn rank_layouts(&self) -> &[RankLayout] {
        &self.ranks
    }
}

impl SideLayout for ExplicitSide {
    fn side(&self) -> Side {
        self.side
    }

    fn ranks(&self) -> Vec<RankId> {
        self.ranks.iter().map(|r| r.rank).collect()
    }

    fn engines(&self) -> u32 {
        self.engines
    }

    fn rank_layout(&self, rank: RankId) -> Option<RankLayout> {
        self.ranks
            .binary_search_by_key(&rank, |r| r.rank)
            .ok()
            .map(|i| self.ranks[i].clone())
    }

    fn holders(&self, canonical: &str) -> Vec<Holder> {
        self.by_canonical
            .get(canonical)
            .cloned()
            .unwrap_or_default()
    }

    fn tensor_encoding(&self, tensor: &str) -> Option<Encoding> {
        self.encodings.get(tensor).cloned()
    }
}

/// Why a layout is not valid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// A placement names a tensor the model does not have.
    #[error("rank {rank}: `{tensor}` places unknown canonical tensor `{canonical}`")]
    UnknownCanonical {
        /// the rank
        rank: RankId,
        /// the local tensor
        tensor: String,
        /// the canonical name
        canonical: String,
    },
    /// A placement does not fit inside the local or the canonical tensor.
    #[error("rank {rank}: `{tensor}` {message}")]
    OutOfBounds {
        /// the rank
        rank: RankId,
        /// the local tensor
        tensor: String,
        /// what does not fit
        message: String,
    },
    /// Two placements of one local tensor overlap.
    #[error("rank {rank}: `{tensor}` has overlapping placements ({a} and {b})")]
    Overlap {
        /// the rank
        rank: RankId,
        /// the local tensor
        tensor: String,
        /// first placement
        a: String,
        /// second placement
        b: String,
    },
    /// The local dtype cannot hold the canonical dtype.
    #[error(
        "rank {rank}: `{tensor}` is {local} but canonical `{canonical}` is {canonical_dtype}, and no conversion exists"
    )]
    DType {
        /// the rank
        rank: RankId,
        /// the local tensor
        tensor: String,
        /// local dtype
        local: DType,
        /// canonical name
        canonical: String,
        /// canonical dtype
        canonical_dtype: DType,
    },
    /// A rank has two tensors of one name.
    #[error("rank {rank}: tensor name `{tensor}` appears twice")]
    DuplicateName {
        /// the rank
        rank: RankId,
        /// the name
        tensor: String,
    },
    /// A parallel configuration the backend cannot lay out.
    #[error("{0}")]
    Config(String),
    /// A canonical tensor with no elements: a model whose spec was not validated
    /// ([`crate::model::ModelSpec::validate`] refuses every zero size).
    #[error(
        "canonical tensor `{canonical}` has shape {shape}, with no elements (dimension {dim} is 0); every tensor of a model needs at least one element along each dimension"
    )]
    EmptyTensor {
        /// the canonical tensor
        canonical: String,
        /// its shape
        shape: Dims,
        /// the dimension that is 0
        dim: usize,
    },
}
