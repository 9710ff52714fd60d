//! Delta updates over NCCL: what a training rank tells an inference rank about each bucket
//! before sending it, and where each bucket's delta frame sits.
//!
//! With deltas on between two ranks (both published that they take part, and the pair has
//! them on), every step is two NCCL groups instead of one. The first carries a
//! [`BucketHeader`] per bucket ([`HEADER_BYTES`] each): the bucket is sent whole (`Dense`) or
//! as a delta frame of a given length against a given version (`Delta`). The receiver reads
//! the headers on the host (NCCL needs each receive's byte count when it is posted), then the
//! second group moves each bucket's bytes: the whole bucket, as without deltas, or its frame
//! (`awex_core::encoding::delta_frame`, encoded on the training GPU by
//! [`crate::cuda::delta_wire`]'s kernels against the sender's copy of what it last sent).
//!
//! A bucket's frame has one segment per run of elements ([`super::OpSeg`]): each piece, and a
//! sender-encoded FP8 piece's e4m3 bytes and scales apart, so FP8 deltas are taken on the
//! encoded bytes. The receiver gathers the bucket's boxes from its tensors into the slot (or
//! decodes in place where the bucket lies contiguously in one tensor), applies the frame there
//! and unpacks as for a whole bucket; it holds no copy of anything.
//!
//! Both ends step bucket `k` of every pair in step `k` ([`super::schedule`]), so the host's
//! wait for step `k`'s headers (receiver) and for step `k`'s encode (sender) keeps the
//! schedule's induction: every rank posts all of step `k - 1` before it waits in step `k`.

use super::NcclError;
use super::program::{OpSeg, StepIo};
use crate::cuda::delta_wire::{WireSegment, WireTable};

/// Bytes of one bucket's header on the wire.
pub const HEADER_BYTES: u64 = 32;

/// The first word of every header: catches two ends that disagree on the schedule.
const MAGIC: u32 = u32::from_le_bytes(*b"AWXD");

/// What the second group of a step carries for one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BucketHeader {
    /// The bucket's bytes, whole.
    Dense {
        /// The bucket's wire bytes.
        bytes: u64,
    },
    /// A delta frame against `base`.
    Delta {
        /// The bucket's wire bytes (what the frame applies to).
        bytes: u64,
        /// The frame's bytes.
        len: u64,
        /// The version the frame is taken against.
        base: u64,
    },
}

impl BucketHeader {
    /// The header's wire bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES as usize] {
        let (kind, bytes, len, base) = match *self {
            BucketHeader::Dense { bytes } => (0u32, bytes, bytes, 0u64),
            BucketHeader::Delta { bytes, len, base } => (1, bytes, len, base),
        };
        let mut out = [0u8; HEADER_BYTES as usize];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&kind.to_le_bytes());
        out[8..16].copy_from_slice(&bytes.to_le_bytes());
        out[16..24].copy_from_slice(&len.to_le_bytes());
        out[24..32].copy_from_slice(&base.to_le_bytes());
        out
    }

    /// Reads the header of a bucket of `bytes` wire bytes whose frame holds at most
    /// `max_frame` bytes, refusing anything else (naming `peer`, the sender).
    pub fn parse(
        b: &[u8],
        bytes: u64,
        max_frame: u64,
        peer: &str,
    ) -> Result<BucketHeader, NcclError> {
        let bad = |why: String| {
            Err(NcclError::Plan(format!(
                "the delta header from {peer} {why}; both ends must run the same awex with the same plan"
            )))
        };
        let Ok(h) = <[u8; HEADER_BYTES as usize]>::try_from(b) else {
            return bad(format!("holds {} bytes, not {HEADER_BYTES}", b.len()));
        };
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&h[i..i + 8]);
            u64::from_le_bytes(w)
        };
        if u32_at(0) != MAGIC {
            return bad("is not a bucket header (no magic word)".into());
        }
        let (kind, theirs, len, base) = (u32_at(4), u64_at(8), u64_at(16), u64_at(24));
        if theirs != bytes {
            return bad(format!(
                "is for a bucket of {theirs} bytes, but this rank's bucket holds {bytes}"
            ));
        }
        match kind {
            0 if len == bytes => Ok(BucketHeader::Dense { bytes }),
            0 => bad(format!(
                "says whole bucket of {bytes} bytes but {len} bytes"
            )),
            1 if (1..=max_frame).contains(&len) => Ok(BucketHeader::Delta { bytes, len, base }),
            1 => bad(format!(
                "announces a frame of {len} bytes; this bucket's frames hold 1 to {max_frame}"
            )),
            k => bad(format!("has kind {k} (neither whole, 0, nor delta, 1)")),
        }
    }
}

