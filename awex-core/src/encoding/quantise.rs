//! The CPU reference block quantiser and dequantiser over pitched row-major matrices.
//!
//! [`Fp8Quantiser::quantise`] walks the matrix one band of `bn` rows at a time: one pass
//! finds each block's largest magnitude (on the bits, so that a non-finite element is caught
//! without a float compare per element), the recipe turns it into a scale and an element
//! rule, and a second pass over the same band (still in cache) writes the e4m3 bytes. Nothing
//! is allocated per element; a call allocates one small vector per band width.
//!
//! Inputs holding infinity or NaN are refused ([`QuantiseError::NonFinite`]): torch gives NaN
//! blocks for them, and its CPU and CUDA casts disagree on their bytes.

use super::e4m3;
use super::fp8_block::Fp8Block;
use super::recipe::{Op, Recipe, TorchDevice};
use crate::dtype::{bf16_to_f32, f32_to_bf16};

/// A row-major matrix's shape in elements: `rows x cols`, row `r` starting at `r * pitch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape2d {
    /// rows
    pub rows: usize,
    /// columns
    pub cols: usize,
    /// elements from one row's start to the next (>= cols)
    pub pitch: usize,
}

impl Shape2d {
    /// A dense matrix (`pitch == cols`).
    pub const fn dense(rows: usize, cols: usize) -> Shape2d {
        Shape2d {
            rows,
            cols,
            pitch: cols,
        }
    }

    /// Elements a buffer must hold: `(rows - 1) * pitch + cols`, `None` on overflow.
    fn span(&self) -> Option<usize> {
        if self.rows == 0 || self.cols == 0 {
            return Some(0);
        }
        (self.rows - 1)
            .checked_mul(self.pitch)?
            .checked_add(self.cols)
    }

    fn check(&self, what: &'static str, len: usize) -> Result<(), QuantiseError> {
        if self.pitch < self.cols {
            return Err(QuantiseError::Pitch {
                what,
                pitch: self.pitch,
                cols: self.cols,
            });
        }
        match self.span() {
            Some(need) if need <= len => Ok(()),
            need => Err(QuantiseError::Buffer {
                what,
                need: need.unwrap_or(usize::MAX),
                len,
                rows: self.rows,
                cols: self.cols,
                pitch: self.pitch,
            }),
        }
    }
}

/// Why a quantisation or dequantisation was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantiseError {
    /// A buffer is shorter than its shape needs.
    #[error(
        "{what} buffer holds {len} elements but a {rows} x {cols} matrix with pitch {pitch} needs {need}"
    )]
    Buffer {
        /// which buffer
        what: &'static str,
        /// elements needed
        need: usize,
        /// elements held
        len: usize,
        /// rows
        rows: usize,
        /// columns
        cols: usize,
        /// pitch
        pitch: usize,
    },
    /// A pitch is smaller than a row.
    #[error(
        "{what} pitch {pitch} is smaller than its {cols} columns; a row-major pitch is at least the row length"
    )]
    Pitch {
        /// which buffer
        what: &'static str,
        /// the pitch given
        pitch: usize,
        /// the columns
        cols: usize,
    },
    /// The source holds infinity or NaN.
    #[error(
        "element [{row}, {col}] is {value}; awex quantises finite weights only (a training step that produced it should be rolled back, not rolled out)"
    )]
    NonFinite {
        /// row
        row: usize,
        /// column
        col: usize,
        /// the value
        value: f32,
    },
    /// The recipe cannot use this block shape.
    #[error("the {recipe} quantiser works on {want:?} blocks only, not {got:?}")]
    Block {
        /// the recipe's name
        recipe: &'static str,
        /// the block it needs
        want: [u32; 2],
        /// the block asked for
        got: [u32; 2],
    },
    /// The recipe writes scales in another format than the encoding stores.
    #[error(
        "the {recipe} quantiser writes {recipe_format:?} scales but the encoding stores {encoding_format:?} scales; pick a recipe of that format"
    )]
    ScaleFormat {
        /// the recipe's name
        recipe: &'static str,
        /// what it writes
        recipe_format: super::ScaleFormat,
        /// what the encoding holds
        encoding_format: super::ScaleFormat,
    },
    /// A block edge is zero.
    #[error("block {0:?} has a zero edge; block edges are at least 1")]
    ZeroBlock([u32; 2]),
    /// Source and destination shapes differ.
    #[error("the source is {src_rows} x {src_cols} but the destination is {dst_rows} x {dst_cols}")]
    Mismatch {
        /// source rows
        src_rows: usize,
        /// source columns
        src_cols: usize,
        /// destination rows
        dst_rows: usize,
        /// destination columns
        dst_cols: usize,
    },
}

