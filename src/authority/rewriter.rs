//! The client-to-server byte stream's rewriter, without I/O: HTTP/2
//! frames in, the same frames out, but for header blocks whose
//! `:authority` [`Hpack`] rewrote.

use super::hpack::Hpack;
use super::Malformed;

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
pub(super) const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The length of an HTTP/2 frame header.
pub(super) const HEAD_LEN: usize = 9;
/// h2's default SETTINGS_MAX_FRAME_SIZE, which this server never raises:
/// a longer frame is an error h2 reports itself, and the largest payload
/// the rewritten frames may carry.
pub(super) const MAX_PAYLOAD: usize = 16_384;
/// The most frames of one header block held before giving up: h2 ends a
/// connection whose block takes more than 5 CONTINUATIONs (at its 16 KiB
/// header list and frame sizes), so holding more would only buffer, for a
/// peer that stalls, what h2 refuses anyway.
pub(super) const MAX_BLOCK_FRAMES: usize = 6;
/// The buffer capacity kept between header blocks.
pub(super) const KEPT_CAPACITY: usize = 64 * 1024;

/// Frame types and flags (RFC 9113 §6).
pub(super) const HEADERS: u8 = 0x1;
pub(super) const PUSH_PROMISE: u8 = 0x5;
pub(super) const CONTINUATION: u8 = 0x9;
pub(super) const END_STREAM: u8 = 0x1;
pub(super) const END_HEADERS: u8 = 0x4;
pub(super) const PADDED: u8 = 0x8;
pub(super) const PRIORITY: u8 = 0x20;

/// Where the [`Rewriter`] is in the client's byte stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// This many bytes of the preface have been seen (and passed on).
    Preface(usize),
    /// Reading a frame header into `Rewriter::head`.
    Head,
    /// Passing on this many more payload bytes of a frame.
    Forward(usize),
    /// Buffering this many more payload bytes of a header block's frame.
    Collect(usize),
    /// Given up, or at EOF: output is input from now on.
    Passthrough,
}

/// The client-to-server byte stream's rewriter, without I/O: bytes are
/// fed in as they arrive, and the bytes for the server are appended to an
/// output buffer. Frames other than a header block's pass through as they
/// arrive; a header block is held until complete, then passed on as it
/// came or, when an `:authority` value was rewritten, as new frames.
pub(super) struct Rewriter {
    pub(super) phase: Phase,
    /// The frame header being read.
    pub(super) head: [u8; HEAD_LEN],
    pub(super) head_len: usize,
    /// The header block's frames as received (HEADERS, CONTINUATIONs):
    /// what goes out when nothing is rewritten. Non-empty exactly while a
    /// header block is being collected.
    pub(super) frames: Vec<u8>,
    /// Where the frame being collected starts in `frames`.
    pub(super) frame_start: usize,
    /// How many frames the block being collected has had.
    pub(super) block_frames: usize,
    /// The header block: the frames' fragments, without padding.
    pub(super) block: Vec<u8>,
    /// The block's HEADERS frame: stream id, flags, and the PRIORITY
    /// fields (when flagged), for the rewritten frames.
    pub(super) stream: u32,
    pub(super) flags: u8,
    pub(super) priority: [u8; 5],
    pub(super) hpack: Hpack,
}

impl Rewriter {
    /// A rewriter for a connection's first byte on.
    pub(super) fn new() -> Self {
        Rewriter {
            phase: Phase::Preface(0),
            head: [0; HEAD_LEN],
            head_len: 0,
            frames: Vec::new(),
            frame_start: 0,
            block_frames: 0,
            block: Vec::new(),
            stream: 0,
            flags: 0,
            priority: [0; 5],
            hpack: Hpack::new(),
        }
    }

    /// Whether output is input for the rest of the connection.
    pub(super) fn is_passthrough(&self) -> bool {
        self.phase == Phase::Passthrough
    }

