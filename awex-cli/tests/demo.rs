//! The main job end to end: rank processes, a real gateway, verified updates, and fault drills.

use serde_json::Value;
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// The drills are timing-sensitive: run one demo at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Taken for the whole test: one demo of this test binary runs at a time.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The process ids of the demos this test (its thread) started: their segments, and no
    /// one else's, are what [`no_segments_left`] checks.
    static STARTED: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The segment prefixes the demos this test started reported (`segment_prefix`: their
    /// pair and connect uid): what [`no_segments_left`] looks for when a demo reported one.
    static PREFIXES: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs a demo command to its end, remembering its pid for [`no_segments_left`].
fn run_demo(cmd: &mut Command) -> std::process::Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run awex-cli demo");
    STARTED.with(|s| s.borrow_mut().push(child.id()));
    child.wait_with_output().expect("wait for awex-cli demo")
}

fn demo(args: &[&str]) -> (i32, Value, String) {
    // qwen3-tiny unless the test names a model
    let model: &[&str] = if args.contains(&"--model") {
        &[]
    } else {
        &["--model", "qwen3-tiny"]
    };
    let out = run_demo(
        Command::new(env!("CARGO_BIN_EXE_awex-cli"))
            .arg("demo")
            .args(model)
            .arg("--json")
            .args(args),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    if let Some(p) = json["segment_prefix"].as_str() {
        PREFIXES.with(|s| s.borrow_mut().push(p.to_string()));
    }
    (out.status.code().unwrap_or(-1), json, stderr)
}

/// The prefix of every segment of the demo process `pid` (its pair is `demo-{pid}`).
fn segment_prefix(pid: u32) -> String {
    format!("awex-demo-{pid}-")
}

/// Checks that no demo this test started left a shared-memory segment behind; segments of
/// other processes (another test binary's demo, an operator's) are not this test's business.
fn no_segments_left() {
    let started: Vec<String> =
        STARTED.with(|s| s.borrow().iter().map(|&p| segment_prefix(p)).collect());
    assert!(!started.is_empty(), "no demo was started by this test");
    // a demo's pid is not unique on a machine whose /dev/shm other PID namespaces share, or
    // once pids wrap: the prefix of its own connect (pair and uid) is, when it reported one
    let reported: Vec<String> = PREFIXES.with(|s| s.borrow().clone());
    let prefixes = if reported.len() == started.len() {
        reported
    } else {
        started
    };
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| prefixes.iter().any(|p| n.starts_with(p.as_str())))
        .collect();
    assert!(left.is_empty(), "shared memory left behind: {left:?}");
}

