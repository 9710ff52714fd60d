//! `awex-cli serve`.

use std::process::ExitCode;

/// Arguments of `awex-cli serve`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`serve` is not available in this build yet")
}
