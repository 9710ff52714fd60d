//! `awex-cli serve`: runs the weight-update gateway.
//!
//! Settings are layered, later layers winning: defaults < config file (`--config`, TOML keys
//! `bind`, `token_file`, `body_limit_mib`, `tombstone_s`) < environment (`AWEX_BIND`,
//! `AWEX_TOKEN_FILE`, `AWEX_BODY_LIMIT_MIB`, `AWEX_TOMBSTONE_S`; `AWEX_TOKEN` carries the token
//! itself) < flags.

use anyhow::{Context, bail};
use awex_control::server::{GatewayConfig, open_router, serve_router};
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Arguments of `awex-cli serve`.
#[derive(clap::Args, Debug, Default)]
pub struct Args {
    /// Address to listen on [default: 127.0.0.1:7480; env AWEX_BIND].
    #[arg(long)]
    pub bind: Option<String>,
    /// File holding the bearer token clients must send (env AWEX_TOKEN holds the token itself).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// TOML config file with keys bind, token_file, body_limit_mib, tombstone_s.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Largest request body in MiB [default: 8].
    #[arg(long)]
    pub body_limit_mib: Option<u64>,
    /// Seconds a disconnected pair is remembered (its ranks see `disconnect`; its status
    /// answers; mutations get 410) before it and its memory are gone, 1 to 86400 [default: 60;
    /// env AWEX_TOMBSTONE_S].
    #[arg(long)]
    pub tombstone_s: Option<u64>,
    /// Directory of the gateway's durable state (pairs, rosters, rendezvous values, updates,
    /// events), so that a restarted gateway loses nothing; `none` keeps it in memory only.
    /// One gateway per directory; created mode 0700, and one another user owns or can read is
    /// refused. [default: $XDG_STATE_HOME/awex/gateway-PORT, else
    /// $HOME/.local/state/awex/gateway-PORT; env AWEX_STATE_DIR]
    #[arg(long, env = "AWEX_STATE_DIR", value_name = "DIR|none")]
    pub state_dir: Option<String>,
    /// Keep the state in memory only (the same as --state-dir none).
    #[arg(long, conflicts_with = "state_dir")]
    pub ephemeral: bool,
}

