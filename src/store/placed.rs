//! A request's checks answered in parts (a hash slot each, or a store
//! each) and put back in the checks' order.

use crate::{Error, Result};

/// Puts `answers`, one per index of `part` (positions among the request's
/// checks), at those positions of `into`.
pub fn place<T>(into: &mut [Option<T>], part: &[usize], answers: impl IntoIterator<Item = T>) {
    for (&i, answer) in part.iter().zip(answers) {
        into[i] = Some(answer);
    }
}

/// Every check's answer, in order; an error if a check got none.
pub fn every_answer<T>(answers: Vec<Option<T>>) -> Result<Vec<T>> {
    answers
        .into_iter()
        .map(|a| a.ok_or_else(|| Error::Store("a check got no answer".into())))
        .collect()
}
