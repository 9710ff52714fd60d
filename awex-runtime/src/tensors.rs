//! Tensors the runtime reads and writes in place: memory it does not own (pointer, length, dtype, shape).

use super::shm::ShmSegment;
use super::{LayoutMismatch, PlacementError, RuntimeError, TensorError};
use awex_core::dtype::DType;
use awex_core::layout::{Dims, RankLayout};
use awex_gpu::cuda::{CudaError, Device, DeviceBuffer};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// Where a tensor's bytes live: host memory the CPU can read, or one GPU's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host memory (heap, shared memory, a pinned buffer).
    Host,
    /// Device memory of the GPU with this CUDA ordinal.
    Cuda(u32),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Host => f.write_str("host memory"),
            Location::Cuda(d) => write!(f, "GPU {d} memory"),
        }
    }
}

/// The error of a CUDA call made for a tensor set (its message: setup problems such as no CUDA
/// build, no driver or no GPU keep their own, the rest name the tensor operation).
pub(crate) fn cuda_err(what: &str, e: CudaError) -> RuntimeError {
    RuntimeError::Cuda {
        what: what.to_string(),
        source: e,
    }
}

/// A view of one local tensor's memory (row-major, contiguous), owned by someone else.
#[derive(Clone, Debug)]
pub struct TensorView {
    /// Engine-native name.
    pub name: Arc<str>,
    ptr: *mut u8,
    len: usize,
    location: Location,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Dims,
}

// SAFETY: a view is a pointer into memory the registering party keeps alive and does not mutate
// while an update runs (the contract of `TensorView::new`).
unsafe impl Send for TensorView {}
// SAFETY: as above.
unsafe impl Sync for TensorView {}

impl TensorView {
    /// A view of `len` bytes at `ptr` holding a `shape` tensor of `dtype`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid, writable and not be accessed by anyone else while awex
    /// executes an update on it, for as long as the view (or a set holding it) lives.
    pub unsafe fn new(
        name: &str,
        ptr: *mut u8,
        len: usize,
        dtype: DType,
        shape: Dims,
    ) -> Result<Self, RuntimeError> {
        let want = shape.numel() as usize * dtype.size();
        if len != want {
            return Err(TensorError::Size {
                name: name.to_string(),
                len,
                shape,
                dtype,
                want,
            }
            .into());
        }
        if ptr.is_null() && len > 0 {
            return Err(TensorError::NullPointer {
                name: name.to_string(),
            }
            .into());
        }
        Ok(TensorView {
            name: Arc::from(name),
            ptr,
            len,
            location: Location::Host,
            dtype,
            shape,
        })
    }

    /// A view of `len` bytes of device memory at device address `ptr` on GPU `device`.
    ///
    /// Host-only operations ([`TensorView::try_bytes`], the `shm` and `tcp` transports, the
    /// bucket packers, weight filling) refuse such a view; the `cuda-ipc` transport copies it on
    /// the GPU.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be device memory of GPU `device` (from `cuMemAlloc` or a caching
    /// allocator on top of it) that stays allocated, and that nobody else writes while awex
    /// executes an update on it, for as long as the view (or a set holding it) lives.
    pub unsafe fn new_cuda(
        name: &str,
        ptr: u64,
        len: usize,
        dtype: DType,
        shape: Dims,
        device: u32,
    ) -> Result<Self, RuntimeError> {
        // SAFETY: a device address is only stored, never dereferenced on the host.
        let mut v = unsafe { Self::new(name, ptr as usize as *mut u8, len, dtype, shape)? };
        v.location = Location::Cuda(device);
        Ok(v)
    }

    /// Start address (a device address for device views: never dereference it on the host).
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Where the bytes live.
    pub fn location(&self) -> Location {
        self.location
    }

    /// Whether the bytes live in GPU memory.
    pub fn is_device(&self) -> bool {
        self.location != Location::Host
    }

    /// The device address of a device view; `None` for host views.
    pub fn device_ptr(&self) -> Option<u64> {
        match self.location {
            Location::Host => None,
            Location::Cuda(_) => Some(self.ptr as usize as u64),
        }
    }

