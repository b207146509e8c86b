//! `ratekeeper-bench`: a load generator for any server speaking Envoy's rate
//! limit API v3 (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`).
//!
//! Two modes:
//! - **closed loop** (default): `--concurrency N` tasks, each with one request
//!   in flight at a time; latency is measured from the send.
//! - **open loop** (`--rate R`): request `i` is due at `start + i / R`. A
//!   pacer releases send permits as requests fall due; `--concurrency N`
//!   tasks take them, send, and measure latency from the request's
//!   *intended* send time, so a server (or generator) that falls behind shows
//!   up as latency instead of silently lowering the rate (no coordinated
//!   omission). How late sends were against their due times is reported too.
//!
//! The generator shares the machine with the server it measures, so it is
//! built to wake as little as it can: each of `--threads` threads runs its
//! own single-threaded runtime with its share of the `--connections` HTTP/2
//! channels, the tasks and (open loop) the schedule, every `--threads`-th
//! request, paced by a `timerfd` in that runtime (Tokio's own timer has 1 ms
//! granularity). A request never crosses threads, and no thread wakes
//! another. Each task keeps one request and rewrites only its descriptor
//! values. It prints a human summary and, as the last line, one JSON object
//! for scripts (`bench/run.sh`).
//!
//! `--write-request FILE` writes the first request it would send, framed as
//! a gRPC message, and exits: the body for another HTTP/2 load tool (`make
//! bench` gives it to `h2load -d`). `--write-limiter-library FILE` and
//! `--write-limiter-script FILE` write the limiter as ratekeeper loads it, as
//! a function library or as a script (for `redis-benchmark` and callgrind
//! runs of `FCALL` and `EVALSHA`), and exit.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use hdrhistogram::Histogram;
use tokio::sync::Semaphore;
use tonic::transport::{Channel, Endpoint};

// The generator shares the machine with the server it measures: the less CPU
// it spends per call, the more the server gets.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Command-line options.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ratekeeper-bench",
    about = "Load generator for Envoy rate limit service v3 servers"
)]
struct Args {
    /// Server address (`http://host:port` or `host:port`).
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    addr: String,
    /// Requests in flight (closed loop), or sending tasks, i.e. the most
    /// requests in flight (open loop).
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Open loop: requests per second, measured from intended send times.
    #[arg(long)]
    rate: Option<f64>,
    /// Measured seconds (after the warm-up).
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Seconds of load before measuring.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Stop after this many requests in all (closed loop; warm-up included).
    #[arg(long)]
    requests: Option<u64>,
    /// HTTP/2 connections the requests are spread over.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Descriptor values: `distinct` (a new one per request), `uniform:K`,
    /// `hot` (one value), `zipf:K:S` (K values, exponent S).
    #[arg(long, default_value = "distinct")]
    keys: String,
    /// Descriptors per request (descriptor i > 0 gets the value suffix `.i`).
    #[arg(long, default_value_t = 1)]
    descriptors: usize,
    /// The request's domain.
    #[arg(long, default_value = "bench")]
    domain: String,
    /// The key of each descriptor's one entry.
    #[arg(long, default_value = "user_id")]
    key: String,
    /// Generator threads, each with its own runtime, connections and share
    /// of the tasks and of the rate (no more than `--connections`).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Open loop: each thread's pacer wakes at most once per this many µs and
    /// releases every request due by then (fewer wake-ups, at most this much
    /// lag).
    #[arg(long, default_value_t = 100)]
    pace_us: u64,
    /// Per-call deadline in milliseconds (a call past it counts as an error).
    #[arg(long, default_value_t = 5_000)]
    timeout_ms: u64,
    /// Free text copied into the JSON line.
    #[arg(long, default_value = "")]
    label: String,
    /// Write the first request, gRPC-framed, to this file and exit.
    #[arg(long)]
    write_request: Option<std::path::PathBuf>,
    /// Write the limiter's Redis function library (`FUNCTION LOAD` text;
    /// its function has the library's name, on the first line) and exit.
    #[arg(long)]
    write_limiter_library: Option<std::path::PathBuf>,
    /// Write the limiter as the script ratekeeper sends by `EVALSHA`
    /// (`SCRIPT LOAD` text) and exit.
    #[arg(long)]
    write_limiter_script: Option<std::path::PathBuf>,
}

