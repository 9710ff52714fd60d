//! Merging adjacent transfers between the same two tensors into one contiguous box, and ordering them.

use super::transfers::{Boxes, Ends, Item};
use crate::layout::Dims;
use crate::model::NameHasher;
use std::cmp::Ordering;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;

/// Whether `b` continues `a` along box dim `d` on both ends, with everything else equal (`k`
/// box dims each).
fn adjacent(ea: &Ends, a: &Boxes, eb: &Ends, b: &Boxes, d: usize) -> bool {
    let k = a.extent.ndim();
    // (into one FP8 tensor, sender- and receiver-encoded boxes stay apart)
    // (a transposed box is never merged: its destination runs along other dims)
    if b.extent.ndim() != k || ea.encode != eb.encode || ea.transposed || eb.transposed {
        return false;
    }
    let (sn, dn) = (a.src_offset.ndim(), a.dst_offset.ndim());
    // leading local dims (outside the box) must match exactly
    if a.src_offset.as_slice()[..sn - k] != b.src_offset.as_slice()[..sn - k]
        || a.dst_offset.as_slice()[..dn - k] != b.dst_offset.as_slice()[..dn - k]
    {
        return false;
    }
    for i in 0..k {
        let (sa, sb) = (a.src_offset.get(sn - k + i), b.src_offset.get(sn - k + i));
        let (da, db) = (a.dst_offset.get(dn - k + i), b.dst_offset.get(dn - k + i));
        if i == d {
            let e = a.extent.get(i);
            if sb != sa + e || db != da + e {
                return false;
            }
        } else if sa != sb || da != db || a.extent.get(i) != b.extent.get(i) {
            return false;
        }
    }
    true
}

/// Compares two offsets with box dim `d` (of `k` box dims) moved last, without building them.
fn cmp_moved(a: &Dims, b: &Dims, k: usize, d: usize) -> Ordering {
    let (sa, sb) = (a.as_slice(), b.as_slice());
    let (na, nb) = (sa.len(), sb.len());
    let (ma, mb) = (na - k + d, nb - k + d);
    let ia = (0..na).filter(|&i| i != ma).map(|i| sa[i]).chain([sa[ma]]);
    let ib = (0..nb).filter(|&i| i != mb).map(|i| sb[i]).chain([sb[mb]]);
    // as `Dims`' own order: the number of dims first, then the values
    na.cmp(&nb).then_with(|| ia.cmp(ib))
}

fn cmp_along(a: &Boxes, b: &Boxes, d: usize) -> Ordering {
    // sort so that neighbours along dim d are consecutive: dim d compared last
    let k = a.extent.ndim();
    cmp_moved(&a.dst_offset, &b.dst_offset, k, d)
        .then_with(|| cmp_moved(&a.src_offset, &b.src_offset, k, d))
}

/// Orders two tensor names; the same name is usually the same allocation, checked first.
fn cmp_name(a: &Arc<str>, b: &Arc<str>) -> Ordering {
    if Arc::ptr_eq(a, b) {
        Ordering::Equal
    } else {
        a.cmp(b)
    }
}

/// Numbers tensor names: equal names (by content) get one number, whichever allocation holds
/// them. Transfers are numbered as they are emitted; the names are then compared by number.
#[derive(Default)]
pub(super) struct NameNumbers {
    /// the number of each name allocation seen (the allocations stay alive in the transfers)
    by_ptr: HashMap<*const u8, u32, BuildHasherDefault<NameHasher>>,
    /// the number of each distinct name
    by_name: HashMap<Arc<str>, u32, BuildHasherDefault<NameHasher>>,
    /// the last allocation numbered (consecutive transfers mostly share their names)
    last: Option<(*const u8, u32)>,
}

impl NameNumbers {
    /// The number of the name `n`.
    pub(super) fn number(&mut self, n: &Arc<str>) -> u32 {
        let p = Arc::as_ptr(n) as *const u8;
        if let Some((q, k)) = self.last
            && q == p
        {
            return k;
        }
        let k = match self.by_ptr.get(&p) {
            Some(&k) => k,
            None => {
                let fresh = self.by_name.len() as u32;
                let k = *self.by_name.entry(n.clone()).or_insert(fresh);
                self.by_ptr.insert(p, k);
                k
            }
        };
        self.last = Some((p, k));
        k
    }
}

