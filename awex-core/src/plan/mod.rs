//! The planner: from a training layout and an inference layout, each rank's ordered transfers.
//!
//! A rank plans alone, without building the global plan: for every canonical tensor it touches,
//! it asks both sides who holds that tensor ([`SideLayout::holders`]), splits each destination
//! box into cells held by the same set of source ranks, and assigns every (destination rank,
//! cell) to one source with a deterministic greedy that balances egress over all replicas of
//! the source (DP/CP replicas, tied copies). Both ends of a peer pair run the same computation
//! on the same inputs, so they agree on the transfers and their order without talking; a
//! fingerprint per peer pair lets them check it.

mod assign;
pub mod bucket;
mod coalesce;
mod simulate;
mod transfers;

pub use simulate::{RankBuffers, SimulationError, simulate};
pub use transfers::Transfers;

use crate::dtype::DType;
use crate::encoding::{Fp8Block, ScaleFormat};
use crate::layout::copy::{Transpose, swap_last_two};
use crate::layout::{Dims, RankId, Side, SideLayout};
use crate::model::Catalogue;
use crate::model::NameHasher;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;

/// One peer of a rank's plan while it is made: the number of its transfers, then their
/// indices in the plan's [`transfers::Store`] in emission order.
struct PeerList {
    peer: RankId,
    count: u32,
    order: Vec<u32>,
}

/// Where a rank's transfers go as they are emitted, compactly (what transfers between two
/// local tensors share is in one table of ends), each peer numbered as it first comes: a
/// peer's transfers are between one pair of ranks, its number is its pair's.
struct Out {
    side: Side,
    store: transfers::Store,
    lists: Vec<PeerList>,
    numbers: PeerNumbers,
    /// the peer of the last transfer, and its number
    last: Option<(RankId, u32)>,
}

impl Out {
    /// The number of the peer of a transfer from `src` to `dst`.
    fn peer_number(&mut self, src: RankId, dst: RankId) -> u32 {
        let peer = match self.side {
            Side::Training => dst,
            Side::Inference => src,
        };
        match self.last {
            Some((q, at)) if q == peer => at,
            _ => {
                let (lists, pairs) = (&mut self.lists, &mut self.store.pairs);
                let at = self.numbers.number(peer, || {
                    lists.push(PeerList {
                        peer,
                        count: 0,
                        order: Vec::new(),
                    });
                    pairs.push((src, dst));
                    lists.len() as u32 - 1
                });
                self.last = Some((peer, at));
                at
            }
        }
    }

    /// Adds a transfer to peer number `peer` ([`Out::peer_number`]).
    fn emit(&mut self, peer: u32, ends: u32, canonical: u32, boxes: &transfers::Boxes) {
        let item = transfers::Item::new(ends, canonical, peer, boxes, &mut self.store.wide);
        self.push(item);
    }

    /// Adds a transfer whose item is made, its peer numbered ([`Out::peer_number`]).
    #[inline]
    fn push(&mut self, item: transfers::Item) {
        self.lists[item.pair as usize].count += 1;
        self.store.items.push(item);
    }
}

/// The number of each peer of a rank's plan, by the peer: through a table per engine where
/// the ranks are numbered below a bound, else through a map.
#[derive(Default)]
struct PeerNumbers {
    table: Vec<Vec<u32>>,
    map: HashMap<u64, u32, BuildHasherDefault<NameHasher>>,
}

impl PeerNumbers {
    /// Ranks and engines below these find their number in a table.
    const ENGINES: u32 = 1 << 10;
    const RANKS: u32 = 1 << 16;

    /// The number of `peer`, or `fresh()` (the next number), remembered, when it has none yet.
    fn number(&mut self, peer: RankId, fresh: impl FnOnce() -> u32) -> u32 {
        if peer.engine < Self::ENGINES && peer.rank < Self::RANKS {
            let (e, r) = (peer.engine as usize, peer.rank as usize);
            if self.table.len() <= e {
                self.table.resize_with(e + 1, Vec::new);
            }
            let row = &mut self.table[e];
            if row.len() <= r {
                row.resize(r + 1, u32::MAX);
            }
            if row[r] == u32::MAX {
                row[r] = fresh();
            }
            row[r]
        } else {
            let key = (u64::from(peer.engine) << 32) | u64::from(peer.rank);
            *self.map.entry(key).or_insert_with(fresh)
        }
    }
}

