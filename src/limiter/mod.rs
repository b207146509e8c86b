//! Rate-limit policy: units, algorithms and the per-limit check/outcome types
//! that flow between the service and the stores.
//!
//! The policy math lives here once, in Rust, for the in-memory store; each
//! algorithm's Redis twin is a Lua script in `lua/` with the same semantics,
//! and the conformance tests run one table against both.
//!
//! Every list of the algorithms is in this file — [`Algorithm`], [`State`],
//! how a state is loaded and reached ([`State::load`], `dispatch!`), and
//! the Lua twins (`lua_twins!`) — so an algorithm is added here, in its own
//! module, and in its own Lua file.

pub mod batch;
pub mod budget;
pub mod fixed_window;
pub mod gcra;
pub mod sliding_log;
pub mod sliding_window;

use std::fmt;

/// The algorithms' Lua twins, joined in the order the limiter script loads
/// them (see `store::limiter_script`). A macro, for `concat!`.
macro_rules! lua_twins {
    () => {
        concat!(
            include_str!("../../lua/fixed_window.lua"),
            include_str!("../../lua/sliding_window.lua"),
            include_str!("../../lua/sliding_log.lua"),
            include_str!("../../lua/gcra.lua"),
        )
    };
}
pub(crate) use lua_twins;

/// Runs `$body` with `$s` bound to the [`Policy`] inside a [`State`].
macro_rules! dispatch {
    ($state:expr, $s:ident => $body:expr) => {
        match $state {
            $crate::limiter::State::Window($s) => $body,
            $crate::limiter::State::Sliding($s) => $body,
            $crate::limiter::State::Log($s) => $body,
            $crate::limiter::State::Gcra($s) => $body,
        }
    };
}
pub(crate) use dispatch;