/// Coalescing the peers of one plan (one `Groups` per thread): transfers merge when they connect the same two local
/// tensors and their boxes are adjacent along one dim in both tensors (e.g. q, k and v rows
/// that are contiguous on both sides).
///
/// Transfers that may merge form a group: between the same two ranks (a peer's are) and local
/// tensors, boxes of one rank. Merges happen inside a group only, so each group with more than
/// one transfer is merged on its own: for each box dim from the last, its transfers sorted so
/// that neighbours along that dim are consecutive ([`cmp_along`], ties kept in their earlier
/// order), each merged into the one before it where adjacent, until a round merges nothing.
/// Then the peer's transfers are put in execution order: canonical tensor, destination tensor
/// (by name), destination offset, source tensor, source offset.
pub(super) struct Groups<'a> {
    /// per ends: its group, the number of its pair of tensor names ([`NameNumbers`] of each)
    gid: &'a [u32],
    /// per name pair: the last peer (by `epoch`) with a transfer in it, and how many it had
    stamp: Vec<u32>,
    count: Vec<u32>,
    epoch: u32,
    /// per item of the peer: merged into another
    dead: Vec<bool>,
    /// the peer's items that others merged into (grown), in the order of their first merge
    grown: Vec<u32>,
    /// the peer's transfers in name pairs of more than one: (name pair, box dims, item)
    multi: Vec<(u32, u8, u32)>,
    run: Vec<u32>,
    out: Vec<u32>,
    /// the keys of the peer's transfers
    keys: Vec<Key>,
}

/// What grouping and ordering compare first of a transfer.
#[derive(Clone, Copy)]
struct Key {
    /// its ends' group
    group: u32,
    /// its box dims
    k: u8,
    /// its canonical tensor
    canonical: u32,
}

impl<'a> Groups<'a> {
    /// The items the last [`Groups::coalesce`] merged others into (each once, in no
    /// particular order; a merged-into item may itself have been merged into another later).
    pub(super) fn grown(&mut self) -> &[u32] {
        self.grown.sort_unstable();
        self.grown.dedup();
        &self.grown
    }

