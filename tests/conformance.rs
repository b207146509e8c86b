//! One table of (time, checks) -> outcomes, run against every store: the
//! in-memory store and a real Redis, both with the same pinned clock. The two
//! implementations of each algorithm must agree exactly, and with the
//! hand-computed expectations here.

mod common;

use std::sync::Arc;

use common::{command_calls, limiter_calls, Backend};
use proptest::prelude::*;
use ratekeeper::clock::ManualClock;
use ratekeeper::limiter::{Algorithm, Charges, Check, Outcome, MAX_HITS};
use ratekeeper::store::packed::Packed;

/// A check of `algorithm` on key `key`: `limit` per `period_ms`, `burst`, `hits`.
fn ck(algorithm: Algorithm, key: &str, limit: u64, period_ms: u64, burst: u64, hits: u64) -> Check {
    Check {
        key: format!("rk:{{t|{key}}}:{}.{period_ms}", algorithm.key_tag()),
        algorithm,
        limit,
        period_ms,
        burst,
        hits,
        enforce: true,
        charges: Charges::Drop,
    }
}

/// A fixed-window check: `limit` per second.
fn c(key: &str, limit: u64, hits: u64) -> Check {
    ck(Algorithm::FixedWindow, key, limit, 1_000, 0, hits)
}

fn shadow(check: Check) -> Check {
    Check {
        enforce: false,
        ..check
    }
}

fn minute(check: Check) -> Check {
    Check {
        period_ms: 60_000,
        ..check
    }
}

/// `(over, remaining, reset_ms)`.
fn o(over: bool, remaining: u64, reset_ms: u64) -> Outcome {
    Outcome {
        over,
        remaining,
        reset_ms,
        remaining_before: None,
    }
}

/// A charge recorded over its limit, which admitted `before` hits before
/// it: `(over, 0, reset_ms)`.
fn charged_over(before: u64, reset_ms: u64) -> Outcome {
    Outcome {
        remaining_before: Some(before),
        ..o(true, 0, reset_ms)
    }
}

struct Step {
    /// Milliseconds since the start of the table (which starts on a minute edge).
    at: u64,
    checks: Vec<Check>,
    expect: Vec<Outcome>,
    why: &'static str,
    all_or_nothing: bool,
}

fn s(at: u64, checks: Vec<Check>, expect: Vec<Outcome>, why: &'static str) -> Step {
    Step {
        at,
        checks,
        expect,
        why,
        all_or_nothing: true,
    }
}

fn fixed_window() -> Vec<Step> {
    vec![
        s(0, vec![c("a", 3, 1)], vec![o(false, 2, 1000)], "first hit"),
        s(
            100,
            vec![c("a", 3, 1)],
            vec![o(false, 1, 900)],
            "second hit, reset shrinks",
        ),
        s(
            200,
            vec![c("a", 3, 1)],
            vec![o(false, 0, 800)],
            "last allowed",
        ),
        s(
            300,
            vec![c("a", 3, 1)],
            vec![o(true, 0, 700)],
            "over the limit",
        ),
        s(
            999,
            vec![c("a", 3, 1)],
            vec![o(true, 0, 1)],
            "still over at the window's end",
        ),
        s(
            1000,
            vec![c("a", 3, 1)],
            vec![o(false, 2, 1000)],
            "new window",
        ),
        // hits_addend
        s(1000, vec![c("b", 10, 4)], vec![o(false, 6, 1000)], "hits 4"),
        s(
            1000,
            vec![c("b", 10, 7)],
            vec![o(true, 6, 1000)],
            "7 > 6 left: refused, nothing consumed",
        ),
        s(
            1000,
            vec![c("b", 10, 6)],
            vec![o(false, 0, 1000)],
            "exactly what is left",
        ),
        s(
            1000,
            vec![c("b2", 10, 11)],
            vec![o(true, 10, 1000)],
            "more than the capacity, nothing consumed",
        ),
        s(
            1000,
            vec![c("b2", 10, MAX_HITS)],
            vec![o(true, 10, 1000)],
            "huge hits",
        ),
        // check only
        s(
            1000,
            vec![c("c", 1, 0)],
            vec![o(false, 1, 1000)],
            "check only consumes nothing",
        ),
        s(
            1000,
            vec![c("c", 1, 1)],
            vec![o(false, 0, 1000)],
            "consume the one",
        ),
        s(
            1000,
            vec![c("c", 1, 0)],
            vec![o(true, 0, 1000)],
            "check only at the limit is over",
        ),
        // all-or-nothing across a request's limits
        s(
            2000,
            vec![c("d1", 5, 1), c("d2", 1, 2)],
            vec![o(false, 5, 1000), o(true, 1, 1000)],
            "d2 refuses: d1 not consumed",
        ),
        s(
            2000,
            vec![c("d1", 5, 1), c("d2", 1, 1)],
            vec![o(false, 4, 1000), o(false, 0, 1000)],
            "both admitted",
        ),
        // shadow mode never refuses; an over limit consumes nothing
        s(
            2000,
            vec![c("e1", 5, 1), shadow(c("e2", 1, 3))],
            vec![o(false, 4, 1000), o(true, 1, 1000)],
            "a shadow limit over does not block",
        ),
        // a descriptor repeated in one request counts twice
        s(
            3000,
            vec![c("f", 3, 2), c("f", 3, 1)],
            vec![o(false, 1, 1000), o(false, 0, 1000)],
            "same key twice",
        ),
        s(
            4000,
            vec![c("g", 3, 2), c("g", 3, 2)],
            vec![o(false, 3, 1000), o(true, 3, 1000)],
            "same key twice, second over: nothing consumed",
        ),
        s(
            4000,
            vec![c("g", 3, 3)],
            vec![o(false, 0, 1000)],
            "all 3 still there",
        ),
        // windows are aligned to the epoch, per unit
        s(
            4500,
            vec![minute(c("h", 2, 1))],
            vec![o(false, 1, 55_500)],
            "minute window",
        ),
        s(
            60_000,
            vec![minute(c("h", 2, 1))],
            vec![o(false, 1, 60_000)],
            "next minute",
        ),
        // a limit of 0 refuses everything
        s(
            60_000,
            vec![c("z", 0, 1)],
            vec![o(true, 0, 1000)],
            "limit 0",
        ),
        // Envoy's count-everything mode: what fits is consumed anyway
        Step {
            all_or_nothing: false,
            ..s(
                61_000,
                vec![c("ce1", 5, 1), c("ce2", 1, 2)],
                vec![o(false, 4, 1000), o(true, 1, 1000)],
                "count-everything: ce1 consumed though ce2 refuses",
            )
        },
    ]
}

fn sliding_window() -> Vec<Step> {
    let sw = |hits| ck(Algorithm::SlidingWindow, "sw", 4, 1_000, 0, hits);
    vec![
        s(0, vec![sw(1)], vec![o(false, 3, 1000)], "first hit"),
        s(500, vec![sw(3)], vec![o(false, 0, 500)], "fill the window"),
        s(
            600,
            vec![sw(1)],
            vec![o(true, 0, 401)],
            "over: at 1,000 the 4 still weigh 4; at 1,001 floor(3.996) = 3",
        ),
        s(
            1250,
            vec![sw(1)],
            vec![o(false, 0, 750)],
            "previous 4 weighted 3/4: 3 + 1",
        ),
        s(
            1500,
            vec![sw(1)],
            vec![o(false, 0, 500)],
            "weighted 2 + current 2",
        ),
        s(
            1501,
            vec![sw(1)],
            vec![o(false, 0, 499)],
            "weighted floor(1.996) = 1 + current 3",
        ),
        s(
            1510,
            vec![sw(1)],
            vec![o(true, 0, 241)],
            "weighted 1 + current 3 is full until the 4 weigh 0: floor(4 x 249 / 1000) at 1,751",
        ),
        s(
            3100,
            vec![sw(2)],
            vec![o(false, 2, 900)],
            "two windows later: nothing carried",
        ),
    ]
}

fn sliding_log() -> Vec<Step> {
    let sl = |hits| ck(Algorithm::SlidingLog, "sl", 3, 1_000, 0, hits);
    let sl2 = |hits| ck(Algorithm::SlidingLog, "sl2", 10, 1_000, 0, hits);
    let sl3 = |hits| ck(Algorithm::SlidingLog, "sl3", 3, 1_000, 0, hits);
    let big = |hits| ck(Algorithm::SlidingLog, "big", 2_000_000, 3_600_000, 0, hits);
    let mw = |hits| ck(Algorithm::SlidingLog, "mw", 10, 1_000, 0, hits);
    vec![
        s(0, vec![sl(1)], vec![o(false, 2, 1000)], "first hit"),
        s(100, vec![sl(1)], vec![o(false, 1, 1000)], "second"),
        s(200, vec![sl(1)], vec![o(false, 0, 1000)], "third"),
        s(
            300,
            vec![sl(1)],
            vec![o(true, 0, 700)],
            "over until the oldest expires",
        ),
        s(
            1000,
            vec![sl(1)],
            vec![o(false, 0, 1000)],
            "the oldest expired exactly now",
        ),
        s(
            1050,
            vec![sl(2)],
            vec![o(true, 0, 150)],
            "two need the two oldest gone",
        ),
        s(
            1100,
            vec![sl(0)],
            vec![o(false, 1, 900)],
            "check only after one expired",
        ),
        s(
            1100,
            vec![sl(5)],
            vec![o(true, 1, 900)],
            "more than the limit never fits",
        ),
        s(
            5000,
            vec![sl2(1)],
            vec![o(false, 9, 1000)],
            "same millisecond",
        ),
        s(
            5000,
            vec![sl2(1)],
            vec![o(false, 8, 1000)],
            "same millisecond again: a distinct entry",
        ),
        s(
            5000,
            vec![sl2(3)],
            vec![o(false, 5, 1000)],
            "several hits at once",
        ),
        s(
            6000,
            vec![sl3(2), sl3(2)],
            vec![o(false, 3, 0), o(true, 3, 0)],
            "same key twice, second over: nothing logged",
        ),
        // Requests of different weights ageing out one by one.
        s(7000, vec![mw(4)], vec![o(false, 6, 1000)], "4 of 10"),
        s(7200, vec![mw(1)], vec![o(false, 5, 1000)], "1 more"),
        s(7400, vec![mw(3)], vec![o(false, 2, 1000)], "3 more"),
        s(
            7500,
            vec![mw(4)],
            vec![o(true, 2, 500)],
            "4 fit once the oldest (4) has aged out",
        ),
        s(
            7500,
            vec![mw(7)],
            vec![o(true, 2, 700)],
            "7 fit once the two oldest (4 + 1) have aged out",
        ),
        s(
            7500,
            vec![mw(9)],
            vec![o(true, 2, 900)],
            "9 fit once all three (4 + 1 + 3) have aged out",
        ),
        s(
            8000,
            vec![mw(0)],
            vec![o(false, 6, 400)],
            "the 4 aged out: 4 left in the period",
        ),
        s(
            8000,
            vec![mw(7)],
            vec![o(true, 6, 200)],
            "7 fit once the 1 has aged out too",
        ),
        s(
            8200,
            vec![mw(7)],
            vec![o(false, 0, 1000)],
            "the 1 aged out: 7 fit exactly",
        ),
        s(
            8200,
            vec![mw(1)],
            vec![o(true, 0, 200)],
            "full: 1 fits once the 3 has aged out",
        ),
        s(
            8400,
            vec![mw(3)],
            vec![o(false, 0, 1000)],
            "the 3 aged out: 3 fit exactly",
        ),
        // hits_addend of a million (an LLM token budget): one entry each.
        s(
            10_000,
            vec![big(1_000_000)],
            vec![o(false, 1_000_000, 3_600_000)],
            "a million hits in one request",
        ),
        s(
            11_000,
            vec![big(1_000_000)],
            vec![o(false, 0, 3_600_000)],
            "and another million",
        ),
        s(
            12_000,
            vec![big(1)],
            vec![o(true, 0, 3_598_000)],
            "one more: over until the first million ages out",
        ),
        s(
            12_000,
            vec![big(1_000_001)],
            vec![o(true, 0, 3_599_000)],
            "a million and one: over until both have aged out",
        ),
        s(
            3_610_000,
            vec![big(999_999)],
            vec![o(false, 1, 3_600_000)],
            "the first million aged out exactly now",
        ),
    ]
}

