//! `awex-cli bench delta-kernel`: the GPU wire kernels (`awex_gpu::cuda::delta_wire`) on a
//! model-sized bf16 buffer.
//!
//! The buffer is a model's bf16 weights (one segment per tensor, in catalogue order: what a
//! sender's frames hold) or `--bytes` of them in 64 MiB segments. For each `--step F` the new
//! version is made on the GPU from the base by the synthetic optimiser step
//! (`awex_step_bf16`: about a fraction F of the elements change by one ulp), then, in one run:
//! a device copy of the buffer (the floor), the encode kernels (new against base into a frame)
//! and the decode kernels (the frame applied to the base in place), each timed as the best of
//! three rounds of `--runs` launches after a warm-up. The encode's rate counts the bytes it
//! reads (2 N: new and base) and the copy's the bytes it moves (N read, N written), so their
//! ratio is the copy's time over the encode's. The encoder's count of changed elements is
//! reported; the decoded base is then re-encoded against the new version on the GPU (every
//! segment unchanged, no element counted) and compared with it byte for byte (downloaded in
//! slices), and it is the base of the next step.

use anyhow::{Context, bail};
use awex_core::dtype::DType;
use awex_core::model::{Catalogue, ModelSpec};
use awex_gpu::cuda::delta::StepKernel;
use awex_gpu::cuda::delta_wire::{WireKernels, WireSegment, WireTable};
use awex_gpu::cuda::{CopyDesc, CopyEngine, Device};
use serde::Serialize;
use std::process::ExitCode;
use std::time::Instant;

/// Arguments of `awex-cli bench delta-kernel`.
#[derive(clap::Args, Debug)]
pub struct DeltaKernelArgs {
    /// Model whose bf16 weights size the buffer (one segment per tensor): a preset, a
    /// config.json or an HF directory.
    #[arg(long, default_value = "qwen3-8b")]
    model: String,
    /// Bytes of the buffer instead of the model's (even; 64 MiB segments).
    #[arg(long)]
    bytes: Option<u64>,
    /// Fractions of the elements the synthetic step changes, comma-separated (0 to 1).
    #[arg(long, default_value = "0,0.001,0.01,0.03,0.3,1")]
    step: String,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// Launches per timed round; three rounds after a warm-up, the best.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    runs: u32,
    /// Seed of the base's contents and of the steps.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// One step's figures.
#[derive(Debug, Serialize)]
struct StepRun {
    /// the fraction the step kernel changes
    step: f64,
    /// bytes of the frame, and over the buffer's
    frame_bytes: u64,
    frame_fraction: f64,
    /// elements whose bytes differ, as the encoder counted them, and over all elements
    changed_elements: u64,
    changed_fraction: f64,
    /// segments by form: dense, sparse, unchanged
    dense_segments: u64,
    sparse_segments: u64,
    unchanged_segments: u64,
    /// device copy of the buffer: ms and (read + written) GB/s
    copy_ms: f64,
    copy_gbps: f64,
    /// encode: ms and GB/s over the bytes it reads (new and base)
    encode_ms: f64,
    encode_read_gbps: f64,
    /// encode rate over copy rate (copy ms / encode ms)
    encode_over_copy: f64,
    /// decode (apply the frame in place): ms
    decode_ms: f64,
    /// the decoded base equals the new version, every byte
    verified: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    image: String,
    model: Option<String>,
    bytes: u64,
    segments: usize,
    runs: u32,
    steps: Vec<StepRun>,
}

/// Segment sizes (elements) of the buffer: the model's bf16 tensors, or `bytes` in 64 MiB.
fn segment_sizes(a: &DeltaKernelArgs) -> anyhow::Result<(Option<String>, Vec<u64>)> {
    if let Some(b) = a.bytes {
        if b == 0 || b % 2 != 0 {
            bail!("--bytes {b}: an even number of bytes (whole bf16 elements), at least 2");
        }
        let seg = 32u64 << 20;
        let n = b / 2;
        let mut v = vec![seg; (n / seg) as usize];
        if n % seg != 0 {
            v.push(n % seg);
        }
        return Ok((None, v));
    }
    let spec = ModelSpec::resolve(&a.model)?;
    let cat = Catalogue::of(&spec);
    let v: Vec<u64> = cat
        .tensors()
        .iter()
        .filter(|t| t.dtype == DType::Bf16)
        .map(|t| t.numel())
        .collect();
    if v.is_empty() {
        bail!("model {}: no bf16 tensor to encode", a.model);
    }
    Ok((Some(spec.name.clone()), v))
}

fn parse_steps(s: &str) -> anyhow::Result<Vec<f64>> {
    let v: Vec<f64> = s
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<f64>()
                .ok()
                .filter(|f| (0.0..=1.0).contains(f))
                .with_context(|| format!("--step `{p}`: a fraction from 0 to 1"))
        })
        .collect::<anyhow::Result<_>>()?;
    if v.is_empty() {
        bail!("--step lists no fraction");
    }
    Ok(v)
}

