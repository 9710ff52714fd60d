//! Element types of tensors, their sizes, names, and the conversions a sender may apply.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The element type of a tensor (canonical or local).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// bfloat16, the usual parameter type of RL training and inference.
    Bf16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision (fp32 master parameters).
    F32,
    /// IEEE double precision.
    F64,
    /// unsigned bytes.
    U8,
    /// signed bytes.
    I8,
    /// 32-bit integers.
    I32,
    /// 64-bit integers.
    I64,
    /// `float8_e4m3fn` (one byte: sign, 4 exponent bits, 3 mantissa bits, no infinities), the
    /// elements of an FP8 block encoding ([`crate::encoding::Encoding::Fp8Block`]); no implicit
    /// conversion reaches it: an FP8 tensor is written by a block quantiser. Not a model's
    /// dtype: `from_str` (config.json's `torch_dtype`) does not parse it.
    F8E4m3,
}

/// A dtype name that awex does not know, or a conversion it does not support.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DTypeError {
    /// The name is not a dtype awex knows.
    #[error(
        "unknown dtype `{0}`; supported: bf16, f16, f32, f64, u8, i8, i32, i64 (also torch/HF spellings such as bfloat16, float32)"
    )]
    Unknown(String),
    /// The two dtypes cannot be converted into one another.
    #[error(
        "no conversion from {from} to {to}; only conversions among bf16, f16, f32 and f64 are supported"
    )]
    NoConversion {
        /// source dtype
        from: DType,
        /// destination dtype
        to: DType,
    },
    /// Buffer lengths do not match the element counts.
    #[error(
        "conversion buffers disagree: {src} source bytes of {from} vs {dst} destination bytes of {to}"
    )]
    Length {
        /// source dtype
        from: DType,
        /// destination dtype
        to: DType,
        /// source length in bytes
        src: usize,
        /// destination length in bytes
        dst: usize,
    },
}

impl DType {
    /// All dtypes, in a fixed order.
    pub const ALL: [DType; 9] = [
        DType::Bf16,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::U8,
        DType::I8,
        DType::I32,
        DType::I64,
        DType::F8E4m3,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 | DType::I8 | DType::F8E4m3 => 1,
        }
    }

    /// The short lowercase name (`bf16`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F8E4m3 => "f8e4m3",
        }
    }

    /// The name used in safetensors headers (`BF16`).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::Bf16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F8E4m3 => "F8_E4M3",
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::Bf16 | DType::F16 | DType::F32 | DType::F64)
    }

    /// Whether a sender can convert elements of `self` into `to`.
    pub fn converts_to(self, to: DType) -> bool {
        self == to || (self.is_float() && to.is_float())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DType {
    type Err = DTypeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().trim_start_matches("torch.").to_ascii_lowercase();
        Ok(match lower.as_str() {
            "bf16" | "bfloat16" => DType::Bf16,
            "f16" | "fp16" | "float16" | "half" => DType::F16,
            "f32" | "fp32" | "float32" | "float" => DType::F32,
            "f64" | "fp64" | "float64" | "double" => DType::F64,
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            _ => return Err(DTypeError::Unknown(s.to_string())),
        })
    }
}

/// Rounds an f32 to bf16 bits (round to nearest even; NaN stays NaN).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        // keep the payload (so bf16 -> f32 -> bf16 is exact); never let a NaN become infinity
        let t = (bits >> 16) as u16;
        return if t & 0x007f == 0 { t | 0x0040 } else { t };
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Widens bf16 bits to f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Rounds an f32 to IEEE half bits (round to nearest even, overflow to infinity).
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x007f_ffff;
    if exp == 0xff {
        // inf or NaN
        return sign
            | 0x7c00
            | if man != 0 {
                0x0200 | (man >> 13) as u16
            } else {
                0
            };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // subnormal or zero in half
        if e < -10 {
            return sign;
        }
        let m = man | 0x0080_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rem = m & ((1u32 << shift) - 1);
        let mut out = m >> shift;
        if rem > half || (rem == half && (out & 1) == 1) {
            out += 1;
        }
        return sign | out as u16;
    }
    let mut out = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && (out & 1) == 1) {
        out += 1; // may carry into the exponent, which is the correct rounding
    }
    sign | out as u16
}

/// Widens IEEE half bits to f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x03ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // subnormal: normalise
            let mut e = 127 - 15 + 1;
            let mut m = man;
            while m & 0x0400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | ((e as u32) << 23) | ((m & 0x03ff) << 13)
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 127 - 15) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

