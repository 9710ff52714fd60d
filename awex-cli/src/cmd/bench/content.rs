//! What the benchmarks' training ranks hold and how the receivers check it: deterministic
//! tensor contents keyed by rank and name, the bit-for-bit check of every destination byte, and
//! the JSON-lines pipe both benchmark paths talk over.

use anyhow::{Context, bail};
use awex_core::layout::copy::StridedBox;
use awex_core::layout::{LocalTensor, RankId};
use awex_core::plan::Transfer;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

// ---------------------------------------------------------------------------------------------
// deterministic tensor contents

pub(super) fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The content key of a training tensor: FNV-1a of its rank and name.
pub(super) fn tensor_key(rank: RankId, name: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in rank
        .engine
        .to_le_bytes()
        .iter()
        .chain(&rank.rank.to_le_bytes())
        .chain(name.as_bytes())
    {
        h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Bytes `start..start + out.len()` of the content of the tensor with key `key`.
pub(super) fn gen_bytes(key: u64, start: u64, out: &mut [u8]) {
    let end = start + out.len() as u64;
    let (mut k, mut i) = (start, 0usize);
    while k < end {
        let w = splitmix(key ^ (k >> 3)).to_le_bytes();
        let b = (k & 7) as usize;
        let take = (8 - b).min((end - k) as usize);
        out[i..i + take].copy_from_slice(&w[b..b + take]);
        i += take;
        k += take as u64;
    }
}

pub(super) fn threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

/// [`gen_bytes`] on all cores.
pub(super) fn par_gen(key: u64, start: u64, out: &mut [u8]) {
    let piece = out.len().div_ceil(threads()).max(1 << 16);
    std::thread::scope(|s| {
        for (i, chunk) in out.chunks_mut(piece).enumerate() {
            s.spawn(move || gen_bytes(key, start + (i * piece) as u64, chunk));
        }
    });
}

pub(super) fn send_line<T: Serialize>(w: &mut impl Write, msg: &T) -> anyhow::Result<()> {
    let mut line = serde_json::to_string(msg)?;
    line.push('\n');
    w.write_all(line.as_bytes())?;
    w.flush()?;
    Ok(())
}

pub(super) fn read_line<T: for<'de> Deserialize<'de>>(
    r: &mut impl BufRead,
    who: &str,
) -> anyhow::Result<T> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("the {who} closed its pipe (it exited; see its error above)");
    }
    serde_json::from_str(line.trim()).with_context(|| format!("bad message from the {who}: {line}"))
}

/// Makes generated 16-bit words finite (bit 14 of each cleared: the high byte's bit 6, at odd
/// offsets `start + i`), as `Weights::Finite` does: the FP8 quantisers refuse the infinity and
/// NaN that random bf16 holds. Offsets are those of [`gen_bytes`], so a range made finite
/// alone equals the same range of a larger one made finite.
pub(super) fn make_finite(start: u64, out: &mut [u8]) {
    let first = (start % 2 == 0) as usize;
    for b in out.iter_mut().skip(first).step_by(2) {
        *b &= !0x40;
    }
}

