//! Exact deltas: the elements of a payload that differ from the version the receiver holds,
//! encoded densely or sparsely, whichever is smaller.
//!
//! A delta is an encoding of a transfer's payload, not a new plan: the sender packs the bytes a
//! transfer would move (destination dtype; for an FP8 destination its e4m3 bytes and scales)
//! for the new version and for the base version, and encodes each *segment* (one piece's
//! elements of one element size) against the base. The receiver holds the base in its
//! destination tensors and writes only the changed elements; the result is bit-identical to a
//! dense update. Measured on optimiser-made versions (lr 1e-6, bf16), a few per cent of
//! elements change per step, and a few tenths of a per cent of FP8 bytes: every 128 x 128 block
//! and nearly every 64 KiB chunk hold a change, so the unit is the element
//! (`bench/delta_density.py`, docs/deltas.md).
//!
//! # Wire format of one segment (`n` elements of `s` bytes, both known to both ends from the plan)
//!
//! ```text
//! segment  := tag:u8 body
//! tag 0    dense:      n * s value bytes (the whole segment)
//! tag 1    sparse:     counts[ceil(n / 256)]:u8, then per chunk of 256 elements, in order:
//!                        count 255: the whole chunk's values (min(256, rest) * s bytes)
//!                        count c < 255: c local offsets (u8, strictly increasing), c * s values
//! tag 2    unchanged:  no body
//! tag 3    gaps:       c:u32 (changed elements, 1..=n), k:u8 (0..=31), the c gaps
//!                      Rice-coded with parameter k, bit-packed, then c * s values
//! ```
//!
//! Values are the elements' bytes as they sit in memory (little-endian). A *gap* is an index
//! minus the previous index minus one (the first index itself); its Rice code is `gap >> k` one
//! bits, a zero bit, then the `k` low bits of `gap`, least significant first. Bits fill each
//! byte from its least significant bit; the last byte is padded with zeros.
//!
//! The encoder picks, per segment, the smallest of the four (in the sparse form, per chunk
//! dense (255) where `c * (1 + s) >= chunk * s`), and for the gaps the `k` that gives the
//! fewest bits. With changes spread as an optimiser spreads them, the gaps cost about 1.2
//! bytes per change at 0.3 % of e4m3 bytes changed and 0.8 at 3 % of bf16 elements (the sparse
//! form: 2.1 and 1.1), near the entropy of the changed set. Decoding checks every count,
//! offset, index and length against the segment and the buffer before it writes: a malformed
//! delta is an error naming what is wrong, never a panic or a write outside the segment.
//!
//! A bucket's segments can travel together in a frame that a GPU decoder can split without
//! parsing them ([`super::delta_frame`]); the GPU encoder writes the dense, sparse and
//! unchanged forms only ([`Forms::NoGaps`]).

use thiserror::Error;

/// Elements per chunk of a sparse segment.
pub const CHUNK: usize = 256;
/// The count byte of a chunk sent whole.
pub const DENSE_CHUNK: u8 = 255;

/// The tag of a dense segment.
pub const TAG_DENSE: u8 = 0;
/// The tag of a sparse segment.
pub const TAG_SPARSE: u8 = 1;
/// The tag of an unchanged segment.
pub const TAG_UNCHANGED: u8 = 2;
/// The tag of a gaps (Rice-coded) segment.
pub const TAG_GAPS: u8 = 3;
/// The largest Rice parameter of a gaps segment (gaps are below 2^32).
const MAX_RICE_K: u8 = 31;
/// Bytes of a gaps segment before its bits: tag, count, parameter.
const GAPS_HEADER: usize = 1 + 4 + 1;

/// A malformed or mismatched delta.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DeltaError {
    /// The buffer ended inside a segment.
    #[error("delta segment of {n} elements ends early: needs {need} more bytes at byte {at}")]
    Truncated {
        /// elements of the segment
        n: usize,
        /// where the read started, in the segment
        at: usize,
        /// bytes missing
        need: usize,
    },
    /// An unknown segment tag.
    #[error(
        "delta segment tag {tag} at byte {at} is none of dense (0), sparse (1), unchanged (2), gaps (3)"
    )]
    Tag {
        /// the tag read
        tag: u8,
        /// where
        at: usize,
    },
    /// A chunk count larger than its chunk.
    #[error("delta chunk {chunk} counts {count} changed elements, but holds {len}")]
    Count {
        /// the chunk
        chunk: usize,
        /// its count
        count: u8,
        /// its elements
        len: usize,
    },
    /// Offsets not strictly increasing or outside their chunk.
    #[error(
        "delta chunk {chunk}: offset {offset} after {prev:?} is not increasing within its {len} elements"
    )]
    Offset {
        /// the chunk
        chunk: usize,
        /// the offending offset
        offset: u8,
        /// the offset before it
        prev: Option<u8>,
        /// the chunk's elements
        len: usize,
    },
    /// A gaps segment whose count of changed elements is 0 or above its elements.
    #[error("delta gaps segment counts {count} changed elements, but holds {n} (it needs 1..={n})")]
    GapCount {
        /// the count read
        count: u64,
        /// elements of the segment
        n: usize,
    },
    /// A gaps segment's Rice parameter above 31.
    #[error("delta gaps segment has Rice parameter {0}; the format allows 0..=31")]
    RiceParameter(u8),
    /// A gaps segment's `i`-th change lands at or past the segment's end.
    #[error(
        "delta gaps segment: change {i} lands at element {index} or beyond, past its {n} elements"
    )]
    Index {
        /// which change (0-based)
        i: usize,
        /// where it lands (at least)
        index: u64,
        /// elements of the segment
        n: usize,
    },
    /// Changes handed to an encoder that are not strictly increasing indices of the segment.
    #[error(
        "delta encoder: change {i} is element {index}, not after the one before it and below the segment's {n} elements"
    )]
    Changes {
        /// which change (0-based)
        i: usize,
        /// its index
        index: u64,
        /// elements of the segment
        n: usize,
    },
    /// A gaps segment whose bits end in a byte with padding bits set.
    #[error("delta gaps segment: the padding bits of byte {at} are not zero")]
    Padding {
        /// where
        at: usize,
    },
    /// Old and new payloads of different lengths, or not whole elements.
    #[error(
        "delta of {old} against {new} bytes with {elem}-byte elements: both must be the same whole number of elements"
    )]
    Lengths {
        /// bytes of the base
        old: usize,
        /// bytes of the new payload
        new: usize,
        /// element size
        elem: usize,
    },
    /// An element size the format does not carry.
    #[error("delta element size {0} is none of 1, 2, 4, 8")]
    ElementSize(usize),
    /// A segment of more elements than the format's indices reach.
    #[error("a delta segment of {0} elements: one segment holds at most 2^32 - 1")]
    TooLong(usize),
}

/// What one encoded segment (or a sum of them) holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeltaStats {
    /// Elements covered.
    pub elements: u64,
    /// Elements whose bytes changed.
    pub changed: u64,
    /// Bytes of the dense payload.
    pub dense_bytes: u64,
    /// Bytes of the encoded delta.
    pub delta_bytes: u64,
}

impl DeltaStats {
    /// Adds another segment's figures.
    pub fn add(&mut self, o: &DeltaStats) {
        self.elements += o.elements;
        self.changed += o.changed;
        self.dense_bytes += o.dense_bytes;
        self.delta_bytes += o.delta_bytes;
    }

