//! Merging adjacent transfers between the same two tensors into one contiguous box, and ordering them.

use super::Transfer;
use crate::layout::Dims;
use crate::model::NameHasher;
use std::cmp::Ordering;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;

/// Whether `b` continues `a` along box dim `d` on both ends, with everything else equal.
fn adjacent(a: &Transfer, b: &Transfer, d: usize) -> bool {
    let k = a.extent.ndim();
    // (into one FP8 tensor, sender- and receiver-encoded boxes stay apart)
    // (a transposed box is never merged: its destination runs along other dims)
    if b.extent.ndim() != k || a.encode != b.encode || a.transposed || b.transposed {
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

fn cmp_along(a: &Transfer, b: &Transfer, d: usize) -> Ordering {
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

/// A transfer of the peer, with the numbers of its two tensors' names.
#[derive(Clone, Copy)]
struct Item {
    /// index into the transfers
    at: u32,
    src: u32,
    dst: u32,
}

/// Transfers that may merge: between the same two ranks and local tensors, boxes of one rank.
///
/// Only which transfers fall in one group matters, not the order of the groups: merges happen
/// inside a group, in the group's own order (`cmp_along`, ties kept in their earlier order by
/// the stable sort), and the final order ([`coalesce`]'s last sort) compares names
/// alphabetically. So the names compare by their numbers.
fn group(a: Item, b: Item, ts: &[Transfer]) -> Ordering {
    let (x, y) = (&ts[a.at as usize], &ts[b.at as usize]);
    x.src_rank
        .cmp(&y.src_rank)
        .then_with(|| x.dst_rank.cmp(&y.dst_rank))
        .then_with(|| a.src.cmp(&b.src))
        .then_with(|| a.dst.cmp(&b.dst))
        .then_with(|| x.extent.ndim().cmp(&y.extent.ndim()))
}

/// Coalesces one peer's transfers and puts them in execution order.
///
/// Transfers merge when they connect the same two local tensors and their boxes are adjacent
/// along one dim in both tensors (e.g. q, k and v rows that are contiguous on both sides).
/// `live` lists the peer's transfers in `ts` (in emission order), `names` the numbers of every
/// transfer's source and destination tensor names ([`NameNumbers`]); the transfers stay where they
/// are while these indices are sorted and merged (a merged transfer grows in place in `ts`), and
/// the indices of the result come back in execution order.
#[inline(never)]
pub(super) fn coalesce(ts: &mut [Transfer], names: &[(u32, u32)], live: Vec<u32>) -> Vec<u32> {
    let max_k = live
        .iter()
        .map(|&i| ts[i as usize].extent.ndim())
        .max()
        .unwrap_or(0);
    let mut live: Vec<Item> = live
        .iter()
        .map(|&at| {
            let (src, dst) = names[at as usize];
            Item { at, src, dst }
        })
        .collect();
    let mut out: Vec<Item> = Vec::with_capacity(live.len());
    loop {
        let before = live.len();
        for d in (0..max_k).rev() {
            let along = |a: Item, b: Item| -> Ordering {
                group(a, b, ts).then_with(|| {
                    let (x, y) = (&ts[a.at as usize], &ts[b.at as usize]);
                    let (ka, kb) = (x.extent.ndim(), y.extent.ndim());
                    if d >= ka || d >= kb {
                        return Ordering::Equal;
                    }
                    cmp_along(x, y, d)
                })
            };
            if !live.is_sorted_by(|&a, &b| along(a, b).is_le()) {
                live.sort_by(|&a, &b| along(a, b));
            }
            out.clear();
            for &i in &live {
                if let Some(&l) = out.last() {
                    let (last, t) = (&ts[l.at as usize], &ts[i.at as usize]);
                    if d < t.extent.ndim()
                        && group(l, i, ts) == Ordering::Equal
                        && adjacent(last, t, d)
                    {
                        let e = last.extent.get(d) + t.extent.get(d);
                        let c = last.canonical.min(t.canonical);
                        let last = &mut ts[l.at as usize];
                        last.extent.set(d, e);
                        last.canonical = c;
                        continue;
                    }
                }
                out.push(i);
            }
            std::mem::swap(&mut live, &mut out);
        }
        if live.len() == before {
            break;
        }
    }
    let order = |a: &Transfer, b: &Transfer| -> Ordering {
        a.canonical
            .cmp(&b.canonical)
            .then_with(|| cmp_name(&a.dst_tensor, &b.dst_tensor))
            .then_with(|| a.dst_offset.cmp(&b.dst_offset))
            .then_with(|| cmp_name(&a.src_tensor, &b.src_tensor))
            .then_with(|| a.src_offset.cmp(&b.src_offset))
    };
    let mut live: Vec<u32> = live.into_iter().map(|i| i.at).collect();
    if !live.is_sorted_by(|&a, &b| order(&ts[a as usize], &ts[b as usize]).is_le()) {
        live.sort_by(|&a, &b| order(&ts[a as usize], &ts[b as usize]));
    }
    live
}
