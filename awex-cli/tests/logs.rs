//! The gateway logs every pair connect and disconnect (and refused requests), at `info` by
//! default, as JSON lines with `--log-format json`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn http(port: u16, request: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(request.as_bytes()).expect("write");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[test]
fn serve_logs_connect_disconnect_and_refusals_as_json_lines() {
    let port = free_port();
    let mut serve = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args([
            "serve",
            "--bind",
            &format!("127.0.0.1:{port}"),
            "--log-format",
            "json",
            "--ephemeral",
        ])
        .env_remove("RUST_LOG")
        .env("AWEX_TOKEN", "t0ken")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start serve");
    // wait for the listener
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "serve did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let gw = format!("http://127.0.0.1:{port}");
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
            .args(args)
            .env("AWEX_TOKEN", "t0ken")
            .output()
            .expect("run awex-cli");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    cli(&[
        "pair",
        "connect",
        "--gateway",
        &gw,
        "--name",
        "logged",
        "--model",
        "qwen3-tiny",
        "--train",
        "megatron:tp=1",
        "--infer",
        "sglang:tp=1",
    ]);
    // nothing is torn: a resume is accepted and says what serves
    let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args([
            "pair",
            "resume",
            "--gateway",
            &gw,
            "--name",
            "logged",
            "--accept-torn",
        ])
        .env("AWEX_TOKEN", "t0ken")
        .output()
        .expect("run awex-cli");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "pair logged resumed; serving version none"
    );
    cli(&["pair", "disconnect", "--gateway", &gw, "--name", "logged"]);
    let refused = http(
        port,
        "GET /v1/pairs/logged/status HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    );
    assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
    std::thread::sleep(Duration::from_millis(200));
    let _ = serve.kill();
    let stderr = serve.stderr.take().expect("stderr");
    let lines: Vec<serde_json::Value> = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect();
    let _ = serve.wait();
    let find = |message: &str| {
        lines
            .iter()
            .find(|l| l["fields"]["message"] == message)
            .unwrap_or_else(|| panic!("no `{message}` line in {lines:#?}"))
            .clone()
    };
    let c = find("pair connected");
    assert_eq!(c["level"], "INFO");
    assert_eq!(c["fields"]["pair"], "logged");
    assert_eq!(c["fields"]["transport"], "shm");
    assert_eq!(find("pair disconnected")["fields"]["pair"], "logged");
    let r = find("refused a request without the gateway's token");
    assert_eq!(r["level"], "WARN");
    assert_eq!(r["fields"]["path"], "/v1/pairs/logged/status");
    // the token itself is never logged
    assert!(!lines.iter().any(|l| l.to_string().contains("t0ken")));
}

#[test]
fn a_bad_log_filter_is_refused_with_the_valid_forms() {
    let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args(["plan", "--log-level", "very=loud=please"])
        .output()
        .expect("run awex-cli");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--log-level/RUST_LOG `very=loud=please` is not a log filter"),
        "{err}"
    );
}

#[test]
fn gc_reports_what_it_removed_as_json() {
    // a pair name no live process uses: nothing of it to remove, and the answer says so exactly
    let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args(["gc", "--pair", "no-such-pair-for-gc", "--json"])
        .output()
        .expect("run awex-cli");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        v,
        serde_json::json!({ "removed": [], "removed_sockets": [] })
    );
}

