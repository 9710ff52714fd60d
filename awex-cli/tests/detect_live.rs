//! `awex-cli detect` reports the live job from a process's environment and command line: its
//! own (torch.distributed variables only), or another process's through `--pid`.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn cli(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_awex-cli"));
    c.args(args).env("PATH", "/nonexistent"); // no python3: detection must not need it
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ] {
        c.env_remove(k);
    }
    c.envs(env.iter().copied());
    let out = c.output().expect("run awex-cli");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Kills the child it holds when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn this_process_reports_its_torch_distributed_variables() {
    let (code, out, err) = cli(
        &["detect", "--json"],
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    let live = &j["live"];
    assert_eq!(live["source"], "this process");
    assert_eq!(
        (live["rank"].as_u64(), live["world_size"].as_u64()),
        (Some(1), Some(2))
    );
    assert_eq!(live["dist"]["MASTER_ADDR"], "127.0.0.1");
    assert!(live["cmdline"].is_null());
    let not_found: Vec<&str> = live["not_found"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        not_found.contains(&"LOCAL_RANK (torch.distributed)"),
        "{not_found:?}"
    );
    assert!(
        not_found.contains(&"a command line (this process is awex-cli itself; pass --pid PID)")
    );

    let (code, out, _) = cli(&["detect"], &[("RANK", "1"), ("WORLD_SIZE", "2")]);
    assert_eq!(code, 0);
    assert!(
        out.contains("live job (this process):\n  rank 1 of 2\n"),
        "{out}"
    );
    assert!(out.contains("      found:     RANK=1\n"), "{out}");
}

#[test]
fn pid_reads_another_process_environment_and_command_line() {
    // a shell that stays the process (`read` is a builtin; `; :` keeps it from exec-ing
    // anything) until its stdin closes, with a Megatron launch's variables and flags as its
    // arguments. It says `ready` once it runs its script: `spawn` returns as soon as the child
    // left this process's memory, before the kernel set up the new image's arguments and
    // environment, so a read of /proc/PID/environ right after `spawn` can find them empty.
    let child = Command::new("/bin/sh")
        .args([
            "-c",
            "echo ready; read line; :",
            "pretrain_gpt.py",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size=4",
        ])
        .env_clear()
        .envs([
            ("RANK", "5"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "1"),
            ("TORCHELASTIC_RUN_ID", "job"),
            ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start /bin/sh");
    let mut child = Child(child);
    let mut ready = String::new();
    let stdout = child.0.stdout.take().expect("the child's stdout is piped");
    BufReader::new(stdout)
        .read_line(&mut ready)
        .expect("read the child's first line");
    assert_eq!(ready, "ready\n", "the shell did not start its script");
    let pid = child.0.id().to_string();
    let (code, out, err) = cli(&["detect", "--json", "--pid", &pid], &[]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    let live = &j["live"];
    assert_eq!(live["source"], format!("pid {pid}"));
    assert_eq!(
        (live["rank"].as_u64(), live["world_size"].as_u64()),
        (Some(5), Some(16))
    );
    assert_eq!(live["launcher"], "torchrun");
    assert_eq!(
        live["engines"]["megatron"],
        serde_json::json!({"tp": 2, "pp": 4})
    );
    assert_eq!(live["cmdline"][0], "/bin/sh");
    // the backends score that process's environment, not awex-cli's
    let megatron = j["training"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["backend"] == "megatron")
        .unwrap();
    let evidence = megatron["evidence"].to_string();
    assert!(
        evidence.contains("CUDA_DEVICE_MAX_CONNECTIONS"),
        "{evidence}"
    );
    drop(child);

    let (code, _, err) = cli(&["detect", "--pid", "4294967295"], &[]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--pid 4294967295: no such process (/proc/4294967295/environ)"),
        "{err}"
    );
}
