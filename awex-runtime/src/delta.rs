//! Delta updates on a rank ([`awex_core::encoding::delta`] holds the format): the training
//! rank's copy of what it last sent ([`SenderBase`]), the per-bucket encoder, the receiver's
//! in-place apply ([`apply_bucket`]) and the versions each end knows the other holds.
//!
//! A bucket's payload is its pieces' packed bytes in order (destination dtype; a sender-encoded
//! FP8 piece is its e4m3 bytes then its scales). Each piece (and each piece's scales) is one
//! segment of the delta, encoded against the same bucket packed from the sender's copy of the
//! base version. The receiver, which holds the base in its destination tensors, writes each
//! changed element where [`crate::bucket::unpack`] would have written it.
//!
//! Memory: the sender keeps one host copy of its registered tensors (its shard as it holds it,
//! in its dtype: 2 bytes per parameter in bf16, 4 in fp32), refreshed after each update it sent
//! whole. Receivers keep nothing: their tensors are the base.

use crate::bucket::{dst_view, piece_box, piece_scale_box};
use crate::tensors::{TensorSet, TensorView};
use crate::{RuntimeError, TransportError};
use awex_core::dtype::DType;
use awex_core::encoding::delta::{self, DeltaStats};
use awex_core::layout::copy::StridedBox;
use awex_core::layout::{Dims, RankId};
use awex_core::plan::Transfer;
use awex_core::plan::bucket::Bucket;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// Which version each inference rank provably holds, as the gateway announced it with the
/// update: every inference rank holds `version` except those in `except` (restarted, torn, new
/// or failed ranks), which get dense bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerBases {
    /// The version the holders hold.
    pub version: u64,
    /// Inference ranks that do not hold it.
    pub except: HashSet<RankId>,
}

impl PeerBases {
    /// The version inference rank `r` holds, if any.
    pub fn of(&self, r: RankId) -> Option<u64> {
        (!self.except.contains(&r)).then_some(self.version)
    }
}

/// A training rank's copy of the bytes it last sent, and their version.
pub struct SenderBase {
    copy: TensorSet,
    version: Option<u64>,
    /// What this update's encoders found changed (written into the copy once every peer's
    /// encode is done: until then other buckets still compare against the copy).
    changes: Mutex<Changes>,
    /// The write of the last update's changed elements into the copy, running off the
    /// update's path ([`SenderBase::refresh_changed`]); joined before anything reads the copy.
    pending: Mutex<Option<std::thread::JoinHandle<Result<(), String>>>>,
}

/// A tensor's changed elements handed to the background write: the copy's bytes as a raw
/// pointer (the copy outlives the write: [`SenderBase`] joins it before it reads, refreshes
/// or drops the copy).
struct Scatter {
    name: std::sync::Arc<str>,
    es: usize,
    changed: Changed,
    dst: *mut u8,
    len: usize,
}

// SAFETY: `dst` points into the sender's copy, which only the background write touches until
// it is joined (see `SenderBase::pending`).
unsafe impl Send for Scatter {}

/// The parts of the sender's tensors an update's deltas found changed: single elements (with
/// their new bytes) where the encoder compared the tensors in place, whole boxes where it
/// compared packed bytes (converted or FP8-encoded pieces).
#[derive(Debug, Default)]
pub struct Changes {
    /// Per source tensor, the changed elements.
    elements: HashMap<std::sync::Arc<str>, Changed>,
    /// Source boxes to copy whole: `(tensor, offset, extent)`.
    boxes: Vec<(std::sync::Arc<str>, Dims, Dims)>,
}

/// A tensor's changed elements: their offsets in the tensor (in elements) and their new bytes,
/// in the same order (taken while encoding, so the refresh reads nothing of the live tensor).
#[derive(Debug, Default)]
struct Changed {
    at: Vec<u32>,
    values: Vec<u8>,
}

impl Changes {
    /// Adds `other`'s changes.
    pub fn merge(&mut self, other: Changes) {
        for (k, mut v) in other.elements {
            let c = self.elements.entry(k).or_default();
            c.at.append(&mut v.at);
            c.values.append(&mut v.values);
        }
        self.boxes.extend(other.boxes);
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.elements.values().all(|c| c.at.is_empty()) && self.boxes.is_empty()
    }
}

impl SenderBase {
    /// A zeroed host copy of `live`'s tensors, holding no version yet.
    pub fn new(live: &TensorSet) -> Result<Self, RuntimeError> {
        Ok(SenderBase {
            copy: live.host_mirror()?,
            version: None,
            changes: Mutex::default(),
            pending: Mutex::default(),
        })
    }

    /// Waits for the background write of the last update's changes, if one runs: the copy
    /// then holds its version. Were that write to fail, the copy holds no version (the next
    /// update is sent whole) and the reason is returned.
    pub fn settle(&mut self) -> Result<(), RuntimeError> {
        let r = join_pending(&self.pending);
        if r.is_err() {
            self.version = None;
        }
        r
    }

