//! No import cycles between the library's modules: a module never imports
//! one that imports it back, at any level of the tree (`config` and
//! `service`, or `store::batcher` and `store::redis`). Layers only work if
//! they stay layers; this test keeps them so.
//!
//! It reads `src/` as text: every `use crate::…`, `use super::…` and inline
//! `crate::…`/`super::…` path outside test modules is an edge from the file
//! to the deepest module the path names. A module and its own submodules
//! may use each other (a `mod.rs` re-exporting its children, a child using
//! its parent's types); everything else must form no cycle, once per depth
//! of the tree (files, then directories collapsed to their first segments).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A module path without `crate`: `["store", "redis"]`; the root is `[]`.
type Module = Vec<String>;

#[test]
fn the_library_has_no_import_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = library_edges(&src);
    assert!(
        edges.len() > 20,
        "found only {} imports: the parser is broken",
        edges.len()
    );
    let cycles = cycles(&edges);
    assert!(
        cycles.is_empty(),
        "import cycles (each line: modules that import each other, directly or around a loop):\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_checker_sees_a_cycle() {
    let edge = |a: &str, b: &str| (path(a), path(b));
    let found = cycles(&[
        edge("config::file", "service::failure"),
        edge("service::rls", "config::watch"),
        edge("store::redis", "store::batcher"),
        edge("store::batcher", "store::redis"),
        edge("limiter::gcra", "limiter"),
        edge("limiter", "limiter::gcra"),
    ]);
    assert_eq!(
        found,
        ["config <-> service", "store::batcher <-> store::redis"]
    );
}

fn path(text: &str) -> Module {
    text.split("::").map(str::to_owned).collect()
}

/// Every import between the library's files: (from, to).
fn library_edges(src: &Path) -> Vec<(Module, Module)> {
    let mut files = Vec::new();
    collect(src, src, &mut files);
    let modules: BTreeSet<Module> = files.iter().map(|(m, _)| m.clone()).collect();
    // `crate::Error` and the like: names the root re-exports from a module.
    let root_exports: BTreeMap<String, Module> = files
        .iter()
        .filter(|(m, _)| m.is_empty())
        .flat_map(|(_, text)| use_paths(text, &[]))
        .filter_map(|p| Some((p.last()?.clone(), p[..p.len() - 1].to_vec())))
        .collect();
    let mut edges = Vec::new();
    for (module, text) in &files {
        for p in use_paths(text, module)
            .into_iter()
            .chain(inline_paths(text, module))
        {
            let mut target = deepest(&modules, &p);
            if target.is_empty() {
                if let Some(re) = p.first().and_then(|name| root_exports.get(name)) {
                    target = re.clone();
                }
            }
            edges.push((module.clone(), target));
        }
    }
    edges
}

/// The library's `.rs` files with their module paths (not the binaries, not
/// test-only modules).
fn collect(root: &Path, dir: &Path, out: &mut Vec<(Module, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read src")
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let rel = path.strip_prefix(root).expect("under src");
        if path.is_dir() {
            if rel != Path::new("bin") {
                collect(root, &path, out);
            }
            continue;
        }
        let name = rel.to_string_lossy();
        if !name.ends_with(".rs") || name == "main.rs" || name.ends_with("tests.rs") {
            continue;
        }
        let mut module: Module = rel
            .with_extension("")
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
            module.pop();
        }
        let text = std::fs::read_to_string(&path).expect("read file");
        out.push((module, strip(&text)));
    }
}

/// The code without comments and without the trailing `#[cfg(test)]` module.
fn strip(text: &str) -> String {
    let code: Vec<&str> = text
        .lines()
        .map(|line| line.split_once("//").map_or(line, |(code, _)| code))
        .collect();
    let code = code.join("\n");
    match code.find("#[cfg(test)]\nmod tests") {
        Some(at) => code[..at].to_owned(),
        None => code,
    }
}

/// The paths of every `use` item, braces expanded, made absolute.
fn use_paths(text: &str, module: &[String]) -> Vec<Module> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = find_word(rest, "use") {
        let after = &rest[at + 3..];
        let end = after.find(';').unwrap_or(after.len());
        let tree = without_aliases(&after[..end]);
        expand(&tree, &mut Vec::new(), &mut out);
        rest = &after[end..];
    }
    out.into_iter()
        .filter_map(|p| absolute(&p, module))
        .collect()
}

