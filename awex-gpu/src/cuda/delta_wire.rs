//! GPU kernels for the delta wire format (`delta_wire.cu`): a sender encodes a bucket's delta
//! frame on its GPU (new version against the base, both in device memory), a receiver applies
//! a frame to its destination in place on its GPU. The format and its CPU reference are
//! `awex_core::encoding::delta` (a segment) and `awex_core::encoding::delta_frame` (a frame:
//! segment count, u32 byte lengths, segments).
//!
//! # What the kernels write
//!
//! Tags 0 (dense), 1 (sparse) and 2 (unchanged) only, with the CPU encoder's own rules for
//! them, so a GPU frame equals `delta_frame::encode_frame(.., Forms::NoGaps, ..)` byte for
//! byte: a chunk of 256 elements goes whole (count 255) where `c (1 + s) >= len s` or `c >=
//! 255`, a segment is unchanged when no element changed, dense when `n s < 1 + chunks +
//! payload` (the CPU's comparison, tag excluded on the dense side), sparse otherwise. The gaps
//! form (tag 3) is a serial Rice-coded bit stream and is never written; the decoder refuses a
//! frame holding one ([`CudaError::DeltaWire`] names the segment) before writing anything.
//!
//! # How (encode: four launches on one stream, then one read of a status word)
//!
//! 1. `awex_wire_compare`: one warp per 256-element chunk, each warp a run of [`RUN`] (256)
//!    chunks at a time (runs `w`, `w + warps`, ...; the next chunk's loads issued before the
//!    current one is compared). Lane `l` loads elements `8 l .. 8 l + 7` of new and base (one
//!    8-, 16- or 32-byte vector each where the segment is aligned, bytes otherwise), makes an
//!    8-bit mask of the elements that differ, and a warp scan of the masks' popcounts gives the
//!    chunk's count and each lane's place among its changes. The chunk's word (payload bytes,
//!    count byte) goes to `words`; a sparse chunk's offsets and values are appended to the
//!    run's stream: a ring of 2048 bytes in shared memory, written out 512 bytes at a time
//!    (one aligned 16-byte vector a lane) to the run's place in the scratch (the region of its
//!    first chunk: 256 `s` bytes a chunk, so the stream always fits). A dense chunk writes
//!    nothing: its values are new's bytes. The changed elements are summed per block into a
//!    third status word ([`WireKernels::finish_encode_counted`]).
//! 2. `awex_wire_tile_sums`: per tile of 1024 chunks, a block scan of the payload bytes: the
//!    tile's sum, and the in-tile prefix at each segment's first chunk.
//! 3. `awex_wire_plan` (one block): the tiles' exclusive prefix, each segment's payload bytes,
//!    form, length and offset; the header and each segment's tag; the frame's length in the
//!    status word.
//! 4. `awex_wire_write`: per tile, one block scan of two prefixes per chunk: payload bytes
//!    (plus the tile's prefix: its place in the frame) and staged bytes since its run's first
//!    chunk (its place in the run's stream). A lane per chunk writes its count byte and finds
//!    its payload's place and source (the stream, or new for a whole chunk or a dense
//!    segment); a warp's 32 chunks' payloads of up to 64 bytes are copied together, the
//!    group's bytes one after another, four a lane, every load issued before the stores; a
//!    larger payload is copied by the whole warp, a 4-byte word a lane (funnel-shifted from
//!    two aligned source words).
//!
//! The encoder reads new and base once (2 N bytes) and writes the words (4 bytes a chunk),
//! the streams (the payload, in whole lines) and the frame; the write pass reads the words and
//! the streams again. Staging each sparse chunk in its own region instead (the first version)
//! left a partly written 32-byte sector per chunk, scattered: at 1 % of bf16 elements changed
//! that made the compare 15.7 ms against 11.5 with nothing changed (an H100, qwen3-8b-sized;
//! docs/deltas.md).
//!
//! Decode, four launches: `awex_wire_read_header` (count, lengths, offsets, tags; the lengths
//! of dense and unchanged segments), `awex_wire_decode_sums` (each chunk's payload bytes from
//! its count byte, the count checked against the chunk), `awex_wire_decode_plan` (every sparse
//! segment ends where its length says), `awex_wire_apply` (one warp per chunk writes its
//! values, a sparse chunk's offsets checked first: increasing and inside the chunk). Every
//! header, tag and length check happens before anything is written; a bad offset fails its
//! chunk (unwritten) and the frame, as the CPU decoder fails at that chunk with the chunks
//! before it written. Errors come back through a status word as [`CudaError::DeltaWire`].
//!
//! [`host`] runs the same algorithm on the CPU (same chunks, words, runs and streams, tiles
//! and choices): CI checks that its frames decode with the CPU decoder to the new version and
//! equal the CPU encoder's; the GPU tests check that the kernels' frames equal its bytes.
//!
//! The PTX and the sm_90 cubin are built from `delta_wire.cu` with the CUDA 13.0 compiler
//! (`C=/path/to/cuda-13`, `PATH=$C/bin:$PATH`):
//!
//! ```sh
//! nvcc -ptx -arch=compute_75 -O3 -I$C/include delta_wire.cu -o delta_wire.ptx
//! ptxas -arch=sm_90 -O3 delta_wire.ptx -o delta_wire.sm_90.cubin
//! ```

use super::device::{Device, DeviceBuffer, Stream};
use super::engine::Kernel;
use super::{CudaError, KernelArg, sys};
use awex_core::encoding::delta::{
    CHUNK, DENSE_CHUNK, TAG_DENSE, TAG_GAPS, TAG_SPARSE, TAG_UNCHANGED, dense_chunk,
};
use awex_core::encoding::delta_frame::header_len;
use std::ffi::CStr;

