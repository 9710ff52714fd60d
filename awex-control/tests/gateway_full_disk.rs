//! A full disk does not wedge the gateway: the failed write is a 503, `/healthz` says
//! `degraded` with the store's error while writes fail, changes are refused before they are
//! made, and once space is freed the gateway writes again (reopening its database) without a
//! restart. The disk is a small tmpfs mounted for the test (needs root; skipped otherwise).

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use gateway_common::{connect_request, start};
use serde_json::{Value, json};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// A tmpfs of `size` mounted on a fresh directory; unmounted when dropped.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(size: &str) -> Result<Tmpfs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(Tmpfs(dir))
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // lazily: the gateway of the test may still hold its database open
        let _ = Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

/// Fills the file system of `dir` with `filler` until it refuses more.
fn fill(filler: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(filler).unwrap();
    let chunk = vec![0xa5u8; 64 * 1024];
    while f.write_all(&chunk).is_ok() {}
    // the last partial chunk too
    while f.write_all(&[0xa5]).is_ok() {}
}

async fn health(base: &str) -> Value {
    reqwest::get(format!("{base}/healthz"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_full_disk_the_gateway_writes_again_once_space_is_freed_without_a_restart() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let fs = match Tmpfs::mount("4m") {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("skipped: cannot mount a tmpfs here: {e}");
            return;
        }
    };
    let state = fs.path().join("state");
    let base = start(GatewayConfig {
        state_dir: Some(state.clone()),
        ..GatewayConfig::default()
    })
    .await;
    let c = Client::new(&base, None).unwrap().with_retries(0);
    c.connect(&connect_request("disk", 1, 1, 1)).await.unwrap();
    assert_eq!(health(&base).await, json!({"status": "ok"}));
    let filler = fs.path().join("filler");
    fill(&filler);
    // writes until one fails (the database may have free pages left for a few)
    let value = json!("x".repeat(32 * 1024));
    let mut failed = None;
    for i in 0..200 {
        if let Err(e) = c.put_kv("disk", &format!("k{i}"), value.clone()).await {
            failed = Some((i, e));
            break;
        }
    }
    let (at, e) = failed.expect("a write on a full disk failed");
    assert_eq!(e.status(), Some(503), "{e}");
    assert!(e.to_string().contains("could not persist its state"), "{e}");
    // the value is set in memory and queued: the answer says so, it is not a refusal
    assert!(e.queued(), "{e:?}");
    assert!(
        e.to_string().contains("the change WAS MADE and is queued"),
        "{e}"
    );
    let h = health(&base).await;
    assert_eq!(h["status"], "degraded", "{h}");
    assert!(
        h["store"]["error"].as_str().is_some_and(|s| !s.is_empty()),
        "{h}"
    );
    // a change is refused before it is made while writes fail
    let e = c.put_kv("disk", "while-full", json!(1)).await.unwrap_err();
    assert_eq!(e.status(), Some(503), "{e}");
    assert!(
        e.to_string()
            .contains("changes are refused until it can again"),
        "{e}"
    );
    // space comes back: the gateway writes again by itself (it retries every second)
    std::fs::remove_file(&filler).unwrap();
    let mut healthy = false;
    for _ in 0..120 {
        if health(&base).await == json!({"status": "ok"}) {
            healthy = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        healthy,
        "healthz still degraded a minute after space was freed"
    );
    c.put_kv("disk", "after", json!(2)).await.unwrap();
    // the change answered "queued" is there, as its answer said
    let kept = c
        .get_kv("disk", &format!("k{at}"), Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(kept.value, value);
    let st = c.status("disk").await.unwrap();
    assert_eq!(st.name, "disk");
    assert!(at > 0 || st.name == "disk");
}
