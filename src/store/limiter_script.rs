//! The limiter script as Redis sees it: its text (the files of `lua/`
//! joined), loaded as a function library where Redis has functions (7.0+)
//! and as a plain script otherwise; the call carrying one or more requests'
//! checks (`FCALL`, or `EVALSHA`); and the reply read back as [`Outcome`]s.
//! Arguments are described in `lua/README.md`.
//!
//! The library has a second function, the budget reservations'
//! (`lua/budget.lua`, its own script where Redis has no functions): one
//! `FUNCTION LOAD`, one reload when Redis lost it, for both.
//!
//! Why a function where Redis has them: a script runs its whole text on
//! every call, and defining the limiter's helpers, building its algorithm
//! closures and parsing the same limits again cost more than a lone
//! one-check request's own work. A library runs that text once, at
//! `FUNCTION LOAD`, and keeps its parse memo; each call runs only the
//! function (`lua/README.md` has the instruction counts). The library is named after the script's SHA-1,
//! so replicas of different versions each load, and call, their own.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use redis::aio::ConnectionLike;
use redis::{
    Arg, Cmd, ErrorKind, RedisError, RedisResult, RedisWrite, Script, ServerErrorKind, ToRedisArgs,
};

use super::budget::record_bucket;
use super::generation::Generation;
use super::packed::Packed;
use crate::clock::Clock;
use crate::limiter::budget::Taken;
use crate::limiter::{Check, Outcome};
use crate::{Error, Result};

/// The limiter's Lua files, by part, in the order they are joined.
macro_rules! lua {
    (prelude) => {
        include_str!("../../lua/prelude.lua")
    };
    (algorithms) => {
        crate::limiter::lua_twins!()
    };
    (batch) => {
        include_str!("../../lua/batch.lua")
    };
    (budget) => {
        include_str!("../../lua/budget.lua")
    };
}

/// The one limiter script: helpers, every algorithm, then the batch driver.
pub const TEXT: &str = concat!(lua!(prelude), lua!(algorithms), lua!(batch));

/// The budget script: helpers, every algorithm, then reserve and settle,
/// called with the script's keys and arguments.
pub const BUDGET_TEXT: &str = concat!(
    lua!(prelude),
    lua!(algorithms),
    lua!(budget),
    "return budget_call(KEYS, ARGV)\n"
);

/// The time argument both scripts (this one and `lua/leases.lua`) take: the
/// pinned clock's ms, or `""` for the Redis server's `TIME`.
pub fn script_now(clock: Option<&Arc<dyn Clock>>) -> String {
    clock.map(|c| c.now_ms().to_string()).unwrap_or_default()
}

/// The limiter in both forms, and which one this Redis runs.
#[derive(Debug)]
pub struct LimiterScript {
    script: Script,
    /// The budget reservations' script (`BUDGET_TEXT`).
    budget_script: Script,
    /// `FUNCTION LOAD` text: the same files, batch.lua as the function,
    /// budget.lua's `budget_call` as the budget function.
    library: String,
    /// The library's name, also its limiter function's.
    function: String,
    /// The library's budget function.
    budget_function: String,
    /// Calls go by `FCALL` until Redis shows it has no functions (before
    /// 7.0, or the commands renamed away or denied by ACL); then by
    /// `EVALSHA` for good.
    functions: AtomicBool,
    /// Bumped whenever Redis turns out to have lost the limiter.
    generation: Generation,
    /// The most ms a call adds to the TTL of the keys it saves (0: none).
    expiry_jitter_ms: u64,
    /// Settlements are recorded in their counters' hash slot (on a
    /// cluster), not in hashes the whole store shares: `record_bucket`.
    records_in_slot: bool,
}

