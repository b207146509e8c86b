//! The rewrite's tests: RFC 7541's examples, rewrites checked with a
//! reference decoder, every split of the input, and what makes it give up.

use std::collections::VecDeque;

use super::hpack::*;
use super::huffman::{CODE, LENGTHS};
use super::rewriter::*;
use super::*;

const ISTIO: &[u8] = b"outbound|8081||ratelimit.default.svc.cluster.local";
const ISTIO_FIXED: &[u8] = b"outbound-8081--ratelimit.default.svc.cluster.local";
const CONTOUR: &[u8] = b"extension/projectcontour/ratelimit";
const CONTOUR_FIXED: &[u8] = b"extension-projectcontour-ratelimit";
const DATA: u8 = 0x0;

// ---- building input ----

fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    digits
        .chunks(2)
        .map(|d| u8::from_str_radix(std::str::from_utf8(d).unwrap(), 16).unwrap())
        .collect()
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    write_head(&mut f, payload.len(), kind, flags, stream);
    f.extend_from_slice(payload);
    f
}

fn headers(stream: u32, block: &[u8]) -> Vec<u8> {
    frame(HEADERS, END_HEADERS, stream, block)
}

/// The preface, the client's SETTINGS, then `frames`.
fn conn(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut c = PREFACE.to_vec();
    c.extend(frame(0x4, 0, 0, &[0, 2, 0, 0, 0, 0]));
    frames.iter().for_each(|f| c.extend_from_slice(f));
    c
}

fn huffman_encode(s: &[u8]) -> Vec<u8> {
    let (mut out, mut acc, mut bits) = (Vec::new(), 0u64, 0u32);
    for &b in s {
        acc = (acc << LENGTHS[b as usize]) | u64::from(CODE.codes[b as usize]);
        bits += u32::from(LENGTHS[b as usize]);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
    }
    out
}

fn string(s: &[u8], huffman: bool) -> Vec<u8> {
    let mut out = Vec::new();
    if huffman {
        let enc = huffman_encode(s);
        write_int(&mut out, 0x80, 7, enc.len());
        out.extend(enc);
    } else {
        write_int(&mut out, 0, 7, s.len());
        out.extend_from_slice(s);
    }
    out
}

/// A literal field: `kind` 0x40 (incremental indexing), 0x00 (without
/// indexing) or 0x10 (never indexed); `index` 0 for a literal name.
fn literal(kind: u8, index: usize, name: &[u8], value: &[u8], huffman: bool) -> Vec<u8> {
    let mut out = Vec::new();
    write_int(&mut out, kind, if kind == 0x40 { 6 } else { 4 }, index);
    if index == 0 {
        out.extend(string(name, huffman));
    }
    out.extend(string(value, huffman));
    out
}

// ---- running ----

struct Run {
    out: Vec<u8>,
    passthrough: bool,
    table: usize,
}

fn run(input: &[u8], chunk: usize) -> Run {
    let mut r = Rewriter::new();
    let mut out = Vec::new();
    for piece in input.chunks(chunk) {
        r.feed(piece, &mut out);
    }
    let (passthrough, table) = (r.is_passthrough(), r.table_size());
    r.finish(&mut out);
    Run {
        out,
        passthrough,
        table,
    }
}

/// Runs `input` whole and split at every byte (and in other chunk
/// sizes); all must give the same output.
fn transform(input: &[u8]) -> Run {
    let whole = run(input, input.len().max(1));
    for chunk in [1, 2, 7, 9, 100, 4096] {
        let split = run(input, chunk);
        assert!(
            split.out == whole.out,
            "output differs fed in chunks of {chunk}"
        );
        assert_eq!(split.passthrough, whole.passthrough);
        assert_eq!(split.table, whole.table);
    }
    whole
}

// ---- reading output ----

#[derive(Debug)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

fn parse_frames(bytes: &[u8]) -> Vec<Frame> {
    assert_eq!(&bytes[..24], PREFACE);
    let (mut rest, mut frames) = (&bytes[24..], Vec::new());
    while !rest.is_empty() {
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
        let payload = rest[HEAD_LEN..HEAD_LEN + len].to_vec();
        frames.push(Frame {
            kind: rest[3],
            flags: rest[4],
            stream,
            payload,
        });
        rest = &rest[HEAD_LEN + len..];
    }
    frames
}

