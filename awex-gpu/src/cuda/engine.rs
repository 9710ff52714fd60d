//! The copy engine: issues copy descriptors on a few streams, ordered by events.
//!
//! An update is one batch: every stream waits, on the device, for the event that says the
//! source is ready (the training side records it; through an IPC event handle when it is
//! another process), the descriptors are spread over the streams by bytes, the streams join
//! back into the first one, and a `done` event is recorded there for whoever must not touch
//! the memory before the copies end. The host never polls per tensor. A batch that repeats
//! with the same addresses can be captured once into a CUDA graph and replayed with one launch.
//!
//! Copies go through the driver's copy calls ([`CopyMethod::Driver`]) or through awex's own
//! copy kernel on the SMs ([`CopyMethod::Kernel`], `copy_rows.ptx`), which moves pitched rows
//! of 16-byte vectors. The kernel loads from a cubin compiled ahead of time for sm_90 (the
//! H100/H200) when the build carries one and the device takes it, else from the PTX, which the
//! driver compiles at run time (see [`CopyEngine::kernel_image`]). A captured batch moves all its
//! kernel copies in one launch of the tile kernel (`copy_tiles.ptx`, see [`super::tiles`])
//! unless told otherwise ([`CopyEngine::set_tiles`]).
//!
//! Copies read and write raw device addresses, so the functions that queue them
//! ([`CopyEngine::launch`], [`CopyEngine::capture`], [`CopyEngine::replay`]) are `unsafe`:
//! the caller vouches for the memory behind every descriptor.

use super::delta::{DELTA_CUBIN_SM90, DELTA_PTX, DIFF_BLOCKS_PER_SM, DIFF_NAME};
use super::desc::CopyDesc;
use super::device::{Device, DeviceBuffer, Event, Stream};
use super::raw::{RawFunction, RawGraphExec, RawModule};
use super::tiles::{
    DEFAULT_TILE_BYTES, table_within_bound, tile_count, tile_table_bytes, tiles_fit,
};
use super::{CudaError, KernelArg, sys};
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// How a copy engine moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CopyMethod {
    /// The driver's copy calls (`cuMemcpyDtoDAsync`, `cuMemcpy2DAsync`, `cuMemcpy3DAsync`).
    Driver,
    /// awex's copy kernel for every descriptor whose addresses, width and pitches are
    /// multiples of 16 bytes (see [`kernel_fits`]); the driver's calls for the rest.
    Kernel,
}

/// The copy kernel's PTX, NUL-terminated for the driver.
const KERNEL_PTX: &str = concat!(include_str!("copy_rows.ptx"), "\0");
/// The same kernel compiled ahead of time for sm_90 (`ptxas -arch=sm_90 copy_rows.ptx`); empty
/// when the build carries none. A device that refuses it gets the PTX.
const KERNEL_CUBIN_SM90: &[u8] = include_bytes!("copy_rows.sm_90.cubin");
/// The kernel's entry point.
const KERNEL_NAME: &CStr = c"awex_copy_rows";
/// The tile kernel (one launch for a whole batch, see [`super::tiles`]): PTX, the same
/// compiled for sm_90 (`ptxas -arch=sm_90 -O3 copy_tiles.ptx`), entry point.
const TILES_PTX: &str = concat!(include_str!("copy_tiles.ptx"), "\0");
const TILES_CUBIN_SM90: &[u8] = include_bytes!("copy_tiles.sm_90.cubin");
const TILES_NAME: &CStr = c"awex_copy_tiles";
/// Resident blocks per SM of the tile kernel: 256 threads of 32 registers each (ptxas), so 8
/// blocks fill an SM's 2,048 threads on sm_80 and sm_90.
const TILE_BLOCKS_PER_SM: u32 = 8;
/// Where a tile table starts in its device buffer: the block counter comes first (a `u32` at
/// byte 0), then the diff kernel's count of vectors written (a `u64` at byte 8).
const TABLE_OFFSET: u64 = 256;
/// Where the diff kernel's count of written vectors sits in a table's buffer.
const CHANGED_OFFSET: u64 = 8;
/// Threads per block of the copy kernel.
pub const KERNEL_THREADS: u32 = 256;
/// Blocks a copy kernel launch aims at (about one full wave of resident blocks on an H100/H200).
const KERNEL_BLOCKS: u64 = 1024;

