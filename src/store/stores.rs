//! A server's counter stores: the main one and, with envoyproxy/ratelimit's
//! `REDIS_PERSECOND`, a second Redis for the limits whose unit is the
//! second (theirs sends those, and only those, there). [`Stores::role_of`]
//! is the one place that decides which store a check goes to; everything
//! kept per store (the over-limit cache, health) follows it through
//! [`Stores::map`].
//!
//! A request whose checks span both stores cannot be one atomic step: each
//! store applies its own checks, all-or-nothing among them, as the slots of
//! a Redis Cluster do (envoyproxy/ratelimit is never all-or-nothing).

use futures_util::future::join;

use super::placed::{every_answer, place};
use super::Store;
use crate::limiter::{Check, Outcome};
use crate::{Error, Result};

/// Which of a server's stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Main,
    /// Limits whose unit is the second (`REDIS_PERSECOND`).
    PerSecond,
}

impl Role {
    /// Its place in what is kept per store in an array (main 0, per-second
    /// 1), as the paced log lines of each store are.
    pub fn index(self) -> usize {
        usize::from(self == Role::PerSecond)
    }

    /// The `store` label of the store metrics.
    pub fn name(self) -> &'static str {
        match self {
            Role::Main => "main",
            Role::PerSecond => "per_second",
        }
    }
}

/// The period of a limit whose unit is the second.
const SECOND_MS: u64 = 1_000;

/// One `S` per store: the stores themselves, or what is kept beside each.
#[derive(Debug, Clone)]
pub struct Stores<S = Store> {
    main: S,
    per_second: Option<S>,
}

impl From<Store> for Stores {
    fn from(store: Store) -> Self {
        Stores::new(store, None)
    }
}

impl<S> Stores<S> {
    pub fn new(main: S, per_second: Option<S>) -> Self {
        Stores { main, per_second }
    }

    /// The main store: every limit not per second, and the concurrency
    /// leases.
    pub fn main(&self) -> &S {
        &self.main
    }

    /// The store playing `role` (the main one when there is no other).
    pub fn get(&self, role: Role) -> &S {
        match (role, &self.per_second) {
            (Role::PerSecond, Some(per_second)) => per_second,
            _ => &self.main,
        }
    }

    /// Which store `check`'s counter lives in.
    pub fn role_of(&self, check: &Check) -> Role {
        if self.per_second.is_some() && check.period_ms == SECOND_MS {
            Role::PerSecond
        } else {
            Role::Main
        }
    }

    /// The store of `check`'s counter.
    pub fn for_check(&self, check: &Check) -> &S {
        self.get(self.role_of(check))
    }

    /// The one store all of `checks` live in, if they share one (always,
    /// without a per-second store: no allocation on the common path).
    pub fn only(&self, checks: &[Check]) -> Option<Role> {
        let first = checks.first().map_or(Role::Main, |c| self.role_of(c));
        checks
            .iter()
            .all(|c| self.role_of(c) == first)
            .then_some(first)
    }

    /// Each store with its role, the main one first.
    pub fn iter(&self) -> impl Iterator<Item = (Role, &S)> {
        std::iter::once((Role::Main, &self.main))
            .chain(self.per_second.iter().map(|s| (Role::PerSecond, s)))
    }

    /// What `f` makes of each store, kept by the same roles.
    pub fn map<T>(&self, mut f: impl FnMut(&S) -> T) -> Stores<T> {
        Stores {
            main: f(&self.main),
            per_second: self.per_second.as_ref().map(f),
        }
    }
}

/// The checks of one store, picked out of a request's.
#[derive(Clone)]
pub struct Part {
    pub role: Role,
    /// Where each check sits in the request.
    pub indices: Vec<usize>,
    pub checks: Vec<Check>,
}

/// The parts' answers put back in the request's order.
pub struct Joined {
    /// Per check, its outcome where its store answered.
    pub outcomes: Vec<Option<Outcome>>,
    /// The first part that failed: why, and which store.
    pub failure: Option<(Error, Role)>,
}

impl Joined {
    pub fn new(checks: usize, answers: [(Part, Result<Vec<Outcome>>); 2]) -> Joined {
        let mut joined = Joined {
            outcomes: vec![None; checks],
            failure: None,
        };
        for (part, answer) in answers {
            match answer {
                Ok(outcomes) => place(&mut joined.outcomes, &part.indices, outcomes),
                Err(error) => {
                    joined.failure = joined.failure.or(Some((error, part.role)));
                }
            }
        }
        joined
    }

