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
/// The one block shape the kernel runs (every known FP8 checkpoint's).
pub const GPU_BLOCK: [u32; 2] = [128, 128];

/// The kernel's mode for `recipe`, or why the GPU cannot run it.
pub fn gpu_mode(recipe: Recipe) -> Result<u32, CudaError> {
    match recipe {
        Recipe::Vllm => Ok(0),
        Recipe::DeepGemmUe8m0 => Ok(1),
        Recipe::DeepGemmLegacy => Ok(2),
        Recipe::AwexPython => Ok(3),
        other => Err(CudaError::Fp8(format!(
            "the {other} recipe has no GPU kernel yet (the GPU runs vllm, deepgemm-ue8m0, deepgemm-legacy and awex-python); quantise it on the CPU"
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
        let bad = |why: String| Err(CudaError::Fp8(why));
        if encoding.block != GPU_BLOCK {
            return bad(format!(
                "the kernel quantises {GPU_BLOCK:?} blocks, not {:?}; quantise other blocks on the CPU",
                encoding.block
            ));
        }
        let (gx, gy) = self.grid();
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
        if gy > 65_535 {
            return bad(format!(
                "{} rows need {gy} block rows; at most 65535 per launch",
                self.rows
            ));
        }
        Ok(())
    }
}

/// The loaded quantising kernel and its status word.
pub struct Fp8Kernel {
    kernel: Kernel,
    status: DeviceBuffer,
}

impl Fp8Kernel {
    /// Loads the kernel on `dev` (the driver compiles the PTX: sm_89 or newer).
    pub fn load(dev: &Device) -> Result<Fp8Kernel, CudaError> {
        let kernel = Kernel::load(dev, FP8_PTX, &[], FP8_NAME)?;
        let status = dev.alloc(256)?;
        // device memory comes uninitialised: the count starts at zero
        status.upload(0, &[0; 4])?;
        Ok(Fp8Kernel { kernel, status })
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
        let mode = gpu_mode(recipe)?;
        if recipe.scale_format() != encoding.scale_format {
            return Err(CudaError::Fp8(format!(
                "the {recipe} recipe writes {:?} scales but the encoding stores {:?} scales",
                recipe.scale_format(),
                encoding.scale_format
            )));
        }
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
        s.sync()?;
        let mut b = [0u8; 4];
        self.status.download(0, &mut b)?;
        self.status.upload(0, &[0; 4])?;
        Ok(u32::from_le_bytes(b))
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
    fn the_gpu_runs_four_recipes_and_names_the_others() {
        assert_eq!(gpu_mode(Recipe::Vllm).unwrap(), 0);
        assert_eq!(gpu_mode(Recipe::AwexPython).unwrap(), 3);
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

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_loading_says_built_without_cuda() {
        assert_eq!(Device::open(0).unwrap_err(), CudaError::NotBuilt);
    }
}
