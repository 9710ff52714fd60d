//! Buckets packed and unpacked with conversion and checksums (the cut itself is
//! [`awex_core::plan::bucket`]).

use super::tensors::TensorSet;
use super::{RuntimeError, TensorError, TransportError};
use awex_core::layout::Dims;
use awex_core::layout::copy::{StridedBox, copy_box};
use awex_core::plan::Transfer;
use xxhash_rust::xxh3::Xxh3;

pub use awex_core::plan::bucket::{Bucket, Piece, make_buckets, piece_box};

fn tensor_err(side: &'static str, name: &str) -> RuntimeError {
    TensorError::NotRegistered {
        side,
        name: name.to_string(),
    }
    .into()
}

/// Packs a bucket's pieces from the source tensors into `out` (destination dtype), returning the bytes written.
pub fn pack(
    bucket: &Bucket,
    transfers: &[Transfer],
    src: &TensorSet,
    out: &mut [u8],
) -> Result<usize, RuntimeError> {
    let mut at = 0usize;
    for p in &bucket.pieces {
        let t = &transfers[p.transfer as usize];
        let (so, _, e) = piece_box(t, p);
        let v = src
            .get(&t.src_tensor)
            .ok_or_else(|| tensor_err("source", &t.src_tensor))?;
        let n = (e.numel() as usize) * t.dst_dtype.size();
        let cap = out.len();
        let dst = out
            .get_mut(at..at + n)
            .ok_or_else(|| RuntimeError::from(TransportError::BufferTooSmall { cap }))?;
        copy_box(
            v.try_bytes()?,
            &v.shape,
            &so,
            v.dtype,
            dst,
            &e,
            &Dims::zeros(e.ndim()),
            t.dst_dtype,
            &e,
        )?;
        at += n;
    }
    Ok(at)
}

/// Unpacks a bucket's bytes into the destination tensors.
pub fn unpack(
    bucket: &Bucket,
    transfers: &[Transfer],
    dst: &TensorSet,
    inp: &[u8],
) -> Result<(), RuntimeError> {
    let mut at = 0usize;
    for p in &bucket.pieces {
        let t = &transfers[p.transfer as usize];
        let (_, d, e) = piece_box(t, p);
        let v = dst
            .get(&t.dst_tensor)
            .ok_or_else(|| tensor_err("destination", &t.dst_tensor))?;
        let n = (e.numel() as usize) * t.dst_dtype.size();
        let src = inp
            .get(at..at + n)
            .ok_or_else(|| RuntimeError::from(TransportError::ShortBucket { len: inp.len() }))?;
        // SAFETY: each destination box is written by exactly one piece of one bucket (the plan is exact).
        let out = unsafe { v.try_bytes_mut()? };
        copy_box(
            src,
            &e,
            &Dims::zeros(e.ndim()),
            t.dst_dtype,
            out,
            &v.shape,
            &d,
            v.dtype,
            &e,
        )?;
        at += n;
    }
    Ok(())
}

/// xxh3 of a bucket's bytes as they sit in the destination tensors (equals the hash of the packed bucket).
pub fn hash_destination(
    bucket: &Bucket,
    transfers: &[Transfer],
    dst: &TensorSet,
) -> Result<u64, RuntimeError> {
    let mut h = Xxh3::new();
    for p in &bucket.pieces {
        let t = &transfers[p.transfer as usize];
        let (_, d, e) = piece_box(t, p);
        let v = dst
            .get(&t.dst_tensor)
            .ok_or_else(|| tensor_err("destination", &t.dst_tensor))?;
        let es = v.dtype.size() as u64;
        let b = StridedBox::new(&e, &Dims::zeros(e.ndim()), &v.shape, &d, &e)?;
        let bytes = v.try_bytes()?;
        b.for_each_run(|_, at, n| h.update(&bytes[(at * es) as usize..((at + n) * es) as usize]));
    }
    Ok(h.digest())
}

#[cfg(test)]
mod tests {
    use super::*;
    use awex_core::dtype::DType;
    use awex_core::layout::RankId;
    use std::sync::Arc;

    fn transfer(rows: u64, cols: u64) -> Transfer {
        Transfer {
            encode: None,
            src_rank: RankId::train(0),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: Arc::from("s"),
            src_shape: Dims::new(&[rows, cols]),
            src_offset: Dims::new(&[0, 0]),
            src_dtype: DType::Bf16,
            dst_tensor: Arc::from("d"),
            dst_shape: Dims::new(&[rows, cols]),
            dst_offset: Dims::new(&[0, 0]),
            dst_dtype: DType::Bf16,
            extent: Dims::new(&[rows, cols]),
        }
    }

    #[test]
    fn buckets_split_rows_and_respect_the_size() {
        // 10 rows of 8 bytes, then 3 rows of 8 bytes; buckets of 32 bytes
        let ts = vec![transfer(10, 4), transfer(3, 4)];
        let b = make_buckets(&ts, 32);
        let shape: Vec<Vec<(u32, u64, u64)>> = b
            .iter()
            .map(|b| {
                b.pieces
                    .iter()
                    .map(|p| (p.transfer, p.row0, p.rows))
                    .collect()
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                vec![(0, 0, 4)],
                vec![(0, 4, 4)],
                vec![(0, 8, 2), (1, 0, 2)],
                vec![(1, 2, 1)]
            ]
        );
        assert!(b.iter().all(|b| b.bytes <= 32));
        // a row larger than the bucket travels alone
        let big = make_buckets(&[transfer(2, 100)], 16);
        assert_eq!(big.len(), 2);
        assert_eq!(big[0].bytes, 200);
    }

    #[test]
    fn pack_then_unpack_moves_the_box_and_hashes_agree() {
        let mut t = transfer(2, 2);
        t.src_shape = Dims::new(&[3, 4]);
        t.src_offset = Dims::new(&[1, 1]);
        t.dst_shape = Dims::new(&[2, 3]);
        t.dst_offset = Dims::new(&[0, 1]);
        let mut src_buf: Vec<u8> = (0..24).collect();
        let mut dst_buf = vec![0u8; 12];
        let src = TensorSet::from_views(vec![unsafe {
            crate::TensorView::new("s", src_buf.as_mut_ptr(), 24, DType::Bf16, t.src_shape).unwrap()
        }])
        .unwrap();
        let dst = TensorSet::from_views(vec![unsafe {
            crate::TensorView::new("d", dst_buf.as_mut_ptr(), 12, DType::Bf16, t.dst_shape).unwrap()
        }])
        .unwrap();
        let ts = vec![t];
        let b = &make_buckets(&ts, 1 << 20)[0];
        let mut wire = vec![0u8; 8];
        assert_eq!(pack(b, &ts, &src, &mut wire).unwrap(), 8);
        // rows 1..3, columns 1..3 of a 3x4 bf16 tensor
        assert_eq!(wire, [10, 11, 12, 13, 18, 19, 20, 21]);
        unpack(b, &ts, &dst, &wire).unwrap();
        assert_eq!(dst_buf, [0, 0, 10, 11, 12, 13, 0, 0, 18, 19, 20, 21]);
        assert_eq!(
            hash_destination(b, &ts, &dst).unwrap(),
            xxhash_rust::xxh3::xxh3_64(&wire)
        );
    }
}
