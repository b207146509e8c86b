//! The W3C trace context of an incoming call (`traceparent`), fresh ids, and
//! the head-sampling decision, all without allocating: an unsampled request
//! must cost next to nothing.

use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};

/// The parent a span joins: the caller's trace and span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

/// Parses a `traceparent` header value (`00-<trace>-<span>-<flags>`).
/// `None` for anything malformed, all-zero ids or version `ff`: the
/// request is then traced as a root, as the W3C rules say.
pub fn parse_traceparent(value: &[u8]) -> Option<Parent> {
    // Version 00 is exactly 55 bytes; a later version may append fields
    // after a '-'.
    if value.len() < 55 || (value.len() > 55 && value[55] != b'-') {
        return None;
    }
    let version = hex_byte(&value[0..2])?;
    if version == 0xff || (version == 0 && value.len() != 55) {
        return None;
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let mut trace_id = [0u8; 16];
    for (i, byte) in trace_id.iter_mut().enumerate() {
        *byte = hex_byte(&value[3 + 2 * i..5 + 2 * i])?;
    }
    let mut span_id = [0u8; 8];
    for (i, byte) in span_id.iter_mut().enumerate() {
        *byte = hex_byte(&value[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&value[53..55])?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
    })
}

/// Lower-case hex only, as the W3C format requires.
fn hex_byte(pair: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    Some(digit(pair[0])? << 4 | digit(pair[1])?)
}

/// The ratio sampler of OpenTelemetry's SDKs (`TraceIdRatioBased`): a trace
/// is sampled when the low 63 bits of its id's last 8 bytes fall under
/// `rate × 2⁶³`, so every service with the same rate decides alike.
#[derive(Debug, Clone, Copy)]
pub struct Ratio {
    threshold: u64,
}

impl Ratio {
    pub fn new(rate: f64) -> Ratio {
        let threshold = if rate >= 1.0 {
            u64::MAX
        } else if rate > 0.0 {
            (rate * (1u64 << 63) as f64) as u64
        } else {
            0
        };
        Ratio { threshold }
    }

    pub fn samples(&self, trace_id: &[u8; 16]) -> bool {
        let mut low = [0u8; 8];
        low.copy_from_slice(&trace_id[8..]);
        self.samples_low(u64::from_be_bytes(low))
    }

    /// [`Ratio::samples`] given the id's last 8 bytes (big-endian).
    pub fn samples_low(&self, low: u64) -> bool {
        self.threshold == u64::MAX || (low >> 1) < self.threshold
    }
}

thread_local! {
    /// xorshift64* state per thread, seeded from the std hasher's random
    /// keys: ids need to be unique, not secret.
    static STATE: Cell<u64> = Cell::new(
        std::collections::hash_map::RandomState::new().build_hasher().finish() | 1,
    );
}

/// A random non-zero 64-bit number.
pub fn random_u64() -> u64 {
    STATE.with(|state| {
        let mut x = state.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        state.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1
    })
}

/// A fresh trace id.
pub fn new_trace_id() -> [u8; 16] {
    trace_id_with_low(random_u64())
}

/// A fresh trace id ending in `low` (big-endian).
pub fn trace_id_with_low(low: u64) -> [u8; 16] {
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&random_u64().to_be_bytes());
    id[8..].copy_from_slice(&low.to_be_bytes());
    id
}

/// A fresh span id.
pub fn new_span_id() -> [u8; 8] {
    random_u64().to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_gives_the_callers_ids_and_flag() {
        let parent = parse_traceparent(VALID.as_bytes()).expect("valid");
        assert_eq!(parent.trace_id[0], 0x4b);
        assert_eq!(parent.trace_id[15], 0x36);
        assert_eq!(
            parent.span_id,
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert!(parent.sampled);
        let unsampled = VALID.replace("-01", "-00");
        assert!(!parse_traceparent(unsampled.as_bytes()).unwrap().sampled);
    }

    #[test]
    fn malformed_traceparents_are_ignored() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse_traceparent(bad.as_bytes()), None, "{bad:?}");
        }
        let future = format!("01-{}-more", &VALID[3..]);
        assert!(parse_traceparent(future.as_bytes()).is_some());
    }

    #[test]
    fn the_ratio_sampler_keeps_about_its_share() {
        let ratio = Ratio::new(0.01);
        let kept = (0..100_000)
            .filter(|_| ratio.samples(&new_trace_id()))
            .count();
        assert!((700..1300).contains(&kept), "kept {kept} of 100000 at 1%");
        assert!(Ratio::new(1.0).samples(&new_trace_id()));
        assert!(!Ratio::new(0.0).samples(&new_trace_id()));
    }
}
