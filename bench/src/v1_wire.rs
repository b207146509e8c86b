//! What the hand-written clients of ratekeeper's own API (`proto/ratekeeper/v1`)
//! share: the `Descriptor` message (concurrency.proto's, which budget.proto
//! imports) and a unary call with prost messages. The messages are written
//! out by hand (the fields the proto gives them, same tags) rather than
//! generated in a build script: a dozen small messages do not justify
//! `protoc` in the generator's build.

use http::uri::PathAndQuery;
use tonic::client::Grpc;
use tonic::transport::Channel;
use tonic::Status;

/// One `key`/`value` pair of a descriptor.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Entry {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// Matched against the domain's rules.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Descriptor {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
}

/// Calls the unary method `path` (`/package.Service/Method`) with `request`.
pub async fn unary<Req, Resp>(
    grpc: &mut Grpc<Channel>,
    path: &'static str,
    request: Req,
    timeout: Option<std::time::Duration>,
) -> Result<Resp, Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
    let mut request = tonic::Request::new(request);
    if let Some(timeout) = timeout {
        // Sent as `grpc-timeout`, as Envoy sends its filter's timeout.
        request.set_timeout(timeout);
    }
    let response = grpc
        .unary(request, PathAndQuery::from_static(path), codec)
        .await?;
    Ok(response.into_inner())
}
