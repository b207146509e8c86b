//! A client for ratekeeper's `ratekeeper.v1.ConcurrencyService`
//! (`proto/ratekeeper/v1/concurrency.proto`), the three unary calls the soak
//! run churns, with messages written by hand ([`crate::v1_wire`] says why).

use envoy_types::pb::google::protobuf::Duration;
use tonic::client::Grpc;
use tonic::transport::Channel;
use tonic::Status;

use crate::v1_wire::unary;
pub use crate::v1_wire::{Descriptor, Entry};

#[derive(Clone, PartialEq, prost::Message)]
pub struct AcquireRequest {
    #[prost(string, tag = "1")]
    pub domain: String,
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<Descriptor>,
    #[prost(message, optional, tag = "3")]
    pub lease_ttl: Option<Duration>,
    #[prost(string, tag = "4")]
    pub holder: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AcquireResponse {
    #[prost(bool, tag = "1")]
    pub granted: bool,
    #[prost(string, tag = "2")]
    pub lease_id: String,
    #[prost(uint32, tag = "3")]
    pub active: u32,
    #[prost(uint32, tag = "4")]
    pub limit: u32,
    #[prost(message, optional, tag = "5")]
    pub retry_after: Option<Duration>,
    #[prost(message, optional, tag = "6")]
    pub lease_ttl: Option<Duration>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseIds {
    #[prost(string, repeated, tag = "1")]
    pub lease_ids: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeartbeatResponse {
    #[prost(string, repeated, tag = "1")]
    pub extended: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    pub lost: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReleaseResponse {}

const ACQUIRE: &str = "/ratekeeper.v1.ConcurrencyService/AcquireConnection";
const HEARTBEAT: &str = "/ratekeeper.v1.ConcurrencyService/Heartbeat";
const RELEASE: &str = "/ratekeeper.v1.ConcurrencyService/Release";

/// `ConcurrencyService` over one HTTP/2 channel (cheap to clone).
#[derive(Clone)]
pub struct ConcurrencyClient {
    grpc: Grpc<Channel>,
}

impl ConcurrencyClient {
    pub fn new(channel: Channel) -> Self {
        ConcurrencyClient {
            grpc: Grpc::new(channel),
        }
    }

    /// Takes a lease on the one-entry descriptor `key`=`value` of `domain`.
    pub async fn acquire(
        &mut self,
        domain: &str,
        key: &str,
        value: &str,
        holder: &str,
    ) -> Result<AcquireResponse, Status> {
        let request = AcquireRequest {
            domain: domain.to_owned(),
            descriptors: vec![Descriptor {
                entries: vec![Entry {
                    key: key.to_owned(),
                    value: value.to_owned(),
                }],
            }],
            lease_ttl: None,
            holder: holder.to_owned(),
        };
        unary(&mut self.grpc, ACQUIRE, request, None).await
    }

    pub async fn heartbeat(&mut self, lease_id: &str) -> Result<HeartbeatResponse, Status> {
        unary(&mut self.grpc, HEARTBEAT, one_lease(lease_id), None).await
    }

    pub async fn release(&mut self, lease_id: &str) -> Result<ReleaseResponse, Status> {
        unary(&mut self.grpc, RELEASE, one_lease(lease_id), None).await
    }
}

fn one_lease(lease_id: &str) -> LeaseIds {
    LeaseIds {
        lease_ids: vec![lease_id.to_owned()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written messages put each field under the proto's tag: an
    /// AcquireResponse's bytes as the proto defines them decode as such.
    #[test]
    fn fields_travel_under_the_protos_tags() {
        // granted (1) = true, lease_id (2) = "x", active (3) = 2, limit (4) = 3
        let bytes = [0x08, 0x01, 0x12, 0x01, b'x', 0x18, 0x02, 0x20, 0x03];
        let decoded: AcquireResponse = prost::Message::decode(&bytes[..]).unwrap();
        assert!(decoded.granted);
        assert_eq!(decoded.lease_id, "x");
        assert_eq!((decoded.active, decoded.limit), (2, 3));
        let encoded = prost::Message::encode_to_vec(&one_lease("ab"));
        assert_eq!(encoded, [0x0a, 0x02, b'a', b'b']);
    }
}
