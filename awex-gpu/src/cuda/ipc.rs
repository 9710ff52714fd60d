//! Sharing weight memory between processes: one IPC handle per allocation, opened once.
//!
//! The training side exports the allocations behind its tensors ([`IpcExport`]): each tensor
//! pointer is resolved to its allocation's base (`cuMemGetAddressRange`), so a contiguous
//! parameter buffer holding every tensor is one handle, and a caching allocator's blocks are a
//! handle each, whatever the number of tensors. Handles are cached: exporting more pointers
//! later only adds the new allocations. The inference side opens each handle once
//! ([`IpcImport`]), addresses tensors as (allocation, offset), and closes them on drop.
//!
//! Memory mapped with `cuMemMap` (virtual memory management: PyTorch's expandable segments,
//! whose physical chunks of 2 or 20 MiB are mapped back to back) has no legacy IPC handle. A
//! tensor there is shared as a *span*: the chunks it lies over, in address order, each exported
//! as a POSIX file descriptor that stays open in the exporting process. The importer takes those
//! descriptors with `pidfd_getfd` (or, where the kernel refuses that, from the exporter's
//! socket: [`super::fdpass`]), imports each chunk, and maps them back to back into one reserved
//! address range of its own, so the span is addressed as one allocation.

use super::device::Device;
use super::fdpass::{FdServer, fetch_fds};
use super::handle::IpcMemHandle;
use super::{CudaError, sys};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

/// One allocation shared by the training side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedAllocation {
    /// The driver's IPC handle (all zero for a span of `cuMemMap` chunks).
    pub handle: IpcMemHandle,
    /// Size of the allocation (or span) in bytes.
    pub size: u64,
    /// For memory mapped with `cuMemMap`: the chunks of the span and where to take them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<SharedChunks>,
}

/// A span of `cuMemMap` chunks: the exporting process and its descriptor of each chunk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedChunks {
    /// The exporting process (whose file descriptors these are).
    pub pid: u32,
    /// The chunks in address order.
    pub chunks: Vec<SharedChunk>,
}

/// One physical chunk of a span.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedChunk {
    /// Byte offset from the span's first address.
    pub offset: u64,
    /// Size in bytes (the whole physical allocation).
    pub size: u64,
    /// The exporting process's POSIX file descriptor for it.
    pub fd: i32,
}

impl SharedChunks {
    /// Checks the list against the span's size: chunks in order, none empty, none overlapping
    /// the next or passing the end.
    pub fn check(&self, size: u64) -> Result<(), CudaError> {
        let bad = |why: String| CudaError::BadChunks { size, why };
        if self.chunks.is_empty() {
            return Err(bad("no chunks".into()));
        }
        let mut end = 0u64;
        for (i, c) in self.chunks.iter().enumerate() {
            if c.size == 0 || c.fd < 0 {
                return Err(bad(format!("chunk {i}: size {}, fd {}", c.size, c.fd)));
            }
            if c.offset < end {
                return Err(bad(format!(
                    "chunk {i} at {} overlaps the one before",
                    c.offset
                )));
            }
            end = c
                .offset
                .checked_add(c.size)
                .filter(|&e| e <= size)
                .ok_or_else(|| {
                    bad(format!(
                        "chunk {i} ({} + {}) passes the end",
                        c.offset, c.size
                    ))
                })?;
        }
        Ok(())
    }
}

