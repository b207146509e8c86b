//! Property tests: for random arrival sequences and hits, no algorithm ever
//! admits more than its bound (on the in-memory store; the conformance table
//! shows Redis agrees with it step for step). Plus a measurement of the
//! sliding-window counter's error against the exact sliding log.

mod common;

use std::sync::Arc;

use proptest::prelude::*;
use ratekeeper::clock::ManualClock;
use ratekeeper::limiter::{Algorithm, Charges, Check};
use ratekeeper::store::MemoryStore;

const START_MS: u64 = 1_800_000_000_000;

/// Runs `arrivals` (gap before each in ms, hits) through one limit and
/// returns the admitted `(time, hits)`.
fn run(
    algorithm: Algorithm,
    limit: u64,
    period_ms: u64,
    burst: u64,
    arrivals: &[(u64, u64)],
) -> Vec<(u64, u64)> {
    let clock = Arc::new(ManualClock::new(START_MS));
    let store = MemoryStore::new(clock.clone());
    let mut now = START_MS;
    let mut admitted = Vec::new();
    for &(gap, hits) in arrivals {
        now += gap;
        clock.set(now);
        let check = Check {
            key: "k".into(),
            algorithm,
            limit,
            period_ms,
            burst,
            hits,
            enforce: true,
            charges: Charges::Drop,
        };
        let outcome = store.apply(&[check], true)[0];
        if !outcome.over && hits > 0 {
            admitted.push((now, hits));
        }
    }
    admitted
}

/// The most hits admitted in any half-open window `(t - len, t]`.
fn max_in_any_window(admitted: &[(u64, u64)], len: u64) -> u64 {
    rolling_counts(admitted, len).into_iter().max().unwrap_or(0)
}

fn arrivals(max_gap: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0..max_gap, 0u64..=3), 1..200)
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fixed_window_admits_at_most_the_limit_per_aligned_window(
        limit in 1u64..20, arrivals in arrivals(400),
    ) {
        let admitted = run(Algorithm::FixedWindow, limit, 1_000, 0, &arrivals);
        let mut per_window = std::collections::HashMap::new();
        for (t, h) in admitted {
            *per_window.entry(t / 1_000).or_insert(0) += h;
        }
        prop_assert!(per_window.values().all(|&n| n <= limit), "{per_window:?}");
    }

    #[test]
    fn sliding_log_admits_at_most_the_limit_in_any_window(
        limit in 1u64..20, arrivals in arrivals(400),
    ) {
        let admitted = run(Algorithm::SlidingLog, limit, 1_000, 0, &arrivals);
        prop_assert!(max_in_any_window(&admitted, 1_000) <= limit);
    }

    #[test]
    fn sliding_window_admits_at_most_the_limit_per_aligned_window_and_twice_in_any(
        limit in 1u64..20, arrivals in arrivals(400),
    ) {
        let admitted = run(Algorithm::SlidingWindow, limit, 1_000, 0, &arrivals);
        let mut per_window = std::collections::HashMap::new();
        for &(t, h) in &admitted {
            *per_window.entry(t / 1_000).or_insert(0) += h;
        }
        prop_assert!(per_window.values().all(|&n| n <= limit));
        prop_assert!(max_in_any_window(&admitted, 1_000) <= 2 * limit);
    }

    #[test]
    fn gcra_admits_at_most_burst_plus_rate_times_t(
        limit in 1u64..20, burst_extra in 0u64..20, leaky in any::<bool>(), arrivals in arrivals(400),
    ) {
        let algorithm = if leaky { Algorithm::LeakyBucket } else { Algorithm::TokenBucket };
        let burst = limit + burst_extra;
        let admitted = run(algorithm, limit, 1_000, burst, &arrivals);
        let emission_us = (1_000_000u64).div_ceil(limit);
        for (i, &(t1, _)) in admitted.iter().enumerate() {
            let mut total = 0;
            for &(t2, h) in &admitted[i..] {
                total += h;
                // Over [t1, t2]: the bucket's content plus what refilled meanwhile.
                let bound = burst + (t2 - t1) * 1_000 / emission_us;
                prop_assert!(total <= bound, "{total} admitted in [{t1}, {t2}] > {bound}");
            }
        }
    }
}

/// Per admitted hit (sorted by time): the admitted hits in `(t - len, t]`.
fn rolling_counts(admitted: &[(u64, u64)], len: u64) -> Vec<u64> {
    let (mut start, mut sum) = (0, 0);
    admitted
        .iter()
        .map(|&(t, h)| {
            sum += h;
            while admitted[start].0 + len <= t {
                sum -= admitted[start].1;
                start += 1;
            }
            sum
        })
        .collect()
}

