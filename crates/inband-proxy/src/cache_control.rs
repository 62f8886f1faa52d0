//! What http-cache-semantics 3 is shown of a message, and what it is not.
//!
//! The library reads fields as sent and gets several of them wrong:
//! - Cache-Control directive names are case-insensitive (RFC 9111 §5.2),
//!   but it keys them by the text: to it `Private` is not `private` and
//!   `MAX-AGE=60` is no max-age;
//! - `Age: 7200, 0` fails its integer parse and counts as 0, where RFC 9111
//!   §5.1 has a list's first member decide;
//! - it parses HTTP-dates (Expires, Date, Last-Modified) as RFC 2822,
//!   which accepts what RFC 9110 §5.6.7 does not (`18  Aug  2050`) and
//!   refuses two of the three formats a recipient must accept (rfc850,
//!   asctime);
//! - it knows nothing of `CDN-Cache-Control` (RFC 9213).
//!
//! So the library decides on a copy of the fields made right here (the
//! "view"), and what goes on the wire, to the origin or to a client, and
//! what is stored and served, is the message as it came. A request's
//! Cache-Control and Pragma are lower-cased in place where the request
//! enters (so the cache layer and the library read one form) with the
//! fields as sent kept beside them, and put back before the request goes
//! to the origin ([`restore_request`]).

use http::header::{self, HeaderName};
use http::{request, response, HeaderMap, HeaderValue};

/// Cache-Control and Pragma of a request as the client sent them, when
/// lowering their directive names changed them.
#[derive(Clone)]
struct SentFields(Vec<(HeaderName, HeaderValue)>);

const DIRECTIVE_FIELDS: [HeaderName; 2] = [header::CACHE_CONTROL, header::PRAGMA];

/// Lower-cases the request's Cache-Control and Pragma directive names;
/// the fields as sent go into the request's extensions for
/// [`restore_request`]. Nothing is allocated when they already are.
pub fn normalize_request(parts: &mut request::Parts) {
    let mut sent = Vec::new();
    for name in &DIRECTIVE_FIELDS {
        if !parts.headers.get_all(name).iter().any(|v| needs_lowering(v.as_bytes())) {
            continue;
        }
        sent.extend(parts.headers.get_all(name).iter().map(|v| (name.clone(), v.clone())));
        lower_names(&mut parts.headers, name);
    }
    if !sent.is_empty() {
        parts.extensions.insert(SentFields(sent));
    }
}

/// Puts back the Cache-Control and Pragma the client sent into headers
/// derived from a request [`normalize_request`] changed (the request
/// itself, or a revalidation request built from it, whose extensions were
/// copied over).
pub fn restore_request(headers: &mut HeaderMap, extensions: &http::Extensions) {
    let Some(SentFields(sent)) = extensions.get::<SentFields>() else { return };
    for name in &DIRECTIVE_FIELDS {
        headers.remove(name);
    }
    for (n, v) in sent {
        headers.append(n, v.clone());
    }
}

