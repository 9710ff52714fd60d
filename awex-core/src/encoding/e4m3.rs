//! The `float8_e4m3fn` element format: rounding an f32 into it and widening it back.
//!
//! e4m3fn has one sign bit, four exponent bits (bias 7) and three mantissa bits; it has no
//! infinity, its one NaN pattern per sign is `0x7f` / `0xff`, and its largest finite value is
//! 448 (`0x7e`). [`from_f32`] rounds to nearest, ties to even, and saturates values beyond 448
//! to ±448, as PTX `cvt.rn.satfinite.e4m3x2.f32` and torch 2.14's CPU cast do. (torch 2.11's
//! CUDA cast turns values above 464 into NaN instead; no block quantiser awex implements ever
//! produces such a value from finite input, since every scaled element is at most 448 times
//! `1 + 2^-22`.)

/// The largest finite e4m3fn value.
pub const MAX: f32 = 448.0;

/// The e4m3fn byte nearest to `x` (ties to even), saturated to ±448; NaN maps to `0x7f`/`0xff`.
///
/// Branch-free (every path computed, then selected) so that loops over it vectorise.
#[inline(always)]
pub fn from_f32(x: f32) -> u8 {
    // below 2^-6, the smallest normal: adding 2^14 lets the FPU's own round-to-nearest-even
    // put the subnormal's three mantissa bits (steps of 2^-9) at the bottom of the word
    const DENORM: u32 = 141 << 23;
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = bits & 0x7fff_ffff;
    let sub = (f32::from_bits(a) + f32::from_bits(DENORM))
        .to_bits()
        .wrapping_sub(DENORM) as u8;
    // normal: rebias the exponent (127 -> 7) and round the 20 dropped mantissa bits to even
    let odd = (a >> 20) & 1;
    let normal = (a
        .wrapping_sub(120 << 23)
        .wrapping_add(0x7_ffff)
        .wrapping_add(odd)
        >> 20) as u8;
    let mut mag = if a < (121 << 23) { sub } else { normal };
    // 448.0 and beyond (infinity included) saturate to the largest finite value
    if a >= 0x43e0_0000 {
        mag = 0x7e;
    }
    if a > 0x7f80_0000 {
        mag = 0x7f;
    }
    sign | mag
}

/// The exact f32 value of an e4m3fn byte (`0x7f`/`0xff` are NaN).
#[inline]
pub fn to_f32(b: u8) -> f32 {
    TABLE[b as usize]
}

const fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m * (1.0 / 512.0)
    } else {
        let mut p = 1.0f32;
        let mut k = e - 7;
        while k > 0 {
            p *= 2.0;
            k -= 1;
        }
        while k < 0 {
            p *= 0.5;
            k += 1;
        }
        (1.0 + m / 8.0) * p
    };
    sign * mag
}

const TABLE: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode(i as u8);
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_byte_round_trips() {
        for b in 0..=255u8 {
            let v = to_f32(b);
            if v.is_nan() {
                assert!(b & 0x7f == 0x7f);
                continue;
            }
            // -0.0 keeps its sign bit
            assert_eq!(from_f32(v), b, "byte {b:#04x} value {v}");
        }
        assert_eq!(to_f32(0x7e), 448.0);
        assert_eq!(to_f32(0x01), 1.0 / 512.0);
        assert_eq!(to_f32(0x08), 1.0 / 64.0);
    }

    #[test]
    fn rounds_half_way_values_to_the_even_mantissa() {
        // 1 + 1/16 is half way between 1.0 (0x38) and 1.125 (0x39): even wins
        assert_eq!(from_f32(1.0625), 0x38);
        // 1.125 + 1/16 is half way between 0x39 and 0x3a: even wins (up)
        assert_eq!(from_f32(1.1875), 0x3a);
        // just above half way rounds up
        assert_eq!(from_f32(f32::from_bits(1.0625f32.to_bits() + 1)), 0x39);
        // subnormals: 2^-10 is half of the smallest subnormal, ties to zero (even)
        assert_eq!(from_f32(2f32.powi(-10)), 0x00);
        assert_eq!(from_f32(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(from_f32(-1.5 * 2f32.powi(-9)), 0x82);
        // the largest subnormal rounds into the smallest normal
        assert_eq!(from_f32(7.9 * 2f32.powi(-9)), 0x08);
    }

    #[test]
    fn saturates_beyond_448_and_keeps_nan() {
        assert_eq!(from_f32(448.0), 0x7e);
        assert_eq!(from_f32(460.0), 0x7e);
        assert_eq!(from_f32(464.0), 0x7e);
        assert_eq!(from_f32(500.0), 0x7e);
        assert_eq!(from_f32(f32::INFINITY), 0x7e);
        assert_eq!(from_f32(-1e30), 0xfe);
        assert_eq!(from_f32(f32::NAN), 0x7f);
        assert_eq!(from_f32(-f32::NAN), 0xff);
        // 432 is half way between 416 (0x7d) and 448 (0x7e): even is 448
        assert_eq!(from_f32(432.0), 0x7e);
        assert_eq!(from_f32(431.9), 0x7d);
    }

    #[test]
    fn matches_a_brute_force_nearest_even_search() {
        let finite: Vec<(u8, f64)> = (0..=0x7eu8).map(|b| (b, to_f32(b) as f64)).collect();
        let mut x = 0x1234_5678u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // magnitudes from 2^-12 to 2^9
            let v = f32::from_bits((x % (0x4400_0000 - 0x3980_0000)) + 0x3980_0000);
            let mut best = (0u8, f64::INFINITY);
            for &(b, f) in &finite {
                let d = (f - v as f64).abs();
                if d < best.1 || (d == best.1 && b & 1 == 0) {
                    best = (b, d);
                }
            }
            let want = if v >= 448.0 { 0x7e } else { best.0 };
            assert_eq!(from_f32(v), want, "{v}");
        }
    }
}