/// The header blocks in `frames`, with their HEADERS frame's flags;
/// checks CONTINUATIONs follow on the same stream and END_HEADERS ends
/// each block.
fn parse_blocks(frames: &[Frame]) -> Vec<(u8, Vec<u8>)> {
    let (mut blocks, mut open) = (Vec::new(), false);
    for f in frames {
        match f.kind {
            HEADERS => {
                assert!(!open, "HEADERS inside a block");
                let (range, _) = headers_fragment(f.flags, f.stream, &f.payload).unwrap();
                blocks.push((f.flags, f.payload[range].to_vec()));
            }
            CONTINUATION => {
                assert!(open, "CONTINUATION outside a block");
                blocks.last_mut().unwrap().1.extend_from_slice(&f.payload);
            }
            _ => assert!(!open, "frame inside a block"),
        }
        if f.kind == HEADERS || f.kind == CONTINUATION {
            open = f.flags & END_HEADERS == 0;
        }
    }
    assert!(!open);
    blocks
}

/// A complete HPACK decoder, to check what h2 would read.
struct RefDecoder {
    table: VecDeque<(Vec<u8>, Vec<u8>)>,
    size: usize,
    max: usize,
}

type Fields = Vec<(String, String)>;

fn static_entry(index: usize) -> (Vec<u8>, Vec<u8>) {
    let value = match index {
        2 => "GET",
        3 => "POST",
        4 => "/",
        5 => "/index.html",
        6 => "http",
        7 => "https",
        8 => "200",
        9 => "204",
        10 => "206",
        11 => "304",
        12 => "400",
        13 => "404",
        14 => "500",
        16 => "gzip, deflate",
        _ => "",
    };
    (STATIC_NAMES[index - 1].into(), value.into())
}

impl RefDecoder {
    fn new() -> Self {
        RefDecoder {
            table: VecDeque::new(),
            size: 0,
            max: 4096,
        }
    }

    fn get(&self, index: usize) -> (Vec<u8>, Vec<u8>) {
        match index {
            1..=61 => static_entry(index),
            _ => self.table[index - 62].clone(),
        }
    }

    fn string(r: &mut Reader<'_>) -> Vec<u8> {
        let s = r.string().unwrap();
        if !s.huffman {
            return s.bytes.to_vec();
        }
        let mut out = Vec::new();
        huffman::decode(s.bytes, |b| out.push(b)).unwrap();
        out
    }

    fn evict(&mut self) {
        while self.size > self.max {
            let (n, v) = self.table.pop_back().unwrap();
            self.size -= n.len() + v.len() + 32;
        }
    }

    fn decode(&mut self, block: &[u8]) -> Fields {
        let (mut r, mut fields) = (Reader { buf: block, pos: 0 }, Vec::new());
        while r.pos < block.len() {
            let first = r.peek().unwrap();
            let (name, value) = if first & 0x80 != 0 {
                self.get(r.int(7).unwrap())
            } else if first & 0xe0 == 0x20 {
                self.max = r.int(5).unwrap();
                self.evict();
                continue;
            } else {
                let indexing = first & 0x40 != 0;
                let name = match r.int(if indexing { 6 } else { 4 }).unwrap() {
                    0 => Self::string(&mut r),
                    index => self.get(index).0,
                };
                let value = Self::string(&mut r);
                if indexing {
                    self.size += name.len() + value.len() + 32;
                    self.table.push_front((name.clone(), value.clone()));
                    self.evict();
                }
                (name, value)
            };
            let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
            fields.push((text(name), text(value)));
        }
        fields
    }
}

