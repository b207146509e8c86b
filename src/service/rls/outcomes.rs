//! Step 2 of a decision: the outcomes of a plan's checks. The over-limit
//! cache ([`OverCache`]) answers when it knows every check's counter to be
//! full until its window ends — the hot key of a refused caller then costs
//! no store round trip; otherwise the store applies the checks as one
//! atomic step, and the cache learns from its answer. With a per-second
//! store ([`Stores`]), each store's checks go to it (and its cache) at
//! once, and a store that fails leaves the other's outcomes standing
//! (under `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` both are asked first
//! whether either refuses: [`refused_across`]).

use std::cell::Cell;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::join;

use crate::limiter::{Check, Outcome};
use crate::otel::shared::{StoreCallTrace, STORE_CALL};
use crate::otel::DecisionSpan;
use crate::service::over_cache::{OverCache, Ticket};
use crate::store::limiter_script::Pass;
use crate::store::stores::{Joined, Part};
use crate::store::{Role, Store, Stores};
use crate::{Error, Result};

/// A store failed: which, why, and the outcomes the other store gave.
#[derive(Debug)]
pub struct Failed {
    pub error: Error,
    pub store: Role,
    /// Per check, its outcome where its store answered (all `None` when
    /// the failed store held every check).
    pub answered: Vec<Option<Outcome>>,
}

/// The checks' outcomes, each from its store or that store's cache, and
/// whether the caches answered them all; a sampled decision's `span`
/// follows the main store's part.
pub async fn from_cache_or_stores(
    stores: &Stores,
    overs: &Stores<Arc<OverCache>>,
    checks: &[Check],
    all_or_nothing: bool,
    mut span: Option<&mut DecisionSpan>,
) -> std::result::Result<(Vec<Outcome>, Source), Failed> {
    if let Some(role) = stores.only(checks) {
        let (store, over) = (stores.get(role), overs.get(role));
        return from_cache_or_store(store, over, checks, all_or_nothing, span)
            .await
            .map_err(|error| Failed {
                error,
                store: role,
                answered: vec![None; checks.len()],
            });
    }
    let [main, per_second] = stores.split(checks);
    let parts = [&main, &per_second];
    let trace = span.as_deref_mut();
    if let Some(refused) = refused_across(stores, overs, parts, all_or_nothing, trace).await {
        return refused;
    }
    let part = |role: Role, checks, span| {
        from_cache_or_store(
            stores.get(role),
            overs.get(role),
            checks,
            all_or_nothing,
            span,
        )
    };
    let answers = join(
        part(main.role, &main.checks, span),
        part(per_second.role, &per_second.checks, None),
    )
    .await;
    let cached = [&answers.0, &answers.1]
        .iter()
        .all(|answer| matches!(answer, Ok((_, Source::Cache))));
    let outcomes_of = |answer: Result<(Vec<Outcome>, Source)>| answer.map(|(o, _)| o);
    let joined = Joined::new(
        checks.len(),
        [
            (main, outcomes_of(answers.0)),
            (per_second, outcomes_of(answers.1)),
        ],
    );
    let source = if cached { Source::Cache } else { Source::Store };
    answer_of(joined, source)
}

/// The joined outcomes of a request's parts, or which store failed.
fn answer_of(
    joined: Joined,
    source: Source,
) -> std::result::Result<(Vec<Outcome>, Source), Failed> {
    let checks = joined.outcomes.len();
    match joined.failure {
        None => joined
            .complete()
            .map(|outcomes| (outcomes, source))
            .map_err(|error| Failed {
                error,
                store: Role::Main,
                answered: vec![None; checks],
            }),
        Some((error, store)) => Err(Failed {
            error,
            store,
            answered: joined.outcomes,
        }),
    }
}

