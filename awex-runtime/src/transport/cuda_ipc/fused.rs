//! FP8 blocks quantised straight out of a training peer's memory: the geometry that turns a
//! planned transfer into FP8 tensor `X` into kernel jobs (`awex_gpu::cuda::Fp8Job`) reading the
//! peer's bf16 where it lies and writing `X`'s e4m3 bytes and `X_scale_inv` where they lie.
//!
//! A transfer can be fused when its box covers whole blocks of the destination matrix (its two
//! trailing dims start on a block boundary and end on one or at the matrix's edge): each of
//! those blocks then has all its elements in this one box of this one sender, so the kernel can
//! take its amax and write its scale without any other piece (each destination byte is written
//! once). An FP8 tensor is fused only when every transfer into it can be (`EncodingTransport`
//! decides from the plan); its other tensors go through the receiver's bf16 staging.

use awex_core::dims::Dims;
use awex_core::dtype::DType;
use awex_core::encoding::Fp8Block;
use awex_core::plan::Transfer;
use awex_gpu::cuda::Fp8Job;
use std::sync::Arc;

/// Where an FP8 engine tensor's bytes lie on the receiver's GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Target {
    /// first e4m3 byte
    pub dst: u64,
    /// first fp32 scale
    pub scales: u64,
    /// the tensor's shape (a matrix or a stack of them)
    pub shape: Dims,
}

/// Whether the box of `t` covers whole `encoding` blocks of its destination matrix, out of a
/// bf16 source, with sizes one kernel job takes: the kernel can quantise it from the sender's
/// memory alone.
pub fn fusable(t: &Transfer, encoding: &Fp8Block) -> bool {
    let (e, d, o) = (
        t.extent.as_slice(),
        t.dst_shape.as_slice(),
        t.dst_offset.as_slice(),
    );
    let (k, nd, ns) = (e.len(), d.len(), t.src_shape.ndim());
    if k < 2 || nd < k || ns < k || o.len() != nd || t.src_offset.ndim() != ns {
        return false;
    }
    if t.src_dtype != DType::Bf16 || t.dst_dtype != DType::Bf16 {
        return false;
    }
    let whole = |dim: usize, edim: usize, block: u32| {
        let (b, at, n, size) = (block as u64, o[dim], e[edim], d[dim]);
        b > 0 && at % b == 0 && ((at + n) % b == 0 || at + n == size)
    };
    let fits = |x: u64| x <= u32::MAX as u64;
    whole(nd - 2, k - 2, encoding.block[0])
        && whole(nd - 1, k - 1, encoding.block[1])
        && fits(e[k - 2])
        && fits(e[k - 1])
        && fits(2 * t.src_shape.as_slice()[ns - 1])
        && fits(d[nd - 1])
}

/// Element offset of `at` (one index per dim) in a dense row-major `shape`.
fn offset(shape: &[u64], at: &[u64]) -> u64 {
    shape.iter().zip(at).fold(0u64, |acc, (&n, &i)| acc * n + i)
}

/// The kernel jobs of a [`fusable`] transfer `t` whose source tensor starts at `src` (the
/// receiver's address of the sender's bf16 tensor) into `target`: one per matrix of its box.
/// `None` when `t` is not fusable.
pub fn fused_jobs(
    t: &Transfer,
    src: u64,
    target: &Fp8Target,
    encoding: &Fp8Block,
) -> Option<Vec<Fp8Job>> {
    if !fusable(t, encoding) || target.shape != t.dst_shape {
        return None;
    }
    let (e, s, d) = (
        t.extent.as_slice(),
        t.src_shape.as_slice(),
        t.dst_shape.as_slice(),
    );
    let (k, ns, nd) = (e.len(), s.len(), d.len());
    let (rows, cols) = (d[nd - 2], d[nd - 1]);
    let [sr, sc] = encoding.scale_shape(rows, cols);
    let (bn, bk) = (encoding.block[0] as u64, encoding.block[1] as u64);
    let lead: u64 = e[..k - 2].iter().product();
    let mut jobs = Vec::with_capacity(lead as usize);
    let mut si = t.src_offset.as_slice().to_vec();
    let mut di = t.dst_offset.as_slice().to_vec();
    for m in 0..lead {
        // the m-th matrix of the box: its leading indices, innermost fastest
        let mut rest = m;
        for j in (0..k - 2).rev() {
            let x = rest % e[j];
            rest /= e[j];
            si[ns - k + j] = t.src_offset.as_slice()[ns - k + j] + x;
            di[nd - k + j] = t.dst_offset.as_slice()[nd - k + j] + x;
        }
        let src_el = offset(s, &si);
        let dst_el = offset(d, &di);
        // the destination matrix and the box's first block in it
        let mat = dst_el / (rows * cols);
        let (r0, c0) = (di[nd - 2], di[nd - 1]);
        let scale_el = mat * sr * sc + (r0 / bn) * sc + c0 / bk;
        jobs.push(Fp8Job {
            src: src + 2 * src_el,
            dst: target.dst + dst_el,
            scales: target.scales + 4 * scale_el,
            rows: e[k - 2] as u32,
            cols: e[k - 1] as u32,
            src_pitch: (2 * s[ns - 1]) as u32,
            dst_pitch: cols as u32,
            scale_pitch: sc as u32,
        });
    }
    Some(jobs)
}

