//! How descriptor values are picked (`--keys`): the distributions, and the
//! small random generator that draws from them.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// How descriptor values are chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyDist {
    /// Every request a value never used before.
    Distinct,
    /// Uniformly among `K` values.
    Uniform(u64),
    /// Always the value `hot`.
    Hot,
    /// Among `K` values, value `i` (1-based) with weight `1 / i^S`.
    Zipf(u64, f64),
}

impl KeyDist {
    /// Parses `distinct`, `uniform:K`, `hot` or `zipf:K:S`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split(':').collect();
        let count = |s: &str| match s.parse::<u64>() {
            Ok(k) if k > 0 => Ok(k),
            _ => Err(format!("--keys {text}: K must be a positive integer")),
        };
        match parts.as_slice() {
            ["distinct"] => Ok(KeyDist::Distinct),
            ["hot"] => Ok(KeyDist::Hot),
            ["uniform", k] => Ok(KeyDist::Uniform(count(k)?)),
            ["zipf", k, s] => {
                let s: f64 = s
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| format!("--keys {text}: S must be a positive number"))?;
                Ok(KeyDist::Zipf(count(k)?, s))
            }
            _ => Err(format!(
                "--keys {text}: expected distinct, uniform:K, hot or zipf:K:S"
            )),
        }
    }
}

/// splitmix64: a tiny, fast, good-enough generator for picking keys.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[0, n)` (n > 0; the modulo bias is negligible here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// State shared by every task's key picker.
#[derive(Debug)]
pub struct KeySpace {
    dist: KeyDist,
    /// Makes `distinct` values unique across runs against one server.
    run_prefix: String,
    next_distinct: AtomicU64,
    /// Zipf: cumulative weights, normalised to end at 1.
    zipf_cdf: Vec<f64>,
}

impl KeySpace {
    pub fn new(dist: KeyDist) -> Self {
        let zipf_cdf = match dist {
            KeyDist::Zipf(k, s) => {
                let mut acc = 0.0;
                let mut cdf: Vec<f64> = (1..=k)
                    .map(|i| {
                        acc += 1.0 / (i as f64).powf(s);
                        acc
                    })
                    .collect();
                cdf.iter_mut().for_each(|c| *c /= acc);
                cdf
            }
            _ => Vec::new(),
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        KeySpace {
            dist,
            run_prefix: format!("{:x}-", nanos ^ u64::from(std::process::id())),
            next_distinct: AtomicU64::new(0),
            zipf_cdf,
        }
    }

    /// Writes the next base value into `out` (cleared first).
    pub fn pick(&self, rng: &mut Rng, out: &mut String) {
        out.clear();
        // Writing to a String cannot fail.
        let _ = match self.dist {
            KeyDist::Distinct => {
                let n = self.next_distinct.fetch_add(1, Ordering::Relaxed);
                write!(out, "{}{n}", self.run_prefix)
            }
            KeyDist::Uniform(k) => write!(out, "k{}", rng.below(k)),
            KeyDist::Hot => {
                out.push_str("hot");
                Ok(())
            }
            KeyDist::Zipf(..) => {
                let u = rng.next_f64();
                let i = self.zipf_cdf.partition_point(|&c| c < u);
                write!(out, "k{}", i.min(self.zipf_cdf.len() - 1))
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_key_distributions() {
        assert_eq!(KeyDist::parse("distinct"), Ok(KeyDist::Distinct));
        assert_eq!(KeyDist::parse("hot"), Ok(KeyDist::Hot));
        assert_eq!(KeyDist::parse("uniform:10"), Ok(KeyDist::Uniform(10)));
        assert_eq!(KeyDist::parse("zipf:100:1.1"), Ok(KeyDist::Zipf(100, 1.1)));
        assert!(KeyDist::parse("uniform:0").is_err());
        assert!(KeyDist::parse("zipf:10").is_err());
        assert!(KeyDist::parse("zipf:10:-1").is_err());
        assert!(KeyDist::parse("random").is_err());
    }

    #[test]
    fn zipf_prefers_low_ranks() {
        let keys = KeySpace::new(KeyDist::Zipf(1_000, 1.2));
        let mut rng = Rng(7);
        let mut value = String::new();
        let hits = (0..10_000)
            .filter(|_| {
                keys.pick(&mut rng, &mut value);
                value == "k0"
            })
            .count();
        // Rank 1 has about 1 / zeta(1.2) ~ 18% of the mass over 1000 keys.
        assert!((1_000..3_000).contains(&hits), "{hits}");
    }
}
