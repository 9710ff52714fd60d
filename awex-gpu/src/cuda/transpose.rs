//! Element-wise boxes on the GPU: the transfers an engine stores with their last two dims
//! swapped (gpt-oss's experts on SGLang and vLLM, docs/models.md) and the ones that convert
//! dtypes (a trainer's bf16 `A_log` into the engines' fp32, an fp32 router into a bf16 gate),
//! moved by one launch of `awex_transpose_table` (`transpose.cu`) over a table of jobs, each
//! one matrix of the box.
//!
//! A transposed box ([`StridedBox::new_transposed`]) runs one element at a time: one of its
//! dims is contiguous in the source and another in the destination
//! ([`StridedBox::transposed_pair`]). [`transpose_jobs`] makes one job per matrix of those two
//! dims (every index of the box's other dims); the kernel moves 32 x 32 tiles through shared
//! memory so that both ends are read and written in rows. A converting box that is not
//! transposed is a straight job per matrix of its contiguous runs ([`convert_jobs`]). The
//! conversions are [`Conversion`]'s: bf16 and f16 to and from f32, equal bit for bit to
//! [`awex_core::dtype::convert`] (round to nearest even, NaN payloads kept, a widened f16 NaN
//! quiet), which the CPU transports run. The geometry is pure and checked on the host against
//! the CPU copy ([`emulate`]).
//!
//! The PTX and the sm_90 cubin are built from `transpose.cu` with the CUDA 13.0 compiler (the
//! `nvidia-cuda-nvcc`, `-crt`, `-runtime` and `nvidia-nvvm` 13.0 wheels hold it):
//!
//! ```sh
//! nvcc -ptx -arch=compute_75 -O3 transpose.cu -o transpose.ptx
//! ptxas -arch=sm_90 -O3 transpose.ptx -o transpose.sm_90.cubin
//! ```

use super::device::{Device, DeviceBuffer, Stream};
use super::engine::Kernel;
use super::{CudaError, KernelArg, sys};
use awex_core::dtype::DType;
use awex_core::layout::copy::StridedBox;
use awex_core::plan::Transfer;
use std::ffi::CStr;

const TRANSPOSE_PTX: &str = concat!(include_str!("transpose.ptx"), "\0");
const TRANSPOSE_CUBIN_SM90: &[u8] = include_bytes!("transpose.sm_90.cubin");
const TRANSPOSE_NAME: &CStr = c"awex_transpose_table";
/// Bytes of one job in device memory (see `transpose.cu`).
pub const JOB_BYTES: usize = 48;
/// Elements along each side of a tile (one block per tile).
const TILE: u64 = 32;

/// A dtype conversion the GPU makes on the way (the kernel's `mode`, bits 0-7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Conversion {
    /// Bytes as they are.
    #[default]
    None = 0,
    /// bf16 widened to f32 (exact).
    Bf16ToF32 = 1,
    /// f32 rounded to bf16 (to nearest even).
    F32ToBf16 = 2,
    /// f16 widened to f32 (exact).
    F16ToF32 = 3,
    /// f32 rounded to f16 (to nearest even, overflow to infinity).
    F32ToF16 = 4,
}

impl Conversion {
    /// Every conversion the GPU makes.
    const ALL: [Conversion; 4] = [
        Conversion::Bf16ToF32,
        Conversion::F32ToBf16,
        Conversion::F16ToF32,
        Conversion::F32ToF16,
    ];

    /// The conversion from `src` to `dst` elements, if the GPU makes it (`None` for equal
    /// dtypes).
    pub fn of(src: DType, dst: DType) -> Option<Conversion> {
        if src == dst {
            return Some(Conversion::None);
        }
        Self::ALL
            .into_iter()
            .find(|c| c.dtypes() == Some((src, dst)))
    }

    /// Bytes of an element after the conversion of one of `elem` bytes.
    pub fn dst_elem(self, elem: u32) -> u32 {
        match self {
            Conversion::None => elem,
            Conversion::Bf16ToF32 | Conversion::F16ToF32 => 4,
            Conversion::F32ToBf16 | Conversion::F32ToF16 => 2,
        }
    }

    /// The source and destination dtypes of a conversion (`None` for none).
    pub fn dtypes(self) -> Option<(DType, DType)> {
        match self {
            Conversion::None => None,
            Conversion::Bf16ToF32 => Some((DType::Bf16, DType::F32)),
            Conversion::F32ToBf16 => Some((DType::F32, DType::Bf16)),
            Conversion::F16ToF32 => Some((DType::F16, DType::F32)),
            Conversion::F32ToF16 => Some((DType::F32, DType::F16)),
        }
    }
}

