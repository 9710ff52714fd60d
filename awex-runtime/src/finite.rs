//! The non-finite check of a training rank's sources (pair option `check_finite`): before an
//! update moves anything, every floating-point tensor the rank sends is read once, in
//! parallel, and the first infinity or NaN fails the update naming the tensor, the element and
//! the value. FP8 pairs check their quantised tensors in the quantiser whatever this says (it
//! reads every value anyway); this check covers every tensor, at the price of one read of the
//! rank's shard per update (docs/gateway.md, "check_finite").

use crate::{RuntimeError, TensorSet};
use awex_core::dtype::{DType, first_non_finite};

/// Bytes one thread scans at a time (big tensors are split so that the threads share them).
const CHUNK: usize = 16 << 20;

/// Checks the tensors of `set` named by `names` (each once); the first non-finite element in
/// name order fails with [`RuntimeError::NonFinite`].
pub fn check_sources<'a>(
    set: &TensorSet,
    names: impl IntoIterator<Item = &'a str>,
) -> Result<(), RuntimeError> {
    let mut seen = std::collections::BTreeSet::new();
    // (tensor, first element of the chunk, bytes, dtype)
    let mut jobs: Vec<(&str, usize, &[u8], DType)> = Vec::new();
    for name in names {
        if !seen.insert(name) {
            continue;
        }
        let Some(v) = set.get(name) else { continue };
        let es = v.dtype.size();
        if matches!(v.dtype, DType::U8 | DType::I8 | DType::I32 | DType::I64) {
            continue;
        }
        let bytes = v.try_bytes()?;
        let step = CHUNK / es * es;
        for (k, c) in bytes.chunks(step).enumerate() {
            jobs.push((name, k * (step / es), c, v.dtype));
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(jobs.len().max(1));
    let jobs = &jobs;
    // per thread: the first hit of its jobs (jobs are in name order; the lowest job index wins)
    let hits: Vec<Option<(usize, usize)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    jobs.iter()
                        .enumerate()
                        .skip(t)
                        .step_by(threads)
                        .find_map(|(j, (_, _, b, dt))| first_non_finite(b, *dt).map(|i| (j, i)))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(None))
            .collect()
    });
    let Some((j, i)) = hits.into_iter().flatten().min() else {
        return Ok(());
    };
    let (name, first, bytes, dtype) = jobs[j];
    let es = dtype.size();
    Err(RuntimeError::NonFinite {
        tensor: name.to_string(),
        element: (first + i) as u64,
        value: describe(&bytes[i * es..(i + 1) * es], dtype),
    })
}

/// `NaN`, `+inf` or `-inf`, with the element's bits.
fn describe(e: &[u8], dtype: DType) -> String {
    let mut w = [0u8; 8];
    w[..e.len()].copy_from_slice(e);
    let bits = u64::from_le_bytes(w);
    let sign = bits >> (8 * e.len() - 1) & 1 == 1;
    let mantissa = match dtype {
        DType::Bf16 => bits & 0x7f,
        DType::F16 => bits & 0x3ff,
        DType::F32 => bits & 0x7f_ffff,
        DType::F64 => bits & 0xf_ffff_ffff_ffff,
        _ => 1, // e4m3: no infinity
    };
    let what = match (mantissa, sign) {
        (0, false) => "+inf",
        (0, true) => "-inf",
        _ => "NaN",
    };
    format!("{what} ({dtype} bits {bits:#0w$x})", w = 2 + 2 * e.len())
}
