//! Strided box copies: the geometry of moving one N-d box between two row-major tensors.
//!
//! A box is reduced to [`StridedBox`]: contiguous runs of `run` elements, repeated over up to
//! `MAX_DIMS - 1` outer dimensions, each with its own source and destination stride. Dimensions
//! that are contiguous on both ends are merged first, so a box of whole rows is one run. The
//! same description drives CPU copies, bucket packing, and 2-D/3-D device copies.

use super::{Dims, MAX_DIMS};
use crate::dtype::{self, DType, DTypeError};

/// A box as contiguous runs: element offsets and strides on both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedBox {
    /// First element of the box in the source tensor.
    pub src_base: u64,
    /// First element of the box in the destination tensor.
    pub dst_base: u64,
    /// Elements in one contiguous run (on both ends).
    pub run: u64,
    /// Outer dimensions, innermost first: (count, source stride, destination stride) in elements.
    pub outer: [(u64, u64, u64); MAX_DIMS - 1],
    /// How many entries of `outer` are used.
    pub n_outer: usize,
}

/// Why a box copy cannot be done.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CopyError {
    /// The box does not fit one of the tensors (box extent, offset and the tensor's shape).
    #[error("{0}")]
    OutOfBounds(Box<str>),
    /// A buffer is smaller than its shape says.
    #[error("{0}")]
    ShortBuffer(Box<str>),
    /// The box has more dims than a tensor.
    #[error("box has {box_dims} dims but the tensor has {tensor_dims}")]
    Rank {
        /// box dims
        box_dims: usize,
        /// tensor dims
        tensor_dims: usize,
    },
    /// A dtype conversion failed.
    #[error(transparent)]
    DType(#[from] DTypeError),
}

/// Extends a box extent with leading 1s to `ndim` dims (box dims align with trailing tensor dims).
fn widen(extent: &Dims, ndim: usize) -> Result<Dims, CopyError> {
    if extent.ndim() > ndim {
        return Err(CopyError::Rank {
            box_dims: extent.ndim(),
            tensor_dims: ndim,
        });
    }
    let mut v = [1u64; MAX_DIMS];
    let lead = ndim - extent.ndim();
    v[lead..ndim].copy_from_slice(extent.as_slice());
    Ok(Dims::new(&v[..ndim]))
}

fn check_fit(extent: &Dims, offset: &Dims, shape: &Dims) -> Result<Dims, CopyError> {
    let w = widen(extent, shape.ndim())?;
    let fits = offset.ndim() == shape.ndim()
        && (0..shape.ndim()).all(|i| {
            offset
                .get(i)
                .checked_add(w.get(i))
                .is_some_and(|end| end <= shape.get(i))
        });
    if !fits {
        return Err(CopyError::OutOfBounds(
            format!("box {extent} at {offset} does not fit a tensor of shape {shape}").into(),
        ));
    }
    Ok(w)
}

