//! Delta frames: a bucket's segment deltas ([`super::delta`]) behind a header of their byte
//! lengths, so that a GPU decoder finds every segment without parsing the ones before it.
//!
//! The segments a bucket holds are known to both ends from the plan: their order, each one's
//! element count `n` and element size `s`. A frame carries them in that order:
//!
//! ```text
//! frame    := count:u32, len[count]:u32, segment[0] .. segment[count - 1]
//! count    the number of segments (checked against the plan's)
//! len[i]   the bytes of segment i (tag included), 1 ..= 2^32 - 1
//! segment  one segment of the wire format of `super::delta`, tag and body, unchanged
//! ```
//!
//! Integers are little-endian; nothing is padded, so segment `i` starts at `4 + 4 count +
//! len[0] + ... + len[i - 1]`. A segment longer than 2^32 - 1 bytes cannot be framed: the
//! sender splits it (a segment's encoding is at most `1 + n s` bytes).
//!
//! The CPU encoders write all four forms ([`Forms::All`]); the GPU encoder
//! (`awex_gpu::cuda::delta_wire`) writes dense, sparse and unchanged only
//! ([`Forms::NoGaps`]) with exactly the CPU's rules for them, so its frames equal
//! [`encode_frame`]'s with `Forms::NoGaps` byte for byte. [`decode_frame`] reads either: the
//! CPU decoder is the judge of every frame. The GPU decoder takes tags 0-2 and refuses a frame
//! holding a gaps segment ([`gpu_decodable`] says so on the host).
//!
//! Decoding checks the header against the plan (count, every length at least 1, the lengths
//! summing to the frame's bytes) before anything is written, and that every segment ends
//! exactly where its length says; a malformed frame is an error naming the segment, never a
//! panic or a write outside the segment.

use super::delta::{self, DeltaError, DeltaStats, Forms, TAG_GAPS};
use thiserror::Error;

/// Bytes of the header of a frame of `count` segments.
pub fn header_len(count: usize) -> usize {
    4 + 4 * count
}

/// A malformed frame, or one that does not match the plan.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    /// The frame is shorter than its header.
    #[error(
        "delta frame of {len} bytes is shorter than the header of {count} segments ({need} bytes)"
    )]
    Header {
        /// bytes of the frame
        len: usize,
        /// segments the plan expects
        count: usize,
        /// bytes of the header
        need: usize,
    },
    /// The frame holds another number of segments than the plan's.
    #[error(
        "delta frame holds {found} segments, the plan {want}: sender and receiver disagree on the bucket"
    )]
    Count {
        /// the count read
        found: u32,
        /// the plan's
        want: usize,
    },
    /// The lengths do not add up to the frame's bytes.
    #[error("delta frame's segment lengths sum to {sum} bytes, but {body} follow the header")]
    Lengths {
        /// sum of the lengths
        sum: u64,
        /// bytes after the header
        body: usize,
    },
    /// A segment of length 0 (every segment has at least its tag).
    #[error("delta frame: segment {seg} has length 0 (every segment holds at least its tag)")]
    Empty {
        /// the segment
        seg: usize,
    },
    /// A segment too long for the header's u32 length.
    #[error(
        "delta frame: segment {seg} encodes to {bytes} bytes, above the 2^32 - 1 a frame carries; split it"
    )]
    TooLong {
        /// the segment
        seg: usize,
        /// its bytes
        bytes: usize,
    },
    /// A segment that does not decode.
    #[error("delta frame: segment {seg}: {source}")]
    Segment {
        /// the segment
        seg: usize,
        /// what is wrong with it
        source: DeltaError,
    },
    /// A segment that decodes in other than its length.
    #[error("delta frame: segment {seg} is {len} bytes long, but its delta ends after {used}")]
    SegmentLength {
        /// the segment
        seg: usize,
        /// its length in the header
        len: usize,
        /// bytes its delta took
        used: usize,
    },
    /// Old and new payloads or bases not matching the plan's segments.
    #[error("delta frame: segment {seg}: {detail}")]
    Plan {
        /// the segment
        seg: usize,
        /// what does not match
        detail: String,
    },
    /// A gaps segment where the GPU decoder reads the frame.
    #[error(
        "delta frame: segment {seg} is a gaps segment (tag 3), which the GPU decoder does not read; encode frames for a GPU receiver with the dense, sparse and unchanged forms only (Forms::NoGaps), or decode this one on the CPU"
    )]
    Gaps {
        /// the segment
        seg: usize,
    },
}

