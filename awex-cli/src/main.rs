//! `awex-cli`: detect engines, plan weight exchanges, run the gateway, the demo and benchmarks.

mod cmd;
mod link;
mod logs;
mod report;
mod safetensors;
mod settings;

use clap::{Parser, Subcommand};

/// awex moves fresh model weights from a training job into running inference engines.
#[derive(Parser, Debug)]
#[command(name = "awex-cli", version, about, long_about = None)]
struct Cli {
    /// Log filter: a level (error, warn, info, debug, trace) or directives like
    /// `awex_control=debug,warn` [default: info for `serve` and `worker`, warn otherwise; env
    /// RUST_LOG].
    #[arg(long, global = true)]
    log_level: Option<String>,
    /// Log line format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = logs::LogFormat::Text)]
    log_format: logs::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Detect which training and inference engines run here, with evidence.
    Detect(cmd::detect::Args),
    /// Compute the exchange plan between a training layout and an inference layout.
    Plan(cmd::plan::Args),
    /// Run the weight-update gateway (the control plane).
    Serve(cmd::serve::Args),
    /// Operate pairs on a running gateway: connect, update, status, disconnect.
    Pair(cmd::pair::Args),
    /// Measure a data path against its floor, measured in the same run (e.g. `bench ipc`).
    Bench(cmd::bench::Args),
    /// Run the main job: a gateway, training and inference rank processes, N verified updates.
    Demo(cmd::demo::Args),
    /// Remove the shared-memory segments of awex ranks that died without cleaning up.
    Gc(cmd::gc::Args),
    /// Predict an update's time on a stated cluster from every rank's real plan.
    Simulate(SimulateArgs),
    /// One rank process of a pair (spawned by `demo`).
    #[command(hide = true)]
    Worker(cmd::worker::Args),
}

/// `simulate`'s arguments: the simulator's and the inference side's FP8 flags (as `plan`'s).
#[derive(clap::Args, Debug)]
#[command(after_help = awex_sim::cli::AFTER_HELP)]
struct SimulateArgs {
    #[command(flatten)]
    sim: awex_sim::cli::Args,
    /// The inference side's FP8 encoding.
    #[command(flatten)]
    quant: cmd::quant::QuantArgs,
}

fn main() -> std::process::ExitCode {
    // die quietly on a closed pipe (`awex-cli plan | head`) like other command-line tools
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    link::link_backends();
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Serve(_) | Command::Worker(_) => "info",
        _ => "warn",
    };
    if let Err(e) = logs::init(cli.log_level.as_deref(), cli.log_format, default_level) {
        eprintln!("error: {}", report::chain(&e));
        return std::process::ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Detect(a) => cmd::detect::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Pair(a) => cmd::pair::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Demo(a) => cmd::demo::run(a),
        Command::Gc(a) => cmd::gc::run(a),
        Command::Simulate(a) => a
            .quant
            .resolve_model(&a.sim.model)
            .and_then(|fp8| awex_sim::cli::run_with(a.sim, fp8))
            .map(|()| std::process::ExitCode::SUCCESS),
        Command::Worker(a) => cmd::worker::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", report::chain(&e));
            std::process::ExitCode::from(2)
        }
    }
}
