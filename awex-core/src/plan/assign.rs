//! Assigning every destination piece of one canonical tensor to one source rank.

use super::coalesce::NameNumbers;
use super::transfers::{Boxes, Ends, Item};
use super::{Encode, EncodeAt, Pair, PlanError};
use crate::dtype::DType;
use crate::encoding::Encoding;
use crate::layout::{Alike, AlikeKey, Dims, Holder, RankId, Region, Side};
use crate::model::CanonicalTensor;
use crate::model::NameHasher;
use crate::weights::splitmix;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasherDefault;

/// The planner's tables: keys of the model's own making (see [`NameHasher`]).
type Map<K, V> = HashMap<K, V, BuildHasherDefault<NameHasher>>;
use std::sync::Arc;

/// Buffers reused across tensors of one rank's plan.
#[derive(Default)]
pub(super) struct Scratch {
    ranks: Vec<RankId>,
    loads: Vec<u64>,
    ties: Vec<u64>,
    pieces: Vec<Piece>,
    order: Vec<u32>,
    /// per candidate set: a lazy min-heap (large sets only)
    heaps: Vec<BinaryHeap<Reverse<(u64, u64, u32)>>>,
    hit: Vec<usize>,
    set: Vec<u32>,
    cells: Vec<(Region, u32)>,
    /// distinct source regions, and the range of each one's candidates in `region_cands`
    region_boxes: Vec<Region>,
    region_ranges: Vec<(u32, u32)>,
    region_cands: Vec<(u32, Cand)>,
    /// every candidate set's candidates, one after another
    flat: Vec<Cand>,
    /// per candidate set: its source regions (range in `set_keys`) and its range in `flat`
    sets: Vec<((u32, u32), (u32, u32))>,
    set_keys: Vec<u32>,
    /// per rank of the universe: how many candidate positions of this tensor name it
    occ: Vec<u32>,
    /// per set: its range in `flat` when its pieces take its candidates in turn
    turn_taking: Vec<Option<(u32, u32)>>,
    /// the pieces of the sets that search, in greedy order
    searched: Vec<u32>,
    /// the pieces that may involve the planning rank, in piece order: on the inference side
    /// its own pieces, on the training side those of the sets that name it as a candidate
    mine: Vec<u32>,
    /// every destination holder's cells with their candidate set, in holder order
    all_cells: Vec<(u32, Region, u32)>,
    /// per set, while the turns are dealt: the next piece's turn
    next_turn: Vec<u32>,
    /// per set that takes its candidates in turn: see [`Turns`]
    rr_sets: Vec<Option<Turns>>,
    /// the (tie, position) keys of turn-taking sets, sorted, once a piece of the set is needed
    rr: Vec<(u64, u32)>,
    /// per set: the bytes of all its pieces when they are equal (u64::MAX: they differ)
    set_bytes: Vec<u64>,
    /// per rank number: its index in the universe (valid for the universe's ranks only)
    slot: Vec<u32>,
    /// per source region: the candidate set of that region alone (u32::MAX: none yet)
    single_set: Vec<u32>,
    /// the candidate sets of more than one region
    multi_sets: Vec<u32>,
    /// the regions a destination box meets, by where they start along dim 0
    by0: Dim0Index,
    /// the source regions' spans along dim 0, sorted (see [`sources_apart`])
    spans: Vec<(u64, u64)>,
    /// structures of tensors planned before, by their holders
    cache: Vec<Saved>,
    /// the [`holders_key`] of each cached structure
    keys: Vec<u64>,
    /// the cached structures of each [`holders_key`]
    by_key: Map<u64, Vec<u32>>,
    /// the slot the next new structure replaces once the cache is full
    victim: usize,
    /// holder lists handed to the layouts to write the next tensor's holders over
    spare_src: Vec<Holder>,
    spare_dst: Vec<Holder>,
    /// what the transfers between two local tensors share, for every transfer emitted
    ends: EndsTable,
    /// holder lists of alike classes
    classes: Classes,
    /// the last structure stamp given
    stamps: u64,
}

/// The ends of every transfer emitted, with the group of each ([`super::coalesce::Groups`]:
/// the number of its pair of tensor names, equal names by content getting one number).
#[derive(Default)]
struct EndsTable {
    ends: Vec<Ends>,
    groups: Vec<u32>,
    /// the ends made for the tensor being planned, most recent last
    recent: Vec<u32>,
    src: NameNumbers,
    dst: NameNumbers,
    pairs: Map<(u32, u32), u32>,
}

impl EndsTable {
    /// The index of the ends of a transfer from `sh` into `dh` among those of this tensor (a
    /// new one if none is equal): a tensor's transfers from every source rank mostly share one.
    fn of(
        &mut self,
        (sname, sh): (&Arc<str>, &Holder),
        (dname, dh): (&Arc<str>, &Holder),
        dst_dtype: DType,
        encode: &Option<Encode>,
    ) -> u32 {
        let same = |a: &Arc<str>, b: &Arc<str>| Arc::ptr_eq(a, b) || a == b;
        let found = self.recent.iter().rposition(|&at| {
            let e = &self.ends[at as usize];
            e.src_dtype == sh.dtype
                && e.dst_dtype == dst_dtype
                && e.transposed == dh.transposed
                && e.src_shape == sh.tensor_shape
                && e.dst_shape == dh.tensor_shape
                && e.encode == *encode
                && same(&e.src_tensor, sname)
                && same(&e.dst_tensor, dname)
        });
        if let Some(i) = found {
            // (the most recent is looked at first)
            let last = self.recent.len() - 1;
            self.recent.swap(i, last);
            return self.recent[last];
        }
        self.push(Ends {
            src_tensor: sname.clone(),
            src_shape: sh.tensor_shape,
            src_dtype: sh.dtype,
            dst_tensor: dname.clone(),
            dst_shape: dh.tensor_shape,
            dst_dtype,
            encode: encode.clone(),
            transposed: dh.transposed,
        })
    }

    /// Adds ends made for the tensor being planned, with its group; returns its index.
    fn push(&mut self, e: Ends) -> u32 {
        let key = (
            self.src.number(&e.src_tensor),
            self.dst.number(&e.dst_tensor),
        );
        let fresh = self.pairs.len() as u32;
        self.groups.push(*self.pairs.entry(key).or_insert(fresh));
        self.ends.push(e);
        let at = self.ends.len() as u32 - 1;
        self.recent.push(at);
        at
    }
}

/// The transfers one tensor emitted, emitted again for the next tensors of its pair of kept
/// holder lists ([`Classes`]): when every piece the rank emits has one candidate source, what
/// the rank emits depends on the holders only (a tensor's identity picks among candidates), so
/// such a tensor's transfers are these with its own canonical tensor and names.
struct Emission {
    /// its ends in the order they were made (their names are the tensor's)
    ends: Vec<Ends>,
    /// its transfers in order, each with its index into `ends` and its peer's number in the
    /// plan (a peer is numbered when its first transfer is emitted), none of their boxes past
    /// 32 bits (a tensor with such a box is not kept)
    items: Vec<Item>,
}

