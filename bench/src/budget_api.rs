//! A client for ratekeeper's `ratekeeper.v1.BudgetService`
//! (`proto/ratekeeper/v1/budget.proto`): Reserve and Settle, for the
//! generator's `--mode budget`, with messages written by hand
//! ([`crate::v1_wire`] says why).

use envoy_types::pb::google::protobuf::Duration;
use tonic::client::Grpc;
use tonic::transport::Channel;
use tonic::Status;

use crate::v1_wire::{unary, Descriptor};

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReserveRequest {
    #[prost(string, tag = "1")]
    pub domain: String,
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<Descriptor>,
    #[prost(uint64, tag = "3")]
    pub estimate: u64,
    #[prost(message, optional, tag = "4")]
    pub ttl: Option<Duration>,
}

/// One descriptor's standing after a Reserve or Settle.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BudgetStatus {
    #[prost(uint64, tag = "1")]
    pub remaining: u64,
    #[prost(uint64, tag = "2")]
    pub limit: u64,
    #[prost(bool, tag = "3")]
    pub over: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReserveResponse {
    #[prost(bool, tag = "1")]
    pub granted: bool,
    #[prost(string, tag = "2")]
    pub reservation_id: String,
    #[prost(message, repeated, tag = "3")]
    pub statuses: Vec<BudgetStatus>,
    #[prost(message, optional, tag = "4")]
    pub retry_after: Option<Duration>,
    #[prost(message, optional, tag = "5")]
    pub ttl: Option<Duration>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SettleRequest {
    #[prost(string, tag = "1")]
    pub reservation_id: String,
    #[prost(uint64, tag = "2")]
    pub actual: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SettleResponse {
    #[prost(uint64, tag = "1")]
    pub settled: u64,
    #[prost(bool, tag = "2")]
    pub already_settled: bool,
    #[prost(message, repeated, tag = "3")]
    pub statuses: Vec<BudgetStatus>,
}

const RESERVE: &str = "/ratekeeper.v1.BudgetService/Reserve";
const SETTLE: &str = "/ratekeeper.v1.BudgetService/Settle";

/// `BudgetService` over one HTTP/2 channel (cheap to clone).
#[derive(Clone)]
pub struct BudgetClient {
    grpc: Grpc<Channel>,
}

impl BudgetClient {
    pub fn new(channel: Channel) -> Self {
        BudgetClient {
            grpc: Grpc::new(channel),
        }
    }

    /// Reserves, the call's `grpc-timeout` being `timeout`.
    pub async fn reserve(
        &mut self,
        request: ReserveRequest,
        timeout: std::time::Duration,
    ) -> Result<ReserveResponse, Status> {
        unary(&mut self.grpc, RESERVE, request, Some(timeout)).await
    }

    /// Settles, the call's `grpc-timeout` being `timeout`.
    pub async fn settle(
        &mut self,
        reservation_id: String,
        actual: u64,
        timeout: std::time::Duration,
    ) -> Result<SettleResponse, Status> {
        let request = SettleRequest {
            reservation_id,
            actual,
        };
        unary(&mut self.grpc, SETTLE, request, Some(timeout)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1_wire::Entry;

    /// The hand-written messages put each field under the proto's tag.
    #[test]
    fn fields_travel_under_the_protos_tags() {
        // granted (1) = true, reservation_id (2) = "r", statuses (3) =
        // [{remaining (1) = 5, limit (2) = 9, over (3) = false}]
        let bytes = [
            0x08, 0x01, 0x12, 0x01, b'r', 0x1a, 0x04, 0x08, 0x05, 0x10, 0x09,
        ];
        let decoded: ReserveResponse = prost::Message::decode(&bytes[..]).unwrap();
        assert!(decoded.granted);
        assert_eq!(decoded.reservation_id, "r");
        assert_eq!(
            (decoded.statuses[0].remaining, decoded.statuses[0].limit),
            (5, 9)
        );

        let request = ReserveRequest {
            domain: "d".to_owned(),
            descriptors: vec![Descriptor {
                entries: vec![Entry {
                    key: "k".to_owned(),
                    value: "v".to_owned(),
                }],
            }],
            estimate: 7,
            ttl: None,
        };
        let encoded = prost::Message::encode_to_vec(&request);
        let descriptor = [0x12, 0x08, 0x0a, 0x06, 0x0a, 0x01, b'k', 0x12, 0x01, b'v'];
        assert_eq!(encoded[..3], [0x0a, 0x01, b'd']);
        assert_eq!(encoded[3..13], descriptor);
        assert_eq!(encoded[13..], [0x18, 0x07]);
        let settle = SettleRequest {
            reservation_id: "ab".to_owned(),
            actual: 3,
        };
        let encoded = prost::Message::encode_to_vec(&settle);
        assert_eq!(encoded, [0x0a, 0x02, b'a', b'b', 0x10, 0x03]);
    }
}
