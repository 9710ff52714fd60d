//! FP8 inference ranks (receiver-encoded blocks): a transport that receives every transfer
//! into an FP8 tensor as the canonical dtype (bf16) into a staging tensor of the engine
//! tensor's shape, and, once all of an update's transfers landed (and their checksums were
//! verified), quantises each staging tensor with the pair's recipe into the engine's e4m3
//! tensor and its scale tensor ([`Fp8Block::scale_name`]).
//!
//! A quantisation that fails (infinity or NaN in the weights) fails the update, naming the
//! tensor and the element: the rank reports the error, so the version is never committed (an
//! atomic pair's live tensors are not touched: this transport runs inside the staging one).
//! Checksums cover the bf16 bytes on the wire, on both ends, before they are quantised.
//!
//! Two quantisers: the CPU one ([`EncodingTransport::new`], shm and tcp: host staging,
//! `Fp8Quantiser` on up to 8 threads) and the GPU one ([`EncodingTransport::on_gpu`], cuda-ipc:
//! device staging allocated once per pair, then `awex_gpu::cuda::Fp8Kernel` launched once per
//! matrix on one stream after the inner transport's copies were synchronised, and one wait for
//! its status word). The GPU kernel reads a pitched source, so the seam for fusing the
//! quantiser into the copy (reading a block straight out of the trainer's memory where one
//! sender holds it whole) is the [`Job`]'s source address; it is the staging for now.

use crate::transport::cuda_ipc_fusable as fusable;
use crate::transport::{ExecContext, ExecStats, Fp8Target, FusedFp8, PairSecret, Transport};
use crate::{RuntimeError, TensorSet, TensorView};
use awex_core::dtype::DType;
use awex_core::encoding::{Encoding, Fp8Block, Fp8Quantiser, InferFp8, QuantiseError, Shape2d};
use awex_core::layout::{LocalTensor, RankId, RankLayout};
use awex_core::model::Catalogue;
use awex_core::plan::RankPlan;
use awex_gpu::cuda::{CudaError, Fp8Batch, Fp8Job, Fp8Kernel, GPU_BLOCK, Stream, gpu_mode};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// One FP8 tensor of the rank: its staging and what the quantiser writes.
struct Job {
    /// the engine tensor (e4m3)
    name: Arc<str>,
    /// its scale tensor
    scales: Arc<str>,
    /// matrices in the tensor (the product of its leading dims)
    mats: usize,
    rows: usize,
    cols: usize,
    /// the staging dtype (the canonical dtype: bf16 or f32)
    dtype: DType,
    /// the blocks to quantise, when not all of them: `(matrix, block rows, block columns)`
    /// ranges touched by receiver-encoded transfers (the others arrive sender-encoded, straight
    /// into the target, and must not be overwritten from the staging). `None`: every block.
    only: Option<Vec<BlockRect>>,
}

/// A rectangle of blocks of one FP8 tensor: matrices `[m0, m1)`, block rows `[r0, r1)`, block
/// columns `[c0, c1)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct BlockRect {
    m0: u64,
    m1: u64,
    r0: u64,
    r1: u64,
    c0: u64,
    c1: u64,
}

/// The blocks a receiver-encoded transfer touches in its FP8 destination of `shape` (`[.., R,
/// C]`) in `block` blocks.
fn touched_blocks(t: &awex_core::plan::Transfer, block: [u32; 2]) -> BlockRect {
    let (shape, off, ext) = (&t.dst_shape, &t.dst_offset, &t.extent);
    let (n, k) = (shape.ndim(), ext.ndim());
    let [bn, bk] = block.map(u64::from);
    // the matrices: the leading dims of the box (stacked), as a flat range
    let mut m0 = 0u64;
    let mut m1 = 0u64;
    for i in 0..n - 2 {
        let len = if i >= n - k { ext.get(i - (n - k)) } else { 1 };
        m0 = m0 * shape.get(i) + off.get(i);
        m1 = m1 * shape.get(i) + off.get(i) + len - 1;
    }
    let (r, c) = (off.get(n - 2), off.get(n - 1));
    let (re, ce) = (ext.get(k - 2), ext.get(k - 1));
    BlockRect {
        m0,
        m1: m1 + 1,
        r0: r / bn,
        r1: (r + re).div_ceil(bn),
        c0: c / bk,
        c1: (c + ce).div_ceil(bk),
    }
}

