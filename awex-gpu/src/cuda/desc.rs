//! From planned boxes to device copy descriptors: the geometry of the CUDA data path.
//!
//! A [`Transfer`] moves one box between two row-major tensors; [`StridedBox`] reduces it to
//! contiguous runs with strides. Here those runs become [`CopyDesc`]s, each one driver call:
//! a plain linear copy (one run), a pitched 2-D copy (runs repeated over one outer dimension,
//! `cuMemcpy2DAsync`), or a pitched 3-D copy (two outer dimensions, `cuMemcpy3DAsync`). A
//! fourth dimension, or strides the driver cannot express, is looped over on the host. This is a
//! pure function, so the exact byte ranges are tested on any machine.

use super::CudaError;
use awex_core::layout::copy::StridedBox;
use awex_core::plan::Transfer;

/// The largest row pitch, in bytes, that the driver accepts for pitched copies
/// (`CU_DEVICE_ATTRIBUTE_MAX_PITCH` on every current NVIDIA GPU).
pub const MAX_PITCH: u64 = (1 << 31) - 1;

/// Which driver call a descriptor needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyKind {
    /// One contiguous range (`cuMemcpyDtoDAsync`).
    Linear,
    /// Rows with a pitch on each side (`cuMemcpy2DAsync`).
    Pitched2D,
    /// Slices of rows (`cuMemcpy3DAsync`).
    Pitched3D,
}

/// One device-to-device copy: `depth` slices of `height` rows of `width` bytes.
///
/// Row `y` of slice `z` starts at `src + (z * src_rows + y) * src_pitch` and lands at
/// `dst + (z * dst_rows + y) * dst_pitch`, as in the driver's `CUDA_MEMCPY3D`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyDesc {
    /// Address of the first source byte.
    pub src: u64,
    /// Address of the first destination byte.
    pub dst: u64,
    /// Bytes per row.
    pub width: u64,
    /// Rows per slice.
    pub height: u64,
    /// Slices.
    pub depth: u64,
    /// Bytes from one source row to the next.
    pub src_pitch: u64,
    /// Bytes from one destination row to the next.
    pub dst_pitch: u64,
    /// Source rows from one slice to the next.
    pub src_rows: u64,
    /// Destination rows from one slice to the next.
    pub dst_rows: u64,
}

impl CopyDesc {
    /// A contiguous copy of `len` bytes.
    pub fn linear(src: u64, dst: u64, len: u64) -> Self {
        CopyDesc {
            src,
            dst,
            width: len,
            height: 1,
            depth: 1,
            src_pitch: len,
            dst_pitch: len,
            src_rows: 1,
            dst_rows: 1,
        }
    }

    /// The driver call this descriptor needs.
    pub fn kind(&self) -> CopyKind {
        if self.depth > 1 {
            CopyKind::Pitched3D
        } else if self.height > 1 {
            CopyKind::Pitched2D
        } else {
            CopyKind::Linear
        }
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.width * self.height * self.depth
    }

    /// Calls `f(src_addr, dst_addr, len)` for every contiguous row, slice-major then row order.
    pub fn for_each_row(&self, mut f: impl FnMut(u64, u64, u64)) {
        for z in 0..self.depth {
            for y in 0..self.height {
                f(
                    self.src + (z * self.src_rows + y) * self.src_pitch,
                    self.dst + (z * self.dst_rows + y) * self.dst_pitch,
                    self.width,
                );
            }
        }
    }
}

/// Counts of descriptors by kind, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DescStats {
    /// Linear copies.
    pub linear: usize,
    /// 2-D pitched copies.
    pub pitched_2d: usize,
    /// 3-D pitched copies.
    pub pitched_3d: usize,
    /// Bytes moved by all of them.
    pub bytes: u64,
}

impl DescStats {
    /// Tallies a list of descriptors.
    pub fn of(descs: &[CopyDesc]) -> Self {
        let mut s = DescStats::default();
        for d in descs {
            match d.kind() {
                CopyKind::Linear => s.linear += 1,
                CopyKind::Pitched2D => s.pitched_2d += 1,
                CopyKind::Pitched3D => s.pitched_3d += 1,
            }
            s.bytes += d.bytes();
        }
        s
    }
}

