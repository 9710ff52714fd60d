//! The `cuda-ipc` control segment: what a training rank publishes for its receivers (its IPC
//! handles and `cuMemMap` spans, its tensors, its peers' bucket ranges and checksums), written
//! and read over the codec shared with `shm` (`transport::control`).

use super::super::control::{ControlSegment, table_words};
use crate::{RuntimeError, TransportError};
use awex_gpu::cuda::handle::HANDLE_BYTES;
use awex_gpu::cuda::{ExportedAllocation, IpcMemHandle, RemoteAddr, SharedChunk, SharedChunks};
use std::sync::atomic::{AtomicU64, Ordering};

pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"AWEXIPC2");
/// Header words: magic, ready, done, allocations, tensors, peers, sums, device, chunks.
pub(super) const HEADER_WORDS: usize = 9;
/// Words of one allocation entry: the handle's 64 bytes, the size, and the kind: 0 for a legacy
/// IPC handle, 1 for a span of `cuMemMap` chunks, whose handle words then hold the exporting
/// pid, the span's first entry in the chunk table and its number of chunks.
pub(super) const ALLOC_WORDS: usize = HANDLE_BYTES / 8 + 2;
/// Words of one chunk entry: offset in its span, size, the exporter's file descriptor.
pub(super) const CHUNK_WORDS: usize = 3;
/// Words of one tensor entry: name hash, allocation, offset, length.
pub(super) const TENSOR_WORDS: usize = 4;
/// Words of one peer entry: peer key, first checksum index, buckets.
pub(super) const PEER_WORDS: usize = 3;

/// A tensor of the training rank, as the control segment lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TensorEntry {
    pub(super) hash: u64,
    pub(super) at: RemoteAddr,
    pub(super) len: u64,
}

/// A peer of the training rank: its key, its first checksum index and its bucket count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PeerEntry {
    pub(super) key: u64,
    pub(super) first_sum: u64,
    pub(super) buckets: u64,
}

/// What a training rank publishes in its control segment besides the header words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Published {
    pub(super) device: u32,
    pub(super) allocations: Vec<ExportedAllocation>,
    pub(super) tensors: Vec<TensorEntry>,
    pub(super) peers: Vec<PeerEntry>,
    pub(super) sums: usize,
}

impl Published {
    pub(super) fn chunks(&self) -> usize {
        self.allocations
            .iter()
            .filter_map(|a| a.chunks.as_ref())
            .map(|c| c.chunks.len())
            .sum()
    }

    pub(super) fn words(&self) -> usize {
        HEADER_WORDS
            + ALLOC_WORDS * self.allocations.len()
            + TENSOR_WORDS * self.tensors.len()
            + PEER_WORDS * self.peers.len()
            + CHUNK_WORDS * self.chunks()
            + self.sums
    }
}

/// The `cuda-ipc` tables of a control segment ([`ControlSegment`]): after the header, the
/// allocations, tensors, peers and `cuMemMap` chunks, then one word per bucket checksum.
pub(super) struct Control {
    pub(super) seg: ControlSegment,
    /// first word of the checksums
    sums_at: usize,
    sums: usize,
}

impl Control {
    pub(super) fn word(&self, i: usize) -> &AtomicU64 {
        self.seg.word(i)
    }
    pub(super) fn ready(&self) -> &AtomicU64 {
        self.seg.ready()
    }
    pub(super) fn done(&self) -> &AtomicU64 {
        self.seg.done()
    }
    pub(super) fn sum(&self, i: u64) -> Result<&AtomicU64, RuntimeError> {
        if i as usize >= self.sums {
            return Err(TransportError::ChecksumOutside {
                index: i,
                sums: self.sums,
            }
            .into());
        }
        Ok(self.word(self.sums_at + i as usize))
    }