/// The state directory `--state-dir` / `--ephemeral` name for a gateway on `port`; `env` reads
/// an environment variable (for the default under the user's home).
pub fn state_dir(
    args: &Args,
    port: u16,
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> anyhow::Result<Option<PathBuf>> {
    Ok(match args.state_dir.as_deref().map(str::trim) {
        _ if args.ephemeral => None,
        Some("none") => None,
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => Some(default_state_dir(port, env)?),
    })
}

/// Where `serve` keeps its state by default: `$XDG_STATE_HOME/awex/gateway-<port>`, else
/// `$HOME/.local/state/awex/gateway-<port>`. Never a shared temporary directory, where another
/// user could create the directory first: without either variable, `--state-dir` is needed.
pub fn default_state_dir(
    port: u16,
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> anyhow::Result<PathBuf> {
    let leaf = format!("gateway-{port}");
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(x) = nonempty("XDG_STATE_HOME") {
        return Ok(PathBuf::from(x).join("awex").join(leaf));
    }
    if let Some(h) = nonempty("HOME") {
        return Ok(PathBuf::from(h).join(".local/state/awex").join(leaf));
    }
    bail!(
        "neither XDG_STATE_HOME nor HOME is set, so the gateway has no private default state directory; give --state-dir DIR (created mode 0700), or --ephemeral to keep the state in memory"
    )
}

/// The layered settings of the server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeSettings {
    /// Listen address.
    pub bind: String,
    /// Token file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Body limit in MiB.
    pub body_limit_mib: u64,
    /// Seconds a disconnected pair is remembered.
    #[serde(default = "default_tombstone_s")]
    pub tombstone_s: u64,
}

fn default_tombstone_s() -> u64 {
    60
}

impl Default for ServeSettings {
    fn default() -> Self {
        ServeSettings {
            bind: "127.0.0.1:7480".into(),
            token_file: None,
            body_limit_mib: 8,
            tombstone_s: default_tombstone_s(),
        }
    }
}

/// The flags, as a figment layer (absent flags do not override).
#[derive(Serialize)]
struct Flags {
    #[serde(skip_serializing_if = "Option::is_none")]
    bind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body_limit_mib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tombstone_s: Option<u64>,
}

/// Layers defaults < config file < `env` < flags.
pub fn settings(args: &Args, env: Figment) -> anyhow::Result<ServeSettings> {
    let mut fig = Figment::from(Serialized::defaults(ServeSettings::default()));
    if let Some(path) = &args.config {
        if !path.is_file() {
            bail!("config file {} does not exist", path.display());
        }
        fig = fig.merge(Toml::file(path));
    }
    fig = fig.merge(env).merge(Serialized::defaults(Flags {
        bind: args.bind.clone(),
        token_file: args.token_file.clone(),
        body_limit_mib: args.body_limit_mib,
        tombstone_s: args.tombstone_s,
    }));
    fig.extract()
        .map_err(|e| anyhow::anyhow!("bad gateway settings: {e}"))
}

/// The environment layer: `AWEX_BIND`, `AWEX_TOKEN_FILE`, `AWEX_BODY_LIMIT_MIB`,
/// `AWEX_TOMBSTONE_S`.
fn env_layer() -> Figment {
    Figment::from(Env::prefixed("AWEX_").only(&[
        "bind",
        "token_file",
        "body_limit_mib",
        "tombstone_s",
    ]))
}

/// The largest token file read: a token is a line, not a document.
const MAX_TOKEN_FILE_BYTES: u64 = 64 << 10;

/// Reads a token file: trimmed, non-empty.
pub fn read_token(path: &Path) -> anyhow::Result<String> {
    // a regular file of a token's size: a FIFO is refused, not waited on
    let text = awex_core::file::read_regular_text(path, MAX_TOKEN_FILE_BYTES)
        .map_err(|e| anyhow::anyhow!("cannot read token file {}: {e}", path.display()))?;
    let token = text.trim().to_string();
    if token.is_empty() {
        bail!("token file {} is empty", path.display());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                eprintln!(
                    "warning: token file {} is readable by other users; chmod 600 it",
                    path.display()
                );
            }
        }
    }
    Ok(token)
}

/// The token: `--token-file`, else `AWEX_TOKEN`, else a `token_file` from the environment or
/// the config file.
pub fn token(
    args: &Args,
    settings: &ServeSettings,
    env_token: Option<String>,
) -> anyhow::Result<Option<String>> {
    if let Some(f) = &args.token_file {
        return read_token(f).map(Some);
    }
    if let Some(t) = env_token
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
    {
        return Ok(Some(t));
    }
    settings.token_file.as_deref().map(read_token).transpose()
}

