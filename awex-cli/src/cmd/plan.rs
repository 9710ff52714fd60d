//! `awex-cli plan`.

use std::process::ExitCode;

/// Arguments of `awex-cli plan`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`plan` is not available in this build yet")
}
