//! Bearer-token authentication: 401 when the token is missing, 403 when it is wrong, compared in
//! constant time so that response timing says nothing about the token.

use super::AppState;
use super::error::ApiError;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

/// Middleware on every route that needs the token (all of `/v1` and `/metrics`).
pub(crate) async fn require_token(
    State(gateway): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(expected) = gateway.config.token.as_deref() else {
        return next.run(request).await;
    };
    match check(request.headers().get(header::AUTHORIZATION), expected) {
        Ok(()) => {
            // the connection keeps its slot in a flood of connections without the token
            let conn = request
                .extensions()
                .get::<axum::extract::ConnectInfo<super::listener::Conn>>();
            if let Some(axum::extract::ConnectInfo(c)) = conn {
                c.0.prove();
            }
            next.run(request).await
        }
        Err(e) => {
            tracing::warn!(
                method = %request.method(),
                path = %request.uri().path(),
                reason = %e,
                "refused a request without the gateway's token"
            );
            e.into_response()
        }
    }
}

fn check(value: Option<&axum::http::HeaderValue>, expected: &str) -> Result<(), ApiError> {
    let Some(value) = value else {
        return Err(ApiError::Unauthorized(
            "missing bearer token: send `Authorization: Bearer <token>`".into(),
        ));
    };
    let bytes = value.as_bytes();
    let presented = match bytes.split_at_checked(7) {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case(b"bearer ") => rest,
        _ => {
            return Err(ApiError::Unauthorized(
                "the Authorization header must be `Bearer <token>`".into(),
            ));
        }
    };
    if tokens_equal(presented, expected.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::Forbidden(
            "the bearer token is not valid for this gateway".into(),
        ))
    }
}

/// Compares a presented token with the expected one in time that depends only on the expected
/// token's length: every byte of it is compared, whatever is presented.
fn tokens_equal(presented: &[u8], expected: &[u8]) -> bool {
    let same_len = (presented.len() as u64).ct_eq(&(expected.len() as u64));
    let mut diff = subtle::Choice::from(1u8);
    for (i, e) in expected.iter().enumerate() {
        let p = presented.get(i).copied().unwrap_or(!*e);
        diff &= p.ct_eq(e);
    }
    bool::from(same_len & diff)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn tokens_equal_only_for_identical_bytes() {
        assert!(tokens_equal(b"s3cret", b"s3cret"));
        assert!(!tokens_equal(b"s3cre", b"s3cret"));
        assert!(!tokens_equal(b"s3cretX", b"s3cret"));
        assert!(!tokens_equal(b"s3crex", b"s3cret"));
        assert!(!tokens_equal(b"", b"s3cret"));
    }

    #[test]
    fn missing_malformed_and_wrong_tokens_are_401_401_403() {
        let missing = check(None, "tok").unwrap_err();
        assert_eq!(missing.status().as_u16(), 401);
        let basic = HeaderValue::from_static("Basic dG9rOnRvaw==");
        let malformed = check(Some(&basic), "tok").unwrap_err();
        assert_eq!(malformed.status().as_u16(), 401);
        assert_eq!(
            malformed.to_string(),
            "the Authorization header must be `Bearer <token>`"
        );
        let wrong = HeaderValue::from_static("Bearer nope");
        assert_eq!(
            check(Some(&wrong), "tok").unwrap_err().status().as_u16(),
            403
        );
        let right = HeaderValue::from_static("bearer tok");
        assert!(check(Some(&right), "tok").is_ok());
    }
}
