//! Tests that need a GPU: ignored by default, run with
//! `cargo test -p awex-gpu --features cuda --lib -- --ignored cuda::gpu_tests` on a machine with
//! one (or the test binary built here and carried there: `bench/results/2026-12-01-d-call1/call.sh`).

use super::desc::tests::transfer;
use super::*;
use awex_core::dtype::DType;
use awex_core::layout::Dims;
use awex_core::layout::copy::copy_box;
use awex_core::plan::Transfer;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Deterministic, non-zero bytes.
fn pattern(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64)
        .map(|i| ((i.wrapping_mul(2654435761) ^ seed) >> 3) as u8 | 1)
        .collect()
}

/// The transfers the copy tests run: linear rows, a 2-D column block, a 3-D box, a 4-D box.
fn shapes() -> Vec<Transfer> {
    vec![
        transfer(
            &[96, 64],
            &[16, 0],
            &[64, 64],
            &[8, 0],
            &[32, 64],
            DType::Bf16,
        ),
        transfer(
            &[48, 96],
            &[0, 40],
            &[48, 40],
            &[0, 0],
            &[48, 40],
            DType::Bf16,
        ),
        transfer(
            &[6, 20, 32],
            &[1, 3, 5],
            &[4, 16, 24],
            &[0, 2, 1],
            &[3, 10, 17],
            DType::F32,
        ),
        transfer(
            &[3, 4, 10, 12],
            &[1, 1, 2, 3],
            &[2, 3, 8, 9],
            &[0, 0, 1, 1],
            &[2, 3, 6, 7],
            DType::Bf16,
        ),
    ]
}