/// The bytes the plan's `transfers` into one destination tensor of `nbytes` bytes write there
/// (the generated content of their sources, made finite if asked); bytes no transfer writes
/// are zero. Generated on every core, in pieces of at most 4 MiB.
pub(super) fn expected_tensor(
    transfers: &[&Transfer],
    nbytes: usize,
    finite: bool,
) -> anyhow::Result<Vec<u8>> {
    let mut out = vec![0u8; nbytes];
    // (destination byte, length, key, source byte)
    let mut items: Vec<(usize, usize, u64, u64)> = Vec::new();
    for t in transfers {
        let es = t.dst_dtype.size() as u64;
        let key = tensor_key(t.src_rank, &t.src_tensor);
        let b = StridedBox::new_transposed(
            &t.src_shape,
            &t.src_offset,
            &t.dst_shape,
            &t.dst_offset,
            &t.extent,
            t.transpose(),
        )?;
        let mut bad = None;
        b.for_each_run(|s, d, n| {
            let (mut s, mut d, mut n) = (s * es, d * es, n * es);
            if d + n > nbytes as u64 {
                bad = Some(d + n);
                return;
            }
            while n > 0 {
                let k = n.min(4 << 20);
                items.push((d as usize, k as usize, key, s));
                (s, d, n) = (s + k, d + k, n - k);
            }
        });
        if let Some(end) = bad {
            bail!(
                "`{}`: a transfer writes up to byte {end} of {nbytes}",
                t.dst_tensor
            );
        }
    }
    items.sort_unstable_by_key(|i| i.0);
    // disjoint pieces of `out`, one per item (transfers into one tensor never overlap)
    let mut pieces = Vec::with_capacity(items.len());
    let (mut rest, mut at) = (&mut out[..], 0usize);
    for &(d, n, key, s) in &items {
        if d < at {
            bail!(
                "two transfers write byte {d} of `{}`",
                transfers[0].dst_tensor
            );
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(d - at);
        let (piece, tail) = tail.split_at_mut(n);
        pieces.push((piece, key, s));
        (rest, at) = (tail, d + n);
    }
    let per = pieces.len().div_ceil(threads()).max(1);
    std::thread::scope(|scope| {
        for group in pieces.chunks_mut(per) {
            scope.spawn(move || {
                for (piece, key, s) in group.iter_mut() {
                    gen_bytes(*key, *s, piece);
                    if finite {
                        make_finite(*s, piece);
                    }
                }
            });
        }
    });
    Ok(out)
}

/// [`verify`] over any receiver: `fetch(i, out)` reads tensor `i` of `tensors` whole. With
/// `finite`, the senders' content was made finite ([`make_finite`]).
pub(super) fn verify_with(
    transfers: &[Transfer],
    tensors: &[LocalTensor],
    finite: bool,
    fetch: &mut dyn FnMut(usize, &mut [u8]) -> anyhow::Result<()>,
) -> anyhow::Result<(bool, String)> {
    let mut by_dst: HashMap<&str, Vec<&Transfer>> = HashMap::new();
    for t in transfers {
        by_dst.entry(&t.dst_tensor).or_default().push(t);
    }
    let checked = AtomicU64::new(0);
    let mismatch: Mutex<Option<String>> = Mutex::new(None);
    let mut host = Vec::new();
    for (ti, lt) in tensors.iter().enumerate() {
        let Some(ts) = by_dst.get(&*lt.name) else {
            continue;
        };
        host.resize(lt.nbytes() as usize, 0u8);
        fetch(ti, &mut host)?;
        // (key, source byte, destination byte, length), in pieces of at most 4 MiB
        let mut items: Vec<(u64, u64, u64, u64)> = Vec::new();
        for t in ts {
            let es = t.dst_dtype.size() as u64;
            let key = tensor_key(t.src_rank, &t.src_tensor);
            let b = StridedBox::new_transposed(
                &t.src_shape,
                &t.src_offset,
                &t.dst_shape,
                &t.dst_offset,
                &t.extent,
                t.transpose(),
            )?;
            b.for_each_run(|s, d, n| {
                let (mut s, mut d, mut n) = (s * es, d * es, n * es);
                while n > 0 {
                    let k = n.min(4 << 20);
                    items.push((key, s, d, k));
                    (s, d, n) = (s + k, d + k, n - k);
                }
            });
        }
        let next = AtomicUsize::new(0);
        let host = &host;
        std::thread::scope(|s| {
            for _ in 0..threads() {
                s.spawn(|| {
                    let mut want = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(key, sb, db, n)) = items.get(i) else {
                            break;
                        };
                        want.resize(n as usize, 0);
                        gen_bytes(key, sb, &mut want);
                        if finite {
                            make_finite(sb, &mut want);
                        }
                        let got = &host[db as usize..(db + n) as usize];
                        if got != &want[..] {
                            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                            let mut m = mismatch.lock().unwrap_or_else(|p| p.into_inner());
                            m.get_or_insert_with(|| {
                                format!(
                                    "`{}` byte {}: got {:#04x}, want {:#04x}",
                                    lt.name,
                                    db as usize + at,
                                    got[at],
                                    want[at]
                                )
                            });
                        }
                        checked.fetch_add(n, Ordering::Relaxed);
                    }
                });
            }
        });
    }
    let checked = checked.into_inner();
    let want: u64 = transfers.iter().map(Transfer::bytes).sum();
    let need: u64 = tensors
        .iter()
        .map(|t| {
            t.placements
                .iter()
                .map(|p| p.region.numel() * t.dtype.size() as u64)
                .sum::<u64>()
        })
        .sum();
    if let Some(m) = mismatch.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Ok((false, m));
    }
    if checked != want || want != need {
        return Ok((
            false,
            format!("checked {checked} bytes; the plan moves {want}; the placements need {need}"),
        ));
    }
    Ok((
        true,
        format!("all {checked} destination bytes equal the sender's"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_bytes_do_not_depend_on_where_a_range_starts() {
        let key = tensor_key(RankId::train(0), "decoder.layers.0.mlp.linear_fc1.weight");
        let mut whole = vec![0u8; 100];
        gen_bytes(key, 0, &mut whole);
        let mut part = vec![0u8; 37];
        gen_bytes(key, 13, &mut part);
        assert_eq!(&whole[13..50], &part[..]);
        let mut big = vec![0u8; 300_000];
        par_gen(key, 5, &mut big);
        let mut one = vec![0u8; 300_000];
        gen_bytes(key, 5, &mut one);
        assert_eq!(big, one);
    }

    #[test]
    fn finite_content_clears_bit_14_of_every_word_wherever_a_range_starts() {
        let key = tensor_key(RankId::train(0), "w");
        let mut whole = vec![0u8; 4096];
        gen_bytes(key, 0, &mut whole);
        make_finite(0, &mut whole);
        // bf16 with bit 14 clear has an exponent under 0x80: finite
        for w in whole.chunks(2) {
            let x = u16::from_le_bytes([w[0], w[1]]);
            assert_eq!(x & 0x4000, 0);
        }
        let mut part = vec![0u8; 1001];
        gen_bytes(key, 77, &mut part);
        make_finite(77, &mut part);
        assert_eq!(&whole[77..1078], &part[..]);
        let raw = {
            let mut r = vec![0u8; 4096];
            gen_bytes(key, 0, &mut r);
            r
        };
        assert!(
            raw.chunks(2).any(|w| w[1] & 0x40 != 0),
            "random bytes hold bit 14"
        );
    }

    #[test]
    fn expected_tensors_pass_the_byte_check_of_a_real_plan() {
        let r = crate::cmd::plan::resolve("qwen3-tiny", "megatron:tp=2", "sglang:tp=1").unwrap();
        let rank = awex_core::layout::RankId::infer(0, 0);
        let plan = r
            .plan_pair()
            .plan_rank(awex_core::layout::Side::Inference, rank)
            .unwrap();
        let transfers: Vec<Transfer> = plan
            .peers
            .iter()
            .flat_map(|p| p.transfers.iter().cloned())
            .collect();
        let layout = r.inference.rank_layout(rank).unwrap();
        for finite in [false, true] {
            let mut fetch = |i: usize, out: &mut [u8]| {
                let t = &layout.tensors[i];
                let ts: Vec<&Transfer> = transfers
                    .iter()
                    .filter(|x| *x.dst_tensor == *t.name)
                    .collect();
                out.copy_from_slice(&expected_tensor(&ts, out.len(), finite)?);
                Ok(())
            };
            let (ok, detail) =
                verify_with(&transfers, &layout.tensors, finite, &mut fetch).unwrap();
            assert!(ok, "{detail}");
            // and the other content is caught
            let mut other = |i: usize, out: &mut [u8]| {
                let t = &layout.tensors[i];
                let ts: Vec<&Transfer> = transfers
                    .iter()
                    .filter(|x| *x.dst_tensor == *t.name)
                    .collect();
                out.copy_from_slice(&expected_tensor(&ts, out.len(), !finite)?);
                Ok(())
            };
            let (ok, _) = verify_with(&transfers, &layout.tensors, finite, &mut other).unwrap();
            assert!(!ok);
        }
    }

    #[test]
    fn tensor_keys_differ_by_rank_and_name() {
        let a = tensor_key(RankId::train(0), "x");
        assert_ne!(a, tensor_key(RankId::train(1), "x"));
        assert_ne!(a, tensor_key(RankId::train(0), "y"));
        assert_eq!(a, tensor_key(RankId::train(0), "x"));
    }

    #[test]
    fn expected_tensor_on_every_core_equals_each_runs_content_and_zero_elsewhere() {
        use awex_core::dims::Dims;
        use awex_core::dtype::DType;
        // two senders' boxes into a [4, 3_000_000] bf16 tensor (rows 0 and 2, pieces of 4 MiB
        // and more), rows 1 and 3 written by no one
        let t = |rank: u32, row: u64| Transfer {
            src_rank: RankId::train(rank),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: "w".into(),
            src_shape: Dims::new(&[1, 3_000_000]),
            src_offset: Dims::new(&[0, 0]),
            src_dtype: DType::Bf16,
            dst_tensor: "q".into(),
            dst_shape: Dims::new(&[4, 3_000_000]),
            dst_offset: Dims::new(&[row, 0]),
            dst_dtype: DType::Bf16,
            extent: Dims::new(&[1, 3_000_000]),
            encode: None,
            transposed: false,
        };
        let (a, b) = (t(0, 2), t(1, 0));
        let row = 6_000_000usize;
        let got = expected_tensor(&[&a, &b], 4 * row, true).unwrap();
        for (r, rank) in [(0usize, Some(1u32)), (1, None), (2, Some(0)), (3, None)] {
            let mut want = vec![0u8; row];
            if let Some(k) = rank {
                gen_bytes(tensor_key(RankId::train(k), "w"), 0, &mut want);
                make_finite(0, &mut want);
            }
            assert!(got[r * row..(r + 1) * row] == want[..], "row {r}");
        }
        // a byte written twice, or past the tensor, is refused by name
        let e = expected_tensor(&[&a, &a], 4 * row, true).unwrap_err();
        assert!(e.to_string().contains("two transfers write byte"), "{e}");
        let e = expected_tensor(&[&a], 2 * row, true).unwrap_err();
        assert!(
            e.to_string().contains("`q`: a transfer writes up to byte"),
            "{e}"
        );
    }
}