fn fields(list: &[(&str, &str)]) -> Fields {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

// ---- primitives ----

#[test]
fn huffman_code_is_rfc_7541s() {
    assert_eq!(
        (CODE.codes[b'0' as usize], LENGTHS[b'0' as usize]),
        (0x0, 5)
    );
    assert_eq!(
        (CODE.codes[b'a' as usize], LENGTHS[b'a' as usize]),
        (0x3, 5)
    );
    assert_eq!(
        (CODE.codes[b'A' as usize], LENGTHS[b'A' as usize]),
        (0x21, 6)
    );
    assert_eq!(
        (CODE.codes[b'|' as usize], LENGTHS[b'|' as usize]),
        (0x7fc, 11)
    );
    assert_eq!((CODE.codes[0], LENGTHS[0]), (0x1ff8, 13));
    assert_eq!((CODE.codes[255], LENGTHS[255]), (0x3ffffee, 26));
    assert_eq!((CODE.codes[256], LENGTHS[256]), (0x3fff_ffff, 30));
    assert_eq!(CODE.limit[30], 1 << 32, "the code is complete");
    // RFC 7541 Appendix C.4 and C.6 strings.
    for (plain, coded) in [
        ("www.example.com", "f1e3c2e5f23a6ba0ab90f4ff"),
        ("no-cache", "a8eb10649cbf"),
        ("custom-key", "25a849e95ba97d7f"),
        ("custom-value", "25a849e95bb8e8b4bf"),
        ("302", "6402"),
        ("private", "aec3771a4b"),
        ("gzip", "9bd9ab"),
    ] {
        assert_eq!(huffman_encode(plain.as_bytes()), hex(coded), "{plain}");
        let mut out = Vec::new();
        huffman::decode(&hex(coded), |b| out.push(b)).unwrap();
        assert_eq!(out, plain.as_bytes());
    }
    assert_eq!(huffman_encode(b":authority"), HUFFMAN_AUTHORITY);
}

#[test]
fn huffman_round_trips_every_byte() {
    let all: Vec<u8> = (0..=255).collect();
    for s in [&all[..], b"", b"a", b"\xff\xfe\x00", ISTIO] {
        let mut out = Vec::new();
        huffman::decode(&huffman_encode(s), |b| out.push(b)).unwrap();
        assert_eq!(out, s);
    }
    for b in 0..=255u8 {
        let mut out = Vec::new();
        huffman::decode(&huffman_encode(&[b, b, b]), |b| out.push(b)).unwrap();
        assert_eq!(out, [b, b, b]);
    }
}

#[test]
fn huffman_rejects_eos_and_bad_padding() {
    let decode = |s: &[u8]| {
        let mut out = Vec::new();
        huffman::decode(s, |b| out.push(b)).map(|()| out)
    };
    assert_eq!(decode(&[0x1f]), Ok(b"a".to_vec()), "'a' and three ones");
    assert_eq!(decode(&[]), Ok(vec![]));
    assert_eq!(decode(&[0x18]), Err(Malformed), "padding of zeros");
    assert_eq!(decode(&[0x1f, 0xff]), Err(Malformed), "11 bits of padding");
    assert_eq!(decode(&[0xff]), Err(Malformed), "8 bits of padding");
    assert_eq!(decode(&[0xff, 0xff, 0xff, 0xff]), Err(Malformed), "EOS");
    assert_eq!(
        decode(&[0x07, 0xff, 0xff, 0xff, 0xff]),
        Err(Malformed),
        "EOS after '0'"
    );
}

#[test]
fn integers_as_rfc_7541_c1_with_h2s_limit() {
    let read = |bytes: &[u8], prefix| Reader { buf: bytes, pos: 0 }.int(prefix);
    assert_eq!(read(&[0x0a], 5), Ok(10));
    assert_eq!(read(&[0x1f, 0x9a, 0x0a], 5), Ok(1337));
    assert_eq!(read(&[0xea, 0x9a, 0x0a], 5), Ok(10), "flag bits ignored");
    assert_eq!(
        read(&[0x1f, 0xff, 0xff, 0xff, 0x7f], 5),
        Ok(31 + (1 << 28) - 1)
    );
    assert_eq!(
        read(&[0x1f, 0xff, 0xff, 0xff, 0xff, 0x00], 5),
        Err(Malformed)
    );
    assert_eq!(read(&[0x1f, 0x80], 5), Err(Malformed), "truncated");
    for prefix in 4..=7 {
        for value in [
            0,
            1,
            14,
            15,
            16,
            62,
            63,
            64,
            126,
            127,
            128,
            300,
            16_383,
            1 << 20,
        ] {
            let mut buf = Vec::new();
            write_int(&mut buf, 0, prefix, value);
            assert_eq!(read(&buf, prefix), Ok(value));
        }
    }
    let mut buf = Vec::new();
    write_int(&mut buf, 0xe0, 5, 1337);
    assert_eq!(buf, [0xff, 0x9a, 0x0a]);
}

/// An owned copy, as h2 hands `from_maybe_shared` its own buffer.
fn bytes_of(v: &[u8]) -> Vec<u8> {
    v.into()
}

#[test]
fn fast_authority_check_agrees_with_http() {
    let values: [&[u8]; 20] = [
        b"a",
        b"a:1",
        b"a.b-c:65536",
        b"a:",
        b":1",
        b"-",
        b".",
        b"a::1",
        b"a|b",
        b"",
        b"[::1]:80",
        b"u@h",
        b"a b",
        b"a/b",
        b"a%20",
        b"a:1:2",
        b"1.2.3.4:5",
        b"A-Z",
        b"\xc3\xa9",
        b"a:b",
    ];
    for v in values {
        let http = http::uri::Authority::from_maybe_shared(bytes_of(v)).is_ok();
        assert_eq!(
            is_valid_authority(v),
            http,
            "{:?}",
            String::from_utf8_lossy(v)
        );
    }
}

// ---- RFC 7541 Appendix C: nothing to rewrite, table in step ----

fn check_unchanged(blocks: &[Vec<u8>], sizes: &[usize], expected: &[Fields]) {
    let frames: Vec<Vec<u8>> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| headers(2 * i as u32 + 1, b))
        .collect();
    let input = conn(&frames);
    let whole = transform(&input);
    assert!(whole.out == input);
    assert!(!whole.passthrough);
    // The table's size after each block, as the RFC gives it.
    let (mut r, mut out) = (Rewriter::new(), Vec::new());
    r.feed(&conn(&[]), &mut out);
    let mut reference = RefDecoder::new();
    for ((f, size), (block, fields)) in frames.iter().zip(sizes).zip(blocks.iter().zip(expected)) {
        r.feed(f, &mut out);
        assert_eq!(r.table_size(), *size);
        assert_eq!(&reference.decode(block), fields);
    }
    assert!(out == input);
}