/// The kernels' PTX, NUL-terminated for the driver.
pub(crate) const WIRE_PTX: &str = concat!(include_str!("delta_wire.ptx"), "\0");
/// The same compiled for sm_90.
pub(crate) const WIRE_CUBIN_SM90: &[u8] = include_bytes!("delta_wire.sm_90.cubin");
/// The kernels' entry points, in launch order: encode, then decode.
const NAMES: [&CStr; 8] = [
    c"awex_wire_compare",
    c"awex_wire_tile_sums",
    c"awex_wire_plan",
    c"awex_wire_write",
    c"awex_wire_read_header",
    c"awex_wire_decode_sums",
    c"awex_wire_decode_plan",
    c"awex_wire_apply",
];
/// Chunks per tile of the scan.
pub const TILE: u64 = 1024;
/// Chunks per run of the compare kernel: a warp's unit of work, whose sparse chunks' bytes
/// form one stream in the scratch (`RUN` in `delta_wire.cu`; it divides [`TILE`]).
pub const RUN: u64 = 256;
/// Bytes of a segment's entry in the kernels' table.
const SEG_BYTES: usize = 48;
/// Bytes of a segment's plan (offset, payload start, tag, length).
const PLAN_BYTES: u64 = 24;
/// Status words: the frame's length, the first error (`seg * 256 + code`, all ones: none),
/// the encoder's count of changed elements.
const STATUS_BYTES: u64 = 32;
/// Blocks per SM of the compare kernel: 256 threads of at most 64 registers
/// (`__launch_bounds__(256, 4)`: two chunks' loads in flight per warp, a few words spilled
/// to L1; measured faster on an H100 than 3 blocks of 80 registers without spilling), so that
/// the whole grid is resident at once.
const COMPARE_BLOCKS_PER_SM: u32 = 4;

/// One segment of a frame for the kernels: `n` elements of `elem` bytes (1, 2 or 4) lying
/// contiguously at `src` (the encoder's new version, or the decoder's destination) and, for
/// the encoder, at `base` (the version the receiver holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireSegment {
    /// new version (encode) or destination (decode), a device address
    pub src: u64,
    /// base version (encode; 0 for decode), a device address
    pub base: u64,
    /// elements
    pub n: u64,
    /// bytes per element: 1 (e4m3), 2 (bf16) or 4 (f32)
    pub elem: u32,
}

/// A frame's segments laid out for the kernels: each one's first chunk in the table and its
/// scratch region.
#[derive(Clone, Debug)]
pub struct WireTable {
    segs: Vec<WireSegment>,
    first: Vec<u64>,
    scratch_at: Vec<u64>,
    chunks: u64,
    scratch: u64,
}

impl WireTable {
    /// Lays out `segs` (in frame order), checking what the format and the kernels take.
    pub fn new(segs: &[WireSegment]) -> Result<WireTable, CudaError> {
        let bad = |i: usize, why: String| Err(CudaError::DeltaWire(format!("segment {i}: {why}")));
        if segs.len() > (u32::MAX as usize - 4) / 4 {
            return Err(CudaError::DeltaWire(format!(
                "{} segments in one frame; its u32 header holds at most {}",
                segs.len(),
                (u32::MAX - 4) / 4
            )));
        }
        let (mut first, mut scratch_at) = (vec![], vec![]);
        let (mut chunks, mut scratch) = (0u64, 0u64);
        for (i, s) in segs.iter().enumerate() {
            if !matches!(s.elem, 1 | 2 | 4) {
                return bad(
                    i,
                    format!(
                        "element size {} is none of 1 (e4m3), 2 (bf16) and 4 (f32), the sizes the kernels take",
                        s.elem
                    ),
                );
            }
            // a segment encodes to at most 1 + n s bytes; its length is a u32
            if s.n
                .checked_mul(s.elem as u64)
                .is_none_or(|b| b >= u32::MAX as u64)
            {
                return bad(
                    i,
                    format!(
                        "{} elements of {} bytes: a framed segment holds under 2^32 - 1 bytes; split it",
                        s.n, s.elem
                    ),
                );
            }
            first.push(chunks);
            scratch_at.push(scratch);
            let c = s.n.div_ceil(CHUNK as u64);
            chunks += c;
            scratch += c * CHUNK as u64 * s.elem as u64;
        }
        if chunks.div_ceil(TILE) > i32::MAX as u64 {
            return Err(CudaError::DeltaWire(format!(
                "{chunks} chunks need more tiles than one launch has blocks; split the frame"
            )));
        }
        Ok(WireTable {
            segs: segs.to_vec(),
            first,
            scratch_at,
            chunks,
            scratch,
        })
    }

    /// The segments.
    pub fn segments(&self) -> &[WireSegment] {
        &self.segs
    }

    /// 256-element chunks of all segments.
    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    /// Tiles of the scan.
    pub fn tiles(&self) -> u64 {
        self.chunks.div_ceil(TILE)
    }

    /// Bytes of the encoder's scratch (256 `s` bytes a chunk).
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch
    }

    /// The longest frame of these segments (every one dense): what the encoder's output
    /// buffer holds at least.
    pub fn max_frame_len(&self) -> u64 {
        header_len(self.segs.len()) as u64
            + self
                .segs
                .iter()
                .map(|s| 1 + s.n * s.elem as u64)
                .sum::<u64>()
    }

    /// The kernels' table: 48 bytes a segment (`Seg` in `delta_wire.cu`).
    fn bytes(&self) -> Vec<u8> {
        let mut t = Vec::with_capacity(self.segs.len() * SEG_BYTES);
        for (i, s) in self.segs.iter().enumerate() {
            for v in [s.src, s.base, s.n, self.first[i], self.scratch_at[i]] {
                t.extend_from_slice(&v.to_le_bytes());
            }
            t.extend_from_slice(&s.elem.to_le_bytes());
            t.extend_from_slice(&0u32.to_le_bytes());
        }
        t
    }
}

/// What the status word's error code means.
const E_HEADER: u32 = 1;
const E_COUNT: u32 = 2;
const E_LENGTHS: u32 = 3;
const E_EMPTY: u32 = 4;
const E_TAG: u32 = 5;
const E_GAPS: u32 = 6;
const E_CHUNK: u32 = 7;
const E_SEGLEN: u32 = 8;
const E_OFFSET: u32 = 9;
const E_TOOLONG: u32 = 10;
/// The status word with no error.
const NO_ERROR: u64 = u64::MAX;

/// The error a status word (`seg * 256 + code`) stands for.
pub fn wire_error(word: u64) -> CudaError {
    let (seg, code) = (word >> 8, (word & 0xff) as u32);
    let what = match code {
        E_HEADER => "the frame is shorter than its header of segment lengths".to_string(),
        E_COUNT => {
            "the frame's segment count differs from the table's: sender and receiver disagree on the bucket".to_string()
        }
        E_LENGTHS => "the segment lengths do not sum to the frame's bytes".to_string(),
        E_EMPTY => format!("segment {seg} has length 0 (every segment holds at least its tag)"),
        E_TAG => format!(
            "segment {seg}'s tag is none of dense (0), sparse (1), unchanged (2), gaps (3)"
        ),
        E_GAPS => format!(
            "segment {seg} is a gaps segment (tag 3), which the GPU decoder does not read; encode frames for a GPU receiver with the dense, sparse and unchanged forms only (Forms::NoGaps, or the GPU encoder), or decode this one on the CPU"
        ),
        E_CHUNK => format!("segment {seg}: a chunk counts more changed elements than it holds"),
        E_SEGLEN => format!(
            "segment {seg}'s delta does not end where its length in the header says"
        ),
        E_OFFSET => format!(
            "segment {seg}: a chunk's offsets are not increasing within its elements (that chunk was left unwritten)"
        ),
        E_TOOLONG => format!("segment {seg} encodes to more than 2^32 - 1 bytes; split it"),
        c => format!("unknown status {c} for segment {seg}"),
    };
    CudaError::DeltaWire(what)
}

