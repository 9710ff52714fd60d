//! Planner benchmark on synthetic layouts: one rank's plan as the world grows.
//!
//! A rank's planning cost must grow with its own pieces, not with the world: the training side
//! has `dp` replicas of a `tp`-way row split of 64 tensors; the inference side `engines` copies
//! of an 8-way split. Run: `cargo bench -p awex-core --bench planner`.

use awex_core::DType;
use awex_core::layout::{RankId, Side};
use awex_core::plan::Pair;
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};

fn main() {
    divan::main();
}

fn side(
    side: Side,
    engines: u32,
    replicas: u32,
    shards: u32,
    rows: u64,
    n: usize,
) -> SyntheticSide {
    let cuts: Vec<u64> = (1..shards)
        .map(|s| rows * s as u64 / shards as u64)
        .collect();
    SyntheticSide {
        side,
        engines,
        replicas,
        shards,
        splits: (0..n)
            .map(|_| TensorSplit {
                dim: 0,
                cuts: cuts.clone(),
                pad: 0,
            })
            .collect(),
        dtype: DType::Bf16,
        fuse: false,
    }
}

/// One training rank's plan, with `dp` replicas (world = 8 * dp) feeding 4 engines of tp=8.
#[divan::bench(args = [1, 4, 16, 64])]
fn training_rank_plan(bencher: divan::Bencher, dp: u32) {
    let cat = catalogue(&vec![vec![4096, 1024]; 64]);
    let train = side(Side::Training, 1, dp, 8, 4096, 64).build(&cat);
    let infer = side(Side::Inference, 4, 1, 8, 4096, 64).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    bencher.bench(|| {
        pair.plan_rank(Side::Training, RankId::train(3))
            .map(|p| p.transfers())
    });
}

/// One inference rank's plan as the number of engines grows.
#[divan::bench(args = [1, 4, 16])]
fn inference_rank_plan(bencher: divan::Bencher, engines: u32) {
    let cat = catalogue(&vec![vec![4096, 1024]; 64]);
    let train = side(Side::Training, 1, 4, 8, 4096, 64).build(&cat);
    let infer = side(Side::Inference, engines, 1, 8, 4096, 64).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    bencher.bench(|| {
        pair.plan_rank(Side::Inference, RankId::infer(0, 5))
            .map(|p| p.transfers())
    });
}