/// A source element type the quantiser reads.
pub trait SourceElement: Copy {
    /// `|x|` as bits that order like the magnitudes; [`SourceElement::NON_FINITE`] and above
    /// are infinity or NaN.
    fn abs_bits(self) -> u32;
    /// The smallest `abs_bits` of a non-finite value.
    const NON_FINITE: u32;
    /// The exact f32 value.
    fn widen(self) -> f32;
    /// The value of an `abs_bits` (finite).
    fn from_abs_bits(b: u32) -> f32;
}

/// bf16, as its bits.
impl SourceElement for u16 {
    #[inline(always)]
    fn abs_bits(self) -> u32 {
        (self & 0x7fff) as u32
    }
    const NON_FINITE: u32 = 0x7f80;
    #[inline(always)]
    fn widen(self) -> f32 {
        bf16_to_f32(self)
    }
    fn from_abs_bits(b: u32) -> f32 {
        bf16_to_f32(b as u16)
    }
}

impl SourceElement for f32 {
    #[inline(always)]
    fn abs_bits(self) -> u32 {
        self.to_bits() & 0x7fff_ffff
    }
    const NON_FINITE: u32 = 0x7f80_0000;
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    fn from_abs_bits(b: u32) -> f32 {
        f32::from_bits(b)
    }
}

/// A block quantiser: a recipe, the device whose torch arithmetic it follows, and the block.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Quantiser {
    /// which torch reference to reproduce
    pub recipe: Recipe,
    /// whose `tensor / python_float` to follow
    pub device: TorchDevice,
    /// the encoding (block shape)
    pub encoding: Fp8Block,
}

impl Fp8Quantiser {
    /// A quantiser for `encoding` with `recipe`, following CUDA torch.
    pub fn new(recipe: Recipe, encoding: Fp8Block) -> Fp8Quantiser {
        Fp8Quantiser {
            recipe,
            device: TorchDevice::Cuda,
            encoding,
        }
    }

    fn check_block(&self) -> Result<[usize; 2], QuantiseError> {
        let b = self.encoding.block;
        if b[0] == 0 || b[1] == 0 {
            return Err(QuantiseError::ZeroBlock(b));
        }
        if self.recipe.scale_format() != self.encoding.scale_format {
            return Err(QuantiseError::ScaleFormat {
                recipe: self.recipe.name(),
                recipe_format: self.recipe.scale_format(),
                encoding_format: self.encoding.scale_format,
            });
        }
        if let Some(want) = self.recipe.required_block()
            && want != b
        {
            return Err(QuantiseError::Block {
                recipe: self.recipe.name(),
                want,
                got: b,
            });
        }
        Ok([b[0] as usize, b[1] as usize])
    }