/// One segment of a frame as the plan gives it: `n` elements of `elem` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentSpec {
    /// elements
    pub n: usize,
    /// bytes per element (1, 2, 4 or 8)
    pub elem: usize,
}

/// Appends the frame of `segments` (each: base bytes, new bytes, element size) to `out`, each
/// segment encoded with `forms`. Returns the figures of all segments together (`delta_bytes`
/// counts the header too).
pub fn encode_frame(
    segments: &[(&[u8], &[u8], usize)],
    forms: Forms,
    out: &mut Vec<u8>,
) -> Result<DeltaStats, FrameError> {
    let start = out.len();
    out.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    out.resize(start + header_len(segments.len()), 0);
    let mut total = DeltaStats::default();
    for (i, &(old, new, elem)) in segments.iter().enumerate() {
        let at = out.len();
        let st = delta::encode_with(old, new, elem, forms, out)
            .map_err(|source| FrameError::Segment { seg: i, source })?;
        let len = out.len() - at;
        let Ok(l32) = u32::try_from(len) else {
            out.truncate(start);
            return Err(FrameError::TooLong { seg: i, bytes: len });
        };
        out[start + 4 + 4 * i..start + 8 + 4 * i].copy_from_slice(&l32.to_le_bytes());
        total.add(&st);
    }
    total.delta_bytes = (out.len() - start) as u64;
    Ok(total)
}

/// Where each segment of `frame` lies (byte ranges of `frame`), after checking the header
/// against the plan's `count` segments.
pub fn segment_ranges(
    frame: &[u8],
    count: usize,
) -> Result<Vec<std::ops::Range<usize>>, FrameError> {
    let need = header_len(count);
    if frame.len() < need {
        return Err(FrameError::Header {
            len: frame.len(),
            count,
            need,
        });
    }
    let word = |i: usize| u32::from_le_bytes([frame[i], frame[i + 1], frame[i + 2], frame[i + 3]]);
    let found = word(0);
    if found as usize != count {
        return Err(FrameError::Count { found, want: count });
    }
    let mut at = need;
    let mut out = Vec::with_capacity(count);
    let mut sum = 0u64;
    for i in 0..count {
        let len = word(4 + 4 * i) as usize;
        if len == 0 {
            return Err(FrameError::Empty { seg: i });
        }
        sum += len as u64;
        let end = at.saturating_add(len);
        out.push(at..end);
        at = end;
    }
    if sum != (frame.len() - need) as u64 {
        return Err(FrameError::Lengths {
            sum,
            body: frame.len() - need,
        });
    }
    Ok(out)
}

/// The tag of every segment of `frame` (checked against the plan's `count`).
pub fn frame_tags(frame: &[u8], count: usize) -> Result<Vec<u8>, FrameError> {
    Ok(segment_ranges(frame, count)?
        .into_iter()
        .map(|r| frame[r.start])
        .collect())
}

/// Whether the GPU decoder reads `frame`: a well-formed header and no gaps segment (the first
/// one is named).
pub fn gpu_decodable(frame: &[u8], count: usize) -> Result<(), FrameError> {
    match frame_tags(frame, count)?
        .iter()
        .position(|&t| t == TAG_GAPS)
    {
        Some(seg) => Err(FrameError::Gaps { seg }),
        None => Ok(()),
    }
}

