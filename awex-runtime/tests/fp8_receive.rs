//! An FP8 inference rank in process: the transport's bytes land in bf16 staging, the rank
//! quantises them into the engine's e4m3 and scale tensors, and non-finite weights fail the
//! update naming the tensor.
//!
//! The inner transport is a stand-in that writes what a real one would deliver (the version's
//! canonical bf16 at every placement, `fill_or_check_from` over the plain layout); the shm and
//! tcp transports themselves carry FP8 pairs in `awex-cli/tests/demo.rs`.
//!
//! The GPU quantiser (cuda-ipc) has the same tests, ignored here (no GPU): run them with
//! `cargo test -p awex-runtime --features cuda --test fp8_receive -- --ignored` on a machine
//! with one (`scripts/gpu_fp8_ipc.sh` runs the test binary it finds in `.gpu/`).

use awex_core::encoding::{Encoding, Fp8Config, InferFp8, Recipe};
use awex_core::layout::{RankLayout, Side};
use awex_core::model::presets;
use awex_core::pair::{PairSpec, ResolvedPair};
use awex_core::weights::Weights;
use awex_core::{BackendSpec, Transport as TransportKind};
use awex_runtime::fill::{fill_or_check_from, fill_or_check_with};
use awex_runtime::transport::{
    EncodingTransport, ExecContext, ExecStats, Transport, refuse_on_gpu,
};
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
    // every block receiver-encoded (the stand-in delivers bf16 everywhere; the senders'
    // encoding runs through the real transports in awex-cli/tests/demo.rs)
    let mut pp = p.plan_pair();
    pp.encode_on_sender = false;
    let plan = pp.plan_rank(Side::Inference, rank).unwrap();
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
        bases: None,
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

#[test]
fn both_sides_of_a_cuda_ipc_pair_refuse_an_encoding_the_gpu_kernel_cannot_write() {
    use awex_runtime::rank::{RankConfig, make_transport, prepare};
    for side in [Side::Training, Side::Inference] {
        let c = RankConfig {
            infer_fp8: Some(fp8()),
            gateway: "http://127.0.0.1:9".into(),
            token: None,
            pair: "p".into(),
            side,
            rank: match side {
                Side::Training => awex_core::layout::RankId::train(0),
                Side::Inference => awex_core::layout::RankId::infer(0, 0),
            },
            model: presets::preset("qwen3-tiny").unwrap(),
            train: "megatron:tp=2".parse().unwrap(),
            infer: "sglang:tp=2".parse().unwrap(),
            transport: TransportKind::CudaIpc,
            bucket_bytes: 1 << 20,
            host: "127.0.0.1".into(),
            uid: String::new(),
            apply: Default::default(),
            transports: Default::default(),
            gateway_lost: awex_runtime::rank::DEFAULT_GATEWAY_LOST,
            deltas: true,
        };
        let prepared = prepare(&c).unwrap();
        let tensors = Arc::new(TensorSet::allocate_host(&prepared.layout).unwrap());
        let e = make_transport(&c, &prepared, tensors)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("the GPU kernel cannot write this encoding")
                && e.contains("it quantises 128x128 blocks only, not 16x16"),
            "{side:?}: {e}"
        );
    }
}

/// The five recipes the GPU kernel runs.
const GPU_RECIPES: [Recipe; 5] = [
    Recipe::Vllm,
    Recipe::VllmUe8m0,
    Recipe::DeepGemmUe8m0,
    Recipe::DeepGemmLegacy,
    Recipe::AwexPython,
];

/// 128 x 128 blocks with `recipe` (UE8M0 scales for a recipe that writes them).
fn fp8_128(recipe: Recipe) -> InferFp8 {
    let mut q = serde_json::json!({
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
    });
    if recipe.scale_format() == awex_core::encoding::ScaleFormat::Ue8m0 {
        q["scale_fmt"] = "ue8m0".into();
    }
    InferFp8::new(Fp8Config::from_hf(&q).unwrap(), recipe).unwrap()
}