fn token_bucket() -> Vec<Step> {
    let tb = |hits| ck(Algorithm::TokenBucket, "tb", 4, 1_000, 4, hits);
    let tb2 = |hits| ck(Algorithm::TokenBucket, "tb2", 1, 1_000, 3, hits);
    let tb3 = |hits| ck(Algorithm::TokenBucket, "tb3", 3, 1_000, 3, hits);
    vec![
        s(
            0,
            vec![tb(1)],
            vec![o(false, 3, 250)],
            "one token out, full again in 250 ms",
        ),
        s(0, vec![tb(3)], vec![o(false, 0, 1000)], "empty"),
        s(
            100,
            vec![tb(1)],
            vec![o(true, 0, 150)],
            "next token in 150 ms",
        ),
        s(
            250,
            vec![tb(1)],
            vec![o(false, 0, 1000)],
            "one token refilled",
        ),
        s(2000, vec![tb(0)], vec![o(false, 4, 0)], "full again"),
        s(
            2000,
            vec![tb(5)],
            vec![o(true, 4, 0)],
            "more than the bucket never fits",
        ),
        s(
            3000,
            vec![tb2(3)],
            vec![o(false, 0, 3000)],
            "burst 3 at 1 per second",
        ),
        s(
            3500,
            vec![tb2(1)],
            vec![o(true, 0, 500)],
            "next token in 500 ms",
        ),
        s(4000, vec![tb2(1)], vec![o(false, 0, 3000)], "refilled"),
        s(
            5000,
            vec![tb3(3)],
            vec![o(false, 0, 1001)],
            "3 per second: 333334 us per token",
        ),
        s(
            5334,
            vec![tb3(1)],
            vec![o(false, 0, 1000)],
            "one token back after 333.334 ms",
        ),
    ]
}

fn leaky_bucket() -> Vec<Step> {
    let lb = |hits| ck(Algorithm::LeakyBucket, "lb", 2, 1_000, 2, hits);
    vec![
        s(0, vec![lb(1)], vec![o(false, 1, 0)], "served at once"),
        s(
            0,
            vec![lb(1)],
            vec![o(false, 0, 500)],
            "queued behind one: wait 500 ms",
        ),
        s(
            100,
            vec![lb(1)],
            vec![o(true, 0, 400)],
            "queue full for 400 ms",
        ),
        s(500, vec![lb(1)], vec![o(false, 0, 500)], "a place freed"),
        s(500, vec![lb(0)], vec![o(true, 0, 500)], "check only: full"),
    ]
}

fn mixed() -> Vec<Step> {
    let fw = |hits| c("mix1", 5, hits);
    let tb = |hits| ck(Algorithm::TokenBucket, "mix2", 1, 1_000, 1, hits);
    vec![
        s(
            7000,
            vec![fw(1), tb(2)],
            vec![o(false, 5, 1000), o(true, 1, 0)],
            "a token bucket refusal spares the fixed window",
        ),
        s(
            7000,
            vec![fw(1), tb(1)],
            vec![o(false, 4, 1000), o(false, 0, 1000)],
            "both admitted in one step",
        ),
    ]
}

/// `check` on a limit that takes charges.
fn charged(check: Check) -> Check {
    Check {
        charges: Charges::Record,
        ..check
    }
}

/// `check` on a limit that takes charges only where it is itself over
/// (`STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`).
fn charged_when_over(check: Check) -> Check {
    Check {
        charges: Charges::WhenOver,
        ..check
    }
}

/// Limits that take charges: hits over the limit are recorded (by a fixed
/// window in full, by the others up to a count of twice the limit), so the
/// next check is refused until the overrun has been repaid; a check (hits
/// 0) consumes nothing.
fn charges() -> Vec<Step> {
    let fw = |hits| charged(c("fwc", 10, hits));
    let sw = |hits| charged(ck(Algorithm::SlidingWindow, "swc", 10, 1_000, 0, hits));
    let sl = |hits| charged(ck(Algorithm::SlidingLog, "slc", 10, 1_000, 0, hits));
    let tb = |hits| charged(ck(Algorithm::TokenBucket, "tbc", 10, 1_000, 10, hits));
    let lb = |hits| charged(ck(Algorithm::LeakyBucket, "lbc", 2, 1_000, 2, hits));
    vec![
        s(0, vec![fw(0)], vec![o(false, 10, 1000)], "fw: check only"),
        s(0, vec![fw(15)], vec![charged_over(10, 1000)], "fw: 15 recorded"),
        s(
            100,
            vec![fw(0)],
            vec![o(true, 0, 900)],
            "fw: next check refused",
        ),
        s(
            100,
            vec![fw(10)],
            vec![charged_over(0, 900)],
            "fw: all 10 recorded: 25 (no bound but the window's end)",
        ),
        s(
            100,
            vec![charged(c("fwc", 100, 0))],
            vec![o(false, 75, 900)],
            "fw: the same counter under a limit of 100 (a `limit` override's): 25 counted",
        ),
        s(
            1000,
            vec![fw(0)],
            vec![o(false, 10, 1000)],
            "fw: a new window",
        ),
        s(
            0,
            vec![sw(15)],
            vec![charged_over(10, 1334)],
            "sw: 15 recorded; one more hit fits once they weigh 9: floor(15 x 666 / 1000), at 1,334",
        ),
        s(
            1200,
            vec![sw(0)],
            vec![o(true, 0, 134)],
            "sw: 15 x 0.8 = 12 still count, 9 at 1,334",
        ),
        s(
            1500,
            vec![sw(0)],
            vec![o(false, 3, 500)],
            "sw: 15 x 0.5 = 7: 3 left",
        ),
        s(2000, vec![sl(4)], vec![o(false, 6, 1000)], "sl: 4 admitted"),
        s(
            2100,
            vec![sl(9)],
            vec![charged_over(6, 900)],
            "sl: 9 recorded: 13, one hit fits once the 4 age out",
        ),
        s(
            2500,
            vec![sl(0)],
            vec![o(true, 0, 500)],
            "sl: next check refused",
        ),
        s(
            3000,
            vec![sl(0)],
            vec![o(false, 1, 100)],
            "sl: the 4 aged out: 9 held, 1 left",
        ),
        s(
            3000,
            vec![sl(30)],
            vec![charged_over(1, 1000)],
            "sl: 11 recorded (20 at most)",
        ),
        s(4000, vec![tb(0)], vec![o(false, 10, 0)], "tb: full"),
        s(
            4000,
            vec![tb(15)],
            vec![charged_over(10, 600)],
            "tb: a debt of 5 tokens: one back in 600 ms",
        ),
        s(
            4500,
            vec![tb(0)],
            vec![o(true, 0, 100)],
            "tb: next check refused",
        ),
        s(
            4600,
            vec![tb(1)],
            vec![o(false, 0, 1000)],
            "tb: the debt repaid, one admitted",
        ),
        s(
            9000,
            vec![tb(100)],
            vec![charged_over(10, 1100)],
            "tb: 20 recorded: refused 1.1 s, not 10",
        ),
        s(
            9000,
            vec![lb(3)],
            vec![charged_over(2, 1000)],
            "lb: 3 recorded in a queue of 2",
        ),
        s(
            10_000,
            vec![lb(1)],
            vec![o(false, 0, 500)],
            "lb: queued behind the overrun",
        ),
    ]
}

/// Charges under all-or-nothing: a refused request records its charges and
/// nothing else.
fn charges_all_or_nothing() -> Vec<Step> {
    let fw = |key, hits| charged(c(key, 5, hits));
    let when_over = |key, hits| charged_when_over(c(key, 5, hits));
    let tb = |key, hits| ck(Algorithm::TokenBucket, key, 1, 1_000, 1, hits);
    vec![
        s(
            7000,
            vec![fw("ca1", 2), tb("ca2", 2)],
            vec![o(false, 3, 1000), o(true, 1, 0)],
            "the token bucket refuses; the charge is recorded anyway",
        ),
        s(
            7000,
            vec![fw("ca3", 10), tb("ca4", 1)],
            vec![charged_over(5, 1000), o(false, 1, 0)],
            "the charge over its limit is recorded; the admitted token bucket consumes nothing",
        ),
        s(
            7000,
            vec![fw("ca3", 0), tb("ca4", 1)],
            vec![o(true, 0, 1000), o(false, 1, 0)],
            "refused by the recorded charge",
        ),
        s(
            7000,
            vec![fw("cb1", 3), fw("cb2", 6)],
            vec![o(false, 2, 1000), charged_over(5, 1000)],
            "refused by one fixed window: both record (envoyproxy/ratelimit increments every key)",
        ),
        s(
            7000,
            vec![when_over("cc1", 3), when_over("cc2", 6)],
            vec![o(false, 5, 1000), charged_over(5, 1000)],
            "when over only: the window taken over its limit records, the one that fitted is spared",
        ),
        s(
            7000,
            vec![when_over("cc1", 5), when_over("cc2", 0)],
            vec![o(false, 5, 1000), o(true, 0, 1000)],
            "the spared window still has all 5; the other is over (and records nothing more)",
        ),
        s(
            7000,
            vec![when_over("cc3", 2), when_over("cc4", 2)],
            vec![o(false, 3, 1000), o(false, 3, 1000)],
            "admitted: both count",
        ),
        // Not all or nothing (Envoy's count-everything, upstream's only
        // way): what fits counts, but a window spares what it fitted
        // whenever the request is refused, as envoyproxy/ratelimit does.
        Step {
            all_or_nothing: false,
            ..s(
                7000,
                vec![
                    when_over("cd1", 3),
                    when_over("cd2", 6),
                    c("cd3", 5, 1),
                    fw("cd4", 2),
                ],
                vec![
                    o(false, 5, 1000),
                    charged_over(5, 1000),
                    o(false, 4, 1000),
                    o(false, 3, 1000),
                ],
                "count-everything, refused: the window that fitted is spared, the others count",
            )
        },
        Step {
            all_or_nothing: false,
            ..s(
                7000,
                vec![
                    when_over("cd1", 0),
                    c("cd3", 5, 0),
                    fw("cd4", 0),
                ],
                vec![o(false, 5, 1000), o(false, 4, 1000), o(false, 3, 1000)],
                "cd1 still has all 5; cd3 and cd4 kept their hits",
            )
        },
        Step {
            all_or_nothing: false,
            ..s(
                7000,
                vec![when_over("ce3", 2), tb("ce4", 2)],
                vec![o(false, 5, 1000), o(true, 1, 0)],
                "count-everything, refused by a token bucket: the window is spared",
            )
        },
    ]
}

