//! `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` and
//! `Retry-After` response headers, from the request's tightest limit (which
//! the decision picks: `service::rls`).
//!
//! Values are decimal integers only, so they can never carry CR, LF or NUL;
//! names are checked once at start-up.

use envoy_types::pb::envoy::config::core::v3::HeaderValue;

use crate::{Error, Result};

/// Header names (envoyproxy/ratelimit's defaults; `X-RateLimit-*` is common too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNames {
    pub limit: String,
    pub remaining: String,
    pub reset: String,
    pub retry_after: String,
}

impl Default for HeaderNames {
    fn default() -> Self {
        HeaderNames {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
            retry_after: "Retry-After".into(),
        }
    }
}

impl HeaderNames {
    /// Refuses names that are not HTTP tokens (RFC 9110 `tchar`s).
    pub fn validate(&self) -> Result<()> {
        for name in [&self.limit, &self.remaining, &self.reset, &self.retry_after] {
            let token = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !token {
                return Err(Error::Startup(format!(
                    "{name:?} is not a valid HTTP header name"
                )));
            }
        }
        Ok(())
    }
}

/// Whether and how to add the headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderSettings {
    /// The default for domains that do not set `response_headers`.
    pub enabled: bool,
    pub names: HeaderNames,
}

/// A limit's state after a decision, as its status and the headers
/// describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    /// The most hits the limit admits at once.
    pub limit: u64,
    pub remaining: u64,
    /// Until fully reset or, when over, until the refused hits would fit.
    pub reset_ms: u64,
    /// Over and enforced (shadow-mode limits never count as over).
    pub over: bool,
}

/// The headers for the request's tightest limit; `Retry-After` only when
/// the request is `refused` (its overall code): a shadow-mode or quota
/// descriptor can be over in an admitted request, and a client honouring
/// the header would back off from a request that was let through.
pub fn response_headers(
    names: &HeaderNames,
    tightest: &LimitState,
    refused: bool,
) -> Vec<HeaderValue> {
    let header = |key: &str, value: u64| HeaderValue {
        key: key.to_owned(),
        value: value.to_string(),
        raw_value: Vec::new(),
    };
    let reset_s = tightest.reset_ms.div_ceil(1_000);
    let mut headers = vec![
        header(&names.limit, tightest.limit),
        header(&names.remaining, tightest.remaining),
        header(&names.reset, reset_s),
    ];
    if refused && tightest.over {
        headers.push(header(&names.retry_after, reset_s.max(1)));
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(remaining: u64, reset_ms: u64, over: bool) -> LimitState {
        LimitState {
            limit: 10,
            remaining,
            reset_ms,
            over,
        }
    }

    #[test]
    fn headers_round_reset_up_and_add_retry_after_when_over() {
        let names = HeaderNames::default();
        let h = response_headers(&names, &s(3, 1_001, false), false);
        let pairs: Vec<(&str, &str)> = h
            .iter()
            .map(|h| (h.key.as_str(), h.value.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("RateLimit-Limit", "10"),
                ("RateLimit-Remaining", "3"),
                ("RateLimit-Reset", "2")
            ]
        );
        let h = response_headers(&names, &s(0, 0, true), true);
        assert_eq!(
            h.last().map(|h| (h.key.as_str(), h.value.as_str())),
            Some(("Retry-After", "1"))
        );
        // Over, but admitted (shadow mode, a quota descriptor): no Retry-After.
        let h = response_headers(&names, &s(0, 0, true), false);
        assert_eq!(h.len(), 3, "{h:?}");
    }

    #[test]
    fn header_names_must_be_tokens() {
        assert!(HeaderNames::default().validate().is_ok());
        for bad in ["", "X-Rate Limit", "X-Rate\r\nInjected: 1", "Colon:"] {
            let names = HeaderNames {
                limit: bad.into(),
                ..HeaderNames::default()
            };
            assert!(names.validate().is_err(), "{bad:?}");
        }
    }
}
