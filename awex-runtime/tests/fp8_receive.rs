//! An FP8 inference rank in process: the transport's bytes land in bf16 staging, the rank
//! quantises them into the engine's e4m3 and scale tensors, and non-finite weights fail the
//! update naming the tensor.
//!
//! The inner transport is a stand-in that writes what a real one would deliver (the version's
//! canonical bf16 at every placement, `fill_or_check_from` over the plain layout); the shm and
//! tcp transports themselves carry FP8 pairs in `awex-cli/tests/demo.rs`.

use awex_core::encoding::{Encoding, Fp8Config, InferFp8, Recipe};
use awex_core::layout::{RankLayout, Side};
use awex_core::model::presets;
use awex_core::pair::{PairSpec, ResolvedPair};
use awex_core::weights::Weights;
use awex_core::{BackendSpec, Transport as TransportKind};
use awex_runtime::fill::{fill_or_check_from, fill_or_check_with};
use awex_runtime::transport::{EncodingTransport, ExecContext, ExecStats, Transport};
use awex_runtime::{RuntimeError, TensorSet};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const _: [&str; 2] = [awex_megatron::CRATE, awex_sglang::CRATE];

fn pair(fp8: Option<InferFp8>) -> ResolvedPair {
    PairSpec {
        model: presets::preset("qwen3-tiny").unwrap(),
        train: "megatron:tp=2".parse::<BackendSpec>().unwrap(),
        infer: "sglang:tp=2".parse::<BackendSpec>().unwrap(),
        transport: TransportKind::Tcp,
        infer_fp8: fp8,
    }
    .resolve()
    .unwrap()
}

fn fp8() -> InferFp8 {
    let c = Fp8Config::from_hf(&serde_json::json!({
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]
    }))
    .unwrap();
    InferFp8::new(c, Recipe::Vllm).unwrap()
}

/// Delivers version `version` of the weights into its set (the staging in place of the FP8
/// tensors), then poisons element `nan` of tensor `.0` if asked.
struct Deliver {
    set: Arc<TensorSet>,
    plain: RankLayout,
    cat: awex_core::Catalogue,
    weights: Weights,
    nan: Option<(String, usize)>,
}

impl Transport for Deliver {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn rendezvous(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        fill_or_check_from(
            &self.weights,
            &self.plain,
            &self.cat,
            &self.set,
            ctx.version,
            false,
        )
        .map_err(RuntimeError::Fp8)?;
        if let Some((name, i)) = &self.nan {
            let v = self.set.get(name).unwrap();
            // SAFETY: nobody else touches the staging during this call.
            let b = unsafe { v.try_bytes_mut() }.unwrap();
            b[2 * i..2 * i + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
        }
        Ok(ExecStats::default())
    }
    fn close(&mut self) {}
}

fn run(
    nan: Option<(&str, usize)>,
) -> (
    Result<ExecStats, RuntimeError>,
    ResolvedPair,
    Arc<TensorSet>,
) {
    let f = fp8();
    let p = pair(Some(f.clone()));
    let plain = pair(None);
    let rank = p.inference.ranks()[1];
    let layout = p.inference.rank_layout(rank).unwrap();
    let plan = p.plan_pair().plan_rank(Side::Inference, rank).unwrap();
    let target = Arc::new(TensorSet::allocate_host(&layout).unwrap());
    let weights = Weights::Finite(Box::new(Weights::Synthetic));
    let plain_layout = plain.inference.rank_layout(rank).unwrap();
    let cat = p.catalogue.clone();
    let mut t = EncodingTransport::new(&layout, &p.catalogue, &plan, &f, target.clone(), |set| {
        Ok(Box::new(Deliver {
            set,
            plain: plain_layout,
            cat,
            weights,
            nan: nan.map(|(n, i)| (n.to_string(), i)),
        }))
    })
    .unwrap();
    let cancel = AtomicBool::new(false);
    let peers = HashMap::new();
    let ctx = ExecContext {
        version: 3,
        attempt: 1,
        deadline: Instant::now() + Duration::from_secs(600),
        cancel: &cancel,
        checksums: false,
        peers: &peers,
        corrupt: false,
    };
    (t.execute(&ctx), p, target)
}

#[test]
fn the_rank_quantises_its_staging_into_the_reference_bytes_and_scales() {
    let f = fp8();
    let (r, p, target) = run(None);
    r.unwrap();
    let rank = p.inference.ranks()[1];
    let layout = p.inference.rank_layout(rank).unwrap();
    assert!(
        layout
            .tensors
            .iter()
            .any(|t| matches!(t.encoding, Encoding::Fp8Block(_)))
    );
    let w = Weights::Finite(Box::new(Weights::Synthetic));
    fill_or_check_with(&w, &layout, &p.catalogue, &target, 3, true, Some(&f)).unwrap();
    // the check sees a wrong version, a flipped e4m3 byte and a flipped scale
    let e = fill_or_check_with(&w, &layout, &p.catalogue, &target, 4, true, Some(&f)).unwrap_err();
    assert!(e.contains("differs from version 4"), "{e}");
    for (name, at, what) in [
        ("model.layers.2.mlp.down_proj.weight", 5usize, "element 5"),
        (
            "model.layers.2.mlp.down_proj.weight_scale_inv",
            1,
            "scale 0",
        ),
    ] {
        let v = target.get(name).unwrap();
        // SAFETY: no update runs.
        let b = unsafe { v.try_bytes_mut() }.unwrap();
        b[at] ^= 1;
        let e =
            fill_or_check_with(&w, &layout, &p.catalogue, &target, 3, true, Some(&f)).unwrap_err();
        assert!(
            e.contains(name) && e.contains(what) && e.contains("recipe vllm"),
            "{e}"
        );
        b[at] ^= 1;
    }
    fill_or_check_with(&w, &layout, &p.catalogue, &target, 3, true, Some(&f)).unwrap();
    // without the FP8 config an FP8 tensor cannot be checked, and says so
    let e = fill_or_check_with(&w, &layout, &p.catalogue, &target, 3, true, None).unwrap_err();
    assert!(e.contains("is FP8 but no FP8 config was given"), "{e}");
}

#[test]
fn a_nan_in_the_weights_fails_the_update_naming_the_tensor_and_element() {
    // element 70 of the staging of down_proj [64, 64]: row 1, column 6
    let (r, _, _) = run(Some(("model.layers.1.mlp.down_proj.weight", 70)));
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains("quantising `model.layers.1.mlp.down_proj.weight` to FP8 (vllm) failed: element [1, 6] is NaN")
            && e.contains("the update is not committed"),
        "{e}"
    );
}
