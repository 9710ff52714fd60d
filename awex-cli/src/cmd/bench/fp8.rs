//! `awex-cli bench fp8`: the block-FP8 quantisers on random bf16 weights of model shapes.
//!
//! For each shape it quantises one random matrix with awex's CPU reference (timed against a
//! single-thread memcpy floor of the same bytes) and, unless `--cpu-only`, with the GPU kernel
//! (`awex_gpu::cuda::fp8`), compares every e4m3 byte and scale of the two, and times the
//! kernel against a device-to-device copy of the bf16 bytes measured in the same run (both as
//! bytes read plus bytes written per second). `--dump DIR` writes each matrix and both
//! quantisations for `scripts/gpu_fp8_check.sh` to compare with torch.

use crate::cmd::demo::memcpy_gbps;
use anyhow::{Context, bail};
use awex_core::encoding::{Fp8Quantiser, Recipe, Shape2d};
use awex_gpu::cuda::{CopyDesc, CopyEngine, Device, Fp8Job, Fp8Kernel, GPU_BLOCK};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// Arguments of `awex-cli bench fp8`.
#[derive(clap::Args, Debug)]
pub struct Fp8Args {
    /// Shapes, comma-separated: `ROWSxCOLS` or `qwen3-8b` (one layer's fused qkv, o, gate_up
    /// and down projections).
    #[arg(long, default_value = "4096x4096,qwen3-8b")]
    shapes: String,
    /// The quantiser (vllm, deepgemm-ue8m0, deepgemm-legacy, awex-python on the GPU; any on the CPU).
    #[arg(long, default_value = "vllm")]
    recipe: String,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// Kernel launches (and copies) per timed round; three rounds after a warm-up, the best.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    runs: u32,
    /// Quantise on the CPU only (no GPU needed).
    #[arg(long)]
    cpu_only: bool,
    /// Seed of the random matrices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write `NAME.bf16`, `NAME.cpu.e4m3`, `NAME.cpu.scales` (and `.gpu.` ones) and
    /// `manifest.json` here.
    #[arg(long)]
    dump: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// One shape's results.
#[derive(Debug, Serialize)]
struct ShapeRun {
    name: String,
    rows: usize,
    cols: usize,
    /// CPU quantisation, ms, and its read + write bandwidth, GB/s.
    cpu_ms: f64,
    cpu_gbps: f64,
    /// GPU kernel, ms (best round's mean), and its read + write bandwidth, GB/s.
    gpu_ms: Option<f64>,
    gpu_gbps: Option<f64>,
    /// Device copy of the bf16 bytes, ms (best round's mean), read + write GB/s.
    copy_ms: Option<f64>,
    copy_gbps: Option<f64>,
    /// Kernel bandwidth over copy bandwidth.
    gpu_over_copy: Option<f64>,
    /// e4m3 bytes and scales where GPU and CPU differ.
    e4m3_mismatches: Option<u64>,
    scale_mismatches: Option<u64>,
    /// The batch kernel (`fp8_table.ptx`, what an update launches) over the same matrix: ms,
    /// read + write GB/s, that over the copy's rate, and its mismatches with the CPU.
    batch_ms: Option<f64>,
    batch_gbps: Option<f64>,
    batch_over_copy: Option<f64>,
    batch_mismatches: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Report {
    recipe: String,
    /// Single-thread memcpy, GB/s copied (read + write: twice this).
    memcpy_gbps: f64,
    shapes: Vec<ShapeRun>,
}

fn parse_shapes(s: &str) -> anyhow::Result<Vec<(String, usize, usize)>> {
    let mut out = vec![];
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part == "qwen3-8b" {
            // hidden 4096, 32 query and 8 KV heads of 128, intermediate 12288
            for (n, r, c) in [
                ("qwen3-8b.qkv", 6144, 4096),
                ("qwen3-8b.o", 4096, 4096),
                ("qwen3-8b.gate_up", 24576, 4096),
                ("qwen3-8b.down", 4096, 12288),
            ] {
                out.push((n.to_string(), r, c));
            }
            continue;
        }
        let Some((r, c)) = part.split_once('x') else {
            bail!("shape `{part}`: expected ROWSxCOLS (e.g. 4096x4096) or qwen3-8b");
        };
        let (r, c): (usize, usize) = (
            r.parse().with_context(|| format!("shape `{part}`: rows"))?,
            c.parse()
                .with_context(|| format!("shape `{part}`: columns"))?,
        );
        if r == 0 || c == 0 || r > 1 << 20 || c > 1 << 20 || r * c > 1 << 31 {
            bail!("shape `{part}`: rows and columns from 1 to 1048576, at most 2^31 elements");
        }
        out.push((part.to_string(), r, c));
    }
    if out.is_empty() {
        bail!("--shapes lists no shape");
    }
    Ok(out)
}

/// Weights-like bf16: random sign, magnitudes 2^-14 .. 2^-1 (xorshift64*).
fn random_bf16(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let x = s.wrapping_mul(0x2545_F491_4F6C_DD1D);
            let exp = 113 + (x >> 8) % 14;
            (((x >> 63) << 15) | (exp << 7) | (x & 0x7f)) as u16
        })
        .collect()
}

