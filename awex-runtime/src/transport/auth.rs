//! Peer authentication of the data plane: the per-pair secret the gateway hands every rank in
//! its join answer, and the HMAC-SHA256 challenge-response of the tcp hello.
//!
//! Both ends of a tcp connection contribute a fresh 32-byte nonce; each proves it holds the
//! pair secret with `HMAC-SHA256(secret, role || pair || nonce_s || nonce_r || src || dst ||
//! fingerprint || bucket bytes || tag)`, where `tag` is the update version and attempt the
//! connection was opened for. A process without the secret (everything else about a pair is
//! public: fingerprint, bucket size, ports) cannot complete a hello, and a recorded hello is
//! useless because the other end's nonce changes every time.
//!
//! Rendezvous values that must stay private to the pair's ranks (the NCCL unique id, which
//! lets whoever holds it join the communicator) are **sealed** before they go into the
//! gateway's kv ([`PairSecret::seal`]): encrypted and authenticated with keys derived from the
//! pair secret, bound to the pair and to the kv key they are published under (which names the
//! version and attempt), so the stored value reveals nothing usable, and a forged, tampered or
//! replayed value (copied from another key, pair or connect) is refused by [`PairSecret::open`].
//! The construction uses only HMAC-SHA256, as a PRF: `k_enc = HMAC(secret, "awex-seal-v1
//! enc")`, `k_mac = HMAC(secret, "awex-seal-v1 mac")`; a fresh 16-byte nonce `n`; keystream
//! block `i` = `HMAC(k_enc, n || i)` (counter mode); tag = `HMAC(k_mac, pair || label || n ||
//! ciphertext)` (encrypt-then-MAC, lengths prefixed); the sealed form is hex of `n ||
//! ciphertext || tag`.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A pair's data-plane secret (32 bytes), as issued by the gateway at connect.
///
/// Its `Debug` never prints the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct PairSecret {
    pair: String,
    key: [u8; 32],
}

impl std::fmt::Debug for PairSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PairSecret({}, <redacted>)", self.pair)
    }
}

impl PairSecret {
    /// The secret of `pair`.
    pub fn new(pair: &str, key: [u8; 32]) -> Self {
        PairSecret {
            pair: pair.to_string(),
            key,
        }
    }

    /// Parses the hex form of the join answer (64 hex digits).
    pub fn from_hex(pair: &str, hex: &str) -> Option<Self> {
        let b = hex.as_bytes();
        if b.len() != 64 {
            return None;
        }
        let mut key = [0u8; 32];
        for (i, k) in key.iter_mut().enumerate() {
            let d = |c: u8| (c as char).to_digit(16);
            *k = (d(b[2 * i])? * 16 + d(b[2 * i + 1])?) as u8;
        }
        Some(Self::new(pair, key))
    }

    /// A random secret (tests; the gateway issues the real ones).
    pub fn random(pair: &str) -> Self {
        Self::new(pair, random_bytes())
    }

    /// The pair it belongs to.
    pub fn pair(&self) -> &str {
        &self.pair
    }

    /// The proof of `role` over a hello's transcript.
    pub(crate) fn prove(&self, role: &[u8], transcript: &[u8]) -> [u8; 32] {
        self.mac(role, transcript).finalize().into_bytes().into()
    }

    /// Checks the other end's proof in constant time.
    pub(crate) fn verify(&self, role: &[u8], transcript: &[u8], proof: &[u8]) -> bool {
        self.mac(role, transcript).verify_slice(proof).is_ok()
    }

    fn mac(&self, role: &[u8], transcript: &[u8]) -> Hmac<Sha256> {
        // HMAC accepts keys of any length: this cannot fail
        let mut m = hmac_of(&self.key);
        m.update(b"awex-tcp-hello-v1\0");
        m.update(role);
        m.update(&(self.pair.len() as u64).to_le_bytes());
        m.update(self.pair.as_bytes());
        m.update(transcript);
        m
    }
}

/// Why a sealed value was refused by [`PairSecret::open`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// Not a sealed value at all (wrong length or not hex).
    #[error("not a sealed value ({0})")]
    Malformed(String),
    /// Its tag does not verify with this pair's secret for this label.
    #[error(
        "its authentication tag does not verify with the pair secret: it was written by a process without the secret, tampered with, or copied from another pair, connect, version or attempt"
    )]
    Forged,
}

const SEAL_NONCE: usize = 16;
const SEAL_TAG: usize = 32;

impl PairSecret {
    fn subkey(&self, purpose: &[u8]) -> [u8; 32] {
        let mut m = hmac_of(&self.key);
        m.update(b"awex-seal-v1 ");
        m.update(purpose);
        m.finalize().into_bytes().into()
    }

