//! The binary's commands other than serving, run as a user (or a CI job)
//! runs them: `ratekeeper validate` and `ratekeeper --version`.

use std::path::Path;
use std::process::{Command, Output};

const GOOD: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 50}\n";
/// Refused at line 2 (a key the format does not have).
const UNKNOWN_KEY: &str = "domain: a\nextra: 1\n";
/// Refused at line 4 (no such unit).
const BAD_UNIT: &str =
    "domain: b\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n";

fn ratekeeper(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratekeeper"));
    command.args(args).env_remove("CONFIG_DIR");
    command.env_remove("RUNTIME_ROOT");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().unwrap()
}

fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn validate_reports_every_bad_file_with_its_line() {
    let dir = dir_with(&[
        ("a.yaml", UNKNOWN_KEY),
        ("b.yaml", BAD_UNIT),
        ("c.yaml", GOOD),
    ]);
    let d = dir.path().display();
    let out = ratekeeper(&["validate", "--config-dir", &d.to_string()], &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(text(&out.stdout), "");
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(
        lines[0].starts_with(&format!("{d}/a.yaml:2: unknown field `extra`")),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with(&format!("{d}/b.yaml:4: ")) && lines[1].contains("fortnight"),
        "{stderr}"
    );
    assert_eq!(lines[2], format!("ratekeeper: {d}: 2 errors"));
}

#[test]
fn validate_reports_domains_defined_twice() {
    let dir = dir_with(&[("a.yaml", GOOD), ("b.yaml", GOOD)]);
    let d = dir.path().display().to_string();
    let out = ratekeeper(&["validate", "--config-dir", &d], &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with(&format!("{d}/b.yaml: duplicate domain \"web\"")),
        "{stderr}"
    );
}

#[test]
fn validate_of_a_good_directory_prints_one_summary_line() {
    let dir = dir_with(&[
        ("web.yaml", GOOD),
        ("two.yml", "domain: b\n---\ndomain: a\n"),
    ]);
    let d = dir.path().display().to_string();
    let out = ratekeeper(&["validate", "--config-dir", &d], &[]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(
        text(&out.stdout),
        format!("{d}: ok, 2 limits files, 3 domains (a, b, web)\n")
    );
    assert_eq!(text(&out.stderr), "");
}

/// What loads but may not do what its author meant is said with the file
/// and line: a `*` in a descriptor key (a pattern there, literal here;
/// not for a key whose value is itself, Envoy Gateway's hostname-less
/// routes, which a request sends as they are) and a bucket rate whole
/// microseconds cannot space.
#[test]
fn validate_warns_with_the_file_and_line_of_what_it_loads_differently() {
    let file = "domain: w\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: \"star*\"\n    rate_limit: {unit: minute, requests_per_unit: 9}\n  - key: fast\n    rate_limit: {unit: minute, requests_per_unit: 100000000, algorithm: token_bucket}\n  - key: \"httproute/ns/r/rule/0/match/0/*\"\n    value: \"httproute/ns/r/rule/0/match/0/*\"\n    rate_limit: {unit: minute, requests_per_unit: 9}\n";
    let dir = dir_with(&[("w.yaml", file)]);
    let d = dir.path().display().to_string();
    let out = ratekeeper(&["validate", "--config-dir", &d], &[]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let stderr = text(&out.stderr);
    for warning in [
        format!(" WARN {d}/w.yaml:5: descriptors[1]: descriptor key \"star*\" holds '*'"),
        format!(
            " WARN {d}/w.yaml:8: descriptors[2].rate_limit: token_bucket of 100000000 per minute"
        ),
    ] {
        assert!(stderr.contains(&warning), "no {warning:?} in {stderr}");
    }
    assert_eq!(stderr.matches(" WARN ").count(), 2, "{stderr}");
}

/// A key repeated in a mapping: read as their loader reads it (a repeated
/// `rate_limit` adds to the first, field by field), with a warning naming
/// the file and the line.
#[test]
fn validate_warns_about_a_repeated_key_and_reads_it_as_theirs() {
    let repeated = "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n";
    let dir = dir_with(&[("r.yaml", repeated)]);
    let d = dir.path().display().to_string();
    let out = ratekeeper(&["validate", "--config-dir", &d], &[]);
    // The later unit counts: its bad unit is refused.
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!(
            " WARN {d}/r.yaml:3: descriptors[0]: duplicate field `rate_limit`: read as \
             envoyproxy/ratelimit reads the file"
        )),
        "{stderr}"
    );
    assert!(stderr.contains("fortnight"), "{stderr}");

    // The second adds to the first: the first's unit stays.
    let added = repeated.replace(
        "{unit: fortnight, requests_per_unit: 1}",
        "{requests_per_unit: 7}",
    );
    // `validate` of `file` as r.yaml: exits `code`, says stderr.
    let validate = |file: &str, code: i32| {
        std::fs::write(dir.path().join("r.yaml"), file).unwrap();
        let out = ratekeeper(&["validate", "--config-dir", &d], &[]);
        assert_eq!(out.status.code(), Some(code), "{out:?}");
        text(&out.stderr)
    };
    validate(&added, 0);

    // In a document with merge keys (read whole, then merged): the same
    // warning, at the repeated key's line.
    let merging = format!(
        "{added}  - key: m\n    rate_limit: {{<<: {{unit: minute}}, requests_per_unit: 2}}\n"
    );
    let stderr = validate(&merging, 0);
    assert!(
        stderr.contains(&format!(
            " WARN {d}/r.yaml:5: duplicate field `rate_limit`: read as envoyproxy/ratelimit \
             reads the file"
        )),
        "{stderr}"
    );
    // Two merge keys in one mapping are read otherwise than there: said so.
    let two = "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {<<: {unit: hour}, <<: {unit: minute}, requests_per_unit: 1}\n";
    let stderr = validate(two, 0);
    assert!(
        stderr.contains(&format!(
            " WARN {d}/r.yaml:4: two merge keys (<<) in one mapping: the last one counts"
        )),
        "{stderr}"
    );
}

#[test]
fn validate_warns_about_a_directory_without_domains() {
    let dir = dir_with(&[("notes.txt", "not a limits file")]);
    let d = dir.path().display().to_string();
    let out = ratekeeper(&["validate", "--config-dir", &d], &[]);
    // The server would start with it, so it passes, with a warning.
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(
        text(&out.stdout),
        format!("{d}: ok, 0 limits files, 0 domains ()\n")
    );
    assert_eq!(
        text(&out.stderr),
        format!("warning: {d}: no domains: every request would be allowed\n")
    );
}

#[test]
fn validate_finds_the_directory_as_the_server_does() {
    let good = dir_with(&[("web.yaml", GOOD)]);
    let bad = dir_with(&[("a.yaml", UNKNOWN_KEY)]);
    // CONFIG_DIR, and the flag given before the command, name it too...
    let out = ratekeeper(&["validate"], &[("CONFIG_DIR", good.path())]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let g = good.path().display().to_string();
    let out = ratekeeper(&["--config-dir", &g, "validate"], &[]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    // ...the command's own flag wins...
    let b = bad.path().display().to_string();
    let out = ratekeeper(
        &["validate", "--config-dir", &b],
        &[("CONFIG_DIR", good.path())],
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    // ...and envoyproxy/ratelimit's RUNTIME_ROOT layout is followed.
    let root = tempfile::tempdir().unwrap();
    let config = root.path().join("current").join("config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(config.join("a.yaml"), UNKNOWN_KEY).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratekeeper"));
    let out = command
        .arg("validate")
        .env_remove("CONFIG_DIR")
        .env("RUNTIME_ROOT", root.path())
        .env("RUNTIME_SUBDIRECTORY", "current")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        text(&out.stderr).starts_with(&format!("{}/a.yaml:2: ", config.display())),
        "{out:?}"
    );
}

#[test]
fn version_names_the_release_and_the_commit() {
    let out = ratekeeper(&["--version"], &[]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let line = text(&out.stdout);
    let expected_commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| text(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    assert_eq!(
        line,
        format!(
            "ratekeeper {} (commit {expected_commit})\n",
            env!("CARGO_PKG_VERSION")
        )
    );
}
