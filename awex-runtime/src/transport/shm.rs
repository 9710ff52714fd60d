//! The `shm` transport: inference ranks copy their boxes straight out of the training rank's
//! shared-memory tensors (one copy), converting dtype while copying.
//!
//! Each training rank publishes a control segment: a header (ready version, done count), a
//! table of its tensors' offsets in its data segment, and per-peer bucket checksums. Per update
//! it computes checksums (when on), publishes `ready = version`, and waits until every peer
//! counted itself done. Receivers wait for `ready`, copy, verify, and count themselves done.
//!
//! With deltas on ([`crate::delta`]), the sender encodes, for each receiver that holds the
//! version its copy holds, every bucket's delta into its delta segment (`…-delta`, sized for
//! the worst case but written only as far as the deltas reach: tmpfs commits the pages written)
//! and names the base per receiver in the control segment; such a receiver reads the deltas
//! instead of the tensors and applies them in place.

use super::control::{ControlSegment, NONE, table_words};
use super::{ExecContext, ExecStats, Transport};
use crate::bucket::{
    Bucket, Dest, dst_view, hash_destination, make_buckets, pack, piece_box, piece_scale_box,
    quantise_box,
};
use crate::delta::{
    BucketKey, Changes, HeldBases, SenderBase, apply_bucket, check_base, encode_bucket_from,
    max_len,
};
use crate::shm::ShmSegment;
use crate::tensors::TensorSet;
use crate::{PlacementError, RuntimeError, ShmError, TensorError, TransportError};
use awex_core::encoding::Fp8Quantiser;
use awex_core::encoding::delta::DeltaStats;
use awex_core::layout::RankId;
use awex_core::layout::Side;
use awex_core::layout::copy::copy_box_transposed;
use awex_core::plan::RankPlan;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One bucket's delta as the sender encodes it: its bytes, its figures and (with checksums) the
/// digest of the dense bytes the receiver ends with.
type Encoded = (Vec<u8>, DeltaStats, u64);

const MAGIC: u64 = u64::from_le_bytes(*b"AWEXSHM1");
const HEADER: usize = 64;

