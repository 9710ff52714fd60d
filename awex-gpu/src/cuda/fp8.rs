//! The block-FP8 quantising kernel: bf16 rows in, e4m3 bytes and fp32 scales out, with the
//! bytes of awex's CPU reference (`awex_core::encoding`) for the recipes it runs.
//!
//! `fp8_block.ptx` runs one block of 256 threads per 128 x 128 block of the matrix: a pass for
//! the block's largest magnitude, the recipe's scale in fp32 with IEEE rounding in the torch
//! reference's order on CUDA, and a pass writing e4m3 (`cvt.rn.satfinite.e4m3x2.f32`, sm_89
//! and newer). The source and destination are pitched, so a kernel reads a trainer's tensor
//! where it lies and writes an engine's tensor and scale tensor where they lie. Blocks holding
//! infinity or NaN are counted in a status word and left unwritten; [`Fp8Kernel::quantise`]
//! reports them as [`CudaError::Fp8NonFinite`].

use super::device::{Device, DeviceBuffer, Stream};
use super::engine::Kernel;
use super::{CudaError, sys};
use awex_core::encoding::{Fp8Block, Recipe};
use std::ffi::CStr;

/// The kernel's PTX, NUL-terminated for the driver (compiled at load for the device).
const FP8_PTX: &str = concat!(include_str!("fp8_block.ptx"), "\0");
/// Its entry point.
const FP8_NAME: &CStr = c"awex_fp8_block_quant";
/// The batch kernel's PTX (`fp8_table.ptx`: a table of jobs, one launch), NUL-terminated.
const TABLE_PTX: &str = concat!(include_str!("fp8_table.ptx"), "\0");
/// Its entry point.
const TABLE_NAME: &CStr = c"awex_fp8_block_table";
/// Bytes of one job of the batch kernel's table.
const ENTRY_BYTES: usize = 64;
/// The most blocks one batch launch takes (the grid's x limit).
const MAX_BATCH_BLOCKS: u64 = i32::MAX as u64;
/// The one block shape the kernel runs (every known FP8 checkpoint's).
pub const GPU_BLOCK: [u32; 2] = [128, 128];

/// The kernel's mode for `recipe`, or why the GPU cannot run it.
pub fn gpu_mode(recipe: Recipe) -> Result<u32, CudaError> {
    // the kernel reads bf16 only: a recipe runs as the one that gives its bytes on bf16
    // (`vllm-ue8m0` as `deepgemm-ue8m0`)
    match recipe.on_bf16() {
        Recipe::Vllm => Ok(0),
        Recipe::DeepGemmUe8m0 => Ok(1),
        Recipe::DeepGemmLegacy => Ok(2),
        Recipe::AwexPython => Ok(3),
        other => Err(CudaError::Fp8(format!(
            "the {other} recipe has no GPU kernel yet (the GPU runs vllm, vllm-ue8m0, deepgemm-ue8m0, deepgemm-legacy and awex-python); quantise it on the CPU"
        ))),
    }
}

/// One quantisation: where the matrix and its outputs lie on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Job {
    /// first bf16 element
    pub src: u64,
    /// first e4m3 byte
    pub dst: u64,
    /// first fp32 scale
    pub scales: u64,
    /// rows
    pub rows: u32,
    /// columns
    pub cols: u32,
    /// bytes from one source row to the next (>= 2 * cols, even)
    pub src_pitch: u32,
    /// bytes from one destination row to the next (>= cols)
    pub dst_pitch: u32,
    /// scales from one block row's scales to the next (>= ceil(cols / 128))
    pub scale_pitch: u32,
}

impl Fp8Job {
    /// The launch grid: one block per 128 x 128 block of the matrix.
    pub fn grid(&self) -> (u32, u32) {
        (self.cols.div_ceil(128), self.rows.div_ceil(128))
    }

    /// Checks the shape (pitches, alignment, grid size) against `encoding`.
    pub fn check(&self, encoding: &Fp8Block) -> Result<(), CudaError> {
        self.check_shape(encoding)?;
        let gy = self.grid().1;
        if gy > 65_535 {
            return Err(CudaError::Fp8(format!(
                "{} rows need {gy} block rows; at most 65535 per launch",
                self.rows
            )));
        }
        Ok(())
    }