    fn host_only(&self) -> RuntimeError {
        TensorError::HostOnly {
            name: self.name.to_string(),
            location: self.location,
        }
        .into()
    }

    /// The bytes of a host view; a device view is refused with an error naming the tensor.
    pub fn try_bytes(&self) -> Result<&[u8], RuntimeError> {
        if self.is_device() {
            return Err(self.host_only());
        }
        Ok(self.bytes())
    }

    /// The bytes of a host view, writable; a device view is refused with an error naming the tensor.
    ///
    /// # Safety
    /// As [`TensorView::bytes_mut`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn try_bytes_mut(&self) -> Result<&mut [u8], RuntimeError> {
        if self.is_device() {
            return Err(self.host_only());
        }
        // SAFETY: guaranteed by the caller.
        Ok(unsafe { self.bytes_mut() })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    ///
    /// # Panics
    /// On a device view, whose bytes the host cannot read (use [`TensorView::try_bytes`]
    /// where a view may live on a GPU).
    pub fn bytes(&self) -> &[u8] {
        if self.is_device() {
            panic!("{}", self.host_only());
        }
        if self.len == 0 {
            return &[];
        }
        // SAFETY: guaranteed by the contract of `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    ///
    /// # Safety
    /// No other reference to these bytes may be alive (the runtime writes each destination box once).
    ///
    /// # Panics
    /// On a device view (use [`TensorView::try_bytes_mut`] where a view may live on a GPU).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        if self.is_device() {
            panic!("{}", self.host_only());
        }
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: guaranteed by the caller and the contract of `new`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Memory a `TensorSet` owns on behalf of its views.
enum Backing {
    Host(#[allow(dead_code)] Vec<Vec<u64>>),
    Shm(Arc<ShmSegment>),
    /// One device allocation per tensor, and the GPU they live on.
    Cuda(Device, #[allow(dead_code)] Vec<DeviceBuffer>),
}

/// The registered local tensors of one rank, by name.
pub struct TensorSet {
    views: HashMap<Arc<str>, TensorView>,
    order: Vec<Arc<str>>,
    backing: Option<Backing>,
}

/// Byte alignment of tensors awex allocates.
const ALIGN: usize = 256;

impl TensorSet {
    /// A set of views registered by the caller (memory owned elsewhere).
    pub fn from_views(views: Vec<TensorView>) -> Result<Self, RuntimeError> {
        let mut map = HashMap::new();
        let mut order = Vec::new();
        for v in views {
            if map.contains_key(&v.name) {
                return Err(TensorError::Twice {
                    name: v.name.to_string(),
                }
                .into());
            }
            order.push(v.name.clone());
            map.insert(v.name.clone(), v);
        }
        Ok(TensorSet {
            views: map,
            order,
            backing: None,
        })
    }

    /// Allocates zeroed host memory for every tensor of a rank layout.
    pub fn allocate_host(layout: &RankLayout) -> Result<Self, RuntimeError> {
        Self::host_tensors(
            layout
                .tensors
                .iter()
                .map(|t| (&*t.name, t.nbytes() as usize, t.dtype, t.shape)),
        )
    }

    fn host_tensors<'a>(
        tensors: impl Iterator<Item = (&'a str, usize, DType, Dims)>,
    ) -> Result<Self, RuntimeError> {
        let mut bufs = Vec::new();
        let mut views = Vec::new();
        for (name, len, dtype, shape) in tensors {
            let mut b = vec![0u64; len.div_ceil(8)];
            // touch every page now, so the first update does not pay for page faults
            for w in b.iter_mut().step_by(512) {
                // SAFETY: a valid, aligned element of the vector.
                unsafe { std::ptr::write_volatile(w, 0) };
            }
            let ptr = b.as_mut_ptr() as *mut u8;
            // SAFETY: the buffer lives in `bufs`, owned by the set, and never moves (Vec of Vec).
            views.push(unsafe { TensorView::new(name, ptr, len, dtype, shape)? });
            bufs.push(b);
        }
        let mut set = Self::from_views(views)?;
        set.backing = Some(Backing::Host(bufs));
        Ok(set)
    }

    /// Allocates zeroed device memory on `dev` for every tensor of a rank layout: one
    /// allocation per tensor (rounded up to 256 bytes).
    ///
    /// One allocation per tensor rather than one buffer for all: the CUDA IPC runs
    /// (docs/benchmarks.md) opened 291 per-tensor allocations of qwen3-8b in 17 ms against
    /// 117 ms for one 16.4 GB buffer, and read them at 3827 against 3320 GB/s, because reading
    /// through the IPC mapping of one huge allocation is slower. Padding stays zero: every
    /// allocation is zeroed here.
    pub fn allocate_cuda(layout: &RankLayout, dev: &Device) -> Result<Self, RuntimeError> {
        let what = "allocating tensors on the GPU";
        let stream = dev.stream().map_err(|e| cuda_err(what, e))?;
        let mut bufs = Vec::with_capacity(layout.tensors.len());
        let mut views = Vec::with_capacity(layout.tensors.len());
        for t in &layout.tensors {
            let len = t.nbytes() as usize;
            let cap = len.max(1).div_ceil(ALIGN) * ALIGN;
            let b = dev.alloc(cap as u64).map_err(|e| {
                cuda_err(
                    &format!(
                        "allocating `{}` ({len} bytes) on GPU {}",
                        t.name,
                        dev.ordinal()
                    ),
                    e,
                )
            })?;
            b.fill_u32(0, &stream).map_err(|e| cuda_err(what, e))?;
            // SAFETY: the allocation lives in `bufs`, owned by the set, and holds `len` bytes.
            views.push(unsafe {
                TensorView::new_cuda(&t.name, b.ptr(), len, t.dtype, t.shape, dev.ordinal())?
            });
            bufs.push(b);
        }
        stream.sync().map_err(|e| cuda_err(what, e))?;
        let mut set = Self::from_views(views)?;
        set.backing = Some(Backing::Cuda(dev.clone(), bufs));
        Ok(set)
    }

    /// Zeroed host memory with the same tensors (names, shapes, dtypes) as this set: a staging
    /// copy of a device set, filled or checked on the host.
    pub fn host_mirror(&self) -> Result<Self, RuntimeError> {
        Self::host_tensors(self.iter().map(|v| (&*v.name, v.len(), v.dtype, v.shape)))
    }

    /// Where the set's tensors live (host memory for an empty set); an error when they are
    /// spread over host memory and GPUs.
    pub fn location(&self) -> Result<Location, RuntimeError> {
        let mut views = self.iter();
        let Some(first) = views.next() else {
            return Ok(Location::Host);
        };
        if let Some(other) = views.find(|v| v.location != first.location) {
            return Err(TensorError::MixedLocations {
                first: first.name.to_string(),
                first_location: first.location,
                other: other.name.to_string(),
                other_location: other.location,
            }
            .into());
        }
        Ok(first.location)
    }

    /// Refuses a set holding any device view, for the host-only operation `what`.
    pub fn require_host(&self, what: &str) -> Result<(), RuntimeError> {
        match self.iter().find(|v| v.is_device()) {
            None => Ok(()),
            Some(v) => Err(PlacementError::DeviceTensor {
                transport: what.to_string(),
                name: v.name.to_string(),
                location: v.location,
            }
            .into()),
        }
    }

    /// The GPU every tensor of the set lives on: the device the set was allocated on, or the
    /// one its registered device views name.
    pub fn cuda_device(&self) -> Result<Device, RuntimeError> {
        if let Some(Backing::Cuda(d, _)) = &self.backing {
            return Ok(d.clone());
        }
        match self.location()? {
            Location::Cuda(ordinal) => {
                Device::open(ordinal).map_err(|e| cuda_err("opening the tensors' GPU", e))
            }
            Location::Host => Err(PlacementError::NotOnGpu.into()),
        }
    }

    /// The views of `host` matching this set's device views one to one (same names and sizes).
    fn pair_with<'a>(
        &'a self,
        host: &'a TensorSet,
    ) -> Result<Vec<(&'a TensorView, &'a TensorView)>, RuntimeError> {
        let mut out = Vec::with_capacity(self.len());
        for d in self.iter() {
            let h = host.get(&d.name).ok_or_else(|| {
                RuntimeError::from(TensorError::NoStagingCopy {
                    name: d.name.to_string(),
                })
            })?;
            if !d.is_device() {
                return Err(TensorError::NotStaged {
                    name: d.name.to_string(),
                    location: d.location,
                }
                .into());
            }
            if h.is_device() {
                return Err(TensorError::StagingOnDevice {
                    name: d.name.to_string(),
                    location: h.location,
                }
                .into());
            }
            if h.len() != d.len() {
                return Err(TensorError::StagingSize {
                    name: d.name.to_string(),
                    device: d.len(),
                    host: h.len(),
                }
                .into());
            }
            out.push((d, h));
        }
        Ok(out)
    }

    /// Copies every tensor of the host set `host` into this device set; returns once the
    /// bytes are in device memory (safe to share with another process right away).
    pub fn upload_from(&self, host: &TensorSet) -> Result<u64, RuntimeError> {
        let pairs = self.pair_with(host)?;
        let dev = self.cuda_device()?;
        let mut moved = 0u64;
        let mut last = None;
        for (d, h) in pairs {
            let Some(ptr) = d.device_ptr().filter(|_| !d.is_empty()) else {
                continue;
            };
            // SAFETY: a device view covers `d.len()` bytes of device memory on `dev` (its
            // constructor's contract), which `pair_with` matched to the host view's length.
            unsafe { dev.copy_from_host(ptr, h.try_bytes()?) }
                .map_err(|e| cuda_err(&format!("uploading `{}`", d.name), e))?;
            moved += d.len() as u64;
            last = Some(ptr);
        }
        // a synchronous copy from pageable host memory may return before its DMA ends; a
        // synchronous read behind it on the same (legacy) stream returns only after it
        if let Some(ptr) = last {
            // SAFETY: `ptr` starts a non-empty device view on `dev`.
            unsafe { dev.copy_to_host(ptr, &mut [0u8]) }
                .map_err(|e| cuda_err("waiting for the uploads", e))?;
        }
        Ok(moved)
    }

    /// Copies every tensor of this device set into the host set `host` (synchronous).
    pub fn download_to(&self, host: &TensorSet) -> Result<u64, RuntimeError> {
        let pairs = self.pair_with(host)?;
        let dev = self.cuda_device()?;
        let mut moved = 0u64;
        for (d, h) in pairs {
            let Some(ptr) = d.device_ptr().filter(|_| !d.is_empty()) else {
                continue;
            };
            // SAFETY: the staging set is the caller's, not read while it is being written.
            let out = unsafe { h.try_bytes_mut()? };
            // SAFETY: the device view covers `out.len()` bytes on `dev` (see `upload_from`).
            unsafe { dev.copy_to_host(ptr, out) }
                .map_err(|e| cuda_err(&format!("downloading `{}`", d.name), e))?;
            moved += d.len() as u64;
        }
        Ok(moved)
    }

    /// A zeroed set with this set's tensors (names, shapes, dtypes) in the same kind of memory:
    /// on the same GPU for a device set, host memory otherwise. Atomic apply receives into it.
    pub fn staging_like(&self) -> Result<Self, RuntimeError> {
        match self.location()? {
            Location::Host => self.host_mirror(),
            Location::Cuda(_) => {
                let dev = self.cuda_device()?;
                let layout = RankLayout {
                    rank: awex_core::layout::RankId::train(0),
                    tensors: self
                        .iter()
                        .map(|v| awex_core::layout::LocalTensor {
                            name: v.name.clone(),
                            shape: v.shape,
                            dtype: v.dtype,
                            encoding: awex_core::encoding::Encoding::Plain(v.dtype),
                            placements: vec![],
                        })
                        .collect(),
                };
                Self::allocate_cuda(&layout, &dev)
            }
        }
    }

    /// Copies every tensor of `src` (same names and sizes, same kind of memory) into this set,
    /// host to host or device to device; returns the bytes copied once they are in place.
    pub fn copy_from(&self, src: &TensorSet) -> Result<u64, RuntimeError> {
        let mut pairs = Vec::with_capacity(self.len());
        for d in self.iter() {
            let s = src.get(&d.name).ok_or_else(|| TensorError::NoStagingCopy {
                name: d.name.to_string(),
            })?;
            if s.len() != d.len() || s.location != d.location {
                return Err(TensorError::StagingMismatch {
                    name: d.name.to_string(),
                    live: d.len(),
                    live_location: d.location,
                    staging: s.len(),
                    staging_location: s.location,
                }
                .into());
            }
            pairs.push((d, s));
        }
        let mut moved = 0u64;
        match self.location()? {
            Location::Host => {
                // pieces of at most 64 MiB, spread over a few threads (big shards copy at the
                // memory bandwidth of several cores, not one)
                const PIECE: usize = 64 << 20;
                let mut pieces: Vec<(usize, usize, usize)> = Vec::new();
                for (d, s) in pairs {
                    // SAFETY: the destination is this set's, written by nobody else meanwhile
                    // (the caller's contract for live tensors between updates); `src` is a
                    // distinct allocation of the same length.
                    let out = unsafe { d.try_bytes_mut()? };
                    let inp = s.try_bytes()?;
                    moved += d.len() as u64;
                    let mut at = 0;
                    while at < out.len() {
                        let n = PIECE.min(out.len() - at);
                        pieces.push((
                            out.as_mut_ptr() as usize + at,
                            inp.as_ptr() as usize + at,
                            n,
                        ));
                        at += n;
                    }
                }
                let threads = std::thread::available_parallelism()
                    .map_or(1, |n| n.get())
                    .clamp(1, 8)
                    .min(pieces.len().max(1));
                std::thread::scope(|scope| {
                    for t in 0..threads {
                        let mine: Vec<_> =
                            pieces.iter().skip(t).step_by(threads).copied().collect();
                        scope.spawn(move || {
                            for (dst, src, n) in mine {
                                // SAFETY: each piece lies inside one destination view and the
                                // matching source view (same length, checked above); pieces
                                // never overlap, and the views outlive this scope.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        src as *const u8,
                                        dst as *mut u8,
                                        n,
                                    )
                                };
                            }
                        });
                    }
                });
            }
            Location::Cuda(_) => {
                let dev = self.cuda_device()?;
                let engine = awex_gpu::cuda::CopyEngine::new(&dev, 1)
                    .map_err(|e| cuda_err("applying the staged tensors", e))?;
                let descs: Vec<_> = pairs
                    .iter()
                    .filter_map(|(d, s)| {
                        let (dp, sp) = (d.device_ptr()?, s.device_ptr()?);
                        (!d.is_empty())
                            .then(|| awex_gpu::cuda::CopyDesc::linear(sp, dp, d.len() as u64))
                    })
                    .collect();
                moved = descs.iter().map(|d| d.width).sum();
                // SAFETY: every range is a whole device view of one of the two sets, on `dev`,
                // checked to have the same length; the sets are distinct allocations.
                unsafe { engine.launch(&descs, None, None) }
                    .and_then(|_| engine.sync())
                    .map_err(|e| cuda_err("applying the staged tensors", e))?;
            }
        }
        Ok(moved)
    }

