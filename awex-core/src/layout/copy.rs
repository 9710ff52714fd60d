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
    /// A transposed box that cannot be copied (fewer than two dims, or too many strided dims).
    #[error("{0}")]
    Transposed(Box<str>),
}

/// Which end of a box copy stores the box with its last two dims swapped.
///
/// A box of extent `[.., a, b]` whose end is transposed occupies `[.., b, a]` there: box
/// element `(.., i, j)` sits at `(.., j, i)` from that end's offset (the offset is of the
/// transposed box). Inference engines that hold an expert stack as `[E, out, in]` while the
/// checkpoint holds `[E, in, out]` (gpt-oss) receive their boxes transposed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Transpose {
    /// Both ends hold the box as it is.
    #[default]
    None,
    /// The source holds the box transposed.
    Src,
    /// The destination holds the box transposed.
    Dst,
}

/// `extent` with its last two dims swapped (unchanged with fewer than two dims).
pub fn swap_last_two(extent: &Dims) -> Dims {
    let mut e = *extent;
    let k = e.ndim();
    if k >= 2 {
        let (a, b) = (e.get(k - 2), e.get(k - 1));
        e.set(k - 2, b);
        e.set(k - 1, a);
    }
    e
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
        Self::new_transposed(
            src_shape,
            src_off,
            dst_shape,
            dst_off,
            extent,
            Transpose::None,
        )
    }

    /// [`StridedBox::new`] where one end may hold the box transposed ([`Transpose`]): that
    /// end's offset is of the transposed box, which must fit its tensor. A transposed box
    /// needs at least two dims; its runs are single elements (no dim is contiguous on both
    /// ends), so it has at most `MAX_DIMS - 1` dims once dims contiguous on both ends merge.
    pub fn new_transposed(
        src_shape: &Dims,
        src_off: &Dims,
        dst_shape: &Dims,
        dst_off: &Dims,
        extent: &Dims,
        t: Transpose,
    ) -> Result<Self, CopyError> {
        let k = extent.ndim();
        if t != Transpose::None && k < 2 {
            return Err(CopyError::Transposed(
                format!("box {extent} has fewer than 2 dims and cannot be transposed").into(),
            ));
        }
        let swapped = swap_last_two(extent);
        let (s_ext, d_ext) = match t {
            Transpose::None => (extent, extent),
            Transpose::Src => (&swapped, extent),
            Transpose::Dst => (extent, &swapped),
        };
        check_fit(s_ext, src_off, src_shape)?;
        check_fit(d_ext, dst_off, dst_shape)?;
        let s_str = src_shape.strides();
        let d_str = dst_shape.strides();
        let s_lead = src_shape.ndim() - k;
        let d_lead = dst_shape.ndim() - k;
        // the tensor dim (of the box's k trailing ones) that box dim i runs along
        let perm = |i: usize, transposed: bool| {
            if transposed && i + 2 >= k {
                2 * k - 3 - i
            } else {
                i
            }
        };
        let (ts, td) = (t == Transpose::Src, t == Transpose::Dst);
        // per box dim (innermost first): (count, src stride, dst stride)
        let mut dims: Vec<(u64, u64, u64)> = (0..k)
            .rev()
            .map(|i| {
                (
                    extent.get(i),
                    s_str.get(s_lead + perm(i, ts)),
                    d_str.get(d_lead + perm(i, td)),
                )
            })
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
        if n_outer > MAX_DIMS - 1 {
            return Err(CopyError::Transposed(
                format!(
                    "transposed box {extent} has {n_outer} strided dims, more than the {} a copy walks",
                    MAX_DIMS - 1
                )
                .into(),
            ));
        }
        outer[..n_outer].copy_from_slice(outer_dims);
        Ok(StridedBox {
            src_base: src_shape.linear(src_off),
            dst_base: dst_shape.linear(dst_off),
            run,
            outer,
            n_outer,
        })
    }

    /// For a box of one-element runs with an outer dim of unit source stride and another of
    /// unit destination stride (a transposed box's two swapped dims), those two dims' indices
    /// in `outer`: `(p, q)`, `p` contiguous in the source and `q` in the destination.
    pub fn transposed_pair(&self) -> Option<(usize, usize)> {
        if self.run != 1 {
            return None;
        }
        let outer = &self.outer[..self.n_outer];
        let p = outer.iter().position(|o| o.0 > 1 && o.1 == 1)?;
        let q = outer
            .iter()
            .enumerate()
            .position(|(i, o)| i != p && o.0 > 1 && o.2 == 1)?;
        Some((p, q))
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
    copy_box_transposed(
        src,
        src_shape,
        src_off,
        src_dtype,
        dst,
        dst_shape,
        dst_off,
        dst_dtype,
        extent,
        Transpose::None,
    )
}