fn name_hash(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

/// The `shm` tables of a control segment ([`ControlSegment`]): after the header, one entry of 3
/// words per tensor (name hash, offset in the data segment, length), one per peer (peer key,
/// first checksum index, buckets), then one word per bucket checksum; then for deltas one word
/// per peer (the base its deltas are against, [`NONE`] for dense) and two per bucket (offset
/// and length of its delta in the delta segment).
struct Control {
    seg: ControlSegment,
}

/// Header words: magic, ready, done, tensors, peers, sums, bucket bytes.
const W_BUCKET: usize = 6;

impl Control {
    fn word_at(&self, i: usize) -> Option<&AtomicU64> {
        self.seg.word_at(i)
    }
    fn word(&self, i: usize) -> &AtomicU64 {
        self.seg.word(i)
    }
    fn ready(&self) -> &AtomicU64 {
        self.seg.ready()
    }
    fn done(&self) -> &AtomicU64 {
        self.seg.done()
    }
    fn n_tensors(&self) -> u64 {
        self.word(3).load(Ordering::Acquire)
    }
    fn n_peers(&self) -> u64 {
        self.word(4).load(Ordering::Acquire)
    }
    fn n_sums(&self) -> u64 {
        self.word(5).load(Ordering::Acquire)
    }
    fn bucket_bytes(&self) -> u64 {
        self.word(W_BUCKET).load(Ordering::Acquire)
    }
    fn entry(&self, base: usize) -> Option<(u64, u64, u64)> {
        Some((
            self.word_at(base)?.load(Ordering::Relaxed),
            self.word_at(base.checked_add(1)?)?.load(Ordering::Relaxed),
            self.word_at(base.checked_add(2)?)?.load(Ordering::Relaxed),
        ))
    }
    fn tensor_entry(&self, i: u64) -> Option<(u64, u64, u64)> {
        if i >= self.n_tensors() {
            return None;
        }
        self.entry(HEADER / 8 + 3 * usize::try_from(i).ok()?)
    }
    fn peer_entry(&self, i: u64) -> Option<(u64, u64, u64)> {
        if i >= self.n_peers() {
            return None;
        }
        let t = usize::try_from(self.n_tensors()).ok()?.checked_mul(3)?;
        self.entry(
            (HEADER / 8)
                .checked_add(t)?
                .checked_add(3usize.checked_mul(usize::try_from(i).ok()?)?)?,
        )
    }
    /// Checksum `i`, or `None` outside the table (an index that came from a peer).
    fn sum(&self, i: u64) -> Option<&AtomicU64> {
        if i >= self.n_sums() {
            return None;
        }
        let t = usize::try_from(self.n_tensors()).ok()?.checked_mul(3)?;
        let p = usize::try_from(self.n_peers()).ok()?.checked_mul(3)?;
        self.word_at(
            (HEADER / 8)
                .checked_add(t)?
                .checked_add(p)?
                .checked_add(usize::try_from(i).ok()?)?,
        )
    }
    /// Words of a control segment with these tables; `None` when that overflows.
    fn size(n_tensors: u64, n_peers: u64, n_sums: u64) -> Option<usize> {
        table_words(
            HEADER / 8,
            &[
                (3, n_tensors),
                (3, n_peers),
                (1, n_sums),
                (1, n_peers),
                (2, n_sums),
                (1, n_peers),
            ],
        )
    }
    /// First word of the delta tables.
    fn delta_tables(&self) -> Option<usize> {
        let t = usize::try_from(self.n_tensors()).ok()?.checked_mul(3)?;
        let p = usize::try_from(self.n_peers()).ok()?.checked_mul(3)?;
        let s = usize::try_from(self.n_sums()).ok()?;
        (HEADER / 8).checked_add(t)?.checked_add(p)?.checked_add(s)
    }
    /// The base peer `i`'s deltas are against ([`NONE`]: dense).
    fn peer_base(&self, i: u64) -> Option<&AtomicU64> {
        if i >= self.n_peers() {
            return None;
        }
        self.word_at(self.delta_tables()?.checked_add(usize::try_from(i).ok()?)?)
    }
    /// Bucket `i`'s delta: (offset, length) in the delta segment.
    fn delta_at(&self, i: u64) -> Option<(&AtomicU64, &AtomicU64)> {
        if i >= self.n_sums() {
            return None;
        }
        let p = usize::try_from(self.n_peers()).ok()?;
        let at = self
            .delta_tables()?
            .checked_add(p)?
            .checked_add(usize::try_from(i).ok()?.checked_mul(2)?)?;
        Some((self.word_at(at)?, self.word_at(at.checked_add(1)?)?))
    }
    /// The tag of the last update peer `i` took all its bytes of (receivers set it before
    /// counting themselves `done`): which peers are done, when some engines are left out.
    fn peer_done(&self, i: u64) -> Option<&AtomicU64> {
        if i >= self.n_peers() {
            return None;
        }
        let p = usize::try_from(self.n_peers()).ok()?;
        let s = usize::try_from(self.n_sums()).ok()?;
        let at = self
            .delta_tables()?
            .checked_add(p)?
            .checked_add(s.checked_mul(2)?)?
            .checked_add(usize::try_from(i).ok()?)?;
        self.word_at(at)
    }
    fn valid(&self) -> bool {
        self.seg.has_magic(MAGIC, HEADER / 8)
            && Control::size(self.n_tensors(), self.n_peers(), self.n_sums())
                .is_some_and(|n| n <= self.seg.words())
    }
}

fn peer_key(r: RankId) -> u64 {
    ((r.engine as u64) << 32) | r.rank as u64
}

/// A sender peer as one receiver sees it.
struct Remote {
    ctl_name: String,
    ctl: Control,
    data: ShmSegment,
    /// name hash -> (offset, len)
    tensors: HashMap<u64, (u64, u64)>,
    /// first checksum index of this receiver's buckets
    sums_at: u64,
    /// this receiver's index in the sender's peer table
    peer_at: u64,
    /// the sender's delta segment, once a delta arrived
    delta: Option<ShmSegment>,
}

/// Shared-memory transport for one rank.
pub struct ShmTransport {
    side: Side,
    me: RankId,
    plan: Arc<RankPlan>,
    buckets: Vec<Vec<Bucket>>,
    tensors: Arc<TensorSet>,
    ctl: Option<Control>,
    remotes: HashMap<RankId, Remote>,
    scratch: Vec<u8>,
    bucket_bytes: u64,
    /// the quantiser of sender-encoded FP8 transfers (either side of an FP8 pair)
    fp8: Option<Fp8Quantiser>,
    /// deltas on, training side: the copy of what was last sent, and the delta segment
    base: Option<SenderBase>,
    /// this update's peers all take deltas (set by the encode, used by the refresh)
    all_deltas: bool,
    delta_seg: Option<ShmSegment>,
    /// training ranks: the engines the gateway left out of the running version
    lost: Option<Arc<super::LostEngines>>,
    /// the engines the last send left out before they took its bytes
    unreached: std::collections::BTreeSet<u32>,
    /// deltas on: what this (inference) rank's tensors hold, per sender
    held: HeldBases,
    deltas: bool,
    /// Pair option `check_finite` (training ranks): sources read for infinity and NaN first.
    check_finite: bool,
}

/// The delta segment's name of the control segment `ctl`.
fn delta_name(ctl: &str) -> String {
    match ctl.strip_suffix("-ctl") {
        Some(stem) => format!("{stem}-delta"),
        None => format!("{ctl}-delta"),
    }
}

impl ShmTransport {
    /// Quantises the plan's sender-encoded FP8 transfers with `q` (the pair's recipe): the
    /// receiver as it reads the sender's shared memory straight into the engine's e4m3 and
    /// scale tensors, the sender as it packs a bucket to checksum it.
    pub fn set_fp8(&mut self, q: Option<Fp8Quantiser>) {
        self.fp8 = q;
    }

    /// A transport for one rank; a training rank's tensors must live in a shared-memory segment
    /// (`TensorSet::allocate_shm`), whose name it publishes with its control segment `ctl_name`.
    pub fn new(
        plan: Arc<RankPlan>,
        tensors: Arc<TensorSet>,
        bucket_bytes: u64,
        ctl_name: &str,
    ) -> Result<Self, RuntimeError> {
        tensors.require_host("the shm transport")?;
        let buckets: Vec<Vec<Bucket>> = plan
            .peers
            .iter()
            .map(|p| make_buckets(&p.transfers, bucket_bytes))
            .collect();
        let mut t = ShmTransport {
            side: plan.side,
            me: plan.rank,
            plan,
            buckets,
            tensors,
            ctl: None,
            remotes: HashMap::new(),
            scratch: Vec::new(),
            bucket_bytes: bucket_bytes.max(1),
            fp8: None,
            base: None,
            all_deltas: false,
            delta_seg: None,
            lost: None,
            unreached: Default::default(),
            held: HeldBases::default(),
            deltas: false,
            check_finite: false,
        };
        if t.side == Side::Training {
            t.create_control(ctl_name)?;
        }
        Ok(t)
    }

    fn create_control(&mut self, name: &str) -> Result<(), RuntimeError> {
        let data = self
            .tensors
            .shm()
            .ok_or_else(|| RuntimeError::from(PlacementError::NotShared))?;
        let views: Vec<_> = self.tensors.iter().collect();
        let n_sums: usize = self.buckets.iter().map(Vec::len).sum();
        let size = Control::size(
            views.len() as u64,
            self.plan.peers.len() as u64,
            n_sums as u64,
        )
        .ok_or(ShmError::TablesOverflow)?;
        let ctl = Control {
            seg: ControlSegment::create(name, size)?,
        };
        let base = data.ptr() as usize;
        ctl.word(3).store(views.len() as u64, Ordering::Relaxed);
        ctl.word(4)
            .store(self.plan.peers.len() as u64, Ordering::Relaxed);
        ctl.word(5).store(n_sums as u64, Ordering::Relaxed);
        ctl.word(W_BUCKET)
            .store(self.bucket_bytes, Ordering::Relaxed);
        for (i, v) in views.iter().enumerate() {
            let p = v.ptr() as usize;
            let off = p.wrapping_sub(base);
            if p < base || off + v.len() > data.len() {
                return Err(PlacementError::OutsideSegment {
                    name: v.name.to_string(),
                }
                .into());
            }
            let w = HEADER / 8 + 3 * i;
            ctl.word(w).store(name_hash(&v.name), Ordering::Relaxed);
            ctl.word(w + 1).store(off as u64, Ordering::Relaxed);
            ctl.word(w + 2).store(v.len() as u64, Ordering::Relaxed);
        }
        let mut first = 0u64;
        for (i, (p, b)) in self.plan.peers.iter().zip(&self.buckets).enumerate() {
            let w = HEADER / 8 + 3 * views.len() + 3 * i;
            ctl.word(w).store(peer_key(p.peer), Ordering::Relaxed);
            ctl.word(w + 1).store(first, Ordering::Relaxed);
            ctl.word(w + 2).store(b.len() as u64, Ordering::Relaxed);
            first += b.len() as u64;
        }
        ctl.seg.seal(MAGIC);
        self.ctl = Some(ctl);
        Ok(())
    }

    fn open_remote(&self, peer: RankId, info: &serde_json::Value) -> Result<Remote, RuntimeError> {
        let field = |k: &str| {
            info.get(k).and_then(|v| v.as_str()).ok_or_else(|| {
                RuntimeError::from(TransportError::NoRendezvous {
                    peer,
                    transport: "shm",
                    field: k.to_string(),
                    suffix: " segment",
                    info: info.to_string(),
                })
            })
        };
        let ctl_name = field("ctl")?.to_string();
        let ctl = Control {
            seg: ControlSegment::open(&ctl_name)?,
        };
        if !ctl.valid() {
            return Err(TransportError::NotShmControl {
                name: ctl_name,
                peer,
            }
            .into());
        }
        if ctl.bucket_bytes() != self.bucket_bytes {
            return Err(TransportError::BucketSize {
                peer,
                theirs: ctl.bucket_bytes(),
                ours: self.bucket_bytes,
            }
            .into());
        }
        let data = ShmSegment::open(field("data")?)?;
        let mut tensors = HashMap::new();
        for i in 0..ctl.n_tensors() {
            let (h, off, len) = ctl
                .tensor_entry(i)
                .ok_or_else(|| RuntimeError::from(TransportError::TableOutside { peer }))?;
            if off
                .checked_add(len)
                .is_none_or(|end| end > data.len() as u64)
            {
                return Err(TransportError::TensorOutside { peer }.into());
            }
            tensors.insert(h, (off, len));
        }
        let me = peer_key(self.me);
        let (peer_at, (_, sums_at, n)) = (0..ctl.n_peers())
            .map_while(|i| ctl.peer_entry(i))
            .enumerate()
            .find(|(_, e)| e.0 == me)
            .ok_or_else(|| RuntimeError::from(TransportError::NoPlanFor { peer, me: self.me }))?;
        let peer_at = peer_at as u64;
        // the sender's bucket count for this rank must be this rank's, and its checksums
        // inside the sender's table
        let mine = self
            .plan
            .peers
            .iter()
            .position(|p| p.peer == peer)
            .map_or(0, |i| self.buckets[i].len() as u64);
        if n != mine || sums_at.checked_add(n).is_none_or(|end| end > ctl.n_sums()) {
            return Err(TransportError::BucketCount {
                peer,
                me: self.me,
                theirs: n,
                sums_at,
                ours: mine,
                sums: ctl.n_sums(),
            }
            .into());
        }
        Ok(Remote {
            ctl_name,
            ctl,
            data,
            tensors,
            sums_at,
            peer_at,
            delta: None,
        })
    }

    fn send(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        if self.check_finite {
            let sources = self.plan.peers.iter().flat_map(|p| &p.transfers);
            crate::finite::check_sources(&self.tensors, sources.map(|t| &*t.src_tensor))?;
        }
        let (stats, deltas) = self.encode_send(ctx)?;
        if !deltas.is_empty() {
            self.write_deltas(&deltas)?;
        }
        self.publish(ctx, stats)
    }

    /// Checksums (with checksums on) and this update's deltas (to peers that hold the copy's
    /// version), written into the control segment's tables; the deltas' bytes are returned.
    /// The deltas are encoded in parallel, one bucket per job, each job into bytes of its own,
    /// then laid end to end in the order of the plan (so the segment's bytes do not depend on
    /// how many threads ran).
    fn encode_send(&mut self, ctx: &ExecContext<'_>) -> Result<(ExecStats, Vec<u8>), RuntimeError> {
        let ctl = self
            .ctl
            .as_ref()
            .ok_or(TransportError::Closed("shm transport"))?;
        let mut stats = ExecStats::default();
        let mut idx = 0u64;
        // the delta buckets to encode (a bucket that several peers take, engines replicating a
        // layout, is encoded once and its delta read by each of them from one place in the
        // delta segment), and for each table entry that takes a delta: its index and job
        let mut jobs: Vec<(usize, &Bucket)> = Vec::new();
        let mut entries: Vec<(u64, usize)> = Vec::new();
        let mut seen: HashMap<BucketKey, usize> = HashMap::new();
        // the copy may be refreshed from the encoders' changes (recorded as they go) only when
        // every peer takes a delta against it: then every box this rank sends is compared
        self.all_deltas = self.base.is_some();
        if let Some(b) = self.base.as_mut() {
            // the last update's changes may still be landing in the copy (off that update's
            // path); a copy they could not be written into holds no version: every byte then
            if let Err(e) = b.settle() {
                tracing::warn!(version = ctx.version, "{e}");
            }
            b.forget_changes();
        }
        for (pi, (peer, buckets)) in self.plan.peers.iter().zip(&self.buckets).enumerate() {
            let base = self
                .base
                .as_ref()
                .and_then(|b| b.base_for(ctx.bases, peer.peer));
            self.all_deltas &= base.is_some();
            if let Some(w) = ctl.peer_base(pi as u64) {
                w.store(base.unwrap_or(NONE), Ordering::Relaxed);
            }
            if base.is_some() && self.base.is_some() {
                for b in buckets {
                    let key = BucketKey::of(b, &peer.transfers);
                    let job = *seen.entry(key).or_insert_with(|| {
                        jobs.push((pi, b));
                        jobs.len() - 1
                    });
                    entries.push((idx, job));
                    idx += 1;
                }
                continue;
            }
            for b in buckets {
                if ctx.checksums {
                    self.scratch.resize(b.bytes as usize, 0);
                    let n = pack(
                        b,
                        &peer.transfers,
                        &self.tensors,
                        &mut self.scratch,
                        self.fp8.as_ref(),
                    )?;
                    let h = xxhash_rust::xxh3::xxh3_64(&self.scratch[..n]);
                    ctl.sum(idx)
                        .ok_or(TransportError::ChecksumTable)?
                        .store(h, Ordering::Relaxed);
                    stats.checksum = stats.checksum.wrapping_add(h);
                }
                idx += 1;
                stats.buckets += 1;
            }
            stats.bytes += peer.bytes;
        }
        let Some(sb) = self.base.as_ref().filter(|_| !jobs.is_empty()) else {
            return Ok((stats, Vec::new()));
        };
        // every job's delta against the copy (and, with checksums, the digest of the dense
        // bytes the receiver ends with), on up to 8 threads
        let (peers, tensors, fp8) = (&self.plan.peers, &self.tensors, self.fp8.as_ref());
        let encode = |(pi, b): (usize, &Bucket)| -> Result<Encoded, RuntimeError> {
            let transfers = &peers[pi].transfers;
            let mut out = Vec::new();
            let mut scratch = (Vec::new(), Vec::new(), Vec::new());
            let mut changes = Changes::default();
            ctx.check()?;
            let d = encode_bucket_from(
                b,
                transfers,
                tensors,
                sb.copy()?,
                fp8,
                &mut out,
                &mut scratch,
                Some(&mut changes),
            )?;
            // written into the copy once every peer is done (`ShmTransport::publish`), never
            // while another job still compares against it
            sb.record(changes)?;
            let h = if ctx.checksums {
                let mut new = vec![0u8; b.bytes as usize];
                let n = pack(b, transfers, tensors, &mut new, fp8)?;
                xxhash_rust::xxh3::xxh3_64(&new[..n])
            } else {
                0
            };
            Ok((out, d, h))
        };
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 8)
            .min(jobs.len());
        let jobs = &jobs;
        let mut done: Vec<Option<Result<Encoded, RuntimeError>>> =
            (0..jobs.len()).map(|_| None).collect();
        let parts: Vec<Vec<(usize, Result<Encoded, RuntimeError>)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let encode = &encode;
                    scope.spawn(move || {
                        (t..jobs.len())
                            .step_by(threads)
                            .map(|j| (j, encode(jobs[j])))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        vec![(0, Err(TransportError::Panicked("delta encoder").into()))]
                    })
                })
                .collect()
        });
        for (j, r) in parts.into_iter().flatten() {
            done[j] = Some(r);
        }
        // laid end to end in job order; each table entry points at its job's bytes
        let mut deltas: Vec<u8> = Vec::new();
        let mut placed: Vec<(usize, usize, DeltaStats, u64)> = Vec::with_capacity(jobs.len());
        for r in done {
            let (bytes, d, h) = r.ok_or(TransportError::Panicked("delta encoder"))??;
            stats.compared += d.dense_bytes;
            placed.push((deltas.len(), bytes.len(), d, h));
            deltas.extend_from_slice(&bytes);
        }
        for (i, job) in entries {
            let (at, len, d, h) = placed[job];
            let (wo, wl) = ctl.delta_at(i).ok_or(TransportError::ChecksumTable)?;
            wo.store(at as u64, Ordering::Relaxed);
            wl.store(len as u64, Ordering::Relaxed);
            if ctx.checksums {
                ctl.sum(i)
                    .ok_or(TransportError::ChecksumTable)?
                    .store(h, Ordering::Relaxed);
                stats.checksum = stats.checksum.wrapping_add(h);
            }
            stats.delta.add(&d);
            stats.bytes += len as u64;
            stats.buckets += 1;
        }
        Ok((stats, deltas))
    }

    /// Publishes the version to the receivers and waits until every one is done.
    fn publish(
        &mut self,
        ctx: &ExecContext<'_>,
        mut stats: ExecStats,
    ) -> Result<ExecStats, RuntimeError> {
        let ctl = self
            .ctl
            .as_ref()
            .ok_or(TransportError::Closed("shm transport"))?;
        ctl.done().store(0, Ordering::Relaxed);
        ctl.ready().store(ctx.tag(), Ordering::Release);
        let want = self.plan.peers.len() as u64;
        self.unreached.clear();
        let tag = ctx.tag();
        let peers = &self.plan.peers;
        let done = |i: usize| {
            ctl.peer_done(i as u64)
                .is_some_and(|w| w.load(Ordering::Acquire) == tag)
        };
        let result = match &self.lost {
            // engines the gateway left out are not waited for, nor, from the cut-off on,
            // engines that have not taken this rank's bytes yet
            Some(lost) => {
                let cutoff = lost.cutoff();
                ctx.wait_until(|| {
                    ctl.done().load(Ordering::Acquire) >= want
                        || peers
                            .iter()
                            .enumerate()
                            .all(|(i, p)| done(i) || lost.contains(p.peer.engine))
                        || cutoff.is_some_and(|c| Instant::now() >= c)
                })
            }
            None => ctx.wait_until(|| ctl.done().load(Ordering::Acquire) >= want),
        };
        if result.is_ok() && ctl.done().load(Ordering::Acquire) < want {
            for (i, p) in peers.iter().enumerate() {
                if !done(i) {
                    self.unreached.insert(p.peer.engine);
                }
            }
            // (engine slots out of the version from its start were expected to take nothing)
            let absent = |e: u32| self.lost.as_ref().is_some_and(|l| l.is_absent(e));
            let left_out = |e: u32| self.lost.as_ref().is_some_and(|l| l.contains(e));
            let (told, late): (Vec<u32>, Vec<u32>) = self
                .unreached
                .iter()
                .filter(|&&e| !absent(e))
                .partition(|&&e| left_out(e));
            if !told.is_empty() {
                tracing::warn!(
                    version = ctx.version,
                    engines = ?told,
                    "the gateway left engines out of this version before they took this rank's bytes"
                );
            }
            if !late.is_empty() {
                tracing::warn!(
                    version = ctx.version,
                    engines = ?late,
                    "engines had not taken this rank's bytes close to the deadline (stopped or stalled): they are reported unreached and left out of this version"
                );
            }
        }
        // once every peer is done (or this rank gave up) nobody may read these weights as this
        // version any more: the trainer is free to change them
        ctl.ready().store(NONE, Ordering::Release);
        // the copy may be refreshed from the encoders' changes only when every peer took a
        // delta against it (every box this rank sends was compared) and took it
        let all_deltas = std::mem::take(&mut self.all_deltas) && self.unreached.is_empty();
        if let Some(b) = self.base.as_mut() {
            match &result {
                Ok(()) => {
                    let t = std::time::Instant::now();
                    stats.refreshed = if all_deltas {
                        b.refresh_changed(&self.tensors, ctx.version)?
                    } else {
                        b.refresh(&self.tensors, ctx.version)?
                    };
                    tracing::debug!(
                        version = ctx.version,
                        refresh_ms = t.elapsed().as_secs_f64() * 1e3,
                        refresh_bytes = stats.refreshed,
                        partial = all_deltas,
                        "refreshed the copy of what was sent"
                    );
                }
                Err(_) => b.invalidate(),
            }
        }
        result.map(|_| stats)
    }

    /// Copies this update's deltas into the delta segment, created at the first delta with
    /// room for the largest possible one (every bucket of every peer dense, plus its tags).
    fn write_deltas(&mut self, deltas: &[u8]) -> Result<(), RuntimeError> {
        if self.delta_seg.is_none() {
            let ctl = self
                .ctl
                .as_ref()
                .ok_or(TransportError::Closed("shm transport"))?;
            let most: usize = self.buckets.iter().flatten().map(max_len).sum();
            let name = delta_name(ctl.seg.segment().name());
            self.delta_seg = Some(ShmSegment::create(&name, most.max(1))?);
        }
        let seg = self
            .delta_seg
            .as_ref()
            .ok_or(TransportError::Closed("shm transport"))?;
        if deltas.len() > seg.len() {
            return Err(TransportError::Delta(format!(
                "{} bytes of deltas exceed the delta segment's {}",
                deltas.len(),
                seg.len()
            ))
            .into());
        }
        // SAFETY: the segment is this rank's; receivers read it only after `ready` is published.
        unsafe { std::ptr::copy_nonoverlapping(deltas.as_ptr(), seg.ptr(), deltas.len()) };
        Ok(())
    }

    fn receive(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        let mut stats = ExecStats::default();
        for (pi, peer) in self.plan.peers.iter().enumerate() {
            let info = ctx.peers.get(&peer.peer).cloned().unwrap_or_default();
            let stale = match (
                self.remotes.get(&peer.peer),
                info.get("ctl").and_then(|v| v.as_str()),
            ) {
                (Some(r), Some(name)) => r.ctl_name != name,
                _ => true,
            };
            if stale {
                let r = self.open_remote(peer.peer, &info)?;
                self.remotes.insert(peer.peer, r);
            }
            // from here on this sender's boxes may be torn until every bucket landed
            let held = self.held.begin(peer.peer);
            let remote = &self.remotes[&peer.peer];
            ctx.wait_until(|| remote.ctl.ready().load(Ordering::Acquire) == ctx.tag())?;
            let base = remote
                .ctl
                .peer_base(remote.peer_at)
                .map_or(NONE, |w| w.load(Ordering::Acquire));
            if base != NONE {
                check_base(peer.peer, base, held)?;
                if let Some(r) = self.remotes.get_mut(&peer.peer)
                    && r.delta.is_none()
                {
                    // only the pages the sender wrote: the segment is sized for every bucket dense
                    r.delta = Some(ShmSegment::open_lazy(&delta_name(&r.ctl_name))?);
                }
                let remote = &self.remotes[&peer.peer];
                let st = receive_deltas(remote, peer, &self.buckets[pi], &self.tensors, ctx)?;
                stats.add(&st);
                if let Some(w) = remote.ctl.peer_done(remote.peer_at) {
                    w.store(ctx.tag(), Ordering::Release);
                }
                remote.ctl.done().fetch_add(1, Ordering::AcqRel);
                self.held.finish(peer.peer, ctx.version);
                continue;
            }
            for (bi, b) in self.buckets[pi].iter().enumerate() {
                ctx.check()?;
                for p in &b.pieces {
                    let t = &peer.transfers[p.transfer as usize];
                    let (so, d, e) = piece_box(t, p);
                    let &(off, len) =
                        remote
                            .tensors
                            .get(&name_hash(&t.src_tensor))
                            .ok_or_else(|| {
                                RuntimeError::from(TransportError::Unshared {
                                    peer: peer.peer,
                                    tensor: t.src_tensor.to_string(),
                                })
                            })?;
                    // SAFETY: off+len was checked against the mapping when the remote was opened.
                    let src = unsafe {
                        std::slice::from_raw_parts(
                            remote.data.ptr().add(off as usize),
                            len as usize,
                        )
                    };
                    if t.sender_encoded() {
                        // the blocks whole in this box: quantised from the sender's memory
                        // straight into the engine's e4m3 and scale tensors
                        receive_encoded(t, p, src, &self.tensors, self.fp8.as_ref())?;
                        continue;
                    }
                    let dst = self.tensors.get(&t.dst_tensor).ok_or_else(|| {
                        RuntimeError::from(TensorError::NotRegistered {
                            side: "destination",
                            name: t.dst_tensor.to_string(),
                        })
                    })?;
                    // SAFETY: the plan writes each destination box exactly once.
                    let out = unsafe { dst.try_bytes_mut()? };
                    copy_box_transposed(
                        src,
                        &t.src_shape,
                        &so,
                        t.src_dtype,
                        out,
                        &dst.shape,
                        &d,
                        dst.dtype,
                        &e,
                        t.transpose(),
                    )?;
                }
                if ctx.corrupt && bi == 0 {
                    corrupt_first_byte(b, &peer.transfers, &self.tensors);
                }
                if ctx.checksums {
                    let h = check_bucket(remote, peer, bi, b, &self.tensors)?;
                    stats.checksum = stats.checksum.wrapping_add(h);
                }
                stats.buckets += 1;
            }
            if remote.ctl.ready().load(Ordering::Acquire) != ctx.tag() {
                return Err(TransportError::Withdrawn {
                    peer: peer.peer,
                    version: ctx.version,
                }
                .into());
            }
            if let Some(w) = remote.ctl.peer_done(remote.peer_at) {
                w.store(ctx.tag(), Ordering::Release);
            }
            remote.ctl.done().fetch_add(1, Ordering::AcqRel);
            stats.bytes += peer.bytes;
            self.held.finish(peer.peer, ctx.version);
        }
        Ok(stats)
    }
}

