//! `SideLayout::alike`: a layout that says two tensors are laid out alike gives them equal
//! holders but for their local tensor's name, and every holder names the tensor it says; and
//! the planner plans the same transfers whether a layout says it or not.

use awex_core::backend::side_layout;
use awex_core::layout::{Alike, Holder, RankId, RankLayout, Side, SideLayout};
use awex_core::plan::Pair;
use awex_core::{AlikeKey, BackendSpec, Catalogue, ModelSpec};
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

mod common;

/// Every family's tiny preset, and two larger models of families with more than one shape.
fn models() -> impl Iterator<Item = &'static str> {
    common::TINY_FAMILIES
        .into_iter()
        .chain(["deepseek-v2-lite", "qwen3-30b-a3b"])
}

fn layout(model: &ModelSpec, side: Side, spec: &str) -> Result<Arc<dyn SideLayout>, String> {
    std::hint::black_box((
        awex_megatron::CRATE,
        awex_sglang::CRATE,
        awex_fsdp::CRATE,
        awex_vllm::CRATE,
    ));
    let spec: BackendSpec = spec.parse().unwrap();
    side_layout(side, &spec, model).map_err(|e| format!("{} {spec}: {e}", model.name))
}

/// Checks the promise over every tensor of the model; returns (tensors with a key, keys).
fn check_promise(model: &ModelSpec, l: &dyn SideLayout, what: &str) -> (usize, usize) {
    let cat = Catalogue::of(model);
    let mut first: HashMap<AlikeKey, (String, Vec<Holder>)> = HashMap::new();
    let mut with_key = 0;
    for c in cat.tensors() {
        let Some(Alike { key, tensor }) = l.alike(&c.name) else {
            continue;
        };
        with_key += 1;
        let mut hs = l.holders(&c.name);
        assert!(
            !hs.is_empty(),
            "{what}: `{}` has a key but no holders",
            c.name
        );
        for h in &mut hs {
            assert_eq!(
                h.tensor, tensor,
                "{what}: a holder of `{}` names another tensor than its key's",
                c.name
            );
            h.tensor = Arc::from("");
        }
        match first.entry(key) {
            Entry::Occupied(e) => assert_eq!(
                e.get().1,
                hs,
                "{what}: `{}` and `{}` have one key but different holders",
                e.get().0,
                c.name
            ),
            Entry::Vacant(e) => {
                e.insert((c.name.clone(), hs));
            }
        }
    }
    (with_key, first.len())
}

#[test]
fn tensors_of_one_alike_key_have_the_same_holders_but_for_their_name() {
    let sides = [
        (Side::Training, "fsdp:dp=4"),
        (Side::Training, "fsdp:dp=3,replicate=2"),
        (Side::Training, "fsdp:dp=2,tp=2"),
        (Side::Training, "fsdp:dp=5,fused_experts=1"),
        (Side::Training, "fsdp:dp=4,replicate=2,fused_experts=1"),
        (Side::Training, "megatron:tp=2,pp=2,dp=2"),
        (Side::Training, "megatron:tp=2,pp=2,ep=2,etp=1"),
        (Side::Inference, "sglang:tp=4,engines=2"),
        (Side::Inference, "sglang:tp=4,ep=2,engines=2"),
        (
            Side::Inference,
            "sglang:tp=4,engines=2,fused_shared_experts=1",
        ),
        (Side::Inference, "sglang:tp=2,fused_shared_experts=0"),
        // Qwen3-Next's shared expert fused under expert parallelism (a copy on every EP rank)
        // or apart; the other models refuse or ignore the key here
        (
            Side::Inference,
            "sglang:tp=4,ep=2,engines=2,fused_shared_experts=1",
        ),
        (
            Side::Inference,
            "sglang:tp=4,ep=2,engines=2,fused_shared_experts=0",
        ),
        (Side::Inference, "vllm:tp=4,engines=2"),
        (Side::Inference, "vllm:tp=2,ep=2"),
    ];
    let mut checked = 0;
    for name in models() {
        let model = ModelSpec::resolve(name).unwrap();
        for (side, spec) in sides {
            // (a layout a family refuses is not one to check)
            let Ok(l) = layout(&model, side, spec) else {
                continue;
            };
            let what = format!("{name} {spec}");
            let (with_key, keys) = check_promise(&model, &*l, &what);
            if spec.starts_with("fsdp") {
                // the FSDP layout gives every tensor a key, and a model's layers share theirs
                assert_eq!(with_key, Catalogue::of(&model).len(), "{what}");
                assert!(
                    keys < with_key,
                    "{what}: {keys} keys for {with_key} tensors"
                );
            }
            checked += with_key;
        }
    }
    assert!(checked > 1000, "{checked} tensors checked");
}

