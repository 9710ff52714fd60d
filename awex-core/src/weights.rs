//! Deterministic canonical weights for demos and tests: every canonical byte is a function of
//! (tensor, version, offset).
//!
//! The source is either synthetic (pseudo-random bytes) or an HF checkpoint, whose bytes are
//! version 0; later versions flip bits of it with the synthetic stream, so every version differs.
//! [`Weights::Stepped`] makes versions as an optimiser does instead (a seeded fp32 master moved by
//! a bounded step of a given learning rate each version, cast to the tensor's dtype), so that
//! only the elements a real step would change differ from one version to the next: what deltas
//! are measured on.

use crate::dtype::DType;
use crate::model::Catalogue;

/// The SplitMix64 finaliser: a cheap, well-mixed 64-bit hash of `x` (the seeded streams of
/// [`Stepped`], the planner's tie-breaks, the benchmarks' contents and the GPU step kernel's
/// element picks all use it).
pub fn splitmix(mut x: u64) -> u64 {
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
    /// Versions made by optimiser-like steps ([`Stepped`]).
    Stepped(std::sync::Arc<Stepped>),
    /// Another source with some tensors rounded through a narrower dtype, as a trainer that
    /// holds them in it holds them (a bf16 FSDP trainer's `A_log` of an fp32 checkpoint): what
    /// its receivers get. Built by [`Weights::held_as`].
    HeldAs(std::sync::Arc<HeldAs>, Box<Weights>),
}

/// The tensors a trainer holds in a narrower dtype than the checkpoint's: name -> (the
/// checkpoint's dtype, the held one).
pub type HeldAs = std::collections::HashMap<String, (DType, DType)>;

/// Versions made as an optimiser makes them: an fp32 master per element (version 0: a seeded
/// init, or a checkpoint's values), moved at every version `k` by `lr * u_k`, then cast to the
/// tensor's dtype (bf16 and f16 round to nearest even). Version `v` is a closed form of
/// `(tensor, element, v)`: `master_0 + lr * (u_1 + ... + u_v)`, summed in f64 and rounded to
/// f32 once, so any rank computes any version alone (cost grows with `v`), with integer
/// arithmetic and one multiplication only: every machine computes the same bytes.
///
/// The model is calibrated on AdamW (`bench/delta_density.py`, docs/deltas.md): a transformers
/// Qwen3 trained in fp32 on CPU, lr 1e-6, random tokens, measured per step.
///
/// - The init is that of transformers' Qwen3 (`initializer_range` 0.02: normal, standard
///   deviation 0.02), made as the sum of 12 seeded uniforms (Irwin-Hall: normal to within its
///   tails, bounded at 6 standard deviations).
/// - Adam moves an element by `lr * m / (sqrt(v) + eps)`. Its first step is `lr * sign(g)`;
///   with noisy gradients `|m / sqrt(v)|` then falls and settles near [`ADAM_MEAN_STEP`] (mean
///   over elements). How many elements change in a step depends on the mean step and the
///   weights' distribution (measured: at the same mean step, uniform steps from the same init
///   change as many bf16 elements and e4m3 bytes as Adam's, within 2 %), so `u_k` is uniform
///   in `[-2 ADAM_MEAN_STEP, 2 ADAM_MEAN_STEP)`, drawn per element and version.
///
/// A bf16 element changes in a step when the master crosses a rounding boundary, with a
/// probability of about `lr |u| / ulp`: at lr 1e-6 about 1 % of the elements, and about 0.1 %
/// of the e4m3 bytes after 128 x 128 block quantisation, as Adam's steps after the first few
/// tens. Tensors of other dtypes (integers) take the synthetic stream.
#[derive(Clone)]
pub struct Stepped {
    /// The learning rate.
    pub lr: f64,
    dtypes: std::collections::HashMap<String, DType>,
    start: Option<std::sync::Arc<crate::model::Checkpoint>>,
}

/// The mean over elements of Adam's `|m / (sqrt(v) + eps)|` once its first steps are past: the
/// mean step of [`Stepped`] in units of the learning rate. Measured by `bench/delta_density.py`
/// (AdamW, betas 0.9 and 0.999, a tiny Qwen3 on random tokens): 0.178 over steps 41-60, 0.174
/// at step 60, falling slowly; for gradients of pure noise the theory gives `sqrt((1 - beta1) /
/// (1 + beta1)) * sqrt(2 / pi)` = 0.183. Early steps are larger (1 at the first, 0.28 at the
/// tenth) and change more: 4.2 % and 1.4 % of bf16 elements.
pub const ADAM_MEAN_STEP: f64 = 0.18;