    /// The version the copy holds (`None` before the first update sent whole, or after one
    /// that failed).
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// The copy, once the background write of the last update's changes (if any) is done.
    pub fn copy(&self) -> Result<&TensorSet, RuntimeError> {
        join_pending(&self.pending)?;
        Ok(&self.copy)
    }

    /// Bytes the copy takes.
    pub fn bytes(&self) -> u64 {
        self.copy.iter().map(|v| v.len() as u64).sum()
    }

    /// Forgets the version (a send failed part-way: some receivers may hold either version).
    pub fn invalidate(&mut self) {
        let _ = join_pending(&self.pending);
        self.version = None;
        self.forget_changes();
    }

    /// Drops the changes recorded so far (an update starts, or its attempt is retried).
    pub fn forget_changes(&self) {
        if let Ok(mut c) = self.changes.lock() {
            *c = Changes::default();
        }
    }

    /// Records changes an encoder found; they are written by [`SenderBase::refresh_changed`].
    pub fn record(&self, changes: Changes) -> Result<(), RuntimeError> {
        self.changes
            .lock()
            .map_err(|_| TransportError::Panicked("a peer recording a delta's changes"))?
            .merge(changes);
        Ok(())
    }

    /// Copies `live` (host tensors) into the copy, which then holds `version`.
    pub fn refresh(&mut self, live: &TensorSet, version: u64) -> Result<u64, RuntimeError> {
        self.version = None;
        // a background write still running would land over the copy
        let _ = join_pending(&self.pending);
        self.forget_changes();
        let n = self.copy.copy_from(live)?;
        self.version = Some(version);
        Ok(n)
    }

    /// Writes into the copy only what this update's encoders found changed (recorded with
    /// [`SenderBase::record`]), which then holds `version`; returns the bytes written.
    ///
    /// Boxes recorded whole are copied from `live` before this returns (the trainer may write
    /// its tensors as soon as the update is done); the changed elements, whose new bytes were
    /// recorded while encoding, are written by a background thread, off the update's path: the
    /// rank waits for it only when it next reads the copy ([`SenderBase::copy`],
    /// [`SenderBase::settle`]), while its trainer computes the next version.
    ///
    /// Exact only when every peer of the update took a delta against the copy's version from
    /// this rank (so every box the rank sends was compared, and the copy already equals `live`
    /// everywhere else in those boxes) and the rank's plan, hence its boxes, does not change;
    /// otherwise call [`SenderBase::refresh`]. Elements outside every box the rank sends are
    /// never read by its encoders.
    pub fn refresh_changed(&mut self, live: &TensorSet, version: u64) -> Result<u64, RuntimeError> {
        join_pending(&self.pending)?;
        if self.version.take().is_none() {
            // nothing to build on (no peer compared against the copy): copy it whole
            return self.refresh(live, version);
        }
        let changes = std::mem::take(
            &mut *self
                .changes
                .lock()
                .map_err(|_| TransportError::Panicked("a peer recording a delta's changes"))?,
        );
        // writing element by element costs more per byte than the copy's threaded memcpy:
        // when the changes come near the copy's size, copy it whole
        let mut want = 0u64;
        for (name, c) in &changes.elements {
            want += 2 * c.at.len() as u64 * pair(live, &self.copy, name)?.0.dtype.size() as u64;
        }
        for (name, _, ext) in &changes.boxes {
            want += ext.numel() * pair(live, &self.copy, name)?.0.dtype.size() as u64;
        }
        if want >= self.bytes() {
            let n = self.copy.copy_from(live)?;
            self.version = Some(version);
            return Ok(n);
        }
        let mut n = 0u64;
        // the changed elements' recorded bytes, one tensor per job, checked here (every
        // offset inside its tensor) and written in the background
        let mut jobs = Vec::with_capacity(changes.elements.len());
        let Changes { elements, boxes } = changes;
        for (name, ch) in elements {
            let (_, c) = pair(live, &self.copy, &name)?;
            let es = c.dtype.size().max(1);
            let inside = ch.at.iter().all(|&i| (i as usize + 1) * es <= c.len());
            if ch.values.len() != ch.at.len() * es || !inside {
                return Err(outside(&name));
            }
            // SAFETY: the copy is this rank's own host buffer; nothing else writes it, and
            // nothing reads it before the background write is joined.
            let cb = unsafe { c.try_bytes_mut()? };
            n += ch.values.len() as u64;
            jobs.push(Scatter {
                name,
                es,
                changed: ch,
                dst: cb.as_mut_ptr(),
                len: cb.len(),
            });
        }
        for (name, off, ext) in &boxes {
            let (l, c) = pair(live, &self.copy, name)?;
            let es = l.dtype.size();
            let lb = l.try_bytes()?;
            // SAFETY: as above.
            let cb = unsafe { c.try_bytes_mut()? };
            let sb = StridedBox::new(&l.shape, off, &l.shape, off, ext)?;
            let mut bad = false;
            sb.for_each_run(|s, _, k| {
                let (a, b) = (s as usize * es, (s + k) as usize * es);
                match (lb.get(a..b), cb.get_mut(a..b)) {
                    (Some(s), Some(d)) => d.copy_from_slice(s),
                    _ => bad = true,
                }
            });
            if bad {
                return Err(outside(name));
            }
            n += ext.numel() * es as u64;
        }
        if !jobs.is_empty() {
            let handle = std::thread::Builder::new()
                .name("awex-copy-refresh".into())
                .spawn(move || scatter_all(jobs))
                .map_err(|e| {
                    TransportError::Delta(format!(
                        "could not start the refresh of the sender's copy: {e}"
                    ))
                })?;
            *self
                .pending
                .lock()
                .map_err(|_| TransportError::Panicked("the refresh of the sender's copy"))? =
                Some(handle);
        }
        self.version = Some(version);
        Ok(n)
    }