impl StridedBox {
    /// The runs of a box of `extent` at `src_off` in `src_shape` and at `dst_off` in `dst_shape`.
    ///
    /// `extent` has at most as many dims as either tensor; it aligns with their trailing dims.
    pub fn new(
        src_shape: &Dims,
        src_off: &Dims,
        dst_shape: &Dims,
        dst_off: &Dims,
        extent: &Dims,
    ) -> Result<Self, CopyError> {
        check_fit(extent, src_off, src_shape)?;
        check_fit(extent, dst_off, dst_shape)?;
        let k = extent.ndim();
        let s_str = src_shape.strides();
        let d_str = dst_shape.strides();
        let s_lead = src_shape.ndim() - k;
        let d_lead = dst_shape.ndim() - k;
        // per box dim (innermost first): (count, src stride, dst stride)
        let mut dims: Vec<(u64, u64, u64)> = (0..k)
            .rev()
            .map(|i| (extent.get(i), s_str.get(s_lead + i), d_str.get(d_lead + i)))
            .collect();
        if dims.is_empty() {
            dims.push((1, 1, 1));
        }
        // merge dims that are contiguous on both ends
        let mut merged: Vec<(u64, u64, u64)> = vec![dims[0]];
        for &(c, ss, ds) in &dims[1..] {
            let last = merged.len() - 1;
            let (lc, ls, ld) = merged[last];
            if c == 1 {
                continue;
            }
            if ss == lc * ls && ds == lc * ld {
                merged[last] = (lc * c, ls, ld);
            } else if lc == 1 {
                merged[last] = (c, ss, ds);
            } else {
                merged.push((c, ss, ds));
            }
        }
        // the innermost dim must have unit stride to be a run
        let (run, outer_dims) = if merged[0].1 == 1 && merged[0].2 == 1 {
            (merged[0].0, &merged[1..])
        } else {
            (1, &merged[..])
        };
        let mut outer = [(1, 0, 0); MAX_DIMS - 1];
        let n_outer = outer_dims.len();
        outer[..n_outer].copy_from_slice(outer_dims);
        Ok(StridedBox {
            src_base: src_shape.linear(src_off),
            dst_base: dst_shape.linear(dst_off),
            run,
            outer,
            n_outer,
        })
    }

    /// Number of runs.
    pub fn runs(&self) -> u64 {
        self.outer[..self.n_outer].iter().map(|o| o.0).product()
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.run * self.runs()
    }

    /// First elements of run `r` (row-major) in the source and the destination tensor.
    pub fn run_at(&self, mut r: u64) -> (u64, u64) {
        let (mut s, mut d) = (self.src_base, self.dst_base);
        for &(c, ss, ds) in &self.outer[..self.n_outer] {
            s += (r % c) * ss;
            d += (r % c) * ds;
            r /= c;
        }
        (s, d)
    }

    /// Calls `f(src_elem, dst_elem, run_elems)` for every run, in row-major order.
    pub fn for_each_run(&self, mut f: impl FnMut(u64, u64, u64)) {
        let n = self.runs();
        let mut idx = [0u64; MAX_DIMS - 1];
        let (mut s, mut d) = (self.src_base, self.dst_base);
        for _ in 0..n {
            f(s, d, self.run);
            // advance the odometer
            for (i, &(c, ss, ds)) in idx.iter_mut().zip(&self.outer[..self.n_outer]) {
                *i += 1;
                s += ss;
                d += ds;
                if *i < c {
                    break;
                }
                *i = 0;
                s -= ss * c;
                d -= ds * c;
            }
        }
    }
}

fn check_len(buf_len: usize, shape: &Dims, dtype: DType) -> Result<(), CopyError> {
    let need = shape
        .checked_numel()
        .and_then(|n| n.checked_mul(dtype.size() as u64));
    if need.is_none_or(|need| (buf_len as u64) < need) {
        return Err(CopyError::ShortBuffer(
            format!("buffer of {buf_len} bytes is smaller than shape {shape} of {dtype} needs")
                .into(),
        ));
    }
    Ok(())
}

