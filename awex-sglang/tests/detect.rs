//! SGLang's server-info responses (recorded fixtures) parse into what awex reads; detection
//! against live servers is tested where the probe is gathered (`awex-control/tests/probe_sglang.rs`).

use awex_sglang::ServerInfo;
use serde_json::Value;

const V05: &str = include_str!("fixtures/server_info_v0.5.json");
const V040: &str = include_str!("fixtures/get_server_info_v0.4.0.json");

#[test]
fn recorded_responses_parse_into_server_info() {
    let v05: Value = serde_json::from_str(V05).expect("fixture is JSON");
    assert_eq!(
        ServerInfo::from_json(&v05),
        Ok(ServerInfo {
            tp_size: 4,
            dp_size: 2,
            ep_size: 2,
            model_path: Some("Qwen/Qwen3-30B-A3B".into()),
            version: Some("0.5.2".into()),
            enable_dp_attention: false,
            attn_dp_size: 1,
            moe_dense_tp_size: None,
        })
    );
    let v040: Value = serde_json::from_str(V040).expect("fixture is JSON");
    let info = ServerInfo::from_json(&v040).expect("parses");
    assert_eq!((info.tp_size, info.dp_size, info.ep_size), (2, 1, 1));
    assert_eq!(
        ServerInfo::from_json(&serde_json::json!({"tp_size": 0})),
        Err("`tp_size` must be a positive integer, found 0".into())
    );
    assert_eq!(
        ServerInfo::from_json(&serde_json::json!([1])),
        Err("expected a JSON object, found an array".into())
    );
}
