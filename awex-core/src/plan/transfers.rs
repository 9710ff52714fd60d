//! [`Transfers`]: one peer's transfers, stored compactly.
//!
//! A rank of a large pair plans about 100,000 transfers (Qwen3.5-397B from FSDP2 at dp 256 into
//! SGLang at tp 16: 103,488 for one inference rank), most of them between local tensors whose
//! names, shapes, dtypes and encodings other transfers share: each transfer keeps only its
//! ranks (an index), its canonical tensor, the index of what it shares ([`Ends`], one table
//! for every peer of a plan) and its three boxes in 32-bit values, 52 bytes where a
//! [`Transfer`] takes 272. The [`Transfer`]s are made when they are first read as a slice and
//! kept (a transport reads them on every update); making a plan, its fingerprints and its
//! byte counts, and serialising it, reads the parts only.

use super::{Encode, Transfer};
use crate::dtype::DType;
use crate::layout::{Dims, RankId};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::HashMap;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

/// What the transfers between one pair of local tensors share: everything of a [`Transfer`]
/// but its ranks, its canonical tensor and its boxes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Ends {
    pub(super) src_tensor: Arc<str>,
    pub(super) src_shape: Dims,
    pub(super) src_dtype: DType,
    pub(super) dst_tensor: Arc<str>,
    pub(super) dst_shape: Dims,
    pub(super) dst_dtype: DType,
    pub(super) encode: Option<Encode>,
    pub(super) transposed: bool,
}

impl Ends {
    fn of(t: &Transfer) -> Ends {
        Ends {
            src_tensor: t.src_tensor.clone(),
            src_shape: t.src_shape,
            src_dtype: t.src_dtype,
            dst_tensor: t.dst_tensor.clone(),
            dst_shape: t.dst_shape,
            dst_dtype: t.dst_dtype,
            encode: t.encode.clone(),
            transposed: t.transposed,
        }
    }
}

/// One transfer: its ends, canonical tensor and rank pair by index, and its boxes as 32-bit
/// values, or (`wide`: a value past 32 bits, or more than 3 dims) the index of its boxes in
/// the [`Store`]'s table of boxes kept whole (in `src[0]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Item {
    /// index into the table of [`Ends`]
    pub(super) ends: u32,
    /// the transfer's `canonical`
    pub(super) canonical: u32,
    /// index into the (source, destination) rank pairs
    pub(super) pair: u32,
    /// the number of box dims
    pub(super) k: u8,
    /// the number of dims of the source and destination offsets
    ns: u8,
    nd: u8,
    wide: bool,
    src: [u32; NARROW],
    dst: [u32; NARROW],
    extent: [u32; NARROW],
}

/// The dims an item holds itself (local tensors have up to 3; a box of more is `wide`).
const NARROW: usize = 3;

/// A transfer's three boxes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Boxes {
    pub(super) src_offset: Dims,
    pub(super) dst_offset: Dims,
    pub(super) extent: Dims,
}

fn narrow(d: &Dims) -> Option<[u32; NARROW]> {
    if d.ndim() > NARROW {
        return None;
    }
    let mut v = [0u32; NARROW];
    for (o, &x) in v.iter_mut().zip(d.as_slice()) {
        *o = u32::try_from(x).ok()?;
    }
    Some(v)
}

fn widen(v: &[u32; NARROW], n: usize) -> Dims {
    let mut w = [0u64; NARROW];
    for (o, &x) in w.iter_mut().zip(v) {
        *o = x as u64;
    }
    Dims::new(&w[..n])
}

impl Item {
    /// An item of these boxes; boxes with a value of 2^32 or more go into `wide`.
    pub(super) fn new(
        ends: u32,
        canonical: u32,
        pair: u32,
        b: &Boxes,
        wide: &mut Vec<Boxes>,
    ) -> Item {
        let narrowed = (
            narrow(&b.src_offset),
            narrow(&b.dst_offset),
            narrow(&b.extent),
        );
        let mut it = Item {
            ends,
            canonical,
            pair,
            k: b.extent.ndim() as u8,
            ns: b.src_offset.ndim() as u8,
            nd: b.dst_offset.ndim() as u8,
            wide: false,
            src: [0; NARROW],
            dst: [0; NARROW],
            extent: [0; NARROW],
        };
        if let (Some(src), Some(dst), Some(extent)) = narrowed {
            (it.src, it.dst, it.extent) = (src, dst, extent);
        } else {
            it.wide = true;
            it.src[0] = wide.len() as u32;
            wide.push(*b);
        }
        it
    }

