//! The CUDA driver calls awex makes, over cudarc's raw bindings loaded at run time.
//!
//! Every entry point is checked before first use: [`init`] makes sure libcuda loads and exports
//! every symbol listed in [`REQUIRED`], then initialises the driver, so that no later call can
//! hit cudarc's panic on a missing library or symbol. Each function returns the driver's error
//! as a [`CudaError`] naming the call.

use super::CudaError;
use super::desc::CopyDesc;
use super::handle::{HANDLE_BYTES, IpcEventHandle, IpcMemHandle};
use super::raw::{RawCtx, RawEvent, RawFunction, RawGraphExec, RawModule, RawStream};
use cudarc::driver::sys as cu;
use std::ffi::{CStr, c_char, c_void};
use std::ptr;
use std::sync::OnceLock;

/// Every driver entry point this module calls, under the name cudarc loads.
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuMemCreate",
    "cuMemRetainAllocationHandle",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuMemGetInfo_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpy2DAsync_v2",
    "cuMemcpy3DAsync_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphDestroy",
    "cuGraphExecDestroy",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// Whether libcuda can be loaded on this machine (no driver call is made).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { cu::is_culib_present() }
}

/// Loads libcuda, checks every entry point, and initialises the driver, once per process.
pub(crate) fn init() -> Result<(), CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !driver_present() {
            return Err(CudaError::NoDriver {
                detail: "tried libcuda.so and libcuda.so.1 on the library search path".into(),
            });
        }
        // SAFETY: the library is present, so culib() loads it instead of panicking.
        let lib = unsafe { cu::culib() };
        for &symbol in REQUIRED {
            // SAFETY: the symbol is only looked up, never called through this type.
            if unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_err() {
                return Err(CudaError::OldDriver { symbol });
            }
        }
        // SAFETY: every entry point used below was checked above.
        let r = unsafe { cu::cuInit(0) };
        if r == cu::CUresult::CUDA_ERROR_NO_DEVICE {
            return Err(CudaError::NoGpu {
                detail: "cuInit: CUDA_ERROR_NO_DEVICE".into(),
            });
        }
        check("cuInit", r)?;
        let mut n = 0;
        check("cuDeviceGetCount", unsafe { cu::cuDeviceGetCount(&mut n) })?;
        if n <= 0 {
            return Err(CudaError::NoGpu {
                detail: "cuDeviceGetCount returned 0".into(),
            });
        }
        Ok(())
    })
    .clone()
}

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return "unknown".into();
    }
    // SAFETY: the driver returns NUL-terminated static strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Turns a driver result into `Ok` or an error naming `call`.
fn check(call: &'static str, r: cu::CUresult) -> Result<(), CudaError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (mut name, mut msg) = (ptr::null(), ptr::null());
    // SAFETY: both entry points were checked by init; they write static string pointers.
    unsafe {
        cu::cuGetErrorName(r, &mut name);
        cu::cuGetErrorString(r, &mut msg);
    }
    Err(CudaError::Driver {
        call,
        code: r as u32,
        name: cstr(name),
        message: cstr(msg),
    })
}

/// Number of devices.
pub(crate) fn device_count() -> Result<u32, CudaError> {
    init()?;
    let mut n = 0;
    check("cuDeviceGetCount", unsafe { cu::cuDeviceGetCount(&mut n) })?;
    Ok(n.max(0) as u32)
}

/// The driver's CUDA version (e.g. 13000 for 13.0).
pub(crate) fn driver_version() -> Result<i32, CudaError> {
    init()?;
    let mut v = 0;
    check("cuDriverGetVersion", unsafe {
        cu::cuDriverGetVersion(&mut v)
    })?;
    Ok(v)
}

fn device(ordinal: u32) -> Result<cu::CUdevice, CudaError> {
    init()?;
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    let mut d = 0;
    check("cuDeviceGet", unsafe {
        cu::cuDeviceGet(&mut d, ordinal as i32)
    })?;
    Ok(d)
}