/// The checksum of the bytes bucket `bi` from `peer` left in `tensors`, refused unless it is
/// the one the sender published for that bucket.
fn check_bucket(
    remote: &Remote,
    peer: &awex_core::plan::PeerPlan,
    bi: usize,
    b: &Bucket,
    tensors: &TensorSet,
) -> Result<u64, RuntimeError> {
    let h = hash_destination(b, &peer.transfers, tensors)?;
    let want = remote
        .sums_at
        .checked_add(bi as u64)
        .and_then(|i| remote.ctl.sum(i))
        .ok_or_else(|| {
            RuntimeError::from(TransportError::NoChecksum {
                peer: peer.peer,
                bucket: bi,
            })
        })?
        .load(Ordering::Relaxed);
    if h != want {
        return Err(RuntimeError::Checksum {
            peer: peer.peer,
            bucket: bi as u64,
        });
    }
    Ok(h)
}

/// Applies one sender's deltas of this update (its delta segment, at the offsets its control
/// segment names for this rank's buckets) to this rank's tensors; checks the checksums of the
/// bytes they leave there.
fn receive_deltas(
    remote: &Remote,
    peer: &awex_core::plan::PeerPlan,
    buckets: &[Bucket],
    tensors: &TensorSet,
    ctx: &ExecContext<'_>,
) -> Result<ExecStats, RuntimeError> {
    let mut stats = ExecStats::default();
    let seg = remote
        .delta
        .as_ref()
        .ok_or(TransportError::Closed("delta segment"))?;
    // SAFETY: the mapping is the segment's whole length; the sender wrote it before `ready`.
    let all = unsafe { std::slice::from_raw_parts(seg.ptr(), seg.len()) };
    for (bi, b) in buckets.iter().enumerate() {
        ctx.check()?;
        let i = remote.sums_at.checked_add(bi as u64);
        let (off, len) = i
            .and_then(|i| remote.ctl.delta_at(i))
            .map(|(o, l)| (o.load(Ordering::Relaxed), l.load(Ordering::Relaxed)))
            .ok_or(TransportError::ChecksumTable)?;
        let bytes = off
            .checked_add(len)
            .and_then(|end| all.get(off as usize..end as usize))
            .ok_or_else(|| {
                RuntimeError::from(TransportError::Delta(format!(
                    "training rank {}'s delta for bucket {bi} lies outside its delta segment",
                    peer.peer
                )))
            })?;
        let d = apply_bucket(b, &peer.transfers, tensors, bytes)?;
        if ctx.corrupt && bi == 0 {
            corrupt_first_byte(b, &peer.transfers, tensors);
        }
        if ctx.checksums {
            let h = check_bucket(remote, peer, bi, b, tensors)?;
            stats.checksum = stats.checksum.wrapping_add(h);
        }
        stats.delta.add(&d);
        stats.bytes += len;
        stats.buckets += 1;
    }
    if remote.ctl.ready().load(Ordering::Acquire) != ctx.tag() {
        return Err(TransportError::Withdrawn {
            peer: peer.peer,
            version: ctx.version,
        }
        .into());
    }
    Ok(stats)
}

