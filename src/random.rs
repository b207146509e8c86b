//! Random numbers where a jitter needs one now and then: std's random hash
//! keys, so no RNG crate for a number per reconnection or per thread.

use std::hash::{BuildHasher, Hasher};

/// A number in [0, 1).
pub fn unit() -> f64 {
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    #[test]
    fn units_are_in_range_and_differ() {
        let draws: Vec<f64> = (0..64).map(|_| super::unit()).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        assert!(draws.windows(2).any(|w| w[0] != w[1]));
    }
}