/// The holders of each side's [`crate::layout::Alike`] classes, built once per plan, and what is known of each
/// pair of them.
#[derive(Default)]
struct Classes {
    /// every kept list
    lists: Vec<Vec<Holder>>,
    /// the list of each training and inference class
    src: Map<AlikeKey, u32>,
    dst: Map<AlikeKey, u32>,
    /// per pair of lists: their structure's slot and what the rank emitted for them
    pairs: Map<(u32, u32), PairEntry>,
}

impl Classes {
    /// Keeps a list, registered by `at` under its number.
    fn keep(&mut self, v: Vec<Holder>, at: impl FnOnce(&mut Self, u32) -> Option<u32>) -> u32 {
        let i = self.lists.len() as u32;
        self.lists.push(v);
        at(self, i);
        i
    }
}

/// A pair of kept lists' structure: its cache slot while the slot holds it (`stamp`), and what
/// the rank emitted for the pair.
struct PairEntry {
    slot: u32,
    stamp: u64,
    emission: Option<Box<Emission>>,
}

impl Scratch {
    /// Room for the ends of `tensors` tensors' transfers (mostly one each), so that the table
    /// is not copied while it grows.
    pub(super) fn reserve_ends(&mut self, tensors: usize) {
        self.ends.ends.reserve(tensors);
        self.ends.groups.reserve(tensors);
    }

    /// The table of ends of every transfer emitted, and the group of each.
    pub(super) fn take_ends(&mut self) -> (Vec<Ends>, Vec<u32>) {
        (
            std::mem::take(&mut self.ends.ends),
            std::mem::take(&mut self.ends.groups),
        )
    }
}

/// Structures kept for tensors laid out alike. The tensors of a layer interleave many layouts
/// (a hybrid layer's linear attention, attention, norms, router and shared expert take about 20,
/// and every expert held by another training rank is one more), and a structure is reused by
/// the next layer's tensors: the large ones (a norm cut into every FSDP shard, for every
/// inference rank) must not be pushed out by the small ones between them.
const CACHED: usize = 4096;

/// One tensor's structure (see [`structure`]) and the holders it was built from.
#[derive(Default)]
struct Saved {
    /// which structure it holds (a slot given to a new one gets a new stamp)
    stamp: u64,
    src: Vec<Holder>,
    dst: Vec<Holder>,
    ranks: Vec<RankId>,
    region_boxes: Vec<Region>,
    region_ranges: Vec<(u32, u32)>,
    region_cands: Vec<(u32, Cand)>,
    flat: Vec<Cand>,
    sets: Vec<((u32, u32), (u32, u32))>,
    set_keys: Vec<u32>,
    pieces: Vec<Piece>,
    order: Vec<u32>,
    turn_taking: Vec<Option<(u32, u32)>>,
    searched: Vec<u32>,
    mine: Vec<u32>,
}

/// Exchanges the structure buffers of the scratch with a saved structure's.
fn swap_structure(s: &mut Scratch, k: &mut Saved) {
    use std::mem::swap;
    swap(&mut s.ranks, &mut k.ranks);
    swap(&mut s.region_boxes, &mut k.region_boxes);
    swap(&mut s.region_ranges, &mut k.region_ranges);
    swap(&mut s.region_cands, &mut k.region_cands);
    swap(&mut s.flat, &mut k.flat);
    swap(&mut s.sets, &mut k.sets);
    swap(&mut s.set_keys, &mut k.set_keys);
    swap(&mut s.pieces, &mut k.pieces);
    swap(&mut s.order, &mut k.order);
    swap(&mut s.turn_taking, &mut k.turn_taking);
    swap(&mut s.searched, &mut k.searched);
    swap(&mut s.mine, &mut k.mine);
}

/// A candidate set whose pieces take its candidates in turn, in (tie, position) order.
#[derive(Clone, Copy)]
struct Turns {
    /// the set's range in the flat candidate list
    cands: (u32, u32),
    /// start of its (tie, position) keys in `Scratch::rr` (`u32::MAX`: not made yet)
    keys: u32,
    /// whether those keys are sorted (else only one turn has been looked up in them)
    sorted: bool,
}

/// Source universes whose ranks are all below this find each rank's index in a table.
const DENSE_MAX: u32 = 1 << 16;

/// A destination box meeting more source regions than this finds each cell's regions through
/// an index along dim 0 instead of testing them all.
const INDEX_MIN: usize = 16;

/// Candidate sets up to this size are searched linearly instead of through a heap.
const LINEAR_MAX: u32 = 32;

/// A candidate source: (index into the rank universe, index into the source holders).
#[derive(Clone, Copy)]
struct Cand {
    rank: u32,
    holder: u32,
}

struct Piece {
    dst_rank: RankId,
    dst_holder: u32,
    cell: Region,
    bytes: u64,
    /// range into the flat candidate list
    cands: (u32, u32),
    /// index of that candidate set (one heap each)
    set: u32,
    /// position of the chosen candidate in the flat list, or, in a set that takes its
    /// candidates in turn, the piece's turn (dealt once per structure: it depends on nothing
    /// else)
    chosen: u32,
}

/// The tie-break of source rank `r` in tensor `id`.
fn tie(id: u32, r: RankId) -> u64 {
    splitmix(((id as u64) << 32) ^ ((r.engine as u64) << 24) ^ r.rank as u64)
}

fn holder_key(h: &Holder) -> (Region, &str, Dims) {
    (h.region, &h.tensor, h.local_offset)
}

/// Offset in the local tensor of `cell`, given where the holder's region sits (in a holder
/// that holds its box transposed, the cell's offset in the last two box dims moves along the
/// swapped local dims: the offset of the transposed cell).
fn local_at(h: &Holder, cell: &Region) -> Dims {
    let mut off = h.local_offset;
    let n = off.ndim();
    let k = cell.ndim();
    for d in 0..k {
        let l = if h.transposed && d + 2 >= k {
            2 * k - 3 - d
        } else {
            d
        };
        let v = off.get(n - k + l) + cell.offset.get(d) - h.region.offset.get(d);
        off.set(n - k + l, v);
    }
    off
}

/// A tensor's alike classes on the training and the inference side.
pub(super) type Alikes = (Option<Alike>, Option<Alike>);