/// How descriptor values are chosen.
#[derive(Debug, Clone, PartialEq)]
enum KeyDist {
    /// Every request a value never used before.
    Distinct,
    /// Uniformly among `K` values.
    Uniform(u64),
    /// Always the value `hot`.
    Hot,
    /// Among `K` values, value `i` (1-based) with weight `1 / i^S`.
    Zipf(u64, f64),
}

impl KeyDist {
    /// Parses `distinct`, `uniform:K`, `hot` or `zipf:K:S`.
    fn parse(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split(':').collect();
        let count = |s: &str| match s.parse::<u64>() {
            Ok(k) if k > 0 => Ok(k),
            _ => Err(format!("--keys {text}: K must be a positive integer")),
        };
        match parts.as_slice() {
            ["distinct"] => Ok(KeyDist::Distinct),
            ["hot"] => Ok(KeyDist::Hot),
            ["uniform", k] => Ok(KeyDist::Uniform(count(k)?)),
            ["zipf", k, s] => {
                let s: f64 = s
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| format!("--keys {text}: S must be a positive number"))?;
                Ok(KeyDist::Zipf(count(k)?, s))
            }
            _ => Err(format!(
                "--keys {text}: expected distinct, uniform:K, hot or zipf:K:S"
            )),
        }
    }
}

/// splitmix64: a tiny, fast, good-enough generator for picking keys.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[0, n)` (n > 0; the modulo bias is negligible here).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// State shared by every task's key picker.
#[derive(Debug)]
struct KeySpace {
    dist: KeyDist,
    /// Makes `distinct` values unique across runs against one server.
    run_prefix: String,
    next_distinct: AtomicU64,
    /// Zipf: cumulative weights, normalised to end at 1.
    zipf_cdf: Vec<f64>,
}

impl KeySpace {
    fn new(dist: KeyDist) -> Self {
        let zipf_cdf = match dist {
            KeyDist::Zipf(k, s) => {
                let mut acc = 0.0;
                let mut cdf: Vec<f64> = (1..=k)
                    .map(|i| {
                        acc += 1.0 / (i as f64).powf(s);
                        acc
                    })
                    .collect();
                cdf.iter_mut().for_each(|c| *c /= acc);
                cdf
            }
            _ => Vec::new(),
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        KeySpace {
            dist,
            run_prefix: format!("{:x}-", nanos ^ u64::from(std::process::id())),
            next_distinct: AtomicU64::new(0),
            zipf_cdf,
        }
    }

    /// Writes the next base value into `out` (cleared first).
    fn pick(&self, rng: &mut Rng, out: &mut String) {
        out.clear();
        // Writing to a String cannot fail.
        let _ = match self.dist {
            KeyDist::Distinct => {
                let n = self.next_distinct.fetch_add(1, Ordering::Relaxed);
                write!(out, "{}{n}", self.run_prefix)
            }
            KeyDist::Uniform(k) => write!(out, "k{}", rng.below(k)),
            KeyDist::Hot => {
                out.push_str("hot");
                Ok(())
            }
            KeyDist::Zipf(..) => {
                let u = rng.next_f64();
                let i = self.zipf_cdf.partition_point(|&c| c < u);
                write!(out, "k{}", i.min(self.zipf_cdf.len() - 1))
            }
        };
    }
}

/// One task's reusable request: only descriptor values change per call.
struct RequestTemplate {
    request: RateLimitRequest,
    base: String,
    rng: Rng,
    keys: Arc<KeySpace>,
}

impl RequestTemplate {
    fn new(args: &Args, keys: Arc<KeySpace>, seed: u64) -> Self {
        let descriptors = (0..args.descriptors.max(1))
            .map(|_| RateLimitDescriptor {
                entries: vec![Entry {
                    key: args.key.clone(),
                    value: String::new(),
                }],
                ..Default::default()
            })
            .collect();
        RequestTemplate {
            request: RateLimitRequest {
                domain: args.domain.clone(),
                descriptors,
                hits_addend: 0,
            },
            base: String::new(),
            rng: Rng(seed),
            keys,
        }
    }

