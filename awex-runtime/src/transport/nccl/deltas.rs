//! Delta updates of the nccl transport: per step, a header per bucket then its frame
//! ([`awex_gpu::nccl::BucketHeader`]); the training rank encodes each packed bucket against its
//! GPU copy of what it last sent and applies the frame to that copy, the inference rank gathers
//! the step's boxes into its slot and applies the frames there (the module docs of
//! [`super`] tell the whole step).

use super::{Gpu, stop_reason, wait_one};
use crate::transport::{ExecContext, ExecStats};
use awex_core::layout::Side;
use awex_gpu::cuda::delta_wire::{WireKernels, WireWork};
use awex_gpu::cuda::{CopyDesc, Device, DeviceBuffer, Event, Stream};
use awex_gpu::nccl::{
    BucketHeader, Communicator, FrameLayout, HEADER_BYTES, NcclError, OpKind, P2p, Program,
    SLOT_ALIGN, wire_table,
};
use std::sync::Arc;

/// A rank's delta updates: the wire kernels, per step the frames and headers of the buckets
/// whose peer takes part, and (training) the copy of what was last sent.
pub(super) struct Deltas {
    pub(super) kernels: WireKernels,
    /// Training: encodes and updates the copy, beside the NCCL stream.
    pub(super) stream: Arc<Stream>,
    /// `done[s]`: training, the copy's update from the step in slot `s` finished; inference,
    /// the step's boxes are gathered into slot `s`.
    pub(super) done: [Event; 2],
    pub(super) frames: [DeviceBuffer; 2],
    /// Every step's headers, [`HEADER_BYTES`] a bucket.
    pub(super) headers: DeviceBuffer,
    pub(super) steps: Vec<DeltaStep>,
    /// Training: the encoders' scratch (one encode at a time on `stream`).
    pub(super) scratch: Option<DeviceBuffer>,
    /// Training: the bytes last sent in every delta bucket, a region each (the works in
    /// `steps` point into it; held here so that it lives as long as they do).
    _copy: Option<DeviceBuffer>,
    /// Training: the version `copy` holds (`None` after any update that did not end well).
    pub(super) copy_version: Option<u64>,
    /// Inference: the version the tensors hold from the last update received whole.
    pub(super) held: Option<u64>,
}

/// One step's delta buckets.
pub(super) struct DeltaStep {
    pub(super) frames: FrameLayout,
    /// Offset of the step's first header in `headers`.
    pub(super) header_at: u64,
    /// Per operation: its bucket's work where its peer takes part.
    pub(super) ops: Vec<Option<OpDelta>>,
    /// Inference: the copies gathering the step's staged boxes into its slot.
    pub(super) gathers: Vec<CopyDesc>,
}

/// One delta bucket's kernel work.
pub(super) struct OpDelta {
    /// Training: encodes the wire bytes against the copy; inference: applies a frame where the
    /// bucket's bytes sit (slot or tensor).
    pub(super) work: WireWork,
    /// Training: applies the frame to the copy.
    pub(super) into_copy: Option<WireWork>,
    /// Its header's index in the step.
    pub(super) header: u64,
    /// Elements of the bucket.
    pub(super) elements: u64,
}