    /// Quantises the `shape` matrix in `src` into e4m3 bytes (`q`, pitch `q_pitch`) and one
    /// fp32 scale per block (`scales`, `[ceil(rows / bn), ceil(cols / bk)]` with pitch
    /// `scale_pitch`).
    pub fn quantise<T: SourceElement>(
        &self,
        src: &[T],
        shape: Shape2d,
        q: &mut [u8],
        q_pitch: usize,
        scales: &mut [f32],
        scale_pitch: usize,
    ) -> Result<(), QuantiseError> {
        let [bn, bk] = self.check_block()?;
        shape.check("source", src.len())?;
        let (rows, cols) = (shape.rows, shape.cols);
        Shape2d {
            rows,
            cols,
            pitch: q_pitch,
        }
        .check("e4m3", q.len())?;
        let nbc = cols.div_ceil(bk);
        Shape2d {
            rows: rows.div_ceil(bn),
            cols: nbc,
            pitch: scale_pitch,
        }
        .check("scale", scales.len())?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let mut amax = vec![0u32; nbc];
        let mut ops = vec![Op::Mul(0.0); nbc];
        for (band, r0) in (0..rows).step_by(bn).enumerate() {
            let r1 = (r0 + bn).min(rows);
            amax.fill(0);
            for r in r0..r1 {
                let row = &src[r * shape.pitch..r * shape.pitch + cols];
                for (a, chunk) in amax.iter_mut().zip(row.chunks(bk)) {
                    let m = chunk.iter().fold(0u32, |m, x| m.max(x.abs_bits()));
                    *a = (*a).max(m);
                }
            }
            for (cb, (&a, op)) in amax.iter().zip(ops.iter_mut()).enumerate() {
                if a >= T::NON_FINITE {
                    return Err(self.non_finite(
                        src,
                        shape,
                        r0..r1,
                        cb * bk..((cb + 1) * bk).min(cols),
                    ));
                }
                let (s, o) = self.recipe.rule(T::from_abs_bits(a), self.device);
                scales[band * scale_pitch + cb] = s;
                *op = o;
            }
            for r in r0..r1 {
                let row = &src[r * shape.pitch..r * shape.pitch + cols];
                let out = &mut q[r * q_pitch..r * q_pitch + cols];
                for ((chunk, out), &op) in row.chunks(bk).zip(out.chunks_mut(bk)).zip(&ops) {
                    apply_chunk(op, chunk, out);
                }
            }
        }
        Ok(())
    }

    fn non_finite<T: SourceElement>(
        &self,
        src: &[T],
        shape: Shape2d,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> QuantiseError {
        for r in rows {
            for c in cols.clone() {
                let v = src[r * shape.pitch + c];
                if v.abs_bits() >= T::NON_FINITE {
                    return QuantiseError::NonFinite {
                        row: r,
                        col: c,
                        value: v.widen(),
                    };
                }
            }
        }
        QuantiseError::NonFinite {
            row: 0,
            col: 0,
            value: f32::NAN,
        }
    }
}

/// One block row's elements through `op`; the match is outside the loops.
#[inline]
fn apply_chunk<T: SourceElement>(op: Op, src: &[T], out: &mut [u8]) {
    match op {
        Op::Mul(m) => {
            for (o, x) in out.iter_mut().zip(src) {
                *o = e4m3::from_f32(x.widen() * m);
            }
        }
        Op::Div(d) => {
            for (o, x) in out.iter_mut().zip(src) {
                *o = e4m3::from_f32(x.widen() / d);
            }
        }
        op => {
            for (o, x) in out.iter_mut().zip(src) {
                *o = op.apply(x.widen());
            }
        }
    }
}

/// The dequantised element type an engine asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DequantTo {
    /// bf16 (`(e4m3.float() * scale).to(bfloat16)`, round to nearest even)
    Bf16,
    /// fp32 (`e4m3.float() * scale`)
    F32,
}