/// Under `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, a request spanning
/// both Redis is refused when either refuses it, sparing the fixed windows
/// it fitted in the other: each part is first known from its over-limit
/// cache (every check full) or asked of its Redis without counting, as
/// theirs reads every key of both before it counts. When an enforced check
/// of either is over, the parts the cache knows are answered by it and the
/// others decided as refused (their cache learning from them). `None` when
/// the request is not refused (decided then as usual, each store its
/// part), when no check spares what it fitted, or when a store fails to
/// answer the first question (the usual path then meets that failure, and
/// its mode); also when, decided as refused, no enforced check is over any
/// more (a window ended between the two questions): the usual path decides
/// it anew rather than admit it uncounted. A sampled decision's `span`
/// follows the main Redis's part, as on the usual path: the store call is
/// its refused pass, or the cache answered it.
async fn refused_across(
    stores: &Stores,
    overs: &Stores<Arc<OverCache>>,
    parts: [&Part; 2],
    all_or_nothing: bool,
    mut span: Option<&mut DecisionSpan>,
) -> Option<std::result::Result<(Vec<Outcome>, Source), Failed>> {
    let (Store::Redis(main), Store::Redis(per_second)) =
        (stores.get(Role::Main), stores.get(Role::PerSecond))
    else {
        return None;
    };
    if !parts
        .iter()
        .any(|p| p.checks.iter().any(Check::spares_fitted))
    {
        return None;
    }
    let redis = |part: &Part| match part.role {
        Role::Main => main,
        Role::PerSecond => per_second,
    };
    let tickets = parts.map(|part| overs.get(part.role).ticket());
    // Peeked: counted as the cache's answers only when they are used.
    let known = parts.map(|part| {
        let (over, now_ms) = (overs.get(part.role), stores.get(part.role).now_ms());
        let known: Option<Vec<Outcome>> =
            part.checks.iter().map(|c| over.peek(c, now_ms)).collect();
        known
    });
    let ask = |i: usize, pass| {
        ask_unless_known(redis(parts[i]), parts[i], &known[i], all_or_nothing, pass)
    };
    let cache_refuses = parts
        .iter()
        .zip(&known)
        .any(|(part, known)| known.as_deref().is_some_and(|o| refuses(part, o)));
    // The cache refusing already (a hot key), nothing is asked first.
    if !cache_refuses {
        let asked = join(ask(0, Pass::DryRun), ask(1, Pass::DryRun)).await;
        let (first, second) = (asked.0.ok()?, asked.1.ok()?);
        if !(refuses(parts[0], &first) || refuses(parts[1], &second)) {
            return None;
        }
    }
    // The dry run before the refused pass is not a span of its own.
    let (main_kind, main_checks) = (stores.get(parts[0].role).kind(), parts[0].checks.len());
    let main_span = span.as_deref_mut().filter(|_| known[0].is_none());
    let main_call = async {
        let call = ask(0, Pass::Refused);
        match main_span {
            None => call.await,
            Some(span) => traced(span, main_kind, main_checks, call).await,
        }
    };
    let decided = join(main_call, ask(1, Pass::Refused)).await;
    let answers = [decided.0, decided.1];
    let refused = decided_as_refused(stores, overs, parts, answers, &known, tickets)?;
    if let (Some(span), Some(_)) = (span, &known[0]) {
        span.answered_by("cache");
    }
    Some(refused)
}

/// Whether an enforced check of `part` is over in `outcomes`.
fn refuses(part: &Part, outcomes: &[Outcome]) -> bool {
    let mut checked = part.checks.iter().zip(outcomes);
    checked.any(|(check, outcome)| check.refused_by(outcome))
}

/// [`refused_across`]'s answer once both parts were decided as refused
/// (`answers`): each cache that did not answer its part learns from its
/// store's answer (under the `tickets` taken before asking), the parts the
/// caches knew (`known`) count as their answers, and the request is
/// refused; `None` when no enforced check is over any more and both
/// stores answered.
fn decided_as_refused(
    stores: &Stores,
    overs: &Stores<Arc<OverCache>>,
    parts: [&Part; 2],
    answers: [Result<Vec<Outcome>>; 2],
    known: &[Option<Vec<Outcome>>; 2],
    tickets: [Ticket; 2],
) -> Option<std::result::Result<(Vec<Outcome>, Source), Failed>> {
    for ((part, answer), (known, ticket)) in
        parts.iter().zip(&answers).zip(known.iter().zip(tickets))
    {
        let over = overs.get(part.role);
        match (answer, known) {
            (Ok(outcomes), None) => over.learn(
                ticket,
                &part.checks,
                outcomes,
                stores.get(part.role).now_ms(),
            ),
            (Ok(_), Some(_)) => over.count_answered(part.checks.len()),
            (Err(_), _) => {}
        }
    }
    let still_refused = parts
        .iter()
        .zip(&answers)
        .any(|(part, answer)| answer.as_ref().is_ok_and(|o| refuses(part, o)));
    if !still_refused && answers.iter().all(Result::is_ok) {
        return None;
    }
    let [first, second] = answers;
    let checks = parts[0].indices.len() + parts[1].indices.len();
    let joined = Joined::new(
        checks,
        [(parts[0].clone(), first), (parts[1].clone(), second)],
    );
    let source = match known.iter().all(Option::is_some) {
        true => Source::Cache,
        false => Source::Store,
    };
    Some(answer_of(joined, source))
}

/// A part's outcomes: `known` (its over-limit cache's), else its Redis's
/// in `pass`.
async fn ask_unless_known(
    redis: &crate::store::RedisStore,
    part: &Part,
    known: &Option<Vec<Outcome>>,
    all_or_nothing: bool,
    pass: Pass,
) -> Result<Vec<Outcome>> {
    match known {
        Some(outcomes) => Ok(outcomes.clone()),
        None => {
            redis
                .apply_in_pass(&part.checks, all_or_nothing, pass)
                .await
        }
    }
}