/// Why an FP8 rank could not be set up, or an update not quantised.
fn fp8_error(message: String) -> RuntimeError {
    RuntimeError::Fp8(message)
}

/// A transport over staging tensors for the FP8 tensors and the target tensors for the rest;
/// [`Transport::execute`] quantises the staging into the target after the transfers.
pub struct EncodingTransport {
    inner: Box<dyn Transport>,
    staging: Arc<TensorSet>,
    target: Arc<TensorSet>,
    jobs: Vec<Job>,
    quantiser: Fp8Quantiser,
    /// the GPU quantiser (cuda-ipc), or `None` for the CPU one
    gpu: Option<GpuQuantiser>,
    /// FP8 tensors the cuda-ipc transport quantises out of the senders' memory (no staging)
    fused: usize,
}

/// The GPU quantiser of a cuda-ipc inference rank: the kernel, its stream, and the launches
/// of each FP8 tensor (built once: the staging and the target live as long as the transport).
struct GpuQuantiser {
    kernel: Fp8Kernel,
    stream: Stream,
    /// every matrix of every staging tensor, one launch
    batch: Fp8Batch,
    /// the tensor of each job of the batch
    names: Vec<Arc<str>>,
}

/// Refuses an FP8 encoding the GPU kernel cannot write (cuda-ipc quantises on the GPU only:
/// there is no fallback to the host), naming what and the fix.
pub fn refuse_on_gpu(fp8: &InferFp8) -> Result<(), RuntimeError> {
    refuse_on_gpu_over(awex_core::Transport::CudaIpc, fp8)
}

/// [`refuse_on_gpu`] for a GPU transport: cuda-ipc quantises on the inference GPU, nccl on
/// the training GPU, both with the same kernel and no host fallback.
pub fn refuse_on_gpu_over(
    transport: awex_core::Transport,
    fp8: &InferFp8,
) -> Result<(), RuntimeError> {
    let gpu = match transport {
        awex_core::Transport::Nccl => "the training GPU",
        _ => "the GPU",
    };
    let say = |why: String| {
        fp8_error(format!(
            "the {transport} transport quantises FP8 on {gpu}, and the GPU kernel cannot write this encoding ({}): {why}; use --transport shm or tcp, which quantise on the CPU",
            fp8.describe()
        ))
    };
    if fp8.encoding().block != GPU_BLOCK {
        return Err(say(format!(
            "it quantises {}x{} blocks only, not {}x{}",
            GPU_BLOCK[0],
            GPU_BLOCK[1],
            fp8.encoding().block[0],
            fp8.encoding().block[1]
        )));
    }
    if let Err(e) = gpu_mode(fp8.recipe) {
        let why = match e {
            CudaError::Fp8(m) => m,
            e => e.to_string(),
        };
        return Err(say(why));
    }
    Ok(())
}

/// The FP8 (e4m3) tensors of a layout.
pub fn fp8_tensors(layout: &RankLayout) -> Vec<&LocalTensor> {
    layout
        .tensors
        .iter()
        .filter(|t| matches!(t.encoding, Encoding::Fp8Block(_)))
        .collect()
}

impl EncodingTransport {
    /// Builds the staging of every FP8 tensor of `layout` (host memory, the canonical dtype of
    /// its placements) and `inner` over a set that holds the staging in place of the FP8
    /// tensors and `target`'s own tensors for the rest. `target` is where e4m3 bytes and
    /// scales are written (the live tensors, or an atomic pair's staging copy of them).
    pub fn new(
        layout: &RankLayout,
        catalogue: &Catalogue,
        plan: &RankPlan,
        fp8: &InferFp8,
        target: Arc<TensorSet>,
        inner: impl FnOnce(Arc<TensorSet>) -> Result<Box<dyn Transport>, RuntimeError>,
    ) -> Result<EncodingTransport, RuntimeError> {
        target.require_host("quantising FP8 tensors on the CPU (shm, tcp)")?;
        Self::build(layout, catalogue, plan, fp8, target, inner, None)
    }