    /// The base a delta to `peer` is taken against: the copy's version when the gateway says
    /// the peer holds exactly that one.
    pub fn base_for(&self, bases: Option<&PeerBases>, peer: RankId) -> Option<u64> {
        let held = bases?.of(peer)?;
        (self.version == Some(held)).then_some(held)
    }
}

fn pair<'s>(
    live: &'s TensorSet,
    copy: &'s TensorSet,
    name: &str,
) -> Result<(&'s TensorView, &'s TensorView), RuntimeError> {
    match (live.get(name), copy.get(name)) {
        (Some(l), Some(c)) if l.len() == c.len() && l.dtype == c.dtype => Ok((l, c)),
        _ => Err(TransportError::Delta(format!(
            "`{name}` is not in both the live tensors and the sender's copy with one size: refresh the copy whole"
        ))
        .into()),
    }
}

/// Writes `values` (`es` bytes per element) at the element offsets `at` of `dst`; false when an
/// offset lies outside it.
fn scatter(es: usize, at: &[u32], values: &[u8], dst: &mut [u8]) -> bool {
    fn typed<const N: usize>(at: &[u32], values: &[u8], dst: &mut [u8]) -> bool {
        for (&i, v) in at.iter().zip(values.chunks_exact(N)) {
            let o = i as usize * N;
            match dst.get_mut(o..o + N) {
                Some(d) => d.copy_from_slice(v),
                None => return false,
            }
        }
        true
    }
    match es {
        1 => typed::<1>(at, values, dst),
        2 => typed::<2>(at, values, dst),
        4 => typed::<4>(at, values, dst),
        8 => typed::<8>(at, values, dst),
        _ => at
            .iter()
            .zip(values.chunks_exact(es.max(1)))
            .all(|(&i, v)| {
                let o = i as usize * es;
                dst.get_mut(o..o + es)
                    .map(|d| d.copy_from_slice(v))
                    .is_some()
            }),
    }
}

fn outside(name: &str) -> RuntimeError {
    TransportError::Delta(format!("a recorded change lies outside `{name}`")).into()
}

impl Drop for SenderBase {
    fn drop(&mut self) {
        // the background write points into the copy, freed after this
        let _ = join_pending(&self.pending);
    }
}

/// Joins the background write of the copy, if one runs; its failure is returned once.
fn join_pending(
    pending: &Mutex<Option<std::thread::JoinHandle<Result<(), String>>>>,
) -> Result<(), RuntimeError> {
    let handle = pending
        .lock()
        .map_err(|_| TransportError::Panicked("the refresh of the sender's copy"))?
        .take();
    let Some(h) = handle else {
        return Ok(());
    };
    let t = std::time::Instant::now();
    let r = h.join();
    tracing::debug!(
        waited_ms = t.elapsed().as_secs_f64() * 1e3,
        "waited for the refresh of the sender's copy"
    );
    match r {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(TransportError::Delta(e).into()),
        Err(_) => Err(TransportError::Panicked("the refresh of the sender's copy").into()),
    }
}

/// The background write: each tensor's changed elements into the copy, on up to 8 threads
/// (each tensor of the copy is a buffer of its own).
fn scatter_all(jobs: Vec<Scatter>) -> Result<(), String> {
    let t = std::time::Instant::now();
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .clamp(1, 8)
        .min(jobs.len().max(1));
    let mut lanes: Vec<Vec<Scatter>> = (0..threads).map(|_| Vec::new()).collect();
    for (k, j) in jobs.into_iter().enumerate() {
        lanes[k % threads].push(j);
    }
    let bad: Vec<Option<std::sync::Arc<str>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = lanes
            .into_iter()
            .map(|lane| {
                scope.spawn(move || {
                    for j in lane {
                        // SAFETY: `dst`/`len` are one tensor of the copy, written by this job
                        // alone (see `Scatter`).
                        let dst = unsafe { std::slice::from_raw_parts_mut(j.dst, j.len) };
                        if !scatter(j.es, &j.changed.at, &j.changed.values, dst) {
                            return Some(j.name);
                        }
                    }
                    None
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(None))
            .collect()
    });
    tracing::debug!(
        refresh_ms = t.elapsed().as_secs_f64() * 1e3,
        "refreshed the sender's copy from the changes, off the update's path"
    );
    match bad.into_iter().flatten().next() {
        Some(name) => Err(format!(
            "a recorded change lies outside `{name}`: the sender's copy holds no version, and the next update is sent whole"
        )),
        None => Ok(()),
    }
}

/// The segments of a bucket's payload, in order: `(element bytes, elements)`.
pub fn segments(bucket: &Bucket, transfers: &[Transfer]) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(bucket.pieces.len());
    for p in &bucket.pieces {
        let t = &transfers[p.transfer as usize];
        let (_, _, e) = piece_box(t, p);
        out.push((t.dst_dtype.size(), e.numel() as usize));
        if let Some((_, sext)) = piece_scale_box(t, p) {
            out.push((4, sext.numel() as usize));
        }
    }
    out
}

