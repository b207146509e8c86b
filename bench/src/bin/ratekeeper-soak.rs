//! The `ratekeeper-soak` binary (`bench/soak.sh` runs it): flags in; the
//! run's per-second timeline and audit admissions written to the files
//! named, and one JSON summary line (totals, admissions, first errors) on
//! stdout. Exit codes: 0 the run ended (whatever it counted: the report
//! judges), 1 it could not run or write, 2 bad flags.

use std::path::Path;
use std::process::ExitCode;

use clap::Parser;
use ratekeeper_bench::soak::{self, audit, SoakArgs};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = SoakArgs::parse();
    if let Err(e) = args.validate() {
        eprintln!("ratekeeper-soak: {e}");
        return ExitCode::from(2);
    }
    let record = match soak::run(&args) {
        Ok(record) => record,
        Err(e) => {
            eprintln!("ratekeeper-soak: {e}");
            return ExitCode::FAILURE;
        }
    };
    let timeline = record.timeline.json_lines();
    let admissions = audit::json_lines(&record.admissions);
    let written = [
        (&args.timeline_out, timeline),
        (&args.audit_out, admissions),
    ]
    .into_iter()
    .try_for_each(|(path, text)| match path {
        Some(path) => write(path, text),
        None => Ok(()),
    });
    if let Err(e) = written {
        eprintln!("ratekeeper-soak: {e}");
        return ExitCode::FAILURE;
    }
    let summary = serde_json::json!({
        "totals": record.timeline.total(),
        "audit_admissions": record.admissions.len(),
        "errors": record.errors,
    });
    println!("{summary}");
    ExitCode::SUCCESS
}

fn write(path: &Path, text: serde_json::Result<String>) -> Result<(), String> {
    let text = text.map_err(|e| format!("cannot encode {}: {e}", path.display()))?;
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}
