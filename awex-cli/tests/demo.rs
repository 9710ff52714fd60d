//! The main job end to end: rank processes, a real gateway, verified updates, and fault drills.

use serde_json::Value;
use std::process::Command;
use std::sync::Mutex;

/// The drills are timing-sensitive: run one demo at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn demo(args: &[&str]) -> (i32, Value, String) {
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .arg("demo")
        .args(["--model", "qwen3-tiny", "--json"])
        .args(args)
        .output()
        .expect("run awex-cli demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), json, stderr)
}

fn no_segments_left() {
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("awex-demo-"))
        .collect();
    assert!(left.is_empty(), "shared memory left behind: {left:?}");
}

#[test]
fn shm_demo_verifies_every_update_bit_for_bit() {
    let (code, j, err) = demo(&[
        "--train",
        "megatron:tp=2,pp=2",
        "--infer",
        "sglang:tp=2,engines=2",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(j["verified"], true);
    assert_eq!(j["transport"], "shm");
    let ups = j["updates"].as_array().unwrap();
    assert_eq!(ups.len(), 3);
    for (i, u) in ups.iter().enumerate() {
        assert_eq!(u["version"], i as u64 + 1);
        assert_eq!(u["verified"], true);
        // two engines of qwen3-tiny (tp=2): every placed bf16 element once per engine
        assert_eq!(u["bytes"], ups[0]["bytes"]);
    }
    assert!(ups[0]["bytes"].as_u64().unwrap() > 1_000_000);
    assert!(j["memcpy_gbps"].as_f64().unwrap() > 0.0);
    assert_eq!(j["leaked_segments"], Value::Array(vec![]));
    no_segments_left();
}

#[test]
fn tcp_demo_with_checksums_verifies_and_converts_fp32() {
    let (code, j, err) = demo(&[
        "--transport",
        "tcp",
        "--checksum",
        "--train",
        "megatron:tp=2,dp=2,fp32=1",
        "--infer",
        "sglang:tp=4",
        "--updates",
        "2",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(j["verified"], true);
    assert_eq!(j["updates"].as_array().unwrap().len(), 2);
}

#[test]
fn killed_training_rank_fails_the_update_and_a_restart_commits_the_retry() {
    let (code, j, err) = demo(&[
        "--fault-kill-train-rank",
        "1",
        "--fault-version",
        "2",
        "--deadline-s",
        "3",
    ]);
    assert_eq!(code, 0, "{err}");
    let ups = j["updates"].as_array().unwrap();
    assert_eq!(ups.len(), 4, "{j}");
    let failed = &ups[1];
    assert_eq!(
        (failed["version"].as_u64(), failed["verified"].as_bool()),
        (Some(2), Some(false))
    );
    assert!(
        failed["error"].as_str().unwrap().contains("deadline"),
        "{failed}"
    );
    assert!(
        failed["seconds"].as_f64().unwrap() < 6.0,
        "reported failed within twice the deadline"
    );
    assert_eq!(
        (ups[2]["version"].as_u64(), ups[2]["attempts"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(ups[2]["verified"], true);
    assert_eq!(ups[3]["verified"], true);
    assert_eq!(j["verified"], true);
    no_segments_left();
}

#[test]
fn corrupted_bucket_fails_the_update_with_checksums_on() {
    for transport in ["shm", "tcp"] {
        let (code, j, err) = demo(&[
            "--transport",
            transport,
            "--checksum",
            "--fault-corrupt-version",
            "2",
            "--deadline-s",
            "3",
        ]);
        assert_eq!(code, 1, "{err}");
        assert_eq!(j["verified"], false);
        let ups = j["updates"].as_array().unwrap();
        assert_eq!(ups[0]["verified"], true);
        assert_eq!(ups[1]["verified"], false);
        assert!(
            ups[1]["error"]
                .as_str()
                .unwrap()
                .contains("failed its checksum"),
            "{}",
            ups[1]
        );
        no_segments_left();
    }
}

#[test]
fn rank_with_a_disagreeing_layout_is_refused_at_join() {
    let (code, _, err) = demo(&["--fault-bad-infer", "sglang:tp=4"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("this rank was started with inference layout `sglang:tp=4` but pair")
            && err.contains("every rank must use the pair's layouts"),
        "{err}"
    );
    no_segments_left();
}

#[test]
fn gpu_transports_say_so_clearly() {
    let (code, _, err) = demo(&["--transport", "nccl"]);
    assert_eq!(code, 2);
    assert!(err.contains("use --transport shm or tcp"), "{err}");
}
