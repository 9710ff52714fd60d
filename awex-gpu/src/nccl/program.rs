//! A rank's update as device work: for every step, where each bucket's bytes sit and which
//! 2-D copies pack (training) or unpack (inference) them.
//!
//! A bucket that is one piece lying contiguously in the local tensor goes over the wire
//! straight from (or into) the tensor. Any other bucket is packed into a staging slot before
//! the send, or received into one and unpacked after, with pitched copies built from the
//! piece boxes ([`push_box`]). Two slots alternate between steps, so a rank holds at most two
//! steps of staging. Everything here is geometry on addresses: it is tested on host memory.
//!
//! FP8 (a sender-encoded transfer, [`Transfer::sender_encoded`]): the training rank quantises
//! each piece of such a transfer straight into its slot with the block-FP8 kernel
//! ([`crate::cuda::Fp8Kernel`]): one [`Fp8Job`] per matrix of the piece's box reads the bf16
//! where it lies in the tensor and writes the e4m3 bytes and fp32 scales where the bucket's
//! wire format puts them (the piece's e4m3 bytes row-major over its box, then its blocks'
//! scales row-major over its scale box: the tcp transport's bucket, byte for byte). The
//! inference rank unpacks them as any bucket, with two plain copies per piece: the e4m3 box
//! into the engine's e4m3 tensor, the scale box into its scale tensor. A transfer whose blocks
//! no one sender holds whole (receiver-encoded in the plan) is refused, naming the tensor.

use super::NcclError;
use super::ranks::CommWorld;
use super::schedule::{Op, Step};
use crate::cuda::desc::push_box;
use crate::cuda::transpose::{Conversion, TransposeJob, box_convert_jobs, box_jobs, conversion};
use crate::cuda::{CopyDesc, Fp8Job};
use awex_core::dtype::DType;
use awex_core::encoding::Fp8Block;
use awex_core::layout::copy::StridedBox;
use awex_core::layout::{Dims, RankId, Side};
use awex_core::plan::bucket::{Bucket, piece_box, piece_scale_box};
use awex_core::plan::{RankPlan, SCALE_BYTES, Transfer, covers_whole_blocks};
use std::collections::HashMap;
use std::sync::Arc;

/// Alignment of each staged bucket inside a slot.
pub const SLOT_ALIGN: u64 = 256;

/// A local tensor in device memory (row-major, contiguous), owned by the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTensor {
    /// Engine-native name.
    pub name: Arc<str>,
    /// Device address of the first byte.
    pub ptr: u64,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Dims,
}

impl DeviceTensor {
    /// Size in bytes.
    pub fn nbytes(&self) -> u64 {
        self.shape.numel() * self.dtype.size() as u64
    }
}

/// The registered device tensors of one rank, by name.
#[derive(Clone, Debug, Default)]
pub struct DeviceTensors {
    map: HashMap<Arc<str>, DeviceTensor>,
}

impl DeviceTensors {
    /// A set of tensors registered by their owner.
    ///
    /// # Safety
    /// Each tensor's `[ptr, ptr + nbytes)` must be memory on the transport's GPU that stays
    /// allocated, and that nobody else writes (training) or touches (inference) while an
    /// update runs, for as long as the set is used.
    pub unsafe fn new(tensors: Vec<DeviceTensor>) -> Result<Self, NcclError> {
        let mut map = HashMap::with_capacity(tensors.len());
        for t in tensors {
            if t.ptr == 0 && t.nbytes() > 0 {
                return Err(NcclError::Plan(format!(
                    "device tensor `{}` has a null address",
                    t.name
                )));
            }
            let name = t.name.clone();
            if map.insert(name.clone(), t).is_some() {
                return Err(NcclError::Plan(format!(
                    "device tensor `{name}` is registered twice"
                )));
            }
        }
        Ok(DeviceTensors { map })
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&DeviceTensor> {
        self.map.get(name)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no tensor is registered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Where an operation's bytes sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wire {
    /// At this device address, inside a tensor (no staging).
    Direct(u64),
    /// At this offset of the step's staging slot.
    Staged(u64),
}

impl Wire {
    /// The device address, given the slot's base address.
    pub fn addr(&self, slot: u64) -> u64 {
        match *self {
            Wire::Direct(a) => a,
            Wire::Staged(off) => slot + off,
        }
    }
}

/// One operation of a step with its peer's communicator rank and its bytes' place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpIo {
    /// The operation.
    pub op: Op,
    /// The peer's communicator rank.
    pub peer_comm: u32,
    /// Where the bytes sit.
    pub wire: Wire,
}

/// One run of elements of a bucket's wire bytes: a piece's elements (in the destination's
/// dtype), or a sender-encoded piece's e4m3 bytes or its fp32 scales. A bucket's runs follow
/// each other in wire order and cover its bytes; they are the segments of its delta frame
/// (`awex_core::encoding::delta_frame`), as the tcp transport's deltas cut a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpSeg {
    /// Byte offset in the bucket's wire bytes.
    pub at: u64,
    /// Elements.
    pub n: u64,
    /// Bytes per element.
    pub elem: u32,
}

