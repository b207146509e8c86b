//! envoyproxy/ratelimit's stats that are read rather than counted: their
//! Redis pools' (`ratelimit.redis_pool.*`, and
//! `ratelimit.redis_per_second_pool.*` for `REDIS_PERSECOND`'s) and
//! their local cache's (`ratelimit.localcache.*`), made from our
//! connections ([`crate::store::PoolCounts`]) and over-limit caches
//! ([`crate::service::over_cache::CacheStats`]). Read at each statsd flush
//! and Prometheus scrape ([`their_stats::read_when_sent`]): the request
//! path does nothing for them.

use std::sync::{Arc, Weak};

use crate::service::over_cache::{CacheStats, OverCache};
use crate::statsd::{Reader, Reading};
use crate::store::{PoolCounts, PoolReader, Role, Stores};
use crate::their_stats;

/// A pool stat: its name in the pool's scope, how it is sent, its count.
type PoolStat = (&'static str, Reading, fn(PoolCounts) -> u64);

/// A local cache stat: its name in their `localcache` scope, its count.
type CacheStat = (&'static str, fn(&CacheStats) -> u64);

/// Sends the pool stats of each Redis store and, with `local_cache` (theirs
/// has a cache only with `LOCAL_CACHE_SIZE_IN_BYTES` set), the local cache
/// stats of the over-limit caches together (theirs has one cache for both
/// Redis). Neither keeps the stores or caches alive.
pub fn register(stores: &Stores, caches: &Stores<Arc<OverCache>>, local_cache: bool) {
    for (role, store) in stores.iter() {
        if let Some(pool) = store.pool() {
            register_pool(role, pool);
        }
    }
    if local_cache {
        let caches: Vec<Weak<OverCache>> = caches.iter().map(|(_, c)| Arc::downgrade(c)).collect();
        register_cache(Arc::new(caches));
    }
}

/// `cx_active` (a gauge), `cx_total` and `cx_local_close` (counters), as
/// their radix pool trace counts them.
fn register_pool(role: Role, pool: PoolReader) {
    let scope = match role {
        Role::Main => "redis_pool",
        Role::PerSecond => "redis_per_second_pool",
    };
    let pool = Arc::new(pool);
    let stats: [PoolStat; 3] = [
        ("cx_active", Reading::Gauge, |c| c.active),
        ("cx_total", Reading::Total, |c| c.opened),
        ("cx_local_close", Reading::Total, |c| c.closed),
    ];
    for (stat, reading, read) in stats {
        let pool = pool.clone();
        let reader: Reader = Arc::new(move || read(pool.counts()));
        their_stats::read_when_sent(&format!("ratelimit.{scope}.{stat}"), reading, reader);
    }
}

/// The freecache gauges whose meaning carries over (see [`CacheStats`]);
/// theirs are gauges holding running totals, and so are these.
fn register_cache(caches: Arc<Vec<Weak<OverCache>>>) {
    let stats: [CacheStat; 4] = [
        ("entryCount", |s| s.entries),
        ("hitCount", |s| s.hits),
        ("expiredCount", |s| s.expired),
        ("overwriteCount", |s| s.overwrites),
    ];
    for (stat, read) in stats {
        let caches = caches.clone();
        let reader: Reader = Arc::new(move || {
            let live = caches.iter().filter_map(Weak::upgrade);
            live.map(|cache| read(&cache.stats())).sum()
        });
        let name = format!("ratelimit.localcache.{stat}");
        their_stats::read_when_sent(&name, Reading::Gauge, reader);
    }
}