/// Writes one piece of a sender-encoded transfer from the sender's shared copy of its source
/// tensor (`src`): the piece's blocks quantised into the e4m3 tensor and the scale tensor.
fn receive_encoded(
    t: &awex_core::plan::Transfer,
    p: &crate::bucket::Piece,
    src: &[u8],
    tensors: &TensorSet,
    fp8: Option<&Fp8Quantiser>,
) -> Result<(), RuntimeError> {
    let q = fp8.ok_or_else(|| {
        RuntimeError::Fp8(format!(
            "the plan quantises `{}` from its sender's memory, but this rank was not given the inference side's FP8 config",
            t.dst_tensor
        ))
    })?;
    let (so, d, e) = piece_box(t, p);
    let (soff, _) = piece_scale_box(t, p).expect("a sender-encoded transfer has scales");
    let v = dst_view(tensors, t)?;
    let scale_name = awex_core::encoding::Fp8Block::scale_name(&t.dst_tensor);
    let sv = tensors.get(&scale_name).ok_or_else(|| {
        RuntimeError::from(TensorError::NotRegistered {
            side: "destination",
            name: scale_name.clone(),
        })
    })?;
    // SAFETY: the plan writes each destination box, and each block's scale, exactly once.
    let (qb, sb) = unsafe { (v.try_bytes_mut()?, sv.try_bytes_mut()?) };
    // SAFETY: f32 has no invalid bit patterns; the alignment is checked.
    let (pre, scales, _) = unsafe { sb.align_to_mut::<f32>() };
    if !pre.is_empty() || sv.dtype != awex_core::dtype::DType::F32 {
        return Err(RuntimeError::Fp8(format!(
            "scale tensor `{scale_name}` is not 4-byte aligned f32"
        )));
    }
    quantise_box(
        q,
        &t.dst_tensor,
        src,
        &t.src_shape,
        t.src_dtype,
        &so,
        &e,
        Dest {
            data: qb,
            shape: v.shape,
            offset: d,
        },
        Dest {
            data: scales,
            shape: sv.shape,
            offset: soff,
        },
    )
}

