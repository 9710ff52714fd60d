//! Assigning every destination piece of one canonical tensor to one source rank.

use super::{Pair, PlanError, Transfer};
use crate::layout::{Dims, Holder, RankId, Region, Side};
use crate::model::CanonicalTensor;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Buffers reused across tensors of one rank's plan.
#[derive(Default)]
pub(super) struct Scratch {
    ranks: Vec<RankId>,
    loads: Vec<u64>,
    ties: Vec<u64>,
    pieces: Vec<Piece>,
    order: Vec<u32>,
}

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
    chosen: u32,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn holder_key(h: &Holder) -> (Region, &str, Dims) {
    (h.region, &h.tensor, h.local_offset)
}

/// Offset in the local tensor of `cell`, given where the holder's region sits.
fn local_at(h: &Holder, cell: &Region) -> Dims {
    let mut off = h.local_offset;
    let n = off.ndim();
    let k = cell.ndim();
    for d in 0..k {
        let v = off.get(n - k + d) + cell.offset.get(d) - h.region.offset.get(d);
        off.set(n - k + d, v);
    }
    off
}

/// Computes the assignment of one canonical tensor and emits the transfers that involve `me`.
pub(super) fn assign_tensor(
    pair: &Pair<'_>,
    id: u32,
    c: &CanonicalTensor,
    side: Side,
    me: RankId,
    s: &mut Scratch,
    emit: &mut dyn FnMut(Transfer),
) -> Result<(), PlanError> {
    let mut src = pair.training.holders(&c.name);
    let mut dst = pair.inference.holders(&c.name);
    // backends usually answer in order already; sort only when they do not
    if !src.is_sorted_by(|a, b| holder_key(a) <= holder_key(b)) {
        src.sort_by(|a, b| holder_key(a).cmp(&holder_key(b)));
    }
    if !dst.is_sorted_by(|a, b| holder_key(a) <= holder_key(b)) {
        dst.sort_by(|a, b| holder_key(a).cmp(&holder_key(b)));
    }
    for h in src.iter_mut().chain(dst.iter_mut()) {
        if !h.ranks.is_sorted() {
            h.ranks.sort_unstable();
        }
    }

    // the universe of source ranks, with loads and a per-tensor tie-break
    s.ranks.clear();
    for h in &src {
        s.ranks.extend_from_slice(&h.ranks);
    }
    if !s.ranks.is_sorted() {
        s.ranks.sort_unstable();
    }
    s.ranks.dedup();
    s.loads.clear();
    s.loads.resize(s.ranks.len(), 0);
    s.ties.clear();
    s.ties.extend(
        s.ranks
            .iter()
            .map(|r| splitmix(((id as u64) << 32) ^ ((r.engine as u64) << 24) ^ r.rank as u64)),
    );

    // distinct source regions, each with its candidates
    let mut regions: Vec<(Region, Vec<Cand>)> = Vec::new();
    for (hi, h) in src.iter().enumerate() {
        let pos = match regions.iter().position(|(r, _)| *r == h.region) {
            Some(p) => p,
            None => {
                regions.push((h.region, Vec::new()));
                regions.len() - 1
            }
        };
        for r in &h.ranks {
            let ri = s.ranks.binary_search(r).unwrap_or(0) as u32;
            regions[pos].1.push(Cand {
                rank: ri,
                holder: hi as u32,
            });
        }
    }

    // cut every destination box into cells held by one set of source candidates
    s.pieces.clear();
    let mut flat: Vec<Cand> = Vec::new();
    // candidate sets seen in this tensor (by the source regions they come from) -> range in `flat`
    let mut sets: Vec<(Vec<u32>, (u32, u32))> = Vec::new();
    let mut cells: Vec<(Region, u32)> = Vec::new();
    for (dhi, dh) in dst.iter().enumerate() {
        let want = dh.region;
        cells.clear();
        let hit: Vec<usize> = regions
            .iter()
            .enumerate()
            .filter(|(_, (r, _))| r.intersect(&want).is_some())
            .map(|(i, _)| i)
            .collect();
        let mut push_cell = |cell: Region, flat: &mut Vec<Cand>| -> Result<(), PlanError> {
            let set: Vec<u32> = hit
                .iter()
                .filter(|&&i| regions[i].0.contains(&cell))
                .map(|&i| i as u32)
                .collect();
            if set.is_empty() {
                return Err(PlanError::Uncovered {
                    canonical: c.name.clone(),
                    region: cell.to_string(),
                    dst: dh.ranks.first().copied().unwrap_or(RankId::infer(0, 0)),
                });
            }
            let index = match sets.iter().position(|(k, _)| *k == set) {
                Some(i) => i as u32,
                None => {
                    let start = flat.len() as u32;
                    for &i in &set {
                        flat.extend_from_slice(&regions[i as usize].1);
                    }
                    sets.push((set, (start, flat.len() as u32)));
                    sets.len() as u32 - 1
                }
            };
            cells.push((cell, index));
            Ok(())
        };
        if hit.iter().any(|&i| regions[i].0.contains(&want)) {
            // common case: one source region holds the whole destination box
            push_cell(want, &mut flat)?;
        } else {
            let boxes: Vec<Region> = hit.iter().map(|&i| regions[i].0).collect();
            let mut err = None;
            crate::layout::ops::grid_cells(&want, &boxes, |cell| {
                if err.is_none()
                    && let Err(e) = push_cell(cell, &mut flat)
                {
                    err = Some(e);
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
        }
        for &(cell, set) in &cells {
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
            for &r in &dh.ranks {
                s.pieces.push(Piece {
                    dst_rank: r,
                    dst_holder: dhi as u32,
                    cell,
                    bytes: cell.numel() * dh.dtype.size() as u64,
                    cands: range,
                    set,
                    chosen: u32::MAX,
                });
            }
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
    let mut heaps: Vec<BinaryHeap<Reverse<(u64, u64, u32)>>> = vec![BinaryHeap::new(); sets.len()];
    for &pi in &s.order {
        let p = &mut s.pieces[pi as usize];
        let heap = &mut heaps[p.set as usize];
        if heap.is_empty() {
            for pos in p.cands.0..p.cands.1 {
                let r = flat[pos as usize].rank as usize;
                heap.push(Reverse((s.loads[r], s.ties[r], pos)));
            }
        }
        let best = loop {
            let Some(Reverse((load, tie, pos))) = heap.pop() else {
                break p.cands.0;
            };
            let r = flat[pos as usize].rank as usize;
            if load == s.loads[r] {
                break pos;
            }
            heap.push(Reverse((s.loads[r], tie, pos)));
        };
        p.chosen = best;
        let r = flat[best as usize].rank as usize;
        s.loads[r] += p.bytes;
        heap.push(Reverse((s.loads[r], s.ties[r], best)));
    }

    // emit the pieces that involve this rank
    for p in &s.pieces {
        let cand = flat[p.chosen as usize];
        let src_rank = s.ranks[cand.rank as usize];
        let mine = match side {
            Side::Training => src_rank == me,
            Side::Inference => p.dst_rank == me,
        };
        if !mine {
            continue;
        }
        let sh = &src[cand.holder as usize];
        let dh = &dst[p.dst_holder as usize];
        emit(Transfer {
            src_rank,
            dst_rank: p.dst_rank,
            canonical: id,
            src_tensor: sh.tensor.clone(),
            src_shape: sh.tensor_shape,
            src_offset: local_at(sh, &p.cell),
            src_dtype: sh.dtype,
            dst_tensor: dh.tensor.clone(),
            dst_shape: dh.tensor_shape,
            dst_offset: local_at(dh, &p.cell),
            dst_dtype: dh.dtype,
            extent: p.cell.extent,
        });
    }
    Ok(())
}
