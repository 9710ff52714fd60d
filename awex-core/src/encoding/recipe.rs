//! The block quantisers awex reproduces, one per torch reference, selectable by name.
//!
//! Every recipe computes, per block, `amax = max |x|` in fp32 (zero padding beyond the
//! matrix's edge, as each reference pads), a scale `sf` (what `weight_scale_inv` stores) and
//! the element rule; the fp32 operation order is the reference's own, since `x * (1 / sf)`,
//! `x / sf` and `x * (448 / amax)` round differently. Where a reference divides a tensor by a
//! Python float (`amax / 448.0`), torch's answer depends on the device ([`TorchDevice`]).
//!
//! | name | reference | scale | element |
//! | --- | --- | --- | --- |
//! | `vllm` (default; alias `deepgemm`) | vLLM 0.33 `vllm/utils/deep_gemm.py::per_block_cast_to_fp8` (what `online/fp8.py` runs), DeepGEMM `deep_gemm/utils/math.py::per_block_cast_to_fp8(use_ue8m0=False)` | `clamp(amax, 1e-4) / 448` | `x * (1 / sf)` |
//! | `vllm-ue8m0` | the same with `use_ue8m0=True` (`_ceil_to_ue8m0`: `2 ** ceil(log2(sf))`) | power of two | `x * (1 / sf)` |
//! | `deepgemm-ue8m0` | DeepGEMM `per_block_cast_to_fp8(use_ue8m0=True)` (`ceil_to_ue8m0` on the bits) | power of two | `x * (1 / sf)` |
//! | `deepgemm-legacy` | DeepGEMM's early `tests/test_core.py::per_block_cast_to_fp8` | `clamp(amax, 1e-4) / 448` | `x * (448 / amax)` |
//! | `awex-python` | inclusionAI/Awex `awex/converter/weights_converter.py::per_block_cast_to_fp8` | `clamp(amax, 1e-4) / 448` | `x / sf` |
//! | `awex-python-ue8m0` | the same with `scale_ue8m0=True` (`max(sf, 1e-10).log2().ceil().exp2()`) | power of two | `x / sf` |
//! | `slime` | THUDM/slime `slime/utils/fp8_kernel.py::_blockwise_cast_to_fp8_triton` | `max(amax, 1e-10) / 448` | `clamp(x * (1 / sf), -448, 448)` |
//! | `slime-pow2` | the same with `force_pow_2_scale=True` (`exp2(ceil(log2(sf)))`) | power of two | as `slime` |
//! | `sglang-ue8m0` | SGLang 0.5.23 `fp8_utils.py::requant_weight_ue8m0` over a `vllm` quantisation: dequantise to bf16 (`block_quant_dequant`), requantise with its `per_block_cast_to_fp8` (DeepGEMM's UE8M0) | power of two | `x * (1 / sf)` of the bf16 dequantisation |
//!
//! The `log2` recipes (`vllm-ue8m0`, `awex-python-ue8m0`, `slime-pow2`) take the correctly
//! rounded fp32 `log2`; torch's and Triton's `log2` may differ from it by one ulp, which
//! changes the scale only when `sf` lies within about 2^-20 (relative) above a power of two.
//! slime's Triton kernel, compiled on an H200, computes `_absmax / fp8_max` as `_absmax *
//! fl(1/448)` and `1.0 / x_s` exactly: `slime` on [`TorchDevice::Cuda`] gives its bytes.

use super::e4m3;
use super::fp8_block::{Fp8Block, ScaleFormat};
use crate::dtype::{bf16_to_f32, f32_to_bf16};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How torch evaluated `tensor / python_float` in the reference.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TorchDevice {
    /// On CUDA, where the engines quantise: aten's `div_true_kernel_cuda` multiplies by the
    /// fp32 reciprocal of a CPU scalar (`amax * fl(1 / 448)`).
    #[default]
    Cuda,
    /// On the CPU: a true division (`amax / 448`).
    Cpu,
}