/// Copies a box from one tensor's bytes into another's, converting dtype if they differ.
#[allow(clippy::too_many_arguments)]
pub fn copy_box(
    src: &[u8],
    src_shape: &Dims,
    src_off: &Dims,
    src_dtype: DType,
    dst: &mut [u8],
    dst_shape: &Dims,
    dst_off: &Dims,
    dst_dtype: DType,
    extent: &Dims,
) -> Result<(), CopyError> {
    check_len(src.len(), src_shape, src_dtype)?;
    check_len(dst.len(), dst_shape, dst_dtype)?;
    if !src_dtype.converts_to(dst_dtype) {
        return Err(DTypeError::NoConversion {
            from: src_dtype,
            to: dst_dtype,
        }
        .into());
    }
    let b = StridedBox::new(src_shape, src_off, dst_shape, dst_off, extent)?;
    let (se, de) = (src_dtype.size() as u64, dst_dtype.size() as u64);
    let mut result = Ok(());
    b.for_each_run(|s, d, n| {
        let s = &src[(s * se) as usize..((s + n) * se) as usize];
        let d = &mut dst[(d * de) as usize..((d + n) * de) as usize];
        if src_dtype == dst_dtype {
            d.copy_from_slice(s);
        } else if let Err(e) = dtype::convert(s, src_dtype, d, dst_dtype) {
            result = Err(e.into());
        }
    });
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(n: usize) -> Vec<u8> {
        (0..n).map(|i| i as u8).collect()
    }

    #[test]
    fn whole_rows_merge_into_one_run() {
        let b = StridedBox::new(
            &Dims::new(&[8, 4]),
            &Dims::new(&[2, 0]),
            &Dims::new(&[3, 4]),
            &Dims::new(&[0, 0]),
            &Dims::new(&[3, 4]),
        )
        .unwrap();
        assert_eq!((b.run, b.runs(), b.src_base, b.dst_base), (12, 1, 8, 0));
    }

    #[test]
    fn column_block_is_strided_runs() {
        // columns 2..4 of a 3x6 tensor into a 3x2 tensor
        let b = StridedBox::new(
            &Dims::new(&[3, 6]),
            &Dims::new(&[0, 2]),
            &Dims::new(&[3, 2]),
            &Dims::new(&[0, 0]),
            &Dims::new(&[3, 2]),
        )
        .unwrap();
        assert_eq!(b.run, 2);
        assert_eq!(b.outer[0], (3, 6, 2));
        let mut runs = vec![];
        b.for_each_run(|s, d, n| runs.push((s, d, n)));
        assert_eq!(runs, vec![(2, 0, 2), (8, 2, 2), (14, 4, 2)]);
    }

    #[test]
    fn box_into_higher_rank_tensor_aligns_trailing_dims() {
        // a 2x3 canonical box into slot 1 of a [2, 2, 3] local tensor
        let src = iota(6);
        let mut dst = vec![0u8; 12];
        copy_box(
            &src,
            &Dims::new(&[2, 3]),
            &Dims::new(&[0, 0]),
            DType::U8,
            &mut dst,
            &Dims::new(&[2, 2, 3]),
            &Dims::new(&[1, 0, 0]),
            DType::U8,
            &Dims::new(&[2, 3]),
        )
        .unwrap();
        assert_eq!(dst, [0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn out_of_bounds_box_is_an_error() {
        let src = iota(6);
        let mut dst = vec![0u8; 6];
        let e = copy_box(
            &src,
            &Dims::new(&[2, 3]),
            &Dims::new(&[1, 0]),
            DType::U8,
            &mut dst,
            &Dims::new(&[2, 3]),
            &Dims::new(&[0, 0]),
            DType::U8,
            &Dims::new(&[2, 3]),
        );
        assert!(matches!(e, Err(CopyError::OutOfBounds(_))));
    }

    #[test]
    fn converts_while_copying() {
        let src: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut dst = vec![0u8; 4];
        copy_box(
            &src,
            &Dims::new(&[2, 2]),
            &Dims::new(&[0, 1]),
            DType::F32,
            &mut dst,
            &Dims::new(&[2]),
            &Dims::new(&[0]),
            DType::Bf16,
            &Dims::new(&[2, 1]),
        )
        .unwrap_err();
        // a 2-d box cannot go into a 1-d tensor; a [2,1] column into a [2,1] tensor can
        let mut dst = vec![0u8; 4];
        copy_box(
            &src,
            &Dims::new(&[2, 2]),
            &Dims::new(&[0, 1]),
            DType::F32,
            &mut dst,
            &Dims::new(&[2, 1]),
            &Dims::new(&[0, 0]),
            DType::Bf16,
            &Dims::new(&[2, 1]),
        )
        .unwrap();
        assert_eq!(dst, [0x00, 0x40, 0x80, 0x40]);
    }
}