    /// The fraction of elements that changed (0 for none).
    pub fn density(&self) -> f64 {
        if self.elements == 0 {
            0.0
        } else {
            self.changed as f64 / self.elements as f64
        }
    }
}

fn check_elem(elem: usize) -> Result<(), DeltaError> {
    match elem {
        1 | 2 | 4 | 8 => Ok(()),
        e => Err(DeltaError::ElementSize(e)),
    }
}

/// Whether a chunk of `len` elements with `c` changes is cheaper sent whole.
pub fn dense_chunk(c: usize, len: usize, elem: usize) -> bool {
    c * (1 + elem) >= len * elem || c >= DENSE_CHUNK as usize
}

/// For every mask of `PER` lanes (bit `j` set: lane `j` changed), the lanes set, in order, then
/// zeros: the positions [`changed_elements`] writes for a word whose lanes differ by that mask.
const fn lane_table<const PER: usize, const MASKS: usize>() -> [[u8; PER]; MASKS] {
    let mut t = [[0u8; PER]; MASKS];
    let mut m = 0;
    while m < MASKS {
        let (mut j, mut n) = (0, 0);
        while j < PER {
            if m >> j & 1 == 1 {
                t[m][n] = j as u8;
                n += 1;
            }
            j += 1;
        }
        m += 1;
    }
    t
}

const LANES_1: [[u8; 8]; 256] = lane_table::<8, 256>();
const LANES_2: [[u8; 4]; 16] = lane_table::<4, 16>();
const LANES_4: [[u8; 2]; 4] = lane_table::<2, 4>();
const LANES_8: [[u8; 1]; 2] = lane_table::<1, 2>();

/// The lanes of `x` (`PER` lanes of `8 / PER` bytes) that are not zero, lane `j` as bit `j`.
#[inline(always)]
fn lane_mask<const PER: usize>(x: u64) -> usize {
    match PER {
        8 => {
            // the top bit of each byte: set where the byte is not zero
            const L: u64 = 0x7f7f_7f7f_7f7f_7f7f;
            let r = ((x & L).wrapping_add(L) | x) & !L;
            // byte i's top bit to bit 56 + i (the sums below bit 56 cannot carry into it)
            (((r >> 7).wrapping_mul(0x0102_0408_1020_4080)) >> 56) as usize
        }
        4 => {
            const L: u64 = 0x7fff_7fff_7fff_7fff;
            let r = ((x & L).wrapping_add(L) | x) & !L;
            // lane i's top bit (16 i + 15) to bit 48 + i
            ((((r >> 15).wrapping_mul((1 << 48) | (1 << 33) | (1 << 18) | (1 << 3))) >> 48) & 0xf)
                as usize
        }
        2 => (x as u32 != 0) as usize | (((x >> 32) != 0) as usize) << 1,
        _ => (x != 0) as usize,
    }
}

/// Pushes the indices (within `o` and `w`, in elements of `elem` bytes) of the elements that
/// differ, plus `first`. Compares 32 bytes at a time (four words OR-ed: the compiler turns it
/// into vector loads); a word that differs writes all its lanes' indices from a table of its
/// lane mask and keeps as many as differ, so that no branch depends on which lanes changed.
pub fn changed_elements(o: &[u8], w: &[u8], elem: usize, first: u32, out: &mut Vec<u32>) {
    changed(o, w, elem, first, out, None)
}

/// [`changed_elements`], appending each changed element's bytes in `w` to `values` too (in the
/// order of the indices), read while the compare has them at hand: what
/// [`encode_changes`] takes.
pub fn changed_values(
    o: &[u8],
    w: &[u8],
    elem: usize,
    first: u32,
    idx: &mut Vec<u32>,
    values: &mut Vec<u8>,
) {
    changed(o, w, elem, first, idx, Some(values))
}

fn changed(
    o: &[u8],
    w: &[u8],
    elem: usize,
    first: u32,
    out: &mut Vec<u32>,
    mut values: Option<&mut Vec<u8>>,
) {
    match (elem, values.as_deref_mut()) {
        (1, None) => changed_lanes::<8, 1, false>(o, w, first, &LANES_1, out, &mut Vec::new()),
        (1, Some(v)) => changed_lanes::<8, 1, true>(o, w, first, &LANES_1, out, v),
        (2, None) => changed_lanes::<4, 2, false>(o, w, first, &LANES_2, out, &mut Vec::new()),
        (2, Some(v)) => changed_lanes::<4, 2, true>(o, w, first, &LANES_2, out, v),
        (4, None) => changed_lanes::<2, 4, false>(o, w, first, &LANES_4, out, &mut Vec::new()),
        (4, Some(v)) => changed_lanes::<2, 4, true>(o, w, first, &LANES_4, out, v),
        (_, None) => changed_lanes::<1, 8, false>(o, w, first, &LANES_8, out, &mut Vec::new()),
        (_, Some(v)) => changed_lanes::<1, 8, true>(o, w, first, &LANES_8, out, v),
    }
    // the elements after the last whole word (`elem` is 8 for the last arms: no tail)
    let len = o.len().min(w.len());
    let es = elem.clamp(1, 8);
    for e in (len / 8 * 8 / es)..(len / es) {
        let new = &w[e * es..(e + 1) * es];
        if o[e * es..(e + 1) * es] != *new {
            out.push(first + e as u32);
            if let Some(v) = values.as_deref_mut() {
                v.extend_from_slice(new);
            }
        }
    }
}

/// [`changed`] over the whole words of `o` and `w`: `PER` elements of `E` bytes a word, and
/// with `VALUES` their bytes in `w` appended to `values`.
fn changed_lanes<const PER: usize, const E: usize, const VALUES: bool>(
    o: &[u8],
    w: &[u8],
    first: u32,
    table: &[[u8; PER]],
    out: &mut Vec<u32>,
    values: &mut Vec<u8>,
) {
    let len = o.len().min(w.len());
    let (o, w) = (&o[..len], &w[..len]);
    let word = |b: &[u8], i: usize| {
        let mut x = [0u8; 8];
        x.copy_from_slice(&b[i * 8..i * 8 + 8]);
        u64::from_le_bytes(x)
    };
    // indices (and the words' lanes) gather here, whole words at a time, and go out in batches
    const BATCH: usize = 1024;
    let mut buf = [0u32; BATCH + 32];
    let mut vals = [0u64; BATCH + 32];
    let mut n = 0usize;
    let flush = |buf: &[u32], vals: &[u64], out: &mut Vec<u32>, values: &mut Vec<u8>| {
        out.extend_from_slice(buf);
        if VALUES {
            values.reserve(vals.len() * E);
            for v in vals {
                values.extend_from_slice(&v.to_le_bytes()[..E]);
            }
        }
    };
    // word `i`, which differs from the base by `x` and holds `new`
    let put = |i: usize,
               x: u64,
               new: u64,
               buf: &mut [u32; BATCH + 32],
               vals: &mut [u64; BATCH + 32],
               n: &mut usize| {
        let m = lane_mask::<PER>(x);
        let base = first.wrapping_add((i * PER) as u32);
        let lanes = &table[m];
        let dst = &mut buf[*n..*n + PER];
        for j in 0..PER {
            dst[j] = base.wrapping_add(lanes[j] as u32);
        }
        if VALUES {
            let dst = &mut vals[*n..*n + PER];
            for j in 0..PER {
                // (lane j of a word starts at bit 8 E j: below 64)
                dst[j] = new >> (8 * E * lanes[j] as usize);
            }
        }
        *n += m.count_ones() as usize;
    };
    let words = len / 8;
    for (bi, (ob, wb)) in o.chunks_exact(32).zip(w.chunks_exact(32)).enumerate() {
        let nw = [word(wb, 0), word(wb, 1), word(wb, 2), word(wb, 3)];
        let x = [
            word(ob, 0) ^ nw[0],
            word(ob, 1) ^ nw[1],
            word(ob, 2) ^ nw[2],
            word(ob, 3) ^ nw[3],
        ];
        if x[0] | x[1] | x[2] | x[3] == 0 {
            continue;
        }
        for k in 0..4 {
            put(bi * 4 + k, x[k], nw[k], &mut buf, &mut vals, &mut n);
        }
        if n >= BATCH {
            flush(&buf[..n], &vals[..n], out, values);
            n = 0;
        }
    }
    for i in words / 4 * 4..words {
        let nw = word(w, i);
        put(i, word(o, i) ^ nw, nw, &mut buf, &mut vals, &mut n);
    }
    flush(&buf[..n], &vals[..n], out, values);
}

