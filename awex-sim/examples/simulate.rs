//! `simulate` as a stand-alone program, with the Megatron, FSDP and SGLang layouts linked:
//! `cargo run --release -p awex-sim --example simulate -- --model qwen3-8b ...`

use clap::Parser;

/// Predicts an update's time on a stated cluster from awex's own plans.
#[derive(Parser)]
#[command(name = "simulate")]
struct Cli {
    #[command(flatten)]
    args: awex_sim::cli::Args,
}

fn main() -> anyhow::Result<()> {
    // keep the backend crates linked so that their layouts are registered
    std::hint::black_box((awex_megatron::CRATE, awex_fsdp::CRATE, awex_sglang::CRATE));
    awex_sim::cli::run(Cli::parse().args)
}