/// One piece's copy between its tensor and a slot.
#[derive(Clone, Copy, Debug)]
struct PieceCopy {
    boxed: StridedBox,
    elem: u64,
    tensor: u64,
    slot_off: u64,
}

/// One matrix of a sender-encoded piece, quantised from its tensor into a slot.
#[derive(Clone, Debug)]
struct PieceQuant {
    /// Device address of the matrix's first bf16 element.
    src: u64,
    /// Offset of its e4m3 bytes in the slot.
    dst_off: u64,
    /// Offset of its fp32 scales in the slot.
    scale_off: u64,
    rows: u32,
    cols: u32,
    src_pitch: u32,
    scale_pitch: u32,
    /// The destination tensor (for errors).
    tensor: Arc<str>,
}

/// A piece the engine stores transposed, between a slot (the box row-major, as the sender
/// packed it) and its inference tensor (the box's last two dims swapped): one transpose job
/// per matrix of the box ([`crate::cuda::transpose`]).
#[derive(Clone, Copy, Debug)]
struct PieceTranspose {
    /// Slot to tensor, in elements (`src_base` from the piece's first slot element).
    boxed: StridedBox,
    elem: u64,
    tensor: u64,
    slot_off: u64,
}

/// A piece whose dtype the sender converts as it packs it (bf16 or f16 to and from f32): from
/// its training tensor into a slot, in the inference dtype, by the element-wise kernel
/// ([`crate::cuda::transpose::box_convert_jobs`]), so that the wire and the receiver hold the
/// engine's bytes (as the tcp sender packs them).
#[derive(Clone, Copy, Debug)]
struct PieceConvert {
    /// Tensor to slot, in elements (`dst_base` from the piece's first slot element).
    boxed: StridedBox,
    /// Bytes of a source element.
    elem: u64,
    conv: Conversion,
    tensor: u64,
    slot_off: u64,
}

/// What moves one piece between its tensors and a slot.
enum Part {
    Copy(PieceCopy),
    Quant(PieceQuant),
    Transpose(PieceTranspose),
    Convert(PieceConvert),
}

/// `b` the other way round: its destination read and its source written.
fn reversed(b: &StridedBox) -> StridedBox {
    let mut r = *b;
    std::mem::swap(&mut r.src_base, &mut r.dst_base);
    for o in &mut r.outer[..r.n_outer] {
        std::mem::swap(&mut o.1, &mut o.2);
    }
    r
}