/// Whether the copy kernel can move `d`: 16-byte vectors on both ends.
pub fn kernel_fits(d: &CopyDesc) -> bool {
    d.width > 0
        && [d.src, d.dst, d.width, d.src_pitch, d.dst_pitch]
            .iter()
            .all(|v| v % 16 == 0)
}

/// The copy kernel's grid (x blocks along a row, y blocks over rows) for `height` rows of
/// `nvec` vectors: about 1,024 blocks (`KERNEL_BLOCKS`), no more than the rows and vectors need
/// (each thread moves four vectors per step).
pub fn kernel_grid(nvec: u64, height: u64) -> (u32, u32) {
    let gy = height.clamp(1, 65_535).min(KERNEL_BLOCKS);
    let per_row = nvec.div_ceil(KERNEL_THREADS as u64 * 4).max(1);
    let gx = per_row.min((KERNEL_BLOCKS / gy).max(1));
    (gx as u32, gy as u32)
}

/// A loaded kernel (the copy kernels, the FP8 quantiser), unloaded on drop.
pub(crate) struct Kernel {
    pub(crate) dev: Device,
    module: RawModule,
    pub(crate) func: RawFunction,
    /// which image loaded: "cubin sm_90" or "ptx"
    pub(crate) image: &'static str,
}

impl Kernel {
    /// Loads `name` from the sm_90 `cubin` when there is one and the device takes it, else
    /// from the `ptx` (NUL-terminated).
    pub(crate) fn load(
        dev: &Device,
        ptx: &str,
        cubin: &[u8],
        name: &CStr,
    ) -> Result<Kernel, CudaError> {
        dev.bind()?;
        if !cubin.is_empty()
            && let Ok(k) = Kernel::load_image(dev, cubin, name, "cubin sm_90")
        {
            return Ok(k);
        }
        Kernel::load_image(dev, ptx.as_bytes(), name, "ptx")
    }

    /// Makes the kernel's device current on this thread.
    pub(crate) fn dev_bind(&self) -> Result<(), CudaError> {
        self.dev.bind()
    }

    fn load_image(
        dev: &Device,
        image: &[u8],
        name: &CStr,
        what: &'static str,
    ) -> Result<Kernel, CudaError> {
        let module = sys::module_load(image)?;
        match sys::module_function(module, name) {
            Ok(func) => Ok(Kernel {
                dev: dev.clone(),
                module,
                func,
                image: what,
            }),
            Err(e) => {
                let _ = sys::module_unload(module);
                Err(e)
            }
        }
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        let _ = self
            .dev
            .bind()
            .and_then(|_| sys::module_unload(self.module));
    }
}

/// Which stream each descriptor goes to: in submission order, each to the stream with the
/// fewest bytes queued so far (ties to the lowest index).
pub fn assign_streams(descs: &[CopyDesc], streams: usize) -> Vec<usize> {
    let mut load = vec![0u64; streams.max(1)];
    descs
        .iter()
        .map(|d| {
            let (k, _) = load
                .iter()
                .enumerate()
                .min_by_key(|&(i, &l)| (l, i))
                .unwrap_or((0, &0));
            load[k] += d.bytes();
            k
        })
        .collect()
}

/// The order in which a batch's copies are issued to the streams.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CopyOrder {
    /// Largest first, each to the stream with the fewest bytes so far (longest-processing-time
    /// first: the streams end closer together). Measured on an H200 (`docs/benchmarks.md`,
    /// 2026-12-01 19:01 UTC): qwen3-8b out of per-tensor allocations 8.41 -> 8.27 ms,
    /// qwen3-30b-a3b 34.00 -> 33.18 ms. The destinations of one batch never overlap, so the
    /// order does not change what lands.
    #[default]
    LargestFirst,
    /// In submission order, each to the stream with the fewest bytes so far.
    Submission,
}

/// The indices of `descs`, largest copy first (ties in submission order).
pub fn largest_first_order(descs: &[CopyDesc]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..descs.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(descs[i].bytes()), i));
    order
}

/// Whether an engine with the kernel captures batches through the tile kernel unless told.
pub const TILES_BY_DEFAULT: bool = true;