/// One matrix of an element-wise box: source element `(r, c)` at
/// `src + r * src_pitch + c * elem`, converted by `conv`, goes to
/// `dst + c * dst_pitch + r * delem` (transposed) or `dst + r * dst_pitch + c * delem`
/// (`straight`), `delem` the converted element's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransposeJob {
    /// First source byte.
    pub src: u64,
    /// First destination byte.
    pub dst: u64,
    /// Source rows (destination columns).
    pub rows: u32,
    /// Source columns (destination rows).
    pub cols: u32,
    /// Bytes between source rows.
    pub src_pitch: u32,
    /// Bytes between destination rows.
    pub dst_pitch: u32,
    /// Bytes per source element: 1, 2 or 4.
    pub elem: u32,
    /// The conversion on the way.
    pub conv: Conversion,
    /// Rows land as rows (a converting box), not as columns.
    pub straight: bool,
}

impl TransposeJob {
    /// 32 x 32 tiles the kernel runs for it.
    pub fn tiles(&self) -> u64 {
        (self.rows as u64).div_ceil(TILE) * (self.cols as u64).div_ceil(TILE)
    }

    /// Bytes written.
    pub fn bytes(&self) -> u64 {
        self.rows as u64 * self.cols as u64 * self.conv.dst_elem(self.elem) as u64
    }

    /// The kernel's `mode` word.
    fn mode(&self) -> u32 {
        self.conv as u32 | (u32::from(self.straight) << 8)
    }
}

/// The jobs of transfer `t` whose source tensor starts at `src` and destination tensor at
/// `dst`, when it is a transposed box of one-element runs; `None` for any other transfer
/// (copied by [`super::copy_descriptors`], or converted by [`convert_jobs`]). A box whose
/// element size is not 1, 2 or 4 bytes, whose conversion the GPU does not make, or whose
/// pitches or sides pass 32 bits, is refused naming the tensor.
pub fn transpose_jobs(
    t: &Transfer,
    src: u64,
    dst: u64,
) -> Result<Option<Vec<TransposeJob>>, CudaError> {
    if !t.transposed {
        return Ok(None);
    }
    let b = t
        .strided_box()
        .map_err(|e| CudaError::geometry(&t.dst_tensor, e))?;
    let conv = conversion(t)?;
    matrix_jobs(&b, t.src_dtype.size() as u64, conv, src, dst, &t.dst_tensor)
}

/// The conversion of transfer `t`, refused naming the tensor and its dtypes where the GPU does
/// not make it (every GPU path asks this).
pub fn conversion(t: &Transfer) -> Result<Conversion, CudaError> {
    Conversion::of(t.src_dtype, t.dst_dtype).ok_or_else(|| CudaError::Conversion {
        tensor: t.dst_tensor.to_string(),
        src: t.src_dtype,
        dst: t.dst_dtype,
    })
}

/// The jobs of transfer `t` whose source tensor starts at `src` and destination tensor at
/// `dst`, when it converts dtypes: one straight job per matrix of its contiguous runs, a box of
/// one run cut into rows of [`RUN_ROW`] elements and a rest so that a tile's rows are used
/// (any box; a transposed one of one-element runs moves faster through [`transpose_jobs`],
/// tried first); `None` for a transfer that does not convert. A conversion the GPU does not
/// make ([`Conversion::of`]) or a pitch past 32 bits is refused naming the tensor.
pub fn convert_jobs(
    t: &Transfer,
    src: u64,
    dst: u64,
) -> Result<Option<Vec<TransposeJob>>, CudaError> {
    if !t.converts() {
        return Ok(None);
    }
    let conv = conversion(t)?;
    let b = t
        .strided_box()
        .map_err(|e| CudaError::geometry(&t.dst_tensor, e))?;
    box_convert_jobs(&b, t.src_dtype.size() as u64, conv, src, dst, &t.dst_tensor).map(Some)
}