fn c3_c4_fields() -> [Fields; 3] {
    let base = [(":method", "GET"), (":scheme", "http"), (":path", "/")];
    let authority = (":authority", "www.example.com");
    [
        fields(&[base[0], base[1], base[2], authority]),
        fields(&[
            base[0],
            base[1],
            base[2],
            authority,
            ("cache-control", "no-cache"),
        ]),
        fields(&[
            base[0],
            (":scheme", "https"),
            (":path", "/index.html"),
            authority,
            ("custom-key", "custom-value"),
        ]),
    ]
}

#[test]
fn rfc_c3_requests_pass_unchanged() {
    let blocks = [
        hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d"),
        hex("8286 84be 5808 6e6f 2d63 6163 6865"),
        hex("8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65"),
    ];
    check_unchanged(&blocks, &[57, 110, 164], &c3_c4_fields());
}

#[test]
fn rfc_c4_requests_pass_unchanged() {
    let blocks = [
        hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff"),
        hex("8286 84be 5886 a8eb 1064 9cbf"),
        hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
    ];
    check_unchanged(&blocks, &[57, 110, 164], &c3_c4_fields());
}

#[test]
fn rfc_c5_eviction_after_a_size_update() {
    // C.5's responses, the table sized to 256 by an update up front.
    let mut first = vec![0x3f, 0xe1, 0x01];
    first.extend(hex(
        "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133
         2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70
         6c65 2e63 6f6d",
    ));
    let blocks = [
        first,
        hex("4803 3330 37c1 c0bf"),
        hex(
            "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d
             54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049
             5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e
             3d31",
        ),
    ];
    let (date, location) = (
        ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
        ("location", "https://www.example.com"),
    );
    let expected = [
        fields(&[
            (":status", "302"),
            ("cache-control", "private"),
            date,
            location,
        ]),
        fields(&[
            (":status", "307"),
            ("cache-control", "private"),
            date,
            location,
        ]),
        fields(&[
            (":status", "200"),
            ("cache-control", "private"),
            ("date", "Mon, 21 Oct 2013 20:13:22 GMT"),
            location,
            ("content-encoding", "gzip"),
            (
                "set-cookie",
                "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1",
            ),
        ]),
    ];
    check_unchanged(&blocks, &[222, 222, 215], &expected);
}

// ---- rewriting ----