#[test]
fn the_gpu_quantiser_refuses_what_its_kernel_cannot_write_instead_of_falling_back_to_the_host() {
    for recipe in GPU_RECIPES {
        assert!(refuse_on_gpu(&fp8_128(recipe)).is_ok(), "{}", recipe.name());
    }
    let e = refuse_on_gpu(&fp8()).unwrap_err().to_string();
    assert!(
        e.contains("the cuda-ipc transport quantises FP8 on the GPU, and the GPU kernel cannot write this encoding (fp8 e4m3, 16x16 blocks")
            && e.contains("it quantises 128x128 blocks only, not 16x16; use --transport shm or tcp, which quantise on the CPU"),
        "{e}"
    );
    let e = refuse_on_gpu(&fp8_128(Recipe::Slime))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the slime recipe has no GPU kernel yet")
            && e.contains("use --transport shm or tcp"),
        "{e}"
    );
    // the transport refuses before it touches a GPU, and host tensors are no GPU's
    let p = pair(Some(fp8()));
    let rank = p.inference.ranks()[1];
    let layout = p.inference.rank_layout(rank).unwrap();
    let plan = p.plan_pair().plan_rank(Side::Inference, rank).unwrap();
    let target = Arc::new(TensorSet::allocate_host(&layout).unwrap());
    let built =
        EncodingTransport::on_gpu(&layout, &p.catalogue, &plan, &fp8(), target, true, |_| {
            unreachable!("refused before the inner transport")
        });
    assert!(
        built.err().unwrap().to_string().contains("16x16"),
        "refused by name"
    );
}

/// A Qwen3 whose dims are multiples of 128 (qwen3-tiny's are not: its 64-row q projection would
/// cut a block), Megatron tp 2 into SGLang tp 1.
fn gpu_pair(fp8: Option<InferFp8>) -> ResolvedPair {
    let mut model = presets::preset("qwen3-tiny").unwrap();
    (model.hidden_size, model.num_heads, model.num_kv_heads) = (256, 2, 1);
    (model.head_dim, model.intermediate_size) = (128, 256);
    PairSpec {
        model,
        train: "megatron:tp=2".parse::<BackendSpec>().unwrap(),
        infer: "sglang:tp=1".parse::<BackendSpec>().unwrap(),
        transport: TransportKind::CudaIpc,
        infer_fp8: fp8,
    }
    .resolve()
    .unwrap()
}

#[test]
fn the_gpu_tests_pair_takes_128_blocks_and_plans_every_fp8_tensor_as_received_bf16() {
    for recipe in GPU_RECIPES {
        let p = gpu_pair(Some(fp8_128(recipe)));
        let rank = p.inference.ranks()[0];
        let layout = p.inference.rank_layout(rank).unwrap();
        let plan = p.plan_pair().plan_rank(Side::Inference, rank).unwrap();
        let fp8: Vec<_> = layout
            .tensors
            .iter()
            .filter(|t| matches!(t.encoding, Encoding::Fp8Block(_)))
            .collect();
        assert!(fp8.len() >= 8, "{}", fp8.len());
        assert!(
            fp8.iter()
                .any(|t| &*t.name == "model.layers.1.mlp.down_proj.weight")
        );
        let into_fp8 = plan
            .peers
            .iter()
            .flat_map(|p| &p.transfers)
            .filter(|t| fp8.iter().any(|f| f.name == t.dst_tensor));
        assert!(into_fp8.clone().count() > 0);
        assert!(
            into_fp8
                .into_iter()
                .all(|t| t.encode.is_some() && t.dst_dtype == awex_core::DType::Bf16)
        );
    }
}

#[test]
fn the_cpu_quantiser_writes_the_reference_bytes_of_the_gpu_tests_pair_for_each_gpu_recipe() {
    // what the GPU tests below expect, on the CPU quantiser: the same pair, recipes and check
    for recipe in GPU_RECIPES {
        let f = fp8_128(recipe);
        let (p, plain) = (gpu_pair(Some(f.clone())), gpu_pair(None));
        let rank = p.inference.ranks()[0];
        let layout = p.inference.rank_layout(rank).unwrap();
        let plan = p.plan_pair().plan_rank(Side::Inference, rank).unwrap();
        let target = Arc::new(TensorSet::allocate_host(&layout).unwrap());
        let (plain_layout, cat) = (
            plain.inference.rank_layout(rank).unwrap(),
            p.catalogue.clone(),
        );
        let mut t =
            EncodingTransport::new(&layout, &p.catalogue, &plan, &f, target.clone(), |set| {
                Ok(Box::new(Deliver {
                    set,
                    plain: plain_layout,
                    cat,
                    weights: Weights::Finite(Box::new(Weights::Synthetic)),
                    nan: None,
                }))
            })
            .unwrap();
        let (cancel, peers) = (AtomicBool::new(false), HashMap::new());
        let ctx = ExecContext {
            version: 3,
            attempt: 1,
            deadline: Instant::now() + Duration::from_secs(600),
            cancel: &cancel,
            checksums: false,
            peers: &peers,
            corrupt: false,
            bases: None,
        };
        t.execute(&ctx).unwrap();
        let w = Weights::Finite(Box::new(Weights::Synthetic));
        fill_or_check_with(&w, &layout, &p.catalogue, &target, 3, true, Some(&f))
            .unwrap_or_else(|e| panic!("{}: {e}", recipe.name()));
    }
}