/// The most bytes a bucket's delta can take (dense plus one tag per segment).
pub fn max_len(bucket: &Bucket) -> usize {
    bucket.bytes as usize + 2 * bucket.pieces.len()
}

fn delta_err(what: String) -> impl FnOnce(delta::DeltaError) -> RuntimeError {
    move |e| RuntimeError::from(TransportError::Delta(format!("{what}: {e}")))
}

/// Appends the delta of bucket payload `new` against `old` (both packed by
/// [`crate::bucket::pack`]) to `out`, segment by segment.
pub fn encode_bucket(
    bucket: &Bucket,
    transfers: &[Transfer],
    old: &[u8],
    new: &[u8],
    out: &mut Vec<u8>,
) -> Result<DeltaStats, RuntimeError> {
    let mut st = DeltaStats::default();
    let mut at = 0usize;
    for (elem, n) in segments(bucket, transfers) {
        let len = elem * n;
        let (o, w) = match (old.get(at..at + len), new.get(at..at + len)) {
            (Some(o), Some(w)) => (o, w),
            _ => {
                return Err(TransportError::ShortBucket {
                    len: new.len().min(old.len()),
                }
                .into());
            }
        };
        st.add(&delta::encode(o, w, elem, out).map_err(delta_err("encoding a delta".into()))?);
        at += len;
    }
    Ok(st)
}

/// Appends the delta of a bucket to `out`, reading the live tensors and the sender's copy of
/// the base in place: a plain piece whose dtype does not change is compared run by run where
/// it sits (no packing); a converted or FP8-encoded piece is packed from both (`scratch`) and
/// compared packed. The bytes equal [`encode_bucket`] over the two packed buckets. With
/// `changes`, what changed is recorded there for [`SenderBase::refresh_changed`]: the changed
/// elements (and their new bytes) of pieces compared in place, the source box of a packed piece
/// that changed and of every FP8-encoded one.
#[allow(clippy::too_many_arguments)]
pub fn encode_bucket_from(
    bucket: &Bucket,
    transfers: &[Transfer],
    live: &TensorSet,
    copy: &TensorSet,
    fp8: Option<&awex_core::encoding::Fp8Quantiser>,
    out: &mut Vec<u8>,
    scratch: &mut (Vec<u8>, Vec<u8>, Vec<u32>),
    mut changes: Option<&mut Changes>,
) -> Result<DeltaStats, RuntimeError> {
    let mut st = DeltaStats::default();
    for p in &bucket.pieces {
        let t = &transfers[p.transfer as usize];
        let (so, _, e) = piece_box(t, p);
        fn view<'s>(
            set: &'s TensorSet,
            name: &str,
            side: &'static str,
        ) -> Result<&'s TensorView, RuntimeError> {
            set.get(name).ok_or_else(|| {
                RuntimeError::from(crate::TensorError::NotRegistered {
                    side,
                    name: name.to_string(),
                })
            })
        }
        let (lv, cv) = (
            view(live, &t.src_tensor, "source")?,
            view(copy, &t.src_tensor, "copy of the source")?,
        );
        if t.sender_encoded() || t.src_dtype != t.dst_dtype || lv.dtype != t.dst_dtype {
            // one piece packed from both sets, compared packed
            let one = Bucket {
                pieces: vec![*p],
                bytes: bucket.bytes,
            };
            let (new, old, _) = scratch;
            let cap = max_len(&one).max(16);
            new.resize(cap, 0);
            old.resize(cap, 0);
            let n = crate::bucket::pack(&one, transfers, live, new, fp8)?;
            let m = crate::bucket::pack(&one, transfers, copy, old, fp8)?;
            let d = encode_bucket(&one, transfers, &old[..m], &new[..n], out)?;
            // an FP8 box is refreshed whole even when its bytes did not change: its scales
            // come from block maxima, so a box whose copy mixed old and new elements (written
            // through another engine's overlapping box) could pack to bytes no receiver holds
            if let Some(c) = changes.as_deref_mut()
                && (d.changed > 0 || t.sender_encoded())
            {
                c.boxes.push((t.src_tensor.clone(), so, e));
            }
            st.add(&d);
            continue;
        }
        let es = t.dst_dtype.size();
        let sb = StridedBox::new(&lv.shape, &so, &e, &Dims::zeros(e.ndim()), &e)?;
        let (lb, cb) = (lv.try_bytes()?, cv.try_bytes()?);
        // the changed elements' indices and their new bytes, read by the compare
        let (vals, _, idx) = scratch;
        idx.clear();
        vals.clear();
        let mut bad = false;
        sb.for_each_run(|s, d, n| {
            let (a, b) = ((s as usize) * es, ((s + n) as usize) * es);
            match (cb.get(a..b), lb.get(a..b)) {
                (Some(o), Some(w)) => delta::changed_values(o, w, es, d as u32, idx, vals),
                _ => bad = true,
            }
        });
        if bad || e.numel() > u32::MAX as u64 {
            return Err(TransportError::Delta(format!(
                "`{}`: a box outside the tensor, or over 2^32 elements",
                t.src_tensor
            ))
            .into());
        }
        let run = sb.run as usize;
        // where box element `i` lies in the tensor (one run: no run to look up)
        let (one_run, base) = (sb.n_outer == 0, sb.src_base as usize);
        let locate = |i: usize| {
            if one_run {
                base + i
            } else {
                sb.run_at((i / run) as u64).0 as usize + i % run
            }
        };
        if let Some(c) = changes.as_deref_mut()
            && !idx.is_empty()
        {
            if lv.shape.numel() > u32::MAX as u64 {
                c.boxes.push((t.src_tensor.clone(), so, e));
            } else {
                let v = c.elements.entry(t.src_tensor.clone()).or_default();
                v.at.extend(idx.iter().map(|&i| locate(i as usize) as u32));
                v.values.extend_from_slice(vals);
            }
        }
        st.add(
            &delta::encode_changes(
                e.numel() as usize,
                es,
                idx,
                vals,
                |i| {
                    let at = locate(i) * es;
                    &lb[at..at + es]
                },
                out,
            )
            .map_err(delta_err(format!(
                "encoding the delta of `{}`",
                t.src_tensor
            )))?,
        );
    }
    Ok(st)
}

