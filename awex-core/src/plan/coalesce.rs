//! Merging adjacent transfers between the same two tensors into one contiguous box, and ordering them.

use super::Transfer;
use crate::layout::{Dims, RankId};
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

/// A transfer of the peer, with the numbers of its two tensors' names and, copied out of it,
/// what the grouping and the final order compare first (made as the transfer is emitted, so
/// coalescing reads a transfer itself only to compare boxes of one group or equal canonicals).
#[derive(Clone, Copy)]
pub(super) struct Item {
    /// index into the transfers
    at: u32,
    src: u32,
    dst: u32,
    src_rank: RankId,
    dst_rank: RankId,
    /// the number of box dims
    k: u8,
    /// the transfer's `canonical` (kept equal to it as transfers merge)
    canonical: u32,
}

impl Item {
    /// Transfer `t`, at index `at` of its peer's transfers, with the numbers of its source
    /// and destination tensor names ([`NameNumbers`]).
    pub(super) fn new(at: u32, t: &Transfer, src: u32, dst: u32) -> Self {
        Item {
            at,
            src,
            dst,
            src_rank: t.src_rank,
            dst_rank: t.dst_rank,
            k: t.extent.ndim() as u8,
            canonical: t.canonical,
        }
    }
}

/// Transfers that may merge: between the same two ranks and local tensors, boxes of one rank.
///
/// Only which transfers fall in one group matters, not the order of the groups: merges happen
/// inside a group, in the group's own order (`cmp_along`, ties kept in their earlier order by
/// the stable sort), and the final order ([`coalesce`]'s last sort) compares names
/// alphabetically. So the names compare by their numbers.
fn group(a: &Item, b: &Item) -> Ordering {
    a.src_rank
        .cmp(&b.src_rank)
        .then_with(|| a.dst_rank.cmp(&b.dst_rank))
        .then_with(|| a.src.cmp(&b.src))
        .then_with(|| a.dst.cmp(&b.dst))
        .then_with(|| a.k.cmp(&b.k))
}

/// Coalesces one peer's transfers and puts them in execution order.
///
/// Transfers merge when they connect the same two local tensors and their boxes are adjacent
/// along one dim in both tensors (e.g. q, k and v rows that are contiguous on both sides).
/// `live` lists the peer's transfers in `ts` (in emission order) with the numbers of their
/// source and destination tensor names ([`NameNumbers`]); the transfers stay where they are
/// while these items are sorted and merged (a merged transfer grows in place in `ts`), and the
/// indices of the result come back in execution order.
#[inline(never)]
pub(super) fn coalesce(ts: &mut [Transfer], mut live: Vec<Item>) -> Vec<u32> {
    let max_k = live.iter().map(|i| i.k as usize).max().unwrap_or(0);
    let mut out: Vec<Item> = Vec::with_capacity(live.len());
    loop {
        let before = live.len();
        for d in (0..max_k).rev() {
            let along = |a: &Item, b: &Item| -> Ordering {
                group(a, b).then_with(|| {
                    if d >= a.k as usize || d >= b.k as usize {
                        return Ordering::Equal;
                    }
                    cmp_along(&ts[a.at as usize], &ts[b.at as usize], d)
                })
            };
            if !live.is_sorted_by(|a, b| along(a, b).is_le()) {
                live.sort_by(along);
            }
            out.clear();
            for &i in &live {
                if let Some(l) = out.last_mut()
                    && d < i.k as usize
                    && group(l, &i) == Ordering::Equal
                    && adjacent(&ts[l.at as usize], &ts[i.at as usize], d)
                {
                    let t = &ts[i.at as usize];
                    let e = ts[l.at as usize].extent.get(d) + t.extent.get(d);
                    let c = l.canonical.min(i.canonical);
                    let last = &mut ts[l.at as usize];
                    last.extent.set(d, e);
                    last.canonical = c;
                    l.canonical = c;
                    continue;
                }
                out.push(i);
            }
            std::mem::swap(&mut live, &mut out);
        }
        if live.len() == before {
            break;
        }
    }
    let order = |a: &Item, b: &Item| -> Ordering {
        let (x, y) = (&ts[a.at as usize], &ts[b.at as usize]);
        a.canonical
            .cmp(&b.canonical)
            .then_with(|| cmp_name(&x.dst_tensor, &y.dst_tensor))
            .then_with(|| x.dst_offset.cmp(&y.dst_offset))
            .then_with(|| cmp_name(&x.src_tensor, &y.src_tensor))
            .then_with(|| x.src_offset.cmp(&y.src_offset))
    };
    if !live.is_sorted_by(|a, b| order(a, b).is_le()) {
        live.sort_by(order);
    }
    live.into_iter().map(|i| i.at).collect()
}

/// Puts `ts` in the order of `order` (indices into `ts`, each at most once, as [`coalesce`]
/// returns them) in place, and drops the transfers it leaves out (merged into others).
pub(super) fn arrange<T>(ts: &mut Vec<T>, order: &[u32]) {
    // mostly the emission order already, less the merged transfers at the end (or none)
    if order.iter().enumerate().all(|(k, &i)| i as usize == k) {
        ts.truncate(order.len());
        return;
    }
    // the original index of the transfer now at each position, and the position of each
    let mut at: Vec<u32> = (0..ts.len() as u32).collect();
    let mut pos: Vec<u32> = at.clone();
    for (k, &i) in order.iter().enumerate() {
        let p = pos[i as usize] as usize;
        if p != k {
            ts.swap(k, p);
            let moved = at[k];
            at[p] = moved;
            pos[moved as usize] = p as u32;
            at[k] = i;
            pos[i as usize] = k as u32;
        }
    }
    ts.truncate(order.len());
}

#[cfg(test)]
mod tests {
    use super::arrange;

    #[test]
    fn arrange_puts_items_in_order_and_drops_the_rest() {
        // every order of a few items, with some left out, against building the result anew
        let orders: [&[u32]; 7] = [
            &[0, 1, 2, 3, 4],
            &[0, 1, 2],
            &[4, 3, 2, 1, 0],
            &[2, 0, 4],
            &[1, 2, 3, 4, 0],
            &[3, 4, 0, 1],
            &[],
        ];
        for order in orders {
            let mut v: Vec<String> = (0..5).map(|i| format!("t{i}")).collect();
            let want: Vec<String> = order.iter().map(|&i| v[i as usize].clone()).collect();
            arrange(&mut v, order);
            assert_eq!(v, want, "order {order:?}");
        }
    }
}
