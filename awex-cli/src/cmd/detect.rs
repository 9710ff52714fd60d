//! `awex-cli detect`.

use std::process::ExitCode;

/// Arguments of `awex-cli detect`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`detect` is not available in this build yet")
}
