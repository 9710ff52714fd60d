//! Buckets packed and unpacked with conversion and checksums (the cut itself is
//! [`awex_core::plan::bucket`]).

use super::tensors::{TensorSet, TensorView};
use super::{RuntimeError, TensorError, TransportError};
use awex_core::dtype::DType;
use awex_core::encoding::{Fp8Block, Fp8Quantiser, QuantiseError, Shape2d};
use awex_core::layout::Dims;
use awex_core::layout::copy::{StridedBox, Transpose, copy_box, copy_box_transposed};
use awex_core::plan::Transfer;
use xxhash_rust::xxh3::Xxh3;

pub use awex_core::plan::bucket::{Bucket, Piece, make_buckets, piece_box, piece_scale_box};

fn tensor_err(side: &'static str, name: &str) -> RuntimeError {
    TensorError::NotRegistered {
        side,
        name: name.to_string(),
    }
    .into()
}

/// The name under which a set whose FP8 tensor `name` is a bf16 staging (the receiver's
/// [`crate::transport::EncodingTransport`]) also holds the engine's e4m3 tensor itself, which
/// sender-encoded transfers write.
pub fn encoded_name(name: &str) -> String {
    format!("{name}\u{0}e4m3")
}

/// The tensor a transfer's destination box is written in: for a sender-encoded transfer the
/// e4m3 tensor ([`encoded_name`], else the tensor of its name), else the tensor of its name.
pub fn dst_view<'a>(set: &'a TensorSet, t: &Transfer) -> Result<&'a TensorView, RuntimeError> {
    let v = if t.sender_encoded() {
        set.get(&encoded_name(&t.dst_tensor))
            .or_else(|| set.get(&t.dst_tensor))
    } else {
        set.get(&t.dst_tensor)
    };
    let v = v.ok_or_else(|| tensor_err("destination", &t.dst_tensor))?;
    if v.dtype != t.dst_dtype && t.sender_encoded() {
        return Err(RuntimeError::Fp8(format!(
            "the plan writes e4m3 into `{}`, which this rank holds as {}; both sides must be built with the same FP8 inference config",
            t.dst_tensor, v.dtype
        )));
    }
    Ok(v)
}

/// The scale tensor a sender-encoded transfer's scales land in.
fn scale_view<'a>(set: &'a TensorSet, t: &Transfer) -> Result<&'a TensorView, RuntimeError> {
    let name = Fp8Block::scale_name(&t.dst_tensor);
    let v = set
        .get(&name)
        .ok_or_else(|| tensor_err("destination", &name))?;
    if v.dtype != DType::F32 {
        return Err(RuntimeError::Fp8(format!(
            "scale tensor `{name}` is {}; FP8 block scales are f32",
            v.dtype
        )));
    }
    Ok(v)
}

/// Element offset of `idx` in a row-major tensor of `shape`.
fn linear(shape: &Dims, idx: &Dims) -> usize {
    let mut at = 0u64;
    for i in 0..shape.ndim() {
        at = at * shape.get(i) + idx.get(i);
    }
    at as usize
}

/// A pitched destination of a quantised box: a tensor's bytes (or a dense buffer), its shape,
/// and where the box starts in it.
pub(crate) struct Dest<'a, T> {
    pub(crate) data: &'a mut [T],
    pub(crate) shape: Dims,
    pub(crate) offset: Dims,
}