impl LimiterScript {
    /// The limiter, called as a function (`functions`) until Redis shows it
    /// has none, or as a script only.
    pub fn new(functions: bool) -> Self {
        let script = Script::new(TEXT);
        // Named after everything it holds, so that a change to either
        // function makes a library of another name.
        let whole = Script::new(concat!(
            lua!(prelude),
            lua!(algorithms),
            lua!(batch),
            lua!(budget)
        ));
        let function = format!("ratekeeper_{}", whole.get_hash());
        let budget_function = format!("{function}_budget");
        let library = format!(
            "#!lua name={function}\n{}{}redis.register_function('{function}', \
             function(KEYS, ARGV)\n{}end)\n{}redis.register_function('{budget_function}', \
             budget_call)\n",
            lua!(prelude),
            lua!(algorithms),
            lua!(batch),
            lua!(budget),
        );
        LimiterScript {
            script,
            budget_script: Script::new(BUDGET_TEXT),
            library,
            function,
            budget_function,
            functions: AtomicBool::new(functions),
            generation: Generation::default(),
            expiry_jitter_ms: 0,
            records_in_slot: false,
        }
    }

    /// For a Redis Cluster: each settlement's record shares its counters'
    /// hash slot (`record_bucket`).
    pub fn on_cluster(self, clustered: bool) -> Self {
        LimiterScript {
            records_in_slot: clustered,
            ..self
        }
    }

    /// Each call adds a random 0..=`max_ms` ms to the TTL of the keys it
    /// saves (envoyproxy/ratelimit's `EXPIRATION_JITTER_MAX_SECONDS`), so
    /// that the keys of one window do not all expire in the same instant.
    /// Decisions do not change: a window ends when it ends, whatever its
    /// key's TTL.
    pub fn with_expiry_jitter(self, max_ms: u64) -> Self {
        LimiterScript {
            expiry_jitter_ms: max_ms,
            ..self
        }
    }

    /// Bumped whenever a call found the limiter gone from Redis (so Redis
    /// lost its data too, or is another server).
    pub fn generation(&self) -> &Generation {
        &self.generation
    }

    /// Whether calls go by `FCALL`.
    pub fn uses_functions(&self) -> bool {
        self.functions.load(Ordering::Relaxed)
    }

    /// The `FUNCTION LOAD` text.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// Makes the limiter callable on the server behind `conn` (on a cluster,
    /// every master): loads the library, or the script where Redis has no
    /// functions.
    pub async fn load<C: ConnectionLike>(&self, conn: &mut C) -> RedisResult<()> {
        if self.uses_functions() {
            let mut load = redis::cmd("FUNCTION");
            load.arg("LOAD").arg(&self.library);
            match load.query_async::<redis::Value>(conn).await {
                Ok(_) => return Ok(()),
                // The name is the code's hash: a library of that name is this one.
                Err(error) if detail_has(&error, "already exists") => return Ok(()),
                Err(error) if no_functions(&error) => self.fall_back(&error),
                Err(error) => return Err(error),
            }
        }
        self.script.load_async(conn).await?;
        self.budget_script.load_async(conn).await.map(drop)
    }

    /// Runs `cmd` (made by [`Self::command`] or [`Self::budget_command`])
    /// and reads its reply's integers ([`Packed`]). When Redis has lost the
    /// limiter (a restart, a failover, `FUNCTION FLUSH`, `SCRIPT FLUSH`) it
    /// is loaded again and the call made once more; when Redis turns out to
    /// have no functions, the call is made as a script.
    pub async fn call<C: ConnectionLike>(&self, conn: &mut C, cmd: &Cmd) -> RedisResult<Vec<i64>> {
        if cmd.args_iter().next() != Some(Arg::Simple(b"FCALL".as_slice())) {
            return self.call_script(conn, cmd).await;
        }
        match cmd.query_async::<Packed>(conn).await {
            Err(error) if detail_has(&error, "Function not found") => {
                tracing::info!("the limiter function was gone from Redis: loading it again");
                self.generation.bump();
                self.load(conn).await?
            }
            Err(error) if no_functions(&error) => self.fall_back(&error),
            result => return result.map(|packed| packed.0),
        }
        if self.uses_functions() {
            cmd.query_async::<Packed>(conn).await.map(|packed| packed.0)
        } else {
            self.call_script(conn, &self.as_script_call(cmd)).await
        }
    }

