//! The lazy layout at the size of a 1T-parameter MoE model (moe-1t, 1024 ranks).

mod common;

use awex_core::layout::{RankId, validate_rank};
use awex_core::model::Catalogue;
use common::*;
use std::time::Instant;

#[test]
fn moe_1t_holders_cover_every_tensor_exactly_once_per_replica() {
    let model = preset("moe-1t");
    let pairs = [("tp", 8), ("pp", 8), ("dp", 16), ("ep", 32), ("etp", 1)];
    let side = layout(&model, &pairs).unwrap();
    assert_eq!(side.world_size(), 1024);
    let cat = Catalogue::of(&model);
    let start = Instant::now();
    let mut holders = 0usize;
    let mut rank_refs = 0usize;
    for t in cat.tensors() {
        let h = side.holders(&t.name);
        // shards of one replica are disjoint and together make the whole tensor
        let covered: u64 = h.iter().map(|h| h.region.numel()).sum();
        assert_eq!(covered, t.numel(), "{}", t.name);
        holders += h.len();
        rank_refs += h.iter().map(|h| h.ranks.len()).sum::<usize>();
    }
    println!(
        "moe-1t: holders() of {} tensors: {} holders, {} rank entries in {:?}",
        cat.len(),
        holders,
        rank_refs,
        start.elapsed()
    );
    // expert shards: 63 MoE layers x 384 experts x 3 tensors, each held by edp = 128 / 32 = 4 ranks
    let expert = side.holders("model.layers.5.mlp.experts.200.down_proj.weight");
    assert_eq!(expert.len(), 1);
    // layer 5 is on stage 0 (8 layers per stage); expert 200 = ep 16, local 8; stage-local 16 + 32 * edp
    assert_eq!(
        expert[0].ranks,
        [16, 48, 80, 112].map(RankId::train).to_vec()
    );
    assert_eq!(
        &*expert[0].tensor,
        "decoder.layers.5.mlp.experts.linear_fc2.weight8"
    );
    let q = side.holders("model.layers.63.self_attn.q_proj.weight");
    assert_eq!(q.len(), 8);
    assert!(
        q.iter()
            .all(|h| h.ranks.len() == 16 && h.ranks[0].rank >= 7 * 128)
    );
    let start = Instant::now();
    for r in [0, 1023] {
        let rl = side.rank_layout(RankId::train(r)).unwrap();
        validate_rank(&rl, &cat).unwrap();
        println!(
            "moe-1t rank {r}: {} tensors, {} bytes",
            rl.tensors.len(),
            rl.nbytes()
        );
    }
    println!("moe-1t: two rank layouts in {:?}", start.elapsed());
}

/// Kimi-K2 (1T, MLA, 384 experts + 1 shared, first layer dense) at the planner scale:
/// tp 8, pp 8 (61 layers: 5 on the first stage, 8 on each other), dp 16, ep 32, etp 1, with
/// Transformer Engine (MLA's down projections whole on every rank of the stage).
#[test]
fn kimi_k2_holders_cover_every_tensor_exactly_once_per_replica() {
    let model = preset("kimi-k2");
    let pairs = [
        ("tp", 8),
        ("pp", 8),
        ("dp", 16),
        ("ep", 32),
        ("etp", 1),
        ("first_stage_layers", 5),
    ];
    let side = layout(&model, &pairs).unwrap();
    assert_eq!(side.world_size(), 1024);
    let cat = Catalogue::of(&model);
    for t in cat.tensors() {
        let h = side.holders(&t.name);
        let covered: u64 = h.iter().map(|h| h.region.numel()).sum();
        assert_eq!(covered, t.numel(), "{}", t.name);
    }
    // layer 60 is on the last stage (ranks 896..1024): the q down projection whole on all 128
    let q_down = side.holders("model.layers.60.self_attn.q_a_proj.weight");
    assert_eq!(q_down.len(), 1);
    assert_eq!(q_down[0].ranks.len(), 128);
    assert_eq!(q_down[0].ranks[0], RankId::train(896));
    assert_eq!(
        &*q_down[0].tensor,
        "decoder.layers.7.self_attention.linear_q_down_proj.weight"
    );
    // the kv up projection: 64 heads of (nope 128 + v 128) rows over tp 8, 16 ranks each
    let kv_up = side.holders("model.layers.60.self_attn.kv_b_proj.weight");
    assert_eq!(kv_up.len(), 8);
    assert!(kv_up.iter().all(|h| h.ranks.len() == 16));
    assert_eq!(kv_up[3].region.offset.as_slice(), &[3 * 8 * 256, 0]);
    assert_eq!(kv_up[3].region.extent.as_slice(), &[8 * 256, 512]);
    for r in [0, 1023] {
        let rl = side.rank_layout(RankId::train(r)).unwrap();
        validate_rank(&rl, &cat).unwrap();
    }
}