/// What a bucket's delta depends on at the sender: per piece, the source box, the dtypes and
/// the encoding (not the receiving rank, nor where the receiver puts the bytes). Replicas of
/// one inference layout (engines) get buckets with equal keys, hence equal deltas.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BucketKey(Vec<PieceKey>);

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PieceKey {
    src: std::sync::Arc<str>,
    offset: Dims,
    extent: Dims,
    src_dtype: DType,
    dst_dtype: DType,
    encode: Option<awex_core::plan::Encode>,
}

impl BucketKey {
    /// The key of `bucket` of a peer plan's `transfers`.
    pub fn of(bucket: &Bucket, transfers: &[Transfer]) -> Self {
        BucketKey(
            bucket
                .pieces
                .iter()
                .map(|p| {
                    let t = &transfers[p.transfer as usize];
                    let (so, _, e) = piece_box(t, p);
                    PieceKey {
                        src: t.src_tensor.clone(),
                        offset: so,
                        extent: e,
                        src_dtype: t.src_dtype,
                        dst_dtype: t.dst_dtype,
                        encode: t.encode.clone(),
                    }
                })
                .collect(),
        )
    }
}

/// One bucket's delta as the sender encoded it.
#[derive(Debug, Default)]
pub struct Encoded {
    /// The delta's bytes.
    pub bytes: Vec<u8>,
    /// Its figures.
    pub stats: DeltaStats,
    /// Checksum of the dense bucket (the bytes the receiver ends with); 0 without checksums.
    pub checksum: u64,
}

struct SharedEntry {
    uses_left: usize,
    value: Option<std::sync::Arc<Encoded>>,
}

/// The deltas of one update that more than one peer of a training rank takes (engines that
/// replicate a layout receive the same source boxes): each is encoded once and kept until its
/// last peer took it, so a rank compares its bytes once per update, not once per engine.
/// Buckets only one peer takes are encoded by that peer and never kept.
#[derive(Default)]
pub struct SharedDeltas {
    entries: HashMap<BucketKey, Mutex<SharedEntry>>,
}