/// The mappings behind `ptr..ptr + len`, walked with `range_of` (the driver's address range of
/// the mapping at an address): (base, size) of each, back to back, the first holding `ptr`.
pub fn span_of(
    ptr: u64,
    len: u64,
    mut range_of: impl FnMut(u64) -> Result<(u64, u64), CudaError>,
) -> Result<Vec<(u64, u64)>, CudaError> {
    let end = ptr
        .checked_add(len.max(1))
        .ok_or(CudaError::UnknownPointer { ptr })?;
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut at = ptr;
    while at < end {
        let (base, size) = range_of(at).map_err(|_| match out.last() {
            Some(_) => CudaError::NotContiguous { ptr, len, hole: at },
            None => CudaError::UnknownPointer { ptr },
        })?;
        if size == 0
            || at < base
            || at >= base + size
            || out.last().is_some_and(|&(b, s)| b + s != base)
        {
            return Err(CudaError::NotContiguous { ptr, len, hole: at });
        }
        out.push((base, size));
        at = base + size;
    }
    Ok(out)
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
    /// The first allocation holding `ptr..ptr + len` whole.
    pub fn find_range(&self, ptr: u64, len: u64) -> Option<RemoteAddr> {
        let end = ptr.checked_add(len)?;
        self.allocations
            .iter()
            .position(|&(b, s)| ptr >= b && end <= b + s)
            .map(|i| RemoteAddr {
                allocation: i as u32,
                offset: ptr - self.allocations[i].0,
            })
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

/// The spans of `cuMemMap` chunks behind `ranges` ((pointer, bytes), any order): one per run of
/// ranges that overlap or lie in chunks that follow each other, in address order, each its
/// chunks' (base, size) back to back ([`span_of`]).
pub fn spans_of(
    mut ranges: Vec<(u64, u64)>,
    mut range_of: impl FnMut(u64) -> Result<(u64, u64), CudaError>,
) -> Result<Vec<Vec<(u64, u64)>>, CudaError> {
    ranges.sort_unstable();
    let mut spans: Vec<Vec<(u64, u64)>> = Vec::new();
    for (p, len) in ranges {
        let len = len.max(1);
        let end = p
            .checked_add(len)
            .ok_or(CudaError::UnknownPointer { ptr: p })?;
        if let Some(last) = spans.last_mut()
            && let Some(&(b, s)) = last.last()
            && (p <= b + s || range_of(p).is_ok_and(|(base, _)| base == b + s))
        {
            if end > b + s {
                last.extend(span_of(b + s, end - (b + s), &mut range_of)?);
            }
            continue;
        }
        spans.push(span_of(p, len, &mut range_of)?);
    }
    Ok(spans)
}

/// The training side's shared memory: one handle per allocation behind its tensors.
pub struct IpcExport {
    dev: Device,
    index: AllocationIndex,
    allocations: Vec<ExportedAllocation>,
    /// Open descriptors of `cuMemMap` chunks, closed on drop.
    fds: Vec<i32>,
    /// Serves `fds` to receivers that `pidfd_getfd` refuses ([`IpcExport::serve_fds`]).
    server: Option<FdServer>,
}

impl IpcExport {
    /// Exports the allocations behind `ptrs` (device pointers of the training tensors).
    pub fn new(dev: &Device, ptrs: &[u64]) -> Result<IpcExport, CudaError> {
        let ranges: Vec<(u64, u64)> = ptrs.iter().map(|&p| (p, 1)).collect();
        IpcExport::of_ranges(dev, &ranges)
    }

    /// Exports the memory behind `ranges` ((device pointer, bytes) of the training tensors);
    /// a tensor over `cuMemMap` chunks is shared as the span of chunks it covers.
    pub fn of_ranges(dev: &Device, ranges: &[(u64, u64)]) -> Result<IpcExport, CudaError> {
        let mut e = IpcExport {
            dev: dev.clone(),
            index: AllocationIndex::default(),
            allocations: Vec::new(),
            fds: Vec::new(),
            server: None,
        };
        e.extend_ranges(ranges)?;
        Ok(e)
    }

    /// Adds pointers; only allocations not exported before get a handle.
    pub fn extend(&mut self, ptrs: &[u64]) -> Result<(), CudaError> {
        let ranges: Vec<(u64, u64)> = ptrs.iter().map(|&p| (p, 1)).collect();
        self.extend_ranges(&ranges)
    }

    /// Adds (pointer, bytes) ranges; only memory not exported before is. Ranges over
    /// `cuMemMap` chunks that overlap or follow each other chunk to chunk become one span.
    pub fn extend_ranges(&mut self, ranges: &[(u64, u64)]) -> Result<(), CudaError> {
        self.dev.bind()?;
        let mut vmm: Vec<(u64, u64)> = Vec::new();
        for &(p, len) in ranges {
            let len = len.max(1);
            if self.index.find_range(p, len).is_some() {
                continue;
            }
            if let Some(at) = self.index.find(p)
                && self.allocations[at.allocation as usize].chunks.is_none()
            {
                continue; // inside a cuMemAlloc allocation: its copies are checked against it
            }
            let (base, size) = sys::address_range(p)?;
            if p < base || p >= base + size.max(1) {
                return Err(CudaError::UnknownPointer { ptr: p });
            }
            let legacy = match sys::ipc_mem_handle(base) {
                Ok(handle) => {
                    self.index.allocations.push((base, size));
                    self.allocations.push(ExportedAllocation {
                        handle,
                        size,
                        chunks: None,
                    });
                    continue;
                }
                Err(e) => e,
            };
            match sys::vmm_retain(p) {
                Ok(h) => {
                    let _ = sys::vmm_release(h);
                }
                Err(_) => {
                    return Err(CudaError::Export {
                        base,
                        size,
                        detail: legacy.to_string(),
                    });
                }
            }
            vmm.push((p, len));
        }
        for span in spans_of(vmm, sys::address_range)? {
            self.export_span(&span)?;
        }
        Ok(())
    }

    /// Exports back-to-back `cuMemMap` chunks ((base, size) each) as one span.
    fn export_span(&mut self, span: &[(u64, u64)]) -> Result<(), CudaError> {
        let first = span[0].0;
        let (last, last_size) = span[span.len() - 1];
        raise_fd_limit();
        let mut chunks = Vec::with_capacity(span.len());
        for &(base, size) in span {
            let fd = sys::vmm_retain(base).and_then(|h| {
                let fd = sys::vmm_export_fd(h);
                let _ = sys::vmm_release(h);
                fd
            });
            let fd = fd.map_err(|e| CudaError::ExportFd {
                base,
                size,
                detail: e.to_string(),
            })?;
            self.fds.push(fd);
            chunks.push(SharedChunk {
                offset: base - first,
                size,
                fd,
            });
        }
        let size = last + last_size - first;
        self.index.allocations.push((first, size));
        self.allocations.push(ExportedAllocation {
            handle: IpcMemHandle([0; super::handle::HANDLE_BYTES]),
            size,
            chunks: Some(SharedChunks {
                pid: std::process::id(),
                chunks,
            }),
        });
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

    /// Serves the descriptors of the exported spans on a Unix socket at `path`, for receivers
    /// the kernel does not let take them with `pidfd_getfd`; returns the path, or `None` when
    /// nothing is mapped with `cuMemMap` (then no socket is made).
    pub fn serve_fds(&mut self, path: &Path) -> Result<Option<PathBuf>, CudaError> {
        if self.fds.is_empty() {
            return Ok(None);
        }
        self.server = None;
        self.server = Some(FdServer::start(path, self.fds.clone())?);
        Ok(Some(path.to_path_buf()))
    }

    /// Where `ptr..ptr + len` lies in the export: the first allocation or span holding it
    /// whole, else the allocation holding `ptr` (the copies are checked against its size).
    pub fn locate_range(&self, ptr: u64, len: u64) -> Result<RemoteAddr, CudaError> {
        self.index
            .find_range(ptr, len.max(1))
            .or_else(|| self.index.find(ptr))
            .ok_or(CudaError::UnknownPointer { ptr })
    }
}

impl Drop for IpcExport {
    fn drop(&mut self) {
        self.server = None; // no peer is handed a descriptor closed below
        for &fd in &self.fds {
            // SAFETY: these descriptors were returned by the driver to this export, which owns them.
            unsafe { libc::close(fd) };
        }
    }
}

/// A span exports one descriptor per chunk (about 800 for 16 GB in 20 MiB chunks), which the
/// default soft limit of 1024 open files would soon stop: raise it to the hard limit, once.
fn raise_fd_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain syscalls on a local struct.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
                r.rlim_cur = r.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &r);
            }
        }
    });
}