#[inline]
fn read_f64(src: &[u8], dtype: DType) -> f64 {
    match dtype {
        DType::Bf16 => bf16_to_f32(u16::from_le_bytes([src[0], src[1]])) as f64,
        DType::F16 => f16_to_f32(u16::from_le_bytes([src[0], src[1]])) as f64,
        DType::F32 => f32::from_le_bytes([src[0], src[1], src[2], src[3]]) as f64,
        DType::F64 => f64::from_le_bytes(src[..8].try_into().unwrap_or([0; 8])),
        _ => 0.0,
    }
}

#[inline]
fn write_f64(dst: &mut [u8], dtype: DType, v: f64) {
    match dtype {
        DType::Bf16 => dst[..2].copy_from_slice(&f32_to_bf16(v as f32).to_le_bytes()),
        DType::F16 => dst[..2].copy_from_slice(&f32_to_f16(v as f32).to_le_bytes()),
        DType::F32 => dst[..4].copy_from_slice(&(v as f32).to_le_bytes()),
        DType::F64 => dst[..8].copy_from_slice(&v.to_le_bytes()),
        _ => {}
    }
}

/// The index of the first element of `bytes` (little-endian elements of `dtype`) that is
/// infinite or NaN; `None` when all are finite, or for a dtype without such values (integers).
/// `f8e4m3` has no infinities: its NaN is `0x7f`/`0xff`. A trailing partial element is ignored.
///
/// Reads 64 bytes per step with no branch inside, then finds the element within the step
/// that holds it.
pub fn first_non_finite(bytes: &[u8], dtype: DType) -> Option<usize> {
    /// The first element whose bits under `mask` (the exponent; for e4m3 also the mantissa)
    /// are all set. Words of 8 bytes hold `8 / N` elements: `x = (w & M) ^ M` has a zero lane
    /// exactly where an element is bad, found with the zero-lane test `(x - low) & !x & high`
    /// (each lane's top bit is outside the mask, so a lane never borrows into the test by
    /// itself; a borrow out of a zero lane only marks lanes above it, and a hit is then
    /// located element by element).
    fn scan<const N: usize>(bytes: &[u8], mask: u64) -> Option<usize> {
        let lanes = |v: u64| (0..8 / N).fold(0u64, |a, k| a | v << (8 * N * k));
        let m = lanes(mask);
        let (low, high) = (lanes(1), lanes(1u64 << (8 * N - 1)));
        let word_hit = |w: &[u8]| {
            let w = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
            let x = (w & m) ^ m;
            if N == 8 {
                u64::from(x == 0)
            } else {
                x.wrapping_sub(low) & !x & high
            }
        };
        let bad = |e: &[u8]| {
            let mut w = [0u8; 8];
            w[..N].copy_from_slice(e);
            u64::from_le_bytes(w) & mask == mask
        };
        let first = |c: &[u8]| c.chunks_exact(N).position(bad);
        let mut steps = bytes.chunks_exact(64);
        let mut at = 0usize;
        for step in steps.by_ref() {
            // eight words, no branch among them
            if step.chunks_exact(8).fold(0, |a, w| a | word_hit(w)) != 0 {
                return first(step).map(|k| at + k);
            }
            at += 64 / N;
        }
        first(steps.remainder()).map(|k| at + k)
    }
    match dtype {
        DType::Bf16 => scan::<2>(bytes, 0x7f80),
        DType::F16 => scan::<2>(bytes, 0x7c00),
        DType::F32 => scan::<4>(bytes, 0x7f80_0000),
        DType::F64 => scan::<8>(bytes, 0x7ff0_0000_0000_0000),
        DType::F8E4m3 => scan::<1>(bytes, 0x7f),
        DType::U8 | DType::I8 | DType::I32 | DType::I64 => None,
    }
}