/// The straight jobs that move box `b` (strides in elements on each end) of `ses`-byte source
/// elements at `src`, converted by `conv`, to `dst` ([`convert_jobs`] of a transfer; the nccl
/// transport's sender packing a converting piece into its slot). A pitch past 32 bits is
/// refused naming `tensor`.
pub fn box_convert_jobs(
    b: &StridedBox,
    ses: u64,
    conv: Conversion,
    src: u64,
    dst: u64,
    tensor: &str,
) -> Result<Vec<TransposeJob>, CudaError> {
    let des = u64::from(conv.dst_elem(ses as u32));
    let bad = |what: String| {
        CudaError::geometry(
            tensor,
            awex_core::layout::copy::CopyError::Transposed(what.into()),
        )
    };
    let fits = |v: u64| u32::try_from(v).ok();
    let job = |s: u64, d: u64, rows: u64, cols: u64, sp: u64, dp: u64| match (
        fits(rows),
        fits(cols),
        fits(sp),
        fits(dp),
    ) {
        (Some(rows), Some(cols), Some(src_pitch), Some(dst_pitch)) => Ok(TransposeJob {
            src: src + s * ses,
            dst: dst + d * des,
            rows,
            cols,
            src_pitch,
            dst_pitch,
            elem: ses as u32,
            conv,
            straight: true,
        }),
        _ => Err(bad(format!(
            "a {rows} x {cols} matrix with row pitches of {sp} and {dp} bytes passes the GPU conversion's 32-bit fields"
        ))),
    };
    let mut jobs = Vec::new();
    if b.n_outer == 0 {
        // one run: rows of RUN_ROW elements, then the rest
        let (rows, rest) = (b.run / RUN_ROW, b.run % RUN_ROW);
        if rows > 0 {
            let (sp, dp) = (RUN_ROW * ses, RUN_ROW * des);
            jobs.push(job(b.src_base, b.dst_base, rows, RUN_ROW, sp, dp)?);
        }
        if rest > 0 {
            let at = rows * RUN_ROW;
            jobs.push(job(
                b.src_base + at,
                b.dst_base + at,
                1,
                rest,
                rest * ses,
                rest * des,
            )?);
        }
        return Ok(jobs);
    }
    // the innermost outer dim gives the rows; every index of the others one job
    let (rows, ss, ds) = b.outer[0];
    for (s, d) in matrix_bases(b, &b.outer[1..b.n_outer]) {
        jobs.push(job(s, d, rows, b.run, ss * ses, ds * des)?);
    }
    Ok(jobs)
}

/// The first source and destination elements of every matrix of box `b` whose other dims are
/// `rest` (count, source stride, destination stride; innermost first), in that order.
fn matrix_bases(b: &StridedBox, rest: &[(u64, u64, u64)]) -> impl Iterator<Item = (u64, u64)> {
    let n: u64 = rest.iter().map(|o| o.0).product();
    (0..n).map(move |mut k| {
        let (mut s, mut d) = (b.src_base, b.dst_base);
        for &(c, so, dso) in rest {
            s += (k % c) * so;
            d += (k % c) * dso;
            k /= c;
        }
        (s, d)
    })
}

/// The elements of a converting box's single run laid out as one row of a job.
pub const RUN_ROW: u64 = 1024;

/// The jobs that move box `b` of `es`-byte elements from the tensor (or buffer) at `src` to
/// the one at `dst`, when it is a transposed box of one-element runs; `None` for any other
/// box. A box whose element size is not 1, 2 or 4 bytes, or whose pitches or sides pass 32
/// bits, is refused naming `tensor`.
pub fn box_jobs(
    b: &StridedBox,
    es: u64,
    src: u64,
    dst: u64,
    tensor: &str,
) -> Result<Option<Vec<TransposeJob>>, CudaError> {
    matrix_jobs(b, es, Conversion::None, src, dst, tensor)
}