fn bytes_of_u16(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_of_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Runs `bench fp8`.
pub fn run(a: Fp8Args) -> anyhow::Result<ExitCode> {
    let recipe: Recipe = a.recipe.parse()?;
    let enc = recipe.encoding(GPU_BLOCK);
    let shapes = parse_shapes(&a.shapes)?;
    if let Some(d) = &a.dump {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let gpu = if a.cpu_only {
        None
    } else {
        let dev = Device::open(a.gpu)?;
        let kernel = Fp8Kernel::load(&dev)?;
        let engine = CopyEngine::new(&dev, 1)?;
        let stream = dev.stream()?;
        Some((dev, kernel, engine, stream))
    };
    let quant = Fp8Quantiser::new(recipe, enc.clone());
    let mut report = Report {
        recipe: recipe.to_string(),
        memcpy_gbps: memcpy_gbps(),
        shapes: vec![],
    };
    let mut manifest = vec![];
    let mut bad = false;
    for (i, (name, rows, cols)) in shapes.into_iter().enumerate() {
        let n = rows * cols;
        let x = random_bf16(n, a.seed.wrapping_add(i as u64));
        let [sr, sc] = enc.scale_shape(rows as u64, cols as u64);
        let ns = (sr * sc) as usize;
        let mut q = vec![0u8; n];
        let mut s = vec![0f32; ns];
        let t = Instant::now();
        quant.quantise(
            &x,
            Shape2d::dense(rows, cols),
            &mut q,
            cols,
            &mut s,
            sc as usize,
        )?;
        let cpu_s = t.elapsed().as_secs_f64();
        let moved = (3 * n + 4 * ns) as f64;
        let mut run = ShapeRun {
            name: name.clone(),
            rows,
            cols,
            cpu_ms: cpu_s * 1e3,
            cpu_gbps: moved / cpu_s / 1e9,
            gpu_ms: None,
            gpu_gbps: None,
            copy_ms: None,
            copy_gbps: None,
            gpu_over_copy: None,
            e4m3_mismatches: None,
            scale_mismatches: None,
            batch_ms: None,
            batch_gbps: None,
            batch_over_copy: None,
            batch_mismatches: None,
        };
        let mut gq = vec![];
        let mut gs = vec![];
        if let Some((dev, kernel, engine, stream)) = &gpu {
            let src = dev.alloc(2 * n as u64)?;
            let dst = dev.alloc(n as u64)?;
            let sbuf = dev.alloc(4 * ns as u64)?;
            let copy_dst = dev.alloc(2 * n as u64)?;
            src.upload(0, &bytes_of_u16(&x))?;
            let job = Fp8Job {
                src: src.ptr(),
                dst: dst.ptr(),
                scales: sbuf.ptr(),
                rows: rows as u32,
                cols: cols as u32,
                src_pitch: 2 * cols as u32,
                dst_pitch: cols as u32,
                scale_pitch: sc as u32,
            };
            // SAFETY: the three buffers above hold exactly the matrix, its bytes and scales.
            unsafe { kernel.quantise(stream, &job, recipe, &enc)? };
            gq = vec![0u8; n];
            let mut sb = vec![0u8; 4 * ns];
            dst.download(0, &mut gq)?;
            sbuf.download(0, &mut sb)?;
            gs = sb
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let e4m3_bad = gq.iter().zip(&q).filter(|(g, c)| g != c).count() as u64;
            let scale_bad = gs
                .iter()
                .zip(&s)
                .filter(|(g, c)| g.to_bits() != c.to_bits())
                .count() as u64;
            bad |= e4m3_bad != 0 || scale_bad != 0;
            run.e4m3_mismatches = Some(e4m3_bad);
            run.scale_mismatches = Some(scale_bad);
            // timed: `runs` kernel launches back to back, then as many device copies of the bf16
            // bytes; three rounds after a warm-up, the best round of each
            let copy = [CopyDesc::linear(src.ptr(), copy_dst.ptr(), 2 * n as u64)];
            let (mut k, mut c) = (f64::MAX, f64::MAX);
            for round in 0..4 {
                let t = Instant::now();
                for _ in 0..a.runs {
                    // SAFETY: as above.
                    unsafe { kernel.launch(stream, &job, recipe, &enc)? };
                }
                stream.sync()?;
                let kr = t.elapsed().as_secs_f64() / a.runs as f64;
                let t = Instant::now();
                for _ in 0..a.runs {
                    // SAFETY: both ranges are live buffers of 2n bytes.
                    unsafe { engine.launch(&copy, None, None)? };
                }
                engine.sync()?;
                let cr = t.elapsed().as_secs_f64() / a.runs as f64;
                if round > 0 {
                    k = k.min(kr);
                    c = c.min(cr);
                }
            }
            run.gpu_ms = Some(k * 1e3);
            run.gpu_gbps = Some(moved / k / 1e9);
            run.copy_ms = Some(c * 1e3);
            run.copy_gbps = Some(4.0 * n as f64 / c / 1e9);
            run.gpu_over_copy = Some((moved / k) / (4.0 * n as f64 / c));
            if kernel.take_status(stream)? != 0 {
                bail!("{name}: the kernel saw non-finite blocks in finite random input");
            }
            // the batch kernel: same bytes into fresh buffers, then timed as above
            let bdst = dev.alloc(n as u64)?;
            let bs = dev.alloc(4 * ns as u64)?;
            let bjob = Fp8Job {
                dst: bdst.ptr(),
                scales: bs.ptr(),
                ..job
            };
            let batch = kernel.batch(&[bjob], &enc)?;
            // SAFETY: as above, into the batch's own buffers.
            unsafe { kernel.launch_batch(stream, &batch, recipe, &enc)? };
            stream.sync()?;
            let mut bq = vec![0u8; n];
            let mut bsb = vec![0u8; 4 * ns];
            bdst.download(0, &mut bq)?;
            bs.download(0, &mut bsb)?;
            let want_s = bytes_of_f32(&s);
            let mism = (bq.iter().zip(&q).filter(|(g, c)| g != c).count()
                + bsb.iter().zip(&want_s).filter(|(g, c)| g != c).count())
                as u64;
            bad |= mism != 0;
            run.batch_mismatches = Some(mism);
            let mut b = f64::MAX;
            for round in 0..4 {
                let t = Instant::now();
                for _ in 0..a.runs {
                    // SAFETY: as above.
                    unsafe { kernel.launch_batch(stream, &batch, recipe, &enc)? };
                }
                stream.sync()?;
                if round > 0 {
                    b = b.min(t.elapsed().as_secs_f64() / a.runs as f64);
                }
            }
            run.batch_ms = Some(b * 1e3);
            run.batch_gbps = Some(moved / b / 1e9);
            run.batch_over_copy = Some((moved / b) / (4.0 * n as f64 / c));
            if kernel.take_batch_status(stream)?.blocks != 0 {
                bail!("{name}: the batch kernel saw non-finite blocks in finite random input");
            }
        }
        if let Some(d) = &a.dump {
            let file = |suffix: &str| d.join(format!("{name}.{suffix}"));
            std::fs::write(file("bf16"), bytes_of_u16(&x))?;
            std::fs::write(file("cpu.e4m3"), &q)?;
            std::fs::write(file("cpu.scales"), bytes_of_f32(&s))?;
            if !gq.is_empty() {
                std::fs::write(file("gpu.e4m3"), &gq)?;
                std::fs::write(file("gpu.scales"), bytes_of_f32(&gs))?;
            }
            manifest.push(serde_json::json!({"name": name, "rows": rows, "cols": cols}));
        }
        report.shapes.push(run);
    }
    if let Some(d) = &a.dump {
        let m =
            serde_json::json!({"recipe": recipe.name(), "block": enc.block, "matrices": manifest});
        std::fs::write(d.join("manifest.json"), serde_json::to_vec_pretty(&m)?)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(if bad {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.digits$}"))
}

fn print_table(r: &Report) {
    println!(
        "bench fp8: recipe {}, memcpy floor {:.1} GB/s (read + write {:.1} GB/s, one thread)",
        r.recipe,
        r.memcpy_gbps,
        2.0 * r.memcpy_gbps
    );
    println!(
        "{:<18} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>12}",
        "shape",
        "rows",
        "cols",
        "cpu ms",
        "cpu GB/s",
        "gpu ms",
        "gpu GB/s",
        "copy ms",
        "copy GB/s",
        "ratio",
        "mismatches"
    );
    for s in &r.shapes {
        let mism = match (s.e4m3_mismatches, s.scale_mismatches) {
            (Some(e), Some(c)) => format!("{e}/{c}"),
            _ => "-".into(),
        };
        println!(
            "{:<18} {:>7} {:>7} {:>9.2} {:>9.2} {:>9} {:>9} {:>9} {:>9} {:>7} {:>12}",
            s.name,
            s.rows,
            s.cols,
            s.cpu_ms,
            s.cpu_gbps,
            opt(s.gpu_ms, 3),
            opt(s.gpu_gbps, 0),
            opt(s.copy_ms, 3),
            opt(s.copy_gbps, 0),
            opt(s.gpu_over_copy, 2),
            mism
        );
    }
    println!(
        "GB/s are bytes read + bytes written per second; ratio = gpu GB/s / copy GB/s; mismatches = e4m3 bytes / scales where GPU and CPU differ"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_name_the_fault() {
        let s = parse_shapes("4096x4096,qwen3-8b").unwrap();
        assert_eq!(s.len(), 5);
        assert_eq!(s[3], ("qwen3-8b.gate_up".to_string(), 24576, 4096));
        assert!(
            parse_shapes("4096")
                .unwrap_err()
                .to_string()
                .contains("expected ROWSxCOLS")
        );
        assert!(
            parse_shapes("0x5")
                .unwrap_err()
                .to_string()
                .contains("from 1 to 1048576")
        );
        assert!(
            parse_shapes("")
                .unwrap_err()
                .to_string()
                .contains("no shape")
        );
    }

    #[test]
    fn cpu_only_runs_and_dumps_what_the_torch_check_reads() {
        let d = tempfile::tempdir().unwrap();
        let args = Fp8Args {
            shapes: "130x260".into(),
            recipe: "vllm".into(),
            gpu: 0,
            runs: 1,
            cpu_only: true,
            seed: 1,
            dump: Some(d.path().to_path_buf()),
            json: true,
        };
        assert_eq!(run(args).unwrap(), ExitCode::SUCCESS);
        assert_eq!(
            std::fs::read(d.path().join("130x260.bf16")).unwrap().len(),
            2 * 130 * 260
        );
        assert_eq!(
            std::fs::read(d.path().join("130x260.cpu.e4m3"))
                .unwrap()
                .len(),
            130 * 260
        );
        assert_eq!(
            std::fs::read(d.path().join("130x260.cpu.scales"))
                .unwrap()
                .len(),
            4 * 2 * 3
        );
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join("manifest.json")).unwrap())
                .unwrap();
        assert_eq!(m["recipe"], "vllm");
        assert_eq!(m["matrices"][0]["cols"], 260);
    }
}