/// One box moved from a source rank's local tensor into a destination rank's local tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    /// The sending (training) rank.
    pub src_rank: RankId,
    /// The receiving (inference) rank.
    pub dst_rank: RankId,
    /// Lowest catalogue index of the canonical tensors this transfer carries (orders transfers).
    pub canonical: u32,
    /// Source local tensor.
    pub src_tensor: Arc<str>,
    /// Shape of the source local tensor.
    pub src_shape: Dims,
    /// Offset of the box in the source local tensor.
    pub src_offset: Dims,
    /// Source dtype.
    pub src_dtype: DType,
    /// Destination local tensor.
    pub dst_tensor: Arc<str>,
    /// Shape of the destination local tensor.
    pub dst_shape: Dims,
    /// Offset of the box in the destination local tensor.
    pub dst_offset: Dims,
    /// Destination dtype (the sender converts when it differs).
    pub dst_dtype: DType,
    /// Extent of the box; aligns with the trailing dims of both local tensors.
    pub extent: Dims,
    /// Set when the destination tensor is FP8 blocks; [`Encode::at`] says who quantises. A
    /// receiver-encoded transfer delivers `dst_dtype` (the canonical dtype) into the
    /// destination's staging; a sender-encoded one (`dst_dtype` is `f8e4m3`) delivers the
    /// e4m3 bytes of its box into the destination tensor itself and the scales of its blocks
    /// into the scale tensor ([`Transfer::scale_box`]). `None` (plain) for every transfer of
    /// a plain pair, which is then planned, serialised and fingerprinted exactly as before
    /// encodings existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encode: Option<Encode>,
    /// Whether the destination tensor holds the box with its last two dims swapped
    /// ([`crate::layout::Placement::transposed`]): box element `(.., i, j)` lands at
    /// `(.., j, i)` from `dst_offset`, the offset of the transposed box, which occupies
    /// [`Transfer::dst_extent`]. Never merged with another transfer; never FP8-encoded. Left
    /// out of the serialised transfer (and of its fingerprint) when `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transposed: bool,
}

/// Who turns the bf16 of a destination block into e4m3 bytes and its scale.
///
/// A block is quantised where all its elements are. When the pair's transport encodes on the
/// sender ([`Pair::encode_on_sender`]), the planner cuts every destination box of an FP8
/// tensor into the part that covers whole blocks of the destination's local tensor (in each
/// of its two trailing dims the part starts on a block boundary and ends on one or at the
/// tensor's edge; leading dims, an expert stack's, are free) and the pieces of cut blocks
/// around it. Every destination byte is written by one transfer, so the whole-block part's
/// one sender holds each of its blocks whole: it is [`EncodeAt::Sender`] (where the sender
/// holds the canonical dtype, which it quantises as the receiver would from its staging; a
/// source of another dtype leaves the box receiver-encoded). The pieces of cut
/// blocks are [`EncodeAt::Receiver`], and so is every transfer into an FP8 tensor when the
/// transport does not encode on the sender: the receiver quantises exactly the blocks that
/// no sender-encoded transfer covers. Both ends cut alike, from the same plan inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EncodeAt {
    /// The receiving rank, once every transfer of the update landed in its staging: the
    /// transfer carries the canonical dtype (`dst_dtype`) into the staging.
    Receiver,
    /// The sending rank, which holds every block of the box whole: the transfer carries the
    /// box's e4m3 bytes (`dst_dtype` is `f8e4m3`) into the destination tensor and its blocks'
    /// fp32 scales into the scale tensor ([`Transfer::scale_box`]).
    Sender,
}

/// Where a sender-encoded transfer's scales land: a box of the destination's scale tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScaleBox {
    /// The scale tensor (`Fp8Block::scale_name(dst_tensor)`).
    pub tensor: String,
    /// Its shape: the destination tensor's with the two trailing dims in blocks (rounded up).
    pub shape: Dims,
    /// Offset of the box: the transfer's `dst_offset` with the two trailing dims in blocks.
    pub offset: Dims,
    /// Extent of the box (the transfer's box dims): its `extent` with the two trailing dims
    /// in blocks (rounded up: a box ending at the tensor's edge ends in a partial block).
    pub extent: Dims,
}

