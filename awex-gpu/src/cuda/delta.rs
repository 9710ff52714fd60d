//! GPU delta kernels (`delta.cu`; the CPU reference of the format is
//! `awex_core::encoding::delta`).
//!
//! - `awex_diff_tiles`: the receiver side of a colocated delta update. It walks the same tile
//!   table as the copy kernel ([`super::tiles`]) but reads the destination first and writes a
//!   16-byte vector only where its bytes differ from the source's, counting the vectors it
//!   wrote. The destination ends holding exactly the source's bytes whatever it held before,
//!   so the receiver needs no record of its base version and a torn or restarted receiver is
//!   repaired by the same pass. [`super::CopyEngine::capture_diff`] captures it.
//! - `awex_step_bf16` ([`StepKernel`]): a synthetic optimiser step for benchmarks and tests,
//!   changing about a given fraction of bf16 elements by one unit in the last place, element by
//!   element, so that deltas are measured at the densities real training makes.
//!
//! The PTX and the sm_90 cubin are built from `delta.cu` with the CUDA 13.0 compiler:
//!
//! ```sh
//! nvcc -ptx -arch=compute_75 -O3 delta.cu -o delta.ptx
//! ptxas -arch=sm_90 -O3 delta.ptx -o delta.sm_90.cubin
//! ```

use super::device::{Device, Stream};
use super::engine::Kernel;
use super::{CudaError, KernelArg, sys};
use awex_core::weights::splitmix;
use std::ffi::CStr;

/// The delta kernels' PTX, NUL-terminated for the driver.
pub(crate) const DELTA_PTX: &str = concat!(include_str!("delta.ptx"), "\0");
/// The same compiled for sm_90.
pub(crate) const DELTA_CUBIN_SM90: &[u8] = include_bytes!("delta.sm_90.cubin");
/// The diff kernel's entry point.
pub(crate) const DIFF_NAME: &CStr = c"awex_diff_tiles";
/// The step kernel's entry point.
const STEP_NAME: &CStr = c"awex_step_bf16";
/// Resident blocks per SM of the diff kernel: 256 threads of up to 64 registers
/// (`__launch_bounds__(256, 4)`).
pub(crate) const DIFF_BLOCKS_PER_SM: u32 = 4;

/// The step kernel's threshold for changing about `fraction` of the elements (clamped to 0..=1).
pub fn step_threshold(fraction: f64) -> u32 {
    let f = if fraction.is_nan() {
        0.0
    } else {
        fraction.clamp(0.0, 1.0)
    };
    (f * 4_294_967_296.0).min(u32::MAX as f64) as u32
}

/// Whether the step kernel changes element `i` for `seed` at `threshold` (the kernel's rule,
/// for checking its output on the host).
pub fn step_changes(seed: u64, i: u64, threshold: u32) -> bool {
    ((splitmix(seed ^ i) >> 32) as u32) < threshold
}

/// The synthetic optimiser step (`awex_step_bf16`), loaded on one device.
pub struct StepKernel {
    kernel: Kernel,
    blocks: u32,
}

impl StepKernel {
    /// Loads the kernel on `dev`.
    pub fn load(dev: &Device) -> Result<StepKernel, CudaError> {
        let kernel = Kernel::load(dev, DELTA_PTX, DELTA_CUBIN_SM90, STEP_NAME)?;
        let blocks = sys::device_sm_count(dev.ordinal()).unwrap_or(128) * 8;
        Ok(StepKernel { kernel, blocks })
    }

    /// Queues one step on `s`: of the `n` bf16 elements at `ptr`, those that
    /// [`step_changes`] picks for `seed` and `fraction` get their lowest bit flipped.
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + 2 n` must be device memory of the kernel's context, allocated and used by
    /// nothing else until the step has finished.
    pub unsafe fn launch(
        &self,
        s: &Stream,
        ptr: u64,
        n: u64,
        seed: u64,
        fraction: f64,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        self.kernel.dev_bind()?;
        let mut args = [
            KernelArg::U64(ptr),
            KernelArg::U64(n),
            KernelArg::U64(seed),
            KernelArg::U32(step_threshold(fraction)),
        ];
        // SAFETY: the kernel takes (u16*, u64, u64, u32); the caller vouches for the memory.
        unsafe { sys::launch_args(self.kernel.func, self.blocks, (256, 1), s.raw, &mut args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_span_none_to_all() {
        assert_eq!(step_threshold(0.0), 0);
        assert_eq!(step_threshold(-1.0), 0);
        assert_eq!(step_threshold(f64::NAN), 0);
        assert_eq!(step_threshold(1.0), u32::MAX);
        assert_eq!(step_threshold(0.5), 1 << 31);
    }

    #[test]
    fn the_step_changes_about_the_fraction_asked() {
        for f in [0.001, 0.01, 0.03, 0.2] {
            let t = step_threshold(f);
            let n = 1_000_000u64;
            let c = (0..n).filter(|&i| step_changes(7, i, t)).count() as f64 / n as f64;
            assert!((c - f).abs() < 0.1 * f + 0.0005, "{f}: {c}");
        }
        // another seed changes other elements
        let t = step_threshold(0.01);
        let a: Vec<u64> = (0..100_000).filter(|&i| step_changes(1, i, t)).collect();
        let b: Vec<u64> = (0..100_000).filter(|&i| step_changes(2, i, t)).collect();
        assert_ne!(a, b);
    }

    #[test]
    fn delta_ptx_is_nul_terminated_with_both_entries() {
        assert!(DELTA_PTX.ends_with('\0'));
        assert_eq!(DELTA_PTX.matches('\0').count(), 1);
        assert!(DELTA_PTX.contains(".visible .entry awex_diff_tiles("));
        assert!(DELTA_PTX.contains(".visible .entry awex_step_bf16("));
        assert!(DELTA_CUBIN_SM90.is_empty() || DELTA_CUBIN_SM90.starts_with(b"\x7fELF"));
    }
}