/// Quantises a box of `extent` (every matrix of it, the trailing two dims) at `so` in a source
/// tensor (`src` bytes of `src_shape`, bf16 or f32) into e4m3 bytes and fp32 scales at their
/// destinations (each box dims aligned with the trailing dims of its tensor). The box covers
/// whole blocks (the plan's sender-encoded boxes do), so its blocks are the destination's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantise_box(
    q: &Fp8Quantiser,
    name: &str,
    src: &[u8],
    src_shape: &Dims,
    src_dtype: DType,
    so: &Dims,
    extent: &Dims,
    e4m3: Dest<'_, u8>,
    scales: Dest<'_, f32>,
) -> Result<(), RuntimeError> {
    let k = extent.ndim();
    let (rows, cols) = (extent.get(k - 2) as usize, extent.get(k - 1) as usize);
    let mats = extent.as_slice()[..k - 2].iter().product::<u64>();
    let shape = |s: &Dims| s.get(s.ndim() - 1) as usize;
    let (sp, qp, cp) = (shape(src_shape), shape(&e4m3.shape), shape(&scales.shape));
    let err = |e: QuantiseError| {
        RuntimeError::Fp8(format!(
            "quantising `{name}` to FP8 ({}) on the sender failed: {e}; the update is not committed",
            q.recipe.name()
        ))
    };
    // the matrix `m` (row-major over the box's leading dims) of an offset in a tensor of `n` dims
    let at = |off: &Dims, m: u64| {
        let mut o = *off;
        let n = o.ndim();
        let mut r = m;
        for i in (0..k - 2).rev() {
            let d = extent.get(i);
            o.set(n - k + i, o.get(n - k + i) + r % d);
            r /= d;
        }
        o
    };
    let (qdata, sdata) = (e4m3.data, scales.data);
    for m in 0..mats {
        let s0 = linear(src_shape, &at(so, m));
        let q0 = linear(&e4m3.shape, &at(&e4m3.offset, m));
        let c0 = linear(&scales.shape, &at(&scales.offset, m));
        let shape2 = Shape2d {
            rows,
            cols,
            pitch: sp,
        };
        let (qo, co) = (&mut qdata[q0..], &mut sdata[c0..]);
        match src_dtype {
            DType::Bf16 => {
                // SAFETY: any bits are a valid u16; the alignment is checked.
                let (pre, x, _) = unsafe { src.align_to::<u16>() };
                if !pre.is_empty() {
                    return Err(RuntimeError::Fp8(format!(
                        "`{name}`'s source is misaligned"
                    )));
                }
                q.quantise(&x[s0..], shape2, qo, qp, co, cp).map_err(err)?;
            }
            DType::F32 => {
                // SAFETY: as above (f32 has no invalid bit patterns).
                let (pre, x, _) = unsafe { src.align_to::<f32>() };
                if !pre.is_empty() {
                    return Err(RuntimeError::Fp8(format!(
                        "`{name}`'s source is misaligned"
                    )));
                }
                q.quantise(&x[s0..], shape2, qo, qp, co, cp).map_err(err)?;
            }
            d => {
                return Err(RuntimeError::Fp8(format!(
                    "`{name}`: the sender quantises bf16 or f32, and its source is {d}"
                )));
            }
        }
    }
    Ok(())
}

/// Packs one piece of a sender-encoded transfer: its e4m3 bytes (row-major over the piece's
/// box), then its blocks' fp32 scales (row-major over [`piece_scale_box`]), returning the bytes
/// written.
fn pack_encoded(
    t: &Transfer,
    p: &Piece,
    src: &TensorView,
    q: Option<&Fp8Quantiser>,
    out: &mut [u8],
) -> Result<usize, RuntimeError> {
    let q = q.ok_or_else(|| {
        RuntimeError::Fp8(format!(
            "the plan quantises `{}` on this sender, but the rank was not given the inference side's FP8 config; both sides must be built with the same FP8 inference config",
            t.dst_tensor
        ))
    })?;
    let (so, _, e) = piece_box(t, p);
    let (_, sext) = piece_scale_box(t, p).expect("a sender-encoded transfer has scales");
    let n = e.numel() as usize;
    let ns = sext.numel() as usize;
    let cap = out.len();
    let out = out
        .get_mut(..n + 4 * ns)
        .ok_or_else(|| RuntimeError::from(TransportError::BufferTooSmall { cap }))?;
    let (qb, sb) = out.split_at_mut(n);
    let mut scales = vec![0f32; ns];
    quantise_box(
        q,
        &t.dst_tensor,
        src.try_bytes()?,
        &src.shape,
        src.dtype,
        &so,
        &e,
        Dest {
            data: qb,
            shape: e,
            offset: Dims::zeros(e.ndim()),
        },
        Dest {
            data: &mut scales,
            shape: sext,
            offset: Dims::zeros(sext.ndim()),
        },
    )?;
    for (o, s) in sb.chunks_exact_mut(4).zip(&scales) {
        o.copy_from_slice(&s.to_le_bytes());
    }
    Ok(n + 4 * ns)
}