impl SharedDeltas {
    /// The shared keys among the buckets of each peer (`(buckets, transfers)` per peer).
    pub fn new<'a>(peers: impl IntoIterator<Item = (&'a [Bucket], &'a [Transfer])>) -> Self {
        let mut count: HashMap<BucketKey, usize> = HashMap::new();
        for (buckets, transfers) in peers {
            for b in buckets {
                *count.entry(BucketKey::of(b, transfers)).or_default() += 1;
            }
        }
        SharedDeltas {
            entries: count
                .into_iter()
                .filter(|&(_, n)| n > 1)
                .map(|(k, n)| {
                    let e = SharedEntry {
                        uses_left: n,
                        value: None,
                    };
                    (k, Mutex::new(e))
                })
                .collect(),
        }
    }

    /// Buckets two or more peers take.
    pub fn shared(&self) -> usize {
        self.entries.len()
    }

    /// The delta of `bucket`: encoded by `encode` on its first use (a peer asking meanwhile
    /// waits for it), then handed to every other peer with the same key; dropped after the
    /// last. A failed encode is not kept (the next peer tries again).
    pub fn get(
        &self,
        bucket: &Bucket,
        transfers: &[Transfer],
        encode: impl FnOnce() -> Result<Encoded, RuntimeError>,
    ) -> Result<std::sync::Arc<Encoded>, RuntimeError> {
        let Some(entry) = self.entries.get(&BucketKey::of(bucket, transfers)) else {
            return encode().map(std::sync::Arc::new);
        };
        let mut e = entry
            .lock()
            .map_err(|_| TransportError::Panicked("a peer encoding a shared delta"))?;
        let v = match &e.value {
            Some(v) => v.clone(),
            None => std::sync::Arc::new(encode()?),
        };
        e.uses_left = e.uses_left.saturating_sub(1);
        e.value = (e.uses_left > 0).then(|| v.clone());
        Ok(v)
    }
}

/// Where one segment's elements land: a box of a tensor.
struct Target<'a> {
    view: &'a TensorView,
    /// the dtype on the wire (the plan's destination dtype)
    wire: DType,
    sb: StridedBox,
    name: &'a str,
}

impl Target<'_> {
    /// Element offset in the tensor of run `r` of the box.
    fn run_at(&self, r: u64) -> u64 {
        self.sb.run_at(r).1
    }

    /// Writes the consecutive elements `values` (wire dtype) from box element `first` on.
    fn write(&self, out: &mut [u8], first: usize, values: &[u8]) -> Result<(), RuntimeError> {
        let (we, te) = (self.wire.size(), self.view.dtype.size());
        if self.sb.n_outer == 0 && self.wire == self.view.dtype {
            // the box is one run of the tensor: no run to look up
            let at = (self.sb.dst_base as usize + first) * te;
            let dst = at
                .checked_add(values.len())
                .and_then(|end| out.get_mut(at..end))
                .ok_or_else(|| self.outside())?;
            // one element (most writes at optimiser densities): a fixed-size copy
            match values.len() {
                2 => dst[..2].copy_from_slice(&values[..2]),
                1 => dst[0] = values[0],
                4 => dst[..4].copy_from_slice(&values[..4]),
                _ => dst.copy_from_slice(values),
            }
            return Ok(());
        }
        let run = self.sb.run as usize;
        let mut i = first;
        let mut v = values;
        while !v.is_empty() {
            let (r, off) = (i / run, i % run);
            let k = (run - off).min(v.len() / we);
            let at = (self.run_at(r as u64) as usize + off) * te;
            let dst = out.get_mut(at..at + k * te).ok_or_else(|| self.outside())?;
            if self.wire == self.view.dtype {
                dst.copy_from_slice(&v[..k * we]);
            } else {
                awex_core::dtype::convert(&v[..k * we], self.wire, dst, self.view.dtype)
                    .map_err(|e| RuntimeError::from(TransportError::Delta(e.to_string())))?;
            }
            v = &v[k * we..];
            i += k;
        }
        Ok(())
    }

    fn outside(&self) -> RuntimeError {
        TransportError::Delta(format!("a delta writes outside `{}`", self.name)).into()
    }
}