/// Weights-like bf16 bytes for the base: random sign, magnitudes 2^-14 .. 2^-1.
fn fill_bytes(len: usize, seed: u64, at: u64) -> Vec<u8> {
    (0..len / 2)
        .flat_map(|i| {
            let x = awex_core::weights::splitmix(seed ^ (at / 2 + i as u64));
            let exp = 113 + (x >> 8) % 14;
            ((((x >> 63) << 15) | (exp << 7) | (x & 0x7f)) as u16).to_le_bytes()
        })
        .collect()
}

/// Runs `bench delta-kernel`.
pub fn run(a: DeltaKernelArgs) -> anyhow::Result<ExitCode> {
    let steps = parse_steps(&a.step)?;
    let (model, sizes) = segment_sizes(&a)?;
    let n: u64 = sizes.iter().sum();
    let bytes = 2 * n;
    let dev = Device::open(a.gpu).with_context(
        || "bench delta-kernel runs the GPU wire kernels: it needs a build with `--features cuda` and an NVIDIA GPU",
    )?;
    let kernels = WireKernels::load(&dev)?;
    let step_kernel = StepKernel::load(&dev)?;
    let engine = CopyEngine::new(&dev, 1)?;
    let stream = dev.stream()?;
    let base = dev.alloc(bytes)?;
    let new = dev.alloc(bytes)?;
    let mut segs = vec![];
    let mut at = 0u64;
    for &s in &sizes {
        segs.push(WireSegment {
            src: new.ptr() + 2 * at,
            base: base.ptr() + 2 * at,
            n: s,
            elem: 2,
        });
        at += s;
    }
    let enc_table = WireTable::new(&segs)?;
    let dec_table = WireTable::new(
        &segs
            .iter()
            .map(|s| WireSegment {
                src: s.base,
                base: 0,
                ..*s
            })
            .collect::<Vec<_>>(),
    )?;
    let enc = kernels.prepare(&dev, &enc_table, true)?;
    let dec = kernels.prepare(&dev, &dec_table, false)?;
    let frame = dev.alloc(enc.max_frame_len().max(bytes))?;
    eprintln!(
        "bench delta-kernel: {} bytes in {} segments; device memory {:.1} GB (new, base, frame, scratch)",
        bytes,
        sizes.len(),
        (2 * bytes + frame.len() + enc.bytes() + dec.bytes()) as f64 / 1e9
    );
    // the base: one slice of weights-like bf16 uploaded over the whole buffer (what changes
    // is the step kernel's choice, not the contents)
    let slice = 256u64 << 20;
    let fill = fill_bytes(slice.min(bytes) as usize, a.seed, 0);
    let mut o = 0u64;
    while o < bytes {
        let len = slice.min(bytes - o);
        base.upload(o, &fill[..len as usize])?;
        o += len;
    }
    let mut report = Report {
        device: dev.name()?,
        image: kernels.image().to_string(),
        model,
        bytes,
        segments: sizes.len(),
        runs: a.runs,
        steps: vec![],
    };
    let mut bad = false;
    let whole = [CopyDesc::linear(base.ptr(), new.ptr(), bytes)];
    for (si, &f) in steps.iter().enumerate() {
        // new = base, stepped
        // SAFETY: both buffers hold `bytes` bytes and live until the sync below.
        unsafe { engine.launch(&whole, None, None)? };
        engine.sync()?;
        // SAFETY: `new` holds n bf16 elements.
        unsafe { step_kernel.launch(&stream, new.ptr(), n, a.seed ^ (si as u64 + 1), f)? };
        stream.sync()?;
        // timed: copies of the buffer (new into the frame buffer), encodes, decodes
        let copy = [CopyDesc::linear(new.ptr(), frame.ptr(), bytes)];
        let mut c = f64::MAX;
        for round in 0..4 {
            let t = Instant::now();
            for _ in 0..a.runs {
                // SAFETY: `new` and `frame` hold `bytes` bytes each.
                unsafe { engine.launch(&copy, None, None)? };
            }
            engine.sync()?;
            if round > 0 {
                c = c.min(t.elapsed().as_secs_f64() / a.runs as f64);
            }
        }
        let mut e = f64::MAX;
        for round in 0..4 {
            let t = Instant::now();
            for _ in 0..a.runs {
                // SAFETY: the table's segments lie in `new` and `base`, the frame buffer holds
                // the longest frame; all live until the sync.
                unsafe { kernels.launch_encode(&stream, &enc, frame.ptr())? };
            }
            stream.sync()?;
            if round > 0 {
                e = e.min(t.elapsed().as_secs_f64() / a.runs as f64);
            }
        }
        let (len, changed) = kernels.finish_encode_counted(&stream, &enc)?;
        // the forms the frame holds (its header and tags)
        let mut head = vec![0u8; 4 + 4 * sizes.len()];
        frame.download(0, &mut head)?;
        let (mut forms, mut off) = ([0u64; 3], head.len() as u64);
        for i in 0..sizes.len() {
            let l = u32::from_le_bytes(head[4 + 4 * i..8 + 4 * i].try_into()?) as u64;
            let mut t = [0u8; 1];
            frame.download(off, &mut t)?;
            forms[(t[0] as usize).min(2)] += 1;
            off += l;
        }
        if off != len {
            bail!("step {f}: the frame's lengths sum to {off} bytes, the encoder reported {len}");
        }
        // decode into the base (idempotent: every run writes the same bytes)
        let mut d = f64::MAX;
        for round in 0..4 {
            let t = Instant::now();
            for _ in 0..a.runs {
                // SAFETY: the destinations lie in `base`, the frame in `frame`.
                unsafe { kernels.launch_decode(&stream, &dec, frame.ptr(), len)? };
            }
            stream.sync()?;
            if round > 0 {
                d = d.min(t.elapsed().as_secs_f64() / a.runs as f64);
            }
            if round == 0 {
                kernels.finish_decode(&stream, &dec)?;
            }
        }
        kernels.finish_decode(&stream, &dec)?;
        // the decoded base against the new version: re-encoded on the device (every segment
        // must come out unchanged), then every byte on the host
        // SAFETY: as above.
        unsafe { kernels.launch_encode(&stream, &enc, frame.ptr())? };
        let (again, changed_again) = kernels.finish_encode_counted(&stream, &enc)?;
        let unchanged = (4 + 5 * sizes.len()) as u64;
        if again != unchanged || changed_again != 0 {
            eprintln!(
                "step {f}: the decoded base re-encodes to {again} bytes ({changed_again} elements changed) against the new version, not {unchanged} (all unchanged)"
            );
        }
        // every byte: the decoded base against the new version
        let mut verified = again == unchanged && changed_again == 0;
        let mut o = 0u64;
        let (mut x, mut y) = (vec![], vec![]);
        while o < bytes {
            let l = slice.min(bytes - o) as usize;
            x.resize(l, 0);
            y.resize(l, 0);
            base.download(o, &mut x)?;
            new.download(o, &mut y)?;
            if x != y {
                verified = false;
                let at = x.iter().zip(&y).position(|(p, q)| p != q).unwrap_or(0);
                eprintln!(
                    "step {f}: the decoded base differs from the new version at byte {}",
                    o + at as u64
                );
                break;
            }
            o += l as u64;
        }
        bad |= !verified;
        report.steps.push(StepRun {
            step: f,
            frame_bytes: len,
            frame_fraction: len as f64 / bytes as f64,
            changed_elements: changed,
            changed_fraction: changed as f64 / n as f64,
            dense_segments: forms[0],
            sparse_segments: forms[1],
            unchanged_segments: forms[2],
            copy_ms: c * 1e3,
            copy_gbps: 2.0 * bytes as f64 / c / 1e9,
            encode_ms: e * 1e3,
            encode_read_gbps: 2.0 * bytes as f64 / e / 1e9,
            encode_over_copy: c / e,
            decode_ms: d * 1e3,
            verified,
        });
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

fn print_table(r: &Report) {
    println!(
        "bench delta-kernel: {} ({}), {} bytes of bf16 in {} segments{}, best of 3 rounds of {} launches",
        r.device,
        r.image,
        r.bytes,
        r.segments,
        r.model
            .as_ref()
            .map_or(String::new(), |m| format!(" ({m})")),
        r.runs
    );
    println!(
        "{:>6} {:>9} {:>12} {:>8} {:>11} {:>9} {:>10} {:>9} {:>12} {:>7} {:>9} {:>8}",
        "step",
        "changed %",
        "frame B",
        "frame %",
        "d/s/u segs",
        "copy ms",
        "copy GB/s",
        "enc ms",
        "enc read GB/s",
        "ratio",
        "dec ms",
        "verified"
    );
    for s in &r.steps {
        println!(
            "{:>6} {:>9.3} {:>12} {:>8.3} {:>11} {:>9.3} {:>10.0} {:>9.3} {:>12.0} {:>7.3} {:>9.3} {:>8}",
            s.step,
            100.0 * s.changed_fraction,
            s.frame_bytes,
            100.0 * s.frame_fraction,
            format!(
                "{}/{}/{}",
                s.dense_segments, s.sparse_segments, s.unchanged_segments
            ),
            s.copy_ms,
            s.copy_gbps,
            s.encode_ms,
            s.encode_read_gbps,
            s.encode_over_copy,
            s.decode_ms,
            s.verified
        );
    }
    println!(
        "copy GB/s: bytes read + written; enc read GB/s: new + base read by the encoder; ratio = copy ms / enc ms (the encode's read rate over the copy's rate)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(bytes: Option<u64>, step: &str) -> DeltaKernelArgs {
        DeltaKernelArgs {
            model: "qwen3-8b".into(),
            bytes,
            step: step.into(),
            gpu: 0,
            runs: 1,
            seed: 1,
            json: true,
        }
    }

    #[test]
    fn sizes_and_steps_parse_and_bad_ones_name_the_fault() {
        let (m, v) = segment_sizes(&args(None, "0")).unwrap();
        assert_eq!(m.as_deref(), Some("qwen3-8b"));
        // qwen3-8b: about 8.19e9 bf16 elements
        let n: u64 = v.iter().sum();
        assert!((8.0e9..8.4e9).contains(&(n as f64)), "{n}");
        let (_, v) = segment_sizes(&args(Some((64 << 20) + 6), "0")).unwrap();
        assert_eq!(v, vec![32 << 20, 3]);
        assert!(
            segment_sizes(&args(Some(3), "0"))
                .unwrap_err()
                .to_string()
                .contains("even number")
        );
        assert_eq!(parse_steps("0, 0.01,1").unwrap(), vec![0.0, 0.01, 1.0]);
        assert!(
            parse_steps("2")
                .unwrap_err()
                .to_string()
                .contains("from 0 to 1")
        );
        assert!(
            parse_steps("")
                .unwrap_err()
                .to_string()
                .contains("no fraction")
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_a_gpu_build_it_says_so_and_fails() {
        let e = run(args(Some(1 << 20), "0.01")).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("needs a build with `--features cuda`"),
            "{msg}"
        );
    }
}
