//! The request path as routes compare it (routes.rs; a route's prefix is
//! checked against the same form in config.rs).

use std::borrow::Cow;

/// The path as routes compare it, RFC 3986 §6.2.2: unreserved characters
/// percent-decoded, `.` and `..` segments removed, and `//` merged (as
/// nginx does). A backend that normalises `/public/../admin` to `/admin`
/// must not receive it through the `/public` route, past `/admin`'s rate
/// limit. The request is forwarded as it came; only the choice uses this.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    let b = path.as_bytes();
    let needs = b.contains(&b'%') || path.contains("/.") || path.contains("//");
    if !needs {
        return Cow::Borrowed(path);
    }
    let mut decoded = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                let c = (h * 16 + l) as u8;
                if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                    decoded.push(c);
                    i += 3;
                    continue;
                }
            }
        }
        decoded.push(b[i]);
        i += 1;
    }
    // Only ASCII was decoded into a valid string: still valid.
    let decoded = String::from_utf8(decoded).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = decoded.split('/').collect();
    let last = segments.len() - 1;
    for (k, seg) in segments.iter().enumerate() {
        match *seg {
            "" if k != 0 && k != last => {}
            "." => {}
            ".." => {
                if out.len() > 1 {
                    out.pop();
                }
            }
            s => out.push(s),
        }
    }
    // A path ending in a dot segment ends in a slash.
    if matches!(segments[last], "." | "..") {
        out.push("");
    }
    let joined = out.join("/");
    Cow::Owned(if joined.starts_with('/') { joined } else { format!("/{joined}") })
}
