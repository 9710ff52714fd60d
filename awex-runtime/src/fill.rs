//! Fills a rank's tensors with, or checks them against, the canonical weights of a version
//! ([`awex_core::weights`]).

use crate::TensorSet;
use awex_core::dtype::DType;
use awex_core::encoding::{Encoding, Fp8Block, InferFp8, Shape2d};
use awex_core::layout::copy::StridedBox;
use awex_core::layout::{Dims, LocalTensor, RankLayout};
use awex_core::model::Catalogue;
pub use awex_core::weights::Weights;

/// [`fill_or_check_from`] with synthetic weights.
pub fn fill_or_check(
    layout: &RankLayout,
    cat: &Catalogue,
    tensors: &TensorSet,
    version: u64,
    check: bool,
) -> Result<(), String> {
    fill_or_check_from(&Weights::Synthetic, layout, cat, tensors, version, check)
}

/// Fills (`check = false`) or checks (`check = true`) a rank's tensors against the canonical
/// weights of `version`: placed boxes hold canonical bytes (converted to the local dtype),
/// everything else is zero. Returns the first mismatch, described.
pub fn fill_or_check_from(
    weights: &Weights,
    layout: &RankLayout,
    cat: &Catalogue,
    tensors: &TensorSet,
    version: u64,
    check: bool,
) -> Result<(), String> {
    fill_or_check_with(weights, layout, cat, tensors, version, check, None)
}