/// A layout as another one, but saying nothing of tensors laid out alike.
struct NoAlike(Arc<dyn SideLayout>);

impl SideLayout for NoAlike {
    fn side(&self) -> Side {
        self.0.side()
    }
    fn ranks(&self) -> Vec<RankId> {
        self.0.ranks()
    }
    fn engines(&self) -> u32 {
        self.0.engines()
    }
    fn rank_layout(&self, rank: RankId) -> Option<RankLayout> {
        self.0.rank_layout(rank)
    }
    fn holders(&self, canonical: &str) -> Vec<Holder> {
        self.0.holders(canonical)
    }
    fn holders_into(&self, canonical: &str, out: &mut Vec<Holder>) {
        self.0.holders_into(canonical, out)
    }
    fn for_each_canonical(&self, rank: RankId, f: &mut dyn FnMut(&str)) -> bool {
        self.0.for_each_canonical(rank, f)
    }
}

#[test]
fn every_rank_plans_the_same_transfers_whether_its_layouts_say_alike_or_not() {
    let pairs = [
        (
            "qwen3.5-moe-tiny",
            "fsdp:dp=4,fused_experts=1",
            "sglang:tp=4,ep=2,engines=2",
        ),
        (
            "qwen3.5-moe-tiny",
            "fsdp:dp=3,replicate=2",
            "vllm:tp=2,engines=2",
        ),
        (
            "qwen3-next-tiny",
            "fsdp:dp=5,fused_experts=1",
            "vllm:tp=4,ep=4",
        ),
        (
            "qwen3-next-tiny",
            "fsdp:dp=4",
            "sglang:tp=4,ep=2,engines=2,fused_shared_experts=1",
        ),
        ("gpt-oss-tiny", "fsdp:dp=4", "vllm:tp=4,ep=4,engines=2"),
        ("qwen3-moe-tiny", "fsdp:dp=2,tp=2", "vllm:tp=2,engines=2"),
        (
            "deepseek-v3-tiny",
            "fsdp:dp=4,replicate=2",
            "sglang:tp=4,engines=2,fused_shared_experts=1",
        ),
    ];
    for (name, train, infer) in pairs {
        let model = ModelSpec::resolve(name).unwrap();
        let cat = Catalogue::of(&model);
        let training = layout(&model, Side::Training, train).unwrap();
        let inference = layout(&model, Side::Inference, infer).unwrap();
        let plain_training = NoAlike(training.clone());
        let plain_inference = NoAlike(inference.clone());
        let with = Pair {
            catalogue: &cat,
            training: &*training,
            inference: &*inference,
            encode_on_sender: false,
        };
        let without = Pair {
            catalogue: &cat,
            training: &plain_training,
            inference: &plain_inference,
            encode_on_sender: false,
        };
        let mut transfers = 0;
        for (side, l) in [(Side::Training, &training), (Side::Inference, &inference)] {
            for r in l.ranks() {
                let a = with.plan_rank(side, r).unwrap();
                let b = without.plan_rank(side, r).unwrap();
                assert_eq!(
                    a.fingerprint, b.fingerprint,
                    "{name} {train} -> {infer}: {r}"
                );
                assert_eq!(a.peers.len(), b.peers.len());
                for (p, q) in a.peers.iter().zip(&b.peers) {
                    assert_eq!(p.peer, q.peer);
                    assert_eq!(
                        &p.transfers[..],
                        &q.transfers[..],
                        "{name}: {r} and {}",
                        p.peer
                    );
                    transfers += p.transfers.len();
                }
            }
        }
        assert!(transfers > 0, "{name}");
    }
}