/// The response as http-cache-semantics is to see it: directive names
/// lower-cased, `CDN-Cache-Control` in place of Cache-Control when it is
/// there and valid, the first member of Age or none, and HTTP-dates
/// re-written in the one format the library reads right (an invalid
/// Expires as `0`, "already expired", RFC 9111 §5.3; an invalid Date or
/// Last-Modified dropped, as if absent).
pub fn library_response(head: &response::Parts) -> response::Parts {
    let mut r = http::Response::new(());
    *r.status_mut() = head.status;
    *r.version_mut() = head.version;
    *r.headers_mut() = head.headers.clone();
    let h = r.headers_mut();
    if let Some(cdn) = crate::cdn_cache_control::valid(&head.headers) {
        h.remove(header::CACHE_CONTROL);
        h.remove(header::PRAGMA);
        h.insert(header::CACHE_CONTROL, cdn);
    }
    for name in &DIRECTIVE_FIELDS {
        lower_names(h, name);
    }
    if let Some(age) = h.get(header::AGE) {
        match first_member(age.as_bytes()) {
            a if !a.is_empty() && a.iter().all(u8::is_ascii_digit) => {
                let a = HeaderValue::from_bytes(a).expect("digits are a valid header value");
                h.insert(header::AGE, a);
            }
            _ => {
                h.remove(header::AGE);
            }
        }
    }
    let date = |h: &HeaderMap, name: &HeaderName| {
        let mut values = h.get_all(name).iter();
        let one = values.next()?;
        if values.next().is_some() {
            return None;
        }
        let t = httpdate::parse_http_date(one.to_str().ok()?).ok()?;
        Some(HeaderValue::from_str(&httpdate::fmt_http_date(t)).expect("an HTTP-date is a valid header value"))
    };
    if h.contains_key(header::EXPIRES) {
        let v = date(h, &header::EXPIRES).unwrap_or(HeaderValue::from_static("0"));
        h.insert(header::EXPIRES, v);
    }
    for name in [header::DATE, header::LAST_MODIFIED] {
        match date(h, &name) {
            Some(v) => h.insert(name, v),
            None => h.remove(name),
        };
    }
    // The library stores only the statuses it lists (no 400, 500, 299);
    // RFC 9111 §3 lets a cache store any final status that has explicit
    // freshness, unless `must-understand` asks for a status it knows.
    // Shown as a 200 the library decides the same for every other reason;
    // the status served is the stored one.
    let status = head.status.as_u16();
    let explicit = h.contains_key(header::EXPIRES) || directive(h, "max-age").is_some() || directive(h, "s-maxage").is_some();
    if explicit && status >= 200 && status != 206 && status != 304 && directive(h, "must-understand").is_none() {
        *r.status_mut() = http::StatusCode::OK;
    }
    r.into_parts().0
}

/// The first member of a field's first line, trimmed: `7200` of `7200, 0`.
fn first_member(v: &[u8]) -> &[u8] {
    let end = v.iter().position(|&b| b == b',').unwrap_or(v.len());
    v[..end].trim_ascii()
}

fn lower_names(headers: &mut HeaderMap, name: &HeaderName) {
    if !headers.get_all(name).iter().any(|v| needs_lowering(v.as_bytes())) {
        return;
    }
    let values: Vec<HeaderValue> = headers
        .get_all(name)
        .iter()
        .map(|v| HeaderValue::from_bytes(&lowered(v.as_bytes())).expect("lower-casing ASCII keeps a valid header value"))
        .collect();
    headers.remove(name);
    for v in values {
        headers.append(name, v);
    }
}

/// Walks a Cache-Control-shaped field: calls `f` with every byte and
/// whether it is part of a directive name (outside values and quoted
/// strings, which may hold commas and `=`).
fn scan(v: &[u8], mut f: impl FnMut(usize, bool)) {
    let (mut in_name, mut quoted) = (true, false);
    for (i, &b) in v.iter().enumerate() {
        match b {
            b'"' if !in_name => quoted = !quoted,
            b',' if !quoted => in_name = true,
            b'=' if in_name => in_name = false,
            _ => {}
        }
        f(i, in_name);
    }
}

fn needs_lowering(v: &[u8]) -> bool {
    let mut upper = false;
    scan(v, |i, name| upper |= name && v[i].is_ascii_uppercase());
    upper
}

/// The field with directive names lower-cased, values and quoted strings
/// byte for byte: written by hand because no library rewrites only names.
fn lowered(v: &[u8]) -> Vec<u8> {
    let mut out = v.to_vec();
    scan(v, |i, name| {
        if name {
            out[i] = v[i].to_ascii_lowercase();
        }
    });
    out
}

