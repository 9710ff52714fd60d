//! Merging adjacent transfers between the same two tensors into one contiguous box, and ordering them.

use super::Transfer;
use crate::layout::Dims;
use std::cmp::Ordering;

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

/// Coalesces one peer's transfers and puts them in execution order.
///
/// Transfers merge when they connect the same two local tensors and their boxes are adjacent
/// along one dim in both tensors (e.g. q, k and v rows that are contiguous on both sides).
#[inline(never)]
pub(super) fn coalesce(mut ts: Vec<Transfer>) -> Vec<Transfer> {
    let group = |a: &Transfer, b: &Transfer| -> Ordering {
        (
            &a.src_rank,
            &a.dst_rank,
            &a.src_tensor,
            &a.dst_tensor,
            a.extent.ndim(),
        )
            .cmp(&(
                &b.src_rank,
                &b.dst_rank,
                &b.src_tensor,
                &b.dst_tensor,
                b.extent.ndim(),
            ))
    };
    let max_k = ts.iter().map(|t| t.extent.ndim()).max().unwrap_or(0);
    loop {
        let before = ts.len();
        for d in (0..max_k).rev() {
            ts.sort_by(|a, b| {
                group(a, b).then_with(|| {
                    let (ka, kb) = (a.extent.ndim(), b.extent.ndim());
                    if d >= ka || d >= kb {
                        return Ordering::Equal;
                    }
                    cmp_along(a, b, d)
                })
            });
            let mut out: Vec<Transfer> = Vec::with_capacity(ts.len());
            for t in ts.drain(..) {
                if let Some(last) = out.last_mut()
                    && d < t.extent.ndim()
                    && group(last, &t) == Ordering::Equal
                    && adjacent(last, &t, d)
                {
                    let e = last.extent.get(d) + t.extent.get(d);
                    last.extent.set(d, e);
                    last.canonical = last.canonical.min(t.canonical);
                    continue;
                }
                out.push(t);
            }
            ts = out;
        }
        if ts.len() == before {
            break;
        }
    }
    ts.sort_by(|a, b| {
        (
            a.canonical,
            &a.dst_tensor,
            a.dst_offset,
            &a.src_tensor,
            a.src_offset,
        )
            .cmp(&(
                b.canonical,
                &b.dst_tensor,
                b.dst_offset,
                &b.src_tensor,
                b.src_offset,
            ))
    });
    ts
}