/// The gap before each changed index: the index minus the previous one minus one.
fn gaps(idx: &[u32]) -> impl Iterator<Item = u64> + '_ {
    let mut next = 0u64;
    idx.iter().map(move |&i| {
        let g = i as u64 - next;
        next = i as u64 + 1;
        g
    })
}

/// Bits of the Rice codes of the gaps of `idx` with parameter `k`.
fn rice_bits(idx: &[u32], k: u32) -> u64 {
    gaps(idx).map(|g| (g >> k) + 1 + k as u64).sum()
}

/// The Rice parameter that codes the gaps of `idx` (not empty, increasing, below `n`) in the
/// fewest bits, and those bits. The optimum lies near `log2` of the mean gap: the bits are
/// convex in `k`, so the search walks down from there while it gains.
fn best_rice(idx: &[u32]) -> (u32, u64) {
    let span = *idx.last().unwrap_or(&0) as u64 + 1;
    let mean = span / idx.len().max(1) as u64;
    let mut k = (63 - mean.max(1).leading_zeros()).min(MAX_RICE_K as u32);
    let mut bits = rice_bits(idx, k);
    while k > 0 {
        let b = rice_bits(idx, k - 1);
        if b > bits {
            break;
        }
        (k, bits) = (k - 1, b);
    }
    while k < MAX_RICE_K as u32 {
        let b = rice_bits(idx, k + 1);
        if b >= bits {
            break;
        }
        (k, bits) = (k + 1, b);
    }
    (k, bits)
}

/// Writes bits least significant first into whole bytes.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    held: u32,
}

impl BitWriter<'_> {
    /// The low `bits` (at most 32) of `v`. Whole 32-bit words go out once held (the same bytes
    /// as one at a time: least significant first).
    #[inline]
    fn put(&mut self, v: u64, bits: u32) {
        debug_assert!(bits <= 32 && self.held < 32);
        if bits == 0 {
            return;
        }
        self.acc |= (v & ((1u64 << bits) - 1)) << self.held;
        self.held += bits;
        if self.held >= 32 {
            self.out.extend_from_slice(&(self.acc as u32).to_le_bytes());
            self.acc >>= 32;
            self.held -= 32;
        }
    }

    #[inline]
    fn rice(&mut self, g: u64, k: u32) {
        let mut q = g >> k;
        if q + 1 + k as u64 <= 32 {
            // q ones, the zero that ends them, the k low bits: one code of at most 32 bits
            let low = g & ((1u64 << k) - 1);
            self.put(((1u64 << q) - 1) | low << (q + 1), q as u32 + 1 + k);
            return;
        }
        while q >= 32 {
            self.put(u32::MAX as u64, 32);
            q -= 32;
        }
        // q ones, then the zero that ends them
        self.put((1u64 << q) - 1, q as u32 + 1);
        self.put(g, k);
    }

    fn finish(mut self) {
        while self.held > 0 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.held = self.held.saturating_sub(8);
        }
    }
}

/// Reads what [`BitWriter`] wrote; reading past the end is an error, not padding.
struct BitReader<'a> {
    buf: &'a [u8],
    /// the next bit
    pos: u64,
}

impl BitReader<'_> {
    /// The next 57 bits or more (zeros past the end), without consuming them.
    fn peek(&self) -> u64 {
        let byte = (self.pos / 8) as usize;
        let mut w = [0u8; 8];
        if byte < self.buf.len() {
            let n = (self.buf.len() - byte).min(8);
            w[..n].copy_from_slice(&self.buf[byte..byte + n]);
        }
        u64::from_le_bytes(w) >> (self.pos % 8)
    }

    /// Consumes `bits`; false when that runs past the buffer.
    fn skip(&mut self, bits: u64) -> bool {
        self.pos += bits;
        self.pos <= self.buf.len() as u64 * 8
    }
}

/// Appends a gaps segment (tag 3) of the changes at `idx` (not empty) with Rice parameter `k`.
fn put_gaps<'a>(
    idx: &[u32],
    k: u32,
    elem: usize,
    value: impl Fn(usize) -> &'a [u8],
    out: &mut Vec<u8>,
) {
    put_gaps_header(idx, k, out);
    put_values(out, elem, idx.iter().map(|&i| i as usize), idx.len(), value);
}

/// A gaps segment up to its values: tag, count, parameter and the Rice-coded gaps.
fn put_gaps_header(idx: &[u32], k: u32, out: &mut Vec<u8>) {
    out.push(TAG_GAPS);
    out.extend_from_slice(&(idx.len() as u32).to_le_bytes());
    out.push(k as u8);
    let mut w = BitWriter {
        out,
        acc: 0,
        held: 0,
    };
    for g in gaps(idx) {
        w.rice(g, k);
    }
    w.finish();
}

/// Appends the values of the elements `at` (`count` of them, each `value(i)`, `elem` bytes)
/// to `out`, copied as fixed-size elements.
fn put_values<'a>(
    out: &mut Vec<u8>,
    elem: usize,
    at: impl Iterator<Item = usize>,
    count: usize,
    value: impl Fn(usize) -> &'a [u8],
) {
    fn each<'a, const E: usize>(
        out: &mut Vec<u8>,
        at: impl Iterator<Item = usize>,
        value: impl Fn(usize) -> &'a [u8],
    ) {
        for i in at {
            let mut v = [0u8; E];
            v.copy_from_slice(&value(i)[..E]);
            out.extend_from_slice(&v);
        }
    }
    out.reserve(count * elem);
    match elem {
        1 => each::<1>(out, at, value),
        2 => each::<2>(out, at, value),
        4 => each::<4>(out, at, value),
        8 => each::<8>(out, at, value),
        _ => at.for_each(|i| out.extend_from_slice(value(i))),
    }
}

/// Which segment forms an encoder may write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forms {
    /// All four (the CPU encoders): the smallest of dense, sparse, unchanged and gaps.
    All,
    /// Dense, sparse and unchanged only (tags 0-2): what the GPU encoder writes, whose rules
    /// are local to a chunk or a segment (the gaps' Rice code is a serial bit stream). The
    /// choice among the three is the same as with [`Forms::All`] where gaps lose.
    NoGaps,
}

