//! Operations on layouts: validation, coverage, materialize (canonical -> local), reconstruct (local -> canonical).

use super::copy::{CopyError, Transpose, copy_box_transposed};
use super::{Dims, ExplicitSide, Holder, LayoutError, Placement, RankLayout, Region, SideLayout};
use crate::model::Catalogue;
use std::collections::{HashMap, HashSet};

/// The local box a placement occupies: its region's extent, widened with leading 1s to the local rank.
/// (transposed: the region's extent with its last two dims swapped, see [`Placement::transposed`]).
pub(crate) fn local_box(p: &Placement) -> Option<Region> {
    let (local_offset, region) = (&p.local_offset, &p.region);
    let n = local_offset.ndim();
    let k = region.ndim();
    if k > n {
        return None;
    }
    let mut ext = [1u64; super::MAX_DIMS];
    ext[n - k..n].copy_from_slice(p.local_extent().as_slice());
    Some(Region {
        offset: *local_offset,
        extent: Dims::new(&ext[..n]),
    })
}

/// Checks one rank's layout against the catalogue: known tensors, boxes in bounds, no overlaps, convertible dtypes, unique names.
pub fn validate_rank(layout: &RankLayout, cat: &Catalogue) -> Result<(), LayoutError> {
    let rank = layout.rank;
    let mut names = HashSet::new();
    for t in &layout.tensors {
        if !names.insert(&*t.name) {
            return Err(LayoutError::DuplicateName {
                rank,
                tensor: t.name.to_string(),
            });
        }
        // 4x: a local tensor may be wider than the checkpoint dtype (bf16 -> f64 at most)
        let max_bytes = 4 * crate::limits::MAX_MODEL_BYTES;
        let bytes = t
            .shape
            .checked_numel()
            .and_then(|n| n.checked_mul(t.dtype.size() as u64));
        if bytes.is_none_or(|b| b > max_bytes) {
            return Err(LayoutError::OutOfBounds {
                rank,
                tensor: t.name.to_string(),
                message: format!(
                    "has shape {} of {}, more than the {max_bytes} bytes a local tensor may hold",
                    t.shape, t.dtype
                ),
            });
        }
        let mut boxes: Vec<(Region, String)> = Vec::with_capacity(t.placements.len());
        for p in &t.placements {
            let oob = |message: String| LayoutError::OutOfBounds {
                rank,
                tensor: t.name.to_string(),
                message,
            };
            let c = cat
                .get(&p.canonical)
                .ok_or_else(|| LayoutError::UnknownCanonical {
                    rank,
                    tensor: t.name.to_string(),
                    canonical: p.canonical.to_string(),
                })?;
            if !p.region.fits(&c.shape) {
                return Err(oob(format!(
                    "places box {} of `{}`, outside its shape {}",
                    p.region, p.canonical, c.shape
                )));
            }
            if p.local_offset.ndim() != t.shape.ndim() {
                return Err(oob(format!(
                    "has shape {} but a placement offset {} of another rank",
                    t.shape, p.local_offset
                )));
            }
            if p.transposed && p.region.ndim() < 2 {
                return Err(oob(format!(
                    "places `{}` {} transposed, but a transposed box needs at least 2 dims",
                    p.canonical, p.region
                )));
            }
            if p.transposed && t.encoding != crate::encoding::Encoding::Plain(t.dtype) {
                return Err(oob(format!(
                    "places `{}` {} transposed into a tensor of encoding {:?}; transposed boxes go into plain tensors only",
                    p.canonical, p.region, t.encoding
                )));
            }
            let lb = local_box(p).ok_or_else(|| {
                oob(format!(
                    "has {} dims, fewer than the {} of `{}`",
                    t.shape.ndim(),
                    p.region.ndim(),
                    p.canonical
                ))
            })?;
            if !lb.fits(&t.shape) {
                return Err(oob(format!(
                    "places `{}` {}{} at {}, outside its local shape {}",
                    p.canonical,
                    p.region,
                    if p.transposed { " transposed" } else { "" },
                    p.local_offset,
                    t.shape
                )));
            }
            if !c.dtype.converts_to(t.dtype) {
                return Err(LayoutError::DType {
                    rank,
                    tensor: t.name.to_string(),
                    local: t.dtype,
                    canonical: c.name.clone(),
                    canonical_dtype: c.dtype,
                });
            }
            boxes.push((lb, format!("`{}` {}", p.canonical, p.region)));
        }
        // overlap check: sort by first coordinate, compare neighbours that can still overlap
        boxes.sort_by_key(|b| b.0.offset);
        for i in 0..boxes.len() {
            for j in i + 1..boxes.len() {
                if boxes[j].0.offset.get(0) >= boxes[i].0.end().get(0) {
                    break;
                }
                if boxes[i].0.intersect(&boxes[j].0).is_some() {
                    return Err(LayoutError::Overlap {
                        rank,
                        tensor: t.name.to_string(),
                        a: boxes[i].1.clone(),
                        b: boxes[j].1.clone(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Part of a canonical tensor that no rank of one replica holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoverageGap {
    /// The canonical tensor.
    pub canonical: String,
    /// The engine (replica) missing it; 0 on the training side.
    pub engine: u32,
    /// A box nobody in that replica holds.
    pub region: Region,
}

impl std::fmt::Display for CoverageGap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "engine {}: {} of `{}` is held by no rank",
            self.engine, self.region, self.canonical
        )
    }
}

/// A box with no elements where one with elements is needed: its first zero dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EmptyExtent {
    /// The dimension whose extent is 0.
    pub(crate) dim: usize,
}

/// Splits `within` by every boundary of `boxes` into grid cells, calling `f` for each; a
/// `within` with a zero extent (no cells, no elements) is an error, never an index.
pub(crate) fn grid_cells(
    within: &Region,
    boxes: &[Region],
    mut f: impl FnMut(Region),
) -> Result<(), EmptyExtent> {
    let n = within.ndim();
    if let Some(dim) = (0..n).find(|&d| within.extent.get(d) == 0) {
        return Err(EmptyExtent { dim });
    }
    let mut cuts: Vec<Vec<u64>> = Vec::with_capacity(n);
    for d in 0..n {
        let lo = within.offset.get(d);
        let hi = lo + within.extent.get(d);
        let mut c: Vec<u64> = Vec::with_capacity(2 * boxes.len() + 2);
        c.extend([lo, hi]);
        for b in boxes {
            for v in [b.offset.get(d), b.offset.get(d) + b.extent.get(d)] {
                if v > lo && v < hi {
                    c.push(v);
                }
            }
        }
        c.sort_unstable();
        c.dedup();
        cuts.push(c);
    }
    let mut idx = vec![0usize; n];
    loop {
        let mut cell = *within;
        for d in 0..n {
            cell.offset.set(d, cuts[d][idx[d]]);
            cell.extent.set(d, cuts[d][idx[d] + 1] - cuts[d][idx[d]]);
        }
        f(cell);
        // odometer, last dim fastest
        let mut d = n;
        loop {
            if d == 0 {
                return Ok(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] + 1 < cuts[d].len() {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Every gap in coverage: each canonical element must be held at least once in every replica.
/// A canonical tensor with no elements (a zero dimension) is an error.
pub fn coverage(side: &dyn SideLayout, cat: &Catalogue) -> Result<Vec<CoverageGap>, LayoutError> {
    let mut gaps = Vec::new();
    let dropped = side.dropped();
    for c in cat.tensors() {
        if dropped.contains(&c.name) {
            continue;
        }
        let holders = side.holders(&c.name);
        let full = Region::full(c.shape);
        for engine in 0..side.engines() {
            let boxes: Vec<Region> = holders
                .iter()
                .filter(|h| h.ranks.iter().any(|r| r.engine == engine))
                .map(|h| h.region)
                .collect();
            let mut first_gap = None;
            grid_cells(&full, &boxes, |cell| {
                if first_gap.is_none() && !boxes.iter().any(|b| b.contains(&cell)) {
                    first_gap = Some(cell);
                }
            })
            .map_err(|e| LayoutError::EmptyTensor {
                canonical: c.name.clone(),
                shape: c.shape,
                dim: e.dim,
            })?;
            if let Some(region) = first_gap {
                gaps.push(CoverageGap {
                    canonical: c.name.clone(),
                    engine,
                    region,
                });
            }
        }
    }
    Ok(gaps)
}

fn normalise(mut hs: Vec<Holder>) -> Vec<Holder> {
    for h in &mut hs {
        h.ranks.sort();
        h.ranks.dedup();
    }
    hs.sort_by(|a, b| {
        (&a.tensor, a.local_offset, a.region, &a.ranks).cmp(&(
            &b.tensor,
            b.local_offset,
            b.region,
            &b.ranks,
        ))
    });
    hs
}

/// Checks that a side's `holders` agree with its per-rank layouts (builds the world: small layouts only).
pub fn validate_holders(side: &dyn SideLayout, cat: &Catalogue) -> Result<(), String> {
    let explicit = ExplicitSide::from_side(side);
    for c in cat.tensors() {
        let lazy = normalise(side.holders(&c.name));
        let want = normalise(explicit.holders(&c.name));
        if lazy != want {
            return Err(format!(
                "holders(`{}`) disagree with the rank layouts:\n  holders(): {:?}\n  from ranks: {:?}",
                c.name, lazy, want
            ));
        }
    }
    Ok(())
}

/// Fills one rank's local tensors from full canonical tensors (padding stays zero).
///
/// `canonical(name)` returns a canonical tensor's bytes in its catalogue dtype.
pub fn materialize<'a>(
    layout: &RankLayout,
    cat: &Catalogue,
    canonical: &dyn Fn(&str) -> Option<&'a [u8]>,
) -> Result<Vec<Vec<u8>>, CopyError> {
    let mut out = Vec::with_capacity(layout.tensors.len());
    for t in &layout.tensors {
        let mut buf = vec![0u8; t.nbytes() as usize];
        for p in &t.placements {
            let (Some(c), Some(src)) = (cat.get(&p.canonical), canonical(&p.canonical)) else {
                continue;
            };
            copy_box_transposed(
                src,
                &c.shape,
                &p.region.offset,
                c.dtype,
                &mut buf,
                &t.shape,
                &p.local_offset,
                t.dtype,
                &p.region.extent,
                p.transpose(),
            )?;
        }
        out.push(buf);
    }
    Ok(out)
}

/// Rebuilds full canonical tensors from local tensors of some ranks (`buffers[i][j]`: rank i, tensor j).
///
/// Elements held by no given rank stay zero; elements held twice are taken from the later rank.
pub fn reconstruct(
    layouts: &[RankLayout],
    buffers: &[Vec<Vec<u8>>],
    cat: &Catalogue,
) -> Result<HashMap<String, Vec<u8>>, CopyError> {
    let mut out: HashMap<String, Vec<u8>> = HashMap::new();
    for (layout, bufs) in layouts.iter().zip(buffers) {
        for (t, buf) in layout.tensors.iter().zip(bufs) {
            for p in &t.placements {
                let Some(c) = cat.get(&p.canonical) else {
                    continue;
                };
                let dst = out
                    .entry(c.name.clone())
                    .or_insert_with(|| vec![0u8; c.nbytes() as usize]);
                copy_box_transposed(
                    buf,
                    &t.shape,
                    &p.local_offset,
                    t.dtype,
                    dst,
                    &c.shape,
                    &p.region.offset,
                    c.dtype,
                    &p.region.extent,
                    if p.transposed {
                        Transpose::Src
                    } else {
                        Transpose::None
                    },
                )?;
            }
        }
    }
    Ok(out)
}