    /// Allocates every tensor of a rank layout inside one new shared-memory segment `name`.
    pub fn allocate_shm(layout: &RankLayout, name: &str) -> Result<Self, RuntimeError> {
        let mut offsets = Vec::with_capacity(layout.tensors.len());
        let mut total = 0usize;
        for t in &layout.tensors {
            offsets.push(total);
            total += (t.nbytes() as usize).div_ceil(ALIGN) * ALIGN;
        }
        let seg = Arc::new(ShmSegment::create(name, total)?);
        let mut views = Vec::new();
        for (t, off) in layout.tensors.iter().zip(offsets) {
            // SAFETY: offset + len lies inside the segment, owned by the set.
            views.push(unsafe {
                TensorView::new(
                    &t.name,
                    seg.ptr().add(off),
                    t.nbytes() as usize,
                    t.dtype,
                    t.shape,
                )?
            });
        }
        let mut set = Self::from_views(views)?;
        set.backing = Some(Backing::Shm(seg));
        Ok(set)
    }

    /// The shared-memory segment holding every tensor, when the set was allocated there.
    pub fn shm(&self) -> Option<&Arc<ShmSegment>> {
        match &self.backing {
            Some(Backing::Shm(s)) => Some(s),
            _ => None,
        }
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&TensorView> {
        self.views.get(name)
    }

    /// Tensors in registration order.
    pub fn iter(&self) -> impl Iterator<Item = &TensorView> {
        self.order.iter().filter_map(|n| self.views.get(n))
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// Whether no tensor is registered.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }

    /// Checks the registered tensors against the rank's computed layout: same names, shapes and dtypes.
    pub fn check_layout(&self, layout: &RankLayout) -> Result<(), RuntimeError> {
        for t in &layout.tensors {
            let v = self.views.get(&*t.name).ok_or_else(|| {
                RuntimeError::from(LayoutMismatch::Missing {
                    rank: layout.rank,
                    tensor: t.name.to_string(),
                    shape: t.shape,
                    dtype: t.dtype,
                })
            })?;
            if v.shape != t.shape {
                return Err(LayoutMismatch::Shape {
                    tensor: t.name.to_string(),
                    rank: layout.rank,
                    expected: t.shape,
                    got: v.shape,
                }
                .into());
            }
            if v.dtype != t.dtype {
                return Err(LayoutMismatch::DType {
                    tensor: t.name.to_string(),
                    rank: layout.rank,
                    expected: t.dtype,
                    got: v.dtype,
                }
                .into());
            }
        }
        if let Some(extra) = self.order.iter().find(|n| layout.tensor(n).is_none()) {
            return Err(LayoutMismatch::Extra {
                tensor: extra.to_string(),
                rank: layout.rank,
            }
            .into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{ShmTransport, TcpTransport};
    use awex_core::layout::{RankId, Side};
    use awex_core::plan::RankPlan;

    /// A device view at a made-up address: never dereferenced by the code under test.
    fn device_view(name: &str) -> TensorView {
        // SAFETY: the address is only stored; every test here checks that nothing reads it.
        unsafe {
            TensorView::new_cuda(
                name,
                0x7f00_0000_0000,
                64,
                DType::Bf16,
                Dims::new(&[4, 8]),
                1,
            )
        }
        .unwrap()
    }

    fn host_view(name: &str, buf: &mut [u8]) -> TensorView {
        // SAFETY: the buffers outlive the views in every test.
        unsafe { TensorView::new(name, buf.as_mut_ptr(), 64, DType::Bf16, Dims::new(&[4, 8])) }
            .unwrap()
    }

    fn empty_plan(side: Side) -> Arc<RankPlan> {
        Arc::new(RankPlan {
            side,
            rank: match side {
                Side::Training => RankId::train(0),
                Side::Inference => RankId::infer(0, 0),
            },
            peers: vec![],
            fingerprint: 0,
        })
    }

    #[test]
    fn device_view_keeps_its_address_and_refuses_host_reads() {
        let v = device_view("model.w");
        assert_eq!(v.location(), Location::Cuda(1));
        assert!(v.is_device());
        assert_eq!(v.device_ptr(), Some(0x7f00_0000_0000));
        assert_eq!(v.len(), 64);
        let want = "tensor: `model.w` lives in GPU 1 memory; this operation reads host memory only: copy the tensor to a host TensorSet first (TensorSet::download_to) or use the cuda-ipc transport";
        assert_eq!(v.try_bytes().unwrap_err().to_string(), want);
        // SAFETY: refused before any access.
        assert_eq!(unsafe { v.try_bytes_mut() }.unwrap_err().to_string(), want);
        let mut buf = vec![7u8; 64];
        let h = host_view("h", &mut buf);
        assert_eq!((h.location(), h.device_ptr()), (Location::Host, None));
        assert_eq!(h.try_bytes().unwrap(), &[7u8; 64][..]);
    }

    #[test]
    #[should_panic(
        expected = "`model.w` lives in GPU 1 memory; this operation reads host memory only"
    )]
    fn infallible_bytes_of_a_device_view_stop_instead_of_reading_device_memory() {
        let _ = device_view("model.w").bytes();
    }

    #[test]
    fn host_only_transports_and_fills_refuse_device_sets() {
        let set = || Arc::new(TensorSet::from_views(vec![device_view("model.w")]).unwrap());
        let e = ShmTransport::new(
            empty_plan(Side::Training),
            set(),
            1 << 20,
            "awex-test-x-ctl",
        )
        .err()
        .unwrap();
        assert_eq!(
            e.to_string(),
            "the shm transport reads and writes host memory, but `model.w` lives in GPU 1 memory; use the cuda-ipc transport for tensors in GPU memory"
        );
        let e = TcpTransport::new(
            empty_plan(Side::Inference),
            set(),
            1 << 20,
            "127.0.0.1:0",
            "127.0.0.1",
        )
        .err()
        .unwrap();
        assert_eq!(
            e.to_string(),
            "the tcp transport reads and writes host memory, but `model.w` lives in GPU 1 memory; use the cuda-ipc transport for tensors in GPU memory"
        );
        // filling weights goes through the same refusal
        let layout = RankLayout {
            rank: RankId::train(0),
            tensors: vec![awex_core::layout::LocalTensor {
                name: Arc::from("model.w"),
                shape: Dims::new(&[4, 8]),
                dtype: DType::Bf16,
                encoding: awex_core::encoding::Encoding::Plain(DType::Bf16),
                placements: vec![],
            }],
        };
        let cat = awex_core::model::Catalogue::of(
            &awex_core::model::ModelSpec::resolve("qwen3-tiny").unwrap(),
        );
        let e = crate::fill::fill_or_check(&layout, &cat, &set(), 1, false).unwrap_err();
        assert_eq!(
            e,
            "tensor: `model.w` lives in GPU 1 memory; this operation reads host memory only: copy the tensor to a host TensorSet first (TensorSet::download_to) or use the cuda-ipc transport"
        );
    }

    #[test]
    fn bucket_packing_refuses_device_views() {
        use crate::bucket::{hash_destination, make_buckets, pack};
        let t = awex_core::plan::Transfer {
            encode: None,
            src_rank: RankId::train(0),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: Arc::from("model.w"),
            src_shape: Dims::new(&[4, 8]),
            src_offset: Dims::new(&[0, 0]),
            src_dtype: DType::Bf16,
            dst_tensor: Arc::from("model.w"),
            dst_shape: Dims::new(&[4, 8]),
            dst_offset: Dims::new(&[0, 0]),
            dst_dtype: DType::Bf16,
            extent: Dims::new(&[4, 8]),
            transposed: false,
        };
        let set = TensorSet::from_views(vec![device_view("model.w")]).unwrap();
        let b = make_buckets(std::slice::from_ref(&t), 1 << 20);
        let mut out = vec![0u8; 64];
        let e = pack(&b[0], std::slice::from_ref(&t), &set, &mut out, None).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("tensor: `model.w` lives in GPU 1 memory"),
            "{e}"
        );
        let e = hash_destination(&b[0], std::slice::from_ref(&t), &set).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("tensor: `model.w` lives in GPU 1 memory"),
            "{e}"
        );
    }

    #[test]
    fn set_location_is_shared_by_all_views_or_an_error() {
        let mut buf = vec![0u8; 64];
        let mixed =
            TensorSet::from_views(vec![host_view("a", &mut buf), device_view("b")]).unwrap();
        assert_eq!(
            mixed.location().unwrap_err().to_string(),
            "tensor: `a` lives in host memory but `b` in GPU 1 memory; register every tensor of a rank in one place"
        );
        assert_eq!(
            TensorSet::from_views(vec![]).unwrap().location().unwrap(),
            Location::Host
        );
        let dev = TensorSet::from_views(vec![device_view("b")]).unwrap();
        assert_eq!(dev.location().unwrap(), Location::Cuda(1));
        assert!(mixed.require_host("x").is_err());
        assert!(
            TensorSet::from_views(vec![host_view("a", &mut buf)])
                .unwrap()
                .require_host("x")
                .is_ok()
        );
    }

    #[test]
    fn host_mirror_holds_the_same_tensors_zeroed_in_host_memory() {
        let set = TensorSet::from_views(vec![device_view("b"), device_view("a")]).unwrap();
        let m = set.host_mirror().unwrap();
        let names: Vec<&str> = m.iter().map(|v| &*v.name).collect();
        assert_eq!(names, ["b", "a"]);
        for v in m.iter() {
            assert_eq!(
                (v.location(), v.len(), v.dtype, v.shape),
                (Location::Host, 64, DType::Bf16, Dims::new(&[4, 8]))
            );
            assert_eq!(v.try_bytes().unwrap(), &[0u8; 64][..]);
        }
    }

    #[test]
    fn applying_a_staging_set_copies_every_byte_and_refuses_a_mismatched_one() {
        let layout = |rows: u64| RankLayout {
            rank: awex_core::layout::RankId::infer(0, 0),
            tensors: ["a", "b"]
                .iter()
                .map(|n| awex_core::layout::LocalTensor {
                    name: Arc::from(*n),
                    shape: Dims::new(&[rows, 8]),
                    dtype: DType::Bf16,
                    encoding: awex_core::encoding::Encoding::Plain(DType::Bf16),
                    placements: vec![],
                })
                .collect(),
        };
        let live = TensorSet::allocate_host(&layout(3)).unwrap();
        let staging = live.staging_like().unwrap();
        for (i, v) in staging.iter().enumerate() {
            // SAFETY: a fresh set of this test's own.
            let b = unsafe { v.try_bytes_mut() }.unwrap();
            for (j, x) in b.iter_mut().enumerate() {
                *x = (i * 100 + j) as u8;
            }
        }
        assert_eq!(live.copy_from(&staging).unwrap(), 2 * 48);
        for v in live.iter() {
            assert_eq!(
                v.bytes(),
                staging.get(&v.name).unwrap().bytes(),
                "{}",
                v.name
            );
        }
        let other = TensorSet::allocate_host(&layout(4)).unwrap();
        assert_eq!(
            live.copy_from(&other).unwrap_err().to_string(),
            "tensor: `a` holds 48 bytes in host memory but its staging copy 64 bytes in host memory"
        );
        let half = TensorSet::from_views(vec![]).unwrap();
        assert_eq!(
            live.copy_from(&half).unwrap_err().to_string(),
            "tensor: the host staging set has no tensor `a`"
        );
    }

    #[test]
    fn staging_copies_need_a_device_set_and_a_matching_host_set() {
        let mut buf = vec![0u8; 64];
        let host = TensorSet::from_views(vec![host_view("a", &mut buf)]).unwrap();
        assert_eq!(
            host.upload_from(&host).unwrap_err().to_string(),
            "tensor: `a` lives in host memory; only tensors in GPU memory are staged through the host"
        );
        let dev = TensorSet::from_views(vec![device_view("b")]).unwrap();
        assert_eq!(
            dev.download_to(&host).unwrap_err().to_string(),
            "tensor: the host staging set has no tensor `b`"
        );
        assert_eq!(
            dev.upload_from(&dev).unwrap_err().to_string(),
            "tensor: the staging copy of `b` lives in GPU 1 memory; it must be host memory (TensorSet::host_mirror)"
        );
        assert_eq!(
            host.cuda_device().unwrap_err().to_string(),
            "these tensors live in host memory, not on a GPU; allocate them with TensorSet::allocate_cuda or register device views (TensorView::new_cuda)"
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn device_sets_without_the_cuda_feature_say_the_build_lacks_cuda() {
        let dev = TensorSet::from_views(vec![device_view("b")]).unwrap();
        let host = dev.host_mirror().unwrap();
        let msg = "awex was built without CUDA; rebuild with `--features cuda`";
        assert_eq!(dev.cuda_device().unwrap_err().to_string(), msg);
        assert_eq!(dev.download_to(&host).unwrap_err().to_string(), msg);
        assert_eq!(dev.upload_from(&host).unwrap_err().to_string(), msg);
    }
}
