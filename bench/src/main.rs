//! The `ratekeeper-bench` binary: flags in; a run's report out, or (with
//! `--write-request FILE`) the first request it would send, gRPC-framed,
//! written to FILE. Exit codes: 0 done, 1 the run or the write failed, 2 bad
//! flags.

use std::process::ExitCode;

use clap::Parser;
use ratekeeper_bench::request::first_request_frame;
use ratekeeper_bench::{run, Args, Report};

// The generator shares the machine with the server it measures: the less CPU
// it spends per call, the more the server gets.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Args::parse();
    let dist = match args.validate() {
        Ok(dist) => dist,
        Err(e) => {
            eprintln!("ratekeeper-bench: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(path) = &args.write_request {
        return match std::fs::write(path, first_request_frame(&args, dist)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ratekeeper-bench: cannot write {}: {e}", path.display());
                ExitCode::FAILURE
            }
        };
    }
    let report = match run(&args, dist) {
        Ok(summary) => Report::new(&args, &summary),
        Err(e) => {
            eprintln!("ratekeeper-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    for line in report.summary() {
        println!("{line}");
    }
    if let Some(e) = &report.first_error {
        eprintln!("first error: {e}");
    }
    match report.json() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ratekeeper-bench: cannot write the JSON line: {e}");
            ExitCode::FAILURE
        }
    }
}
