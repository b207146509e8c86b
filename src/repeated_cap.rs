//! The caps on a request's repeated fields (`service::caps::MAX_DESCRIPTORS`,
//! `service::concurrency::MAX_LEASE_IDS`) applied to its bytes as they
//! arrive, before tonic decodes them: decoded, a 4 MiB `ShouldRateLimit` of
//! two million empty descriptors is some 240 MB of structs, a `Heartbeat`
//! of two million empty lease ids some 48 MB of strings, each refused by
//! its cap only afterwards. The calls of the services whose requests carry
//! descriptors (the rate limit, concurrency and budget services; field 2 of
//! each such message) or lease ids (field 1 of a `Heartbeat` or `Release`)
//! have their bodies wrapped by [`Counted`], which counts that field's
//! length-delimited occurrences at the top of each message and ends the
//! call with `INVALID_ARGUMENT` at the first past the cap. Inside each
//! descriptor it counts the entries too (field 1), against
//! `caps::MAX_ENTRIES` a descriptor and `caps::MAX_REQUEST_ENTRIES` in all:
//! one descriptor of two million empty entries decodes as large as two
//! million descriptors. Fields inside a group (the deprecated wire types
//! 3 and 4, which the decoder skips) count as nothing, and the scan goes
//! on after them. Other messages of those services have no such field 2
//! (a settle's is a number). A compressed or malformed message is left to
//! the decoder.

use std::pin::Pin;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use futures_util::ready;
use http_body::{Body as HttpBody, Frame};
use tonic::codegen::http::Request;
use tonic::codegen::{Bytes, Service};
use tonic::server::NamedService;
use tonic::Status;

use crate::pb::v1::budget_service_server::BudgetServiceServer;
use crate::pb::v1::concurrency_service_server::ConcurrencyServiceServer;
use crate::service::budget::Budget;
use crate::service::caps::{self, MAX_DESCRIPTORS, MAX_ENTRIES, MAX_REQUEST_ENTRIES};
use crate::service::concurrency::{self, Concurrency, MAX_LEASE_IDS};
use crate::service::rls::RateLimiter;

/// The layer for [`tonic::transport::Server::layer`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RepeatedCapLayer;

impl<S> tower_layer::Layer<S> for RepeatedCapLayer {
    type Service = RepeatedCap<S>;

    fn layer(&self, inner: S) -> RepeatedCap<S> {
        RepeatedCap { inner }
    }
}

/// The services whose requests carry descriptors, as field 2.
const WITH_DESCRIPTORS: [&str; 3] = [
    <RateLimitServiceServer<RateLimiter> as NamedService>::NAME,
    <ConcurrencyServiceServer<Concurrency> as NamedService>::NAME,
    <BudgetServiceServer<Budget> as NamedService>::NAME,
];

/// The concurrency service's methods whose requests carry lease ids, as
/// field 1.
const WITH_LEASE_IDS: [&str; 2] = ["Heartbeat", "Release"];

/// What a call's messages are counted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counting {
    Descriptors,
    LeaseIds,
}

impl Counting {
    /// What the call to `path` (`/<service>/<method>`) is counted for, if
    /// anything.
    fn of(path: &str) -> Option<Counting> {
        let (service, method) = path.get(1..)?.split_once('/')?;
        if service == <ConcurrencyServiceServer<Concurrency> as NamedService>::NAME
            && WITH_LEASE_IDS.contains(&method)
        {
            return Some(Counting::LeaseIds);
        }
        WITH_DESCRIPTORS
            .contains(&service)
            .then_some(Counting::Descriptors)
    }

    /// The counted field's number.
    fn field(self) -> u64 {
        match self {
            Counting::Descriptors => 2,
            Counting::LeaseIds => 1,
        }
    }

    /// The most occurrences a message may hold.
    fn max(self) -> usize {
        match self {
            Counting::Descriptors => MAX_DESCRIPTORS,
            Counting::LeaseIds => MAX_LEASE_IDS,
        }
    }

    /// Why a message past [`Counting::max`] is refused.
    fn past_max(self) -> String {
        match self {
            Counting::Descriptors => caps::past_max_descriptors(),
            Counting::LeaseIds => concurrency::past_max_lease_ids(),
        }
    }
}

/// Passes every call to `inner`, the bodies of those [`Counting::of`]
/// names counted. In front of the router, whose boxing of each request's
/// body then boxes the counting one: no allocation more.
#[derive(Debug, Clone)]
pub struct RepeatedCap<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for RepeatedCap<S>
where
    S: Service<Request<Counted<B>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> S::Future {
        let scan = Counting::of(request.uri().path()).map(Scan::new);
        self.inner
            .call(request.map(|body| Counted { inner: body, scan }))
    }
}