/// The transpose jobs of `b` between the addresses `src` and `dst`, which the program has
/// already checked (a box it builds always makes jobs).
fn jobs_of(b: &StridedBox, elem: u64, src: u64, dst: u64) -> Vec<TransposeJob> {
    box_jobs(b, elem, src, dst, "")
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// One step: its operations and the copies that pack or unpack its staged buckets.
#[derive(Clone, Debug)]
pub struct StepIo {
    /// The step's number.
    pub index: usize,
    /// The operations, in issue order.
    pub ops: Vec<OpIo>,
    /// Staging bytes the step uses (aligned).
    pub staged_bytes: u64,
    /// Per operation (in `ops`' order), its bucket's runs of elements.
    pub segs: Vec<Vec<OpSeg>>,
    copies: Vec<PieceCopy>,
    quants: Vec<PieceQuant>,
    transposes: Vec<PieceTranspose>,
    converts: Vec<PieceConvert>,
}

impl StepIo {
    /// The copies that pack (training: tensors to slot) or unpack (inference: slot to tensors)
    /// this step's staged buckets, for a slot at device address `slot`.
    pub fn copies(&self, side: Side, slot: u64) -> Vec<CopyDesc> {
        let mut out = Vec::new();
        for c in &self.copies {
            let at = slot + c.slot_off;
            match side {
                Side::Training => push_box(&c.boxed, c.elem, c.tensor, at, &mut out),
                Side::Inference => push_box(&c.boxed, c.elem, at, c.tensor, &mut out),
            }
        }
        out
    }

    /// Inference ranks: the copies that gather this step's staged boxes from the tensors into
    /// a slot at device address `slot`, where [`StepIo::copies`] would unpack them (the same
    /// boxes the other way round): a delta is applied to the bytes the tensors hold there.
    pub fn gathers(&self, slot: u64) -> Vec<CopyDesc> {
        let mut out = Vec::new();
        for c in &self.copies {
            push_box(
                &reversed(&c.boxed),
                c.elem,
                c.tensor,
                slot + c.slot_off,
                &mut out,
            );
        }
        out
    }

    /// Inference ranks: the transpose jobs that unpack this step's transposed pieces from a
    /// slot at device address `slot` into their tensors (with [`StepIo::copies`], every piece).
    pub fn transpose_jobs(&self, slot: u64) -> Vec<TransposeJob> {
        self.transposes
            .iter()
            .flat_map(|t| jobs_of(&t.boxed, t.elem, slot + t.slot_off, t.tensor))
            .collect()
    }

    /// Inference ranks: the transpose jobs that gather this step's transposed pieces from
    /// their tensors into a slot at `slot` (with [`StepIo::gathers`], every piece).
    pub fn gather_transpose_jobs(&self, slot: u64) -> Vec<TransposeJob> {
        self.transposes
            .iter()
            .flat_map(|t| jobs_of(&reversed(&t.boxed), t.elem, t.tensor, slot + t.slot_off))
            .collect()
    }

    /// Whether the step has transposed pieces.
    pub fn has_transposes(&self) -> bool {
        !self.transposes.is_empty()
    }

    /// Training ranks: the element-wise jobs that pack this step's converting pieces from
    /// their tensors into a slot at device address `slot`, in the inference dtype (with
    /// [`StepIo::copies`] and [`StepIo::fp8_jobs`], every piece; each job writes its own bytes).
    pub fn convert_jobs(&self, slot: u64) -> Vec<TransposeJob> {
        self.converts
            .iter()
            .flat_map(|c| {
                box_convert_jobs(&c.boxed, c.elem, c.conv, c.tensor, slot + c.slot_off, "")
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Whether the step has pieces the sender converts.
    pub fn has_converts(&self) -> bool {
        !self.converts.is_empty()
    }

    /// Wire bytes of the step.
    pub fn bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.op.bytes).sum()
    }

    /// Whether the step has anything to pack or unpack.
    pub fn has_copies(&self) -> bool {
        !self.copies.is_empty()
    }

    /// The quantisations that pack this step's sender-encoded pieces (training) into a slot
    /// at device address `slot`: one job per matrix, each writing its own bytes of the slot
    /// (disjoint from every other job's and from the copies'). Empty on an inference rank.
    pub fn fp8_jobs(&self, slot: u64) -> Vec<Fp8Job> {
        self.quants
            .iter()
            .map(|q| Fp8Job {
                src: q.src,
                dst: slot + q.dst_off,
                scales: slot + q.scale_off,
                rows: q.rows,
                cols: q.cols,
                src_pitch: q.src_pitch,
                dst_pitch: q.cols,
                scale_pitch: q.scale_pitch,
            })
            .collect()
    }

    /// The destination tensor of each of [`StepIo::fp8_jobs`], in the same order.
    pub fn fp8_tensors(&self) -> impl Iterator<Item = &str> {
        self.quants.iter().map(|q| &*q.tensor)
    }

    /// Whether the step quantises anything.
    pub fn has_fp8(&self) -> bool {
        !self.quants.is_empty()
    }
}

/// A rank's whole update as device work.
#[derive(Clone, Debug)]
pub struct Program {
    /// The rank's side.
    pub side: Side,
    /// The rank.
    pub rank: RankId,
    /// The steps, in issue order.
    pub steps: Vec<StepIo>,
    /// Bytes one staging slot needs (the largest step's staging; 0 when nothing is staged).
    pub slot_bytes: u64,
    /// The FP8 encoding of the plan's sender-encoded transfers, when it has any (the
    /// training rank quantises them with [`StepIo::fp8_jobs`]).
    pub fp8: Option<Fp8Block>,
}

impl Program {
    /// Wire bytes of the whole update.
    pub fn bytes(&self) -> u64 {
        self.steps
            .iter()
            .flat_map(|s| &s.ops)
            .map(|o| o.op.bytes)
            .sum()
    }

    /// Operations whose bytes go straight from or into a tensor, and operations staged.
    pub fn direct_and_staged(&self) -> (usize, usize) {
        let ops = self.steps.iter().flat_map(|s| &s.ops);
        let direct = ops
            .clone()
            .filter(|o| matches!(o.wire, Wire::Direct(_)))
            .count();
        (direct, ops.count() - direct)
    }

    /// Lays out a rank's schedule on its device tensors.
    pub fn build(
        plan: &RankPlan,
        buckets: &[Vec<Bucket>],
        steps: &[Step],
        tensors: &DeviceTensors,
        world: &CommWorld,
    ) -> Result<Program, NcclError> {
        let side = plan.side;
        let peer_side = side.other();
        if buckets.len() != plan.peers.len() {
            return Err(NcclError::Plan(format!(
                "{side} rank {} has {} peers but {} bucket lists were given",
                plan.rank,
                plan.peers.len(),
                buckets.len()
            )));
        }
        let mut fp8: Option<Fp8Block> = None;
        for p in &plan.peers {
            for t in &p.transfers {
                check_transfer(side, t, tensors)?;
                if let Some(e) = t.encode.as_ref().filter(|_| t.sender_encoded()) {
                    match &fp8 {
                        Some(f) if *f != e.encoding => {
                            return Err(NcclError::Plan(format!(
                                "`{}` is encoded as {:?}, but another FP8 tensor of the plan as {f:?}; a pair has one FP8 encoding",
                                t.dst_tensor, e.encoding
                            )));
                        }
                        Some(_) => {}
                        None => fp8 = Some(e.encoding.clone()),
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(steps.len());
        let mut slot_bytes = 0u64;
        for step in steps {
            let mut ops = Vec::with_capacity(step.ops.len());
            let mut segs = Vec::with_capacity(step.ops.len());
            let mut copies = Vec::new();
            let mut quants = Vec::new();
            let mut transposes = Vec::new();
            let mut converts = Vec::new();
            let mut at = 0u64;
            for op in &step.ops {
                let peer = plan.peers.get(op.peer_index).filter(|p| p.peer == op.peer);
                let (Some(peer), Some(bucket)) = (
                    peer,
                    buckets.get(op.peer_index).and_then(|b| b.get(op.bucket)),
                ) else {
                    return Err(NcclError::Plan(format!(
                        "step {} names bucket {} of peer {} ({}), which the plan of {side} rank {} does not have",
                        step.index, op.bucket, op.peer_index, op.peer, plan.rank
                    )));
                };
                let peer_comm = world.comm_rank(peer_side, op.peer)?;
                let (parts, within, runs) = piece_parts(side, bucket, &peer.transfers, tensors)?;
                if within != op.bytes {
                    return Err(NcclError::Plan(format!(
                        "step {} packs {within} bytes for a bucket of {} bytes of peer {}; the plan and its buckets disagree",
                        step.index, op.bytes, op.peer
                    )));
                }
                let wire = match parts.as_slice() {
                    [Part::Copy(one)] if one.boxed.runs() == 1 => {
                        let base = match side {
                            Side::Training => one.boxed.src_base,
                            Side::Inference => one.boxed.dst_base,
                        };
                        Wire::Direct(one.tensor + base * one.elem)
                    }
                    _ => {
                        let off = at;
                        for p in parts {
                            match p {
                                Part::Copy(mut c) => {
                                    c.slot_off += off;
                                    copies.push(c);
                                }
                                Part::Quant(mut q) => {
                                    q.dst_off += off;
                                    q.scale_off += off;
                                    quants.push(q);
                                }
                                Part::Transpose(mut t) => {
                                    t.slot_off += off;
                                    transposes.push(t);
                                }
                                Part::Convert(mut c) => {
                                    c.slot_off += off;
                                    converts.push(c);
                                }
                            }
                        }
                        at = (off + within).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
                        Wire::Staged(off)
                    }
                };
                ops.push(OpIo {
                    op: *op,
                    peer_comm,
                    wire,
                });
                segs.push(runs);
            }
            slot_bytes = slot_bytes.max(at);
            out.push(StepIo {
                index: step.index,
                ops,
                staged_bytes: at,
                segs,
                copies,
                quants,
                transposes,
                converts,
            });
        }
        Ok(Program {
            side,
            rank: plan.rank,
            steps: out,
            slot_bytes,
            fp8,
        })
    }
}

/// Checks that the nccl transport can move a transfer: bytes, a conversion the training GPU
/// makes as it packs (bf16 and f16 to and from f32: [`Conversion::of`]), or FP8 that the
/// training GPU quantises: sender-encoded, whole blocks of bf16. A transfer the plan leaves
/// to the receiver to quantise (its blocks cut between training ranks, or held in another
/// dtype) is refused, naming the tensor and the fix.
pub fn check_encoding(t: &Transfer) -> Result<(), NcclError> {
    if t.receiver_encoded() {
        let why = if t.src_dtype != t.dst_dtype {
            format!(
                "the trainer holds it as {} and the plan quantises from the canonical {}",
                t.src_dtype, t.dst_dtype
            )
        } else {
            "a training shard boundary cuts its FP8 blocks, so no one sender holds them whole"
                .to_string()
        };
        return Err(NcclError::Plan(format!(
            "`{}`: the plan has the receiver quantise this box to FP8 ({why}), but the nccl transport quantises on the training GPU only, whole blocks of bf16; use a training layout whose shards hold whole blocks in bf16 (Megatron tp or FSDP at dp 1), or --transport cuda-ipc, shm or tcp",
            t.dst_tensor
        )));
    }
    if let Some(e) = t.encode.as_ref().filter(|_| t.sender_encoded()) {
        let whole = covers_whole_blocks(e.encoding.block, &t.dst_shape, &t.dst_offset, &t.extent);
        if !whole || t.dst_dtype != DType::F8E4m3 || t.extent.ndim() < 2 {
            return Err(NcclError::Plan(format!(
                "`{}`: the plan has the sender quantise a box at {} of {} that does not cover whole {}x{} blocks in {}; both ends must run the same awex planner",
                t.dst_tensor,
                t.dst_offset,
                t.extent,
                e.encoding.block[0],
                e.encoding.block[1],
                t.dst_dtype
            )));
        }
        if t.src_dtype != DType::Bf16 {
            return Err(NcclError::Plan(format!(
                "`{}`: the training GPU quantises bf16 to FP8, but the trainer holds this tensor as {}; keep it in bf16, or use --transport shm or tcp",
                t.src_tensor, t.src_dtype
            )));
        }
    } else {
        conversion(t)?;
    }
    Ok(())
}

/// Checks that a transfer's tensor on this side is registered as the plan expects, and that
/// the transfer is one the device path moves ([`check_encoding`]).
fn check_transfer(side: Side, t: &Transfer, tensors: &DeviceTensors) -> Result<(), NcclError> {
    check_encoding(t)?;
    let (name, shape, dtype) = match side {
        Side::Training => (&t.src_tensor, &t.src_shape, t.src_dtype),
        Side::Inference => (&t.dst_tensor, &t.dst_shape, t.dst_dtype),
    };
    registered(side, name, shape, dtype, tensors)?;
    if side == Side::Inference
        && let Some(sb) = t.scale_box()
    {
        registered(side, &sb.tensor, &sb.shape, DType::F32, tensors)?;
    }
    Ok(())
}

/// The registered tensor `name`, which must have `shape` and `dtype`.
fn registered<'a>(
    side: Side,
    name: &str,
    shape: &Dims,
    dtype: DType,
    tensors: &'a DeviceTensors,
) -> Result<&'a DeviceTensor, NcclError> {
    let v = tensors.get(name).ok_or_else(|| {
        NcclError::Plan(format!(
            "{side} tensor `{name}` is in the plan but not registered on the device"
        ))
    })?;
    if v.shape != *shape || v.dtype != dtype {
        return Err(NcclError::Plan(format!(
            "{side} tensor `{name}` is registered as {} {} but the plan expects {} {}",
            v.dtype, v.shape, dtype, shape
        )));
    }
    Ok(v)
}

/// Element offset of `idx` in a row-major tensor of `shape`.
fn linear(shape: &Dims, idx: &Dims) -> u64 {
    (0..shape.ndim()).fold(0, |at, i| at * shape.get(i) + idx.get(i))
}

/// The parts that move a bucket's pieces between their tensors and a packed buffer, packed
/// order, with offsets from the buffer's start, the bucket's packed bytes and its runs of
/// elements ([`OpSeg`]).
fn piece_parts(
    side: Side,
    bucket: &Bucket,
    transfers: &[Transfer],
    tensors: &DeviceTensors,
) -> Result<(Vec<Part>, u64, Vec<OpSeg>), NcclError> {
    let mut out = Vec::with_capacity(bucket.pieces.len());
    let mut runs = Vec::with_capacity(bucket.pieces.len());
    let mut within = 0u64;
    for p in &bucket.pieces {
        let t = transfers.get(p.transfer as usize).ok_or_else(|| {
            NcclError::Plan(format!(
                "a bucket names transfer {} of a peer plan with {}",
                p.transfer,
                transfers.len()
            ))
        })?;
        if t.transposed && t.sender_encoded() {
            return Err(NcclError::Plan(format!(
                "`{}` is quantised to FP8 on the sender and stored transposed by the engine; the nccl transport does not quantise transposed boxes: use shm or tcp",
                t.dst_tensor
            )));
        }
        let (so, d, e) = piece_box(t, p);
        let zeros = Dims::zeros(e.ndim());
        let geometry = |e: awex_core::layout::copy::CopyError| {
            NcclError::Plan(format!("`{}`: {e}", t.dst_tensor))
        };
        let tensor = |name: &str| {
            tensors
                .get(name)
                .ok_or_else(|| NcclError::Plan(format!("{side} tensor `{name}` is not registered")))
        };
        if t.sender_encoded() {
            let Some((soff, sext)) = piece_scale_box(t, p) else {
                return Err(NcclError::Plan(format!(
                    "`{}` is sender-encoded without a scale box",
                    t.dst_tensor
                )));
            };
            let n = e.numel();
            let scale_at = within + n;
            match side {
                Side::Training => {
                    let src = tensor(&t.src_tensor)?;
                    out.extend(
                        quant_parts(t, src.ptr, &so, &e, &sext, within, scale_at)?
                            .into_iter()
                            .map(Part::Quant),
                    );
                }
                Side::Inference => {
                    let q = tensor(&t.dst_tensor)?;
                    let sb = t.scale_box().expect("a sender-encoded transfer has scales");
                    let s = tensor(&sb.tensor)?;
                    out.push(Part::Copy(PieceCopy {
                        boxed: StridedBox::new(&e, &zeros, &t.dst_shape, &d, &e)
                            .map_err(geometry)?,
                        elem: 1,
                        tensor: q.ptr,
                        slot_off: within,
                    }));
                    out.push(Part::Copy(PieceCopy {
                        boxed: StridedBox::new(
                            &sext,
                            &Dims::zeros(sext.ndim()),
                            &sb.shape,
                            &soff,
                            &sext,
                        )
                        .map_err(geometry)?,
                        elem: SCALE_BYTES,
                        tensor: s.ptr,
                        slot_off: scale_at,
                    }));
                }
            }
            runs.push(OpSeg {
                at: within,
                n,
                elem: 1,
            });
            runs.push(OpSeg {
                at: scale_at,
                n: sext.numel(),
                elem: SCALE_BYTES as u32,
            });
            within = scale_at + sext.numel() * SCALE_BYTES;
            continue;
        }
        if t.transposed && side == Side::Inference {
            // the box lands with its last two dims swapped; the slot holds it as packed
            let boxed = StridedBox::new_transposed(&e, &zeros, &t.dst_shape, &d, &e, t.transpose())
                .map_err(geometry)?;
            let elem = t.dst_dtype.size() as u64;
            let dst = tensor(&t.dst_tensor)?.ptr;
            // every job's fields checked here, once; a box with no two dims to swap (one row
            // or one column) is an ordinary pitched copy
            match box_jobs(&boxed, elem, within, dst, &t.dst_tensor)? {
                Some(_) => out.push(Part::Transpose(PieceTranspose {
                    boxed,
                    elem,
                    tensor: dst,
                    slot_off: within,
                })),
                None => out.push(Part::Copy(PieceCopy {
                    boxed,
                    elem,
                    tensor: dst,
                    slot_off: within,
                })),
            }
            runs.push(OpSeg {
                at: within,
                n: e.numel(),
                elem: elem as u32,
            });
            within += e.numel() * elem;
            continue;
        }
        if side == Side::Training && t.converts() {
            let conv = conversion(t)?;
            let boxed = StridedBox::new(&t.src_shape, &so, &e, &zeros, &e).map_err(geometry)?;
            let (ses, des) = (t.src_dtype.size() as u64, t.dst_dtype.size() as u64);
            // every job's fields checked here, once
            let src = tensor(&t.src_tensor)?.ptr;
            box_convert_jobs(&boxed, ses, conv, src, within, &t.dst_tensor)?;
            runs.push(OpSeg {
                at: within,
                n: e.numel(),
                elem: des as u32,
            });
            out.push(Part::Convert(PieceConvert {
                boxed,
                elem: ses,
                conv,
                tensor: src,
                slot_off: within,
            }));
            within += e.numel() * des;
            continue;
        }
        let (name, boxed) = match side {
            Side::Training => (
                &t.src_tensor,
                StridedBox::new(&t.src_shape, &so, &e, &zeros, &e).map_err(geometry)?,
            ),
            Side::Inference => (
                &t.dst_tensor,
                StridedBox::new(&e, &zeros, &t.dst_shape, &d, &e).map_err(geometry)?,
            ),
        };
        let elem = t.dst_dtype.size() as u64;
        let c = PieceCopy {
            boxed,
            elem,
            tensor: tensor(name)?.ptr,
            slot_off: within,
        };
        runs.push(OpSeg {
            at: within,
            n: c.boxed.numel(),
            elem: elem as u32,
        });
        within += c.boxed.numel() * elem;
        out.push(Part::Copy(c));
    }
    Ok((out, within, runs))
}

/// The quantisations of one sender-encoded piece: its box `e` at `so` of the source tensor
/// (bf16 at `src`), one job per matrix (row-major over the box's leading dims), writing its
/// e4m3 bytes at `at` (row-major over `e`) and its scales at `scale_at` (row-major over the
/// scale box `sext`), as the tcp transport's bucket holds them.
fn quant_parts(
    t: &Transfer,
    src: u64,
    so: &Dims,
    e: &Dims,
    sext: &Dims,
    at: u64,
    scale_at: u64,
) -> Result<Vec<PieceQuant>, NcclError> {
    let k = e.ndim();
    let (rows, cols) = (e.get(k - 2), e.get(k - 1));
    let (srows, scols) = (sext.get(k - 2), sext.get(k - 1));
    let mats = e.as_slice()[..k - 2].iter().product::<u64>();
    let src_cols = t.src_shape.get(t.src_shape.ndim() - 1);
    let big = |what: &str, v: u64| {
        u32::try_from(v).map_err(|_| {
            NcclError::Plan(format!(
                "`{}`: {what} {v} exceeds what one FP8 kernel job takes (2^32 - 1)",
                t.dst_tensor
            ))
        })
    };
    if scale_at % SCALE_BYTES != 0 {
        return Err(NcclError::Plan(format!(
            "`{}`: this bucket's bytes before the piece's FP8 scales ({scale_at}) are not a multiple of 4, so the training GPU cannot write the fp32 scales in place; use --transport shm or tcp for this pair",
            t.dst_tensor
        )));
    }
    let (rows32, cols32) = (big("rows", rows)?, big("columns", cols)?);
    let (src_pitch, scale_pitch) = (
        big("source pitch", 2 * src_cols)?,
        big("scale columns", scols)?,
    );
    let mut out = Vec::with_capacity(mats as usize);
    let ns = t.src_shape.ndim();
    for m in 0..mats {
        // the matrix `m` of the box: its leading-dims index added to the piece's offset
        let mut o = *so;
        let mut r = m;
        for i in (0..k - 2).rev() {
            let dim = e.get(i);
            o.set(ns - k + i, o.get(ns - k + i) + r % dim);
            r /= dim;
        }
        out.push(PieceQuant {
            src: src + 2 * linear(&t.src_shape, &o),
            dst_off: at + m * rows * cols,
            scale_off: scale_at + m * srows * scols * SCALE_BYTES,
            rows: rows32,
            cols: cols32,
            src_pitch,
            scale_pitch,
            tensor: t.dst_tensor.clone(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use awex_core::encoding::{Fp8Quantiser, Recipe, Shape2d};
    use awex_core::plan::bucket::Piece;
    use awex_core::plan::{Encode, EncodeAt};

    /// A sender-encoded transfer of `extent` at `src_offset` of a bf16 tensor of `src_shape`
    /// into the whole e4m3 tensor of that extent, 16 x 16 blocks.
    fn encoded(src_shape: &[u64], src_offset: &[u64], extent: &[u64]) -> Transfer {
        let enc = Fp8Block {
            block: [16, 16],
            ..Fp8Block::default()
        };
        Transfer {
            src_rank: RankId::train(0),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: Arc::from("s"),
            src_shape: Dims::new(src_shape),
            src_offset: Dims::new(src_offset),
            src_dtype: DType::Bf16,
            dst_tensor: Arc::from("d"),
            dst_shape: Dims::new(extent),
            dst_offset: Dims::zeros(extent.len()),
            dst_dtype: DType::F8E4m3,
            extent: Dims::new(extent),
            encode: Some(Encode {
                encoding: enc,
                at: EncodeAt::Sender,
            }),
            transposed: false,
        }
    }

    #[test]
    fn a_stacked_box_is_one_job_per_matrix_writing_e4m3_then_scales_as_the_bucket_holds_them() {
        // experts 1..3 (of 4), rows 16..56 (40: 2.5 row blocks, the edge of the destination)
        // and columns 8..56 (48) of a [4, 64, 64] bf16 stack, into a [2, 40, 48] e4m3 stack
        let t = encoded(&[4, 64, 64], &[1, 16, 8], &[2, 40, 48]);
        assert!(check_encoding(&t).is_ok());
        let p = Piece {
            transfer: 0,
            row0: 0,
            rows: 2,
        };
        let (so, _, e) = piece_box(&t, &p);
        let (_, sext) = piece_scale_box(&t, &p).unwrap();
        assert_eq!(sext, Dims::new(&[2, 3, 3]));
        let bf16 = |x: f32| (x.to_bits() >> 16) as u16;
        let src: Vec<u16> = (0..4 * 64 * 64)
            .map(|i| bf16(((i * 53 % 211) as f32 - 105.0) * 0.013))
            .collect();
        let n = e.numel();
        let wire = n + sext.numel() * SCALE_BYTES;
        // after 12 bytes of an earlier piece: the scales start 4-aligned (12 + 3840)
        let at = 12;
        let jobs = quant_parts(&t, src.as_ptr() as u64, &so, &e, &sext, at, at + n).unwrap();
        assert_eq!(jobs.len(), 2);
        let q = Fp8Quantiser::new(Recipe::Vllm, t.encode.as_ref().unwrap().encoding.clone());
        let mut slot = vec![0u32; ((at + wire) / 4) as usize];
        let base = slot.as_mut_ptr() as u64;
        for j in &jobs {
            // what the kernel does, with the CPU reference, at the job's addresses
            let (rows, cols) = (j.rows as usize, j.cols as usize);
            let sp = j.src_pitch as usize / 2;
            let off = (j.src - src.as_ptr() as u64) as usize / 2;
            // SAFETY: the job's e4m3 rows and scale rows lie inside `slot` (asserted below
            // by the bytes landing where the bucket expects them).
            let (qb, sb) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        (base + j.dst_off) as *mut u8,
                        (rows - 1) * cols + cols,
                    ),
                    std::slice::from_raw_parts_mut((base + j.scale_off) as *mut f32, 9),
                )
            };
            let shape = Shape2d {
                rows,
                cols,
                pitch: sp,
            };
            q.quantise(&src[off..], shape, qb, cols, sb, j.scale_pitch as usize)
                .unwrap();
        }
        // the bucket: expert 1's e4m3 then expert 2's, then expert 1's 3 x 3 scales, then 2's
        let mut want = vec![0u8; wire as usize];
        let (wq, ws) = want.split_at_mut(n as usize);
        for m in 0..2usize {
            let mut scales = [0f32; 9];
            let s0 = (1 + m) * 64 * 64 + 16 * 64 + 8;
            q.quantise(
                &src[s0..],
                Shape2d {
                    rows: 40,
                    cols: 48,
                    pitch: 64,
                },
                &mut wq[m * 40 * 48..(m + 1) * 40 * 48],
                48,
                &mut scales,
                3,
            )
            .unwrap();
            for (i, s) in scales.iter().enumerate() {
                ws[(m * 9 + i) * 4..(m * 9 + i + 1) * 4].copy_from_slice(&s.to_le_bytes());
            }
        }
        // SAFETY: `slot` holds `at + wire` bytes.
        let got = unsafe { std::slice::from_raw_parts((base + at) as *const u8, wire as usize) };
        assert!(got == &want[..], "the jobs' bytes are not the bucket's");
        // scales that would start off a 4-byte boundary are refused, naming the tensor
        let e = quant_parts(&t, src.as_ptr() as u64, &so, &e, &sext, 2, 2 + n)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("`d`: this bucket's bytes before"), "{e}");
    }

    #[test]
    fn a_sender_encoded_box_that_cuts_a_block_or_reads_f32_is_refused() {
        let mut t = encoded(&[64, 64], &[0, 0], &[32, 48]);
        check_encoding(&t).unwrap();
        t.dst_shape = Dims::new(&[40, 48]);
        t.dst_offset = Dims::new(&[8, 0]);
        let e = check_encoding(&t).unwrap_err().to_string();
        assert!(e.contains("does not cover whole 16x16 blocks"), "{e}");
        let mut t = encoded(&[64, 64], &[0, 0], &[32, 48]);
        t.src_dtype = DType::F32;
        let e = check_encoding(&t).unwrap_err().to_string();
        assert!(
            e.contains("the trainer holds this tensor as f32; keep it in bf16"),
            "{e}"
        );
    }
}
