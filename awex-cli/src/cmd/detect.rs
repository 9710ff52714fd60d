//! `awex-cli detect`: which training and inference engines run here, with evidence.

use awex_core::backend::{Detection, inference_backends, training_backends};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `awex-cli detect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A checkpoint directory to inspect.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Base URL of a running inference server, SGLang or vLLM (e.g. http://127.0.0.1:30000).
    #[arg(long, alias = "server-url")]
    pub sglang_url: Option<String>,
    /// Inspect a running process instead of this one: its environment and command line, read
    /// from /proc/PID/environ and /proc/PID/cmdline (the backends score that environment).
    #[arg(long)]
    pub pid: Option<u32>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// One backend's verdict.
#[derive(Serialize, Debug)]
pub struct Verdict {
    /// Backend name.
    pub backend: &'static str,
    /// Score in [0, 1].
    pub score: f64,
    /// What it looked for and what it found, one line each.
    pub evidence: Vec<String>,
    /// Parallel config, when known.
    pub parallel: Option<awex_core::ParallelConfig>,
    /// What it looked for and did not find.
    pub not_found: Vec<String>,
}

/// Both sides' verdicts, best first.
#[derive(Serialize, Debug)]
pub struct Report {
    /// Training backends.
    pub training: Vec<Verdict>,
    /// Inference backends.
    pub inference: Vec<Verdict>,
    /// The live job the environment (and, with `--pid`, the command line) describes.
    pub live: super::live::Live,
}

fn verdict(backend: &'static str, d: Detection) -> Verdict {
    Verdict {
        backend,
        score: d.score,
        evidence: d.evidence,
        parallel: d.parallel,
        not_found: d.not_found,
    }
}

/// Probes this machine with every registered backend; with `process` (`(pid, environment,
/// command line)`), the backends score that process's environment instead of this one's.
pub async fn detect(
    checkpoint: Option<PathBuf>,
    url: Option<String>,
    process: Option<(u32, BTreeMap<String, String>, Vec<String>)>,
) -> Report {
    let (packages, paths) = awex_control::probe::wanted();
    let mut probe = awex_control::probe::gather(
        &packages,
        &paths,
        checkpoint,
        url,
        awex_control::probe::HTTP_TIMEOUT,
    )
    .await;
    let live = match process {
        Some((pid, env, cmdline)) => {
            let live = super::live::inspect(&format!("pid {pid}"), &env, Some(&cmdline));
            probe.env = env;
            live
        }
        None => super::live::inspect("this process", &probe.env, None),
    };
    let mut training = Vec::new();
    for b in training_backends() {
        training.push(verdict(b.name(), b.detect(&probe)));
    }
    let mut inference = Vec::new();
    for b in inference_backends() {
        inference.push(verdict(b.name(), b.detect(&probe)));
    }
    let by_score =
        |a: &Verdict, b: &Verdict| b.score.total_cmp(&a.score).then(a.backend.cmp(b.backend));
    training.sort_by(by_score);
    inference.sort_by(by_score);
    Report {
        training,
        inference,
        live,
    }
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if let Some(c) = &args.checkpoint
        && !c.exists()
    {
        anyhow::bail!("--checkpoint {}: no such file or directory", c.display());
    }
    if let Some(u) = &args.sglang_url {
        awex_control::probe::check_base_url(u).map_err(|e| anyhow::anyhow!("--sglang-url {e}"))?;
    }
    let process = match args.pid {
        Some(pid) => {
            let (env, cmdline) = super::live::read_proc(pid).map_err(anyhow::Error::msg)?;
            Some((pid, env, cmdline))
        }
        None => None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(detect(args.checkpoint, args.sglang_url, process));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    for (title, list) in [
        ("training", &report.training),
        ("inference", &report.inference),
    ] {
        println!("{title}:");
        if list.is_empty() {
            println!("  (no {title} backend compiled into this binary)");
        }
        for v in list {
            let parallel = v
                .parallel
                .as_ref()
                .map(|p| format!("  [{p}]"))
                .unwrap_or_default();
            println!("  {:<10} score {:.2}{parallel}", v.backend, v.score);
            for e in &v.evidence {
                println!("      found:     {e}");
            }
            for e in &v.not_found {
                println!("      not found: {e}");
            }
        }
    }
    let live = &report.live;
    println!("live job ({}):", live.source);
    if let (Some(r), Some(w)) = (live.rank, live.world_size) {
        println!("  rank {r} of {w}");
    }
    for (engine, sizes) in &live.engines {
        let sizes: Vec<String> = sizes.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("  {engine:<10} {}", sizes.join(","));
    }
    for e in &live.found {
        println!("      found:     {e}");
    }
    for e in &live.not_found {
        println!("      not found: {e}");
    }
    Ok(ExitCode::SUCCESS)
}
