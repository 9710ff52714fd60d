//! Merging adjacent transfers between the same two tensors into one contiguous box, and ordering them.

use super::Transfer;
use crate::layout::Dims;
use std::cmp::Ordering;
use std::sync::Arc;

/// Whether `b` continues `a` along box dim `d` on both ends, with everything else equal.
fn adjacent(a: &Transfer, b: &Transfer, d: usize) -> bool {
    let k = a.extent.ndim();
    if b.extent.ndim() != k {
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

/// Transfers that may merge: between the same two ranks and local tensors, boxes of one rank.
fn group(a: &Transfer, b: &Transfer) -> Ordering {
    a.src_rank
        .cmp(&b.src_rank)
        .then_with(|| a.dst_rank.cmp(&b.dst_rank))
        .then_with(|| cmp_name(&a.src_tensor, &b.src_tensor))
        .then_with(|| cmp_name(&a.dst_tensor, &b.dst_tensor))
        .then_with(|| a.extent.ndim().cmp(&b.extent.ndim()))
}

/// Coalesces one peer's transfers and puts them in execution order.
///
/// Transfers merge when they connect the same two local tensors and their boxes are adjacent
/// along one dim in both tensors (e.g. q, k and v rows that are contiguous on both sides).
/// `live` lists the peer's transfers in `ts` (in emission order); the transfers stay where they
/// are while these indices are sorted and merged (a merged transfer grows in place in `ts`), and
/// the indices of the result come back in execution order.
#[inline(never)]
pub(super) fn coalesce(ts: &mut [Transfer], mut live: Vec<u32>) -> Vec<u32> {
    let max_k = live
        .iter()
        .map(|&i| ts[i as usize].extent.ndim())
        .max()
        .unwrap_or(0);
    let mut out: Vec<u32> = Vec::with_capacity(live.len());
    loop {
        let before = live.len();
        for d in (0..max_k).rev() {
            let along = |a: &Transfer, b: &Transfer| -> Ordering {
                group(a, b).then_with(|| {
                    let (ka, kb) = (a.extent.ndim(), b.extent.ndim());
                    if d >= ka || d >= kb {
                        return Ordering::Equal;
                    }
                    cmp_along(a, b, d)
                })
            };
            let ordered =
                live.is_sorted_by(|&a, &b| along(&ts[a as usize], &ts[b as usize]).is_le());
            if !ordered {
                live.sort_by(|&a, &b| along(&ts[a as usize], &ts[b as usize]));
            }
            out.clear();
            for &i in &live {
                if let Some(&l) = out.last() {
                    let (last, t) = (&ts[l as usize], &ts[i as usize]);
                    if d < t.extent.ndim()
                        && group(last, t) == Ordering::Equal
                        && adjacent(last, t, d)
                    {
                        let e = last.extent.get(d) + t.extent.get(d);
                        let c = last.canonical.min(t.canonical);
                        let last = &mut ts[l as usize];
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
    if !live.is_sorted_by(|&a, &b| order(&ts[a as usize], &ts[b as usize]).is_le()) {
        live.sort_by(|&a, &b| order(&ts[a as usize], &ts[b as usize]));
    }
    live
}