/// A directive of a Cache-Control, its name matched in any letter case:
/// `None` when absent, `Some(None)` when present without a value,
/// `Some(Some(v))` with one (quotes removed).
pub fn directive<'a>(headers: &'a HeaderMap, name: &str) -> Option<Option<&'a str>> {
    headers.get_all(header::CACHE_CONTROL).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).find_map(|d| {
        let (n, v) = match d.split_once('=') {
            Some((n, v)) => (n, Some(v.trim().trim_matches('"'))),
            None => (d, None),
        };
        n.trim().eq_ignore_ascii_case(name).then_some(v)
    })
}

/// `no-store` in the request, or in the response's Cache-Control with no
/// valid CDN-Cache-Control to stand in for it (RFC 9213): an answer no
/// cache may store (RFC 9111 §3), found without the caching library,
/// whose policy copies the response's header map and parses both
/// Cache-Controls (about a twentieth of the proxy's CPU on pass-through
/// misses). Directive names are matched in any case, as the library sees
/// them lower-cased.
pub fn forbids_storing(req: &HeaderMap, resp: &HeaderMap) -> bool {
    directive(req, "no-store").is_some() || (directive(resp, "no-store").is_some() && crate::cdn_cache_control::valid(resp).is_none())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(cc: &[&str]) -> request::Parts {
        let mut b = http::Request::get("http://x/");
        for v in cc {
            b = b.header("cache-control", *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn values(h: &HeaderMap, name: HeaderName) -> Vec<String> {
        h.get_all(name).iter().map(|v| v.to_str().unwrap().to_string()).collect()
    }

    #[test]
    fn lowers_names_and_keeps_values_and_quoted_strings() {
        for (sent, want) in [
            (&["Private, MAX-AGE=60"][..], &["private, max-age=60"][..]),
            (&["No-Cache=\"Set-Cookie, X-Foo\", S-MaxAge=5"], &["no-cache=\"Set-Cookie, X-Foo\", s-maxage=5"]),
            (&["public", "No-Store"], &["public", "no-store"]),
            (&["x-ext=\"A=B\", Stale-If-Error=9"], &["x-ext=\"A=B\", stale-if-error=9"]),
        ] {
            let mut p = request(sent);
            normalize_request(&mut p);
            assert_eq!(values(&p.headers, header::CACHE_CONTROL), want);
        }
    }

    #[test]
    fn a_normalized_request_is_restored_as_sent() {
        let mut p = request(&["No-Cache", "max-age=5"]);
        normalize_request(&mut p);
        assert_eq!(values(&p.headers, header::CACHE_CONTROL), ["no-cache", "max-age=5"]);
        let mut out = p.headers.clone();
        restore_request(&mut out, &p.extensions);
        assert_eq!(values(&out, header::CACHE_CONTROL), ["No-Cache", "max-age=5"]);
        // Already lower-case: nothing stashed, nothing restored.
        let mut q = request(&["no-cache"]);
        normalize_request(&mut q);
        assert!(q.extensions.get::<SentFields>().is_none());
    }

    #[test]
    fn directive_matches_names_in_any_case() {
        let p = request(&["Only-If-Cached, Stale-While-Revalidate=\"30\""]);
        assert_eq!(directive(&p.headers, "only-if-cached"), Some(None));
        assert_eq!(directive(&p.headers, "stale-while-revalidate"), Some(Some("30")));
        assert_eq!(directive(&p.headers, "max-age"), None);
    }

    fn view(headers: &[(&str, &str)]) -> HeaderMap {
        let mut b = http::Response::builder().status(200);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        library_response(&b.body(()).unwrap().into_parts().0).headers
    }

    #[test]
    fn the_view_takes_ages_first_member_and_rewrites_dates() {
        assert_eq!(view(&[("age", "7200, 0")])["age"], "7200");
        assert_eq!(view(&[("age", "0, 7200")])["age"], "0");
        assert!(!view(&[("age", "abc")]).contains_key("age"));
        assert!(!view(&[("age", "-5")]).contains_key("age"));
        assert_eq!(view(&[("expires", "Thu, 18  Aug  2050 02:01:18 GMT")])["expires"], "0");
        assert_eq!(view(&[("expires", "Thursday, 18-Aug-50 02:01:18 GMT")])["expires"], "Thu, 18 Aug 2050 02:01:18 GMT");
        assert_eq!(view(&[("expires", "Thu Aug 18 02:01:18 2050")])["expires"], "Thu, 18 Aug 2050 02:01:18 GMT");
        assert!(!view(&[("date", "yesterday")]).contains_key("date"));
    }

    #[test]
    fn any_final_status_with_explicit_freshness_is_storable_unless_it_must_be_understood() {
        use http_cache_semantics::{CacheOptions, CachePolicy};
        let req = http::Request::get("http://x/").body(()).unwrap();
        for (status, cc, storable) in [(500, "max-age=60", true), (299, "max-age=60", true), (500, "", false), (599, "max-age=60, must-understand", false)] {
            let mut b = http::Response::builder().status(status).header("last-modified", "Tue, 01 Jul 2025 10:00:00 GMT");
            if !cc.is_empty() {
                b = b.header("cache-control", cc);
            }
            let v = library_response(&b.body(()).unwrap().into_parts().0);
            let p = CachePolicy::new_options(&req, &v, std::time::SystemTime::now(), CacheOptions { shared: true, ..Default::default() });
            assert_eq!(p.is_storable() && !p.time_to_live(std::time::SystemTime::now()).is_zero(), storable, "{status} {cc}");
        }
    }

    #[test]
    fn the_library_honours_directives_in_any_case_in_the_view() {
        use http_cache_semantics::{CacheOptions, CachePolicy};
        let req = http::Request::get("http://x/").body(()).unwrap();
        for (cc, storable) in [("Private, max-age=60", false), ("No-Store, max-age=60", false), ("MAX-AGE=60", true)] {
            let resp = http::Response::builder().status(200).header("cache-control", cc).body(()).unwrap().into_parts().0;
            let v = library_response(&resp);
            let p = CachePolicy::new_options(&req, &v, std::time::SystemTime::now(), CacheOptions { shared: true, ..Default::default() });
            assert_eq!(p.is_storable() && !p.time_to_live(std::time::SystemTime::now()).is_zero(), storable, "{cc}");
            // The message itself is untouched.
            assert_eq!(resp.headers["cache-control"], cc);
        }
    }

    /// What the short cut refuses, the library would refuse too; a valid
    /// CDN-Cache-Control stands in for the response's Cache-Control, an
    /// invalid one does not.
    #[test]
    fn no_store_forbids_storing_as_the_library_would() {
        use http_cache_semantics::{CacheOptions, CachePolicy};
        let cases = [
            (&[][..], "no-store", None, true),
            (&[][..], "No-Store, max-age=60", None, true),
            (&["no-store"][..], "max-age=60", None, true),
            (&[][..], "no-store", Some("max-age=60"), false),
            (&[][..], "no-store", Some("max-age=oops"), true),
            (&[][..], "max-age=60", None, false),
            (&[][..], "no-cache=\"x\", max-age=60", None, false),
        ];
        for (req_cc, cc, cdn, forbidden) in cases {
            let mut req = request(req_cc);
            normalize_request(&mut req);
            let mut b = http::Response::builder().status(200).header("cache-control", cc);
            if let Some(v) = cdn {
                b = b.header("cdn-cache-control", v);
            }
            let resp = b.body(()).unwrap().into_parts().0;
            assert_eq!(forbids_storing(&req.headers, &resp.headers), forbidden, "{req_cc:?} {cc} {cdn:?}");
            let p = CachePolicy::new_options(&req, &library_response(&resp), std::time::SystemTime::now(), CacheOptions { shared: true, ..Default::default() });
            assert!(!forbidden || !p.is_storable(), "the library would store {req_cc:?} {cc} {cdn:?}");
        }
    }
}