#[tokio::test]
async fn every_algorithm_agrees_on_every_store() {
    let tables = [
        ("fixed_window", fixed_window()),
        ("sliding_window", sliding_window()),
        ("sliding_log", sliding_log()),
        ("token_bucket", token_bucket()),
        ("leaky_bucket", leaky_bucket()),
        ("mixed", mixed()),
        ("charges", charges()),
        ("charges_all_or_nothing", charges_all_or_nothing()),
    ];
    for backend in Backend::all() {
        for (name, table) in &tables {
            run_table(&backend, name, table).await;
        }
    }
}

/// Runs `table` on a fresh store of `backend`, its clock pinned from a start
/// on a minute boundary (so every window in the table is aligned).
async fn run_table(backend: &Backend, name: &str, table: &[Step]) {
    let start = 1_800_000_000_000u64;
    let clock = Arc::new(ManualClock::new(start));
    let store = backend.store(clock.clone());
    for (i, step) in table.iter().enumerate() {
        clock.set(start + step.at);
        let got = store
            .apply(&step.checks, step.all_or_nothing)
            .await
            .expect("store");
        assert_eq!(
            got,
            step.expect,
            "{} {name} step {i}: {}",
            backend.name(),
            step.why
        );
    }
}

/// The charges' table (one key per request) on a Redis Cluster as well.
#[tokio::test]
async fn charges_agree_on_a_redis_cluster() {
    let cluster = Backend::Cluster(common::RedisCluster::start(3, 0));
    run_table(&cluster, "charges", &charges()).await;
}

#[tokio::test]
async fn redis_counters_always_carry_a_ttl() {
    let redis = common::RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000_250));
    let store = redis.store(Some(clock));
    store
        .apply(&[minute(c("ttl", 10, 1)), c("ttl2", 10, 1)], true)
        .await
        .unwrap();
    // Refused and check-only requests write nothing.
    store.apply(&[c("refused", 1, 5)], true).await.unwrap();
    store.apply(&[c("checked", 1, 0)], true).await.unwrap();
    let mut conn = redis.client().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in keys {
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
        let max = if key.contains("|ttl}") { 59_750 } else { 750 };
        assert!(ttl > 0 && ttl <= max, "{key} has PTTL {ttl}");
    }
}

#[tokio::test]
async fn redis_window_counters_get_their_expiry_once_per_window() {
    // The save that begins a window sets the key to expire at the window's
    // end (sliding: one window later); later hits in that window leave the
    // expiry alone, and the next window sets it again.
    let redis = common::RedisServer::start();
    let start = 1_800_000_000_250;
    let clock = Arc::new(ManualClock::new(start));
    let store = redis.store(Some(clock.clone()));
    let checks = [
        c("fw", 10, 1),
        ck(Algorithm::SlidingWindow, "sw", 10, 1_000, 0, 1),
    ];
    let mut conn = redis.client().get_connection().unwrap();
    let pttl = |conn: &mut redis::Connection, check: &Check| -> i64 {
        redis::cmd("PTTL").arg(&check.key).query(conn).unwrap()
    };
    // (ms after start, fixed-window remaining, PEXPIREs so far, PTTLs)
    for (at, remaining, pexpires, fw_ttl, sw_ttl) in [
        (0, 9, 2, 750, 1_750),
        (500, 8, 2, 750, 1_750),
        (1_100, 9, 4, 650, 1_650),
    ] {
        clock.set(start + at);
        let got = store.apply(&checks, true).await.unwrap();
        assert_eq!(got[0].remaining, remaining, "at +{at} ms");
        assert_eq!(command_calls(&mut conn, "pexpire"), pexpires, "at +{at} ms");
        // Redis's own clock moved by a few ms meanwhile, not by `at`.
        let (fw, sw) = (pttl(&mut conn, &checks[0]), pttl(&mut conn, &checks[1]));
        assert!(
            fw <= fw_ttl && fw > fw_ttl - 100,
            "at +{at} ms: fw PTTL {fw}"
        );
        assert!(
            sw <= sw_ttl && sw > sw_ttl - 100,
            "at +{at} ms: sw PTTL {sw}"
        );
    }
}

/// A sliding log stores one sorted-set member per call that admitted hits,
/// whatever its hits: a limit of 3,000,000 per hour and three requests of a
/// million hits each (plus one refused) leave 3 members and Redis's memory
/// where it was (one member per hit, they left 3,000,000 members and some
/// 300 MB, and each request blocked Redis for about half a second).
#[tokio::test]
async fn a_sliding_log_request_is_one_member_whatever_its_hits() {
    let redis = common::RedisServer::start();
    let start = 1_800_000_000_000;
    let clock = Arc::new(ManualClock::new(start));
    let store = redis.store(Some(clock.clone()));
    let mut conn = redis.client().get_connection().unwrap();
    let used_memory = |conn: &mut redis::Connection| -> u64 {
        let info: String = redis::cmd("INFO").arg("memory").query(conn).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory in INFO memory")
    };
    let big = |hits| ck(Algorithm::SlidingLog, "llm", 3_000_000, 3_600_000, 0, hits);
    // A first call loads the limiter, whose memory is not the log's.
    store.apply(&[big(0)], true).await.unwrap();
    let before = used_memory(&mut conn);
    for (at, remaining) in [(0, 2_000_000), (1, 1_000_000), (2, 0)] {
        clock.set(start + at);
        let got = store.apply(&[big(1_000_000)], true).await.unwrap();
        assert_eq!(got, vec![o(false, remaining, 3_600_000)], "at +{at} ms");
    }
    let got = store.apply(&[big(1_000_000)], true).await.unwrap();
    assert_eq!(got, vec![o(true, 0, 3_599_998)]);
    let members: u64 = redis::cmd("ZCARD")
        .arg(&big(1).key)
        .query(&mut conn)
        .unwrap();
    assert_eq!(members, 3);
    let grown = used_memory(&mut conn).saturating_sub(before);
    assert!(grown < 100_000, "Redis used {grown} bytes more");
}

/// Aged-out entries are dropped at most 64 per call, so a key idle for a
/// period after many requests never stalls Redis with one long removal; the
/// ones left count for nothing, running totals continue past them, and the
/// time until enough hits age out is still found among the ones in the
/// period.
#[tokio::test]
async fn a_sliding_log_drops_aged_out_entries_a_few_at_a_time() {
    let redis = common::RedisServer::start();
    let start = 1_800_000_000_000u64;
    let store = redis.store(Some(Arc::new(ManualClock::new(start))));
    let mut conn = redis.client().get_connection().unwrap();
    let sl = |key: &str, hits| ck(Algorithm::SlidingLog, key, 10, 1_000, 0, hits);
    // 100 requests of one hit each, aged out; on `busy` one of 3 hits since.
    for key in ["idle", "busy"] {
        let mut seed = redis::cmd("ZADD");
        seed.arg(sl(key, 1).key);
        for i in 1..=100u64 {
            seed.arg(start - 5_000 + i).arg(format!("{i:016}:1"));
        }
        if key == "busy" {
            seed.arg(start - 500).arg("0000000000000103:3");
        }
        let _: u64 = seed.query(&mut conn).unwrap();
    }
    let zcard = |conn: &mut redis::Connection, key: &str| -> u64 {
        redis::cmd("ZCARD").arg(sl(key, 1).key).query(conn).unwrap()
    };
    let members = |conn: &mut redis::Connection, key: &str| -> Vec<String> {
        redis::cmd("ZRANGE")
            .arg(sl(key, 1).key)
            .arg(0)
            .arg(-1)
            .query(conn)
            .unwrap()
    };
    // idle: all aged out.
    let got = store.apply(&[sl("idle", 1)], true).await.unwrap();
    assert_eq!(got, vec![o(false, 9, 1000)]);
    assert_eq!(zcard(&mut conn, "idle"), 100 - 64 + 1);
    let got = store.apply(&[sl("idle", 1)], true).await.unwrap();
    assert_eq!(got, vec![o(false, 8, 1000)]);
    assert_eq!(
        members(&mut conn, "idle"),
        ["0000000000000101:1", "0000000000000102:1"]
    );
    // busy: over, 8 fit once the 3 has aged out (found past 36 aged out).
    let got = store.apply(&[sl("busy", 8)], true).await.unwrap();
    assert_eq!(got, vec![o(true, 7, 500)]);
    assert_eq!(zcard(&mut conn, "busy"), 100 - 64 + 1);
    let got = store.apply(&[sl("busy", 1)], true).await.unwrap();
    assert_eq!(got, vec![o(false, 6, 1000)]);
    assert_eq!(
        members(&mut conn, "busy"),
        ["0000000000000103:3", "0000000000000104:1"]
    );
    let got = store.apply(&[sl("busy", 7)], true).await.unwrap();
    assert_eq!(got, vec![o(true, 6, 500)]);
}