/// The device's marketing name.
pub(crate) fn device_name(ordinal: u32) -> Result<String, CudaError> {
    let d = device(ordinal)?;
    let mut buf = [0 as c_char; 256];
    check("cuDeviceGetName", unsafe {
        cu::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, d)
    })?;
    Ok(cstr(buf.as_ptr()))
}

/// The device's memory in bytes.
pub(crate) fn device_total_mem(ordinal: u32) -> Result<u64, CudaError> {
    let d = device(ordinal)?;
    let mut b = 0usize;
    check("cuDeviceTotalMem", unsafe {
        cu::cuDeviceTotalMem_v2(&mut b, d)
    })?;
    Ok(b as u64)
}

/// The device's streaming multiprocessors.
pub(crate) fn device_sm_count(ordinal: u32) -> Result<u32, CudaError> {
    let d = device(ordinal)?;
    let mut n = 0;
    check("cuDeviceGetAttribute", unsafe {
        cu::cuDeviceGetAttribute(
            &mut n,
            cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            d,
        )
    })?;
    Ok(n.max(1) as u32)
}

/// Whether device `a` can read device `b`'s memory directly.
pub(crate) fn can_access_peer(a: u32, b: u32) -> Result<bool, CudaError> {
    let (da, db) = (device(a)?, device(b)?);
    let mut ok = 0;
    check("cuDeviceCanAccessPeer", unsafe {
        cu::cuDeviceCanAccessPeer(&mut ok, da, db)
    })?;
    Ok(ok != 0)
}

/// Retains the device's primary context (the one the runtime API and PyTorch share).
pub(crate) fn ctx_retain(ordinal: u32) -> Result<RawCtx, CudaError> {
    let d = device(ordinal)?;
    let mut c = ptr::null_mut();
    check("cuDevicePrimaryCtxRetain", unsafe {
        cu::cuDevicePrimaryCtxRetain(&mut c, d)
    })?;
    Ok(RawCtx(c.cast()))
}

/// Releases a primary context retained by [`ctx_retain`].
pub(crate) fn ctx_release(ordinal: u32) -> Result<(), CudaError> {
    let d = device(ordinal)?;
    check("cuDevicePrimaryCtxRelease", unsafe {
        cu::cuDevicePrimaryCtxRelease_v2(d)
    })
}

/// Makes a context current on the calling thread.
pub(crate) fn ctx_set(c: RawCtx) -> Result<(), CudaError> {
    check("cuCtxSetCurrent", unsafe {
        cu::cuCtxSetCurrent(c.0.cast())
    })
}

/// Allocates device memory in the current context.
pub(crate) fn mem_alloc(bytes: u64) -> Result<u64, CudaError> {
    let mut p = 0;
    check("cuMemAlloc", unsafe {
        cu::cuMemAlloc_v2(&mut p, bytes as usize)
    })?;
    Ok(p)
}

/// Frees memory from [`mem_alloc`].
pub(crate) fn mem_free(p: u64) -> Result<(), CudaError> {
    check("cuMemFree", unsafe { cu::cuMemFree_v2(p) })
}