/// The standard deviation of [`Stepped`]'s init (transformers' `initializer_range` for Qwen3).
pub const INIT_STD: f64 = 0.02;

/// Elements of one tensor computed at once by [`Stepped`].
const STEP_RUN: usize = 1024;

impl Stepped {
    /// Versions of the catalogue's tensors stepped at `lr` from a seeded init, or from
    /// `start`'s values (version 0 is then the checkpoint, widened and cast back exactly).
    pub fn new(
        cat: &Catalogue,
        lr: f64,
        start: Option<std::sync::Arc<crate::model::Checkpoint>>,
    ) -> Stepped {
        Stepped {
            lr,
            dtypes: cat
                .tensors()
                .iter()
                .map(|c| (c.name.clone(), c.dtype))
                .collect(),
            start,
        }
    }

    /// Element `i`'s master at version 0.
    fn init(&self, name: &str, seed0: u64, dtype: DType, i: u64) -> f64 {
        if let Some(ck) = &self.start
            && let Some(src) = ck.tensor(name)
        {
            let es = dtype.size();
            let at = i as usize * es;
            return match src.get(at..at + es) {
                Some(b) => element_to_f64(b, dtype),
                None => 0.0,
            };
        }
        // 12 uniforms of 32 bits from 6 hashes: their sum less 6 has mean 0 and variance 1
        let mut h = seed0 ^ i.wrapping_mul(0xd134_2543_de82_ef95);
        let mut sum = 0u64;
        for _ in 0..6 {
            h = splitmix(h);
            sum += (h >> 32) + (h & 0xffff_ffff);
        }
        (sum as f64 / 4_294_967_296.0 - 6.0) * INIT_STD
    }

    /// Writes the elements `[first, first + out.len() / es)` of tensor `name` at `version`.
    fn elements(&self, name: &str, dtype: DType, version: u64, first: u64, out: &mut [u8]) {
        let es = dtype.size();
        let n = out.len() / es;
        let seed0 = seed(name, 0) ^ 0x005e_ed0f_5eed;
        let mut master: Vec<f64> = (0..n as u64)
            .map(|j| self.init(name, seed0, dtype, first + j))
            .collect();
        let mut sum = vec![0i64; n];
        for k in 1..=version {
            let sk = seed(name, k) ^ 0x57e9_57e9;
            for (j, s) in sum.iter_mut().enumerate() {
                let h = splitmix(sk ^ (first + j as u64).wrapping_mul(0x9e6c_63d0_676a_9a99));
                // uniform in [-2^31, 2^31): the step u_k over 2 ADAM_MEAN_STEP, times 2^31
                *s += (h >> 32) as i64 - (1i64 << 31);
            }
        }
        let scale = self.lr * 2.0 * ADAM_MEAN_STEP / 2_147_483_648.0;
        for (m, s) in master.iter_mut().zip(&sum) {
            *m += *s as f64 * scale;
        }
        for (j, m) in master.iter().enumerate() {
            let x = *m as f32;
            let o = &mut out[j * es..(j + 1) * es];
            match dtype {
                DType::Bf16 => o.copy_from_slice(&crate::dtype::f32_to_bf16(x).to_le_bytes()),
                DType::F16 => o.copy_from_slice(&crate::dtype::f32_to_f16(x).to_le_bytes()),
                DType::F32 => o.copy_from_slice(&x.to_le_bytes()),
                _ => o.copy_from_slice(&(*m).to_le_bytes()[..es]),
            }
        }
    }

    fn bytes_at(&self, name: &str, version: u64, at: u64, out: &mut [u8]) {
        let dtype = match self.dtypes.get(name) {
            Some(d @ (DType::Bf16 | DType::F16 | DType::F32)) => *d,
            _ => return canonical_bytes_at(seed(name, version), at, out),
        };
        let es = dtype.size() as u64;
        let end = at + out.len() as u64;
        let mut e = at / es;
        let mut buf = vec![0u8; STEP_RUN * es as usize];
        while e * es < end {
            let n = ((end.div_ceil(es)) - e).min(STEP_RUN as u64);
            let run = &mut buf[..(n * es) as usize];
            self.elements(name, dtype, version, e, run);
            // the part of this run inside [at, end)
            let (lo, hi) = ((e * es).max(at), ((e + n) * es).min(end));
            out[(lo - at) as usize..(hi - at) as usize]
                .copy_from_slice(&run[(lo - e * es) as usize..(hi - e * es) as usize]);
            e += n;
        }
    }
}