/// Runs batches of device-to-device copies on a fixed set of streams.
pub struct CopyEngine {
    dev: Device,
    streams: Vec<Stream>,
    /// joins[k] is recorded on stream k and waited on by stream 0; joins[0] forks captures
    joins: Vec<Event>,
    kernel: Option<Kernel>,
    /// The tile kernel, loaded with the copy kernel.
    tiles: Option<Kernel>,
    /// The diff kernel (`delta.cu`), loaded with the copy kernel.
    diff: Option<Kernel>,
    /// Blocks of a diff launch: [`DIFF_BLOCKS_PER_SM`] per SM.
    diff_blocks: u32,
    /// Blocks of a tile launch: [`TILE_BLOCKS_PER_SM`] per SM.
    tile_blocks: u32,
    /// With the tile kernel: the tile size of captured batches (0: a launch per copy).
    tile_bytes: AtomicU64,
    /// With the kernel: linear copies of at least this many bytes go through the driver
    /// (`u64::MAX`: none). Atomic so that it can change between batches through `&self`.
    driver_min: AtomicU64,
    /// Issue copies in submission order ([`CopyOrder::Submission`]) rather than largest first.
    submission_order: AtomicBool,
}

/// How a captured batch splits with tiles on: the copies the tile kernel takes, in `tiles`
/// tiles of `table`, and the `rest` (the driver's).
struct Tiled {
    copies: usize,
    /// bytes of those copies
    bytes: u64,
    /// the tile kernel is the diff kernel
    diff: bool,
    rest: Vec<CopyDesc>,
    table: DeviceBuffer,
    tiles: u32,
}

/// A batch captured into a CUDA graph, replayed with [`CopyEngine::replay`].
pub struct CopyGraph {
    dev: Device,
    exec: RawGraphExec,
    /// Descriptors in the graph.
    pub copies: usize,
    /// Of them, the ones moved by the tile kernel's one launch.
    pub tiled_copies: usize,
    /// Tiles of that launch.
    pub tiles: usize,
    /// Device memory of the tile table and its counter.
    pub table_bytes: u64,
    /// Whether the tile launch writes only the vectors that differ
    /// ([`CopyEngine::capture_diff`]); see [`CopyGraph::changed_vectors`].
    pub diff: bool,
    /// Bytes of the copies the diff launch takes (0 unless [`CopyGraph::diff`]).
    pub diff_bytes: u64,
    /// The tile table and its counter, alive as long as the graph that reads them (dropped
    /// after `exec` is destroyed).
    _table: Option<DeviceBuffer>,
}

impl CopyGraph {
    /// After a replay of a diff graph has finished: the 16-byte vectors whose bytes differed,
    /// out of [`CopyGraph::diff_bytes`] / 16. The kernel wrote each of them, and also the other
    /// half of each 32-byte sector one of them lies in (a half-sector write costs the memory a
    /// read-merge-write; the half written too already held the source's bytes). `None` for a
    /// graph that copies every byte.
    pub fn changed_vectors(&self) -> Result<Option<u64>, CudaError> {
        let Some(t) = self._table.as_ref().filter(|_| self.diff) else {
            return Ok(None);
        };
        let mut b = [0u8; 8];
        t.download(CHANGED_OFFSET, &mut b)?;
        Ok(Some(u64::from_le_bytes(b)))
    }
}

impl Drop for CopyGraph {
    fn drop(&mut self) {
        let _ = self.dev.bind().and_then(|_| sys::graph_destroy(self.exec));
    }
}

impl CopyEngine {
    /// An engine with `streams` streams on `dev`, copying through the driver.
    pub fn new(dev: &Device, streams: usize) -> Result<CopyEngine, CudaError> {
        CopyEngine::with_method(dev, streams, CopyMethod::Driver)
    }

