//! A run: its threads, each with its own single-threaded runtime,
//! connections and share of the tasks (and of the open loop's schedule);
//! all connect first, then start together, and their tallies are merged.

use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;
use tonic::transport::{Channel, Endpoint};

use crate::args::Args;
use crate::call::Caller;
use crate::keys::{KeyDist, KeySpace};
use crate::pacer::{pace, Alarm};
use crate::request::RequestTemplate;
use crate::schedule::Schedule;
use crate::tally::Tally;
use crate::tasks::{closed_loop_task, open_loop_task, Window};

/// What one run measured.
pub struct Summary {
    pub tally: Tally,
    pub measured: Duration,
    pub cpu: Option<Duration>,
}

/// When a run's load starts and stops: the same for every thread.
#[derive(Debug, Clone, Copy)]
struct Timing {
    start: Instant,
    window: Window,
    /// Open loop: requests not sent by then are counted as unsent.
    hard_stop: Instant,
}

/// What thread `index` of `threads` takes of `total` (connections, tasks):
/// every `threads`-th one, starting at `index`.
fn share(total: usize, index: usize, threads: usize) -> impl Iterator<Item = usize> {
    (index..total).step_by(threads)
}

/// Runs the load described by `args` on its threads and gathers the
/// results. Every thread connects first; the load starts once all have.
pub fn run(args: &Args, dist: KeyDist) -> Result<Summary, String> {
    // Each thread needs a connection and a task of its own.
    let threads = args
        .threads
        .min(args.connections.max(1))
        .min(args.concurrency.max(1))
        .max(1);
    let keys = Arc::new(KeySpace::new(dist));
    let budget = args.requests.map(|n| Arc::new(AtomicU64::new(n)));
    let (ready_tx, ready) = std::sync::mpsc::channel::<Result<(), String>>();
    let mut starts = Vec::with_capacity(threads);
    let mut workers = Vec::with_capacity(threads);
    for index in 0..threads {
        let (start_tx, start) = std::sync::mpsc::channel::<Timing>();
        starts.push(start_tx);
        let (args, keys, budget, ready) =
            (args.clone(), keys.clone(), budget.clone(), ready_tx.clone());
        let worker = std::thread::Builder::new()
            .name(format!("bench-{index}"))
            .spawn(move || thread_load(&args, index, threads, keys, budget, ready, start))
            .map_err(|e| format!("cannot start a generator thread: {e}"))?;
        workers.push(worker);
    }
    drop(ready_tx);
    for _ in 0..threads {
        // A thread that ended without a word failed to report (it panicked).
        ready
            .recv()
            .map_err(|_| "a generator thread ended before connecting".to_owned())??;
    }
    let cpu_start = process_cpu();
    let start = Instant::now();
    let window = Window {
        measure_from: start + Duration::from_secs_f64(args.warmup),
        end: start + Duration::from_secs_f64(args.warmup + args.duration),
    };
    let timing = Timing {
        start,
        window,
        hard_stop: window.end + Duration::from_secs_f64((args.duration * 0.2).max(1.0)),
    };
    for start in &starts {
        // A thread that already ended reports its error when joined.
        let _ = start.send(timing);
    }
    let mut tally = Tally::new();
    for worker in workers {
        let thread_tally = worker
            .join()
            .map_err(|_| "a generator thread panicked".to_owned())??;
        tally.merge(thread_tally);
    }
    // Calls started (or intended) in [measure_from, end) are counted; with a
    // request budget the run may end early.
    let measured = Instant::now()
        .min(window.end)
        .saturating_duration_since(window.measure_from);
    let cpu = match (cpu_start, process_cpu()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    Ok(Summary {
        tally,
        measured,
        cpu,
    })
}

/// One generator thread: its own runtime, its share of the connections and
/// tasks, and (open loop) its share of the schedule. Says when it is
/// connected, then waits for the run's start.
fn thread_load(
    args: &Args,
    index: usize,
    threads: usize,
    keys: Arc<KeySpace>,
    budget: Option<Arc<AtomicU64>>,
    ready: Sender<Result<(), String>>,
    start: Receiver<Timing>,
) -> Result<Tally, String> {
    let (runtime, channels, alarm) = match prepare(args, index, threads) {
        Ok(prepared) => {
            let _ = ready.send(Ok(()));
            prepared
        }
        Err(e) => {
            let _ = ready.send(Err(e.clone()));
            return Err(e);
        }
    };
    drop(ready);
    let Ok(timing) = start.recv() else {
        // Another thread failed to connect: the run is off.
        return Ok(Tally::new());
    };
    let part = ThreadShare {
        index,
        threads,
        channels,
        alarm,
        keys,
        budget,
    };
    runtime.block_on(load(args, part, timing))
}

/// A thread's runtime, its connections and (open loop) its pacer's timer.
fn prepare(
    args: &Args,
    index: usize,
    threads: usize,
) -> Result<(Runtime, Vec<Channel>, Option<Alarm>), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let connections = share(args.connections.max(1), index, threads).count();
    let channels = runtime.block_on(connect(&args.addr, connections))?;
    // The timer registers with the reactor of the runtime entered.
    let entered = runtime.enter();
    let alarm = args
        .rate
        .map(|_| Alarm::new())
        .transpose()
        .map_err(|e| format!("cannot create the pacer's timer: {e}"))?;
    drop(entered);
    Ok((runtime, channels, alarm))
}