/// Applies a bucket's delta to the destination tensors (which hold the base version): every
/// changed element lands where [`crate::bucket::unpack`] would have put it. The whole delta
/// must be consumed.
pub fn apply_bucket(
    bucket: &Bucket,
    transfers: &[Transfer],
    dst: &TensorSet,
    delta_bytes: &[u8],
) -> Result<DeltaStats, RuntimeError> {
    let mut st = DeltaStats::default();
    let mut at = 0usize;
    for p in &bucket.pieces {
        let t = &transfers[p.transfer as usize];
        if t.transposed {
            // (connect and `enable_deltas` refuse such plans first)
            return Err(crate::TransportError::Unsupported(format!(
                "a delta for `{}` would land transposed, which delta updates do not apply yet",
                t.dst_tensor
            ))
            .into());
        }
        let (_, d, e) = piece_box(t, p);
        let v = dst_view(dst, t)?;
        let mut targets = vec![Target {
            view: v,
            wire: t.dst_dtype,
            sb: StridedBox::new(&e, &Dims::zeros(e.ndim()), &v.shape, &d, &e)?,
            name: &t.dst_tensor,
        }];
        let scale_name;
        if let Some((soff, sext)) = piece_scale_box(t, p) {
            scale_name = awex_core::encoding::Fp8Block::scale_name(&t.dst_tensor);
            let sv = dst.get(&scale_name).ok_or_else(|| {
                RuntimeError::from(crate::TensorError::NotRegistered {
                    side: "destination",
                    name: scale_name.clone(),
                })
            })?;
            targets.push(Target {
                view: sv,
                wire: DType::F32,
                sb: StridedBox::new(&sext, &Dims::zeros(sext.ndim()), &sv.shape, &soff, &sext)?,
                name: &scale_name,
            });
        }
        for tg in &targets {
            let elem = tg.wire.size();
            let n = tg.sb.run as usize * {
                let mut runs = 1usize;
                for &(c, _, _) in &tg.sb.outer[..tg.sb.n_outer] {
                    runs *= c as usize;
                }
                runs
            };
            // SAFETY: the plan writes each destination box exactly once per update.
            let out = unsafe { tg.view.try_bytes_mut()? };
            let mut failed = None;
            let mut changed = 0u64;
            let rest = delta_bytes.get(at..).unwrap_or(&[]);
            let used = delta::decode(rest, elem, n, |first, values| {
                if failed.is_none() {
                    changed += (values.len() / elem) as u64;
                    failed = tg.write(out, first, values).err();
                }
            })
            .map_err(delta_err(format!("the delta for `{}`", tg.name)))?;
            if let Some(e) = failed {
                return Err(e);
            }
            at += used;
            st.add(&DeltaStats {
                elements: n as u64,
                changed,
                dense_bytes: (n * elem) as u64,
                delta_bytes: used as u64,
            });
        }
    }
    if at != delta_bytes.len() {
        return Err(TransportError::Delta(format!(
            "a bucket's delta holds {} bytes but its segments take {at}",
            delta_bytes.len()
        ))
        .into());
    }
    Ok(st)
}

/// What a receiving rank knows it holds, per sending peer: the version whose bytes from that
/// peer it received whole. A peer's entry is dropped as soon as a receive from it starts (a
/// failure from then on may leave its boxes torn).
#[derive(Default)]
pub struct HeldBases {
    held: Mutex<HashMap<RankId, u64>>,
}

impl HeldBases {
    /// Starts a receive from `peer`: returns the version its boxes held, and forgets it.
    pub fn begin(&self, peer: RankId) -> Option<u64> {
        self.held.lock().ok()?.remove(&peer)
    }

    /// A receive of `version` from `peer` completed.
    pub fn finish(&self, peer: RankId, version: u64) {
        if let Ok(mut h) = self.held.lock() {
            h.insert(peer, version);
        }
    }

    /// Forgets everything (the tensors were written by someone else).
    pub fn clear(&self) {
        if let Ok(mut h) = self.held.lock() {
            h.clear();
        }
    }
}

