//! The admin API's view of concurrency leases: the live leases of one
//! limited entity (domain + descriptor entries, as in `AcquireConnection`),
//! and revoking one. A revoked lease is gone from its set, so its holder's
//! next heartbeat finds it lost (a `Hold` stream gets `lost` at its next
//! refresh, on whichever replica holds it).

use serde::Serialize;

use super::lease_id::set_key;
use super::rls::AdminError;
use crate::config::watch::SharedConfig;
use crate::keys::Values;
use crate::store::{LeaseRef, Store};

/// What the admin API needs to find an entity's lease set.
#[derive(Debug, Clone)]
pub struct AdminLeases {
    pub config: SharedConfig,
    pub store: Store,
    pub key_prefix: String,
    pub values: Values,
}

/// An entity's concurrency rule and live leases.
#[derive(Debug, Serialize)]
pub struct Listed {
    pub rule: String,
    pub max_connections: u32,
    pub leases: Vec<Lease>,
}

/// One live lease. The id is the random part of the lease id the holder
/// got (before its first `.`).
#[derive(Debug, Serialize)]
pub struct Lease {
    pub id: String,
    /// When it expires without a heartbeat, in Unix ms (the store's clock).
    pub expires_at_ms: u64,
    /// The `holder` its `AcquireConnection`/`Hold` named; empty if none.
    pub holder: String,
}

impl AdminLeases {
    /// The live leases of the entity `entries` name in `domain`.
    pub async fn list(
        &self,
        domain: &str,
        entries: &[(String, String)],
    ) -> Result<Listed, AdminError> {
        let (key, rule, max_connections) = self.set_of(domain, entries)?;
        let members = self
            .store
            .leases(&key)
            .await
            .map_err(|e| AdminError::Store(e.to_string()))?;
        Ok(Listed {
            rule,
            max_connections,
            leases: members
                .into_iter()
                .map(|lease| Lease {
                    id: lease.member,
                    expires_at_ms: lease.expires_at_ms,
                    holder: lease.holder,
                })
                .collect(),
        })
    }

    /// Removes lease `id` (its random part, or the whole lease id) from the
    /// entity's set; returns whether it was there.
    pub async fn revoke(
        &self,
        domain: &str,
        entries: &[(String, String)],
        id: &str,
    ) -> Result<bool, AdminError> {
        let member = id.split('.').next().unwrap_or(id);
        if member.len() != 32 || !member.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(AdminError::BadInput(format!(
                "lease {id:?} is not a lease id (32 hex digits first)"
            )));
        }
        let (key, _, _) = self.set_of(domain, entries)?;
        let fail = |e: crate::Error| AdminError::Store(e.to_string());
        let live = self.store.leases(&key).await.map_err(fail)?;
        let found = live.iter().any(|lease| lease.member == member);
        let keys = [key];
        let lease = LeaseRef {
            member,
            ttl_ms: 0,
            keys: &keys,
        };
        self.store.release(&[lease]).await.map_err(fail)?;
        Ok(found)
    }

    /// The entity's lease set key, its rule's path and limit.
    fn set_of(
        &self,
        domain: &str,
        entries: &[(String, String)],
    ) -> Result<(String, String, u32), AdminError> {
        let config = self.config.current();
        let rules = &config
            .domain(domain)
            .ok_or_else(|| AdminError::UnknownDomain(domain.to_owned()))?
            .concurrency;
        let pairs = entries.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let rule = rules.find(pairs.clone()).ok_or_else(|| {
            AdminError::BadInput(format!("no concurrency rule of {domain:?} matches"))
        })?;
        let key = set_key(&self.key_prefix, domain, pairs, self.values);
        Ok((key, rule.path.clone(), rule.max_connections))
    }
}