/// A gRPC request's block with `authority` as a literal of `kind`.
fn request(kind: u8, authority: &[u8], huffman: bool) -> Vec<u8> {
    let mut b = vec![0x83, 0x86]; // :method POST, :scheme http
    b.extend(literal(
        0x40,
        4,
        b"",
        b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        huffman,
    ));
    b.extend(literal(kind, 1, b"", authority, huffman));
    b.extend(literal(
        0x40,
        0,
        b"content-type",
        b"application/grpc",
        huffman,
    ));
    b.extend(literal(0x00, 0, b"te", b"trailers", huffman));
    b
}

fn request_fields(authority: &[u8]) -> Fields {
    let path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let authority = std::str::from_utf8(authority).unwrap();
    fields(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ])
}

/// Decodes every block of `bytes` (a connection) in order.
fn decode_all(bytes: &[u8]) -> (Vec<(u8, Fields)>, usize) {
    let mut reference = RefDecoder::new();
    let blocks = parse_blocks(&parse_frames(bytes));
    let decoded = blocks
        .into_iter()
        .map(|(flags, b)| (flags, reference.decode(&b)))
        .collect();
    (decoded, reference.size)
}

#[test]
fn istio_authority_rewritten_and_indexed_references_follow() {
    for huffman in [false, true] {
        let first = request(0x40, ISTIO, huffman);
        // The same request again, from the table: :path is 64,
        // :authority 63, content-type 62.
        let mut second = vec![0x83, 0x86, 0xc0, 0xbf, 0xbe];
        second.extend(literal(0x00, 0, b"te", b"trailers", huffman));
        let grpc_message = frame(DATA, END_STREAM, 1, &[0, 0, 0, 0, 3, 1, 2, 3]);
        let input = conn(&[
            frame(HEADERS, END_HEADERS, 1, &first),
            grpc_message.clone(),
            frame(HEADERS, END_HEADERS | END_STREAM, 3, &second),
        ]);
        let got = transform(&input);
        assert!(!got.passthrough);

        let (sent, sent_table) = decode_all(&input);
        let (read, read_table) = decode_all(&got.out);
        assert_eq!(sent[0].1, request_fields(ISTIO));
        assert_eq!(sent[1].1, request_fields(ISTIO));
        assert_eq!(read[0], (END_HEADERS, request_fields(ISTIO_FIXED)));
        assert_eq!(
            read[1],
            (END_HEADERS | END_STREAM, request_fields(ISTIO_FIXED))
        );
        assert_eq!((read_table, got.table), (sent_table, sent_table));

        let frames = parse_frames(&got.out);
        assert_eq!(frames.len(), 4);
        let mut fixed_field = vec![0x41, ISTIO_FIXED.len() as u8];
        fixed_field.extend_from_slice(ISTIO_FIXED);
        let field_at = frames[1]
            .payload
            .windows(fixed_field.len())
            .position(|w| w == fixed_field);
        assert!(
            field_at.is_some(),
            "a raw literal with incremental indexing, name index 1"
        );
        assert_eq!((frames[1].kind, frames[1].stream), (HEADERS, 1));
        assert_eq!(frames[2].payload, grpc_message[HEAD_LEN..]);
        // The second block had nothing to rewrite: its frame as sent.
        let tail = frame(HEADERS, END_HEADERS | END_STREAM, 3, &second);
        assert!(got.out.ends_with(&tail));
    }
}

#[test]
fn representations_kept_when_rewritten() {
    // (block, the rewritten block)
    let fixed = |repr: u8| {
        let mut b = vec![repr, CONTOUR_FIXED.len() as u8];
        b.extend_from_slice(CONTOUR_FIXED);
        b
    };
    let cases = [
        (literal(0x00, 1, b"", CONTOUR, false), fixed(0x01)),
        (literal(0x10, 1, b"", CONTOUR, true), fixed(0x11)),
        (literal(0x10, 0, b":authority", CONTOUR, false), fixed(0x11)),
        (literal(0x00, 0, b":authority", CONTOUR, true), fixed(0x01)),
        (literal(0x40, 0, b":authority", CONTOUR, true), fixed(0x41)),
    ];
    for (block, want) in cases {
        let got = transform(&conn(&[headers(1, &block)]));
        let frames = parse_frames(&got.out);
        assert_eq!(frames[1].payload, want);
        assert_eq!(frames[1].flags, END_HEADERS);
        let indexed = block[0] & 0x40 != 0;
        assert_eq!(got.table, if indexed { 10 + CONTOUR.len() + 32 } else { 0 });
    }
}