    /// The groups of a plan's transfers: `gid` the group of each ends.
    pub(super) fn new(gid: &'a [u32]) -> Groups<'a> {
        let groups = gid.iter().map(|&g| g as usize + 1).max().unwrap_or(0);
        Groups {
            gid,
            stamp: vec![0; groups],
            count: vec![0; groups],
            epoch: 0,
            dead: Vec::new(),
            grown: Vec::new(),
            multi: Vec::new(),
            run: Vec::new(),
            out: Vec::new(),
            keys: Vec::new(),
        }
    }

    /// Coalesces one peer's transfers (`order`: their indices in `items`, the peer's items, in
    /// emission order; a merged transfer grows in place and the one merged into it leaves
    /// `order`) and puts them in execution order. `ends` and `wide` are the store's tables; a
    /// peer none of whose items is wide, nor can become wide by merging, may be given any
    /// `wide` (it is neither read nor written).
    #[inline(never)]
    pub(super) fn coalesce(
        &mut self,
        order: &mut Vec<u32>,
        items: &mut [Item],
        ends: &[Ends],
        wide: &mut Vec<Boxes>,
    ) {
        self.dead.clear();
        self.grown.clear();
        self.dead.resize(items.len(), false);
        // what grouping and ordering compare first, read once
        self.keys.clear();
        self.keys.extend(order.iter().map(|&i| {
            let it = &items[i as usize];
            Key {
                group: self.gid[it.ends as usize],
                k: it.k,
                canonical: it.canonical,
            }
        }));
        let keys = &self.keys;
        self.epoch += 1;
        for k in keys {
            let g = k.group as usize;
            if self.stamp[g] != self.epoch {
                self.stamp[g] = self.epoch;
                self.count[g] = 0;
            }
            self.count[g] += 1;
        }
        // the transfers of name pairs with more than one
        self.multi.clear();
        let count = &self.count;
        self.multi.extend(
            keys.iter()
                .zip(order.iter())
                .filter(|(k, _)| count[k.group as usize] > 1)
                .map(|(k, &i)| (k.group, k.k, i)),
        );
        let mut merged = false;
        if !self.multi.is_empty() {
            // by group (of a name pair, boxes of one rank), each group in emission order
            self.multi.sort_by_key(|&(g, k, _)| (g, k));
            let mut a = 0;
            while a < self.multi.len() {
                let (g, k, _) = self.multi[a];
                let b = a + self.multi[a..]
                    .iter()
                    .take_while(|x| (x.0, x.1) == (g, k))
                    .count();
                if b - a > 1 {
                    self.run.clear();
                    self.run.extend(self.multi[a..b].iter().map(|x| x.2));
                    merged |= merge_group(
                        &mut self.run,
                        &mut self.out,
                        k as usize,
                        ends,
                        items,
                        wide,
                        (&mut self.dead, &mut self.grown),
                    );
                }
                a = b;
            }
            if merged {
                let dead = &self.dead;
                order.retain(|&i| !dead[i as usize]);
            }
        }
        let order_of = |a: &u32, b: &u32| -> Ordering {
            let (a, b) = (&items[*a as usize], &items[*b as usize]);
            a.canonical.cmp(&b.canonical).then_with(|| {
                let (x, y) = (&ends[a.ends as usize], &ends[b.ends as usize]);
                let (xb, yb) = (a.boxes(wide), b.boxes(wide));
                cmp_name(&x.dst_tensor, &y.dst_tensor)
                    .then_with(|| xb.dst_offset.cmp(&yb.dst_offset))
                    .then_with(|| cmp_name(&x.src_tensor, &y.src_tensor))
                    .then_with(|| xb.src_offset.cmp(&yb.src_offset))
            })
        };
        // in order already where the canonicals increase (as emitted, unless merged)
        let sorted = if merged {
            order.is_sorted_by(|a, b| order_of(a, b).is_le())
        } else {
            keys.windows(2).zip(order.windows(2)).all(|(k, o)| {
                k[0].canonical < k[1].canonical
                    || (k[0].canonical == k[1].canonical && order_of(&o[0], &o[1]).is_le())
            })
        };
        if !sorted {
            order.sort_by(order_of);
        }
    }
}

/// Merges the transfers of one group (`run`, `k` box dims) to a fixed point, marking those
/// merged into others `dead` and those they merged into `grown`; whether any merged.
fn merge_group(
    run: &mut Vec<u32>,
    out: &mut Vec<u32>,
    k: usize,
    ends: &[Ends],
    items: &mut [Item],
    wide: &mut Vec<Boxes>,
    (dead, grown): (&mut [bool], &mut Vec<u32>),
) -> bool {
    let start = run.len();
    loop {
        let before = run.len();
        for d in (0..k).rev() {
            let along = |a: &u32, b: &u32| {
                let (a, b) = (&items[*a as usize], &items[*b as usize]);
                cmp_along(&a.boxes(wide), &b.boxes(wide), d)
            };
            if !run.is_sorted_by(|a, b| along(a, b).is_le()) {
                run.sort_by(along);
            }
            out.clear();
            for &i in run.iter() {
                if let Some(&l) = out.last() {
                    let (li, ii) = (&items[l as usize], &items[i as usize]);
                    let (lb, ib) = (li.boxes(wide), ii.boxes(wide));
                    if adjacent(
                        &ends[li.ends as usize],
                        &lb,
                        &ends[ii.ends as usize],
                        &ib,
                        d,
                    ) {
                        let e = lb.extent.get(d) + ib.extent.get(d);
                        let c = li.canonical.min(ii.canonical);
                        let last = &mut items[l as usize];
                        last.canonical = c;
                        last.set_extent(d, e, wide);
                        dead[i as usize] = true;
                        grown.push(l);
                        continue;
                    }
                }
                out.push(i);
            }
            std::mem::swap(run, out);
        }
        if run.len() == before {
            break;
        }
    }
    run.len() != start
}
