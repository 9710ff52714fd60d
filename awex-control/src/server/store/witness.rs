//! The acknowledged-commit record, `gateway.commit` beside the database: after every commit the
//! gateway writes the commit's sequence number here (and syncs it) before it answers anyone, so
//! that at start a database older than what was acknowledged (a restored backup, a repair that
//! went back a transaction, a disk that lost writes) is detected instead of served.
//!
//! The file holds two 32-byte slots, written alternately (the commit's number decides which):
//! `magic (8) | database id (8) | sequence (8) | check (8)`, the check being the first 8 bytes
//! of SHA-256 over the first 24. A write torn by a crash spoils one slot only; the other still
//! holds the previous commit, which is what had been acknowledged.

use sha2::{Digest, Sha256};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The file's name in the state directory.
pub(crate) const FILE: &str = "gateway.commit";
const MAGIC: &[u8; 8] = b"awexack1";
const SLOT: usize = 32;

/// The newest valid slot: the database it belongs to and the last acknowledged commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Acked {
    pub(crate) db_id: u64,
    pub(crate) seq: u64,
}

/// The open record file.
pub(crate) struct Witness {
    file: File,
    path: PathBuf,
}

fn check(head: &[u8]) -> [u8; 8] {
    let d = Sha256::digest(head);
    let mut out = [0u8; 8];
    out.copy_from_slice(&d[..8]);
    out
}

fn encode(a: Acked) -> [u8; SLOT] {
    let mut b = [0u8; SLOT];
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&a.db_id.to_le_bytes());
    b[16..24].copy_from_slice(&a.seq.to_le_bytes());
    let c = check(&b[..24]);
    b[24..].copy_from_slice(&c);
    b
}

fn decode(b: &[u8]) -> Option<Acked> {
    if b.len() < SLOT || &b[..8] != MAGIC || b[24..SLOT] != check(&b[..24]) {
        return None;
    }
    let word = |r: std::ops::Range<usize>| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[r]);
        u64::from_le_bytes(w)
    };
    Some(Acked {
        db_id: word(8..16),
        seq: word(16..24),
    })
}

impl Witness {
    /// Reads `dir/gateway.commit`: `Ok(None)` when there is none, `Err` naming the file when it
    /// exists but no slot is valid.
    pub(crate) fn read(dir: &Path) -> Result<Option<Acked>, String> {
        let path = dir.join(FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        if bytes.is_empty() {
            // created, and the gateway stopped before it wrote the record: damage when the
            // database holds commits (`Store::open` tells), a leftover when it holds none
            return Ok(None);
        }
        let slots = [bytes.get(..SLOT), bytes.get(SLOT..2 * SLOT)];
        let best = slots
            .into_iter()
            .flatten()
            .filter_map(decode)
            .max_by_key(|a| a.seq);
        match best {
            Some(a) => Ok(Some(a)),
            None => Err(format!(
                "{} is damaged ({} bytes, no valid record): it says which commit the gateway last acknowledged. If gateway.redb is intact, remove {} and start again (the check is then skipped once)",
                path.display(),
                bytes.len(),
                path.display()
            )),
        }
    }

    /// Opens (creating, mode 0600) `dir/gateway.commit` for writing.
    pub(crate) fn open(dir: &Path) -> std::io::Result<Witness> {
        let path = dir.join(FILE);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)?;
        Ok(Witness { file, path })
    }

    /// Records `a` as acknowledged: written into its slot and synced.
    pub(crate) fn record(&self, a: Acked) -> std::io::Result<()> {
        let at = (a.seq % 2) * SLOT as u64;
        self.file.write_all_at(&encode(a), at)?;
        self.file.sync_data()
    }

    /// The file's path (for messages).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_valid_slot_wins_and_a_torn_slot_falls_back_to_the_other() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Witness::read(dir.path()).unwrap(), None);
        let w = Witness::open(dir.path()).unwrap();
        for seq in 1..=5 {
            w.record(Acked { db_id: 9, seq }).unwrap();
        }
        assert_eq!(
            Witness::read(dir.path()).unwrap(),
            Some(Acked { db_id: 9, seq: 5 })
        );
        // tear slot 1 (seq 5): the other slot's seq 4 remains
        w.file.write_all_at(&[0xff; 4], SLOT as u64 + 20).unwrap();
        assert_eq!(
            Witness::read(dir.path()).unwrap(),
            Some(Acked { db_id: 9, seq: 4 })
        );
        w.file.write_all_at(&[0xff; 4], 20).unwrap();
        let e = Witness::read(dir.path()).unwrap_err();
        assert!(
            e.contains("gateway.commit is damaged (64 bytes, no valid record)"),
            "{e}"
        );
    }
}