/// Takes descriptor `fd` of process `pid` (`pidfd_getfd`): a new descriptor of this process.
fn take_fd(pidfd: i32, pid: u32, fd: i32) -> Result<i32, CudaError> {
    // SAFETY: a syscall with plain integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) };
    if r < 0 {
        return Err(CudaError::FetchFd {
            pid,
            fd,
            detail: std::io::Error::last_os_error().to_string(),
        });
    }
    Ok(r as i32)
}

/// A pidfd of process `pid` (closed by the caller).
fn pidfd_of(pid: u32, fd: i32) -> Result<i32, CudaError> {
    // SAFETY: a syscall with plain integer arguments.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(CudaError::FetchFd {
            pid,
            fd,
            detail: format!("pidfd_open: {}", std::io::Error::last_os_error()),
        });
    }
    Ok(pidfd as i32)
}

/// Whether this process may take descriptor `fd` of `pid` with `pidfd_getfd`.
fn can_take(pid: u32, fd: i32) -> Result<(), CudaError> {
    let pidfd = pidfd_of(pid, fd)?;
    let r = take_fd(pidfd, pid, fd);
    // SAFETY: our own descriptors.
    unsafe {
        libc::close(pidfd);
        if let Ok(t) = r {
            libc::close(t);
        }
    }
    r.map(|_| ())
}

