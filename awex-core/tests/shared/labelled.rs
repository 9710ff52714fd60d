//! Labelled checkpoints and the numpy-like slicing the gpt-oss layout references need, shared by
//! `awex-sglang/tests/gpt_oss.rs` and `awex-vllm/tests/gpt_oss.rs` (each includes this file with
//! `#[path]`): every element of a canonical tensor holds its own label, so a rank's bytes say
//! exactly which checkpoint elements it holds.

use awex_core::dtype::{bf16_to_f32, f32_to_bf16};
use awex_core::model::Catalogue;
use std::collections::HashMap;

/// A tensor as `(shape, f32 elements)`.
pub type Tensor = (Vec<usize>, Vec<f32>);

/// The value of element `i` of canonical tensor number `t`: exact in f32 for the tiny model.
pub fn label(t: usize, i: usize) -> f32 {
    ((t + 1) * (1 << 17) + i) as f32
}

/// The checkpoint: every canonical tensor of `cat`, each element its label (tensors numbered
/// in name order, as `engines/tests/write_gpt_oss_expected.py` numbers them).
pub fn checkpoint(cat: &Catalogue) -> HashMap<String, Tensor> {
    let mut sorted: Vec<_> = cat.tensors().iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    sorted
        .into_iter()
        .enumerate()
        .map(|(t, c)| {
            let shape: Vec<usize> = c.shape.as_slice().iter().map(|&d| d as usize).collect();
            let n: usize = shape.iter().product();
            assert!(n < 1 << 17, "{} is too large to label", c.name);
            (
                c.name.clone(),
                (shape, (0..n).map(|i| label(t, i)).collect()),
            )
        })
        .collect()
}

/// Rows `[a, b)` of the leading dim of `x` (all of them when `b` is past the end; zero rows
/// after the end up to `b - a` when `pad`).
pub fn rows(x: &Tensor, a: usize, b: usize, pad: bool) -> Tensor {
    let row: usize = x.0[1..].iter().product();
    let have = x.0[0].min(b).saturating_sub(a);
    let n = if pad { b - a } else { have };
    let mut data = vec![0f32; n * row];
    data[..have * row].copy_from_slice(&x.1[a * row..(a + have) * row]);
    let mut shape = x.0.clone();
    shape[0] = n;
    (shape, data)
}

/// Columns `[a, b)` of the last dim of `x`.
pub fn cols(x: &Tensor, a: usize, b: usize) -> Tensor {
    let last = *x.0.last().unwrap();
    let outer = x.1.len() / last;
    let data = (0..outer)
        .flat_map(|o| x.1[o * last + a..o * last + b].iter().copied())
        .collect();
    let mut shape = x.0.clone();
    *shape.last_mut().unwrap() = b - a;
    (shape, data)
}

/// `x[:, a..b, :]` of a 3-d tensor.
pub fn mid(x: &Tensor, a: usize, b: usize) -> Tensor {
    let (e, m, l) = (x.0[0], x.0[1], x.0[2]);
    let data = (0..e)
        .flat_map(|i| x.1[(i * m + a) * l..(i * m + b) * l].iter().copied())
        .collect();
    (vec![e, b - a, l], data)
}

/// The last two dims of a 3-d tensor swapped.
pub fn swap(x: &Tensor) -> Tensor {
    let (e, m, l) = (x.0[0], x.0[1], x.0[2]);
    let mut data = vec![0f32; x.1.len()];
    for i in 0..e {
        for a in 0..m {
            for b in 0..l {
                data[(i * l + b) * m + a] = x.1[(i * m + a) * l + b];
            }
        }
    }
    (vec![e, l, m], data)
}

/// The tensors stacked along their leading dim.
pub fn cat_rows(parts: &[Tensor]) -> Tensor {
    let mut shape = parts[0].0.clone();
    shape[0] = parts.iter().map(|p| p.0[0]).sum();
    (
        shape,
        parts.iter().flat_map(|p| p.1.iter().copied()).collect(),
    )
}

/// `x` rounded to bf16 (round to nearest even, as torch's `.to(torch.bfloat16)`).
pub fn bf16(x: &Tensor) -> Tensor {
    let round = |v: f32| bf16_to_f32(f32_to_bf16(v));
    (x.0.clone(), x.1.iter().map(|&v| round(v)).collect())
}

/// `engines/tests/write_gpt_oss_expected.py`'s checksum of a bf16 tensor's labels.
pub fn checksum(v: &[f32]) -> u64 {
    v.iter().enumerate().fold(0u64, |a, (i, &x)| {
        a.wrapping_add((x as u64).wrapping_mul(i as u64 + 1))
    })
}
