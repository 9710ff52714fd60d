//! The colocated GPU data path: CUDA IPC between training and inference processes on one host.
//!
//! A training rank exports the allocations behind its weights once ([`IpcExport`]: one handle
//! per allocation, not per tensor). An inference rank opens each handle once ([`IpcImport`]),
//! turns its planned transfers into device copy descriptors ([`copy_descriptors`]: linear,
//! 2-D or 3-D pitched copies with exact byte ranges), and runs them on a few streams
//! ([`CopyEngine`]), ordered against the training process by inter-process events. The same
//! pull works across GPUs of one host through peer access.
//!
//! This module always compiles. Built without the `cuda` feature, its API is the same and
//! every call returns [`CudaError::NotBuilt`]; built with it, libcuda is loaded at run time and
//! a missing driver or GPU is an error ([`CudaError::NoDriver`], [`CudaError::NoGpu`]), never a
//! panic. [`fp8`] holds the block-FP8 quantising kernel (bf16 in, e4m3 and scales out),
//! [`delta_wire`] the kernels that encode and decode the delta wire format. The
//! geometry ([`desc`]) and handle encoding ([`handle`]) are pure and need no GPU.

pub mod delta;
pub mod delta_wire;
pub mod desc;
mod device;
mod engine;
mod error;
pub mod fdpass;
pub mod fp8;
pub mod handle;
mod ipc;

#[cfg_attr(not(feature = "cuda"), path = "sys_stub.rs")]
mod sys;
pub mod tiles;
pub mod transpose;

pub use desc::{
    CopyDesc, CopyKind, DescStats, coalesce, copy_descriptors, merge_contiguous, plan_copies,
    split_linear,
};
pub use device::{
    Device, DeviceBuffer, Event, Stream, device_count, driver_present, driver_version,
};
pub use engine::{
    CopyEngine, CopyGraph, CopyMethod, CopyOrder, TILES_BY_DEFAULT, assign_streams, kernel_fits,
    kernel_grid,
};
pub use error::CudaError;
pub use fp8::{Fp8Batch, Fp8Job, Fp8Kernel, Fp8Status, GPU_BLOCK, gpu_mode};
pub use handle::{IpcEventHandle, IpcMemHandle};
pub use ipc::{
    AllocationIndex, ExportedAllocation, IpcExport, IpcImport, RemoteAddr, SharedChunk,
    SharedChunks, span_of,
};

/// Whether this build has CUDA support compiled in (the `cuda` feature).
pub const BUILT: bool = cfg!(feature = "cuda");

/// One argument of a kernel launch, as the kernel declares it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum KernelArg {
    /// A `.u64` parameter (an address or a 64-bit count).
    U64(u64),
    /// A `.u32` parameter.
    U32(u32),
}

/// Opaque driver objects, passed between the safe types and the driver calls.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod raw {
    use std::ffi::c_void;

    /// A `CUcontext`.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct RawCtx(pub(crate) *mut c_void);
    /// A `CUstream`.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct RawStream(pub(crate) *mut c_void);
    /// A `CUevent`.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct RawEvent(pub(crate) *mut c_void);
    /// A `CUgraphExec`.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct RawGraphExec(pub(crate) *mut c_void);
    /// A `CUmodule`.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct RawModule(pub(crate) *mut c_void);
    /// A `CUfunction`.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct RawFunction(pub(crate) *mut c_void);

    // SAFETY: driver handles are process-wide and the driver API is thread-safe; every use
    // makes the owning context current first.
    unsafe impl Send for RawCtx {}
    unsafe impl Sync for RawCtx {}
    unsafe impl Send for RawStream {}
    unsafe impl Sync for RawStream {}
    unsafe impl Send for RawEvent {}
    unsafe impl Sync for RawEvent {}
    unsafe impl Send for RawGraphExec {}
    unsafe impl Sync for RawGraphExec {}
    unsafe impl Send for RawModule {}
    unsafe impl Sync for RawModule {}
    unsafe impl Send for RawFunction {}
    unsafe impl Sync for RawFunction {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_every_call_says_built_without_cuda() {
        let msg = "awex was built without CUDA; rebuild with `--features cuda`";
        assert_eq!(BUILT, cfg!(feature = "cuda"));
        assert!(!driver_present());
        assert_eq!(Device::open(0).unwrap_err().to_string(), msg);
        assert_eq!(device_count().unwrap_err(), CudaError::NotBuilt);
        assert_eq!(driver_version().unwrap_err(), CudaError::NotBuilt);
    }

    /// On a machine without libcuda (CI, the developers' machines), the feature build must
    /// answer with NoDriver, not panic inside cudarc. On a GPU machine this proves nothing,
    /// and the GPU tests cover it.
    #[cfg(feature = "cuda")]
    #[test]
    fn without_libcuda_every_call_says_no_driver() {
        assert_eq!(BUILT, cfg!(feature = "cuda"));
        if driver_present() {
            eprintln!("libcuda is present here; the GPU tests cover this machine");
            return;
        }
        let want = "no CUDA driver found: libcuda could not be loaded (tried libcuda.so and libcuda.so.1 on the library search path); install the NVIDIA driver or run on a machine with a GPU";
        assert_eq!(Device::open(0).unwrap_err().to_string(), want);
        assert!(matches!(device_count(), Err(CudaError::NoDriver { .. })));
        assert!(matches!(driver_version(), Err(CudaError::NoDriver { .. })));
    }

    #[test]
    fn no_gpu_and_old_driver_messages_name_the_fix() {
        assert_eq!(
            CudaError::NoGpu {
                detail: "cuInit: CUDA_ERROR_NO_DEVICE".into()
            }
            .to_string(),
            "no GPU: the CUDA driver loaded but reports no device (cuInit: CUDA_ERROR_NO_DEVICE)"
        );
        assert_eq!(
            CudaError::OldDriver {
                symbol: "cuMemcpy3DAsync_v2"
            }
            .to_string(),
            "the CUDA driver lacks `cuMemcpy3DAsync_v2`; install a newer NVIDIA driver (awex uses the CUDA 13.0 driver API)"
        );
        assert_eq!(
            CudaError::NoSuchDevice {
                ordinal: 3,
                count: 1
            }
            .to_string(),
            "no GPU 3: this machine has 1 GPU(s), ordinals 0..1"
        );
    }
}

#[cfg(all(test, feature = "cuda"))]
mod gpu_tests;
