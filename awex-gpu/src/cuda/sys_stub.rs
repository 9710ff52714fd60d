//! The driver calls of a build without the `cuda` feature: each one says so.
//!
//! Same functions as `sys.rs`, so the public CUDA types compile and behave the same way in
//! every build; here each returns [`CudaError::NotBuilt`].

use super::CudaError;
use super::desc::CopyDesc;
use super::handle::{IpcEventHandle, IpcMemHandle};
use super::raw::{RawCtx, RawEvent, RawFunction, RawGraphExec, RawModule, RawStream};
use std::ffi::CStr;

const NO: CudaError = CudaError::NotBuilt;

/// Whether libcuda can be loaded: never, without CUDA compiled in.
pub(crate) fn driver_present() -> bool {
    false
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn init() -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn device_count() -> Result<u32, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn driver_version() -> Result<i32, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn device_name(_: u32) -> Result<String, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn device_total_mem(_: u32) -> Result<u64, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn can_access_peer(_: u32, _: u32) -> Result<bool, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn ctx_retain(_: u32) -> Result<RawCtx, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn ctx_release(_: u32) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn ctx_set(_: RawCtx) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn mem_alloc(_: u64) -> Result<u64, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn mem_free(_: u64) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn address_range(_: u64) -> Result<(u64, u64), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_create(_: u64, _: u32) -> Result<u64, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_retain(_: u64) -> Result<u64, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_release(_: u64) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_export_fd(_: u64) -> Result<i32, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_import_fd(_: i32) -> Result<u64, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_reserve(_: u64) -> Result<u64, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_free(_: u64, _: u64) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_map(_: u64, _: u64, _: u64) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_unmap(_: u64, _: u64) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn vmm_set_access(_: u64, _: u64, _: u32) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn ipc_mem_handle(_: u64) -> Result<IpcMemHandle, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn ipc_open_mem(_: &IpcMemHandle) -> Result<u64, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn ipc_close_mem(_: u64) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn stream_create() -> Result<RawStream, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn stream_destroy(_: RawStream) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn stream_sync(_: RawStream) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn stream_wait(_: RawStream, _: RawEvent) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn event_create(_: bool) -> Result<RawEvent, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn event_destroy(_: RawEvent) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn event_record(_: RawEvent, _: RawStream) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn event_sync(_: RawEvent) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn ipc_event_handle(_: RawEvent) -> Result<IpcEventHandle, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn ipc_open_event(_: &IpcEventHandle) -> Result<RawEvent, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn copy_async(_: &CopyDesc, _: RawStream) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn memcpy_htod(_: u64, _: &[u8]) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn memcpy_dtoh(_: &mut [u8], _: u64) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn memset_d16_async(
    _: u64,
    _: u16,
    _: u64,
    _: RawStream,
) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn memset_d32_async(
    _: u64,
    _: u32,
    _: u64,
    _: RawStream,
) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn mem_get_info() -> Result<(u64, u64), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn capture_begin(_: RawStream) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn capture_end(_: RawStream) -> Result<RawGraphExec, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn graph_launch(_: RawGraphExec, _: RawStream) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn module_load(_: &[u8]) -> Result<RawModule, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn module_function(_: RawModule, _: &CStr) -> Result<RawFunction, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn module_unload(_: RawModule) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn launch_copy_rows(
    _: RawFunction,
    _: (u32, u32),
    _: u32,
    _: RawStream,
    _: [u64; 6],
) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn device_sm_count(_: u32) -> Result<u32, CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn launch_args(
    _: RawFunction,
    _: u32,
    _: impl Into<(u32, u32)>,
    _: RawStream,
    _: &mut [super::KernelArg],
) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
///
/// # Safety
///
/// None needed (nothing is touched); unsafe to match the driver build.
pub(crate) unsafe fn launch_fp8_block_quant(
    _: RawFunction,
    _: (u32, u32),
    _: RawStream,
    _: [u64; 4],
    _: [u32; 6],
) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) unsafe fn launch_fp8_table(
    _: RawFunction,
    _: u32,
    _: RawStream,
    _: [u64; 3],
    _: u32,
) -> Result<(), CudaError> {
    Err(NO)
}

/// Always [`CudaError::NotBuilt`].
pub(crate) fn graph_destroy(_: RawGraphExec) -> Result<(), CudaError> {
    Err(NO)
}
