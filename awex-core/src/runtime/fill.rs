//! Deterministic weights for demos and tests: every canonical byte is a function of (tensor, version, offset).
//!
//! The source is either synthetic (pseudo-random bytes) or an HF checkpoint, whose bytes are
//! version 0; later versions flip bits of it with the synthetic stream, so every version differs.

use crate::layout::RankLayout;
use crate::layout::copy::StridedBox;
use crate::model::Catalogue;
use crate::runtime::TensorSet;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The seed of canonical tensor `name` at `version`.
pub fn seed(name: &str, version: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), version)
}

/// Writes canonical bytes `[at, at + out.len())` of the tensor with `seed` into `out`.
pub fn canonical_bytes_at(seed: u64, at: u64, out: &mut [u8]) {
    let mut i = 0usize;
    while i < out.len() {
        let pos = at + i as u64;
        let word = splitmix(seed ^ (pos / 8).wrapping_mul(0xd134_2543_de82_ef95)).to_le_bytes();
        let from = (pos % 8) as usize;
        let n = (8 - from).min(out.len() - i);
        out[i..i + n].copy_from_slice(&word[from..from + n]);
        i += n;
    }
}

/// Where canonical weights come from.
#[derive(Clone)]
pub enum Weights {
    /// Pseudo-random bytes per (tensor, version).
    Synthetic,
    /// An HF checkpoint (version 0), perturbed deterministically for later versions.
    Checkpoint(std::sync::Arc<crate::model::Checkpoint>),
}

impl Weights {
    /// Canonical bytes `[at, at + out.len())` of tensor `name` at `version`.
    pub fn bytes_at(&self, name: &str, version: u64, at: u64, out: &mut [u8]) {
        match self {
            Weights::Synthetic => canonical_bytes_at(seed(name, version), at, out),
            Weights::Checkpoint(ck) => {
                let src = ck.tensor(name).unwrap_or(&[]);
                let a = (at as usize).min(src.len());
                let b = (a + out.len()).min(src.len());
                out[..b - a].copy_from_slice(&src[a..b]);
                out[b - a..].fill(0);
                if version > 0 {
                    let mut noise = vec![0u8; out.len()];
                    canonical_bytes_at(seed(name, version), at, &mut noise);
                    for (o, n) in out.iter_mut().zip(noise) {
                        *o ^= n;
                    }
                }
            }
        }
    }

    /// A whole canonical tensor at `version`.
    pub fn tensor(&self, cat: &Catalogue, name: &str, version: u64) -> Option<Vec<u8>> {
        let c = cat.get(name)?;
        let mut v = vec![0u8; c.nbytes() as usize];
        self.bytes_at(name, version, 0, &mut v);
        Some(v)
    }
}

/// A whole canonical tensor's bytes at `version`.
pub fn canonical_tensor(cat: &Catalogue, name: &str, version: u64) -> Option<Vec<u8>> {
    let c = cat.get(name)?;
    let mut v = vec![0u8; c.nbytes() as usize];
    canonical_bytes_at(seed(name, version), 0, &mut v);
    Some(v)
}

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
                    if let Err(e) = crate::dtype::convert(&row, c.dtype, &mut conv, t.dtype) {
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