    /// The next request to send (descriptor `i > 0` gets the suffix `.i`).
    fn next(&mut self) -> RateLimitRequest {
        self.keys.pick(&mut self.rng, &mut self.base);
        for (i, descriptor) in self.request.descriptors.iter_mut().enumerate() {
            let value = &mut descriptor.entries[0].value;
            value.clone_from(&self.base);
            if i > 0 {
                let _ = write!(value, ".{i}");
            }
        }
        self.request.clone()
    }
}

/// Counts and latencies gathered by one task, merged at the end.
struct Tally {
    /// Latency of answered calls, µs.
    latency: Histogram<u64>,
    /// Open loop: how late each send was against its intended time, µs.
    send_lag: Histogram<u64>,
    /// Open loop: latency from the actual send (what the server and the
    /// network took, without the generator's own lag), µs.
    from_send: Histogram<u64>,
    ok: u64,
    over_limit: u64,
    /// Answers whose overall code is neither OK nor OVER_LIMIT.
    unknown: u64,
    errors: u64,
    /// Open loop: requests still unsent when the run was cut off.
    unsent: u64,
    /// Calls made, warm-up included (for CPU per call).
    calls: u64,
    first_error: Option<String>,
}

impl Tally {
    fn new() -> Self {
        let histogram = || {
            // Bounds are constants that hdrhistogram accepts.
            Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
        };
        Tally {
            latency: histogram(),
            send_lag: histogram(),
            from_send: histogram(),
            ok: 0,
            over_limit: 0,
            unknown: 0,
            errors: 0,
            unsent: 0,
            calls: 0,
            first_error: None,
        }
    }

    /// Records one call's outcome and latency.
    fn record(&mut self, result: &CallResult, latency: Duration) {
        match result {
            Ok(code) => {
                self.latency.saturating_record(micros(latency));
                match Code::try_from(*code) {
                    Ok(Code::Ok) => self.ok += 1,
                    Ok(Code::OverLimit) => self.over_limit += 1,
                    _ => self.unknown += 1,
                }
            }
            Err(message) => {
                self.errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some(message.clone());
                }
            }
        }
    }

