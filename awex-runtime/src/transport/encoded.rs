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

use crate::transport::{ExecContext, ExecStats, PairSecret, Transport};
use crate::{RuntimeError, TensorSet, TensorView};
use awex_core::dtype::DType;
use awex_core::encoding::{Encoding, Fp8Block, Fp8Quantiser, InferFp8, QuantiseError, Shape2d};
use awex_core::layout::{LocalTensor, RankId, RankLayout};
use awex_core::model::Catalogue;
use awex_core::plan::RankPlan;
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
        let mut jobs = Vec::new();
        let mut staging_tensors = Vec::new();
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
            staging_tensors.push(LocalTensor::plain(t.name.clone(), t.shape, dtype, vec![]));
            jobs.push(Job {
                name: t.name.clone(),
                scales: Arc::from(scales),
                mats: mats as usize,
                rows: rows as usize,
                cols: cols as usize,
                dtype,
            });
        }
        // every transfer into an FP8 tensor delivers its staging dtype, receiver-encoded
        let staged: HashMap<&str, DType> = jobs.iter().map(|j| (&*j.name, j.dtype)).collect();
        for t in plan.peers.iter().flat_map(|p| &p.transfers) {
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
        let staging = Arc::new(TensorSet::allocate_host(&RankLayout {
            rank: layout.rank,
            tensors: staging_tensors,
        })?);
        let views: Vec<TensorView> = target
            .iter()
            .map(|v| staging.get(&v.name).unwrap_or(v).clone())
            .collect();
        let over = Arc::new(TensorSet::from_views(views)?);
        Ok(EncodingTransport {
            inner: inner(over)?,
            staging,
            target,
            jobs,
            quantiser: fp8.quantiser(),
        })
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

impl Transport for EncodingTransport {
    fn kind(&self) -> awex_core::Transport {
        self.inner.kind()
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
        self.quantise_all()?;
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

    fn close(&mut self) {
        self.inner.close()
    }
}
