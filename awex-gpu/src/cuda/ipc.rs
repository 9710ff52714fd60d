//! Sharing weight memory between processes: one IPC handle per allocation, opened once.
//!
//! The training side exports the allocations behind its tensors ([`IpcExport`]): each tensor
//! pointer is resolved to its allocation's base (`cuMemGetAddressRange`), so a contiguous
//! parameter buffer holding every tensor is one handle, and a caching allocator's blocks are a
//! handle each, whatever the number of tensors. Handles are cached: exporting more pointers
//! later only adds the new allocations. The inference side opens each handle once
//! ([`IpcImport`]), addresses tensors as (allocation, offset), and closes them on drop.

use super::device::Device;
use super::handle::IpcMemHandle;
use super::{CudaError, sys};
use serde::{Deserialize, Serialize};

/// One allocation shared by the training side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedAllocation {
    /// The driver's IPC handle.
    pub handle: IpcMemHandle,
    /// Size of the allocation in bytes.
    pub size: u64,
}

/// A byte inside an exported allocation: how the other process names a training pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteAddr {
    /// Index into the export's allocations.
    pub allocation: u32,
    /// Byte offset from the allocation's base.
    pub offset: u64,
}

/// Allocations found behind a set of pointers: bases, sizes, and where each pointer falls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocationIndex {
    /// (base, size) of every allocation, in order of first appearance.
    pub allocations: Vec<(u64, u64)>,
}

impl AllocationIndex {
    /// Adds the allocations behind `ptrs`, asking `range_of` only for pointers that no known
    /// allocation contains; returns the indices of the allocations that are new.
    pub fn add(
        &mut self,
        ptrs: &[u64],
        mut range_of: impl FnMut(u64) -> Result<(u64, u64), CudaError>,
    ) -> Result<Vec<usize>, CudaError> {
        let mut new = Vec::new();
        for &p in ptrs {
            if self.find(p).is_some() {
                continue;
            }
            let (base, size) = range_of(p)?;
            if p < base || p >= base + size.max(1) {
                return Err(CudaError::UnknownPointer { ptr: p });
            }
            new.push(self.allocations.len());
            self.allocations.push((base, size));
        }
        Ok(new)
    }

    /// The allocation containing `ptr`, as an address the other process understands.
    pub fn find(&self, ptr: u64) -> Option<RemoteAddr> {
        self.allocations
            .iter()
            .position(|&(b, s)| ptr >= b && ptr < b + s.max(1))
            .map(|i| RemoteAddr {
                allocation: i as u32,
                offset: ptr - self.allocations[i].0,
            })
    }
}

/// The training side's shared memory: one handle per allocation behind its tensors.
pub struct IpcExport {
    dev: Device,
    index: AllocationIndex,
    allocations: Vec<ExportedAllocation>,
}

impl IpcExport {
    /// Exports the allocations behind `ptrs` (device pointers of the training tensors).
    pub fn new(dev: &Device, ptrs: &[u64]) -> Result<IpcExport, CudaError> {
        let mut e = IpcExport {
            dev: dev.clone(),
            index: AllocationIndex::default(),
            allocations: Vec::new(),
        };
        e.extend(ptrs)?;
        Ok(e)
    }

    /// Adds pointers; only allocations not exported before get a handle.
    pub fn extend(&mut self, ptrs: &[u64]) -> Result<(), CudaError> {
        self.dev.bind()?;
        let new = self.index.add(ptrs, sys::address_range)?;
        for i in new {
            let (base, size) = self.index.allocations[i];
            let handle = sys::ipc_mem_handle(base).map_err(|e| CudaError::Export {
                base,
                size,
                detail: e.to_string(),
            })?;
            self.allocations.push(ExportedAllocation { handle, size });
        }
        Ok(())
    }

    /// The exported allocations, in the order [`RemoteAddr::allocation`] counts them.
    pub fn allocations(&self) -> &[ExportedAllocation] {
        &self.allocations
    }

    /// Where `ptr` lies in the export.
    pub fn locate(&self, ptr: u64) -> Result<RemoteAddr, CudaError> {
        self.index
            .find(ptr)
            .ok_or(CudaError::UnknownPointer { ptr })
    }
}

/// What one opening thread returns: the mappings it opened, and the error it stopped at.
type OpenedPart = (Vec<(u64, u64)>, Option<CudaError>);

/// The inference side's view of the training side's allocations, mapped into its own context.
pub struct IpcImport {
    dev: Device,
    mapped: Vec<(u64, u64)>,
}

impl IpcImport {
    /// Opens every allocation once (with peer access when the exporter is another GPU).
    pub fn open(dev: &Device, allocations: &[ExportedAllocation]) -> Result<IpcImport, CudaError> {
        IpcImport::open_with(dev, allocations, 1)
    }

