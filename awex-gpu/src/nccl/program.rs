//! A rank's update as device work: for every step, where each bucket's bytes sit and which
//! 2-D copies pack (training) or unpack (inference) them.
//!
//! A bucket that is one piece lying contiguously in the local tensor goes over the wire
//! straight from (or into) the tensor. Any other bucket is packed into a staging slot before
//! the send, or received into one and unpacked after, with pitched copies built from the
//! piece boxes ([`push_box`]). Two slots alternate between steps, so a rank holds at most two
//! steps of staging. Everything here is geometry on addresses: it is tested on host memory.

use super::NcclError;
use super::ranks::CommWorld;
use super::schedule::{Op, Step};
use crate::cuda::CopyDesc;
use crate::cuda::desc::push_box;
use awex_core::dtype::DType;
use awex_core::layout::copy::StridedBox;
use awex_core::layout::{Dims, RankId, Side};
use awex_core::plan::bucket::{Bucket, piece_box};
use awex_core::plan::{RankPlan, Transfer};
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

/// One piece's copy between its tensor and a slot.
#[derive(Clone, Copy, Debug)]
struct PieceCopy {
    boxed: StridedBox,
    elem: u64,
    tensor: u64,
    slot_off: u64,
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
    copies: Vec<PieceCopy>,
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

    /// Wire bytes of the step.
    pub fn bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.op.bytes).sum()
    }

    /// Whether the step has anything to pack or unpack.
    pub fn has_copies(&self) -> bool {
        !self.copies.is_empty()
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
        for p in &plan.peers {
            for t in &p.transfers {
                check_transfer(side, t, tensors)?;
            }
        }
        let mut out = Vec::with_capacity(steps.len());
        let mut slot_bytes = 0u64;
        for step in steps {
            let mut ops = Vec::with_capacity(step.ops.len());
            let mut copies = Vec::new();
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
                let pieces = piece_copies(side, bucket, &peer.transfers, tensors)?;
                let wire = match pieces.as_slice() {
                    [one] if one.boxed.runs() == 1 => {
                        let base = match side {
                            Side::Training => one.boxed.src_base,
                            Side::Inference => one.boxed.dst_base,
                        };
                        Wire::Direct(one.tensor + base * one.elem)
                    }
                    _ => {
                        let off = at;
                        let mut within = 0u64;
                        for mut c in pieces {
                            c.slot_off = off + within;
                            within += c.boxed.numel() * c.elem;
                            copies.push(c);
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
            }
            slot_bytes = slot_bytes.max(at);
            out.push(StepIo {
                index: step.index,
                ops,
                staged_bytes: at,
                copies,
            });
        }
        Ok(Program {
            side,
            rank: plan.rank,
            steps: out,
            slot_bytes,
        })
    }
}

/// Checks that a transfer's tensor on this side is registered as the plan expects, and that
/// the transfer moves bytes only (the device path does not convert dtypes).
fn check_transfer(side: Side, t: &Transfer, tensors: &DeviceTensors) -> Result<(), NcclError> {
    if t.converts() {
        return Err(crate::cuda::CudaError::Conversion {
            tensor: t.dst_tensor.to_string(),
            src: t.src_dtype,
            dst: t.dst_dtype,
        }
        .into());
    }
    let (name, shape, dtype) = match side {
        Side::Training => (&t.src_tensor, &t.src_shape, t.src_dtype),
        Side::Inference => (&t.dst_tensor, &t.dst_shape, t.dst_dtype),
    };
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
    Ok(())
}

/// The copies of a bucket's pieces between their tensors and a packed buffer, packed order.
fn piece_copies(
    side: Side,
    bucket: &Bucket,
    transfers: &[Transfer],
    tensors: &DeviceTensors,
) -> Result<Vec<PieceCopy>, NcclError> {
    let mut out = Vec::with_capacity(bucket.pieces.len());
    for p in &bucket.pieces {
        let t = transfers.get(p.transfer as usize).ok_or_else(|| {
            NcclError::Plan(format!(
                "a bucket names transfer {} of a peer plan with {}",
                p.transfer,
                transfers.len()
            ))
        })?;
        if t.transposed {
            return Err(NcclError::Plan(format!(
                "`{}` receives its box transposed (the engine stores it with its last two dims swapped); the nccl transport does not move transposed boxes yet: use shm or tcp",
                t.dst_tensor
            )));
        }
        let (so, d, e) = piece_box(t, p);
        let zeros = Dims::zeros(e.ndim());
        let geometry = |e: awex_core::layout::copy::CopyError| {
            NcclError::Plan(format!("`{}`: {e}", t.dst_tensor))
        };
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
        let tensor = tensors
            .get(name)
            .ok_or_else(|| NcclError::Plan(format!("{side} tensor `{name}` is not registered")))?;
        out.push(PieceCopy {
            boxed,
            elem: t.dst_dtype.size() as u64,
            tensor: tensor.ptr,
            slot_off: 0,
        });
    }
    Ok(out)
}
