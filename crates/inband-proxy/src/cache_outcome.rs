//! The cache's word on a request: reached by `cache_layer`, counted by
//! `metrics`, logged by `server`.

use http::{HeaderValue, Response};

/// How a request was served, for metrics and the `X-Cache` header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Fresh entry served, origin not asked.
    Hit,
    /// Nothing usable stored; origin asked.
    Miss,
    /// A stale entry served: at once under `stale-while-revalidate`
    /// (revalidated in the background), or under `stale-if-error` because
    /// the origin failed.
    Stale,
    /// A stale entry the origin replaced with a new response.
    Updated,
    /// A stale entry the origin confirmed with 304.
    Revalidated,
    /// Served the result of a concurrent request's origin fetch.
    Coalesced,
    /// A stale entry the origin failed to revalidate, with no
    /// `stale-if-error` allowance: the origin's error was passed on.
    Error,
}

impl Outcome {
    pub const ALL: [Outcome; 7] =
        [Outcome::Hit, Outcome::Miss, Outcome::Stale, Outcome::Updated, Outcome::Revalidated, Outcome::Coalesced, Outcome::Error];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::Miss => "miss",
            Outcome::Stale => "stale",
            Outcome::Updated => "updated",
            Outcome::Revalidated => "revalidated",
            Outcome::Coalesced => "coalesced",
            Outcome::Error => "error",
        }
    }

    fn header(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            Outcome::Hit | Outcome::Coalesced => "HIT",
            Outcome::Miss => "MISS",
            Outcome::Stale => "STALE",
            Outcome::Updated => "UPDATED",
            Outcome::Revalidated => "REVALIDATED",
            Outcome::Error => "ERROR",
        })
    }

    /// Marks a response: `X-Cache` for the client, the outcome itself for
    /// the access log.
    pub fn mark<B>(self, resp: &mut Response<B>) {
        resp.headers_mut().insert("x-cache", self.header());
        resp.extensions_mut().insert(self);
    }
}
