//! `options_from_names`: the options a live Megatron rank's parameter names decide
//! (`local_spec`, `grouped_gemm`, `single_grouped_weight`), read back from the names awex's own
//! layout gives every rank, so that `Writer.attach` recognises what the layout describes.

mod common;

use awex_core::backend::TrainingBackend;
use awex_megatron::{Config, MegatronBackend};
use common::*;

/// Parallel keys and their values.
type Pairs<'a> = &'a [(&'a str, u64)];

#[test]
fn options_from_names_give_back_the_spec_and_expert_module_of_every_rank_layout() {
    let moe = preset("qwen3-moe-tiny");
    let dense = preset("qwen3-tiny");
    // (pairs, the options the names must decide)
    let cases: [(Pairs, Pairs); 5] = [
        (
            &[("ep", 2), ("dp", 2)],
            &[("local_spec", 0), ("grouped_gemm", 1)],
        ),
        (
            &[("ep", 2), ("dp", 2), ("single_grouped_weight", 1)],
            &[
                ("local_spec", 0),
                ("grouped_gemm", 1),
                ("single_grouped_weight", 1),
            ],
        ),
        (
            &[("ep", 2), ("dp", 2), ("grouped_gemm", 0)],
            &[("local_spec", 0), ("grouped_gemm", 0)],
        ),
        (
            &[("ep", 2), ("dp", 2), ("local_spec", 1)],
            &[("local_spec", 1), ("grouped_gemm", 0)],
        ),
        (
            &[("pp", 2), ("vpp", 2), ("local_spec", 1)],
            &[("local_spec", 1), ("grouped_gemm", 0)],
        ),
    ];
    for (pairs, want) in cases {
        let side = layout(&moe, pairs).unwrap();
        for r in 0..side.world_size() as u32 {
            let names: Vec<String> = rank(side.as_ref(), r)
                .tensors
                .iter()
                .map(|t| t.name.to_string())
                .collect();
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let found = MegatronBackend.options_from_names(&refs);
            assert_eq!(found, want, "{pairs:?} rank {r}");
            // and what they decide resolves to the layout the names came from
            let both = |kv: &[(&str, u64)]| {
                let c = Config::resolve(&pc(kv)).unwrap();
                (c.local_spec, c.experts)
            };
            assert_eq!(both(&found), both(pairs), "{pairs:?} rank {r}");
        }
    }
    for (pairs, local) in [
        (&[("tp", 2)][..], 0),
        (&[("tp", 2), ("local_spec", 1)][..], 1),
    ] {
        let side = layout(&dense, pairs).unwrap();
        let names: Vec<String> = rank(side.as_ref(), 0)
            .tensors
            .iter()
            .map(|t| t.name.to_string())
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        assert_eq!(
            MegatronBackend.options_from_names(&refs),
            [("local_spec", local)]
        );
    }
}
