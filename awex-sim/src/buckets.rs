//! A peer plan's buckets, counted instead of built.
//!
//! The transports cut each peer's transfers with `make_buckets` (`awex-runtime/src/bucket.rs`);
//! a 1T-parameter pair has about 10^8 buckets, too many to build as piece lists. [`bucket_runs`]
//! walks the same arithmetic and yields run-length encoded buckets (bytes, and whether each
//! end can use it in place or must stage it), equal bucket for bucket to `make_buckets` (a
//! test checks it against the real function). A sender-encoded FP8 piece (e4m3 + scales) is
//! staged on both ends: the sender quantises it into a slot, the receiver writes two tensors.

use awex_core::layout::Dims;
use awex_core::plan::Transfer;
use awex_core::plan::bucket::Units;

/// Consecutive buckets alike in size and staging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketRun {
    /// Wire bytes of each bucket.
    pub bytes: u64,
    /// Buckets in the run.
    pub count: u64,
    /// The sender packs these buckets into a staging slot (more than one piece, or one piece
    /// that is not contiguous in its source tensor).
    pub staged_src: bool,
    /// The receiver unpacks them from a staging slot.
    pub staged_dst: bool,
}

/// Whether `rows` rows of transfer box `extent`, starting at its first row, are one contiguous
/// run of the local tensor `shape` (the box aligned with the tensor's trailing dims).
fn contiguous(shape: &Dims, extent: &Dims, rows: u64) -> bool {
    let k = extent.ndim();
    let n = shape.ndim();
    let ext = |i: usize| if i == 0 { rows } else { extent.get(i) };
    let Some(first) = (0..k).find(|&i| ext(i) > 1) else {
        return true;
    };
    (first + 1..k).all(|i| ext(i) == shape.get(n - k + i))
}

struct Acc<'a> {
    out: &'a mut Vec<BucketRun>,
    bytes: u64,
    pieces: u32,
    src_ok: bool,
    dst_ok: bool,
}

impl Acc<'_> {
    fn push_run(&mut self, r: BucketRun) {
        if let Some(last) = self.out.last_mut()
            && last.bytes == r.bytes
            && last.staged_src == r.staged_src
            && last.staged_dst == r.staged_dst
        {
            last.count += r.count;
            return;
        }
        self.out.push(r);
    }

    fn close(&mut self) {
        let one = self.pieces == 1;
        let r = BucketRun {
            bytes: self.bytes,
            count: 1,
            staged_src: !(one && self.src_ok),
            staged_dst: !(one && self.dst_ok),
        };
        self.push_run(r);
        self.bytes = 0;
        self.pieces = 0;
    }
}

/// The buckets `make_buckets(transfers, max_bytes)` makes, run-length encoded.
pub fn bucket_runs<T: std::borrow::Borrow<Transfer>>(
    transfers: impl IntoIterator<Item = T>,
    max_bytes: u64,
) -> Vec<BucketRun> {
    let max_bytes = max_bytes.max(1);
    let mut out = Vec::new();
    let mut acc = Acc {
        out: &mut out,
        bytes: 0,
        pieces: 0,
        src_ok: false,
        dst_ok: false,
    };
    for t in transfers {
        let t = t.borrow();
        let rows = t.extent.get(0);
        let u = Units::of(t);
        let units = if rows == 0 { 0 } else { u.count };
        let per = max_bytes / u.bytes.max(1);
        // a sender-encoded piece is quantised into a slot and lands in two tensors: staged
        let enc = t.sender_encoded();
        let mut u0 = 0;
        while u0 < units {
            // many whole buckets of one piece each, in one step (the last unit, which may be
            // smaller, stays out of it)
            if acc.pieces == 0 && per >= 1 && (units - u0) / per >= 2 {
                let n = (units - u0) / per - 1;
                let (_, run_rows) = u.rows_of(u0, per, rows);
                let r = BucketRun {
                    bytes: per * u.bytes,
                    count: n,
                    staged_src: enc || !contiguous(&t.src_shape, &t.extent, run_rows),
                    staged_dst: enc || !contiguous(&t.dst_shape, &t.extent, run_rows),
                };
                acc.push_run(r);
                u0 += n * per;
                continue;
            }
            let room = max_bytes.saturating_sub(acc.bytes);
            let mut take = (room / u.bytes.max(1)).min(units - u0);
            if take == 0 {
                if acc.pieces > 0 {
                    acc.close();
                    continue;
                }
                take = 1;
            }
            let (_, take_rows) = u.rows_of(u0, take, rows);
            acc.pieces += 1;
            acc.src_ok = !enc && contiguous(&t.src_shape, &t.extent, take_rows);
            acc.dst_ok = !enc && contiguous(&t.dst_shape, &t.extent, take_rows);
            acc.bytes += u.bytes_of(u0, take);
            u0 += take;
            if acc.bytes >= max_bytes {
                acc.close();
            }
        }
    }
    if acc.pieces > 0 {
        acc.close();
    }
    out
}

