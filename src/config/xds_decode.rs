//! Decodes the `RateLimitConfig` messages of an xDS response, however deep
//! their descriptors nest, up to [`MAX_DESCRIPTOR_DEPTH`]. prost stops at
//! 100 nested messages, and Envoy Gateway nests one descriptor per match
//! of a rule (a rule of 8 client selectors, each of up to 128 headers, 16
//! query parameters, a method, a path and a source CIDR, nests some 1,185
//! deep): one such rule made the whole snapshot refused, every domain's
//! limits with it. Each message is decoded without its children, which
//! are kept as bytes and decoded the same way in turn: prost never sees
//! more than one level.

use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
use prost::Message;

use crate::pb::rls_conf::{RateLimitConfig, RateLimitDescriptor};

/// Deepest descriptor nesting taken: above Envoy Gateway's deepest (see
/// the module doc), as a request's entries are (one a level,
/// [`crate::service::caps::MAX_ENTRIES`]); past it a snapshot is refused
/// with a reason. Go's protobuf, theirs, stops at 10,000 levels.
pub const MAX_DESCRIPTOR_DEPTH: usize = 2_048;

/// The field of `RateLimitConfig` holding its descriptors.
const CONFIG_DESCRIPTORS: u32 = 3;
/// The field of `RateLimitDescriptor` holding its children.
const DESCRIPTOR_CHILDREN: u32 = 4;

/// One `RateLimitConfig` from its bytes.
pub fn decode_config(bytes: &[u8]) -> Result<RateLimitConfig, String> {
    let (rest, children) = split(bytes, CONFIG_DESCRIPTORS)?;
    let mut config = RateLimitConfig::decode(rest.as_slice()).map_err(|e| e.to_string())?;
    config.descriptors = children
        .into_iter()
        .map(|child| decode_descriptor(child, 1))
        .collect::<Result<_, _>>()?;
    Ok(config)
}

/// One descriptor at `depth` (1 for a message's own), with its children.
fn decode_descriptor(bytes: &[u8], depth: usize) -> Result<RateLimitDescriptor, String> {
    if depth > MAX_DESCRIPTOR_DEPTH {
        return Err(format!(
            "descriptors nest deeper than {MAX_DESCRIPTOR_DEPTH} levels"
        ));
    }
    let (rest, children) = split(bytes, DESCRIPTOR_CHILDREN)?;
    let mut descriptor = RateLimitDescriptor::decode(rest.as_slice()).map_err(|e| e.to_string())?;
    descriptor.descriptors = children
        .into_iter()
        .map(|child| decode_descriptor(child, depth + 1))
        .collect::<Result<_, _>>()?;
    Ok(descriptor)
}

/// A message's bytes split into its other fields (in their order, so a
/// field given twice decodes as it would have) and the bytes of each
/// message in its repeated field `children`.
fn split(bytes: &[u8], children: u32) -> Result<(Vec<u8>, Vec<&[u8]>), String> {
    let malformed = |e: prost::DecodeError| e.to_string();
    let (mut rest, mut found) = (Vec::with_capacity(bytes.len()), Vec::new());
    let mut buf = bytes;
    while !buf.is_empty() {
        let start = bytes.len() - buf.len();
        let (tag, wire_type) = decode_key(&mut buf).map_err(malformed)?;
        if tag == children && wire_type == WireType::LengthDelimited {
            let length = decode_varint(&mut buf).map_err(malformed)?;
            let length = usize::try_from(length)
                .ok()
                .filter(|&n| n <= buf.len())
                .ok_or("a message's length runs past its end")?;
            found.push(&buf[..length]);
            buf = &buf[length..];
        } else {
            skip_field(wire_type, tag, &mut buf, DecodeContext::default()).map_err(malformed)?;
            rest.extend_from_slice(&bytes[start..bytes.len() - buf.len()]);
        }
    }
    Ok((rest, found))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::rls_conf::{RateLimitPolicy, RateLimitUnit};

    /// A chain of `depth` descriptors, the deepest with a limit.
    fn chain(depth: usize) -> RateLimitConfig {
        let mut node = RateLimitDescriptor {
            key: format!("k{depth}"),
            rate_limit: Some(RateLimitPolicy {
                unit: RateLimitUnit::Minute as i32,
                requests_per_unit: 5,
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        };
        for level in (1..depth).rev() {
            node = RateLimitDescriptor {
                key: format!("k{level}"),
                value: "v".into(),
                descriptors: vec![node],
                ..RateLimitDescriptor::default()
            };
        }
        RateLimitConfig {
            name: "deep".into(),
            domain: "d".into(),
            descriptors: vec![node],
        }
    }

    /// Runs on a stack as large as the one snapshots are compiled on:
    /// building, encoding and comparing the messages recurse once a level.
    #[test]
    fn decodes_what_prost_decodes_and_deeper() {
        std::thread::Builder::new()
            .stack_size(64 << 20)
            .spawn(decode_deep)
            .unwrap()
            .join()
            .unwrap();
    }

    fn decode_deep() {
        let shallow = chain(5);
        let bytes = shallow.encode_to_vec();
        assert_eq!(decode_config(&bytes), Ok(shallow));
        let deep = chain(MAX_DESCRIPTOR_DEPTH);
        let bytes = deep.encode_to_vec();
        assert!(
            RateLimitConfig::decode(bytes.as_slice()).is_err(),
            "prost's limit"
        );
        assert_eq!(decode_config(&bytes), Ok(deep));
        let too_deep = chain(MAX_DESCRIPTOR_DEPTH + 1).encode_to_vec();
        let refused = decode_config(&too_deep).unwrap_err();
        assert!(refused.contains("deeper than 2048 levels"), "{refused}");
    }

    /// Fields in any order, a field given twice (the last wins, as
    /// prost's), and bytes that are no message are read as prost reads
    /// them.
    #[test]
    fn reads_fields_as_prost_does() {
        let mut bytes = RateLimitConfig {
            domain: "first".into(),
            ..RateLimitConfig::default()
        }
        .encode_to_vec();
        bytes.extend(chain(2).encode_to_vec());
        let expected = RateLimitConfig::decode(bytes.as_slice()).unwrap();
        assert_eq!(expected.domain, "d");
        assert_eq!(decode_config(&bytes), Ok(expected));
        for bad in [&[0x1a, 0x05, 0x0a][..], &[0xff], &[0x0a, 0x80]] {
            assert!(decode_config(bad).is_err(), "{bad:?}");
            assert!(RateLimitConfig::decode(bad).is_err(), "{bad:?}");
        }
    }
}