    /// Checks the pitches and alignment against `encoding` (what a batch launch needs).
    fn check_shape(&self, encoding: &Fp8Block) -> Result<(), CudaError> {
        let bad = |why: String| Err(CudaError::Fp8(why));
        if encoding.block != GPU_BLOCK {
            return bad(format!(
                "the kernel quantises {GPU_BLOCK:?} blocks, not {:?}; quantise other blocks on the CPU",
                encoding.block
            ));
        }
        let gx = self.grid().0;
        if (self.src_pitch as u64) < 2 * self.cols as u64 || self.src_pitch % 2 != 0 {
            return bad(format!(
                "source pitch {} bytes is not an even number of at least 2 x {} columns",
                self.src_pitch, self.cols
            ));
        }
        if self.dst_pitch < self.cols {
            return bad(format!(
                "destination pitch {} bytes is under the {} columns",
                self.dst_pitch, self.cols
            ));
        }
        if self.scale_pitch < gx {
            return bad(format!(
                "scale pitch {} is under the {gx} block columns",
                self.scale_pitch
            ));
        }
        if self.src % 2 != 0 || self.scales % 4 != 0 {
            return bad(format!(
                "source {:#x} must be 2-byte and scales {:#x} 4-byte aligned",
                self.src, self.scales
            ));
        }
        Ok(())
    }
}

/// Many quantisations for one launch of the batch kernel: their table and the index from
/// each block of the launch to its job, in device memory of the kernel's device (built once,
/// launched on every update).
pub struct Fp8Batch {
    table: DeviceBuffer,
    index: DeviceBuffer,
    blocks: u32,
    jobs: usize,
}

impl Fp8Batch {
    /// Blocks of the launch (128 x 128 blocks of all the jobs).
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Jobs in the table.
    pub fn jobs(&self) -> usize {
        self.jobs
    }
}

/// The table entries and the block index of `jobs`: each job's block columns and first
/// block, blocks in job order, row-major inside a job (jobs with no element take none).
fn batch_entries(jobs: &[Fp8Job]) -> Result<(Vec<u8>, Vec<u8>, u32), CudaError> {
    let mut table = Vec::with_capacity(jobs.len() * ENTRY_BYTES);
    let mut index: Vec<u8> = Vec::new();
    let mut first = 0u64;
    for (i, j) in jobs.iter().enumerate() {
        let (gx, gy) = if j.rows == 0 || j.cols == 0 {
            (0, 0)
        } else {
            j.grid()
        };
        let n = gx as u64 * gy as u64;
        if first + n > MAX_BATCH_BLOCKS {
            return Err(CudaError::Fp8(format!(
                "{} jobs need more than {MAX_BATCH_BLOCKS} blocks in one launch; quantise them in several batches",
                jobs.len()
            )));
        }
        let mut e = [0u8; ENTRY_BYTES];
        e[0..8].copy_from_slice(&j.src.to_le_bytes());
        e[8..16].copy_from_slice(&j.dst.to_le_bytes());
        e[16..24].copy_from_slice(&j.scales.to_le_bytes());
        for (k, v) in [
            j.rows,
            j.cols,
            j.src_pitch,
            j.dst_pitch,
            j.scale_pitch,
            gx,
            first as u32,
        ]
        .into_iter()
        .enumerate()
        {
            e[24 + 4 * k..28 + 4 * k].copy_from_slice(&v.to_le_bytes());
        }
        table.extend_from_slice(&e);
        let idx = (i as u32).to_le_bytes();
        for _ in 0..n {
            index.extend_from_slice(&idx);
        }
        first += n;
    }
    Ok((table, index, first as u32))
}

/// The loaded quantising kernel and its status word.
pub struct Fp8Kernel {
    kernel: Kernel,
    table: Kernel,
    /// [blocks holding infinity or NaN, the lowest batch job holding one (u32::MAX: none)]
    status: DeviceBuffer,
}

/// The non-finite blocks a batch counted since the last look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Status {
    /// blocks holding infinity or NaN (left unwritten)
    pub blocks: u32,
    /// the lowest index of a batch job holding one (`None` after single launches)
    pub first_job: Option<u32>,
}

