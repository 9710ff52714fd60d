//! CUDA IPC handles as plain bytes: what one process hands another to share memory or an event.
//!
//! The driver's `CUipcMemHandle` and `CUipcEventHandle` are 64 opaque bytes. awex carries them
//! as hex strings (in JSON, over the gateway, through a pipe), so these types serialise as such.

use super::CudaError;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// Size of a driver IPC handle in bytes.
pub const HANDLE_BYTES: usize = 64;

fn to_hex(b: &[u8; HANDLE_BYTES]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Result<[u8; HANDLE_BYTES], CudaError> {
    let bad = || CudaError::BadHandle(s.to_string());
    if s.len() != 2 * HANDLE_BYTES || !s.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; HANDLE_BYTES];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

macro_rules! handle_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(pub [u8; HANDLE_BYTES]);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&to_hex(&self.0))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), to_hex(&self.0))
            }
        }

        impl FromStr for $name {
            type Err = CudaError;
            fn from_str(s: &str) -> Result<Self, CudaError> {
                from_hex(s).map($name)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&to_hex(&self.0))
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

handle_type!(
    /// A device allocation shared with another process (`CUipcMemHandle`).
    IpcMemHandle
);
handle_type!(
    /// An inter-process event shared with another process (`CUipcEventHandle`).
    IpcEventHandle
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_round_trips_through_hex_json() {
        let mut b = [0u8; HANDLE_BYTES];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 5) as u8;
        }
        let h = IpcMemHandle(b);
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(&json[..11], "\"00050a0f14");
        assert_eq!(json.len(), 2 * HANDLE_BYTES + 2);
        assert_eq!(serde_json::from_str::<IpcMemHandle>(&json).unwrap(), h);
    }

    #[test]
    fn short_or_non_hex_handle_is_refused() {
        assert_eq!(
            "abcd".parse::<IpcEventHandle>().unwrap_err().to_string(),
            "bad IPC handle `abcd`: expected 128 hex digits (64 bytes)"
        );
        let zz = "zz".repeat(HANDLE_BYTES);
        assert_eq!(
            zz.parse::<IpcEventHandle>().unwrap_err(),
            CudaError::BadHandle(zz.clone())
        );
    }
}