    fn seal_tag(&self, label: &str, nonce: &[u8], ct: &[u8]) -> Hmac<Sha256> {
        let mut m = hmac_of(&self.subkey(b"mac"));
        for part in [self.pair.as_bytes(), label.as_bytes(), nonce] {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part);
        }
        m.update(ct);
        m
    }

    fn keystream_xor(&self, nonce: &[u8], data: &mut [u8]) {
        let k_enc = self.subkey(b"enc");
        for (i, chunk) in data.chunks_mut(32).enumerate() {
            let mut m = hmac_of(&k_enc);
            m.update(nonce);
            m.update(&(i as u64).to_le_bytes());
            let block: [u8; 32] = m.finalize().into_bytes().into();
            for (d, k) in chunk.iter_mut().zip(block.iter()) {
                *d ^= k;
            }
        }
    }

    /// Seals `plain` for publication under `label` (a kv key) of this pair: hex of nonce,
    /// ciphertext and tag. Only a holder of the secret can open it, and only under `label`.
    pub fn seal(&self, label: &str, plain: &[u8]) -> String {
        let nonce = &random_bytes()[..SEAL_NONCE];
        let mut ct = plain.to_vec();
        self.keystream_xor(nonce, &mut ct);
        let tag = self.seal_tag(label, nonce, &ct).finalize().into_bytes();
        let mut out = String::with_capacity(2 * (SEAL_NONCE + ct.len() + SEAL_TAG));
        for b in nonce.iter().chain(ct.iter()).chain(tag.iter()) {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }

    /// Opens a value sealed by [`PairSecret::seal`] under `label`; the tag is checked (in
    /// constant time) before anything is decrypted.
    pub fn open(&self, label: &str, sealed: &str) -> Result<Vec<u8>, SealError> {
        let raw = from_hex(sealed).ok_or_else(|| {
            SealError::Malformed(format!(
                "{} characters, not an even count of hex digits",
                sealed.len()
            ))
        })?;
        if raw.len() < SEAL_NONCE + SEAL_TAG {
            return Err(SealError::Malformed(format!(
                "{} bytes, shorter than a nonce and a tag ({} bytes)",
                raw.len(),
                SEAL_NONCE + SEAL_TAG
            )));
        }
        let (nonce, rest) = raw.split_at(SEAL_NONCE);
        let (ct, tag) = rest.split_at(rest.len() - SEAL_TAG);
        self.seal_tag(label, nonce, ct)
            .verify_slice(tag)
            .map_err(|_| SealError::Forged)?;
        let mut plain = ct.to_vec();
        self.keystream_xor(nonce, &mut plain);
        Ok(plain)
    }
}

fn hmac_of(key: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length: this cannot fail
    <Hmac<Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("hmac takes any key length"))
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if b.len() % 2 != 0 {
        return None;
    }
    let d = |c: u8| (c as char).to_digit(16);
    b.chunks(2)
        .map(|p| Some((d(p[0])? * 16 + d(p[1])?) as u8))
        .collect()
}

/// 32 bytes from the kernel's random source.
pub fn random_bytes() -> [u8; 32] {
    use std::io::Read;
    let mut b = [0u8; 32];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok();
    // SAFETY: plain syscall into a valid 32-byte buffer.
    if !ok && unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, 32, 0) } != 32 {
        // no randomness at all: refuse to run rather than use predictable nonces
        panic!("awex: no source of randomness (/dev/urandom, getrandom)");
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_secret_role_pair_and_transcript() {
        let s = PairSecret::random("p");
        let p = s.prove(b"S", b"abc");
        assert!(s.verify(b"S", b"abc", &p));
        assert!(!s.verify(b"R", b"abc", &p), "role");
        assert!(!s.verify(b"S", b"abd", &p), "transcript");
        assert!(
            !PairSecret::new("q", s.key).verify(b"S", b"abc", &p),
            "pair"
        );
        assert!(!PairSecret::random("p").verify(b"S", b"abc", &p), "secret");
        assert!(format!("{s:?}").contains("redacted"));
        let hex: String = s.key.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(PairSecret::from_hex("p", &hex), Some(s));
        assert_eq!(PairSecret::from_hex("p", "zz"), None);
    }

    #[test]
    fn sealed_values_open_only_with_the_secret_pair_and_label() {
        let s = PairSecret::random("p");
        let plain: Vec<u8> = (0..128u32).map(|i| (i * 7) as u8).collect();
        let sealed = s.seal("nccl.uid.3.2", &plain);
        assert_eq!(sealed.len(), 2 * (16 + 128 + 32));
        assert_eq!(s.open("nccl.uid.3.2", &sealed).unwrap(), plain);
        // the stored form reveals nothing of the plaintext, and two seals differ (fresh nonce)
        let plain_hex: String = plain.iter().map(|b| format!("{b:02x}")).collect();
        assert!(!sealed.contains(&plain_hex[..32]));
        assert_ne!(s.seal("nccl.uid.3.2", &plain), sealed);
        // replayed under another key, opened by another pair or secret: refused
        assert_eq!(s.open("nccl.uid.4.2", &sealed), Err(SealError::Forged));
        assert_eq!(s.open("nccl.uid", &sealed), Err(SealError::Forged));
        assert_eq!(
            PairSecret::new("q", s.key).open("nccl.uid.3.2", &sealed),
            Err(SealError::Forged)
        );
        assert_eq!(
            PairSecret::random("p").open("nccl.uid.3.2", &sealed),
            Err(SealError::Forged)
        );
        // any flipped bit (nonce, ciphertext, tag) is refused
        for pos in [0, 40, sealed.len() - 1] {
            let mut t = sealed.clone().into_bytes();
            t[pos] = if t[pos] == b'0' { b'1' } else { b'0' };
            let t = String::from_utf8(t).unwrap();
            assert_eq!(
                s.open("nccl.uid.3.2", &t),
                Err(SealError::Forged),
                "position {pos}"
            );
        }
        assert!(matches!(s.open("k", "abc"), Err(SealError::Malformed(_))));
        assert!(matches!(
            s.open("k", &"ab".repeat(10)),
            Err(SealError::Malformed(_))
        ));
        assert!(matches!(
            s.open("k", &"zz".repeat(60)),
            Err(SealError::Malformed(_))
        ));
    }
}