/// The CPU emulation of the kernels' algorithm: the same chunks, words, runs and their
/// streams in the scratch, tiles, choices and copies, one step at a time.
pub mod host {
    use super::*;

    /// A chunk's word (payload bytes, count byte) and, for a sparse chunk, its offsets and
    /// values (the bytes `awex_wire_compare` appends to its run's stream).
    pub fn compare_chunk(new: &[u8], base: &[u8], elem: usize, local: u64) -> (u32, u8, Vec<u8>) {
        let (size, count, bytes, _) = compare_counted(new, base, elem, local);
        (size, count, bytes)
    }

    /// [`compare_chunk`] and the chunk's changed elements.
    fn compare_counted(
        new: &[u8],
        base: &[u8],
        elem: usize,
        local: u64,
    ) -> (u32, u8, Vec<u8>, u64) {
        let n = new.len() / elem;
        let first = local as usize * CHUNK;
        let len = (n - first).min(CHUNK);
        fn at(b: &[u8], j: usize, first: usize, elem: usize) -> &[u8] {
            &b[(first + j) * elem..(first + j + 1) * elem]
        }
        let offs: Vec<usize> = (0..len)
            .filter(|&j| at(new, j, first, elem) != at(base, j, first, elem))
            .collect();
        let c = offs.len();
        if dense_chunk(c, len, elem) {
            return ((len * elem) as u32, DENSE_CHUNK, vec![], c as u64);
        }
        let mut bytes: Vec<u8> = offs.iter().map(|&j| j as u8).collect();
        for &j in &offs {
            bytes.extend_from_slice(at(new, j, first, elem));
        }
        ((c * (1 + elem)) as u32, c as u8, bytes, c as u64)
    }

    /// The frame the kernels write for `table`, reading segment `i`'s new version from
    /// `new[i]` and its base from `base[i]` (host copies of the device bytes).
    pub fn encode(table: &WireTable, new: &[&[u8]], base: &[&[u8]]) -> Vec<u8> {
        encode_counted(table, new, base).0
    }

    /// [`encode`] and the number of elements whose bytes differ (what
    /// [`WireKernels::finish_encode_counted`] reports).
    pub fn encode_counted(table: &WireTable, new: &[&[u8]], base: &[&[u8]]) -> (Vec<u8>, u64) {
        let segs = &table.segs;
        let m = segs.len();
        assert!(
            new.len() == m && base.len() == m,
            "one new and one base per segment"
        );
        // where each chunk's 256 s bytes of scratch start
        let mut chunk_at = Vec::with_capacity(table.chunks as usize);
        for (i, s) in segs.iter().enumerate() {
            for local in 0..s.n.div_ceil(CHUNK as u64) {
                chunk_at.push(table.scratch_at[i] + local * (CHUNK as u64) * s.elem as u64);
            }
        }
        // 1. compare: a word per chunk; the sparse chunks' bytes of each run of RUN chunks
        // appended to the run's stream, at its first chunk's place in the scratch
        let mut words = vec![(0u32, 0u8); table.chunks as usize];
        let mut scratch = vec![0u8; table.scratch as usize];
        let mut changed = 0u64;
        let mut fill = 0usize;
        let mut k = 0usize;
        for (i, s) in segs.iter().enumerate() {
            let e = s.elem as usize;
            for local in 0..s.n.div_ceil(CHUNK as u64) {
                if k as u64 % RUN == 0 {
                    fill = chunk_at[k] as usize;
                }
                let (size, count, bytes, c) = compare_counted(new[i], base[i], e, local);
                words[k] = (size, count);
                changed += c;
                scratch[fill..fill + bytes.len()].copy_from_slice(&bytes);
                fill += bytes.len();
                k += 1;
            }
        }
        // 2. tile sums, and each segment's in-tile prefix at its first chunk
        let tiles = table.tiles() as usize;
        let mut tile = vec![0u64; tiles];
        let mut start = vec![0u64; m];
        for (t, sum) in tile.iter_mut().enumerate() {
            let t0 = t * TILE as usize;
            let t1 = (t0 + TILE as usize).min(words.len());
            let mut pre = vec![0u64; t1 - t0 + 1];
            for k in t0..t1 {
                pre[k - t0 + 1] = pre[k - t0] + words[k].0 as u64;
            }
            *sum = pre[t1 - t0];
            for (i, &f) in table.first.iter().enumerate() {
                if (t0 as u64..t1 as u64).contains(&f) {
                    start[i] = pre[f as usize - t0];
                }
            }
        }
        // 3. plan: the tiles' prefix, each segment's form, length and offset
        let mut total = 0u64;
        for v in tile.iter_mut() {
            (*v, total) = (total, total + *v);
        }
        for (i, st) in start.iter_mut().enumerate() {
            let f = table.first[i];
            *st = if f >= table.chunks {
                total
            } else {
                tile[(f / TILE) as usize] + *st
            };
        }
        let mut frame = vec![0u8; header_len(m)];
        frame[0..4].copy_from_slice(&(m as u32).to_le_bytes());
        let mut plan = Vec::with_capacity(m);
        for (i, s) in segs.iter().enumerate() {
            let end = if i + 1 < m { start[i + 1] } else { total };
            let body = end - start[i];
            let sparse = 1 + s.n.div_ceil(CHUNK as u64) + body;
            let dense = s.n * s.elem as u64;
            let (tag, len) = if body == 0 {
                (TAG_UNCHANGED, 1)
            } else if dense < sparse {
                (TAG_DENSE, 1 + dense)
            } else {
                (TAG_SPARSE, sparse)
            };
            frame[4 + 4 * i..8 + 4 * i].copy_from_slice(&(len as u32).to_le_bytes());
            plan.push((frame.len() as u64, tag));
            frame.push(tag);
            frame.resize(frame.len() + len as usize - 1, 0);
        }
        // 4. write: each chunk's count byte and payload at its place, a sparse chunk's from
        // its run's stream (after the staged bytes of the run's chunks before it), a whole
        // chunk's from new
        let mut staged = 0u64;
        for (i, s) in segs.iter().enumerate() {
            let e = s.elem as usize;
            let (off, tag) = plan[i];
            let nch = s.n.div_ceil(CHUNK as u64);
            let mut at = start[i];
            for local in 0..nch {
                let k = (table.first[i] + local) as usize;
                if k as u64 % RUN == 0 {
                    staged = 0;
                }
                let run = chunk_at[k - k % RUN as usize];
                let first = local as usize * CHUNK;
                let len = (s.n as usize - first).min(CHUNK);
                let chunk_new = &new[i][first * e..(first + len) * e];
                let (size, count) = words[k];
                match tag {
                    TAG_DENSE => {
                        let d = (off + 1) as usize + first * e;
                        frame[d..d + len * e].copy_from_slice(chunk_new);
                    }
                    TAG_SPARSE => {
                        frame[(off + 1 + local) as usize] = count;
                        let d = (off + 1 + nch + (at - start[i])) as usize;
                        let src: &[u8] = if count == DENSE_CHUNK {
                            chunk_new
                        } else {
                            let r = (run + staged) as usize;
                            &scratch[r..r + size as usize]
                        };
                        frame[d..d + size as usize].copy_from_slice(src);
                    }
                    _ => {}
                }
                at += size as u64;
                if count != DENSE_CHUNK {
                    staged += size as u64;
                }
            }
        }
        (frame, changed)
    }

