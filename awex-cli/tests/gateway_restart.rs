//! Rank processes and a gateway process killed with SIGKILL mid-update: with its state
//! directory the restarted gateway fails the version in flight ("gateway restarted during
//! update 2"), the workers retry, re-attach, run the retry to its commit, and exit 0 once the
//! pair is disconnected; restarted without its state (`--state-dir none`), the gateway answers
//! 404 for the pair and every worker exits non-zero saying so, never 0.

use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CLI: &str = env!("CARGO_BIN_EXE_awex-cli");

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(port: u16, state: &str) -> Proc {
    let child = Command::new(CLI)
        .args([
            "serve",
            "--bind",
            &format!("127.0.0.1:{port}"),
            "--state-dir",
            state,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("127.0.0.1:{port}");
    let start = Instant::now();
    while std::net::TcpStream::connect(&url).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the gateway did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Proc(child)
}

fn pair(url: &str, args: &[&str]) -> (i32, Value) {
    let out = Command::new(CLI)
        .args(["pair", "--gateway", url])
        .args(args)
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v)
}

fn connect(url: &str, name: &str) {
    let (code, _) = pair(
        url,
        &[
            "connect",
            "--name",
            name,
            "--model",
            "qwen3-tiny",
            "--train",
            "megatron:tp=1",
            "--infer",
            "sglang:tp=1",
            "--transport",
            "shm",
            "--bucket-mib",
            "1",
            "--update-deadline-s",
            "20",
            "--json",
        ],
    );
    assert_eq!(code, 0, "connect");
}

fn worker(url: &str, name: &str, side: &str) -> Child {
    Command::new(CLI)
        .args([
            "worker",
            "--gateway",
            url,
            "--pair",
            name,
            "--side",
            side,
            "--rank",
            "0",
            "--model",
            "qwen3-tiny",
            "--train",
            "megatron:tp=1",
            "--infer",
            "sglang:tp=1",
            "--transport",
            "shm",
            "--bucket-mib",
            "1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait_ready(url: &str, name: &str) {
    let start = Instant::now();
    loop {
        let (_, st) = pair(url, &["status", "--name", name, "--json"]);
        if st["state"] == "ready" {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "not ready: {st}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn update(url: &str, name: &str, version: u64) -> Value {
    let v = version.to_string();
    let args = [
        "update",
        "--name",
        name,
        "--version",
        &v,
        "--wait",
        "--timeout-s",
        "60",
        "--json",
    ];
    pair(url, &args).1
}

/// Waits for a worker's end; its exit code and stderr.
fn exit_of(mut w: Child) -> (i32, String) {
    let start = Instant::now();
    while w.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = w.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = w.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn signal(w: &Child, sig: i32) {
    // SAFETY: signalling a child process this test started.
    assert_eq!(unsafe { libc::kill(w.id() as i32, sig) }, 0);
}

#[test]
fn workers_outlive_a_gateway_killed_mid_update_and_the_retry_commits() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let state = state.to_str().unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let gw = serve(port, state);
    connect(&url, "restart");
    let (t, i) = (
        worker(&url, "restart", "train"),
        worker(&url, "restart", "infer"),
    );
    wait_ready(&url, "restart");
    assert_eq!(update(&url, "restart", 1)["state"], "committed");
    // the inference rank is stopped so that version 2 stays in flight; the gateway dies
    signal(&i, libc::SIGSTOP);
    let (code, _) = pair(&url, &["update", "--name", "restart", "--version", "2"]);
    assert_eq!(code, 0);
    std::thread::sleep(Duration::from_millis(500));
    drop(gw); // SIGKILL
    std::thread::sleep(Duration::from_secs(1));
    let gw = serve(port, state);
    signal(&i, libc::SIGCONT);
    let (_, st) = pair(&url, &["status", "--name", "restart", "--json"]);
    assert_eq!(st["serving_version"], 1, "{st}");
    let u = update(&url, "restart", 2);
    if u["state"] != "committed" {
        let _ = pair(&url, &["disconnect", "--name", "restart"]);
        let (a, b) = (exit_of(t), exit_of(i));
        panic!("{u}\ntrain {a:?}\ninfer {b:?}");
    }
    assert_eq!(u["attempt"], 2, "{u}");
    let (_, st) = pair(&url, &["status", "--name", "restart", "--json"]);
    assert_eq!(st["serving_version"], 2, "{st}");
    let (code, _) = pair(&url, &["disconnect", "--name", "restart"]);
    assert_eq!(code, 0);
    for (side, w) in [("train", t), ("infer", i)] {
        let (code, err) = exit_of(w);
        assert_eq!(code, 0, "{side} worker: {err}");
    }
    drop(gw);
}

#[test]
fn workers_exit_non_zero_when_a_restarted_gateway_does_not_know_their_pair() {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let gw = serve(port, "none");
    connect(&url, "forgotten");
    let (t, i) = (
        worker(&url, "forgotten", "train"),
        worker(&url, "forgotten", "infer"),
    );
    wait_ready(&url, "forgotten");
    drop(gw);
    let gw = serve(port, "none");
    for (side, w) in [("train", t), ("infer", i)] {
        let (code, err) = exit_of(w);
        assert_eq!(code, 2, "{side} worker: {err}");
        assert!(
            err.contains(&format!(
                "the gateway at {url} has no pair `forgotten` (404 unknown pair)"
            )),
            "{side} worker: {err}"
        );
    }
    drop(gw);
}

/// A rank process of pair `name` (inference side `sglang:tp=1,engines=3`).
fn fleet_worker(url: &str, name: &str, side: &str, engine: u32) -> Child {
    Command::new(CLI)
        .args(["worker", "--gateway", url, "--pair", name, "--side", side])
        .args(["--engine", &engine.to_string(), "--rank", "0"])
        .args(["--model", "qwen3-tiny", "--train", "megatron:tp=1"])
        .args(["--infer", "sglang:tp=1,engines=3", "--transport", "shm"])
        .args(["--bucket-mib", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// `GET {path}` on the gateway (no token): the JSON body.
fn get(port: u16, path: &str) -> Value {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or(Value::Null)
}

#[test]
fn real_ranks_keep_an_added_and_a_removed_engine_straight_across_gateway_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let state = state.to_str().unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let name = "fleet";
    let gw = serve(port, state);
    let (code, _) = pair(
        &url,
        &[
            "connect",
            "--name",
            name,
            "--model",
            "qwen3-tiny",
            "--train",
            "megatron:tp=1",
            "--infer",
            "sglang:tp=1,engines=3",
            "--spare",
            "1",
            "--commit",
            "available",
            "--transport",
            "shm",
            "--bucket-mib",
            "1",
            // version 3 is held in flight by a stopped rank while engine 1 is removed and the
            // gateway restarted: far longer than a loaded machine needs for those steps (the
            // training rank gives a silent engine up shortly before the deadline, which would
            // commit version 3 on engine 2)
            "--update-deadline-s",
            "300",
            "--json",
        ],
    );
    assert_eq!(code, 0, "connect");
    let t = fleet_worker(&url, name, "train", 0);
    let i0 = fleet_worker(&url, name, "infer", 0);
    let i1 = fleet_worker(&url, name, "infer", 1);
    wait_ready(&url, name);
    let u = update(&url, name, 1);
    assert_eq!(u["state"], "committed", "{u}");
    // engine 2 is added; the gateway dies before its rank joined
    let (code, added) = pair(&url, &["add-engine", "--name", name, "--json"]);
    assert_eq!((code, &added["engine"]), (0, &Value::from(2)), "{added}");
    drop(gw);
    let gw = serve(port, state);
    let (_, st) = pair(&url, &["status", "--name", name, "--json"]);
    assert_eq!(st["engines"][2]["state"], "joining", "{st}");
    let i2 = fleet_worker(&url, name, "infer", 2);
    let start = Instant::now();
    loop {
        let (_, st) = pair(&url, &["status", "--name", name, "--json"]);
        let joined = st["roster"].as_array().is_some_and(|r| {
            r.iter()
                .any(|x| x["side"] == "inference" && x["rank"]["engine"] == 2)
        });
        if joined {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "engine 2 did not join: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // its first version catches it up: every byte verified by its rank
    let u = update(&url, name, 2);
    assert_eq!(u["state"], "committed", "{u}");
    assert!(
        u.get("left_out")
            .is_none_or(|l| l == &serde_json::json!([])),
        "{u}"
    );
    // (the rank publishes its verdict after its report)
    let start = Instant::now();
    let verdict = loop {
        let v = get(
            port,
            &format!("/v1/pairs/{name}/kv/verify.2.0?timeout_ms=5000"),
        );
        if v["value"]["version"] == 2 {
            break v;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no verdict: {v}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(verdict["value"]["ok"], true, "{verdict}");
    let (_, st) = pair(&url, &["status", "--name", name, "--json"]);
    assert_eq!(st["engines"][2]["state"], "serving", "{st}");
    assert_eq!(st["engines"][2]["serving_version"], 2, "{st}");
    // version 3 is held in flight (engine 0's rank stopped); engine 1 is removed, its rank
    // exits; the gateway dies
    signal(&i0, libc::SIGSTOP);
    let (code, _) = pair(&url, &["update", "--name", name, "--version", "3"]);
    assert_eq!(code, 0);
    let (code, removed) = pair(
        &url,
        &["remove-engine", "--name", name, "--engine", "1", "--json"],
    );
    assert_eq!(
        (code, &removed["status"]["state"]),
        (0, &Value::from("absent")),
        "{removed}"
    );
    let (code, err) = exit_of(i1);
    assert_eq!(code, 0, "the removed engine's rank: {err}");
    drop(gw);
    let gw = serve(port, state);
    signal(&i0, libc::SIGCONT);
    let (_, st) = pair(&url, &["status", "--name", name, "--json"]);
    assert_eq!(st["engines"][1]["state"], "absent", "{st}");
    assert_eq!(st["serving_version"], 2, "never committed: {st}");
    // the retry goes to engines 0 and 2 and commits
    let u = update(&url, name, 3);
    assert_eq!(u["state"], "committed", "{u}");
    assert_eq!(u["attempt"], 2, "{u}");
    let (_, st) = pair(&url, &["status", "--name", name, "--json"]);
    let states: Vec<(&str, u64)> = st["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["state"].as_str().unwrap(),
                e["serving_version"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        states,
        [("serving", 3), ("absent", 0), ("serving", 3)],
        "{st}"
    );
    let (code, _) = pair(&url, &["disconnect", "--name", name]);
    assert_eq!(code, 0);
    for (side, w) in [("train", t), ("infer 0", i0), ("infer 2", i2)] {
        let (code, err) = exit_of(w);
        assert_eq!(code, 0, "{side} worker: {err}");
    }
    drop(gw);
}