    /// An engine with `streams` streams on `dev`, copying with `method`.
    pub fn with_method(
        dev: &Device,
        streams: usize,
        method: CopyMethod,
    ) -> Result<CopyEngine, CudaError> {
        if streams == 0 {
            return Err(CudaError::Streams(0));
        }
        let mut s = Vec::with_capacity(streams);
        let mut j = Vec::with_capacity(streams);
        for _ in 0..streams {
            s.push(dev.stream()?);
            j.push(dev.event(false)?);
        }
        let sms = match method {
            CopyMethod::Driver => 0,
            CopyMethod::Kernel => sys::device_sm_count(dev.ordinal()).unwrap_or(128),
        };
        let (kernel, tiles, tile_blocks) = match method {
            CopyMethod::Driver => (None, None, 0),
            CopyMethod::Kernel => (
                Some(Kernel::load(
                    dev,
                    KERNEL_PTX,
                    KERNEL_CUBIN_SM90,
                    KERNEL_NAME,
                )?),
                // a device that takes the copy kernel but not the tile kernel keeps the
                // first: its batches are launched per copy (`tiles()` is then `None`)
                Kernel::load(dev, TILES_PTX, TILES_CUBIN_SM90, TILES_NAME).ok(),
                sms * TILE_BLOCKS_PER_SM,
            ),
        };
        let diff = match method {
            CopyMethod::Driver => None,
            CopyMethod::Kernel => Kernel::load(dev, DELTA_PTX, DELTA_CUBIN_SM90, DIFF_NAME).ok(),
        };
        let tile_bytes = if TILES_BY_DEFAULT {
            DEFAULT_TILE_BYTES
        } else {
            0
        };
        Ok(CopyEngine {
            dev: dev.clone(),
            streams: s,
            joins: j,
            kernel,
            tiles,
            diff,
            diff_blocks: sms * DIFF_BLOCKS_PER_SM,
            tile_blocks,
            tile_bytes: AtomicU64::new(tile_bytes),
            driver_min: AtomicU64::new(u64::MAX),
            submission_order: AtomicBool::new(false),
        })
    }

    /// Issues every later batch's copies in `order` ([`CopyOrder::LargestFirst`] by default).
    pub fn set_order(&self, order: CopyOrder) {
        self.submission_order
            .store(order == CopyOrder::Submission, Ordering::Relaxed);
    }

    /// With the kernel, captures every later batch's kernel copies into one launch of the tile
    /// kernel over tiles of about `bytes` (`Some`), or one launch per copy (`None`). Plain
    /// [`CopyEngine::launch`]es always launch per copy. The default: [`TILES_BY_DEFAULT`],
    /// tiles of [`DEFAULT_TILE_BYTES`].
    pub fn set_tiles(&self, bytes: Option<u64>) {
        self.tile_bytes
            .store(bytes.map_or(0, |b| b.max(16)), Ordering::Relaxed);
    }

    /// See [`CopyEngine::set_tiles`]; `None` also for an engine without the kernel.
    pub fn tiles(&self) -> Option<u64> {
        match self.tile_bytes.load(Ordering::Relaxed) {
            0 => None,
            _ if self.tiles.is_none() => None,
            b => Some(b),
        }
    }

