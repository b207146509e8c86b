//! One table of (time, checks) -> outcomes, run against every store: the
//! in-memory store and a real Redis, both with the same pinned clock. The two
//! implementations of each algorithm must agree exactly.

mod common;

use std::sync::Arc;

use common::Backend;
use ratekeeper::clock::ManualClock;
use ratekeeper::limiter::{Algorithm, Check, Outcome, MAX_HITS};

/// A check on key `key`: `limit` per second, `hits`, enforced or shadow.
fn c(key: &str, limit: u64, hits: u64) -> Check {
    Check {
        key: format!("rk:{{t|{key}}}:fw.1"),
        algorithm: Algorithm::FixedWindow,
        limit,
        period_ms: 1_000,
        hits,
        enforce: true,
    }
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
    }
}

struct Step {
    /// Milliseconds since the start of the table (which starts on a window edge).
    at: u64,
    checks: Vec<Check>,
    expect: Vec<Outcome>,
    why: &'static str,
}

fn table() -> Vec<Step> {
    let s = |at, checks, expect, why| Step {
        at,
        checks,
        expect,
        why,
    };
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
        // shadow mode never refuses, and is counted
        s(
            2000,
            vec![c("e1", 5, 1), shadow(c("e2", 1, 3))],
            vec![o(false, 4, 1000), o(true, 0, 1000)],
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
    ]
}

#[tokio::test]
async fn fixed_window_table_agrees_on_every_store() {
    // A start on a minute boundary, so every window in the table is aligned.
    let start = 1_800_000_000_000u64;
    for backend in Backend::all() {
        let clock = Arc::new(ManualClock::new(start));
        let store = backend.store(clock.clone());
        for (i, step) in table().into_iter().enumerate() {
            clock.set(start + step.at);
            let got = store.apply(&step.checks).await.expect("store");
            assert_eq!(
                got,
                step.expect,
                "{} step {i}: {}",
                backend.name(),
                step.why
            );
        }
    }
}

#[tokio::test]
async fn redis_counters_always_carry_a_ttl() {
    let redis = common::RedisServer::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000_250));
    let store = redis.store(Some(clock));
    store
        .apply(&[minute(c("ttl", 10, 1)), c("ttl2", 10, 1)])
        .await
        .unwrap();
    // Refused and check-only requests write nothing.
    store.apply(&[c("refused", 1, 5)]).await.unwrap();
    store.apply(&[c("checked", 1, 0)]).await.unwrap();
    let mut conn = redis.client().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in keys {
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
        let max = if key.ends_with("ttl}:fw.1") {
            59_750
        } else {
            750
        };
        assert!(ttl > 0 && ttl <= max, "{key} has PTTL {ttl}");
    }
}

#[tokio::test]
async fn redis_script_is_reloaded_after_script_flush() {
    let redis = common::RedisServer::start();
    let store = redis.store(Some(Arc::new(ManualClock::new(1_800_000_000_000))));
    assert!(!store.apply(&[c("x", 5, 1)]).await.unwrap()[0].over);
    let mut conn = redis.client().get_connection().unwrap();
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
    let after = store.apply(&[c("x", 5, 1)]).await.unwrap();
    assert_eq!(
        after[0].remaining, 3,
        "the counter survived, the script was reloaded"
    );
}

#[tokio::test]
async fn redis_reads_its_own_clock_when_none_is_pinned() {
    let redis = common::RedisServer::start();
    let store = redis.store(None);
    let out = store.apply(&[minute(c("clock", 5, 1))]).await.unwrap();
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
