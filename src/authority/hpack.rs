//! HPACK (RFC 7541) as far as the rewrite needs it: the fields of a header
//! block read one by one, the shape of the dynamic table kept in step
//! with the server's, and `:authority` values h2 would refuse rewritten.

use std::collections::VecDeque;

use super::{huffman, Malformed};

/// h2's SETTINGS_HEADER_TABLE_SIZE, the default, which this server never
/// changes: the most the client may size the table to.
pub(super) const MAX_TABLE_SIZE: usize = 4096;
/// The bytes an entry costs beyond its name and value (RFC 7541 §4.1).
pub(super) const ENTRY_OVERHEAD: usize = 32;
/// ":authority", Huffman-coded. A Huffman string has one valid encoding
/// (the padding is fixed), so comparing the encoded bytes is exact.
pub(super) const HUFFMAN_AUTHORITY: [u8; 8] = [0xb8, 0x3b, 0x53, 0x39, 0xec, 0x32, 0x7d, 0x7f];

/// The names of HPACK's static table (RFC 7541 Appendix A), index 1 first:
/// their lengths size the entries a literal naming them adds.
pub(super) const STATIC_NAMES: [&str; 61] = [
    ":authority",
    ":method",
    ":method",
    ":path",
    ":path",
    ":scheme",
    ":scheme",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "accept",
    "access-control-allow-origin",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-range",
    "content-type",
    "cookie",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "link",
    "location",
    "max-forwards",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "refresh",
    "retry-after",
    "server",
    "set-cookie",
    "strict-transport-security",
    "transfer-encoding",
    "user-agent",
    "vary",
    "via",
    "www-authenticate",
];

/// A header block reader and rewriter that keeps the shape of the server's
/// HPACK dynamic table: no values, only the sizes that decide evictions and
/// which names are `:authority`.
pub(super) struct Hpack {
    pub(super) table: Table,
    /// The `:authority` value being looked at, decoded.
    pub(super) value: Vec<u8>,
    /// The rewritten block, when one was rewritten.
    pub(super) out: Vec<u8>,
}

/// A name as far as the table is concerned.
#[derive(Clone, Copy)]
pub(super) struct Name {
    pub(super) len: usize,
    pub(super) authority: bool,
}

impl Hpack {
    /// The state of a connection's start: an empty table of 4,096 bytes.
    pub(super) fn new() -> Self {
        Hpack {
            table: Table::new(),
            value: Vec::new(),
            out: Vec::new(),
        }
    }

    /// Reads a complete header block, keeping the table in step; true if
    /// `out` holds the block with its `:authority` values rewritten.
    /// Untouched fields are copied byte for byte.
    pub(super) fn block(&mut self, block: &[u8]) -> Result<bool, Malformed> {
        self.out.clear();
        let mut r = Reader { buf: block, pos: 0 };
        let mut copied = 0;
        let mut can_resize = true;
        while r.pos < block.len() {
            let start = r.pos;
            if let Some(repr) = self.field(&mut r, &mut can_resize)? {
                self.out.extend_from_slice(&block[copied..start]);
                write_authority(&mut self.out, repr, &self.value);
                copied = r.pos;
            }
        }
        if copied == 0 {
            return Ok(false);
        }
        self.out.extend_from_slice(&block[copied..]);
        Ok(true)
    }

    /// Reads one field representation. Returns the first byte of its
    /// rewrite (the representation, name index 1) when it is an
    /// `:authority` to rewrite with `self.value`.
    pub(super) fn field(
        &mut self,
        r: &mut Reader<'_>,
        can_resize: &mut bool,
    ) -> Result<Option<u8>, Malformed> {
        let first = r.peek()?;
        if first & 0x80 != 0 {
            *can_resize = false;
            self.table.name(r.int(7)?)?;
            return Ok(None);
        }
        if first & 0xe0 == 0x20 {
            // h2 takes size updates only before the block's first field.
            let size = r.int(5)?;
            if !*can_resize || size > MAX_TABLE_SIZE {
                return Err(Malformed);
            }
            self.table.set_max(size);
            return Ok(None);
        }
        *can_resize = false;
        let indexing = first & 0x40 != 0;
        let (prefix, repr) = if indexing {
            (6, 0x40)
        } else {
            (4, first & 0xf0)
        };
        let name = match r.int(prefix)? {
            0 => literal_name(r.string()?, indexing)?,
            index => self.table.name(index)?,
        };
        let value = r.string()?;
        let (fixed, value_len) = if name.authority {
            (self.fix_authority(value)?, self.value.len())
        } else if indexing {
            (false, value.decoded_len()?)
        } else {
            (false, 0)
        };
        if indexing {
            self.table.insert(name, value_len);
        }
        Ok(fixed.then_some(repr | 1))
    }

    /// Decodes an `:authority` value into `self.value` and, if h2 would
    /// refuse it, rewrites it there; true if rewritten.
    pub(super) fn fix_authority(&mut self, value: Str<'_>) -> Result<bool, Malformed> {
        self.value.clear();
        if value.huffman {
            let out = &mut self.value;
            huffman::decode(value.bytes, |b| out.push(b))?;
        } else {
            self.value.extend_from_slice(value.bytes);
        }
        if is_valid_authority(&self.value) {
            return Ok(false);
        }
        for b in self.value.iter_mut() {
            if !(b.is_ascii_alphanumeric() || *b == b'.' || *b == b'-') {
                *b = b'-';
            }
        }
        // Only an empty value stays invalid; it is left as it was.
        Ok(is_valid_authority(&self.value))
    }
}