    /// With the kernel, sends every linear copy (one row) of at least `bytes` through the
    /// driver's `cuMemcpyDtoDAsync` instead (`None`: the kernel for every copy it fits). The
    /// driver's device copy reads and writes a few percent faster than the kernel on large
    /// contiguous blocks; the kernel wins on small and pitched ones, where each driver call
    /// costs microseconds of host time.
    /// The setting applies to the batches queued or captured after it.
    pub fn set_driver_min(&self, bytes: Option<u64>) {
        self.driver_min
            .store(bytes.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// See [`CopyEngine::set_driver_min`].
    pub fn driver_min(&self) -> Option<u64> {
        match self.driver_min.load(Ordering::Relaxed) {
            u64::MAX => None,
            b => Some(b),
        }
    }

    /// Whether `d` goes through the copy kernel.
    pub fn by_kernel(&self, d: &CopyDesc) -> bool {
        let linear_big =
            d.height == 1 && d.depth == 1 && self.driver_min().is_some_and(|min| d.width >= min);
        self.kernel.is_some() && kernel_fits(d) && !linear_big
    }

    /// How this engine copies.
    pub fn method(&self) -> CopyMethod {
        match self.kernel {
            Some(_) => CopyMethod::Kernel,
            None => CopyMethod::Driver,
        }
    }

    /// Which image the copy kernel loaded from (`"cubin sm_90"` or `"ptx"`); `None` for an
    /// engine that copies through the driver.
    pub fn kernel_image(&self) -> Option<&'static str> {
        self.kernel.as_ref().map(|k| k.image)
    }

    /// Runs one small copy on every stream and waits for it, so that the first real batch
    /// pays for no lazy loading (the kernel's first launch, the streams' first work).
    pub fn warm_up(&self) -> Result<(), CudaError> {
        let buf = self.dev.alloc(64)?;
        let d = CopyDesc::linear(buf.ptr(), buf.ptr() + 32, 32);
        for k in 0..self.streams.len() {
            // SAFETY: both halves lie in `buf`, which lives until the sync below.
            unsafe { self.issue(&d, k)? };
        }
        // the tile kernel's first launch too, over a table of that one copy
        let table = self.table(&[d], 16)?;
        if let Some((t, n)) = &table {
            // SAFETY: the table's one tile lies in `buf`; both live until the sync below.
            unsafe { self.issue_tiles(t, *n, 0, false)? };
        }
        for s in &self.streams {
            s.sync()?;
        }
        Ok(())
    }

    /// Queues one descriptor on stream `k`.
    ///
    /// # Safety
    ///
    /// As for [`CopyEngine::launch`], for `d`.
    unsafe fn issue(&self, d: &CopyDesc, k: usize) -> Result<(), CudaError> {
        let s = self.streams[k].raw;
        let r = match &self.kernel {
            Some(kern) if self.by_kernel(d) => {
                let nvec = d.width / 16;
                let grid = kernel_grid(nvec, d.height);
                (0..d.depth).try_for_each(|z| {
                    let args = [
                        d.src + z * d.src_rows * d.src_pitch,
                        d.dst + z * d.dst_rows * d.dst_pitch,
                        nvec,
                        d.src_pitch,
                        d.dst_pitch,
                        d.height,
                    ];
                    // SAFETY: the kernel is loaded in this context; the rows are `d`'s, which
                    // the caller vouches for.
                    unsafe { sys::launch_copy_rows(kern.func, grid, KERNEL_THREADS, s, args) }
                })
            }
            // SAFETY: the caller vouches for `d`.
            _ => unsafe { sys::copy_async(d, s) },
        };
        r.map_err(|e| CudaError::Copy {
            desc: format!("{d:?}"),
            detail: e.to_string(),
        })
    }

    /// The tile table of `descs` (all for the tile kernel) in device memory, counter first,
    /// and its tile count; `None` without the tile kernel or copies, or when the table would
    /// be over [`MAX_TABLE_BYTES`](super::tiles::MAX_TABLE_BYTES) (the batch is then launched per copy).
    fn table(
        &self,
        descs: &[CopyDesc],
        tile: u64,
    ) -> Result<Option<(DeviceBuffer, u32)>, CudaError> {
        if self.tiles.is_none() || descs.is_empty() {
            return Ok(None);
        }
        // counted before anything is made: a table over the bound is never built
        let count = tile_count(descs, tile);
        if count == 0 || !table_within_bound(count) {
            return Ok(None);
        }
        // within the bound, so far below u32::MAX
        let n = count as u32;
        let bytes = tile_table_bytes(descs, tile);
        let buf = self.dev.alloc(TABLE_OFFSET + bytes.len() as u64)?;
        buf.upload(TABLE_OFFSET, &bytes)?;
        Ok(Some((buf, n)))
    }

    /// Queues the tile kernel (`diff`: the diff kernel) over `n` tiles of `table` on stream
    /// `k`: zeroes the counters, then launches.
    ///
    /// # Safety
    ///
    /// As for [`CopyEngine::launch`], for every tile of the table.
    unsafe fn issue_tiles(
        &self,
        table: &DeviceBuffer,
        n: u32,
        k: usize,
        diff: bool,
    ) -> Result<(), CudaError> {
        let s = self.streams[k].raw;
        // the diff kernel also counts the vectors it writes, in the `u64` after the counter
        let (kern, blocks, words) = match diff {
            true => (&self.diff, self.diff_blocks, 4),
            false => (&self.tiles, self.tile_blocks, 1),
        };
        let Some(kern) = kern else {
            return Ok(());
        };
        let mut args = vec![
            KernelArg::U64(table.ptr() + TABLE_OFFSET),
            KernelArg::U64(table.ptr()),
            KernelArg::U32(n),
        ];
        if diff {
            args.push(KernelArg::U64(table.ptr() + CHANGED_OFFSET));
        }
        let r = (|| {
            // SAFETY: the counters are the first 16 bytes of `table`, which the caller keeps
            // alive.
            unsafe { sys::memset_d32_async(table.ptr(), 0, words, s)? };
            // SAFETY: the kernel takes (tiles, counter, ntiles[, changed]) and is loaded in
            // this context; the tiles are the caller's.
            unsafe { sys::launch_args(kern.func, blocks.max(1), (KERNEL_THREADS, 1), s, &mut args) }
        })();
        r.map_err(|e| CudaError::Copy {
            desc: format!("{n} tiles"),
            detail: e.to_string(),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Number of streams.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// The first stream, where batches end and `done` is recorded.
    pub fn main_stream(&self) -> &Stream {
        &self.streams[0]
    }

    /// # Safety
    ///
    /// As for [`CopyEngine::launch`].
    unsafe fn queue_copies(&self, descs: &[CopyDesc]) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.queue_copies_from(descs, 0) }
    }

    /// Queues `descs` on the streams from `first` on (all of them when `first` is the last
    /// one or beyond), then joins every stream into the first.
    ///
    /// # Safety
    ///
    /// As for [`CopyEngine::launch`].
    unsafe fn queue_copies_from(&self, descs: &[CopyDesc], first: usize) -> Result<(), CudaError> {
        let first = if first + 1 >= self.streams.len() {
            0
        } else {
            first
        };
        let n = self.streams.len() - first;
        if !self.submission_order.load(Ordering::Relaxed) {
            let order = largest_first_order(descs);
            let sorted: Vec<CopyDesc> = order.iter().map(|&i| descs[i]).collect();
            for (d, k) in sorted.iter().zip(assign_streams(&sorted, n)) {
                // SAFETY: the caller vouches for every descriptor.
                unsafe { self.issue(d, first + k)? };
            }
        } else {
            for (d, k) in descs.iter().zip(assign_streams(descs, n)) {
                // SAFETY: the caller vouches for every descriptor.
                unsafe { self.issue(d, first + k)? };
            }
        }
        for k in 1..self.streams.len() {
            self.joins[k].record(&self.streams[k])?;
            self.streams[0].wait(&self.joins[k])?;
        }
        Ok(())
    }

    /// Queues a batch: waits for `after` on every stream, copies, records `done` at the end.
    /// Returns once queued; [`CopyEngine::sync`] waits for the end.
    ///
    /// # Safety
    ///
    /// For every descriptor, the bytes it reads must be device memory mapped in this engine's
    /// context (its own, or opened through IPC) and the bytes it writes device memory of that
    /// context; all of it must stay allocated, and the destinations unused by anything else,
    /// until the batch has finished (after `after` and before [`CopyEngine::sync`] returns or
    /// `done` fires). The destinations of one batch must not overlap.
    pub unsafe fn launch(
        &self,
        descs: &[CopyDesc],
        after: Option<&Event>,
        done: Option<&Event>,
    ) -> Result<(), CudaError> {
        self.dev.bind()?;
        if let Some(e) = after {
            for s in &self.streams {
                s.wait(e)?;
            }
        }
        // SAFETY: the caller's contract.
        unsafe { self.queue_copies(descs)? };
        if let Some(e) = done {
            e.record(&self.streams[0])?;
        }
        Ok(())
    }

    /// Captures a batch into a graph (nothing runs until [`CopyEngine::replay`]).
    ///
    /// # Safety
    ///
    /// Nothing is copied here, but the graph holds the descriptors' addresses: every replay
    /// must meet [`CopyEngine::launch`]'s conditions for them, which [`CopyEngine::replay`]'s
    /// caller vouches for.
    ///
    /// With tiles on ([`CopyEngine::set_tiles`]), every copy the kernel takes is moved by one
    /// launch of the tile kernel on the first stream and the rest (the driver's) go to the
    /// other streams.
    pub unsafe fn capture(&self, descs: &[CopyDesc]) -> Result<CopyGraph, CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.capture_as(descs, false) }
    }