/// The copies that carry `t` from the source tensor at address `src` to the destination tensor
/// at address `dst` (both the tensors' first bytes).
///
/// Byte copies only: a transfer that converts dtypes is refused (the element-wise kernel
/// converts it: [`super::transpose::convert_jobs`]).
pub fn copy_descriptors(t: &Transfer, src: u64, dst: u64) -> Result<Vec<CopyDesc>, CudaError> {
    if t.converts() {
        return Err(CudaError::geometry(
            &t.dst_tensor,
            awex_core::layout::copy::CopyError::Transposed(
                format!(
                    "the box converts {} to {}: copies cannot move it, the element-wise kernel does (`transpose::convert_jobs`)",
                    t.src_dtype, t.dst_dtype
                )
                .into(),
            ),
        ));
    }
    let b = t
        .strided_box()
        .map_err(|e| CudaError::geometry(&t.dst_tensor, e))?;
    if t.transposed && b.transposed_pair().is_some() {
        return Err(CudaError::geometry(
            &t.dst_tensor,
            awex_core::layout::copy::CopyError::Transposed(
                "the box is received transposed (the engine stores it with its last two dims swapped): copies cannot move it, the transpose kernel does (`transpose::transpose_jobs`)".into(),
            ),
        ));
    }
    let mut out = Vec::new();
    push_box(&b, t.dst_dtype.size() as u64, src, dst, &mut out);
    Ok(out)
}

/// Appends the descriptors of a strided box whose element size is `es` bytes.
pub fn push_box(b: &StridedBox, es: u64, src: u64, dst: u64, out: &mut Vec<CopyDesc>) {
    let width = b.run * es;
    let outer: Vec<(u64, u64, u64)> = b.outer[..b.n_outer]
        .iter()
        .map(|&(c, ss, ds)| (c, ss * es, ds * es))
        .collect();
    let src0 = src + b.src_base * es;
    let dst0 = dst + b.dst_base * es;
    let Some(&(h, sp, dp)) = outer.first() else {
        out.push(CopyDesc::linear(src0, dst0, width));
        return;
    };
    if sp > MAX_PITCH || dp > MAX_PITCH {
        // the driver cannot pitch this far: one linear copy per run
        loop_outer(&outer, 0, src0, dst0, &mut |s, d| {
            out.push(CopyDesc::linear(s, d, width))
        });
        return;
    }
    let plane = CopyDesc {
        src: src0,
        dst: dst0,
        width,
        height: h,
        depth: 1,
        src_pitch: sp,
        dst_pitch: dp,
        src_rows: h,
        dst_rows: h,
    };
    // a second outer dim becomes the depth when its strides are whole multiples of the pitches
    if let Some(&(z, ss, ds)) = outer.get(1)
        && ss % sp == 0
        && ds % dp == 0
        && ss / sp >= h
        && ds / dp >= h
    {
        let cube = CopyDesc {
            depth: z,
            src_rows: ss / sp,
            dst_rows: ds / dp,
            ..plane
        };
        loop_outer(&outer, 2, 0, 0, &mut |s, d| {
            out.push(CopyDesc {
                src: cube.src + s,
                dst: cube.dst + d,
                ..cube
            })
        });
        return;
    }
    loop_outer(&outer, 1, 0, 0, &mut |s, d| {
        out.push(CopyDesc {
            src: plane.src + s,
            dst: plane.dst + d,
            ..plane
        })
    });
}

/// The copies of a list of planned transfers, in order; with `merge`, each series of
/// transfers between the same source and destination tensors is [`coalesce`]d.
///
/// `addr` gives a transfer's source and destination tensor addresses. Merging stops at tensor
/// boundaries: the driver wants every row of a pitched copy inside one allocation, and two
/// tensors may be two allocations.
pub fn plan_copies(
    transfers: &[Transfer],
    merge: bool,
    mut addr: impl FnMut(&Transfer) -> Result<(u64, u64), CudaError>,
) -> Result<Vec<CopyDesc>, CudaError> {
    let mut out = Vec::new();
    let mut series: Vec<CopyDesc> = Vec::new();
    let mut key = None;
    for t in transfers {
        let k = (t.src_rank, &*t.src_tensor, &*t.dst_tensor);
        if key != Some(k) {
            flush(&mut series, merge, &mut out);
            key = Some(k);
        }
        let (src, dst) = addr(t)?;
        series.extend(copy_descriptors(t, src, dst)?);
    }
    flush(&mut series, merge, &mut out);
    Ok(out)
}