/// A block quantiser, named after the torch code whose bytes it reproduces (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Recipe {
    /// vLLM's (and DeepGEMM's current) `x * (1 / (amax / 448))`; the default.
    #[default]
    #[serde(rename = "vllm")]
    Vllm,
    /// vLLM's with `use_ue8m0=True` (`2 ** ceil(log2(sf))`).
    #[serde(rename = "vllm-ue8m0")]
    VllmUe8m0,
    /// DeepGEMM's with `use_ue8m0=True` (`ceil_to_ue8m0` on the fp32 bits).
    #[serde(rename = "deepgemm-ue8m0")]
    DeepGemmUe8m0,
    /// DeepGEMM's early tests: `x * (448 / amax)`.
    #[serde(rename = "deepgemm-legacy")]
    DeepGemmLegacy,
    /// The Python Awex: `x / (amax / 448)`.
    #[serde(rename = "awex-python")]
    AwexPython,
    /// The Python Awex with `scale_ue8m0=True`.
    #[serde(rename = "awex-python-ue8m0")]
    AwexPythonUe8m0,
    /// slime's Triton kernel: `clamp(x * (1 / (max(amax, 1e-10) / 448)), -448, 448)`.
    #[serde(rename = "slime")]
    Slime,
    /// slime's Triton kernel with `force_pow_2_scale=True`.
    #[serde(rename = "slime-pow2")]
    SlimePow2,
    /// What SGLang serves after its UE8M0 requantisation of a `vllm`-quantised checkpoint.
    #[serde(rename = "sglang-ue8m0")]
    SglangUe8m0,
}

/// What one block's elements go through once its scale is known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Op {
    /// `e4m3(x * m)`
    Mul(f32),
    /// `e4m3(x / d)`
    Div(f32),
    /// `e4m3(clamp(x * m, -448, 448))`
    MulClamp(f32),
    /// `e4m3(bf16(e4m3(x * r1) * s1) * r2)`: a quantisation, the engine's dequantisation to
    /// bf16, and a second quantisation.
    Requant {
        /// first multiplier
        r1: f32,
        /// first scale
        s1: f32,
        /// second multiplier
        r2: f32,
    },
}

/// The fp32 `clamp(1e-4)` of torch (the Python float rounded to the tensor's dtype).
const CLAMP_MIN: f32 = 1e-4;
/// slime's `eps` argument and Awex's UE8M0 floor.
const EPS: f32 = 1e-10;
/// `fl32(1 / 448)`: what CUDA torch multiplies by for `/ 448.0`.
const RECIP_448: f32 = (1.0f64 / 448.0) as f32;

/// `amax / 448.0` as torch computes it on `dev`.
#[inline]
fn div448(a: f32, dev: TorchDevice) -> f32 {
    match dev {
        TorchDevice::Cuda => a * RECIP_448,
        TorchDevice::Cpu => a / 448.0,
    }
}

/// DeepGEMM's `ceil_to_ue8m0`: the smallest power of two >= |x|, from the bits (exponent
/// clamped to 1..=254).
pub fn ceil_ue8m0_bits(x: f32) -> f32 {
    let bits = x.abs().to_bits();
    let exp = ((bits >> 23) & 0xff) + u32::from(bits & 0x7f_ffff != 0);
    f32::from_bits(exp.clamp(1, 254) << 23)
}

/// `2 ** ceil(log2(x))` with the correctly rounded fp32 `log2`.
pub fn ceil_pow2_log2(x: f32) -> f32 {
    let l = (x.abs() as f64).log2() as f32;
    (l.ceil() as f64).exp2() as f32
}

impl Recipe {
    /// Every recipe, in a fixed order.
    pub const ALL: [Recipe; 9] = [
        Recipe::Vllm,
        Recipe::VllmUe8m0,
        Recipe::DeepGemmUe8m0,
        Recipe::DeepGemmLegacy,
        Recipe::AwexPython,
        Recipe::AwexPythonUe8m0,
        Recipe::Slime,
        Recipe::SlimePow2,
        Recipe::SglangUe8m0,
    ];