/// A literal name: its decoded length (needed only when it is indexed)
/// and whether it is `:authority`.
pub(super) fn literal_name(name: Str<'_>, indexing: bool) -> Result<Name, Malformed> {
    let authority = if name.huffman {
        name.bytes == HUFFMAN_AUTHORITY
    } else {
        name.bytes == b":authority"
    };
    let len = if indexing { name.decoded_len()? } else { 0 };
    Ok(Name { len, authority })
}

/// Writes an `:authority` field as `repr` (its original representation
/// with name index 1) and `value` as a plain string literal.
pub(super) fn write_authority(out: &mut Vec<u8>, repr: u8, value: &[u8]) {
    out.push(repr);
    write_int(out, 0, 7, value.len());
    out.extend_from_slice(value);
}

/// Whether h2 takes `value` as an `:authority`. The common
/// `host[:port]` shape is checked here without allocating; anything else
/// is left to the `http` crate, as h2 does.
pub(super) fn is_valid_authority(value: &[u8]) -> bool {
    let (host, port) = match value.iter().position(|&b| b == b':') {
        Some(colon) => (&value[..colon], Some(&value[colon + 1..])),
        None => (value, None),
    };
    let plain_host = !host.is_empty()
        && host
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'.' || *b == b'-');
    let plain_port = match port {
        Some(port) => !port.is_empty() && port.iter().all(u8::is_ascii_digit),
        None => true,
    };
    if plain_host && plain_port {
        return true;
    }
    // What `Authority::from_maybe_shared`, h2's check, does with bytes
    // that are not already `Bytes`.
    http::uri::Authority::try_from(value).is_ok()
}

/// The shape of the dynamic table (RFC 7541 §2.3.2, §4): entry sizes and
/// names' lengths, newest first.
pub(super) struct Table {
    pub(super) entries: VecDeque<Entry>,
    pub(super) size: usize,
    pub(super) max: usize,
}

/// A dynamic table entry: its size (RFC 7541 §4.1) and its name.
#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) size: usize,
    pub(super) name: Name,
}

impl Table {
    /// The table at a connection's start.
    pub(super) fn new() -> Self {
        Table {
            entries: VecDeque::new(),
            size: 0,
            max: MAX_TABLE_SIZE,
        }
    }

    /// The name at `index` of the static and dynamic tables' joint index
    /// space; an index out of range is an error for h2 too.
    pub(super) fn name(&self, index: usize) -> Result<Name, Malformed> {
        match index {
            0 => Err(Malformed),
            1..=61 => Ok(Name {
                len: STATIC_NAMES[index - 1].len(),
                authority: index == 1,
            }),
            _ => self
                .entries
                .get(index - 62)
                .map(|e| e.name)
                .ok_or(Malformed),
        }
    }

    /// Adds an entry, evicting the oldest to make room; one larger than
    /// the table leaves it empty.
    pub(super) fn insert(&mut self, name: Name, value_len: usize) {
        let size = name.len + value_len + ENTRY_OVERHEAD;
        let Some(room) = self.max.checked_sub(size) else {
            self.evict_to(0);
            return;
        };
        self.evict_to(room);
        self.size += size;
        self.entries.push_front(Entry { size, name });
    }

    /// A dynamic table size update: evicts down to the new size.
    pub(super) fn set_max(&mut self, max: usize) {
        self.max = max;
        self.evict_to(max);
    }

    /// Evicts the oldest entries until the table holds at most `size`.
    fn evict_to(&mut self, size: usize) {
        while self.size > size {
            match self.entries.pop_back() {
                Some(old) => self.size -= old.size,
                None => break,
            }
        }
    }
}

/// A string literal's bytes as sent.
#[derive(Clone, Copy)]
pub(super) struct Str<'a> {
    pub(super) huffman: bool,
    pub(super) bytes: &'a [u8],
}

impl Str<'_> {
    /// The decoded length: a Huffman string is decoded (and checked) only
    /// to count.
    pub(super) fn decoded_len(&self) -> Result<usize, Malformed> {
        if !self.huffman {
            return Ok(self.bytes.len());
        }
        let mut n = 0;
        huffman::decode(self.bytes, |_| n += 1)?;
        Ok(n)
    }
}

/// Reads HPACK's primitives (RFC 7541 §5) from a header block.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    /// The next byte, not consumed; the block's end is an error.
    pub(super) fn peek(&self) -> Result<u8, Malformed> {
        self.buf.get(self.pos).copied().ok_or(Malformed)
    }

    /// The next byte, consumed.
    pub(super) fn byte(&mut self) -> Result<u8, Malformed> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    /// An integer with a `prefix`-bit prefix. Like h2, at most four
    /// continuation bytes (values up to about 2^28), so no overflow.
    pub(super) fn int(&mut self, prefix: u32) -> Result<usize, Malformed> {
        let mask = (1u8 << prefix) - 1;
        let mut value = usize::from(self.byte()? & mask);
        if value < usize::from(mask) {
            return Ok(value);
        }
        for shift in [0, 7, 14, 21] {
            let b = self.byte()?;
            value += usize::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(Malformed)
    }

    /// A string literal: H bit, 7-bit-prefix length, bytes.
    pub(super) fn string(&mut self) -> Result<Str<'a>, Malformed> {
        let huffman = self.peek()? & 0x80 != 0;
        let len = self.int(7)?;
        let bytes = self.buf.get(self.pos..self.pos + len).ok_or(Malformed)?;
        self.pos += len;
        Ok(Str { huffman, bytes })
    }
}

/// Writes an integer with a `prefix`-bit prefix after `flags`' high bits.
pub(super) fn write_int(out: &mut Vec<u8>, flags: u8, prefix: u32, value: usize) {
    let mask = (1usize << prefix) - 1;
    if value < mask {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | mask as u8);
    let mut rest = value - mask;
    while rest >= 0x80 {
        out.push(0x80 | (rest & 0x7f) as u8);
        rest >>= 7;
    }
    out.push(rest as u8);
}