/// Appends the delta of a segment of `n` elements of `elem` bytes whose changed elements are
/// `idx` (increasing, each below `n`), reading the new value of element `i` through
/// `value(i)`: the same bytes [`encode`] writes for the same change, without either payload
/// packed (a sender reads its tensors in place).
pub fn encode_indexed<'a>(
    n: usize,
    elem: usize,
    idx: &[u32],
    value: impl Fn(usize) -> &'a [u8],
    out: &mut Vec<u8>,
) -> Result<DeltaStats, DeltaError> {
    encode_forms(n, elem, idx, value, out, true)
}

/// [`encode`] restricted to `forms`: with [`Forms::NoGaps`], the bytes the GPU encoder
/// writes for the same segment.
pub fn encode_with(
    old: &[u8],
    new: &[u8],
    elem: usize,
    forms: Forms,
    out: &mut Vec<u8>,
) -> Result<DeltaStats, DeltaError> {
    check_elem(elem)?;
    if old.len() != new.len() || new.len() % elem != 0 {
        return Err(DeltaError::Lengths {
            old: old.len(),
            new: new.len(),
            elem,
        });
    }
    if new.len() / elem > u32::MAX as usize {
        return Err(DeltaError::TooLong(new.len() / elem));
    }
    let (mut idx, mut values) = (Vec::new(), Vec::new());
    if old != new {
        changed_values(old, new, elem, 0, &mut idx, &mut values);
    }
    encode_values(
        new.len() / elem,
        elem,
        &idx,
        Some(&values),
        |i| &new[i * elem..(i + 1) * elem],
        out,
        forms == Forms::All,
    )
}

/// [`encode_indexed`], with the gaps form allowed or not.
fn encode_forms<'a>(
    n: usize,
    elem: usize,
    idx: &[u32],
    value: impl Fn(usize) -> &'a [u8],
    out: &mut Vec<u8>,
    gaps_allowed: bool,
) -> Result<DeltaStats, DeltaError> {
    encode_values(n, elem, idx, None, value, out, gaps_allowed)
}

/// Appends the delta of a segment of `n` elements of `elem` bytes whose changed elements are
/// `idx` (increasing, each below `n`) with their new bytes `values` (in that order, as
/// [`changed_values`] gives them), reading the new value of other elements through `value(i)`
/// (a chunk or segment sent whole): the same bytes as [`encode_indexed`].
pub fn encode_changes<'a>(
    n: usize,
    elem: usize,
    idx: &[u32],
    values: &[u8],
    value: impl Fn(usize) -> &'a [u8],
    out: &mut Vec<u8>,
) -> Result<DeltaStats, DeltaError> {
    if values.len() != idx.len() * elem {
        return Err(DeltaError::Lengths {
            old: idx.len() * elem,
            new: values.len(),
            elem,
        });
    }
    encode_values(n, elem, idx, Some(values), value, out, true)
}

/// [`encode_forms`], the changed elements' values from `changed` where given.
fn encode_values<'a>(
    n: usize,
    elem: usize,
    idx: &[u32],
    changed: Option<&[u8]>,
    value: impl Fn(usize) -> &'a [u8],
    out: &mut Vec<u8>,
    gaps_allowed: bool,
) -> Result<DeltaStats, DeltaError> {
    check_elem(elem)?;
    let start = out.len();
    let stats = |out: &Vec<u8>| DeltaStats {
        elements: n as u64,
        changed: idx.len() as u64,
        dense_bytes: (n * elem) as u64,
        delta_bytes: (out.len() - start) as u64,
    };
    if idx.is_empty() {
        out.push(TAG_UNCHANGED);
        return Ok(stats(out));
    }
    let chunks = n.div_ceil(CHUNK);
    // where each chunk's changes end in `idx`: the changes per chunk (each change checked to
    // follow the one before it inside the segment), summed
    let mut ends = vec![0u32; chunks];
    let mut next = 0usize;
    for (c, &i) in idx.iter().enumerate() {
        let i = i as usize;
        if i < next || i >= n {
            return Err(DeltaError::Changes {
                i: c,
                index: i as u64,
                n,
            });
        }
        ends[i / CHUNK] += 1;
        next = i + 1;
    }
    let mut at = 0u32;
    for e in ends.iter_mut() {
        at += *e;
        *e = at;
    }
    let mut sparse = 1 + chunks;
    let mut from = 0usize;
    for (c, &end) in ends.iter().enumerate() {
        let end = end as usize;
        let len = (n - c * CHUNK).min(CHUNK);
        let k = end - from;
        sparse += if dense_chunk(k, len, elem) {
            len * elem
        } else {
            k * (1 + elem)
        };
        from = end;
    }
    let (k, bits) = best_rice(idx);
    let rice = if gaps_allowed {
        GAPS_HEADER + bits.div_ceil(8) as usize + idx.len() * elem
    } else {
        usize::MAX
    };
    if n * elem < sparse.min(rice) {
        out.push(TAG_DENSE);
        put_values(out, elem, 0..n, n, value);
        return Ok(stats(out));
    }
    if rice < sparse {
        match changed {
            Some(v) => {
                put_gaps_header(idx, k, out);
                out.extend_from_slice(v);
            }
            None => put_gaps(idx, k, elem, value, out),
        }
        return Ok(stats(out));
    }
    out.push(TAG_SPARSE);
    let counts_at = out.len();
    out.resize(counts_at + chunks, 0);
    let mut from = 0usize;
    for (c, &end) in ends.iter().enumerate() {
        let end = end as usize;
        let len = (n - c * CHUNK).min(CHUNK);
        let k = end - from;
        let first = c * CHUNK;
        if dense_chunk(k, len, elem) {
            out[counts_at + c] = DENSE_CHUNK;
            put_values(out, elem, first..first + len, len, &value);
        } else if k > 0 {
            out[counts_at + c] = k as u8;
            out.extend(idx[from..end].iter().map(|&i| (i as usize - first) as u8));
            match changed {
                Some(v) => out.extend_from_slice(&v[from * elem..end * elem]),
                None => put_values(
                    out,
                    elem,
                    idx[from..end].iter().map(|&i| i as usize),
                    k,
                    &value,
                ),
            }
        }
        from = end;
    }
    Ok(stats(out))
}

/// Appends the delta of `new` against `old` (same length, whole `elem`-byte elements) to
/// `out`: the smallest of dense, sparse and unchanged. Returns its figures.
pub fn encode(
    old: &[u8],
    new: &[u8],
    elem: usize,
    out: &mut Vec<u8>,
) -> Result<DeltaStats, DeltaError> {
    encode_with(old, new, elem, Forms::All, out)
}

fn take<'a>(buf: &'a [u8], at: &mut usize, len: usize, n: usize) -> Result<&'a [u8], DeltaError> {
    let end = at
        .checked_add(len)
        .filter(|&e| e <= buf.len())
        .ok_or(DeltaError::Truncated {
            n,
            at: *at,
            need: len.saturating_sub(buf.len().saturating_sub(*at)),
        })?;
    let s = &buf[*at..end];
    *at = end;
    Ok(s)
}