/// Bytes of one FP8 scale (fp32, whichever [`ScaleFormat`]).
pub const SCALE_BYTES: u64 = 4;

/// Whether a box of an FP8 tensor covers whole blocks: in each of the two trailing dims it
/// starts on a block boundary and ends on one or at the tensor's edge. `offset` and `shape`
/// are the local tensor's (`n` dims); `extent` the box's (`k <= n` trailing dims).
pub fn covers_whole_blocks(block: [u32; 2], shape: &Dims, offset: &Dims, extent: &Dims) -> bool {
    let (n, k) = (shape.ndim(), extent.ndim());
    if n < 2 || k < 2 || offset.ndim() != n || k > n {
        return false;
    }
    (0..2).all(|i| {
        let b = block[i] as u64;
        let (o, e, edge) = (
            offset.get(n - 2 + i),
            extent.get(k - 2 + i),
            shape.get(n - 2 + i),
        );
        o % b == 0 && ((o + e) % b == 0 || o + e == edge)
    })
}

/// How a transfer into an FP8 tensor is encoded.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Encode {
    /// The destination tensor's encoding.
    pub encoding: Fp8Block,
    /// Where its blocks are quantised.
    pub at: EncodeAt,
}

impl Transfer {
    /// How the box copy is oriented: [`Transpose::Dst`] for a transposed transfer.
    pub fn transpose(&self) -> Transpose {
        if self.transposed {
            Transpose::Dst
        } else {
            Transpose::None
        }
    }

    /// The box as runs between its two tensors (element offsets and strides on each end), in
    /// its orientation: what every copy of it walks.
    pub fn strided_box(
        &self,
    ) -> Result<crate::layout::copy::StridedBox, crate::layout::copy::CopyError> {
        crate::layout::copy::StridedBox::new_transposed(
            &self.src_shape,
            &self.src_offset,
            &self.dst_shape,
            &self.dst_offset,
            &self.extent,
            self.transpose(),
        )
    }

