//! Compiles the trimmed Envoy protos in `proto/` into a file descriptor set
//! for gRPC reflection. No Rust code is generated here: the message types come
//! from the `envoy-types` crate.

use std::path::PathBuf;
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("envoy_rls_descriptor.bin");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let include = protoc_bin_vendored::include_path()?;
    let status = Command::new(protoc)
        .arg("--include_imports")
        .arg(format!("--descriptor_set_out={}", out.display()))
        .arg("-Iproto")
        .arg(format!("-I{}", include.display()))
        .arg("proto/envoy/service/ratelimit/v3/rls.proto")
        .status()?;
    if !status.success() {
        return Err(format!("protoc failed: {status}").into());
    }
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
