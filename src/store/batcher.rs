//! Joins concurrent requests into one script call (standalone and Sentinel
//! Redis; a cluster call can only touch one slot): the limiter's checks
//! ([`Checks`]) and the budget's reserves and settles ([`BudgetOps`]).
//!
//! Every script call costs Redis a fixed price (command dispatch, running
//! the script's top level, the reply) and costs ratekeeper a round trip
//! through the connection's pipeline. Under load those fixed costs dominate
//! a one-check request, so requests that arrive while earlier calls are in
//! flight wait and then go together in the next call. Nothing waits for a
//! batch to fill: with a call slot free, a request is sent at once (alone,
//! at low load), so batching adds no latency, only takes away queueing.
//!
//! The script decides the requests of a call one after another, each
//! atomic on its own, exactly as if they had come in separate calls in
//! that order.
//!
//! Every request is answered within the call deadline of its arrival,
//! queueing included, without a timer of its own (arming a Tokio timer
//! per request cost a wake-up of the runtime's driver, an `eventfd` write,
//! for about one request in seven under load): a call must answer by the
//! earliest deadline among its requests, and a request whose deadline
//! passed while it queued is answered with the error and not sent. The
//! queue is first in, first out and every deadline is arrival plus the
//! same call deadline, so the calls a request waits behind (sent before
//! it, or carrying requests that arrived before it) end by its own
//! deadline: it reaches a call, or its error, in time.
//!
//! Budget operations are the exception ([`Batched::late`]): their calls
//! wait for Redis [`LATE_ANSWER`] past their callers' deadline, each caller
//! on a timer of its own, so that a Reserve Redis granted after its caller
//! stopped waiting is given back from its answer ([`Batched::unclaimed`]):
//! nothing else records it.
//!
//! Tracing: a call carrying several requests, sampled ones among them, is
//! reported back to them as one shared call (`otel::shared`), so that it
//! appears once in a trace and the other decisions link to it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Cmd;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::caller::Caller;
use super::connection::LATE_ANSWER;
use super::limiter_script::{self, script_now, BudgetOp, LimiterScript};
use crate::clock::Clock;
use crate::limiter::{Check, Outcome};
use crate::otel::shared::{self, SharedCall, SpanRef};
use crate::otel::{new_span_id, now_ns};
use crate::{Error, Result};

/// Most checks in one script call: bounds how long one call holds Redis's
/// single thread (a request larger than this still goes, alone).
const MAX_CHECKS_PER_CALL: usize = 256;

/// A kind of request a [`Batcher`] joins: how a call of several is made,
/// and how its reply is handed back to each.
pub trait Batched: Send + Sync + 'static {
    /// One request.
    type Request: Send + Sync + 'static;
    /// One request's answer.
    type Answer: Send + 'static;
    /// The checks a request carries (bounds a call's size, and tracing
    /// reports it).
    fn checks(request: &Self::Request) -> usize;
    /// The call deciding `requests` in order; `now` as [`script_now`].
    fn command(&self, now: &str, requests: &[&Self::Request]) -> Cmd;
    /// The reply of that call, as one answer per request (in order).
    fn answers(&self, reply: &[i64], requests: &[&Self::Request]) -> Result<Vec<Self::Answer>>;
    /// The script the call runs (for its reload).
    fn script(&self) -> &LimiterScript;
    /// How much longer than its caller waits a call keeps waiting for
    /// Redis, so that what it made late can be undone (`unclaimed`). A
    /// caller then waits on a timer of its own.
    fn late(&self) -> Duration {
        Duration::ZERO
    }
    /// What undoes `answer` to `request`, which its caller no longer waits
    /// for (it went away, or its deadline passed while Redis was slow):
    /// sent in the background.
    fn unclaimed(&self, _request: &Self::Request, _answer: &Self::Answer) -> Option<Self::Request> {
        None
    }
    /// Whether `answer`, to what `unclaimed` made, says it undid.
    fn undid(_answer: &Self::Answer) -> bool {
        true
    }
}

/// The limiter's requests: checks, and whether all or nothing.
pub struct Checks(pub Arc<LimiterScript>);

impl Batched for Checks {
    type Request = (Vec<Check>, bool);
    type Answer = Vec<Outcome>;

    fn checks(request: &Self::Request) -> usize {
        request.0.len()
    }

    fn command(&self, now: &str, requests: &[&Self::Request]) -> Cmd {
        let requests = requests.iter().map(|(checks, all)| (*all, checks.iter()));
        self.0.command(now, requests)
    }

    fn answers(&self, reply: &[i64], requests: &[&Self::Request]) -> Result<Vec<Vec<Outcome>>> {
        let total = requests.iter().map(|r| r.0.len()).sum();
        let mut rest = limiter_script::outcomes(reply, total)?.into_iter();
        Ok(requests
            .iter()
            .map(|r| rest.by_ref().take(r.0.len()).collect())
            .collect())
    }