/// As [`run`] on GPU 0 with 128 x 128 blocks ([`gpu_pair`]): device target and staging, the
/// stand-in uploads what a real transport would copy.
#[cfg(feature = "cuda")]
fn run_gpu(
    recipe: Recipe,
    nan: Option<(&str, usize)>,
) -> (
    Result<ExecStats, RuntimeError>,
    ResolvedPair,
    Arc<TensorSet>,
) {
    use awex_gpu::cuda::Device;

    struct Upload(Deliver);
    impl Transport for Upload {
        fn kind(&self) -> TransportKind {
            TransportKind::CudaIpc
        }
        fn rendezvous(&self) -> serde_json::Value {
            serde_json::Value::Null
        }
        fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
            let d = &self.0;
            let host = d.set.host_mirror()?;
            fill_or_check_from(&d.weights, &d.plain, &d.cat, &host, ctx.version, false)
                .map_err(RuntimeError::Fp8)?;
            if let Some((name, i)) = &d.nan {
                let v = host.get(name).unwrap();
                // SAFETY: nobody else touches the host copy.
                let b = unsafe { v.try_bytes_mut() }.unwrap();
                b[2 * i..2 * i + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
            }
            d.set.upload_from(&host)?;
            Ok(ExecStats::default())
        }
        fn close(&mut self) {}
    }

    let f = fp8_128(recipe);
    let spec = gpu_pair;
    let p = spec(Some(f.clone()));
    let plain = spec(None);
    let rank = p.inference.ranks()[0];
    let layout = p.inference.rank_layout(rank).unwrap();
    let plan = p.plan_pair().plan_rank(Side::Inference, rank).unwrap();
    let dev = Device::open(0).unwrap();
    let target = Arc::new(TensorSet::allocate_cuda(&layout, &dev).unwrap());
    let plain_layout = plain.inference.rank_layout(rank).unwrap();
    let cat = p.catalogue.clone();
    let mut t = EncodingTransport::on_gpu(
        &layout,
        &p.catalogue,
        &plan,
        &f,
        target.clone(),
        false,
        |set| {
            Ok(Box::new(Upload(Deliver {
                set,
                plain: plain_layout,
                cat,
                weights: Weights::Finite(Box::new(Weights::Synthetic)),
                nan: nan.map(|(n, i)| (n.to_string(), i)),
            })))
        },
    )
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
        bases: None,
    };
    (t.execute(&ctx), p, target)
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU"]
fn gpu_the_rank_quantises_its_device_staging_into_the_reference_bytes_for_each_gpu_recipe() {
    for recipe in GPU_RECIPES {
        let f = fp8_128(recipe);
        let (r, p, target) = run_gpu(recipe, None);
        r.unwrap();
        let layout = p.inference.rank_layout(p.inference.ranks()[0]).unwrap();
        assert!(
            layout
                .tensors
                .iter()
                .any(|t| matches!(t.encoding, Encoding::Fp8Block(_)))
        );
        let host = target.host_mirror().unwrap();
        target.download_to(&host).unwrap();
        let w = Weights::Finite(Box::new(Weights::Synthetic));
        fill_or_check_with(&w, &layout, &p.catalogue, &host, 3, true, Some(&f))
            .unwrap_or_else(|e| panic!("{}: {e}", recipe.name()));
        let e =
            fill_or_check_with(&w, &layout, &p.catalogue, &host, 4, true, Some(&f)).unwrap_err();
        assert!(e.contains("differs from version 4"), "{e}");
    }
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU"]
fn gpu_a_nan_in_the_weights_fails_the_update_naming_the_tensor() {
    let (r, _, _) = run_gpu(
        Recipe::Vllm,
        Some(("model.layers.1.mlp.down_proj.weight", 70)),
    );
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains("quantising `model.layers.1.mlp.down_proj.weight` to FP8 (vllm) on the GPU failed: 1 block(s) hold infinity or NaN")
            && e.contains("the update is not committed"),
        "{e}"
    );
}
