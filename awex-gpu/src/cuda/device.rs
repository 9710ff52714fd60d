//! A GPU and what lives on it: its context, device buffers, streams and events.

use super::handle::IpcEventHandle;
use super::raw::{RawCtx, RawEvent, RawStream};
use super::{CudaError, sys};
use std::sync::Arc;

/// Whether libcuda can be loaded here (always false in a build without CUDA).
pub fn driver_present() -> bool {
    sys::driver_present()
}

/// The CUDA version of the installed driver (e.g. 13000 for 13.0).
pub fn driver_version() -> Result<i32, CudaError> {
    sys::driver_version()
}

/// The number of GPUs the driver sees.
pub fn device_count() -> Result<u32, CudaError> {
    sys::device_count()
}

struct DeviceInner {
    ordinal: u32,
    ctx: RawCtx,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // a release that fails at teardown has nothing left to clean
        let _ = sys::ctx_release(self.ordinal);
    }
}

/// An opened GPU: its primary context, shared with the CUDA runtime (and so with PyTorch).
///
/// Every awex call on the device makes this context current on the calling thread first, so a
/// `Device` can be used from any thread.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.inner.ordinal)
    }
}

impl Device {
    /// Opens GPU `ordinal`; errors say whether CUDA is not built in, the driver is missing, or
    /// there is no such GPU.
    pub fn open(ordinal: u32) -> Result<Device, CudaError> {
        sys::init()?;
        let ctx = sys::ctx_retain(ordinal)?;
        let d = Device {
            inner: Arc::new(DeviceInner { ordinal, ctx }),
        };
        d.bind()?;
        Ok(d)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        sys::ctx_set(self.inner.ctx)
    }

    /// The GPU's name (e.g. "NVIDIA H200").
    pub fn name(&self) -> Result<String, CudaError> {
        sys::device_name(self.inner.ordinal)
    }

    /// The GPU's memory in bytes.
    pub fn total_memory(&self) -> Result<u64, CudaError> {
        sys::device_total_mem(self.inner.ordinal)
    }

    /// Whether this GPU can read GPU `peer`'s memory directly (NVLink or PCIe peer access).
    pub fn can_access_peer(&self, peer: u32) -> Result<bool, CudaError> {
        sys::can_access_peer(self.inner.ordinal, peer)
    }

    /// Allocates `bytes` of device memory.
    pub fn alloc(&self, bytes: u64) -> Result<DeviceBuffer, CudaError> {
        self.bind()?;
        let ptr = sys::mem_alloc(bytes.max(1))?;
        Ok(DeviceBuffer {
            dev: self.clone(),
            ptr,
            len: bytes,
            mapped: None,
        })
    }

    /// Allocates `bytes` as physical chunks of `chunk` bytes (a multiple of 2 MiB) created with
    /// `cuMemCreate` and mapped back to back into one reserved range: the memory PyTorch's
    /// expandable segments hold (its large pool maps 20 MiB chunks), for measuring that path.
    pub fn alloc_chunked(&self, bytes: u64, chunk: u64) -> Result<DeviceBuffer, CudaError> {
        const GRANULE: u64 = 2 << 20;
        if chunk == 0 || chunk % GRANULE != 0 {
            return Err(CudaError::OutOfRange {
                what: "a chunk size (a multiple of 2 MiB)",
                offset: 0,
                len: chunk,
                size: GRANULE,
            });
        }
        self.bind()?;
        let total = bytes.max(1).div_ceil(chunk) * chunk;
        let ptr = sys::vmm_reserve(total)?;
        let mut buf = DeviceBuffer {
            dev: self.clone(),
            ptr,
            len: bytes,
            mapped: Some((total, 0, chunk)),
        };
        let mut at = 0;
        while at < total {
            let h = sys::vmm_create(chunk, self.inner.ordinal)?;
            let m = sys::vmm_map(ptr + at, chunk, h);
            let _ = sys::vmm_release(h); // the mapping keeps the memory
            m?;
            at += chunk;
            buf.mapped = Some((total, at, chunk)); // what Drop unmaps if the next step fails
            sys::vmm_set_access(ptr + at - chunk, chunk, self.inner.ordinal)?;
        }
        Ok(buf)
    }

    /// A new stream that does not synchronise with the legacy default stream.
    pub fn stream(&self) -> Result<Stream, CudaError> {
        self.bind()?;
        Ok(Stream {
            dev: self.clone(),
            raw: sys::stream_create()?,
        })
    }

    /// A new event without timing; `interprocess` makes it shareable through an IPC handle.
    pub fn event(&self, interprocess: bool) -> Result<Event, CudaError> {
        self.bind()?;
        Ok(Event {
            dev: self.clone(),
            raw: sys::event_create(interprocess)?,
        })
    }

    /// Opens an event another process shared; it can be waited on, and is destroyed on drop.
    pub fn open_event(&self, h: &IpcEventHandle) -> Result<Event, CudaError> {
        self.bind()?;
        Ok(Event {
            dev: self.clone(),
            raw: sys::ipc_open_event(h)?,
        })
    }