/// A request body, failing once its counted field passes its cap (when it
/// is scanned).
pub struct Counted<B> {
    inner: B,
    scan: Option<Scan>,
}

impl<B> HttpBody for Counted<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(error)) => return Poll::Ready(Some(Err(Status::from_error(error.into())))),
            None => return Poll::Ready(None),
        };
        if let (Some(scan), Some(data)) = (&mut this.scan, frame.data_ref()) {
            scan.feed(data);
            if let Some(refused) = scan.refusal() {
                return Poll::Ready(Some(Err(Status::invalid_argument(refused))));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Where the scan of a request's bytes is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    /// A gRPC frame's 5-byte header (compressed flag, big-endian length).
    Header {
        read: u8,
        compressed: bool,
        length: u64,
    },
    /// A field's tag, a varint (`value` so far, `shift` bits in).
    Tag { value: u64, shift: u32 },
    /// A varint field's value.
    Varint,
    /// A length-delimited field's length.
    Length { value: u64, shift: u32 },
    /// `n` bytes of a field's value (or a compressed message) to pass.
    Skip { n: u64 },
    /// Malformed: nothing more is counted (the decoder will say why).
    Lost,
}

impl At {
    /// Before a gRPC frame's first header byte.
    const FRAME: At = At::Header {
        read: 0,
        compressed: false,
        length: 0,
    };
}

/// What a length-delimited field about to be read is to the scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// A descriptor: its bytes are read, for its entries.
    Descriptor,
    /// Anything else: its bytes are passed.
    Other,
}

/// Counts the length-delimited occurrences of one field at the top of a
/// stream of gRPC messages, fed in pieces of any size (and, for
/// descriptors, each one's entries).
#[derive(Debug, Clone, Copy)]
struct Scan {
    counting: Counting,
    at: At,
    /// Bytes of the current message still to come.
    left: u64,
    count: usize,
    /// Groups open at this point (fields inside count as nothing).
    groups: u32,
    /// What the length-delimited field whose length is being read is.
    field: Field,
    /// Bytes of the descriptor being read still to come, inside one.
    descriptor_left: Option<u64>,
    /// Entries of that descriptor, and of the message in all.
    descriptor_entries: usize,
    entries: usize,
    /// Why the message is refused, once past an entries cap.
    refused: Option<Option<usize>>,
}

impl Scan {
    fn new(counting: Counting) -> Scan {
        Scan {
            counting,
            at: At::FRAME,
            left: 0,
            count: 0,
            groups: 0,
            field: Field::Other,
            descriptor_left: None,
            descriptor_entries: 0,
            entries: 0,
            refused: None,
        }
    }

    /// Why the message read so far is refused, if it is: past its field's
    /// cap, or past an entries cap.
    fn refusal(&self) -> Option<String> {
        if self.count > self.counting.max() {
            return Some(self.counting.past_max());
        }
        self.refused.map(caps::past_max_entries)
    }

    /// Reads `bytes`; the count of fields so far in the current message.
    fn feed(&mut self, mut bytes: &[u8]) -> usize {
        while !bytes.is_empty() && self.at != At::Lost {
            if let At::Skip { n } = self.at {
                let step = n.min(bytes.len() as u64) as usize;
                bytes = &bytes[step..];
                self.consumed(step as u64);
                self.at = match n - step as u64 {
                    0 => self.next_field(),
                    n => At::Skip { n },
                };
                continue;
            }
            let byte = bytes[0];
            bytes = &bytes[1..];
            self.at = match self.at {
                At::Header {
                    read,
                    compressed,
                    length,
                } => self.header(read, compressed, length, byte),
                At::Tag { value, shift } => match self.varint(value, shift, byte) {
                    Varint::Done(tag) => self.tag(tag),
                    Varint::More(value, shift) => At::Tag { value, shift },
                    Varint::Bad => At::Lost,
                },
                At::Varint => match self.varint(0, 0, byte) {
                    Varint::Done(_) => self.next_field(),
                    _ => At::Varint,
                },
                At::Length { value, shift } => match self.varint(value, shift, byte) {
                    Varint::Done(length) => self.length(length),
                    Varint::More(value, shift) => At::Length { value, shift },
                    Varint::Bad => At::Lost,
                },
                At::Skip { .. } | At::Lost => At::Lost,
            };
        }
        self.count
    }