/// What one thread of a run works with.
struct ThreadShare {
    index: usize,
    threads: usize,
    channels: Vec<Channel>,
    alarm: Option<Alarm>,
    keys: Arc<KeySpace>,
    budget: Option<Arc<AtomicU64>>,
}

/// A thread's load: its tasks (and open loop, its pacer), run to the end;
/// their tallies merged.
async fn load(args: &Args, part: ThreadShare, timing: Timing) -> Result<Tally, String> {
    let timeout = Duration::from_millis(args.timeout_ms);
    let ThreadShare {
        index,
        threads,
        channels,
        alarm,
        keys,
        budget,
    } = part;
    let schedule = args.rate.map(|rate| {
        Arc::new(Schedule::new(
            timing.start,
            timing.window.end,
            rate,
            index,
            threads,
        ))
    });
    let task_ids: Vec<usize> = share(args.concurrency.max(1), index, threads).collect();
    let pacer = match (&schedule, alarm) {
        (Some(schedule), Some(alarm)) => {
            let schedule = schedule.clone();
            let quantum = Duration::from_micros(args.pace_us);
            let tasks = task_ids.len();
            Some(tokio::spawn(async move {
                let paced = pace(&schedule, alarm, quantum, tasks).await;
                if paced.is_err() {
                    // Waiting tasks must not hang on a pacer that failed.
                    schedule.abandon();
                }
                paced
            }))
        }
        _ => None,
    };
    let mut tasks = Vec::new();
    for (n, &i) in task_ids.iter().enumerate() {
        let client = Caller::new(args, channels[n % channels.len()].clone());
        let template = RequestTemplate::new(args, keys.clone(), 0x5EED ^ (i as u64) << 20);
        tasks.push(match &schedule {
            Some(schedule) => tokio::spawn(open_loop_task(
                client,
                template,
                schedule.clone(),
                timing.window,
                timing.hard_stop,
                timeout,
            )),
            None => tokio::spawn(closed_loop_task(
                client,
                template,
                timing.window,
                budget.clone(),
                timeout,
            )),
        });
    }
    let mut tally = Tally::new();
    for task in tasks {
        match task.await {
            Ok(t) => tally.merge(t),
            Err(e) => return Err(format!("a load task failed: {e}")),
        }
    }
    if let Some(pacer) = pacer {
        pacer
            .await
            .map_err(|e| format!("the pacer failed: {e}"))??;
    }
    Ok(tally)
}

/// Opens `count` HTTP/2 channels to `addr`.
pub async fn connect(addr: &str, count: usize) -> Result<Vec<Channel>, String> {
    let uri = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let endpoint = Endpoint::from_shared(uri.clone())
        .map_err(|e| format!("bad address {addr:?}: {e}"))?
        .tcp_nodelay(true)
        .buffer_size(65_536)
        .initial_connection_window_size(16 << 20)
        .initial_stream_window_size(1 << 20);
    let mut channels = Vec::with_capacity(count);
    for _ in 0..count.max(1) {
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| format!("cannot connect to {uri}: {e}"))?;
        channels.push(channel);
    }
    Ok(channels)
}

/// CPU time (user + system) this process has used so far.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields overall, in clock ticks (USER_HZ = 100 on Linux).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_share_connections_and_tasks_without_overlap() {
        let mut seen: Vec<usize> = (0..3).flat_map(|t| share(10, t, 3)).collect();
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        assert_eq!(share(4, 1, 2).collect::<Vec<_>>(), vec![1, 3]);
    }
}