    /// As [`EncodingTransport::new`] for tensors on a GPU (cuda-ipc): the staging is device
    /// memory on `target`'s GPU (bf16 only), and the GPU kernel quantises it after the inner
    /// transport's copies. An encoding the kernel cannot write is refused ([`refuse_on_gpu`]).
    ///
    /// With `fuse`, an FP8 tensor every planned transfer into which covers whole blocks
    /// ([`crate::transport::cuda_ipc_fusable`]) gets no staging: `inner` must then be the
    /// cuda-ipc transport, whose receive quantises those blocks straight out of the training
    /// ranks' memory ([`CudaIpcTransport::fuse_fp8`](crate::transport::CudaIpcTransport::fuse_fp8)).
    pub fn on_gpu(
        layout: &RankLayout,
        catalogue: &Catalogue,
        plan: &RankPlan,
        fp8: &InferFp8,
        target: Arc<TensorSet>,
        fuse: bool,
        inner: impl FnOnce(Arc<TensorSet>) -> Result<Box<dyn Transport>, RuntimeError>,
    ) -> Result<EncodingTransport, RuntimeError> {
        refuse_on_gpu(fp8)?;
        Self::build(layout, catalogue, plan, fp8, target, inner, Some(fuse))
    }

    /// How many FP8 tensors of this rank are quantised out of the senders' memory, and how
    /// many through the staging.
    pub fn fused_and_staged(&self) -> (usize, usize) {
        (self.fused, self.jobs.len())
    }

