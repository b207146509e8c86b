//! The limiter script as Redis sees it: its text (the files of `lua/`
//! joined), the `EVALSHA` command carrying one or more requests' checks, and
//! the reply read back as [`Outcome`]s. Arguments are described in
//! `lua/README.md`.

use redis::Cmd;

use crate::limiter::{Check, Outcome};
use crate::{Error, Result};

/// The one limiter script: helpers, every algorithm, then the batch driver.
pub const TEXT: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/sliding_window.lua"),
    include_str!("../../lua/sliding_log.lua"),
    include_str!("../../lua/gcra.lua"),
    include_str!("../../lua/batch.lua"),
);

/// Values the script returns per check.
const REPLY_FIELDS: usize = 3;

/// `EVALSHA` of the script (by `hash`) deciding `requests` one after another,
/// each `(all_or_nothing, checks)`; `now` is the pinned time in ms or `""`
/// for the server's clock. Checks are borrowed where they are (a cluster
/// slot's are picked out of its request), and integers are written straight
/// into the command's one buffer: no allocation per argument.
pub fn command<'c, R, C>(hash: &str, now: &str, requests: R) -> Cmd
where
    R: Iterator<Item = (bool, C)> + Clone,
    C: ExactSizeIterator<Item = &'c Check>,
{
    let keys: usize = requests.clone().map(|(_, checks)| checks.len()).sum();
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(hash).arg(keys);
    for (_, checks) in requests.clone() {
        for check in checks {
            cmd.arg(check.key.as_str());
        }
    }
    cmd.arg(now);
    for (all_or_nothing, checks) in requests {
        cmd.arg(flag(all_or_nothing)).arg(checks.len());
        for check in checks {
            cmd.arg(check.algorithm.key_tag())
                .arg(check.limit)
                .arg(check.period_ms)
                .arg(check.burst)
                .arg(check.hits)
                .arg(flag(check.enforce));
        }
    }
    cmd
}

fn flag(on: bool) -> &'static str {
    if on {
        "1"
    } else {
        "0"
    }
}

/// The script's reply for `checks` checks, in the order they were sent.
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
        })
        .collect())
}