fn expected(t: &Transfer, src: &[u8], poison: u8) -> Vec<u8> {
    let mut want = vec![poison; (t.dst_shape.numel() * t.dst_dtype.size() as u64) as usize];
    copy_box(
        src,
        &t.src_shape,
        &t.src_offset,
        t.src_dtype,
        &mut want,
        &t.dst_shape,
        &t.dst_offset,
        t.dst_dtype,
        &t.extent,
    )
    .unwrap();
    want
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_device_opens_and_reports_an_nvidia_gpu() {
    let d = Device::open(0).unwrap();
    assert!(d.name().unwrap().starts_with("NVIDIA"), "{:?}", d.name());
    assert!(d.total_memory().unwrap() > 1 << 30);
    assert!(driver_version().unwrap() >= 12000);
    let n = device_count().unwrap();
    assert_eq!(
        Device::open(n).unwrap_err(),
        CudaError::NoSuchDevice {
            ordinal: n,
            count: n
        }
    );
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_descriptors_copy_exact_bytes_on_streams_and_in_a_graph() {
    let d = Device::open(0).unwrap();
    for method in [CopyMethod::Driver, CopyMethod::Kernel] {
        let engine = CopyEngine::with_method(&d, 3, method).unwrap();
        assert_eq!(engine.method(), method);
        engine.set_tiles(None);
        copy_shapes(&d, &engine);
    }
    // the tile kernel: tiles of one vector, of 64 bytes, and the default
    let engine = CopyEngine::with_method(&d, 3, CopyMethod::Kernel).unwrap();
    for tile in [16, 64, tiles::DEFAULT_TILE_BYTES] {
        engine.set_tiles(Some(tile));
        copy_shapes(&d, &engine);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_tile_kernel_moves_a_large_batch_exactly() {
    let d = Device::open(0).unwrap();
    let engine = CopyEngine::with_method(&d, 4, CopyMethod::Kernel).unwrap();
    let n = 48usize << 20;
    let src_host = pattern(n, 7);
    let src = d.alloc(n as u64).unwrap();
    src.upload(0, &src_host).unwrap();
    let dst = d.alloc(n as u64).unwrap();
    // linear copies of odd sizes back to back, one 2-D block of 3 KiB rows out of 4 KiB, one
    // 16-byte copy, one unaligned copy (the driver's)
    let (s, t) = (src.ptr(), dst.ptr());
    let mut descs = Vec::new();
    let mut at = 0u64;
    for k in 0..40u64 {
        let len = (1 << 18) + 16 * (k * 977 % 4096);
        descs.push(CopyDesc::linear(s + at, t + at, len));
        at += len + 16 * (k % 3);
    }
    let base = 24u64 << 20;
    descs.push(CopyDesc {
        height: 2048,
        src_pitch: 4096,
        dst_pitch: 4096,
        ..CopyDesc::linear(s + base, t + base, 3072)
    });
    let tail = 40u64 << 20;
    descs.push(CopyDesc::linear(s + tail, t + tail, 16));
    descs.push(CopyDesc::linear(s + tail + 33, t + tail + 35, 1001));
    let mut want = vec![0xCDu8; n];
    for dd in &descs {
        dd.for_each_row(|a, b, len| {
            let (a, b, len) = ((a - s) as usize, (b - t) as usize, len as usize);
            want[b..b + len].copy_from_slice(&src_host[a..a + len]);
        });
    }
    for tile in [4096, tiles::DEFAULT_TILE_BYTES, 1 << 20] {
        engine.set_tiles(Some(tile));
        // SAFETY: every descriptor stays inside `src` and `dst`, alive until the syncs below.
        let g = unsafe { engine.capture(&descs) }.unwrap();
        assert_eq!((g.copies, g.tiled_copies), (43, 42), "tile {tile}");
        assert!(
            g.tiles >= 42 && g.table_bytes > 0,
            "tile {tile}: {} tiles",
            g.tiles
        );
        for _ in 0..2 {
            dst.fill_u32(0xCDCD_CDCD, engine.main_stream()).unwrap();
            // SAFETY: as above.
            unsafe { engine.replay(&g, None, None) }.unwrap();
            engine.sync().unwrap();
            let mut got = vec![0u8; n];
            dst.download(0, &mut got).unwrap();
            let bad = got.iter().zip(&want).position(|(a, b)| a != b);
            assert_eq!(bad, None, "tile {tile}: first wrong byte");
        }
    }
}

/// The diff graph ends with exactly the copy's bytes whatever the destination held (poisoned,
/// the old version, the new one), writes only the 16-byte vectors that differ and counts them;
/// the step kernel changes the elements its host rule names, each by its lowest bit.
#[test]
#[ignore = "needs a GPU"]
fn gpu_diff_graph_counts_the_changed_vectors_and_ends_exact() {
    let d = Device::open(0).unwrap();
    let engine = CopyEngine::with_method(&d, 4, CopyMethod::Kernel).unwrap();
    assert!(engine.diffs(), "the diff kernel did not load");
    // big linear copies go through the driver in a plain capture, through the diff kernel here
    engine.set_driver_min(Some(1 << 20));
    let n = 24usize << 20;
    let old_host = pattern(n, 11);
    let src = d.alloc(n as u64).unwrap();
    src.upload(0, &old_host).unwrap();
    let dst = d.alloc(n as u64).unwrap();
    let (s, t) = (src.ptr(), dst.ptr());
    let mut descs = vec![
        CopyDesc::linear(s, t, 8 << 20),
        CopyDesc {
            height: 1024,
            src_pitch: 4096,
            dst_pitch: 4096,
            ..CopyDesc::linear(s + (8 << 20), t + (8 << 20), 3072)
        },
    ];
    let mut at = 12u64 << 20;
    for k in 0..20u64 {
        let len = (1 << 16) + 16 * (k * 613 % 1024);
        descs.push(CopyDesc::linear(s + at, t + at, len));
        at += len + 16 * (k % 3);
    }
    // one copy the kernel cannot take (unaligned): copied whole
    descs.push(CopyDesc::linear(
        s + (20 << 20) + 3,
        t + (20 << 20) + 5,
        999,
    ));
    let expect = |src_host: &[u8], base: &[u8]| {
        let mut want = base.to_vec();
        for dd in &descs {
            dd.for_each_row(|a, b, len| {
                let (a, b, len) = ((a - s) as usize, (b - t) as usize, len as usize);
                want[b..b + len].copy_from_slice(&src_host[a..a + len]);
            });
        }
        want
    };
    // SAFETY: every descriptor stays inside `src` and `dst`, alive until the syncs below.
    let g = unsafe { engine.capture_diff(&descs) }.unwrap();
    assert!(g.diff);
    assert_eq!((g.copies, g.tiled_copies), (23, 22));
    let tiled: u64 = descs[..22].iter().map(|d| d.bytes()).sum();
    assert_eq!(g.diff_bytes, tiled);
    let download = || {
        let mut got = vec![0u8; n];
        dst.download(0, &mut got).unwrap();
        got
    };
    // 1. a poisoned destination: every tiled vector differs
    dst.fill_u32(0xCDCD_CDCD, engine.main_stream()).unwrap();
    // SAFETY: as above.
    unsafe { engine.replay(&g, None, None) }.unwrap();
    engine.sync().unwrap();
    let v1 = download();
    assert_eq!(v1, expect(&old_host, &vec![0xCDu8; n]));
    assert_eq!(g.changed_vectors().unwrap(), Some(tiled / 16));
    // 2. the same source again: nothing to write
    // SAFETY: as above.
    unsafe { engine.replay(&g, None, None) }.unwrap();
    engine.sync().unwrap();
    assert_eq!(g.changed_vectors().unwrap(), Some(0));
    assert_eq!(download(), v1);
    // 3. an optimiser-like step of 1 % of the bf16 elements on the source
    let step = delta::StepKernel::load(&d).unwrap();
    let seed = 0x5eed;
    // SAFETY: `src` holds n / 2 bf16 elements and lives until the sync below.
    unsafe { step.launch(engine.main_stream(), s, n as u64 / 2, seed, 0.01) }.unwrap();
    engine.sync().unwrap();
    let mut new_host = old_host.clone();
    let th = delta::step_threshold(0.01);
    for i in 0..n / 2 {
        if delta::step_changes(seed, i as u64, th) {
            new_host[2 * i] ^= 1;
        }
    }
    let mut got_src = vec![0u8; n];
    src.download(0, &mut got_src).unwrap();
    assert!(got_src == new_host, "the step kernel broke its host rule");
    // SAFETY: as above.
    unsafe { engine.replay(&g, None, None) }.unwrap();
    engine.sync().unwrap();
    let want = expect(&new_host, &v1);
    let got = download();
    assert_eq!(got.iter().zip(&want).position(|(a, b)| a != b), None);
    // the count is exactly the tiled vectors whose bytes changed (whatever the 32-byte sectors
    // also wrote, the bytes above are the source's)
    let mut changed = 0u64;
    for dd in &descs[..22] {
        dd.for_each_row(|a, _, len| {
            let a = (a - s) as usize;
            for v in (a..a + len as usize).step_by(16) {
                changed += (old_host[v..v + 16] != new_host[v..v + 16]) as u64;
            }
        });
    }
    assert!(changed > 0);
    assert_eq!(g.changed_vectors().unwrap(), Some(changed));
    // the plain capture of the same batch reports no count
    // SAFETY: as above.
    let plain = unsafe { engine.capture(&descs) }.unwrap();
    assert!(!plain.diff);
    assert_eq!(plain.changed_vectors().unwrap(), None);
}

/// The transpose kernel writes every transposed box exactly as the CPU's transposed copy does
/// (1, 2 and 4-byte elements, odd sides, offsets on both ends, several matrices per box), and
/// nothing outside the boxes.
#[test]
#[ignore = "needs a GPU"]
fn gpu_transpose_kernel_equals_the_cpu_transposed_copy() {
    use awex_core::layout::copy::copy_box_transposed;
    let d = Device::open(0).unwrap();
    let k = transpose::TransposeKernel::load(&d).unwrap();
    let stream = d.stream().unwrap();
    for dtype in [DType::F8E4m3, DType::Bf16, DType::F32] {
        let es = dtype.size();
        for (src_shape, src_off, dst_shape, dst_off, extent) in [
            (
                &[4u64, 45, 70][..],
                &[1u64, 3, 5][..],
                &[3u64, 66, 40][..],
                &[0u64, 2, 1][..],
                &[2u64, 37, 61][..],
            ),
            (
                &[8, 2880, 640],
                &[0, 0, 0],
                &[8, 640, 2880],
                &[0, 0, 0],
                &[8, 2880, 640],
            ),
            (
                &[5, 2, 31, 9],
                &[1, 0, 0, 0],
                &[4, 2, 9, 31],
                &[0, 1, 0, 0],
                &[3, 1, 31, 9],
            ),
        ] {
            let mut t = transfer(src_shape, src_off, dst_shape, dst_off, extent, dtype);
            t.transposed = true;
            let src_host = pattern(Dims::new(src_shape).numel() as usize * es, 3);
            let n = Dims::new(dst_shape).numel() as usize * es;
            let mut want = vec![0xABu8; n];
            copy_box_transposed(
                &src_host,
                &t.src_shape,
                &t.src_offset,
                dtype,
                &mut want,
                &t.dst_shape,
                &t.dst_offset,
                dtype,
                &t.extent,
                t.transpose(),
            )
            .unwrap();
            let src = d.alloc(src_host.len() as u64).unwrap();
            src.upload(0, &src_host).unwrap();
            let dst = d.alloc(n as u64).unwrap();
            dst.upload(0, &vec![0xABu8; n]).unwrap();
            let jobs = transpose::transpose_jobs(&t, src.ptr(), dst.ptr())
                .unwrap()
                .unwrap();
            let batch = k.batch(&jobs).unwrap().unwrap();
            // SAFETY: every job lies in `src` and `dst` (the geometry is checked against the
            // tensors' shapes); both live until the sync below.
            unsafe { k.launch(&stream, &batch) }.unwrap();
            stream.sync().unwrap();
            let mut got = vec![0u8; n];
            dst.download(0, &mut got).unwrap();
            let bad = got.iter().zip(&want).position(|(a, b)| a != b);
            assert_eq!(bad, None, "{dtype:?} {extent:?}: first wrong byte");
        }
    }
}

/// The kernel's conversions equal `awex_core::dtype::convert` (the CPU transports') bit for
/// bit: every bf16 and f16 value widened, and f32 values rounded to both (every sign and
/// exponent with the mantissas around each rounding boundary, NaN payloads, plus 16M others);
/// and converting boxes (straight and transposed, offset on both ends) equal the CPU's
/// converting copy, nothing outside them written.
#[test]
#[ignore = "needs a GPU"]
fn gpu_conversions_equal_the_cpu_conversion_bit_for_bit() {
    use awex_core::layout::copy::copy_box_transposed;
    use transpose::{Conversion, TransposeJob};
    let d = Device::open(0).unwrap();
    let k = transpose::TransposeKernel::load(&d).unwrap();
    let stream = d.stream().unwrap();
    // one straight job over `src` as elements of `from`, converted to `to`
    let run = |src_host: &[u8], from: DType, to: DType| -> Vec<u8> {
        let n = src_host.len() / from.size();
        let cols = 1024u64;
        let rows = (n as u64).div_ceil(cols);
        assert_eq!(n as u64 % cols, 0);
        let src = d.alloc(src_host.len() as u64).unwrap();
        src.upload(0, src_host).unwrap();
        let out = n * to.size();
        let dst = d.alloc(out as u64).unwrap();
        let job = TransposeJob {
            src: src.ptr(),
            dst: dst.ptr(),
            rows: rows as u32,
            cols: cols as u32,
            src_pitch: (cols * from.size() as u64) as u32,
            dst_pitch: (cols * to.size() as u64) as u32,
            elem: from.size() as u32,
            conv: Conversion::of(from, to).unwrap(),
            straight: true,
        };
        let batch = k.batch(&[job]).unwrap().unwrap();
        // SAFETY: the job lies in `src` and `dst`; both live until the sync below.
        unsafe { k.launch(&stream, &batch) }.unwrap();
        stream.sync().unwrap();
        let mut got = vec![0u8; out];
        dst.download(0, &mut got).unwrap();
        got
    };
    let check = |src: &[u8], from: DType, to: DType| {
        let got = run(src, from, to);
        let mut want = vec![0u8; got.len()];
        awex_core::dtype::convert(src, from, &mut want, to).unwrap();
        let (fs, ts) = (from.size(), to.size());
        if let Some(i) = (0..src.len() / fs).find(|&i| got[i * ts..][..ts] != want[i * ts..][..ts])
        {
            panic!(
                "{from} -> {to}: element {:02x?} gave {:02x?}, the CPU {:02x?}",
                &src[i * fs..][..fs],
                &got[i * ts..][..ts],
                &want[i * ts..][..ts]
            );
        }
    };
    let halves: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    check(&halves, DType::Bf16, DType::F32);
    check(&halves, DType::F16, DType::F32);
    let mut words: Vec<u32> = Vec::new();
    for sign_exp in 0..512u32 {
        for m in [
            0u32, 1, 2, 0xfff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001,
            0x18000, 0xffff, 0x10000, 0x1ffff, 0x3fffff, 0x400000, 0x400001, 0x7fe000, 0x7fffff,
        ] {
            words.push(sign_exp << 23 | m);
        }
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while words.len() % 1024 != 0 || words.len() < 16 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        words.push(x as u32);
    }
    let floats: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    check(&floats, DType::F32, DType::Bf16);
    check(&floats, DType::F32, DType::F16);

    // boxes: straight and transposed, both directions
    for (from, to) in [(DType::Bf16, DType::F32), (DType::F32, DType::Bf16)] {
        for transposed in [false, true] {
            let (src_shape, src_off, extent) = (&[4u64, 45, 70], &[1u64, 3, 5], &[2u64, 37, 61]);
            let (dst_shape, dst_off): (&[u64], &[u64]) = if transposed {
                (&[3, 66, 40], &[0, 2, 1])
            } else {
                (&[3, 40, 66], &[0, 1, 2])
            };
            let mut t = transfer(src_shape, src_off, dst_shape, dst_off, extent, from);
            (t.dst_dtype, t.transposed) = (to, transposed);
            let src_host = pattern(Dims::new(src_shape).numel() as usize * from.size(), 5);
            let n = Dims::new(dst_shape).numel() as usize * to.size();
            let mut want = vec![0xABu8; n];
            copy_box_transposed(
                &src_host,
                &t.src_shape,
                &t.src_offset,
                from,
                &mut want,
                &t.dst_shape,
                &t.dst_offset,
                to,
                &t.extent,
                t.transpose(),
            )
            .unwrap();
            let src = d.alloc(src_host.len() as u64).unwrap();
            src.upload(0, &src_host).unwrap();
            let dst = d.alloc(n as u64).unwrap();
            dst.upload(0, &vec![0xABu8; n]).unwrap();
            let jobs = if transposed {
                transpose::transpose_jobs(&t, src.ptr(), dst.ptr())
            } else {
                transpose::convert_jobs(&t, src.ptr(), dst.ptr())
            }
            .unwrap()
            .unwrap();
            let batch = k.batch(&jobs).unwrap().unwrap();
            // SAFETY: every job lies in `src` and `dst` (the geometry is checked against the
            // tensors' shapes); both live until the sync below.
            unsafe { k.launch(&stream, &batch) }.unwrap();
            stream.sync().unwrap();
            let mut got = vec![0u8; n];
            dst.download(0, &mut got).unwrap();
            let bad = got.iter().zip(&want).position(|(a, b)| a != b);
            assert_eq!(
                bad, None,
                "{from} -> {to} transposed {transposed}: first wrong byte"
            );
        }
    }
}

/// Runs every transfer of [`shapes`] (launched, then captured and replayed) and checks the bytes.
fn copy_shapes(d: &Device, engine: &CopyEngine) {
    for (i, t) in shapes().iter().enumerate() {
        let es = t.src_dtype.size() as u64;
        let src_host = pattern((t.src_shape.numel() * es) as usize, i as u64);
        let src = d.alloc(src_host.len() as u64).unwrap();
        src.upload(0, &src_host).unwrap();
        let dst_len = t.dst_shape.numel() * es;
        let dst = d.alloc(dst_len).unwrap();
        let descs = copy_descriptors(t, src.ptr(), dst.ptr()).unwrap();
        let want = expected(t, &src_host, 0xAB);
        // plain launch
        dst.fill_u32(0xABAB_ABAB, engine.main_stream()).unwrap();
        // SAFETY: the descriptors stay inside `src` and `dst`, alive until the sync below.
        unsafe { engine.launch(&descs, None, None) }.unwrap();
        engine.sync().unwrap();
        let mut got = vec![0u8; dst_len as usize];
        dst.download(0, &mut got).unwrap();
        assert_eq!(
            got,
            want,
            "{:?}, transfer {i} ({:?})",
            engine.method(),
            DescStats::of(&descs)
        );
        // captured graph, replayed twice over a poisoned destination
        // SAFETY: as above; every replay is synchronised before the buffers drop.
        let g = unsafe { engine.capture(&descs) }.unwrap();
        for _ in 0..2 {
            dst.fill_u32(0xABAB_ABAB, engine.main_stream()).unwrap();
            // SAFETY: as above.
            unsafe { engine.replay(&g, None, None) }.unwrap();
            engine.sync().unwrap();
            let mut got = vec![0u8; dst_len as usize];
            dst.download(0, &mut got).unwrap();
            assert_eq!(got, want, "graph, transfer {i}");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_graphs_replayed_on_lanes_at_once_move_every_byte_before_the_sync() {
    // a receiver's peers read concurrently: two captured graphs (two peers' batches, tiles on)
    // replayed on lanes 0 and 1, joined, synced: every byte of both lands, twice over a poisoned
    // destination
    let d = Device::open(0).unwrap();
    let engine = CopyEngine::with_method(&d, 4, CopyMethod::Kernel).unwrap();
    let n = 16usize << 20;
    let src_host = pattern(n, 11);
    let src = d.alloc(n as u64).unwrap();
    src.upload(0, &src_host).unwrap();
    let dst = d.alloc(n as u64).unwrap();
    let (s, t) = (src.ptr(), dst.ptr());
    let half = (n / 2) as u64;
    let peer = |from: u64| -> Vec<CopyDesc> {
        (0..8u64)
            .map(|k| {
                let at = from + k * (half / 8);
                CopyDesc::linear(s + at, t + at, half / 8)
            })
            .collect()
    };
    // SAFETY: every descriptor stays inside `src` and `dst`, alive until the syncs below.
    let (g0, g1) = unsafe {
        (
            engine.capture(&peer(0)).unwrap(),
            engine.capture(&peer(half)).unwrap(),
        )
    };
    for round in 0..2u8 {
        dst.upload(0, &vec![0xA0 | round; n]).unwrap();
        // SAFETY: as above.
        unsafe {
            engine.replay_on(&g0, 0, None).unwrap();
            engine.replay_on(&g1, 1, None).unwrap();
        }
        engine.join_lanes().unwrap();
        engine.sync().unwrap();
        let mut got = vec![0u8; n];
        dst.download(0, &mut got).unwrap();
        assert!(
            got == src_host,
            "round {round}: the lanes' copies did not all land"
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_export_has_one_handle_per_allocation() {
    let d = Device::open(0).unwrap();
    let a = d.alloc(1 << 20).unwrap();
    let b = d.alloc(1 << 16).unwrap();
    let mut e = IpcExport::new(&d, &[a.ptr(), a.ptr() + 256, b.ptr() + 10]).unwrap();
    assert_eq!(e.allocations().len(), 2);
    assert!(e.allocations()[0].size >= 1 << 20);
    assert_ne!(e.allocations()[0].handle, e.allocations()[1].handle);
    assert_eq!(
        e.locate(b.ptr() + 10).unwrap(),
        RemoteAddr {
            allocation: 1,
            offset: 10
        }
    );
    // cached: pointers into known allocations add no handle
    e.extend(&[a.ptr() + 4096, b.ptr()]).unwrap();
    assert_eq!(e.allocations().len(), 2);
}

/// What the exporting child hands the parent.
#[derive(serde::Serialize, serde::Deserialize)]
struct ChildHandles {
    allocations: Vec<ExportedAllocation>,
    tensor: RemoteAddr,
    ready: IpcEventHandle,
}

const CHILD_ENV: &str = "AWEX_IPC_TEST_DIR";
const CHILD_TEST: &str = "cuda::gpu_tests::gpu_ipc_child_exports_for_parent";

fn wait_for(path: &Path, secs: u64) -> bool {
    let t0 = Instant::now();
    while !path.exists() {
        if t0.elapsed() > Duration::from_secs(secs) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// The exporting side of `gpu_ipc_pull_between_two_processes`; does nothing unless started by it.
#[test]
#[ignore = "needs a GPU"]
fn gpu_ipc_child_exports_for_parent() {
    let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return;
    };
    let t = &shapes()[1];
    let d = Device::open(0).unwrap();
    let host = pattern((t.src_shape.numel() * 2) as usize, 77);
    // the tensor sits 4 KiB into a larger buffer, like one tensor of a contiguous param buffer
    let buf = d.alloc(host.len() as u64 + 8192).unwrap();
    let s = d.stream().unwrap();
    buf.fill_u32(0, &s).unwrap();
    s.sync().unwrap();
    buf.upload(4096, &host).unwrap();
    let ready = d.event(true).unwrap();
    ready.record(&s).unwrap();
    let e = IpcExport::new(&d, &[buf.ptr() + 4096]).unwrap();
    let msg = ChildHandles {
        allocations: e.allocations().to_vec(),
        tensor: e.locate(buf.ptr() + 4096).unwrap(),
        ready: ready.ipc_handle().unwrap(),
    };
    let tmp = dir.join("handles.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&msg).unwrap()).unwrap();
    std::fs::rename(&tmp, dir.join("handles.json")).unwrap();
    assert!(wait_for(&dir.join("done"), 120), "parent never finished");
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_ipc_pull_between_two_processes() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args(["--ignored", "--exact", CHILD_TEST, "--nocapture"])
        .env(CHILD_ENV, dir.path())
        .spawn()
        .unwrap();
    assert!(wait_for(&dir.path().join("handles.json"), 120));
    let msg: ChildHandles =
        serde_json::from_slice(&std::fs::read(dir.path().join("handles.json")).unwrap()).unwrap();
    assert_eq!(msg.allocations.len(), 1);
    assert_eq!(msg.tensor.offset, 4096);
    let t = &shapes()[1];
    let d = Device::open(0).unwrap();
    let imp = IpcImport::open(&d, &msg.allocations).unwrap();
    let ready = d.open_event(&msg.ready).unwrap();
    let src = imp.ptr(msg.tensor, t.src_shape.numel() * 2).unwrap();
    assert!(matches!(
        imp.ptr(msg.tensor, msg.allocations[0].size),
        Err(CudaError::OutOfRange { .. })
    ));
    let dst_len = t.dst_shape.numel() * 2;
    let dst = d.alloc(dst_len).unwrap();
    let engine = CopyEngine::new(&d, 2).unwrap();
    dst.fill_u32(0xABAB_ABAB, engine.main_stream()).unwrap();
    let done = d.event(false).unwrap();
    let descs = copy_descriptors(t, src, dst.ptr()).unwrap();
    // SAFETY: the source lies in the opened mapping (checked by `imp.ptr`), the destination in
    // `dst`; both outlive `done.sync()`.
    unsafe { engine.launch(&descs, Some(&ready), Some(&done)) }.unwrap();
    done.sync().unwrap();
    let mut got = vec![0u8; dst_len as usize];
    dst.download(0, &mut got).unwrap();
    let host = pattern((t.src_shape.numel() * 2) as usize, 77);
    assert_eq!(got, expected(t, &host, 0xAB));
    drop(imp);
    drop(ready);
    std::fs::write(dir.path().join("done"), b"").unwrap();
    assert!(child.wait().unwrap().success());
}

/// The driver rejects a pitched copy whose rows lie in two allocations, which is why
/// [`plan_copies`] merges series only between the same two tensors.
#[test]
#[ignore = "needs a GPU"]
fn gpu_pitched_copy_across_two_allocations_is_refused() {
    let d = Device::open(0).unwrap();
    let a = d.alloc(4096).unwrap();
    let b = d.alloc(4096).unwrap();
    let (lo, hi) = if a.ptr() < b.ptr() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    let dst = d.alloc(1 << 16).unwrap();
    let two_allocs = CopyDesc {
        src: lo.ptr(),
        dst: dst.ptr(),
        width: 256,
        height: 2,
        depth: 1,
        src_pitch: hi.ptr() - lo.ptr(),
        dst_pitch: 256,
        src_rows: 2,
        dst_rows: 2,
    };
    let engine = CopyEngine::new(&d, 1).unwrap();
    // SAFETY: the rows lie in the two live buffers; the driver refuses the copy before it runs.
    let e = unsafe { engine.launch(&[two_allocs], None, None) }.unwrap_err();
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
}

/// A pitched copy whose last row ends exactly at the end of its allocation is accepted, though
/// `pitch * height` bytes from its start run past that end.
#[test]
#[ignore = "needs a GPU"]
fn gpu_pitched_copy_may_end_at_its_allocation_end() {
    let d = Device::open(0).unwrap();
    let size = 2u64 << 20;
    let src = d.alloc(size).unwrap();
    let host = pattern(size as usize, 9);
    src.upload(0, &host).unwrap();
    let dst = d.alloc(4 * 64).unwrap();
    let start = size - (3 * 1024 + 64);
    let desc = CopyDesc {
        src: src.ptr() + start,
        dst: dst.ptr(),
        width: 64,
        height: 4,
        depth: 1,
        src_pitch: 1024,
        dst_pitch: 64,
        src_rows: 4,
        dst_rows: 4,
    };
    let engine = CopyEngine::new(&d, 1).unwrap();
    // SAFETY: every row lies in `src` (the last one ends at its end) and `dst`.
    unsafe { engine.launch(&[desc], None, None) }.unwrap();
    engine.sync().unwrap();
    let mut got = vec![0u8; 256];
    dst.download(0, &mut got).unwrap();
    let want: Vec<u8> = (0..4)
        .flat_map(|r| {
            let s = (start + r * 1024) as usize;
            host[s..s + 64].to_vec()
        })
        .collect();
    assert_eq!(got, want);
}

/// bf16 bits of magnitudes 2^-20 .. 2^6 with random signs, and a zero block at the start.
fn fp8_matrix(rows: usize, cols: usize, seed: u64) -> Vec<u16> {
    let mut s = seed | 1;
    (0..rows * cols)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if i / cols < 128 && i % cols < 128 {
                return 0;
            }
            (((s >> 63) << 15) | ((107 + (s >> 8) % 26) << 7) | (s & 0x7f)) as u16
        })
        .collect()
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_fp8_kernel_gives_the_cpu_references_bytes_in_every_layout() {
    use awex_core::encoding::{Fp8Block, Fp8Quantiser, Recipe, Shape2d};
    let d = Device::open(0).unwrap();
    let k = Fp8Kernel::load(&d).unwrap();
    let s = d.stream().unwrap();
    let grid = Fp8Block::default();
    for (rows, cols) in [(300usize, 520usize), (257, 130), (1, 1000), (1024, 1024)] {
        let x = fp8_matrix(rows, cols, rows as u64 * 31 + cols as u64);
        let [sr, sc] = grid.scale_shape(rows as u64, cols as u64);
        let (sr, sc) = (sr as usize, sc as usize);
        for recipe in [
            Recipe::Vllm,
            Recipe::VllmUe8m0,
            Recipe::DeepGemmUe8m0,
            Recipe::DeepGemmLegacy,
            Recipe::AwexPython,
        ] {
            let enc = recipe.encoding(GPU_BLOCK);
            let mut want = vec![0u8; rows * cols];
            let mut want_s = vec![0f32; sr * sc];
            Fp8Quantiser::new(recipe, enc.clone())
                .quantise(
                    &x,
                    Shape2d::dense(rows, cols),
                    &mut want,
                    cols,
                    &mut want_s,
                    sc,
                )
                .unwrap();
            // (source offset in elements, source padding, destination offset, padding)
            for (soff, spad, doff, dpad) in [(0, 0, 0, 0), (0, 24, 0, 40), (1, 7, 3, 5)] {
                let sp = cols + soff + spad;
                let dp = cols + doff + dpad;
                let mut host = vec![0u8; 2 * rows * sp];
                for r in 0..rows {
                    for c in 0..cols {
                        let b = x[r * cols + c].to_le_bytes();
                        let at = 2 * (r * sp + soff + c);
                        host[at..at + 2].copy_from_slice(&b);
                    }
                }
                let src = d.alloc(host.len() as u64).unwrap();
                src.upload(0, &host).unwrap();
                let dst = d.alloc((rows * dp) as u64).unwrap();
                dst.upload(0, &vec![0xaa; rows * dp]).unwrap();
                let sbuf = d.alloc((4 * sr * (sc + 1)) as u64).unwrap();
                let job = Fp8Job {
                    src: src.ptr() + 2 * soff as u64,
                    dst: dst.ptr() + doff as u64,
                    scales: sbuf.ptr(),
                    rows: rows as u32,
                    cols: cols as u32,
                    src_pitch: 2 * sp as u32,
                    dst_pitch: dp as u32,
                    scale_pitch: sc as u32 + 1,
                };
                // SAFETY: the buffers above hold the rows and scale rows the job describes.
                unsafe { k.quantise(&s, &job, recipe, &enc).unwrap() };
                let mut got = vec![0u8; rows * dp];
                dst.download(0, &mut got).unwrap();
                let mut gs = vec![0u8; 4 * sr * (sc + 1)];
                sbuf.download(0, &mut gs).unwrap();
                for r in 0..rows {
                    let row = &got[r * dp..(r + 1) * dp];
                    assert_eq!(
                        &row[doff..doff + cols],
                        &want[r * cols..(r + 1) * cols],
                        "{recipe} {rows}x{cols} row {r}, source offset {soff} pad {spad}, destination offset {doff} pad {dpad}"
                    );
                    assert!(
                        row[..doff]
                            .iter()
                            .chain(&row[doff + cols..])
                            .all(|&b| b == 0xaa)
                    );
                }
                for br in 0..sr {
                    for bc in 0..sc {
                        let at = 4 * (br * (sc + 1) + bc);
                        let g = f32::from_le_bytes(gs[at..at + 4].try_into().unwrap());
                        assert_eq!(
                            g.to_bits(),
                            want_s[br * sc + bc].to_bits(),
                            "{recipe} scale [{br}, {bc}]"
                        );
                    }
                }
            }
        }
    }
    // a block with infinity is counted and refused
    let mut x = fp8_matrix(256, 256, 5);
    x[200 * 256 + 3] = 0x7f80;
    let src = d.alloc(2 * 256 * 256).unwrap();
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    src.upload(0, &bytes).unwrap();
    let dst = d.alloc(256 * 256).unwrap();
    let sbuf = d.alloc(16).unwrap();
    let job = Fp8Job {
        src: src.ptr(),
        dst: dst.ptr(),
        scales: sbuf.ptr(),
        rows: 256,
        cols: 256,
        src_pitch: 512,
        dst_pitch: 256,
        scale_pitch: 2,
    };
    // SAFETY: as above.
    let e = unsafe { k.quantise(&s, &job, Recipe::Vllm, &grid) }.unwrap_err();
    assert_eq!(e, CudaError::Fp8NonFinite { blocks: 1 });
    assert_eq!(k.take_status(&s).unwrap(), 0);
}

/// Segments for the wire kernels' tests: (element size, base, new), each of every form, odd
/// lengths, empty ones, optimiser steps on bf16 and a few large enough to span many tiles.
fn wire_segments() -> Vec<(usize, Vec<u8>, Vec<u8>)> {
    use delta_wire::tests::{masked, stepped};
    let mut v = vec![];
    for lr in [1e-7, 1e-6, 3e-6, 3e-5] {
        let (b, n) = stepped(128, 1000, lr, 2);
        v.push((2, b, n));
    }
    let mut k = 10u64;
    for (elem, n, f) in [
        (2usize, 0usize, 0.0),
        (1, 4099, 0.003),
        (4, 257, 1.0),
        (2, 1, 1.0),
        (4, 0, 0.0),
        (1, 1_000_003, 0.001),
        (2, 3_000_001, 0.01),
        (4, 700_000, 0.03),
        (2, 600_000, 0.3),
        (2, 255, 0.0),
        (1, 999, 1.0),
    ] {
        k += 1;
        let (b, nw) = masked(n, elem, f, k);
        v.push((elem, b, nw));
    }
    v
}

/// Lays `segs` out in two device buffers (new and base), each segment at an offset that is a
/// multiple of its element size: 256-byte aligned, except every third one (2 or 4 bytes off,
/// so the kernels' unaligned path runs). Returns the buffers and each segment's offset.
fn wire_upload(
    d: &Device,
    segs: &[(usize, Vec<u8>, Vec<u8>)],
) -> (DeviceBuffer, DeviceBuffer, Vec<u64>, usize) {
    let mut offs = vec![];
    let mut at = 0usize;
    for (i, (e, b, _)) in segs.iter().enumerate() {
        at = at.div_ceil(256) * 256 + if i % 3 == 2 { *e.max(&2) } else { 0 };
        offs.push(at as u64);
        at += b.len();
    }
    let total = at.max(16);
    let (mut hn, mut hb) = (vec![0x5au8; total], vec![0x5au8; total]);
    for ((_, b, n), &o) in segs.iter().zip(&offs) {
        hb[o as usize..o as usize + b.len()].copy_from_slice(b);
        hn[o as usize..o as usize + n.len()].copy_from_slice(n);
    }
    let new = d.alloc(total as u64).unwrap();
    let base = d.alloc(total as u64).unwrap();
    new.upload(0, &hn).unwrap();
    base.upload(0, &hb).unwrap();
    (new, base, offs, total)
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_wire_frames_equal_the_host_emulation_and_decode_to_the_new_version() {
    use awex_core::encoding::delta_frame;
    use delta_wire::{WireKernels, WireSegment, WireTable, host};
    let d = Device::open(0).unwrap();
    let k = WireKernels::load(&d).unwrap();
    eprintln!("wire kernels: {}", k.image());
    let s = d.stream().unwrap();
    let segs = wire_segments();
    let (new, base, offs, total) = wire_upload(&d, &segs);
    let table = |dst_is_base: bool| {
        let v: Vec<WireSegment> = segs
            .iter()
            .zip(&offs)
            .map(|((e, b, _), &o)| WireSegment {
                src: if dst_is_base {
                    base.ptr() + o
                } else {
                    new.ptr() + o
                },
                base: if dst_is_base { 0 } else { base.ptr() + o },
                n: (b.len() / e) as u64,
                elem: *e as u32,
            })
            .collect();
        WireTable::new(&v).unwrap()
    };
    let enc = table(false);
    let work = k.prepare(&d, &enc, true).unwrap();
    let frame = d.alloc(work.max_frame_len()).unwrap();
    let news: Vec<&[u8]> = segs.iter().map(|s| s.2.as_slice()).collect();
    let bases: Vec<&[u8]> = segs.iter().map(|s| s.1.as_slice()).collect();
    let (want, want_changed) = host::encode_counted(&enc, &news, &bases);
    let counted: u64 = segs
        .iter()
        .map(|(e, b, n)| delta_wire::tests::count_changed(b, n, *e))
        .sum();
    assert_eq!(want_changed, counted);
    // encode twice: the second run finds no state of the first
    for round in 0..2 {
        frame.fill_u32(0xA5A5_A5A5, &s).unwrap();
        // SAFETY: the table's segments lie in `new` and `base`, the frame holds the longest
        // frame; all live until the sync in finish_encode.
        unsafe { k.launch_encode(&s, &work, frame.ptr()) }.unwrap();
        let (len, changed) = k.finish_encode_counted(&s, &work).unwrap();
        assert_eq!(len, want.len() as u64, "round {round}");
        assert_eq!(changed, want_changed, "round {round}: changed elements");
        let mut got = vec![0u8; len as usize];
        frame.download(0, &mut got).unwrap();
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
            panic!(
                "round {round}: the kernels' frame differs from the emulation's at byte {at} of {len}"
            );
        }
    }
    // a scratch of the caller's: the same frame; one off the 16-byte alignment is refused
    let scratch = d.alloc(work.scratch_bytes() + 16).unwrap();
    frame.fill_u32(0xA5A5_A5A5, &s).unwrap();
    // SAFETY: as above, and the scratch is ours, alive until the sync in finish_encode.
    unsafe { k.launch_encode_in(&s, &work, frame.ptr(), scratch.ptr(), scratch.len()) }.unwrap();
    let (len, changed) = k.finish_encode_counted(&s, &work).unwrap();
    assert_eq!((len, changed), (want.len() as u64, want_changed));
    let mut got = vec![0u8; len as usize];
    frame.download(0, &mut got).unwrap();
    assert!(
        got == want,
        "the frame encoded with the caller's scratch differs"
    );
    // SAFETY: refused before any launch.
    let e =
        unsafe { k.launch_encode_in(&s, &work, frame.ptr(), scratch.ptr() + 4, scratch.len() - 4) }
            .unwrap_err();
    assert!(e.to_string().contains("not 16-byte aligned"), "{e}");
    // the CPU decoder is the judge of the kernels' frame
    let mut cpu: Vec<Vec<u8>> = segs.iter().map(|s| s.1.clone()).collect();
    let mut refs: Vec<&mut [u8]> = cpu.iter_mut().map(|g| g.as_mut_slice()).collect();
    let elems: Vec<usize> = segs.iter().map(|s| s.0).collect();
    delta_frame::apply_frame(&want, &elems, &mut refs).unwrap();
    for (g, s) in cpu.iter().zip(&segs) {
        assert!(g == &s.2);
    }
    // decode on the GPU into the base, in place: the new version, nothing else touched
    let dec = table(true);
    let dwork = k.prepare(&d, &dec, false).unwrap();
    let mut host_new = vec![0u8; total];
    new.download(0, &mut host_new).unwrap();
    let mut host_base = vec![0u8; total];
    base.download(0, &mut host_base).unwrap();
    for round in 0..2 {
        // SAFETY: the destinations lie in `base`, the frame in `frame`; both live until the sync.
        unsafe { k.launch_decode(&s, &dwork, frame.ptr(), want.len() as u64) }.unwrap();
        k.finish_decode(&s, &dwork).unwrap();
        let mut got = vec![0u8; total];
        base.download(0, &mut got).unwrap();
        assert!(
            got == host_new,
            "round {round}: the decoded base is not the new version"
        );
    }
    // a frame with a gaps segment (the CPU encoder's own) is refused before anything is written
    base.upload(0, &host_base).unwrap();
    let view: Vec<(&[u8], &[u8], usize)> = segs
        .iter()
        .map(|(e, b, n)| (b.as_slice(), n.as_slice(), *e))
        .collect();
    let mut gaps = vec![];
    delta_frame::encode_frame(&view, awex_core::encoding::delta::Forms::All, &mut gaps).unwrap();
    let g = delta_frame::frame_tags(&gaps, segs.len())
        .unwrap()
        .iter()
        .position(|&t| t == 3)
        .expect("the CPU encoder picks gaps for some segment");
    let gbuf = d.alloc(gaps.len() as u64).unwrap();
    gbuf.upload(0, &gaps).unwrap();
    // SAFETY: as above.
    unsafe { k.launch_decode(&s, &dwork, gbuf.ptr(), gaps.len() as u64) }.unwrap();
    let e = k.finish_decode(&s, &dwork).unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("segment {g} is a gaps segment (tag 3)")),
        "{e}"
    );
    let mut got = vec![0u8; total];
    base.download(0, &mut got).unwrap();
    assert!(got == host_base, "a refused frame wrote nothing");
    // a malformed frame (lengths not matching) is refused too
    // SAFETY: as above.
    unsafe { k.launch_decode(&s, &dwork, frame.ptr(), want.len() as u64 - 1) }.unwrap();
    let e = k.finish_decode(&s, &dwork).unwrap_err();
    assert!(e.to_string().contains("do not sum"), "{e}");
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_wire_encodes_the_step_kernels_versions_like_the_emulation() {
    use delta_wire::{WireKernels, WireSegment, WireTable, host};
    let d = Device::open(0).unwrap();
    let k = WireKernels::load(&d).unwrap();
    let s = d.stream().unwrap();
    let step = delta::StepKernel::load(&d).unwrap();
    // 40 M bf16 elements in segments of a few sizes, stepped at 1 % on the GPU
    let n = 40usize << 20;
    let host_base = pattern(2 * n, 3);
    let base = d.alloc(2 * n as u64).unwrap();
    let new = d.alloc(2 * n as u64).unwrap();
    base.upload(0, &host_base).unwrap();
    new.upload(0, &host_base).unwrap();
    // SAFETY: `new` holds n bf16 elements, alive until the sync below.
    unsafe { step.launch(&s, new.ptr(), n as u64, 77, 0.01) }.unwrap();
    s.sync().unwrap();
    let mut host_new = vec![0u8; 2 * n];
    new.download(0, &mut host_new).unwrap();
    let sizes = [1usize << 20, 3_000_000, 17, 12 << 20];
    let mut segs = vec![];
    let mut at = 0usize;
    let mut i = 0;
    while at < n {
        let len = sizes[i % sizes.len()].min(n - at);
        segs.push((at, len));
        at += len;
        i += 1;
    }
    let table = WireTable::new(
        &segs
            .iter()
            .map(|&(a, l)| WireSegment {
                src: new.ptr() + 2 * a as u64,
                base: base.ptr() + 2 * a as u64,
                n: l as u64,
                elem: 2,
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let work = k.prepare(&d, &table, true).unwrap();
    let frame = d.alloc(work.max_frame_len()).unwrap();
    // SAFETY: as in the test above.
    unsafe { k.launch_encode(&s, &work, frame.ptr()) }.unwrap();
    let (len, changed) = k.finish_encode_counted(&s, &work).unwrap();
    let news: Vec<&[u8]> = segs
        .iter()
        .map(|&(a, l)| &host_new[2 * a..2 * (a + l)])
        .collect();
    let bases: Vec<&[u8]> = segs
        .iter()
        .map(|&(a, l)| &host_base[2 * a..2 * (a + l)])
        .collect();
    let (want, want_changed) = host::encode_counted(&table, &news, &bases);
    assert_eq!(len, want.len() as u64);
    assert_eq!(
        changed,
        delta_wire::tests::count_changed(&host_base, &host_new, 2),
        "changed elements"
    );
    assert_eq!(changed, want_changed);
    let mut got = vec![0u8; len as usize];
    frame.download(0, &mut got).unwrap();
    assert!(
        got == want,
        "the kernels' frame of the step differs from the emulation's"
    );
    // about 1.5 % of the dense bytes at 1 % of the elements
    let f = len as f64 / (2 * n) as f64;
    assert!((0.01..0.03).contains(&f), "{f}");
}