    fn build(
        layout: &RankLayout,
        catalogue: &Catalogue,
        plan: &RankPlan,
        fp8: &InferFp8,
        target: Arc<TensorSet>,
        inner: impl FnOnce(Arc<TensorSet>) -> Result<Box<dyn Transport>, RuntimeError>,
        gpu_fuse: Option<bool>,
    ) -> Result<EncodingTransport, RuntimeError> {
        let on_gpu = gpu_fuse.is_some();
        let mut jobs = Vec::new();
        let mut staging_tensors = Vec::new();
        // the FP8 tensors every transfer into which covers whole blocks (cuda-ipc fuses them)
        let fused: std::collections::HashSet<&str> = if gpu_fuse == Some(true) {
            let mut into: HashMap<&str, bool> = HashMap::new();
            for t in plan.peers.iter().flat_map(|p| &p.transfers) {
                *into.entry(&*t.dst_tensor).or_insert(true) &= fusable(t, fp8.encoding());
            }
            into.into_iter()
                .filter(|&(_, ok)| ok)
                .map(|(n, _)| n)
                .collect()
        } else {
            Default::default()
        };
        let mut targets = HashMap::new();
        for t in fp8_tensors(layout) {
            let Encoding::Fp8Block(b) = &t.encoding else {
                continue;
            };
            if b != fp8.encoding() {
                return Err(fp8_error(format!(
                    "`{}` is encoded as {b:?} but the pair's FP8 encoding is {:?}",
                    t.name,
                    fp8.encoding()
                )));
            }
            let dtype = t
                .placements
                .first()
                .and_then(|p| catalogue.get(&p.canonical))
                .map(|c| c.dtype)
                .unwrap_or(DType::Bf16);
            if on_gpu && dtype != DType::Bf16 {
                return Err(fp8_error(format!(
                    "`{}` arrives as {dtype}, but the GPU FP8 kernel (cuda-ipc) quantises bf16 only; train in bf16 or use --transport shm or tcp",
                    t.name
                )));
            }
            let s = t.shape.as_slice();
            let nd = s.len();
            if nd < 2 {
                return Err(fp8_error(format!(
                    "`{}` has shape {s:?}; an FP8 tensor is a matrix or a stack of them",
                    t.name
                )));
            }
            let scales = Fp8Block::scale_name(&t.name);
            let sv = target.get(&scales).ok_or_else(|| {
                fp8_error(format!(
                    "FP8 tensor `{}` has no scale tensor `{scales}` registered; register the engine's weight_scale_inv next to its weight",
                    t.name
                ))
            })?;
            let mats: u64 = s[..nd - 2].iter().product();
            let (rows, cols) = (s[nd - 2], s[nd - 1]);
            let [sr, sc] = b.scale_shape(rows, cols);
            if sv.dtype != DType::F32 || sv.shape.numel() != mats * sr * sc {
                return Err(fp8_error(format!(
                    "scale tensor `{scales}` is {} {:?}; FP8 tensor `{}` of shape {s:?} in {}x{} blocks needs f32 with {} elements",
                    sv.dtype,
                    sv.shape.as_slice(),
                    t.name,
                    b.block[0],
                    b.block[1],
                    mats * sr * sc
                )));
            }
            if fused.contains(&*t.name) {
                let ptr = |n: &str, v: &TensorView| {
                    v.device_ptr().ok_or_else(|| {
                        fp8_error(format!(
                            "`{n}` is not in GPU memory; the cuda-ipc FP8 path quantises on the GPU"
                        ))
                    })
                };
                let q = target.get(&t.name).ok_or_else(|| {
                    fp8_error(format!("FP8 tensor `{}` is not registered", t.name))
                })?;
                if q.len() as u64 != t.shape.numel() {
                    return Err(fp8_error(format!(
                        "`{}` holds {} bytes; its {:?} e4m3 elements need {}",
                        t.name,
                        q.len(),
                        s,
                        t.shape.numel()
                    )));
                }
                let target = Fp8Target {
                    dst: ptr(&t.name, q)?,
                    scales: ptr(&scales, sv)?,
                    shape: t.shape,
                };
                targets.insert(t.name.clone(), target);
                continue;
            }
            // the blocks receiver-encoded transfers touch: all of them (the whole tensor, as
            // every block of a receiver-encoded plan), some, or none (no staging at all)
            let into = || {
                plan.peers
                    .iter()
                    .flat_map(|p| &p.transfers)
                    .filter(|x| x.dst_tensor == t.name)
            };
            let senders = into().any(|x| x.sender_encoded());
            let mut rects: Vec<BlockRect> = into()
                .filter(|x| x.receiver_encoded())
                .map(|x| touched_blocks(x, b.block))
                .collect();
            if senders && rects.is_empty() {
                continue;
            }
            if senders && on_gpu {
                return Err(fp8_error(format!(
                    "the plan quantises blocks of `{}` on the sender, which the cuda-ipc receiver does not read; both sides must plan with the same transport",
                    t.name
                )));
            }
            rects.sort_unstable();
            rects.dedup();
            staging_tensors.push(LocalTensor::plain(t.name.clone(), t.shape, dtype, vec![]));
            jobs.push(Job {
                name: t.name.clone(),
                scales: Arc::from(scales),
                mats: mats as usize,
                rows: rows as usize,
                cols: cols as usize,
                dtype,
                only: senders.then_some(rects),
            });
        }
        let fp8_names: HashMap<&str, ()> = fp8_tensors(layout)
            .into_iter()
            .map(|t| (&*t.name, ()))
            .collect();
        // every transfer into an FP8 tensor delivers its staging dtype, receiver-encoded, or
        // e4m3 and scales, sender-encoded in the pair's encoding
        // (fused tensors take bf16 straight out of the senders' memory)
        let staged: HashMap<&str, DType> = jobs
            .iter()
            .map(|j| (&*j.name, j.dtype))
            .chain(targets.keys().map(|n| (&**n, DType::Bf16)))
            .collect();
        for t in plan.peers.iter().flat_map(|p| &p.transfers) {
            if let Some(e) = &t.encode
                && t.sender_encoded()
            {
                if !fp8_names.contains_key(&*t.dst_tensor)
                    || t.dst_dtype != DType::F8E4m3
                    || e.encoding != *fp8.encoding()
                {
                    return Err(fp8_error(format!(
                        "the plan moves e4m3 blocks ({:?}) into `{}`, which this rank does not hold in the pair's FP8 encoding ({:?}); both sides must be built with the same FP8 inference config",
                        e.encoding,
                        t.dst_tensor,
                        fp8.encoding()
                    )));
                }
                continue;
            }
            if let Some(&d) = staged.get(&*t.dst_tensor)
                && (t.encode.is_none() || t.dst_dtype != d)
            {
                return Err(fp8_error(format!(
                    "the plan moves {} into FP8 tensor `{}` {}; both sides must be built with the same FP8 inference config",
                    t.dst_dtype,
                    t.dst_tensor,
                    if t.encode.is_none() {
                        "as plain bytes".to_string()
                    } else {
                        format!("but its staging is {d}")
                    }
                )));
            }
        }
        let staging_layout = RankLayout {
            rank: layout.rank,
            tensors: staging_tensors,
        };
        let (staging, gpu) = if on_gpu {
            let dev = target.cuda_device()?;
            let cuda = |what: &'static str| {
                move |source| RuntimeError::Cuda {
                    what: what.into(),
                    source,
                }
            };
            let staging = TensorSet::allocate_cuda(&staging_layout, &dev)?;
            let quantiser = fp8.quantiser();
            let mut launches = Vec::new();
            let mut names = Vec::new();
            for j in &jobs {
                let ks = gpu_jobs(&staging, &target, &quantiser, j)?;
                names.extend(std::iter::repeat_n(j.name.clone(), ks.len()));
                launches.extend(ks);
            }
            let kernel = Fp8Kernel::load(&dev).map_err(cuda("loading the FP8 kernel"))?;
            let stream = dev
                .stream()
                .map_err(cuda("creating the FP8 kernel's stream"))?;
            let batch = kernel
                .batch(&launches, fp8.encoding())
                .map_err(cuda("building the FP8 kernel's jobs"))?;
            let g = GpuQuantiser {
                kernel,
                stream,
                batch,
                names,
            };
            (staging, Some(g))
        } else {
            (TensorSet::allocate_host(&staging_layout)?, None)
        };
        let staging = Arc::new(staging);
        let mut views: Vec<TensorView> = target
            .iter()
            .map(|v| staging.get(&v.name).unwrap_or(v).clone())
            .collect();
        // a staged FP8 tensor that also takes sender-encoded blocks: its e4m3 tensor too, under
        // the name sender-encoded transfers look it up by
        for j in jobs.iter().filter(|j| j.only.is_some()) {
            if let Some(v) = target.get(&j.name) {
                let mut e = v.clone();
                e.name = Arc::from(crate::bucket::encoded_name(&j.name));
                views.push(e);
            }
        }
        let over = Arc::new(TensorSet::from_views(views)?);
        let mut inner = inner(over)?;
        let n_fused = targets.len();
        if !targets.is_empty() {
            let ipc = inner.cuda_ipc_mut().ok_or_else(|| {
                fp8_error(
                    "quantising FP8 blocks out of the training ranks' memory needs the cuda-ipc transport".into(),
                )
            })?;
            ipc.fuse_fp8(FusedFp8 {
                recipe: fp8.recipe,
                encoding: fp8.encoding().clone(),
                targets,
            })?;
        }
        Ok(EncodingTransport {
            inner,
            staging,
            target,
            jobs,
            quantiser: fp8.quantiser(),
            gpu,
            fused: n_fused,
        })
    }

    /// Quantises the staging as it is into the target again, on the GPU, and waits: what an
    /// update does after its copies (for timing the kernel alone against a floor). `Ok(false)`
    /// for the CPU quantiser.
    pub fn quantise_on_gpu(&self) -> Result<bool, RuntimeError> {
        match &self.gpu {
            Some(g) => self.quantise_all_gpu(g).map(|()| true),
            None => Ok(false),
        }
    }

    /// Bytes of the bf16 staging (what the FP8 tensors' copies land in).
    pub fn staging_bytes(&self) -> u64 {
        self.staging.iter().map(|v| v.len() as u64).sum()
    }

    /// The GPU path: every matrix of every staging tensor quantised by one launch of the batch
    /// kernel (the inner transport synchronised its copies before returning), then one wait.
    /// Blocks holding infinity or NaN are counted by the kernel, which also keeps the lowest
    /// job holding one: the error names its tensor.
    fn quantise_all_gpu(&self, g: &GpuQuantiser) -> Result<(), RuntimeError> {
        let cuda = |what: String| move |source| RuntimeError::Cuda { what, source };
        let (recipe, enc) = (self.quantiser.recipe, &self.quantiser.encoding);
        // SAFETY: `gpu_jobs` built every job of the batch from a staging tensor and the target
        // e4m3 and scale tensors of its FP8 tensor (lengths checked against its shape), all
        // device memory on this GPU held by `self.staging` and `self.target` as long as
        // `self`; each job writes its own bytes, and nothing else touches them during the
        // update (its copies are over: the inner transport synchronised them).
        if let Err(e) = unsafe { g.kernel.launch_batch(&g.stream, &g.batch, recipe, enc) } {
            let _ = g.kernel.take_batch_status(&g.stream);
            return Err(cuda("quantising the staging to FP8 on the GPU".into())(e));
        }
        let st = g
            .kernel
            .take_batch_status(&g.stream)
            .map_err(cuda("waiting for the FP8 kernel".into()))?;
        if st.blocks == 0 {
            return Ok(());
        }
        let name = st
            .first_job
            .and_then(|j| g.names.get(j as usize))
            .map_or("?", |n| &**n);
        Err(non_finite(name, st.blocks, recipe))
    }

    /// Quantises every staging tensor into its e4m3 tensor and scales; the first failure,
    /// naming the tensor.
    fn quantise_all(&self) -> Result<(), RuntimeError> {
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 8)
            .min(self.jobs.len().max(1));
        let (jobs, staging, target, quantiser) =
            (&self.jobs, &*self.staging, &*self.target, &self.quantiser);
        let results: Vec<Result<(), RuntimeError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        for j in jobs.iter().skip(t).step_by(threads) {
                            quantise(staging, target, quantiser, j)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(fp8_error("a quantiser thread panicked".into())))
                })
                .collect()
        });
        results.into_iter().collect()
    }
}