    /// The extent the box occupies in the destination tensor's trailing dims: `extent`, its
    /// last two dims swapped for a transposed transfer.
    pub fn dst_extent(&self) -> Dims {
        if self.transposed {
            swap_last_two(&self.extent)
        } else {
            self.extent
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.extent.numel()
    }

    /// Bytes on the wire: the destination dtype's; for a sender-encoded transfer its e4m3
    /// bytes plus its blocks' fp32 scales ([`Transfer::scale_box`]).
    pub fn bytes(&self) -> u64 {
        self.numel() * self.dst_dtype.size() as u64 + self.scale_bytes()
    }

    /// Whether the sender quantises this transfer's blocks ([`EncodeAt::Sender`]).
    pub fn sender_encoded(&self) -> bool {
        matches!(
            self.encode,
            Some(Encode {
                at: EncodeAt::Sender,
                ..
            })
        )
    }

    /// Whether the receiver quantises this transfer's blocks ([`EncodeAt::Receiver`]).
    pub fn receiver_encoded(&self) -> bool {
        matches!(
            self.encode,
            Some(Encode {
                at: EncodeAt::Receiver,
                ..
            })
        )
    }

    /// The box of the destination's scale tensor a sender-encoded transfer writes (`None` for
    /// any other transfer): its blocks' scales, in block coordinates of the local tensor.
    pub fn scale_box(&self) -> Option<ScaleBox> {
        let e = self.encode.as_ref()?;
        if e.at != EncodeAt::Sender {
            return None;
        }
        let b = e.encoding.block.map(u64::from);
        let blocks = |d: &Dims, ceil: bool| {
            let mut v = *d;
            let n = v.ndim();
            for (i, &bi) in b.iter().enumerate() {
                let x = v.get(n - 2 + i);
                v.set(n - 2 + i, if ceil { x.div_ceil(bi) } else { x / bi });
            }
            v
        };
        Some(ScaleBox {
            tensor: Fp8Block::scale_name(&self.dst_tensor),
            shape: blocks(&self.dst_shape, true),
            offset: blocks(&self.dst_offset, false),
            extent: blocks(&self.extent, true),
        })
    }

    /// Scale bytes on the wire: a sender-encoded transfer's blocks' scales, else 0.
    pub fn scale_bytes(&self) -> u64 {
        self.scale_box()
            .map_or(0, |s| s.extent.numel() * SCALE_BYTES)
    }

    /// Whether the sender converts the dtype.
    pub fn converts(&self) -> bool {
        self.src_dtype != self.dst_dtype
    }

    /// Appends the bytes the fingerprint hashes (hashing the concatenation of every transfer's
    /// bytes in one call gives the same digest as feeding them piecewise): its ranks, the
    /// digest of its ends ([`ends_digest`]: names, shapes, dtypes, transpose, encoding), and its
    /// three boxes with their dims' counts. The planner writes the same bytes from a plan's
    /// compact transfers ([`Transfers`]); this is the reference its tests hold them to.
    #[cfg(test)]
    fn hash_bytes(&self, h: &mut Vec<u8>) {
        for r in [self.src_rank, self.dst_rank] {
            h.extend_from_slice(&r.engine.to_le_bytes());
            h.extend_from_slice(&r.rank.to_le_bytes());
        }
        let sum = ends_digest(
            &mut Vec::new(),
            (&self.src_tensor, &self.src_shape, self.src_dtype),
            (&self.dst_tensor, &self.dst_shape, self.dst_dtype),
            self.transposed,
            self.encode.as_ref(),
        );
        h.extend_from_slice(&sum.to_le_bytes());
        let boxes = [&self.src_offset, &self.dst_offset, &self.extent];
        h.extend(boxes.map(|d| d.ndim() as u8));
        for d in boxes {
            for x in d.as_slice() {
                h.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
}

/// The digest of what a transfer's fingerprint bytes say of its two local tensors
/// ([`Transfer::hash_bytes`]): each end's name, shape and dtype, then its transpose and
/// encoding, if any. Transfers between the same two tensors share it, so a plan hashes it once
/// per pair of tensors instead of once per transfer.
pub(crate) fn ends_digest(
    h: &mut Vec<u8>,
    src: (&str, &Dims, DType),
    dst: (&str, &Dims, DType),
    transposed: bool,
    encode: Option<&Encode>,
) -> u64 {
    h.clear();
    for (name, shape, dt) in [src, dst] {
        h.extend_from_slice(name.as_bytes());
        h.push(0);
        h.push(shape.ndim() as u8);
        for d in shape.as_slice() {
            h.extend_from_slice(&d.to_le_bytes());
        }
        h.extend_from_slice(dt.as_str().as_bytes());
        h.push(0);
    }
    if transposed {
        h.extend_from_slice(b"transposed");
    }
    if let Some(e) = encode {
        h.extend_from_slice(b"fp8");
        for b in e.encoding.block {
            h.extend_from_slice(&b.to_le_bytes());
        }
        h.push(match e.encoding.scale_format {
            ScaleFormat::F32 => 0,
            ScaleFormat::Ue8m0 => 1,
        });
        h.push(match e.at {
            EncodeAt::Receiver => 0,
            EncodeAt::Sender => 1,
        });
    }
    xxhash_rust::xxh3::xxh3_64(h)
}

/// Every transfer between one rank and one peer, in the order both ends execute them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerPlan {
    /// The rank on the other side.
    pub peer: RankId,
    /// The transfers, ordered (stored compactly: [`Transfers`]).
    pub transfers: Transfers,
    /// Total bytes on the wire.
    pub bytes: u64,
    /// xxh3 of the transfers; equal on both ends of the pair.
    pub fingerprint: u64,
}

/// One rank's plan: its transfers grouped by peer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlan {
    /// The rank's side.
    pub side: Side,
    /// The rank.
    pub rank: RankId,
    /// Per-peer transfers, sorted by peer.
    pub peers: Vec<PeerPlan>,
    /// xxh3 over the peers' fingerprints.
    pub fingerprint: u64,
}

impl RankPlan {
    /// The first transfer whose destination holds its box transposed
    /// ([`Transfer::transposed`]), if any: what a path that does not transpose refuses.
    pub fn first_transposed(&self) -> Option<&Transfer> {
        self.peers
            .iter()
            .flat_map(|p| &p.transfers)
            .find(|t| t.transposed)
    }

    /// Total bytes this rank sends or receives.
    pub fn bytes(&self) -> u64 {
        self.peers.iter().map(|p| p.bytes).sum()
    }

    /// Number of transfers.
    pub fn transfers(&self) -> usize {
        self.peers.iter().map(|p| p.transfers.len()).sum()
    }

    /// The plan with one peer.
    pub fn peer(&self, peer: RankId) -> Option<&PeerPlan> {
        self.peers
            .binary_search_by_key(&peer, |p| p.peer)
            .ok()
            .map(|i| &self.peers[i])
    }
}

/// Why a plan cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// The rank does not exist on its side.
    #[error("{side} side has no rank {rank}")]
    NoSuchRank {
        /// the side
        side: Side,
        /// the rank
        rank: RankId,
    },
    /// A destination box is held by no training rank.
    #[error("inference rank {dst} needs {region} of `{canonical}`, which no training rank holds")]
    Uncovered {
        /// canonical tensor
        canonical: String,
        /// the missing box
        region: String,
        /// the destination rank
        dst: RankId,
    },
    /// A destination box with no elements (a zero dimension): a layout of a model whose spec
    /// was not validated.
    #[error(
        "`{canonical}`: the destination box {region} has no elements (dimension {dim} is 0); every tensor of a model needs at least one element along each dimension"
    )]
    EmptyBox {
        /// canonical tensor
        canonical: String,
        /// the empty box
        region: String,
        /// the dimension that is 0
        dim: usize,
    },
    /// The inference side places a tensor the model does not have.
    #[error("`{0}` is placed by a rank but is not a tensor of the model")]
    UnknownCanonical(String),
    /// An inference tensor is `f8e4m3` but its side gives no FP8 encoding for it, or its
    /// canonical dtype is not one the quantisers read.
    #[error(
        "`{canonical}`: inference tensor `{tensor}` is FP8 but {reason}; an FP8 inference side is built from a quantization_config (`plan --infer-quant fp8`)"
    )]
    Encoding {
        /// canonical tensor
        canonical: String,
        /// the inference tensor
        tensor: String,
        /// what is missing
        reason: String,
    },
    /// A holder that cannot take part in a transposed transfer: a transposed training holder
    /// (only inference tensors may hold boxes transposed) or a transposed FP8 destination.
    #[error("`{canonical}`: tensor `{tensor}` holds it transposed, but {reason}")]
    Transposed {
        /// canonical tensor
        canonical: String,
        /// the local tensor
        tensor: String,
        /// why it cannot be moved
        reason: String,
    },
    /// Source and destination dtypes cannot be converted.
    #[error("`{canonical}`: training holds {src} and inference needs {dst}; no conversion exists")]
    DType {
        /// canonical tensor
        canonical: String,
        /// source dtype
        src: DType,
        /// destination dtype
        dst: DType,
    },
}