/// A tensor's alike classes ([`crate::layout::SideLayout::alike`]), as [`assign_tensor`] takes
/// them: sides that lay the tensor out like earlier ones (FSDP: hundreds of holders per tensor)
/// build the holders of each class once: the training side's class, and with it the inference
/// side's.
pub(super) fn alikes(pair: &Pair<'_>, name: &str) -> Alikes {
    let alike = pair.training.alike(name);
    let dst = alike.as_ref().and_then(|_| pair.inference.alike(name));
    (alike, dst)
}

/// Computes the assignment of one canonical tensor (its classes `alikes` of [`alikes`]) and
/// emits the transfers that involve `me`.
#[inline(never)]
pub(super) fn assign_tensor(
    pair: &Pair<'_>,
    id: u32,
    c: &CanonicalTensor,
    (side, me): (Side, RankId),
    (alike, dst_alike): Alikes,
    s: &mut Scratch,
    out: &mut super::Out,
) -> Result<(), PlanError> {
    s.ends.recent.clear();
    let transposed = |h: &Holder, reason: &str| PlanError::Transposed {
        canonical: c.name.clone(),
        tensor: h.tensor.to_string(),
        reason: reason.into(),
    };
    let build_src = |src: &mut Vec<Holder>| {
        pair.training.holders_into(&c.name, src);
        sort_holders(src);
        match src.iter().find(|h| h.transposed) {
            Some(h) => Err(transposed(
                h,
                "it is a training tensor; only an inference tensor may hold a box transposed",
            )),
            None => Ok(()),
        }
    };
    let build_dst = |dst: &mut Vec<Holder>| {
        pair.inference.holders_into(&c.name, dst);
        // backends usually answer in order already; sort only when they do not
        sort_holders(dst);
        // FP8 destinations receive the canonical dtype into their staging (the receiver
        // quantises)
        let encodes = fp8_destinations(pair, c, dst)?;
        if let Some(e) = &encodes
            && let Some(h) = dst.iter().zip(e).find(|(h, e)| h.transposed && e.is_some())
        {
            return Err(transposed(
                h.0,
                "it is FP8: transposed boxes go into plain (bf16/fp32) tensors only",
            ));
        }
        Ok(encodes)
    };
    // each side's holders: its class's kept list, else this tensor's own
    let src_list = match &alike {
        Some(a) => Some(match s.classes.src.get(&a.key) {
            Some(&i) => i,
            None => {
                let mut v = Vec::new();
                build_src(&mut v)?;
                s.classes.keep(v, |c, i| c.src.insert(a.key, i))
            }
        }),
        None => None,
    };
    let dst_list = match &dst_alike {
        Some(b) => match s.classes.dst.get(&b.key) {
            Some(&i) => Some(i),
            None => {
                let mut v = Vec::new();
                // (a class with an FP8 destination is not kept: its tensors build their own)
                build_dst(&mut v)?
                    .is_none()
                    .then(|| s.classes.keep(v, |c, i| c.dst.insert(b.key, i)))
            }
        },
        None => None,
    };
    let mut src = match src_list {
        Some(i) => std::mem::take(&mut s.classes.lists[i as usize]),
        None => {
            let mut v = std::mem::take(&mut s.spare_src);
            build_src(&mut v)?;
            v
        }
    };
    let mut encodes = None;
    let mut dst = match dst_list {
        Some(i) => std::mem::take(&mut s.classes.lists[i as usize]),
        None => {
            let mut v = std::mem::take(&mut s.spare_dst);
            encodes = build_dst(&mut v)?;
            v
        }
    };
    let held = Held {
        src: &src,
        dst: &dst,
        encodes: encodes.as_deref(),
        lists: (src_list, dst_list),
        names: (
            alike.as_ref().map(|a| &a.tensor),
            dst_alike.as_ref().map(|b| &b.tensor),
        ),
    };
    let result = assign_holders(pair, id, c, (side, me), s, out, held);
    // the lists go back where they came from; a structure made from this tensor's own lists
    // keeps them (the slot's old ones are the next tensor's)
    let made = result?;
    if let Some(saved) = made {
        let k = &mut s.cache[saved];
        match src_list {
            Some(_) => k.src.clone_from(&src),
            None => src = std::mem::replace(&mut k.src, src),
        }
        match dst_list {
            Some(_) => k.dst.clone_from(&dst),
            None => dst = std::mem::replace(&mut k.dst, dst),
        }
    }
    match src_list {
        Some(i) => s.classes.lists[i as usize] = src,
        None => s.spare_src = src,
    }
    match dst_list {
        Some(i) => s.classes.lists[i as usize] = dst,
        None => s.spare_dst = dst,
    }
    Ok(())
}

/// A tensor's holders on both sides, as [`assign_holders`] takes them.
struct Held<'a> {
    src: &'a [Holder],
    dst: &'a [Holder],
    /// the FP8 encoding of each destination holder, if any is FP8
    encodes: Option<&'a [Option<Encode>]>,
    /// the kept lists ([`Classes`]) the holders are, if they are
    lists: (Option<u32>, Option<u32>),
    /// the local tensor each side's [`crate::layout::Alike`] class names, if it gave one
    names: (Option<&'a Arc<str>>, Option<&'a Arc<str>>),
}