/// The error for FP8 tensor `name` whose weights hold infinity or NaN in `blocks` blocks.
fn non_finite(name: &str, blocks: u32, recipe: awex_core::encoding::Recipe) -> RuntimeError {
    fp8_error(format!(
        "quantising `{name}` to FP8 ({}) on the GPU failed: {blocks} block(s) hold infinity or NaN; the update is not committed",
        recipe.name()
    ))
}

/// The kernel launches of one FP8 tensor (one per matrix of a stack): the bf16 staging in,
/// the e4m3 tensor and its scales out, all dense.
fn gpu_jobs(
    staging: &TensorSet,
    target: &TensorSet,
    quantiser: &Fp8Quantiser,
    j: &Job,
) -> Result<Vec<Fp8Job>, RuntimeError> {
    let missing = |n: &str| fp8_error(format!("`{n}` is not registered"));
    let ptr = |set: &TensorSet, n: &str, want: usize| {
        let v = set.get(n).ok_or_else(|| missing(n))?;
        let p = v.device_ptr().ok_or_else(|| {
            fp8_error(format!(
                "`{n}` is not in GPU memory; the cuda-ipc FP8 path quantises on the GPU"
            ))
        })?;
        if v.len() != want {
            return Err(fp8_error(format!(
                "`{n}` holds {} bytes; its FP8 job needs {want}",
                v.len()
            )));
        }
        Ok(p)
    };
    let [sr, sc] = quantiser
        .encoding
        .scale_shape(j.rows as u64, j.cols as u64)
        .map(|x| x as usize);
    let m = j.rows * j.cols;
    let src = ptr(staging, &j.name, 2 * m * j.mats)?;
    let dst = ptr(target, &j.name, m * j.mats)?;
    let scales = ptr(target, &j.scales, 4 * sr * sc * j.mats)?;
    let u32_of = |x: usize, what: &str| {
        u32::try_from(x).map_err(|_| {
            fp8_error(format!(
                "`{}`: {what} {x} is past what one GPU FP8 launch takes",
                j.name
            ))
        })
    };
    let (rows, cols) = (u32_of(j.rows, "rows")?, u32_of(j.cols, "columns")?);
    let (src_pitch, scale_pitch) = (
        u32_of(2 * j.cols, "row bytes")?,
        u32_of(sc, "scale columns")?,
    );
    Ok((0..j.mats)
        .map(|mat| Fp8Job {
            src: src + (2 * m * mat) as u64,
            dst: dst + (m * mat) as u64,
            scales: scales + (4 * sr * sc * mat) as u64,
            rows,
            cols,
            src_pitch,
            dst_pitch: cols,
            scale_pitch,
        })
        .collect())
}