/// Decodes every segment of `frame` against the plan's `specs`, calling `write(segment, first,
/// values)` for each run of changed elements (see [`delta::decode`]). The header is checked
/// before anything is written; each segment is checked to end where its length says.
pub fn decode_frame(
    frame: &[u8],
    specs: &[SegmentSpec],
    mut write: impl FnMut(usize, usize, &[u8]),
) -> Result<(), FrameError> {
    let ranges = segment_ranges(frame, specs.len())?;
    for (i, (r, sp)) in ranges.into_iter().zip(specs).enumerate() {
        let len = r.len();
        let used = delta::decode(&frame[r], sp.elem, sp.n, |first, v| write(i, first, v))
            .map_err(|source| FrameError::Segment { seg: i, source })?;
        if used != len {
            return Err(FrameError::SegmentLength { seg: i, len, used });
        }
    }
    Ok(())
}

/// Applies `frame` to `bases` (one per segment, in order, each the segment's whole bytes of
/// `elems[i]`-byte elements), turning them into the new version.
pub fn apply_frame(
    frame: &[u8],
    elems: &[usize],
    bases: &mut [&mut [u8]],
) -> Result<(), FrameError> {
    if elems.len() != bases.len() {
        return Err(FrameError::Plan {
            seg: elems.len().min(bases.len()),
            detail: format!(
                "{} element sizes for {} bases: one each",
                elems.len(),
                bases.len()
            ),
        });
    }
    let mut specs = Vec::with_capacity(elems.len());
    for (i, (&e, b)) in elems.iter().zip(bases.iter()).enumerate() {
        if e == 0 || b.len() % e != 0 {
            return Err(FrameError::Plan {
                seg: i,
                detail: format!("{} bytes are not whole {e}-byte elements", b.len()),
            });
        }
        specs.push(SegmentSpec {
            n: b.len() / e,
            elem: e,
        });
    }
    decode_frame(frame, &specs, |seg, first, v| {
        let e = elems[seg];
        bases[seg][first * e..first * e + v.len()].copy_from_slice(v);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoding::delta::tests::{rng, versions};
    use crate::encoding::delta::{TAG_DENSE, TAG_SPARSE, TAG_UNCHANGED};

    #[test]
    fn frames_of_both_forms_apply_to_the_new_bytes_and_find_every_segment() {
        // segments of every element size, density and a few lengths, empty ones included
        let mut segs = vec![];
        let mut k = 0u64;
        for elem in [1usize, 2, 4, 8] {
            for (n, per_mille) in [
                (0, 0),
                (1, 1000),
                (300, 0),
                (4099, 3),
                (777, 30),
                (1000, 1000),
            ] {
                k += 1;
                segs.push((elem, versions(n, elem, per_mille, k)));
            }
        }
        let view: Vec<(&[u8], &[u8], usize)> = segs
            .iter()
            .map(|(e, (o, n))| (o.as_slice(), n.as_slice(), *e))
            .collect();
        let elems: Vec<usize> = segs.iter().map(|s| s.0).collect();
        for forms in [Forms::All, Forms::NoGaps] {
            let mut f = vec![0xAA]; // frames append: what precedes is kept
            let st = encode_frame(&view, forms, &mut f).unwrap();
            assert_eq!(f[0], 0xAA);
            let f = &f[1..];
            assert_eq!(st.delta_bytes as usize, f.len());
            let mut bases: Vec<Vec<u8>> = segs.iter().map(|s| s.1.0.clone()).collect();
            let mut refs: Vec<&mut [u8]> = bases.iter_mut().map(|b| b.as_mut_slice()).collect();
            apply_frame(f, &elems, &mut refs).unwrap();
            for (b, s) in bases.iter().zip(&segs) {
                assert_eq!(b, &s.1.1);
            }
            // each segment found from the header alone equals its own encoding
            let ranges = segment_ranges(f, segs.len()).unwrap();
            for (r, &(o, n, e)) in ranges.iter().zip(&view) {
                let mut one = vec![];
                delta::encode_with(o, n, e, forms, &mut one).unwrap();
                assert_eq!(&f[r.clone()], one.as_slice());
            }
            let tags = frame_tags(f, segs.len()).unwrap();
            assert_eq!(tags[0], TAG_UNCHANGED); // n = 0
            assert!(tags.contains(&TAG_DENSE) && tags.contains(&TAG_SPARSE));
            match forms {
                Forms::NoGaps => {
                    assert!(!tags.contains(&TAG_GAPS));
                    gpu_decodable(f, segs.len()).unwrap();
                }
                Forms::All => {
                    let g = tags.iter().position(|&t| t == TAG_GAPS).unwrap();
                    assert_eq!(
                        gpu_decodable(f, segs.len()),
                        Err(FrameError::Gaps { seg: g })
                    );
                }
            }
        }
    }

    #[test]
    fn malformed_frames_are_errors_naming_what_is_wrong() {
        let (o1, n1) = versions(600, 2, 30, 1);
        let (o2, n2) = versions(100, 4, 1000, 2);
        let mut f = vec![];
        encode_frame(&[(&o1, &n1, 2), (&o2, &n2, 4)], Forms::NoGaps, &mut f).unwrap();
        let specs = [
            SegmentSpec { n: 600, elem: 2 },
            SegmentSpec { n: 100, elem: 4 },
        ];
        let ok = |f: &[u8]| decode_frame(f, &specs, |_, _, _| {});
        ok(&f).unwrap();
        assert!(matches!(
            ok(&f[..5]),
            Err(FrameError::Header { need: 12, .. })
        ));
        assert_eq!(
            decode_frame(&f, &specs[..1], |_, _, _| {}),
            Err(FrameError::Count { found: 2, want: 1 })
        );
        // one byte more or less than the lengths say
        let mut longer = f.clone();
        longer.push(0);
        assert!(matches!(ok(&longer), Err(FrameError::Lengths { .. })));
        assert!(matches!(
            ok(&f[..f.len() - 1]),
            Err(FrameError::Lengths { .. })
        ));
        // a zero length
        let mut z = f.clone();
        z[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(ok(&z), Err(FrameError::Empty { seg: 0 }));
        // a length moved from one segment to the next: the first ends before its length says
        let mut moved = f.clone();
        let l0 = u32::from_le_bytes(f[4..8].try_into().unwrap());
        let l1 = u32::from_le_bytes(f[8..12].try_into().unwrap());
        moved[4..8].copy_from_slice(&(l0 + 1).to_le_bytes());
        moved[8..12].copy_from_slice(&(l1 - 1).to_le_bytes());
        assert_eq!(
            ok(&moved),
            Err(FrameError::SegmentLength {
                seg: 0,
                len: l0 as usize + 1,
                used: l0 as usize
            })
        );
        // a bad tag in the second segment names it
        let mut bad = f.clone();
        bad[12 + l0 as usize] = 7;
        assert!(matches!(
            ok(&bad),
            Err(FrameError::Segment {
                seg: 1,
                source: DeltaError::Tag { tag: 7, .. }
            })
        ));
        // bases that are not whole elements
        let mut odd = vec![0u8; 3];
        assert!(matches!(
            apply_frame(&f, &[2], &mut [&mut odd]),
            Err(FrameError::Plan { seg: 0, .. })
        ));
        // random bytes never panic
        let mut s = 3u64;
        for _ in 0..5000 {
            let len = rng(&mut s) as usize % 40;
            let mut r: Vec<u8> = (0..len).map(|_| rng(&mut s) as u8).collect();
            if r.len() >= 4 {
                r[0..4].copy_from_slice(&2u32.to_le_bytes());
            }
            let _ = decode_frame(&r, &specs, |_, _, _| {});
        }
    }
}
