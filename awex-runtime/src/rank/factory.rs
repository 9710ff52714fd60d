//! The one place a rank's transport is built ([`make_transport`]): the transport its
//! [`RankConfig`](super::RankConfig) names, with that transport's typed config.

use super::{Prepared, RankConfig};
use crate::RuntimeError;
use crate::tensors::TensorSet;
use crate::transport::{
    CudaIpcTransport, EncodingTransport, ShmTransport, StagedTransport, TcpTransport, Transport,
    fp8_tensors,
};
use awex_control::wire::ApplyMode;
use awex_core::layout::Side;
use std::sync::Arc;

/// Builds the transport of a rank over its live `tensors`. An inference rank of an atomic pair
/// (`cfg.apply`) gets a [`StagedTransport`]: the transport moves bytes into a staging copy of
/// its tensors (same kind of memory), which is copied into `tensors` only on the gateway's
/// `apply` event.
pub fn make_transport(
    cfg: &RankConfig,
    prepared: &Prepared,
    tensors: Arc<TensorSet>,
) -> Result<Box<dyn Transport>, RuntimeError> {
    if cfg.apply == ApplyMode::Atomic && cfg.side == Side::Inference {
        let staging = Arc::new(tensors.staging_like()?);
        let inner = encoding_over(cfg, prepared, staging.clone())?;
        return Ok(Box::new(StagedTransport::new(inner, staging, tensors)));
    }
    encoding_over(cfg, prepared, tensors)
}

/// The transport over `tensors`; an inference rank holding FP8 tensors gets an
/// [`EncodingTransport`] around it (bf16 staging, quantised after the transfers: on the CPU for
/// shm and tcp, on the GPU for cuda-ipc). nccl quantises on the training GPU as it packs: its
/// inference ranks write the e4m3 bytes and scales straight into the engine's tensors (a plan
/// that leaves blocks to the receiver is refused by [`super::prepare`], naming the tensor).
fn encoding_over(
    cfg: &RankConfig,
    prepared: &Prepared,
    tensors: Arc<TensorSet>,
) -> Result<Box<dyn Transport>, RuntimeError> {
    let encodes = prepared
        .plan
        .peers
        .iter()
        .any(|p| p.transfers.iter().any(|t| t.encode.is_some()));
    let fp8 = !fp8_tensors(&prepared.layout).is_empty();
    if !(encodes || fp8) {
        return transport_over(cfg, prepared, tensors);
    }
    // an encoding the GPU kernel cannot write refuses the pair on both sides (no host fallback)
    if cfg.transport.on_gpu()
        && let Some(f) = &cfg.infer_fp8
    {
        crate::transport::refuse_on_gpu_over(cfg.transport, f)?;
    }
    if cfg.transport == awex_core::Transport::Nccl {
        // every FP8 block quantised by its sender (`prepare` refused anything else): the
        // inference rank writes e4m3 and scales straight into the engine's tensors
        return transport_over(cfg, prepared, tensors);
    }
    if cfg.side == Side::Training || !fp8 {
        return transport_over(cfg, prepared, tensors);
    }
    let Some(f) = &cfg.infer_fp8 else {
        return Err(RuntimeError::Fp8(
            "this rank's layout has FP8 tensors but it was configured without the inference side's FP8 config".into(),
        ));
    };
    let (layout, cat, plan) = (&prepared.layout, &prepared.catalogue, &prepared.plan);
    let inner = |over| transport_over(cfg, prepared, over);
    Ok(Box::new(if cfg.transport.on_gpu() {
        let fuse = cfg.transports.cuda_ipc.fuse_fp8;
        EncodingTransport::on_gpu(layout, cat, plan, f, tensors, fuse, inner)?
    } else {
        EncodingTransport::new(layout, cat, plan, f, tensors, inner)?
    }))
}

pub(super) fn transport_over(
    cfg: &RankConfig,
    prepared: &Prepared,
    tensors: Arc<TensorSet>,
) -> Result<Box<dyn Transport>, RuntimeError> {
    // `awex-{pair}-{uid}-{rank}-ctl`: exact names, liveness by lock (see `crate::shm`)
    let ctl = cfg.shm_scope().name(
        &crate::host::rank_tag(&cfg.side.short()[..1], cfg.rank),
        "ctl",
    );
    if cfg.transport.uses_shm_segments() {
        // the segments of ranks killed earlier on this host (the next connect reclaims them)
        crate::shm::gc(None);
    }
    match cfg.transport {
        awex_core::Transport::Shm => {
            let mut t = ShmTransport::new(prepared.plan.clone(), tensors, cfg.bucket_bytes, &ctl)?;
            t.set_fp8(cfg.infer_fp8.as_ref().map(|f| f.quantiser()));
            Ok(Box::new(t))
        }
        awex_core::Transport::Tcp => {
            let bind = cfg
                .transports
                .tcp
                .bind
                .clone()
                .unwrap_or_else(|| format!("{}:0", cfg.host));
            let mut t = TcpTransport::new(
                prepared.plan.clone(),
                tensors,
                cfg.bucket_bytes,
                &bind,
                &cfg.host,
            )?;
            t.set_fp8(cfg.infer_fp8.as_ref().map(|f| f.quantiser()));
            t.set_delta_threads(cfg.transports.tcp.delta_threads);
            Ok(Box::new(t))
        }
        awex_core::Transport::CudaIpc => Ok(Box::new(CudaIpcTransport::new(
            prepared.plan.clone(),
            tensors,
            cfg.bucket_bytes,
            &ctl,
            &cfg.transports.cuda_ipc,
        )?)),
        awex_core::Transport::Nccl => nccl_transport(cfg, prepared, tensors),
    }
}

/// The `nccl` transport of a rank over its device tensors: one communicator for the whole
/// pair. Training rank 0 creates the communicator's unique id here and publishes it, sealed
/// with the pair secret, right after it joined ([`Transport::kv_at_join`]); every other rank
/// reads and verifies it once all ranks have joined, so no rank waits on one that waits on it.
pub(super) fn nccl_transport(
    cfg: &RankConfig,
    prepared: &Prepared,
    tensors: Arc<TensorSet>,
) -> Result<Box<dyn Transport>, RuntimeError> {
    use crate::transport::{NcclConfig, NcclTransport};
    use awex_gpu::nccl::{CommWorld, Library, NcclError, creates_uid};
    if !awex_gpu::cuda::BUILT {
        return Err(RuntimeError::Nccl(NcclError::NeedsCuda));
    }
    let world = CommWorld::of(&*prepared.pair.training, &*prepared.pair.inference)?;
    let lib = Arc::new(Library::load(cfg.transports.nccl_library.as_deref())?);
    let uid = if creates_uid(cfg.side, cfg.rank) {
        Some(lib.unique_id()?)
    } else {
        None
    };
    // the GPU of the registered tensors (for_rank checks they all share it)
    let device = match tensors.location() {
        Ok(crate::Location::Cuda(d)) => d,
        _ => 0,
    };
    let mut nc = NcclConfig::new(device, world);
    nc.bucket_bytes = cfg.bucket_bytes;
    nc.deltas = cfg.deltas;
    let mut t = NcclTransport::for_rank(lib, nc, prepared.plan.clone(), tensors, uid)?;
    t.set_fp8(cfg.infer_fp8.as_ref().map(|f| f.quantiser()));
    Ok(Box::new(t))
}