#[test]
fn name_from_a_dynamic_authority_entry_is_recognised() {
    let first = literal(0x40, 1, b"", b"ok.example", false);
    let mut second = literal(0x40, 0, b"x-other", b"v", true);
    // Name index 63: the `:authority` entry, now second newest.
    second.extend(literal(0x00, 63, b"", ISTIO, true));
    second.extend(literal(0x00, 62, b"", ISTIO, false));
    let input = conn(&[headers(1, &first), headers(3, &second)]);
    let got = transform(&input);
    let (read, _) = decode_all(&got.out);
    let istio = std::str::from_utf8(ISTIO).unwrap();
    let fixed = std::str::from_utf8(ISTIO_FIXED).unwrap();
    assert_eq!(read[0].1, fields(&[(":authority", "ok.example")]));
    assert_eq!(
        read[1].1,
        fields(&[("x-other", "v"), (":authority", fixed), ("x-other", istio)])
    );
}

#[test]
fn valid_and_empty_authorities_left_alone() {
    for authority in [
        &b"ratelimit:8081"[..],
        b"[::1]:8081",
        b"u@www.example.com",
        b"",
    ] {
        for huffman in [false, true] {
            let input = conn(&[headers(1, &request(0x40, authority, huffman))]);
            let got = transform(&input);
            assert!(got.out == input);
            assert!(!got.passthrough);
        }
    }
}

#[test]
fn padded_priority_headers_rewritten_without_padding() {
    let block = request(0x00, CONTOUR, false);
    let priority = [0x80, 0, 0, 0, 15];
    let mut payload = vec![3];
    payload.extend(priority);
    payload.extend(&block);
    payload.extend([0, 0, 0]);
    let flags = PADDED | PRIORITY | END_STREAM | END_HEADERS;
    let got = transform(&conn(&[frame(HEADERS, flags, 1, &payload)]));
    let frames = parse_frames(&got.out);
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[1].flags, PRIORITY | END_STREAM | END_HEADERS);
    assert_eq!(frames[1].payload[..5], priority);
    let mut reference = RefDecoder::new();
    assert_eq!(
        reference.decode(&frames[1].payload[5..]),
        request_fields(CONTOUR_FIXED)
    );

    // Nothing to rewrite: the frame as it came, padding and all.
    let mut payload = vec![3];
    payload.extend(priority);
    payload.extend(request(0x00, b"ratelimit", true));
    payload.extend([0, 0, 0]);
    let input = conn(&[frame(HEADERS, flags, 1, &payload)]);
    assert!(transform(&input).out == input);
}

#[test]
fn block_across_continuations() {
    for (authority, rewritten) in [(ISTIO, true), (&b"ratelimit.svc"[..], false)] {
        let block = request(0x40, authority, true);
        let (a, rest) = block.split_at(20);
        let (b, c) = rest.split_at(rest.len() / 2);
        let input = conn(&[
            frame(HEADERS, END_STREAM, 5, a),
            frame(CONTINUATION, 0, 5, b),
            frame(CONTINUATION, END_HEADERS, 5, c),
            frame(DATA, END_STREAM, 5, b"x"),
        ]);
        let got = transform(&input);
        if !rewritten {
            assert!(got.out == input);
            continue;
        }
        let frames = parse_frames(&got.out);
        let kinds: Vec<_> = frames.iter().map(|f| (f.kind, f.flags, f.stream)).collect();
        assert_eq!(
            kinds,
            [
                (0x4, 0, 0),
                (HEADERS, END_STREAM | END_HEADERS, 5),
                (DATA, END_STREAM, 5)
            ]
        );
        let (read, _) = decode_all(&got.out);
        assert_eq!(read[0].1, request_fields(ISTIO_FIXED));
    }
}