    /// Creates segment `name` holding `p`, then marks it valid.
    pub(super) fn create(name: &str, p: &Published) -> Result<Control, RuntimeError> {
        let c = Control {
            seg: ControlSegment::create(name, p.words())?,
            sums_at: p.words() - p.sums,
            sums: p.sums,
        };
        let mut w = c.seg.writer(HEADER_WORDS);
        let mut first_chunk = 0u64;
        for a in &p.allocations {
            match &a.chunks {
                None => {
                    for chunk in a.handle.0.chunks_exact(8) {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(chunk);
                        w.put(u64::from_le_bytes(b));
                    }
                    w.put(a.size);
                    w.put(0);
                }
                Some(sc) => {
                    let n = sc.chunks.len() as u64;
                    for v in [sc.pid as u64, first_chunk, n] {
                        w.put(v);
                    }
                    for _ in 3..HANDLE_BYTES / 8 {
                        w.put(0);
                    }
                    w.put(a.size);
                    w.put(1);
                    first_chunk += n;
                }
            }
        }
        for t in &p.tensors {
            w.put(t.hash);
            w.put(t.at.allocation as u64);
            w.put(t.at.offset);
            w.put(t.len);
        }
        for e in &p.peers {
            w.put(e.key);
            w.put(e.first_sum);
            w.put(e.buckets);
        }
        for sc in p.allocations.iter().filter_map(|a| a.chunks.as_ref()) {
            for ch in &sc.chunks {
                w.put(ch.offset);
                w.put(ch.size);
                w.put(ch.fd as u64);
            }
        }
        for (i, v) in [
            p.allocations.len(),
            p.tensors.len(),
            p.peers.len(),
            p.sums,
            p.device as usize,
            p.chunks(),
        ]
        .into_iter()
        .enumerate()
        {
            c.word(3 + i).store(v as u64, Ordering::Relaxed);
        }
        c.seg.seal(MAGIC);
        Ok(c)
    }