/// The most threads [`Pair::plan_rank`] takes.
pub const PLAN_THREADS: usize = 4;

/// A plan of more transfers than this has its peers coalesced and fingerprinted on several
/// threads.
pub const THREADED_TRANSFERS: usize = 16_384;

/// A rank of at least this many tensors finds their alike classes on several threads.
pub const THREADED_TENSORS: usize = 2_048;

/// Coalesces a peer's transfers ([`coalesce::Groups::coalesce`]) on `copy`, a copy of its
/// items (`items` in `l.order`), and puts `l.order` in execution order, and `order` the same
/// order as indices into `copy`; returns the items that merges grew, with their indices in
/// `items`.
fn coalesce_copy(
    g: &mut coalesce::Groups,
    l: &mut PeerList,
    (copy, order): (&mut [transfers::Item], &mut Vec<u32>),
    ends: &[transfers::Ends],
    wide: &mut Vec<transfers::Boxes>,
) -> Vec<(u32, transfers::Item)> {
    order.clear();
    order.extend(0..copy.len() as u32);
    g.coalesce(order, copy, ends, wide);
    let grown = g
        .grown()
        .iter()
        .map(|&j| (l.order[j as usize], copy[j as usize]))
        .collect();
    l.order = order.iter().map(|&j| l.order[j as usize]).collect();
    grown
}

