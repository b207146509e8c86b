//! Input caps, enforced before any store work so a hostile request costs
//! little, and the one validation of a request's domain and descriptors
//! against them that every service runs. Documented in the README.
//!
//! Each cap is above anything Envoy sends for a valid configuration (Envoy
//! Gateway's API included: 256 rules a policy, up to some 1,160 entries a
//! rule: 8 client selectors of 128 headers and 16 query parameters), since
//! a refused request passes Envoy's filter unlimited under its default
//! `failure_mode_deny: false`. So nothing a client of Envoy controls (header
//! and query values, whose length Envoy bounds only by its header limits)
//! is capped here: a long value goes into keys as its digest
//! ([`crate::keys::MAX_RAW_VALUE_BYTES`]), and entry keys come from Envoy's
//! configuration (a key no rule names costs nothing).

use tonic::Status;

use super::wire::Entries;
use crate::config::compile::MAX_DOMAIN_BYTES;
use crate::config::xds_decode::MAX_DESCRIPTOR_DEPTH;

/// Largest accepted gRPC message, in bytes: gRPC's default, which
/// envoyproxy/ratelimit keeps.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Most descriptors in one request.
pub const MAX_DESCRIPTORS: usize = 1024;
/// Most entries in one descriptor: as deep as a descriptor tree nests (a
/// request's entries match one level each), above Envoy Gateway's deepest
/// rule (some 1,160 matches).
pub const MAX_ENTRIES: usize = MAX_DESCRIPTOR_DEPTH;

/// Most entries in one request, all descriptors together: far above what
/// Envoy sends (a handful a descriptor), low enough that a 4 MiB message of
/// empty entries (two million) is refused before it is decoded.
pub const MAX_REQUEST_ENTRIES: usize = 64 * 1024;

/// Why a request past [`MAX_ENTRIES`] in a descriptor, or past
/// [`MAX_REQUEST_ENTRIES`] in all, is refused where entries are counted as
/// they are read (`descriptor`: the index of the one past its cap).
pub fn past_max_entries(descriptor: Option<usize>) -> String {
    match descriptor {
        Some(i) => format!("descriptors[{i}] has more than {MAX_ENTRIES} entries: at most {MAX_ENTRIES} are accepted"),
        None => format!("more than {MAX_REQUEST_ENTRIES} entries in all: at most {MAX_REQUEST_ENTRIES} are accepted per request"),
    }
}

/// Why a request of more than [`MAX_DESCRIPTORS`] is refused where it is
/// counted as it is read, and stopped past the cap (`/json`'s body, a gRPC
/// call's bytes): how many it holds is not known.
pub fn past_max_descriptors() -> String {
    format!("more than {MAX_DESCRIPTORS} descriptors: at most {MAX_DESCRIPTORS} are accepted per request")
}

/// Checks a request's domain and descriptors against the caps and Envoy's
/// own rules (a domain, at least one descriptor, no empty entry key);
/// `INVALID_ARGUMENT` naming the first offending field otherwise.
pub fn validate<D: Entries>(domain: &str, descriptors: &[D]) -> Result<(), Status> {
    let invalid = |m: String| Err(Status::invalid_argument(m));
    if domain.is_empty() {
        return invalid("the rate limit domain must not be empty".into());
    }
    if domain.len() > MAX_DOMAIN_BYTES {
        return invalid(format!(
            "the domain is longer than {MAX_DOMAIN_BYTES} bytes"
        ));
    }
    if descriptors.is_empty() {
        return invalid("the rate limit descriptor list must not be empty".into());
    }
    if descriptors.len() > MAX_DESCRIPTORS {
        return invalid(format!(
            "{} descriptors: at most {MAX_DESCRIPTORS} are accepted per request",
            descriptors.len(),
        ));
    }
    let mut in_all = 0;
    for (i, descriptor) in descriptors.iter().enumerate() {
        let entries = descriptor.entries();
        in_all += entries.len();
        if in_all > MAX_REQUEST_ENTRIES {
            return invalid(past_max_entries(None));
        }
        if entries.len() > MAX_ENTRIES {
            return invalid(format!(
                "descriptors[{i}] has {} entries: at most {MAX_ENTRIES} are accepted",
                entries.len(),
            ));
        }
        for (j, (key, _)) in entries.enumerate() {
            if key.is_empty() {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}]: the key must not be empty"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::v1::{Descriptor, Entry};

    fn descriptor(entries: &[(&str, &str)]) -> Descriptor {
        Descriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
        }
    }

    #[test]
    fn names_the_first_field_over_a_cap() {
        let ok = [descriptor(&[("user", "a")])];
        assert!(validate("api", &ok).is_ok());
        let long_value = "v".repeat(64 * 1024);
        assert!(validate("api", &[descriptor(&[("k", &long_value)])]).is_ok());
        let many = vec![descriptor(&[("k", "v")]); MAX_DESCRIPTORS + 1];
        let wide = [descriptor(&vec![("k", "v"); MAX_ENTRIES + 1])];
        let all_wide = vec![descriptor(&vec![("k", "v"); 2000]); 40];
        let cases: [(&str, &[Descriptor], &str); 6] = [
            ("", &ok, "domain must not be empty"),
            ("api", &[], "descriptor list must not be empty"),
            ("api", &many, "at most 1024"),
            (
                "api",
                &[descriptor(&[("", "a")])],
                "descriptors[0].entries[0]: the key must not be empty",
            ),
            ("api", &wide, "at most 2048"),
            ("api", &all_wide, "more than 65536 entries in all"),
        ];
        for (domain, descriptors, message) in cases {
            let e = validate(domain, descriptors).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(
                e.message().contains(message),
                "{:?} / {message:?}",
                e.message()
            );
        }
    }
}
