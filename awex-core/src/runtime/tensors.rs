//! Tensors the runtime reads and writes in place: memory it does not own (pointer, length, dtype, shape).

use super::RuntimeError;
use super::shm::ShmSegment;
use crate::dtype::DType;
use crate::layout::{Dims, RankLayout};
use std::collections::HashMap;
use std::sync::Arc;

/// A view of one local tensor's memory (row-major, contiguous), owned by someone else.
#[derive(Clone, Debug)]
pub struct TensorView {
    /// Engine-native name.
    pub name: Arc<str>,
    ptr: *mut u8,
    len: usize,
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
            return Err(RuntimeError::Tensor(format!(
                "`{name}`: {len} bytes given but shape {shape} of {dtype} needs {want}"
            )));
        }
        if ptr.is_null() && len > 0 {
            return Err(RuntimeError::Tensor(format!("`{name}`: null data pointer")));
        }
        Ok(TensorView {
            name: Arc::from(name),
            ptr,
            len,
            dtype,
            shape,
        })
    }

    /// Start address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
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
    pub fn bytes(&self) -> &[u8] {
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
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
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
                return Err(RuntimeError::Tensor(format!(
                    "`{}` is registered twice",
                    v.name
                )));
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
        let mut bufs = Vec::new();
        let mut views = Vec::new();
        for t in &layout.tensors {
            let len = t.nbytes() as usize;
            let mut b = vec![0u64; len.div_ceil(8)];
            // touch every page now, so the first update does not pay for page faults
            for w in b.iter_mut().step_by(512) {
                // SAFETY: a valid, aligned element of the vector.
                unsafe { std::ptr::write_volatile(w, 0) };
            }
            let ptr = b.as_mut_ptr() as *mut u8;
            // SAFETY: the buffer lives in `bufs`, owned by the set, and never moves (Vec of Vec).
            views.push(unsafe { TensorView::new(&t.name, ptr, len, t.dtype, t.shape)? });
            bufs.push(b);
        }
        let mut set = Self::from_views(views)?;
        set.backing = Some(Backing::Host(bufs));
        Ok(set)
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
                RuntimeError::Layout(format!(
                    "rank {} must register `{}` (shape {}, {}), but it was not registered",
                    layout.rank, t.name, t.shape, t.dtype
                ))
            })?;
            if v.shape != t.shape {
                return Err(RuntimeError::Layout(format!(
                    "`{}` has shape {} but rank {}'s layout needs {}",
                    t.name, v.shape, layout.rank, t.shape
                )));
            }
            if v.dtype != t.dtype {
                return Err(RuntimeError::Layout(format!(
                    "`{}` is {} but rank {}'s layout needs {}",
                    t.name, v.dtype, layout.rank, t.dtype
                )));
            }
        }
        if let Some(extra) = self.order.iter().find(|n| layout.tensor(n).is_none()) {
            return Err(RuntimeError::Layout(format!(
                "`{extra}` is not a tensor of rank {}'s layout",
                layout.rank
            )));
        }
        Ok(())
    }
}