/// The frames, headers, kernel work and (training) copy of a program's buckets whose peer
/// takes part in deltas (`delta_peers`, by the plan's peer index), over the slots at
/// `base(0)` and `base(1)`.
pub(super) fn setup(
    dev: &Device,
    program: &Program,
    delta_peers: &[bool],
    base: &dyn Fn(usize) -> u64,
) -> Result<Deltas, NcclError> {
    let kernels = WireKernels::load(dev)?;
    let training = program.side == Side::Training;
    let mut steps = Vec::with_capacity(program.steps.len());
    let (mut headers, mut copy_bytes, mut frame_bytes, mut scratch) = (0u64, 0u64, 0u64, 0u64);
    // the copy's regions, laid out before anything is allocated
    let mut layout = Vec::with_capacity(program.steps.len());
    for st in &program.steps {
        let frames = FrameLayout::of(st, |i| delta_peers[st.ops[i].op.peer_index]);
        let mut at = Vec::with_capacity(st.ops.len());
        for (i, f) in frames.at.iter().enumerate() {
            if f.is_none() {
                at.push(None);
                continue;
            }
            at.push(Some(copy_bytes));
            copy_bytes = (copy_bytes + st.ops[i].op.bytes).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        }
        frame_bytes = frame_bytes.max(frames.bytes);
        layout.push((frames, at));
    }
    let copy = if training && copy_bytes > 0 {
        Some(dev.alloc(copy_bytes)?)
    } else {
        None
    };
    for (k, (st, (frames, at))) in program.steps.iter().zip(layout).enumerate() {
        let slot = base(k % 2);
        let header_at = headers;
        let mut ops = Vec::with_capacity(st.ops.len());
        let mut n = 0u64;
        for (i, o) in st.ops.iter().enumerate() {
            let Some(copy_at) = at[i] else {
                ops.push(None);
                continue;
            };
            let segs = &st.segs[i];
            let wire = o.wire.addr(slot);
            let (work, into_copy) = match (&copy, training) {
                (Some(c), true) => {
                    let table = wire_table(segs, wire, c.ptr() + copy_at)?;
                    scratch = scratch.max(table.scratch_bytes());
                    let into = wire_table(segs, c.ptr() + copy_at, 0)?;
                    (
                        kernels.prepare(dev, &table, false)?,
                        Some(kernels.prepare(dev, &into, false)?),
                    )
                }
                _ => (
                    kernels.prepare(dev, &wire_table(segs, wire, 0)?, false)?,
                    None,
                ),
            };
            ops.push(Some(OpDelta {
                work,
                into_copy,
                header: n,
                elements: segs.iter().map(|s| s.n).sum(),
            }));
            n += 1;
        }
        headers += n * HEADER_BYTES;
        let gathers = if !training && n > 0 {
            st.gathers(slot)
        } else {
            Vec::new()
        };
        steps.push(DeltaStep {
            frames,
            header_at,
            ops,
            gathers,
        });
    }
    let frame_buf = || dev.alloc(frame_bytes.max(SLOT_ALIGN));
    let d = Deltas {
        stream: Arc::new(dev.stream()?),
        done: [dev.event(false)?, dev.event(false)?],
        frames: [frame_buf()?, frame_buf()?],
        headers: dev.alloc(headers.max(HEADER_BYTES))?,
        steps,
        scratch: if training && scratch > 0 {
            Some(dev.alloc(scratch)?)
        } else {
            None
        },
        _copy: copy,
        copy_version: None,
        held: None,
        kernels,
    };
    tracing::info!(
        side = %program.side,
        rank = %program.rank,
        copy_bytes = if training { copy_bytes } else { 0 },
        frame_bytes = 2 * frame_bytes,
        "nccl delta updates: GPU memory for the copy of what this rank sends (training) and the frames of two steps"
    );
    Ok(d)
}

/// A training rank's delta step `k` in slot `s`: encodes every delta bucket (once the pack
/// and quantisation of the step are done), waits for the frames' lengths, sends the headers
/// (one group), and queues the copy's update from the frames (recording `d.done[s]`).
/// Returns each delta bucket's header (by operation index); the caller sends the frames or
/// whole buckets as they say.
#[allow(clippy::too_many_arguments)]
pub(super) fn send(
    gpu: &Gpu,
    d: &Deltas,
    ds: &DeltaStep,
    step: &awex_gpu::nccl::StepIo,
    s: usize,
    packed: &[&Event],
    bases: Option<&crate::delta::PeerBases>,
    comm: &mut Communicator,
    ctx: &ExecContext<'_>,
    k: usize,
    stats: &mut ExecStats,
) -> Result<Vec<(usize, BucketHeader)>, NcclError> {
    let frames = d.frames[s].ptr();
    d.stream.wait(&gpu.free[s])?;
    if step.has_copies() {
        d.stream.wait(&gpu.ready[s])?;
    }
    for e in packed {
        d.stream.wait(e)?;
    }
    let (scratch, scratch_len) = d.scratch.as_ref().map_or((0, 0), |b| (b.ptr(), b.len()));
    for (i, od) in ds.ops.iter().enumerate() {
        let (Some(od), Some((off, _))) = (od, ds.frames.at[i]) else {
            continue;
        };
        // SAFETY: the work's segments are the bucket's wire bytes (a registered tensor range
        // or slot `s`, packed above) and its region of the copy; the frame lies in the frame
        // buffer at its layout's offset, the scratch is used by this stream only, one encode
        // at a time; the frames of step `k - 2` were sent once `free[s]` passed.
        unsafe {
            d.kernels
                .launch_encode_in(&d.stream, &od.work, frames + off, scratch, scratch_len)?
        };
    }
    wait_one(&d.stream, comm, ctx, k)?;
    let mut heads = Vec::with_capacity(ds.ops.len());
    let mut bytes = Vec::new();
    for (i, od) in ds.ops.iter().enumerate() {
        let Some(od) = od else { continue };
        let o = &step.ops[i];
        let (len, changed) = d.kernels.finish_encode_counted(&d.stream, &od.work)?;
        let peer_base = bases.and_then(|b| b.of(o.op.peer));
        // a frame no shorter than the bucket goes whole (a tiny bucket, or most of it changed)
        let h = match d.copy_version {
            Some(v) if peer_base == Some(v) && len < o.op.bytes => {
                stats.delta.elements += od.elements;
                stats.delta.changed += changed;
                stats.delta.dense_bytes += o.op.bytes;
                stats.delta.delta_bytes += len;
                BucketHeader::Delta {
                    bytes: o.op.bytes,
                    len,
                    base: v,
                }
            }
            _ => BucketHeader::Dense { bytes: o.op.bytes },
        };
        bytes.extend_from_slice(&h.to_bytes());
        heads.push((i, h, len));
    }
    d.headers.upload(ds.header_at, &bytes)?;
    // the copy takes the new bytes from the frames (every one of them, whole or delta: a frame
    // applied to the copy leaves the bytes sent, whatever it held)
    for &(i, _, len) in &heads {
        let (Some(od), Some((off, _))) = (ds.ops[i].as_ref(), ds.frames.at[i]) else {
            continue;
        };
        if let Some(w) = &od.into_copy {
            // SAFETY: the work's segments are the bucket's region of the copy (read by this
            // stream's encodes only, which are ordered before); the frame was just encoded.
            unsafe { d.kernels.launch_decode(&d.stream, w, frames + off, len)? };
        }
    }
    d.done[s].record(&d.stream)?;
    let head_ops: Vec<P2p> = heads
        .iter()
        .map(|&(i, _, _)| {
            let o = &step.ops[i];
            let at = ds.ops[i].as_ref().map_or(0, |od| od.header);
            P2p {
                kind: OpKind::Send,
                addr: d.headers.ptr() + ds.header_at + at * HEADER_BYTES,
                bytes: HEADER_BYTES,
                peer: o.peer_comm,
            }
        })
        .collect();
    let mut stop = || stop_reason(ctx, k);
    // SAFETY: the headers lie in the header buffer, written above (synchronously).
    unsafe { comm.group(&head_ops, gpu.nccl_stream.as_raw(), &mut stop)? };
    Ok(heads.into_iter().map(|(i, h, _)| (i, h)).collect())
}

