//! Generates ratekeeper's own gRPC API (`proto/ratekeeper/`) and
//! envoyproxy/ratelimit's `RateLimitConfig` (`proto/ratelimit/`, limits over
//! xDS), OpenTelemetry's OTLP trace export (`proto/opentelemetry/`), and compiles the trimmed Envoy protos in `proto/envoy/` into a descriptor set for gRPC
//! reflection. Envoy's Rust types come from the `envoy-types` crate, so no
//! Rust code is generated for them. protoc is the vendored one: no system
//! package needed. Also names the build's commit for `ratekeeper --version`.

use std::path::PathBuf;
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let include = protoc_bin_vendored::include_path()?;

    let status = Command::new(&protoc)
        .arg("--include_imports")
        .arg(format!(
            "--descriptor_set_out={}",
            out.join("envoy_rls_descriptor.bin").display()
        ))
        .arg("-Iproto")
        .arg(format!("-I{}", include.display()))
        .arg("proto/envoy/service/ratelimit/v3/rls.proto")
        .status()?;
    if !status.success() {
        return Err(format!("protoc failed: {status}").into());
    }

    // tonic-prost-build finds protoc through this variable.
    std::env::set_var("PROTOC", &protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .file_descriptor_set_path(out.join("ratekeeper_descriptor.bin"))
        .compile_protos(
            &own_protos("proto/ratekeeper/v1")?,
            &[PathBuf::from("proto"), include.clone()],
        )?;
    // Messages only, and kept out of the reflection descriptor set: nothing
    // serves them.
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .compile_protos(
            &[PathBuf::from(
                "proto/ratelimit/config/ratelimit/v3/rls_conf.proto",
            )],
            &[PathBuf::from("proto"), include],
        )?;

    // OTLP trace export: messages, the exporter's client and the tests'
    // receiver; not served, so kept out of the reflection descriptor set.
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(
            &[PathBuf::from(
                "proto/opentelemetry/proto/collector/trace/v1/trace_service.proto",
            )],
            &[PathBuf::from("proto")],
        )?;

    println!("cargo:rerun-if-changed=proto");
    emit_commit();
    Ok(())
}

/// `RATEKEEPER_COMMIT` for the binary: the variable of that name when the
/// build is given one (a Docker build has no `.git`: pass it as a build
/// argument), else `git rev-parse --short HEAD` of this checkout, else
/// "unknown".
fn emit_commit() {
    println!("cargo:rerun-if-env-changed=RATEKEEPER_COMMIT");
    let commit = std::env::var("RATEKEEPER_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=RATEKEEPER_COMMIT={}", commit.trim());
}

/// HEAD of the git checkout this crate is the top of (not of some repository
/// that merely contains it, as a vendored copy would be), and the files to
/// watch so a new commit rebuilds with the new name.
fn git_commit() -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        out.status.success().then(|| text.trim().to_owned())
    };
    let top = PathBuf::from(git(&["rev-parse", "--show-toplevel"])?);
    let here = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").ok()?);
    if top.canonicalize().ok()? != here.canonicalize().ok()? {
        return None;
    }
    // HEAD moves on checkout; the branch's ref (loose or packed) on commit.
    // Only files that exist: cargo reruns the script on every build for a
    // path that does not.
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    for path in ["HEAD", "packed-refs"].into_iter().chain(branch.as_deref()) {
        if let Some(file) = git(&["rev-parse", "--git-path", path]) {
            if std::path::Path::new(&file).exists() {
                println!("cargo:rerun-if-changed={file}");
            }
        }
    }
    git(&["rev-parse", "--short", "HEAD"])
}

/// Every `.proto` file of ratekeeper's own API: a new service is a new file
/// there (and its module in `src/service/`), nothing to list here.
fn own_protos(dir: &str) -> Result<Vec<PathBuf>, Box<dyn std::error::Error>> {
    let mut protos = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "proto") {
            protos.push(path);
        }
    }
    protos.sort();
    Ok(protos)
}