    /// A header byte: after the fifth, the message (or a compressed one,
    /// passed whole).
    fn header(&mut self, read: u8, compressed: bool, length: u64, byte: u8) -> At {
        let (compressed, length) = match read {
            0 => (byte != 0, 0),
            _ => (compressed, length << 8 | u64::from(byte)),
        };
        if read < 4 {
            return At::Header {
                read: read + 1,
                compressed,
                length,
            };
        }
        self.left = length;
        self.count = 0;
        self.groups = 0;
        self.descriptor_left = None;
        self.entries = 0;
        match (compressed, length) {
            (_, 0) => self.next_field(),
            (true, n) => At::Skip { n },
            (false, _) => At::Tag { value: 0, shift: 0 },
        }
    }

    /// A byte of a varint read `shift` bits in, `value` so far.
    fn varint(&mut self, value: u64, shift: u32, byte: u8) -> Varint {
        self.consumed(1);
        if shift > 63 {
            return Varint::Bad;
        }
        let value = value | u64::from(byte & 0x7f) << shift;
        match byte & 0x80 {
            0 => Varint::Done(value),
            _ => Varint::More(value, shift + 7),
        }
    }

    /// What follows a field's tag.
    fn tag(&mut self, tag: u64) -> At {
        match tag & 7 {
            0 => At::Varint,
            1 => At::Skip { n: 8 },
            2 => {
                self.field = Field::Other;
                if self.groups == 0 {
                    self.counted(tag >> 3);
                }
                At::Length { value: 0, shift: 0 }
            }
            3 => {
                self.groups += 1;
                self.next_field()
            }
            4 if self.groups > 0 => {
                self.groups -= 1;
                self.next_field()
            }
            5 => At::Skip { n: 4 },
            _ => At::Lost,
        }
    }

    /// Counts a length-delimited field number `field` outside any group:
    /// the counted field at the top, or an entry inside a descriptor.
    fn counted(&mut self, field: u64) {
        match self.descriptor_left {
            None if field == self.counting.field() => {
                self.count += 1;
                if self.counting == Counting::Descriptors {
                    self.field = Field::Descriptor;
                }
            }
            Some(_) if field == 1 => {
                self.descriptor_entries += 1;
                self.entries += 1;
                if self.descriptor_entries > MAX_ENTRIES {
                    self.refused.get_or_insert(Some(self.count - 1));
                } else if self.entries > MAX_REQUEST_ENTRIES {
                    self.refused.get_or_insert(None);
                }
            }
            _ => {}
        }
    }

    /// What follows a length-delimited field's length: its bytes (a
    /// descriptor's read field by field).
    fn length(&mut self, length: u64) -> At {
        let room = self.descriptor_left.unwrap_or(self.left).min(self.left);
        match length {
            0 => self.next_field(),
            n if n > room => At::Lost,
            n if self.field == Field::Descriptor => {
                self.descriptor_left = Some(n);
                self.descriptor_entries = 0;
                At::Tag { value: 0, shift: 0 }
            }
            n => At::Skip { n },
        }
    }

    /// The next field's tag (a descriptor read whole: the next top-level
    /// one's), or the next message's header.
    fn next_field(&mut self) -> At {
        if self.descriptor_left == Some(0) {
            self.descriptor_left = None;
        }
        match self.left {
            0 => At::FRAME,
            _ => At::Tag { value: 0, shift: 0 },
        }
    }

    /// `n` bytes of the message (and of the descriptor being read) read.
    fn consumed(&mut self, n: u64) {
        self.left = self.left.saturating_sub(n);
        if let Some(left) = &mut self.descriptor_left {
            *left = left.saturating_sub(n);
        }
    }
}

/// A varint after one more byte.
enum Varint {
    Done(u64),
    More(u64, u32),
    Bad,
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use prost::Message;

    /// `message` as gRPC frames it.
    fn framed(message: &impl Message) -> Vec<u8> {
        frame(&message.encode_to_vec())
    }

    /// A message's bytes behind gRPC's frame header (uncompressed).
    fn frame(body: &[u8]) -> Vec<u8> {
        let mut framed = vec![0];
        framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
        framed.extend_from_slice(body);
        framed
    }