    fn script(&self) -> &LimiterScript {
        &self.0
    }
}

/// The budget's reserves and settles, each answered with its own reply
/// (or its own error: a malformed one fails alone).
pub struct BudgetOps(pub Arc<LimiterScript>);

impl Batched for BudgetOps {
    type Request = BudgetOp;
    type Answer = Result<Vec<i64>>;

    fn checks(request: &BudgetOp) -> usize {
        request.checks.len()
    }

    fn command(&self, now: &str, requests: &[&BudgetOp]) -> Cmd {
        self.0.budget_command(now, requests.iter().copied())
    }

    fn answers(&self, reply: &[i64], requests: &[&BudgetOp]) -> Result<Vec<Result<Vec<i64>>>> {
        limiter_script::budget_answers(reply, requests.len())
    }

    fn script(&self) -> &LimiterScript {
        &self.0
    }

    fn late(&self) -> Duration {
        LATE_ANSWER
    }

    fn unclaimed(&self, request: &BudgetOp, answer: &Result<Vec<i64>>) -> Option<BudgetOp> {
        limiter_script::give_back(request, answer.as_deref().ok()?)
    }

    /// A settle's answer: settled now (1) or before (2), not unknown (0).
    fn undid(answer: &Result<Vec<i64>>) -> bool {
        matches!(answer.as_deref(), Ok([1 | 2, ..]))
    }
}

/// Logs how the give-back of a reservation made after its caller had
/// stopped waiting ended: `Ok(true)` given back.
pub fn log_give_back(ended: Result<bool>) {
    match ended {
        Ok(true) => {
            tracing::info!("gave back a reservation made after its caller had stopped waiting")
        }
        Ok(false) => tracing::warn!(
            "a reservation made after its caller had stopped waiting was not given back (its \
             TTL had passed): it stays charged until its window passes"
        ),
        Err(error) => tracing::warn!(
            %error,
            "could not give back a reservation made after its caller had stopped waiting: it \
             stays charged until its window passes"
        ),
    }
}

/// Sends requests to Redis in as few script calls as keeps up.
pub struct Batcher<K: Batched> {
    caller: Arc<Caller>,
    kind: K,
    clock: Option<Arc<dyn Clock>>,
    /// Calls in flight at most; requests beyond wait for the next call.
    max_in_flight: usize,
    state: Mutex<State<K>>,
}

struct State<K: Batched> {
    waiting: Vec<Waiting<K>>,
    in_flight: usize,
}

/// A request waiting to be sent, and where its answer goes.
struct Waiting<K: Batched> {
    request: K::Request,
    /// Answered by then: its arrival plus the call deadline.
    deadline: Instant,
    /// The store span of a sampled decision (tracing).
    trace: Option<SpanRef>,
    answer: oneshot::Sender<Reply<K>>,
}

/// A request's answer, and for a sampled one the call that carried it.
type Reply<K> = (Result<<K as Batched>::Answer>, Option<SharedCall>);

impl<K: Batched> Batcher<K> {
    pub fn new(
        caller: Arc<Caller>,
        kind: K,
        clock: Option<Arc<dyn Clock>>,
        max_in_flight: usize,
    ) -> Self {
        Batcher {
            caller,
            kind,
            clock,
            max_in_flight: max_in_flight.max(1),
            state: Mutex::new(State {
                waiting: Vec::new(),
                in_flight: 0,
            }),
        }
    }

    /// Decides one request, as one atomic step in Redis; answers within
    /// the call deadline (queueing included) or fails.
    pub async fn apply(self: &Arc<Self>, request: K::Request) -> Result<K::Answer> {
        // No breaker check here: the call checks it once, and a second
        // check would take the one probe the breaker grants after its
        // cool-down, leaving the call itself refused.
        let (answer, answered) = oneshot::channel();
        let waited = self.caller.call_timeout;
        let late = self.kind.late();
        let request = Waiting {
            request,
            deadline: Instant::now() + waited + late,
            trace: shared::current(),
            answer,
        };
        let start = {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.waiting.push(request);
            if state.in_flight < self.max_in_flight {
                state.in_flight += 1;
                Some(next_call(&mut state.waiting))
            } else {
                None
            }
        };
        if let Some(call) = start {
            // A task of its own, so that this caller going away (a client
            // cancelling) can never strand the other requests of its call.
            tokio::spawn(Arc::clone(self).send(call));
        }
        // No timer here unless the call may outlast this caller (`late`):
        // `send` answers by the deadline (module doc).
        let answered = if late.is_zero() {
            answered.await.ok()
        } else {
            match tokio::time::timeout(waited, answered).await {
                Ok(answered) => answered.ok(),
                Err(_) => {
                    let slow = Error::Store(format!("no answer within {waited:?}"));
                    Some((Err(slow), None))
                }
            }
        };
        let (result, carried_by) = answered.unwrap_or_else(|| {
            let lost = Error::Store("the call carrying this request was lost".into());
            (Err(lost), None)
        });
        if let Some(call) = carried_by {
            shared::carried_by(call);
        }
        result
    }