    /// Applies `frame` to `dst` (segment `i`'s destination bytes in `dst[i]`) as the decode
    /// kernels do, with their checks and their status: header, tags and lengths before any
    /// write; a chunk with bad offsets left unwritten and the frame failed.
    pub fn decode(table: &WireTable, frame: &[u8], dst: &mut [&mut [u8]]) -> Result<(), CudaError> {
        let segs = &table.segs;
        let m = segs.len();
        let mut status = NO_ERROR;
        let fail =
            |st: &mut u64, seg: usize, code: u32| *st = (*st).min(seg as u64 * 256 + code as u64);
        // read_header
        let head = header_len(m);
        if frame.len() < head {
            fail(&mut status, 0, E_HEADER);
            return Err(wire_error(status));
        }
        let word = |i: usize| u32::from_le_bytes(frame[i..i + 4].try_into().unwrap_or([0; 4]));
        if word(0) as usize != m {
            fail(&mut status, 0, E_COUNT);
            return Err(wire_error(status));
        }
        let mut off = vec![0u64; m];
        let mut lens = vec![0u64; m];
        let mut carry = head as u64;
        for i in 0..m {
            lens[i] = word(4 + 4 * i) as u64;
            off[i] = carry;
            carry += lens[i];
            if lens[i] == 0 {
                fail(&mut status, i, E_EMPTY);
            }
        }
        if carry != frame.len() as u64 {
            fail(&mut status, 0, E_LENGTHS);
            return Err(wire_error(status));
        }
        let mut tags = vec![0u8; m];
        for (i, s) in segs.iter().enumerate() {
            if lens[i] == 0 {
                continue;
            }
            let tag = frame[off[i] as usize];
            tags[i] = tag;
            let nch = s.n.div_ceil(CHUNK as u64);
            match tag {
                TAG_GAPS => fail(&mut status, i, E_GAPS),
                t if t > TAG_GAPS => fail(&mut status, i, E_TAG),
                TAG_UNCHANGED if lens[i] != 1 => fail(&mut status, i, E_SEGLEN),
                TAG_DENSE if lens[i] != 1 + s.n * s.elem as u64 => fail(&mut status, i, E_SEGLEN),
                TAG_SPARSE if lens[i] < 1 + nch => fail(&mut status, i, E_SEGLEN),
                _ => {}
            }
        }
        if status != NO_ERROR {
            return Err(wire_error(status));
        }
        // decode_sums and decode_plan: payload bytes per chunk, each sparse segment's sum
        let mut sizes: Vec<Vec<(u64, u8)>> = vec![vec![]; m];
        let mut bodies = vec![0u64; m];
        for (i, s) in segs.iter().enumerate() {
            if tags[i] != TAG_SPARSE {
                continue;
            }
            let e = s.elem as u64;
            let nch = s.n.div_ceil(CHUNK as u64);
            let mut body = 0u64;
            for local in 0..nch {
                let len = (s.n - local * CHUNK as u64).min(CHUNK as u64);
                let count = frame[(off[i] + 1 + local) as usize];
                let size = if count == DENSE_CHUNK {
                    len * e
                } else {
                    if count as u64 > len {
                        fail(&mut status, i, E_CHUNK);
                    }
                    count as u64 * (1 + e)
                };
                sizes[i].push((size, count));
                body += size;
            }
            bodies[i] = body;
        }
        if status != NO_ERROR {
            return Err(wire_error(status));
        }
        for (i, s) in segs.iter().enumerate() {
            if tags[i] == TAG_SPARSE && 1 + s.n.div_ceil(CHUNK as u64) + bodies[i] != lens[i] {
                fail(&mut status, i, E_SEGLEN);
            }
        }
        if status != NO_ERROR {
            return Err(wire_error(status));
        }
        // apply
        for (i, s) in segs.iter().enumerate() {
            let e = s.elem as usize;
            let d = &mut *dst[i];
            let nch = s.n.div_ceil(CHUNK as u64) as usize;
            match tags[i] {
                TAG_DENSE => {
                    let o = off[i] as usize + 1;
                    d[..s.n as usize * e].copy_from_slice(&frame[o..o + s.n as usize * e]);
                }
                TAG_SPARSE => {
                    let mut at = off[i] as usize + 1 + nch;
                    for (local, &(size, count)) in sizes[i].iter().enumerate() {
                        let first = local * CHUNK;
                        let len = (s.n as usize - first).min(CHUNK);
                        let p = &frame[at..at + size as usize];
                        at += size as usize;
                        if count == DENSE_CHUNK {
                            d[first * e..(first + len) * e].copy_from_slice(p);
                            continue;
                        }
                        let c = count as usize;
                        let ok =
                            (0..c).all(|j| (p[j] as usize) < len && (j == 0 || p[j] > p[j - 1]));
                        if !ok {
                            fail(&mut status, i, E_OFFSET);
                            continue;
                        }
                        for j in 0..c {
                            let t = (first + p[j] as usize) * e;
                            d[t..t + e].copy_from_slice(&p[c + j * e..c + (j + 1) * e]);
                        }
                    }
                }
                _ => {}
            }
        }
        if status != NO_ERROR {
            return Err(wire_error(status));
        }
        Ok(())
    }
}

