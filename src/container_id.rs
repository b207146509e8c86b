//! DogStatsD origin detection: the container this process runs in, found
//! as envoyproxy/ratelimit's DogStatsD client (datadog-go v5.5.0) finds it,
//! for the `|c:<id>` field it adds to every line. The Datadog agent tags a
//! line so marked with its container's and pod's tags (`kube_namespace`,
//! `pod_name`, …); without it a pod's stats lose them.
//!
//! None when `DD_ENTITY_ID` is set (the client tags `dd.internal.entity_id`
//! instead) or `DD_ORIGIN_DETECTION_ENABLED` is false. Otherwise, in the
//! host's cgroup namespace, the container id read from `/proc/self/cgroup`;
//! in a namespace of its own (cgroup v2 under Kubernetes, Docker), when
//! `/proc/self/mountinfo` shows a container, the inode of this process's
//! cgroup directory as `in-<inode>`, which the agent maps to the container.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::OnceLock;

use regex::Regex;

/// Where the process's cgroups, mounts and cgroup namespace are read, and
/// where cgroups are mounted: Linux's, or a test's files.
pub struct Paths<'a> {
    pub cgroup: &'a str,
    pub mountinfo: &'a str,
    pub cgroup_namespace: &'a str,
    pub cgroup_mount: &'a str,
}

/// This system's.
pub const LINUX: Paths<'static> = Paths {
    cgroup: "/proc/self/cgroup",
    mountinfo: "/proc/self/mountinfo",
    cgroup_namespace: "/proc/self/ns/cgroup",
    cgroup_mount: "/sys/fs/cgroup",
};

/// The inode of the host's cgroup namespace (Linux's `proc_ns.h`).
const HOST_CGROUP_NAMESPACE_INODE: u64 = 0xEFFF_FFFB;