    /// The recipe's name (`vllm`, `deepgemm-ue8m0`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Recipe::Vllm => "vllm",
            Recipe::VllmUe8m0 => "vllm-ue8m0",
            Recipe::DeepGemmUe8m0 => "deepgemm-ue8m0",
            Recipe::DeepGemmLegacy => "deepgemm-legacy",
            Recipe::AwexPython => "awex-python",
            Recipe::AwexPythonUe8m0 => "awex-python-ue8m0",
            Recipe::Slime => "slime",
            Recipe::SlimePow2 => "slime-pow2",
            Recipe::SglangUe8m0 => "sglang-ue8m0",
        }
    }

    /// How the recipe's scales are stored.
    pub const fn scale_format(self) -> ScaleFormat {
        match self {
            Recipe::Vllm | Recipe::DeepGemmLegacy | Recipe::AwexPython | Recipe::Slime => {
                ScaleFormat::F32
            }
            _ => ScaleFormat::Ue8m0,
        }
    }

    /// The encoding this recipe writes for `block`: its scale format.
    pub fn encoding(self, block: [u32; 2]) -> Fp8Block {
        Fp8Block {
            block,
            scale_format: self.scale_format(),
        }
    }

    /// The block shape the reference is limited to, if any (SGLang's requantisation asserts
    /// `[128, 128]`).
    pub const fn required_block(self) -> Option<[u32; 2]> {
        match self {
            Recipe::SglangUe8m0 => Some([128, 128]),
            _ => None,
        }
    }

    /// The recipe that gives this one's bytes for every block of bf16 weights quantised in the
    /// CUDA order (what the GPU kernel quantises): `deepgemm-ue8m0` for `vllm-ue8m0`, whose
    /// `2 ** ceil(log2(sf))` differs from rounding the fp32 bits up only for scales a few ulps
    /// above a power of two, which no bf16 amax times fl(1/448) lands on (checked for every
    /// finite bf16 amax in this module's tests); itself for the others.
    pub const fn on_bf16(self) -> Recipe {
        match self {
            Recipe::VllmUe8m0 => Recipe::DeepGemmUe8m0,
            other => other,
        }
    }

    /// The scale and element rule of a block whose largest magnitude is `amax` (finite).
    pub(crate) fn rule(self, amax: f32, dev: TorchDevice) -> (f32, Op) {
        let clamped = amax.max(CLAMP_MIN);
        match self {
            Recipe::Vllm => {
                let sf = div448(clamped, dev);
                (sf, Op::Mul(1.0 / sf))
            }
            Recipe::VllmUe8m0 => {
                let sf = ceil_pow2_log2(div448(clamped, dev));
                (sf, Op::Mul(1.0 / sf))
            }
            Recipe::DeepGemmUe8m0 => {
                let sf = ceil_ue8m0_bits(div448(clamped, dev));
                (sf, Op::Mul(1.0 / sf))
            }
            Recipe::DeepGemmLegacy => {
                // `448.0 / amax` is `amax.reciprocal() * 448.0` (torch's Tensor.__rtruediv__)
                (div448(clamped, dev), Op::Mul((1.0 / clamped) * 448.0))
            }
            Recipe::AwexPython => {
                let sf = div448(clamped, dev);
                (sf, Op::Div(sf))
            }
            Recipe::AwexPythonUe8m0 => {
                let sf = ceil_pow2_log2(div448(clamped, dev).max(EPS));
                (sf, Op::Div(sf))
            }
            Recipe::Slime | Recipe::SlimePow2 => {
                // the compiled Triton kernel multiplies by fl(1/448), as CUDA torch does
                let mut s = div448(amax.max(EPS), dev);
                if self == Recipe::SlimePow2 {
                    s = ceil_pow2_log2(s);
                }
                (s, Op::MulClamp(1.0 / s))
            }
            Recipe::SglangUe8m0 => {
                let (s1, op1) = Recipe::Vllm.rule(amax, dev);
                let r1 = match op1 {
                    Op::Mul(r) => r,
                    _ => 1.0 / s1,
                };
                // every step is monotonic in |x|, so the dequantised block's amax is that of
                // the dequantised amax
                let deq = bf16_to_f32(f32_to_bf16(e4m3::to_f32(e4m3::from_f32(amax * r1)) * s1));
                let s2 = ceil_ue8m0_bits(div448(deq.abs().max(CLAMP_MIN), dev));
                (
                    s2,
                    Op::Requant {
                        r1,
                        s1,
                        r2: 1.0 / s2,
                    },
                )
            }
        }
    }
}

