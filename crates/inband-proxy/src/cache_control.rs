//! Cache-Control directive names are case-insensitive (RFC 9111 §5.2), but
//! http-cache-semantics 3 keys its parsed directives by the text as sent:
//! to it `Private` is not `private` and `MAX-AGE=60` is no max-age. Every
//! Cache-Control and Pragma field is rewritten with lower-case directive
//! names where it enters the proxy (the client's request in server.rs, the
//! origin's response in forward.rs), so the library decides with the
//! names it knows, and so do the directives read here because it does not
//! act on them (`only-if-cached`, RFC 5861's `stale-*`).
//!
//! Written by hand because the rewrite must keep everything else byte for
//! byte: values, and quoted strings, which may hold commas and `=`.

use http::{header, HeaderMap, HeaderValue};

pub fn normalize(headers: &mut HeaderMap) {
    for name in [header::CACHE_CONTROL, header::PRAGMA] {
        let needs = headers.get_all(&name).iter().any(|v| lowered(v.as_bytes()).is_some());
        if !needs {
            continue;
        }
        let values: Vec<HeaderValue> = headers
            .get_all(&name)
            .iter()
            .map(|v| match lowered(v.as_bytes()) {
                Some(l) => HeaderValue::from_bytes(&l).expect("lower-casing ASCII keeps a valid header value"),
                None => v.clone(),
            })
            .collect();
        headers.remove(&name);
        for v in values {
            headers.append(&name, v);
        }
    }
}

/// The field with directive names lower-cased, `None` when they already are.
fn lowered(v: &[u8]) -> Option<Vec<u8>> {
    let mut out = v.to_vec();
    let (mut in_name, mut quoted, mut changed) = (true, false, false);
    for b in out.iter_mut() {
        match *b {
            b'"' if !in_name => quoted = !quoted,
            b',' if !quoted => in_name = true,
            b'=' if in_name => in_name = false,
            c if in_name && c.is_ascii_uppercase() => {
                *b = c.to_ascii_lowercase();
                changed = true;
            }
            _ => {}
        }
    }
    changed.then_some(out)
}

/// A directive of a normalized Cache-Control: `None` when absent,
/// `Some(None)` when present without a value, `Some(Some(v))` with one
/// (quotes removed).
pub fn directive<'a>(headers: &'a HeaderMap, name: &str) -> Option<Option<&'a str>> {
    headers.get_all(header::CACHE_CONTROL).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).find_map(|d| {
        let (n, v) = match d.split_once('=') {
            Some((n, v)) => (n, Some(v.trim().trim_matches('"'))),
            None => (d, None),
        };
        (n.trim() == name).then_some(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(values: &[&str]) -> Vec<String> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::CACHE_CONTROL, v.parse().unwrap());
        }
        normalize(&mut h);
        h.get_all(header::CACHE_CONTROL).iter().map(|v| v.to_str().unwrap().to_string()).collect()
    }

    #[test]
    fn lowers_names_and_keeps_values_and_quoted_strings() {
        assert_eq!(norm(&["Private, MAX-AGE=60"]), ["private, max-age=60"]);
        assert_eq!(norm(&["No-Cache=\"Set-Cookie, X-Foo\", S-MaxAge=5"]), ["no-cache=\"Set-Cookie, X-Foo\", s-maxage=5"]);
        assert_eq!(norm(&["public", "No-Store"]), ["public", "no-store"]);
        assert_eq!(norm(&["x-ext=\"A=B\", Stale-If-Error=9"]), ["x-ext=\"A=B\", stale-if-error=9"]);
    }

    #[test]
    fn directive_reads_the_normalized_field() {
        let mut h = HeaderMap::new();
        h.append(header::CACHE_CONTROL, "Only-If-Cached, Stale-While-Revalidate=\"30\"".parse().unwrap());
        normalize(&mut h);
        assert_eq!(directive(&h, "only-if-cached"), Some(None));
        assert_eq!(directive(&h, "stale-while-revalidate"), Some(Some("30")));
        assert_eq!(directive(&h, "max-age"), None);
    }

    #[test]
    fn the_library_honours_directives_in_any_case_once_normalized() {
        use http_cache_semantics::{CacheOptions, CachePolicy};
        let req = http::Request::get("http://x/").body(()).unwrap();
        for (cc, storable) in [("Private, max-age=60", false), ("No-Store, max-age=60", false), ("MAX-AGE=60", true)] {
            let mut resp = http::Response::builder().status(200).header("cache-control", cc).body(()).unwrap();
            normalize(resp.headers_mut());
            let p = CachePolicy::new_options(&req, &resp, std::time::SystemTime::now(), CacheOptions { shared: true, ..Default::default() });
            assert_eq!(p.is_storable() && !p.time_to_live(std::time::SystemTime::now()).is_zero(), storable, "{cc}");
        }
    }
}
