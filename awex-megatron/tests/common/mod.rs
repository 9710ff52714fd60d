//! Helpers shared by the awex-megatron integration tests: model specs, layouts, canonical bytes.

#![allow(dead_code)]

use awex_core::backend::Backend;
use awex_core::backend::ParallelConfig;
use awex_core::layout::{
    LayoutError, LocalTensor, RankId, RankLayout, SideLayout, coverage, materialize, reconstruct,
    validate_holders, validate_rank,
};
use awex_core::model::{Architecture, Catalogue, ModelSpec, presets};
use awex_megatron::MegatronBackend;
use std::collections::HashMap;
use std::sync::Arc;

/// A built-in preset.
pub fn preset(name: &str) -> ModelSpec {
    presets::preset(name).unwrap_or_else(|| panic!("no preset {name}"))
}

/// A Qwen2-style model: q/k/v biases, no q/k norms (qwen3-tiny sizes).
pub fn qwen2_tiny() -> ModelSpec {
    ModelSpec {
        name: "qwen2-tiny".into(),
        architecture: Architecture::Qwen2,
        attention_bias: true,
        ..preset("qwen3-tiny")
    }
}

/// qwen3-tiny with tied embeddings.
pub fn tied_tiny() -> ModelSpec {
    ModelSpec {
        name: "qwen3-tiny-tied".into(),
        tie_word_embeddings: true,
        ..preset("qwen3-tiny")
    }
}

/// A model whose query groups hold 4 heads, so that tp > groups cuts inside the query block.
pub fn wide_groups() -> ModelSpec {
    ModelSpec {
        name: "wide-groups".into(),
        architecture: Architecture::Qwen2,
        attention_bias: true,
        hidden_size: 8,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 4,
        intermediate_size: 16,
        vocab_size: 300,
        num_layers: 2,
        ..preset("qwen3-tiny")
    }
}

/// A parallel config from pairs.
pub fn pc(pairs: &[(&str, u64)]) -> ParallelConfig {
    ParallelConfig::from_pairs(pairs.iter().copied())
}

/// The Megatron layout of `model` under `pairs`.
pub fn layout(
    model: &ModelSpec,
    pairs: &[(&str, u64)],
) -> Result<Arc<dyn SideLayout>, LayoutError> {
    MegatronBackend.layout(model, &pc(pairs))
}

/// One rank's layout (panics if the rank does not exist: a test bug).
pub fn rank(side: &dyn SideLayout, r: u32) -> RankLayout {
    side.rank_layout(RankId::train(r))
        .unwrap_or_else(|| panic!("rank {r} missing"))
}

/// A tensor of a rank by name.
pub fn tensor<'a>(rl: &'a RankLayout, name: &str) -> &'a LocalTensor {
    rl.tensor(name).unwrap_or_else(|| {
        let names: Vec<&str> = rl.tensors.iter().map(|t| &*t.name).collect();
        panic!("rank {} has no `{name}`; it has {names:?}", rl.rank)
    })
}

/// Deterministic pseudo-random canonical bytes: finite bf16/f16 values (exponent MSB cleared), distinct per tensor.
pub fn canonical_bytes(cat: &Catalogue) -> HashMap<String, Vec<u8>> {
    cat.tensors()
        .iter()
        .map(|t| {
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            for b in t.name.bytes() {
                x = (x ^ b as u64).wrapping_mul(0x100_0000_01b3);
            }
            let mut bytes = vec![0u8; t.nbytes() as usize];
            for c in bytes.chunks_exact_mut(2) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let v = (x as u16) & !0x4000;
                c.copy_from_slice(&v.to_le_bytes());
            }
            (t.name.clone(), bytes)
        })
        .collect()
}

/// Validates every rank, the holders, coverage, and the materialize -> reconstruct round trip.
pub fn check_everything(model: &ModelSpec, pairs: &[(&str, u64)]) {
    let side = layout(model, pairs).unwrap_or_else(|e| panic!("{pairs:?}: {e}"));
    let cat = Catalogue::of(model);
    let ranks: Vec<RankLayout> = side
        .ranks()
        .into_iter()
        .map(|r| side.rank_layout(r).expect("listed rank has a layout"))
        .collect();
    assert_eq!(ranks.len(), side.world_size(), "{pairs:?}");
    for rl in &ranks {
        validate_rank(rl, &cat).unwrap_or_else(|e| panic!("{} {pairs:?}: {e}", model.name));
    }
    validate_holders(side.as_ref(), &cat)
        .unwrap_or_else(|e| panic!("{} {pairs:?}: {e}", model.name));
    let gaps = coverage(side.as_ref(), &cat).unwrap_or_else(|e| panic!("{e}"));
    assert!(gaps.is_empty(), "{} {pairs:?}: {gaps:?}", model.name);
    let canon = canonical_bytes(&cat);
    let get = |n: &str| canon.get(n).map(|v| v.as_slice());
    let buffers: Vec<Vec<Vec<u8>>> = ranks
        .iter()
        .map(|rl| materialize(rl, &cat, &get).expect("materialize"))
        .collect();
    let back = reconstruct(&ranks, &buffers, &cat).expect("reconstruct");
    assert_eq!(back.len(), cat.len(), "{} {pairs:?}", model.name);
    for t in cat.tensors() {
        assert!(
            back.get(&t.name) == canon.get(&t.name),
            "{} {pairs:?}: `{}` does not round trip",
            model.name,
            t.name
        );
    }
}
