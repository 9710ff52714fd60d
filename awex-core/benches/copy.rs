//! The transposed box copy (`copy_box_transposed`, what shm/tcp pack and unpack call for boxes an
//! engine holds transposed, gpt-oss's experts) against a memcpy floor of the same bytes and the
//! one-element-per-run copy it replaced, in the same run.
//!
//! One `[E, 2880, 5760]` slab of a gpt-oss-120b `gate_up_proj`-shaped expert stack (`E` = 2,
//! 66 MB of bf16) copied into a destination holding each expert transposed (`[E, 5760, 2880]`),
//! per element size (1, 2 and 4 bytes); divan prints each one's throughput in bytes moved per
//! second. Run: `cargo bench -p awex-core --bench copy`.

use awex_core::DType;
use awex_core::layout::Dims;
use awex_core::layout::copy::{StridedBox, Transpose, copy_box_transposed};
use divan::{Bencher, counter::BytesCount};

const E: u64 = 2;
const ROWS: u64 = 2880;
const COLS: u64 = 5760;

fn main() {
    divan::main();
}

fn dtype(size: usize) -> DType {
    match size {
        1 => DType::U8,
        2 => DType::Bf16,
        _ => DType::F32,
    }
}

fn bytes(size: usize) -> usize {
    (E * ROWS * COLS) as usize * size
}

fn source(size: usize) -> Vec<u8> {
    (0..bytes(size))
        .map(|i| (i * 31 + i / 4096) as u8)
        .collect()
}

#[divan::bench(args = [1, 2, 4])]
fn memcpy_floor(b: Bencher, size: usize) {
    let src = source(size);
    let mut dst = vec![0u8; src.len()];
    b.counter(BytesCount::new(bytes(size)))
        .bench_local(|| dst.copy_from_slice(divan::black_box(&src)));
}

#[divan::bench(args = [1, 2, 4])]
fn transposed_tiled(b: Bencher, size: usize) {
    let src = source(size);
    let mut dst = vec![0u8; src.len()];
    let (s_shape, d_shape) = (Dims::new(&[E, ROWS, COLS]), Dims::new(&[E, COLS, ROWS]));
    let z = Dims::zeros(3);
    let dt = dtype(size);
    b.counter(BytesCount::new(bytes(size))).bench_local(|| {
        copy_box_transposed(
            divan::black_box(&src),
            &s_shape,
            &z,
            dt,
            &mut dst,
            &d_shape,
            &z,
            dt,
            &s_shape,
            Transpose::Dst,
        )
        .unwrap()
    });
}

/// The copy as it was before tiling: one `copy_from_slice` of one element per run.
#[divan::bench(args = [1, 2, 4])]
fn transposed_per_element(b: Bencher, size: usize) {
    let src = source(size);
    let mut dst = vec![0u8; src.len()];
    let (s_shape, d_shape) = (Dims::new(&[E, ROWS, COLS]), Dims::new(&[E, COLS, ROWS]));
    let z = Dims::zeros(3);
    let sb =
        StridedBox::new_transposed(&s_shape, &z, &d_shape, &z, &s_shape, Transpose::Dst).unwrap();
    let n = size as u64;
    b.counter(BytesCount::new(bytes(size))).bench_local(|| {
        let src = divan::black_box(&src);
        sb.for_each_run(|s, d, r| {
            dst[(d * n) as usize..((d + r) * n) as usize]
                .copy_from_slice(&src[(s * n) as usize..((s + r) * n) as usize]);
        })
    });
}