/// The wire kernels, loaded on one device.
pub struct WireKernels {
    k: Vec<Kernel>,
    compare_blocks: u32,
}

/// Device memory for one table: the table itself, a word per chunk, the tiles, the plan, the
/// status words and (for encoding) the scratch regions.
pub struct WireWork {
    table: DeviceBuffer,
    words: DeviceBuffer,
    tiles: DeviceBuffer,
    plan: DeviceBuffer,
    status: DeviceBuffer,
    scratch: Option<DeviceBuffer>,
    nsegs: u32,
    chunks: u64,
    ntiles: u32,
    max_frame: u64,
    scratch_need: u64,
}

impl WireWork {
    /// The longest frame of its table (the encoder's output buffer holds at least this).
    pub fn max_frame_len(&self) -> u64 {
        self.max_frame
    }

    /// Bytes of scratch an encode of its table needs ([`WireTable::scratch_bytes`]).
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch_need
    }

    /// Device bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.table.len()
            + self.words.len()
            + self.tiles.len()
            + self.plan.len()
            + self.status.len()
            + self.scratch.as_ref().map_or(0, |s| s.len())
    }
}

impl WireKernels {
    /// Loads the kernels on `dev` (the sm_90 cubin where the device takes it, else the PTX).
    pub fn load(dev: &Device) -> Result<WireKernels, CudaError> {
        let k = NAMES
            .iter()
            .map(|n| Kernel::load(dev, WIRE_PTX, WIRE_CUBIN_SM90, n))
            .collect::<Result<Vec<_>, _>>()?;
        let compare_blocks =
            sys::device_sm_count(dev.ordinal()).unwrap_or(132) * COMPARE_BLOCKS_PER_SM;
        Ok(WireKernels { k, compare_blocks })
    }