/// Joins back-to-back jobs of one destination tensor into one job, the way copies of a layer's
/// experts are joined: job `b` continues job `a` when `a` ends on a block-row boundary and
/// `b`'s rows, e4m3 rows and scale rows start right after `a`'s at the same pitches and width
/// (the next expert of a stack, read out of a sender that holds the experts back to back), and
/// `same_source(start, end)` says the joined source bytes lie in one allocation. No block of
/// the joined job mixes the two, so every byte and scale is what the two jobs write. `names`
/// holds each job's destination tensor (kept aligned).
pub fn join_jobs(
    jobs: Vec<Fp8Job>,
    names: Vec<Arc<str>>,
    encoding: &Fp8Block,
    mut same_source: impl FnMut(u64, u64) -> bool,
) -> (Vec<Fp8Job>, Vec<Arc<str>>) {
    let bn = encoding.block[0] as u64;
    let mut out: Vec<Fp8Job> = Vec::with_capacity(jobs.len());
    let mut out_names: Vec<Arc<str>> = Vec::with_capacity(names.len());
    for (b, name) in jobs.into_iter().zip(names) {
        if let (Some(a), Some(an)) = (out.last_mut(), out_names.last())
            && *an == name
            && bn > 0
            && (a.cols, a.src_pitch, a.dst_pitch, a.scale_pitch)
                == (b.cols, b.src_pitch, b.dst_pitch, b.scale_pitch)
            && a.rows as u64 % bn == 0
            && a.rows as u64 + b.rows as u64 <= u32::MAX as u64
        {
            let rows = a.rows as u64;
            let src_end = b.src + b.rows as u64 * b.src_pitch as u64;
            if b.src == a.src + rows * a.src_pitch as u64
                && b.dst == a.dst + rows * a.dst_pitch as u64
                && b.scales == a.scales + 4 * (rows / bn) * a.scale_pitch as u64
                && same_source(a.src, src_end)
            {
                a.rows += b.rows;
                continue;
            }
        }
        out.push(b);
        out_names.push(name);
    }
    (out, out_names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use awex_core::layout::RankId;
    use std::sync::Arc;

    fn transfer(src: (&[u64], &[u64]), dst: (&[u64], &[u64]), extent: &[u64]) -> Transfer {
        Transfer {
            src_rank: RankId::train(0),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: Arc::from("w"),
            src_shape: Dims::new(src.0),
            src_offset: Dims::new(src.1),
            src_dtype: DType::Bf16,
            dst_tensor: Arc::from("q"),
            dst_shape: Dims::new(dst.0),
            dst_offset: Dims::new(dst.1),
            dst_dtype: DType::Bf16,
            extent: Dims::new(extent),
            encode: None,
            transposed: false,
        }
    }

    const BLOCK: Fp8Block = Fp8Block {
        block: [128, 128],
        scale_format: awex_core::encoding::ScaleFormat::F32,
    };

    #[test]
    fn boxes_of_whole_blocks_fuse_and_cut_blocks_do_not() {
        // Megatron's query group rows into SGLang's qkv_proj: 512 rows at row 1024
        let t = transfer(
            (&[1536, 4096], &[512, 0]),
            (&[6144, 4096], &[1024, 0]),
            &[512, 4096],
        );
        assert!(fusable(&t, &BLOCK));
        // ends at the matrix's edge, not on a block boundary: still whole blocks
        let edge = transfer((&[200, 300], &[0, 0]), (&[200, 300], &[0, 0]), &[200, 300]);
        assert!(fusable(&edge, &BLOCK));
        // an FSDP chunk cutting block rows: 100 rows
        let cut = transfer((&[100, 256], &[0, 0]), (&[256, 256], &[0, 0]), &[100, 256]);
        assert!(!fusable(&cut, &BLOCK));
        // starting off a block column
        let off = transfer(
            (&[128, 256], &[0, 64]),
            (&[128, 256], &[0, 64]),
            &[128, 192],
        );
        assert!(!fusable(&off, &BLOCK));
        // f32 sources go through the staging
        let mut f = t.clone();
        (f.src_dtype, f.dst_dtype) = (DType::F32, DType::F32);
        assert!(!fusable(&f, &BLOCK));
        // a 1-D box never
        let row = transfer((&[4096], &[0]), (&[1, 4096], &[0, 0]), &[4096]);
        assert!(!fusable(&row, &BLOCK));
    }

    #[test]
    fn jobs_read_the_senders_rows_and_write_the_box_and_its_scales() {
        let t = transfer(
            (&[1536, 4096], &[512, 0]),
            (&[6144, 4096], &[1024, 0]),
            &[512, 4096],
        );
        let target = Fp8Target {
            dst: 1 << 40,
            scales: 1 << 41,
            shape: Dims::new(&[6144, 4096]),
        };
        let jobs = fused_jobs(&t, 1 << 30, &target, &BLOCK).unwrap();
        assert_eq!(
            jobs,
            vec![Fp8Job {
                src: (1 << 30) + 2 * 512 * 4096,
                dst: (1 << 40) + 1024 * 4096,
                // block row 8 of 48, 32 block columns
                scales: (1 << 41) + 4 * 8 * 32,
                rows: 512,
                cols: 4096,
                src_pitch: 8192,
                dst_pitch: 4096,
                scale_pitch: 32,
            }]
        );
        // a shape other than the target's is refused
        let other = Fp8Target {
            shape: Dims::new(&[6144, 2048]),
            ..target
        };
        assert!(fused_jobs(&t, 0, &other, &BLOCK).is_none());
    }

    #[test]
    fn a_stack_of_experts_is_one_job_per_matrix_at_its_scales() {
        // experts 2..4 of a [8, 256, 384] stack from a sender's [4, 256, 512] (columns 128..)
        let t = transfer(
            (&[4, 256, 512], &[1, 0, 128]),
            (&[8, 256, 384], &[2, 0, 0]),
            &[2, 256, 384],
        );
        let target = Fp8Target {
            dst: 0,
            scales: 0,
            shape: Dims::new(&[8, 256, 384]),
        };
        let jobs = fused_jobs(&t, 0, &target, &BLOCK).unwrap();
        assert_eq!(jobs.len(), 2);
        for (i, j) in jobs.iter().enumerate() {
            let (se, de) = ((1 + i as u64) * 256 * 512 + 128, (2 + i as u64) * 256 * 384);
            assert_eq!((j.src, j.dst), (2 * se, de));
            // [2, 3] scales per expert
            assert_eq!(j.scales, 4 * (2 + i as u64) * 6);
            assert_eq!(
                (j.rows, j.cols, j.src_pitch, j.dst_pitch),
                (256, 384, 1024, 384)
            );
            assert_eq!(j.scale_pitch, 3);
        }
    }

    /// A block's scale address and its rows: (source row, e4m3 row, width).
    type BlockRows = (u64, Vec<(u64, u64, u64)>);

    /// What each block of `jobs` reads and writes: (scale address, [(source row, e4m3 row,
    /// width)]) for every 128 x 128 block, sorted: two job lists with the same blocks write the
    /// same bytes and scales from the same elements.
    fn blocks(jobs: &[Fp8Job]) -> Vec<BlockRows> {
        let mut out = Vec::new();
        for j in jobs {
            let (gx, gy) = j.grid();
            for by in 0..gy as u64 {
                for bx in 0..gx as u64 {
                    let rows = (by * 128..((by + 1) * 128).min(j.rows as u64)).map(|r| {
                        let c0 = bx * 128;
                        let w = (j.cols as u64 - c0).min(128);
                        (
                            j.src + r * j.src_pitch as u64 + 2 * c0,
                            j.dst + r * j.dst_pitch as u64 + c0,
                            w,
                        )
                    });
                    out.push((
                        j.scales + 4 * (by * j.scale_pitch as u64 + bx),
                        rows.collect(),
                    ));
                }
            }
        }
        out.sort();
        out
    }

    fn names(n: usize, name: &str) -> Vec<Arc<str>> {
        vec![Arc::from(name); n]
    }

    #[test]
    fn back_to_back_experts_join_into_one_job_with_the_same_blocks() {
        // experts 1..4 of a [4, 256, 512] sender stack (all its rows, columns 128..) into
        // experts 2..5 of an [8, 256, 384] engine stack
        let t = transfer(
            (&[4, 256, 512], &[1, 0, 128]),
            (&[8, 256, 384], &[2, 0, 0]),
            &[3, 256, 384],
        );
        let target = Fp8Target {
            dst: 1 << 40,
            scales: 1 << 41,
            shape: Dims::new(&[8, 256, 384]),
        };
        let jobs = fused_jobs(&t, 1 << 30, &target, &BLOCK).unwrap();
        assert_eq!(jobs.len(), 3);
        let mut asked = Vec::new();
        let (joined, n) = join_jobs(jobs.clone(), names(3, "q"), &BLOCK, |a, b| {
            asked.push((a, b));
            true
        });
        assert_eq!(joined.len(), 1);
        assert_eq!(n, names(1, "q"));
        assert_eq!(
            joined[0],
            Fp8Job {
                rows: 768,
                ..jobs[0]
            }
        );
        assert_eq!(blocks(&joined), blocks(&jobs));
        // the source range asked about is the joined one
        let end = jobs[0].src + 512 * 1024;
        assert_eq!(
            asked,
            vec![(jobs[0].src, end), (jobs[0].src, end + 256 * 1024)]
        );
    }

    #[test]
    fn jobs_stay_apart_across_tensors_allocations_gaps_and_partial_block_rows() {
        let t = transfer(
            (&[4, 256, 512], &[0, 0, 0]),
            (&[4, 256, 512], &[0, 0, 0]),
            &[2, 256, 512],
        );
        let target = Fp8Target {
            dst: 0,
            scales: 1 << 30,
            shape: Dims::new(&[4, 256, 512]),
        };
        let jobs = fused_jobs(&t, 1 << 20, &target, &BLOCK).unwrap();
        let apart = |js: Vec<Fp8Job>, n: Vec<Arc<str>>, same: bool| {
            join_jobs(js, n, &BLOCK, |_, _| same).0.len()
        };
        assert_eq!(apart(jobs.clone(), names(2, "q"), true), 1);
        // two engine tensors
        let two = vec![Arc::from("q"), Arc::from("k")];
        assert_eq!(apart(jobs.clone(), two, true), 2);
        // the sources in two allocations
        assert_eq!(apart(jobs.clone(), names(2, "q"), false), 2);
        // a sender whose experts are not back to back (the second one elsewhere)
        let mut gap = jobs.clone();
        gap[1].src += 4096;
        assert_eq!(apart(gap, names(2, "q"), true), 2);
        // 200-row experts: the first one's last block row is partial, joining would mix experts
        let t = transfer(
            (&[2, 200, 256], &[0, 0, 0]),
            (&[2, 200, 256], &[0, 0, 0]),
            &[2, 200, 256],
        );
        let target = Fp8Target {
            shape: Dims::new(&[2, 200, 256]),
            ..target
        };
        let jobs = fused_jobs(&t, 1 << 20, &target, &BLOCK).unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!(apart(jobs, names(2, "q"), true), 2);
    }
}
