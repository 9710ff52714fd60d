//! The 1T-parameter MoE pair (1,152 ranks) simulates within 10 s on the 2-core development
//! machine. Timing only means something in a release build:
//! `cargo test --release -p awex-sim --test scale -- --ignored`.

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
    let t0 = Instant::now();
    let r = report(&cli.args).unwrap();
    let s = t0.elapsed().as_secs_f64();
    println!(
        "predicted {:.3} s, bound {:.3} s, simulated in {s:.2} s (plan {:.2} s, run {:.2} s)",
        r.predicted_s, r.lower_bound_s, r.sim.plan_s, r.sim.run_s
    );
    assert_eq!(r.training_ranks + r.inference_ranks, 1152);
    assert!(r.predicted_s >= r.lower_bound_s);
    assert!(s <= 10.0, "simulated in {s:.2} s");
}