/// Removes a file this test created, also when the test fails.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn the_segment_check_sees_only_the_demos_this_test_started() {
    let _one = one_at_a_time();
    // what another demo on the machine (another `cargo test`, an operator) would have open
    let other = std::path::PathBuf::from(format!(
        "/dev/shm/awex-demo-other{}-t0.0.bucket0",
        std::process::id()
    ));
    std::fs::write(&other, b"another demo's segment").unwrap();
    let _gone = RemoveOnDrop(other);
    let (code, j, err) = demo(&["--updates", "1"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(j["verified"], true);
    no_segments_left();
    // and a segment of this test's own demo is found
    let pid = STARTED.with(|s| s.borrow()[0]);
    let mine = std::path::PathBuf::from(format!("/dev/shm/{}t0.0.left", segment_prefix(pid)));
    std::fs::write(&mine, b"left behind").unwrap();
    let _mine = RemoveOnDrop(mine);
    let found = std::panic::catch_unwind(no_segments_left).is_err();
    assert!(
        !found,
        "a segment of another connect of the demo's pair name was taken for its own"
    );
    let own = PREFIXES.with(|s| s.borrow()[0].clone());
    assert!(
        own.starts_with(&segment_prefix(pid)) && own.len() == segment_prefix(pid).len() + 33,
        "{own}"
    );
    let mine = std::path::PathBuf::from(format!("/dev/shm/{own}t0.0.left-data"));
    std::fs::write(&mine, b"left behind").unwrap();
    let _mine = RemoveOnDrop(mine);
    let found = std::panic::catch_unwind(no_segments_left).is_err();
    assert!(found, "a segment of this test's demo was not found");
}

/// A live segment named like the demo's own but of another connect: what a demo of the same
/// pid in another PID namespace sharing /dev/shm holds, or the ranks of a killed demo whose pid
/// this one reused (they keep their segments until they give the lost gateway up). The demo
/// used to take every `awex-demo-{pid}-*` segment for its own: it reported such a segment
/// LEAKED and failed, and the test's check (by pid, after the demo exited) could find another
/// demo's live ranks' segments, which are gone once that demo ends.
#[test]
fn a_live_segment_of_another_demo_with_the_same_pid_is_neither_reported_nor_removed() {
    let _one = one_at_a_time();
    let child = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args(["demo", "--model", "qwen3-tiny", "--json", "--updates", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run awex-cli demo");
    let pid = child.id();
    STARTED.with(|s| s.borrow_mut().push(pid));
    // created (and its liveness lock held, as a live rank holds it) while the demo measures
    // its floors, seconds before its ranks start: long before its check
    let foreign = awex_runtime::shm::segment_name(
        &format!("demo-{pid}"),
        "f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0",
        "t0.0.0badf00d",
        "data",
    );
    let seg = awex_runtime::shm::ShmSegment::create(&foreign, 4096).unwrap();
    let out = child.wait_with_output().expect("wait for awex-cli demo");
    let j: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    if let Some(p) = j["segment_prefix"].as_str() {
        PREFIXES.with(|s| s.borrow_mut().push(p.to_string()));
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}\n{j}");
    assert_eq!(j["checks"]["shared_memory"]["ok"], true, "{j}");
    assert_eq!(j["leaked_segments"], Value::Array(vec![]), "{j}");
    assert!(
        std::path::Path::new(&format!("/dev/shm/{foreign}")).exists(),
        "the demo removed a live segment that was not its own"
    );
    no_segments_left();
    drop(seg);
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
        // the slowest inference rank's data plane: inside the update, which also waits on the
        // gateway's round trips
        let moved = u["transfer_ms"]
            .as_f64()
            .expect("transfer_ms of a committed update");
        let whole = u["seconds"].as_f64().unwrap() * 1e3;
        assert!(moved > 0.0 && moved < whole, "{moved} ms of {whole} ms");
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
        "--checksums",
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

/// A bf16 FSDP trainer holds Qwen3.5's fp32 `A_log` rounded to bf16 and sends it widened into
/// the engines' fp32: the demo checks the engines against what the trainer holds (it reported
/// every update NOT verified before, comparing with the unrounded checkpoint values).
#[test]
fn a_trainer_holding_a_tensor_narrower_than_the_checkpoint_is_verified_against_what_it_sends() {
    let _one = one_at_a_time();
    for infer in ["sglang:tp=2", "vllm:tp=2,ep=2"] {
        let (code, j, err) = demo(&[
            "--model",
            "qwen3.5-moe-tiny",
            "--train",
            "fsdp:dp=2",
            "--infer",
            infer,
            "--updates",
            "2",
        ]);
        assert_eq!(code, 0, "{infer}: {err}");
        assert_eq!(j["verified"], true, "{infer}: {j}");
    }
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
    // the killed process's presence poll closed: the version fails at once, naming it
    assert!(
        failed["error"].as_str().unwrap().contains(
            "training rank 1 is gone without reporting: its event poll's connection closed"
        ),
        "{failed}"
    );
    // a failed attempt has no data-plane time (its move did not finish)
    assert!(failed.get("transfer_ms").is_none(), "{failed}");
    // in place, the ranks had been told to write: the version is torn
    assert_eq!(failed["torn"], true, "{failed}");
    assert!(failed["live_intact"].is_boolean(), "{failed}");
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
fn available_commits_without_a_killed_engine_which_is_behind_then_catches_up() {
    let _one = one_at_a_time();
    for transport in ["shm", "tcp"] {
        // three engines; engine 1's rank is SIGKILLed as version 2 starts
        let (code, j, err) = demo(&[
            "--transport",
            transport,
            "--infer",
            "sglang:tp=1,engines=3",
            "--commit",
            "available",
            "--fault-kill-infer-engine",
            "1",
            "--fault-version",
            "2",
            "--updates",
            "4",
            "--deadline-s",
            "60",
        ]);
        assert_eq!(code, 0, "{transport}: {err}");
        let ups = j["updates"].as_array().unwrap();
        assert_eq!(ups.len(), 4, "{transport}: {j}");
        // version 2 commits on engines 0 and 2, every byte verified there, without waiting
        // for the deadline (the dead rank's presence poll closed: its engine is left out)
        let v2 = &ups[1];
        assert_eq!(
            (v2["version"].as_u64(), v2["attempts"].as_u64()),
            (Some(2), Some(1)),
            "{transport}: {v2}"
        );
        assert_eq!(v2["verified"], true, "{transport}: {v2}");
        assert_eq!(v2["left_out"], serde_json::json!([1]), "{transport}: {v2}");
        assert!(v2["seconds"].as_f64().unwrap() < 60.0, "{transport}: {v2}");
        // the killed engine was reported behind, never serving version 2
        assert_eq!(v2["behind"], true, "{transport}: {v2}");
        // restarted, it took every byte of version 3 (verified) and serves it like the others
        let v3 = &ups[2];
        assert_eq!(v3["verified"], true, "{transport}: {v3}");
        assert!(v3.get("left_out").is_none(), "{transport}: {v3}");
        assert_eq!(v3["caught_up"], true, "{transport}: {v3}");
        assert_eq!(ups[3]["verified"], true, "{transport}: {j}");
        assert_eq!(j["checks"]["engines"]["ok"], true, "{transport}: {j}");
        assert_eq!(j["verified"], true, "{transport}: {j}");
    }
    no_segments_left();
}

#[test]
fn atomic_available_commits_without_a_killed_engine_whose_ranks_skip_apply_then_it_catches_up() {
    let _one = one_at_a_time();
    // atomic pair with deltas, three engines; engine 1's rank is SIGKILLed as version 2
    // starts: `apply` names it, the others copy staging into their live tensors and the version
    // commits there; restarted, engine 1 takes every byte of version 3, the others a delta
    let (code, j, err) = demo(&[
        "--transport",
        "shm",
        "--infer",
        "sglang:tp=1,engines=3",
        "--commit",
        "available",
        "--atomic",
        "--deltas",
        "--lr",
        "1e-6",
        "--fault-kill-infer-engine",
        "1",
        "--fault-version",
        "2",
        "--updates",
        "3",
        "--deadline-s",
        "60",
    ]);
    assert_eq!(code, 0, "{err}");
    let ups = j["updates"].as_array().unwrap();
    assert_eq!(ups.len(), 3, "{j}");
    let v2 = &ups[1];
    assert_eq!(
        (v2["version"].as_u64(), v2["attempts"].as_u64()),
        (Some(2), Some(1)),
        "{v2}"
    );
    assert_eq!(v2["verified"], true, "{v2}");
    assert_eq!(v2["left_out"], serde_json::json!([1]), "{v2}");
    assert_eq!(v2["behind"], true, "{v2}");
    let v3 = &ups[2];
    assert_eq!(v3["verified"], true, "{v3}");
    assert!(v3.get("left_out").is_none(), "{v3}");
    assert_eq!(v3["caught_up"], true, "{v3}");
    assert_eq!(j["checks"]["engines"]["ok"], true, "{j}");
    assert_eq!(j["checks"]["deltas"]["ok"], true, "{j}");
    assert_eq!(j["verified"], true, "{j}");
    no_segments_left();
}

#[test]
fn an_engine_added_mid_run_catches_up_whole_and_then_serves() {
    let _one = one_at_a_time();
    for transport in ["shm", "tcp"] {
        // engine 2's slot starts empty; the engine is added (and its rank started) just before
        // version 3
        let (code, j, err) = demo(&[
            "--transport",
            transport,
            "--infer",
            "sglang:tp=1,engines=3",
            "--commit",
            "available",
            "--fault-add-engine",
            "--fault-version",
            "3",
            "--updates",
            "4",
            "--deltas",
            "--deadline-s",
            "60",
        ]);
        assert_eq!(code, 0, "{transport}: {err}");
        let ups = j["updates"].as_array().unwrap();
        assert_eq!(ups.len(), 4, "{transport}: {j}");
        for u in &ups[..2] {
            // out of the versions before it was added, which committed on the others at once
            assert_eq!(u["left_out"], serde_json::json!([2]), "{transport}: {u}");
            assert_eq!(u["attempts"], 1, "{transport}: {u}");
        }
        for u in &ups[2..] {
            // its first version and the next: it took part, every byte of it verified
            assert!(u.get("left_out").is_none(), "{transport}: {u}");
            assert_eq!(u["verified"], true, "{transport}: {u}");
        }
        // the three engines' share of the dense bytes in its first version, not two engines'
        let (two, three) = (
            ups[1]["dense_bytes"].as_u64().unwrap(),
            ups[2]["dense_bytes"].as_u64().unwrap(),
        );
        assert_eq!(two * 3, three * 2, "{transport}: {j}");
        // deltas: the spare slot is no exception to the base; the added engine's rank is, in
        // its first version (every byte to it), and no more after
        assert_eq!(
            ups[1]["base"],
            serde_json::json!([1, 0]),
            "{transport}: {j}"
        );
        assert_eq!(
            ups[2]["base"],
            serde_json::json!([2, 1]),
            "{transport}: {j}"
        );
        assert_eq!(
            ups[3]["base"],
            serde_json::json!([3, 0]),
            "{transport}: {j}"
        );
        assert_eq!(j["checks"]["deltas"]["ok"], true, "{transport}: {j}");
        assert_eq!(j["checks"]["fleet"]["ok"], true, "{transport}: {j}");
        assert_eq!(j["verified"], true, "{transport}: {j}");
    }
    no_segments_left();
}

#[test]
fn an_engine_removed_mid_update_leaves_the_others_versions_whole() {
    let _one = one_at_a_time();
    for transport in ["shm", "tcp"] {
        let (code, j, err) = demo(&[
            "--transport",
            transport,
            "--infer",
            "sglang:tp=1,engines=3",
            "--commit",
            "quorum:2",
            "--fault-remove-engine",
            "1",
            "--fault-version",
            "2",
            "--updates",
            "4",
            "--deadline-s",
            "60",
        ]);
        assert_eq!(code, 0, "{transport}: {err}");
        let ups = j["updates"].as_array().unwrap();
        assert_eq!(ups.len(), 4, "{transport}: {j}");
        assert!(ups[0].get("left_out").is_none(), "{transport}: {j}");
        for u in &ups[1..] {
            // removed while version 2 ran: that one and every later one commit at once on
            // the two others, every byte verified there
            assert_eq!(u["left_out"], serde_json::json!([1]), "{transport}: {u}");
            assert_eq!(u["attempts"], 1, "{transport}: {u}");
            assert_eq!(u["verified"], true, "{transport}: {u}");
        }
        // its rank processes exited cleanly on their own (no worker error), its slot is free
        assert_eq!(
            j["worker_errors"],
            serde_json::json!([]),
            "{transport}: {j}"
        );
        assert_eq!(j["checks"]["fleet"]["ok"], true, "{transport}: {j}");
        assert_eq!(j["verified"], true, "{transport}: {j}");
    }
    no_segments_left();
}

#[test]
fn quorum_with_two_engines_stopped_does_not_commit_and_the_retry_commits_everywhere() {
    let _one = one_at_a_time();
    // over tcp too: a SIGSTOPped engine's rank, once resumed, abandons the attempt it missed
    // (past the gateway's deadline of that attempt, or over) and takes the retry
    for transport in ["shm", "tcp"] {
        let (code, j, err) = demo(&[
            "--transport",
            transport,
            "--infer",
            "sglang:tp=1,engines=3",
            "--commit",
            "quorum:2",
            "--fault-stop-infer-engines",
            "1,2",
            "--fault-version",
            "2",
            "--updates",
            "3",
            "--deadline-s",
            "4",
        ]);
        assert_eq!(code, 0, "{transport}: {err}");
        let ups = j["updates"].as_array().unwrap();
        assert_eq!(ups.len(), 4, "{transport}: {j}");
        let failed = &ups[1];
        assert_eq!(
            (failed["version"].as_u64(), failed["verified"].as_bool()),
            (Some(2), Some(false)),
            "{transport}: {failed}"
        );
        // one engine cannot make a quorum of two: the version does not commit, and no engine
        // is reported serving it (in place, it may have written: torn, kept from serving)
        assert_eq!(failed["none_serving"], true, "{transport}: {failed}");
        assert_eq!(failed["torn"], true, "{transport}: {failed}");
        // after SIGCONT, the retry commits (on a quorum at least), every byte verified where
        // it committed
        assert_eq!(
            (ups[2]["version"].as_u64(), ups[2]["attempts"].as_u64()),
            (Some(2), Some(2)),
            "{transport}: {j}"
        );
        assert_eq!(ups[2]["verified"], true, "{transport}: {j}");
        // every engine is back in the retry
        assert!(ups[2].get("left_out").is_none(), "{transport}: {j}");
        assert_eq!(ups[3]["verified"], true, "{transport}: {j}");
        assert_eq!(j["verified"], true, "{transport}: {j}");
    }
    no_segments_left();
}

#[test]
fn available_with_a_stopped_engine_commits_on_the_others_near_the_deadline_and_it_catches_up() {
    let _one = one_at_a_time();
    for transport in ["shm", "tcp"] {
        let (code, j, err) = demo(&[
            "--transport",
            transport,
            "--infer",
            "sglang:tp=1,engines=3",
            "--commit",
            "available",
            "--fault-stop-infer-engines",
            "1",
            "--fault-version",
            "2",
            "--updates",
            "3",
            "--deadline-s",
            "4",
        ]);
        assert_eq!(code, 0, "{transport}: {err}");
        let ups = j["updates"].as_array().unwrap();
        // a silent engine holds version 2 until close to its deadline, whatever the transport:
        // the training ranks give it up at the cut-off, 0.5 s before the deadline (shm; and
        // tcp where its sends do not fit in socket buffers), or the gateway leaves it out at
        // the deadline (tcp, whose sends to it fit); either way version 2 commits on the two
        // others in its first attempt, and the resumed engine catches up in version 3
        assert!(
            ups[1]["seconds"].as_f64().unwrap() >= 3.4,
            "{transport}: {}",
            ups[1]
        );
        assert_eq!(ups.len(), 3, "{transport}: {j}");
        assert_eq!(
            (ups[1]["version"].as_u64(), ups[1]["attempts"].as_u64()),
            (Some(2), Some(1)),
            "{transport}: {j}"
        );
        assert_eq!(
            ups[1]["left_out"],
            serde_json::json!([1]),
            "{transport}: {j}"
        );
        assert_eq!(ups[1]["verified"], true, "{transport}: {j}");
        assert!(ups[2].get("left_out").is_none(), "{transport}: {j}");
        let last = ups.last().unwrap();
        assert_eq!(last["version"].as_u64(), Some(3), "{transport}: {j}");
        assert_eq!(last["verified"], true, "{transport}: {j}");
        assert_eq!(j["verified"], true, "{transport}: {j}");
    }
    no_segments_left();
}

#[test]
fn atomic_killed_training_rank_leaves_the_live_weights_intact_and_not_torn() {
    let _one = one_at_a_time();
    let (code, j, err) = demo(&[
        "--atomic",
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
    // a SIGKILLed sender before `apply`: every inference rank's live tensors still hold
    // version 1 byte for byte, the pair is not torn, and the retry commits
    assert_eq!(failed["torn"], false, "{failed}");
    assert_eq!(failed["live_intact"], true, "{failed}");
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
            "--checksums",
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
    // a CPU transport takes no GPU flag, --gpu included, and says which applies where
    for flag in [["--infer-gpus", "1"], ["--gpu", "1"]] {
        let (code, _, err) = demo(&["--transport", "shm", flag[0], flag[1]]);
        assert_eq!(code, 2);
        assert!(
            err.contains("`shm` runs on the CPU and takes no GPU flags: --gpu applies to --transport cuda-ipc (the GPU of every rank) and nccl (the default of --train-gpus and --infer-gpus); --train-gpus and --infer-gpus apply to nccl only"),
            "{err}"
        );
    }
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
    let out = run_demo(
        Command::new(env!("CARGO_BIN_EXE_awex-cli"))
            .args([
                "demo",
                "--json",
                "--updates",
                "1",
                "--model",
                hf.to_str().unwrap(),
            ])
            .args(["--dump-dir", second.to_str().unwrap()]),
    );
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
    // with --updates 1 every dump holds the checkpoint: the canonical one tensor for tensor,
    // the training ranks theirs in Megatron's layout
    let ckpt_file = hf.join("model.safetensors");
    for name in safetensor_names(&ckpt_file) {
        assert_eq!(
            safetensor(&second.join("canonical.safetensors"), &name),
            safetensor(&ckpt_file, &name),
            "{name}"
        );
    }
    training_dumps_match(&second, &ckpt_file);
    assert_eq!(j["checks"]["dumps"]["ok"], true, "{j}");
}

/// Every tensor name of a safetensors file.
fn safetensor_names(path: &std::path::Path) -> Vec<String> {
    let data = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    h.as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

/// The first pipeline stage of the default `megatron:tp=2,pp=2` (ranks 0 and 1) holds the
/// embedding rows of its TP rank and every layer norm of layers 0 and 1 whole: each equals
/// `canonical`'s.
fn training_dumps_match(dump: &std::path::Path, canonical: &std::path::Path) {
    let embed = safetensor(canonical, "model.embed_tokens.weight");
    let rank0 = dump.join("train/rank-0.safetensors");
    assert_eq!(
        safetensor(&rank0, "embedding.word_embeddings.weight"),
        embed[..512 * 64 * 2],
        "training rank 0's embedding rows"
    );
    for rank in [0, 1] {
        let f = dump.join(format!("train/rank-{rank}.safetensors"));
        for layer in [0, 1] {
            for (megatron, hf) in [
                (
                    "self_attention.linear_qkv.layer_norm_weight",
                    "input_layernorm.weight",
                ),
                (
                    "mlp.linear_fc1.layer_norm_weight",
                    "post_attention_layernorm.weight",
                ),
                (
                    "self_attention.k_layernorm.weight",
                    "self_attn.k_norm.weight",
                ),
            ] {
                assert_eq!(
                    safetensor(&f, &format!("decoder.layers.{layer}.{megatron}")),
                    safetensor(canonical, &format!("model.layers.{layer}.{hf}")),
                    "training rank {rank} layer {layer} {megatron}"
                );
            }
        }
    }
}

#[test]
fn training_dumps_hold_the_last_version_like_the_canonical_one() {
    let _one = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d");
    let (code, j, err) = demo(&["--updates", "2", "--dump-dir", d.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(j["updates"].as_array().map(Vec::len), Some(2));
    // not version 3, which the trainers pre-fill after committing version 2
    training_dumps_match(&d, &d.join("canonical.safetensors"));
}

#[test]
fn demo_says_what_it_checked_in_the_table_and_in_json() {
    let _one = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("dump");
    let out = run_demo(
        Command::new(env!("CARGO_BIN_EXE_awex-cli"))
            .args([
                "demo",
                "--model",
                "qwen3-tiny",
                "--updates",
                "2",
                "--checksums",
            ])
            .args(["--dump-dir", d.to_str().unwrap()]),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after_table: Vec<&str> = stdout
        .lines()
        .skip_while(|l| *l != "checks:")
        .skip(1)
        .collect();
    assert_eq!(after_table.len(), 4, "{stdout}");
    assert_eq!(
        after_table[0],
        "  ok      every byte of every inference rank (4 ranks, 2 engines) compared with the canonical weights of that version after each update: 2 of 2 updates verified"
    );
    assert_eq!(
        after_table[1],
        "  ok      per-bucket xxh3 checksums verified by every receiver and compared by the gateway (sent = received) before each commit: 2 of 2 updates compared"
    );
    assert!(
        after_table[2]
            .starts_with("  ok      no shared memory left behind (no /dev/shm/awex-demo-")
            && after_table[2].ends_with("-* after disconnect)"),
        "{}",
        after_table[2]
    );
    assert_eq!(
        after_table[3],
        format!(
            "  ok      {} holds version 2: canonical.safetensors (HF layout), train/rank-N.safetensors (4 files), infer/engine-E/rank-N.safetensors (4 files), each rank's tensors in its engine's layout",
            d.display()
        )
    );
    // the same checks in --json; those that did not run are absent
    let (code, j, err) = demo(&[
        "--train",
        "megatron:tp=1",
        "--infer",
        "sglang:tp=1",
        "--updates",
        "1",
    ]);
    assert_eq!(code, 0, "{err}");
    let checks = j["checks"].as_object().unwrap();
    let mut keys: Vec<&str> = checks.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(keys, ["every_byte", "shared_memory"]);
    assert_eq!(
        checks["every_byte"],
        serde_json::json!({"ok": true, "detail": "every byte of every inference rank (1 rank, 1 engine) compared with the canonical weights of that version after each update: 1 of 1 update verified"})
    );
    assert_eq!(checks["shared_memory"]["ok"], true);
    no_segments_left();
}

#[test]
fn progress_reaches_a_piped_stderr_within_a_second() {
    use std::io::BufRead;
    let _one = one_at_a_time();
    let t0 = std::time::Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args(["demo", "--model", "qwen3-tiny", "--json", "--updates", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    STARTED.with(|s| s.borrow_mut().push(child.id()));
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    // the line comes first, while the demo still runs (not with the result at the end)
    assert!(
        child.try_wait().unwrap().is_none(),
        "the demo had ended before its first progress line was read ({:?})",
        t0.elapsed()
    );
    assert_eq!(
        first,
        "awex demo: qwen3-tiny | megatron:pp=2,tp=2 -> sglang:engines=2,tp=2 | transport shm; measuring the floor"
    );
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(
        rest.iter()
            .any(|l| l.starts_with("awex demo: version 1 committed in ")
                && l.ends_with("every byte verified")),
        "{rest:?}"
    );
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    // stdout is the JSON alone
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["verified"], true);
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

/// Delta updates over cuda-ipc: the receivers' copies write only the 16-byte vectors that
/// differ; with optimiser-like versions (lr 1e-6) every update after the first writes a small
/// part of the dense bytes, and every byte of every update is verified, with checksums and
/// atomic apply too. Needs a GPU and a `--features cuda` build: `cargo test -p awex-cli
/// --features cuda --test demo -- --ignored cuda_ipc`.
#[test]
#[ignore = "needs a GPU and --features cuda"]
fn cuda_ipc_delta_demo_writes_only_what_changed_and_verifies_every_update() {
    let _one = one_at_a_time();
    for extra in [&[][..], &["--checksums", "--atomic"][..]] {
        let (code, j, err) = demo(
            &[
                &[
                    "--transport",
                    "cuda-ipc",
                    "--train",
                    "megatron:tp=2",
                    "--infer",
                    "sglang:tp=2,engines=2",
                    "--deltas",
                    "--lr",
                    "1e-6",
                    "--updates",
                    "4",
                ][..],
                extra,
            ]
            .concat(),
        );
        assert_eq!(code, 0, "{err}\n{j}");
        assert_eq!(j["verified"], true, "{j}");
        let ups = j["updates"].as_array().unwrap();
        assert_eq!(ups.len(), 4);
        for u in &ups[1..] {
            let (bytes, dense) = (
                u["bytes"].as_u64().unwrap(),
                u["dense_bytes"].as_u64().unwrap(),
            );
            assert!(bytes * 4 < dense, "{extra:?}: {u}");
        }
        assert_eq!(j["leaked_segments"], serde_json::json!([]));
    }
    no_segments_left();
}

/// FP8 over cuda-ipc: the receivers quantise on the GPU; every byte of every update equals the
/// CPU reference's, with checksums and atomic apply. Needs a GPU and a `--features cuda`
/// build: `cargo test -p awex-cli --features cuda --test demo -- --ignored cuda_ipc`.
#[test]
#[ignore = "needs a GPU and --features cuda"]
fn cuda_ipc_fp8_demo_quantises_on_the_gpu_and_every_byte_equals_the_reference() {
    let _one = one_at_a_time();
    let bf16 = fp8_model_dir(None);
    let model = bf16.path().to_str().unwrap();
    for extra in [&[][..], &["--checksums", "--atomic"][..]] {
        let (code, j, err) = demo_of(
            model,
            &[
                &[
                    "--transport",
                    "cuda-ipc",
                    "--train",
                    "megatron:tp=2",
                    "--infer",
                    "sglang:tp=2",
                    "--infer-quant",
                    "fp8",
                ][..],
                extra,
            ]
            .concat(),
        );
        assert_eq!(code, 0, "{err}\n{j}");
        assert_eq!(j["transport"], "cuda-ipc");
        assert_eq!(j["verified"], true, "{j}");
        assert!(
            j["checks"].to_string().contains(
                "FP8 tensors and their scales: the CPU reference quantiser, fp8 e4m3, 128x128 blocks, fp32 scales, recipe vllm"
            ),
            "{}",
            j["checks"]
        );
        assert_eq!(j["leaked_segments"], serde_json::json!([]));
    }
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
        "--checksums",
    ]);
    assert_eq!(code, 0, "{err}\n{j}");
    assert_eq!(j["transport"], "nccl");
    assert_eq!(j["verified"], true);
    assert_eq!(j["updates"].as_array().map(Vec::len), Some(3));
    assert_eq!(j["worker_errors"], serde_json::json!([]));
    no_segments_left();
}

/// A Qwen3 model directory whose every linear dimension is a multiple of 128 (hidden 256, two
/// 128-wide heads over one KV head, intermediate 256), with `quantization` as its
/// `quantization_config` when given (an FP8 checkpoint's config).
fn fp8_model_dir(quantization: Option<Value>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "intermediate_size": 256,
        "vocab_size": 1000,
        "dtype": "bfloat16"
    });
    if let Some(q) = quantization {
        cfg["quantization_config"] = q;
    }
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

fn demo_of(model: &str, args: &[&str]) -> (i32, Value, String) {
    let out = run_demo(
        Command::new(env!("CARGO_BIN_EXE_awex-cli"))
            .arg("demo")
            .args(["--model", model, "--json"])
            .args(args),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    if let Some(p) = json["segment_prefix"].as_str() {
        PREFIXES.with(|s| s.borrow_mut().push(p.to_string()));
    }
    (out.status.code().unwrap_or(-1), json, stderr)
}

#[test]
fn fp8_demo_quantises_on_the_receivers_and_every_byte_equals_the_reference() {
    let _one = one_at_a_time();
    let bf16 = fp8_model_dir(None);
    let fp8 = fp8_model_dir(Some(serde_json::json!({
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": [128, 128]
    })));
    let model = bf16.path().to_str().unwrap();
    // shm (atomic) with --infer-quant from Megatron tp 2; tcp (checksums) with the FP8
    // checkpoint's config.json from FSDP dp 3, whose 86-row chunks cut 128-row blocks (the
    // receiver quantises whole blocks once their pieces arrived)
    let runs: [(&str, &str, Vec<&str>); 2] = [
        (
            "shm",
            "megatron:tp=2",
            vec!["--infer-quant", "fp8", "--atomic"],
        ),
        (
            "tcp",
            "fsdp:dp=3",
            vec![
                "--infer-config",
                fp8.path().to_str().unwrap(),
                "--checksums",
            ],
        ),
    ];
    for (transport, train, extra) in runs {
        let mut args = vec![
            "--transport",
            transport,
            "--train",
            train,
            "--infer",
            "sglang:tp=2",
            "--updates",
            "2",
        ];
        args.extend(extra);
        let (code, j, err) = demo_of(model, &args);
        assert_eq!(code, 0, "{transport}: {err}");
        assert_eq!(j["verified"], true, "{transport}");
        let ups = j["updates"].as_array().unwrap();
        assert_eq!(ups.len(), 2);
        for u in ups {
            assert_eq!(u["verified"], true, "{transport}: {u}");
        }
        assert!(
            j["checks"].to_string().contains(
                "FP8 tensors and their scales: the CPU reference quantiser, fp8 e4m3, 128x128 blocks, fp32 scales, recipe vllm"
            ),
            "{}",
            j["checks"]
        );
        no_segments_left();
    }
}

#[test]
fn fp8_demo_refuses_on_the_gpu_transports_what_the_gpu_kernel_cannot_write_and_blocks_cut_by_tensor_parallelism()
 {
    let _one = one_at_a_time();
    let (code, _, err) = demo_of(
        "qwen3-tiny",
        &[
            "--infer-quant",
            "fp8",
            "--fp8-block",
            "16x16",
            "--transport",
            "cuda-ipc",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("the cuda-ipc transport quantises FP8 on the GPU, and the GPU kernel cannot write this encoding (fp8 e4m3, 16x16 blocks")
            && err.contains("it quantises 128x128 blocks only, not 16x16; use --transport shm or tcp, which quantise on the CPU"),
        "{err}"
    );
    // a recipe the GPU kernel does not run: refused, not quantised on the host (a Qwen3 whose
    // dims are multiples of 128, so that the blocks are the GPU's)
    let bf16 = fp8_model_dir(None);
    let model = bf16.path().to_str().unwrap();
    let (code, _, err) = demo_of(
        model,
        &[
            "--infer",
            "sglang:tp=1",
            "--infer-quant",
            "fp8",
            "--fp8-recipe",
            "slime",
            "--transport",
            "cuda-ipc",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("the slime recipe has no GPU kernel yet")
            && err.contains("use --transport shm or tcp"),
        "{err}"
    );
    let (code, _, err) = demo_of(
        model,
        &[
            "--infer",
            "sglang:tp=1",
            "--infer-quant",
            "fp8",
            "--fp8-block",
            "16x16",
            "--transport",
            "nccl",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("the nccl transport quantises FP8 on the training GPU, and the GPU kernel cannot write this encoding (fp8 e4m3, 16x16 blocks")
            && err.contains("use --transport shm or tcp, which quantise on the CPU"),
        "{err}"
    );
    // nccl: FSDP dp 3's row chunks cut the model's 128-row blocks between training ranks,
    // which the training GPUs cannot quantise whole: refused before any rank starts
    let (code, _, err) = demo_of(
        model,
        &[
            "--train",
            "fsdp:dp=3",
            "--infer",
            "sglang:tp=1",
            "--infer-quant",
            "fp8",
            "--transport",
            "nccl",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("a training shard boundary cuts its FP8 blocks")
            && err.contains("or --transport cuda-ipc, shm or tcp"),
        "{err}"
    );
    // qwen3-tiny's q projection has 64 rows: 32 per rank cut a 128-row block
    let (code, _, err) = demo_of(
        "qwen3-tiny",
        &["--infer", "sglang:tp=2", "--infer-quant", "fp8"],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("`model.layers.0.self_attn.qkv_proj.weight`")
            && err.contains(
                "output_partition_size = 32 is not divisible by weight quantization block_n = 128"
            ),
        "{err}"
    );
}

#[test]
fn delta_demos_over_shm_and_tcp_move_a_few_per_cent_and_verify_every_byte() {
    let _one = one_at_a_time();
    // bf16, and an FP8 inference side (16 x 16 blocks: FSDP's 86-row chunks of qwen3-tiny cut
    // some, which the receivers quantise, the others the training ranks encode) over four
    // updates: the senders' copies are refreshed from the changes (the changed elements, whole
    // FP8 boxes), and a copy left wrong would send a wrong delta, caught by the byte check
    let fp8 = [
        "--infer-quant",
        "fp8",
        "--fp8-block",
        "16x16",
        "--train",
        "fsdp:dp=3",
        "--infer",
        "sglang:tp=2,engines=2",
    ];
    for (transport, quant) in [("shm", false), ("tcp", false), ("shm", true), ("tcp", true)] {
        let mut args = vec![
            "--transport",
            transport,
            "--deltas",
            "--lr",
            "1e-6",
            "--checksums",
            "--updates",
            if quant { "4" } else { "3" },
        ];
        if quant {
            args.extend(fp8);
        }
        let (code, j, err) = demo(&args);
        assert_eq!(code, 0, "{transport} fp8 {quant}: {err}");
        assert_eq!(j["verified"], true, "{j}");
        assert_eq!(j["checks"]["deltas"]["ok"], true, "{j}");
        let ups = j["updates"].as_array().unwrap();
        // the first update moves every byte; the later ones only what changed
        assert!(ups[0].get("base").is_none(), "{}", ups[0]);
        for (i, u) in ups.iter().enumerate().skip(1) {
            assert_eq!(u["base"], serde_json::json!([i as u64, 0]), "{u}");
            let (moved, dense) = (
                u["bytes"].as_f64().unwrap(),
                u["dense_bytes"].as_f64().unwrap(),
            );
            assert_eq!(dense, ups[0]["bytes"].as_f64().unwrap());
            assert!(moved < 0.10 * dense, "{transport}: {moved} of {dense}");
            let d = u["density"].as_f64().unwrap();
            assert!(
                (0.003..0.08).contains(&d),
                "{transport} fp8 {quant}: density {d}"
            );
        }
        // this demo's own segments (its pair's names), delta segments included
        assert_eq!(j["leaked_segments"], Value::Array(vec![]), "{transport}");
    }
}

#[test]
fn with_deltas_a_killed_training_rank_is_retried_with_every_byte_and_deltas_resume() {
    let _one = one_at_a_time();
    let (code, j, err) = demo(&[
        "--transport",
        "tcp",
        "--deltas",
        "--lr",
        "1e-6",
        "--fault-kill-train-rank",
        "1",
        "--fault-version",
        "2",
        "--deadline-s",
        "5",
    ]);
    assert_eq!(code, 0, "{err}");
    let ups = j["updates"].as_array().unwrap();
    assert_eq!(ups.len(), 4, "{j}");
    assert_eq!(ups[1]["verified"], false);
    // the retry: the restarted trainer keeps no copy and the torn ranks hold nothing, so
    // whoever cannot prove the base gets every byte; every byte is verified
    let retry = &ups[2];
    assert_eq!(
        (retry["version"].as_u64(), retry["verified"].as_bool()),
        (Some(2), Some(true))
    );
    assert!(
        retry["bytes"].as_u64() > Some(ups[0]["bytes"].as_u64().unwrap() / 4),
        "{retry}"
    );
    // the next one is a delta again, for every rank
    assert_eq!(ups[3]["base"], serde_json::json!([2, 0]), "{}", ups[3]);
    assert_eq!(ups[3]["verified"], true);
    assert_eq!(j["checks"]["deltas"]["ok"], true, "{j}");
}

/// A DeepSeek-V3 directory (the deepseek-v3-tiny sizes, bf16) whose every tensor is BF16, as
/// `model.to(torch.bfloat16).save_pretrained(...)` writes it: the router's
/// `e_score_correction_bias`, F32 in the model, included. Values are finite (high byte 0x3c).
fn deepseek_bf16_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 1000,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 32,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "tie_word_embeddings": false, "dtype": "bfloat16"
    });
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let spec = awex_core::ModelSpec::from_config_value(&cfg).unwrap();
    let cat = awex_core::Catalogue::of(&spec);
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (t, c) in cat.tensors().iter().enumerate() {
        let n = c.shape.numel() as usize;
        let at = data.len();
        for i in 0..n {
            data.extend_from_slice(&[((i * 31 + t * 7) % 251) as u8, 0x3c]);
        }
        header.insert(
            c.name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": c.shape.as_slice(), "data_offsets": [at, data.len()]}),
        );
    }
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(data);
    std::fs::write(dir.path().join("model.safetensors"), out).unwrap();
    dir
}

#[test]
fn fsdp_demo_follows_the_transformers_release_into_both_engines_from_a_bf16_router_bias_checkpoint()
{
    let _one = one_at_a_time();
    let dir = deepseek_bf16_dir();
    let model = dir.path().to_str().unwrap();
    // transformers 5.24's fp32 routers narrowed into SGLang's and vLLM's bf16 DeepSeek gates,
    // 5.19's bf16 ones moved as they are; GLM-4.5's bf16 routers widened into the engines' fp32
    let runs = [
        (
            model,
            "fsdp:dp=2,fused_experts=1,transformers=524",
            "sglang:tp=2,fused_shared_experts=0",
        ),
        (model, "fsdp:dp=2,fused_experts=1", "vllm:tp=2"),
        ("glm-4.5-tiny", "fsdp:dp=2,transformers=519", "vllm:tp=2"),
        (
            "glm-4.5-tiny",
            "fsdp:dp=2,transformers=525",
            "sglang:tp=2,fused_shared_experts=0",
        ),
    ];
    for (m, train, infer) in runs {
        let (code, j, err) = demo_of(
            m,
            &[
                "--transport",
                "tcp",
                "--train",
                train,
                "--infer",
                infer,
                "--updates",
                "2",
                "--checksums",
            ],
        );
        assert_eq!(code, 0, "{train} -> {infer}: {err}");
        assert_eq!(j["verified"], true, "{train} -> {infer}");
        for u in j["updates"].as_array().unwrap() {
            assert_eq!(u["verified"], true, "{train} -> {infer}: {u}");
        }
    }
}