/// Flips one byte of a bucket's first destination box (fault injection for tests).
pub(crate) fn corrupt_first_byte(
    b: &Bucket,
    transfers: &[awex_core::plan::Transfer],
    tensors: &TensorSet,
) {
    if let Some(p) = b.pieces.first() {
        let t = &transfers[p.transfer as usize];
        if let Ok(v) = dst_view(tensors, t) {
            let (_, d, _) = piece_box(t, p);
            let at = v.shape.linear(&d) as usize * v.dtype.size();
            // SAFETY: the box is inside the tensor (checked by the copy that wrote it).
            if let Some(x) = unsafe { v.try_bytes_mut() }
                .ok()
                .and_then(|out| out.get_mut(at))
            {
                *x ^= 0x5a;
            }
        }
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> awex_core::Transport {
        awex_core::Transport::Shm
    }

    fn rendezvous(&self) -> serde_json::Value {
        match (&self.ctl, self.tensors.shm()) {
            (Some(c), Some(d)) => {
                serde_json::json!({ "ctl": c.seg.segment().name(), "data": d.name() })
            }
            _ => serde_json::json!({}),
        }
    }

    fn connect(&mut self, peers: &HashMap<RankId, serde_json::Value>) -> Result<(), RuntimeError> {
        if self.side == Side::Inference {
            for p in &self.plan.peers {
                if let Some(info) = peers.get(&p.peer) {
                    let r = self.open_remote(p.peer, info)?;
                    self.remotes.insert(p.peer, r);
                }
            }
        }
        Ok(())
    }

    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        match self.side {
            Side::Training => self.send(ctx),
            Side::Inference => self.receive(ctx),
        }
    }

    fn check_finite_sources(&mut self) -> Result<(), RuntimeError> {
        self.check_finite = true;
        Ok(())
    }

    fn enable_deltas(&mut self) -> Result<bool, RuntimeError> {
        super::refuse_transposed(&self.plan, "delta updates")?;
        if self.side == Side::Training && self.base.is_none() {
            self.base = Some(SenderBase::new(&self.tensors)?);
        }
        self.deltas = true;
        Ok(true)
    }

    fn tolerate_lost_engines(&mut self, lost: Option<Arc<super::LostEngines>>) -> bool {
        self.lost = lost.filter(|_| self.plan.side == Side::Training);
        self.lost.is_some()
    }

    fn unreached(&self) -> Vec<u32> {
        self.unreached.iter().copied().collect()
    }

    fn holds_base(&self) -> bool {
        self.deltas && self.side == Side::Inference
    }

    fn close(&mut self) {
        if let Some(d) = self.delta_seg.take() {
            d.unlink();
        }
        self.remotes.clear();
        if let Some(c) = self.ctl.take() {
            c.seg.segment().unlink();
        }
        if let Some(d) = self.tensors.shm() {
            d.unlink();
        }
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.close();
    }
}