/// Maps a span of another process's `cuMemMap` chunks back to back into addresses reserved
/// here, readable and writable by device `ordinal`; returns the first address. The chunks'
/// descriptors come from `fds` (the exporter's socket) when given, else by `pidfd_getfd`.
fn open_span(
    size: u64,
    shared: &SharedChunks,
    ordinal: u32,
    fds: Option<&HashMap<RawFd, OwnedFd>>,
) -> Result<u64, CudaError> {
    shared.check(size)?;
    let pidfd = match fds {
        Some(_) => -1,
        None => pidfd_of(shared.pid, shared.chunks[0].fd)?,
    };
    let va = match sys::vmm_reserve(size) {
        Ok(va) => va,
        Err(e) => {
            // SAFETY: our own descriptor.
            unsafe { libc::close(pidfd) };
            return Err(e);
        }
    };
    let mut mapped: Vec<&SharedChunk> = Vec::with_capacity(shared.chunks.len());
    let mut result = Ok(());
    for c in &shared.chunks {
        let imported = match fds {
            Some(map) => match map.get(&c.fd) {
                Some(f) => sys::vmm_import_fd(f.as_raw_fd()),
                None => Err(CudaError::FetchFd {
                    pid: shared.pid,
                    fd: c.fd,
                    detail: "the exporter's socket did not hand it over".into(),
                }),
            },
            None => take_fd(pidfd, shared.pid, c.fd).and_then(|fd| {
                let h = sys::vmm_import_fd(fd);
                // SAFETY: the descriptor was just taken by this process; the import holds the
                // memory.
                unsafe { libc::close(fd) };
                h
            }),
        };
        let step = imported.and_then(|h| {
            let m = sys::vmm_map(va + c.offset, c.size, h);
            let _ = sys::vmm_release(h); // the mapping keeps the memory
            m
        });
        if let Err(e) = step {
            result = Err(e);
            break;
        }
        mapped.push(c);
        if let Err(e) = sys::vmm_set_access(va + c.offset, c.size, ordinal) {
            result = Err(e);
            break;
        }
    }
    if pidfd >= 0 {
        // SAFETY: our own descriptor.
        unsafe { libc::close(pidfd) };
    }
    match result {
        Ok(()) => Ok(va),
        Err(e) => {
            for c in mapped {
                let _ = sys::vmm_unmap(va + c.offset, c.size);
            }
            let _ = sys::vmm_free(va, size);
            Err(e)
        }
    }
}

/// One mapped allocation of an import: local base, size, and for a span its chunks.
#[derive(Clone, Debug)]
struct Mapped {
    base: u64,
    size: u64,
    chunks: Option<Vec<(u64, u64)>>,
}

impl Mapped {
    fn open(
        a: &ExportedAllocation,
        ordinal: u32,
        fds: Option<&HashMap<RawFd, OwnedFd>>,
    ) -> Result<Mapped, CudaError> {
        match &a.chunks {
            None => Ok(Mapped {
                base: sys::ipc_open_mem(&a.handle)?,
                size: a.size,
                chunks: None,
            }),
            Some(shared) => Ok(Mapped {
                base: open_span(a.size, shared, ordinal, fds)?,
                size: a.size,
                chunks: Some(shared.chunks.iter().map(|c| (c.offset, c.size)).collect()),
            }),
        }
    }

