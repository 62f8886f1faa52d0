//! Built-in phase sets (`--phases`, docs/trace.md "Built-in phase sets"):
//! markers on functions of our own binary, each chosen because it is
//! called exactly once per event of its phase, and kept out of line
//! (`#[inline(never)]` in its crate) so that it has a symbol and no caller
//! skips it.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Set {
    pub name: &'static str,
    /// The program the set is for, for the message when a marker is missing.
    pub program: &'static str,
    /// (phase name, function), as `--phase NAME=SYMBOL`.
    pub markers: &'static [(&'static str, &'static str)],
}

pub const SETS: [Set; 2] = [
    Set {
        name: "proxy",
        program: "inband proxy",
        markers: &[
            // A request head has been parsed and the handler starts.
            ("request_in", "inband_proxy::conn::State::begin_request"),
            // The cache is asked for a stored response (the call, not the
            // polls of its future).
            ("cache_lookup", "inband_proxy::cache_store::HttpCache::lookup"),
            // The request goes to a backend (retries inside one call).
            ("origin_fetch", "inband_proxy::forward::send"),
            // The response head is handed to hyper, which writes it and
            // the body from here on.
            ("response_out", "inband_proxy::access::Tracked::new"),
        ],
    },
    Set {
        name: "cache",
        program: "a program using inband-cache (inband proxy, inband bench cache)",
        markers: &[
            // The four backends' copies of each (one generic function).
            ("store_get", "<inband_cache::cache::Cache<B> as inband_cache::Store>::get"),
            ("store_put", "<inband_cache::cache::Cache<B> as inband_cache::Store>::put"),
            ("store_delete", "<inband_cache::cache::Cache<B> as inband_cache::Store>::delete"),
        ],
    },
];

pub fn parse(name: &str) -> Result<Set, String> {
    SETS.iter().copied().find(|s| s.name == name).ok_or_else(|| {
        let names: Vec<&str> = SETS.iter().map(|s| s.name).collect();
        format!("no phase set {name:?} (there are: {})", names.join(", "))
    })
}