/// Measures how far the sliding-window counter strays from the exact log on
/// random traffic, and pins the result: see the README's algorithms section.
/// Returns (worst rolling-window excess, share of admissions over the exact
/// limit, admitted relative to the log).
fn sliding_window_error(
    limit: u64,
    rounds: u64,
    mut gap: impl FnMut(u64, u64) -> u64,
) -> (f64, f64, f64) {
    let (mut worst, mut wrong, mut admitted_window, mut admitted_log) =
        (0u64, 0usize, 0usize, 0usize);
    for round in 0..rounds {
        let arrivals: Vec<(u64, u64)> = (0..3_000u64).map(|i| (gap(round, i), 1)).collect();
        let window = run(Algorithm::SlidingWindow, limit, 1_000, 0, &arrivals);
        let log = run(Algorithm::SlidingLog, limit, 1_000, 0, &arrivals);
        let counts = rolling_counts(&window, 1_000);
        worst = worst.max(counts.iter().copied().max().unwrap_or(0));
        wrong += counts.iter().filter(|&&n| n > limit).count();
        admitted_window += window.len();
        admitted_log += log.len();
    }
    (
        worst as f64 / limit as f64 - 1.0,
        wrong as f64 / admitted_window as f64,
        admitted_window as f64 / admitted_log as f64 - 1.0,
    )
}

#[test]
fn sliding_window_error_vs_exact_log() {
    // A fixed xorshift sequence: the measurement is the same on every run.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut below = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let limit = 100;
    // Steady overload: uniform gaps of 0-12 ms, ~1.7x the limit.
    let steady = sliding_window_error(limit, 10, |_, _| below(13));
    // Busy spells at ~1.7x between quiet ones at ~0.25x (gaps of 0-79 ms):
    // the shifts between them are where a weighted estimate errs most.
    let bursty = sliding_window_error(limit, 10, |round, i| {
        if (i / 500 + round) % 3 == 0 {
            below(80)
        } else {
            below(13)
        }
    });
    for (name, (excess, wrong, throughput)) in [("steady", steady), ("bursty", bursty)] {
        println!(
            "sliding_window vs sliding_log, {name} traffic at {limit}/s: worst rolling-window excess {:.1}%, \
             admissions over the exact limit {:.2}%, admitted {:+.2}% vs the log",
            excess * 100.0,
            wrong * 100.0,
            throughput * 100.0
        );
        assert!(excess <= 1.0, "never more than twice the limit");
    }
    // Pinned to the measurement (deterministic), with a little headroom: a
    // change that makes the estimate worse fails here.
    assert!(steady.0 <= 0.05 && steady.1 <= 0.40, "{steady:?}");
    assert!(bursty.0 <= 0.45 && bursty.1 <= 0.25, "{bursty:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, cases: common::proptest_cases(2_000), ..ProptestConfig::default() })]

    /// Distinct (domain, entries) never share a counter key, whatever the
    /// values hold: separators, braces, percent signs, unicode, empties.
    #[test]
    fn counter_keys_are_injective(
        a in descriptor_strategy(), b in descriptor_strategy(),
    ) {
        let key = |(domain, entries): &(String, Vec<(String, String)>)| {
            ratekeeper::keys::counter_key(
                "rk:",
                domain,
                entries.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                ratekeeper::keys::Values::Raw,
                "fw.60",
            )
        };
        prop_assert_eq!(a == b, key(&a) == key(&b), "{:?} vs {:?}", a, b);
        // The whole descriptor is the hash tag: one slot per descriptor.
        let k = key(&a);
        let open = k.find('{').unwrap();
        prop_assert_eq!(k[open..].find('}').map(|c| c + open), k.rfind('}'));
    }
}

fn descriptor_strategy() -> impl Strategy<Value = (String, Vec<(String, String)>)> {
    // A small alphabet full of separators makes collisions likely if the
    // encoding were not injective.
    let part = prop::collection::vec(
        prop::sample::select(vec![
            'a', 'b', ':', '|', '=', '{', '}', '%', '_', '\n', 'é', ' ',
        ]),
        0..4,
    )
    .prop_map(|chars| chars.into_iter().collect::<String>());
    (
        part.clone(),
        prop::collection::vec((part.clone(), part), 0..3),
    )
}
