//! SGLang's engine control: the calls around an update and the check of a live server's info
//! against the pair's declared layout.

use awex_core::backend::{
    EngineCall, EngineControl, EngineExpect, HttpMethod, InferenceBackend, ParallelConfig,
    TriggerWork,
};
use awex_sglang::SglangBackend;
use serde_json::{Value, json};

fn control() -> &'static dyn EngineControl {
    SglangBackend
        .engine_control()
        .expect("the sglang backend drives its servers")
}

fn expect(parallel: &ParallelConfig) -> EngineExpect<'_> {
    EngineExpect {
        engine: 1,
        parallel,
        model: None,
        architecture: "Qwen3ForCausalLM",
    }
}

#[test]
fn pause_retracts_and_resume_continues() {
    let c = control();
    let facts = c
        .check_server(
            &json!({"tp_size": 2}),
            &expect(&ParallelConfig::from_pairs([("tp", 2)])),
        )
        .expect("agrees");
    assert_eq!(
        c.before_update(&facts, 3),
        vec![EngineCall {
            method: HttpMethod::Post,
            path: "/pause_generation".into(),
            body: Some(json!({"mode": "retract"})),
        }]
    );
    assert_eq!(
        c.resume(&facts),
        vec![EngineCall::post("/continue_generation", json!({}))]
    );
    assert_eq!(facts.ranks, 2);
}

#[test]
fn a_server_that_disagrees_with_the_pair_is_named_with_both_values() {
    let c = control();
    let p = ParallelConfig::from_pairs([("tp", 4), ("ep", 1)]);
    assert_eq!(
        c.check_server(&json!({"tp_size": 2, "ep_size": 1}), &expect(&p)),
        Err("the pair declares sglang tp=4 but the server reports tp_size=2".into())
    );
    assert_eq!(
        c.check_server(&json!({"tp_size": 4, "dp_size": 2}), &expect(&p))
            .unwrap_err(),
        "the server runs dp_size=2: awex drives one server per engine (start one server per replica, each an awex engine)"
    );
}

#[test]
fn attention_data_parallelism_and_a_dense_mlp_tp_of_its_own_are_refused_at_connect() {
    let c = control();
    let p = ParallelConfig::from_pairs([("tp", 4), ("ep", 1)]);
    // SGLang 0.5.23 reports attn_dp_size, and enable_dp_attention = attn_dp_size > 1
    for info in [
        json!({"tp_size": 4, "attn_dp_size": 2}),
        json!({"tp_size": 4, "enable_dp_attention": true}),
    ] {
        let e = c.check_server(&info, &expect(&p)).unwrap_err();
        assert!(
            e.starts_with("the server runs attention data parallelism (attn_dp_size=2")
                || e.starts_with(
                    "the server runs attention data parallelism (enable_dp_attention=true"
                ),
            "{e}"
        );
        assert!(e.contains("start the server without it"), "{e}");
    }
    let e = c
        .check_server(&json!({"tp_size": 4, "moe_dense_tp_size": 1}), &expect(&p))
        .unwrap_err();
    assert!(
        e.starts_with("the server runs moe_dense_tp_size=1 with tp_size=4"),
        "{e}"
    );
    // the defaults pass
    for info in [
        json!({"tp_size": 4, "attn_dp_size": 1, "enable_dp_attention": false}),
        json!({"tp_size": 4, "moe_dense_tp_size": null}),
        json!({"tp_size": 4, "moe_dense_tp_size": 4}),
    ] {
        let e = c.check_server(&info, &expect(&p)).err().unwrap_or_default();
        assert!(
            !e.contains("attention data") && !e.contains("moe_dense"),
            "{e}"
        );
    }
}