/// Quantises one staging tensor into its e4m3 tensor and scales.
fn quantise(
    staging: &TensorSet,
    target: &TensorSet,
    quantiser: &Fp8Quantiser,
    j: &Job,
) -> Result<(), RuntimeError> {
    let missing = |n: &str| fp8_error(format!("`{n}` is not registered"));
    let src = staging.get(&j.name).ok_or_else(|| missing(&j.name))?;
    let q = target.get(&j.name).ok_or_else(|| missing(&j.name))?;
    let s = target.get(&j.scales).ok_or_else(|| missing(&j.scales))?;
    let src = src.try_bytes()?;
    // SAFETY: the target tensors are written by this rank's update only, which is this
    // call (the transfers are over); each job writes its own two tensors.
    let (qb, sb) = unsafe { (q.try_bytes_mut()?, s.try_bytes_mut()?) };
    // SAFETY: f32 has no invalid bit patterns; the alignment is checked.
    let (pre, scales, post) = unsafe { sb.align_to_mut::<f32>() };
    if !pre.is_empty() || !post.is_empty() {
        return Err(fp8_error(format!(
            "scale tensor `{}` is not 4-byte aligned",
            j.scales
        )));
    }
    let m = j.rows * j.cols;
    let [sr, sc] = quantiser
        .encoding
        .scale_shape(j.rows as u64, j.cols as u64)
        .map(|x| x as usize);
    let shape = Shape2d::dense(j.rows, j.cols);
    let named = |mat: usize, e: QuantiseError| {
        fp8_error(format!(
            "quantising `{}`{} to FP8 ({}) failed: {e}; the update is not committed",
            j.name,
            if j.mats > 1 {
                format!(" (matrix {mat})")
            } else {
                String::new()
            },
            quantiser.recipe.name()
        ))
    };
    if let Some(rects) = &j.only {
        return quantise_blocks(src, qb, scales, quantiser, j, rects, named);
    }
    for mat in 0..j.mats {
        let qm = &mut qb[mat * m..(mat + 1) * m];
        let sm = &mut scales[mat * sr * sc..(mat + 1) * sr * sc];
        match j.dtype {
            DType::F32 => {
                // SAFETY: as above; host staging is 8-byte aligned (checked).
                let (pre, x, _) = unsafe { src.align_to::<f32>() };
                if !pre.is_empty() {
                    return Err(fp8_error(format!("staging of `{}` is misaligned", j.name)));
                }
                quantiser
                    .quantise(&x[mat * m..(mat + 1) * m], shape, qm, j.cols, sm, sc)
                    .map_err(|e| named(mat, e))?;
            }
            _ => {
                // SAFETY: as above (bf16 bits as u16).
                let (pre, x, _) = unsafe { src.align_to::<u16>() };
                if !pre.is_empty() {
                    return Err(fp8_error(format!("staging of `{}` is misaligned", j.name)));
                }
                quantiser
                    .quantise(&x[mat * m..(mat + 1) * m], shape, qm, j.cols, sm, sc)
                    .map_err(|e| named(mat, e))?;
            }
        }
    }
    Ok(())
}