/// A peer's (fingerprint, bytes on the wire) from its items in execution order.
fn fingerprint<'a>(
    store: &transfers::Store,
    items: impl ExactSizeIterator<Item = &'a transfers::Item>,
    ends: &transfers::EndsSums,
    bytes: &mut Vec<u8>,
) -> (u64, u64) {
    bytes.clear();
    let wire = store.hash_and_count(items, ends, bytes);
    (xxhash_rust::xxh3::xxh3_64(bytes), wire)
}

/// Runs `f` on every job, on up to `threads` threads (the calling thread one of them), each
/// thread with its own `state`: the jobs are cut into contiguous chunks of about equal `weight`,
/// [`CHUNKS_PER_THREAD`] per thread, which the threads take in turn as they get free (a job's
/// cost is not quite its weight). The results come in the jobs' order, so they do not depend on
/// the threads or on which thread ran what.
fn in_groups<J: Send, S, R: Send>(
    jobs: Vec<J>,
    threads: usize,
    weight: impl Fn(&J) -> usize,
    state: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, J) -> R + Sync,
) -> Vec<R> {
    if threads <= 1 || jobs.len() < 2 {
        let mut s = state();
        return jobs.into_iter().map(|j| f(&mut s, j)).collect();
    }
    let chunks = (threads * CHUNKS_PER_THREAD).min(jobs.len());
    let per = jobs
        .iter()
        .map(&weight)
        .sum::<usize>()
        .div_ceil(chunks)
        .max(1);
    let mut cut: Vec<Vec<J>> = vec![Vec::new()];
    let mut acc = 0;
    for j in jobs {
        acc += weight(&j);
        cut.last_mut().expect("a chunk").push(j);
        if acc >= per {
            cut.push(Vec::new());
            acc = 0;
        }
    }
    cut.retain(|c| !c.is_empty());
    let helpers = (threads - 1).min(cut.len() - 1);
    let queue = std::sync::Mutex::new(cut.into_iter().enumerate());
    let work = || {
        let mut s = state();
        let mut done: Vec<(usize, Vec<R>)> = Vec::new();
        loop {
            // (the lock is held only to take a chunk: no job runs under it)
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some((at, chunk)) = next else {
                return done;
            };
            done.push((at, chunk.into_iter().map(|j| f(&mut s, j)).collect()));
        }
    };
    let work = &work;
    let mut done = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..helpers).map(|_| sc.spawn(work)).collect();
        let mut done = work();
        for h in handles {
            done.extend(h.join().expect("a planning thread panicked"));
        }
        done
    });
    done.sort_unstable_by_key(|(at, _)| *at);
    done.into_iter().flat_map(|(_, r)| r).collect()
}

/// How many chunks of jobs [`in_groups`] makes per thread.
const CHUNKS_PER_THREAD: usize = 8;

/// The two sides of a pair and the model they share.
pub struct Pair<'a> {
    /// Canonical catalogue of the model.
    pub catalogue: &'a Catalogue,
    /// The training side (sources).
    pub training: &'a dyn SideLayout,
    /// The inference side (destinations).
    pub inference: &'a dyn SideLayout,
    /// Whether the pair's transport quantises FP8 blocks on the sender
    /// ([`crate::Transport::encodes_fp8_on_sender`]): transfers that cover whole blocks of
    /// their FP8 destination are then [`EncodeAt::Sender`]. `false`: every FP8 block is
    /// receiver-encoded. (No effect on a plain pair.)
    pub encode_on_sender: bool,
}