    /// Runs an `EVALSHA` of the script, loading it on `NOSCRIPT` and trying
    /// once more.
    async fn call_script<C: ConnectionLike>(
        &self,
        conn: &mut C,
        cmd: &Cmd,
    ) -> RedisResult<Vec<i64>> {
        let reply = match cmd.query_async::<Packed>(conn).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                tracing::info!("the limiter script was gone from Redis: loading it again");
                self.generation.bump();
                self.script.load_async(conn).await?;
                self.budget_script.load_async(conn).await?;
                cmd.query_async(conn).await
            }
            result => result,
        };
        reply.map(|packed| packed.0)
    }

    fn fall_back(&self, error: &RedisError) {
        if self.functions.swap(false, Ordering::Relaxed) {
            tracing::warn!(%error, "Redis has no functions: the limiter runs as a script (EVALSHA)");
        }
    }

    /// The `EVALSHA` twin of an `FCALL`: the same arguments after the name.
    fn as_script_call(&self, cmd: &Cmd) -> Cmd {
        let budget = cmd.args_iter().nth(1) == Some(Arg::Simple(self.budget_function.as_bytes()));
        let script = if budget {
            &self.budget_script
        } else {
            &self.script
        };
        let mut script_call = redis::cmd("EVALSHA");
        script_call.arg(script.get_hash());
        for arg in cmd.args_iter().skip(2) {
            if let Arg::Simple(bytes) = arg {
                script_call.arg(bytes);
            }
        }
        script_call
    }

    /// A call of the budget function (`lua/budget.lua`, which describes
    /// the arguments) making `ops` one after another, each in one slot.
    pub fn budget_command<'o>(
        &self,
        now: &str,
        ops: impl Iterator<Item = &'o BudgetOp> + Clone,
    ) -> Cmd {
        let mut cmd = self.invocation(&self.budget_function, &self.budget_script);
        let keys = |op: &BudgetOp| op.checks.len() + usize::from(op.settle.is_some());
        cmd.arg(ops.clone().map(keys).sum::<usize>());
        for op in ops.clone() {
            for check in &op.checks {
                cmd.arg(check.key.as_str());
            }
            if let Some(settle) = &op.settle {
                // Its slot's: a settle always has checks (`Store::settle`).
                let counter = op.checks.first().map_or("", |c| c.key.as_str());
                let ends_ms = settle.ttl_ends_ms();
                let in_slot = self.records_in_slot;
                cmd.arg(record_bucket(counter, &op.nonce, ends_ms, in_slot));
            }
        }
        cmd.arg(now);
        for op in ops {
            cmd.arg(BudgetHeader(op));
            for check in &op.checks {
                cmd.arg(CheckFields(check));
            }
            if let Some(settle) = &op.settle {
                cmd.arg(TakenArg(&settle.taken));
                cmd.arg(op.nonce.as_str());
            }
        }
        cmd
    }

    /// The call deciding `requests` one after another, each
    /// `(all_or_nothing, checks)`; `now` is the pinned time in ms or `""`
    /// for the server's clock. Checks are borrowed where they are (a cluster
    /// slot's are picked out of its request), and integers are written
    /// straight into the command's one buffer: no allocation per argument.
    pub fn command<'c, R, C>(&self, now: &str, requests: R) -> Cmd
    where
        R: Iterator<Item = (bool, C)> + Clone,
        C: ExactSizeIterator<Item = &'c Check>,
    {
        self.command_in(
            now,
            requests.map(|(all, checks)| (all, Pass::Decide, checks)),
        )
    }

    /// The health probe's call: the limiter with no checks, which reads
    /// and writes nothing. On a cluster a keyless call goes to any node,
    /// and a replica refuses a function that may write, so there `slot_key`
    /// is declared (and unused): its slot sends the call to a primary.
    pub fn probe_command(&self, now: &str, slot_key: Option<&str>) -> Cmd {
        let mut cmd = self.invocation(&self.function, &self.script);
        cmd.arg(usize::from(slot_key.is_some()));
        if let Some(key) = slot_key {
            cmd.arg(key);
        }
        cmd.arg(now);
        cmd
    }

    /// `FCALL <function>` or `EVALSHA <script's sha>`, before the keys.
    fn invocation(&self, function: &str, script: &Script) -> Cmd {
        if self.uses_functions() {
            let mut cmd = redis::cmd("FCALL");
            cmd.arg(function);
            cmd
        } else {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(script.get_hash());
            cmd
        }
    }

    /// The call deciding one request's checks in one hash slot, in `pass`.
    pub fn slot_command<'c, C>(&self, now: &str, all_or_nothing: bool, pass: Pass, checks: C) -> Cmd
    where
        C: ExactSizeIterator<Item = &'c Check> + Clone,
    {
        self.command_in(now, std::iter::once((all_or_nothing, pass, checks)))
    }

    fn command_in<'c, R, C>(&self, now: &str, requests: R) -> Cmd
    where
        R: Iterator<Item = (bool, Pass, C)> + Clone,
        C: ExactSizeIterator<Item = &'c Check>,
    {
        let mut cmd = self.invocation(&self.function, &self.script);
        let keys: usize = requests.clone().map(|(_, _, checks)| checks.len()).sum();
        cmd.arg(keys);
        for (_, _, checks) in requests.clone() {
            for check in checks {
                cmd.arg(check.key.as_str());
            }
        }
        if self.expiry_jitter_ms == 0 {
            cmd.arg(now);
        } else {
            let jitter_ms = crate::otel::random_u64() % (self.expiry_jitter_ms + 1);
            cmd.arg(JitteredNow { now, jitter_ms });
        }
        for (all_or_nothing, pass, checks) in requests {
            cmd.arg(RequestHeader {
                checks: checks.len(),
                all_or_nothing,
                pass,
            });
            for check in checks {
                cmd.arg(CheckFields(check));
            }
        }
        cmd
    }
}