    /// Whether no item of `items` is wide and none would become wide merged with others: a
    /// merged extent is at most the sum of their extents along its dim.
    pub(super) fn stay_narrow(items: &[Item]) -> bool {
        let mut sum = [0u64; NARROW];
        for it in items {
            if it.wide {
                return false;
            }
            for (s, &e) in sum.iter_mut().zip(&it.extent[..it.k as usize]) {
                *s += u64::from(e);
            }
        }
        sum.iter().all(|&s| s <= u64::from(u32::MAX))
    }

    /// The item's boxes.
    #[inline]
    pub(super) fn boxes(&self, wide: &[Boxes]) -> Boxes {
        if self.wide {
            return wide[self.src[0] as usize];
        }
        Boxes {
            src_offset: widen(&self.src, self.ns as usize),
            dst_offset: widen(&self.dst, self.nd as usize),
            extent: widen(&self.extent, self.k as usize),
        }
    }

    /// The number of elements of the box.
    #[inline]
    pub(super) fn numel(&self, wide: &[Boxes]) -> u64 {
        if self.wide {
            return wide[self.src[0] as usize].extent.numel();
        }
        self.extent[..self.k as usize]
            .iter()
            .fold(1u64, |a, &b| a.saturating_mul(b as u64))
    }

    /// Sets box dim `d` of the extent (a merge), moving the boxes into `wide` if it does not
    /// fit 32 bits.
    pub(super) fn set_extent(&mut self, d: usize, v: u64, wide: &mut Vec<Boxes>) {
        if !self.wide
            && let Ok(x) = u32::try_from(v)
        {
            self.extent[d] = x;
            return;
        }
        let mut b = self.boxes(wide);
        b.extent.set(d, v);
        if self.wide {
            wide[self.src[0] as usize] = b;
        } else {
            *self = Item::new(self.ends, self.canonical, self.pair, &b, wide);
            debug_assert!(self.wide, "an extent past 32 bits is kept wide");
        }
    }
}

/// The parts of a plan's transfers, shared by its peers: the ends, the rank pairs and every
/// transfer's item (its boxes past 32 bits in `wide`).
#[derive(Clone, Debug, Default)]
pub(super) struct Store {
    pub(super) ends: Vec<Ends>,
    pub(super) pairs: Vec<(RankId, RankId)>,
    pub(super) items: Vec<Item>,
    pub(super) wide: Vec<Boxes>,
}

