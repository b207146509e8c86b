//! How deep a YAML text's flow collections (`[...]`, `{...}`) nest, found
//! before it is parsed. libyaml's scanner (serde_yaml's) takes time
//! quadratic in that depth: 32,000 `[` took 3.2 s and 128,000 took 48 s,
//! holding a reload (and a shutdown) behind the parse, while serde_yaml
//! refuses past 128 levels only once it has parsed them. Deep block nesting
//! (indentation) parses in linear time, and is not counted.
//!
//! A light scanner, not a parser: it follows YAML's rules for where a
//! collection can begin (in block context only where a node starts: at a
//! line's start, after `- `, `: `, `? ` or a node's anchor or tag; in flow
//! context anywhere outside a scalar), and skips quoted scalars and
//! comments, so brackets inside values are not counted.

/// Deepest flow nesting read: serde_yaml's own recursion limit.
pub const MAX_FLOW_DEPTH: usize = 128;

/// The line (from 1) where `text`'s flow collections first nest deeper
/// than [`MAX_FLOW_DEPTH`]; `None` when they never do.
pub fn too_deep(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let (mut depth, mut line, mut node_start) = (0usize, 1usize, true);
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let spaced = |at: usize| bytes.get(at).map_or(true, |c| c.is_ascii_whitespace());
        match b {
            b'\n' => {
                line += 1;
                node_start = true;
            }
            b' ' | b'\t' | b'\r' => {}
            b'#' if i == 0 || bytes[i - 1].is_ascii_whitespace() => {
                while i + 1 < bytes.len() && bytes[i + 1] != b'\n' {
                    i += 1;
                }
            }
            b'[' | b'{' if node_start || depth > 0 => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Some(line);
                }
                node_start = true;
            }
            b']' | b'}' if depth > 0 => {
                depth -= 1;
                node_start = false;
            }
            b',' if depth > 0 => node_start = true,
            b'"' | b'\'' if node_start => {
                let (end, newlines) = quoted_end(bytes, i);
                line += newlines;
                i = end;
                node_start = false;
            }
            b'&' | b'!' if node_start => {
                // An anchor or a tag: the node it marks follows.
                while i + 1 < bytes.len() && !bytes[i + 1].is_ascii_whitespace() {
                    i += 1;
                }
            }
            b'-' | b'?' | b':' if spaced(i + 1) => node_start = true,
            b':' if depth > 0 => node_start = true,
            _ => node_start = false,
        }
        i += 1;
    }
    None
}

/// The index of the quote ending the quoted scalar that opens at `start`
/// (the last byte when unclosed), and the newlines it spans.
fn quoted_end(bytes: &[u8], start: usize) -> (usize, usize) {
    let quote = bytes[start];
    let (mut i, mut newlines) = (start + 1, 0);
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => newlines += 1,
            // `\"` in a double-quoted scalar; `''` in a single-quoted one.
            b'\\' if quote == b'"' => i += 1,
            b'\'' if quote == b'\'' && bytes.get(i + 1) == Some(&b'\'') => i += 1,
            c if c == quote => return (i, newlines),
            _ => {}
        }
        i += 1;
    }
    (bytes.len().saturating_sub(1), newlines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_flow_nesting_is_found_with_its_line() {
        let deep = |open: &str| format!("domain: a\ndescriptors: {}\n", open.repeat(129));
        assert_eq!(too_deep(&deep("[")), Some(2));
        assert_eq!(too_deep(&deep("{a: ")), Some(2));
        assert_eq!(too_deep(&deep("{\"a\":[")), Some(2), "JSON's way");
        assert_eq!(too_deep(&deep("[\n")), Some(2 + 128), "across lines");
        assert_eq!(too_deep(&format!("x: &a !t {}", "[".repeat(129))), Some(1));
        assert_eq!(too_deep(&format!("- {}", "[".repeat(129))), Some(1));
        let just = format!("{}{}", "[".repeat(128), "]".repeat(128));
        assert_eq!(too_deep(&just), None);
        assert_eq!(too_deep(&format!("{just}\n{just}\n")), None);
    }

    #[test]
    fn brackets_in_values_and_comments_are_not_counted() {
        let many = "[".repeat(200);
        for text in [
            format!("value: \"{many}\"\n"),
            format!("value: '{many}'\n"),
            format!("value: 'it''s {many}'\n"),
            format!("value: \"a \\\" {many}\"\n"),
            format!("value: a{many}\n"),
            format!("value: a-{many}\n"),
            format!("# {many}\nvalue: x # {many}\n"),
            "- value: x[\n".repeat(200),
            "- {key: \"[[\", value: '{{'}\n".repeat(200),
        ] {
            assert_eq!(too_deep(&text), None, "{text:.60}");
        }
    }
}
