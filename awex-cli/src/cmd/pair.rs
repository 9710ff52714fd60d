//! `awex-cli pair`.

use std::process::ExitCode;

/// Arguments of `awex-cli pair`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`pair` is not available in this build yet")
}