/// Quantises the blocks of `rects` only (the receiver-encoded blocks of a tensor whose other
/// blocks arrived sender-encoded) from the staging into the e4m3 tensor and its scales.
fn quantise_blocks(
    src: &[u8],
    qb: &mut [u8],
    scales: &mut [f32],
    quantiser: &Fp8Quantiser,
    j: &Job,
    rects: &[BlockRect],
    named: impl Fn(usize, QuantiseError) -> RuntimeError,
) -> Result<(), RuntimeError> {
    let [bn, bk] = quantiser.encoding.block.map(|b| b as usize);
    let m = j.rows * j.cols;
    let [sr, sc] = quantiser
        .encoding
        .scale_shape(j.rows as u64, j.cols as u64)
        .map(|x| x as usize);
    for r in rects {
        let (r0, r1) = (r.r0 as usize * bn, (r.r1 as usize * bn).min(j.rows));
        let (c0, c1) = (r.c0 as usize * bk, (r.c1 as usize * bk).min(j.cols));
        let shape = Shape2d {
            rows: r1 - r0,
            cols: c1 - c0,
            pitch: j.cols,
        };
        for mat in r.m0 as usize..r.m1 as usize {
            let at = mat * m + r0 * j.cols + c0;
            let qm = &mut qb[at..(mat + 1) * m];
            let s0 = mat * sr * sc + r.r0 as usize * sc + r.c0 as usize;
            let sm = &mut scales[s0..(mat + 1) * sr * sc];
            match j.dtype {
                DType::F32 => {
                    // SAFETY: f32 has no invalid bit patterns; the alignment is checked.
                    let (pre, x, _) = unsafe { src.align_to::<f32>() };
                    if !pre.is_empty() {
                        return Err(fp8_error(format!("staging of `{}` is misaligned", j.name)));
                    }
                    quantiser
                        .quantise(&x[at..], shape, qm, j.cols, sm, sc)
                        .map_err(|e| named(mat, e))?;
                }
                _ => {
                    // SAFETY: as above (bf16 bits as u16).
                    let (pre, x, _) = unsafe { src.align_to::<u16>() };
                    if !pre.is_empty() {
                        return Err(fp8_error(format!("staging of `{}` is misaligned", j.name)));
                    }
                    quantiser
                        .quantise(&x[at..], shape, qm, j.cols, sm, sc)
                        .map_err(|e| named(mat, e))?;
                }
            }
        }
    }
    Ok(())
}