/// Packs a bucket's pieces from the source tensors into `out` (destination dtype; a
/// sender-encoded piece quantised by `fp8`, e4m3 then scales), returning the bytes written.
pub fn pack(
    bucket: &Bucket,
    transfers: &[Transfer],
    src: &TensorSet,
    out: &mut [u8],
    fp8: Option<&Fp8Quantiser>,
) -> Result<usize, RuntimeError> {
    let mut at = 0usize;
    for p in &bucket.pieces {
        let t = &transfers[p.transfer as usize];
        let v = src
            .get(&t.src_tensor)
            .ok_or_else(|| tensor_err("source", &t.src_tensor))?;
        if t.sender_encoded() {
            let cap = out.len();
            let rest = out
                .get_mut(at..)
                .ok_or_else(|| RuntimeError::from(TransportError::BufferTooSmall { cap }))?;
            at += pack_encoded(t, p, v, fp8, rest)?;
            continue;
        }
        let (so, _, e) = piece_box(t, p);
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

/// Unpacks a bucket's bytes into the destination tensors (a sender-encoded piece's e4m3 bytes
/// into the e4m3 tensor, its scales into the scale tensor).
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
        let v = dst_view(dst, t)?;
        let n = (e.numel() as usize) * t.dst_dtype.size();
        let src = inp
            .get(at..at + n)
            .ok_or_else(|| RuntimeError::from(TransportError::ShortBucket { len: inp.len() }))?;
        // SAFETY: each destination box is written by exactly one piece of one bucket (the plan is exact).
        let out = unsafe { v.try_bytes_mut()? };
        // (a transposed transfer's box lands with its last two dims swapped)
        copy_box_transposed(
            src,
            &e,
            &Dims::zeros(e.ndim()),
            t.dst_dtype,
            out,
            &v.shape,
            &d,
            v.dtype,
            &e,
            t.transpose(),
        )?;
        at += n;
        if let Some((soff, sext)) = piece_scale_box(t, p) {
            let sv = scale_view(dst, t)?;
            let n = sext.numel() as usize * 4;
            let src = inp.get(at..at + n).ok_or_else(|| {
                RuntimeError::from(TransportError::ShortBucket { len: inp.len() })
            })?;
            // SAFETY: as above: each block's scale is written by the one piece holding it.
            let out = unsafe { sv.try_bytes_mut()? };
            copy_box(
                src,
                &sext,
                &Dims::zeros(sext.ndim()),
                DType::F32,
                out,
                &sv.shape,
                &soff,
                DType::F32,
                &sext,
            )?;
            at += n;
        }
    }
    Ok(())
}

/// Feeds the bytes of box `e` at `d` of tensor `v` to `h`, run by run, in the box's order (a
/// transposed box, [`Transpose::Dst`], is read element by element as the bucket packed it).
fn hash_box(
    h: &mut Xxh3,
    v: &TensorView,
    d: &Dims,
    e: &Dims,
    t: Transpose,
) -> Result<(), RuntimeError> {
    let es = v.dtype.size() as u64;
    let b = StridedBox::new_transposed(e, &Dims::zeros(e.ndim()), &v.shape, d, e, t)?;
    let bytes = v.try_bytes()?;
    b.for_each_run(|_, at, n| h.update(&bytes[(at * es) as usize..((at + n) * es) as usize]));
    Ok(())
}