/// [`assign_tensor`] with the tensor's holders: returns the cache slot of a structure it made
/// from these holders, whose own lists the caller sets.
fn assign_holders(
    pair: &Pair<'_>,
    id: u32,
    c: &CanonicalTensor,
    (side, me): (Side, RankId),
    s: &mut Scratch,
    out: &mut super::Out,
    held: Held<'_>,
) -> Result<Option<usize>, PlanError> {
    let Held {
        src,
        dst,
        encodes,
        lists,
        names,
    } = held;
    // a pair of kept lists finds its structure directly while that slot holds it; any other
    // pair of holders by a digest, then by comparing them
    let kept = lists.0.zip(lists.1);
    // what the rank emitted for this pair of kept lists, while its structure is kept, is
    // emitted again with this tensor's names (an entry whose structure is gone has none)
    if let (Some(k), (Some(sname), Some(dname))) = (kept, names)
        && let Some(e) = s.classes.pairs.get(&k)
        && s.cache[e.slot as usize].stamp == e.stamp
        && let Some(em) = &e.emission
    {
        let base = s.ends.ends.len() as u32;
        for e in &em.ends {
            s.ends.push(Ends {
                src_tensor: sname.clone(),
                src_shape: e.src_shape,
                src_dtype: e.src_dtype,
                dst_tensor: dname.clone(),
                dst_shape: e.dst_shape,
                dst_dtype: e.dst_dtype,
                encode: e.encode.clone(),
                transposed: e.transposed,
            });
        }
        for it in &em.items {
            let mut it = *it;
            (it.ends, it.canonical) = (base + it.ends, id);
            out.push(it);
        }
        return Ok(None);
    }
    let mut hit = kept
        .and_then(|k| s.classes.pairs.get(&k))
        .filter(|e| s.cache[e.slot as usize].stamp == e.stamp)
        .map(|e| e.slot as usize);
    // (only a structure found or made by its holders needs their digest)
    let key = if hit.is_none() {
        holders_key(src, dst)
    } else {
        0
    };
    if hit.is_none() {
        hit = s.by_key.get(&key).and_then(|slots| {
            slots.iter().map(|&i| i as usize).find(|&i| {
                let k = &s.cache[i];
                same_holders(&k.src, src) && same_holders(&k.dst, dst)
            })
        });
    }
    let slot = match hit {
        Some(i) => i,
        None => {
            structure(c, src, dst, side, me, s)?;
            if s.cache.len() < CACHED {
                s.cache.push(Saved::default());
                s.keys.push(0);
                s.cache.len() - 1
            } else {
                s.victim = (s.victim + 1) % CACHED;
                let old = s.keys[s.victim];
                if let Some(slots) = s.by_key.get_mut(&old) {
                    slots.retain(|&i| i as usize != s.victim);
                }
                s.victim
            }
        }
    };
    let mut saved = std::mem::take(&mut s.cache[slot]);
    if hit.is_none() {
        s.stamps += 1;
        saved.stamp = s.stamps;
    }
    // what the rank emitted for this pair of kept lists, if anything (kept lists have no FP8
    // destination)
    let entry = kept.inspect(|&k| {
        let e = s.classes.pairs.entry(k).or_insert(PairEntry {
            slot: slot as u32,
            stamp: saved.stamp,
            emission: None,
        });
        if e.stamp != saved.stamp || e.slot != slot as u32 {
            *e = PairEntry {
                slot: slot as u32,
                stamp: saved.stamp,
                emission: None,
            };
        }
    });
    if hit.is_some() {
        swap_structure(s, &mut saved);
    }
    // what this tensor emits is kept for the next ones of its pair of kept lists when what it
    // emits depends on them only
    let mut record = (entry.is_some()
        && names.0.is_some()
        && names.1.is_some()
        && s.mine.iter().all(|&pi| {
            let c = s.pieces[pi as usize].cands;
            c.1 - c.0 == 1
        }))
    .then(|| Emission {
        ends: Vec::new(),
        items: Vec::new(),
    });
    let mut no_wide = Vec::new();
    let ends_base = s.ends.ends.len() as u32;
    // kept lists name the tensor of their class's first tensor: this one's names are its
    // classes'
    let (src_holders, dst_holders) = (src, dst);
    let (src_name, dst_name) = (
        names.0.filter(|_| lists.0.is_some()),
        names.1.filter(|_| lists.1.is_some()),
    );
    let flat = &s.flat;
    let sets = &s.sets;

    // A set whose pieces are all of one size and whose candidates are ranks that no other
    // candidate position of this tensor names starts with every load at 0 and only its own
    // pieces change them: the greedy then takes its candidates in turn, in (tie, position)
    // order. Such sets skip the search; since no other set reads their candidates' loads, the
    // loads are not kept, and the order is sorted only once a piece of the set is emitted.
    // (which sets qualify depends on the structure only: see `turn_taking`)
    s.rr_sets.clear();
    s.rr.clear();
    s.rr_sets.extend(s.turn_taking.iter().map(|t| {
        t.map(|cands| Turns {
            cands,
            keys: u32::MAX,
            sorted: false,
        })
    }));
    // loads, and a per-tensor tie-break, for the sets that search
    if !s.searched.is_empty() {
        s.loads.clear();
        s.loads.resize(s.ranks.len(), 0);
        s.ties.clear();
        s.ties.extend(s.ranks.iter().map(|&r| tie(id, r)));
    }
    // small sets: the same minimum of (load, tie, position), found by a scan
    for h in s.heaps.iter_mut().take(sets.len()) {
        h.clear();
    }
    if s.heaps.len() < sets.len() {
        s.heaps.resize_with(sets.len(), BinaryHeap::new);
    }
    // (the pieces of turn-taking sets hold their turns already)
    for &pi in &s.searched {
        let p = &mut s.pieces[pi as usize];
        if p.cands.1 - p.cands.0 <= LINEAR_MAX {
            let mut best = p.cands.0;
            let mut key = (u64::MAX, u64::MAX);
            for pos in p.cands.0..p.cands.1 {
                let r = flat[pos as usize].rank as usize;
                let k = (s.loads[r], s.ties[r]);
                if k < key {
                    key = k;
                    best = pos;
                }
            }
            p.chosen = best;
            let r = flat[best as usize].rank as usize;
            s.loads[r] += p.bytes;
            continue;
        }
        let heap = &mut s.heaps[p.set as usize];
        if heap.is_empty() {
            for pos in p.cands.0..p.cands.1 {
                let r = flat[pos as usize].rank as usize;
                heap.push(Reverse((s.loads[r], s.ties[r], pos)));
            }
        }
        // entries are refreshed in place at the top (one sift down instead of a pop and a push)
        let best = loop {
            let Some(mut top) = heap.peek_mut() else {
                let r = flat[p.cands.0 as usize].rank as usize;
                s.loads[r] += p.bytes;
                heap.push(Reverse((s.loads[r], s.ties[r], p.cands.0)));
                break p.cands.0;
            };
            let Reverse((load, _, pos)) = *top;
            let r = flat[pos as usize].rank as usize;
            if load == s.loads[r] {
                s.loads[r] += p.bytes;
                top.0.0 = s.loads[r];
                break pos;
            }
            top.0.0 = s.loads[r];
        };
        p.chosen = best;
    }

    // emit the pieces that involve this rank (only those that may are looked at)
    for &pi in &s.mine {
        let p = &s.pieces[pi as usize];
        // a turn-taking set's piece holds its turn; any other piece its candidate's position
        let chosen = match &mut s.rr_sets[p.set as usize] {
            // one candidate: its only turn
            Some(t) if t.cands.1 - t.cands.0 == 1 => t.cands.0,
            Some(t) => {
                // positions differ, so the keys are distinct: the turn-th smallest is one key
                let turn = p.chosen as usize;
                if t.keys == u32::MAX {
                    // first lookup (often the only one, on the inference side): a selection
                    t.keys = s.rr.len() as u32;
                    let ranks = &s.ranks;
                    s.rr.extend(
                        (t.cands.0..t.cands.1)
                            .map(|pos| (tie(id, ranks[flat[pos as usize].rank as usize]), pos)),
                    );
                    let keys = &mut s.rr[t.keys as usize..];
                    keys.select_nth_unstable(turn);
                    keys[turn].1
                } else {
                    let keys =
                        &mut s.rr[t.keys as usize..(t.keys + t.cands.1 - t.cands.0) as usize];
                    if !t.sorted {
                        keys.sort_unstable();
                        t.sorted = true;
                    }
                    keys[turn].1
                }
            }
            None => p.chosen,
        };
        let cand = flat[chosen as usize];
        let src_rank = s.ranks[cand.rank as usize];
        let mine = match side {
            Side::Training => src_rank == me,
            Side::Inference => p.dst_rank == me,
        };
        if !mine {
            continue;
        }
        let sh = &src_holders[cand.holder as usize];
        let sname = src_name.unwrap_or(&sh.tensor);
        let dh = &dst_holders[p.dst_holder as usize];
        let dname = dst_name.unwrap_or(&dh.tensor);
        let encode = encodes.and_then(|e| e[p.dst_holder as usize].clone());
        let ends = &mut s.ends;
        let record = &mut record;
        let mut send = |cell: &Region, encode: Option<Encode>| {
            let dst_dtype = match &encode {
                Some(e) if e.at == EncodeAt::Sender => DType::F8E4m3,
                _ => dh.dtype,
            };
            let made = ends.ends.len();
            let at = ends.of((sname, sh), (dname, dh), dst_dtype, &encode);
            let boxes = Boxes {
                src_offset: local_at(sh, cell),
                dst_offset: local_at(dh, cell),
                extent: cell.extent,
            };
            let peer = out.peer_number(src_rank, p.dst_rank);
            if let Some(r) = record {
                if ends.ends.len() > made {
                    r.ends.push(ends.ends[at as usize].clone());
                }
                let it = Item::new(at - ends_base, id, peer, &boxes, &mut no_wide);
                if no_wide.is_empty() {
                    r.items.push(it);
                } else {
                    *record = None;
                }
            }
            out.emit(peer, at, id, &boxes);
        };
        match encode {
            // the whole blocks of the box are quantised by its sender, the cut ones (at the
            // box's edges) by the receiver; the sender quantises its own elements, so only
            // where it holds the canonical dtype (which the receiver's staging holds)
            Some(e) if pair.encode_on_sender && sh.dtype == dh.dtype => {
                let parts = split_whole_blocks(
                    e.encoding.block,
                    &dh.tensor_shape,
                    &local_at(dh, &p.cell),
                    &p.cell,
                );
                for (cell, whole) in parts.iter().flatten() {
                    let at = if *whole {
                        EncodeAt::Sender
                    } else {
                        EncodeAt::Receiver
                    };
                    send(
                        cell,
                        Some(Encode {
                            encoding: e.encoding.clone(),
                            at,
                        }),
                    );
                }
            }
            encode => send(&p.cell, encode),
        }
    }
    // the structure goes (back) into its slot; the scratch keeps the slot's old buffers
    swap_structure(s, &mut saved);
    if let (Some(r), Some(k)) = (record, entry) {
        if let Some(e) = s.classes.pairs.get_mut(&k) {
            e.emission = Some(Box::new(r));
        }
    }
    if hit.is_none() {
        s.keys[slot] = key;
        s.by_key.entry(key).or_default().push(slot as u32);
    }
    s.cache[slot] = saved;
    Ok(hit.is_none().then_some(slot))
}