impl Store {
    /// The fingerprint bytes of `items` (this store's, or copies of them) appended to `h`, as
    /// [`Transfer::hash_bytes`] would write them, without making them (each transfer's ranks,
    /// its ends' digest from `sums`, made once for the store's ends, and its boxes), and their
    /// bytes on the wire.
    pub(super) fn hash_and_count<'a>(
        &self,
        items: impl ExactSizeIterator<Item = &'a Item>,
        sums: &EndsSums,
        h: &mut Vec<u8>,
    ) -> u64 {
        let st = self;
        let mut wire = 0u64;
        // one transfer's bytes, written at once: ranks, ends' digest, three dims' counts, boxes
        const HEAD: usize = 16 + 8 + 3;
        let mut rec = [0u8; HEAD + 8 * 3 * NARROW];
        h.reserve(items.len() * (HEAD + 8 * 2 * NARROW));
        for it in items {
            wire += st.bytes(it);
            let (src_rank, dst_rank) = st.pairs[it.pair as usize];
            for (at, x) in [
                src_rank.engine,
                src_rank.rank,
                dst_rank.engine,
                dst_rank.rank,
            ]
            .into_iter()
            .enumerate()
            {
                rec[4 * at..4 * at + 4].copy_from_slice(&x.to_le_bytes());
            }
            rec[16..24].copy_from_slice(&sums.0[it.ends as usize].to_le_bytes());
            if it.wide {
                let w = &st.wide[it.src[0] as usize];
                let boxes = [&w.src_offset, &w.dst_offset, &w.extent];
                for (c, d) in rec[24..HEAD].iter_mut().zip(boxes) {
                    *c = d.ndim() as u8;
                }
                h.extend_from_slice(&rec[..HEAD]);
                for d in boxes {
                    for &x in d.as_slice() {
                        h.extend_from_slice(&x.to_le_bytes());
                    }
                }
            } else {
                rec[24..HEAD].copy_from_slice(&[it.ns, it.nd, it.k]);
                let mut n = HEAD;
                for v in [
                    &it.src[..it.ns as usize],
                    &it.dst[..it.nd as usize],
                    &it.extent[..it.k as usize],
                ] {
                    for &x in v {
                        rec[n..n + 8].copy_from_slice(&(x as u64).to_le_bytes());
                        n += 8;
                    }
                }
                h.extend_from_slice(&rec[..n]);
            }
        }
        wire
    }

    /// Bytes on the wire of an item ([`Transfer::bytes`]) without making it.
    fn bytes(&self, it: &Item) -> u64 {
        let e = &self.ends[it.ends as usize];
        let b = it.numel(&self.wide) * e.dst_dtype.size() as u64;
        match &e.encode {
            // (only a sender-encoded transfer has scale bytes: the transfer says)
            Some(_) => b + self.make(it).scale_bytes(),
            None => b,
        }
    }

    fn make(&self, it: &Item) -> Transfer {
        let e = &self.ends[it.ends as usize];
        let (src_rank, dst_rank) = self.pairs[it.pair as usize];
        let b = it.boxes(&self.wide);
        Transfer {
            src_rank,
            dst_rank,
            canonical: it.canonical,
            src_tensor: e.src_tensor.clone(),
            src_shape: e.src_shape,
            src_offset: b.src_offset,
            src_dtype: e.src_dtype,
            dst_tensor: e.dst_tensor.clone(),
            dst_shape: e.dst_shape,
            dst_offset: b.dst_offset,
            dst_dtype: e.dst_dtype,
            extent: b.extent,
            encode: e.encode.clone(),
            transposed: e.transposed,
        }
    }
}

/// One peer's transfers, in the order both ends execute them, stored compactly (see the
/// module's documentation). Read as a slice (`&transfers[..]`, `for t in &transfers`), they are
/// made once, when first read, and kept; [`Transfers::transfer`] makes one without keeping
/// it. Serialised as the list of its transfers.
#[derive(Clone, Default)]
pub struct Transfers {
    store: Arc<Store>,
    /// the peer's items in the store, in order
    order: Vec<u32>,
    made: OnceLock<Vec<Transfer>>,
}

impl Transfers {
    /// The transfers of items `order` of `store` (shared with the plan's other peers).
    pub(super) fn from_parts(store: Arc<Store>, order: Vec<u32>) -> Transfers {
        Transfers {
            store,
            order,
            made: OnceLock::new(),
        }
    }

    /// The number of transfers.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Every transfer, made when first read and kept (for a reader that goes over them on
    /// every update: a transport).
    pub fn as_slice(&self) -> &[Transfer] {
        self.made.get_or_init(|| self.iter_owned().collect())
    }

    fn item(&self, i: usize) -> &Item {
        &self.store.items[self.order[i] as usize]
    }

    /// Every transfer in order, each made as it is read and none kept (for a reader that goes
    /// over them once).
    pub fn iter_owned(&self) -> impl ExactSizeIterator<Item = Transfer> + '_ {
        self.order
            .iter()
            .map(|&i| self.store.make(&self.store.items[i as usize]))
    }

    /// Transfer `i` made from its parts, not kept (panics past the end, as indexing does).
    pub fn transfer(&self, i: usize) -> Transfer {
        self.store.make(self.item(i))
    }

    /// Bytes on the wire of transfer `i` ([`Transfer::bytes`]) without making it.
    pub fn bytes_of(&self, i: usize) -> u64 {
        self.store.bytes(self.item(i))
    }

    /// Appends the bytes the fingerprint hashes of every transfer, in order, as
    /// [`Transfer::hash_bytes`] would, without making them: each transfer's bytes are its
    /// ranks, its ends' digest (`sums`, made once for the store's ends) and its boxes.
    #[cfg(test)]
    pub(super) fn hash_bytes(&self, sums: &EndsSums, h: &mut Vec<u8>) {
        let items = self.order.iter().map(|&i| &self.store.items[i as usize]);
        self.store.hash_and_count(items, sums, h);
    }
}