/// xxh3 of a bucket's bytes as they sit in the destination tensors (equals the hash of the
/// packed bucket; a sender-encoded piece's e4m3 bytes then its scales).
pub fn hash_destination(
    bucket: &Bucket,
    transfers: &[Transfer],
    dst: &TensorSet,
) -> Result<u64, RuntimeError> {
    let mut h = Xxh3::new();
    for p in &bucket.pieces {
        let t = &transfers[p.transfer as usize];
        let (_, d, e) = piece_box(t, p);
        hash_box(&mut h, dst_view(dst, t)?, &d, &e, t.transpose())?;
        if let Some((soff, sext)) = piece_scale_box(t, p) {
            hash_box(&mut h, scale_view(dst, t)?, &soff, &sext, Transpose::None)?;
        }
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
            transposed: false,
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
        assert_eq!(pack(b, &ts, &src, &mut wire, None).unwrap(), 8);
        // rows 1..3, columns 1..3 of a 3x4 bf16 tensor
        assert_eq!(wire, [10, 11, 12, 13, 18, 19, 20, 21]);
        unpack(b, &ts, &dst, &wire).unwrap();
        assert_eq!(dst_buf, [0, 0, 10, 11, 12, 13, 0, 0, 18, 19, 20, 21]);
        assert_eq!(
            hash_destination(b, &ts, &dst).unwrap(),
            xxhash_rust::xxh3::xxh3_64(&wire)
        );
    }

    #[test]
    fn transposed_pieces_land_transposed_and_hashes_agree() {
        // rows 1..5 of a 5 x 3 bf16 source into a 3 x 6 tensor that holds the box transposed
        // at column 2; buckets of one row each, so every piece starts at another column
        let mut t = transfer(4, 3);
        t.src_shape = Dims::new(&[5, 3]);
        t.src_offset = Dims::new(&[1, 0]);
        t.dst_shape = Dims::new(&[3, 6]);
        t.dst_offset = Dims::new(&[0, 2]);
        t.transposed = true;
        let mut src_buf: Vec<u8> = (0..30).map(|i| i as u8 + 1).collect();
        let mut dst_buf = vec![0u8; 36];
        let src = TensorSet::from_views(vec![unsafe {
            crate::TensorView::new("s", src_buf.as_mut_ptr(), 30, DType::Bf16, t.src_shape).unwrap()
        }])
        .unwrap();
        let dst = TensorSet::from_views(vec![unsafe {
            crate::TensorView::new("d", dst_buf.as_mut_ptr(), 36, DType::Bf16, t.dst_shape).unwrap()
        }])
        .unwrap();
        let ts = vec![t];
        let buckets = make_buckets(&ts, 6);
        assert_eq!(buckets.len(), 4);
        for b in &buckets {
            let mut wire = vec![0u8; 6];
            assert_eq!(pack(b, &ts, &src, &mut wire, None).unwrap(), 6);
            unpack(b, &ts, &dst, &wire).unwrap();
            assert_eq!(
                hash_destination(b, &ts, &dst).unwrap(),
                xxhash_rust::xxh3::xxh3_64(&wire)
            );
        }
        drop((src, dst));
        // element (i, j) of the box (source row 1 + i, column j) at (j, 2 + i)
        let mut want = vec![0u8; 36];
        for i in 0..4 {
            for j in 0..3 {
                let s = ((1 + i) * 3 + j) * 2;
                let d = (j * 6 + 2 + i) * 2;
                want[d..d + 2].copy_from_slice(&src_buf[s..s + 2]);
            }
        }
        assert_eq!(dst_buf, want);
    }

    #[test]
    fn sender_encoded_pieces_carry_e4m3_and_scales_and_a_flipped_byte_is_caught() {
        use awex_core::encoding::{Fp8Block, Fp8Quantiser, Recipe, Shape2d};
        use awex_core::plan::{Encode, EncodeAt};
        // a 40 x 48 bf16 source (rows 8..40 sent), into a 32 x 48 e4m3 tensor in 16 x 16
        // blocks: 2 x 3 scales
        let enc = Fp8Block {
            block: [16, 16],
            ..Fp8Block::default()
        };
        let q = Fp8Quantiser::new(Recipe::Vllm, enc.clone());
        let t = Transfer {
            encode: Some(Encode {
                encoding: enc,
                at: EncodeAt::Sender,
            }),
            src_shape: Dims::new(&[40, 48]),
            src_offset: Dims::new(&[8, 0]),
            dst_shape: Dims::new(&[32, 48]),
            dst_dtype: DType::F8E4m3,
            extent: Dims::new(&[32, 48]),
            ..transfer(32, 48)
        };
        let bf16 = |x: f32| (x.to_bits() >> 16) as u16;
        let mut src_buf: Vec<u16> = (0..40 * 48)
            .map(|i| bf16(((i * 37 % 101) as f32 - 50.0) * 0.37))
            .collect();
        let mut q_buf = vec![0u8; 32 * 48];
        let mut s_buf = vec![0f32; 6];
        let view = |name: &str, p: *mut u8, len: usize, dt: DType, shape: &[u64]| unsafe {
            crate::TensorView::new(name, p, len, dt, Dims::new(shape)).unwrap()
        };
        let src = TensorSet::from_views(vec![view(
            "s",
            src_buf.as_mut_ptr() as *mut u8,
            40 * 48 * 2,
            DType::Bf16,
            &[40, 48],
        )])
        .unwrap();
        let dst = TensorSet::from_views(vec![
            view("d", q_buf.as_mut_ptr(), 32 * 48, DType::F8E4m3, &[32, 48]),
            view(
                "d_scale_inv",
                s_buf.as_mut_ptr() as *mut u8,
                24,
                DType::F32,
                &[2, 3],
            ),
        ])
        .unwrap();
        let ts = vec![t];
        // buckets of one row of blocks: two pieces of 16 rows, each e4m3 then 3 scales
        let b = make_buckets(&ts, 16 * 48 + 12);
        assert_eq!(b.len(), 2);
        assert_eq!(b.iter().map(|b| b.bytes).sum::<u64>(), 32 * 48 + 24);
        // the reference: the whole 32 x 48 box quantised at once
        let (mut rq, mut rs) = (vec![0u8; 32 * 48], vec![0f32; 6]);
        q.quantise(
            &src_buf[8 * 48..],
            Shape2d::dense(32, 48),
            &mut rq,
            48,
            &mut rs,
            3,
        )
        .unwrap();
        let mut wires = Vec::new();
        for (i, bk) in b.iter().enumerate() {
            let mut wire = vec![0u8; bk.bytes as usize];
            // the sender needs the pair's quantiser
            assert!(pack(bk, &ts, &src, &mut wire, None).is_err());
            assert_eq!(
                pack(bk, &ts, &src, &mut wire, Some(&q)).unwrap(),
                wire.len()
            );
            assert_eq!(wire[..16 * 48], rq[i * 16 * 48..(i + 1) * 16 * 48]);
            let scales: Vec<u8> = rs[i * 3..i * 3 + 3]
                .iter()
                .flat_map(|s| s.to_le_bytes())
                .collect();
            assert_eq!(wire[16 * 48..], scales[..]);
            unpack(bk, &ts, &dst, &wire).unwrap();
            assert_eq!(
                hash_destination(bk, &ts, &dst).unwrap(),
                xxhash_rust::xxh3::xxh3_64(&wire)
            );
            wires.push(wire);
        }
        assert_eq!(q_buf, rq);
        assert_eq!(s_buf, rs);
        // a flipped e4m3 byte or scale byte on the wire lands, and the checksum tells
        for at in [5usize, 16 * 48 + 2] {
            let mut bad = wires[1].clone();
            bad[at] ^= 0x20;
            unpack(&b[1], &ts, &dst, &bad).unwrap();
            assert_ne!(
                hash_destination(&b[1], &ts, &dst).unwrap(),
                xxhash_rust::xxh3::xxh3_64(&wires[1]),
                "byte {at}"
            );
        }
    }
}