/// A use tree with `as alias` dropped and no whitespace.
fn without_aliases(tree: &str) -> String {
    let mut out = String::new();
    let mut tokens = tree.split_whitespace();
    while let Some(token) = tokens.next() {
        if token == "as" {
            let alias = tokens.next().unwrap_or("");
            out.push_str(alias.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_'));
        } else {
            out.push_str(token);
        }
    }
    out
}

/// Finds `word` as a whole word.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(i) = text[from..].find(word).map(|i| i + from) {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        if !before.is_some_and(is_ident) && after.is_some_and(char::is_whitespace) {
            return Some(i);
        }
        from = i + word.len();
    }
    None
}

/// Expands a use tree such as `a::{b, c::{d, e}}` into its paths.
fn expand(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let depth = prefix.len();
    let (head, group) = match tree.find('{') {
        Some(open) if tree.ends_with('}') => (&tree[..open], Some(&tree[open + 1..tree.len() - 1])),
        _ => (tree, None),
    };
    prefix.extend(
        head.split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
    );
    match group {
        None => out.push(prefix.clone()),
        Some(group) => {
            for item in split_top(group) {
                expand(item, prefix, out);
            }
        }
    }
    prefix.truncate(depth);
}

/// Splits a brace group's items at its top-level commas.
fn split_top(group: &str) -> Vec<&str> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    items.into_iter().filter(|s| !s.is_empty()).collect()
}

/// Inline `crate::a::b` and `super::a` paths in code.
fn inline_paths(text: &str, module: &[String]) -> Vec<Module> {
    let mut out = Vec::new();
    for anchor in ["crate::", "super::"] {
        for (at, _) in text.match_indices(anchor) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let tail: String = text[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let segments: Vec<String> = tail
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            out.extend(absolute(&segments, module));
        }
    }
    out
}

/// `crate::…`, `super::…` or `self::…` as a path from the root; `None` for
/// other crates.
fn absolute(path: &[String], module: &[String]) -> Option<Module> {
    let (first, rest) = path.split_first()?;
    let mut base: Module = match first.as_str() {
        "crate" => Vec::new(),
        "self" => module.to_vec(),
        "super" => module[..module.len().saturating_sub(1)].to_vec(),
        _ => return None,
    };
    let mut rest = rest;
    while let Some(("super", tail)) = rest.split_first().map(|(h, t)| (h.as_str(), t)) {
        base.pop();
        rest = tail;
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The longest prefix of `path` that is a module.
fn deepest(modules: &BTreeSet<Module>, path: &[String]) -> Module {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|m| modules.contains(m))
        .unwrap_or_default()
}

/// Every cycle, as its strongly connected modules joined by ` <-> `, at
/// each depth of the tree.
fn cycles(edges: &[(Module, Module)]) -> Vec<String> {
    let deepest = edges
        .iter()
        .flat_map(|(a, b)| [a.len(), b.len()])
        .max()
        .unwrap_or(0);
    let mut found = BTreeSet::new();
    for depth in 1..=deepest {
        let mut graph: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
        for (a, b) in edges {
            let (a, b) = (cut(a, depth), cut(b, depth));
            // A module and its ancestors or descendants are one unit.
            if a.is_empty() || b.is_empty() || a.starts_with(&b) || b.starts_with(&a) {
                continue;
            }
            graph.entry(a).or_default().insert(b);
        }
        for component in components(&graph) {
            let names: Vec<String> = component.iter().map(|m| m.join("::")).collect();
            found.insert(names.join(" <-> "));
        }
    }
    found.into_iter().collect()
}

fn cut(module: &[String], depth: usize) -> Module {
    module[..module.len().min(depth)].to_vec()
}

/// The strongly connected components of more than one module (a module
/// reaching itself through another).
fn components(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<BTreeSet<Module>> {
    let reach = |from: &Module| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(m) = stack.pop() {
            for next in graph.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&Module, BTreeSet<Module>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<BTreeSet<Module>> = Vec::new();
    for (m, seen) in &reachable {
        if !seen.contains(*m) || out.iter().any(|c| c.contains(*m)) {
            continue;
        }
        let component: BTreeSet<Module> = seen
            .iter()
            .filter(|other| reachable.get(other).is_some_and(|r| r.contains(*m)))
            .cloned()
            .collect();
        out.push(component);
    }
    out
}