/// [`fill_or_check_from`] for a layout that may hold FP8 tensors: each FP8 tensor's expected
/// e4m3 bytes and scales are what `fp8`'s quantiser writes for the whole canonical tensors
/// (the checkpoint the reference quantiser would write from that version's weights), at the
/// placements' boxes; scale tensors are filled or checked with their weight.
pub fn fill_or_check_with(
    weights: &Weights,
    layout: &RankLayout,
    cat: &Catalogue,
    tensors: &TensorSet,
    version: u64,
    check: bool,
    fp8: Option<&InferFp8>,
) -> Result<(), String> {
    let mut row = Vec::new();
    let mut conv = Vec::new();
    for t in &layout.tensors {
        match &t.encoding {
            Encoding::Plain(_) => {}
            // written and checked with their weight
            Encoding::Fp8Scales(_) => continue,
            Encoding::Fp8Block(_) => {
                let fp8 = fp8.ok_or_else(|| {
                    format!(
                        "`{}` is FP8 but no FP8 config was given to fill or check it",
                        t.name
                    )
                })?;
                fp8_fill_or_check(weights, t, cat, tensors, version, check, fp8)?;
                continue;
            }
        }
        let v = tensors
            .get(&t.name)
            .ok_or_else(|| format!("`{}` is not registered", t.name))?;
        // SAFETY: filling happens while no update runs on these tensors.
        let bytes = unsafe { v.try_bytes_mut() }.map_err(|e| e.to_string())?;
        let es = t.dtype.size();
        let mut covered = vec![false; if check { t.shape.numel() as usize } else { 0 }];
        for p in &t.placements {
            let Some(c) = cat.get(&p.canonical) else {
                return Err(format!("unknown canonical `{}`", p.canonical));
            };
            let ce = c.dtype.size() as u64;
            let b = StridedBox::new_transposed(
                &c.shape,
                &p.region.offset,
                &t.shape,
                &p.local_offset,
                &p.region.extent,
                p.transpose(),
            )
            .map_err(|e| e.to_string())?;
            let mut err = None;
            b.for_each_run(|src, dst, n| {
                if err.is_some() {
                    return;
                }
                row.resize((n * ce) as usize, 0);
                weights.bytes_at(&p.canonical, version, src * ce, &mut row);
                let want: &[u8] = if c.dtype == t.dtype {
                    &row
                } else {
                    conv.resize(n as usize * es, 0);
                    if let Err(e) = awex_core::dtype::convert(&row, c.dtype, &mut conv, t.dtype) {
                        err = Some(e.to_string());
                        return;
                    }
                    &conv
                };
                let range = dst as usize * es..(dst + n) as usize * es;
                if check {
                    if bytes[range.clone()] != *want {
                        let off = bytes[range.clone()]
                            .iter()
                            .zip(want)
                            .position(|(a, b)| a != b)
                            .unwrap_or(0);
                        err = Some(format!(
                            "`{}` element {} (from `{}`) differs from version {version}",
                            t.name,
                            dst as usize + off / es,
                            p.canonical
                        ));
                    }
                    for c in &mut covered[dst as usize..(dst + n) as usize] {
                        *c = true;
                    }
                } else {
                    bytes[range].copy_from_slice(want);
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
        }
        if check
            && let Some(i) = covered
                .iter()
                .enumerate()
                .position(|(i, c)| !c && bytes[i * es..(i + 1) * es].iter().any(|&b| b != 0))
        {
            return Err(format!("`{}` padding element {i} is not zero", t.name));
        }
    }
    Ok(())
}

/// The expected e4m3 bytes and scales of FP8 tensor `t` at `version` (quantised from the
/// whole canonical tensors), written (`check = false`) or compared.
fn fp8_fill_or_check(
    weights: &Weights,
    t: &LocalTensor,
    cat: &Catalogue,
    tensors: &TensorSet,
    version: u64,
    check: bool,
    fp8: &InferFp8,
) -> Result<(), String> {
    let q = fp8.quantiser();
    let [bn, bk] = fp8.encoding().block.map(u64::from);
    let scale_name = Fp8Block::scale_name(&t.name);
    let qv = tensors
        .get(&t.name)
        .ok_or_else(|| format!("`{}` is not registered", t.name))?;
    let sv = tensors
        .get(&scale_name)
        .ok_or_else(|| format!("`{scale_name}` is not registered"))?;
    // SAFETY: filling and checking happen while no update runs on these tensors.
    let (qb, sb) = unsafe { (qv.try_bytes_mut(), sv.try_bytes_mut()) };
    let (qb, sb) = (
        qb.map_err(|e| e.to_string())?,
        sb.map_err(|e| e.to_string())?,
    );
    let nd = t.shape.ndim();
    let mut covered = vec![false; if check { qb.len() } else { 0 }];
    let block_dims = |d: &Dims, ceil: bool| {
        let mut v = d.as_slice().to_vec();
        let n = v.len();
        for (i, b) in [bn, bk].into_iter().enumerate() {
            v[n - 2 + i] = if ceil {
                v[n - 2 + i].div_ceil(b)
            } else {
                v[n - 2 + i] / b
            };
        }
        Dims::new(&v)
    };
    let scale_shape = block_dims(&t.shape, true);
    for p in &t.placements {
        let c = cat
            .get(&p.canonical)
            .ok_or_else(|| format!("unknown canonical `{}`", p.canonical))?;
        if p.transposed {
            return Err(format!(
                "`{}` is FP8 but places `{}` transposed; transposed boxes go into plain tensors only",
                t.name, c.name
            ));
        }
        let cs = c.shape.as_slice();
        let cd = cs.len();
        if cd < 2 || nd < 2 {
            return Err(format!(
                "`{}` is FP8 but `{}` is not a matrix",
                t.name, c.name
            ));
        }
        let (rows, cols) = (cs[cd - 2] as usize, cs[cd - 1] as usize);
        let mats = (c.numel() as usize) / (rows * cols).max(1);
        let raw = weights
            .tensor(cat, &c.name, version)
            .ok_or_else(|| format!("no weights for `{}`", c.name))?;
        let [sr, sc] = fp8
            .encoding()
            .scale_shape(rows as u64, cols as u64)
            .map(|x| x as usize);
        let mut cq = vec![0u8; mats * rows * cols];
        let mut cscale = vec![0f32; mats * sr * sc];
        for m in 0..mats {
            let (e0, s0) = (m * rows * cols, m * sr * sc);
            let shape = Shape2d::dense(rows, cols);
            let (qm, smat) = (&mut cq[e0..e0 + rows * cols], &mut cscale[s0..s0 + sr * sc]);
            let r = match c.dtype {
                DType::F32 => {
                    let x: Vec<f32> = raw[e0 * 4..(e0 + rows * cols) * 4]
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    q.quantise(&x, shape, qm, cols, smat, sc)
                }
                _ => {
                    let x: Vec<u16> = raw[e0 * 2..(e0 + rows * cols) * 2]
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect();
                    q.quantise(&x, shape, qm, cols, smat, sc)
                }
            };
            r.map_err(|e| format!("quantising `{}` at version {version}: {e}", c.name))?;
        }
        let scale_bytes: Vec<u8> = cscale.iter().flat_map(|f| f.to_le_bytes()).collect();
        // the weight's box in elements, then its scales' box in blocks
        for (es, src, dst, local_shape, canon_shape, region, local_offset, what) in [
            (
                1usize,
                &cq[..],
                &mut *qb,
                t.shape,
                c.shape,
                p.region,
                p.local_offset,
                "element",
            ),
            (
                4,
                &scale_bytes[..],
                &mut *sb,
                scale_shape,
                block_dims(&c.shape, true),
                awex_core::layout::Region {
                    offset: block_dims(&p.region.offset, false),
                    extent: block_dims(&p.region.extent, true),
                },
                block_dims(&p.local_offset, false),
                "scale",
            ),
        ] {
            let b = StridedBox::new(
                &canon_shape,
                &region.offset,
                &local_shape,
                &local_offset,
                &region.extent,
            )
            .map_err(|e| e.to_string())?;
            let mut err = None;
            b.for_each_run(|s, d, n| {
                if err.is_some() {
                    return;
                }
                let want = &src[s as usize * es..(s + n) as usize * es];
                let range = d as usize * es..(d + n) as usize * es;
                if !check {
                    dst[range].copy_from_slice(want);
                    return;
                }
                if dst[range.clone()] != *want {
                    let off = dst[range.clone()]
                        .iter()
                        .zip(want)
                        .position(|(a, b)| a != b)
                        .unwrap_or(0);
                    err = Some(format!(
                        "`{}` {what} {} (from `{}`, quantised with recipe {}) differs from version {version}",
                        if es == 1 { t.name.to_string() } else { scale_name.clone() },
                        d as usize + off / es,
                        p.canonical,
                        q.recipe.name()
                    ));
                }
                if es == 1 {
                    for c in &mut covered[d as usize..(d + n) as usize] {
                        *c = true;
                    }
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
        }
    }
    if check
        && let Some(i) = covered
            .iter()
            .zip(qb.iter())
            .position(|(c, b)| !c && *b != 0)
    {
        return Err(format!("`{}` padding element {i} is not zero", t.name));
    }
    Ok(())
}

/// Cuts a rank layout into at most `parts` layouts of about equal bytes (whole tensors each),
/// so that filling or checking can run on several threads.
pub fn split_layout(layout: &RankLayout, parts: usize) -> Vec<RankLayout> {
    let parts = parts.clamp(1, layout.tensors.len().max(1));
    let mut out: Vec<RankLayout> = (0..parts)
        .map(|_| RankLayout {
            rank: layout.rank,
            tensors: Vec::new(),
        })
        .collect();
    let mut load = vec![0u64; parts];
    let mut order: Vec<&awex_core::layout::LocalTensor> = layout.tensors.iter().collect();
    // largest first, each to the least-loaded part
    order.sort_by_key(|t| std::cmp::Reverse(t.nbytes()));
    for t in order {
        let (i, _) = load
            .iter()
            .enumerate()
            .min_by_key(|&(i, &l)| (l, i))
            .unwrap_or((0, &0));
        load[i] += t.nbytes();
        out[i].tensors.push(t.clone());
    }
    out.retain(|l| !l.tensors.is_empty());
    out
}

/// [`fill_or_check_from`] on every core: the layout's tensors split over threads.
pub fn fill_or_check_parallel(
    weights: &Weights,
    layout: &RankLayout,
    cat: &Catalogue,
    tensors: &TensorSet,
    version: u64,
    check: bool,
) -> Result<(), String> {
    fill_or_check_parallel_with(weights, layout, cat, tensors, version, check, None)
}

/// [`fill_or_check_with`] on every core: the layout's tensors split over threads.
pub fn fill_or_check_parallel_with(
    weights: &Weights,
    layout: &RankLayout,
    cat: &Catalogue,
    tensors: &TensorSet,
    version: u64,
    check: bool,
    fp8: Option<&InferFp8>,
) -> Result<(), String> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let parts = split_layout(layout, threads);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let jobs: Vec<_> = parts
            .iter()
            .map(|part| {
                s.spawn(move || {
                    fill_or_check_with(weights, part, cat, tensors, version, check, fp8)
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err("a fill thread panicked".into()))
            })
            .collect()
    });
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use awex_core::layout::{Dims, LocalTensor, RankId};
    use std::sync::Arc;

    fn tensor(name: &str, rows: u64) -> LocalTensor {
        LocalTensor {
            name: Arc::from(name),
            shape: Dims::new(&[rows, 4]),
            dtype: awex_core::DType::Bf16,
            encoding: awex_core::encoding::Encoding::Plain(awex_core::DType::Bf16),
            placements: vec![],
        }
    }

    #[test]
    fn layout_splits_into_parts_of_about_equal_bytes_keeping_every_tensor_once() {
        let layout = RankLayout {
            rank: RankId::train(0),
            tensors: vec![
                tensor("a", 10),
                tensor("b", 40),
                tensor("c", 30),
                tensor("d", 20),
                tensor("e", 20),
            ],
        };
        let parts = split_layout(&layout, 2);
        let names: Vec<Vec<&str>> = parts
            .iter()
            .map(|p| p.tensors.iter().map(|t| &*t.name).collect())
            .collect();
        assert_eq!(names, vec![vec!["b", "e"], vec!["c", "d", "a"]]);
        let bytes: Vec<u64> = parts
            .iter()
            .map(|p| p.tensors.iter().map(|t| t.nbytes()).sum())
            .collect();
        assert_eq!(bytes, vec![480, 480]);
        // more parts than tensors: one tensor each; an empty layout: one empty part at most
        assert_eq!(split_layout(&layout, 64).len(), 5);
        let empty = RankLayout {
            rank: RankId::train(0),
            tensors: vec![],
        };
        assert!(split_layout(&empty, 4).is_empty());
    }
}
