//! `CDN-Cache-Control` (RFC 9213): Cache-Control for the caches of the
//! site's own delivery path, which take it over Cache-Control (and so
//! over Expires and Pragma) when it is there and valid. The field is a
//! Structured Field dictionary (RFC 8941), parsed with `sfv`; an invalid
//! one, or one whose delta-seconds directive is not an integer, is
//! ignored whole (RFC 9213 §2.1), and Cache-Control applies.
//!
//! http-cache-semantics reads only Cache-Control, so the valid field is
//! handed to it as one, in Cache-Control syntax.

use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use sfv::{BareItem, ListEntry, Parser};

pub const CDN_CACHE_CONTROL: HeaderName = HeaderName::from_static("cdn-cache-control");

/// Directives whose value is delta-seconds: an Integer, never negative.
const SECONDS: [&str; 4] = ["max-age", "s-maxage", "stale-while-revalidate", "stale-if-error"];

/// The response's CDN-Cache-Control as a Cache-Control value, `None` when
/// it is absent or invalid.
pub fn valid(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut lines = headers.get_all(&CDN_CACHE_CONTROL).iter().peekable();
    lines.peek()?;
    // RFC 8941 §4.2: several lines are parsed as one, joined by commas.
    let joined = lines.map(HeaderValue::as_bytes).collect::<Vec<_>>().join(&b", "[..]);
    let dict = Parser::parse_dictionary(&joined).ok()?;
    let mut out = Vec::new();
    for (name, entry) in &dict {
        let directive = match entry {
            ListEntry::Item(item) => match &item.bare_item {
                BareItem::Integer(n) if *n >= 0 => format!("{name}={n}"),
                _ if SECONDS.contains(&name.as_str()) => return None,
                BareItem::Boolean(false) => continue,
                BareItem::Token(t) => format!("{name}={t}"),
                BareItem::String(s) => format!("{name}=\"{s}\""),
                _ => name.clone(),
            },
            // A field list (`no-cache=("set-cookie")`): the directive
            // whole, which asks more of the cache, never less.
            ListEntry::InnerList(_) if SECONDS.contains(&name.as_str()) => return None,
            ListEntry::InnerList(_) => name.clone(),
        };
        out.push(directive);
    }
    HeaderValue::from_str(&out.join(", ")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cdn(values: &[&str]) -> Option<String> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(CDN_CACHE_CONTROL, v.parse().unwrap());
        }
        valid(&h).map(|v| v.to_str().unwrap().to_string())
    }

    #[test]
    fn valid_dictionaries_become_cache_control() {
        assert_eq!(cdn(&["max-age=60"]).as_deref(), Some("max-age=60"));
        assert_eq!(cdn(&["no-store"]).as_deref(), Some("no-store"));
        assert_eq!(cdn(&["private, max-age=5"]).as_deref(), Some("private, max-age=5"));
        assert_eq!(cdn(&["max-age=5;ext=1", "no-cache"]).as_deref(), Some("max-age=5, no-cache"));
        assert_eq!(cdn(&[]), None);
    }

    #[test]
    fn invalid_fields_and_wrong_types_are_ignored_whole() {
        assert_eq!(cdn(&["max-age=10000, &&&&&"]), None);
        assert_eq!(cdn(&["max-age=\"10000\""]), None);
        assert_eq!(cdn(&["max-age=-1"]), None);
        assert_eq!(cdn(&["MAX-AGE=60"]), None, "dictionary keys are lower-case");
    }
}