/// [`copy_box`] where one end may hold the box transposed ([`Transpose`]; the offset of that
/// end is of the transposed box).
#[allow(clippy::too_many_arguments)]
pub fn copy_box_transposed(
    src: &[u8],
    src_shape: &Dims,
    src_off: &Dims,
    src_dtype: DType,
    dst: &mut [u8],
    dst_shape: &Dims,
    dst_off: &Dims,
    dst_dtype: DType,
    extent: &Dims,
    t: Transpose,
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
    let b = StridedBox::new_transposed(src_shape, src_off, dst_shape, dst_off, extent, t)?;
    if src_dtype == dst_dtype
        && let Some((p, q)) = b.transposed_pair()
    {
        // one element per run: walk the two swapped dims in tiles instead (same bytes)
        match src_dtype.size() {
            1 => copy_tiles::<1>(src, dst, &b, p, q),
            2 => copy_tiles::<2>(src, dst, &b, p, q),
            4 => copy_tiles::<4>(src, dst, &b, p, q),
            8 => copy_tiles::<8>(src, dst, &b, p, q),
            _ => copy_runs(src, src_dtype, dst, dst_dtype, &b)?,
        }
        return Ok(());
    }
    copy_runs(src, src_dtype, dst, dst_dtype, &b)
}

/// Copies the box run by run, converting dtype if the two differ.
fn copy_runs(
    src: &[u8],
    src_dtype: DType,
    dst: &mut [u8],
    dst_dtype: DType,
    b: &StridedBox,
) -> Result<(), CopyError> {
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

/// Elements per side of the square tiles a transposed copy walks, by element size: a tile row
/// of 2- and 4-byte elements spans one or two 64-byte cache lines, and both tiles (the source's
/// and the destination's) stay in L1 while a tile is copied.
const fn tile(elem: usize) -> u64 {
    match elem {
        1 => 64,
        _ => 32,
    }
}

/// Copies a box of one element per run whose outer dims `p` (unit source stride) and `q` (unit
/// destination stride) swap sides, in square tiles of those two dims: each source row of a tile
/// is read contiguously, each destination row written contiguously across the tile's rows, so
/// both ends stream whole cache lines. `N` is the element size of both ends (no conversion).
/// The box was checked to fit both buffers ([`StridedBox::new_transposed`], `check_len`).
fn copy_tiles<const N: usize>(src: &[u8], dst: &mut [u8], b: &StridedBox, p: usize, q: usize) {
    let (np, _, dp) = b.outer[p];
    let (nq, sq, _) = b.outer[q];
    let t = tile(N);
    // the other outer dims (a leading expert dim, say), walked as an odometer
    let mut rest = [(1u64, 0u64, 0u64); MAX_DIMS - 1];
    let mut n_rest = 0;
    for (i, &o) in b.outer[..b.n_outer].iter().enumerate() {
        if i != p && i != q {
            rest[n_rest] = o;
            n_rest += 1;
        }
    }
    let rest = &rest[..n_rest];
    let outer_runs: u64 = rest.iter().map(|o| o.0).product();
    let mut idx = [0u64; MAX_DIMS - 1];
    let (mut s0, mut d0) = (b.src_base, b.dst_base);
    for _ in 0..outer_runs {
        for q0 in (0..nq).step_by(t as usize) {
            let q1 = (q0 + t).min(nq);
            for p0 in (0..np).step_by(t as usize) {
                let len = ((p0 + t).min(np) - p0) as usize;
                for qi in q0..q1 {
                    let s = (s0 + qi * sq + p0) as usize * N;
                    let row = &src[s..s + len * N];
                    let mut d = (d0 + qi + p0 * dp) as usize * N;
                    for e in row.chunks_exact(N) {
                        dst[d..d + N].copy_from_slice(e);
                        d += dp as usize * N;
                    }
                }
            }
        }
        for (i, &(c, ss, ds)) in idx.iter_mut().zip(rest) {
            *i += 1;
            s0 += ss;
            d0 += ds;
            if *i < c {
                break;
            }
            *i = 0;
            s0 -= ss * c;
            d0 -= ds * c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(n: usize) -> Vec<u8> {
        (0..n).map(|i| i as u8).collect()
    }

    /// Element `(.., i, j)` of a box, read from a row-major tensor at `off` (transposed: at
    /// `(.., j, i)`), one element at a time: the reference a strided copy must match.
    fn naive_index(shape: &Dims, off: &Dims, extent: &Dims, at: &[u64], transposed: bool) -> u64 {
        let (n, k) = (shape.ndim(), extent.ndim());
        let mut c: Vec<u64> = off.as_slice().to_vec();
        for (d, &x) in at.iter().enumerate().take(k) {
            let l = if transposed && d + 2 >= k {
                2 * k - 3 - d
            } else {
                d
            };
            c[n - k + l] += x;
        }
        shape.linear(&Dims::new(&c))
    }

    #[test]
    fn transposed_boxes_round_trip_element_by_element() {
        // canonical [e, r, c] boxes into local tensors holding them transposed, at offsets,
        // with extra leading dims, then back: every element where the reference puts it
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for case in 0..300 {
            let k = 2 + (case % 2) as usize;
            let ext: Vec<u64> = (0..k).map(|_| 1 + rnd(5)).collect();
            let extent = Dims::new(&ext);
            // source: the box at an offset of a larger tensor
            let s_off: Vec<u64> = (0..k).map(|_| rnd(3)).collect();
            let s_shape: Vec<u64> = (0..k).map(|d| s_off[d] + ext[d] + rnd(3)).collect();
            let (s_shape, s_off) = (Dims::new(&s_shape), Dims::new(&s_off));
            // destination: one more leading dim, the box's last two dims swapped
            let lead = 1 + rnd(3);
            let t_ext = swap_last_two(&extent);
            let mut d_shape = vec![lead];
            let mut d_off = vec![rnd(lead)];
            for d in 0..k {
                let o = rnd(3);
                d_off.push(o);
                d_shape.push(o + t_ext.get(d) + rnd(3));
            }
            let (d_shape, d_off) = (Dims::new(&d_shape), Dims::new(&d_off));
            let src: Vec<u8> = (0..s_shape.numel() * 2)
                .map(|i| (i * 7 + 3) as u8)
                .collect();
            let mut dst = vec![0u8; (d_shape.numel() * 2) as usize];
            copy_box_transposed(
                &src,
                &s_shape,
                &s_off,
                DType::Bf16,
                &mut dst,
                &d_shape,
                &d_off,
                DType::Bf16,
                &extent,
                Transpose::Dst,
            )
            .unwrap();
            let mut written = vec![false; d_shape.numel() as usize];
            let mut at = vec![0u64; k];
            for _ in 0..extent.numel() {
                let s = naive_index(&s_shape, &s_off, &extent, &at, false) as usize;
                let d = naive_index(&d_shape, &d_off, &extent, &at, true) as usize;
                assert_eq!(
                    dst[2 * d..2 * d + 2],
                    src[2 * s..2 * s + 2],
                    "case {case} at {at:?}"
                );
                written[d] = true;
                for x in (0..k).rev() {
                    at[x] += 1;
                    if at[x] < ext[x] {
                        break;
                    }
                    at[x] = 0;
                }
            }
            // nothing outside the transposed box is written
            for (i, w) in written.iter().enumerate() {
                if !w {
                    assert_eq!(dst[2 * i..2 * i + 2], [0, 0], "case {case}: element {i}");
                }
            }
            // and back (the source end transposed), with a dtype conversion on the way
            let mut back = vec![0u8; (s_shape.numel() * 4) as usize];
            copy_box_transposed(
                &dst,
                &d_shape,
                &d_off,
                DType::Bf16,
                &mut back,
                &s_shape,
                &s_off,
                DType::F32,
                &extent,
                Transpose::Src,
            )
            .unwrap();
            let mut again = vec![0u8; src.len()];
            copy_box(
                &back,
                &s_shape,
                &s_off,
                DType::F32,
                &mut again,
                &s_shape,
                &s_off,
                DType::Bf16,
                &extent,
            )
            .unwrap();
            let mut want = vec![0u8; src.len()];
            copy_box(
                &src,
                &s_shape,
                &s_off,
                DType::Bf16,
                &mut want,
                &s_shape,
                &s_off,
                DType::Bf16,
                &extent,
            )
            .unwrap();
            assert_eq!(again, want, "case {case}");
        }
    }

    #[test]
    fn tiled_transposed_copy_matches_the_run_by_run_copy() {
        // boxes of 2-3 dims, larger and smaller than a tile, at odd offsets in tensors with
        // extra leading dims and odd trailing padding, transposed at either end, of 1-, 2-, 4-
        // and 8-byte elements: every destination byte as the one-element-per-run copy leaves it
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let mut tiled_cases = 0;
        for case in 0..400 {
            let dtype = [DType::U8, DType::Bf16, DType::F32, DType::F64][case % 4];
            let k = 2 + (case / 4) % 2;
            let big = case % 3 == 0;
            let ext: Vec<u64> = (0..k)
                .map(|d| {
                    if d + 2 >= k {
                        1 + rnd(if big { 150 } else { 9 })
                    } else {
                        1 + rnd(3)
                    }
                })
                .collect();
            let extent = Dims::new(&ext);
            let t = if case % 2 == 0 {
                Transpose::Dst
            } else {
                Transpose::Src
            };
            let swapped = swap_last_two(&extent);
            let (s_ext, d_ext) = match t {
                Transpose::Src => (swapped, extent),
                _ => (extent, swapped),
            };
            let lead = (rnd(2) as usize).min(MAX_DIMS - k);
            let tensor = |e: &Dims, rnd: &mut dyn FnMut(u64) -> u64| {
                let mut shape: Vec<u64> = (0..lead).map(|_| 1 + rnd(3)).collect();
                let mut off: Vec<u64> = shape.iter().map(|&n| rnd(n)).collect();
                for d in 0..k {
                    let o = rnd(4);
                    off.push(o);
                    shape.push(o + e.get(d) + rnd(4));
                }
                (Dims::new(&shape), Dims::new(&off))
            };
            let (s_shape, s_off) = tensor(&s_ext, &mut rnd);
            let (d_shape, d_off) = tensor(&d_ext, &mut rnd);
            let es = dtype.size();
            let src: Vec<u8> = (0..s_shape.numel() as usize * es)
                .map(|i| (i * 131 + i / 256 + 7) as u8)
                .collect();
            let fill: Vec<u8> = (0..d_shape.numel() as usize * es)
                .map(|i| (i * 17 + 5) as u8)
                .collect();
            let b =
                StridedBox::new_transposed(&s_shape, &s_off, &d_shape, &d_off, &extent, t).unwrap();
            tiled_cases += usize::from(b.transposed_pair().is_some());
            let mut want = fill.clone();
            copy_runs(&src, dtype, &mut want, dtype, &b).unwrap();
            let mut got = fill.clone();
            copy_box_transposed(
                &src, &s_shape, &s_off, dtype, &mut got, &d_shape, &d_off, dtype, &extent, t,
            )
            .unwrap();
            assert!(
                got == want,
                "case {case}: {dtype} box {extent} {t:?} from {s_shape} at {s_off} into {d_shape} at {d_off}"
            );
        }
        // most boxes take the tiled path (a box with a swapped dim of 1 has nothing to swap)
        assert!(tiled_cases > 300, "{tiled_cases} of 400 cases tiled");
    }

    #[test]
    fn transposed_box_that_does_not_fit_or_has_one_dim_is_an_error() {
        // a [2, 3] box transposed occupies [3, 2]: it fits a [3, 2] tensor, not a [2, 3] one
        let (a, b) = (Dims::new(&[2, 3]), Dims::new(&[3, 2]));
        let z = Dims::zeros(2);
        StridedBox::new_transposed(&a, &z, &b, &z, &a, Transpose::Dst).unwrap();
        let e = StridedBox::new_transposed(&a, &z, &a, &z, &a, Transpose::Dst);
        assert!(matches!(e, Err(CopyError::OutOfBounds(_))), "{e:?}");
        let one = Dims::new(&[3]);
        let e = StridedBox::new_transposed(
            &one,
            &Dims::zeros(1),
            &one,
            &Dims::zeros(1),
            &one,
            Transpose::Dst,
        );
        assert!(matches!(e, Err(CopyError::Transposed(_))), "{e:?}");
        // four dims none of which merge: more strided dims than a copy walks
        let four = Dims::new(&[2, 2, 2, 2]);
        let src = Dims::new(&[3, 3, 3, 3]);
        let z4 = Dims::zeros(4);
        let e = StridedBox::new_transposed(&src, &z4, &src, &z4, &four, Transpose::Dst);
        assert!(matches!(e, Err(CopyError::Transposed(_))), "{e:?}");
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