    /// Opens segment `name` and reads what it publishes, checking every count against its size.
    pub(super) fn open(name: &str) -> Result<(Control, Published), RuntimeError> {
        let seg = ControlSegment::open(name)?;
        let bad = |why: &'static str| {
            RuntimeError::from(TransportError::NotIpcControl {
                name: name.to_string(),
                why,
            })
        };
        if seg.words() < HEADER_WORDS {
            return Err(bad("too short"));
        }
        if !seg.has_magic(MAGIC, HEADER_WORDS) {
            return Err(bad("no magic"));
        }
        let n = |i: usize| seg.word(i).load(Ordering::Relaxed);
        let (n_allocs, n_tensors, n_peers, n_sums, device, n_chunks) =
            (n(3), n(4), n(5), n(6), n(7), n(8));
        let words = table_words(
            HEADER_WORDS,
            &[
                (ALLOC_WORDS, n_allocs),
                (TENSOR_WORDS, n_tensors),
                (PEER_WORDS, n_peers),
                (CHUNK_WORDS, n_chunks),
                (1, n_sums),
            ],
        );
        if words.is_none_or(|w| w > seg.words()) {
            return Err(bad("its tables run past its end"));
        }
        // every count fits the mapping, so in usize
        let (n_allocs, n_tensors, n_peers, n_sums, n_chunks) = (
            n_allocs as usize,
            n_tensors as usize,
            n_peers as usize,
            n_sums as usize,
            n_chunks as usize,
        );
        let mut r = seg.reader(HEADER_WORDS);
        let mut allocations = Vec::with_capacity(n_allocs);
        // spans: (allocation, pid, first chunk, chunks), filled in from the chunk table below
        let mut spans = Vec::new();
        for i in 0..n_allocs {
            let mut h = [0u8; HANDLE_BYTES];
            for chunk in h.chunks_exact_mut(8) {
                chunk.copy_from_slice(&r.next().to_le_bytes());
            }
            let size = r.next();
            match r.next() {
                0 => {}
                1 => {
                    let word = |k: usize| {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(&h[8 * k..8 * k + 8]);
                        u64::from_le_bytes(b)
                    };
                    let pid = u32::try_from(word(0)).map_err(|_| bad("span pid"))?;
                    let (first, count) = (word(1), word(2));
                    if first
                        .checked_add(count)
                        .is_none_or(|end| end > n_chunks as u64)
                    {
                        return Err(bad("a span's chunks run past the chunk table"));
                    }
                    spans.push((i, pid, first as usize, count as usize));
                    h = [0u8; HANDLE_BYTES];
                }
                _ => return Err(bad("allocation kind")),
            }
            allocations.push(ExportedAllocation {
                handle: IpcMemHandle(h),
                size,
                chunks: None,
            });
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let (hash, allocation, offset, len) = (r.next(), r.next(), r.next(), r.next());
            let allocation = u32::try_from(allocation).map_err(|_| bad("allocation index"))?;
            tensors.push(TensorEntry {
                hash,
                at: RemoteAddr { allocation, offset },
                len,
            });
        }
        let mut peers = Vec::with_capacity(n_peers);
        for _ in 0..n_peers {
            peers.push(PeerEntry {
                key: r.next(),
                first_sum: r.next(),
                buckets: r.next(),
            });
        }
        let mut table = Vec::with_capacity(n_chunks);
        for _ in 0..n_chunks {
            let (offset, size, fd) = (r.next(), r.next(), r.next());
            let fd = i32::try_from(fd).map_err(|_| bad("chunk file descriptor"))?;
            table.push(SharedChunk { offset, size, fd });
        }
        for (i, pid, first, count) in spans {
            let sc = SharedChunks {
                pid,
                chunks: table[first..first + count].to_vec(),
            };
            sc.check(allocations[i].size)
                .map_err(|_| bad("a span's chunks do not fit it"))?;
            allocations[i].chunks = Some(sc);
        }
        let sums_at = r.position();
        let device = u32::try_from(device).map_err(|_| bad("device ordinal"))?;
        Ok((
            Control {
                seg,
                sums_at,
                sums: n_sums,
            },
            Published {
                device,
                allocations,
                tensors,
                peers,
                sums: n_sums,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::ShmSegment;
    use crate::transport::cuda_ipc::{name_hash, peer_key};
    use awex_core::layout::RankId;

    fn published() -> Published {
        let handle = |seed: u8| {
            let mut h = [0u8; HANDLE_BYTES];
            for (i, b) in h.iter_mut().enumerate() {
                *b = seed.wrapping_mul(31).wrapping_add(i as u8);
            }
            IpcMemHandle(h)
        };
        Published {
            device: 3,
            allocations: vec![
                ExportedAllocation {
                    handle: handle(1),
                    size: 4096,
                    chunks: None,
                },
                ExportedAllocation {
                    handle: IpcMemHandle([0; HANDLE_BYTES]),
                    size: 60 << 20,
                    chunks: Some(SharedChunks {
                        pid: 4242,
                        chunks: vec![
                            SharedChunk {
                                offset: 0,
                                size: 20 << 20,
                                fd: 57,
                            },
                            SharedChunk {
                                offset: 20 << 20,
                                size: 40 << 20,
                                fd: 58,
                            },
                        ],
                    }),
                },
                ExportedAllocation {
                    handle: handle(2),
                    size: 1 << 40,
                    chunks: None,
                },
            ],
            tensors: vec![
                TensorEntry {
                    hash: name_hash("a"),
                    at: RemoteAddr {
                        allocation: 0,
                        offset: 256,
                    },
                    len: 100,
                },
                TensorEntry {
                    hash: name_hash("b"),
                    at: RemoteAddr {
                        allocation: 1,
                        offset: 0,
                    },
                    len: 1 << 39,
                },
            ],
            peers: vec![
                PeerEntry {
                    key: peer_key(RankId::infer(0, 1)),
                    first_sum: 0,
                    buckets: 2,
                },
                PeerEntry {
                    key: peer_key(RankId::infer(1, 0)),
                    first_sum: 2,
                    buckets: 3,
                },
            ],
            sums: 5,
        }
    }

    #[test]
    fn control_segment_round_trips_handles_tensors_peers_and_sums() {
        let name = format!("awex-test-ipc{}-ctl", std::process::id());
        let p = published();
        let writer = Control::create(&name, &p).unwrap();
        // header, 3 allocations, 2 tensors, 2 peers, 2 chunks, 5 sums
        assert_eq!(writer.seg.words(), (9 + 3 * 10 + 2 * 4 + 2 * 3 + 2 * 3 + 5));
        writer.sum(4).unwrap().store(0xfeed, Ordering::Relaxed);
        writer.ready().store(7 << 16 | 2, Ordering::Release);
        let (reader, back) = Control::open(&name).unwrap();
        assert_eq!(back, p);
        assert_eq!(reader.sum(4).unwrap().load(Ordering::Relaxed), 0xfeed);
        assert_eq!(reader.ready().load(Ordering::Acquire), 7 << 16 | 2);
        assert_eq!(
            reader.sum(5).unwrap_err().to_string(),
            "transport: checksum 5 lies outside the 5 the training rank publishes (plans disagree)"
        );
        reader.done().fetch_add(1, Ordering::AcqRel);
        assert_eq!(writer.done().load(Ordering::Acquire), 1);
        drop(reader);
        drop(writer);
        assert!(crate::shm::list_segments(&name).is_empty());
    }

    #[test]
    fn segment_without_the_magic_or_with_oversized_tables_is_refused() {
        let name = format!("awex-test-ipcbad{}-ctl", std::process::id());
        let seg = ShmSegment::create(&name, 80).unwrap();
        let e = Control::open(&name).err().unwrap();
        assert_eq!(
            e.to_string(),
            format!(
                "transport: shared-memory segment `{name}` is not an awex cuda-ipc control segment (no magic)"
            )
        );
        // SAFETY: word 0 and word 3 lie inside the 80-byte segment.
        unsafe {
            *(seg.ptr() as *mut u64) = MAGIC;
            *(seg.ptr().add(24) as *mut u64) = 1_000_000;
        }
        let e = Control::open(&name).err().unwrap();
        assert_eq!(
            e.to_string(),
            format!(
                "transport: shared-memory segment `{name}` is not an awex cuda-ipc control segment (its tables run past its end)"
            )
        );
    }

    #[test]
    fn a_span_past_the_chunk_table_or_outside_its_size_or_of_an_unknown_kind_is_refused() {
        let name = format!("awex-test-ipcspan{}-ctl", std::process::id());
        let p = published();
        // the span is allocation 1: its entry starts after the header, at allocation 0's end
        let at = HEADER_WORDS + ALLOC_WORDS;
        let word = |c: &Control, i: usize, v: u64| c.word(i).store(v, Ordering::Relaxed);
        let cases: [(usize, u64, &str); 4] = [
            (at + 1, 1, "a span's chunks run past the chunk table"), // 2 chunks from index 1
            (at + 1, u64::MAX, "a span's chunks run past the chunk table"),
            (
                at + HANDLE_BYTES / 8,
                30 << 20,
                "a span's chunks do not fit it",
            ), // size < 60 MiB
            (at + HANDLE_BYTES / 8 + 1, 2, "allocation kind"),
        ];
        for (i, v, why) in cases {
            let w = Control::create(&name, &p).unwrap();
            word(&w, i, v);
            let e = Control::open(&name).err().expect(why);
            assert_eq!(
                e.to_string(),
                format!(
                    "transport: shared-memory segment `{name}` is not an awex cuda-ipc control segment ({why})"
                ),
                "word {i} = {v}"
            );
            drop(w);
        }
    }
}