fn flush(series: &mut Vec<CopyDesc>, merge: bool, out: &mut Vec<CopyDesc>) {
    if merge {
        out.extend(coalesce(series));
    } else {
        out.append(series);
    }
    series.clear();
}

/// Cuts every linear copy longer than `max` bytes into pieces of `max` bytes (the last one
/// shorter), so that one large tensor can be spread over several streams.
pub fn split_linear(descs: &[CopyDesc], max: u64) -> Vec<CopyDesc> {
    let mut out = Vec::with_capacity(descs.len());
    for d in descs {
        if max == 0 || d.kind() != CopyKind::Linear || d.width <= max {
            out.push(*d);
            continue;
        }
        let mut done = 0;
        while done < d.width {
            let n = max.min(d.width - done);
            out.push(CopyDesc::linear(d.src + done, d.dst + done, n));
            done += n;
        }
    }
    out
}

/// Merges runs of equal-width linear copies whose addresses advance by fixed pitches into
/// pitched 2-D copies; the same bytes move, in fewer driver calls. The copies must all lie in
/// one source and one destination allocation (see [`plan_copies`]).
///
/// Planned boxes are often regular across transfers: Megatron's interleaved QKV rows go to
/// SGLang's concatenated Q, K and V blocks as one box per query group, each group a fixed
/// stride further on both ends. Each such series becomes one 2-D copy.
pub fn coalesce(descs: &[CopyDesc]) -> Vec<CopyDesc> {
    let mut out: Vec<CopyDesc> = Vec::with_capacity(descs.len());
    for d in descs {
        if let Some(last) = out.last_mut()
            && extend_rows(last, d)
        {
            continue;
        }
        out.push(*d);
    }
    out
}

/// Joins linear copies that continue each other on both ends (the next one starts where the
/// last ended, in the source and in the destination) into one, across tensor boundaries, where
/// `allowed(src_start, src_end, dst_start, dst_end)` accepts the joined ranges (the caller
/// checks that each lies in one allocation: a copy may not span two).
///
/// This is what keeps MoE experts cheap: Megatron holds one tensor per expert, SGLang one
/// `w13` / `w2` per layer; where the expert tensors sit back to back in one training buffer,
/// a layer's experts become one copy instead of one per expert. Linear copies come out sorted
/// by source address after the pitched ones, which keep their order.
pub fn merge_contiguous(
    descs: &[CopyDesc],
    mut allowed: impl FnMut(u64, u64, u64, u64) -> bool,
) -> Vec<CopyDesc> {
    let (mut linear, mut out): (Vec<CopyDesc>, Vec<CopyDesc>) = descs
        .iter()
        .partition(|d| d.kind() == CopyKind::Linear && d.width > 0);
    linear.sort_by_key(|d| (d.src, d.dst));
    let mut merged: Vec<CopyDesc> = Vec::with_capacity(linear.len());
    for d in linear {
        if let Some(last) = merged.last_mut()
            && last.src + last.width == d.src
            && last.dst + last.width == d.dst
            && allowed(last.src, d.src + d.width, last.dst, d.dst + d.width)
        {
            *last = CopyDesc::linear(last.src, last.dst, last.width + d.width);
            continue;
        }
        merged.push(d);
    }
    out.extend(merged);
    out
}

/// Appends linear copy `d` to `cur` as one more row, if it continues `cur`'s pitches.
fn extend_rows(cur: &mut CopyDesc, d: &CopyDesc) -> bool {
    if d.kind() != CopyKind::Linear || cur.depth != 1 || d.width != cur.width {
        return false;
    }
    if cur.height == 1 {
        let (Some(sp), Some(dp)) = (d.src.checked_sub(cur.src), d.dst.checked_sub(cur.dst)) else {
            return false;
        };
        // rows must not overlap, and the driver must accept the pitches
        if sp < cur.width || dp < cur.width || sp > MAX_PITCH || dp > MAX_PITCH {
            return false;
        }
        (cur.src_pitch, cur.dst_pitch) = (sp, dp);
    } else if d.src != cur.src + cur.height * cur.src_pitch
        || d.dst != cur.dst + cur.height * cur.dst_pitch
    {
        return false;
    }
    cur.height += 1;
    (cur.src_rows, cur.dst_rows) = (cur.height, cur.height);
    true
}