/// Refuses a delta against `base` from `peer` when this rank's boxes from it hold `held`.
pub fn check_base(peer: RankId, base: u64, held: Option<u64>) -> Result<(), RuntimeError> {
    if held == Some(base) {
        return Ok(());
    }
    Err(TransportError::Delta(format!(
        "training rank {peer} sent a delta against version {base}, but this rank's tensors from it hold {}; the update fails rather than apply it (the next one is sent whole)",
        held.map_or("no complete version".to_string(), |v| format!("version {v}"))
    ))
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{make_buckets, pack, unpack};
    use awex_core::layout::RankId;
    use std::sync::Arc;

    fn view(name: &str, buf: &mut [u8], dtype: DType, shape: &[u64]) -> TensorView {
        // SAFETY: the buffer outlives the set in each test.
        unsafe {
            TensorView::new(name, buf.as_mut_ptr(), buf.len(), dtype, Dims::new(shape)).unwrap()
        }
    }

    /// A transfer of a 3 x 5 box from a 4 x 6 bf16 source at (1, 1) into a 5 x 7 destination
    /// at (2, 1).
    fn transfer() -> Transfer {
        Transfer {
            encode: None,
            src_rank: RankId::train(0),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: Arc::from("s"),
            src_shape: Dims::new(&[4, 6]),
            src_offset: Dims::new(&[1, 1]),
            src_dtype: DType::Bf16,
            dst_tensor: Arc::from("d"),
            dst_shape: Dims::new(&[5, 7]),
            dst_offset: Dims::new(&[2, 1]),
            dst_dtype: DType::Bf16,
            extent: Dims::new(&[3, 5]),
            transposed: false,
        }
    }

    #[test]
    fn a_bucket_delta_applied_in_place_equals_unpacking_the_new_bucket() {
        let ts = vec![transfer()];
        let b = &make_buckets(&ts, 1 << 20)[0];
        let mut old_src: Vec<u8> = (0..48).map(|i| i as u8).collect();
        let mut new_src = old_src.clone();
        // change two elements inside the box and one outside it
        new_src[2 * (6 + 2)] ^= 1; // (1, 2)
        new_src[2 * (3 * 6 + 5) + 1] ^= 4; // (3, 5)
        new_src[0] ^= 9; // (0, 0): not moved
        let (mut d_full, mut d_delta) = (vec![0xaau8; 70], vec![0xaau8; 70]);
        let old =
            TensorSet::from_views(vec![view("s", &mut old_src, DType::Bf16, &[4, 6])]).unwrap();
        let new =
            TensorSet::from_views(vec![view("s", &mut new_src, DType::Bf16, &[4, 6])]).unwrap();
        let full =
            TensorSet::from_views(vec![view("d", &mut d_full, DType::Bf16, &[5, 7])]).unwrap();
        let inc =
            TensorSet::from_views(vec![view("d", &mut d_delta, DType::Bf16, &[5, 7])]).unwrap();
        let (mut po, mut pn) = (vec![0u8; 30], vec![0u8; 30]);
        pack(b, &ts, &old, &mut po, None).unwrap();
        pack(b, &ts, &new, &mut pn, None).unwrap();
        // the receiver holds the base, then gets the delta
        unpack(b, &ts, &inc, &po).unwrap();
        let mut dl = Vec::new();
        let st = encode_bucket(b, &ts, &po, &pn, &mut dl).unwrap();
        assert_eq!((st.elements, st.changed), (15, 2));
        let applied = apply_bucket(b, &ts, &inc, &dl).unwrap();
        assert_eq!(applied, st);
        unpack(b, &ts, &full, &pn).unwrap();
        drop((full, inc));
        assert_eq!(d_delta, d_full);
        // a delta with a trailing byte is refused
        dl.push(0);
        let inc =
            TensorSet::from_views(vec![view("d", &mut d_delta, DType::Bf16, &[5, 7])]).unwrap();
        assert!(apply_bucket(b, &ts, &inc, &dl).is_err());
    }

    #[test]
    fn the_copy_refreshed_in_the_background_holds_the_recorded_version_whenever_it_is_read() {
        // 16 Mi bf16 elements: the background write of 1 in 8 takes a while
        let n = 16 << 20;
        let mut live_buf: Vec<u8> = (0..2 * n).map(|i| (i * 7 % 251) as u8).collect();
        let live = TensorSet::from_views(vec![view("s", &mut live_buf, DType::Bf16, &[n as u64])])
            .unwrap();
        let mut base = SenderBase::new(&live).unwrap();
        assert_eq!(base.refresh(&live, 1).unwrap(), 2 * n as u64);
        // version 2: every 8th element changes; the encoders record their new bytes
        let at: Vec<u32> = (0..n as u32).step_by(8).collect();
        let mut values = Vec::with_capacity(2 * at.len());
        let mut want = live.get("s").unwrap().try_bytes().unwrap().to_vec();
        for &i in &at {
            let v = [(i % 13) as u8 ^ 0x5a, 0xc3];
            want[2 * i as usize..2 * i as usize + 2].copy_from_slice(&v);
            values.extend_from_slice(&v);
        }
        let mut rec = Changes::default();
        rec.elements.insert(Arc::from("s"), Changed { at, values });
        base.record(rec).unwrap();
        assert_eq!(base.refresh_changed(&live, 2).unwrap(), 2 * (n as u64 / 8));
        // the trainer writes its next version at once, and the copy is read right away: it
        // holds what was recorded, all of it
        // SAFETY: the test's own buffer, not read by the background write.
        let lb = unsafe { live.get("s").unwrap().try_bytes_mut().unwrap() };
        lb[2 * n - 2..].fill(0xee);
        let got = base.copy().unwrap().get("s").unwrap().try_bytes().unwrap();
        assert_eq!(
            got.iter()
                .rev()
                .zip(want.iter().rev())
                .position(|(a, b)| a != b),
            None
        );
        assert_eq!(base.version(), Some(2));
        // a recorded change outside its tensor is refused before anything is written, and the
        // copy then holds no version
        let mut rec = Changes::default();
        rec.elements.insert(
            Arc::from("s"),
            Changed {
                at: vec![n as u32],
                values: vec![1, 2],
            },
        );
        base.record(rec).unwrap();
        let e = base.refresh_changed(&live, 3).unwrap_err().to_string();
        assert!(e.contains("a recorded change lies outside `s`"), "{e}");
        assert_eq!(base.version(), None);
        drop(base);
        drop(live);
    }

    #[test]
    fn bases_name_who_holds_what_and_a_mismatch_is_refused() {
        let bases = PeerBases {
            version: 4,
            except: [RankId::infer(0, 1)].into_iter().collect(),
        };
        assert_eq!(bases.of(RankId::infer(0, 0)), Some(4));
        assert_eq!(bases.of(RankId::infer(0, 1)), None);
        let held = HeldBases::default();
        held.finish(RankId::train(0), 4);
        assert_eq!(held.begin(RankId::train(0)), Some(4));
        // a receive that started and did not finish leaves nothing held
        assert_eq!(held.begin(RankId::train(0)), None);
        assert!(check_base(RankId::train(0), 4, Some(4)).is_ok());
        let e = check_base(RankId::train(0), 4, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("against version 4"), "{e}");
    }
}
