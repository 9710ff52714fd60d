//! Reading an HTTP answer's body with a bound: a server that answers without end (a wrong URL,
//! a broken or hostile engine) costs at most the bound in memory, never all it can send before
//! the request's timeout.

use reqwest::Response;

/// The largest answer read from an inference engine's server (its info routes, a control
/// call's answer) or a probed server URL. SGLang's `/server_info` and vLLM's info routes are a
/// few KiB.
pub const MAX_ENGINE_ANSWER_BYTES: u64 = 16 << 20;

/// The largest gateway answer a client reads: the biggest is a roster of every rank's join
/// info, at most [`crate::wire::MAX_ROSTER_INFO_BYTES`] of infos and [`crate::wire::MAX_RANKS`]
/// ranks' envelopes.
pub const MAX_GATEWAY_ANSWER_BYTES: u64 = 256 << 20;

/// Why an answer's body was not read.
#[derive(Debug)]
pub enum BodyError {
    /// It declares or runs past `max` bytes.
    TooLarge {
        /// The declared length (`Content-Length`), when it was declared.
        declared: Option<u64>,
        /// The bound it broke.
        max: u64,
    },
    /// The connection failed while it was read.
    Read(String),
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::TooLarge {
                declared: Some(n),
                max,
            } => write!(
                f,
                "its answer is {n} bytes, more than the {} MiB awex reads from it",
                max >> 20
            ),
            BodyError::TooLarge {
                declared: None,
                max,
            } => write!(
                f,
                "its answer runs past the {} MiB awex reads from it (left unread)",
                max >> 20
            ),
            BodyError::Read(e) => write!(f, "reading its answer failed: {e}"),
        }
    }
}

impl std::error::Error for BodyError {}

/// The body of `resp`, refused once it declares or holds more than `max` bytes (the rest is
/// never read: the connection is dropped).
pub async fn read_capped(mut resp: Response, max: u64) -> Result<Vec<u8>, BodyError> {
    let declared = resp.content_length();
    if let Some(n) = declared
        && n > max
    {
        return Err(BodyError::TooLarge {
            declared: Some(n),
            max,
        });
    }
    let mut out = Vec::with_capacity(declared.unwrap_or(0) as usize);
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| BodyError::Read(e.to_string()))?
    {
        if (out.len() + chunk.len()) as u64 > max {
            return Err(BodyError::TooLarge {
                declared: None,
                max,
            });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}