    fn close(&self) {
        match &self.chunks {
            None => {
                let _ = sys::ipc_close_mem(self.base);
            }
            Some(chunks) => {
                for &(off, size) in chunks {
                    let _ = sys::vmm_unmap(self.base + off, size);
                }
                let _ = sys::vmm_free(self.base, self.size);
            }
        }
    }
}

/// What one opening thread returns: the mappings it opened, and the error it stopped at.
type OpenedPart = (Vec<Mapped>, Option<CudaError>);

/// The inference side's view of the training side's allocations, mapped into its own context.
pub struct IpcImport {
    dev: Device,
    mapped: Vec<Mapped>,
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
        IpcImport::open_from(dev, allocations, threads, None)
    }

    /// [`IpcImport::open_with`], taking the descriptors of spans of `cuMemMap` chunks from the
    /// exporter's socket `fd_socket` ([`IpcExport::serve_fds`]) where the kernel refuses
    /// `pidfd_getfd`.
    pub fn open_from(
        dev: &Device,
        allocations: &[ExportedAllocation],
        threads: usize,
        fd_socket: Option<&Path>,
    ) -> Result<IpcImport, CudaError> {
        dev.bind()?;
        let ordinal = dev.ordinal();
        let chunks: usize = allocations
            .iter()
            .filter_map(|a| a.chunks.as_ref())
            .map(|c| c.chunks.len())
            .sum();
        let first = allocations
            .iter()
            .find_map(|a| a.chunks.as_ref())
            .and_then(|c| c.chunks.first().map(|ch| (c.pid, ch.fd)));
        let taken = match (first, fd_socket) {
            // `pidfd_getfd` first (no round trip); the socket where the kernel refuses it
            (Some((pid, fd)), Some(path)) if can_take(pid, fd).is_err() => {
                raise_fd_limit();
                Some(fetch_fds(path, chunks)?)
            }
            _ => None,
        };
        let taken = taken.as_ref();
        let threads = threads.clamp(1, allocations.len().max(1));
        let mut imp = IpcImport {
            dev: dev.clone(),
            mapped: Vec::with_capacity(allocations.len()),
        };
        if threads == 1 {
            for a in allocations {
                // on error, the handles opened so far are closed by Drop
                imp.mapped.push(Mapped::open(a, ordinal, taken)?);
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
                            match Mapped::open(a, ordinal, taken) {
                                Ok(m) => got.push(m),
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
            .position(|m| ptr >= m.base && end <= m.base + m.size)
    }

    /// The local base address and size of mapped allocation `i`.
    pub fn mapping(&self, i: usize) -> Option<(u64, u64)> {
        self.mapped.get(i).map(|m| (m.base, m.size))
    }

    /// The local base address and size of the largest mapped allocation, if any.
    pub fn largest(&self) -> Option<(u64, u64)> {
        self.mapped
            .iter()
            .map(|m| (m.base, m.size))
            .max_by_key(|&(_, size)| size)
    }

    /// The local base address and size of the largest allocation opened through a legacy IPC
    /// handle (spans of `cuMemMap` chunks left out), if any.
    pub fn largest_ipc_mapping(&self) -> Option<(u64, u64)> {
        self.mapped
            .iter()
            .filter(|m| m.chunks.is_none())
            .map(|m| (m.base, m.size))
            .max_by_key(|&(_, size)| size)
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
        let (base, size) =
            self.mapping(at.allocation as usize)
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
        for m in &self.mapped {
            m.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pointer_is_found_in_the_allocation_that_holds_it() {
        let idx = AllocationIndex {
            allocations: vec![(0x1000, 0x100), (0x3000, 0x400)],
        };
        assert_eq!(
            idx.find(0x3100),
            Some(RemoteAddr {
                allocation: 1,
                offset: 0x100
            })
        );
        assert_eq!(idx.find(0x10ff).map(|a| a.allocation), Some(0));
        assert_eq!(idx.find(0x1100), None);
    }

    /// Chunks of 0x100 bytes at 0x10000.. 0x10400, then a hole, then one at 0x10500.
    fn chunked(p: u64) -> Result<(u64, u64), CudaError> {
        match p {
            0x10000..0x10400 => Ok((p & !0xff, 0x100)),
            0x10500..0x10600 => Ok((0x10500, 0x100)),
            _ => Err(CudaError::UnknownPointer { ptr: p }),
        }
    }

    #[test]
    fn a_span_is_the_chunks_a_tensor_lies_over_and_a_hole_is_named() {
        assert_eq!(
            span_of(0x10010, 0x10, chunked).unwrap(),
            vec![(0x10000, 0x100)]
        );
        assert_eq!(
            span_of(0x100f0, 0x111, chunked).unwrap(),
            vec![(0x10000, 0x100), (0x10100, 0x100), (0x10200, 0x100)]
        );
        // ends exactly at a chunk's end: that chunk is the last
        assert_eq!(span_of(0x10100, 0x200, chunked).unwrap().len(), 2);
        let e = span_of(0x10300, 0x201, chunked).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the training tensor at 0x10300 (513 bytes) lies over cuMemMap mappings that are not contiguous (a hole at 0x10400)"
        );
        assert_eq!(
            span_of(0x20000, 4, chunked).unwrap_err().to_string(),
            "device pointer 0x20000 lies in no exported allocation"
        );
    }

    #[test]
    fn tensors_over_back_to_back_chunks_share_one_span() {
        // four tensors over chunks 0x10000..0x10400, out of order (the third starts inside the
        // chunk after the span so far, the fourth in the one after that); one after the hole
        let spans = spans_of(
            vec![
                (0x10180, 0x100),
                (0x10000, 0x80),
                (0x10080, 0x80),
                (0x10300, 0x20),
                (0x10510, 8),
            ],
            chunked,
        )
        .unwrap();
        assert_eq!(
            spans,
            vec![
                vec![
                    (0x10000, 0x100),
                    (0x10100, 0x100),
                    (0x10200, 0x100),
                    (0x10300, 0x100)
                ],
                vec![(0x10500, 0x100)],
            ]
        );
        // a tensor starting right at a span's end continues it
        let spans = spans_of(vec![(0x10000, 0x100), (0x10100, 0x10)], chunked).unwrap();
        assert_eq!(spans, vec![vec![(0x10000, 0x100), (0x10100, 0x100)]]);
    }

    #[test]
    fn a_range_is_found_only_where_it_lies_whole() {
        let idx = AllocationIndex {
            allocations: vec![(0x1000, 0x100), (0x1000, 0x300)],
        };
        assert_eq!(idx.find_range(0x1010, 0x10).map(|a| a.allocation), Some(0));
        assert_eq!(idx.find_range(0x1010, 0x100).map(|a| a.allocation), Some(1));
        assert_eq!(idx.find_range(0x1200, 0x101), None);
        assert_eq!(idx.find_range(u64::MAX, 2), None);
    }

    #[test]
    fn a_chunk_list_must_be_ordered_inside_its_span() {
        let c = |offset, size, fd| SharedChunk { offset, size, fd };
        let list = |chunks| SharedChunks { pid: 1, chunks };
        assert!(list(vec![c(0, 16, 3), c(16, 16, 4)]).check(32).is_ok());
        for (chunks, why) in [
            (vec![], "no chunks"),
            (
                vec![c(0, 16, 3), c(8, 16, 4)],
                "chunk 1 at 8 overlaps the one before",
            ),
            (
                vec![c(0, 16, 3), c(16, 17, 4)],
                "chunk 1 (16 + 17) passes the end",
            ),
            (vec![c(0, 0, 3)], "chunk 0: size 0, fd 3"),
            (vec![c(0, 16, -1)], "chunk 0: size 16, fd -1"),
            (
                vec![c(u64::MAX, 2, 3)],
                "chunk 0 (18446744073709551615 + 2) passes the end",
            ),
        ] {
            assert_eq!(
                list(chunks).check(32).unwrap_err().to_string(),
                format!("bad shared mapping list for an allocation of 32 bytes: {why}")
            );
        }
    }
}
