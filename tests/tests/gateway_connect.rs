//! The gateway's connect with every backend registered (as in `awex-cli serve`): a parallel
//! config the backend refuses for the model is refused at connect, with the backend's reason,
//! before any rank joins.

use awex_control::server::{GatewayConfig, router};
use awex_control::wire::{ConnectRequest, InferenceSpec, PairOptions, TrainingSpec, Transport};
use awex_core::model::presets::preset;
use awex_core::{Catalogue, ParallelConfig};
use axum::body::Body;
use axum::http::{Request, header};
use serde_json::Value;
use tower::ServiceExt;

// Linked so that their backends register.
const _: [&str; 4] = [
    awex_megatron::CRATE,
    awex_fsdp::CRATE,
    awex_sglang::CRATE,
    awex_vllm::CRATE,
];

fn request(train: &str, train_parallel: &[(&str, u64)], world: u32) -> ConnectRequest {
    let model = preset("qwen3-0.6b").expect("preset");
    let summary = Catalogue::of(&model).summary();
    ConnectRequest {
        name: "p".into(),
        training: TrainingSpec {
            backend: train.into(),
            parallel: ParallelConfig::from_pairs(train_parallel.iter().copied()),
            world_size: world,
            model: model.clone(),
            catalogue: summary.clone(),
        },
        inference: InferenceSpec {
            spare: 0,
            fp8: None,
            backend: "sglang".into(),
            parallel: ParallelConfig::from_pairs([("tp", 2)]),
            engines: 1,
            world_size: 2,
            urls: Vec::new(),
            model,
            catalogue: summary,
        },
        transport: Transport::Shm,
        options: PairOptions::default(),
    }
}

async fn connect(req: &ConnectRequest) -> (u16, Value) {
    let app = router(GatewayConfig::default());
    let http = Request::builder()
        .method("POST")
        .uri("/v1/pairs")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(req).expect("json")))
        .expect("request");
    let resp = app.oneshot(http).await.expect("response");
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("body");
    (status, serde_json::from_slice(&bytes).expect("json body"))
}

#[tokio::test]
async fn connect_refuses_what_the_registered_backend_refuses() {
    // qwen3-0.6b has 16 query and 8 KV heads: fsdp tp=3 cannot split them
    let (s, v) = connect(&request("fsdp", &[("tp", 3)], 3)).await;
    assert_eq!(
        (s, v["error"].as_str().unwrap_or_default()),
        (
            422,
            "training.parallel `fsdp:tp=3`: model has 16 attention heads and 8 KV heads; fsdp tp=3 needs both divisible by tp (a colwise q/k/v_proj shard must hold whole heads, in the model's query-to-KV ratio)"
        )
    );
    let (s, v) = connect(&request("megatron", &[("tp", 3)], 3)).await;
    assert_eq!(s, 422, "{v}");
    assert!(
        v["error"].as_str().unwrap_or_default().starts_with(
            "training.parallel `megatron:tp=3`: model has 16 attention heads; megatron tp=3"
        ),
        "{v}"
    );
    let (s, v) = connect(&request("fsdp", &[("tp", 2)], 2)).await;
    assert_eq!(s, 201, "{v}");
}

#[tokio::test]
async fn connect_says_which_trained_tensors_the_inference_engine_drops() {
    // a Qwen3 with attention_bias has o_proj biases; vLLM 0.33's Qwen3 class builds o_proj
    // without a bias and its loader skips them
    let model = awex_core::ModelSpec {
        attention_bias: true,
        num_layers: 2,
        ..preset("qwen3-0.6b").expect("preset")
    };
    let summary = Catalogue::of(&model).summary();
    let mut req = request("megatron", &[("tp", 2)], 2);
    req.training.model = model.clone();
    req.training.catalogue = summary.clone();
    req.inference.model = model;
    req.inference.catalogue = summary;
    req.inference.backend = "vllm".into();
    let (s, v) = connect(&req).await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        v["inference"]["dropped"],
        serde_json::json!([
            "model.layers.0.self_attn.o_proj.bias",
            "model.layers.1.self_attn.o_proj.bias"
        ])
    );
    assert!(v["training"].get("dropped").is_none(), "{v}");
    // SGLang 0.5.23's Qwen3 builds o_proj with bias=attention_bias: nothing is dropped
    req.inference.backend = "sglang".into();
    let (s, v) = connect(&req).await;
    assert_eq!(s, 201, "{v}");
    assert!(v["inference"].get("dropped").is_none(), "{v}");
}

#[tokio::test]
async fn connect_carries_the_fp8_encoding_and_refuses_one_the_engines_cannot_hold() {
    let fp8 = |block: [u32; 2], recipe: &str| {
        let config = awex_core::encoding::Fp8Config::from_hf(&serde_json::json!({
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block
        }))
        .unwrap();
        // built field by field, as a client could send it (no check on this side)
        awex_core::encoding::InferFp8 {
            config,
            recipe: recipe.parse().unwrap(),
        }
    };
    let mut req = request("megatron", &[("tp", 2)], 2);
    req.inference.fp8 = Some(fp8([128, 128], "vllm"));
    let (s, v) = connect(&req).await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["inference"]["fp8"]["recipe"], "vllm", "{v}");
    assert!(v["training"].get("fp8").is_none(), "{v}");
    // qwen3-0.6b's 1024 query rows over sglang tp 2 cut no 128-row block; 384-row blocks do
    req.inference.fp8 = Some(fp8([384, 128], "vllm"));
    let (s, v) = connect(&req).await;
    assert_eq!(s, 422, "{v}");
    let e = v["error"].as_str().unwrap_or_default();
    assert!(
        e.starts_with("inference.fp8 with `sglang:tp=2`: ")
            && e.contains("not divisible by weight quantization block_n = 384"),
        "{e}"
    );
    // a recipe that writes power-of-two scales for an encoding of fp32 scales
    req.inference.fp8 = Some(fp8([128, 128], "deepgemm-ue8m0"));
    let (s, v) = connect(&req).await;
    assert_eq!(s, 422, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("inference.fp8: the deepgemm-ue8m0 quantiser writes Ue8m0 scales"),
        "{v}"
    );
}
