//! The live job `awex-cli detect` sees from a process's environment and command line: the
//! torch.distributed launch variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, ...),
//! the launcher, and the engines' command-line hints (Megatron's, FSDP's, SGLang's and vLLM's
//! parallelism flags). It is the environment-only counterpart of Python's
//! `awex.detect()["live"]`: process groups and model objects live in memory, so a process is
//! read from outside through `/proc/PID/environ` and `/proc/PID/cmdline` (`--pid`).

use serde::Serialize;
use std::collections::BTreeMap;

/// The torch.distributed variables looked for, in the order they are reported.
const DIST_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// Engine hints: `(engine, flag, the awex parallel key it sets)` for flags taking a number.
const FLAGS: &[(&str, &str, &str)] = &[
    ("megatron", "--tensor-model-parallel-size", "tp"),
    ("megatron", "--pipeline-model-parallel-size", "pp"),
    ("megatron", "--context-parallel-size", "cp"),
    ("megatron", "--expert-model-parallel-size", "ep"),
    ("megatron", "--expert-tensor-parallel-size", "etp"),
    ("megatron", "--virtual-pipeline-model-parallel-size", "vpp"),
    ("sglang", "--tp-size", "tp"),
    ("sglang", "--tp", "tp"),
    ("sglang", "--ep-size", "ep"),
    ("vllm", "--tensor-parallel-size", "tp"),
    ("vllm", "-tp", "tp"),
];

/// What a process says about the job it belongs to.
#[derive(Serialize, Debug, Default, PartialEq)]
pub struct Live {
    /// Whose environment this is: `this process` or `pid N`.
    pub source: String,
    /// The torch.distributed variables that are set.
    pub dist: BTreeMap<String, String>,
    /// `RANK` and `WORLD_SIZE` as numbers, when both parse.
    pub rank: Option<u64>,
    /// World size.
    pub world_size: Option<u64>,
    /// The launcher, when its variables are set (torchrun, slurm, mpi).
    pub launcher: Option<String>,
    /// Engines the command line names, each with the parallel sizes its flags give.
    pub engines: BTreeMap<String, BTreeMap<String, u64>>,
    /// The process's command line (with `--pid` only).
    pub cmdline: Option<Vec<String>>,
    /// What was found, one line each.
    pub found: Vec<String>,
    /// What was looked for and not found, one line each.
    pub not_found: Vec<String>,
}

/// The live job seen from `env` and, when known, `cmdline`.
pub fn inspect(source: &str, env: &BTreeMap<String, String>, cmdline: Option<&[String]>) -> Live {
    let mut live = Live {
        source: source.to_string(),
        ..Live::default()
    };
    for k in DIST_VARS {
        match env.get(*k) {
            Some(v) => {
                live.found.push(format!("{k}={v}"));
                live.dist.insert((*k).to_string(), v.clone());
            }
            None => live.not_found.push(format!("{k} (torch.distributed)")),
        }
    }
    let num = |k: &str| env.get(k).and_then(|v| v.trim().parse::<u64>().ok());
    live.rank = num("RANK");
    live.world_size = num("WORLD_SIZE");
    for (k, what) in [("RANK", live.rank), ("WORLD_SIZE", live.world_size)] {
        if env.contains_key(k) && what.is_none() {
            live.found
                .push(format!("{k} is set but is not a number: `{}`", env[k]));
        }
    }
    let launchers = [
        ("torchrun", "TORCHELASTIC_RUN_ID"),
        ("slurm", "SLURM_PROCID"),
        ("mpi", "OMPI_COMM_WORLD_RANK"),
    ];
    match launchers.iter().find(|(_, v)| env.contains_key(*v)) {
        Some((name, var)) => {
            live.launcher = Some((*name).to_string());
            live.found.push(format!("launcher {name} ({var} is set)"));
        }
        None => live.not_found.push(
            "a launcher (TORCHELASTIC_RUN_ID, SLURM_PROCID, OMPI_COMM_WORLD_RANK)".to_string(),
        ),
    }
    if env
        .get("ACCELERATE_USE_FSDP")
        .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
    {
        live.engines.entry("fsdp".into()).or_default();
        live.found.push("ACCELERATE_USE_FSDP (fsdp)".to_string());
    }
    match cmdline {
        None => live
            .not_found
            .push("a command line (this process is awex-cli itself; pass --pid PID)".to_string()),
        Some(args) => {
            live.cmdline = Some(args.to_vec());
            hints(args, &mut live);
        }
    }
    live
}

