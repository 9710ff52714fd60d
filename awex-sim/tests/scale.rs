//! The 1T-parameter MoE pair (1,152 ranks) simulates within 10 s on the 2-core development
//! machine. Timing only means something in a release build:
//! `cargo test --release -p awex-sim --test scale -- --ignored`.
//!
//! The machine is shared, so the test bounds the CPU time the simulation takes (user + system,
//! all threads), which other processes do not inflate: on an idle machine the wall time is at
//! most that.

use awex_sim::cli::{Args, report};
use clap::Parser;
use std::time::Instant;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: Args,
}

#[test]
#[ignore = "timing: run in release"]
fn moe_1t_simulates_within_10_s() {
    std::hint::black_box((awex_megatron::CRATE, awex_sglang::CRATE, awex_fsdp::CRATE));
    let cli = Cli::parse_from([
        "simulate",
        "--model",
        "moe-1t",
        "--train",
        "megatron:tp=8,pp=8,dp=16,ep=32,etp=1",
        "--infer",
        "sglang:tp=16,ep=16,engines=8",
        "--topology",
        "h200x8",
    ]);
    let (t0, c0) = (Instant::now(), cpu_s());
    let r = report(&cli.args).unwrap();
    let (s, c) = (t0.elapsed().as_secs_f64(), cpu_s() - c0);
    println!(
        "predicted {:.3} s, bound {:.3} s, simulated in {s:.2} s wall, {c:.2} s CPU (plan {:.2} s, run {:.2} s)",
        r.predicted_s, r.lower_bound_s, r.sim.plan_s, r.sim.run_s
    );
    assert_eq!(r.training_ranks + r.inference_ranks, 1152);
    assert!(r.predicted_s >= r.lower_bound_s);
    assert!(c <= 10.0, "simulated in {c:.2} s of CPU");
}

/// User + system CPU seconds of this process so far (Linux: `/proc/self/stat`, in ticks of
/// 1/100 s).
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // fields after the command name, which ends with the last ')'
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f[i].parse::<f64>().expect("stat field");
    // utime and stime are fields 14 and 15 of the line: 11 and 12 counted from the state (0)
    (ticks(11) + ticks(12)) / 100.0
}
