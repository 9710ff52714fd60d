//! Logs: the gateway and the ranks emit `tracing` events; this installs the subscriber that
//! prints them to stderr, as text or JSON lines, filtered by `--log-level` or `RUST_LOG`.

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line (for log collectors).
    Json,
}

/// Installs the subscriber: `level` (a level such as `info`, or a `RUST_LOG`-style directive
/// list such as `awex_control=debug,warn`) wins over `RUST_LOG`, which wins over `default`.
pub fn init(level: Option<&str>, format: LogFormat, default: &str) -> anyhow::Result<()> {
    let directives = match level {
        Some(l) => l.to_string(),
        None => std::env::var("RUST_LOG").unwrap_or_else(|_| default.to_string()),
    };
    let filter = EnvFilter::try_new(&directives).map_err(|e| {
        anyhow::anyhow!(
            "--log-level/RUST_LOG `{directives}` is not a log filter ({e}); use a level (error, warn, info, debug, trace) or directives like `awex_control=debug,warn`"
        )
    })?;
    // colour codes only for a terminal: a log file or a pipe gets plain text
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_target(true);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    // a second init (tests calling main twice) keeps the first subscriber
    let _ = installed;
    Ok(())
}