/// Decodes one segment of `n` elements of `elem` bytes at the start of `delta`, calling
/// `write(first, values)` for each run of changed elements (`values` holds whole elements,
/// `first` is the index of the first); returns the bytes the segment took. Every count, offset
/// and length is checked before anything is written for its chunk (a gaps segment: before
/// anything is written for it at all).
pub fn decode(
    delta: &[u8],
    elem: usize,
    n: usize,
    mut write: impl FnMut(usize, &[u8]),
) -> Result<usize, DeltaError> {
    check_elem(elem)?;
    let mut at = 0usize;
    let tag = *take(delta, &mut at, 1, n)?.first().unwrap_or(&0);
    match tag {
        TAG_UNCHANGED => {}
        TAG_DENSE => {
            let bytes = n.checked_mul(elem).ok_or(DeltaError::Truncated {
                n,
                at,
                need: usize::MAX,
            })?;
            let v = take(delta, &mut at, bytes, n)?;
            if n > 0 {
                write(0, v);
            }
        }
        TAG_SPARSE => {
            let chunks = n.div_ceil(CHUNK);
            let counts = take(delta, &mut at, chunks, n)?;
            for (c, &count) in counts.iter().enumerate() {
                let first = c * CHUNK;
                let len = (n - first).min(CHUNK);
                if count == DENSE_CHUNK {
                    let v = take(delta, &mut at, len * elem, n)?;
                    write(first, v);
                    continue;
                }
                let k = count as usize;
                if k > len {
                    return Err(DeltaError::Count {
                        chunk: c,
                        count,
                        len,
                    });
                }
                let offs = take(delta, &mut at, k, n)?;
                let vals = take(delta, &mut at, k * elem, n)?;
                let mut prev: Option<u8> = None;
                for &o in offs {
                    if prev.is_some_and(|p| o <= p) || o as usize >= len {
                        return Err(DeltaError::Offset {
                            chunk: c,
                            offset: o,
                            prev,
                            len,
                        });
                    }
                    prev = Some(o);
                }
                // runs of consecutive offsets are written together
                let mut i = 0;
                while i < k {
                    let mut j = i + 1;
                    while j < k && offs[j] as usize == offs[j - 1] as usize + 1 {
                        j += 1;
                    }
                    write(first + offs[i] as usize, &vals[i * elem..j * elem]);
                    i = j;
                }
            }
        }
        TAG_GAPS => {
            let mut c = [0u8; 4];
            c.copy_from_slice(take(delta, &mut at, 4, n)?);
            let c = u32::from_le_bytes(c) as usize;
            let k = take(delta, &mut at, 1, n)?[0];
            if n > u32::MAX as usize {
                return Err(DeltaError::TooLong(n));
            }
            if c == 0 || c > n {
                return Err(DeltaError::GapCount { count: c as u64, n });
            }
            if k > MAX_RICE_K {
                return Err(DeltaError::RiceParameter(k));
            }
            let k = k as u32;
            // the least the bits and values can take, checked before anything is allocated
            let values = c * elem;
            let least = (c as u64 * (1 + k as u64)).div_ceil(8) as usize;
            let rest = delta.len() - at;
            if rest < least + values {
                return Err(DeltaError::Truncated {
                    n,
                    at,
                    need: least + values - rest,
                });
            }
            let mut r = BitReader {
                buf: &delta[at..],
                pos: 0,
            };
            let mut idx: Vec<u32> = Vec::with_capacity(c);
            let mut next = 0u64;
            let limit = n as u64;
            let short = |r: &BitReader, at: usize| DeltaError::Truncated {
                n,
                at: at + (r.pos / 8) as usize,
                need: 1,
            };
            for i in 0..c {
                // the quotient: ones up to the first zero
                let mut q = 0u64;
                loop {
                    let ones = (!r.peek()).trailing_zeros().min(57) as u64;
                    q += ones;
                    if next + (q << k) >= limit {
                        return Err(DeltaError::Index {
                            i,
                            index: next + (q << k),
                            n,
                        });
                    }
                    if ones < 57 {
                        if !r.skip(ones + 1) {
                            return Err(short(&r, at));
                        }
                        break;
                    }
                    if !r.skip(ones) {
                        return Err(short(&r, at));
                    }
                }
                let low = if k == 0 {
                    0
                } else {
                    r.peek() & ((1u64 << k) - 1)
                };
                if !r.skip(k as u64) {
                    return Err(short(&r, at));
                }
                let index = next + ((q << k) | low);
                if index >= limit {
                    return Err(DeltaError::Index { i, index, n });
                }
                idx.push(index as u32);
                next = index + 1;
            }
            if r.pos % 8 != 0 && r.peek() & ((1u64 << (8 - r.pos % 8)) - 1) != 0 {
                return Err(DeltaError::Padding {
                    at: at + (r.pos / 8) as usize,
                });
            }
            at += r.pos.div_ceil(8) as usize;
            let vals = take(delta, &mut at, values, n)?;
            // runs of consecutive indices are written together
            let mut i = 0;
            while i < c {
                let mut j = i + 1;
                while j < c && idx[j] == idx[j - 1] + 1 {
                    j += 1;
                }
                write(idx[i] as usize, &vals[i * elem..j * elem]);
                i = j;
            }
        }
        tag => return Err(DeltaError::Tag { tag, at: 0 }),
    }
    Ok(at)
}

/// Applies one segment at the start of `delta` to `base` (the whole segment's bytes, which it
/// turns into the new version's); returns the bytes the segment took.
pub fn apply(delta: &[u8], elem: usize, base: &mut [u8]) -> Result<usize, DeltaError> {
    check_elem(elem)?;
    if base.len() % elem != 0 {
        return Err(DeltaError::Lengths {
            old: base.len(),
            new: base.len(),
            elem,
        });
    }
    fn typed<const E: usize>(delta: &[u8], base: &mut [u8]) -> Result<usize, DeltaError> {
        decode(delta, E, base.len() / E, |first, v| {
            let at = first * E;
            if v.len() == E {
                // one element (most runs at optimiser densities): a fixed-size copy
                base[at..at + E].copy_from_slice(&v[..E]);
            } else {
                base[at..at + v.len()].copy_from_slice(v)
            }
        })
    }
    match elem {
        1 => typed::<1>(delta, base),
        2 => typed::<2>(delta, base),
        4 => typed::<4>(delta, base),
        _ => typed::<8>(delta, base),
    }
}

/// The expected wire bytes of a delta per dense byte, for `elem`-byte elements that change
/// independently with probability `density` (segments long enough that their headers do not
/// count): the smaller of the sparse form (one count byte per 256 elements plus an offset and
/// a value per change) and the gaps (a value and `1 + k + E[gap >> k]` bits per change at the
/// best `k`), at most the dense bytes (the encoder then sends them whole). The gaps are
/// geometric, `P(gap >= g) = (1 - density)^g`, so `E[gap >> k] = r / (1 - r)` with `r = (1 -
/// density)^(2^k)`. Nothing changed costs nothing but a tag per segment: 0.
pub fn expected_fraction(density: f64, elem: usize) -> f64 {
    let d = density.clamp(0.0, 1.0);
    if d == 0.0 {
        return 0.0;
    }
    let e = elem.max(1) as f64;
    let sparse = (1.0 / CHUNK as f64 + d * (1.0 + e)) / e;
    let gaps = (0..=MAX_RICE_K as i32)
        .map(|k| {
            let r = (1.0 - d).powf(2f64.powi(k));
            let q = if r < 1.0 {
                r / (1.0 - r)
            } else {
                f64::INFINITY
            };
            d * (e + (1.0 + k as f64 + q) / 8.0) / e
        })
        .fold(f64::INFINITY, f64::min);
    sparse.min(gaps).min(1.0)
}

