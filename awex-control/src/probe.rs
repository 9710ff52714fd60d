//! Gathers what backends detect their engines from into a data-only [`Probe`]: this process's
//! environment, which Python packages `python3` can import, and a live server's answers to the
//! backends' info routes.

use awex_core::backend::{Probe, inference_backends, training_backends};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// How long each server GET may take.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(5);

/// The Python packages and server paths every registered backend asks for.
pub fn wanted() -> (Vec<&'static str>, Vec<&'static str>) {
    let mut packages = Vec::new();
    let mut paths = Vec::new();
    for b in training_backends() {
        packages.extend(b.python_packages());
        paths.extend(b.server_info_paths());
    }
    for b in inference_backends() {
        packages.extend(b.python_packages());
        paths.extend(b.server_info_paths());
    }
    packages.sort_unstable();
    packages.dedup();
    let mut seen = std::collections::HashSet::new();
    paths.retain(|p| seen.insert(*p));
    (packages, paths)
}

/// A probe of this process: its environment, importable packages among `packages`, the given
/// checkpoint, and the server's answers to `paths` (each GET bounded by `timeout`).
pub async fn gather(
    packages: &[&str],
    paths: &[&str],
    checkpoint: Option<PathBuf>,
    server_url: Option<String>,
    timeout: Duration,
) -> Probe {
    let mut server_answers = BTreeMap::new();
    if let Some(url) = &server_url {
        // the paths are alternatives for the same facts, newest first: stop at the first answer
        for path in paths {
            let answer = get_json(url, path, timeout).await;
            let found = answer.is_ok();
            server_answers.insert(path.to_string(), answer);
            if found {
                break;
            }
        }
    }
    Probe {
        env: std::env::vars().collect(),
        python_packages: python_importable(packages).await,
        checkpoint,
        server_url,
        server_answers,
    }
}

/// Checks that `url` is an absolute `http(s)://host[:port]` base URL.
pub fn check_base_url(url: &str) -> Result<reqwest::Url, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| {
        format!("`{url}` is not a valid URL ({e}); expected e.g. http://10.0.0.5:30000")
    })?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(format!(
            "`{url}` is not an http(s) base URL; expected e.g. http://10.0.0.5:30000"
        ));
    }
    Ok(parsed)
}

/// `GET {base}/{path}` parsed as JSON; `Err` says why not.
pub async fn get_json(base: &str, path: &str, timeout: Duration) -> Result<Value, String> {
    check_base_url(base)?;
    let url = format!(
        "{}/{}",
        base.trim_end_matches('/'),
        path.trim_start_matches('/')
    );
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
    let resp = client.get(&url).send().await.map_err(|e| {
        if e.is_timeout() {
            format!("GET {url}: timed out after {} ms", timeout.as_millis())
        } else {
            format!("GET {url}: {e}")
        }
    })?;
    if !resp.status().is_success() {
        return Err(format!("GET {url}: HTTP {}", resp.status()));
    }
    let body = crate::body::read_capped(resp, crate::body::MAX_ENGINE_ANSWER_BYTES)
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    serde_json::from_slice(&body).map_err(|e| format!("GET {url}: not JSON: {e}"))
}

/// Asks `python3` which of `packages` are importable; empty when there is no python3 or it fails.
async fn python_importable(packages: &[&str]) -> BTreeMap<String, bool> {
    if packages.is_empty() {
        return BTreeMap::new();
    }
    let names = serde_json::to_string(packages).unwrap_or_else(|_| "[]".into());
    let script = format!(
        "import importlib.util, json\nout = {{}}\nfor n in {names}:\n    try:\n        out[n] = importlib.util.find_spec(n) is not None\n    except Exception:\n        out[n] = False\nprint(json.dumps(out))\n"
    );
    let run = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(20), run).await {
        Ok(Ok(out)) if out.status.success() => {
            serde_json::from_slice(&out.stdout).unwrap_or_default()
        }
        _ => BTreeMap::new(),
    }
}