    /// Copies `dst.len()` bytes from device address `src` to the host (synchronous).
    ///
    /// # Safety
    ///
    /// `src..src + dst.len()` must be device memory mapped in this device's context (owned or
    /// opened through IPC) that stays allocated during the call.
    pub unsafe fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe { sys::memcpy_dtoh(dst, src) }
    }

    /// Copies host bytes to device address `dst` (synchronous).
    ///
    /// # Safety
    ///
    /// `dst..dst + src.len()` must be device memory of this device's context that nothing else
    /// reads or writes during the call.
    pub unsafe fn copy_from_host(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe { sys::memcpy_htod(dst, src) }
    }

    /// Queues a fill of `count` 16-bit words at device address `ptr` with `value` on `s`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + 2 * count` must be device memory of this context that stays allocated, and
    /// that nothing else reads or writes, until the fill has finished on `s`.
    pub unsafe fn fill_u16(
        &self,
        ptr: u64,
        count: u64,
        value: u16,
        s: &Stream,
    ) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe { sys::memset_d16_async(ptr, value, count, s.raw) }
    }

    /// Queues a fill of `count` 32-bit words at device address `ptr` with `value` on `s`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + 4 * count` must be device memory of this context that stays allocated, and
    /// that nothing else reads or writes, until the fill has finished on `s`.
    pub unsafe fn fill_u32(
        &self,
        ptr: u64,
        count: u64,
        value: u32,
        s: &Stream,
    ) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe { sys::memset_d32_async(ptr, value, count, s.raw) }
    }

    /// Free and total memory of this device, in bytes (`cuMemGetInfo`).
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        self.bind()?;
        sys::mem_get_info()
    }
}

/// Device memory owned by awex, freed on drop.
pub struct DeviceBuffer {
    dev: Device,
    ptr: u64,
    len: u64,
    /// For [`Device::alloc_chunked`]: (reserved bytes, bytes mapped from the start, chunk).
    mapped: Option<(u64, u64, u64)>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes)", self.ptr, self.len)
    }
}

impl DeviceBuffer {
    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    fn range(&self, offset: u64, len: u64) -> Result<u64, CudaError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(CudaError::OutOfRange {
                what: "the device buffer",
                offset,
                len,
                size: self.len,
            });
        }
        Ok(self.ptr + offset)
    }

    /// Writes host bytes at `offset` (synchronous).
    pub fn upload(&self, offset: u64, src: &[u8]) -> Result<(), CudaError> {
        let p = self.range(offset, src.len() as u64)?;
        // SAFETY: `range` checked that the bytes lie in this buffer, which `&self` keeps alive.
        unsafe { self.dev.copy_from_host(p, src) }
    }

    /// Reads `dst.len()` bytes at `offset` to the host (synchronous).
    pub fn download(&self, offset: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        let p = self.range(offset, dst.len() as u64)?;
        // SAFETY: `range` checked that the bytes lie in this buffer, which `&self` keeps alive.
        unsafe { self.dev.copy_to_host(p, dst) }
    }

    /// Fills the whole buffer with the 16-bit word `value` (its length must be even), queued on
    /// `s`; the caller synchronises `s` before reading the buffer elsewhere.
    pub fn fill_u16(&self, value: u16, s: &Stream) -> Result<(), CudaError> {
        let p = self.range(0, self.len / 2 * 2)?;
        // SAFETY: the words lie in this buffer; it is freed only on drop, and the driver
        // orders the free after the queued fill (cuMemFree synchronises).
        unsafe { self.dev.fill_u16(p, self.len / 2, value, s) }
    }

    /// Fills the whole buffer with the 32-bit word `value` (whole words only), queued on `s`.
    pub fn fill_u32(&self, value: u32, s: &Stream) -> Result<(), CudaError> {
        let p = self.range(0, self.len / 4 * 4)?;
        // SAFETY: as for `fill_u16`.
        unsafe { self.dev.fill_u32(p, self.len / 4, value, s) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // freeing at teardown: the context may already be gone, nothing else to do
        if self.dev.bind().is_err() {
            return;
        }
        match self.mapped {
            None => {
                let _ = sys::mem_free(self.ptr);
            }
            Some((reserved, mapped, chunk)) => {
                let mut at = 0;
                while at < mapped {
                    let _ = sys::vmm_unmap(self.ptr + at, chunk);
                    at += chunk;
                }
                let _ = sys::vmm_free(self.ptr, reserved);
            }
        }
    }
}

/// A queue of device work.
pub struct Stream {
    dev: Device,
    pub(crate) raw: RawStream,
}

impl Stream {
    /// The driver's `CUstream`, for libraries that enqueue on it (NCCL). Valid while `self` lives.
    pub fn as_raw(&self) -> *mut std::ffi::c_void {
        self.raw.0
    }

    /// Blocks the host until everything queued so far has run.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.dev.bind()?;
        sys::stream_sync(self.raw)
    }

    /// Makes later work on this stream wait for `e`'s last record, on the device.
    pub fn wait(&self, e: &Event) -> Result<(), CudaError> {
        self.dev.bind()?;
        sys::stream_wait(self.raw, e.raw)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.dev.bind().and_then(|_| sys::stream_destroy(self.raw));
    }
}

/// A point in a stream that other streams, or another process, can wait for.
pub struct Event {
    dev: Device,
    pub(crate) raw: RawEvent,
}

impl Event {
    /// Records the event at the current end of `s`.
    pub fn record(&self, s: &Stream) -> Result<(), CudaError> {
        self.dev.bind()?;
        sys::event_record(self.raw, s.raw)
    }

    /// Blocks the host until the last record has run.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.dev.bind()?;
        sys::event_sync(self.raw)
    }

    /// The handle another process opens with [`Device::open_event`] (interprocess events only).
    pub fn ipc_handle(&self) -> Result<IpcEventHandle, CudaError> {
        self.dev.bind()?;
        sys::ipc_event_handle(self.raw)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.dev.bind().and_then(|_| sys::event_destroy(self.raw));
    }
}
