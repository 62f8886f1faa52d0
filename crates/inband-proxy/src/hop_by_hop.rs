//! The fields of one connection that a proxy does not pass on (RFC 9110
//! §7.6.1), for requests, responses and interim responses alike.

use http::header::{self, HeaderMap, HeaderName};

/// RFC 9110 §7.6.1: connection-specific fields a proxy must not forward,
/// plus whatever the Connection header names. Names, not strings: a
/// string is parsed into a name on every lookup, on every request.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

pub fn strip(headers: &mut HeaderMap) {
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for h in named {
            headers.remove(h);
        }
    }
    for h in &HOP_BY_HOP {
        headers.remove(h);
    }
}