/// The encoded size of a segment without writing it (what [`encode`] would append).
pub fn encoded_len(old: &[u8], new: &[u8], elem: usize) -> Result<usize, DeltaError> {
    let mut v = Vec::new();
    encode(old, new, elem, &mut v).map(|s| s.delta_bytes as usize)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn rng(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    /// `n` elements of `elem` bytes, and a copy with about `per_mille` of them changed.
    pub(crate) fn versions(n: usize, elem: usize, per_mille: u64, seed: u64) -> (Vec<u8>, Vec<u8>) {
        let mut s = seed;
        let old: Vec<u8> = (0..n * elem).map(|_| rng(&mut s) as u8).collect();
        let mut new = old.clone();
        for i in 0..n {
            if rng(&mut s) % 1000 < per_mille {
                let b = &mut new[i * elem + (rng(&mut s) as usize % elem)];
                *b = b.wrapping_add(1 + (rng(&mut s) % 255) as u8);
            }
        }
        (old, new)
    }

    #[test]
    fn applying_a_delta_gives_the_new_bytes_at_every_density_and_element_size() {
        for elem in [1, 2, 4, 8] {
            for n in [0, 1, 255, 256, 257, 1000, 4099] {
                for per_mille in [0, 1, 30, 300, 700, 1000] {
                    let (old, new) = versions(n, elem, per_mille, (n * elem) as u64 + per_mille);
                    let mut d = Vec::new();
                    let st = encode(&old, &new, elem, &mut d).unwrap();
                    assert_eq!(st.delta_bytes as usize, d.len());
                    let mut got = old.clone();
                    let used = apply(&d, elem, &mut got).unwrap();
                    assert_eq!(used, d.len(), "elem {elem} n {n} ‰{per_mille}");
                    assert_eq!(got, new, "elem {elem} n {n} ‰{per_mille}");
                    let changed = old
                        .chunks_exact(elem)
                        .zip(new.chunks_exact(elem))
                        .filter(|(a, b)| a != b)
                        .count();
                    assert_eq!(st.changed as usize, changed);
                    assert!(
                        d.len() <= 1 + new.len(),
                        "never larger than dense + its tag"
                    );
                }
            }
        }
    }

    #[test]
    fn sparse_deltas_are_small_at_optimiser_densities() {
        // 3 % of bf16 elements: under 4.4 % of the dense bytes (the sparse form alone: 4.7 %);
        // 0.3 % of e4m3 bytes: under 0.7 % (the sparse form alone: 1.0 %). Below ~1.2 bytes
        // of index per change at 0.3 %, ~0.85 at 3 %: within 10 % of the changed set's entropy
        for (elem, per_mille, most, per_change) in
            [(2usize, 30u64, 0.044, 0.85), (1, 3, 0.007, 1.25)]
        {
            let (old, new) = versions(1 << 20, elem, per_mille, 7 + elem as u64);
            let mut d = Vec::new();
            let st = encode(&old, &new, elem, &mut d).unwrap();
            assert_eq!(d[0], TAG_GAPS);
            let f = d.len() as f64 / new.len() as f64;
            assert!(f < most, "elem {elem} at {per_mille} per mille: {f}");
            let index = (d.len() as f64 - (st.changed as usize * elem) as f64) / st.changed as f64;
            assert!(
                index < per_change,
                "elem {elem}: {index} bytes of index per change"
            );
            let p = st.density();
            let entropy = (-p * p.log2() - (1.0 - p) * (1.0 - p).log2()) / 8.0 / p;
            assert!(
                index < 1.1 * entropy,
                "{index} vs the entropy's {entropy} per change"
            );
        }
        // and an unchanged segment is one byte
        let (old, _) = versions(1 << 12, 1, 0, 9);
        assert_eq!(encoded_len(&old, &old, 1).unwrap(), 1);
    }

    #[test]
    fn the_expected_fraction_matches_what_the_encoder_writes() {
        for (elem, per_mille) in [(2usize, 30u64), (1, 3), (4, 10)] {
            let (old, new) = versions(1 << 18, elem, per_mille, 21);
            let got = encoded_len(&old, &new, elem).unwrap() as f64 / new.len() as f64;
            let want = expected_fraction(per_mille as f64 / 1000.0, elem);
            assert!(
                (got - want).abs() < 0.15 * want,
                "elem {elem}: {got} vs {want}"
            );
        }
        assert_eq!(expected_fraction(1.0, 2), 1.0);
    }

    #[test]
    fn changed_elements_finds_exactly_the_elements_whose_bytes_differ() {
        for elem in [1usize, 2, 4, 8] {
            // lengths around the 32-byte blocks and the 8-byte words, so every tail is walked
            for n in [0usize, 1, 3, 4, 5, 7, 16, 17, 33, 257, 3001] {
                for per_mille in [0u64, 3, 30, 400, 1000] {
                    let (old, new) = versions(n, elem, per_mille, 7 + n as u64 + per_mille);
                    let mut got = Vec::new();
                    changed_elements(&old, &new, elem, 5, &mut got);
                    let want: Vec<u32> = (0..n)
                        .filter(|&i| old[i * elem..(i + 1) * elem] != new[i * elem..(i + 1) * elem])
                        .map(|i| 5 + i as u32)
                        .collect();
                    assert_eq!(got, want, "elem {elem} n {n} ‰{per_mille}");
                }
            }
        }
    }

    #[test]
    fn a_single_differing_bit_anywhere_in_an_element_is_found() {
        // every bit of a 32-byte block and of a tail word, over bases of zeros, ones and noise
        for elem in [1usize, 2, 4, 8] {
            for fill in [0x00u8, 0xff, 0x5a] {
                let old: Vec<u8> = (0..40u8).map(|i| fill ^ i.wrapping_mul(37)).collect();
                for bit in 0..old.len() * 8 {
                    let mut new = old.clone();
                    new[bit / 8] ^= 1 << (bit % 8);
                    let mut got = Vec::new();
                    changed_elements(&old, &new, elem, 9, &mut got);
                    assert_eq!(got, [9 + (bit / 8 / elem) as u32], "elem {elem} bit {bit}");
                }
            }
        }
    }

    #[test]
    fn values_read_with_the_compare_encode_to_the_same_bytes_as_values_read_by_index() {
        for elem in [1usize, 2, 4, 8] {
            for n in [0usize, 1, 7, 33, 256, 257, 3001] {
                for per_mille in [0u64, 3, 30, 400, 700, 1000] {
                    let (old, new) = versions(n, elem, per_mille, 11 + n as u64 + per_mille);
                    let (mut idx, mut vals) = (Vec::new(), Vec::new());
                    changed_values(&old, &new, elem, 0, &mut idx, &mut vals);
                    let mut want_idx = Vec::new();
                    changed_elements(&old, &new, elem, 0, &mut want_idx);
                    assert_eq!(idx, want_idx, "elem {elem} n {n} ‰{per_mille}");
                    let want_vals: Vec<u8> = idx
                        .iter()
                        .flat_map(|&i| new[i as usize * elem..(i as usize + 1) * elem].to_vec())
                        .collect();
                    assert_eq!(vals, want_vals, "elem {elem} n {n} ‰{per_mille}");
                    let value = |i: usize| &new[i * elem..(i + 1) * elem];
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    let sa = encode_indexed(n, elem, &idx, value, &mut a).unwrap();
                    let sb = encode_changes(n, elem, &idx, &vals, value, &mut b).unwrap();
                    assert_eq!(
                        (a, sa.delta_bytes),
                        (b, sb.delta_bytes),
                        "elem {elem} n {n} ‰{per_mille}"
                    );
                }
            }
        }
        // values that do not match the indices are refused, not read past
        let mut d = Vec::new();
        assert!(encode_changes(10, 2, &[1, 4], &[0; 3], |_| &[0, 0][..], &mut d).is_err());
        // an index past the segment, or one not after the one before it, is refused, not a
        // panic (nor a gap that wraps round)
        assert!(encode_changes(10, 2, &[1, 10], &[0; 4], |_| &[0, 0][..], &mut d).is_err());
        let e = encode_indexed(10, 2, &[12, 3], |_| &[0, 0][..], &mut d).unwrap_err();
        assert_eq!(
            e,
            DeltaError::Changes {
                i: 0,
                index: 12,
                n: 10
            }
        );
        let e = encode_indexed(600, 2, &[4, 300, 300], |_| &[0, 0][..], &mut d).unwrap_err();
        assert_eq!(
            e,
            DeltaError::Changes {
                i: 2,
                index: 300,
                n: 600
            }
        );
    }

    #[test]
    fn a_dropped_change_is_caught_by_the_bytes() {
        let (old, new) = versions(4096, 2, 30, 3);
        let mut d = Vec::new();
        let mut idx = Vec::new();
        changed_elements(&old, &new, 2, 0, &mut idx);
        let value = |i: usize| &new[i * 2..i * 2 + 2];
        encode_forms(4096, 2, &idx, value, &mut d, false).unwrap();
        assert_eq!(d[0], TAG_SPARSE);
        // drop the first sparse change of the first chunk that has one by marking it unchanged
        let chunks = 4096usize.div_ceil(CHUNK);
        let c = d[1..1 + chunks]
            .iter()
            .position(|&c| c > 0 && c < DENSE_CHUNK)
            .unwrap();
        // rebuild that chunk without its first offset
        let mut at = 1 + chunks;
        for &k in &d[1..1 + c] {
            at += if k == DENSE_CHUNK {
                CHUNK * 2
            } else {
                k as usize * 3
            };
        }
        let k = d[1 + c] as usize;
        let mut planted = d[..at].to_vec();
        planted[1 + c] -= 1;
        planted.extend_from_slice(&d[at + 1..at + k]);
        planted.extend_from_slice(&d[at + k + 2..]);
        let mut got = old.clone();
        apply(&planted, 2, &mut got).unwrap();
        assert_ne!(got, new, "one change fewer leaves one element at the base");
        let diff = got
            .chunks_exact(2)
            .zip(new.chunks_exact(2))
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(diff, 1);
    }

    #[test]
    fn malformed_deltas_are_errors_not_panics() {
        let mut base = vec![0u8; 600];
        // unknown tag
        assert!(matches!(
            apply(&[9], 2, &mut base),
            Err(DeltaError::Tag { tag: 9, .. })
        ));
        // truncated dense
        assert!(matches!(
            apply(&[0, 1, 2], 2, &mut base),
            Err(DeltaError::Truncated { .. })
        ));
        // empty buffer
        assert!(matches!(
            apply(&[], 2, &mut base),
            Err(DeltaError::Truncated { .. })
        ));
        // a count larger than the last (short) chunk: 300 elements -> chunks of 256 and 44
        let mut d = vec![TAG_SPARSE, 0, 45];
        d.extend(std::iter::repeat_n(0u8, 45 * 3));
        assert!(matches!(
            apply(&d, 2, &mut base),
            Err(DeltaError::Count { chunk: 1, .. })
        ));
        // offsets not increasing
        let d = [TAG_SPARSE, 2, 0, 5, 5, 1, 1, 2, 2];
        assert!(matches!(
            apply(&d, 2, &mut base),
            Err(DeltaError::Offset { .. })
        ));
        // an offset outside the short chunk
        let d = [TAG_SPARSE, 0, 1, 44, 1, 1];
        assert!(matches!(
            apply(&d, 2, &mut base),
            Err(DeltaError::Offset { offset: 44, .. })
        ));
        // a bad element size
        assert_eq!(apply(&[2], 3, &mut base), Err(DeltaError::ElementSize(3)));
        // random bytes never panic
        let mut s = 11u64;
        for _ in 0..2000 {
            let len = rng(&mut s) as usize % 64;
            let mut d: Vec<u8> = (0..len).map(|_| rng(&mut s) as u8).collect();
            if let Some(t) = d.first_mut() {
                *t %= 3;
            }
            let _ = apply(&d, 2, &mut base);
        }
    }

    #[test]
    fn decode_reports_runs_in_increasing_order_within_the_segment() {
        let (old, new) = versions(3000, 4, 50, 5);
        let mut d = Vec::new();
        encode(&old, &new, 4, &mut d).unwrap();
        let mut last_end = 0usize;
        decode(&d, 4, 3000, |first, v| {
            assert!(first >= last_end);
            last_end = first + v.len() / 4;
            assert!(last_end <= 3000);
        })
        .unwrap();
    }

    /// Changes at `idx` of a random `n`-element segment: (old, new).
    fn versions_at(n: usize, elem: usize, idx: &[u32], seed: u64) -> (Vec<u8>, Vec<u8>) {
        let mut s = seed;
        let old: Vec<u8> = (0..n * elem).map(|_| rng(&mut s) as u8).collect();
        let mut new = old.clone();
        for &i in idx {
            let b = &mut new[i as usize * elem + (rng(&mut s) as usize % elem)];
            *b = b.wrapping_add(1 + (rng(&mut s) % 255) as u8);
        }
        (old, new)
    }

    fn gaps_segment(elem: usize, idx: &[u32], k: u32, new: &[u8]) -> Vec<u8> {
        let mut d = Vec::new();
        put_gaps(idx, k, elem, |i| &new[i * elem..(i + 1) * elem], &mut d);
        d
    }

    #[test]
    fn gaps_round_trip_for_every_rice_parameter_and_spread() {
        let mut s = 5u64;
        for elem in [1usize, 2, 4, 8] {
            for n in [1usize, 2, 57, 58, 300, 5000] {
                // spread: every element, random, clustered runs, the last one only, far apart
                let mut sets: Vec<Vec<u32>> = vec![
                    (0..n as u32).collect(),
                    (0..n as u32).filter(|_| rng(&mut s) % 50 == 0).collect(),
                    (0..n as u32).filter(|i| (i / 37) % 5 == 0).collect(),
                    vec![n as u32 - 1],
                    (0..n as u32).step_by(1 + n / 3).collect(),
                ];
                sets.retain(|v| !v.is_empty());
                for idx in sets {
                    let (old, new) = versions_at(n, elem, &idx, n as u64 * 31 + elem as u64);
                    // every parameter, the large quotients of k = 0 over long gaps included
                    for k in [0u32, 1, 3, 7, 12, 31] {
                        let d = gaps_segment(elem, &idx, k, &new);
                        let mut got = old.clone();
                        let used = apply(&d, elem, &mut got).unwrap();
                        assert_eq!(used, d.len(), "elem {elem} n {n} k {k}");
                        assert_eq!(got, new, "elem {elem} n {n} k {k}");
                    }
                    // the encoder's own choice is never larger than the best of the forms
                    let mut d = Vec::new();
                    encode(&old, &new, elem, &mut d).unwrap();
                    let (k, bits) = best_rice(&idx);
                    let least = (0..=31).map(|k| rice_bits(&idx, k)).min().unwrap();
                    assert_eq!(bits, least, "k {k} is not the best parameter");
                    assert!(d.len() <= GAPS_HEADER + bits.div_ceil(8) as usize + idx.len() * elem);
                    assert!(d.len() <= 1 + n * elem);
                    let mut got = old.clone();
                    assert_eq!(apply(&d, elem, &mut got).unwrap(), d.len());
                    assert_eq!(got, new);
                }
            }
        }
    }

    #[test]
    fn a_segment_ends_where_its_bytes_do_so_segments_follow_each_other() {
        let (o1, n1) = versions(3000, 2, 20, 1);
        let (o2, n2) = versions(700, 1, 5, 2);
        let mut d = Vec::new();
        encode(&o1, &n1, 2, &mut d).unwrap();
        assert_eq!(d[0], TAG_GAPS);
        let first = d.len();
        encode(&o2, &n2, 1, &mut d).unwrap();
        let (mut a, mut b) = (o1.clone(), o2.clone());
        let used = apply(&d, 2, &mut a).unwrap();
        assert_eq!(used, first);
        assert_eq!(apply(&d[used..], 1, &mut b).unwrap(), d.len() - first);
        assert_eq!((a, b), (n1, n2));
    }

    #[test]
    fn every_flipped_bit_of_a_gaps_segment_fails_or_gives_other_bytes() {
        let (old, new) = versions(2000, 2, 30, 9);
        let mut d = Vec::new();
        encode(&old, &new, 2, &mut d).unwrap();
        assert_eq!(d[0], TAG_GAPS);
        for bit in 0..d.len() * 8 {
            let mut bad = d.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let mut got = old.clone();
            match apply(&bad, 2, &mut got) {
                Err(_) => {}
                Ok(used) => assert!(
                    got != new || used != d.len(),
                    "bit {bit} flipped still decodes to the new bytes"
                ),
            }
        }
        // and one change dropped at the sender leaves exactly that element at the base
        let mut idx = Vec::new();
        changed_elements(&old, &new, 2, 0, &mut idx);
        let dropped = idx.remove(idx.len() / 2);
        let mut d = Vec::new();
        encode_indexed(2000, 2, &idx, |i| &new[i * 2..i * 2 + 2], &mut d).unwrap();
        let mut got = old.clone();
        apply(&d, 2, &mut got).unwrap();
        let diff: Vec<usize> = (0..2000)
            .filter(|&i| got[i * 2..i * 2 + 2] != new[i * 2..i * 2 + 2])
            .collect();
        assert_eq!(diff, vec![dropped as usize]);
    }

    #[test]
    fn hostile_gaps_segments_are_clear_errors() {
        let mut base = vec![0u8; 2 * 100];
        let seg = |c: u32, k: u8, rest: &[u8]| {
            let mut d = vec![TAG_GAPS];
            d.extend_from_slice(&c.to_le_bytes());
            d.push(k);
            d.extend_from_slice(rest);
            d
        };
        // no changes, more changes than elements
        assert_eq!(
            apply(&seg(0, 3, &[0; 8]), 2, &mut base),
            Err(DeltaError::GapCount { count: 0, n: 100 })
        );
        assert_eq!(
            apply(&seg(u32::MAX, 3, &[0; 8]), 2, &mut base),
            Err(DeltaError::GapCount {
                count: u32::MAX as u64,
                n: 100
            })
        );
        // a segment longer than the indices reach
        let mut huge = vec![0u8; 0];
        assert_eq!(
            decode(&seg(1, 0, &[0; 8]), 1, 1 << 33, |_, v| huge
                .extend_from_slice(v)),
            Err(DeltaError::TooLong(1 << 33))
        );
        // a parameter beyond 31
        assert_eq!(
            apply(&seg(1, 32, &[0; 8]), 2, &mut base),
            Err(DeltaError::RiceParameter(32))
        );
        // 100 changes claimed, a few bytes given: refused before anything is read
        assert!(matches!(
            apply(&seg(100, 0, &[0; 20]), 2, &mut base),
            Err(DeltaError::Truncated { .. })
        ));
        // a gap past the end: k 0, 200 ones (the quotient) then values
        let mut ones = vec![0xffu8; 25];
        ones.extend_from_slice(&[0, 0, 0]);
        assert!(matches!(
            apply(&seg(1, 0, &ones), 2, &mut base),
            Err(DeltaError::Index { i: 0, .. })
        ));
        // the second change lands past the end: gaps 98 then 5 with k 7
        let mut d = Vec::new();
        let mut w = BitWriter {
            out: &mut d,
            acc: 0,
            held: 0,
        };
        w.rice(98, 7);
        w.rice(5, 7);
        w.finish();
        d.extend_from_slice(&[1, 2, 3, 4]);
        assert!(matches!(
            apply(&seg(2, 7, &d), 2, &mut base),
            Err(DeltaError::Index {
                i: 1,
                index: 104,
                n: 100
            })
        ));
        // padding bits set: one change at 3 with k 2 is a zero (quotient 0) then 1, 1 (3
        // bits, least significant first), then padding
        assert_eq!(
            apply(&seg(1, 2, &[0b1111_0110, 9, 9]), 2, &mut base),
            Err(DeltaError::Padding { at: 6 })
        );
        assert_eq!(base, vec![0u8; 200], "nothing written");
        assert_eq!(apply(&seg(1, 2, &[0b0000_0110, 9, 9]), 2, &mut base), Ok(9));
        assert_eq!(&base[4..10], &[0, 0, 9, 9, 0, 0]);
        // every truncation of a valid segment is an error, never a panic or a short write
        let (old, new) = versions(100, 2, 100, 4);
        let mut d = Vec::new();
        encode(&old, &new, 2, &mut d).unwrap();
        assert_eq!(d[0], TAG_GAPS);
        for len in 0..d.len() {
            let mut got = old.clone();
            assert!(
                apply(&d[..len], 2, &mut got).is_err(),
                "{len} of {} bytes",
                d.len()
            );
            assert_eq!(got, old, "nothing written from a truncated segment");
        }
        // random bodies behind a gaps tag: errors or a whole segment, never a panic, never a
        // write outside the segment
        let mut s = 23u64;
        for _ in 0..20000 {
            let len = rng(&mut s) as usize % 48;
            let mut body: Vec<u8> = (0..len).map(|_| rng(&mut s) as u8).collect();
            if body.len() >= 5 {
                // small counts and parameters, so that parsing goes deep
                body[0] %= 8;
                body[1] = 0;
                body[2] = 0;
                body[3] = 0;
                body[4] %= 9;
            }
            let mut d = vec![TAG_GAPS];
            d.extend_from_slice(&body);
            let mut small = vec![0u8; 2 * 40];
            if let Ok(used) = apply(&d, 2, &mut small) {
                assert!(used <= d.len());
            }
        }
    }
}