/// Converts a run of elements from one dtype to another (little-endian bytes).
///
/// Equal dtypes copy bytes. f32 -> bf16, the common case (fp32 master weights
/// into bf16 inference weights), has its own fast loop.
pub fn convert(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> Result<(), DTypeError> {
    if !from.converts_to(to) {
        return Err(DTypeError::NoConversion { from, to });
    }
    if src.len() % from.size() != 0 || src.len() / from.size() * to.size() != dst.len() {
        return Err(DTypeError::Length {
            from,
            to,
            src: src.len(),
            dst: dst.len(),
        });
    }
    if from == to {
        dst.copy_from_slice(src);
        return Ok(());
    }
    match (from, to) {
        (DType::F32, DType::Bf16) => {
            for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
                let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
            }
        }
        (DType::Bf16, DType::F32) => {
            for (s, d) in src.chunks_exact(2).zip(dst.chunks_exact_mut(4)) {
                let v = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => {
            for (s, d) in src
                .chunks_exact(from.size())
                .zip(dst.chunks_exact_mut(to.size()))
            {
                write_f64(d, to, read_f64(s, from));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_non_finite_finds_each_infinity_and_nan_at_every_offset_and_passes_the_largest_finite_values()
     {
        // (dtype, largest finite bits, +inf, nan); e4m3 has no infinity (its NaN twice)
        let cases: [(DType, u64, u64, u64); 5] = [
            (DType::Bf16, 0x7f7f, 0x7f80, 0x7fc1),
            (DType::F16, 0x7bff, 0x7c00, 0x7e01),
            (DType::F32, 0x7f7f_ffff, 0x7f80_0000, 0x7fc0_0001),
            (
                DType::F64,
                0x7fef_ffff_ffff_ffff,
                0x7ff0_0000_0000_0000,
                0x7ff8_0000_0000_0001,
            ),
            (DType::F8E4m3, 0x7e, 0x7f, 0x7f),
        ];
        for (dt, max, inf, nan) in cases {
            let n = dt.size();
            let put = |v: &mut Vec<u8>, k: usize, x: u64| {
                v[k * n..(k + 1) * n].copy_from_slice(&x.to_le_bytes()[..n]);
            };
            for len in [0usize, 1, 3, 15, 16, 17, 33, 80] {
                // finite values everywhere: the largest, its negative, a subnormal, zero
                let mut v = vec![0u8; len * n];
                for k in 0..len {
                    let sign = 1u64 << (8 * n - 1);
                    put(&mut v, k, [max, max | sign, 1, 0][k % 4]);
                }
                assert_eq!(first_non_finite(&v, dt), None, "{dt} len {len}");
                // a partial trailing element is not read
                let mut partial = v.clone();
                partial.extend(std::iter::repeat_n(0xff, n - 1));
                assert_eq!(first_non_finite(&partial, dt), None, "{dt} len {len}+");
                for k in 0..len {
                    for bad in [inf, inf | (1u64 << (8 * n - 1)), nan] {
                        let mut w = v.clone();
                        put(&mut w, k, bad);
                        if k + 1 < len {
                            put(&mut w, len - 1, nan); // a later one does not win
                        }
                        assert_eq!(first_non_finite(&w, dt), Some(k), "{dt} len {len} at {k}");
                    }
                }
            }
        }
        for dt in [DType::U8, DType::I8, DType::I32, DType::I64] {
            assert_eq!(first_non_finite(&[0xff; 64], dt), None, "{dt}");
        }
    }

    #[test]
    fn parses_torch_and_hf_spellings() {
        assert_eq!("torch.bfloat16".parse::<DType>(), Ok(DType::Bf16));
        assert_eq!("float32".parse::<DType>(), Ok(DType::F32));
        assert_eq!("F16".parse::<DType>(), Ok(DType::F16));
        assert!(matches!(
            "fp8".parse::<DType>(),
            Err(DTypeError::Unknown(_))
        ));
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1.0 + 2^-8 is exactly half way between two bf16 values; ties go to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // just above half way rounds up
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn f16_round_trips_every_finite_half() {
        for h in 0u16..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan());
            } else {
                assert_eq!(f32_to_f16(f), h, "half bits {h:#06x} -> {f}");
            }
        }
        assert_eq!(f32_to_f16(65520.0), 0x7c00, "overflow rounds to infinity");
        assert_eq!(f32_to_f16(1.0e-8), 0x0000);
    }

    #[test]
    fn converts_f32_to_bf16_buffers() {
        let src: Vec<u8> = [1.0f32, -2.5, 3.0e38]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut dst = vec![0u8; 6];
        convert(&src, DType::F32, &mut dst, DType::Bf16).unwrap();
        assert_eq!(dst, [0x80, 0x3f, 0x20, 0xc0, 0x62, 0x7f]);
        assert_eq!(
            convert(&src, DType::F32, &mut dst, DType::I32),
            Err(DTypeError::NoConversion {
                from: DType::F32,
                to: DType::I32
            })
        );
        let mut short = vec![0u8; 4];
        assert!(matches!(
            convert(&src, DType::F32, &mut short, DType::Bf16),
            Err(DTypeError::Length { .. })
        ));
    }
}