    /// Whether [`CopyEngine::capture_diff`] can write only what differs (the engine copies
    /// with the kernel, and the diff kernel loaded).
    pub fn diffs(&self) -> bool {
        self.diff.is_some() && self.tiles.is_some()
    }

    /// Like [`CopyEngine::capture`], but every copy the tile table can take (16-byte vectors,
    /// see [`kernel_fits`]; large linear ones too, whatever [`CopyEngine::set_driver_min`]
    /// says) goes through the diff kernel (`delta.cu`): it reads each destination vector and
    /// writes it only where the source's bytes differ (the whole 32-byte sector where one half
    /// differs), and counts the vectors that differed ([`CopyGraph::changed_vectors`]). The result is the same bytes as the copy's. The rest,
    /// and a whole batch whose table would pass the bound or an engine without the diff kernel
    /// ([`CopyEngine::diffs`]), are copied whole: [`CopyGraph::diff`] says which happened.
    ///
    /// # Safety
    ///
    /// As for [`CopyEngine::capture`]; the diff kernel also reads the destinations.
    pub unsafe fn capture_diff(&self, descs: &[CopyDesc]) -> Result<CopyGraph, CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.capture_as(descs, self.diffs()) }
    }

    /// See [`CopyEngine::capture`] and [`CopyEngine::capture_diff`].
    ///
    /// # Safety
    ///
    /// As for [`CopyEngine::capture`].
    unsafe fn capture_as(&self, descs: &[CopyDesc], diff: bool) -> Result<CopyGraph, CudaError> {
        self.dev.bind()?;
        // with tiles: the copies the tile kernel takes, the rest (the driver's), the table
        let tile = match (diff, self.tiles()) {
            (true, t) => Some(t.unwrap_or(DEFAULT_TILE_BYTES)),
            (false, t) => t,
        };
        let split = match tile {
            Some(tile) => {
                let (tiled, rest): (Vec<CopyDesc>, Vec<CopyDesc>) =
                    descs.iter().copied().partition(|d| {
                        tiles_fit(d)
                            && if diff {
                                self.kernel.is_some() && kernel_fits(d)
                            } else {
                                self.by_kernel(d)
                            }
                    });
                self.table(&tiled, tile)?.map(|(table, tiles)| Tiled {
                    copies: tiled.len(),
                    bytes: tiled.iter().map(CopyDesc::bytes).sum(),
                    diff,
                    rest,
                    table,
                    tiles,
                })
            }
            None => None,
        };
        let s0 = &self.streams[0];
        sys::capture_begin(s0.raw)?;
        let body = (|| {
            // fork the other streams off the capturing one so their copies join the graph
            self.joins[0].record(s0)?;
            for s in &self.streams[1..] {
                s.wait(&self.joins[0])?;
            }
            match &split {
                Some(t) => {
                    // SAFETY: captured, not run; the replay's caller vouches for the memory.
                    unsafe { self.issue_tiles(&t.table, t.tiles, 0, t.diff)? };
                    // SAFETY: as above.
                    unsafe { self.queue_copies_from(&t.rest, 1) }
                }
                // no tiles (off, none fit, or a table over the bound): every copy on its own
                // SAFETY: as above.
                None => unsafe { self.queue_copies(descs) },
            }
        })();
        // end the capture whatever happened, so the stream is usable again
        let exec = sys::capture_end(s0.raw);
        body?;
        Ok(CopyGraph {
            dev: self.dev.clone(),
            exec: exec?,
            copies: descs.len(),
            tiled_copies: split.as_ref().map_or(0, |t| t.copies),
            tiles: split.as_ref().map_or(0, |t| t.tiles as usize),
            table_bytes: split.as_ref().map_or(0, |t| t.table.len()),
            diff: split.as_ref().is_some_and(|t| t.diff),
            diff_bytes: split.as_ref().filter(|t| t.diff).map_or(0, |t| t.bytes),
            _table: split.map(|t| t.table),
        })
    }

    /// Queues a captured batch after `after`, recording `done` at its end.
    ///
    /// # Safety
    ///
    /// The descriptors captured in `g` must meet [`CopyEngine::launch`]'s conditions now.
    pub unsafe fn replay(
        &self,
        g: &CopyGraph,
        after: Option<&Event>,
        done: Option<&Event>,
    ) -> Result<(), CudaError> {
        self.dev.bind()?;
        let s0 = &self.streams[0];
        if let Some(e) = after {
            s0.wait(e)?;
        }
        // SAFETY: the caller's contract.
        unsafe { sys::graph_launch(g.exec, s0.raw)? };
        if let Some(e) = done {
            e.record(s0)?;
        }
        Ok(())
    }

    /// Like [`CopyEngine::replay`], but launches the graph on stream `lane` (modulo the stream
    /// count) after `after`, so that graphs replayed on different lanes run at once (a
    /// receiver's peers, read concurrently). [`CopyEngine::join_lanes`] makes the first stream
    /// wait for every lane before [`CopyEngine::sync`].
    ///
    /// # Safety
    ///
    /// As for [`CopyEngine::replay`].
    pub unsafe fn replay_on(
        &self,
        g: &CopyGraph,
        lane: usize,
        after: Option<&Event>,
    ) -> Result<(), CudaError> {
        self.dev.bind()?;
        let s = &self.streams[lane % self.streams.len()];
        if let Some(e) = after {
            s.wait(e)?;
        }
        // SAFETY: the caller's contract.
        unsafe { sys::graph_launch(g.exec, s.raw) }
    }

    /// Makes the first stream wait for the work queued on every other stream (the lanes of
    /// [`CopyEngine::replay_on`]), so that [`CopyEngine::sync`] and later batches follow it.
    pub fn join_lanes(&self) -> Result<(), CudaError> {
        self.dev.bind()?;
        for (s, j) in self.streams.iter().zip(&self.joins).skip(1) {
            j.record(s)?;
            self.streams[0].wait(j)?;
        }
        Ok(())
    }

    /// Blocks until every queued batch has finished.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.streams[0].sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_takes_16_byte_vectors_only() {
        assert!(kernel_fits(&CopyDesc::linear(0x1000, 0x2000, 8192)));
        assert!(!kernel_fits(&CopyDesc::linear(0x1008, 0x2000, 8192)));
        assert!(!kernel_fits(&CopyDesc::linear(0x1000, 0x2000, 68)));
        let pitched = CopyDesc {
            height: 3,
            src_pitch: 200,
            ..CopyDesc::linear(0x1000, 0x2000, 64)
        };
        assert!(!kernel_fits(&pitched));
        assert!(!kernel_fits(&CopyDesc::linear(0, 0, 0)));
    }

    #[test]
    fn largest_first_orders_by_bytes_then_submission() {
        let descs: Vec<CopyDesc> = [8u64, 64, 8, 128, 64]
            .iter()
            .map(|&b| CopyDesc::linear(0x1000, 0x2000, b))
            .collect();
        assert_eq!(largest_first_order(&descs), vec![3, 1, 4, 0, 2]);
        assert_eq!(largest_first_order(&[]), Vec::<usize>::new());
    }

    #[test]
    fn kernel_grid_spreads_about_a_wave_of_blocks() {
        // 1.24 GB embedding: one row of 77.8M vectors
        assert_eq!(kernel_grid(1_244_659_712 / 16, 1), (1024, 1));
        // eight 4 MiB rows (merged q blocks)
        assert_eq!(kernel_grid((4 << 20) / 16, 8), (128, 8));
        // an 8 KiB norm: one block
        assert_eq!(kernel_grid(512, 1), (1, 1));
        // many short rows: rows over y, capped
        assert_eq!(kernel_grid(4, 100_000), (1, 1024));
    }

    #[test]
    fn embedded_cubin_is_empty_or_an_elf_image() {
        assert!(KERNEL_CUBIN_SM90.is_empty() || KERNEL_CUBIN_SM90.starts_with(b"\x7fELF"));
        assert!(TILES_CUBIN_SM90.starts_with(b"\x7fELF"));
    }

    #[test]
    fn kernel_ptx_is_one_nul_terminated_entry() {
        for (ptx, entry) in [
            (KERNEL_PTX, ".visible .entry awex_copy_rows("),
            (TILES_PTX, ".visible .entry awex_copy_tiles("),
        ] {
            assert!(ptx.ends_with('\0'));
            assert_eq!(ptx.matches('\0').count(), 1);
            assert!(ptx.contains(entry));
        }
        assert_eq!(KERNEL_NAME, c"awex_copy_rows");
        assert_eq!(TILES_NAME, c"awex_copy_tiles");
    }

    #[test]
    fn streams_are_balanced_by_bytes_in_submission_order() {
        let d = |n| CopyDesc::linear(0, 0, n);
        let descs = [d(100), d(10), d(10), d(50), d(5), d(40)];
        assert_eq!(assign_streams(&descs, 2), vec![0, 1, 1, 1, 1, 1]);
        assert_eq!(assign_streams(&descs, 3), vec![0, 1, 2, 1, 2, 2]);
        assert_eq!(assign_streams(&descs, 1), vec![0; 6]);
    }
}