/// The digest of each ends of a store in its transfers' fingerprint bytes
/// ([`super::ends_digest`]).
pub(super) struct EndsSums(Vec<u64>);

impl EndsSums {
    #[cfg(test)]
    pub(super) fn of(ends: &[Ends]) -> EndsSums {
        EndsSums::on(ends, 1)
    }

    /// The digests of `ends`, on up to `threads` threads.
    pub(super) fn on(ends: &[Ends], threads: usize) -> EndsSums {
        let sums = super::in_groups(
            ends.chunks(1024).collect(),
            threads,
            |c| c.len(),
            || Vec::with_capacity(256),
            |h, c| {
                c.iter()
                    .map(|e| {
                        super::ends_digest(
                            h,
                            (&e.src_tensor, &e.src_shape, e.src_dtype),
                            (&e.dst_tensor, &e.dst_shape, e.dst_dtype),
                            e.transposed,
                            e.encode.as_ref(),
                        )
                    })
                    .collect::<Vec<u64>>()
            },
        );
        EndsSums(sums.concat())
    }
}

impl Deref for Transfers {
    type Target = [Transfer];

    /// The transfers as a slice: made when first read, then kept.
    fn deref(&self) -> &[Transfer] {
        self.as_slice()
    }
}

impl<'a> IntoIterator for &'a Transfers {
    type Item = &'a Transfer;
    type IntoIter = std::slice::Iter<'a, Transfer>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

impl FromIterator<Transfer> for Transfers {
    /// Any transfers, each kept as it is (ends shared where they are equal).
    fn from_iter<I: IntoIterator<Item = Transfer>>(ts: I) -> Transfers {
        Vec::from_iter(ts).into()
    }
}

impl From<Vec<Transfer>> for Transfers {
    fn from(ts: Vec<Transfer>) -> Transfers {
        let mut ends: Vec<Ends> = Vec::new();
        let mut pairs: Vec<(RankId, RankId)> = Vec::new();
        let mut ends_at: HashMap<Ends, u32> = HashMap::new();
        let mut pairs_at: HashMap<(RankId, RankId), u32> = HashMap::new();
        let mut items = Vec::with_capacity(ts.len());
        let mut wide = Vec::new();
        for t in &ts {
            let at = *ends_at.entry(Ends::of(t)).or_insert_with_key(|e| {
                ends.push(e.clone());
                ends.len() as u32 - 1
            });
            let pair = *pairs_at
                .entry((t.src_rank, t.dst_rank))
                .or_insert_with_key(|&p| {
                    pairs.push(p);
                    pairs.len() as u32 - 1
                });
            let b = Boxes {
                src_offset: t.src_offset,
                dst_offset: t.dst_offset,
                extent: t.extent,
            };
            items.push(Item::new(at, t.canonical, pair, &b, &mut wide));
        }
        Transfers {
            order: (0..items.len() as u32).collect(),
            store: Arc::new(Store {
                ends,
                pairs,
                items,
                wide,
            }),
            // (the transfers are at hand: kept as the slice)
            made: OnceLock::from(ts),
        }
    }
}

impl PartialEq for Transfers {
    fn eq(&self, o: &Transfers) -> bool {
        self.len() == o.len() && self.iter_owned().eq(o.iter_owned())
    }
}

impl Eq for Transfers {}

impl fmt::Debug for Transfers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter_owned()).finish()
    }
}

impl Serialize for Transfers {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter_owned())
    }
}

