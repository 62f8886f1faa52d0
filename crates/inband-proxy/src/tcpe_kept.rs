//! Why a TCPE client's first request stays on the proxy (tcpe.rs), in a
//! module of its own below both tcpe.rs and the metrics that count it.

/// Why the first request of a TCPE connection was proxied without trying a
/// handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kept {
    /// Not a complete GET or HEAD head in origin form with one Host and no
    /// body, Upgrade or bytes after it.
    NotSimple,
    /// The cache holds the URL (fresh or not: it serves or revalidates
    /// it), or the client asked for `only-if-cached`.
    Cached,
    /// No route, or the route rewrites headers or limits its rate: the
    /// server would get the request, and the client the response, without
    /// what the route does to them.
    Route,
    /// `[client_limits] requests_per_s` is set: a handed-off connection's
    /// later requests would not be counted.
    Limits,
    /// No healthy backend (the proxy answers 503).
    NoBackend,
    /// The backend picked has no `[[tcpe.server]]`.
    NoServer,
}

impl Kept {
    pub const ALL: [Kept; 6] = [Kept::NotSimple, Kept::Cached, Kept::Route, Kept::Limits, Kept::NoBackend, Kept::NoServer];

    pub fn label(self) -> &'static str {
        match self {
            Kept::NotSimple => "not_simple",
            Kept::Cached => "cached",
            Kept::Route => "route",
            Kept::Limits => "limits",
            Kept::NoBackend => "no_backend",
            Kept::NoServer => "no_server",
        }
    }
}
