//! The key reservation ids are signed with, shared by every replica.
//!
//! A reservation id carries what its settle gives back or charges (each
//! check's fields, time and mark: `reservation_id`), so the store records
//! nothing at reserve (`store::budget`). The id is trusted only under its
//! MAC: HMAC-SHA-256 with this key, cut to 128 bits. A forged or altered id
//! is refused before any store call.
//!
//! The key is 32 random bytes kept in the store under one name: the first
//! replica to ask publishes its own (`SET NX`), every other reads that one.
//! A replica reads it again at most every [`REREAD`] while it signs, and at
//! once (but at most every [`REREAD_ON_FAILURE`]) when an id fails its
//! check; the key it held before stays good for checking. So after Redis
//! lost the key (a flush, a restart without persistence) the replicas
//! agree again within [`REREAD`]: the first to ask publishes its key again.
//! Ids signed with a key no replica holds any more answer NOT_FOUND, as an
//! expired reservation does; what they took ages out with its window.
//! (On the in-memory store the key lives in the process: one replica.)

use std::sync::{PoisonError, RwLock};
use std::time::{Duration, Instant};

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use super::id_parts::{hex_bytes, push_hex_bytes};
use crate::store::Store;
use crate::{Error, Result};

/// How often a replica that signs reads the shared key again.
pub const REREAD: Duration = Duration::from_secs(10);

/// How often, at most, an id that fails its check makes a replica read the
/// key again: a stream of forged ids costs one store read a second.
pub const REREAD_ON_FAILURE: Duration = Duration::from_secs(1);

/// The length of a MAC in an id, bytes.
pub const MAC_BYTES: usize = 16;

/// The shared key and the one before it, as this replica last read them.
#[derive(Default)]
struct Held {
    /// The key's text as stored, and the key.
    current: Option<(String, hmac::Key)>,
    previous: Option<hmac::Key>,
    read_at: Option<Instant>,
    failed_reread_at: Option<Instant>,
}

/// The signing key of one replica's reservation ids.
pub struct IdKey {
    /// The store key it is kept under.
    name: String,
    held: RwLock<Held>,
}

impl std::fmt::Debug for IdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself.
        f.debug_struct("IdKey").field("name", &self.name).finish()
    }
}

impl IdKey {
    /// The key kept in the store under `name`.
    pub fn new(name: String) -> Self {
        IdKey {
            name,
            held: RwLock::default(),
        }
    }

    /// Makes sure a key is held to [`sign`](Self::sign) with: reads it
    /// from `store` when this replica has none yet, or read it [`REREAD`]
    /// ago. (Before a reserve, so that a reservation once taken is always
    /// given its id.)
    pub async fn ready(&self, store: &Store) -> Result<()> {
        let stale = {
            let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
            !held.read_at.is_some_and(|at| at.elapsed() < REREAD)
        };
        if stale {
            self.read(store).await?;
        }
        Ok(())
    }

    /// The MAC of `payload` under the key held (`None` before the first
    /// [`ready`](Self::ready)).
    pub fn sign(&self, payload: &[u8]) -> Option<[u8; MAC_BYTES]> {
        let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
        held.current.as_ref().map(|(_, key)| mac(key, payload))
    }

    /// Whether `tag` is the MAC of `payload` under the shared key or the
    /// one before it; on a mismatch the key is read again first (at most
    /// every [`REREAD_ON_FAILURE`]), in case the replicas moved to another.
    pub async fn verify(&self, store: &Store, payload: &[u8], tag: &[u8]) -> Result<bool> {
        if self.matches(payload, tag) {
            return Ok(true);
        }
        let due = {
            let mut held = self.held.write().unwrap_or_else(PoisonError::into_inner);
            let due = held.current.is_none()
                || !held
                    .failed_reread_at
                    .is_some_and(|at| at.elapsed() < REREAD_ON_FAILURE);
            if due {
                held.failed_reread_at = Some(Instant::now());
            }
            due
        };
        if !due {
            return Ok(false);
        }
        self.read(store).await?;
        Ok(self.matches(payload, tag))
    }