#[test]
fn large_rewritten_block_split_into_continuations() {
    let mut block = request(0x40, ISTIO, true);
    let big = vec![b'v'; 9000];
    for i in 0..5 {
        block.extend(literal(
            0x00,
            0,
            format!("x-big-{i}").as_bytes(),
            &big,
            false,
        ));
    }
    // Sent as PRIORITY HEADERS and CONTINUATIONs of at most 16,384.
    let priority = [0, 0, 0, 3, 200];
    let mut payload = priority.to_vec();
    payload.extend(&block[..10_000]);
    let mut frames = vec![frame(HEADERS, PRIORITY, 7, &payload)];
    let chunks: Vec<&[u8]> = block[10_000..].chunks(MAX_PAYLOAD).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let flags = if i + 1 == chunks.len() {
            END_HEADERS
        } else {
            0
        };
        frames.push(frame(CONTINUATION, flags, 7, chunk));
    }
    let got = transform(&conn(&frames));

    let out = parse_frames(&got.out);
    let sizes: Vec<_> = out[1..]
        .iter()
        .map(|f| (f.kind, f.flags, f.payload.len()))
        .collect();
    // The Huffman-coded authority goes out raw.
    let coded = literal(0x40, 1, b"", ISTIO, true).len();
    let raw = literal(0x40, 1, b"", ISTIO_FIXED, false).len();
    let total = 5 + block.len() - coded + raw;
    assert_eq!(
        sizes,
        [
            (HEADERS, PRIORITY, MAX_PAYLOAD),
            (CONTINUATION, 0, MAX_PAYLOAD),
            (CONTINUATION, END_HEADERS, total - 2 * MAX_PAYLOAD),
        ]
    );
    assert!(out[1..].iter().all(|f| f.stream == 7));
    assert_eq!(out[1].payload[..5], priority);
    let (read, _) = decode_all(&got.out);
    let mut want = request_fields(ISTIO_FIXED);
    let big = String::from_utf8(big).unwrap();
    want.extend((0..5).map(|i| (format!("x-big-{i}"), big.clone())));
    assert_eq!(read[0].1, want);
}

// ---- giving up ----

#[test]
fn not_http2_passes_through() {
    for input in [
        &b"GET / HTTP/1.1\r\nHost: a|b\r\n\r\n"[..],
        b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n\x00\x00\x05\x01\x04\x00\x00\x00\x01\x41\x03a|b",
        b"PRI * HT",
        b"\x16\x03\x01\x02\x00",
    ] {
        let got = transform(input);
        assert!(got.out == input);
    }
    assert!(transform(b"GET / HTTP/1.1\r\n").passthrough);
}

#[test]
fn bad_hpack_passes_through_for_good() {
    let bad_blocks: [&[u8]; 9] = [
        &[0x80],                                     // index 0
        &[0xbe],                                     // index 62 of an empty table
        &[0x82, 0x20],                               // size update after a field
        &[0x3f, 0xe2, 0x1f],                         // size update past 4,096
        &[0x41, 0x84, 0xff, 0xff, 0xff, 0xff],       // EOS in an :authority
        &[0x41, 0x81, 0x18],                         // zero padding in an :authority
        &[0x40, 0x81, 0xff, 0x01, 0x61],             // bad Huffman name, indexed
        &[0x41, 0x0a, b'a'],                         // string past the block
        &[0x41, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01], // integer overflow
    ];
    for bad in bad_blocks {
        let input = conn(&[headers(1, bad), headers(3, &request(0x40, ISTIO, false))]);
        let got = transform(&input);
        assert!(got.out == input, "{bad:02x?}");
        assert!(got.passthrough, "{bad:02x?}");
    }
}

#[test]
fn frames_h2_refuses_pass_through_for_good() {
    let ok = request(0x40, ISTIO, false);
    let mut self_dependent = vec![0, 0, 0, 1, 16];
    self_dependent.extend(&ok);
    let cases = [
        vec![frame(CONTINUATION, END_HEADERS, 1, &ok)],
        vec![frame(HEADERS, 0, 1, &ok[..4]), frame(DATA, 0, 1, b"x")],
        vec![
            frame(HEADERS, 0, 1, &ok[..4]),
            frame(CONTINUATION, END_HEADERS, 3, &ok[4..]),
        ],
        vec![
            frame(HEADERS, 0, 1, &ok[..4]),
            frame(HEADERS, END_HEADERS, 1, &ok[4..]),
        ],
        vec![frame(PUSH_PROMISE, END_HEADERS, 1, &ok)],
        vec![frame(DATA, 0, 1, &[0; MAX_PAYLOAD + 1])],
        vec![frame(HEADERS, PRIORITY | END_HEADERS, 1, &self_dependent)],
        vec![frame(HEADERS, PADDED | END_HEADERS, 1, &[200, 0x82])],
        vec![frame(HEADERS, PADDED | END_HEADERS, 1, &[])],
        vec![frame(HEADERS, PRIORITY | END_HEADERS, 1, &[0, 0, 0])],
    ];
    for mut frames in cases {
        frames.push(headers(9, &ok));
        let input = conn(&frames);
        let got = transform(&input);
        assert!(got.out == input);
        assert!(got.passthrough);
    }
}