/// Which answered: envoyproxy/ratelimit counts the cache's answers apart
/// (`over_limit_with_local_cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Cache,
    Store,
}

/// The checks' outcomes, from the cache or the store (and which); a
/// sampled decision's `span` learns which, and the store call's time.
pub async fn from_cache_or_store(
    store: &Store,
    over: &OverCache,
    checks: &[Check],
    all_or_nothing: bool,
    span: Option<&mut DecisionSpan>,
) -> Result<(Vec<Outcome>, Source)> {
    let now_ms = store.now_ms();
    if let Some(known) = over.answer(checks, now_ms) {
        metrics::counter!("ratekeeper_over_limit_cache_hits").increment(1);
        if let Some(span) = span {
            span.answered_by("cache");
        }
        return Ok((known, Source::Cache));
    }
    let ticket = over.ticket();
    let call = store.apply(checks, all_or_nothing);
    let outcomes = match span {
        None => call.await,
        Some(span) => traced(span, store.kind(), checks.len(), call).await,
    }?;
    over.learn(ticket, checks, &outcomes, now_ms);
    Ok((outcomes, Source::Store))
}

/// A store `call` of `checks` checks to a store of `kind`, as a sampled
/// decision's `span` sees it: a child span, which a call shared by several
/// decisions links to. (Unsampled calls are awaited as they are: wrapped,
/// the store's future would be moved into this one on every request.)
async fn traced(
    span: &mut DecisionSpan,
    kind: &'static str,
    checks: usize,
    call: impl Future<Output = Result<Vec<Outcome>>>,
) -> Result<Vec<Outcome>> {
    let trace = StoreCallTrace {
        store_span: span.begin_store_call(),
        shared: Cell::new(None),
    };
    let (outcomes, shared) = STORE_CALL
        .scope(trace, async {
            let outcomes = call.await;
            (outcomes, STORE_CALL.with(|t| t.shared.get()))
        })
        .await;
    let error = outcomes.as_ref().err().map(ToString::to_string);
    span.end_store_call(kind, checks, error, shared);
    outcomes
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::{Algorithm, Charges};
    use crate::store::{Generation, MemoryStore};

    fn check(algorithm: Algorithm) -> Check {
        Check {
            key: format!("k-{algorithm:?}"),
            algorithm,
            limit: 1,
            period_ms: 60_000,
            burst: 1,
            hits: 1,
            enforce: true,
            charges: Charges::Drop,
        }
    }

    #[tokio::test]
    async fn a_full_fixed_window_is_answered_from_the_cache_until_it_ends() {
        let clock = Arc::new(ManualClock::new(60_000));
        let store = Store::Memory(MemoryStore::new(clock.clone()));
        // A store that has never seen the key: it would admit.
        let fresh = Store::Memory(MemoryStore::new(clock.clone()));
        let over = OverCache::new(Generation::default());
        let fw = [check(Algorithm::FixedWindow)];
        let (first, _) = from_cache_or_store(&store, &over, &fw, true, None)
            .await
            .unwrap();
        assert!(!first[0].over);
        let (full, source) = from_cache_or_store(&store, &over, &fw, true, None)
            .await
            .unwrap();
        assert!(full[0].over && full[0].remaining == 0);
        assert_eq!(source, Source::Store);
        let cached = from_cache_or_store(&fresh, &over, &fw, true, None)
            .await
            .unwrap();
        assert_eq!(cached, (full, Source::Cache), "answered from the cache");
        clock.advance(60_000);
        let (next, _) = from_cache_or_store(&fresh, &over, &fw, true, None)
            .await
            .unwrap();
        assert!(!next[0].over, "a new window asks the store again");
    }

    #[tokio::test]
    async fn other_algorithms_always_ask_the_store() {
        let clock = Arc::new(ManualClock::new(60_000));
        let store = Store::Memory(MemoryStore::new(clock.clone()));
        let fresh = Store::Memory(MemoryStore::new(clock));
        let over = OverCache::new(Generation::default());
        let tb = [check(Algorithm::TokenBucket)];
        from_cache_or_store(&store, &over, &tb, true, None)
            .await
            .unwrap();
        let (full, _) = from_cache_or_store(&store, &over, &tb, true, None)
            .await
            .unwrap();
        assert!(full[0].over);
        let (again, _) = from_cache_or_store(&fresh, &over, &tb, true, None)
            .await
            .unwrap();
        assert!(!again[0].over, "the store was asked: its counter is gone");
    }
}