/// Dequantises as the engines do (SGLang 0.5.23 `fp8_utils.py::block_quant_dequant`:
/// `(x_q.to(float32) * scale_repeated).to(dtype)`): `out` gets bf16 bits (as `u16`) or f32
/// bits (as `u32`) per `to`, `rows x cols` with pitch `out_pitch`.
#[allow(clippy::too_many_arguments)]
pub fn dequantise(
    block: [u32; 2],
    q: &[u8],
    shape: Shape2d,
    scales: &[f32],
    scale_pitch: usize,
    to: DequantTo,
    out: &mut [u32],
    out_pitch: usize,
) -> Result<(), QuantiseError> {
    if block[0] == 0 || block[1] == 0 {
        return Err(QuantiseError::ZeroBlock(block));
    }
    let [bn, bk] = [block[0] as usize, block[1] as usize];
    shape.check("e4m3", q.len())?;
    let (rows, cols) = (shape.rows, shape.cols);
    Shape2d {
        rows,
        cols,
        pitch: out_pitch,
    }
    .check("output", out.len())?;
    Shape2d {
        rows: rows.div_ceil(bn),
        cols: cols.div_ceil(bk),
        pitch: scale_pitch,
    }
    .check("scale", scales.len())?;
    for r in 0..rows {
        let srow = &scales[(r / bn) * scale_pitch..];
        let qrow = &q[r * shape.pitch..r * shape.pitch + cols];
        let orow = &mut out[r * out_pitch..r * out_pitch + cols];
        for (cb, (qc, oc)) in qrow.chunks(bk).zip(orow.chunks_mut(bk)).enumerate() {
            let s = srow[cb];
            for (o, &b) in oc.iter_mut().zip(qc) {
                let v = e4m3::to_f32(b) * s;
                *o = match to {
                    DequantTo::Bf16 => f32_to_bf16(v) as u32,
                    DequantTo::F32 => v.to_bits(),
                };
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::f32_to_bf16;

    fn q(recipe: Recipe, rows: usize, cols: usize, x: &[u16]) -> (Vec<u8>, Vec<f32>) {
        let e = recipe.encoding([128, 128]);
        let [sr, sc] = e.scale_shape(rows as u64, cols as u64);
        let mut out = vec![0u8; rows * cols];
        let mut s = vec![0f32; (sr * sc) as usize];
        Fp8Quantiser::new(recipe, e)
            .quantise(
                x,
                Shape2d::dense(rows, cols),
                &mut out,
                cols,
                &mut s,
                sc as usize,
            )
            .unwrap();
        (out, s)
    }

    #[test]
    fn the_block_maximum_maps_to_448_and_scales_are_per_block() {
        let (rows, cols) = (130, 260);
        let mut x = vec![0u16; rows * cols];
        for (i, v) in x.iter_mut().enumerate() {
            *v = f32_to_bf16(((i % 97) as f32 - 48.0) / 64.0);
        }
        // block (1, 2) (rows 128.., cols 256..) has one large element
        x[129 * cols + 259] = f32_to_bf16(-3.0);
        let (out, s) = q(Recipe::Vllm, rows, cols, &x);
        assert_eq!(s.len(), 2 * 3);
        assert_eq!(out[129 * cols + 259], 0xfe);
        assert_eq!(s[5], 3.0 * (1.0f64 / 448.0) as f32);
        // the largest magnitude of block (0, 0) is 0.75 (48/64): it maps to 448 too
        assert_eq!(s[0], 0.75 * (1.0f64 / 448.0) as f32);
        assert_eq!(out[0], 0xfe);
        assert_eq!(out[96], 0x7e);
    }

    #[test]
    fn pitched_source_and_destination_leave_the_gaps_alone() {
        let (rows, cols, sp, qp) = (3, 5, 8, 7);
        let x: Vec<u16> = (0..rows * sp).map(|i| f32_to_bf16(i as f32)).collect();
        let mut out = vec![0xaau8; rows * qp];
        let mut s = vec![0f32; 1];
        let quant = Fp8Quantiser::new(Recipe::Vllm, Fp8Block::default());
        quant
            .quantise(
                &x,
                Shape2d {
                    rows,
                    cols,
                    pitch: sp,
                },
                &mut out,
                qp,
                &mut s,
                1,
            )
            .unwrap();
        assert_eq!(out[5], 0xaa);
        assert_eq!(out[6], 0xaa);
        // the largest element is row 2 col 4: 20.0
        assert_eq!(out[2 * qp + 4], 0x7e);
        assert_eq!(s[0], 20.0 * (1.0f64 / 448.0) as f32);
    }

    #[test]
    fn refuses_non_finite_elements_naming_them() {
        let mut x = vec![f32_to_bf16(1.0); 4 * 4];
        x[2 * 4 + 3] = 0xff80; // -inf
        let e = Fp8Quantiser::new(Recipe::Vllm, Fp8Block::default())
            .quantise(&x, Shape2d::dense(4, 4), &mut [0; 16], 4, &mut [0.0], 1)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "element [2, 3] is -inf; awex quantises finite weights only (a training step that produced it should be rolled back, not rolled out)"
        );
        x[2 * 4 + 3] = 0x7fc1; // NaN
        assert!(matches!(
            Fp8Quantiser::new(Recipe::Vllm, Fp8Block::default()).quantise(
                &x,
                Shape2d::dense(4, 4),
                &mut [0; 16],
                4,
                &mut [0.0],
                1
            ),
            Err(QuantiseError::NonFinite { row: 2, col: 3, .. })
        ));
    }

    #[test]
    fn short_buffers_small_pitches_and_wrong_blocks_are_refused() {
        let quant = Fp8Quantiser::new(Recipe::Vllm, Fp8Block::default());
        let x = vec![0u16; 10];
        let err = quant
            .quantise(&x, Shape2d::dense(3, 4), &mut [0; 12], 4, &mut [0.0], 1)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "source buffer holds 10 elements but a 3 x 4 matrix with pitch 4 needs 12"
        );
        let err = quant
            .quantise(
                &x,
                Shape2d {
                    rows: 2,
                    cols: 4,
                    pitch: 3,
                },
                &mut [0; 12],
                4,
                &mut [0.0],
                1,
            )
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("source pitch 3 is smaller than its 4 columns")
        );
        let err = quant
            .quantise(&x[..8], Shape2d::dense(2, 4), &mut [0; 8], 4, &mut [], 1)
            .unwrap_err();
        assert!(err.to_string().starts_with("scale buffer holds 0 elements"));
        let sg = Fp8Quantiser::new(Recipe::SglangUe8m0, Recipe::SglangUe8m0.encoding([64, 64]));
        assert_eq!(
            sg.quantise(&x[..8], Shape2d::dense(2, 4), &mut [0; 8], 4, &mut [0.0], 1)
                .unwrap_err()
                .to_string(),
            "the sglang-ue8m0 quantiser works on [128, 128] blocks only, not [64, 64]"
        );
        let wrong = Fp8Quantiser::new(Recipe::DeepGemmUe8m0, Fp8Block::default());
        assert_eq!(
            wrong
                .quantise(&x[..8], Shape2d::dense(2, 4), &mut [0; 8], 4, &mut [0.0], 1)
                .unwrap_err()
                .to_string(),
            "the deepgemm-ue8m0 quantiser writes Ue8m0 scales but the encoding stores F32 scales; pick a recipe of that format"
        );
    }

    #[test]
    fn dequantise_inverts_within_e4m3_precision() {
        let (rows, cols) = (200, 300);
        let x: Vec<u16> = (0..rows * cols)
            .map(|i| f32_to_bf16(((i * 7919 % 1000) as f32 - 500.0) / 1000.0))
            .collect();
        for recipe in Recipe::ALL {
            let (out, s) = q(recipe, rows, cols, &x);
            let mut back = vec![0u32; rows * cols];
            dequantise(
                [128, 128],
                &out,
                Shape2d::dense(rows, cols),
                &s,
                3,
                DequantTo::F32,
                &mut back,
                cols,
            )
            .unwrap();
            for (i, (&b, &v)) in back.iter().zip(&x).enumerate() {
                let (got, want) = (f32::from_bits(b), bf16_to_f32(v));
                // 3 mantissa bits: relative error at most 2^-4 (twice that for a requantisation),
                // plus the subnormal floor
                let s = s[(i / cols / 128) * 3 + (i % cols) / 128];
                let rel = if recipe == Recipe::SglangUe8m0 {
                    8.0
                } else {
                    16.0
                };
                assert!(
                    (got - want).abs() <= want.abs() / rel + s / 256.0 + 1e-12,
                    "{recipe} [{i}] {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn sglang_requant_equals_quantise_dequantise_requantise() {
        let (rows, cols) = (256, 384);
        let x: Vec<u16> = (0..rows * cols)
            .map(|i| f32_to_bf16((((i * 2654435761usize) >> 7) % 2001) as f32 / 1000.0 - 1.0))
            .collect();
        let (q1, s1) = q(Recipe::Vllm, rows, cols, &x);
        let mut deq = vec![0u32; rows * cols];
        dequantise(
            [128, 128],
            &q1,
            Shape2d::dense(rows, cols),
            &s1,
            3,
            DequantTo::Bf16,
            &mut deq,
            cols,
        )
        .unwrap();
        let deq: Vec<u16> = deq.iter().map(|&v| v as u16).collect();
        let (q2, s2) = q(Recipe::DeepGemmUe8m0, rows, cols, &deq);
        assert_eq!(q(Recipe::SglangUe8m0, rows, cols, &x), (q2, s2));
    }
}