/// A rate limit's time unit, as in envoyproxy/ratelimit's limits files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    /// The window length. Months are 30 days and years 365, as envoyproxy/ratelimit does.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => 2_592_000,
            Unit::Year => 31_536_000,
        }
    }

    /// Parses a unit name, case-insensitively.
    pub fn parse(name: &str) -> Option<Unit> {
        Some(match name.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// The enum value Envoy uses on the wire (`RateLimitResponse.RateLimit.Unit`
    /// and `envoy.type.v3.RateLimitUnit` share it).
    pub fn to_envoy(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    /// The inverse of [`Unit::to_envoy`]; `None` for UNKNOWN or out of range.
    pub fn from_envoy(value: i32) -> Option<Unit> {
        Some(match value {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a limit counts. Each has a Rust module here and a Lua twin in `lua/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Counters per window aligned to the Unix epoch (envoyproxy/ratelimit's).
    FixedWindow,
    /// Current and previous window counts, the previous weighted by overlap.
    SlidingWindow,
    /// Exact log of admitted hits' timestamps.
    SlidingLog,
    /// GCRA; `burst` is the bucket size.
    TokenBucket,
    /// GCRA policing; `burst` is the queue depth, the reset is the wait.
    LeakyBucket,
}

impl Algorithm {
    pub const ALL: [Algorithm; 5] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
    ];

    /// The name used in limits files.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket => "leaky_bucket",
        }
    }

    pub fn parse(name: &str) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Short tag used in counter keys and by the Lua batch script; stable.
    pub fn key_tag(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingWindow => "sw",
            Algorithm::SlidingLog => "sl",
            Algorithm::TokenBucket => "tb",
            Algorithm::LeakyBucket => "lb",
        }
    }

    /// The tag in counter keys: [`Algorithm::key_tag`], except where an
    /// algorithm's stored state changed shape, so that a replica of another
    /// version (side by side during a rolling upgrade) never reads a state
    /// it would misparse: the sliding log's weighted entries live under
    /// `slw` (the log of one member per hit, before, under `sl`).
    pub fn counter_tag(self) -> &'static str {
        match self {
            Algorithm::SlidingLog => "slw",
            other => other.key_tag(),
        }
    }

    /// Whether `burst` means something for this algorithm.
    pub fn has_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::LeakyBucket)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One limit to apply to one counter, as part of a request's batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Counter key (see `keys`).
    pub key: String,
    pub algorithm: Algorithm,
    /// Requests allowed per period (> 0 for the GCRA algorithms).
    pub limit: u64,
    /// Window length in milliseconds (> 0).
    pub period_ms: u64,
    /// Bucket size / queue depth of the GCRA algorithms (> 0); ignored by the others.
    pub burst: u64,
    /// Hits to consume; 0 checks without consuming.
    pub hits: u64,
    /// Whether being over this limit refuses the request (false in shadow mode).
    pub enforce: bool,
    /// What this limit records of hits over it, and of a request another
    /// limit refuses.
    pub charges: Charges,
}

/// Whether a limit takes charges: hits recorded even when over the limit (a
/// cost already incurred, such as an LLM response's tokens), up to
/// [`recordable`]'s bound. Its code is the `charges` field the Lua takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charges {
    /// Nothing over the limit is recorded: a refused request consumes nothing.
    Drop = 0,
    /// Hits over the limit are recorded, and a request another limit refuses
    /// records its hits here too (envoyproxy/ratelimit's fixed window: every
    /// descriptor's counter is incremented).
    Record = 1,
    /// Hits over the limit are recorded, but a refused request leaves this
    /// limit untouched where it fitted (envoyproxy/ratelimit's fixed window
    /// with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`: only the counters the
    /// request takes over their limit are incremented).
    WhenOver = 2,
}

impl Charges {
    /// A limits file's `charges: record` (true) or `drop` (false).
    pub fn recorded(record: bool) -> Charges {
        if record {
            Charges::Record
        } else {
            Charges::Drop
        }
    }

    /// Whether `hits` are recorded on a request this limit found `over`
    /// (or, when it fitted, that another limit refused).
    pub fn records(self, hits: u64, over: bool) -> bool {
        hits > 0
            && match self {
                Charges::Drop => false,
                Charges::Record => true,
                Charges::WhenOver => over,
            }
    }

    /// Whether `hits` are recorded on a refused request: all or nothing,
    /// what [`Charges::records`] says; otherwise what the limit admitted
    /// too, but for `WhenOver`, which spares what it fitted whenever the
    /// request is refused (envoyproxy/ratelimit's rule, which has no
    /// all-or-nothing). Twin of `refused_records` in `lua/prelude.lua`.
    pub fn records_refused(self, hits: u64, over: bool, all_or_nothing: bool) -> bool {
        if all_or_nothing {
            return self.records(hits, over);
        }
        hits > 0 && (self != Charges::Drop || !over) && (over || self != Charges::WhenOver)
    }
}

impl Check {
    /// Hits a decision is about: a check-only request asks about one.
    pub fn need(&self) -> u64 {
        self.hits.max(1)
    }

    /// The most hits one request is ever admitted with, on a counter with
    /// nothing counted: the limit for the windows and the log (0 admits
    /// nothing), the bucket for the GCRA algorithms (whose limit is never
    /// 0: `config` refuses it). The check's view of `Rate::capacity`, the
    /// rate it was planned from (`limit` its `requests_per_unit`, `burst`
    /// its `effective_burst`).
    pub fn capacity(&self) -> u64 {
        if self.algorithm.has_burst() {
            self.burst
        } else {
            self.limit
        }
    }

    /// Whether it gives back the hits it fitted when its request is
    /// refused ([`Charges::WhenOver`]), which a store (a Cluster slot) can
    /// do only for a refusal it sees: a request of such checks spanning
    /// several is first asked in each without saving.
    pub fn spares_fitted(&self) -> bool {
        self.charges == Charges::WhenOver && self.hits > 0
    }

    /// Whether `outcome` refuses the request: over, and enforced (a shadow
    /// or quota check over its limit refuses nothing).
    pub fn refused_by(&self, outcome: &Outcome) -> bool {
        outcome.over && self.enforce
    }
}

#[cfg(test)]
impl Check {
    /// An enforced check without charges, for unit tests; the GCRA
    /// algorithms' burst is the limit.
    pub(crate) fn for_test(
        key: &str,
        algorithm: Algorithm,
        limit: u64,
        period_ms: u64,
        hits: u64,
    ) -> Check {
        Check {
            key: key.into(),
            algorithm,
            limit,
            period_ms,
            burst: if algorithm.has_burst() { limit } else { 0 },
            hits,
            enforce: true,
            charges: Charges::Drop,
        }
    }
}

/// The store's verdict on one [`Check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// This limit alone would refuse the request.
    pub over: bool,
    /// Hits this limit would still admit now, after this request.
    pub remaining: u64,
    /// Milliseconds until the limit is fully restored; when over, until the
    /// refused hits would be admitted; for `leaky_bucket`, the caller's wait.
    pub reset_ms: u64,
    /// When over but its hits were recorded anyway (a charge): the hits
    /// this limit still admitted before them, for the stats' split of hits
    /// into near and over limit. `None` otherwise: a refusal that records
    /// nothing leaves `remaining` as it was before the request.
    pub remaining_before: Option<u64>,
}

/// The hits of `check` a state holding `count` hits records: all of them,
/// up to a count of twice the limit. Debt — hits recorded past the limit —
/// is thus at most one limit, so a charge refuses further requests for at
/// most one period beyond what spending the whole budget would: one huge
/// response cannot lock a user out for years, while any charge up to a full
/// budget past the limit is repaid in full. Admitted hits always fit (their
/// count stays within the limit). The fixed window needs no such bound
/// ([`fixed_window::MAX_COUNT`]). Twin: `charge` in `lua/prelude.lua`.
pub fn recordable(check: &Check, count: u64) -> u64 {
    check
        .hits
        .min(check.limit.saturating_mul(2).saturating_sub(count))
}

/// Hits above this are treated as this (any real limit is a `u32`), so sums
/// stay exact in Lua's doubles and never overflow.
pub const MAX_HITS: u64 = 1 << 32;

/// What a store keeps for one key, per algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Window(fixed_window::Window),
    Sliding(sliding_window::Sliding),
    // Boxed: the log is the one large state, and the in-memory store keeps a
    // `State` per key.
    Log(Box<sliding_log::Log>),
    Gcra(gcra::Gcra),
}

/// Where a state stood before a request, to put it back if the request is
/// refused: the state itself, but for a sliding log where it ended (a
/// request only appends to a log or adds to its newest entry: a copy of a
/// hot key's log, tens of thousands of entries, cost each request of more
/// than one check as much as the log's length).
#[derive(Debug)]
pub enum UndoPoint {
    Whole(State),
    Log(sliding_log::End),
}

impl State {
    /// Where this state stands now, for [`State::undo_to`].
    pub fn undo_point(&self) -> UndoPoint {
        match self {
            State::Log(log) => UndoPoint::Log(log.end()),
            other => UndoPoint::Whole(other.clone()),
        }
    }

    /// Puts the state back where `point` (taken from it, changed since
    /// only by a request's consuming) found it.
    pub fn undo_to(&mut self, point: &UndoPoint) {
        match (self, point) {
            (State::Log(log), UndoPoint::Log(end)) => log.back_to(end),
            (state, UndoPoint::Whole(whole)) => *state = whole.clone(),
            (state, UndoPoint::Log(_)) => {
                debug_assert!(false, "a log's undo point for {state:?}");
            }
        }
    }

    /// `check`'s state as of `now_ms`, from what the store holds (if anything).
    pub fn load(stored: Option<State>, check: &Check, now_ms: u64) -> State {
        match check.algorithm {
            Algorithm::FixedWindow => {
                fixed_window::Window::load(stored, check, now_ms).into_state()
            }
            Algorithm::SlidingWindow => {
                sliding_window::Sliding::load(stored, check, now_ms).into_state()
            }
            Algorithm::SlidingLog => sliding_log::Log::load(stored, check, now_ms).into_state(),
            Algorithm::TokenBucket | Algorithm::LeakyBucket => {
                gcra::Gcra::load(stored, check, now_ms).into_state()
            }
        }
    }
}

/// One algorithm's state machine; the Lua twin in `lua/` has the same
/// functions with the same arithmetic.
pub trait Policy: Sized {
    /// The state as of `now`, from what the store holds (if anything).
    fn load(stored: Option<State>, check: &Check, now_ms: u64) -> Self;
    /// Whether `check.need()` more hits exceed the limit.
    fn is_over(&self, check: &Check, now_ms: u64) -> bool;
    /// Consumes `check.hits` — over the limit too, for a limit that takes
    /// charges, within the bound of [`recordable`].
    fn apply(&mut self, check: &Check, now_ms: u64);
    /// `(remaining, reset_ms)`; `applied` is whether this check's hits were
    /// consumed. Over and applied (a recorded charge), the reset is the time
    /// until one more hit would be admitted.
    fn report(&self, check: &Check, over: bool, applied: bool, now_ms: u64) -> (u64, u64);
    /// How long the store must keep the state, in milliseconds (> 0).
    fn ttl_ms(&self, check: &Check, now_ms: u64) -> u64;
    /// Consumes a reservation's `check.hits` (they fit: `is_over` said so)
    /// and returns its mark, what [`Policy::refund`] needs to find them
    /// again: the sliding log's entry; 0 for the others, which need only
    /// the time of the reservation.
    fn reserve(&mut self, check: &Check, now_ms: u64) -> u64 {
        self.apply(check, now_ms);
        0
    }
    /// Consumes the hits of a reservation's later check on a key whose
    /// first check's [`Policy::reserve`] gave `mark`, and returns this
    /// check's mark: the same entry's, but for the buckets, whose hits are
    /// a stretch of the queue and each check's mark is where its own end.
    fn join(&mut self, check: &Check, now_ms: u64, mark: u64) -> u64 {
        self.apply(check, now_ms);
        mark
    }
    /// Gives back `hits` of the hits a reservation made at `reserved_at_ms`
    /// (with `mark`, from [`Policy::reserve`]) took, as if it had taken
    /// that many fewer: never below zero, never more than it took, and
    /// nothing of what has aged out or drained since.
    fn refund(&mut self, check: &Check, hits: u64, reserved_at_ms: u64, mark: u64, now_ms: u64);
    fn into_state(self) -> State;
}