    /// Every check's outcome (an error if a check got none).
    pub fn complete(self) -> Result<Vec<Outcome>> {
        every_answer(self.outcomes)
    }
}

impl Stores {
    /// `checks` by store, the main store's first, neither empty: for a
    /// request they span ([`Stores::only`] is `None`).
    pub fn split(&self, checks: &[Check]) -> [Part; 2] {
        let part = |role| {
            let indices: Vec<usize> = (0..checks.len())
                .filter(|&i| self.role_of(&checks[i]) == role)
                .collect();
            let checks = indices.iter().map(|&i| checks[i].clone()).collect();
            Part {
                role,
                indices,
                checks,
            }
        };
        [part(Role::Main), part(Role::PerSecond)]
    }

    /// Applies `checks`, each store its own at once, each all-or-nothing
    /// on its own (see the module doc); fails if either store fails.
    pub async fn apply(&self, checks: &[Check], all_or_nothing: bool) -> Result<Vec<Outcome>> {
        if let Some(role) = self.only(checks) {
            return self.get(role).apply(checks, all_or_nothing).await;
        }
        let [main, per_second] = self.split(checks);
        let answers = join(
            self.get(main.role).apply(&main.checks, all_or_nothing),
            self.get(per_second.role)
                .apply(&per_second.checks, all_or_nothing),
        )
        .await;
        let joined = Joined::new(checks.len(), [(main, answers.0), (per_second, answers.1)]);
        match joined.failure {
            Some((error, _)) => Err(error),
            None => joined.complete(),
        }
    }

    /// Deletes the counters of `checks` (the admin API's reset), each from
    /// its store.
    pub async fn delete(&self, checks: &[Check]) -> Result<()> {
        for (role, store) in self.iter() {
            let keys: Vec<String> = checks
                .iter()
                .filter(|c| self.role_of(c) == role)
                .map(|c| c.key.clone())
                .collect();
            if !keys.is_empty() {
                store.delete(&keys).await?;
            }
        }
        Ok(())
    }

    /// The same stores as used by serving lane `lane` ([`Store::for_lane`]).
    pub fn for_lane(&self, lane: usize) -> Stores {
        self.map(|store| store.for_lane(lane))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::Algorithm;
    use crate::store::MemoryStore;

    fn check(key: &str, period_ms: u64, limit: u64) -> Check {
        Check::for_test(key, Algorithm::FixedWindow, limit, period_ms, 1)
    }

    #[test]
    fn only_per_second_limits_go_to_the_per_second_store() {
        let one: Stores<&str> = Stores::new("main", None);
        let two = Stores::new("main", Some("per second"));
        let (second, minute) = (check("s", 1_000, 1), check("m", 60_000, 1));
        let two_seconds = check("2s", 2_000, 1);
        assert_eq!(*one.for_check(&second), "main");
        assert_eq!(*two.for_check(&second), "per second");
        assert_eq!(*two.for_check(&minute), "main");
        assert_eq!(*two.for_check(&two_seconds), "main");
        assert_eq!(
            two.only(std::slice::from_ref(&second)),
            Some(Role::PerSecond)
        );
        assert_eq!(two.only(&[minute.clone(), second]), None);
        assert_eq!(one.only(&[minute]), Some(Role::Main));
    }

    #[tokio::test]
    async fn a_request_spanning_both_is_all_or_nothing_per_store() {
        let clock = Arc::new(ManualClock::new(60_000));
        let (main, per_second) = (
            MemoryStore::new(clock.clone()),
            MemoryStore::new(clock.clone()),
        );
        let stores = Stores::new(
            Store::Memory(main.clone()),
            Some(Store::Memory(per_second.clone())),
        );
        // The per-second limit is full: it refuses, yet the minute limit,
        // in the other store, counts (as across Cluster slots).
        let full = [check("s", 1_000, 1)];
        stores.apply(&full, true).await.unwrap();
        let both = [check("m", 60_000, 5), check("s", 1_000, 1)];
        let outcomes = stores.apply(&both, true).await.unwrap();
        assert_eq!(
            outcomes
                .iter()
                .map(|o| (o.over, o.remaining))
                .collect::<Vec<_>>(),
            [(false, 4), (true, 0)]
        );
        assert_eq!(main.len(), 1, "the minute counter lives in the main store");
        assert_eq!(per_second.len(), 1);
        stores.delete(&both).await.unwrap();
        assert_eq!((main.len(), per_second.len()), (0, 0));
    }
}