/// Running totals near 2^52 are rebased before they could lose precision in
/// Lua's doubles: the entries in the period are rewritten from 0, and the
/// decisions do not change.
#[tokio::test]
async fn a_sliding_log_rebases_running_totals_before_they_lose_precision() {
    let redis = common::RedisServer::start();
    let start = 1_800_000_000_000u64;
    let store = redis.store(Some(Arc::new(ManualClock::new(start))));
    let mut conn = redis.client().get_connection().unwrap();
    let sl = |hits| ck(Algorithm::SlidingLog, "rebase", 10, 1_000, 0, hits);
    let key = sl(1).key;
    let _: u64 = redis::cmd("ZADD")
        .arg(&key)
        .arg(start - 2_000)
        .arg("4503599627370470:20")
        .arg(start - 500)
        .arg("4503599627370494:4")
        .query(&mut conn)
        .unwrap();
    let got = store.apply(&[sl(5)], true).await.unwrap();
    assert_eq!(got, vec![o(false, 1, 1000)]);
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query(&mut conn)
        .unwrap();
    assert_eq!(members, ["0000000000000004:4", "0000000000000009:5"]);
    let got = store.apply(&[sl(2)], true).await.unwrap();
    assert_eq!(got, vec![o(true, 1, 500)], "2 fit once the 4 aged out");
}

#[tokio::test]
async fn redis_joins_requests_in_flight_into_few_calls_each_all_or_nothing() {
    let redis = common::RedisServer::start();
    let store = redis.store(Some(Arc::new(ManualClock::new(1_800_000_000_000))));
    let mut conn = redis.client().get_connection().unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut conn)
        .unwrap();
    // 100 requests at once, each on a shared counter (30 fit) and its own.
    let requests: Vec<Vec<Check>> = (0..100)
        .map(|i| vec![c("shared", 30, 1), c(&format!("own{i}"), 5, 1)])
        .collect();
    let answers =
        futures_util::future::join_all(requests.iter().map(|checks| store.apply(checks, true)))
            .await;
    let mut left_on_shared = Vec::new();
    for answer in answers {
        let outcome = answer.expect("store");
        if !outcome[0].over {
            assert_eq!(outcome[1], o(false, 4, 1000), "its own counter, once");
            left_on_shared.push(outcome[0].remaining);
        }
    }
    // Each request saw the ones before it, within a call and across calls.
    left_on_shared.sort_unstable();
    assert_eq!(left_on_shared, (0..30).collect::<Vec<u64>>());
    // Refused requests wrote nothing, not even their own counters.
    let keys: Vec<String> = redis::cmd("KEYS").arg("*own*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 30, "{keys:?}");
    let calls = limiter_calls(&mut conn);
    assert!(
        calls <= 20,
        "100 requests in flight together took {calls} script calls"
    );
}

#[tokio::test]
async fn redis_limiter_is_reloaded_after_function_flush_and_script_flush() {
    let redis = common::RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let mut conn = redis.client().get_connection().unwrap();
    for (functions, flush) in [(true, "FUNCTION"), (false, "SCRIPT")] {
        let store = redis.store_with(Some(clock.clone()), functions);
        let key = format!("after-{flush}-flush");
        assert!(!store.apply(&[c(&key, 5, 1)], true).await.unwrap()[0].over);
        let _: () = redis::cmd(flush).arg("FLUSH").query(&mut conn).unwrap();
        let after = store.apply(&[c(&key, 5, 1)], true).await.unwrap();
        assert_eq!(
            after[0].remaining, 3,
            "{flush} FLUSH: the counter survived, the limiter was reloaded"
        );
    }
    assert!(command_calls(&mut conn, "fcall") >= 2);
    assert!(command_calls(&mut conn, "evalsha") >= 2);
}

/// A Redis 7 with FCALL and FUNCTION renamed away: as Redis before 7.0
/// answers them, unknown commands.
fn redis_without_functions() -> common::RedisServer {
    common::RedisServer::spawn_free(&[
        "--rename-command",
        "FCALL",
        "",
        "--rename-command",
        "FUNCTION",
        "",
    ])
}

/// Redis before 7.0 has no functions; neither has one whose FUNCTION and
/// FCALL commands are renamed away (as here) or denied by ACL. The limiter
/// then runs as a script, with the same answers.
#[tokio::test]
async fn redis_without_functions_runs_the_limiter_as_a_script() {
    let redis = redis_without_functions();
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let store = redis.store(Some(clock));
    store.warm_up().await.unwrap();
    // The warm-up's probe calls the limiter too (with no checks).
    let mut conn = redis.client().get_connection().unwrap();
    let warm_up = command_calls(&mut conn, "evalsha");
    for left in (0..5).rev() {
        let out = store.apply(&[c("no-functions", 5, 1)], true).await.unwrap();
        assert_eq!((out[0].over, out[0].remaining), (false, left));
    }
    assert!(store.apply(&[c("no-functions", 5, 1)], true).await.unwrap()[0].over);
    assert_eq!(command_calls(&mut conn, "evalsha"), warm_up + 6);
}

/// A user whom ACL denies `FCALL` and `FUNCTION` gets the limiter as a
/// script. A user denied a key is refused for that key, and keeps calling
/// the limiter as a function (the refusal is not taken for a lack of
/// functions).
#[tokio::test]
async fn acl_users_without_functions_get_a_script_and_without_a_key_a_refusal() {
    use ratekeeper::store::{RedisSettings, RedisStore, Store};

    let redis = common::RedisServer::start();
    let mut admin = redis.client().get_connection().unwrap();
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let mut store_of = |user: &str, rules: &[&str]| {
        let _: () = redis::cmd("ACL")
            .arg(&["SETUSER", user, "on", ">pw", "+@all"])
            .arg(rules)
            .query(&mut admin)
            .unwrap();
        let settings = RedisSettings {
            url: format!("redis://{user}:pw@127.0.0.1:{}", redis.port),
            connections: 1,
            ..redis.settings(true)
        };
        let store = RedisStore::new(&settings, Some(clock.clone())).unwrap();
        Store::Redis(Arc::new(store))
    };
    let no_functions = store_of("nofn", &["~*", "-fcall", "-function"]);
    let one_key = store_of("onekey", &["~rk:{t|mine}*"]);
    no_functions.warm_up().await.unwrap();
    one_key.warm_up().await.unwrap();

    let out = no_functions.apply(&[c("a", 5, 2)], true).await.unwrap();
    assert_eq!((out[0].over, out[0].remaining), (false, 3));
    let refused = one_key.apply(&[c("theirs", 5, 1)], true).await.unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("no permissions to access one of the keys"),
        "{refused}"
    );
    let (fcalls, evalshas) = (
        command_calls(&mut admin, "fcall"),
        command_calls(&mut admin, "evalsha"),
    );
    let out = one_key.apply(&[c("mine", 5, 1)], true).await.unwrap();
    assert_eq!((out[0].over, out[0].remaining), (false, 4));
    assert_eq!(command_calls(&mut admin, "fcall"), fcalls + 1);
    assert_eq!(command_calls(&mut admin, "evalsha"), evalshas);
}

/// The function library keeps its memo of parsed arguments across calls,
/// bounded: 20,000 calls whose hits all differ leave Redis's function memory
/// about where it was (unbounded, the memo would hold every one, > 2 MB).
#[test]
fn the_function_library_does_not_grow_with_distinct_arguments() {
    use ratekeeper::store::limiter_script::LimiterScript;

    let redis = common::RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let limiter = LimiterScript::new(true);
    common::load_limiter_library(&mut conn);
    let vm_memory = |conn: &mut redis::Connection| -> u64 {
        let info: String = redis::cmd("INFO").arg("memory").query(conn).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory_vm_functions:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory_vm_functions in INFO memory")
    };
    let call = |hits: u64| {
        let check = Check {
            hits,
            ..c("memo", 1_000_000_000, 1)
        };
        limiter.command("1800000000000", std::iter::once((true, [check].iter())))
    };
    let _: Packed = call(1).query(&mut conn).unwrap();
    let before = vm_memory(&mut conn);
    let mut pipe = redis::pipe();
    for hits in 2..20_002 {
        pipe.add_command(call(hits)).ignore();
    }
    let _: () = pipe.query(&mut conn).unwrap();
    let after = vm_memory(&mut conn);
    assert!(
        after < before + 1_000_000,
        "function memory grew from {before} to {after} bytes"
    );
}

/// Malformed limiter arguments get an error reply, in both forms of the
/// limiter, and leave every counter of the call as it was: an unknown
/// algorithm, a field missing or not a count, a flag out of range, more
/// checks than were sent.
#[test]
fn the_limiter_refuses_malformed_arguments_and_saves_nothing() {
    use ratekeeper::store::limiter_script::TEXT;

    let redis = common::RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let function = common::load_limiter_library(&mut conn);
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(TEXT)
        .query(&mut conn)
        .unwrap();
    let keys = ["rk:{bad|a}:fw.1000", "rk:{bad|b}:fw.1000"];
    let good = "fw 5 1000 0 1 1 0";
    let mut call = |by: &str, args: &[&str]| -> redis::RedisResult<Vec<i64>> {
        let mut cmd = redis::cmd(by);
        cmd.arg(if by == "FCALL" { &function } else { &sha });
        cmd.arg(keys.len()).arg(&keys[..]).arg("1800000000000");
        cmd.arg(args).query::<Packed>(&mut conn).map(|p| p.0)
    };
    let malformed: [&[&str]; 8] = [
        &["1 0", good, "1 0", "xx 5 1000 0 1 1 0"],
        &["1 0", good, "1 0", "fw 5 1000 0 1 1"],
        &["1 0", good, "1 0", "fw 5 -1000 0 1 1 0"],
        &["1 0", good, "1 0", "fw 5 1000 0 1 1 3"],
        &["1 0", good, "1 6", good],
        &["1 0", good, "one 0", good],
        &["1 0", good, "2 0", good],
        &["2 1", good],
    ];
    for by in ["FCALL", "EVALSHA"] {
        for args in malformed {
            let error = call(by, args).expect_err("malformed arguments were decided");
            assert_eq!(
                (error.code(), error.detail()),
                (Some("ERR"), Some("malformed limiter arguments")),
                "{by} {args:?}: {error}"
            );
        }
    }
    let exists: u64 = redis::cmd("EXISTS")
        .arg(&keys[..])
        .query(&mut redis.client().get_connection().unwrap())
        .unwrap();
    assert_eq!(exists, 0, "a refused call saved a counter");
    let decided = call("FCALL", &["1 0", good, "1 0", good]).unwrap();
    assert_eq!(decided, [0, 4, 1000, 0, 4, 1000]);
}

/// Without warm-up (Redis was down when ratekeeper started), the first call
/// finds out that Redis has no functions and is made again as a script.
#[tokio::test]
async fn without_warm_up_the_first_call_falls_back_to_a_script() {
    let redis = redis_without_functions();
    let store = redis.store(Some(Arc::new(ManualClock::new(1_800_000_000_000))));
    let out = store.apply(&[c("cold", 5, 2)], true).await.unwrap();
    assert_eq!((out[0].over, out[0].remaining), (false, 3));
}

