//! The floors every GPU figure is measured against, in the same run: one large device copy
//! (local to local, and out of the sender's memory), and awex's copy kernel over the same
//! bytes. `bench ipc` prints them all; `demo` uses [`device_copy_gbps`].

use super::median;
use awex_gpu::cuda::{CopyDesc, CopyEngine, CopyMethod, Device, split_linear};
use serde::Serialize;
use std::time::Instant;

/// The most bytes one floor copy moves; larger updates are timed on this many bytes and
/// scaled (a copy this long already runs at the copy engine's full rate).
pub const MAX_FLOOR_BYTES: u64 = 8 << 30;

/// One measured floor.
#[derive(Serialize, Debug, Clone)]
pub struct FloorPoint {
    /// What was copied.
    pub name: &'static str,
    /// Bytes copied (times are scaled to the update's bytes).
    pub bytes: u64,
    /// Median of the runs after the first, scaled to the update's bytes.
    pub ms: f64,
    /// The update's bytes, read and written, over `ms`.
    pub gbps: f64,
    /// Every run, scaled (the first warms up).
    pub runs_ms: Vec<f64>,
}

/// The floors for an update of `bytes` on `dev`: one `cuMemcpyDtoD` local to local (the first
/// entry: the floor), one out of the sender's memory at `ipc_src` (`ipc_bytes` readable there),
/// the copy kernel local to local and out of the sender's memory, whole and in 256 MiB pieces
/// on 4 streams. Each is timed on at most [`MAX_FLOOR_BYTES`] and scaled to `bytes`.
pub fn measure(
    dev: &Device,
    bytes: u64,
    ipc_src: u64,
    ipc_bytes: u64,
) -> anyhow::Result<Vec<FloorPoint>> {
    let local_n = bytes.min(MAX_FLOOR_BYTES);
    let ipc_n = ipc_bytes.min(local_n);
    let scratch = dev.alloc(local_n)?;
    let local = dev.alloc(local_n)?;
    let e1 = CopyEngine::new(dev, 1)?;
    let k1 = CopyEngine::with_method(dev, 1, CopyMethod::Kernel)?;
    let k4 = CopyEngine::with_method(dev, 4, CopyMethod::Kernel)?;
    // bf16 1.0, 2.0: never zeros
    local.fill_u32(0x3F80_4000, e1.main_stream())?;
    e1.sync()?;
    let mut floors = Vec::new();
    for (name, src, n, engine, piece) in [
        ("one copy, local to local", local.ptr(), local_n, &e1, 0),
        ("one copy, from the sender's memory", ipc_src, ipc_n, &e1, 0),
        ("copy kernel, local to local", local.ptr(), local_n, &k1, 0),
        (
            "copy kernel, from the sender's memory",
            ipc_src,
            ipc_n,
            &k1,
            0,
        ),
        (
            "copy kernel, 256 MiB pieces on 4 streams, from the sender's memory",
            ipc_src,
            ipc_n,
            &k4,
            256 << 20,
        ),
    ] {
        if n == 0 {
            continue;
        }
        let d = split_linear(&[CopyDesc::linear(src, scratch.ptr(), n)], piece);
        let mut runs = Vec::new();
        for _ in 0..6 {
            let t0 = Instant::now();
            // SAFETY: the source is `local` or `ipc_bytes >= n` bytes of the sender's mapped
            // memory (the caller's contract), the destination `scratch` of `local_n >= n`
            // bytes; both outlive the sync.
            unsafe { engine.launch(&d, None, None)? };
            engine.sync()?;
            runs.push(t0.elapsed().as_secs_f64() * 1e3 * bytes as f64 / n as f64);
        }
        let ms = median(&runs[1..]);
        floors.push(FloorPoint {
            name,
            bytes: n,
            ms,
            gbps: bytes as f64 * 2.0 / ms / 1e6,
            runs_ms: runs,
        });
    }
    Ok(floors)
}

/// Best-of-5 bandwidth of one 1 GiB device-to-device copy on GPU `gpu` (bytes copied per
/// second, after a warm-up copy).
pub fn device_copy_gbps(gpu: u32) -> anyhow::Result<f64> {
    let n = 1u64 << 30;
    let dev = Device::open(gpu)?;
    let src = dev.alloc(n)?;
    let dst = dev.alloc(n)?;
    let engine = CopyEngine::new(&dev, 1)?;
    let copy = [CopyDesc::linear(src.ptr(), dst.ptr(), n)];
    let mut best = f64::MAX;
    for i in 0..6 {
        let t = Instant::now();
        // SAFETY: both ranges are the two live 1 GiB buffers above.
        unsafe { engine.launch(&copy, None, None)? };
        engine.sync()?;
        if i > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(n as f64 / best / 1e9)
}