#[test]
fn ranks_log_join_ready_and_each_update_with_its_version_as_json_lines() {
    let port = free_port();
    let mut serve = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
        .env("AWEX_TOKEN", "t0ken")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start serve");
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "serve did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let gw = format!("http://127.0.0.1:{port}");
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
            .args(args)
            .env("AWEX_TOKEN", "t0ken")
            .output()
            .expect("run awex-cli");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let pair = format!("logged-ranks-{}", std::process::id());
    let sides = [
        "--model",
        "qwen3-tiny",
        "--train",
        "megatron:tp=1",
        "--infer",
        "sglang:tp=1",
    ];
    let mut connect = vec!["pair", "connect", "--gateway", &gw, "--name", &pair];
    connect.extend(sides);
    cli(&connect);
    let worker = |side: &str| {
        Command::new(env!("CARGO_BIN_EXE_awex-cli"))
            .args([
                "worker",
                "--log-format",
                "json",
                "--gateway",
                &gw,
                "--pair",
                &pair,
            ])
            .args(["--side", side, "--rank", "0"])
            .args(sides)
            .env_remove("RUST_LOG")
            .env("AWEX_TOKEN", "t0ken")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a worker")
    };
    let mut ranks = [worker("train"), worker("infer")];
    let start = Instant::now();
    loop {
        let st = cli(&[
            "pair",
            "status",
            "--gateway",
            &gw,
            "--name",
            &pair,
            "--json",
        ]);
        let st: serde_json::Value = serde_json::from_str(&st).expect("status json");
        if st["state"] == "ready" {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the ranks did not join: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    cli(&[
        "pair",
        "update",
        "--gateway",
        &gw,
        "--name",
        &pair,
        "--version",
        "1",
        "--wait",
        "--timeout-s",
        "60",
    ]);
    cli(&["pair", "disconnect", "--gateway", &gw, "--name", &pair]);
    for (i, r) in ranks.iter_mut().enumerate() {
        let status = r.wait().expect("worker exit");
        let stderr = r.stderr.take().expect("stderr");
        let lines: Vec<serde_json::Value> = BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str(&l).ok())
            .collect();
        assert!(status.success(), "rank {i}: {status:?} {lines:#?}");
        let find = |message: &str| {
            lines
                .iter()
                .find(|l| l["fields"]["message"] == message)
                .unwrap_or_else(|| panic!("rank {i}: no `{message}` line in {lines:#?}"))
                .clone()
        };
        let side = ["training", "inference"][i];
        let ready = find("rank ready");
        assert_eq!(ready["level"], "INFO");
        assert_eq!(ready["fields"]["pair"], pair.as_str());
        assert_eq!(ready["fields"]["side"], side);
        find("rank joined");
        assert_eq!(find("update started")["fields"]["version"], 1);
        let done = find("update part done");
        assert!(
            done["fields"]["bytes"].as_u64().is_some_and(|b| b > 0),
            "{done}"
        );
        let c = find("update committed");
        assert_eq!(c["level"], "INFO");
        assert_eq!(c["fields"]["version"], 1);
        assert_eq!(c["fields"]["attempt"], 1);
        assert!(c["fields"]["ms"].as_u64().is_some(), "{c}");
    }
    let _ = serve.kill();
    let _ = serve.wait();
}

#[test]
fn text_logs_to_a_pipe_carry_no_terminal_colour_codes() {
    let port = free_port();
    let mut serve = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args([
            "serve",
            "--bind",
            &format!("127.0.0.1:{port}"),
            "--ephemeral",
        ])
        .env_remove("RUST_LOG")
        .env("AWEX_TOKEN", "t0ken")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start serve");
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "serve did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // a refused request is logged as a warning
    let r = http(
        port,
        "GET /v1/pairs/x/status HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    );
    assert!(r.starts_with("HTTP/1.1 401"), "{r}");
    let _ = serve.kill();
    let mut err = String::new();
    serve
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    let _ = serve.wait();
    assert!(
        err.contains("refused a request without the gateway's token"),
        "{err}"
    );
    assert!(
        !err.contains('\u{1b}'),
        "colour codes in a piped log: {err:?}"
    );
}

#[test]
fn serve_refuses_a_bad_token_before_it_opens_its_state_or_says_it_listens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args(["serve", "--bind", &format!("127.0.0.1:{}", free_port())])
        .arg("--state-dir")
        .arg(&state)
        .env("AWEX_TOKEN", "has space")
        .output()
        .expect("run serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("the gateway token must be 1 to 4096 visible ASCII characters without spaces"),
        "{err}"
    );
    assert!(!err.contains("listening"), "{err}");
    assert!(!state.exists(), "the state directory was created");
}