#[tokio::test]
async fn redis_reads_its_own_clock_when_none_is_pinned() {
    let redis = common::RedisServer::start();
    let store = redis.store(None);
    let out = store
        .apply(&[minute(c("clock", 5, 1))], true)
        .await
        .unwrap();
    assert!(!out[0].over && out[0].remaining == 4, "{out:?}");
    assert!(out[0].reset_ms > 0 && out[0].reset_ms <= 60_000, "{out:?}");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let expected = 60_000 - now_ms % 60_000;
    let skew = expected.abs_diff(out[0].reset_ms);
    assert!(
        !(2_000..=58_000).contains(&skew),
        "reset {} vs expected {expected}",
        out[0].reset_ms
    );
}

/// Concurrency leases: the same steps on every store (on the cluster the
/// user and org sets live in different slots).
#[tokio::test]
async fn leases_agree_on_every_store() {
    use ratekeeper::store::{LeaseRef, LeaseSlot};
    let start = 1_800_000_000_000u64;
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let clock = Arc::new(ManualClock::new(start));
        let store = backend.store(clock.clone());
        let user = |limit| LeaseSlot {
            key: "rk:{t|user=u}:conn".into(),
            limit,
        };
        let org = |limit| LeaseSlot {
            key: "rk:{t|org=o}:conn".into(),
            limit,
        };
        let keys = |slots: &[LeaseSlot]| slots.iter().map(|s| s.key.clone()).collect::<Vec<_>>();
        let both = [user(2), org(3)];
        let both_keys = keys(&both);

        let a = store.acquire(&both, "a", "", 10_000).await.unwrap();
        assert_eq!((a.granted, a.active.clone()), (true, vec![1, 1]), "{name}");
        clock.advance(1_000);
        let b = store.acquire(&both, "b", "", 10_000).await.unwrap();
        assert_eq!((b.granted, b.active.clone()), (true, vec![2, 2]), "{name}");
        // The user set is full: refused everywhere, the org set untouched.
        let c = store.acquire(&both, "c", "", 10_000).await.unwrap();
        // (On a cluster, sets in slots after the refusing one are not asked.)
        assert_eq!(
            (c.granted, c.active[0], c.retry_after_ms),
            (false, 2, 9_000),
            "{name}"
        );
        let org_only = store.acquire(&[org(3)], "d", "", 10_000).await.unwrap();
        assert_eq!(
            (org_only.granted, org_only.active.clone()),
            (true, vec![3]),
            "{name}: c took no org place"
        );

        // Heartbeat extends a; b lapses.
        clock.advance(8_000);
        let lease = |member, keys| LeaseRef {
            member,
            ttl_ms: 10_000,
            keys,
        };
        assert_eq!(
            store.heartbeat(&[lease("a", &both_keys)]).await.unwrap(),
            vec![true],
            "{name}"
        );
        clock.advance(2_000);
        assert_eq!(
            store
                .heartbeat(&[
                    lease("a", &both_keys),
                    lease("b", &both_keys),
                    lease("zz", &both_keys)
                ])
                .await
                .unwrap(),
            vec![true, false, false],
            "{name}: b expired, zz never existed"
        );
        // b's expiry freed its place: expired leases are dropped on acquire.
        let e = store.acquire(&[user(2)], "e", "", 10_000).await.unwrap();
        assert_eq!((e.granted, e.active.clone()), (true, vec![2]), "{name}");
        // Release is idempotent and frees the place at once.
        let user_keys = keys(&[user(2)]);
        store.release(&[lease("e", &user_keys)]).await.unwrap();
        store.release(&[lease("e", &user_keys)]).await.unwrap();
        let f = store.acquire(&[user(2)], "f", "", 10_000).await.unwrap();
        assert!(f.granted, "{name}");
        assert_eq!(
            store.heartbeat(&[lease("e", &user_keys)]).await.unwrap(),
            vec![false],
            "{name}"
        );
    }
}

#[tokio::test]
async fn cluster_requests_across_slots_are_atomic_per_slot() {
    let cluster = common::RedisCluster::start(3, 0);
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let store = cluster.store(Some(clock));
    let (a, b) = (c("slot-a", 5, 1), c("slot-b", 1, 2));
    assert_ne!(
        ratekeeper::keys::cluster_slot(&a.key),
        ratekeeper::keys::cluster_slot(&b.key),
        "the two keys must live in different slots"
    );
    // b refuses; a lives in another slot, so its own call consumed.
    let out = store.apply(&[a.clone(), b.clone()], true).await.unwrap();
    assert_eq!(out, vec![o(false, 4, 1000), o(true, 1, 1000)]);
    // Both fit: both answered from their own slot.
    let out = store.apply(&[a, c("slot-b", 1, 1)], true).await.unwrap();
    assert_eq!(out, vec![o(false, 3, 1000), o(false, 0, 1000)]);
}

/// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` (`Charges::WhenOver`): a
/// refused request spares the fixed windows it fitted, on a cluster too
/// when its checks live in different hash slots (a dry run in every slot
/// first). Before, the slot of the fitted check never learnt of the
/// refusal: each refused request took a user's hit, and locked the user
/// out for the rest of the window.
#[tokio::test]
async fn stop_cache_spares_fitted_windows_across_hash_slots() {
    let when_over = |key: &str| Check {
        charges: Charges::WhenOver,
        ..ck(Algorithm::FixedWindow, key, 2, 3_600_000, 0, 1)
    };
    let (user, route) = (when_over("user"), when_over("route"));
    assert_ne!(
        ratekeeper::keys::cluster_slot(&user.key),
        ratekeeper::keys::cluster_slot(&route.key),
        "the two keys must live in different slots"
    );
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let store = backend.store(Arc::new(ManualClock::new(1_800_000_000_000)));
        for _ in 0..2 {
            store
                .apply(std::slice::from_ref(&route), false)
                .await
                .unwrap();
        }
        for all_or_nothing in [false, true, false] {
            let out = store
                .apply(&[user.clone(), route.clone()], all_or_nothing)
                .await
                .unwrap();
            assert!(!out[0].over && out[1].over, "{name}: {out:?}");
            assert_eq!(out[0].remaining, 2, "{name}: the user's hit spared");
        }
        let out = store
            .apply(std::slice::from_ref(&user), false)
            .await
            .unwrap();
        assert_eq!(out[0].remaining, 1, "{name}: only this hit counted");
    }
}

/// The admin API's reset of a bucket with reservations pending on it: what
/// it had queued counts as given back ahead of every reservation, so one
/// made before the reset, settled after it, gives back nothing of hits that
/// drained. (The give-backs stayed as they were while the TAT fell to now:
/// a settle after the reset gave back 80 hits another reservation held.)
#[tokio::test]
async fn a_reset_bucket_gives_back_nothing_that_drained() {
    use ratekeeper::store::{Settled, Store};
    // 100 a second: 10 ms a hit; a burst of 1,000.
    let check = |hits| ck(Algorithm::TokenBucket, "reset", 100, 1_000, 1_000, hits);
    let key = [check(1).key];
    async fn reserve(ledger: &common::Ledger, store: &Store, check: Check, nonce: &str) -> bool {
        let reserved = ledger.reserve(store, &[check], nonce, 60_000).await;
        reserved.unwrap().granted
    }
    /// The bucket's backlog (ms) once `nonce` is settled at 0.
    async fn backlog_after_settling(ledger: &common::Ledger, store: &Store, nonce: &str) -> u64 {
        match ledger.settle(store, nonce, 0).await.unwrap() {
            Settled::Settled { outcomes } => outcomes[0].reset_ms,
            other => panic!("{nonce} not settled: {other:?}"),
        }
    }
    for backend in Backend::all() {
        let name = backend.name();
        let clock = Arc::new(ManualClock::new(1_800_000_000_000));
        let store = backend.store(clock.clone());
        let ledger = &common::Ledger::default();
        assert!(reserve(ledger, &store, check(500), "r0").await, "{name}");
        assert!(reserve(ledger, &store, check(100), "r1").await, "{name}");
        backlog_after_settling(ledger, &store, "r1").await;
        store.delete(&key).await.unwrap();
        assert!(reserve(ledger, &store, check(100), "r2").await, "{name}");
        assert!(reserve(ledger, &store, check(100), "r3").await, "{name}");
        // r2's hits drained; r3 has 800 ms of its 1,000 to go.
        clock.advance(1_200);
        let backlog = backlog_after_settling(ledger, &store, "r2").await;
        assert_eq!(backlog, 800, "{name}: r3's queue kept");
        // r0, from before the reset, drained too.
        let backlog = backlog_after_settling(ledger, &store, "r0").await;
        assert_eq!(backlog, 800, "{name}: r0 gives nothing back");
    }
}

/// The id of the cluster node serving `slot`, and that node (from `CLUSTER
/// NODES`: `<id> <ip:port@bus> <flags> ... <slot ranges>`).
fn slot_owner(cluster: &common::RedisCluster, slot: u16) -> (String, &common::RedisServer) {
    let mut conn = cluster.nodes[0].client().get_connection().unwrap();
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut conn).unwrap();
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let serves = fields.iter().skip(8).any(|range| {
            let (from, to) = range.split_once('-').unwrap_or((range, range));
            matches!((from.parse::<u16>(), to.parse::<u16>()), (Ok(f), Ok(t)) if (f..=t).contains(&slot))
        });
        let port = fields[1].split(['@', ':']).nth(1).unwrap();
        if serves {
            let node = cluster.nodes.iter().find(|n| n.port.to_string() == port);
            return (fields[0].to_string(), node.unwrap());
        }
    }
    panic!("no node serves slot {slot}");
}

/// A node's cluster id.
fn node_id(node: &common::RedisServer) -> String {
    let mut conn = node.client().get_connection().unwrap();
    redis::cmd("CLUSTER").arg("MYID").query(&mut conn).unwrap()
}

/// One `CLUSTER SETSLOT <slot> <how> [id]` on `node`.
fn set_slot(node: &common::RedisServer, slot: u16, how: &[&str]) {
    let mut conn = node.client().get_connection().unwrap();
    let _: () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg(how)
        .query(&mut conn)
        .unwrap();
}

/// Starts moving `slot` from `from` to `to` and migrates its keys: `from`
/// then answers ASK for them. `finish` assigns the slot to `to` on every
/// node, as `redis-cli --cluster reshard` ends a move.
fn migrate_slot(
    cluster: &common::RedisCluster,
    slot: u16,
    from: (&str, &common::RedisServer),
    to: (&str, &common::RedisServer),
    finish: bool,
) {
    set_slot(to.1, slot, &["IMPORTING", from.0]);
    set_slot(from.1, slot, &["MIGRATING", to.0]);
    let mut conn = from.1.client().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(100)
        .query(&mut conn)
        .unwrap();
    assert!(!keys.is_empty(), "nothing to migrate in slot {slot}");
    let _: () = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(to.1.port)
        .arg("")
        .arg(0)
        .arg(5_000)
        .arg("KEYS")
        .arg(&keys)
        .query(&mut conn)
        .unwrap();
    if finish {
        for node in &cluster.nodes {
            set_slot(node, slot, &["NODE", to.0]);
        }
    }
}