    /// Which image loaded (`"cubin sm_90"` or `"ptx"`).
    pub fn image(&self) -> &'static str {
        self.k[0].image
    }

    /// Uploads `table` and allocates its workspace on `dev` (`encode`: with the scratch
    /// regions the encoder writes).
    pub fn prepare(
        &self,
        dev: &Device,
        table: &WireTable,
        encode: bool,
    ) -> Result<WireWork, CudaError> {
        let t = table.bytes();
        let tb = dev.alloc((t.len() as u64).max(16))?;
        if !t.is_empty() {
            tb.upload(0, &t)?;
        }
        let chunks = table.chunks();
        let ntiles = table.tiles();
        Ok(WireWork {
            table: tb,
            words: dev.alloc((4 * chunks).max(16))?,
            tiles: dev.alloc((8 * ntiles).max(16))?,
            plan: dev.alloc((PLAN_BYTES * table.segs.len() as u64).max(16))?,
            status: dev.alloc(STATUS_BYTES)?,
            scratch: if encode {
                Some(dev.alloc(table.scratch_bytes().max(16))?)
            } else {
                None
            },
            nsegs: table.segs.len() as u32,
            chunks,
            ntiles: ntiles as u32,
            max_frame: table.max_frame_len(),
            scratch_need: table.scratch_bytes(),
        })
    }

    fn launch(
        &self,
        which: usize,
        blocks: u32,
        threads: u32,
        s: &Stream,
        args: &mut [KernelArg],
    ) -> Result<(), CudaError> {
        self.k[which].dev_bind()?;
        // SAFETY: each call below passes exactly the kernel's parameters (`delta_wire.cu`),
        // over the work's buffers and the addresses its caller vouched for.
        unsafe { sys::launch_args(self.k[which].func, blocks, (threads, 1), s.raw, args) }
    }

    /// Queues the encoding of `w`'s table into `frame` on `s`; [`WireKernels::finish_encode`]
    /// then gives the frame's length.
    ///
    /// # Safety
    ///
    /// Every segment of the table must lie in device memory of the kernels' device (new and
    /// base, `n * elem` bytes each) and `frame` must hold `w.max_frame_len()` bytes there,
    /// 4-byte aligned, all of it allocated until the encode has finished on `s` and the frame
    /// written by nothing else meanwhile.
    pub unsafe fn launch_encode(
        &self,
        s: &Stream,
        w: &WireWork,
        frame: u64,
    ) -> Result<(), CudaError> {
        let Some(scratch) = &w.scratch else {
            return Err(CudaError::DeltaWire(
                "this work was prepared for decoding; prepare it with encode = true, or pass a scratch buffer (launch_encode_in)".into(),
            ));
        };
        // SAFETY: the work's own scratch, allocated at the size of its table's.
        unsafe { self.launch_encode_in(s, w, frame, scratch.ptr(), scratch.len()) }
    }

    /// [`WireKernels::launch_encode`] with the encoder's scratch at `scratch` (`scratch_len`
    /// bytes, at least [`WireWork::scratch_bytes`], 16-byte aligned) instead of the work's own: one scratch
    /// serves every table encoded one after another on one stream (a work prepared with
    /// `encode = false` then holds no scratch of its own).
    ///
    /// # Safety
    ///
    /// As [`WireKernels::launch_encode`], and `scratch` must be device memory of `scratch_len`
    /// bytes that nothing else uses until the encode has finished on `s`.
    pub unsafe fn launch_encode_in(
        &self,
        s: &Stream,
        w: &WireWork,
        frame: u64,
        scratch: u64,
        scratch_len: u64,
    ) -> Result<(), CudaError> {
        if scratch_len < w.scratch_need {
            return Err(CudaError::DeltaWire(format!(
                "a scratch of {scratch_len} bytes for a table whose encode needs {}",
                w.scratch_need
            )));
        }
        if frame % 4 != 0 {
            return Err(CudaError::DeltaWire(format!(
                "the frame buffer {frame:#x} is not 4-byte aligned"
            )));
        }
        if scratch % 16 != 0 {
            return Err(CudaError::DeltaWire(format!(
                "the scratch buffer {scratch:#x} is not 16-byte aligned (the compare kernel writes it 16 bytes a lane)"
            )));
        }
        // the frame's length and the first error all ones, the changed elements 0
        w.status.fill_u32(u32::MAX, s)?;
        // SAFETY: words 4 and 5 of the work's own 32-byte status buffer.
        unsafe { w.status.device().fill_u32(w.status.ptr() + 16, 4, 0, s)? };
        let (t, n, c) = (w.table.ptr(), w.nsegs, w.chunks);
        if c > 0 {
            self.launch(
                0,
                self.compare_blocks,
                256,
                s,
                &mut [
                    KernelArg::U64(t),
                    KernelArg::U32(n),
                    KernelArg::U64(c),
                    KernelArg::U64(w.words.ptr()),
                    KernelArg::U64(scratch),
                    KernelArg::U64(w.status.ptr()),
                ],
            )?;
            self.launch(
                1,
                w.ntiles,
                256,
                s,
                &mut [
                    KernelArg::U64(t),
                    KernelArg::U32(n),
                    KernelArg::U64(c),
                    KernelArg::U64(w.words.ptr()),
                    KernelArg::U64(w.tiles.ptr()),
                    KernelArg::U64(w.plan.ptr()),
                ],
            )?;
        }
        self.launch(
            2,
            1,
            1024,
            s,
            &mut [
                KernelArg::U64(t),
                KernelArg::U32(n),
                KernelArg::U64(c),
                KernelArg::U64(w.tiles.ptr()),
                KernelArg::U32(w.ntiles),
                KernelArg::U64(w.plan.ptr()),
                KernelArg::U64(frame),
                KernelArg::U64(w.status.ptr()),
            ],
        )?;
        if c > 0 {
            self.launch(
                3,
                w.ntiles,
                256,
                s,
                &mut [
                    KernelArg::U64(t),
                    KernelArg::U32(n),
                    KernelArg::U64(c),
                    KernelArg::U64(w.words.ptr()),
                    KernelArg::U64(w.tiles.ptr()),
                    KernelArg::U64(w.plan.ptr()),
                    KernelArg::U64(scratch),
                    KernelArg::U64(frame),
                    KernelArg::U64(w.status.ptr()),
                ],
            )?;
        }
        Ok(())
    }

    /// Waits for `s` and reads the status: the frame's length, or what went wrong.
    pub fn finish_encode(&self, s: &Stream, w: &WireWork) -> Result<u64, CudaError> {
        Ok(self.finish_encode_counted(s, w)?.0)
    }

    /// [`WireKernels::finish_encode`] and the number of elements of the table whose bytes
    /// differ between new and base (counted by the compare kernel, dense chunks and segments
    /// included).
    pub fn finish_encode_counted(&self, s: &Stream, w: &WireWork) -> Result<(u64, u64), CudaError> {
        let (len, err, changed) = self.status(s, w)?;
        if err != NO_ERROR {
            return Err(wire_error(err));
        }
        Ok((len, changed))
    }

    /// Queues applying the `frame_len`-byte frame at `frame` to `w`'s table (its segments'
    /// `src` are the destinations, written in place) on `s`; [`WireKernels::finish_decode`]
    /// then says whether it applied.
    ///
    /// # Safety
    ///
    /// The destinations (`n * elem` bytes each) and the frame (`frame_len` bytes, 4-byte
    /// aligned) must lie in device memory of the kernels' device, allocated until the decode
    /// has finished on `s`, the destinations used by nothing else meanwhile.
    pub unsafe fn launch_decode(
        &self,
        s: &Stream,
        w: &WireWork,
        frame: u64,
        frame_len: u64,
    ) -> Result<(), CudaError> {
        if frame % 4 != 0 {
            return Err(CudaError::DeltaWire(format!(
                "the frame buffer {frame:#x} is not 4-byte aligned"
            )));
        }
        w.status.fill_u32(u32::MAX, s)?;
        let (t, n, c) = (w.table.ptr(), w.nsegs, w.chunks);
        self.launch(
            4,
            1,
            1024,
            s,
            &mut [
                KernelArg::U64(t),
                KernelArg::U32(n),
                KernelArg::U64(frame),
                KernelArg::U64(frame_len),
                KernelArg::U64(w.plan.ptr()),
                KernelArg::U64(w.status.ptr()),
            ],
        )?;
        if c > 0 {
            self.launch(
                5,
                w.ntiles,
                256,
                s,
                &mut [
                    KernelArg::U64(t),
                    KernelArg::U32(n),
                    KernelArg::U64(c),
                    KernelArg::U64(frame),
                    KernelArg::U64(w.plan.ptr()),
                    KernelArg::U64(w.status.ptr()),
                    KernelArg::U64(w.words.ptr()),
                    KernelArg::U64(w.tiles.ptr()),
                ],
            )?;
        }
        // always: with no chunk at all it still checks every sparse segment's length
        self.launch(
            6,
            1,
            1024,
            s,
            &mut [
                KernelArg::U64(t),
                KernelArg::U32(n),
                KernelArg::U64(c),
                KernelArg::U64(w.tiles.ptr()),
                KernelArg::U32(w.ntiles),
                KernelArg::U64(w.plan.ptr()),
                KernelArg::U64(w.status.ptr()),
            ],
        )?;
        if c > 0 {
            self.launch(
                7,
                w.ntiles,
                256,
                s,
                &mut [
                    KernelArg::U64(t),
                    KernelArg::U32(n),
                    KernelArg::U64(c),
                    KernelArg::U64(frame),
                    KernelArg::U64(w.words.ptr()),
                    KernelArg::U64(w.tiles.ptr()),
                    KernelArg::U64(w.plan.ptr()),
                    KernelArg::U64(w.status.ptr()),
                ],
            )?;
        }
        Ok(())
    }

    /// Waits for `s` and reads the status of a decode.
    pub fn finish_decode(&self, s: &Stream, w: &WireWork) -> Result<(), CudaError> {
        let (_, err, _) = self.status(s, w)?;
        if err != NO_ERROR {
            return Err(wire_error(err));
        }
        Ok(())
    }

    fn status(&self, s: &Stream, w: &WireWork) -> Result<(u64, u64, u64), CudaError> {
        s.sync()?;
        let mut b = [0u8; 24];
        w.status.download(0, &mut b)?;
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        Ok((word(0), word(8), word(16)))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use awex_core::encoding::delta::Forms;
    use awex_core::encoding::delta_frame;
    use awex_core::weights::{Stepped, Weights, splitmix};

    /// A base of `n` random `elem`-byte elements and a new version with each element changed
    /// (one byte of it) where a hash of its index falls under `fraction`; `fraction` 1 changes
    /// every element.
    pub(crate) fn masked(n: usize, elem: usize, fraction: f64, seed: u64) -> (Vec<u8>, Vec<u8>) {
        let base: Vec<u8> = (0..n * elem)
            .map(|i| splitmix(seed ^ ((i as u64) << 1)) as u8)
            .collect();
        let mut new = base.clone();
        let th = (fraction.clamp(0.0, 1.0) * 2f64.powi(32)) as u64;
        for i in 0..n {
            let h = splitmix(seed.wrapping_mul(31) ^ i as u64);
            if (h >> 32) < th || fraction >= 1.0 {
                new[i * elem + (h as usize % elem)] ^= 1 + (h >> 8) as u8 % 255;
            }
        }
        (base, new)
    }

    /// Two consecutive versions of a `[rows, cols]` bf16 tensor made by the calibrated
    /// optimiser-like step at `lr` (awex_core::weights::Stepped).
    pub(crate) fn stepped(rows: u64, cols: u64, lr: f64, version: u64) -> (Vec<u8>, Vec<u8>) {
        let cat = awex_core::synthetic::catalogue(&[vec![rows, cols]]);
        let w = Weights::Stepped(std::sync::Arc::new(Stepped::new(&cat, lr, None)));
        let base = w.tensor(&cat, "t0", version - 1).unwrap();
        let new = w.tensor(&cat, "t0", version).unwrap();
        (base, new)
    }

    /// Elements whose bytes differ.
    pub(crate) fn count_changed(base: &[u8], new: &[u8], elem: usize) -> u64 {
        base.chunks_exact(elem)
            .zip(new.chunks_exact(elem))
            .filter(|(a, b)| a != b)
            .count() as u64
    }

    fn changed(base: &[u8], new: &[u8], elem: usize) -> f64 {
        count_changed(base, new, elem) as f64 / (base.len() / elem).max(1) as f64
    }

    /// A table of host segments (addresses are fake: the emulation reads the slices).
    fn table_of(segs: &[(usize, &[u8])]) -> WireTable {
        let s: Vec<WireSegment> = segs
            .iter()
            .enumerate()
            .map(|(i, &(e, b))| WireSegment {
                src: 1 << 40 | (i as u64) << 32,
                base: 2 << 40 | (i as u64) << 32,
                n: (b.len() / e) as u64,
                elem: e as u32,
            })
            .collect();
        WireTable::new(&s).unwrap()
    }

    /// The emulated frame of `segs` (elem, base, new) must equal the CPU encoder's frame with
    /// the GPU's forms, decode with the CPU decoder to the new bytes, and decode with the
    /// emulated kernels to the same.
    pub(crate) fn check(segs: &[(usize, Vec<u8>, Vec<u8>)], what: &str) -> Vec<u8> {
        let table = table_of(
            &segs
                .iter()
                .map(|(e, b, _)| (*e, b.as_slice()))
                .collect::<Vec<_>>(),
        );
        let news: Vec<&[u8]> = segs.iter().map(|s| s.2.as_slice()).collect();
        let bases: Vec<&[u8]> = segs.iter().map(|s| s.1.as_slice()).collect();
        let (frame, counted) = host::encode_counted(&table, &news, &bases);
        assert!(frame.len() as u64 <= table.max_frame_len(), "{what}");
        let want: u64 = segs.iter().map(|(e, b, n)| count_changed(b, n, *e)).sum();
        assert_eq!(counted, want, "{what}: changed elements");
        // the CPU encoder with the GPU's forms writes the same bytes
        let view: Vec<(&[u8], &[u8], usize)> = segs
            .iter()
            .map(|(e, b, n)| (b.as_slice(), n.as_slice(), *e))
            .collect();
        let mut cpu = vec![];
        delta_frame::encode_frame(&view, Forms::NoGaps, &mut cpu).unwrap();
        assert!(
            cpu == frame,
            "{what}: the emulated frame differs from the CPU encoder's"
        );
        // the CPU decoder is the judge
        let mut got: Vec<Vec<u8>> = segs.iter().map(|s| s.1.clone()).collect();
        let mut refs: Vec<&mut [u8]> = got.iter_mut().map(|g| g.as_mut_slice()).collect();
        let elems: Vec<usize> = segs.iter().map(|s| s.0).collect();
        delta_frame::apply_frame(&frame, &elems, &mut refs).unwrap();
        for (g, s) in got.iter().zip(segs) {
            assert!(
                g == &s.2,
                "{what}: the CPU decoder does not give the new bytes"
            );
        }
        delta_frame::gpu_decodable(&frame, segs.len()).unwrap();
        // and the emulated decoder
        let mut got: Vec<Vec<u8>> = segs.iter().map(|s| s.1.clone()).collect();
        let mut refs: Vec<&mut [u8]> = got.iter_mut().map(|g| g.as_mut_slice()).collect();
        host::decode(&table, &frame, &mut refs).unwrap();
        for (g, s) in got.iter().zip(segs) {
            assert!(
                g == &s.2,
                "{what}: the emulated decoder does not give the new bytes"
            );
        }
        frame
    }

    #[test]
    fn emulated_frames_of_optimiser_steps_are_the_cpu_encoders_and_decode_to_the_new_version() {
        // bf16 by the calibrated step: about 0.1 %, 1 %, 3 % and 30 % of elements changed
        for (lr, lo, hi) in [
            (1e-7, 0.0003, 0.003),
            (1e-6, 0.005, 0.02),
            (3e-6, 0.015, 0.05),
            (3e-5, 0.15, 0.45),
        ] {
            let (b, n) = stepped(96, 1000, lr, 2);
            let d = changed(&b, &n, 2);
            assert!((lo..hi).contains(&d), "lr {lr}: {d}");
            let f = check(&[(2, b, n)], &format!("bf16 lr {lr}"));
            assert_eq!(f[8], TAG_SPARSE, "lr {lr}");
        }
        // none and every element, each element size, odd lengths
        for elem in [1usize, 2, 4] {
            for n in [1usize, 7, 255, 256, 257, 1000, 4099] {
                for f in [0.0, 0.001, 0.01, 0.03, 0.3, 1.0] {
                    let (b, nw) = masked(n, elem, f, (n * 10 + elem) as u64);
                    check(&[(elem, b, nw)], &format!("elem {elem} n {n} density {f}"));
                }
            }
        }
    }

    #[test]
    fn emulated_frames_of_many_segments_cross_tiles_and_keep_every_form() {
        // segments of every size and form, empty ones between, over several tiles of 1024
        // chunks (a tile is 256 Ki elements)
        let mut segs = vec![];
        let mut k = 0u64;
        for (elem, n, f) in [
            (2usize, 0usize, 0.0),
            (2, 300_001, 0.01),
            (1, 5, 1.0),
            (4, 0, 0.0),
            (4, 70_000, 0.0),
            (1, 400_000, 0.003),
            (2, 1, 1.0),
            (4, 200_000, 0.3),
            (2, 90_000, 1.0),
            (2, 0, 0.0),
        ] {
            k += 1;
            let (b, n) = masked(n, elem, f, k);
            segs.push((elem, b, n));
        }
        let frame = check(&segs, "many segments");
        let tags = delta_frame::frame_tags(&frame, segs.len()).unwrap();
        assert_eq!(
            tags,
            vec![2, 1, 0, 2, 2, 1, 0, 1, 0, 2],
            "unchanged, sparse and dense segments where expected"
        );
        let table = table_of(
            &segs
                .iter()
                .map(|(e, b, _)| (*e, b.as_slice()))
                .collect::<Vec<_>>(),
        );
        assert!(table.tiles() > 3);
    }

    #[test]
    fn emulated_runs_span_segments_of_every_element_size() {
        // segments of a few chunks each, so that every run of RUN chunks holds several of
        // every element size (its stream mixes them), runs ending inside segments, and chunks
        // with no change, sparse ones and whole ones side by side
        let mut segs = vec![];
        let mut total = 0u64;
        for i in 0..300u64 {
            let elem = [1usize, 2, 4][i as usize % 3];
            let n = 37 + (i as usize * 97) % 1500;
            let f = [0.0, 0.01, 0.05, 0.6, 1.0][i as usize % 5];
            let (b, nw) = masked(n, elem, f, 100 + i);
            total += (n as u64).div_ceil(CHUNK as u64);
            segs.push((elem, b, nw));
        }
        assert!(total > 2 * RUN, "{total} chunks");
        let frame = check(&segs, "mixed runs");
        let tags = delta_frame::frame_tags(&frame, segs.len()).unwrap();
        for t in [TAG_DENSE, TAG_SPARSE, TAG_UNCHANGED] {
            assert!(tags.contains(&t), "tag {t} in {tags:?}");
        }
    }

    #[test]
    fn a_dropped_change_fails_the_check_and_a_gaps_frame_is_refused() {
        let (b, n) = stepped(64, 1000, 1e-6, 3);
        let table = table_of(&[(2, &b)]);
        let frame = host::encode(&table, &[&n], &[&b]);
        // the emulation with one change dropped (the first changed element left at the base
        // in the new version it reads) gives a frame the CPU decoder turns into other bytes
        let first = (0..n.len() / 2)
            .find(|&i| n[2 * i..2 * i + 2] != b[2 * i..2 * i + 2])
            .unwrap();
        let mut dropped = n.clone();
        dropped[2 * first..2 * first + 2].copy_from_slice(&b[2 * first..2 * first + 2]);
        let planted = host::encode(&table, &[&dropped], &[&b]);
        assert_ne!(planted, frame);
        let mut got = b.clone();
        delta_frame::apply_frame(&planted, &[2], &mut [&mut got]).unwrap();
        let wrong: Vec<usize> = (0..n.len() / 2)
            .filter(|&i| got[2 * i..2 * i + 2] != n[2 * i..2 * i + 2])
            .collect();
        assert_eq!(wrong, vec![first], "exactly the dropped element is wrong");
        // the CPU encoder's own frame of the same step uses the gaps form: refused by the
        // GPU decoder (emulated) before anything is written, naming the segment
        let mut cpu = vec![];
        delta_frame::encode_frame(&[(&b, &n, 2)], Forms::All, &mut cpu).unwrap();
        assert_eq!(delta_frame::frame_tags(&cpu, 1).unwrap(), vec![TAG_GAPS]);
        let mut dst = b.clone();
        let e = host::decode(&table, &cpu, &mut [&mut dst]).unwrap_err();
        assert!(
            e.to_string()
                .contains("segment 0 is a gaps segment (tag 3)"),
            "{e}"
        );
        assert_eq!(dst, b, "nothing written");
    }

    #[test]
    fn malformed_frames_are_refused_by_the_emulated_decoder_with_the_kernels_status() {
        let (b1, n1) = masked(3000, 2, 0.02, 1);
        let (b2, n2) = masked(600, 4, 1.0, 2);
        let table = table_of(&[(2, &b1), (4, &b2)]);
        let f = host::encode(&table, &[&n1, &n2], &[&b1, &b2]);
        let run = |frame: &[u8]| {
            let (mut d1, mut d2) = (b1.clone(), b2.clone());
            host::decode(&table, frame, &mut [&mut d1, &mut d2]).map(|_| (d1, d2))
        };
        assert_eq!(run(&f).unwrap(), (n1.clone(), n2.clone()));
        let msg = |frame: &[u8]| run(frame).unwrap_err().to_string();
        assert!(msg(&f[..7]).contains("shorter than its header"));
        let mut c = f.clone();
        c[0] = 3;
        assert!(msg(&c).contains("segment count differs"));
        assert!(msg(&f[..f.len() - 1]).contains("do not sum"));
        let l0 = u32::from_le_bytes(f[4..8].try_into().unwrap()) as usize;
        let mut t = f.clone();
        t[12 + l0] = 9;
        assert!(msg(&t).contains("segment 1's tag is none"), "{}", msg(&t));
        // a chunk count above its chunk: the last chunk of segment 0 has 3000 - 11 * 256 = 184
        assert_eq!(f[12], TAG_SPARSE);
        let mut k = f.clone();
        k[12 + 1 + 11] = 200;
        assert!(
            msg(&k).contains("segment 0: a chunk counts more"),
            "{}",
            msg(&k)
        );
        // offsets out of order in the first sparse chunk with two or more changes
        let counts = &f[13..13 + 12];
        let c0 = counts.iter().position(|&c| (2..255).contains(&c)).unwrap();
        let mut at = 13 + 12;
        for &c in &counts[..c0] {
            at += if c == 255 { 512 } else { c as usize * 3 };
        }
        let mut o = f.clone();
        o.swap(at, at + 1);
        assert!(
            msg(&o).contains("offsets are not increasing"),
            "{}",
            msg(&o)
        );
        // element sizes and lengths the kernels do not take
        let e = WireTable::new(&[WireSegment {
            src: 0,
            base: 0,
            n: 4,
            elem: 8,
        }])
        .unwrap_err();
        assert!(e.to_string().contains("element size 8 is none of 1 (e4m3)"));
        let e = WireTable::new(&[WireSegment {
            src: 0,
            base: 0,
            n: 1 << 31,
            elem: 2,
        }])
        .unwrap_err();
        assert!(e.to_string().contains("split it"));
    }

    #[test]
    fn wire_ptx_holds_every_entry_and_the_cubin_is_an_elf() {
        assert!(WIRE_PTX.ends_with('\0'));
        assert_eq!(WIRE_PTX.matches('\0').count(), 1);
        for n in NAMES {
            let n = n.to_str().unwrap();
            assert!(WIRE_PTX.contains(&format!(".visible .entry {n}(")), "{n}");
        }
        assert!(WIRE_CUBIN_SM90.starts_with(b"\x7fELF"));
    }
}
