//! The main job end to end: rank processes, a real gateway, verified updates, and fault drills.

use serde_json::Value;
use std::process::Command;
use std::sync::Mutex;

/// The drills are timing-sensitive: run one demo at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Taken for the whole test, so that the shared-memory checks see no other demo's segments.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn demo(args: &[&str]) -> (i32, Value, String) {
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
    let _one = one_at_a_time();
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
    let _one = one_at_a_time();
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
    let _one = one_at_a_time();
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
    let _one = one_at_a_time();
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
    let _one = one_at_a_time();
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
fn nccl_placements_with_two_ranks_on_one_gpu_or_bad_lists_are_refused_at_start() {
    let _one = one_at_a_time();
    // both sides default to --gpu: one GPU for the whole communicator
    let (code, j, err) = demo(&[
        "--transport",
        "nccl",
        "--train",
        "megatron:tp=1",
        "--infer",
        "sglang:tp=1",
    ]);
    assert_eq!((code, j), (2, Value::Null));
    assert!(
        err.contains("NCCL cannot put two ranks of one communicator on the same GPU: training rank 0 and inference rank 0/0 would both use GPU 0; give every rank its own GPU with --train-gpus and --infer-gpus"),
        "{err}"
    );
    let (code, _, err) = demo(&[
        "--transport",
        "nccl",
        "--train",
        "megatron:tp=2",
        "--infer",
        "sglang:tp=2",
        "--train-gpus",
        "0,1",
        "--infer-gpus",
        "2,1",
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("training rank 1 and inference rank 0/1 would both use GPU 1"),
        "{err}"
    );
    let (code, _, err) = demo(&["--transport", "nccl", "--train-gpus", "0,one"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--train-gpus takes a comma list of GPU ordinals such as `0,1`, but `one` in `0,one` is not one"),
        "{err}"
    );
    let (code, _, err) = demo(&["--transport", "shm", "--infer-gpus", "1"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--train-gpus and --infer-gpus place the ranks of --transport nccl; with `shm` use --gpu"),
        "{err}"
    );
    no_segments_left();
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_transports_say_so_clearly() {
    let _one = one_at_a_time();
    let (code, j, err) = demo(&[
        "--transport",
        "nccl",
        "--train",
        "megatron:tp=1",
        "--infer",
        "sglang:tp=1",
        "--train-gpus",
        "0",
        "--infer-gpus",
        "1",
    ]);
    assert_eq!((code, j), (2, Value::Null));
    assert!(
        err.contains("this awex-cli was built without CUDA, so the demo cannot use `nccl`; rebuild with `cargo build --release -p awex-cli --features cuda`, or use --transport shm or tcp"),
        "{err}"
    );
    no_segments_left();
}

/// Reads one tensor's bytes from a safetensors file.
fn safetensor(path: &std::path::Path, name: &str) -> Vec<u8> {
    let data = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    let off = &h[name]["data_offsets"];
    let (a, b) = (
        off[0].as_u64().unwrap() as usize,
        off[1].as_u64().unwrap() as usize,
    );
    data[8 + n + a..8 + n + b].to_vec()
}

#[test]
fn hf_directory_weights_are_version_zero_and_dumps_hold_engine_layouts() {
    let _one = one_at_a_time();
    // a first run dumps canonical weights; they become an HF checkpoint for a second run
    let tmp = tempfile::tempdir().unwrap();
    let first = tmp.path().join("first");
    let (code, _, err) = demo(&["--updates", "1", "--dump-dir", first.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    for f in [
        "canonical.safetensors",
        "train/rank-3.safetensors",
        "infer/engine-1/rank-1.safetensors",
    ] {
        assert!(first.join(f).is_file(), "{f} missing");
    }
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    std::fs::write(
        hf.join("config.json"),
        r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":64,"num_hidden_layers":4,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":16,"intermediate_size":128,"vocab_size":1000,"torch_dtype":"bfloat16"}"#,
    )
    .unwrap();
    std::fs::copy(
        first.join("canonical.safetensors"),
        hf.join("model.safetensors"),
    )
    .unwrap();
    let second = tmp.path().join("second");
    let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args([
            "demo",
            "--json",
            "--updates",
            "1",
            "--model",
            hf.to_str().unwrap(),
        ])
        .args(["--dump-dir", second.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["updates"][0]["version"], 0);
    assert_eq!(j["verified"], true);
    // SGLang tp=2 rank 0 holds embedding rows 0..512 of 1024 padded rows: exactly the checkpoint's
    let ckpt = safetensor(&hf.join("model.safetensors"), "model.embed_tokens.weight");
    let local = safetensor(
        &second.join("infer/engine-0/rank-0.safetensors"),
        "model.embed_tokens.weight",
    );
    assert_eq!(local.len(), 512 * 64 * 2);
    assert_eq!(local, ckpt[..512 * 64 * 2]);
    // rank 1 holds rows 512..1000 then 24 zero padding rows
    let local1 = safetensor(
        &second.join("infer/engine-0/rank-1.safetensors"),
        "model.embed_tokens.weight",
    );
    assert_eq!(local1[..488 * 128], ckpt[512 * 128..]);
    assert!(local1[488 * 128..].iter().all(|&b| b == 0));
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_ipc_demo_on_a_build_without_cuda_says_so() {
    let _one = one_at_a_time();
    let (code, j, err) = demo(&["--transport", "cuda-ipc"]);
    assert_eq!((code, j), (2, Value::Null));
    assert!(
        err.contains("this awex-cli was built without CUDA, so the demo cannot use `cuda-ipc`; rebuild with `cargo build --release -p awex-cli --features cuda`"),
        "{err}"
    );
    no_segments_left();
}

/// Needs a GPU and a `--features cuda` build: `cargo test -p awex-cli --features cuda --test
/// demo -- --ignored cuda_ipc`.
#[test]
#[ignore = "needs a GPU and --features cuda"]
fn cuda_ipc_demo_verifies_every_update_on_the_gpu() {
    let _one = one_at_a_time();
    let (code, j, err) = demo(&[
        "--transport",
        "cuda-ipc",
        "--train",
        "megatron:tp=2",
        "--infer",
        "sglang:tp=2,engines=2",
    ]);
    assert_eq!(code, 0, "{err}\n{j}");
    assert_eq!(j["transport"], "cuda-ipc");
    assert_eq!(j["verified"], true);
    assert_eq!(j["updates"].as_array().map(Vec::len), Some(3));
    assert!(
        j["device_copy_gbps"].as_f64().is_some_and(|g| g > 0.0),
        "{j}"
    );
    assert_eq!(j["leaked_segments"], serde_json::json!([]));
    no_segments_left();
}

/// Needs 2 GPUs, NCCL >= 2.19 and a `--features cuda` build: `cargo test -p awex-cli --features
/// cuda --test demo -- --ignored nccl_demo`.
#[test]
#[ignore = "needs 2 GPUs, NCCL and --features cuda"]
fn nccl_demo_verifies_every_update_across_two_gpus() {
    let _one = one_at_a_time();
    let (code, j, err) = demo(&[
        "--transport",
        "nccl",
        "--train",
        "megatron:tp=1",
        "--infer",
        "sglang:tp=1",
        "--train-gpus",
        "0",
        "--infer-gpus",
        "1",
        "--checksum",
    ]);
    assert_eq!(code, 0, "{err}\n{j}");
    assert_eq!(j["transport"], "nccl");
    assert_eq!(j["verified"], true);
    assert_eq!(j["updates"].as_array().map(Vec::len), Some(3));
    assert_eq!(j["worker_errors"], serde_json::json!([]));
    no_segments_left();
}