/// [`box_jobs`] of `es`-byte source elements converted by `conv` (the box's strides count
/// elements on each end).
fn matrix_jobs(
    b: &StridedBox,
    es: u64,
    conv: Conversion,
    src: u64,
    dst: u64,
    tensor: &str,
) -> Result<Option<Vec<TransposeJob>>, CudaError> {
    let Some((p, q)) = b.transposed_pair() else {
        return Ok(None);
    };
    let outer = &b.outer[..b.n_outer];
    let (cols, dst_stride) = (outer[p].0, outer[p].2);
    let (rows, src_stride) = (outer[q].0, outer[q].1);
    let fits = |v: u64| u32::try_from(v).ok();
    let bad = |what: String| {
        CudaError::geometry(
            tensor,
            awex_core::layout::copy::CopyError::Transposed(what.into()),
        )
    };
    if !matches!(es, 1 | 2 | 4) {
        return Err(bad(format!(
            "the GPU transposes elements of 1, 2 or 4 bytes; this box's are {es} bytes"
        )));
    }
    let des = u64::from(conv.dst_elem(es as u32));
    let (Some(rows32), Some(cols32), Some(sp), Some(dp)) = (
        fits(rows),
        fits(cols),
        fits(src_stride * es),
        fits(dst_stride * des),
    ) else {
        return Err(bad(format!(
            "a {rows} x {cols} matrix with row pitches of {} and {} bytes passes the GPU transpose's 32-bit fields",
            src_stride * es,
            dst_stride * des
        )));
    };
    // every index of the other dims, innermost first
    let rest: Vec<(u64, u64, u64)> = outer
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != p && *i != q)
        .map(|(_, o)| *o)
        .collect();
    let mut jobs = Vec::new();
    for (s, d) in matrix_bases(b, &rest) {
        jobs.push(TransposeJob {
            src: src + s * es,
            dst: dst + d * des,
            rows: rows32,
            cols: cols32,
            src_pitch: sp,
            dst_pitch: dp,
            elem: es as u32,
            conv,
            straight: false,
        });
    }
    Ok(Some(jobs))
}

/// Runs `jobs` on the host, as the kernel does, over byte buffers addressed from 0 (for tests;
/// conversions through [`awex_core::dtype::convert`]).
pub fn emulate(jobs: &[TransposeJob], src: &[u8], dst: &mut [u8]) {
    for j in jobs {
        let e = j.elem as usize;
        let de = j.conv.dst_elem(j.elem) as usize;
        for r in 0..j.rows as usize {
            for c in 0..j.cols as usize {
                let s = j.src as usize + r * j.src_pitch as usize + c * e;
                let d = if j.straight {
                    j.dst as usize + r * j.dst_pitch as usize + c * de
                } else {
                    j.dst as usize + c * j.dst_pitch as usize + r * de
                };
                match j.conv.dtypes() {
                    None => dst[d..d + e].copy_from_slice(&src[s..s + e]),
                    Some((from, to)) => {
                        let _ = awex_core::dtype::convert(
                            &src[s..s + e],
                            from,
                            &mut dst[d..d + de],
                            to,
                        );
                    }
                }
            }
        }
    }
}