/// One budget operation in one hash slot (`lua/budget.lua`).
#[derive(Debug, Clone)]
pub struct BudgetOp {
    /// `reserve`, `check` or `settle`.
    pub op: &'static str,
    /// The reservation's nonce: its settlement's field in the record
    /// bucket (`record_bucket`; sent with a settle only, kept with a
    /// reserve for its give-back).
    pub nonce: String,
    /// The TTL in ms (reserve, check) or the actual cost (settle).
    pub amount: u64,
    /// This slot's checks (a settle's as reserved: hits the estimate).
    pub checks: Vec<Check>,
    /// A settle's reservation in this slot.
    pub settle: Option<SlotSettle>,
}

/// What a settle in one hash slot says of its reservation.
#[derive(Debug, Clone)]
pub struct SlotSettle {
    /// The reservation's TTL in ms, from when this slot was reserved.
    pub ttl_ms: u64,
    /// How much longer than its TTL this slot takes a settle, in ms: the
    /// later slots of a reservation over several (`RedisStore::settle`).
    pub extra_ms: u64,
    /// How long at least its record lives once settled, in ms (0: until
    /// it expires): the first slot of a reservation over several.
    pub keep_ms: u64,
    /// What the reservation took from each check.
    pub taken: Vec<Taken>,
}

impl SlotSettle {
    /// When this slot's TTL ends, on its clock (ms): what names its
    /// record's bucket, from what the reservation's id holds alone. Not
    /// the expiry, whose extra is the store's (a later slot's grace), so
    /// that the name never depends on how a replica is set.
    fn ttl_ends_ms(&self) -> u64 {
        let made_ms = self.taken.first().map_or(0, |taken| taken.at_ms);
        made_ms.saturating_add(self.ttl_ms)
    }

    /// When the reservation may no longer settle in this slot, on its
    /// clock (ms).
    fn expires_ms(&self) -> u64 {
        self.ttl_ends_ms().saturating_add(self.extra_ms)
    }
}

/// An operation's header argument: `"<op> <keys> <amount>"`, and for a
/// settle ` <expires ms> <keep ms>`.
struct BudgetHeader<'o>(&'o BudgetOp);

