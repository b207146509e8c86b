//! HPACK's Huffman code (RFC 7541 Appendix B). The code is canonical
//! (codes of a length are consecutive, in symbol order, and follow the
//! shorter ones), so it is rebuilt from the code lengths alone, and decoded
//! by comparing a 32-bit window against each length's last code.

use super::Malformed;

/// Code lengths in bits, symbols 0..=255 then EOS (256). From the RFC's
/// table, as h2 (`hpack/huffman/table.rs`) has it.
#[rustfmt::skip]
pub(super) const LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
    30,
];
/// The end-of-string symbol, which must not appear in a string.
pub(super) const EOS: u16 = 256;
/// The shortest code's length: decoding starts looking there.
const SHORTEST: usize = 5;
/// The longest code's length (EOS's, and a few bytes').
const LONGEST: usize = 30;

/// The canonical code's tables.
pub(super) struct Code {
    /// Each symbol's code (right-aligned), for encoding in tests.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) codes: [u32; 257],
    /// Per length: its first code.
    pub(super) first: [u32; LONGEST + 1],
    /// Per length: the first code past it, left-aligned in 32 bits. A
    /// window below it holds a code of this length or shorter.
    pub(super) limit: [u64; LONGEST + 1],
    /// Per length: where its symbols start in `symbols`.
    pub(super) offset: [u16; LONGEST + 1],
    /// Symbols by (length, symbol).
    pub(super) symbols: [u16; 257],
}

/// The tables, built at compile time.
pub(super) static CODE: Code = build();

/// Assigns the canonical codes, as RFC 1951 §3.2.2 does.
const fn build() -> Code {
    let mut count = [0u32; LONGEST + 1];
    let mut s = 0;
    while s < 257 {
        assert!(LENGTHS[s] as usize >= SHORTEST && LENGTHS[s] as usize <= LONGEST);
        count[LENGTHS[s] as usize] += 1;
        s += 1;
    }
    let mut c = Code {
        codes: [0; 257],
        first: [0; LONGEST + 1],
        limit: [0; LONGEST + 1],
        offset: [0; LONGEST + 1],
        symbols: [0; 257],
    };
    let (mut code, mut offset, mut len) = (0u32, 0u16, 1);
    while len <= LONGEST {
        code = (code + count[len - 1]) << 1;
        c.first[len] = code;
        c.limit[len] = ((code + count[len]) as u64) << (32 - len);
        c.offset[len] = offset;
        let mut s = 0;
        while s < 257 {
            if LENGTHS[s] as usize == len {
                c.codes[s] = code + (offset - c.offset[len]) as u32;
                c.symbols[offset as usize] = s as u16;
                offset += 1;
            }
            s += 1;
        }
        len += 1;
    }
    c
}

/// The symbol whose code starts the 32-bit `window`, and its length.
fn symbol(window: u64) -> (usize, u16) {
    let mut len = SHORTEST;
    // The code is complete: the longest length's limit is 2^32.
    while window >= CODE.limit[len] {
        len += 1;
    }
    let rank = (window >> (32 - len)) as u32 - CODE.first[len];
    (len, CODE.symbols[CODE.offset[len] as usize + rank as usize])
}

/// Decodes `src`, handing each byte to `emit`. EOS in the string, or
/// padding that is longer than 7 bits or not all ones, is an error
/// (RFC 7541 §5.2), as for h2.
pub(super) fn decode(src: &[u8], mut emit: impl FnMut(u8)) -> Result<(), Malformed> {
    let total = src.len() * 8;
    // Bits from `pos` on, left-aligned; past the end, ones.
    let (mut window, mut have, mut next, mut pos) = (0u64, 0, 0, 0);
    while pos < total {
        while have <= 56 {
            let byte = src.get(next).copied().unwrap_or(0xff);
            window |= u64::from(byte) << (56 - have);
            have += 8;
            next += 1;
        }
        let (len, sym) = symbol(window >> 32);
        if pos + len > total {
            let left = total - pos;
            let ones = (1u64 << left) - 1;
            return if left <= 7 && window >> (64 - left) == ones {
                Ok(())
            } else {
                Err(Malformed)
            };
        }
        if sym == EOS {
            return Err(Malformed);
        }
        emit(sym as u8);
        window <<= len;
        have -= len;
        pos += len;
    }
    Ok(())
}
