//! The limiter's and the budget function's replies as Redis sends them:
//! their integers packed by the script into one MessagePack array
//! (`cmsgpack.pack`, in every Redis since 2.6), so one bulk string.
//!
//! Why: the client reads an array reply value by value, and a call's
//! reply carries three integers per check (a budget operation five or
//! six). Read one by one they cost ratekeeper more CPU per request than
//! its own decision did (redis-rs's reply parser, measured with `perf`);
//! as one string they are read in one step and decoded here. Redis
//! spends about what it did: it packs the integers instead of writing
//! each as a reply (`bench/lua_instructions.sh`, lua/README.md).

use redis::{FromRedisValue, ParsingError, Value};

/// A packed reply's integers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed(pub Vec<i64>);

impl FromRedisValue for Packed {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        match v {
            Value::BulkString(bytes) => unpack(&bytes).map(Packed).map_err(|reason| {
                format!("the limiter's packed reply is malformed: {reason}").into()
            }),
            other => Err(format!("the limiter answered {other:?}, not a packed reply").into()),
        }
    }
}

/// The integers of a MessagePack array of numbers, as `cmsgpack.pack`
/// writes a Lua array: each integer in its shortest form, a number that is
/// not whole as a float, truncated here as Redis truncates a Lua number it
/// replies with.
pub fn unpack(bytes: &[u8]) -> Result<Vec<i64>, String> {
    let mut input = Input { bytes, at: 0 };
    let count = match input.byte()? {
        b @ 0x90..=0x9f => usize::from(b & 0x0f),
        0xdc => input.uint(2)? as usize,
        0xdd => input.uint(4)? as usize,
        b => return Err(format!("it starts with {b:#04x}, not an array")),
    };
    // Each element takes at least a byte: a count past the bytes left is a
    // lie, and no reason to allocate for it.
    if count > bytes.len() - input.at {
        return Err(format!("an array of {count} in {} bytes", bytes.len()));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(input.number()?);
    }
    if input.at != bytes.len() {
        return Err(format!("{} bytes after the array", bytes.len() - input.at));
    }
    Ok(out)
}

struct Input<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Input<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at + n;
        let taken = self.bytes.get(self.at..end).ok_or("it ends early")?;
        self.at = end;
        Ok(taken)
    }

    fn byte(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    /// A big-endian unsigned integer of `n` bytes (at most 8).
    fn uint(&mut self, n: usize) -> Result<u64, String> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0, |v, &b| (v << 8) | u64::from(b)))
    }

    /// A big-endian two's-complement integer of `n` bytes (at most 8).
    fn int(&mut self, n: usize) -> Result<i64, String> {
        let shift = 64 - 8 * n as u32;
        Ok(((self.uint(n)? << shift) as i64) >> shift)
    }

    fn number(&mut self) -> Result<i64, String> {
        let b = self.byte()?;
        Ok(match b {
            0x00..=0x7f => i64::from(b),
            0xe0..=0xff => i64::from(b as i8),
            0xcc => self.uint(1)? as i64,
            0xcd => self.uint(2)? as i64,
            0xce => self.uint(4)? as i64,
            0xcf => i64::try_from(self.uint(8)?).map_err(|_| "an integer past 2^63")?,
            0xd0 => self.int(1)?,
            0xd1 => self.int(2)?,
            0xd2 => self.int(4)?,
            0xd3 => self.int(8)?,
            0xca => f32::from_bits(self.uint(4)? as u32) as i64,
            0xcb => f64::from_bits(self.uint(8)?) as i64,
            _ => return Err(format!("{b:#04x} is not a number")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_cmsgpack_writes_is_read() {
        // As Redis 7.0's cmsgpack.pack({1, -1, 300, 70000, 2^40, 0}) wrote it.
        let packed =
            b"\x96\x01\xff\xcd\x01,\xce\x00\x01\x11p\xcf\x00\x00\x01\x00\x00\x00\x00\x00\x00";
        assert_eq!(unpack(packed), Ok(vec![1, -1, 300, 70000, 1 << 40, 0]));
        let negatives = b"\x94\xe0\xd0\x80\xd1\x80\x00\xd2\x80\x00\x00\x00";
        assert_eq!(unpack(negatives), Ok(vec![-32, -128, -32768, -(1 << 31)]));
        let wide = b"\x92\xd3\xff\xff\xff\xff\xff\xff\xff\xfe\xcc\xff";
        assert_eq!(unpack(wide), Ok(vec![-2, 255]));
    }

    #[test]
    fn numbers_not_whole_are_truncated_as_redis_replies_them() {
        let mut packed = vec![0x92, 0xca];
        packed.extend(2.5f32.to_bits().to_be_bytes());
        packed.push(0xcb);
        packed.extend((-7.9f64).to_bits().to_be_bytes());
        assert_eq!(unpack(&packed), Ok(vec![2, -7]));
    }

    #[test]
    fn long_arrays_carry_their_count() {
        let mut packed = vec![0xdc, 0x01, 0x00];
        packed.extend(std::iter::repeat_n(0x07, 256));
        assert_eq!(unpack(&packed), Ok(vec![7; 256]));
        assert_eq!(unpack(b"\x90"), Ok(vec![]));
    }

    #[test]
    fn anything_else_is_refused_with_a_reason() {
        for (bytes, reason) in [
            (&b""[..], "it ends early"),
            (b"\x81\x01\x01", "it starts with 0x81, not an array"),
            (b"\x92\x01", "an array of 2 in 2 bytes"),
            (b"\x91\xcd\x01", "it ends early"),
            (b"\x91\xa1x", "0xa1 is not a number"),
            (b"\x91\x01\x01", "1 bytes after the array"),
            (
                b"\xdd\xff\xff\xff\xff\x01",
                "an array of 4294967295 in 6 bytes",
            ),
            (
                b"\x91\xcf\x80\x00\x00\x00\x00\x00\x00\x00",
                "an integer past 2^63",
            ),
        ] {
            assert_eq!(unpack(bytes), Err(reason.to_string()), "{bytes:?}");
        }
    }

    #[test]
    fn a_reply_that_is_not_a_string_is_an_error() {
        let error = Packed::from_redis_value(Value::Array(vec![Value::Int(1)])).unwrap_err();
        assert!(error.to_string().contains("not a packed reply"), "{error}");
        let ok = Packed::from_redis_value(Value::BulkString(b"\x91\x05".to_vec()));
        assert_eq!(ok.unwrap(), Packed(vec![5]));
    }
}