impl Pair<'_> {
    /// The plan of one rank, computed from that rank's own pieces only; a large plan is made
    /// on up to [`PLAN_THREADS`] threads ([`Pair::plan_rank_on`]).
    pub fn plan_rank(&self, side: Side, rank: RankId) -> Result<RankPlan, PlanError> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.plan_rank_on(side, rank, threads.min(PLAN_THREADS))
    }

    /// [`Pair::plan_rank`] on at most `threads` threads, the same plan for any number: a rank
    /// of at least [`THREADED_TENSORS`] tensors finds their alike classes in groups at once,
    /// the tensors are assigned on the calling thread, and a plan of more than
    /// [`THREADED_TRANSFERS`] transfers coalesces and fingerprints its peers in groups at once.
    /// (Assigning runs of tensors on threads, each run with its own caches, was slower on the
    /// 16-core VMs measured: each run touches its own memory for the same structures and
    /// holders, and a page touched first costs microseconds there; `docs/benchmarks.md`.)
    pub fn plan_rank_on(
        &self,
        side: Side,
        rank: RankId,
        threads: usize,
    ) -> Result<RankPlan, PlanError> {
        let layout = match side {
            Side::Training => self.training,
            Side::Inference => self.inference,
        };
        // canonical tensors this rank touches, in catalogue order; a rank's placements mostly
        // follow the catalogue, so each name is first looked for just after the previous one
        let mut ids: Vec<u32> = Vec::new();
        let mut near = None;
        let mut unknown = None;
        let found =
            layout.for_each_canonical(rank, &mut |name| match self.catalogue.id_near(name, near) {
                Some(id) => {
                    near = Some(id);
                    ids.push(id);
                }
                None => {
                    if unknown.is_none() {
                        unknown = Some(name.to_string());
                    }
                }
            });
        if !found {
            return Err(PlanError::NoSuchRank { side, rank });
        }
        if let Some(name) = unknown {
            return Err(PlanError::UnknownCanonical(name));
        }
        ids.sort_unstable();
        ids.dedup();
        // every transfer in emission order, compactly (what transfers between two local
        // tensors share is in one table of ends), each peer numbered as it first comes: a
        // peer's transfers are between one pair of ranks, its number is its pair's
        let mut out = Out {
            side,
            store: transfers::Store::default(),
            lists: Vec::new(),
            numbers: PeerNumbers::default(),
            last: None,
        };
        // room for the transfers a rank of a large pair plans per tensor (address space only:
        // no page is touched before a transfer is written to it), so that the store does not
        // move while it grows
        out.store.items.reserve((ids.len() * 32).min(1 << 20));
        // each tensor's alike classes (functions of its name alone): for a rank of many
        // tensors found on threads first, kept for the tensors that have one (a side without
        // classes keeps nothing), in tensor order
        const CHUNK: usize = 256;
        let first = threads > 1 && ids.len() >= THREADED_TENSORS;
        let found: Vec<(usize, assign::Alikes)> = if first {
            in_groups(
                ids.chunks(CHUNK).enumerate().collect(),
                threads,
                |(_, c)| c.len(),
                || (),
                |_, (k, c)| {
                    c.iter()
                        .enumerate()
                        .map(|(i, &id)| {
                            (
                                k * CHUNK + i,
                                assign::alikes(self, &self.catalogue.by_id(id).name),
                            )
                        })
                        .filter(|(_, a)| a.0.is_some())
                        .collect::<Vec<_>>()
                },
            )
            .concat()
        } else {
            Vec::new()
        };
        let mut found = found.into_iter().peekable();
        let mut scratch = assign::Scratch::default();
        scratch.reserve_ends(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let c = self.catalogue.by_id(id);
            let alikes = if first {
                found
                    .next_if(|(at, _)| *at == i)
                    .map_or((None, None), |(_, a)| a)
            } else {
                assign::alikes(self, &c.name)
            };
            assign::assign_tensor(self, id, c, (side, rank), alikes, &mut scratch, &mut out)?;
        }
        let (ends, groups_of_ends) = scratch.take_ends();
        out.store.ends = ends;
        let Out {
            mut store,
            mut lists,
            ..
        } = out;
        // each peer's transfers, in emission order (a peer's number is its pair's)
        for l in &mut lists {
            l.order.reserve_exact(l.count as usize);
        }
        for (i, it) in store.items.iter().enumerate() {
            lists[it.pair as usize].order.push(i as u32);
        }
        // every peer's transfers coalesced and put in execution order, each peer's on a copy
        // of its items: on threads, the peers whose transfers stay narrow (none of their
        // merges adds a box to the store's wide ones: `Item::stay_narrow`), then the others,
        // one after another; the items that merges grew are then written back
        let spread = if store.items.len() > THREADED_TRANSFERS {
            threads
        } else {
            1
        };
        // (each peer is fingerprinted where it is coalesced, from its items in execution order:
        // a narrow peer's from the copy its job holds, a wide one's from the store once its
        // items are written back)
        let ends_bytes = transfers::EndsSums::on(&store.ends, spread);
        let done = {
            let (st, sums) = (&store, &ends_bytes);
            in_groups(
                lists.iter_mut().collect(),
                spread,
                |l| l.order.len(),
                || {
                    let g = coalesce::Groups::new(&groups_of_ends);
                    (g, Vec::new(), Vec::new(), Vec::new())
                },
                |(g, copy, order, bytes), l| {
                    copy.clear();
                    copy.extend(l.order.iter().map(|&i| st.items[i as usize]));
                    transfers::Item::stay_narrow(copy).then(|| {
                        let mut none = Vec::new();
                        let grown = coalesce_copy(g, l, (copy, order), &st.ends, &mut none);
                        debug_assert!(none.is_empty(), "a narrow peer's merges stay narrow");
                        let items = order.iter().map(|&j| &copy[j as usize]);
                        (grown, fingerprint(st, items, sums, bytes))
                    })
                },
            )
        };
        let mut g = coalesce::Groups::new(&groups_of_ends);
        let (mut copy, mut order, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
        let mut sums = Vec::with_capacity(lists.len());
        for (l, done) in lists.iter_mut().zip(done) {
            let (grown, sum) = match done {
                Some((grown, sum)) => (grown, Some(sum)),
                None => {
                    copy.clear();
                    copy.extend(l.order.iter().map(|&i| store.items[i as usize]));
                    let (ends, wide) = (&store.ends, &mut store.wide);
                    let grown = coalesce_copy(&mut g, l, (&mut copy, &mut order), ends, wide);
                    (grown, None)
                }
            };
            for (i, it) in grown {
                store.items[i as usize] = it;
            }
            sums.push(sum.unwrap_or_else(|| {
                let items = l.order.iter().map(|&i| &store.items[i as usize]);
                fingerprint(&store, items, &ends_bytes, &mut bytes)
            }));
        }
        // peers in order, with their fingerprints and bytes (the store keeps no room it was
        // given and did not use)
        let mut lists: Vec<(PeerList, (u64, u64))> = lists.into_iter().zip(sums).collect();
        lists.sort_unstable_by_key(|(l, _)| l.peer);
        store.items.shrink_to_fit();
        let store = Arc::new(store);
        let mut peers = Vec::with_capacity(lists.len());
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for (PeerList { peer, order, .. }, (fingerprint, wire)) in lists {
            h.update(&fingerprint.to_le_bytes());
            peers.push(PeerPlan {
                peer,
                bytes: wire,
                transfers: Transfers::from_parts(store.clone(), order),
                fingerprint,
            });
        }
        Ok(RankPlan {
            side,
            rank,
            peers,
            fingerprint: h.digest(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::in_groups;

    #[test]
    fn threaded_jobs_come_back_in_job_order_whatever_their_cost() {
        // jobs of very uneven cost (the weight says little of it), each thread reusing a
        // scratch buffer of its own: every result in its job's place, on any number of threads
        let jobs: Vec<u64> = (0..500).collect();
        let want: Vec<u64> = jobs.iter().map(|j| j * 3).collect();
        for threads in [1, 2, 3, 8, 64] {
            let got = in_groups(
                jobs.clone(),
                threads,
                |_| 1,
                Vec::<u64>::new,
                |scratch, j| {
                    scratch.clear();
                    let spin = if j % 97 == 0 { 20_000 } else { 10 };
                    scratch.extend((0..spin).map(std::hint::black_box));
                    scratch.iter().fold(j * 3, |a, &i| a ^ i ^ i)
                },
            );
            assert_eq!(got, want, "{threads} threads");
        }
    }
}