    fn request(descriptors: usize, value: &str) -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".repeat(300),
            descriptors: vec![
                RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "k".into(),
                        value: value.into(),
                    }],
                    ..Default::default()
                };
                descriptors
            ],
            hits_addend: 300,
        }
    }

    #[test]
    fn counts_the_descriptors_whatever_the_pieces() {
        for (n, value) in [
            (0, ""),
            (1, "v"),
            (3, ""),
            (1025, "v"),
            (2, &"x".repeat(70_000)[..]),
        ] {
            let bytes = framed(&request(n, value));
            for piece in [1, 2, 7, 4096, bytes.len()] {
                let mut scan = Scan::new(Counting::Descriptors);
                let mut count = 0;
                for chunk in bytes.chunks(piece) {
                    count = scan.feed(chunk);
                }
                assert_eq!(count, n, "{n} descriptors in pieces of {piece}");
                assert_eq!(
                    scan.at,
                    At::Header {
                        read: 0,
                        compressed: false,
                        length: 0
                    }
                );
            }
        }
    }

    #[test]
    fn heartbeats_and_releases_count_lease_ids_the_other_calls_descriptors() {
        let of = |path: &str| Counting::of(path);
        let concurrency = "/ratekeeper.v1.ConcurrencyService";
        for method in ["Heartbeat", "Release"] {
            assert_eq!(
                of(&format!("{concurrency}/{method}")),
                Some(Counting::LeaseIds)
            );
        }
        for path in [
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            &format!("{concurrency}/AcquireConnection"),
            &format!("{concurrency}/Hold"),
            "/ratekeeper.v1.BudgetService/Settle",
        ] {
            assert_eq!(of(path), Some(Counting::Descriptors), "{path}");
        }
        for path in ["/grpc.health.v1.Health/Check", "", "/", "nothing"] {
            assert_eq!(of(path), None, "{path:?}");
        }
        let heartbeat = crate::pb::v1::HeartbeatRequest {
            lease_ids: vec![String::new(); 3],
        };
        let bytes = framed(&heartbeat);
        assert_eq!(Scan::new(Counting::LeaseIds).feed(&bytes), 3);
        assert_eq!(Scan::new(Counting::Descriptors).feed(&bytes), 0);
    }

    /// `entries` empty entries in each of `descriptors` descriptors.
    fn wide(descriptors: usize, entries: usize) -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![
                RateLimitDescriptor {
                    entries: vec![Entry::default(); entries],
                    hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 7 }),
                    ..Default::default()
                };
                descriptors
            ],
            hits_addend: 1,
        }
    }

    /// The refusal of `bytes` fed in pieces of `piece` bytes.
    fn refusal(bytes: &[u8], piece: usize) -> Option<String> {
        let mut scan = Scan::new(Counting::Descriptors);
        for chunk in bytes.chunks(piece) {
            scan.feed(chunk);
            if let Some(refused) = scan.refusal() {
                return Some(refused);
            }
        }
        None
    }

    /// Entries are counted inside each descriptor, against the cap of one
    /// descriptor and of the request; within them a message passes.
    #[test]
    fn counts_each_descriptors_entries_and_all_of_them() {
        let in_one = format!("descriptors[2] has more than {MAX_ENTRIES} entries");
        let in_all = format!("more than {MAX_REQUEST_ENTRIES} entries in all");
        let mut one_too_many = wide(3, 1);
        one_too_many.descriptors[2] = wide(1, MAX_ENTRIES + 1).descriptors.remove(0);
        for piece in [1, 3, 4096, usize::MAX] {
            let at = |request: &RateLimitRequest| refusal(&framed(request), piece);
            assert_eq!(at(&wide(3, MAX_ENTRIES)), None, "{piece}");
            assert_eq!(at(&wide(32, MAX_REQUEST_ENTRIES / 32)), None, "{piece}");
            assert!(
                at(&one_too_many).is_some_and(|r| r.starts_with(&in_one)),
                "{piece}"
            );
            let many = wide(40, 2000);
            assert!(at(&many).is_some_and(|r| r.starts_with(&in_all)), "{piece}");
        }
    }

    /// A group (wire types 3 and 4, which the decoder skips) hides nothing:
    /// the descriptors after it are counted.
    #[test]
    fn descriptors_after_a_group_are_counted() {
        let mut body = RateLimitRequest {
            domain: "d".into(),
            ..Default::default()
        }
        .encode_to_vec();
        // Field 15 as a group: its start, a field inside, its end.
        body.extend_from_slice(&[15 << 3 | 3, 1 << 3 | 2, 0, 15 << 3 | 4]);
        for _ in 0..MAX_DESCRIPTORS + 1 {
            body.extend_from_slice(&[2 << 3 | 2, 0]);
        }
        let refused = refusal(&frame(&body), 5);
        assert_eq!(refused, Some(caps::past_max_descriptors()));
    }

    #[test]
    fn a_compressed_or_malformed_message_is_not_counted() {
        let mut compressed = framed(&request(3, ""));
        compressed[0] = 1;
        assert_eq!(Scan::new(Counting::Descriptors).feed(&compressed), 0);
        // A length past the message's end: lost, and nothing more counted.
        let mut scan = Scan::new(Counting::Descriptors);
        assert_eq!(scan.feed(&[0, 0, 0, 0, 4, 0x12, 0x7f, 0x12, 0x00]), 1);
        assert_eq!(scan.at, At::Lost);
        assert_eq!(scan.feed(&[0x12, 0x00, 0x12, 0x00]), 1);
    }
}