/// The address `--bind` names: `IP:PORT`, `[IPv6]:PORT`, or `HOST:PORT` for a host name that
/// resolves here (`localhost:7480`; IPv4 first).
pub fn bind_addr(bind: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(a) = bind.parse::<SocketAddr>() {
        return Ok(a);
    }
    let bad = || format!("--bind `{bind}` is not an address like 127.0.0.1:7480 or localhost:7480");
    let (host, port) = bind.rsplit_once(':').with_context(bad)?;
    let port: u16 = port.parse().ok().with_context(bad)?;
    if host.is_empty() {
        bail!(bad());
    }
    let mut addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .with_context(|| format!("--bind `{bind}`: host `{host}` does not resolve here"))?
        .collect();
    addrs.sort_by_key(|a| !a.is_ipv4());
    addrs.into_iter().next().with_context(bad)
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let s = settings(&args, env_layer())?;
    let addr = bind_addr(&s.bind)?;
    let token = token(&args, &s, std::env::var("AWEX_TOKEN").ok())?;
    if token.is_none() && !addr.ip().is_loopback() {
        bail!(
            "refusing to serve on {addr} without a token: give --token-file or AWEX_TOKEN, or bind a loopback address"
        );
    }
    let body_limit = usize::try_from(s.body_limit_mib.saturating_mul(1024 * 1024))
        .context("body_limit_mib is too large")?;
    if body_limit == 0 {
        bail!("body_limit_mib must be at least 1");
    }
    if !(1..=86_400).contains(&s.tombstone_s) {
        bail!(
            "tombstone_s must be 1 to 86400 seconds (how long a disconnected pair is remembered), not {}",
            s.tombstone_s
        );
    }
    let config = GatewayConfig {
        token: token.clone(),
        body_limit,
        tombstone: std::time::Duration::from_secs(s.tombstone_s),
        state_dir: state_dir(&args, addr.port(), |k| std::env::var_os(k))?,
        ..GatewayConfig::default()
    };
    // a bad token is refused before anything is opened or announced
    awex_control::server::check_token_and_bind(addr, &config)?;
    fixed_allocator_thresholds();
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    rt.block_on(async move {
        let listener =
            awex_control::server::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        // the state is opened (and a directory held by another gateway refused) before
        // the gateway says it listens
        let app = open_router(config.clone())?;
        eprintln!(
            "awex gateway listening on http://{local} ({}, body limit {} MiB, state {})",
            if token.is_some() {
                "bearer token required"
            } else {
                "no token: loopback only"
            },
            s.body_limit_mib,
            match &config.state_dir {
                Some(d) => d.display().to_string(),
                None => "in memory only".to_string(),
            }
        );
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("awex gateway: shutting down");
        };
        serve_router(listener, &config, app, shutdown).await?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The gateway's large blocks (connect bodies up to the body limit, a pair's module lists,
/// status answers) come and go with pairs. glibc raises its mmap and trim thresholds after
/// freeing a large block, after which such blocks live in the worker threads' heaps, whose
/// freed tops `malloc_trim` does not return: ten pairs with 6.6 MB FP8 configs left 31 MB
/// resident once forgotten (9 MB at start). A fixed mmap threshold keeps both thresholds fixed:
/// a block of 256 KiB or more is mapped alone and unmapped when freed (11 MB once forgotten).
fn fixed_allocator_thresholds() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt changes only this process's allocator parameters, before any thread
    // of the gateway starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_dir_defaults_to_a_directory_per_port_and_none_or_ephemeral_keep_it_in_memory() {
        let home = |k: &str| (k == "HOME").then(|| std::ffi::OsString::from("/home/u"));
        let d = state_dir(&Args::default(), 7480, home).unwrap().unwrap();
        assert_eq!(d, PathBuf::from("/home/u/.local/state/awex/gateway-7480"));
        let xdg = |k: &str| (k == "XDG_STATE_HOME").then(|| std::ffi::OsString::from("/x"));
        let d = state_dir(&Args::default(), 7480, xdg).unwrap().unwrap();
        assert_eq!(d, PathBuf::from("/x/awex/gateway-7480"));
        let none = Args {
            state_dir: Some("none".into()),
            ..Args::default()
        };
        assert_eq!(state_dir(&none, 7480, home).unwrap(), None);
        let eph = Args {
            ephemeral: true,
            ..Args::default()
        };
        assert_eq!(state_dir(&eph, 7480, home).unwrap(), None);
        let given = Args {
            state_dir: Some("/var/lib/awex".into()),
            ..Args::default()
        };
        assert_eq!(
            state_dir(&given, 7480, home).unwrap(),
            Some(PathBuf::from("/var/lib/awex"))
        );
    }

    #[test]
    fn without_home_or_xdg_state_home_the_default_is_refused_not_a_shared_temp_directory() {
        let e = state_dir(&Args::default(), 7480, |_| None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("neither XDG_STATE_HOME nor HOME is set"),
            "{e}"
        );
        let eph = Args {
            ephemeral: true,
            ..Args::default()
        };
        assert_eq!(state_dir(&eph, 7480, |_| None).unwrap(), None);
    }

    #[test]
    fn bind_takes_addresses_and_host_names() {
        assert_eq!(
            bind_addr("127.0.0.1:7480").unwrap(),
            "127.0.0.1:7480".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            bind_addr("[::1]:7480").unwrap(),
            "[::1]:7480".parse::<SocketAddr>().unwrap()
        );
        let l = bind_addr("localhost:7481").unwrap();
        assert!(l.ip().is_loopback() && l.port() == 7481, "{l}");
        for bad in ["localhost", "localhost:http", ":7480", "7480"] {
            assert_eq!(
                bind_addr(bad).unwrap_err().to_string(),
                format!("--bind `{bad}` is not an address like 127.0.0.1:7480 or localhost:7480")
            );
        }
    }

    fn env(v: serde_json::Value) -> Figment {
        Figment::from(Serialized::defaults(v))
    }

    #[test]
    fn settings_layer_defaults_file_env_and_flags_in_that_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gw.toml");
        std::fs::write(&file, "bind = \"127.0.0.1:1000\"\nbody_limit_mib = 2\n").unwrap();
        let none = Args::default();
        assert_eq!(
            settings(&none, Figment::new()).unwrap(),
            ServeSettings::default()
        );
        let with_file = Args {
            config: Some(file.clone()),
            ..Args::default()
        };
        let s = settings(&with_file, Figment::new()).unwrap();
        assert_eq!((s.bind.as_str(), s.body_limit_mib), ("127.0.0.1:1000", 2));
        let s = settings(
            &with_file,
            env(serde_json::json!({"bind": "127.0.0.1:2000"})),
        )
        .unwrap();
        assert_eq!((s.bind.as_str(), s.body_limit_mib), ("127.0.0.1:2000", 2));
        let flags = Args {
            config: Some(file),
            bind: Some("127.0.0.1:3000".into()),
            ..Args::default()
        };
        let s = settings(&flags, env(serde_json::json!({"bind": "127.0.0.1:2000"}))).unwrap();
        assert_eq!(s.bind, "127.0.0.1:3000");
    }

    #[test]
    fn unknown_config_keys_and_missing_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gw.toml");
        std::fs::write(&file, "bindd = \"x\"\n").unwrap();
        let args = Args {
            config: Some(file),
            ..Args::default()
        };
        let e = settings(&args, Figment::new()).unwrap_err().to_string();
        assert!(e.contains("unknown field"), "{e}");
        assert!(e.contains("bindd"), "{e}");
        let args = Args {
            config: Some(dir.path().join("absent.toml")),
            ..Args::default()
        };
        assert!(
            settings(&args, Figment::new())
                .unwrap_err()
                .to_string()
                .ends_with("absent.toml does not exist")
        );
    }

    #[test]
    fn token_flag_beats_env_token_which_beats_a_configured_file() {
        let dir = tempfile::tempdir().unwrap();
        let flag_file = dir.path().join("flag");
        let conf_file = dir.path().join("conf");
        std::fs::write(&flag_file, "from-flag\n").unwrap();
        std::fs::write(&conf_file, "from-config").unwrap();
        let s = ServeSettings {
            token_file: Some(conf_file),
            ..ServeSettings::default()
        };
        let flag = Args {
            token_file: Some(flag_file),
            ..Args::default()
        };
        assert_eq!(
            token(&flag, &s, Some("from-env".into()))
                .unwrap()
                .as_deref(),
            Some("from-flag")
        );
        let none = Args::default();
        assert_eq!(
            token(&none, &s, Some("from-env".into()))
                .unwrap()
                .as_deref(),
            Some("from-env")
        );
        assert_eq!(
            token(&none, &s, None).unwrap().as_deref(),
            Some("from-config")
        );
        assert_eq!(token(&none, &ServeSettings::default(), None).unwrap(), None);
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "  \n").unwrap();
        let e = read_token(&empty).unwrap_err().to_string();
        assert!(e.ends_with("empty is empty"), "{e}");
    }
}