    fn merge(&mut self, other: Tally) {
        // Same bounds on both sides: adding cannot fail.
        let _ = self.latency.add(&other.latency);
        let _ = self.send_lag.add(&other.send_lag);
        let _ = self.from_send.add(&other.from_send);
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        self.unknown += other.unknown;
        self.errors += other.errors;
        self.unsent += other.unsent;
        self.calls += other.calls;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    fn requests(&self) -> u64 {
        self.ok + self.over_limit + self.unknown + self.errors
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The overall code of an answer, or the error's text.
type CallResult = Result<i32, String>;

/// Sends one request with a deadline.
async fn call(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
    timeout: Duration,
) -> CallResult {
    match tokio::time::timeout(timeout, client.should_rate_limit(request)).await {
        Ok(Ok(response)) => Ok(response.into_inner().overall_code),
        Ok(Err(status)) => Err(format!("{:?}: {}", status.code(), status.message())),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Times shared by every task of a run.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// Calls started (closed) or intended (open) from here on are measured.
    measure_from: Instant,
    /// No call is started after this.
    end: Instant,
}

/// Closed loop: one call in flight at a time until the window ends or the
/// request budget is spent.
async fn closed_loop_task(
    mut client: RateLimitServiceClient<Channel>,
    mut template: RequestTemplate,
    window: Window,
    budget: Option<Arc<AtomicU64>>,
    timeout: Duration,
) -> Tally {
    let mut tally = Tally::new();
    loop {
        if let Some(left) = &budget {
            let taken =
                left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            if taken.is_err() {
                break;
            }
        }
        let started = Instant::now();
        if started >= window.end {
            break;
        }
        let result = call(&mut client, template.next(), timeout).await;
        tally.calls += 1;
        if started >= window.measure_from {
            tally.record(&result, started.elapsed());
        }
    }
    tally
}

/// One thread's open-loop schedule: its `k`-th request is due at
/// `first + k * interval`, for the `total` requests due before the run's
/// end (thread `t` of `T` takes requests `t, t + T, ...` of the whole run's
/// schedule). The pacer adds a permit to `due` as each request falls due;
/// the task that takes a permit claims the next request.
#[derive(Debug)]
struct Schedule {
    first: Instant,
    interval: Duration,
    total: u64,
    due: Semaphore,
    claimed: AtomicU64,
}

impl Schedule {
    /// Thread `thread` of `threads` sharing `rate` requests per second from
    /// `start` until `end`.
    fn new(start: Instant, end: Instant, rate: f64, thread: usize, threads: usize) -> Self {
        let threads = threads.max(1);
        let mut schedule = Schedule {
            first: start + Duration::from_secs_f64(thread as f64 / rate),
            interval: Duration::from_secs_f64(threads as f64 / rate),
            total: 0,
            due: Semaphore::new(0),
            claimed: AtomicU64::new(0),
        };
        let span = end.saturating_duration_since(schedule.first);
        let mut total = (span.as_secs_f64() / schedule.interval.as_secs_f64()) as u64;
        // The estimate may be off by one either way where the division
        // rounds: settle it on the due times themselves.
        while schedule.due_at(total) < end {
            total += 1;
        }
        while total > 0 && schedule.due_at(total - 1) >= end {
            total -= 1;
        }
        schedule.total = total;
        schedule
    }

    /// When this thread's request `k` is due.
    fn due_at(&self, k: u64) -> Instant {
        self.first + self.interval.mul_f64(k as f64)
    }

    /// Waits for a due request; returns its intended send time, or `None`
    /// once the schedule is over.
    async fn next(&self) -> Option<Instant> {
        let permit = self.due.acquire().await.ok()?;
        permit.forget();
        let k = self.claimed.fetch_add(1, Ordering::Relaxed);
        (k < self.total).then(|| self.due_at(k))
    }

    /// The pacer, a task on the thread's own runtime: releases requests as
    /// they fall due, waking at most once per `quantum`; then one permit
    /// more for each of the `tasks`, which claim past the end and stop.
    /// (Closing the semaphore instead could refuse a permit already handed
    /// to a task not yet polled: its request would be lost.)
    async fn pace(&self, alarm: Alarm, quantum: Duration, tasks: usize) -> Result<(), String> {
        let mut released: u64 = 0;
        while released < self.total {
            let now = Instant::now();
            let mut due = 0;
            while released < self.total && self.due_at(released) <= now {
                released += 1;
                due += 1;
            }
            if due > 0 {
                self.due.add_permits(due);
            }
            if released < self.total {
                let next = self.due_at(released).max(Instant::now() + quantum);
                alarm
                    .sleep_until(next)
                    .await
                    .map_err(|e| format!("the pacer's timer failed: {e}"))?;
            }
        }
        self.due.add_permits(tasks);
        Ok(())
    }
}

/// A `timerfd` registered with the thread's runtime: sleeps to the
/// microsecond without another thread (Tokio's timer rounds to 1 ms, which
/// an open loop would count as latency).
struct Alarm {
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl Alarm {
    fn new() -> std::io::Result<Self> {
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
    async fn sleep_until(&self, when: Instant) -> std::io::Result<()> {
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

/// Open loop: takes the next due request, sends it, and measures from its
/// intended time. Requests still unsent at `hard_stop` are counted as unsent.
async fn open_loop_task(
    mut client: RateLimitServiceClient<Channel>,
    mut template: RequestTemplate,
    schedule: Arc<Schedule>,
    window: Window,
    hard_stop: Instant,
    timeout: Duration,
) -> Tally {
    let mut tally = Tally::new();
    while let Some(intended) = schedule.next().await {
        let now = Instant::now();
        if now >= hard_stop {
            tally.unsent += 1;
            continue;
        }
        let result = call(&mut client, template.next(), timeout).await;
        tally.calls += 1;
        if intended >= window.measure_from {
            tally
                .send_lag
                .saturating_record(micros(now.saturating_duration_since(intended)));
            if result.is_ok() {
                tally.from_send.saturating_record(micros(now.elapsed()));
            }
            tally.record(&result, intended.elapsed());
        }
    }
    tally
}

/// Opens `count` HTTP/2 channels to `addr`.
async fn connect(addr: &str, count: usize) -> Result<Vec<Channel>, String> {
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

/// What one run measured.
struct Summary {
    tally: Tally,
    measured: Duration,
    cpu: Option<Duration>,
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
fn run(args: &Args, dist: KeyDist) -> Result<Summary, String> {
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
    ready: std::sync::mpsc::Sender<Result<(), String>>,
    start: std::sync::mpsc::Receiver<Timing>,
) -> Result<Tally, String> {
    let prepared = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
        .and_then(|runtime| {
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
        });
    let (runtime, channels, alarm) = match prepared {
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
    let timeout = Duration::from_millis(args.timeout_ms);
    runtime.block_on(async move {
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
                    let paced = schedule.pace(alarm, quantum, tasks).await;
                    if paced.is_err() {
                        // Waiting tasks must not hang on a pacer that failed.
                        schedule.due.close();
                    }
                    paced
                }))
            }
            _ => None,
        };
        let mut tasks = Vec::new();
        for (n, &i) in task_ids.iter().enumerate() {
            let client = RateLimitServiceClient::new(channels[n % channels.len()].clone());
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
    })
}

/// A JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Prints the human summary and the JSON line.
fn report(args: &Args, summary: &Summary) {
    let t = &summary.tally;
    let secs = summary.measured.as_secs_f64().max(1e-9);
    let requests = t.requests();
    let rps = requests as f64 / secs;
    let q = |p: f64| {
        if t.latency.is_empty() {
            0
        } else {
            t.latency.value_at_quantile(p)
        }
    };
    let (p50, p90, p99, p999, max) = (q(0.5), q(0.9), q(0.99), q(0.999), t.latency.max());
    let quantile = |h: &Histogram<u64>, p: f64| {
        if h.is_empty() {
            0
        } else {
            h.value_at_quantile(p)
        }
    };
    let lag_p99 = quantile(&t.send_lag, 0.99);
    let (sent_p50, sent_p99) = (quantile(&t.from_send, 0.5), quantile(&t.from_send, 0.99));
    let cpu_us_per_req = summary
        .cpu
        .map(|cpu| cpu.as_secs_f64() * 1e6 / (t.calls.max(1) as f64));
    let mode = match args.rate {
        Some(rate) => format!(
            "open loop at {rate} req/s, up to {} in flight",
            args.concurrency
        ),
        None => format!("closed loop, {} in flight", args.concurrency),
    };
    println!(
        "ratekeeper-bench: {mode} over {} connection(s); keys {}, {} descriptor(s), domain {}; {:.1} s measured after {:.1} s warm-up",
        args.connections, args.keys, args.descriptors, args.domain, secs, args.warmup
    );
    println!(
        "requests {requests} ({rps:.0} req/s)  ok {}  over_limit {}  unknown {}  errors {}{}",
        t.ok,
        t.over_limit,
        t.unknown,
        t.errors,
        if t.unsent > 0 {
            format!("  unsent {}", t.unsent)
        } else {
            String::new()
        }
    );
    println!(
        "latency us{}: p50 {p50}  p90 {p90}  p99 {p99}  p99.9 {p999}  max {max}",
        if args.rate.is_some() {
            " (from intended send time)"
        } else {
            ""
        }
    );
    if args.rate.is_some() {
        println!(
            "generator send lag us: p99 {lag_p99}; latency from the actual send us: p50 {sent_p50}  p99 {sent_p99}"
        );
    }
    if let Some(cpu) = cpu_us_per_req {
        println!("generator cpu: {cpu:.1} us/request");
    }
    if let Some(e) = &t.first_error {
        eprintln!("first error: {e}");
    }
    println!(
        concat!(
            "{{\"label\":{},\"mode\":{},\"rate\":{},\"concurrency\":{},\"connections\":{},",
            "\"keys\":{},\"descriptors\":{},\"domain\":{},\"seconds\":{:.3},\"requests\":{},",
            "\"rps\":{:.1},\"ok\":{},\"over_limit\":{},\"unknown\":{},\"errors\":{},\"unsent\":{},",
            "\"p50_us\":{},\"p90_us\":{},\"p99_us\":{},\"p999_us\":{},\"max_us\":{},",
            "\"send_lag_p99_us\":{},\"sent_p50_us\":{},\"sent_p99_us\":{},\"calls\":{},\"client_cpu_us_per_req\":{}}}"
        ),
        json_string(&args.label),
        json_string(if args.rate.is_some() {
            "open"
        } else {
            "closed"
        }),
        args.rate.unwrap_or(0.0),
        args.concurrency,
        args.connections,
        json_string(&args.keys),
        args.descriptors,
        json_string(&args.domain),
        secs,
        requests,
        rps,
        t.ok,
        t.over_limit,
        t.unknown,
        t.errors,
        t.unsent,
        p50,
        p90,
        p99,
        p999,
        max,
        lag_p99,
        sent_p50,
        sent_p99,
        t.calls,
        cpu_us_per_req.map_or("null".to_owned(), |c| format!("{c:.2}")),
    );
}

/// A gRPC message as it travels in an HTTP/2 body: an uncompressed flag,
/// the length (big-endian u32), then the protobuf bytes.
fn grpc_frame(request: &RateLimitRequest) -> Vec<u8> {
    let body = prost::Message::encode_to_vec(request);
    let mut frame = Vec::with_capacity(5 + body.len());
    frame.push(0);
    // A request of a few descriptors is far below 4 GiB.
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame
}

/// Writes one of the `--write-*` files; the exit code says whether it could.
fn write_file(path: &std::path::Path, bytes: &[u8]) -> ExitCode {
    match std::fs::write(path, bytes) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ratekeeper-bench: cannot write {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let dist = match KeyDist::parse(&args.keys) {
        Ok(dist) => dist,
        Err(e) => {
            eprintln!("ratekeeper-bench: {e}");
            return ExitCode::from(2);
        }
    };
    if args.rate.is_some_and(|r| !(r.is_finite() && r > 0.0))
        || !(args.duration.is_finite() && args.duration > 0.0)
        || !(args.warmup.is_finite() && args.warmup >= 0.0)
    {
        eprintln!("ratekeeper-bench: --rate and --duration must be > 0, --warmup >= 0");
        return ExitCode::from(2);
    }
    if let Some(path) = &args.write_limiter_library {
        let limiter = ratekeeper::store::limiter_script::LimiterScript::new(true);
        return write_file(path, limiter.library().as_bytes());
    }
    if let Some(path) = &args.write_limiter_script {
        return write_file(path, ratekeeper::store::limiter_script::TEXT.as_bytes());
    }
    if let Some(path) = &args.write_request {
        let keys = Arc::new(KeySpace::new(dist));
        let request = RequestTemplate::new(&args, keys, 1).next();
        return write_file(path, &grpc_frame(&request));
    }
    match run(&args, dist) {
        Ok(summary) => {
            report(&args, &summary);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ratekeeper-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_key_distributions() {
        assert_eq!(KeyDist::parse("distinct"), Ok(KeyDist::Distinct));
        assert_eq!(KeyDist::parse("hot"), Ok(KeyDist::Hot));
        assert_eq!(KeyDist::parse("uniform:10"), Ok(KeyDist::Uniform(10)));
        assert_eq!(KeyDist::parse("zipf:100:1.1"), Ok(KeyDist::Zipf(100, 1.1)));
        assert!(KeyDist::parse("uniform:0").is_err());
        assert!(KeyDist::parse("zipf:10").is_err());
        assert!(KeyDist::parse("zipf:10:-1").is_err());
        assert!(KeyDist::parse("random").is_err());
    }

    #[test]
    fn zipf_prefers_low_ranks() {
        let keys = KeySpace::new(KeyDist::Zipf(1_000, 1.2));
        let mut rng = Rng(7);
        let mut value = String::new();
        let hits = (0..10_000)
            .filter(|_| {
                keys.pick(&mut rng, &mut value);
                value == "k0"
            })
            .count();
        // Rank 1 has about 1 / zeta(1.2) ~ 18% of the mass over 1000 keys.
        assert!((1_000..3_000).contains(&hits), "{hits}");
    }

    #[test]
    fn distinct_values_never_repeat_and_descriptors_differ() {
        let args = Args::parse_from(["bench", "--descriptors", "3"]);
        let keys = Arc::new(KeySpace::new(KeyDist::Distinct));
        let mut template = RequestTemplate::new(&args, keys, 1);
        let a = template.next();
        let b = template.next();
        assert_ne!(
            a.descriptors[0].entries[0].value,
            b.descriptors[0].entries[0].value
        );
        let values: Vec<&str> = a
            .descriptors
            .iter()
            .map(|d| d.entries[0].value.as_str())
            .collect();
        assert_eq!(values.len(), 3);
        assert!(values[1].ends_with(".1") && values[2].ends_with(".2"));
    }

    #[test]
    fn thread_schedules_interleave_into_the_whole_schedule() {
        let start = Instant::now();
        let end = start + Duration::from_millis(10);
        let rate = 1_000.0;
        let mut due: Vec<Duration> = (0..3)
            .flat_map(|thread| {
                let schedule = Schedule::new(start, end, rate, thread, 3);
                let total = schedule.total;
                (0..total).map(move |k| schedule.due_at(k) - start)
            })
            .collect();
        due.sort();
        let whole: Vec<Duration> = (0..10).map(Duration::from_millis).collect();
        assert_eq!(due.len(), whole.len());
        for (got, want) in due.iter().zip(&whole) {
            let off = got.abs_diff(*want);
            assert!(off < Duration::from_micros(1), "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn tasks_claim_each_due_request_once_then_stop() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let start = Instant::now();
            let schedule = Schedule::new(start, start + Duration::from_millis(5), 1_000.0, 0, 1);
            assert_eq!(schedule.total, 5);
            // What the pacer hands out: every request, then one per task.
            schedule.due.add_permits(5 + 2);
            let mut claimed = Vec::new();
            while let Some(at) = schedule.next().await {
                claimed.push(at - start);
            }
            assert_eq!(claimed.len(), 5);
            assert_eq!(schedule.next().await, None, "the second task stops too");
        });
    }

    #[test]
    fn threads_share_connections_and_tasks_without_overlap() {
        let mut seen: Vec<usize> = (0..3).flat_map(|t| share(10, t, 3)).collect();
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        assert_eq!(share(4, 1, 2).collect::<Vec<_>>(), vec![1, 3]);
    }

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

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }

    #[test]
    fn written_requests_are_one_grpc_message() {
        let args = Args::parse_from(["bench", "--domain", "d", "--keys", "hot"]);
        let keys = Arc::new(KeySpace::new(KeyDist::Hot));
        let request = RequestTemplate::new(&args, keys, 1).next();
        let frame = grpc_frame(&request);
        assert_eq!(frame[0], 0, "not compressed");
        let length = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
        assert_eq!(length, frame.len() - 5);
        let decoded: RateLimitRequest = prost::Message::decode(&frame[5..]).unwrap();
        assert_eq!(decoded.domain, "d");
        assert_eq!(decoded.descriptors[0].entries[0].value, "hot");
    }
}