/// Splits `cell` (a box of a canonical tensor, at `dst_offset` in an FP8 destination tensor of
/// `dst_shape`) into the part covering whole blocks of the destination (`true`) and the parts
/// around it (`false`), at most 3 x 3 boxes in row-major order. In each of the two trailing
/// dims the whole-block part starts on the first block boundary in the box and ends on the
/// last one, or at the tensor's edge when the box reaches it. A box holding no whole block is
/// returned as it is (`false`).
fn split_whole_blocks(
    block: [u32; 2],
    dst_shape: &Dims,
    dst_offset: &Dims,
    cell: &Region,
) -> [Option<(Region, bool)>; 9] {
    let mut out = [None; 9];
    let (n, k) = (dst_shape.ndim(), cell.extent.ndim());
    if n < 2 || k < 2 || k > n {
        out[0] = Some((*cell, false));
        return out;
    }
    // per trailing dim: the segment bounds [o, a) [a, z) [z, o + e), in destination coordinates
    let mut segs = [[0u64; 4]; 2];
    for (i, (&bl, seg)) in block.iter().zip(segs.iter_mut()).enumerate() {
        let b = bl as u64;
        let (o, e, edge) = (
            dst_offset.get(n - 2 + i),
            cell.extent.get(k - 2 + i),
            dst_shape.get(n - 2 + i),
        );
        let end = o + e;
        let a = o.next_multiple_of(b).min(end);
        let z = if end == edge { end } else { end / b * b };
        if z <= a {
            out[0] = Some((*cell, false));
            return out;
        }
        *seg = [o, a, z, end];
    }
    let mut at = 0;
    for r in 0..3 {
        for c in 0..3 {
            let (r0, r1) = (segs[0][r], segs[0][r + 1]);
            let (c0, c1) = (segs[1][c], segs[1][c + 1]);
            if r1 == r0 || c1 == c0 {
                continue;
            }
            let mut sub = *cell;
            sub.offset
                .set(k - 2, cell.offset.get(k - 2) + (r0 - segs[0][0]));
            sub.offset
                .set(k - 1, cell.offset.get(k - 1) + (c0 - segs[1][0]));
            sub.extent.set(k - 2, r1 - r0);
            sub.extent.set(k - 1, c1 - c0);
            out[at] = Some((sub, r == 1 && c == 1));
            at += 1;
        }
    }
    out
}