    /// [`IpcImport::open`] with the handles opened by up to `threads` threads at once (each
    /// opening a contiguous share, in order), for exporters with many allocations.
    pub fn open_with(
        dev: &Device,
        allocations: &[ExportedAllocation],
        threads: usize,
    ) -> Result<IpcImport, CudaError> {
        dev.bind()?;
        let threads = threads.clamp(1, allocations.len().max(1));
        let mut imp = IpcImport {
            dev: dev.clone(),
            mapped: Vec::with_capacity(allocations.len()),
        };
        if threads == 1 {
            for a in allocations {
                // on error, the handles opened so far are closed by Drop
                let p = sys::ipc_open_mem(&a.handle)?;
                imp.mapped.push((p, a.size));
            }
            return Ok(imp);
        }
        let share = allocations.len().div_ceil(threads);
        let parts: Vec<OpenedPart> = std::thread::scope(|s| {
            let hs: Vec<_> = allocations
                .chunks(share)
                .map(|part| {
                    s.spawn(move || {
                        let mut got = Vec::with_capacity(part.len());
                        if let Err(e) = dev.bind() {
                            return (got, Some(e));
                        }
                        for a in part {
                            match sys::ipc_open_mem(&a.handle) {
                                Ok(p) => got.push((p, a.size)),
                                Err(e) => return (got, Some(e)),
                            }
                        }
                        (got, None)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        (
                            Vec::new(),
                            Some(CudaError::Driver {
                                call: "cuIpcOpenMemHandle",
                                code: 0,
                                name: "awex".into(),
                                message: "a thread opening IPC handles panicked".into(),
                            }),
                        )
                    })
                })
                .collect()
        });
        let mut first_err = None;
        for (got, err) in parts {
            // every opened mapping goes into `imp`, so that Drop closes it on error too
            imp.mapped.extend(got);
            if first_err.is_none() {
                first_err = err;
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(imp),
        }
    }

    /// The index of the mapped allocation that holds the local address range `ptr..ptr + len`
    /// whole, if one does.
    pub fn allocation_of(&self, ptr: u64, len: u64) -> Option<usize> {
        let end = ptr.checked_add(len)?;
        self.mapped
            .iter()
            .position(|&(base, size)| ptr >= base && end <= base + size)
    }

    /// The local base address and size of mapped allocation `i`.
    pub fn mapping(&self, i: usize) -> Option<(u64, u64)> {
        self.mapped.get(i).copied()
    }

    /// The local base address and size of the largest mapped allocation, if any.
    pub fn largest(&self) -> Option<(u64, u64)> {
        self.mapped.iter().copied().max_by_key(|&(_, size)| size)
    }

    /// Number of mapped allocations.
    pub fn len(&self) -> usize {
        self.mapped.len()
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.mapped.is_empty()
    }

    /// The local address of `len` bytes at `at`, checked against the allocation's size.
    pub fn ptr(&self, at: RemoteAddr, len: u64) -> Result<u64, CudaError> {
        let &(base, size) =
            self.mapped
                .get(at.allocation as usize)
                .ok_or(CudaError::NoSuchAllocation {
                    index: at.allocation as usize,
                    count: self.mapped.len(),
                })?;
        if at.offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(CudaError::OutOfRange {
                what: "the exported allocation",
                offset: at.offset,
                len,
                size,
            });
        }
        Ok(base + at.offset)
    }
}

impl Drop for IpcImport {
    fn drop(&mut self) {
        if self.dev.bind().is_err() {
            return;
        }
        for &(p, _) in &self.mapped {
            let _ = sys::ipc_close_mem(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three fake allocations: [0x1000, +0x100), [0x2000, +0x10), [0x3000, +0x400).
    fn fake(p: u64) -> Result<(u64, u64), CudaError> {
        [(0x1000, 0x100), (0x2000, 0x10), (0x3000, 0x400)]
            .into_iter()
            .find(|&(b, s)| p >= b && p < b + s)
            .ok_or(CudaError::UnknownPointer { ptr: p })
    }

    #[test]
    fn tensors_of_one_allocation_share_one_entry() {
        let mut idx = AllocationIndex::default();
        let new = idx
            .add(&[0x1000, 0x1040, 0x3100, 0x10ff, 0x3000], fake)
            .unwrap();
        assert_eq!(new, vec![0, 1]);
        assert_eq!(idx.allocations, vec![(0x1000, 0x100), (0x3000, 0x400)]);
        assert_eq!(
            idx.find(0x3100),
            Some(RemoteAddr {
                allocation: 1,
                offset: 0x100
            })
        );
        assert_eq!(idx.find(0x1100), None);
    }

    #[test]
    fn extending_an_index_asks_only_about_new_allocations() {
        let mut idx = AllocationIndex::default();
        idx.add(&[0x1000], fake).unwrap();
        let mut asked = vec![];
        let new = idx
            .add(&[0x1010, 0x2008, 0x2000], |p| {
                asked.push(p);
                fake(p)
            })
            .unwrap();
        assert_eq!(asked, vec![0x2008]);
        assert_eq!(new, vec![1]);
        assert_eq!(idx.allocations[1], (0x2000, 0x10));
    }

    #[test]
    fn pointer_in_no_allocation_is_named() {
        let mut idx = AllocationIndex::default();
        let e = idx.add(&[0x5000], fake).unwrap_err();
        assert_eq!(
            e.to_string(),
            "device pointer 0x5000 lies in no exported allocation"
        );
    }
}
