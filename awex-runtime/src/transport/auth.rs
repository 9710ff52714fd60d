//! Peer authentication of the data plane: the per-pair secret the gateway hands every rank in
//! its join answer, and the HMAC-SHA256 challenge-response of the tcp hello.
//!
//! Both ends of a tcp connection contribute a fresh 32-byte nonce; each proves it holds the
//! pair secret with `HMAC-SHA256(secret, role || pair || nonce_s || nonce_r || src || dst ||
//! fingerprint || bucket bytes || tag)`, where `tag` is the update version and attempt the
//! connection was opened for. A process without the secret (everything else about a pair is
//! public: fingerprint, bucket size, ports) cannot complete a hello, and a recorded hello is
//! useless because the other end's nonce changes every time.

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
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("hmac takes any key length"));
        m.update(b"awex-tcp-hello-v1\0");
        m.update(role);
        m.update(&(self.pair.len() as u64).to_le_bytes());
        m.update(self.pair.as_bytes());
        m.update(transcript);
        m
    }
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
}