    fn matches(&self, payload: &[u8], tag: &[u8]) -> bool {
        let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
        let current = held.current.as_ref().map(|(_, key)| key);
        current
            .into_iter()
            .chain(held.previous.as_ref())
            .any(|key| constant_time_eq(&mac(key, payload), tag))
    }

    /// Reads the shared key, publishing this replica's (or a new one) when
    /// the store has none.
    async fn read(&self, store: &Store) -> Result<()> {
        let candidate = {
            let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
            match &held.current {
                Some((text, _)) => text.clone(),
                None => new_key_text()?,
            }
        };
        let text = store.shared_value(&self.name, &candidate).await?;
        let bytes = key_bytes(&text).ok_or_else(|| {
            Error::Store(format!(
                "{} does not hold a reservation id key (64 hex digits)",
                self.name
            ))
        })?;
        let mut held = self.held.write().unwrap_or_else(PoisonError::into_inner);
        let same = held.current.as_ref().is_some_and(|(held, _)| *held == text);
        if !same {
            let previous = held.current.take().map(|(_, key)| key);
            held.previous = previous;
            held.current = Some((text, hmac::Key::new(hmac::HMAC_SHA256, &bytes)));
        }
        held.read_at = Some(Instant::now());
        Ok(())
    }
}

/// HMAC-SHA-256 of `payload`, cut to [`MAC_BYTES`].
fn mac(key: &hmac::Key, payload: &[u8]) -> [u8; MAC_BYTES] {
    let tag = hmac::sign(key, payload);
    let mut out = [0; MAC_BYTES];
    out.copy_from_slice(&tag.as_ref()[..MAC_BYTES]);
    out
}

/// Equality that takes as long whatever the first difference: a MAC
/// compared byte by byte would tell a forger how much of it was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |d, (x, y)| d | (x ^ y)) == 0
}

/// 32 random bytes as 64 hex digits.
fn new_key_text() -> Result<String> {
    let mut bytes = [0u8; 32];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| Error::Store("the system's random source failed".into()))?;
    let mut text = String::with_capacity(64);
    push_hex_bytes(&mut text, &bytes);
    Ok(text)
}

/// The 32 bytes of a stored key's text.
fn key_bytes(text: &str) -> Option<Vec<u8>> {
    hex_bytes(text).filter(|bytes| bytes.len() == 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::store::MemoryStore;
    use std::sync::Arc;

    fn store() -> Store {
        Store::Memory(MemoryStore::new(Arc::new(ManualClock::new(0))))
    }

    #[tokio::test]
    async fn replicas_of_one_store_share_the_key_and_others_do_not() {
        let (one, other) = (store(), store());
        let (a, b, c) = (
            IdKey::new("k".into()),
            IdKey::new("k".into()),
            IdKey::new("k".into()),
        );
        assert_eq!(a.sign(b"payload"), None, "no key before ready");
        a.ready(&one).await.unwrap();
        let tag = a.sign(b"payload").unwrap();
        assert!(b.verify(&one, b"payload", &tag).await.unwrap());
        assert!(!b.verify(&one, b"payloae", &tag).await.unwrap());
        let mut altered = tag;
        altered[MAC_BYTES - 1] ^= 1;
        assert!(!b.verify(&one, b"payload", &altered).await.unwrap());
        assert!(!b.verify(&one, b"payload", &tag[..8]).await.unwrap());
        assert!(!c.verify(&other, b"payload", &tag).await.unwrap());
    }

    #[test]
    fn key_text_is_64_hex_digits() {
        let text = new_key_text().unwrap();
        assert_eq!(key_bytes(&text).map(|b| b.len()), Some(32));
        assert_ne!(text, new_key_text().unwrap());
        for bad in ["", "zz", &"a".repeat(63), &"g".repeat(64)] {
            assert_eq!(key_bytes(bad), None, "{bad}");
        }
    }
}
