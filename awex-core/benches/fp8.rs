//! The CPU block-FP8 quantiser against a memcpy floor of the same bytes, in the same run.
//!
//! A 4096 x 4096 bf16 matrix (32 MiB) is quantised per recipe (reading 2 bytes and writing 1
//! per element); the floor copies the 32 MiB source once. divan prints each one's throughput
//! in bytes of bf16 source per second. Run: `cargo bench -p awex-core --bench fp8`.

use awex_core::encoding::{Fp8Quantiser, Recipe, Shape2d};
use divan::{Bencher, counter::BytesCount};

const ROWS: usize = 4096;
const COLS: usize = 4096;

fn main() {
    divan::main();
}

fn matrix() -> Vec<u16> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..ROWS * COLS)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let x = s.wrapping_mul(0x2545_F491_4F6C_DD1D);
            (((x >> 63) << 15) | ((113 + (x >> 8) % 14) << 7) | (x & 0x7f)) as u16
        })
        .collect()
}

#[divan::bench]
fn memcpy_floor(b: Bencher) {
    let src = matrix();
    let mut dst = vec![0u16; src.len()];
    b.counter(BytesCount::new(2 * ROWS * COLS))
        .bench_local(|| dst.copy_from_slice(divan::black_box(&src)));
}

#[divan::bench(args = ["vllm", "deepgemm-ue8m0", "deepgemm-legacy", "awex-python", "slime", "sglang-ue8m0"])]
fn quantise(b: Bencher, recipe: &str) {
    let x = matrix();
    let recipe: Recipe = recipe.parse().unwrap();
    let quant = Fp8Quantiser::new(recipe, recipe.encoding([128, 128]));
    let mut q = vec![0u8; ROWS * COLS];
    let mut s = vec![0f32; (ROWS / 128) * (COLS / 128)];
    b.counter(BytesCount::new(2 * ROWS * COLS)).bench_local(|| {
        quant
            .quantise(
                divan::black_box(&x),
                Shape2d::dense(ROWS, COLS),
                &mut q,
                COLS,
                &mut s,
                COLS / 128,
            )
            .unwrap()
    });
}
