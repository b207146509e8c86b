//! Serving lanes: one single-threaded Tokio runtime per core, each serving
//! its share of the client connections.
//!
//! On one multi-threaded runtime a request hops between threads: its HTTP/2
//! stream is read on one, its Redis reply arrives on another, and its
//! answer is written from a third, each hop a wake-up across cores and a
//! cache miss, and each buffer freed on a thread other than the one that
//! allocated it. In a lane everything a request touches — its connection,
//! its Redis batch (see `store::batcher`), the Redis connection that carries
//! the batch and that connection's reader — lives on one thread, so a
//! request never leaves it: each lane serves its own copy of the services,
//! holding the store as that lane sees it (`Store::for_lane`). Each accepted connection goes to the lane with
//! the fewest open (`incoming::deal`); the work of one client connection
//! stays on one core, which is how Envoy uses a rate limit service anyway (a
//! connection per Envoy worker).

use std::sync::mpsc;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::{Error, Result};

/// How many lanes to run when not told: one per core available to the
/// process (cgroup CPU limits included).
pub fn default_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Running lanes; dropping this stops them (each finishes the task it is
/// polling, then its runtime and thread end).
pub struct Lanes {
    handles: Vec<Handle>,
    stops: Vec<oneshot::Sender<()>>,
}

impl std::fmt::Debug for Lanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("count", &self.handles.len())
            .finish()
    }
}

impl Lanes {
    /// Starts `count` lanes (at least one), each a thread running its own
    /// current-thread runtime with I/O and timers.
    pub fn start(count: usize) -> Result<Lanes> {
        let mut lanes = Lanes {
            handles: Vec::new(),
            stops: Vec::new(),
        };
        for index in 0..count.max(1) {
            let (started, handle) = mpsc::channel();
            let (stop, stopped) = oneshot::channel::<()>();
            std::thread::Builder::new()
                .name(format!("rk-lane-{index}"))
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(runtime) => runtime,
                        Err(error) => {
                            let _ = started.send(Err(error));
                            return;
                        }
                    };
                    let _ = started.send(Ok(runtime.handle().clone()));
                    runtime.block_on(async {
                        let _ = stopped.await;
                    });
                })
                .map_err(|source| Error::Io {
                    context: "starting a serving thread".into(),
                    source,
                })?;
            let handle = handle
                .recv()
                .map_err(|_| Error::Startup("a serving thread died at start".into()))?
                .map_err(|source| Error::Io {
                    context: "building a serving thread's runtime".into(),
                    source,
                })?;
            lanes.handles.push(handle);
            lanes.stops.push(stop);
        }
        Ok(lanes)
    }

    /// Each lane's runtime, in lane order.
    pub fn handles(&self) -> &[Handle] {
        &self.handles
    }

    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }
}

impl Drop for Lanes {
    fn drop(&mut self) {
        for stop in self.stops.drain(..) {
            let _ = stop.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_run_on_their_lane() {
        let lanes = Lanes::start(3).expect("lanes");
        let thread = || std::thread::current().name().map(str::to_owned);
        for (i, handle) in lanes.handles().iter().enumerate() {
            let seen = handle.spawn(async move { thread() }).await.expect("task");
            assert_eq!(seen, Some(format!("rk-lane-{i}")));
        }
    }

    #[tokio::test]
    async fn dropping_the_lanes_ends_their_tasks() {
        let lanes = Lanes::start(1).expect("lanes");
        let never = lanes.handles()[0].spawn(std::future::pending::<()>());
        drop(lanes);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), never).await;
        assert!(ended
            .expect("ended in time")
            .is_err_and(|e| e.is_cancelled()));
    }
}
