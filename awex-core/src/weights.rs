//! Deterministic canonical weights for demos and tests: every canonical byte is a function of
//! (tensor, version, offset).
//!
//! The source is either synthetic (pseudo-random bytes) or an HF checkpoint, whose bytes are
//! version 0; later versions flip bits of it with the synthetic stream, so every version differs.

use crate::model::Catalogue;

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
    /// Another source with bit 6 of every odd byte cleared: the top exponent bit of every
    /// little-endian bf16 or f16 element and of every f32's high byte, so every float is finite
    /// (|x| < 2 in bf16 and f32, < 2 in f16). What an FP8 inference side is fed: its
    /// quantisers refuse infinity and NaN, which random bytes hold about once in 256 elements.
    Finite(Box<Weights>),
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
            Weights::Finite(w) => {
                w.bytes_at(name, version, at, out);
                let first_odd = (at % 2 == 0) as usize;
                for b in out.iter_mut().skip(first_odd).step_by(2) {
                    *b &= !0x40;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::bf16_to_f32;

    #[test]
    fn finite_weights_hold_no_infinity_or_nan_at_any_offset_and_differ_from_the_source_only_there()
    {
        let w = Weights::Finite(Box::new(Weights::Synthetic));
        let mut all = vec![0u8; 1 << 16];
        w.bytes_at("t", 3, 0, &mut all);
        let mut raw = vec![0u8; 1 << 16];
        Weights::Synthetic.bytes_at("t", 3, 0, &mut raw);
        let mut nonfinite = 0;
        for (i, (a, r)) in all.chunks_exact(2).zip(raw.chunks_exact(2)).enumerate() {
            let (a, r) = (
                u16::from_le_bytes([a[0], a[1]]),
                u16::from_le_bytes([r[0], r[1]]),
            );
            assert!(bf16_to_f32(a).is_finite(), "element {i}: {a:#06x}");
            assert_eq!(a, r & !0x4000, "element {i}");
            nonfinite += usize::from(!bf16_to_f32(r).is_finite());
        }
        // the synthetic stream itself holds non-finite values (why Finite exists)
        assert!(nonfinite > 0);
        // a read at an odd offset sees the same bytes
        let mut part = vec![0u8; 101];
        w.bytes_at("t", 3, 77, &mut part);
        assert_eq!(part, all[77..178]);
    }
}