impl fmt::Display for BudgetHeader<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = self.0;
        write!(f, "{} {} {}", op.op, op.checks.len(), op.amount)?;
        if let Some(settle) = &op.settle {
            write!(f, " {} {}", settle.expires_ms(), settle.keep_ms)?;
        }
        Ok(())
    }
}

/// A settle's argument of each check's reservation time and mark:
/// `"<at> <mark>"`, space-separated, the mark `-` where it took nothing.
struct TakenArg<'t>(&'t [Taken]);

impl fmt::Display for TakenArg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, taken) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            match taken.mark {
                Some(mark) => write!(f, "{} {mark}", taken.at_ms)?,
                None => write!(f, "{} -", taken.at_ms)?,
            }
        }
        Ok(())
    }
}

/// The budget function's answer to a reserve (or check) of `checks`
/// checks: `[granted, (over, remaining, reset_ms) per check...]`, then when
/// granted the time and each check's mark (-1: none). Returns the
/// outcomes, and what was taken when granted.
pub fn reserved(reply: &[i64], checks: usize) -> Result<(Vec<Outcome>, Option<Vec<Taken>>)> {
    let fields = checks * REPLY_FIELDS;
    let malformed = || Error::Store(format!("budget script returned {reply:?}"));
    let (&granted, rest) = reply.split_first().ok_or_else(malformed)?;
    match (granted, rest.len().checked_sub(fields)) {
        (0, Some(0)) => Ok((outcomes(rest, checks)?, None)),
        (1, Some(extra)) if extra == 1 + checks => {
            let (answers, tail) = rest.split_at(fields);
            let at_ms = u64::try_from(tail[0]).map_err(|_| malformed())?;
            let taken = tail[1..]
                .iter()
                .map(|&mark| Taken {
                    at_ms,
                    mark: u64::try_from(mark).ok(),
                })
                .collect();
            Ok((outcomes(answers, checks)?, Some(taken)))
        }
        _ => Err(malformed()),
    }
}

/// The settle at 0 that gives back `op`, a reserve Redis granted with
/// `reply` after its caller stopped waiting; `None` for anything else.
pub fn give_back(op: &BudgetOp, reply: &[i64]) -> Option<BudgetOp> {
    if op.op != "reserve" {
        return None;
    }
    let taken = reserved(reply, op.checks.len()).ok()?.1?;
    Some(BudgetOp {
        op: "settle",
        nonce: op.nonce.clone(),
        amount: 0,
        checks: op.checks.clone(),
        settle: Some(SlotSettle {
            ttl_ms: op.amount,
            extra_ms: 0,
            keep_ms: 0,
            taken,
        }),
    })
}

/// The budget function's reply to a call of `ops` operations: each one's
/// own answer (as `lua/budget.lua` describes it), or its own error.
pub fn budget_answers(reply: &[i64], ops: usize) -> Result<Vec<Result<Vec<i64>>>> {
    let mut answers = Vec::with_capacity(ops);
    let mut rest = reply;
    while let Some((&len, tail)) = rest.split_first() {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > tail.len() {
            break;
        }
        let (answer, tail) = tail.split_at(len);
        answers.push(match answer {
            [-1, ..] => Err(Error::Store("malformed budget arguments".into())),
            _ => Ok(answer.to_vec()),
        });
        rest = tail;
    }
    if answers.len() != ops || !rest.is_empty() {
        return Err(Error::Store(format!(
            "budget script returned {reply:?} for {ops} operations"
        )));
    }
    Ok(answers)
}

/// Redis answered with an error whose text contains `text`.
fn detail_has(error: &RedisError, text: &str) -> bool {
    error.detail().is_some_and(|d| d.contains(text))
}

/// Redis refused a function command as unknown (before 7.0, or renamed
/// away) or not permitted (ACL: "no permissions to run the 'fcall'
/// command", not a key's permission, which scripts would meet as well).
fn no_functions(error: &RedisError) -> bool {
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::NoPerm) => detail_has(error, "command"),
        _ => error.code() == Some("ERR") && detail_has(error, "unknown command"),
    }
}

/// Values the script returns per check.
pub const REPLY_FIELDS: usize = 3;