/// Total buckets of a run list.
pub fn count(runs: &[BucketRun]) -> u64 {
    runs.iter().map(|r| r.count).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use awex_core::DType;
    use awex_core::layout::RankId;
    use awex_core::layout::copy::StridedBox;
    use awex_core::plan::bucket::{make_buckets, piece_box};
    use std::sync::Arc;

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    fn transfer(seed: &mut u64) -> Transfer {
        let rows = 1 + rng(seed) % 40;
        let cols = 1 + rng(seed) % 9;
        let (src_cols, dst_cols) = (cols + rng(seed) % 2 * 3, cols + rng(seed) % 2 * 2);
        let lead = rng(seed) % 3 == 0;
        let dims = |c: u64| {
            if lead {
                Dims::new(&[2, rows + 3, c])
            } else {
                Dims::new(&[rows + 3, c])
            }
        };
        let off = |c: u64| {
            let o = if c > cols { 1 } else { 0 };
            if lead {
                Dims::new(&[1, 2, o])
            } else {
                Dims::new(&[2, o])
            }
        };
        Transfer {
            encode: None,
            src_rank: RankId::train(0),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: Arc::from("s"),
            src_shape: dims(src_cols),
            src_offset: off(src_cols),
            src_dtype: DType::Bf16,
            dst_tensor: Arc::from("d"),
            dst_shape: dims(dst_cols),
            dst_offset: off(dst_cols),
            dst_dtype: DType::Bf16,
            extent: Dims::new(&[rows, cols]),
            transposed: false,
        }
    }

    #[test]
    fn runs_equal_make_buckets_bucket_for_bucket() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for case in 0..400 {
            let n = 1 + rng(&mut seed) % 6;
            let ts: Vec<Transfer> = (0..n).map(|_| transfer(&mut seed)).collect();
            let max = 1 + rng(&mut seed) % 300;
            let real = make_buckets(&ts, max);
            let mut want = Vec::new();
            for b in &real {
                let runs = |src: bool| {
                    b.pieces.len() == 1 && {
                        let p = &b.pieces[0];
                        let t = &ts[p.transfer as usize];
                        let (so, d, e) = piece_box(t, p);
                        let z = Dims::zeros(e.ndim());
                        let sb = if src {
                            StridedBox::new(&t.src_shape, &so, &e, &z, &e)
                        } else {
                            StridedBox::new(&e, &z, &t.dst_shape, &d, &e)
                        };
                        sb.unwrap().runs() == 1
                    }
                };
                want.push((b.bytes, !runs(true), !runs(false)));
            }
            let got: Vec<(u64, bool, bool)> = bucket_runs(&ts, max)
                .iter()
                .flat_map(|r| (0..r.count).map(|_| (r.bytes, r.staged_src, r.staged_dst)))
                .collect();
            assert_eq!(got, want, "case {case}: max {max}, transfers {ts:?}");
        }
    }

    #[test]
    fn runs_equal_make_buckets_for_sender_encoded_fp8_transfers() {
        use awex_core::encoding::Fp8Block;
        use awex_core::plan::{Encode, EncodeAt};
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for case in 0..300 {
            let n = 1 + rng(&mut seed) % 5;
            let ts: Vec<Transfer> = (0..n)
                .map(|_| {
                    let mut t = transfer(&mut seed);
                    if rng(&mut seed) % 3 > 0 {
                        // a sender-encoded box of whole blocks: the whole destination tensor
                        let (bn, bk) = (1 + rng(&mut seed) % 5, 1 + rng(&mut seed) % 4);
                        let (rows, cols) = (t.extent.get(0), t.extent.get(1));
                        t.dst_shape = Dims::new(&[rows, cols]);
                        t.dst_offset = Dims::zeros(2);
                        t.dst_dtype = DType::F8E4m3;
                        t.encode = Some(Encode {
                            encoding: Fp8Block {
                                block: [bn as u32, bk as u32],
                                ..Fp8Block::default()
                            },
                            at: EncodeAt::Sender,
                        });
                    }
                    t
                })
                .collect();
            let max = 1 + rng(&mut seed) % 300;
            let real = make_buckets(&ts, max);
            // every piece of a sender-encoded transfer holds whole block rows
            for b in &real {
                for p in &b.pieces {
                    let t = &ts[p.transfer as usize];
                    if let Some(e) = &t.encode {
                        let bn = e.encoding.block[0] as u64;
                        assert_eq!(p.row0 % bn, 0);
                        assert!(p.rows % bn == 0 || p.row0 + p.rows == t.extent.get(0));
                    }
                }
            }
            let total: u64 = real.iter().map(|b| b.bytes).sum();
            assert_eq!(
                total,
                ts.iter().map(Transfer::bytes).sum::<u64>(),
                "case {case}"
            );
            let want: Vec<u64> = real.iter().map(|b| b.bytes).collect();
            let runs = bucket_runs(&ts, max);
            let got: Vec<u64> = runs
                .iter()
                .flat_map(|r| (0..r.count).map(|_| r.bytes))
                .collect();
            assert_eq!(got, want, "case {case}: max {max}, transfers {ts:?}");
            // a bucket holding a sender-encoded piece is staged on both ends
            let staged: Vec<bool> = runs
                .iter()
                .flat_map(|r| (0..r.count).map(|_| r.staged_src && r.staged_dst))
                .collect();
            for (b, s) in real.iter().zip(staged) {
                if b.pieces
                    .iter()
                    .any(|p| ts[p.transfer as usize].encode.is_some())
                {
                    assert!(s, "case {case}");
                }
            }
        }
    }
}