impl Op {
    /// One element's e4m3 byte.
    #[inline(always)]
    pub(crate) fn apply(self, x: f32) -> u8 {
        match self {
            Op::Mul(m) => e4m3::from_f32(x * m),
            Op::Div(d) => e4m3::from_f32(x / d),
            Op::MulClamp(m) => e4m3::from_f32((x * m).clamp(-e4m3::MAX, e4m3::MAX)),
            Op::Requant { r1, s1, r2 } => {
                let q1 = e4m3::to_f32(e4m3::from_f32(x * r1));
                e4m3::from_f32(bf16_to_f32(f32_to_bf16(q1 * s1)) * r2)
            }
        }
    }
}

impl fmt::Display for Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A recipe name awex does not know.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "unknown FP8 block quantiser `{0}`; known: vllm (default), deepgemm (= vllm), vllm-ue8m0, deepgemm-ue8m0, deepgemm-legacy, awex-python, awex-python-ue8m0, slime, slime-pow2, sglang-ue8m0"
)]
pub struct UnknownRecipe(pub String);

impl FromStr for Recipe {
    type Err = UnknownRecipe;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "deepgemm" {
            return Ok(Recipe::Vllm);
        }
        Recipe::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| UnknownRecipe(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_bf16_gives_the_same_scale_and_rule_for_every_finite_bf16_amax() {
        for r in Recipe::ALL {
            let same = r.on_bf16();
            for hi in 0u32..0x7f80 {
                let amax = f32::from_bits(hi << 16);
                let (a, b) = (
                    r.rule(amax, TorchDevice::Cuda),
                    same.rule(amax, TorchDevice::Cuda),
                );
                assert!(
                    a.0.to_bits() == b.0.to_bits() && a.1 == b.1,
                    "{r} and {same} differ at amax {amax:e}: {a:?} vs {b:?}"
                );
            }
        }
        // the two pow2 rules do differ on fp32 amax (a scale 1 ulp above 2^4): the mapping is
        // for bf16 weights only
        let sf = f32::from_bits((131 << 23) | 1);
        assert_ne!(ceil_pow2_log2(sf), ceil_ue8m0_bits(sf));
    }

    #[test]
    fn names_round_trip_and_unknown_names_list_the_known_ones() {
        for r in Recipe::ALL {
            assert_eq!(r.name().parse::<Recipe>(), Ok(r));
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.name())
            );
        }
        assert_eq!("deepgemm".parse::<Recipe>(), Ok(Recipe::Vllm));
        let e = "fp8-fast".parse::<Recipe>().unwrap_err().to_string();
        assert!(e.starts_with("unknown FP8 block quantiser `fp8-fast`; known: vllm (default)"));
    }

    #[test]
    fn cuda_and_cpu_torch_divide_by_448_differently() {
        // amax / 448 as a true division and as a multiplication by fl(1/448) disagree here
        let a = f32::from_bits(0x3f80_0004);
        assert_ne!(div448(a, TorchDevice::Cuda), div448(a, TorchDevice::Cpu));
        let (cuda, _) = Recipe::Vllm.rule(1.0, TorchDevice::Cuda);
        assert_eq!(cuda, RECIP_448);
    }

    #[test]
    fn ue8m0_scales_round_up_to_powers_of_two() {
        assert_eq!(ceil_ue8m0_bits(1.0), 1.0);
        assert_eq!(ceil_ue8m0_bits(1.0000001), 2.0);
        assert_eq!(ceil_ue8m0_bits(0.3), 0.5);
        assert_eq!(ceil_pow2_log2(0.3), 0.5);
        assert_eq!(ceil_pow2_log2(0.25), 0.25);
        for r in [
            Recipe::VllmUe8m0,
            Recipe::DeepGemmUe8m0,
            Recipe::AwexPythonUe8m0,
            Recipe::SlimePow2,
            Recipe::SglangUe8m0,
        ] {
            let (s, _) = r.rule(0.7, TorchDevice::Cuda);
            assert_eq!(s.to_bits() & 0x7f_ffff, 0, "{r}: {s}");
            assert!(s >= 0.7 / 448.0, "{r}");
        }
    }

    #[test]
    fn an_all_zero_block_gets_the_clamped_scale() {
        let (s, op) = Recipe::Vllm.rule(0.0, TorchDevice::Cpu);
        assert_eq!(s, 1e-4f32 / 448.0);
        assert_eq!(op.apply(0.0), 0);
        let (s, _) = Recipe::Slime.rule(0.0, TorchDevice::Cpu);
        assert_eq!(s, 1e-10f32 / 448.0);
    }
}
