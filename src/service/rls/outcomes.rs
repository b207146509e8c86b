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
use std::sync::Arc;

use futures_util::future::join;

use crate::limiter::{Check, Outcome};
use crate::otel::shared::{StoreCallTrace, STORE_CALL};
use crate::otel::DecisionSpan;
use crate::service::over_cache::OverCache;
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
    span: Option<&mut DecisionSpan>,
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
    if let Some(refused) = refused_across(stores, overs, [&main, &per_second], all_or_nothing).await
    {
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
    match joined.failure {
        None => joined
            .complete()
            .map(|outcomes| (outcomes, source))
            .map_err(|error| Failed {
                error,
                store: Role::Main,
                answered: vec![None; checks.len()],
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
/// it fitted in the other: both are asked first without counting (a part
/// the over-limit cache answers is refused already), as theirs reads every
/// key of both before it counts. The outcomes when so refused; `None` when
/// it is not (decided then as usual, each store its part), when no check
/// spares what it fitted, or when a store fails to answer the first
/// question (the usual path then meets that failure, and its mode).
async fn refused_across(
    stores: &Stores,
    overs: &Stores<Arc<OverCache>>,
    parts: [&Part; 2],
    all_or_nothing: bool,
) -> Option<std::result::Result<(Vec<Outcome>, Source), Failed>> {
    let [main, per_second] = parts;
    let (Store::Redis(one), Store::Redis(other)) =
        (stores.get(main.role), stores.get(per_second.role))
    else {
        return None;
    };
    if !parts
        .iter()
        .any(|p| p.checks.iter().any(Check::spares_fitted))
    {
        return None;
    }
    // Peeked, not asked: not counted as the cache's answer.
    let cached = |part: &Part| {
        let (now_ms, over) = (stores.get(part.role).now_ms(), overs.get(part.role));
        part.checks
            .iter()
            .all(|check| over.peek(check, now_ms).is_some())
    };
    if !(cached(main) || cached(per_second)) {
        let (a, b) = join(
            one.apply_in_pass(&main.checks, all_or_nothing, Pass::DryRun),
            other.apply_in_pass(&per_second.checks, all_or_nothing, Pass::DryRun),
        )
        .await;
        let refused = |part: &Part, outcomes: Vec<Outcome>| {
            let mut over = part.checks.iter().zip(outcomes);
            over.any(|(check, outcome)| outcome.over && check.enforce)
        };
        if !(refused(main, a.ok()?) || refused(per_second, b.ok()?)) {
            return None;
        }
    }
    let answers = join(
        one.apply_in_pass(&main.checks, all_or_nothing, Pass::Refused),
        other.apply_in_pass(&per_second.checks, all_or_nothing, Pass::Refused),
    )
    .await;
    let checks = main.indices.len() + per_second.indices.len();
    let joined = Joined::new(
        checks,
        [(main.clone(), answers.0), (per_second.clone(), answers.1)],
    );
    Some(match joined.failure {
        None => joined
            .complete()
            .map(|outcomes| (outcomes, Source::Store))
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
    })
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
    let outcomes = match span {
        None => store.apply(checks, all_or_nothing).await,
        Some(span) => {
            let trace = StoreCallTrace {
                store_span: span.begin_store_call(),
                shared: Cell::new(None),
            };
            let (outcomes, shared) = STORE_CALL
                .scope(trace, async {
                    let outcomes = store.apply(checks, all_or_nothing).await;
                    (outcomes, STORE_CALL.with(|t| t.shared.get()))
                })
                .await;
            let error = outcomes.as_ref().err().map(ToString::to_string);
            span.end_store_call(store.kind(), checks.len(), error, shared);
            outcomes
        }
    }?;
    over.learn(ticket, checks, &outcomes, now_ms);
    Ok((outcomes, Source::Store))
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