/// For a tensor some of whose destination holders are FP8 (`f8e4m3`): each holder's
/// [`Encode`] (receiver-encoded; a transfer covering whole blocks becomes sender-encoded where
/// it is emitted), with its dtype turned into the canonical dtype the transfers deliver into
/// the staging. `None` (and nothing changed) when no destination is FP8.
fn fp8_destinations(
    pair: &Pair<'_>,
    c: &CanonicalTensor,
    dst: &mut [Holder],
) -> Result<Option<Vec<Option<Encode>>>, PlanError> {
    if !dst.iter().any(|h| h.dtype == DType::F8E4m3) {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(dst.len());
    for h in dst.iter_mut() {
        if h.dtype != DType::F8E4m3 {
            out.push(None);
            continue;
        }
        let err = |reason: String| PlanError::Encoding {
            canonical: c.name.clone(),
            tensor: h.tensor.to_string(),
            reason,
        };
        let Some(Encoding::Fp8Block(b)) = pair.inference.tensor_encoding(&h.tensor) else {
            return Err(err("its side gives no FP8 block encoding for it".into()));
        };
        if !matches!(c.dtype, DType::Bf16 | DType::F32) {
            return Err(err(format!(
                "the canonical tensor is {}, and awex quantises bf16 or f32",
                c.dtype
            )));
        }
        h.dtype = c.dtype;
        out.push(Some(Encode {
            encoding: b,
            at: EncodeAt::Receiver,
        }));
    }
    Ok(Some(out))
}

/// Sorts holders by (box, local tensor, offset), and each one's ranks, where a layout did not.
fn sort_holders(hs: &mut [Holder]) {
    if !hs.is_sorted_by(|a, b| holder_key(a) <= holder_key(b)) {
        hs.sort_by(|a, b| holder_key(a).cmp(&holder_key(b)));
    }
    for h in hs.iter_mut() {
        if !h.ranks.is_sorted() {
            h.ranks.sort_unstable();
        }
    }
}

/// A digest of part of what [`same_holders`] compares (the number of holders; the box, dtype
/// and rank list ends of the first and last holder): equal holders have equal keys, so most
/// cached structures are passed over without comparing their holders.
fn holders_key(src: &[Holder], dst: &[Holder]) -> u64 {
    let mut k = 0u64;
    let mut mix = |x: u64| k = (k ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    for list in [src, dst] {
        mix(list.len() as u64);
        for h in list.first().into_iter().chain(list.last()) {
            mix(h.dtype as u64);
            let (o, e) = (h.region.offset.as_slice(), h.region.extent.as_slice());
            for d in o.iter().chain(e) {
                mix(*d);
            }
            mix(h.ranks.len() as u64);
            for r in h.ranks.first().into_iter().chain(h.ranks.last()) {
                mix((u64::from(r.engine) << 32) | u64::from(r.rank));
            }
        }
    }
    k
}

/// Whether two holder lists hold the same boxes in the same dtypes on the same ranks (the local
/// tensors, where the boxes sit in them, may differ: only the emitted transfers use those).
fn same_holders(a: &[Holder], b: &[Holder]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.region == y.region && x.dtype == y.dtype && x.ranks == y.ranks)
}

/// Regions sorted by where they start along dim 0, with the furthest dim-0 end reached so far:
/// the regions holding a box are found among those that start at or before it and end at or
/// after it along dim 0, and only those are tested whole.
#[derive(Default)]
struct Dim0Index {
    /// (dim-0 start, dim-0 end, region), sorted
    by0: Vec<(u64, u64, u32)>,
    /// the furthest dim-0 end among `by0[..=j]`
    max_end0: Vec<u64>,
}

impl Dim0Index {
    /// Indexes the regions `hit` (indices into `boxes`, of at least one dim).
    fn build(&mut self, boxes: &[Region], hit: &[usize]) {
        self.by0.clear();
        self.by0.extend(hit.iter().map(|&i| {
            let r = &boxes[i];
            let lo = r.offset.get(0);
            (lo, lo.saturating_add(r.extent.get(0)), i as u32)
        }));
        self.by0.sort_unstable();
        self.max_end0.clear();
        let mut m = 0;
        self.max_end0.extend(self.by0.iter().map(|e| {
            m = m.max(e.1);
            m
        }));
    }

    /// Appends to `out` the indexed regions that contain `cell` (of the regions' dims), in
    /// increasing order: those a scan of `hit` testing each with `contains` finds.
    fn holding(&self, boxes: &[Region], cell: &Region, out: &mut Vec<u32>) {
        let from = out.len();
        let (lo, end) = (
            cell.offset.get(0),
            cell.offset.get(0).saturating_add(cell.extent.get(0)),
        );
        // (a region whose end does not fit 64 bits contains nothing: `contains` decides)
        let upto = self.by0.partition_point(|e| e.0 <= lo);
        for j in (0..upto).rev() {
            if self.max_end0[j] < end {
                break;
            }
            let (_, e, i) = self.by0[j];
            if e >= end && boxes[i as usize].contains(cell) {
                out.push(i);
            }
        }
        out[from..].sort_unstable();
    }
}

/// Whether every source region has one candidate (`ranges`: each region's range of
/// candidates), no rank is the candidate of two, and the regions lie apart along dim 0 (sorted
/// into `spans`): then every element of the tensor has at most one candidate, named for no other.
fn sources_apart(
    boxes: &[Region],
    ranges: &[(u32, u32)],
    ranks: usize,
    spans: &mut Vec<(u64, u64)>,
) -> bool {
    if ranks != boxes.len() || ranges.iter().any(|&(a, b)| b - a != 1) {
        return false;
    }
    let Some(first) = boxes.first() else {
        return true;
    };
    let n = first.ndim();
    if n == 0 || boxes.iter().any(|r| r.ndim() != n) {
        return boxes.len() == 1 && n == 0;
    }
    spans.clear();
    spans.extend(boxes.iter().map(|r| {
        let lo = r.offset.get(0);
        (lo, lo.saturating_add(r.extent.get(0)))
    }));
    spans.sort_unstable();
    spans.windows(2).all(|w| w[0].1 <= w[1].0)
}

/// Whether the source regions `boxes` (apart: [`sources_apart`]) hold every element of a
/// non-empty destination box `want`, each one that meets it in a dtype that `converts(region)`
/// accepts: the parts they hold add up to the box.
fn other_box_holds(want: &Region, boxes: &[Region], converts: impl Fn(usize) -> bool) -> bool {
    let need = want.numel();
    let mut held = 0u64;
    for (i, r) in boxes.iter().enumerate() {
        let part = r.overlap_numel(want);
        if part > 0 {
            if !converts(i) {
                return false;
            }
            held = held.saturating_add(part);
        }
    }
    need > 0 && held == need
}

/// The source-rank universe, the candidate sets, the pieces and their order for one tensor's
/// holders (everything of the assignment that does not depend on the tensor's identity).
fn structure(
    c: &CanonicalTensor,
    src: &[Holder],
    dst: &[Holder],
    side: Side,
    me: RankId,
    s: &mut Scratch,
) -> Result<(), PlanError> {
    // the universe of source ranks
    s.ranks.clear();
    for h in src {
        s.ranks.extend_from_slice(&h.ranks);
    }
    if !s.ranks.is_sorted() {
        s.ranks.sort_unstable();
    }
    s.ranks.dedup();
    // ranks of one engine numbered below a bound find their index in a table, not by search
    let dense = match (s.ranks.first(), s.ranks.last()) {
        (Some(a), Some(b)) => a.engine == b.engine && b.rank < DENSE_MAX,
        _ => false,
    };
    if dense {
        let top = s.ranks.last().map_or(0, |r| r.rank as usize + 1);
        if s.slot.len() < top {
            s.slot.resize(top, 0);
        }
        for (i, r) in s.ranks.iter().enumerate() {
            s.slot[r.rank as usize] = i as u32;
        }
    }

    // distinct source regions, each with its candidates (in holder order); the holders are
    // sorted by region ([`sort_holders`]), so a region equal to an earlier one is the last one
    debug_assert!(src.is_sorted_by(|a, b| holder_key(a) <= holder_key(b)));
    s.region_boxes.clear();
    s.region_cands.clear();
    for (hi, h) in src.iter().enumerate() {
        let pos = match s.region_boxes.last() {
            Some(r) if *r == h.region => s.region_boxes.len() - 1,
            _ => {
                s.region_boxes.push(h.region);
                s.region_boxes.len() - 1
            }
        };
        for r in &h.ranks {
            let ri = match dense {
                true => s.slot[r.rank as usize],
                false => s.ranks.binary_search(r).unwrap_or(0) as u32,
            };
            s.region_cands.push((
                pos as u32,
                Cand {
                    rank: ri,
                    holder: hi as u32,
                },
            ));
        }
    }
    // stable: each region's candidates keep their order
    if !s.region_cands.is_sorted_by_key(|c| c.0) {
        s.region_cands.sort_by_key(|c| c.0);
    }
    s.region_ranges.clear();
    s.region_ranges.resize(s.region_boxes.len(), (0, 0));
    {
        let mut at = 0usize;
        for (i, range) in s.region_ranges.iter_mut().enumerate() {
            let start = at;
            while at < s.region_cands.len() && s.region_cands[at].0 as usize == i {
                at += 1;
            }
            *range = (start as u32, at as u32);
        }
    }
    let region_boxes = &s.region_boxes;
    let region_ranges = &s.region_ranges;
    let region_cands = &s.region_cands;
    // Sources that each hold a region of their own, apart from the others (an FSDP tensor's
    // shards): every cell then has one candidate that no other cell names, so every piece goes
    // to it whatever the other pieces are, and only the destination boxes that may involve the
    // planning rank are cut into cells: on the inference side its own, on the training side
    // those that meet its region (any other box is checked whole: covered, and convertible; one
    // that is not is cut, to name what fails as before)
    let apart = sources_apart(region_boxes, region_ranges, s.ranks.len(), &mut s.spans);
    let my_region = match side {
        Side::Training if apart => s.ranks.binary_search(&me).ok().and_then(|mi| {
            let at = region_cands.iter().position(|c| c.1.rank as usize == mi)?;
            Some(region_boxes[region_cands[at].0 as usize])
        }),
        _ => None,
    };
    let may_involve_me = |dh: &Holder| match side {
        Side::Inference => dh.ranks.binary_search(&me).is_ok(),
        Side::Training => my_region.is_some_and(|r| r.overlap_numel(&dh.region) > 0),
    };

    // cut every destination box into cells held by one set of source candidates
    s.pieces.clear();
    let flat = &mut s.flat;
    flat.clear();
    // candidate sets seen in this tensor (by the source regions they come from) -> range in `flat`
    let sets = &mut s.sets;
    sets.clear();
    let set_keys = &mut s.set_keys;
    set_keys.clear();
    let cells = &mut s.cells;
    let hit = &mut s.hit;
    let set = &mut s.set;
    // the set of each single source region, once made (u32::MAX: not yet); the sets of more
    // than one region, looked for among themselves (every set is made once, so the set found
    // is the one a search of all sets finds)
    let single_set = &mut s.single_set;
    single_set.clear();
    single_set.resize(region_boxes.len(), u32::MAX);
    let multi_sets = &mut s.multi_sets;
    multi_sets.clear();
    let by0 = &mut s.by0;
    s.all_cells.clear();
    for (dhi, dh) in dst.iter().enumerate() {
        let want = dh.region;
        if apart
            && !may_involve_me(dh)
            && other_box_holds(&want, region_boxes, |i| {
                let holder = region_cands[region_ranges[i].0 as usize].1.holder;
                src[holder as usize].dtype.converts_to(dh.dtype)
            })
        {
            continue;
        }
        cells.clear();
        hit.clear();
        hit.extend(
            region_boxes
                .iter()
                .enumerate()
                .filter(|(_, r)| r.overlap_numel(&want) > 0)
                .map(|(i, _)| i),
        );
        let hit = &*hit;
        // Many regions (an FSDP tensor's shards, one per rank): a cell's regions are found
        // through an index along dim 0 instead of testing every region.
        let indexed = hit.len() > INDEX_MIN && want.ndim() > 0;
        if indexed {
            by0.build(region_boxes, hit);
        }
        let by0 = &*by0;
        let mut push_cell = |cell: Region, flat: &mut Vec<Cand>| -> Result<(), PlanError> {
            set.clear();
            if indexed {
                by0.holding(region_boxes, &cell, set);
            } else {
                set.extend(
                    hit.iter()
                        .filter(|&&i| region_boxes[i].contains(&cell))
                        .map(|&i| i as u32),
                );
            }
            if set.is_empty() {
                return Err(PlanError::Uncovered {
                    canonical: c.name.clone(),
                    region: cell.to_string(),
                    dst: dh.ranks.first().copied().unwrap_or(RankId::infer(0, 0)),
                });
            }
            let found = match set[..] {
                [one] => Some(single_set[one as usize]).filter(|&k| k != u32::MAX),
                _ => multi_sets.iter().copied().find(|&k| {
                    let (a, b) = sets[k as usize].0;
                    set_keys[a as usize..b as usize] == set[..]
                }),
            };
            let index = match found {
                Some(i) => i,
                None => {
                    let start = flat.len() as u32;
                    for &i in set.iter() {
                        let (a, b) = region_ranges[i as usize];
                        flat.extend(region_cands[a as usize..b as usize].iter().map(|c| c.1));
                    }
                    let k0 = set_keys.len() as u32;
                    set_keys.extend_from_slice(set);
                    sets.push(((k0, set_keys.len() as u32), (start, flat.len() as u32)));
                    let k = sets.len() as u32 - 1;
                    match set[..] {
                        [one] => single_set[one as usize] = k,
                        _ => multi_sets.push(k),
                    }
                    k
                }
            };
            cells.push((cell, index));
            Ok(())
        };
        if hit.iter().any(|&i| region_boxes[i].contains(&want)) {
            // common case: one source region holds the whole destination box
            push_cell(want, flat)?;
        } else {
            let boxes: Vec<Region> = hit.iter().map(|&i| region_boxes[i]).collect();
            let mut err = None;
            crate::layout::ops::grid_cells(&want, &boxes, |cell| {
                if err.is_none()
                    && let Err(e) = push_cell(cell, flat)
                {
                    err = Some(e);
                }
            })
            .map_err(|e| PlanError::EmptyBox {
                canonical: c.name.clone(),
                region: want.to_string(),
                dim: e.dim,
            })?;
            if let Some(e) = err {
                return Err(e);
            }
        }
        for &(cell, set) in cells.iter() {
            let range = sets[set as usize].1;
            if let Some(cand) = flat[range.0 as usize..range.1 as usize]
                .iter()
                .find(|cand| !src[cand.holder as usize].dtype.converts_to(dh.dtype))
            {
                return Err(PlanError::DType {
                    canonical: c.name.clone(),
                    src: src[cand.holder as usize].dtype,
                    dst: dh.dtype,
                });
            }
            s.all_cells.push((dhi as u32, cell, set));
        }
    }

    // how many candidate positions of this tensor name each source rank
    let flat = &s.flat;
    s.occ.clear();
    s.occ.resize(s.ranks.len(), 0);
    for c in flat.iter() {
        s.occ[c.rank as usize] += 1;
    }
    // When every set is one candidate that no other set names (FSDP's shards, each on one
    // rank), every piece goes to its only candidate and no piece changes another's choice:
    // only the pieces that may involve `me` are made (in the order all would be), not those
    // of every other inference rank.
    let single = s
        .sets
        .iter()
        .all(|&(_, (a, b))| b - a == 1 && s.occ[flat[a as usize].rank as usize] == 1);
    let me_index = match side {
        Side::Training => s.ranks.binary_search(&me).ok(),
        Side::Inference => None,
    };
    let names_me = |set: u32| {
        let (a, b) = s.sets[set as usize].1;
        me_index.is_some_and(|mi| {
            flat[a as usize..b as usize]
                .iter()
                .any(|c| c.rank as usize == mi)
        })
    };
    for &(dhi, cell, set) in &s.all_cells {
        let dh = &dst[dhi as usize];
        if single && side == Side::Training && !names_me(set) {
            continue;
        }
        for &r in &dh.ranks {
            if single && side == Side::Inference && r != me {
                continue;
            }
            s.pieces.push(Piece {
                dst_rank: r,
                dst_holder: dhi,
                cell,
                bytes: cell.numel() * dh.dtype.size() as u64,
                cands: s.sets[set as usize].1,
                set,
                chosen: u32::MAX,
            });
        }
    }

    // greedy: largest pieces first, each to the least-loaded candidate (ties by a per-tensor
    // hash, then by position); one lazy min-heap per candidate set: loads only grow, so an entry
    // whose recorded load is current is a true minimum
    s.order.clear();
    s.order.extend(0..s.pieces.len() as u32);
    {
        let pieces = &s.pieces;
        let by_size = |a: &u32, b: &u32| {
            pieces[*b as usize]
                .bytes
                .cmp(&pieces[*a as usize].bytes)
                .then(a.cmp(b))
        };
        if !s.order.is_sorted_by(|a, b| by_size(a, b).is_le()) {
            s.order.sort_by(by_size);
        }
    }

    // A set whose pieces are all of one size and whose candidates are ranks that no other
    // candidate position of this tensor names takes its candidates in turn (see the greedy).
    let flat = &s.flat;
    s.set_bytes.clear();
    s.set_bytes.resize(s.sets.len(), u64::MAX - 1);
    for p in &s.pieces {
        let b = &mut s.set_bytes[p.set as usize];
        if *b == u64::MAX - 1 {
            *b = p.bytes;
        } else if *b != p.bytes {
            *b = u64::MAX;
        }
    }
    // (a set of one such candidate always takes it: FSDP's shards, each on one rank)
    s.turn_taking.clear();
    for (k, &(_, (a, b))) in s.sets.iter().enumerate() {
        let exclusive = flat[a as usize..b as usize]
            .iter()
            .all(|c| s.occ[c.rank as usize] == 1);
        let turns = exclusive && (b - a == 1 || (b - a > 1 && s.set_bytes[k] != u64::MAX));
        s.turn_taking.push(turns.then_some((a, b)));
    }
    // the pieces that may involve `me`: its own on the inference side; on the training side
    // those of the sets that name it
    s.mine.clear();
    match side {
        Side::Inference => s.mine.extend(
            s.pieces
                .iter()
                .enumerate()
                .filter(|(_, p)| p.dst_rank == me)
                .map(|(i, _)| i as u32),
        ),
        Side::Training => {
            if let Ok(mi) = s.ranks.binary_search(&me) {
                let named: Vec<bool> = s
                    .sets
                    .iter()
                    .map(|&(_, (a, b))| {
                        flat[a as usize..b as usize]
                            .iter()
                            .any(|c| c.rank as usize == mi)
                    })
                    .collect();
                s.mine.extend(
                    s.pieces
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| named[p.set as usize])
                        .map(|(i, _)| i as u32),
                );
            }
        }
    }
    // deal the turns: the i-th piece of a turn-taking set in greedy order takes turn i, modulo
    // the number of candidates; the other pieces search, in greedy order
    s.next_turn.clear();
    s.next_turn.resize(s.sets.len(), 0);
    s.searched.clear();
    for &pi in &s.order {
        let p = &mut s.pieces[pi as usize];
        match s.turn_taking[p.set as usize] {
            Some((a, b)) => {
                let next = &mut s.next_turn[p.set as usize];
                p.chosen = *next;
                *next += 1;
                if *next == b - a {
                    *next = 0;
                }
            }
            None => s.searched.push(pi),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Dim0Index, Region};
    use crate::weights::splitmix;

    /// The index finds exactly the regions a scan testing each with `contains` finds, in the
    /// scan's order: regions that overlap, nest, repeat a start, end at the 64-bit edge.
    #[test]
    fn dim0_index_finds_what_a_scan_finds() {
        let mut x = 7u64;
        let mut next = |m: u64| {
            x = splitmix(x);
            x % m
        };
        let mut index = Dim0Index::default();
        for round in 0..200 {
            let n = 1 + next(40) as usize;
            let mut boxes: Vec<Region> = (0..n)
                .map(|_| {
                    let (o0, o1) = (next(32), next(8));
                    Region::new([o0, o1], [1 + next(24), 1 + next(8)])
                })
                .collect();
            if round % 10 == 0 {
                boxes.push(Region::new([u64::MAX - 4, 0], [8, 8]));
            }
            // every other region met, as a destination box's hits are (increasing)
            let hit: Vec<usize> = (0..boxes.len()).filter(|i| (i + round) % 3 != 0).collect();
            if hit.is_empty() {
                continue;
            }
            index.build(&boxes, &hit);
            for c in 0..50 {
                let lo = if c % 10 == 0 {
                    u64::MAX - next(8)
                } else {
                    next(40)
                };
                let cell = Region::new([lo, next(10)], [1 + next(6), 1 + next(4)]);
                let want: Vec<u32> = hit
                    .iter()
                    .filter(|&&i| boxes[i].contains(&cell))
                    .map(|&i| i as u32)
                    .collect();
                let mut got = vec![u32::MAX];
                index.holding(&boxes, &cell, &mut got);
                assert_eq!(&got[1..], &want[..], "round {round}, cell {cell}");
            }
        }
    }
}
