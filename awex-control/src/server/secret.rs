//! Pair secrets derived, not stored: each pair's data-plane secret is
//! `HMAC-SHA256(key, "awex pair secret v1" ‖ name ‖ uid)`, where the key is derived from a
//! random key file beside the state *and* the bearer token. The state on disk holds only a check
//! value of each secret: a copy of the state directory without the token grants no pair's data
//! plane, and neither does the token without the directory.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

type HmacSha256 = Hmac<Sha256>;

/// The name of the key file a gateway without a token keeps in its state directory.
pub(crate) const KEY_FILE: &str = "pair-secret.key";

/// The key every pair secret of this gateway is derived from.
#[derive(Clone)]
pub(crate) struct SecretKey([u8; 32]);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC takes keys of any length: `new_from_slice` cannot fail
    let Ok(mut m) = HmacSha256::new_from_slice(key) else {
        return [0; 32];
    };
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl SecretKey {
    /// This key combined with the gateway's bearer token: the key of a gateway with a token,
    /// which neither the key file nor the token alone yields.
    pub(crate) fn with_token(&self, token: &str) -> SecretKey {
        SecretKey(hmac(
            &self.0,
            &[b"awex gateway pair-secret key v1", token.as_bytes()],
        ))
    }

    /// A fixed key, for an in-memory gateway on a system without a random source (the pair uids
    /// then come from nowhere either: connect fails before it is used).
    pub(crate) fn fixed() -> SecretKey {
        SecretKey([0x5a; 32])
    }

    /// A fresh random key (an in-memory gateway).
    pub(crate) fn random() -> std::io::Result<SecretKey> {
        let mut b = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
        Ok(SecretKey(b))
    }

    /// The key file `dir/pair-secret.key` (mode 0600), created with a random key when absent;
    /// refuses a file of the wrong size.
    pub(crate) fn from_file(dir: &Path) -> Result<SecretKey, String> {
        use std::os::unix::fs::MetadataExt;
        let path = dir.join(KEY_FILE);
        // checked before it is read: a FIFO would hang the read, and a key others could read
        // or replace is no key (as ssh refuses such a key file)
        if let Ok(m) = std::fs::symlink_metadata(&path) {
            let refuse = |why: String| format!("refusing {}: {why}", path.display());
            if !m.is_file() {
                return Err(refuse(
                    "it is not a regular file; the pair-secret key always is: restore it from a backup, or remove it (every pair then needs to connect again)".into(),
                ));
            }
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            if m.uid() != me {
                return Err(refuse(format!(
                    "it is owned by uid {}, and this gateway runs as uid {me}: that user could read or replace the key of every pair secret; if it is the right key, `chown {me}` it, else remove it (every pair then needs to connect again)",
                    m.uid()
                )));
            }
            let mode = m.mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(refuse(format!(
                    "its mode is {mode:04o}: other users could read or replace the key of every pair secret; if no one else could have read it, run `chmod 600 {}`, else remove it (every pair then needs to connect again)",
                    path.display()
                )));
            }
        }
        match std::fs::read(&path) {
            Ok(b) => <[u8; 32]>::try_from(b.as_slice()).map(SecretKey).map_err(|_| {
                format!(
                    "{} holds {} bytes, not the 32 of a key: it is damaged; restore it from a backup, or remove it (every pair then needs to connect again)",
                    path.display(),
                    b.len()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = SecretKey::random()
                    .map_err(|e| format!("cannot read /dev/urandom for the key: {e}"))?;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
                f.write_all(&key.0)
                    .and_then(|()| f.sync_all())
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                Ok(key)
            }
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }

    /// The data-plane secret of the pair `name` connected with uid `uid` (64 hex digits).
    pub(crate) fn pair_secret(&self, name: &str, uid: &str) -> String {
        hex(&hmac(
            &self.0,
            &[b"awex pair secret v1", name.as_bytes(), uid.as_bytes()],
        ))
    }
}

/// A check value of a pair secret (32 hex digits) that reveals nothing of it: stored, it tells
/// a restarted gateway whether it derives the same secret (the same token) as before.
pub(crate) fn check_value(secret: &str) -> String {
    hex(&hmac(secret.as_bytes(), &[b"awex pair secret check v1"])[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_differ_per_pair_uid_key_and_token_and_the_check_value_is_not_the_secret() {
        let base = SecretKey([7; 32]);
        let a = base.with_token("tok-a");
        let b = base.with_token("tok-b");
        assert_ne!(
            a.pair_secret("p", "00ff"),
            SecretKey([8; 32])
                .with_token("tok-a")
                .pair_secret("p", "00ff"),
            "the token alone does not give the secret"
        );
        let s = a.pair_secret("p", "00ff");
        assert_eq!(s.len(), 64);
        assert_eq!(s, a.pair_secret("p", "00ff"), "deterministic");
        assert_ne!(s, a.pair_secret("p", "00fe"));
        assert_ne!(s, a.pair_secret("q", "00ff"));
        assert_ne!(s, b.pair_secret("p", "00ff"));
        let c = check_value(&s);
        assert_eq!(c.len(), 32);
        assert!(!s.contains(&c));
        assert_ne!(c, check_value(&b.pair_secret("p", "00ff")));
    }

    #[test]
    fn the_key_file_is_created_0600_read_back_and_refused_when_damaged() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let k1 = SecretKey::from_file(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let k2 = SecretKey::from_file(dir.path()).unwrap();
        assert_eq!(k1.pair_secret("p", "u"), k2.pair_secret("p", "u"));
        std::fs::write(dir.path().join(KEY_FILE), b"short").unwrap();
        let e = SecretKey::from_file(dir.path()).unwrap_err();
        assert!(e.contains("holds 5 bytes, not the 32 of a key"), "{e}");
    }

    #[test]
    fn a_key_file_others_can_read_or_that_is_not_a_file_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        SecretKey::from_file(dir.path()).unwrap();
        let path = dir.path().join(KEY_FILE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = SecretKey::from_file(dir.path()).unwrap_err();
        assert_eq!(
            e,
            format!(
                "refusing {}: its mode is 0644: other users could read or replace the key of every pair secret; if no one else could have read it, run `chmod 600 {}`, else remove it (every pair then needs to connect again)",
                path.display(),
                path.display()
            )
        );
        std::fs::remove_file(&path).unwrap();
        let fifo = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads a NUL-terminated path that lives for the call.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = SecretKey::from_file(dir.path()).unwrap_err();
        assert!(e.contains("it is not a regular file"), "{e}");
    }
}