#[test]
fn success_false_is_the_engines_own_message() {
    let c = control();
    let call = EngineCall::post("/pause_generation", json!({}));
    assert_eq!(
        c.check_answer(&call, 200, &json!({"success": true})),
        Ok(())
    );
    assert_eq!(
        c.check_answer(&call, 200, &json!({"success": false, "message": "busy"})),
        Err("busy".into())
    );
    assert_eq!(
        c.check_answer(&call, 500, &json!({"detail": "x"})),
        Err(r#"HTTP 500: {"detail":"x"}"#.into())
    );
}

#[test]
fn a_failed_attempts_session_is_ended_and_triggers_name_the_target_model() {
    let c = control();
    let p = ParallelConfig::from_pairs([("tp", 2)]);
    let info = |version: &str| json!({"tp_size": 2, "version": version, "custom_weight_loader": ["awex.sglang.receive"]});
    let facts = c
        .check_server(&info("0.5.23"), &expect(&p))
        .expect("agrees");
    assert_eq!(
        c.abandon(&facts, None),
        vec![EngineCall::post("/end_weight_update", json!({}))]
    );
    let trigger = c
        .trigger(&facts, &TriggerWork::receive(7, 1))
        .expect("the loader is allowed");
    // awex's loader runs an atomic pair's apply inside the trigger
    assert!(c.applies_in_trigger(&facts));
    assert_eq!(trigger.body.unwrap()["selector"], json!("target"));
    assert_eq!(
        c.warm_up(&facts)[1].body.as_ref().unwrap()["selector"],
        json!("target")
    );
    // before 0.5.21 there is no session to end and no selector
    let old = c
        .check_server(&info("0.5.20"), &expect(&p))
        .expect("agrees");
    assert_eq!(c.abandon(&old, None), vec![]);
    assert!(
        c.trigger(&old, &TriggerWork::receive(7, 1))
            .unwrap()
            .body
            .unwrap()
            .get("selector")
            .is_none()
    );
    // without awex's loader no session was opened (and the ranks stage on their own)
    let plain = c
        .check_server(&json!({"tp_size": 2, "version": "0.5.23"}), &expect(&p))
        .expect("agrees");
    assert_eq!(c.abandon(&plain, Some(3)), vec![]);
}

#[test]
fn the_served_architecture_must_be_the_pairs_and_the_path_is_not_compared() {
    let c = control();
    let p = ParallelConfig::from_pairs([("tp", 2)]);
    let info = |arch: Value| {
        json!({"tp_size": 2, "model_path": "/ckpt/step_100",
               "model_info": {"model_path": "/ckpt/step_100", "architectures": arch}})
    };
    // another path than the trainer's is fine; the architecture agrees
    let facts = c
        .check_server(&info(json!(["Qwen3ForCausalLM"])), &expect(&p))
        .expect("agrees");
    assert_eq!(facts.extra["architectures"], json!(["Qwen3ForCausalLM"]));
    assert_eq!(facts.extra["model_path"], json!("/ckpt/step_100"));
    assert_eq!(
        c.check_server(&info(json!(["Qwen2ForCausalLM"])), &expect(&p)),
        Err("the pair's model is Qwen3ForCausalLM but the server reports architectures=[\"Qwen2ForCausalLM\"] (model_path /ckpt/step_100)".into())
    );
    // a server that does not report its architectures is not refused for it
    for unknown in [json!(null), json!([])] {
        let facts = c.check_server(&info(unknown), &expect(&p)).expect("agrees");
        assert_eq!(facts.extra["architectures"], Value::Null);
    }
    assert!(c.check_server(&json!({"tp_size": 2}), &expect(&p)).is_ok());
    assert_eq!(c.model_info_paths(), ["/model_info", "/get_model_info"]);
}

#[test]
fn abandon_sets_the_reported_version_back_to_the_committed_one_or_the_one_at_connect() {
    let c = control();
    let p = ParallelConfig::from_pairs([("tp", 2)]);
    let info = |version: &str, weight_version: Option<&str>| {
        json!({"tp_size": 2, "version": version, "custom_weight_loader": ["awex.sglang.receive"],
               "model_info": {"architectures": ["Qwen3ForCausalLM"], "weight_version": weight_version}})
    };
    let restore = |v: &str| {
        EngineCall::post(
            "/update_weight_version",
            json!({"new_version": v, "abort_all_requests": false}),
        )
    };
    let end = EngineCall::post("/end_weight_update", json!({}));
    let facts = c
        .check_server(&info("0.5.23", Some("default")), &expect(&p))
        .expect("agrees");
    // a committed version: the session is ended, then that version is reported again
    assert_eq!(c.abandon(&facts, Some(3)), vec![end.clone(), restore("3")]);
    // none committed yet: the version the server reported at connect
    assert_eq!(
        c.abandon(&facts, None),
        vec![end.clone(), restore("default")]
    );
    // a server that reported no version at connect, none committed: nothing to restore
    let silent = c
        .check_server(&info("0.5.23", None), &expect(&p))
        .expect("agrees");
    assert_eq!(c.abandon(&silent, None), vec![end]);
    assert_eq!(c.abandon(&silent, Some(4))[1], restore("4"));
    // before 0.5.21: no session, the version is still set back
    let old = c
        .check_server(&info("0.5.20", Some("7")), &expect(&p))
        .expect("agrees");
    assert_eq!(c.abandon(&old, None), vec![restore("7")]);
    assert_eq!(c.abandon(&old, Some(9)), vec![restore("9")]);
}
