//! The `ratekeeper-bench` binary as scripts call it: exit codes and the
//! file `--write-request` writes. (Runs against a server are tested in the
//! server's package, tests/generator.rs, whose harness starts one.)

use std::process::{Command, Output};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ratekeeper-bench"))
        .args(args)
        .output()
        .expect("run ratekeeper-bench")
}

#[test]
fn bad_flags_exit_2_with_the_reason() {
    for flags in [
        &["--keys", "zipf:10"][..],
        &["--rate=-5"],
        &["--duration", "0"],
    ] {
        let output = bench(flags);
        assert_eq!(output.status.code(), Some(2), "{flags:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.starts_with("ratekeeper-bench: --"), "{stderr}");
    }
}

#[test]
fn write_request_writes_one_grpc_framed_request() {
    let dir = std::env::temp_dir().join(format!("ratekeeper-bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("hot.bin");
    let output = bench(&[
        "--write-request",
        file.to_str().unwrap(),
        "--domain",
        "bench_fw",
        "--keys",
        "hot",
    ]);
    assert!(output.status.success(), "{output:?}");
    let frame = std::fs::read(&file).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    // Uncompressed, then the length of the protobuf message that follows.
    assert_eq!(frame[0], 0);
    let length = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
    assert_eq!(length, frame.len() - 5);
    let body = String::from_utf8_lossy(&frame[5..]);
    assert!(body.contains("bench_fw") && body.contains("user_id") && body.contains("hot"));
}

#[test]
fn an_unreachable_server_fails_with_exit_1() {
    // Port 1 on loopback: nothing listens there.
    let output = bench(&[
        "--addr",
        "127.0.0.1:1",
        "--duration",
        "0.1",
        "--warmup",
        "0",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot connect to http://127.0.0.1:1"),
        "{stderr}"
    );
}