impl Transport for EncodingTransport {
    fn kind(&self) -> awex_core::Transport {
        self.inner.kind()
    }

    fn cuda_ipc(&self) -> Option<&crate::transport::CudaIpcTransport> {
        self.inner.cuda_ipc()
    }

    fn rendezvous(&self) -> serde_json::Value {
        self.inner.rendezvous()
    }

    fn kv_at_join(&self) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        self.inner.kv_at_join()
    }

    fn kv_after_join(&self) -> Option<String> {
        self.inner.kv_after_join()
    }

    fn check_kv(&self, key: &str, value: &serde_json::Value) -> Result<(), RuntimeError> {
        self.inner.check_kv(key, value)
    }

    fn joined(
        &mut self,
        value: Option<&serde_json::Value>,
        join_deadline: Duration,
    ) -> Result<(), RuntimeError> {
        self.inner.joined(value, join_deadline)
    }

    fn authenticate(&mut self, secret: &PairSecret) {
        self.inner.authenticate(secret)
    }

    fn connect(&mut self, peers: &HashMap<RankId, serde_json::Value>) -> Result<(), RuntimeError> {
        self.inner.connect(peers)
    }

    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        let stats = self.inner.execute(ctx)?;
        ctx.check()?;
        match &self.gpu {
            Some(g) => self.quantise_all_gpu(g)?,
            None => self.quantise_all()?,
        }
        Ok(stats)
    }

    fn kv_before_attempt(
        &mut self,
        version: u64,
        attempt: u32,
    ) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        self.inner.kv_before_attempt(version, attempt)
    }

    fn kv_for_attempt(&self, version: u64, attempt: u32) -> Option<String> {
        self.inner.kv_for_attempt(version, attempt)
    }

    fn begin_attempt(&mut self, key: &str, value: &serde_json::Value) -> Result<(), RuntimeError> {
        self.inner.begin_attempt(key, value)
    }

    fn stages(&self) -> bool {
        self.inner.stages()
    }

    fn apply(&mut self) -> Result<u64, RuntimeError> {
        self.inner.apply()
    }

    fn enable_deltas(&mut self) -> Result<bool, RuntimeError> {
        // the staging holds the canonical bytes as received (deltas land there), and every
        // receiver-encoded block is quantised from it again after each update
        self.inner.enable_deltas()
    }

    fn holds_base(&self) -> bool {
        self.inner.holds_base()
    }

    fn check_finite_sources(&mut self) -> Result<(), RuntimeError> {
        self.inner.check_finite_sources()
    }

    fn tolerate_lost_engines(&mut self, lost: Option<Arc<super::LostEngines>>) -> bool {
        self.inner.tolerate_lost_engines(lost)
    }

    fn unreached(&self) -> Vec<u32> {
        self.inner.unreached()
    }

    fn close(&mut self) {
        self.inner.close()
    }
}