#[test]
fn block_past_the_cap_passes_through() {
    let mut frames = vec![frame(HEADERS, 0, 1, &request(0x40, ISTIO, false))];
    let filler = literal(0x00, 0, b"x-filler", &vec![b'f'; MAX_PAYLOAD - 13], false);
    assert_eq!(filler.len(), MAX_PAYLOAD);
    frames.extend((0..64).map(|_| frame(CONTINUATION, 0, 1, &filler)));
    frames.push(frame(CONTINUATION, END_HEADERS, 1, &[]));
    let input = conn(&frames);
    let got = transform(&input);
    assert!(got.out == input);
    assert!(got.passthrough);
}

/// The cap counts frames, so empty CONTINUATIONs (9 bytes each) cannot
/// make a connection hold much: the block's sixth frame is the last held.
#[test]
fn a_block_of_more_frames_than_h2_takes_passes_through() {
    let block = |continuations: usize| {
        let mut frames = vec![frame(HEADERS, 0, 1, &request(0x40, ISTIO, false))];
        frames.extend((1..continuations).map(|_| frame(CONTINUATION, 0, 1, &[])));
        frames.push(frame(CONTINUATION, END_HEADERS, 1, &[]));
        conn(&frames)
    };
    let held = transform(&block(MAX_BLOCK_FRAMES - 1));
    assert!(!held.passthrough, "six frames are rewritten");
    let input = block(MAX_BLOCK_FRAMES);
    let got = transform(&input);
    assert!(got.out == input && got.passthrough);
}

#[test]
fn data_passes_as_it_arrives_and_eof_releases_held_bytes() {
    let data = frame(DATA, 0, 1, &[7; 1000]);
    let mut input = conn(&[data]);
    let mut r = Rewriter::new();
    let mut out = Vec::new();
    let fed = input.len() - 500;
    r.feed(&input[..fed], &mut out);
    assert!(out == input[..fed], "half a DATA frame is passed on");

    // A header block cut short, then EOF.
    let block = request(0x40, ISTIO, false);
    input.extend(frame(HEADERS, 0, 1, &block));
    input.extend(&frame(CONTINUATION, END_HEADERS, 1, b"")[..5]);
    let got = transform(&input);
    assert!(got.out == input);
    r.feed(&input[fed..], &mut out);
    assert!(out.len() < input.len(), "the block is held back");
    r.finish(&mut out);
    assert!(out == input);
    assert!(r.is_passthrough());
}

// ---- the connection ----

#[tokio::test]
async fn reads_through_a_connection_in_small_pieces() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut second = vec![0x83, 0x86, 0xc0, 0xbf, 0xbe];
    second.extend(literal(0x00, 0, b"te", b"trailers", true));
    let input = conn(&[
        headers(1, &request(0x40, ISTIO, true)),
        frame(DATA, END_STREAM, 1, &[0; MAX_PAYLOAD]),
        headers(3, &second),
    ]);
    let want = transform(&input).out;
    assert!(want != input);

    let (client, server) = tokio::io::duplex(64);
    let mut server = AuthorityFixed::new(server);
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let sending = input.clone();
    let writer = tokio::spawn(async move {
        for piece in sending.chunks(13) {
            client_write.write_all(piece).await.unwrap();
        }
        client_write.shutdown().await.unwrap();
    });
    let mut got = Vec::new();
    let mut buf = [0; 5];
    loop {
        let n = server.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    writer.await.unwrap();
    assert!(got == want);

    // Server to client: untouched.
    server
        .write_all(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")
        .await
        .unwrap();
    server.flush().await.unwrap();
    let mut ack = [0; 9];
    client_read.read_exact(&mut ack).await.unwrap();
    assert_eq!(ack, *b"\x00\x00\x00\x04\x01\x00\x00\x00\x00");
    let _ = server.get_ref();
}