/// Where each delta bucket of one step puts its frame in a frame buffer: 256-aligned
/// offsets, and the buffer's bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrameLayout {
    /// Per operation of the step: `Some((offset, longest frame))` where the bucket may travel
    /// as a delta.
    pub at: Vec<Option<(u64, u64)>>,
    /// Bytes the step's frames take.
    pub bytes: u64,
}

impl FrameLayout {
    /// Lays out the frames of `step`'s operations for which `delta(i)` holds and whose bucket
    /// the kernels can frame ([`frameable`]; both ends decide alike from the same plan).
    pub fn of(step: &StepIo, mut delta: impl FnMut(usize) -> bool) -> FrameLayout {
        let mut at = Vec::with_capacity(step.ops.len());
        let mut off = 0u64;
        for (i, segs) in step.segs.iter().enumerate() {
            if !delta(i) || !frameable(segs) {
                at.push(None);
                continue;
            }
            let max = max_frame_len(segs);
            at.push(Some((off, max)));
            off = (off + max).div_ceil(super::SLOT_ALIGN) * super::SLOT_ALIGN;
        }
        FrameLayout { at, bytes: off }
    }
}

/// Whether the wire kernels take a bucket of runs `segs`: elements of 1, 2 or 4 bytes, each run
/// under 2^32 - 1 bytes (a bucket holding anything else always goes whole).
pub fn frameable(segs: &[OpSeg]) -> bool {
    segs.iter().all(|s| {
        matches!(s.elem, 1 | 2 | 4)
            && s.n
                .checked_mul(s.elem as u64)
                .is_some_and(|b| b < u32::MAX as u64)
    })
}

/// The longest frame of a bucket with runs `segs`: every segment dense.
pub fn max_frame_len(segs: &[OpSeg]) -> u64 {
    4 + 4 * segs.len() as u64 + segs.iter().map(|s| 1 + s.n * s.elem as u64).sum::<u64>()
}

/// The kernels' table of a bucket's frame: its runs at `src` (the new bytes to encode, or the
/// bytes a decode writes) and `base` (the version the receiver holds; 0 to decode).
pub fn wire_table(segs: &[OpSeg], src: u64, base: u64) -> Result<WireTable, NcclError> {
    let w: Vec<WireSegment> = segs
        .iter()
        .map(|s| WireSegment {
            src: src + s.at,
            base: if base == 0 { 0 } else { base + s.at },
            n: s.n,
            elem: s.elem,
        })
        .collect();
    Ok(WireTable::new(&w)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_of_8_byte_elements_or_huge_runs_are_not_framed() {
        let seg = |n, elem| OpSeg { at: 0, n, elem };
        assert!(frameable(&[seg(100, 2), seg(7, 1), seg(3, 4)]));
        assert!(!frameable(&[seg(100, 2), seg(4, 8)]));
        assert!(!frameable(&[seg(1 << 31, 2)]));
        assert!(frameable(&[]));
    }

    #[test]
    fn headers_round_trip_and_every_malformed_one_is_refused_by_name() {
        let d = BucketHeader::Delta {
            bytes: 4096,
            len: 100,
            base: 7,
        };
        assert_eq!(
            BucketHeader::parse(&d.to_bytes(), 4096, 5000, "training rank 0").unwrap(),
            d
        );
        let w = BucketHeader::Dense { bytes: 4096 };
        assert_eq!(
            BucketHeader::parse(&w.to_bytes(), 4096, 5000, "training rank 0").unwrap(),
            w
        );
        let err = |b: &[u8], bytes: u64| {
            BucketHeader::parse(b, bytes, 5000, "training rank 3")
                .unwrap_err()
                .to_string()
        };
        // another bucket (the ends disagree on the schedule)
        let e = err(&d.to_bytes(), 8192);
        assert!(
            e.starts_with("the delta header from training rank 3 is for a bucket of 4096 bytes, but this rank's bucket holds 8192"),
            "{e}"
        );
        // a frame longer than the bucket's frames can be: never posted as a receive
        let long = BucketHeader::Delta {
            bytes: 4096,
            len: 5001,
            base: 7,
        };
        assert!(err(&long.to_bytes(), 4096).contains("frames hold 1 to 5000"));
        let empty = BucketHeader::Delta {
            bytes: 4096,
            len: 0,
            base: 7,
        };
        assert!(err(&empty.to_bytes(), 4096).contains("frame of 0 bytes"));
        let mut b = d.to_bytes();
        b[0] ^= 1;
        assert!(err(&b, 4096).contains("no magic word"));
        let mut b = d.to_bytes();
        b[4] = 9;
        assert!(err(&b, 4096).contains("has kind 9"));
        let mut b = w.to_bytes();
        b[16] ^= 1;
        assert!(err(&b, 4096).contains("whole bucket of 4096 bytes but 4097"));
        assert!(err(&b[..31], 4096).contains("holds 31 bytes, not 32"));
    }
}
