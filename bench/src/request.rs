//! The request a task sends, built once and only its descriptor values
//! rewritten per call; and the gRPC framing `--write-request` writes, the
//! body for another HTTP/2 load tool (`make bench` gives it to `h2load -d`).

use std::fmt::Write as _;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

use crate::args::Args;
use crate::keys::{KeyDist, KeySpace, Rng};

/// One task's reusable request: only descriptor values change per call.
pub struct RequestTemplate {
    request: RateLimitRequest,
    base: String,
    rng: Rng,
    keys: Arc<KeySpace>,
}

impl RequestTemplate {
    pub fn new(args: &Args, keys: Arc<KeySpace>, seed: u64) -> Self {
        let descriptors = (0..args.descriptors.max(1))
            .map(|_| RateLimitDescriptor {
                entries: vec![Entry {
                    key: args.key.clone(),
                    value: String::new(),
                }],
                ..Default::default()
            })
            .collect();
        RequestTemplate {
            request: RateLimitRequest {
                domain: args.domain.clone(),
                descriptors,
                hits_addend: 0,
            },
            base: String::new(),
            rng: Rng(seed),
            keys,
        }
    }

    /// The next request to send (descriptor `i > 0` gets the suffix `.i`).
    pub fn next_request(&mut self) -> RateLimitRequest {
        self.keys.pick(&mut self.rng, &mut self.base);
        for (i, descriptor) in self.request.descriptors.iter_mut().enumerate() {
            let value = &mut descriptor.entries[0].value;
            value.clone_from(&self.base);
            if i > 0 {
                let _ = write!(value, ".{i}");
            }
        }
        self.request.clone()
    }
}

/// The first request a run of `args` would send, gRPC-framed.
pub fn first_request_frame(args: &Args, dist: KeyDist) -> Vec<u8> {
    let keys = Arc::new(KeySpace::new(dist));
    grpc_frame(&RequestTemplate::new(args, keys, 1).next_request())
}

/// A gRPC message as it travels in an HTTP/2 body: an uncompressed flag,
/// the length (big-endian u32), then the protobuf bytes.
fn grpc_frame(request: &RateLimitRequest) -> Vec<u8> {
    let body = prost::Message::encode_to_vec(request);
    let mut frame = Vec::with_capacity(5 + body.len());
    frame.push(0);
    // A request of a few descriptors is far below 4 GiB.
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn distinct_values_never_repeat_and_descriptors_differ() {
        let args = Args::parse_from(["bench", "--descriptors", "3"]);
        let keys = Arc::new(KeySpace::new(KeyDist::Distinct));
        let mut template = RequestTemplate::new(&args, keys, 1);
        let a = template.next_request();
        let b = template.next_request();
        assert_ne!(
            a.descriptors[0].entries[0].value,
            b.descriptors[0].entries[0].value
        );
        let values: Vec<&str> = a
            .descriptors
            .iter()
            .map(|d| d.entries[0].value.as_str())
            .collect();
        assert_eq!(values.len(), 3);
        assert!(values[1].ends_with(".1") && values[2].ends_with(".2"));
    }

    #[test]
    fn written_requests_are_one_grpc_message() {
        let args = Args::parse_from(["bench", "--domain", "d", "--keys", "hot"]);
        let frame = first_request_frame(&args, KeyDist::Hot);
        assert_eq!(frame[0], 0, "not compressed");
        let length = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
        assert_eq!(length, frame.len() - 5);
        let decoded: RateLimitRequest = prost::Message::decode(&frame[5..]).unwrap();
        assert_eq!(decoded.domain, "d");
        assert_eq!(decoded.descriptors[0].entries[0].value, "hot");
    }
}