/// The status words as they start and as each look leaves them.
const STATUS_CLEAR: [u8; 8] = [0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];

impl Fp8Kernel {
    /// Loads the kernel on `dev` (the driver compiles the PTX: sm_89 or newer).
    pub fn load(dev: &Device) -> Result<Fp8Kernel, CudaError> {
        let kernel = Kernel::load(dev, FP8_PTX, &[], FP8_NAME)?;
        let table = Kernel::load(dev, TABLE_PTX, &[], TABLE_NAME)?;
        let status = dev.alloc(256)?;
        // device memory comes uninitialised: the count starts at zero
        status.upload(0, &STATUS_CLEAR)?;
        Ok(Fp8Kernel {
            kernel,
            table,
            status,
        })
    }

    /// Which image loaded (`"ptx"`).
    pub fn image(&self) -> &'static str {
        self.kernel.image
    }

    /// Queues the quantisation of `job` with `recipe` on `s`; the status word counts blocks
    /// holding infinity or NaN until [`Fp8Kernel::take_status`] reads and clears it.
    ///
    /// # Safety
    ///
    /// The rows `job` describes (source, destination) and its scale rows must lie in device
    /// memory of the kernel's device that stays allocated until the launch has finished on
    /// `s`, with the destination and scales used by nothing else meanwhile.
    pub unsafe fn launch(
        &self,
        s: &Stream,
        job: &Fp8Job,
        recipe: Recipe,
        encoding: &Fp8Block,
    ) -> Result<(), CudaError> {
        job.check(encoding)?;
        let mode = self.mode_for(recipe, encoding)?;
        if job.rows == 0 || job.cols == 0 {
            return Ok(());
        }
        self.kernel.dev_bind()?;
        // SAFETY: the caller's contract; the status word is ours.
        unsafe {
            sys::launch_fp8_block_quant(
                self.kernel.func,
                job.grid(),
                s.raw,
                [job.src, job.dst, job.scales, self.status.ptr()],
                [
                    job.rows,
                    job.cols,
                    job.src_pitch,
                    job.dst_pitch,
                    job.scale_pitch,
                    mode,
                ],
            )
        }
    }

    /// Reads and clears the count of non-finite blocks since the last call (waits for the
    /// device).
    pub fn take_status(&self, s: &Stream) -> Result<u32, CudaError> {
        self.take_batch_status(s).map(|st| st.blocks)
    }

    /// Reads and clears the status since the last look (waits for `s`): the non-finite blocks
    /// and, after batch launches, the lowest job holding one.
    pub fn take_batch_status(&self, s: &Stream) -> Result<Fp8Status, CudaError> {
        s.sync()?;
        let mut b = [0u8; 8];
        self.status.download(0, &mut b)?;
        self.status.upload(0, &STATUS_CLEAR)?;
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Ok(Fp8Status {
            blocks: word(0),
            first_job: Some(word(4)).filter(|&j| j != u32::MAX),
        })
    }

    /// Builds the table of `jobs` for [`Fp8Kernel::launch_batch`] on the kernel's device,
    /// checking every job's shape against `encoding`.
    pub fn batch(&self, jobs: &[Fp8Job], encoding: &Fp8Block) -> Result<Fp8Batch, CudaError> {
        for j in jobs {
            j.check_shape(encoding)?;
        }
        let (table, index, blocks) = batch_entries(jobs)?;
        let dev = &self.kernel.dev;
        let upload = |bytes: &[u8]| -> Result<DeviceBuffer, CudaError> {
            let b = dev.alloc(bytes.len().max(16) as u64)?;
            if !bytes.is_empty() {
                b.upload(0, bytes)?;
            }
            Ok(b)
        };
        Ok(Fp8Batch {
            table: upload(&table)?,
            index: upload(&index)?,
            blocks,
            jobs: jobs.len(),
        })
    }

    /// Queues every job of `batch` with `recipe` on `s`, in one launch; the status counts
    /// blocks holding infinity or NaN, and the lowest job holding one, until
    /// [`Fp8Kernel::take_batch_status`] reads and clears it.
    ///
    /// # Safety
    ///
    /// As for [`Fp8Kernel::launch`], for every job of the batch; no two jobs may write the
    /// same bytes.
    pub unsafe fn launch_batch(
        &self,
        s: &Stream,
        batch: &Fp8Batch,
        recipe: Recipe,
        encoding: &Fp8Block,
    ) -> Result<(), CudaError> {
        let mode = self.mode_for(recipe, encoding)?;
        if batch.blocks == 0 {
            return Ok(());
        }
        self.table.dev_bind()?;
        // SAFETY: the caller's contract; the table and the index are the batch's, the status
        // word ours, and the index holds `blocks` entries.
        unsafe {
            sys::launch_fp8_table(
                self.table.func,
                batch.blocks,
                s.raw,
                [batch.table.ptr(), batch.index.ptr(), self.status.ptr()],
                mode,
            )
        }
    }

    /// The kernel's mode for `recipe`, refused when the recipe's scale format is not the
    /// encoding's or its block not the kernel's.
    fn mode_for(&self, recipe: Recipe, encoding: &Fp8Block) -> Result<u32, CudaError> {
        if encoding.block != GPU_BLOCK {
            return Err(CudaError::Fp8(format!(
                "the kernel quantises {GPU_BLOCK:?} blocks, not {:?}; quantise other blocks on the CPU",
                encoding.block
            )));
        }
        let mode = gpu_mode(recipe)?;
        if recipe.scale_format() != encoding.scale_format {
            return Err(CudaError::Fp8(format!(
                "the {recipe} recipe writes {:?} scales but the encoding stores {:?} scales",
                recipe.scale_format(),
                encoding.scale_format
            )));
        }
        Ok(mode)
    }

    /// Quantises `job` and waits: [`Fp8Kernel::launch`] then [`Fp8Kernel::take_status`], an
    /// error when blocks held infinity or NaN.
    ///
    /// # Safety
    ///
    /// As for [`Fp8Kernel::launch`].
    pub unsafe fn quantise(
        &self,
        s: &Stream,
        job: &Fp8Job,
        recipe: Recipe,
        encoding: &Fp8Block,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.launch(s, job, recipe, encoding)? };
        match self.take_status(s)? {
            0 => Ok(()),
            blocks => Err(CudaError::Fp8NonFinite { blocks }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(rows: u32, cols: u32) -> Fp8Job {
        Fp8Job {
            src: 0x1000,
            dst: 0x2000,
            scales: 0x3000,
            rows,
            cols,
            src_pitch: 2 * cols,
            dst_pitch: cols,
            scale_pitch: cols.div_ceil(128),
        }
    }

    #[test]
    fn the_gpu_runs_five_recipes_and_names_the_others() {
        assert_eq!(gpu_mode(Recipe::Vllm).unwrap(), 0);
        assert_eq!(gpu_mode(Recipe::AwexPython).unwrap(), 3);
        assert_eq!(gpu_mode(Recipe::VllmUe8m0).unwrap(), 1);
        let e = gpu_mode(Recipe::SglangUe8m0).unwrap_err().to_string();
        assert!(e.starts_with(
            "FP8 block quantisation on the GPU: the sglang-ue8m0 recipe has no GPU kernel yet"
        ));
    }

    #[test]
    fn shapes_the_kernel_cannot_take_are_refused_before_launch() {
        let enc = Fp8Block::default();
        assert_eq!(job(300, 520).grid(), (5, 3));
        assert!(job(300, 520).check(&enc).is_ok());
        let mut j = job(4, 8);
        j.src_pitch = 15;
        assert!(
            j.check(&enc)
                .unwrap_err()
                .to_string()
                .contains("source pitch 15 bytes")
        );
        let mut j = job(4, 300);
        j.scale_pitch = 2;
        assert!(
            j.check(&enc)
                .unwrap_err()
                .to_string()
                .contains("scale pitch 2 is under the 3 block columns")
        );
        let odd = Fp8Block {
            block: [64, 64],
            ..Fp8Block::default()
        };
        assert!(
            job(4, 8)
                .check(&odd)
                .unwrap_err()
                .to_string()
                .contains("not [64, 64]")
        );
        assert!(
            job(65_536 * 128, 8)
                .check(&enc)
                .unwrap_err()
                .to_string()
                .contains("at most 65535")
        );
    }

    #[test]
    fn the_ptx_is_one_nul_terminated_sm89_entry_with_ieee_arithmetic() {
        assert!(FP8_PTX.ends_with('\0'));
        assert_eq!(FP8_PTX.matches('\0').count(), 1);
        assert!(FP8_PTX.contains(".visible .entry awex_fp8_block_quant("));
        assert!(FP8_PTX.contains(".target sm_89"));
        // every float operation rounds to nearest even and keeps subnormals
        for line in FP8_PTX.lines().map(str::trim) {
            for op in ["mul.", "div.", "rcp.", "add.f32", "fma."] {
                if line.starts_with(op) && line.contains("f32") {
                    assert!(line.contains(".rn."), "{line}");
                    assert!(!line.contains(".ftz"), "{line}");
                }
            }
        }
        // ten parameters, in the order sys::launch_fp8_block_quant passes them
        let params: Vec<&str> = FP8_PTX
            .lines()
            .filter(|l| l.trim_start().starts_with(".param"))
            .collect();
        assert_eq!(params.len(), 10);
        assert!(params[..4].iter().all(|p| p.contains(".u64")));
        assert!(params[4..].iter().all(|p| p.contains(".u32")));
    }

    #[test]
    fn a_batch_indexes_every_block_to_its_job_in_order() {
        let mut a = job(300, 520); // 3 x 5 blocks
        a.src = 0xa000;
        let empty = job(0, 128);
        let b = job(128, 128); // 1 block
        let (table, index, blocks) = batch_entries(&[a, empty, b]).unwrap();
        assert_eq!(blocks, 16);
        assert_eq!(table.len(), 3 * ENTRY_BYTES);
        let idx: Vec<u32> = index
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(idx, [vec![0; 15], vec![2]].concat());
        let word = |e: usize, at: usize| {
            u32::from_le_bytes(table[e * 64 + at..e * 64 + at + 4].try_into().unwrap())
        };
        assert_eq!(u64::from_le_bytes(table[0..8].try_into().unwrap()), 0xa000);
        // rows, cols, pitches, scale pitch, block columns, first block
        assert_eq!(
            (24..52)
                .step_by(4)
                .map(|at| word(0, at))
                .collect::<Vec<_>>(),
            [300, 520, 1040, 520, 5, 5, 0]
        );
        assert_eq!((word(1, 44), word(1, 48)), (0, 15));
        assert_eq!((word(2, 44), word(2, 48)), (1, 15));
    }

    #[test]
    fn the_batch_ptx_is_one_entry_with_the_single_kernels_arithmetic() {
        assert!(TABLE_PTX.ends_with('\0'));
        assert_eq!(TABLE_PTX.matches('\0').count(), 1);
        assert!(TABLE_PTX.contains(".visible .entry awex_fp8_block_table("));
        assert!(TABLE_PTX.contains(".target sm_89"));
        for line in TABLE_PTX.lines().map(str::trim) {
            for op in ["mul.", "div.", "rcp.", "add.f32", "fma."] {
                if line.starts_with(op) && line.contains("f32") {
                    assert!(line.contains(".rn."), "{line}");
                    assert!(!line.contains(".ftz"), "{line}");
                }
            }
        }
        // the constants of the scale rule are the single kernel's
        for c in ["0f38D1B717", "0f3B124925", "0f43E00000"] {
            assert!(TABLE_PTX.contains(c) && FP8_PTX.contains(c), "{c}");
        }
        // four parameters, in the order sys::launch_fp8_table passes them
        let params: Vec<&str> = TABLE_PTX
            .lines()
            .filter(|l| l.trim_start().starts_with(".param"))
            .collect();
        assert_eq!(params.len(), 4);
        assert!(params[..3].iter().all(|p| p.contains(".u64")));
        assert!(params[3].contains(".u32"));
        // the fast path converts 8 rows of 8 columns per thread: 32 cvt's, 8 vector stores
        let fast = &TABLE_PTX[TABLE_PTX.find("FAST_Q:").unwrap()..];
        assert_eq!(fast.matches("cvt.rn.satfinite.e4m3x2.f32").count(), 32);
        assert_eq!(fast.matches("st.global.v2.u32").count(), 8);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_loading_says_built_without_cuda() {
        assert_eq!(Device::open(0).unwrap_err(), CudaError::NotBuilt);
    }
}