/// During resharding a call can be redirected more than once: the slot
/// moved since the client last read the topology (MOVED), and it is being
/// moved again (ASK). Each redirect means the script did not run, so it is
/// followed, within the call's deadline; the count goes on where the keys
/// went. (With one redirect allowed, the second came back as an error.)
#[tokio::test]
async fn a_call_redirected_twice_during_resharding_is_answered() {
    let cluster = common::RedisCluster::start(3, 0);
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let store = cluster.store(Some(clock));
    let check = ck(Algorithm::FixedWindow, "resharded", 10, 3_600_000, 0, 1);
    let slot = ratekeeper::keys::cluster_slot(&check.key);
    let out = store
        .apply(std::slice::from_ref(&check), true)
        .await
        .unwrap();
    assert_eq!(out, vec![o(false, 9, 3_600_000)]);

    let (a_id, a) = slot_owner(&cluster, slot);
    let others: Vec<_> = cluster.nodes.iter().filter(|n| n.port != a.port).collect();
    let (b, c_node) = (others[0], others[1]);
    let (b_id, c_id) = (node_id(b), node_id(c_node));
    // The store still thinks A serves the slot; it is B's now, and on its
    // way to C.
    migrate_slot(&cluster, slot, (&a_id, a), (&b_id, b), true);
    migrate_slot(&cluster, slot, (&b_id, b), (&c_id, c_node), false);

    let out = store.apply(std::slice::from_ref(&check), true).await;
    assert_eq!(out.unwrap(), vec![o(false, 8, 3_600_000)]);
}

/// A key of the random runs below: its algorithm, limit, period, burst and
/// what it records over its limit.
type KeySpec = (Algorithm, u64, u64, u64, Charges);
/// A request: all-or-nothing, and its checks as (key index, hits, enforce).
type Request = (bool, Vec<(usize, u64, bool)>);

fn key_specs() -> impl Strategy<Value = Vec<KeySpec>> {
    let algorithm = prop::sample::select(vec![
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
    ]);
    // Limits dividing the periods into multiples of 250 ms, and times on
    // that grid: every TTL Redis is given is then at least 250 ms of real
    // time, far more than a run takes, so Redis never expires a key that
    // the pinned clock still counts.
    let limit = prop::sample::select(vec![1u64, 2, 4]);
    let period = prop::sample::select(vec![1_000u64, 60_000]);
    let charges = prop::sample::select(vec![Charges::Drop, Charges::Record, Charges::WhenOver]);
    prop::collection::vec((algorithm, limit, period, 0u64..4, charges), 4)
}

fn calls() -> impl Strategy<Value = Vec<(u64, Vec<Request>)>> {
    let check = (0usize..4, 0u64..4, prop::bool::weighted(0.8));
    let request = (prop::bool::ANY, prop::collection::vec(check, 1..4));
    prop::collection::vec((0u64..6, prop::collection::vec(request, 1..12)), 1..5)
}