/// The engines `args` names (module or program, parallelism flags).
fn hints(args: &[String], live: &mut Live) {
    let joined = args.join(" ");
    let named = [
        ("megatron", ["megatron", "pretrain_gpt"].as_slice()),
        ("fsdp", ["fsdp", "fully_shard"].as_slice()),
        (
            "sglang",
            ["sglang.launch_server", "sglang serve"].as_slice(),
        ),
        ("vllm", ["vllm serve", "vllm.entrypoints"].as_slice()),
    ];
    for (engine, words) in named {
        if let Some(w) = words.iter().find(|w| joined.contains(*w)) {
            live.engines.entry(engine.into()).or_default();
            live.found
                .push(format!("`{w}` on the command line ({engine})"));
        }
    }
    for (i, a) in args.iter().enumerate() {
        let (flag, value) = match a.split_once('=') {
            Some((f, v)) => (f, Some(v.to_string())),
            None => (a.as_str(), args.get(i + 1).cloned()),
        };
        for (engine, f, key) in FLAGS {
            if flag != *f {
                continue;
            }
            match value.as_deref().and_then(|v| v.parse::<u64>().ok()) {
                Some(n) => {
                    live.engines
                        .entry((*engine).into())
                        .or_default()
                        .insert((*key).into(), n);
                    live.found.push(format!("{f} {n} ({engine} {key}={n})"));
                }
                None => live
                    .found
                    .push(format!("{f} without a number after it ({engine})")),
            }
        }
        if a == "--enable-expert-parallel" {
            live.engines.entry("vllm".into()).or_default();
            live.found
                .push("--enable-expert-parallel (vllm ep = tp)".to_string());
        }
    }
    if live.engines.is_empty() {
        live.not_found.push(
            "an engine on the command line (megatron / pretrain_gpt, fsdp, sglang.launch_server, vllm serve) or its parallelism flags".to_string(),
        );
    }
}

/// Process `pid`'s environment and command line from `/proc`, or why they cannot be read.
pub fn read_proc(pid: u32) -> Result<(BTreeMap<String, String>, Vec<String>), String> {
    let dir = std::path::Path::new("/proc").join(pid.to_string());
    let read = |name: &str| {
        std::fs::read(dir.join(name)).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                format!("--pid {pid}: no such process ({}/{name})", dir.display())
            }
            std::io::ErrorKind::PermissionDenied => format!(
                "--pid {pid}: {}/{name} is not readable by this user (run as the process's owner)",
                dir.display()
            ),
            _ => format!("--pid {pid}: reading {}/{name}: {e}", dir.display()),
        })
    };
    let split = |b: &[u8]| -> Vec<String> {
        b.split(|c| *c == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect()
    };
    let env = split(&read("environ")?)
        .into_iter()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    Ok((env, split(&read("cmdline")?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn args(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn a_torchrun_megatron_rank_is_read_from_its_variables_and_flags() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "none"),
        ]);
        let cmd = args(
            "python pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size=2 --expert-model-parallel-size 4",
        );
        let l = inspect("pid 7", &e, Some(&cmd));
        assert_eq!((l.rank, l.world_size), (Some(3), Some(8)));
        assert_eq!(l.launcher.as_deref(), Some("torchrun"));
        let want: BTreeMap<String, u64> = [("tp", 2), ("pp", 2), ("ep", 4)]
            .map(|(k, v)| (k.to_string(), v))
            .into();
        assert_eq!(l.engines["megatron"], want);
        assert_eq!(l.engines.len(), 1);
        assert!(l.found.contains(&"MASTER_ADDR=10.0.0.1".to_string()));
        assert!(
            l.found
                .contains(&"`pretrain_gpt` on the command line (megatron)".to_string())
        );
        assert!(
            l.found
                .contains(&"--pipeline-model-parallel-size 2 (megatron pp=2)".to_string())
        );
        assert_eq!(
            l.not_found,
            vec![
                "LOCAL_WORLD_SIZE (torch.distributed)",
                "GROUP_RANK (torch.distributed)"
            ]
        );
    }

    #[test]
    fn servers_are_named_from_their_command_lines() {
        let l = inspect(
            "pid 1",
            &env(&[]),
            Some(&args("python -m sglang.launch_server --tp 4 --ep-size 4")),
        );
        assert_eq!(
            l.engines["sglang"],
            [("tp".to_string(), 4), ("ep".to_string(), 4)].into()
        );
        let l = inspect(
            "pid 1",
            &env(&[]),
            Some(&args(
                "vllm serve M --tensor-parallel-size 2 --enable-expert-parallel",
            )),
        );
        assert_eq!(l.engines["vllm"], [("tp".to_string(), 2)].into());
        assert!(
            l.found
                .contains(&"--enable-expert-parallel (vllm ep = tp)".to_string())
        );
        assert_eq!(l.rank, None);
        assert!(
            l.not_found
                .contains(&"RANK (torch.distributed)".to_string())
        );
    }

    #[test]
    fn nothing_set_says_what_was_looked_for() {
        let l = inspect("this process", &env(&[]), None);
        assert!(l.found.is_empty() && l.engines.is_empty() && l.cmdline.is_none());
        assert_eq!(l.not_found.len(), DIST_VARS.len() + 2);
        assert_eq!(
            l.not_found.last().unwrap(),
            "a command line (this process is awex-cli itself; pass --pid PID)"
        );
        let l = inspect("pid 1", &env(&[("RANK", "x")]), Some(&args("bash")));
        assert_eq!(l.rank, None);
        assert!(
            l.found
                .contains(&"RANK is set but is not a number: `x`".to_string())
        );
        assert!(
            l.not_found
                .last()
                .unwrap()
                .starts_with("an engine on the command line")
        );
        let l = inspect("pid 1", &env(&[]), Some(&args("vllm serve M -tp")));
        assert!(
            l.found
                .contains(&"-tp without a number after it (vllm)".to_string())
        );
    }

    #[test]
    fn an_unreadable_pid_is_refused_by_name() {
        let e = read_proc(u32::MAX).unwrap_err();
        assert!(
            e.starts_with(&format!("--pid {}: no such process", u32::MAX)),
            "{e}"
        );
        let (env, cmd) = read_proc(std::process::id()).unwrap();
        assert!(env.contains_key("PATH") || env.is_empty());
        assert!(!cmd.is_empty());
    }
}
