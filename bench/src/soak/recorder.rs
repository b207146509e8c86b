//! Where the soak run's tasks put what they saw: the timeline, the audit
//! admissions and the first error of each kind, behind locks (a few
//! hundred calls a second: contention is not a concern here).

use std::sync::Mutex;
use std::time::SystemTime;

use crate::soak::audit::Admission;
use crate::soak::timeline::{Counts, Timeline};

/// The run's shared record.
#[derive(Debug, Default)]
pub struct Recorder {
    timeline: Mutex<Timeline>,
    admissions: Mutex<Vec<Admission>>,
    first_errors: Mutex<Vec<String>>,
}

/// Distinct error texts kept for the summary.
const ERRORS_KEPT: usize = 8;

impl Recorder {
    /// Updates the counts of the second `sent` falls in, on `replica`.
    pub fn count(&self, sent: SystemTime, replica: usize, update: impl FnOnce(&mut Counts)) {
        // A task that panicked while holding the lock left counts that are
        // still counts: keep going with them.
        let mut timeline = self.timeline.lock().unwrap_or_else(|e| e.into_inner());
        update(timeline.at(sent, replica));
    }

    pub fn admit(&self, admission: Admission) {
        self.admissions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(admission);
    }

    /// Keeps `message` if it is one of the first few distinct errors.
    pub fn error(&self, message: String) {
        let mut errors = self.first_errors.lock().unwrap_or_else(|e| e.into_inner());
        if errors.len() < ERRORS_KEPT && !errors.contains(&message) {
            errors.push(message);
        }
    }

    /// Everything recorded, taken out.
    pub fn finish(self) -> (Timeline, Vec<Admission>, Vec<String>) {
        (
            self.timeline
                .into_inner()
                .unwrap_or_else(|e| e.into_inner()),
            self.admissions
                .into_inner()
                .unwrap_or_else(|e| e.into_inner()),
            self.first_errors
                .into_inner()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }
}