/// How a call decides a request. Every call but a cluster's two passes
/// over a request whose `when_over` checks span hash slots decides it
/// ([`super::RedisStore::apply`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Decide and save.
    Decide,
    /// Decide and save nothing: which checks would be over.
    DryRun,
    /// Decide as refused (another slot of the request refused it).
    Refused,
}

/// A request's header argument: `"<checks> <flags>"`, the flags 1 for
/// all-or-nothing, plus 2 for [`Pass::Refused`] or 4 for [`Pass::DryRun`].
struct RequestHeader {
    checks: usize,
    all_or_nothing: bool,
    pass: Pass,
}

impl fmt::Display for RequestHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pass = match self.pass {
            Pass::Decide => 0,
            Pass::Refused => 2,
            Pass::DryRun => 4,
        };
        write!(
            f,
            "{} {}",
            self.checks,
            u8::from(self.all_or_nothing) + pass
        )
    }
}

/// The time argument with an expiry jitter: `"<now>j<ms>"` (`lua/README.md`).
struct JitteredNow<'a> {
    now: &'a str,
    jitter_ms: u64,
}

impl fmt::Display for JitteredNow<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}j{}", self.now, self.jitter_ms)
    }
}

/// A check's one argument: `"<tag> <limit> <period ms> <burst> <hits>
/// <enforce 0|1> <charges 0|1>"`. One argument rather than seven: Redis makes a string
/// object and a Lua string of every argument, which cost it more than the
/// check's own arithmetic, and the script parses each distinct one once
/// (`lua/README.md`).
struct CheckFields<'c>(&'c Check);

impl fmt::Display for CheckFields<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = self.0;
        write!(
            f,
            "{} {} {} {} {} {} {}",
            c.algorithm.key_tag(),
            c.limit,
            c.period_ms,
            c.burst,
            c.hits,
            u8::from(c.enforce),
            c.charges as u8
        )
    }
}

/// These are written straight into the command's buffer, formatted there
/// (`Cmd`'s `write_arg_fmt`): no allocation per argument.
macro_rules! formatted_arg {
    ($($t:ty),*) => {$(
        impl ToRedisArgs for $t {
            fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
                out.write_arg_fmt(self)
            }
        }
    )*};
}
formatted_arg!(
    RequestHeader,
    CheckFields<'_>,
    JitteredNow<'_>,
    BudgetHeader<'_>,
    TakenArg<'_>
);

/// The script's reply for `checks` checks, in the order they were sent.
/// An `over` of 2 or more is a charge recorded over the limit, which
/// admitted `over - 2` hits before it ([`Outcome::remaining_before`]).
pub fn outcomes(reply: &[i64], checks: usize) -> Result<Vec<Outcome>> {
    if reply.len() != checks * REPLY_FIELDS {
        return Err(Error::Store(format!(
            "script returned {} values for {checks} checks",
            reply.len()
        )));
    }
    Ok(reply
        .chunks_exact(REPLY_FIELDS)
        .map(|v| Outcome {
            over: v[0] != 0,
            remaining: v[1].max(0) as u64,
            reset_ms: v[2].max(0) as u64,
            remaining_before: (v[0] >= 2).then(|| (v[0] - 2) as u64),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|arg| match arg {
                Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "(cursor)".into(),
            })
            .collect()
    }

    /// The probe declares its slot's key on a cluster, where the client
    /// routes a call by its first key (to that slot's primary) and a
    /// keyless one to any node; elsewhere it names none.
    #[test]
    fn the_probe_names_a_key_only_to_be_routed_by_it() {
        for functions in [true, false] {
            let script = LimiterScript::new(functions);
            let keyed = args(&script.probe_command("5", Some("rk:probe:{7}")));
            assert_eq!(keyed[2..], ["1", "rk:probe:{7}", "5"], "{functions}");
            let keyless = args(&script.probe_command("", None));
            assert_eq!(keyless[2..], ["0", ""], "{functions}");
            let call = if functions { "FCALL" } else { "EVALSHA" };
            assert_eq!(keyed[0], call);
        }
    }
}