/// An inference rank's delta step `k`: receives the step's headers (one group), waits for
/// them, and reads them: each delta must be against the version the tensors hold (`held`).
#[allow(clippy::too_many_arguments)]
pub(super) fn receive_headers(
    gpu: &Gpu,
    d: &Deltas,
    ds: &DeltaStep,
    step: &awex_gpu::nccl::StepIo,
    held: Option<u64>,
    comm: &mut Communicator,
    ctx: &ExecContext<'_>,
    k: usize,
) -> Result<Vec<(usize, BucketHeader)>, NcclError> {
    let mine: Vec<(usize, &OpDelta)> = ds
        .ops
        .iter()
        .enumerate()
        .filter_map(|(i, o)| Some((i, o.as_ref()?)))
        .collect();
    let head_ops: Vec<P2p> = mine
        .iter()
        .map(|&(i, od)| P2p {
            kind: OpKind::Recv,
            addr: d.headers.ptr() + ds.header_at + od.header * HEADER_BYTES,
            bytes: HEADER_BYTES,
            peer: step.ops[i].peer_comm,
        })
        .collect();
    let mut stop = || stop_reason(ctx, k);
    // SAFETY: the headers' regions lie in the header buffer, this step's own.
    unsafe { comm.group(&head_ops, gpu.nccl_stream.as_raw(), &mut stop)? };
    wait_one(&gpu.nccl_stream, comm, ctx, k)?;
    let mut raw = vec![0u8; (mine.len() as u64 * HEADER_BYTES) as usize];
    d.headers.download(ds.header_at, &mut raw)?;
    let mut out = Vec::with_capacity(mine.len());
    for (j, &(i, _)) in mine.iter().enumerate() {
        let o = &step.ops[i];
        let max = ds.frames.at[i].map_or(0, |(_, m)| m);
        let peer = format!("training rank {}", o.op.peer);
        let at = j * HEADER_BYTES as usize;
        let h = BucketHeader::parse(&raw[at..at + HEADER_BYTES as usize], o.op.bytes, max, &peer)?;
        if let BucketHeader::Delta { base, .. } = h
            && held != Some(base)
        {
            return Err(NcclError::Plan(format!(
                "{peer} sent a delta against version {base}, but this rank's tensors hold {}; the update fails rather than apply it (the next one is sent whole)",
                held.map_or("no complete version".to_string(), |v| format!(
                    "version {v}"
                ))
            )));
        }
        out.push((i, h));
    }
    Ok(out)
}