/// The job table's bytes as the kernel reads them, and the tiles of the launch.
pub fn table_bytes(jobs: &[TransposeJob]) -> (Vec<u8>, u64) {
    let mut b = Vec::with_capacity(jobs.len() * JOB_BYTES);
    let mut first = 0u64;
    for j in jobs {
        b.extend_from_slice(&j.src.to_le_bytes());
        b.extend_from_slice(&j.dst.to_le_bytes());
        for v in [
            j.rows,
            j.cols,
            j.src_pitch,
            j.dst_pitch,
            first as u32,
            (j.cols as u64).div_ceil(TILE) as u32,
            j.elem,
            j.mode(),
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        first += j.tiles();
    }
    (b, first)
}

/// A job table in device memory, launched by [`TransposeKernel::launch`].
pub struct TransposeBatch {
    table: DeviceBuffer,
    jobs: u32,
    tiles: u32,
    /// Bytes the batch moves.
    pub bytes: u64,
}

impl TransposeBatch {
    /// Jobs (matrices) of the batch.
    pub fn jobs(&self) -> u32 {
        self.jobs
    }
}

/// The transpose kernel, loaded on one device.
pub struct TransposeKernel {
    kernel: Kernel,
}

impl TransposeKernel {
    /// Loads the kernel on `dev`.
    pub fn load(dev: &Device) -> Result<TransposeKernel, CudaError> {
        Ok(TransposeKernel {
            kernel: Kernel::load(dev, TRANSPOSE_PTX, TRANSPOSE_CUBIN_SM90, TRANSPOSE_NAME)?,
        })
    }

    /// Uploads `jobs` as one batch (`None` for no jobs). A batch of more than 2^31 - 1 tiles
    /// or 2^32 - 1 jobs is refused.
    pub fn batch(&self, jobs: &[TransposeJob]) -> Result<Option<TransposeBatch>, CudaError> {
        if jobs.is_empty() {
            return Ok(None);
        }
        let (bytes, tiles) = table_bytes(jobs);
        let (Ok(n), Ok(tiles)) = (u32::try_from(jobs.len()), u32::try_from(tiles)) else {
            return Err(CudaError::Copy {
                desc: format!("{} transposed matrices", jobs.len()),
                detail: "more tiles than one launch takes".into(),
            });
        };
        if tiles > i32::MAX as u32 {
            return Err(CudaError::Copy {
                desc: format!("{tiles} transpose tiles"),
                detail: "more tiles than one launch takes".into(),
            });
        }
        let table = self.kernel.dev.alloc(bytes.len() as u64)?;
        table.upload(0, &bytes)?;
        Ok(Some(TransposeBatch {
            table,
            jobs: n,
            tiles,
            bytes: jobs.iter().map(TransposeJob::bytes).sum(),
        }))
    }

    /// Queues `batch` on `s`.
    ///
    /// # Safety
    ///
    /// Every job's source and destination bytes must be device memory mapped in the kernel's
    /// context, allocated (and the destinations used by nothing else) until the launch has
    /// finished; no two jobs may write the same bytes.
    pub unsafe fn launch(&self, s: &Stream, batch: &TransposeBatch) -> Result<(), CudaError> {
        if batch.tiles == 0 {
            return Ok(());
        }
        self.kernel.dev_bind()?;
        let mut args = [
            KernelArg::U64(batch.table.ptr()),
            KernelArg::U32(batch.jobs),
        ];
        // SAFETY: the kernel takes (jobs, njobs); the caller vouches for the memory.
        unsafe { sys::launch_args(self.kernel.func, batch.tiles, (32, 8), s.raw, &mut args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use awex_core::dims::Dims;
    use awex_core::dtype::DType;
    use awex_core::layout::copy::copy_box_transposed;

    /// A transposed transfer into an engine's expert tensor.
    fn transfer(
        src_shape: &[u64],
        src_off: &[u64],
        dst_shape: &[u64],
        dst_off: &[u64],
        extent: &[u64],
        dtype: DType,
    ) -> Transfer {
        Transfer {
            transposed: true,
            ..crate::cuda::desc::tests::transfer(
                src_shape, src_off, dst_shape, dst_off, extent, dtype,
            )
        }
    }

    #[test]
    fn jobs_move_the_same_bytes_as_the_cpu_transposed_copy() {
        // experts [E, H, I] sharded and offset on both ends, odd sides, every element size
        for dtype in [DType::F8E4m3, DType::Bf16, DType::F32] {
            let es = dtype.size();
            for (src_shape, src_off, dst_shape, dst_off, extent) in [
                (
                    &[4u64, 45, 70][..],
                    &[1u64, 3, 5][..],
                    &[3u64, 66, 40][..],
                    &[0u64, 2, 1][..],
                    &[2u64, 37, 61][..],
                ),
                (&[70, 33], &[0, 0], &[33, 70], &[0, 0], &[70, 33]),
                (
                    &[5, 2, 31, 9],
                    &[1, 0, 0, 0],
                    &[4, 2, 9, 31],
                    &[0, 1, 0, 0],
                    &[3, 1, 31, 9],
                ),
            ] {
                let t = transfer(src_shape, src_off, dst_shape, dst_off, extent, dtype);
                let src: Vec<u8> = (0..Dims::new(src_shape).numel() as usize * es)
                    .map(|i| (i * 7 + i / 251) as u8)
                    .collect();
                let n = Dims::new(dst_shape).numel() as usize * es;
                let mut want = vec![0xABu8; n];
                copy_box_transposed(
                    &src,
                    &t.src_shape,
                    &t.src_offset,
                    dtype,
                    &mut want,
                    &t.dst_shape,
                    &t.dst_offset,
                    dtype,
                    &t.extent,
                    t.transpose(),
                )
                .unwrap();
                let jobs = transpose_jobs(&t, 0, 0).unwrap().unwrap();
                let mut got = vec![0xABu8; n];
                emulate(&jobs, &src, &mut got);
                assert_eq!(got, want, "{dtype:?} {extent:?}");
                let bytes: u64 = jobs.iter().map(TransposeJob::bytes).sum();
                assert_eq!(bytes, t.extent.numel() * es as u64);
            }
        }
    }

    /// The CPU's converting (and, for a transposed transfer, transposing) copy of `t` over
    /// `src` into a destination filled with 0xAB.
    fn cpu_copy(t: &Transfer, src: &[u8]) -> Vec<u8> {
        let n = t.dst_shape.numel() as usize * t.dst_dtype.size();
        let mut want = vec![0xABu8; n];
        copy_box_transposed(
            src,
            &t.src_shape,
            &t.src_offset,
            t.src_dtype,
            &mut want,
            &t.dst_shape,
            &t.dst_offset,
            t.dst_dtype,
            &t.extent,
            t.transpose(),
        )
        .unwrap();
        want
    }

    /// The CPU's copy of `t` over `src`, and the same through the jobs of `t`
    /// ([`transpose_jobs`] for a transposed transfer unless `straight`, else [`convert_jobs`]).
    fn both_ways(
        t: &Transfer,
        src: &[u8],
        straight: bool,
    ) -> (Vec<u8>, Vec<u8>, Vec<TransposeJob>) {
        let want = cpu_copy(t, src);
        let jobs = if t.transposed && !straight {
            transpose_jobs(t, 0, 0)
        } else {
            convert_jobs(t, 0, 0)
        }
        .unwrap()
        .unwrap();
        let mut got = vec![0xABu8; want.len()];
        emulate(&jobs, src, &mut got);
        (want, got, jobs)
    }

    #[test]
    fn converting_jobs_write_the_same_bytes_as_the_cpu_converting_copy() {
        let pairs = [
            (DType::Bf16, DType::F32),
            (DType::F32, DType::Bf16),
            (DType::F16, DType::F32),
            (DType::F32, DType::F16),
        ];
        for (from, to) in pairs {
            for transposed in [false, true] {
                for (src_shape, src_off, dst_shape, dst_off, extent) in [
                    // a layer's A_log: one run shorter than a row of a job
                    (
                        &[32u64][..],
                        &[0u64][..],
                        &[16u64][..],
                        &[0u64][..],
                        &[16u64][..],
                    ),
                    // a router [E, H] whole: one run of 2.7 rows of RUN_ROW and a rest
                    (&[8, 347], &[0, 0], &[8, 347], &[0, 0], &[8, 347]),
                    // sharded and offset on both ends, odd sides
                    (
                        &[4, 45, 70],
                        &[1, 3, 5],
                        &[3, 66, 40],
                        &[0, 2, 1],
                        &[2, 37, 33],
                    ),
                    (
                        &[5, 2, 31, 9],
                        &[1, 0, 0, 0],
                        &[4, 2, 31, 9],
                        &[0, 1, 0, 0],
                        &[3, 1, 31, 9],
                    ),
                ] {
                    if transposed && extent.len() < 2 {
                        continue;
                    }
                    let mut t = transfer(src_shape, src_off, dst_shape, dst_off, extent, from);
                    t.dst_dtype = to;
                    t.transposed = transposed;
                    if transposed {
                        let k = dst_shape.len();
                        let mut d = Dims::new(dst_shape);
                        let (a, b) = (d.get(k - 2), d.get(k - 1));
                        d.set(k - 2, b.max(extent[k - 1] + dst_off[k - 2]));
                        d.set(k - 1, a.max(extent[k - 2] + dst_off[k - 1]));
                        t.dst_shape = d;
                    }
                    // every byte pattern: NaNs with payloads, infinities, subnormals, ties
                    let src: Vec<u8> = (0..t.src_shape.numel() as usize * from.size())
                        .map(|i| (i * 7 + i / 251) as u8)
                        .collect();
                    let (want, got, jobs) = both_ways(&t, &src, false);
                    assert_eq!(
                        got, want,
                        "{from} -> {to} transposed {transposed} {extent:?}"
                    );
                    let bytes: u64 = jobs.iter().map(TransposeJob::bytes).sum();
                    assert_eq!(bytes, t.extent.numel() * to.size() as u64);
                    assert!(jobs.iter().all(|j| j.straight != transposed));
                    // straight jobs move any box, transposed ones too (one element a row)
                    let (want, got, _) = both_ways(&t, &src, true);
                    assert_eq!(got, want, "straight {from} -> {to} {extent:?}");
                }
            }
        }
    }

    #[test]
    fn a_long_run_is_cut_into_rows_of_a_job_and_a_rest() {
        let mut t = transfer(&[3000], &[0], &[3000], &[0], &[3000], DType::Bf16);
        (t.dst_dtype, t.transposed) = (DType::F32, false);
        let jobs = convert_jobs(&t, 0x1000, 0x9000).unwrap().unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!((jobs[0].rows, jobs[0].cols), (2, RUN_ROW as u32));
        assert_eq!((jobs[0].src_pitch, jobs[0].dst_pitch), (2048, 4096));
        assert_eq!((jobs[1].rows, jobs[1].cols), (1, 3000 - 2 * RUN_ROW as u32));
        assert_eq!(jobs[1].src, 0x1000 + 2 * 2048);
        assert_eq!(jobs[1].dst, 0x9000 + 2 * 4096);
        // the mode word: the conversion and the straight bit
        let (b, _) = table_bytes(&jobs);
        assert_eq!(
            u32::from_le_bytes(b[44..48].try_into().unwrap()),
            1 | 1 << 8
        );
        // a transfer that converts nothing takes no jobs
        t.dst_dtype = DType::Bf16;
        assert_eq!(convert_jobs(&t, 0, 0).unwrap(), None);
        // a transposed box with a swapped dim of extent 1 has runs: straight converting jobs
        let mut t = transfer(&[1, 8], &[0, 0], &[8, 1], &[0, 0], &[1, 8], DType::F32);
        t.dst_dtype = DType::Bf16;
        assert_eq!(transpose_jobs(&t, 0, 0).unwrap(), None);
        let src: Vec<u8> = (0..32u8).collect();
        let (want, got, jobs) = both_ways(&t, &src, true);
        assert_eq!(got, want);
        assert!(jobs.iter().all(|j| j.straight));
    }

    #[test]
    fn a_conversion_the_gpu_does_not_make_is_refused_naming_the_tensor_and_dtypes() {
        for (from, to, transposed) in [
            (DType::F64, DType::F32, false),
            (DType::Bf16, DType::F16, false),
            (DType::F32, DType::F64, true),
        ] {
            let mut t = transfer(&[4, 8], &[0, 0], &[8, 4], &[0, 0], &[4, 8], from);
            t.dst_dtype = to;
            t.transposed = transposed;
            if !transposed {
                t.dst_shape = t.src_shape;
            }
            let e = if transposed {
                transpose_jobs(&t, 0, 0)
            } else {
                convert_jobs(&t, 0, 0)
            }
            .unwrap_err()
            .to_string();
            assert_eq!(
                e,
                format!(
                    "`dst`: this transfer converts {from} to {to}, which the GPU transports do not (they convert bf16 and f16 to and from f32); keep both sides in the same dtype, or use a CPU transport (shm, tcp)"
                )
            );
        }
    }

    #[test]
    fn plain_transfers_and_unit_swapped_dims_take_no_jobs() {
        let mut t = transfer(&[4, 8], &[0, 0], &[4, 8], &[0, 0], &[4, 8], DType::Bf16);
        t.transposed = false;
        assert_eq!(transpose_jobs(&t, 0, 0).unwrap(), None);
        // a swapped dim of extent 1: runs are whole rows, the copy descriptors take it
        let t = transfer(&[1, 8], &[0, 0], &[8, 1], &[0, 0], &[1, 8], DType::Bf16);
        assert_eq!(transpose_jobs(&t, 0, 0).unwrap(), None);
    }

    #[test]
    fn the_table_numbers_tiles_job_by_job() {
        let t = transfer(
            &[2, 40, 70],
            &[0, 0, 0],
            &[2, 70, 40],
            &[0, 0, 0],
            &[2, 40, 70],
            DType::Bf16,
        );
        let jobs = transpose_jobs(&t, 0x1000, 0x9000).unwrap().unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].tiles(), 2 * 3);
        let (b, tiles) = table_bytes(&jobs);
        assert_eq!(b.len(), 2 * JOB_BYTES);
        assert_eq!(tiles, 12);
        // the second job's first tile
        assert_eq!(
            u32::from_le_bytes(b[JOB_BYTES + 32..JOB_BYTES + 36].try_into().unwrap()),
            6
        );
        assert_eq!(u32::from_le_bytes(b[36..40].try_into().unwrap()), 3);
        assert_eq!(jobs[1].src - jobs[0].src, 40 * 70 * 2);
    }

    #[test]
    fn transpose_ptx_is_nul_terminated_with_its_entry() {
        assert!(TRANSPOSE_PTX.ends_with('\0'));
        assert_eq!(TRANSPOSE_PTX.matches('\0').count(), 1);
        assert!(TRANSPOSE_PTX.contains(".visible .entry awex_transpose_table("));
        assert!(TRANSPOSE_CUBIN_SM90.starts_with(b"\x7fELF"));
    }
}