impl<'de> Deserialize<'de> for Transfers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Transfers, D::Error> {
        Ok(Vec::<Transfer>::deserialize(d)?.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoding::{Fp8Block, ScaleFormat};
    use crate::layout::Side;
    use crate::plan::{EncodeAt, Pair};
    use crate::synthetic::{SyntheticSide, TensorSplit, catalogue};

    #[test]
    fn items_stay_narrow_only_while_no_merge_of_them_can_pass_32_bits() {
        let mut wide = Vec::new();
        let item = |rows: u64, cols: u64, wide: &mut Vec<Boxes>| {
            let b = Boxes {
                src_offset: Dims::new(&[0, 0]),
                dst_offset: Dims::new(&[0, 0]),
                extent: Dims::new(&[rows, cols]),
            };
            Item::new(0, 0, 0, &b, wide)
        };
        let half = u64::from(u32::MAX / 2);
        let two = [item(half, 8, &mut wide), item(half, 8, &mut wide)];
        assert!(wide.is_empty());
        assert!(Item::stay_narrow(&two));
        // a third such row block could merge past 32 bits along dim 0
        let three = [two[0], two[1], item(2, 8, &mut wide)];
        assert!(!Item::stay_narrow(&three));
        // a wide item never stays narrow
        let big = item(u64::from(u32::MAX) + 1, 1, &mut wide);
        assert_eq!(wide.len(), 1);
        assert!(!Item::stay_narrow(&[two[0], big]));
        assert!(Item::stay_narrow(&[]));
    }

    /// A side of one engine whose `tensors` canonical tensors are stacked whole into one local
    /// tensor, on `replicas` ranks.
    fn stacked(side: Side, tensors: usize, replicas: u32) -> SyntheticSide {
        SyntheticSide {
            side,
            engines: 1,
            replicas,
            shards: 1,
            splits: (0..tensors)
                .map(|_| TensorSplit {
                    dim: 0,
                    cuts: Vec::new(),
                    pad: 0,
                })
                .collect(),
            dtype: DType::Bf16,
            fuse: true,
        }
    }

    #[test]
    fn a_coalesced_peer_s_fingerprint_hashes_its_transfers_in_execution_order() {
        // three canonical tensors stacked into one local tensor on both sides (the source's on
        // two replicas): each peer's transfers merge (fewer come out than
        // went in), and the fingerprint the planner makes where it coalesces is the digest of
        // the made transfers' bytes, in the order they run
        let cat = catalogue(&[vec![6, 2], vec![4, 2], vec![6, 2]]);
        let (train, infer) = (
            stacked(Side::Training, 3, 2).build(&cat),
            stacked(Side::Inference, 3, 1).build(&cat),
        );
        let pair = Pair {
            catalogue: &cat,
            training: &train,
            inference: &infer,
            encode_on_sender: false,
        };
        let mut merged = 0;
        for (s, rank) in [
            (Side::Training, RankId::train(0)),
            (Side::Training, RankId::train(1)),
            (Side::Inference, RankId::infer(0, 0)),
        ] {
            let plan = pair.plan_rank(s, rank).unwrap();
            for p in &plan.peers {
                let mut want = Vec::new();
                for t in &p.transfers {
                    t.hash_bytes(&mut want);
                }
                assert_eq!(
                    p.fingerprint,
                    xxhash_rust::xxh3::xxh3_64(&want),
                    "{s:?} {}",
                    p.peer
                );
                merged += usize::from(p.transfers.len() < 3);
            }
        }
        assert!(merged > 0, "no peer's transfers merged");
    }

    #[test]
    fn transfers_that_merge_past_32_bits_are_kept_wide() {
        // two canonical tensors of 2^31 rows stacked into one local tensor on both sides: their
        // two transfers merge into one of 2^32 rows, which only a wide box holds
        let rows = 1u64 << 31;
        let cat = catalogue(&[vec![rows, 1], vec![rows, 1]]);
        let (train, infer) = (
            stacked(Side::Training, 2, 1).build(&cat),
            stacked(Side::Inference, 2, 1).build(&cat),
        );
        let pair = Pair {
            catalogue: &cat,
            training: &train,
            inference: &infer,
            encode_on_sender: false,
        };
        for (s, rank) in [
            (Side::Training, RankId::train(0)),
            (Side::Inference, RankId::infer(0, 0)),
        ] {
            let plan = pair.plan_rank(s, rank).unwrap();
            assert_eq!(plan.peers.len(), 1);
            let ts = &plan.peers[0].transfers;
            assert_eq!(ts.len(), 1, "{s:?}: {:?}", &ts[..]);
            let t = &ts[0];
            assert_eq!(t.extent, Dims::new(&[2 * rows, 1]));
            assert_eq!(
                (t.src_offset, t.dst_offset),
                (Dims::new(&[0, 0]), Dims::new(&[0, 0]))
            );
            assert_eq!(t.canonical, 0);
            assert_eq!(plan.peers[0].bytes, 2 * rows * 2);
            let (mut want, mut got) = (Vec::new(), Vec::new());
            t.hash_bytes(&mut want);
            ts.hash_bytes(&EndsSums::of(&ts.store.ends), &mut got);
            assert_eq!(got, want);
            assert_eq!(plan.peers[0].fingerprint, xxhash_rust::xxh3::xxh3_64(&want));
        }
    }

    fn transfer(i: u64, dims: &[u64], at: u64, encode: Option<Encode>) -> Transfer {
        let n = dims.len();
        let mut off = vec![0u64; n];
        off[0] = at;
        Transfer {
            src_rank: RankId::train((i % 3) as u32),
            dst_rank: RankId {
                engine: (i % 2) as u32,
                rank: 1,
            },
            canonical: i as u32,
            src_tensor: format!("src.{}", i % 4).into(),
            src_shape: Dims::new(dims),
            src_offset: Dims::new(&off),
            src_dtype: DType::Bf16,
            dst_tensor: format!("dst.{}", i % 5).into(),
            dst_shape: Dims::new(dims),
            dst_offset: Dims::new(&off),
            dst_dtype: DType::Bf16,
            // (an encoded box covers whole blocks of its two trailing dims)
            extent: Dims::new(if encode.is_some() {
                dims
            } else {
                &dims[n.min(2) - 1..]
            }),
            encode,
            transposed: i % 7 == 0,
        }
    }

    #[test]
    fn a_merge_past_32_bits_keeps_the_boxes_whole() {
        // an item's extent grown by a merge past 32 bits moves its boxes aside, whole; a wide
        // item's extent is set in place
        let b = Boxes {
            src_offset: Dims::new(&[3, 0]),
            dst_offset: Dims::new(&[5, 7]),
            extent: Dims::new(&[4, 1 << 20]),
        };
        let mut wide = Vec::new();
        let mut it = Item::new(0, 9, 0, &b, &mut wide);
        assert!(!it.wide && wide.is_empty());
        it.set_extent(0, 6, &mut wide);
        assert_eq!(it.boxes(&wide).extent, Dims::new(&[6, 1 << 20]));
        it.set_extent(0, 1 << 32, &mut wide);
        assert!(it.wide);
        let got = it.boxes(&wide);
        assert_eq!(got.extent, Dims::new(&[1 << 32, 1 << 20]));
        assert_eq!(
            (got.src_offset, got.dst_offset),
            (b.src_offset, b.dst_offset)
        );
        assert_eq!((it.ends, it.canonical, it.pair, it.k), (0, 9, 0, 2));
        it.set_extent(1, 3, &mut wide);
        assert_eq!(it.boxes(&wide).extent, Dims::new(&[1 << 32, 3]));
        assert_eq!(it.numel(&wide), 3 << 32);
        assert_eq!(wide.len(), 1);
    }

    #[test]
    fn an_item_takes_52_bytes() {
        assert_eq!(std::mem::size_of::<Item>(), 52);
        assert_eq!(std::mem::size_of::<Transfer>(), 272);
    }

    #[test]
    fn transfers_made_from_their_parts_are_the_transfers_kept() {
        // boxes past 32 bits and of 4 dims (kept wide), shared and distinct ends, several rank
        // pairs, encodings and transposes: every transfer made from its parts equals the one
        // it was made of, and so do its bytes and its fingerprint bytes
        let fp8 = Some(Encode {
            encoding: Fp8Block {
                block: [128, 128],
                scale_format: ScaleFormat::Ue8m0,
            },
            at: EncodeAt::Sender,
        });
        let mut ts = Vec::new();
        for i in 0..60u64 {
            let dims: &[u64] = match i % 4 {
                0 => &[4096, 1024],
                1 => &[1 << 33, 2],
                2 => &[2, 3, 4, 5],
                _ => &[8],
            };
            let at = if i % 5 == 0 { (1 << 32) + i } else { i };
            let enc = if i % 12 == 0 { fp8.clone() } else { None };
            ts.push(transfer(i, dims, at, enc));
        }
        // offsets whose dims are not their shapes' (a plan read from JSON may hold any)
        let mut odd = transfer(61, &[4096, 1024], 2, None);
        odd.src_offset = Dims::new(&[5]);
        odd.dst_offset = Dims::new(&[1, 2, 3]);
        ts.push(odd);
        let kept = Transfers::from(ts.clone());
        let wide = kept.store.wide.len();
        assert!(wide > 0 && wide < ts.len(), "{wide} of {} wide", ts.len());
        assert!(kept.store.ends.len() < ts.len());
        let made: Vec<Transfer> = kept.iter_owned().collect();
        assert_eq!(made, ts);
        for (i, t) in ts.iter().enumerate() {
            assert_eq!(kept.transfer(i), *t);
            assert_eq!(kept.bytes_of(i), t.bytes(), "transfer {i}");
        }
        let (mut want, mut got) = (Vec::new(), Vec::new());
        for t in &ts {
            t.hash_bytes(&mut want);
        }
        kept.hash_bytes(&EndsSums::of(&kept.store.ends), &mut got);
        assert_eq!(got, want);
        // serialised as the list of its transfers, and read back
        let json = serde_json::to_string(&kept).unwrap();
        assert_eq!(json, serde_json::to_string(&ts).unwrap());
        let back: Transfers = serde_json::from_str(&json).unwrap();
        assert_eq!(back, kept);
        assert_eq!(&back[..], &ts[..]);
    }

    #[test]
    fn a_plan_s_fingerprint_bytes_are_its_transfers_bytes() {
        // a pair whose transfers merge (rows contiguous on both ends) and are cut: the compact
        // fingerprint bytes of every peer equal its made transfers' bytes, and the slice the
        // transports read holds the same transfers
        let cat = catalogue(&vec![vec![4096, 1024]; 8]);
        let side = |side, engines, replicas, shards: u32| SyntheticSide {
            side,
            engines,
            replicas,
            shards,
            splits: (0..8)
                .map(|_| TensorSplit {
                    dim: 0,
                    cuts: (1..shards)
                        .map(|s| 4096 * s as u64 / shards as u64)
                        .collect(),
                    pad: 0,
                })
                .collect(),
            dtype: DType::Bf16,
            fuse: true,
        };
        let train = side(Side::Training, 1, 2, 8).build(&cat);
        let infer = side(Side::Inference, 2, 1, 2).build(&cat);
        let pair = Pair {
            catalogue: &cat,
            training: &train,
            inference: &infer,
            encode_on_sender: false,
        };
        let mut seen = 0;
        for (s, rank) in [
            (Side::Training, RankId::train(0)),
            (Side::Inference, RankId { engine: 1, rank: 0 }),
        ] {
            let plan = pair.plan_rank(s, rank).unwrap();
            for p in &plan.peers {
                let (mut want, mut got) = (Vec::new(), Vec::new());
                for t in &p.transfers {
                    t.hash_bytes(&mut want);
                }
                p.transfers
                    .hash_bytes(&EndsSums::of(&p.transfers.store.ends), &mut got);
                assert_eq!(got, want);
                // the planner's fingerprint (made where the peer is coalesced) hashes them
                assert_eq!(
                    p.fingerprint,
                    xxhash_rust::xxh3::xxh3_64(&want),
                    "{}",
                    p.peer
                );
                assert_eq!(
                    p.transfers.iter_owned().collect::<Vec<_>>(),
                    p.transfers.to_vec()
                );
                assert_eq!(
                    p.bytes,
                    p.transfers.iter().map(Transfer::bytes).sum::<u64>()
                );
                seen += p.transfers.len();
            }
        }
        assert!(seen > 8, "{seen} transfers");
    }
}
