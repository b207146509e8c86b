//! Input caps, enforced before any store work so a hostile request costs
//! little and can never create huge keys, and the one validation of a
//! request's domain and descriptors against them that both services run.
//! Documented in the README.

use tonic::Status;

use super::wire::Entries;

/// Largest accepted gRPC message, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// Most descriptors in one `ShouldRateLimit` request.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries in one descriptor.
pub const MAX_ENTRIES: usize = 16;
/// Longest domain, in bytes.
pub const MAX_DOMAIN_BYTES: usize = 256;
/// Longest descriptor entry key, in bytes.
pub const MAX_KEY_BYTES: usize = 256;
/// Longest descriptor entry value, in bytes.
pub const MAX_VALUE_BYTES: usize = 1024;

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
    for (i, descriptor) in descriptors.iter().enumerate() {
        let entries = descriptor.entries();
        if entries.len() > MAX_ENTRIES {
            return invalid(format!(
                "descriptors[{i}] has {} entries: at most {MAX_ENTRIES} are accepted",
                entries.len(),
            ));
        }
        for (j, (key, value)) in entries.enumerate() {
            if key.is_empty() {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}]: the key must not be empty"
                ));
            }
            if key.len() > MAX_KEY_BYTES {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}]: the key is longer than {MAX_KEY_BYTES} bytes"
                ));
            }
            if value.len() > MAX_VALUE_BYTES {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}]: the value is longer than {MAX_VALUE_BYTES} bytes"
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
        let long_value = "v".repeat(MAX_VALUE_BYTES + 1);
        let many = vec![descriptor(&[("k", "v")]); MAX_DESCRIPTORS + 1];
        let cases: [(&str, &[Descriptor], &str); 5] = [
            ("", &ok, "domain must not be empty"),
            ("api", &[], "descriptor list must not be empty"),
            ("api", &many, "at most 64"),
            (
                "api",
                &[descriptor(&[("", "a")])],
                "descriptors[0].entries[0]: the key must not be empty",
            ),
            (
                "api",
                &[descriptor(&[("k", &long_value)])],
                "value is longer than 1024 bytes",
            ),
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