/// Requests joined into one script call (as the batcher joins requests in
/// flight) get the answers they would get one by one: random requests over
/// four keys of random algorithms, several calls in a row, each call's
/// answers compared with the in-memory store deciding the same requests in
/// the same order, one at a time. Both forms of the limiter, the function
/// (`FCALL`) and the script (`EVALSHA`), run every case.
#[test]
fn one_script_call_decides_its_requests_as_if_they_came_one_by_one() {
    use proptest::test_runner::{Config, TestRunner};
    use ratekeeper::store::{limiter_script::LimiterScript, MemoryStore};

    let redis = common::RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let forms = [LimiterScript::new(true), LimiterScript::new(false)];
    common::load_limiter_library(&mut conn);
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(ratekeeper::store::limiter_script::TEXT)
        .query(&mut conn)
        .unwrap();
    // The runner takes a `Fn`: the connection is borrowed per case.
    let conn = std::cell::RefCell::new(conn);
    let mut runner = TestRunner::new(Config {
        cases: common::proptest_cases(200),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&(key_specs(), calls()), |(specs, calls)| {
        let mut conn = conn.borrow_mut();
        for limiter in &forms {
            let form = if limiter.uses_functions() {
                "FCALL"
            } else {
                "EVALSHA"
            };
            let _: () = redis::cmd("FLUSHDB").query(&mut *conn).unwrap();
            let start = 1_800_000_000_000;
            let clock = Arc::new(ManualClock::new(start));
            let memory = MemoryStore::new(clock.clone());
            let mut now = start;
            for (call, (steps, requests)) in calls.iter().enumerate() {
                now += steps * 250;
                clock.set(now);
                let requests: Vec<(bool, Vec<Check>)> = requests
                    .iter()
                    .map(|(all_or_nothing, checks)| {
                        let checks = checks
                            .iter()
                            .map(|&(k, hits, enforce)| {
                                let (algorithm, limit, period_ms, burst, charges) = specs[k];
                                Check {
                                    enforce,
                                    charges,
                                    ..ck(algorithm, &format!("k{k}"), limit, period_ms, burst, hits)
                                }
                            })
                            .collect();
                        (*all_or_nothing, checks)
                    })
                    .collect();
                let one_by_one: Vec<Outcome> = requests
                    .iter()
                    .flat_map(|(all_or_nothing, checks)| memory.apply(checks, *all_or_nothing))
                    .collect();
                let joined = requests.iter().map(|(a, checks)| (*a, checks.iter()));
                let Packed(reply) = limiter
                    .command(&now.to_string(), joined)
                    .query(&mut *conn)
                    .unwrap();
                let in_one_call =
                    ratekeeper::store::limiter_script::outcomes(&reply, one_by_one.len()).unwrap();
                prop_assert_eq!(in_one_call, one_by_one, "call {} by {}", call, form);
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// What a settle of a budget table must answer.
#[derive(Debug, Clone, Copy)]
enum Answer {
    Now,
    Already(u64),
    Unknown,
}

/// One step of a budget table, on one key.
#[derive(Debug, Clone, Copy)]
enum BudgetOp {
    Reserve {
        nonce: &'static str,
        estimate: u64,
    },
    Settle {
        nonce: &'static str,
        actual: u64,
        answer: Answer,
    },
    /// A plain request of these hits.
    Apply(u64),
}

/// Reserve and settle on one key of `algorithm` (10 per second, a burst of
/// 10 for the buckets), the same steps for every algorithm: settled lower,
/// twice, higher, equal, after the window moved, and never made. Each step
/// is `(at, op, granted, (over, remaining, reset_ms))`; `granted` is for
/// reserves, the outcome is the reserve's or the standing after a settle.
/// Hand-computed per algorithm (the comments give the state after a step).
fn budget_table(algorithm: Algorithm) -> Vec<(u64, BudgetOp, bool, Outcome)> {
    use Algorithm::*;
    use BudgetOp::{Apply, Reserve, Settle};
    let r = |nonce, estimate| Reserve { nonce, estimate };
    let st = |nonce, actual, answer| Settle {
        nonce,
        actual,
        answer,
    };
    let ops = [
        (0, r("a", 6)),
        (0, r("b", 6)),
        (100, st("a", 2, Answer::Now)),
        (100, st("a", 9, Answer::Already(2))),
        (100, r("c", 5)),
        (100, st("c", 8, Answer::Now)),
        (100, r("d", 1)),
        (1500, r("e", 3)),
        (1500, st("e", 3, Answer::Now)),
        (1500, r("f", 2)),
        (2500, Apply(2)),
        (2500, st("never", 0, Answer::Unknown)),
        (2500, st("f", 0, Answer::Now)),
        (2500, st("f", 0, Answer::Already(0))),
    ];
    // The buckets take d (they drained one hit by t = 100); the others refuse it.
    let granted = |i: usize| !matches!(i, 1) && (i != 6 || algorithm.has_burst());
    let expect: [(bool, u64, u64); 14] = match algorithm {
        // count: a 6; 2; c 7; 10 (3 charged); window 1: e 3; f 5; window 2:
        // 2, f's window has passed: nothing back.
        FixedWindow => [
            (false, 4, 1000),
            (true, 4, 1000),
            (false, 8, 900),
            (false, 8, 900),
            (false, 3, 900),
            (true, 0, 900),
            (true, 0, 900),
            (false, 7, 500),
            (false, 7, 500),
            (false, 5, 500),
            (false, 8, 500),
            (false, 0, 0),
            (false, 8, 500),
            (false, 8, 500),
        ],
        // As the fixed window in window 0, but refused until the hits fit
        // (b's 6 once a's 6 weigh 4, at 1,167; one more once the 10 weigh
        // 9, at 1,001); at 1500 the previous 10 weigh 5: e 8, f 10; at 2500
        // the previous 5 weigh 2, +2 = 4; f's 2 come back from the previous
        // window: 3 weigh 1, +2 = 3.
        SlidingWindow => [
            (false, 4, 1000),
            (true, 4, 1167),
            (false, 8, 900),
            (false, 8, 900),
            (false, 3, 900),
            (true, 0, 901),
            (true, 0, 901),
            (false, 2, 500),
            (false, 2, 500),
            (false, 0, 500),
            (false, 6, 500),
            (false, 0, 0),
            (false, 7, 500),
            (false, 7, 500),
        ],
        // Entries (time, hits): a (0, 6) -> (0, 2); c (100, 5) + 3 = 10; at
        // 1500 all aged out: e (1500, 3), f (1501, 2) (its own entry, a ms
        // later); at 2500 e aged out, (2500, 2); f's entry given back.
        SlidingLog => [
            (false, 4, 1000),
            (true, 4, 1000),
            (false, 8, 900),
            (false, 8, 900),
            (false, 3, 1000),
            (true, 0, 900),
            (true, 0, 900),
            (false, 7, 1000),
            (false, 7, 1000),
            (false, 5, 1001),
            (false, 6, 1000),
            (false, 0, 0),
            (false, 8, 1000),
            (false, 8, 1000),
        ],
        // 100 ms per hit; TAT (ms): a 600 -> 200; c 700, 1000 (+3); d 1100;
        // e 1800; f 2000; 2700 at 2500: f drained long ago, nothing back.
        TokenBucket => [
            (false, 4, 600),
            (true, 4, 200),
            (false, 9, 100),
            (false, 9, 100),
            (false, 4, 600),
            (false, 1, 900),
            (false, 0, 1000),
            (false, 7, 300),
            (false, 7, 300),
            (false, 5, 500),
            (false, 8, 200),
            (false, 0, 0),
            (false, 8, 200),
            (false, 8, 200),
        ],
        // The token bucket's TATs; a taken reservation reports its wait.
        LeakyBucket => [
            (false, 4, 0),
            (true, 4, 200),
            (false, 9, 100),
            (false, 9, 100),
            (false, 4, 100),
            (false, 1, 900),
            (false, 0, 900),
            (false, 7, 0),
            (false, 7, 300),
            (false, 5, 300),
            (false, 8, 0),
            (false, 0, 0),
            (false, 8, 200),
            (false, 8, 200),
        ],
    };
    ops.into_iter()
        .zip(expect)
        .enumerate()
        .map(|(i, ((at, op), (over, remaining, reset)))| {
            (at, op, granted(i), o(over, remaining, reset))
        })
        .collect()
}

/// A budget table's check: each algorithm's its own key.
fn budget_check(algorithm: Algorithm, hits: u64) -> Check {
    let burst = if algorithm.has_burst() { 10 } else { 0 };
    let key = format!("budget.{}", algorithm.key_tag());
    ck(algorithm, &key, 10, 1_000, burst, hits)
}

#[tokio::test]
async fn budgets_agree_on_every_store() {
    use ratekeeper::store::Settled;
    let start = 1_800_000_000_000u64;
    for backend in Backend::all_with_cluster() {
        for algorithm in Algorithm::ALL {
            let clock = Arc::new(ManualClock::new(start));
            let store = backend.store(clock.clone());
            let ledger = common::Ledger::default();
            for (i, (at, op, granted, expect)) in budget_table(algorithm).into_iter().enumerate() {
                clock.set(start + at);
                let at = format!("{} {algorithm} step {i} ({op:?})", backend.name());
                match op {
                    BudgetOp::Reserve { nonce, estimate } => {
                        let check = budget_check(algorithm, estimate);
                        let got = ledger
                            .reserve(&store, &[check], nonce, 60_000)
                            .await
                            .expect("reserve");
                        assert_eq!((got.granted, got.outcomes), (granted, vec![expect]), "{at}");
                    }
                    BudgetOp::Settle {
                        nonce,
                        actual,
                        answer,
                    } => {
                        let got = ledger.settle(&store, nonce, actual).await.expect("settle");
                        let want = match answer {
                            Answer::Now => Settled::Settled {
                                outcomes: vec![expect],
                            },
                            Answer::Already(actual) => Settled::Already {
                                actual,
                                outcomes: vec![expect],
                            },
                            Answer::Unknown => Settled::Unknown,
                        };
                        assert_eq!(got, want, "{at}");
                    }
                    BudgetOp::Apply(hits) => {
                        let got = store.apply(&[budget_check(algorithm, hits)], true).await;
                        assert_eq!(got.expect("apply"), vec![expect], "{at}");
                    }
                }
            }
        }
    }
}

/// A fixed window reset (deleted) between a reservation and its settle
/// gives nothing back below zero, on every store: the window counts 0, and
/// on Redis the key the settle's one-command refund (HINCRBY) would have
/// left at -4 with no expiry is a window of 0 expiring at its end.
#[tokio::test]
async fn a_settle_after_a_reset_leaves_an_empty_window() {
    use ratekeeper::store::Settled;
    let start = 1_800_000_000_000u64;
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let clock = Arc::new(ManualClock::new(start));
        let store = backend.store(clock.clone());
        let window = |hits| ck(Algorithm::FixedWindow, "reset", 10, 60_000, 0, hits);
        let reserved = window(6);
        let keys = vec![reserved.key.clone()];
        let ledger = common::Ledger::default();
        let got = ledger
            .reserve(&store, &[reserved], "n", 60_000)
            .await
            .expect("reserve");
        assert!(got.granted, "{name}");
        store.delete(&keys).await.expect("reset");
        clock.set(start + 100);
        let got = ledger.settle(&store, "n", 2).await.expect("settle");
        let empty = Outcome {
            over: false,
            remaining: 10,
            reset_ms: 59_900,
            remaining_before: None,
        };
        assert_eq!(
            got,
            Settled::Settled {
                outcomes: vec![empty]
            },
            "{name}"
        );
        let got = store.apply(&[window(1)], true).await.expect("apply");
        assert_eq!(got[0].remaining, 9, "{name}: the window counts from 0");
        if let Backend::Redis(redis) = &backend {
            let mut conn = redis.client().get_connection().expect("redis");
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&keys[0])
                .query(&mut conn)
                .expect("pttl");
            assert!(
                ttl > 0 && ttl <= 59_900,
                "{name}: expires with its window, PTTL {ttl}"
            );
        }
    }
}

/// A reservation not settled within its TTL stays charged at its estimate:
/// a settle after it is Unknown and gives nothing back, for every
/// algorithm. (Redis expires the marker on its own clock: the test waits the
/// TTL out for real.)
#[tokio::test]
async fn an_expired_reservation_stays_charged_at_its_estimate() {
    use ratekeeper::store::Settled;
    for backend in Backend::all_with_cluster() {
        let name = backend.name();
        let clock = Arc::new(ManualClock::new(1_800_000_000_000));
        let store = backend.store(clock.clone());
        let checks: Vec<Check> = Algorithm::ALL
            .into_iter()
            .map(|algorithm| minute(budget_check(algorithm, 6)))
            .collect();
        let ledger = common::Ledger::default();
        for (i, check) in checks.iter().enumerate() {
            let reserved = ledger
                .reserve(&store, std::slice::from_ref(check), &format!("n{i}"), 200)
                .await
                .unwrap();
            assert!(reserved.granted, "{name} {}", check.algorithm);
        }
        clock.advance(300);
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        for (i, check) in checks.iter().enumerate() {
            let at = format!("{name} {}", check.algorithm);
            let got = ledger.settle(&store, &format!("n{i}"), 0).await.unwrap();
            assert_eq!(got, Settled::Unknown, "{at}");
            let probe = Check {
                hits: 0,
                ..check.clone()
            };
            let left = store.apply(&[probe], true).await.unwrap();
            assert_eq!(left[0].remaining, 4, "{at}: the estimate stays charged");
        }
    }
}

/// 64 reservations at once of 1 against a budget of 10: exactly 10 are
/// granted, on every store.
#[tokio::test]
async fn concurrent_reservations_never_commit_more_than_the_budget() {
    for backend in Backend::all_with_cluster() {
        let clock = Arc::new(ManualClock::new(1_800_000_000_000));
        let store = backend.store(clock);
        let check = minute(c("concurrent", 10, 1));
        let reserves = (0..64).map(|i| {
            let (store, check) = (store.clone(), check.clone());
            tokio::spawn(async move { store.reserve(&[check], &format!("n{i}"), 60_000).await })
        });
        let mut granted = 0;
        for reserve in futures_util::future::join_all(reserves).await {
            granted += usize::from(reserve.expect("task").expect("reserve").granted);
        }
        assert_eq!(granted, 10, "{}", backend.name());
    }
}

/// On a cluster a reservation is taken slot by slot: when a later slot
/// refuses, what the earlier slots took is given back, and every check
/// still gets its outcome.
#[tokio::test]
async fn a_cluster_reservation_refused_in_one_slot_takes_nothing_anywhere() {
    let cluster = common::RedisCluster::start(3, 0);
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let store = cluster.store(Some(clock));
    let (a, b, z) = (
        minute(c("slot-a", 10, 2)),
        minute(c("slot-b", 1, 2)),
        minute(c("slot-c", 5, 2)),
    );
    let slots: std::collections::HashSet<u16> = [&a, &b, &z]
        .iter()
        .map(|c| ratekeeper::keys::cluster_slot(&c.key))
        .collect();
    assert_eq!(slots.len(), 3, "the keys must live in different slots");
    let got = store
        .reserve(&[a.clone(), b.clone(), z.clone()], "n", 60_000)
        .await
        .unwrap();
    assert!(!got.granted);
    assert_eq!(
        got.outcomes,
        vec![
            o(false, 10, 60_000),
            o(true, 1, 60_000),
            o(false, 5, 60_000)
        ]
    );
    let probe = |check: &Check| Check {
        hits: 0,
        ..check.clone()
    };
    let left = store
        .apply(&[probe(&a), probe(&b), probe(&z)], false)
        .await
        .unwrap();
    let left: Vec<u64> = left.iter().map(|o| o.remaining).collect();
    assert_eq!(left, vec![10, 1, 5]);
}

/// The budget function is the limiter library's second function: reloaded
/// with it after `FUNCTION FLUSH`; as a script (Redis without functions,
/// its scripts flushed), loaded again on `NOSCRIPT`. Either way a
/// reservation made before the flush settles after it.
#[tokio::test]
async fn redis_budget_calls_survive_function_flush_script_flush_and_no_functions() {
    use ratekeeper::store::Settled;
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let with = common::RedisServer::start();
    let without = redis_without_functions();
    for (redis, functions, flush) in [
        (&with, true, "FUNCTION"),
        (&with, false, "SCRIPT"),
        (&without, true, "SCRIPT"),
    ] {
        let store = redis.store_with(Some(clock.clone()), functions);
        let check = minute(c(&format!("budget-{flush}-{functions}"), 10, 6));
        let ledger = common::Ledger::default();
        let reserved = ledger
            .reserve(&store, std::slice::from_ref(&check), "n", 60_000)
            .await
            .unwrap();
        assert!(reserved.granted, "{flush} {functions}");
        let mut conn = redis.client().get_connection().unwrap();
        let _: () = redis::cmd(flush).arg("FLUSH").query(&mut conn).unwrap();
        let got = ledger.settle(&store, "n", 1).await.unwrap();
        assert_eq!(
            got,
            Settled::Settled {
                outcomes: vec![o(false, 9, 60_000)]
            },
            "{flush} {functions}"
        );
    }
}

/// Concurrent reserves and settles on single Redis share limiter calls
/// (src/store/batcher.rs), each still its own atomic step: 64 reserves of
/// 1 at once against a budget of 10 grant exactly 10, in fewer calls than
/// operations, and their 10 settles give back exactly what they should.
#[tokio::test]
async fn concurrent_budget_calls_share_redis_calls_and_decide_as_before() {
    use futures_util::future::join_all;
    use ratekeeper::store::Settled;
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let redis = common::RedisServer::start();
    for functions in [true, false] {
        let store = redis.store_with(Some(clock.clone()), functions);
        let check = minute(c(&format!("shared-{functions}"), 10, 1));
        let mut conn = redis.client().get_connection().unwrap();
        let before = limiter_calls(&mut conn);
        let nonces: Vec<String> = (0..64).map(|i| format!("n{i}")).collect();
        let ledger = common::Ledger::default();
        let reserved = join_all(
            nonces
                .iter()
                .map(|n| ledger.reserve(&store, std::slice::from_ref(&check), n, 60_000)),
        )
        .await;
        let calls = limiter_calls(&mut conn) - before;
        let granted: Vec<&String> = nonces
            .iter()
            .zip(&reserved)
            .filter(|(_, r)| r.as_ref().unwrap().granted)
            .map(|(n, _)| n)
            .collect();
        assert_eq!(granted.len(), 10, "functions {functions}");
        assert!(calls < 64, "{calls} calls for 64 reserves ({functions})");
        let before = limiter_calls(&mut conn);
        let settled = join_all(granted.iter().map(|n| ledger.settle(&store, n, 0))).await;
        let calls = limiter_calls(&mut conn) - before;
        assert!(calls < 10, "{calls} calls for 10 settles ({functions})");
        for answer in settled {
            assert!(
                matches!(answer.unwrap(), Settled::Settled { .. }),
                "functions {functions}"
            );
        }
        let probe = Check {
            hits: 0,
            ..check.clone()
        };
        let after = store.apply(&[probe], false).await;
        assert_eq!(after.unwrap()[0].remaining, 10, "all given back");
    }
}

/// A settlement's record is a field of a bucket hash that other
/// settlements share: each settle keeps the bucket at least as long as its
/// own record needs (to the end of its expiry's second, or `keep` from
/// now) and never shortens it for the others; a retry finds its field.
#[test]
fn a_record_bucket_lives_as_long_as_its_longest_record_needs() {
    let redis = common::RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let function = format!("{}_budget", common::load_limiter_library(&mut conn));
    let (key, bucket) = ("rk:{kept|a}:fw.1000", "rk:rsvb.1800000060.a");
    let now = "1800000000000";
    let mut settle = |header: &str, nonce: &str| -> Vec<i64> {
        let fields = "fw 5 1000 0 1 1 0";
        let reply: Packed = redis::cmd("FCALL")
            .arg(&function)
            .arg(2)
            .arg(&[key, bucket])
            .arg(&[now, header, fields, "1800000000000 -", nonce])
            .query(&mut conn)
            .expect("settle");
        reply.0
    };
    let pttl = |conn: &mut redis::Connection| -> i64 {
        redis::cmd("PTTL").arg(bucket).query(conn).expect("PTTL")
    };
    let kept = settle("settle 1 3 1800000060000 100000", "a1");
    assert_eq!(kept[..3], [5, 1, 3], "settled now at 3: {kept:?}");
    let mut conn = redis.client().get_connection().unwrap();
    assert!((99_000..=100_000).contains(&pttl(&mut conn)), "keep: 100 s");
    let plain = settle("settle 1 0 1800000060500 0", "a2");
    assert_eq!(plain[..3], [5, 1, 0], "{plain:?}");
    assert!(pttl(&mut conn) > 99_000, "not shortened to 61 s");
    let longer = settle("settle 1 0 1800000060000 200000", "a3");
    assert_eq!(longer[..3], [5, 1, 0], "{longer:?}");
    assert!(pttl(&mut conn) > 199_000, "lengthened to 200 s");
    let retry = settle("settle 1 9 1800000060000 100000", "a1");
    assert_eq!(retry[..3], [5, 2, 3], "already settled at 3: {retry:?}");
    let fields: Vec<String> = redis::cmd("HKEYS").arg(bucket).query(&mut conn).unwrap();
    assert_eq!(fields.len(), 3, "{fields:?}");
}

/// Malformed budget calls get an error reply and save nothing: an unknown
/// operation, a TTL or actual not a count, fewer fields than keys, a
/// header's tail other than a settle's ` <expires> <keep>`, keys that do
/// not add up (a settle's record bucket missing), a settle's nonce
/// missing, an actual over 2^32 (`MAX_HITS`), more arguments than
/// operations, no time. A check's fields
/// or a settle's times and marks malformed fail that operation alone
/// (`{-1, 1}`), saving nothing.
#[test]
fn the_budget_function_refuses_malformed_arguments_and_saves_nothing() {
    let redis = common::RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let function = common::load_limiter_library(&mut conn);
    let (record, key) = ("rk:rsvb.1800000060.n", "rk:{bad|a}:fw.1000");
    let good = "fw 5 1000 0 1 1 0";
    let now = "1800000000000";
    let settle = "settle 1 1 1800000060000 0";
    let call = |keys: &[&str], args: &[&str]| {
        redis::cmd("FCALL")
            .arg(format!("{function}_budget"))
            .arg(keys.len())
            .arg(keys)
            .arg(args)
            .query::<Packed>(&mut redis.client().get_connection().unwrap())
            .map(|p| p.0)
    };
    let (one, two) = (&[key][..], &[key, record][..]);
    let malformed: [(&[&str], &[&str]); 15] = [
        (one, &[now, "take 1 1000", good]),
        (one, &[now, "reserve 1 soon", good]),
        (one, &[now, "reserve 1 1000"]),
        (one, &[now, "reserve 1 1000 k", good]),
        (two, &[now, "reserve 1 1000", good]),
        (two, &[now, "settle 1 1 1800000060000", good, "1 0", "n"]),
        (two, &[now, "settle 1 1 soon 0", good, "1 0", "n"]),
        (two, &[now, "settle 1 -1 1800000060000 0", good, "1 0", "n"]),
        (
            two,
            &[now, "settle 1 4294967297 1800000060000 0", good, "1 0", "n"],
        ),
        (two, &[now, settle, good]),
        (two, &[now, settle, good, "1 0"]),
        (one, &[now, settle, good, "1 0", "n"]),
        (one, &[now, "reserve 1 1000", good, "reserve 1 1000", good]),
        (one, &["soon", "reserve 1 1000", good]),
        (&[], &[now]),
    ];
    for (keys, args) in malformed {
        let error = call(keys, args).expect_err("malformed arguments were decided");
        assert_eq!(
            (error.code(), error.detail()),
            (Some("ERR"), Some("malformed budget arguments")),
            "{args:?}: {error}"
        );
    }
    let bad_fields = call(one, &[now, "reserve 1 1000", "fw 5 1000 0 1 1"]).unwrap();
    assert_eq!(bad_fields, vec![2, -1, 1]);
    for (fields, marks) in [
        ("fw 5 1000 0 1 1", "1 0"),
        (good, "x 0"),
        (good, "1"),
        (good, "1 0 2 0"),
    ] {
        let answer = call(two, &[now, settle, fields, marks, "n"]).unwrap();
        assert_eq!(answer, vec![2, -1, 1], "{fields:?} {marks:?}");
    }
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert!(keys.is_empty(), "saved {keys:?}");
}

/// A step of the random budget runs below.
#[derive(Debug, Clone)]
enum BudgetStep {
    /// Reserve `estimate` on these (key index, enforce) checks.
    Reserve(Vec<(usize, bool)>, u64),
    /// Settle the n-th reservation made so far (wrapping; none made: a
    /// nonce never used) at an actual.
    Settle(usize, u64),
    /// A plain request of these hits on a key.
    Apply(usize, u64),
}

fn budget_steps() -> impl Strategy<Value = Vec<(u64, BudgetStep)>> {
    let reserve = (
        prop::collection::vec((0usize..4, prop::bool::weighted(0.8)), 1..4),
        1u64..6,
    )
        .prop_map(|(checks, estimate)| BudgetStep::Reserve(checks, estimate));
    let settle = (0usize..8, 0u64..8).prop_map(|(n, actual)| BudgetStep::Settle(n, actual));
    let apply = (0usize..4, 0u64..4).prop_map(|(key, hits)| BudgetStep::Apply(key, hits));
    let step = prop_oneof![reserve, settle, apply];
    prop::collection::vec((0u64..6, step), 1..30)
}

/// Reservations and settlements decided by the Lua twins answer as the
/// in-memory store's: random reserves (several keys, some in shadow mode),
/// settles (lower, higher, twice, of nothing) and plain requests over four
/// keys of random algorithms, time moving on, compared step by step.
#[test]
fn random_budgets_agree_on_memory_and_redis() {
    use proptest::test_runner::{Config, TestRunner};
    use ratekeeper::store::{MemoryStore, Store};

    let redis = common::RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let start = 1_800_000_000_000;
    let clock = Arc::new(ManualClock::new(start));
    let on_redis = runtime.block_on(async { redis.store(Some(clock.clone())) });
    let conn = std::cell::RefCell::new(&mut conn);
    let mut runner = TestRunner::new(Config {
        cases: common::proptest_cases(256),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&(key_specs(), budget_steps()), |(specs, steps)| {
        let _: () = redis::cmd("FLUSHDB").query(*conn.borrow_mut()).unwrap();
        clock.set(start);
        let memory = Store::Memory(MemoryStore::new(clock.clone()));
        let check = |k: usize, hits: u64, enforce: bool| {
            let (algorithm, limit, period_ms, burst, charges) = specs[k];
            Check {
                enforce,
                charges,
                ..ck(algorithm, &format!("k{k}"), limit, period_ms, burst, hits)
            }
        };
        let (on_memory, in_redis) = (common::Ledger::default(), common::Ledger::default());
        let mut reservations = 0;
        for (i, (wait, step)) in steps.iter().enumerate() {
            clock.advance(wait * 250);
            let (a, b) = runtime.block_on(async {
                match step {
                    BudgetStep::Reserve(checks, estimate) => {
                        let checks: Vec<Check> = checks
                            .iter()
                            .map(|&(k, enforce)| check(k, *estimate, enforce))
                            .collect();
                        let nonce = format!("r{reservations}");
                        reservations += 1;
                        let a = on_memory.reserve(&memory, &checks, &nonce, 60_000);
                        let b = in_redis.reserve(&on_redis, &checks, &nonce, 60_000);
                        let (a, b) = (a.await.unwrap(), b.await.unwrap());
                        (format!("{a:?}"), format!("{b:?}"))
                    }
                    BudgetStep::Settle(n, actual) => {
                        let nonce = match reservations {
                            0 => "never".to_owned(),
                            len => format!("r{}", n % len),
                        };
                        let a = on_memory.settle(&memory, &nonce, *actual).await.unwrap();
                        let b = in_redis.settle(&on_redis, &nonce, *actual).await.unwrap();
                        (format!("{a:?}"), format!("{b:?}"))
                    }
                    BudgetStep::Apply(k, hits) => {
                        let checks = [check(*k, *hits, true)];
                        let a = memory.apply(&checks, true).await.unwrap();
                        let b = on_redis.apply(&checks, true).await.unwrap();
                        (format!("{a:?}"), format!("{b:?}"))
                    }
                }
            });
            prop_assert_eq!(a, b, "step {} {:?}", i, step);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
