//! Fills a rank's tensors with, or checks them against, the canonical weights of a version
//! ([`awex_core::weights`]).

use crate::TensorSet;
use awex_core::layout::RankLayout;
use awex_core::layout::copy::StridedBox;
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
    let mut row = Vec::new();
    let mut conv = Vec::new();
    for t in &layout.tensors {
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
            let b = StridedBox::new(
                &c.shape,
                &p.region.offset,
                &t.shape,
                &p.local_offset,
                &p.region.extent,
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
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let parts = split_layout(layout, threads);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let jobs: Vec<_> = parts
            .iter()
            .map(|part| {
                s.spawn(move || fill_or_check_from(weights, part, cat, tensors, version, check))
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