/// One little-endian element of a float dtype, widened (0 for the others).
fn element_to_f64(b: &[u8], dtype: DType) -> f64 {
    match dtype {
        DType::Bf16 => crate::dtype::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
        DType::F16 => crate::dtype::f16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        _ => 0.0,
    }
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
            Weights::Stepped(s) => s.bytes_at(name, version, at, out),
            Weights::Finite(w) => {
                w.bytes_at(name, version, at, out);
                let first_odd = (at % 2 == 0) as usize;
                for b in out.iter_mut().skip(first_odd).step_by(2) {
                    *b &= !0x40;
                }
            }
            Weights::HeldAs(held, w) => match held.get(name) {
                None => w.bytes_at(name, version, at, out),
                Some(&(canonical, narrow)) => {
                    // whole elements around the range, each rounded through `narrow`
                    let es = canonical.size() as u64;
                    let (first, end) = (at / es * es, (at + out.len() as u64).div_ceil(es) * es);
                    let mut wide = vec![0u8; (end - first) as usize];
                    w.bytes_at(name, version, first, &mut wide);
                    let mut low = vec![0u8; wide.len() / es as usize * narrow.size()];
                    // both are float dtypes (`held_as` keeps no other): neither call fails
                    let _ = crate::dtype::convert(&wide, canonical, &mut low, narrow);
                    let _ = crate::dtype::convert(&low, narrow, &mut wide, canonical);
                    let skip = (at - first) as usize;
                    out.copy_from_slice(&wide[skip..skip + out.len()]);
                }
            },
        }
    }

    /// These weights as a trainer holds them when it keeps tensors of `held` (name, dtype) in
    /// a narrower float dtype than the catalogue's: each such tensor rounded through it (what
    /// every receiver of that trainer gets). Unchanged when none is narrower.
    pub fn held_as(
        self,
        cat: &Catalogue,
        held: impl IntoIterator<Item = (String, DType)>,
    ) -> Weights {
        let narrower: HeldAs = held
            .into_iter()
            .filter_map(|(name, d)| {
                let c = cat.get(&name)?.dtype;
                (c.is_float() && d.is_float() && d.size() < c.size()).then_some((name, (c, d)))
            })
            .collect();
        if narrower.is_empty() {
            self
        } else {
            Weights::HeldAs(std::sync::Arc::new(narrower), Box::new(self))
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
    fn weights_held_as_a_narrower_dtype_are_rounded_through_it_at_any_offset_and_nothing_else() {
        use crate::Dims;
        use crate::model::CanonicalTensor;
        let t = |name: &str, dtype| CanonicalTensor {
            name: name.into(),
            shape: Dims::new(&[64]),
            dtype,
        };
        let cat = Catalogue::new(vec![t("a_log", DType::F32), t("w", DType::Bf16)]);
        let held = [
            ("a_log".to_string(), DType::Bf16),
            // wider than the checkpoint, or unknown: kept as it is
            ("w".to_string(), DType::F32),
            ("missing".to_string(), DType::Bf16),
        ];
        let w = Weights::Synthetic.held_as(&cat, held.clone());
        let Weights::HeldAs(map, _) = &w else {
            panic!("a_log is held narrower")
        };
        assert_eq!(map.len(), 1);
        let mut raw = vec![0u8; 256];
        Weights::Synthetic.bytes_at("a_log", 2, 0, &mut raw);
        let mut got = vec![0u8; 256];
        w.bytes_at("a_log", 2, 0, &mut got);
        for (r, g) in raw.chunks_exact(4).zip(got.chunks_exact(4)) {
            let x = f32::from_le_bytes(r.try_into().unwrap());
            let want = bf16_to_f32(crate::dtype::f32_to_bf16(x));
            assert_eq!(g, want.to_le_bytes(), "{x}");
        }
        assert_ne!(raw, got);
        // any byte range is a slice of the whole
        let mut part = vec![0u8; 37];
        w.bytes_at("a_log", 2, 13, &mut part);
        assert_eq!(part, got[13..50]);
        // the other tensors are the source's
        let (mut a, mut b) = (vec![0u8; 128], vec![0u8; 128]);
        w.bytes_at("w", 2, 0, &mut a);
        Weights::Synthetic.bytes_at("w", 2, 0, &mut b);
        assert_eq!(a, b);
        // nothing narrower: the source itself
        let held = [("w".to_string(), DType::F32)];
        assert!(matches!(
            Weights::Synthetic.held_as(&cat, held),
            Weights::Synthetic
        ));
    }

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

    fn stepped(lr: f64) -> (Weights, Catalogue) {
        let cat = crate::synthetic::catalogue(&[vec![512, 1024]]);
        let w = Weights::Stepped(std::sync::Arc::new(Stepped::new(&cat, lr, None)));
        (w, cat)
    }

    fn changed_fraction(a: &[u8], b: &[u8]) -> f64 {
        let n = a.len() / 2;
        let k = a
            .chunks_exact(2)
            .zip(b.chunks_exact(2))
            .filter(|(x, y)| x != y)
            .count();
        k as f64 / n as f64
    }

    /// The e4m3 bytes and scales of a `[rows, cols]` bf16 tensor, awex's default recipe (vLLM's)
    /// with 128 x 128 blocks.
    fn fp8(rows: usize, cols: usize, bf16: &[u8]) -> (Vec<u8>, Vec<u32>) {
        use crate::encoding::{Fp8Quantiser, Recipe, Shape2d};
        let x: Vec<u16> = bf16
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let e = Recipe::Vllm.encoding([128, 128]);
        let [sr, sc] = e.scale_shape(rows as u64, cols as u64);
        let mut q = vec![0u8; rows * cols];
        let mut s = vec![0f32; (sr * sc) as usize];
        Fp8Quantiser::new(Recipe::Vllm, e)
            .quantise(
                &x,
                Shape2d::dense(rows, cols),
                &mut q,
                cols,
                &mut s,
                sc as usize,
            )
            .unwrap();
        (q, s.iter().map(|f| f.to_bits()).collect())
    }

    #[test]
    fn stepped_versions_change_as_many_bf16_elements_and_e4m3_bytes_as_adam_at_lr_1e_6() {
        // bench/delta_density.py on a tiny Qwen3 (AdamW, lr 1e-6, steps 41-60): 0.93 % of
        // bf16 elements and 0.091 % of e4m3 bytes changed per step; within a quarter of that
        let (w, cat) = stepped(1e-6);
        let v: Vec<Vec<u8>> = (0..4).map(|k| w.tensor(&cat, "t0", k).unwrap()).collect();
        let q: Vec<_> = v.iter().map(|b| fp8(512, 1024, b)).collect();
        for k in 1..4 {
            let f = changed_fraction(&v[k - 1], &v[k]);
            assert!((0.0070..0.0116).contains(&f), "step {k}: bf16 {f}");
            let e4m3 = q[k - 1]
                .0
                .iter()
                .zip(&q[k].0)
                .filter(|(a, b)| a != b)
                .count() as f64
                / q[k].0.len() as f64;
            assert!((0.00068..0.00114).contains(&e4m3), "step {k}: e4m3 {e4m3}");
        }
        // a larger learning rate changes more, and every value stays finite and within the
        // init's bounds
        let (w5, _) = stepped(1e-5);
        let f5 = changed_fraction(
            &w5.tensor(&cat, "t0", 1).unwrap(),
            &w5.tensor(&cat, "t0", 2).unwrap(),
        );
        assert!(f5 > changed_fraction(&v[1], &v[2]) * 3.0, "lr 1e-5: {f5}");
        let mut sq = 0.0f64;
        for x in v[3].chunks_exact(2) {
            let f = bf16_to_f32(u16::from_le_bytes([x[0], x[1]]));
            assert!(
                f.is_finite() && (f.abs() as f64) < 6.0 * INIT_STD + 1e-3,
                "{f}"
            );
            sq += (f as f64) * (f as f64);
        }
        // the init's standard deviation is transformers' Qwen3 initializer_range
        let std = (sq / (v[3].len() / 2) as f64).sqrt();
        assert!((std - INIT_STD).abs() < 0.02 * INIT_STD, "{std}");
    }

    #[test]
    fn stepped_bytes_at_any_offset_equal_the_whole_tensor() {
        let (w, cat) = stepped(1e-6);
        let all = w.tensor(&cat, "t0", 2).unwrap();
        for (at, len) in [
            (0usize, 1usize),
            (1, 3),
            (77, 2049),
            (2047, 4096),
            (all.len() - 5, 5),
        ] {
            let mut part = vec![0u8; len];
            w.bytes_at("t0", 2, at as u64, &mut part);
            assert_eq!(part, all[at..at + len], "at {at} len {len}");
        }
    }
}
