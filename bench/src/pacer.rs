//! The open loop's pacer: a task on each thread's runtime that releases the
//! [`Schedule`]'s requests as they fall due, sleeping on a `timerfd` in
//! between (Tokio's timer rounds to 1 ms, which an open loop would count as
//! latency).

use std::time::{Duration, Instant};

use crate::schedule::Schedule;

/// Releases requests as they fall due, waking at most once per `quantum`;
/// then one permit more for each of the `tasks`, which claim past the end
/// and stop. (Closing the semaphore instead could refuse a permit already
/// handed to a task not yet polled: its request would be lost.)
pub async fn pace(
    schedule: &Schedule,
    alarm: Alarm,
    quantum: Duration,
    tasks: usize,
) -> Result<(), String> {
    let mut released: u64 = 0;
    while released < schedule.total {
        let now = Instant::now();
        let mut due = 0;
        while released < schedule.total && schedule.due_at(released) <= now {
            released += 1;
            due += 1;
        }
        if due > 0 {
            schedule.release(due);
        }
        if released < schedule.total {
            let next = schedule.due_at(released).max(Instant::now() + quantum);
            alarm
                .sleep_until(next)
                .await
                .map_err(|e| format!("the pacer's timer failed: {e}"))?;
        }
    }
    schedule.release(tasks);
    Ok(())
}

/// A `timerfd` registered with the thread's runtime: sleeps to the
/// microsecond without another thread.
pub struct Alarm {
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl Alarm {
    /// A new timer, registered with the runtime entered.
    pub fn new() -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: timerfd_create takes no pointers; a negative return is an
        // error, anything else a new descriptor that we alone own.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a valid descriptor owned by no one else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: the AsyncFd owns `fd`, which stays open as long as it does.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)?
        };
        Ok(Alarm { fd })
    }

    /// Returns at `when` (at once if it has passed).
    pub async fn sleep_until(&self, when: Instant) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let wait = when.saturating_duration_since(Instant::now());
        if wait.is_zero() {
            return Ok(());
        }
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: wait.as_secs() as libc::time_t,
                // Below 10^9: fits any c_long.
                tv_nsec: wait.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: `spec` is a valid itimerspec; a null old value is allowed.
        if unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) }
            != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        loop {
            let mut ready = self.fd.readable().await?;
            let mut expirations = [0u8; 8];
            // SAFETY: reads at most 8 bytes into an 8-byte buffer.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    expirations.as_mut_ptr().cast(),
                    expirations.len(),
                )
            };
            if n == 8 {
                return Ok(());
            }
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::WouldBlock {
                return Err(error);
            }
            ready.clear_ready();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alarm_sleeps_until_its_time_and_can_be_rearmed() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let alarm = Alarm::new().unwrap();
            for wait_us in [300, 1_500, 0] {
                let when = Instant::now() + Duration::from_micros(wait_us);
                alarm.sleep_until(when).await.unwrap();
                assert!(Instant::now() >= when);
            }
        });
    }
}