    /// Takes the next bytes from the client, appending to `out` what can
    /// be passed on to the server so far.
    pub(super) fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) {
        while !input.is_empty() {
            let used = match self.phase {
                Phase::Preface(seen) => self.preface(seen, input, out),
                Phase::Head => self.read_head(input, out),
                Phase::Forward(left) => {
                    let n = left.min(input.len());
                    out.extend_from_slice(&input[..n]);
                    self.phase = if n == left {
                        Phase::Head
                    } else {
                        Phase::Forward(left - n)
                    };
                    n
                }
                Phase::Collect(left) => self.collect(left, input, out),
                Phase::Passthrough => {
                    out.extend_from_slice(input);
                    input.len()
                }
            };
            input = &input[used..];
        }
    }

    /// The client's EOF: whatever is held back goes out unchanged.
    pub(super) fn finish(&mut self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.frames);
        if self.phase == Phase::Head {
            out.extend_from_slice(&self.head[..self.head_len]);
        }
        self.give_up();
    }

    /// Passes on the bytes that match the preface; anything else is not
    /// HTTP/2 with prior knowledge, which is not ours to touch.
    pub(super) fn preface(&mut self, seen: usize, input: &[u8], out: &mut Vec<u8>) -> usize {
        let n = (PREFACE.len() - seen).min(input.len());
        if input[..n] != PREFACE[seen..seen + n] {
            self.give_up();
            return 0;
        }
        out.extend_from_slice(&input[..n]);
        self.phase = if seen + n == PREFACE.len() {
            Phase::Head
        } else {
            Phase::Preface(seen + n)
        };
        n
    }

    /// Gathers a frame header, which may arrive in pieces.
    pub(super) fn read_head(&mut self, input: &[u8], out: &mut Vec<u8>) -> usize {
        let n = (HEAD_LEN - self.head_len).min(input.len());
        self.head[self.head_len..self.head_len + n].copy_from_slice(&input[..n]);
        self.head_len += n;
        if self.head_len == HEAD_LEN {
            self.head_len = 0;
            self.start_frame(out);
        }
        n
    }

    /// A frame header is in: forward the frame, start or continue a header
    /// block, or give up on a sequence h2 will refuse anyway.
    pub(super) fn start_frame(&mut self, out: &mut Vec<u8>) {
        let h = self.head;
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let (kind, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let in_block = !self.frames.is_empty();
        let refused = len > MAX_PAYLOAD
            || if in_block {
                kind != CONTINUATION
                    || stream != self.stream
                    || self.block_frames == MAX_BLOCK_FRAMES
            } else {
                kind == CONTINUATION || kind == PUSH_PROMISE
            };
        if refused {
            self.give_up_with(out);
            out.extend_from_slice(&h);
            return;
        }
        if !in_block && kind != HEADERS {
            out.extend_from_slice(&h);
            self.phase = if len == 0 {
                Phase::Head
            } else {
                Phase::Forward(len)
            };
            return;
        }
        if !in_block {
            self.stream = stream;
            self.flags = flags;
        }
        self.frame_start = self.frames.len();
        self.block_frames += 1;
        self.frames.extend_from_slice(&h);
        self.phase = Phase::Collect(len);
        if len == 0 {
            self.frame_done(out);
        }
    }

    /// Buffers a header block frame's payload as it arrives.
    pub(super) fn collect(&mut self, left: usize, input: &[u8], out: &mut Vec<u8>) -> usize {
        let n = left.min(input.len());
        self.frames.extend_from_slice(&input[..n]);
        if n == left {
            self.frame_done(out);
        } else {
            self.phase = Phase::Collect(left - n);
        }
        n
    }

    /// A header block's frame is in: add its fragment to the block, and
    /// process the block if it is complete.
    pub(super) fn frame_done(&mut self, out: &mut Vec<u8>) {
        let frame = &self.frames[self.frame_start..];
        let (kind, flags, payload) = (frame[3], frame[4], &frame[HEAD_LEN..]);
        let fragment = if kind == HEADERS {
            match headers_fragment(flags, self.stream, payload) {
                Some((range, priority)) => {
                    self.priority = priority;
                    range
                }
                None => return self.give_up_with(out),
            }
        } else {
            0..payload.len()
        };
        self.block.extend_from_slice(&payload[fragment]);
        if flags & END_HEADERS == 0 {
            self.phase = Phase::Head;
            return;
        }
        match self.hpack.block(&self.block) {
            Ok(false) => out.extend_from_slice(&self.frames),
            Ok(true) => self.write_rewritten(out),
            Err(Malformed) => return self.give_up_with(out),
        }
        self.frames.clear();
        self.block_frames = 0;
        self.block.clear();
        if self.frames.capacity() > KEPT_CAPACITY {
            // Do not hold a rare huge block's memory for the connection's
            // life; the next block reallocates.
            self.frames = Vec::new();
            self.block = Vec::new();
            self.hpack.out = Vec::new();
        }
        self.phase = Phase::Head;
    }

    /// Writes the rewritten block as a HEADERS frame and as many
    /// CONTINUATIONs as it needs, padding dropped.
    pub(super) fn write_rewritten(&self, out: &mut Vec<u8>) {
        let block = &self.hpack.out;
        let priority: &[u8] = if self.flags & PRIORITY != 0 {
            &self.priority
        } else {
            &[]
        };
        let first = block.len().min(MAX_PAYLOAD - priority.len());
        let mut flags = self.flags & (END_STREAM | PRIORITY);
        if first == block.len() {
            flags |= END_HEADERS;
        }
        write_head(out, priority.len() + first, HEADERS, flags, self.stream);
        out.extend_from_slice(priority);
        out.extend_from_slice(&block[..first]);
        let mut rest = &block[first..];
        while !rest.is_empty() {
            let n = rest.len().min(MAX_PAYLOAD);
            let flags = if n == rest.len() { END_HEADERS } else { 0 };
            write_head(out, n, CONTINUATION, flags, self.stream);
            out.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
        }
    }

    /// Passes on what is held back, unchanged, and stops rewriting.
    pub(super) fn give_up_with(&mut self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.frames);
        self.give_up();
    }

    /// Stops rewriting for good, and frees what rewriting needed.
    pub(super) fn give_up(&mut self) {
        self.phase = Phase::Passthrough;
        self.frames = Vec::new();
        self.block = Vec::new();
        self.hpack = Hpack::new();
    }

    #[cfg(test)]
    pub(super) fn table_size(&self) -> usize {
        self.hpack.table.size
    }
}

/// The header block fragment's range in a HEADERS frame's payload and the
/// PRIORITY fields (zero when not flagged); `None` where h2 refuses the
/// frame before decoding its block (bad padding, a stream depending on
/// itself), so the block must not count towards the table.
pub(super) fn headers_fragment(
    flags: u8,
    stream: u32,
    payload: &[u8],
) -> Option<(std::ops::Range<usize>, [u8; 5])> {
    let mut start = 0;
    let mut pad = 0;
    if flags & PADDED != 0 {
        pad = usize::from(*payload.first()?);
        start = 1;
    }
    let mut priority = [0; 5];
    if flags & PRIORITY != 0 {
        priority.copy_from_slice(payload.get(start..start + 5)?);
        let depends_on = u32::from_be_bytes([priority[0], priority[1], priority[2], priority[3]]);
        if depends_on & 0x7fff_ffff == stream {
            return None;
        }
        start += 5;
    }
    let end = payload.len().checked_sub(pad)?;
    (end >= start).then_some((start..end, priority))
}

/// Writes a frame header.
pub(super) fn write_head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}
