//! vLLM's engine control: the five routes' calls (`vllm/entrypoints/rl/online/api_router.py`,
//! vLLM 0.33.0) and the check of a live server's `/server_info?config_format=json`.

use awex_core::backend::{
    EngineCall, EngineControl, EngineExpect, InferenceBackend, ParallelConfig, TriggerWork,
};
use awex_vllm::VllmBackend;
use serde_json::{Value, json};

fn control() -> &'static dyn EngineControl {
    VllmBackend
        .engine_control()
        .expect("the vllm backend drives its servers")
}

fn expect(parallel: &ParallelConfig) -> EngineExpect<'_> {
    EngineExpect {
        engine: 0,
        parallel,
        model: None,
        architecture: "Qwen3ForCausalLM",
    }
}

fn info(tp: u64, ep: bool, backend: Option<&str>) -> Value {
    json!({"vllm_config": {
        "model_config": {"model": "Qwen/Qwen3-0.6B"},
        "parallel_config": {"tensor_parallel_size": tp, "data_parallel_size": 1, "pipeline_parallel_size": 1, "enable_expert_parallel": ep},
        "weight_transfer_config": backend.map(|b| json!({"backend": b})),
    }, "vllm_env": {}, "system_env": {}})
}

#[test]
fn an_update_is_pause_start_update_finish_resume() {
    let c = control();
    let p = ParallelConfig::from_pairs([("tp", 2)]);
    let facts = c
        .check_server(&info(2, false, Some("awex")), &expect(&p))
        .expect("agrees");
    assert_eq!(facts.ranks, 2);
    assert_eq!(c.info_paths(), ["/server_info?config_format=json"]);
    assert_eq!(
        c.warm_up(&facts),
        vec![EngineCall::post(
            "/init_weight_transfer_engine",
            json!({"init_info": {}})
        )]
    );
    assert_eq!(
        c.before_update(&facts, 7),
        vec![
            EngineCall::post("/pause?mode=keep", json!({})),
            EngineCall::post("/start_weight_update", json!({})),
        ]
    );
    assert_eq!(
        c.trigger(&facts, &TriggerWork::receive(7, 1)),
        Some(EngineCall::post(
            "/update_weights",
            json!({"update_info": {"version": 7}})
        ))
    );
    // awex's weight-transfer engine stages and applies inside `/update_weights` (atomic pairs)
    assert!(c.applies_in_trigger(&facts));
    assert_eq!(
        c.after_update(&facts, 7),
        vec![EngineCall::post(
            "/finish_weight_update",
            json!({"weight_version": "7"})
        )]
    );
    assert_eq!(
        c.resume(&facts),
        vec![EngineCall::post("/resume", json!({}))]
    );
}

#[test]
fn a_failed_attempt_is_abandoned_with_a_finish_that_names_no_version() {
    let c = control();
    let p = ParallelConfig::from_pairs([("tp", 2)]);
    let facts = c
        .check_server(&info(2, false, Some("awex")), &expect(&p))
        .expect("agrees");
    // `weight_version` absent: vLLM keeps reporting the last committed version
    // (`AsyncLLM.finish_weight_update`, `vllm/v1/engine/async_llm.py`)
    for committed in [None, Some(6)] {
        assert_eq!(
            c.abandon(&facts, committed),
            vec![EngineCall::post("/finish_weight_update", json!({}))]
        );
    }
}

#[test]
fn a_server_that_disagrees_is_named_with_both_values() {
    let c = control();
    let p = ParallelConfig::from_pairs([("tp", 4), ("ep", 4)]);
    assert_eq!(
        c.check_server(&info(2, false, Some("awex")), &expect(&p))
            .unwrap_err(),
        "the pair declares vllm tp=4 but the server reports tensor_parallel_size=2"
    );
    assert_eq!(
        c.check_server(&info(4, false, Some("awex")), &expect(&p))
            .unwrap_err(),
        "the pair declares vllm ep=4 but the server reports ep (enable_expert_parallel)=1"
    );
    assert!(
        c.check_server(&info(4, true, Some("awex")), &expect(&p))
            .is_ok()
    );
    assert_eq!(
        c.check_server(&info(4, true, Some("nccl")), &expect(&p))
            .unwrap_err(),
        "the server's weight transfer backend is `nccl`: start it with --weight-transfer-config '{\"backend\": \"awex\"}' (and the awex wheel installed, which registers it)"
    );
    assert!(
        c.check_server(&info(4, true, None), &expect(&p))
            .unwrap_err()
            .contains("not set")
    );
    assert!(
        c.check_server(&json!({"vllm_config": "VllmConfig(...)"}), &expect(&p))
            .unwrap_err()
            .contains("config_format=json")
    );
}

#[test]
fn errors_are_the_servers_own_message() {
    let c = control();
    let call = EngineCall::post("/update_weights", json!({}));
    assert_eq!(
        c.check_answer(&call, 200, &json!({"message": "Weights updated"})),
        Ok(())
    );
    assert_eq!(
        c.check_answer(&call, 200, &json!({"status": "paused"})),
        Ok(())
    );
    assert_eq!(
        c.check_answer(&call, 400, &json!({"error": "bad mode"})),
        Err("bad mode".into())
    );
    assert_eq!(
        c.check_answer(&call, 500, &json!({"error": {"message": "awex: transport: peer reset", "type": "InternalServerError", "code": 500}})),
        Err("awex: transport: peer reset".into())
    );
    assert_eq!(
        c.check_answer(&call, 422, &json!({"detail": "missing"})),
        Err("missing".into())
    );
    assert_eq!(
        c.check_answer(&call, 502, &json!(null)),
        Err("HTTP 502: null".into())
    );
}
