//! Transposed boxes on the GPU: the transfers an engine stores with their last two dims swapped
//! (gpt-oss's experts on SGLang and vLLM, docs/models.md), moved by one launch of
//! `awex_transpose_table` (`transpose.cu`) over a table of jobs, each one matrix of the box.
//!
//! A transposed box ([`StridedBox::new_transposed`]) runs one element at a time: one of its
//! dims is contiguous in the source and another in the destination
//! ([`StridedBox::transposed_pair`]). [`transpose_jobs`] makes one job per matrix of those two
//! dims (every index of the box's other dims); the kernel moves 32 x 32 tiles through shared
//! memory so that both ends are read and written in rows. The geometry is pure and checked on
//! the host against the CPU copy ([`emulate`]).
//!
//! The PTX and the sm_90 cubin are built from `transpose.cu` with the CUDA 13.0 compiler:
//!
//! ```sh
//! nvcc -ptx -arch=compute_75 -O3 transpose.cu -o transpose.ptx
//! ptxas -arch=sm_90 -O3 transpose.ptx -o transpose.sm_90.cubin
//! ```

use super::device::{Device, DeviceBuffer, Stream};
use super::engine::Kernel;
use super::{CudaError, KernelArg, sys};
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

/// One matrix of a transposed box: element `(r, c)` at `src + r * src_pitch + c * elem` goes to
/// `dst + c * dst_pitch + r * elem`.
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
    /// Bytes per element: 1, 2 or 4.
    pub elem: u32,
}

impl TransposeJob {
    /// 32 x 32 tiles the kernel runs for it.
    pub fn tiles(&self) -> u64 {
        (self.rows as u64).div_ceil(TILE) * (self.cols as u64).div_ceil(TILE)
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.rows as u64 * self.cols as u64 * self.elem as u64
    }
}

/// The jobs of transfer `t` whose source tensor starts at `src` and destination tensor at
/// `dst`, when it is a transposed box of one-element runs; `None` for any other transfer
/// (copied by [`super::copy_descriptors`]). A box whose element size is not 1, 2 or 4 bytes,
/// or whose pitches or sides pass 32 bits, is refused naming the tensor.
pub fn transpose_jobs(
    t: &Transfer,
    src: u64,
    dst: u64,
) -> Result<Option<Vec<TransposeJob>>, CudaError> {
    if !t.transposed {
        return Ok(None);
    }
    let b = StridedBox::new_transposed(
        &t.src_shape,
        &t.src_offset,
        &t.dst_shape,
        &t.dst_offset,
        &t.extent,
        t.transpose(),
    )
    .map_err(|e| CudaError::geometry(&t.dst_tensor, e))?;
    let es = t.dst_dtype.size() as u64;
    if !matches!(es, 1 | 2 | 4) || t.converts() {
        return Err(CudaError::geometry(
            &t.dst_tensor,
            awex_core::layout::copy::CopyError::Transposed(
                format!(
                    "the GPU transposes elements of 1, 2 or 4 bytes without conversion; this box is {} -> {}",
                    t.src_dtype, t.dst_dtype
                )
                .into(),
            ),
        ));
    }
    box_jobs(&b, es, src, dst, &t.dst_tensor)
}

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
    let (Some(rows32), Some(cols32), Some(sp), Some(dp)) = (
        fits(rows),
        fits(cols),
        fits(src_stride * es),
        fits(dst_stride * es),
    ) else {
        return Err(bad(format!(
            "a {rows} x {cols} matrix with row pitches of {} and {} bytes passes the GPU transpose's 32-bit fields",
            src_stride * es,
            dst_stride * es
        )));
    };
    // every index of the other dims, innermost first
    let rest: Vec<(u64, u64, u64)> = outer
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != p && *i != q)
        .map(|(_, o)| *o)
        .collect();
    let n: u64 = rest.iter().map(|o| o.0).product();
    let mut jobs = Vec::with_capacity(n as usize);
    for mut k in 0..n {
        let (mut s, mut d) = (b.src_base, b.dst_base);
        for &(c, ss, ds) in &rest {
            s += (k % c) * ss;
            d += (k % c) * ds;
            k /= c;
        }
        jobs.push(TransposeJob {
            src: src + s * es,
            dst: dst + d * es,
            rows: rows32,
            cols: cols32,
            src_pitch: sp,
            dst_pitch: dp,
            elem: es as u32,
        });
    }
    Ok(Some(jobs))
}

/// Runs `jobs` on the host, as the kernel does, over byte buffers addressed from 0 (for tests).
pub fn emulate(jobs: &[TransposeJob], src: &[u8], dst: &mut [u8]) {
    for j in jobs {
        let e = j.elem as usize;
        for r in 0..j.rows as usize {
            for c in 0..j.cols as usize {
                let s = j.src as usize + r * j.src_pitch as usize + c * e;
                let d = j.dst as usize + c * j.dst_pitch as usize + r * e;
                dst[d..d + e].copy_from_slice(&src[s..s + e]);
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
            0,
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