/// Free and total device memory of the current context's device, in bytes.
pub(crate) fn mem_get_info() -> Result<(u64, u64), CudaError> {
    let (mut free, mut total) = (0usize, 0usize);
    check("cuMemGetInfo", unsafe {
        cu::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// The base and size of the allocation that contains `p`.
pub(crate) fn address_range(p: u64) -> Result<(u64, u64), CudaError> {
    let (mut base, mut size) = (0, 0usize);
    check("cuMemGetAddressRange", unsafe {
        cu::cuMemGetAddressRange_v2(&mut base, &mut size, p)
    })?;
    Ok((base, size as u64))
}

fn handle_bytes(r: &[c_char; HANDLE_BYTES]) -> [u8; HANDLE_BYTES] {
    let mut b = [0u8; HANDLE_BYTES];
    for (o, &c) in b.iter_mut().zip(r) {
        *o = c as u8;
    }
    b
}

fn handle_chars(b: &[u8; HANDLE_BYTES]) -> [c_char; HANDLE_BYTES] {
    let mut r = [0 as c_char; HANDLE_BYTES];
    for (o, &c) in r.iter_mut().zip(b) {
        *o = c as c_char;
    }
    r
}

/// The physical allocation mapped at `p`, when `p` is memory mapped with `cuMemMap` (virtual
/// memory management, e.g. PyTorch's expandable segments); an error for `cuMemAlloc` memory.
/// The handle is retained: release it with [`vmm_release`].
pub(crate) fn vmm_retain(p: u64) -> Result<u64, CudaError> {
    let mut h = 0;
    check("cuMemRetainAllocationHandle", unsafe {
        cu::cuMemRetainAllocationHandle(&mut h, p as *mut c_void)
    })?;
    Ok(h)
}

/// A new physical allocation of `size` bytes on device `ordinal` (a multiple of the 2 MiB
/// granularity), exportable as a POSIX file descriptor, as PyTorch's expandable segments make.
pub(crate) fn vmm_create(size: u64, ordinal: u32) -> Result<u64, CudaError> {
    // SAFETY: a plain-data struct; zero is a valid value of every field.
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = cu::CUmemLocation {
        type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    };
    let mut h = 0;
    check("cuMemCreate", unsafe {
        cu::cuMemCreate(&mut h, size as usize, &prop, 0)
    })?;
    Ok(h)
}

/// Drops one reference to a physical allocation handle.
pub(crate) fn vmm_release(h: u64) -> Result<(), CudaError> {
    check("cuMemRelease", unsafe { cu::cuMemRelease(h) })
}

/// A POSIX file descriptor for the physical allocation `h` (owned by the caller).
pub(crate) fn vmm_export_fd(h: u64) -> Result<i32, CudaError> {
    let mut fd: i32 = -1;
    check("cuMemExportToShareableHandle", unsafe {
        cu::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast(),
            h,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(fd)
}

/// The physical allocation behind a POSIX file descriptor from [`vmm_export_fd`] (a new
/// handle: release it once mapped).
pub(crate) fn vmm_import_fd(fd: i32) -> Result<u64, CudaError> {
    let mut h = 0;
    check("cuMemImportFromShareableHandle", unsafe {
        cu::cuMemImportFromShareableHandle(
            &mut h,
            fd as isize as *mut c_void,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(h)
}

/// Reserves `size` bytes of device virtual addresses.
pub(crate) fn vmm_reserve(size: u64) -> Result<u64, CudaError> {
    let mut p = 0;
    check("cuMemAddressReserve", unsafe {
        cu::cuMemAddressReserve(&mut p, size as usize, 0, 0, 0)
    })?;
    Ok(p)
}

/// Frees addresses from [`vmm_reserve`].
pub(crate) fn vmm_free(p: u64, size: u64) -> Result<(), CudaError> {
    check("cuMemAddressFree", unsafe {
        cu::cuMemAddressFree(p, size as usize)
    })
}

/// Maps the whole physical allocation `h` (of `size` bytes) at `p`.
pub(crate) fn vmm_map(p: u64, size: u64, h: u64) -> Result<(), CudaError> {
    check("cuMemMap", unsafe {
        cu::cuMemMap(p, size as usize, 0, h, 0)
    })
}

/// Unmaps `size` bytes at `p`.
pub(crate) fn vmm_unmap(p: u64, size: u64) -> Result<(), CudaError> {
    check("cuMemUnmap", unsafe { cu::cuMemUnmap(p, size as usize) })
}

/// Lets device `ordinal` read and write `size` mapped bytes at `p`.
pub(crate) fn vmm_set_access(p: u64, size: u64, ordinal: u32) -> Result<(), CudaError> {
    let desc = cu::CUmemAccessDesc {
        location: cu::CUmemLocation {
            type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as i32,
        },
        flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    check("cuMemSetAccess", unsafe {
        cu::cuMemSetAccess(p, size as usize, &desc, 1)
    })
}

/// The IPC handle of the allocation whose base is `base`.
pub(crate) fn ipc_mem_handle(base: u64) -> Result<IpcMemHandle, CudaError> {
    let mut h = cu::CUipcMemHandle {
        reserved: [0; HANDLE_BYTES],
    };
    check("cuIpcGetMemHandle", unsafe {
        cu::cuIpcGetMemHandle(&mut h, base)
    })?;
    Ok(IpcMemHandle(handle_bytes(&h.reserved)))
}

/// Maps another process's allocation into the current context (peer access enabled on demand).
pub(crate) fn ipc_open_mem(h: &IpcMemHandle) -> Result<u64, CudaError> {
    let handle = cu::CUipcMemHandle {
        reserved: handle_chars(&h.0),
    };
    let mut p = 0;
    check("cuIpcOpenMemHandle", unsafe {
        cu::cuIpcOpenMemHandle_v2(
            &mut p,
            handle,
            cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    })?;
    Ok(p)
}

/// Unmaps memory from [`ipc_open_mem`].
pub(crate) fn ipc_close_mem(p: u64) -> Result<(), CudaError> {
    check("cuIpcCloseMemHandle", unsafe { cu::cuIpcCloseMemHandle(p) })
}

/// A non-blocking stream in the current context.
pub(crate) fn stream_create() -> Result<RawStream, CudaError> {
    let mut s = ptr::null_mut();
    check("cuStreamCreate", unsafe {
        cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    Ok(RawStream(s.cast()))
}

/// Destroys a stream.
pub(crate) fn stream_destroy(s: RawStream) -> Result<(), CudaError> {
    check("cuStreamDestroy", unsafe {
        cu::cuStreamDestroy_v2(s.0.cast())
    })
}

/// Blocks until everything queued on `s` is done.
pub(crate) fn stream_sync(s: RawStream) -> Result<(), CudaError> {
    check("cuStreamSynchronize", unsafe {
        cu::cuStreamSynchronize(s.0.cast())
    })
}

/// Makes later work on `s` wait for the last record of `e` (on the device, not the host).
pub(crate) fn stream_wait(s: RawStream, e: RawEvent) -> Result<(), CudaError> {
    check("cuStreamWaitEvent", unsafe {
        cu::cuStreamWaitEvent(s.0.cast(), e.0.cast(), 0)
    })
}

/// An event without timing; shareable with other processes when `interprocess`.
pub(crate) fn event_create(interprocess: bool) -> Result<RawEvent, CudaError> {
    let mut flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    if interprocess {
        flags |= cu::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
    }
    let mut e = ptr::null_mut();
    check("cuEventCreate", unsafe { cu::cuEventCreate(&mut e, flags) })?;
    Ok(RawEvent(e.cast()))
}

/// Destroys an event (own or opened from a handle).
pub(crate) fn event_destroy(e: RawEvent) -> Result<(), CudaError> {
    check("cuEventDestroy", unsafe {
        cu::cuEventDestroy_v2(e.0.cast())
    })
}

/// Records `e` at the current end of `s`.
pub(crate) fn event_record(e: RawEvent, s: RawStream) -> Result<(), CudaError> {
    check("cuEventRecord", unsafe {
        cu::cuEventRecord(e.0.cast(), s.0.cast())
    })
}

/// Blocks until the last record of `e` has completed.
pub(crate) fn event_sync(e: RawEvent) -> Result<(), CudaError> {
    check("cuEventSynchronize", unsafe {
        cu::cuEventSynchronize(e.0.cast())
    })
}

/// The IPC handle of an interprocess event.
pub(crate) fn ipc_event_handle(e: RawEvent) -> Result<IpcEventHandle, CudaError> {
    let mut h = cu::CUipcEventHandle {
        reserved: [0; HANDLE_BYTES],
    };
    check("cuIpcGetEventHandle", unsafe {
        cu::cuIpcGetEventHandle(&mut h, e.0.cast())
    })?;
    Ok(IpcEventHandle(handle_bytes(&h.reserved)))
}

/// Opens another process's interprocess event.
pub(crate) fn ipc_open_event(h: &IpcEventHandle) -> Result<RawEvent, CudaError> {
    let handle = cu::CUipcEventHandle {
        reserved: handle_chars(&h.0),
    };
    let mut e = ptr::null_mut();
    check("cuIpcOpenEventHandle", unsafe {
        cu::cuIpcOpenEventHandle(&mut e, handle)
    })?;
    Ok(RawEvent(e.cast()))
}

/// Queues one copy descriptor on `s`.
///
/// # Safety
///
/// Every byte the descriptor reads must lie in device memory mapped in the current context,
/// and every byte it writes in device memory of that context that nothing else reads or writes
/// until the copy has finished on `s`; the memory must stay allocated until then.
pub(crate) unsafe fn copy_async(d: &CopyDesc, s: RawStream) -> Result<(), CudaError> {
    let dev = cu::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    if d.height == 1 && d.depth == 1 {
        return check("cuMemcpyDtoDAsync", unsafe {
            cu::cuMemcpyDtoDAsync_v2(d.dst, d.src, d.width as usize, s.0.cast())
        });
    }
    if d.depth == 1 {
        let p = cu::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: dev,
            srcHost: ptr::null(),
            srcDevice: d.src,
            srcArray: ptr::null_mut(),
            srcPitch: d.src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: dev,
            dstHost: ptr::null_mut(),
            dstDevice: d.dst,
            dstArray: ptr::null_mut(),
            dstPitch: d.dst_pitch as usize,
            WidthInBytes: d.width as usize,
            Height: d.height as usize,
        };
        return check("cuMemcpy2DAsync", unsafe {
            cu::cuMemcpy2DAsync_v2(&p, s.0.cast())
        });
    }
    let p = cu::CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: dev,
        srcHost: ptr::null(),
        srcDevice: d.src,
        srcArray: ptr::null_mut(),
        reserved0: ptr::null_mut(),
        srcPitch: d.src_pitch as usize,
        srcHeight: d.src_rows as usize,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: dev,
        dstHost: ptr::null_mut(),
        dstDevice: d.dst,
        dstArray: ptr::null_mut(),
        reserved1: ptr::null_mut(),
        dstPitch: d.dst_pitch as usize,
        dstHeight: d.dst_rows as usize,
        WidthInBytes: d.width as usize,
        Height: d.height as usize,
        Depth: d.depth as usize,
    };
    check("cuMemcpy3DAsync", unsafe {
        cu::cuMemcpy3DAsync_v2(&p, s.0.cast())
    })
}

/// Copies host bytes to device memory (synchronous).
///
/// # Safety
///
/// `dst..dst + src.len()` must be device memory of the current context that nothing else uses
/// during the copy.
pub(crate) unsafe fn memcpy_htod(dst: u64, src: &[u8]) -> Result<(), CudaError> {
    check("cuMemcpyHtoD", unsafe {
        cu::cuMemcpyHtoD_v2(dst, src.as_ptr().cast::<c_void>(), src.len())
    })?;
    // From pageable memory the call returns once the bytes are staged, before the DMA has
    // written them (CUDA's "API synchronization behavior"), and the non-blocking streams awex
    // launches on do not wait for it: without this a kernel launched next may read, or be
    // overwritten by, the bytes still in flight.
    check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
}

/// Copies device memory to host bytes (synchronous).
///
/// # Safety
///
/// `src..src + dst.len()` must be device memory mapped in the current context.
pub(crate) unsafe fn memcpy_dtoh(dst: &mut [u8], src: u64) -> Result<(), CudaError> {
    check("cuMemcpyDtoH", unsafe {
        cu::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src, dst.len())
    })
}

/// Fills `n` 16-bit words at `p` with `v`, queued on `s`.
///
/// # Safety
///
/// `p..p + n * 2` must be device memory of the current context that stays allocated, and
/// that nothing else reads or writes, until the fill has finished on `s`.
pub(crate) unsafe fn memset_d16_async(
    p: u64,
    v: u16,
    n: u64,
    s: RawStream,
) -> Result<(), CudaError> {
    check("cuMemsetD16Async", unsafe {
        cu::cuMemsetD16Async(p, v, n as usize, s.0.cast())
    })
}

/// Fills `n` 32-bit words at `p` with `v`, queued on `s`.
///
/// # Safety
///
/// `p..p + n * 4` must be device memory of the current context that stays allocated, and
/// that nothing else reads or writes, until the fill has finished on `s`.
pub(crate) unsafe fn memset_d32_async(
    p: u64,
    v: u32,
    n: u64,
    s: RawStream,
) -> Result<(), CudaError> {
    check("cuMemsetD32Async", unsafe {
        cu::cuMemsetD32Async(p, v, n as usize, s.0.cast())
    })
}

/// Starts capturing the work queued on `s` (and streams joined to it by events) into a graph.
pub(crate) fn capture_begin(s: RawStream) -> Result<(), CudaError> {
    check("cuStreamBeginCapture", unsafe {
        cu::cuStreamBeginCapture_v2(
            s.0.cast(),
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
    })
}

/// Ends a capture and instantiates the captured graph.
pub(crate) fn capture_end(s: RawStream) -> Result<RawGraphExec, CudaError> {
    let mut g = ptr::null_mut();
    check("cuStreamEndCapture", unsafe {
        cu::cuStreamEndCapture(s.0.cast(), &mut g)
    })?;
    let mut exec = ptr::null_mut();
    let r = check("cuGraphInstantiateWithFlags", unsafe {
        cu::cuGraphInstantiateWithFlags(&mut exec, g, 0)
    });
    // the executable graph keeps what it needs; the template can go either way
    let d = check("cuGraphDestroy", unsafe { cu::cuGraphDestroy(g) });
    r?;
    d?;
    Ok(RawGraphExec(exec.cast()))
}

/// Queues a captured graph on `s`.
///
/// # Safety
///
/// Every copy captured in `g` must still meet [`copy_async`]'s conditions: the memory it reads
/// and writes is still allocated and mapped, and its destinations are used by nothing else
/// until the graph has finished on `s`.
pub(crate) unsafe fn graph_launch(g: RawGraphExec, s: RawStream) -> Result<(), CudaError> {
    check("cuGraphLaunch", unsafe {
        cu::cuGraphLaunch(g.0.cast(), s.0.cast())
    })
}

/// Loads a module into the current context: a cubin (an ELF image, loaded as it is) or PTX
/// (NUL-terminated text, which the driver compiles for the device).
pub(crate) fn module_load(image: &[u8]) -> Result<RawModule, CudaError> {
    let elf = image.starts_with(b"\x7fELF");
    if !elf && CStr::from_bytes_with_nul(image).is_err() {
        return Err(CudaError::Driver {
            call: "cuModuleLoadData",
            code: 0,
            name: "awex".into(),
            message: "a PTX image must be one NUL-terminated string".into(),
        });
    }
    let mut m = ptr::null_mut();
    // SAFETY: the image is an ELF file the driver parses with its own bounds, or a
    // NUL-terminated string (checked above).
    check("cuModuleLoadData", unsafe {
        cu::cuModuleLoadData(&mut m, image.as_ptr().cast::<c_void>())
    })?;
    Ok(RawModule(m.cast()))
}

/// A kernel of a loaded module.
pub(crate) fn module_function(m: RawModule, name: &CStr) -> Result<RawFunction, CudaError> {
    let mut f = ptr::null_mut();
    check("cuModuleGetFunction", unsafe {
        cu::cuModuleGetFunction(&mut f, m.0.cast(), name.as_ptr())
    })?;
    Ok(RawFunction(f.cast()))
}

/// Unloads a module.
pub(crate) fn module_unload(m: RawModule) -> Result<(), CudaError> {
    check("cuModuleUnload", unsafe { cu::cuModuleUnload(m.0.cast()) })
}

/// Queues `awex_copy_rows(src, dst, nvec, spitch, dpitch, height)` on `s`.
///
/// # Safety
///
/// `f` must be the copy kernel of a module loaded in the current context, and the rows it
/// describes (`height` rows of `nvec` 16-byte vectors, `spitch` / `dpitch` bytes apart) must lie
/// in device memory mapped in that context, the destination rows used by nothing else until the
/// kernel has finished on `s`.
pub(crate) unsafe fn launch_copy_rows(
    f: RawFunction,
    grid: (u32, u32),
    block: u32,
    s: RawStream,
    args: [u64; 6],
) -> Result<(), CudaError> {
    let mut a = args;
    let mut params: [*mut c_void; 6] = [ptr::null_mut(); 6];
    for (p, v) in params.iter_mut().zip(a.iter_mut()) {
        *p = (v as *mut u64).cast();
    }
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            f.0.cast(),
            grid.0,
            grid.1,
            1,
            block,
            1,
            1,
            0,
            s.0.cast(),
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    })
}

/// Launches `f` over `blocks` blocks of `threads` threads on `s` with kernel arguments `args`,
/// each a 64-bit or 32-bit value as the kernel declares it (the delta kernels, `delta.ptx`).
///
/// # Safety
///
/// `f` must be loaded in the current context and take exactly `args`, and every address among
/// them must meet the kernel's contract (see the kernel's caller) until the launch finishes.
pub(crate) unsafe fn launch_args(
    f: RawFunction,
    blocks: u32,
    threads: impl Into<(u32, u32)>,
    s: RawStream,
    args: &mut [super::KernelArg],
) -> Result<(), CudaError> {
    let mut params: Vec<*mut c_void> = args
        .iter_mut()
        .map(|a| match a {
            super::KernelArg::U64(v) => (v as *mut u64).cast(),
            super::KernelArg::U32(v) => (v as *mut u32).cast(),
        })
        .collect();
    let (tx, ty) = threads.into();
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            f.0.cast(),
            blocks,
            1,
            1,
            tx,
            ty,
            1,
            0,
            s.0.cast(),
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    })
}

/// Launches `awex_fp8_block_quant` (`fp8_block.ptx`) over a `grid` of 128 x 128 blocks, 256
/// threads each, on `s`: `ptrs` are source, destination, scales and status; `dims` are rows,
/// columns, source pitch, destination pitch (bytes), scale pitch (elements) and mode.
///
/// # Safety
///
/// `f` must be that kernel, loaded in the current context, and every address with the extents
/// `dims` describe must lie in device memory of this context that stays allocated until the
/// launch has finished, the destination, scales and status used by nothing else meanwhile.
pub(crate) unsafe fn launch_fp8_block_quant(
    f: RawFunction,
    grid: (u32, u32),
    s: RawStream,
    ptrs: [u64; 4],
    dims: [u32; 6],
) -> Result<(), CudaError> {
    let (mut p, mut d) = (ptrs, dims);
    let mut params: [*mut c_void; 10] = [ptr::null_mut(); 10];
    for (slot, v) in params.iter_mut().zip(p.iter_mut()) {
        *slot = (v as *mut u64).cast();
    }
    for (slot, v) in params[4..].iter_mut().zip(d.iter_mut()) {
        *slot = (v as *mut u32).cast();
    }
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            f.0.cast(),
            grid.0,
            grid.1,
            1,
            256,
            1,
            1,
            0,
            s.0.cast(),
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    })
}

/// Launches `awex_fp8_block_table` (`fp8_table.ptx`) with `blocks` blocks of 256 threads on
/// `s`: `ptrs` are the job table, the block-to-job index and the status words.
///
/// # Safety
///
/// `f` must be that kernel, loaded in the current context; the table must describe jobs over
/// device memory of this context (or mapped into it) that stays allocated, with the table, the
/// index and the status, until the launch has finished, the destinations, scales and status
/// used by nothing else meanwhile; `blocks` must not pass the index's length.
pub(crate) unsafe fn launch_fp8_table(
    f: RawFunction,
    blocks: u32,
    s: RawStream,
    ptrs: [u64; 3],
    mode: u32,
) -> Result<(), CudaError> {
    let (mut p, mut m) = (ptrs, mode);
    let mut params: [*mut c_void; 4] = [ptr::null_mut(); 4];
    for (slot, v) in params.iter_mut().zip(p.iter_mut()) {
        *slot = (v as *mut u64).cast();
    }
    params[3] = (&mut m as *mut u32).cast();
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            f.0.cast(),
            blocks,
            1,
            1,
            256,
            1,
            1,
            0,
            s.0.cast(),
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    })
}

/// Destroys an instantiated graph.
pub(crate) fn graph_destroy(g: RawGraphExec) -> Result<(), CudaError> {
    check("cuGraphExecDestroy", unsafe {
        cu::cuGraphExecDestroy(g.0.cast())
    })
}