    /// Sends `call`, then whatever queued meanwhile, until nothing waits.
    async fn send(self: Arc<Self>, mut call: Vec<Waiting<K>>) {
        loop {
            // A caller that stopped waiting (client gone) must not have its
            // hits counted; one whose deadline passed in the queue gets the
            // error instead of a late call.
            call.retain(|w| !w.answer.is_closed());
            let now = Instant::now();
            if call.iter().any(|w| w.deadline <= now) {
                let late;
                (late, call) = call.into_iter().partition(|w| w.deadline <= now);
                let waited = self.caller.call_timeout;
                deliver(
                    late,
                    Err(Error::StoreNotCalled(format!(
                        "no answer within {waited:?}"
                    ))),
                    None,
                    &self.kind,
                );
            }
            if !call.is_empty() {
                // A call of one request is that request's own store span.
                let owner = (call.len() > 1)
                    .then(|| call.iter().find_map(|w| w.trace))
                    .flatten();
                let start_ns = owner.map(|_| now_ns());
                let result = self.call(&call).await;
                let shared = owner.zip(start_ns).map(|(owner, start_ns)| SharedCall {
                    span: SpanRef {
                        trace_id: owner.trace_id,
                        span_id: new_span_id(),
                    },
                    owner,
                    start_ns,
                    end_ns: now_ns(),
                    requests: call.len(),
                    checks: call.iter().map(|w| K::checks(&w.request)).sum(),
                });
                for undo in deliver(call, result, shared, &self.kind) {
                    tokio::spawn(Arc::clone(&self).undo(undo));
                }
            }
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if state.waiting.is_empty() {
                state.in_flight -= 1;
                return;
            }
            call = next_call(&mut state.waiting);
        }
    }

    /// Sends `undo` ([`Batched::unclaimed`]) in the background. Boxed: a
    /// call that `send` spawns, which spawns `send` in turn.
    fn undo(self: Arc<Self>, undo: K::Request) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            log_give_back(self.apply(undo).await.map(|answer| K::undid(&answer)));
        })
    }

    async fn call(&self, call: &[Waiting<K>]) -> Result<Vec<K::Answer>> {
        let now = script_now(self.clock.as_ref());
        let requests: Vec<&K::Request> = call.iter().map(|w| &w.request).collect();
        let cmd = self.kind.command(&now, &requests);
        let deadline = call
            .iter()
            .map(|w| w.deadline)
            .min()
            .unwrap_or_else(|| Instant::now() + self.caller.call_timeout);
        let reply: Vec<i64> = self
            .caller
            .eval_by(self.kind.script(), &cmd, deadline)
            .await?;
        let answers = self.kind.answers(&reply, &requests)?;
        if answers.len() != call.len() {
            return Err(Error::Store(format!(
                "script answered {} of {} requests",
                answers.len(),
                call.len()
            )));
        }
        Ok(answers)
    }
}

/// Takes the requests for the next call off the front of the queue: at
/// least one, and more while they fit in [`MAX_CHECKS_PER_CALL`].
fn next_call<K: Batched>(waiting: &mut Vec<Waiting<K>>) -> Vec<Waiting<K>> {
    let mut checks = 0;
    let mut take = 0;
    for w in waiting.iter() {
        let size = K::checks(&w.request);
        if take > 0 && checks + size > MAX_CHECKS_PER_CALL {
            break;
        }
        checks += size;
        take += 1;
    }
    if take == waiting.len() {
        return std::mem::take(waiting);
    }
    waiting.drain(..take).collect()
}

/// Hands each request its answer (or the call's error), and each sampled
/// one the `shared` call's span; returns what undoes the answers nobody
/// took ([`Batched::unclaimed`]).
fn deliver<K: Batched>(
    call: Vec<Waiting<K>>,
    result: Result<Vec<K::Answer>>,
    shared: Option<SharedCall>,
    kind: &K,
) -> Vec<K::Request> {
    let carried = |w: &Waiting<K>| shared.filter(|_| w.trace.is_some());
    let mut undo = Vec::new();
    match result {
        Ok(answers) => {
            for (w, answer) in call.into_iter().zip(answers) {
                let shared = carried(&w);
                if let Err((Ok(answer), _)) = w.answer.send((Ok(answer), shared)) {
                    undo.extend(kind.unclaimed(&w.request, &answer));
                }
            }
        }
        Err(error) => {
            let (message, called) = match error {
                Error::Store(message) => (message, true),
                Error::StoreNotCalled(message) => (message, false),
                other => (other.to_string(), true),
            };
            for w in call {
                let shared = carried(&w);
                let error = match called {
                    true => Error::Store(message.clone()),
                    false => Error::StoreNotCalled(message.clone()),
                };
                let _ = w.answer.send((Err(error), shared));
            }
        }
    }
    undo
}