/// The `|c:` field's value, if any; `var` reads the environment.
pub fn detect(var: impl Fn(&str) -> Option<String>, paths: &Paths) -> Option<String> {
    if var("DD_ENTITY_ID").is_some_and(|id| !id.is_empty()) {
        return None;
    }
    let enabled = var("DD_ORIGIN_DETECTION_ENABLED");
    if enabled.as_deref().and_then(go_bool) == Some(false) {
        return None;
    }
    let id = match std::fs::metadata(paths.cgroup_namespace) {
        Ok(ns) if ns.ino() == HOST_CGROUP_NAMESPACE_INODE => {
            container_in_cgroups(&read(paths.cgroup))
        }
        _ => container_in_mountinfo(&read(paths.mountinfo))
            .and_then(|_| cgroup_inode(&read(paths.cgroup), Path::new(paths.cgroup_mount))),
    };
    id.filter(|id| !id.is_empty())
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Go's `strconv.ParseBool`; `None` for what it refuses (taken as true).
fn go_bool(text: &str) -> Option<bool> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// The first container id at the end of a cgroup path in
/// `/proc/self/cgroup` (`<n>:<controllers>:<path>` lines): 64 hex digits
/// (Docker, containerd), a UUID, or an ECS task's `<32 hex>-<digits>`.
fn container_in_cgroups(cgroups: &str) -> Option<String> {
    static LINE: OnceLock<Regex> = OnceLock::new();
    static ID: OnceLock<Regex> = OnceLock::new();
    let line = LINE.get_or_init(|| compiled(r"^\d+:[^:]*:(.+)$"));
    let id = ID.get_or_init(|| {
        compiled(
            r"([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{64}|[0-9a-f]{32}-\d+)(?:.scope)?$",
        )
    });
    cgroups.lines().find_map(|l| {
        let path = line.captures(l)?.get(1)?.as_str();
        Some(id.captures(path)?.get(1)?.as_str().to_owned())
    })
}

/// The container id in a mount of `/proc/self/mountinfo` whose path runs
/// `…/<dir>/<id>/…hostname` (the container's `/etc/hostname`), the
/// rightmost on its line, unless `<dir>` is containerd's `sandboxes`.
fn container_in_mountinfo(mountinfo: &str) -> Option<String> {
    static MOUNT: OnceLock<Regex> = OnceLock::new();
    let mount = MOUNT.get_or_init(|| {
        compiled(
            r".*/([^\s/]+)/(([0-9a-f]{64})|([0-9a-f]{32}-[0-9]{10})|([0-9a-f]{8}(-[0-9a-f]{4}){4}$))/[\S]*hostname",
        )
    });
    mountinfo.lines().find_map(|l| {
        let found = mount.captures_iter(l).last()?;
        let dir = found.get(1)?.as_str();
        (dir != "sandboxes").then(|| found.get(2).map(|id| id.as_str().to_owned()))?
    })
}

/// `in-<inode>` of this process's cgroup directory: cgroup v1's `memory`
/// controller's, else v2's (the `0::<path>` line).
fn cgroup_inode(cgroups: &str, mount: &Path) -> Option<String> {
    let node = |controller: &str| {
        cgroups.lines().find_map(|l| {
            let mut fields = l.split(':');
            let (_, c, path) = (fields.next()?, fields.next()?, fields.next()?);
            (fields.next().is_none() && c == controller).then_some(path)
        })
    };
    ["memory", ""].into_iter().find_map(|controller| {
        let path = node(controller)?;
        let dir = mount.join(controller).join(path.trim_start_matches('/'));
        let inode = std::fs::metadata(dir).ok()?.ino();
        Some(format!("in-{inode}"))
    })
}

/// A pattern written here, which compiles.
fn compiled(pattern: &str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| unreachable!("{pattern}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOCKER: &str = "3adbca7c8ec3a1b1ee4e0a6bd5c3c9a7d01e4e4b0a0c7b2d1f3e5a6b7c8d9e0f";

    #[test]
    fn container_ids_are_read_from_cgroup_paths() {
        let v1 = format!(
            "12:memory:/docker/{DOCKER}\n11:cpu,cpuacct:/docker/{DOCKER}\n0::/docker/{DOCKER}\n"
        );
        assert_eq!(container_in_cgroups(&v1).as_deref(), Some(DOCKER));
        let scope = format!("0::/system.slice/docker-{DOCKER}.scope\n");
        assert_eq!(container_in_cgroups(&scope).as_deref(), Some(DOCKER));
        let ecs = "9:perf_event:/ecs/haissam-ecs-classic/5a0d5ceddf6c44c1928d367a815d890f/34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376\n";
        assert_eq!(
            container_in_cgroups(ecs).as_deref(),
            Some("34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376")
        );
        let fargate = "1:name=systemd:/ecs/55091c13-b8cf-4801-b527-f4601742204d/432624d2150b349fe35ba397284dea788c2bf66b885d14dfc1569b01890ca7da\n";
        assert!(container_in_cgroups(fargate).is_some());
        let task = "1:cpu:/ecs/task/34dc0b5e626f2c5c4c5170e34b10e765-1234567890\n";
        assert_eq!(
            container_in_cgroups(task).as_deref(),
            Some("34dc0b5e626f2c5c4c5170e34b10e765-1234567890")
        );
        for none in ["", "0::/\n", "0::/user.slice/session-1.scope\n", "garbage"] {
            assert_eq!(container_in_cgroups(none), None, "{none:?}");
        }
    }

    #[test]
    fn container_ids_are_read_from_hostname_mounts_but_sandboxes() {
        let docker = format!(
            "608 554 259:1 /var/lib/docker/containers/{DOCKER}/hostname /etc/hostname rw,relatime - ext4 /dev/root rw\n"
        );
        assert_eq!(container_in_mountinfo(&docker).as_deref(), Some(DOCKER));
        let sandbox = format!(
            "1 2 0:1 /var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/{DOCKER}/hostname /etc/hostname rw - ext4 /dev/root rw\n"
        );
        assert_eq!(container_in_mountinfo(&sandbox), None);
        assert_eq!(
            container_in_mountinfo("22 1 0:21 / /proc rw - proc proc rw\n"),
            None
        );
    }

    #[test]
    fn the_cgroup_directory_inode_stands_for_the_container() {
        let mount = tempfile::tempdir().expect("temp dir");
        let v2 = mount.path().join("kubepods/pod1/abc");
        std::fs::create_dir_all(&v2).expect("cgroup dir");
        let inode = std::fs::metadata(&v2).expect("dir").ino();
        let found = cgroup_inode("0::/kubepods/pod1/abc\n", mount.path());
        assert_eq!(found, Some(format!("in-{inode}")));
        let v1 = mount.path().join("memory/docker/x");
        std::fs::create_dir_all(&v1).expect("cgroup dir");
        let inode = std::fs::metadata(&v1).expect("dir").ino();
        let both = "4:memory:/docker/x\n0::/kubepods/pod1/abc\n";
        assert_eq!(
            cgroup_inode(both, mount.path()),
            Some(format!("in-{inode}"))
        );
        assert_eq!(cgroup_inode("0::/gone\n", mount.path()), None);
    }

    #[test]
    fn entity_id_or_the_switch_turn_detection_off() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cgroup = dir.path().join("cgroup");
        let mountinfo = dir.path().join("mountinfo");
        std::fs::create_dir_all(dir.path().join("kubepods/c")).expect("cgroup dir");
        std::fs::write(&cgroup, "0::/kubepods/c\n").expect("cgroup file");
        let mount = format!(
            "1 2 0:1 /var/lib/docker/containers/{DOCKER}/hostname /etc/hostname rw - ext4 x rw\n"
        );
        std::fs::write(&mountinfo, mount).expect("mountinfo file");
        let text = |path: &std::path::Path| path.to_str().expect("UTF-8 path").to_owned();
        let (cgroup, mountinfo, dir_path) = (text(&cgroup), text(&mountinfo), text(dir.path()));
        let paths = Paths {
            cgroup: &cgroup,
            mountinfo: &mountinfo,
            // Not the host's namespace: the inode way.
            cgroup_namespace: &dir_path,
            cgroup_mount: &dir_path,
        };
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                let found = pairs.iter().find(|(k, _)| *k == name);
                found.map(|(_, v)| (*v).to_owned())
            }
        };
        let found = detect(env(&[]), &paths).expect("detected");
        assert!(found.starts_with("in-"), "{found}");
        assert_eq!(
            detect(env(&[("DD_ORIGIN_DETECTION_ENABLED", "junk")]), &paths),
            Some(found)
        );
        assert_eq!(detect(env(&[("DD_ENTITY_ID", "pod-uid")]), &paths), None);
        assert_eq!(
            detect(env(&[("DD_ORIGIN_DETECTION_ENABLED", "false")]), &paths),
            None
        );
        assert_eq!(
            detect(env(&[("DD_ORIGIN_DETECTION_ENABLED", "0")]), &paths),
            None
        );
    }
}
