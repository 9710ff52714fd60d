//! A database the storage library cannot read without panicking (a valid header, then random
//! pages) is refused with a message naming the file, and the library's panic is not printed:
//! no backtrace before the clear refusal. In a test binary of its own: it installs the
//! process's first panic hook, which counts what would be printed.

use awex_control::server::{GatewayConfig, open_router};
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicUsize, Ordering};

static PRINTED: AtomicUsize = AtomicUsize::new(0);

fn open(dir: &std::path::Path) -> Result<(), String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        open_router(GatewayConfig {
            state_dir: Some(dir.to_path_buf()),
            ..GatewayConfig::default()
        })
        .map(drop)
        .map_err(|e| e.to_string())
    })
}

#[test]
fn a_database_the_library_panics_on_is_refused_without_printing_the_panic() {
    std::panic::set_hook(Box::new(|_| {
        PRINTED.fetch_add(1, Ordering::SeqCst);
    }));
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(open(dir.path()), Ok(()));
    let file = dir.path().join("gateway.redb");
    let mut bytes = std::fs::read(&file).unwrap();
    // keep the header page, fill every other page with bytes no commit wrote
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in bytes.iter_mut().skip(4096) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(&file, &bytes).unwrap();
    let e = open(dir.path()).unwrap_err();
    assert!(
        e.starts_with(&format!(
            "the gateway's database {} cannot be used: ",
            file.display()
        )),
        "{e}"
    );
    // the library did panic (caught), and nothing was printed
    assert!(
        e.contains("the database library could not read it ("),
        "{e}"
    );
    assert_eq!(PRINTED.load(Ordering::SeqCst), 0, "{e}");
}
