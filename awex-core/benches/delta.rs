//! The CPU delta encoder and decoder against the bytes they read, in the same run.
//!
//! 64 MiB of bf16 (32 Mi elements) and a next version in which 1 % of the elements changed
//! (the lr 1e-6 density, docs/deltas.md), positions uniform: `compare_floor` reads both
//! versions word by word (what any delta must read), `changed` finds the changed elements, `encode` writes the
//! whole segment's delta, `apply` writes it over the old version. divan prints each one's
//! throughput in bytes of one version per second. Run: `cargo bench -p awex-core --bench delta`.

use awex_core::encoding::delta;
use divan::{Bencher, counter::BytesCount};

const ELEMS: usize = 32 << 20;

fn main() {
    divan::main();
}

fn versions(density: f64) -> (Vec<u8>, Vec<u8>) {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        s.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let old: Vec<u8> = (0..ELEMS)
        .flat_map(|_| (((next() >> 20) as u16 & 0x3fff) | 0x3c00).to_le_bytes())
        .collect();
    let mut new = old.clone();
    let cut = (density * u64::MAX as f64) as u64;
    for i in 0..ELEMS {
        if next() < cut {
            new[2 * i] ^= 1;
        }
    }
    (old, new)
}

#[divan::bench]
fn compare_floor(b: Bencher) {
    let (o, n) = versions(0.01);
    // every word of both read (no early exit, as a delta reads them)
    b.counter(BytesCount::new(2 * ELEMS)).bench_local(|| {
        let (o, n) = (divan::black_box(&o), divan::black_box(&n));
        o.chunks_exact(32)
            .zip(n.chunks_exact(32))
            .map(|(a, b)| {
                let w = |x: &[u8], i: usize| {
                    u64::from_le_bytes(x[i * 8..i * 8 + 8].try_into().unwrap())
                };
                (w(a, 0) ^ w(b, 0))
                    | (w(a, 1) ^ w(b, 1))
                    | (w(a, 2) ^ w(b, 2))
                    | (w(a, 3) ^ w(b, 3))
            })
            .fold(0, |acc, x| acc | x)
    });
}

#[divan::bench(args = [0.001, 0.01, 0.03])]
fn changed(b: Bencher, density: f64) {
    let (o, n) = versions(density);
    let mut idx = Vec::new();
    b.counter(BytesCount::new(2 * ELEMS)).bench_local(|| {
        idx.clear();
        delta::changed_elements(&o, &n, 2, 0, &mut idx);
        idx.len()
    });
}

#[divan::bench(args = [0.001, 0.01, 0.03])]
fn encode(b: Bencher, density: f64) {
    let (o, n) = versions(density);
    let mut out = Vec::new();
    b.counter(BytesCount::new(2 * ELEMS)).bench_local(|| {
        out.clear();
        delta::encode(&o, &n, 2, &mut out).unwrap();
        out.len()
    });
}

#[divan::bench(args = [0.001, 0.01, 0.03])]
fn apply(b: Bencher, density: f64) {
    let (o, n) = versions(density);
    let mut d = Vec::new();
    delta::encode(&o, &n, 2, &mut d).unwrap();
    let mut base = o.clone();
    b.counter(BytesCount::new(2 * ELEMS)).bench_local(|| {
        delta::apply(&d, 2, &mut base).unwrap();
    });
}
