//! URL query text percent-decoded (`%XX`, and `+` as a space), as Go's
//! `url.ParseQuery` reads it: the admin API's query strings and a Redis
//! URL's query parameters (the binary's `REDIS_URL`).

use crate::service::id_parts::hex_byte;

/// Percent-decodes (`+` is a space); a malformed escape stays as it is. Text
/// that does not decode to UTF-8 is refused: replacing its bytes would name
/// another descriptor than the one asked for.
pub fn decode(text: &str) -> std::result::Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = bytes.get(i + 1..i + 3).and_then(hex_byte);
        match (bytes[i], escaped) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| format!("{text:?} does not decode to UTF-8"))
}