/// Calls `f(src, dst)` for every index of the outer dims `from..`, in row-major order, the
/// dims' strides added to `src` and `dst`.
fn loop_outer(
    outer: &[(u64, u64, u64)],
    from: usize,
    src: u64,
    dst: u64,
    f: &mut impl FnMut(u64, u64),
) {
    let Some((&(c, ss, ds), inner)) = outer.split_last().filter(|_| outer.len() > from) else {
        f(src, dst);
        return;
    };
    for i in 0..c {
        loop_outer(inner, from, src + i * ss, dst + i * ds, f);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use awex_core::dtype::DType;
    use awex_core::layout::copy::copy_box;
    use awex_core::layout::{Dims, RankId};
    use proptest::prelude::*;
    use std::sync::Arc;

    /// A transfer of `dtype` between tensors `src` and `dst` (not transposed), for tests.
    pub(crate) fn transfer(
        src_shape: &[u64],
        src_off: &[u64],
        dst_shape: &[u64],
        dst_off: &[u64],
        extent: &[u64],
        dtype: DType,
    ) -> Transfer {
        Transfer {
            encode: None,
            src_rank: RankId::train(0),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: Arc::from("src"),
            src_shape: Dims::new(src_shape),
            src_offset: Dims::new(src_off),
            src_dtype: dtype,
            dst_tensor: Arc::from("dst"),
            dst_shape: Dims::new(dst_shape),
            dst_offset: Dims::new(dst_off),
            dst_dtype: dtype,
            extent: Dims::new(extent),
            transposed: false,
        }
    }

    const S: u64 = 0x7f00_0000_0000;
    const D: u64 = 0x7e00_0000_0000;

    #[test]
    fn back_to_back_experts_join_into_one_copy_where_allowed() {
        // four experts of 1 MiB each, back to back on both ends, then a gap, then a 2-D copy
        let e = 1u64 << 20;
        let mut descs: Vec<CopyDesc> = (0..4)
            .rev()
            .map(|i| CopyDesc::linear(S + i * e, D + i * e, e))
            .collect();
        descs.push(CopyDesc::linear(S + 5 * e, D + 5 * e, e));
        let pitched = CopyDesc {
            height: 2,
            src_pitch: 4096,
            dst_pitch: 2048,
            src_rows: 2,
            dst_rows: 2,
            ..CopyDesc::linear(S + 100 * e, D + 100 * e, 1024)
        };
        descs.insert(2, pitched);
        let all = merge_contiguous(&descs, |_, _, _, _| true);
        assert_eq!(
            all,
            vec![
                pitched,
                CopyDesc::linear(S, D, 4 * e),
                CopyDesc::linear(S + 5 * e, D + 5 * e, e)
            ]
        );
        // an allocation boundary at S + 2 MiB on the source side stops the join there
        let split = merge_contiguous(&descs, |s0, s1, _, _| s1 <= S + 2 * e || s0 >= S + 2 * e);
        assert_eq!(
            split,
            vec![
                pitched,
                CopyDesc::linear(S, D, 2 * e),
                CopyDesc::linear(S + 2 * e, D + 2 * e, 2 * e),
                CopyDesc::linear(S + 5 * e, D + 5 * e, e)
            ]
        );
        // the same bytes move
        let bytes = |v: &[CopyDesc]| v.iter().map(CopyDesc::bytes).sum::<u64>();
        assert_eq!(bytes(&all), bytes(&descs));
        assert_eq!(bytes(&split), bytes(&descs));
    }

    #[test]
    fn copies_adjacent_on_one_end_only_stay_apart() {
        let a = CopyDesc::linear(S, D, 256);
        let b = CopyDesc::linear(S + 256, D + 512, 256);
        assert_eq!(merge_contiguous(&[a, b], |_, _, _, _| true), vec![a, b]);
    }

    #[test]
    fn qkv_group_rows_are_one_linear_copy() {
        // Megatron interleaved qkv rows 768..1280 -> SGLang concatenated rows 512..1024 (bf16)
        let t = transfer(
            &[6144, 4096],
            &[768, 0],
            &[6144, 4096],
            &[512, 0],
            &[512, 4096],
            DType::Bf16,
        );
        let d = copy_descriptors(&t, S, D).unwrap();
        assert_eq!(
            d,
            vec![CopyDesc::linear(
                S + 768 * 4096 * 2,
                D + 512 * 4096 * 2,
                512 * 4096 * 2
            )]
        );
        assert_eq!(d[0].kind(), CopyKind::Linear);
    }

    #[test]
    fn row_parallel_column_block_is_one_2d_copy() {
        // the second half of the columns of a [4096, 12288] down_proj into a tp=2 shard
        let t = transfer(
            &[4096, 12288],
            &[0, 6144],
            &[4096, 6144],
            &[0, 0],
            &[4096, 6144],
            DType::Bf16,
        );
        let d = copy_descriptors(&t, S, D).unwrap();
        assert_eq!(
            d,
            vec![CopyDesc {
                src: S + 6144 * 2,
                dst: D,
                width: 6144 * 2,
                height: 4096,
                depth: 1,
                src_pitch: 12288 * 2,
                dst_pitch: 6144 * 2,
                src_rows: 4096,
                dst_rows: 4096,
            }]
        );
        assert_eq!(d[0].kind(), CopyKind::Pitched2D);
        assert_eq!(d[0].bytes(), 4096 * 6144 * 2);
    }

    #[test]
    fn box_in_3d_tensor_is_one_3d_copy_with_exact_rows() {
        // box [2, 3, 4] at (1, 2, 3) of a [4, 6, 8] f32 tensor into (0, 1, 2) of a [2, 5, 10] tensor
        let t = transfer(
            &[4, 6, 8],
            &[1, 2, 3],
            &[2, 5, 10],
            &[0, 1, 2],
            &[2, 3, 4],
            DType::F32,
        );
        let d = copy_descriptors(&t, 0, 10_000).unwrap();
        assert_eq!(
            d,
            vec![CopyDesc {
                src: (48 + 2 * 8 + 3) * 4,
                dst: 10_000 + (10 + 2) * 4,
                width: 16,
                height: 3,
                depth: 2,
                src_pitch: 32,
                dst_pitch: 40,
                src_rows: 6,
                dst_rows: 5,
            }]
        );
        let mut rows = vec![];
        d[0].for_each_row(|s, d, n| rows.push((s, d, n)));
        assert_eq!(
            rows,
            vec![
                (268, 10_048, 16),
                (300, 10_088, 16),
                (332, 10_128, 16),
                (460, 10_248, 16),
                (492, 10_288, 16),
                (524, 10_328, 16),
            ]
        );
    }

    #[test]
    fn four_dim_box_loops_3d_copies_over_the_outermost_dim() {
        // box [2, 2, 3, 3] at (1, 1, 1, 2) of a [3, 3, 4, 6] tensor into a whole [2, 2, 3, 3] one
        let t = transfer(
            &[3, 3, 4, 6],
            &[1, 1, 1, 2],
            &[2, 2, 3, 3],
            &[0, 0, 0, 0],
            &[2, 2, 3, 3],
            DType::Bf16,
        );
        let d = copy_descriptors(&t, 0, 0).unwrap();
        let cube = CopyDesc {
            src: (72 + 24 + 6 + 2) * 2,
            dst: 0,
            width: 6,
            height: 3,
            depth: 2,
            src_pitch: 12,
            dst_pitch: 6,
            src_rows: 4,
            dst_rows: 3,
        };
        assert_eq!(
            d,
            vec![
                cube,
                CopyDesc {
                    src: cube.src + 72 * 2,
                    dst: 18 * 2,
                    ..cube
                }
            ]
        );
        assert_eq!(d[0].kind(), CopyKind::Pitched3D);
    }

    #[test]
    fn pitch_beyond_the_driver_limit_falls_back_to_linear_rows() {
        // a column of a [2, 2^31] bf16 tensor: the row pitch is 4 GiB
        let t = transfer(
            &[2, 1 << 31],
            &[0, 5],
            &[2, 1],
            &[0, 0],
            &[2, 1],
            DType::Bf16,
        );
        let d = copy_descriptors(&t, 0, 0).unwrap();
        assert_eq!(
            d,
            vec![
                CopyDesc::linear(10, 0, 2),
                CopyDesc::linear((1 << 32) + 10, 2, 2)
            ]
        );
    }

    #[test]
    fn a_converting_transfer_is_refused_by_the_copies_naming_the_kernel_that_converts() {
        let mut t = transfer(&[4], &[0], &[4], &[0], &[4], DType::F32);
        t.dst_dtype = DType::Bf16;
        let e = copy_descriptors(&t, 0, 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "`dst`: the box converts f32 to bf16: copies cannot move it, the element-wise kernel does (`transpose::convert_jobs`)"
        );
    }

    #[test]
    fn box_outside_its_tensor_is_a_geometry_error() {
        let t = transfer(&[4, 4], &[3, 0], &[4, 4], &[0, 0], &[2, 4], DType::Bf16);
        let e = copy_descriptors(&t, 0, 0).unwrap_err();
        // the geometry's own message, prefixed with the destination tensor
        let geometry = StridedBox::new(
            &t.src_shape,
            &t.src_offset,
            &t.dst_shape,
            &t.dst_offset,
            &t.extent,
        )
        .unwrap_err();
        assert!(geometry.to_string().contains("[2, 4]"));
        assert_eq!(e.to_string(), format!("`dst`: {geometry}"));
    }

    #[test]
    fn qkv_groups_coalesce_into_one_2d_copy_per_block() {
        // Megatron [q0 k0 v0 q1 k1 v1] (4 q rows, 1 k row, 1 v row per group, rows of 8 bytes)
        // into SGLang [q0 q1 k0 k1 v0 v1]: six boxes, three 2-D copies
        let row = 8;
        let boxes = [
            (0, 0, 4),
            (6, 4, 4),
            (4, 8, 1),
            (10, 9, 1),
            (5, 10, 1),
            (11, 11, 1),
        ];
        let descs: Vec<CopyDesc> = boxes
            .iter()
            .map(|&(s, d, n)| CopyDesc::linear(s * row, 1000 + d * row, n * row))
            .collect();
        let c = coalesce(&descs);
        let two = |src, dst, width, sp, dp| CopyDesc {
            src,
            dst,
            width,
            height: 2,
            depth: 1,
            src_pitch: sp,
            dst_pitch: dp,
            src_rows: 2,
            dst_rows: 2,
        };
        assert_eq!(
            c,
            vec![
                two(0, 1000, 32, 48, 32),
                two(32, 1064, 8, 48, 8),
                two(40, 1080, 8, 48, 8),
            ]
        );
    }

    #[test]
    fn series_merge_within_a_tensor_pair_but_not_across_tensors() {
        // four one-row boxes at a fixed stride on both ends: the first two go from tensor A
        // to X, the last two from A to Y, laid out right after X
        let mut ts = vec![];
        for (i, dst) in ["X", "X", "Y", "Y"].into_iter().enumerate() {
            let mut t = transfer(
                &[8, 4],
                &[2 * i as u64, 0],
                &[2, 4],
                &[i as u64 % 2, 0],
                &[1, 4],
                DType::Bf16,
            );
            t.src_tensor = Arc::from("A");
            t.dst_tensor = Arc::from(dst);
            ts.push(t);
        }
        let addr = |t: &Transfer| {
            Ok((
                0x1000,
                if &*t.dst_tensor == "X" {
                    0x9000
                } else {
                    0x9010
                },
            ))
        };
        let merged = plan_copies(&ts, true, addr).unwrap();
        let row = |s: u64, d: u64| CopyDesc {
            src: 0x1000 + s,
            dst: 0x9000 + d,
            width: 8,
            height: 2,
            depth: 1,
            src_pitch: 16,
            dst_pitch: 8,
            src_rows: 2,
            dst_rows: 2,
        };
        assert_eq!(merged, vec![row(0, 0), row(32, 16)]);
        let apart = plan_copies(&ts, false, addr).unwrap();
        assert_eq!(
            apart,
            vec![
                CopyDesc::linear(0x1000, 0x9000, 8),
                CopyDesc::linear(0x1010, 0x9008, 8),
                CopyDesc::linear(0x1020, 0x9010, 8),
                CopyDesc::linear(0x1030, 0x9018, 8),
            ]
        );
    }

    #[test]
    fn long_linear_copies_split_into_pieces_and_others_stay() {
        let pitched = CopyDesc {
            height: 4,
            ..CopyDesc::linear(0, 0, 100)
        };
        let d = [
            CopyDesc::linear(1000, 5000, 250),
            pitched,
            CopyDesc::linear(0, 0, 100),
        ];
        assert_eq!(
            split_linear(&d, 100),
            vec![
                CopyDesc::linear(1000, 5000, 100),
                CopyDesc::linear(1100, 5100, 100),
                CopyDesc::linear(1200, 5200, 50),
                pitched,
                CopyDesc::linear(0, 0, 100),
            ]
        );
        assert_eq!(split_linear(&d, 0), d.to_vec());
    }

    #[test]
    fn copies_that_would_overlap_or_go_backwards_stay_apart() {
        let a = CopyDesc::linear(100, 100, 16);
        // next row starts inside the first: overlapping rows are no pitched copy
        assert_eq!(coalesce(&[a, CopyDesc::linear(108, 200, 16)]).len(), 2);
        // next row lies before the first
        assert_eq!(coalesce(&[a, CopyDesc::linear(50, 200, 16)]).len(), 2);
        // a third row off the pitch starts a new copy
        let c = coalesce(&[
            a,
            CopyDesc::linear(200, 200, 16),
            CopyDesc::linear(301, 300, 16),
        ]);
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].height, c[1]), (2, CopyDesc::linear(301, 300, 16)));
    }

    #[test]
    fn stats_count_descriptors_by_kind() {
        let d = [
            CopyDesc::linear(0, 0, 10),
            CopyDesc {
                height: 3,
                ..CopyDesc::linear(0, 0, 4)
            },
        ];
        assert_eq!(
            DescStats::of(&d),
            DescStats {
                linear: 1,
                pitched_2d: 1,
                pitched_3d: 0,
                bytes: 22
            }
        );
    }

    /// Executes descriptors on host memory, addresses being offsets into the two buffers.
    fn run_on_host(descs: &[CopyDesc], src: &[u8], dst: &mut [u8]) {
        for d in descs {
            d.for_each_row(|s, t, n| {
                dst[t as usize..(t + n) as usize]
                    .copy_from_slice(&src[s as usize..(s + n) as usize])
            });
        }
    }

    /// Source shape, source offset, destination shape, destination offset, extent.
    type BoxCase = (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>);

    fn boxes() -> impl Strategy<Value = BoxCase> {
        (1usize..=4).prop_flat_map(|n| {
            proptest::collection::vec((1u64..5, 0u64..3, 0u64..3, 0u64..3), n).prop_map(|v| {
                // extent e, source shape e + a + b, destination shape e + c, offsets a and c
                let ext: Vec<u64> = v.iter().map(|x| x.0).collect();
                let src_shape = v.iter().map(|x| x.0 + x.1 + x.2).collect();
                let src_off = v.iter().map(|x| x.1).collect();
                let dst_shape = v.iter().map(|x| x.0 + x.3).collect();
                let dst_off = v.iter().map(|x| x.3).collect();
                (src_shape, src_off, dst_shape, dst_off, ext)
            })
        })
    }

    proptest! {
        #[test]
        fn descriptors_move_exactly_the_bytes_copy_box_moves((ss, so, ds, dof, ext) in boxes()) {
            let t = transfer(&ss, &so, &ds, &dof, &ext, DType::Bf16);
            let descs = copy_descriptors(&t, 0, 0).unwrap();
            let src_len = ss.iter().product::<u64>() as usize * 2;
            let dst_len = ds.iter().product::<u64>() as usize * 2;
            let src: Vec<u8> = (0..src_len).map(|i| (i * 7 + 3) as u8).collect();
            let mut want = vec![0xEEu8; dst_len];
            copy_box(&src, &t.src_shape, &t.src_offset, DType::Bf16, &mut want,
                &t.dst_shape, &t.dst_offset, DType::Bf16, &t.extent).unwrap();
            let mut got = vec![0xEEu8; dst_len];
            run_on_host(&descs, &src, &mut got);
            prop_assert_eq!(got, want);
            prop_assert_eq!(DescStats::of(&descs).bytes, t.bytes());
            // rows come in the box's row-major order, matching the strided runs one to one
            let mut rows = vec![];
            for d in &descs { d.for_each_row(|s, t, n| rows.push((s, t, n))); }
            let b = StridedBox::new(&t.src_shape, &t.src_offset, &t.dst_shape, &t.dst_offset, &t.extent).unwrap();
            let mut runs = vec![];
            b.for_each_run(|s, d, n| runs.push((s * 2, d * 2, n * 2)));
            prop_assert_eq!(&rows, &runs);
            // coalescing keeps every row and its order
            let mut merged = vec![];
            for d in coalesce(&descs) { d.for_each_row(|s, t, n| merged.push((s, t, n))); }
            prop_assert_eq!(merged, rows);
        }
    }
}
