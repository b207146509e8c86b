//! Whether files changed, told by their contents: a watcher comparing
//! modification times misses a file replaced by one with the same time
//! (`cp -p`, `tar`, `rsync -t`, `kubectl cp` keep it).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::Path;

/// A fingerprint of `paths`: their names and contents, or why one cannot
/// be read (so that a file missing, then back, is seen either way), as
/// `read` reads them.
pub fn of_files<P: AsRef<Path>>(
    paths: impl IntoIterator<Item = P>,
    read: impl Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> u64 {
    let mut hasher = DefaultHasher::new();
    for path in paths {
        let path = path.as_ref();
        path.hash(&mut hasher);
        // Read or not, marked apart: an empty file hashed like a missing
        // one (a length of 0, a first error kind of 0).
        match read(path) {
            Ok(contents) => (true, contents).hash(&mut hasher),
            Err(error) => (false, error.kind()).hash(&mut hasher),
        }
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::of_files;

    #[test]
    fn contents_and_names_change_it_and_nothing_else() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, "one").expect("a");
        let read = |p: &std::path::Path| std::fs::read(p);
        let first = of_files([&a, &b], read);
        assert_eq!(of_files([&a, &b], read), first);
        std::fs::write(&a, "two").expect("a");
        let second = of_files([&a, &b], read);
        assert_ne!(second, first);
        std::fs::write(&b, "").expect("b");
        assert_ne!(of_files([&a, &b], read), second, "b appeared");
    }
}
